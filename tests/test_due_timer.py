"""A run released until a time is claimed again at that time by the worker that released it,
not at its next poll (flowly.worker.due_timer): a durable sleep, a step's retry backoff, a
body's retry backoff, a wait's timeout. Each worker here polls once a minute."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest

import flowly
from flowly.worker import due_timer
from flowly.worker.due_timer import DueTimer, announced_due
from tests.support import running_worker, scalar, wait_for


def test_a_durable_sleep_ends_on_time_on_a_worker_that_polls_once_a_minute(
        dsn: str, client: flowly.Client) -> None:
    with running_worker(dsn, workflows=["sleepy"], poll_interval=60):
        began = time.time()
        run_id = client.start("sleepy", {"seconds": 0.5})
        run = client.wait(run_id, timeout=20)
    assert run.status == "completed"
    assert 0.5 <= run.output["woke"] - began < 3


def test_a_step_s_retry_backoff_ends_on_time(dsn: str, client: flowly.Client,
                                              db: psycopg.Connection[Any]) -> None:
    # its step fails twice, backing off 0.05 s, then 0.1 s
    with running_worker(dsn, workflows=["flaky"], poll_interval=60):
        began = time.monotonic()
        run_id = client.start("flaky", {"failures": 2, "backoff": "exponential",
                                         "initial_delay": 0.05})
        run = client.wait(run_id, timeout=20)
        took = time.monotonic() - began
    assert run.status == "completed" and run.output == 3
    assert scalar(db, "select count(*) from flowly.step_attempts where run_id = %s",
                  run_id) == 2
    assert took < 5


def test_a_body_s_retry_backoff_ends_on_time(dsn: str, client: flowly.Client) -> None:
    # the body fails once outside any step; the engine backs its run off for about a second
    with running_worker(dsn, workflows=["replay", "quick"], poll_interval=60):
        began = time.monotonic()
        run_id = client.start("replay", None)
        run = client.wait(run_id, timeout=20)
        took = time.monotonic() - began
    assert run.status == "completed" and run.output["attempt"] == 2
    assert took < 5


def test_a_wait_s_timeout_ends_on_time(dsn: str, client: flowly.Client) -> None:
    with running_worker(dsn, workflows=["event_or_timeout"], poll_interval=60):
        began = time.monotonic()
        run_id = client.start("event_or_timeout", {"timeout": 0.5})
        run = client.wait(run_id, timeout=20)
        took = time.monotonic() - began
    assert run.status == "completed" and run.output == "timed out"
    assert 0.5 <= took < 3.5


def test_a_durable_sleep_ends_on_time_though_the_worker_s_connections_were_cut_meanwhile(
        dsn: str, client: flowly.Client, db: psycopg.Connection[Any]) -> None:
    # a failover or a restart between the release and the due time: the pooled connection
    # the timed claim takes is dead, and the listener's too
    with running_worker(dsn, workflows=["sleepy"], poll_interval=60):
        began = time.time()
        run_id = client.start("sleepy", {"seconds": 2})
        time.sleep(1)
        ours = [db.info.backend_pid, client.connection.info.backend_pid]
        assert scalar(db, "select count(pg_terminate_backend(pid)) from pg_stat_activity"
                      " where datname = current_database() and pid <> all(%s)", ours) > 0
        run = client.wait(run_id, timeout=30)
    assert run.status == "completed"
    assert 2 <= run.output["woke"] - began < 4


def test_a_sleep_whose_row_another_transaction_holds_at_its_due_time_ends_once_it_is_free(
        dsn: str, client: flowly.Client, db: psycopg.Connection[Any]) -> None:
    # the timed claim skips the held row (skip locked) and its time is spent: the poll, once
    # a second here, takes the run when the row is free
    with running_worker(dsn, workflows=["sleepy"], poll_interval=1), \
            psycopg.connect(dsn) as holder:
        run_id = client.start("sleepy", {"seconds": 0.5})
        wait_for(lambda: scalar(  # released to sleep
            db, "select r.status = 'pending' and r.locked_by is null from flowly.runs r"
                " join flowly.timers t on t.run_id = r.id where r.id = %s", run_id))
        holder.execute("select from flowly.runs where id = %s for update", (run_id,))
        time.sleep(1.5)  # past its due time, held all along
        assert client.get(run_id).status == "pending"
        holder.rollback()
        freed = time.time()
        run = client.wait(run_id, timeout=20)
    assert run.status == "completed"
    assert freed < run.output["woke"] < freed + 2.5


def test_reads_of_the_server_s_clock_made_together_share_one_reading(dsn: str) -> None:
    # announcements arriving together each time a claim, and a busy worker has no fresh
    # reading: one read of the clock serves them all
    with running_worker(dsn, workflows=["sleepy"], poll_interval=60) as worker:
        # its own first reading, made once it offers a slot, is not due again for a lease
        wait_for(lambda: not worker._server_clock.due(time.monotonic()))
        reads: list[float] = []
        call_one = worker._call_one

        async def counted(query: Any, params: Any) -> Any:
            if query is worker._calls.server_clock:
                reads.append(time.monotonic())
            return await call_one(query, params)

        async def together() -> None:
            await asyncio.gather(*(worker._read_server_clock() for _ in range(50)))

        worker._call_one = counted  # type: ignore[method-assign]
        assert worker._loop is not None
        asyncio.run_coroutine_threadsafe(together(), worker._loop).result(timeout=10)
        asyncio.run_coroutine_threadsafe(together(), worker._loop).result(timeout=10)
    assert len(reads) == 2


def test_the_timer_wakes_once_per_time_in_order_and_keeps_no_time_beyond_its_horizon() -> None:
    async def scenario() -> tuple[list[float], int]:
        loop = asyncio.get_running_loop()
        woken: list[float] = []
        done = asyncio.Event()

        def wake() -> None:
            woken.append(loop.time())
            if len(woken) == 3:
                done.set()

        timer = DueTimer(loop, wake)
        now = loop.time()
        for delay in (0.3, 0.1, 0.2, 10 * 86400):
            timer.at(now + delay)
        kept = len(timer)
        await asyncio.wait_for(done.wait(), 5)
        timer.close()
        return [at - now for at in woken], kept

    woken, kept = asyncio.run(scenario())
    assert kept == 3  # a run that sleeps ten days is left to the poll
    assert [round(at, 1) for at in woken] == [0.1, 0.2, 0.3]


def test_a_run_started_to_be_due_later_starts_on_time_from_python_and_from_sql(
        dsn: str, client: flowly.Client, db: psycopg.Connection[Any]) -> None:
    with running_worker(dsn, workflows=["echo"], poll_interval=60):
        time.sleep(0.5)  # listening
        began = time.monotonic()
        delayed = client.start("echo", {"value": 1}, delay=0.5)
        scheduled = scalar(db, "select flowly.start('echo', '{\"value\": 2}',"
                               " scheduled_for => now() + interval '0.7 seconds')")
        runs = [client.wait(run_id, timeout=20) for run_id in (delayed, scheduled)]
        took = time.monotonic() - began
    assert [run.output for run in runs] == [1, 2]
    assert all(run.started_at and run.started_at >= run.scheduled_for for run in runs)
    assert 0.7 <= took < 4


def test_a_start_announces_a_run_due_later_once_unless_it_is_due_sooner(
        db: psycopg.Connection[Any]) -> None:
    """Runs due at once wake workers with their queue's name, once a transaction and queue;
    runs due within the hour with their time, only when sooner than any the transaction
    announced for the queue; runs due later than that, to nobody."""
    channel = scalar(db, "select flowly.wakeup_channel()")
    with psycopg.connect(db.info.dsn, autocommit=True) as listener:
        listener.execute(f'listen "{channel}"')
        with db.transaction():
            for seconds in (30, 40, 20, 50, 10, 7200):
                db.execute("select flowly.start('echo', scheduled_for =>"
                           " now() + make_interval(secs => %s))", (seconds,))
            db.execute("select flowly.start('echo', scheduled_for => now() + interval"
                       " '40 seconds', queue => 'other')")
            for _ in range(3):
                db.execute("select flowly.start('echo')")
            now = scalar(db, "select extract(epoch from now())::float8")
        sent = [n.payload for n in listener.notifies(timeout=1.0, stop_after=6)]
    hints = [announced_due(payload) for payload in sent]
    assert [(queue, round(due - now)) for queue, due in filter(None, hints)] == [
        ("default", 30), ("default", 20), ("default", 10), ("other", 40)]
    assert [payload for payload, hint in zip(sent, hints, strict=True) if hint is None] == [
        "default"]


def test_only_a_well_formed_announcement_is_taken_for_one() -> None:
    assert announced_due('{"queue": "q", "due": 1765000000.5}') == ("q", 1765000000.5)
    for payload in ("default", '{"queue": "q"}', '{"due": 1}', '{"queue": "q", "due": "x"}',
                    '{"queue": "q", "due": NaN}', '{"queue": "q", "due": Infinity}',
                    '{not json', '{"queue": "q", "due": [1]}'):
        assert announced_due(payload) is None, payload


def test_the_timer_keeps_at_most_its_share_of_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flood of releases or announcements holds a bounded heap; the times beyond it are
    left to the poll."""
    monkeypatch.setattr(due_timer, "MAX_DUE_TIMES", 5)

    async def scenario() -> int:
        loop = asyncio.get_running_loop()
        timer = DueTimer(loop, lambda: None)
        for delay in range(1, 50):
            timer.at(loop.time() + delay)
        kept = len(timer)
        timer.close()
        return kept

    assert asyncio.run(scenario()) == 5
