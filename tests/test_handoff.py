"""Runs handed straight to an idle worker by start (0030_hand_off_to_idle_workers).

A worker whose claim left it a free slot offers one; start takes it in its own transaction,
writes the run as claimed by that worker and sends it the run by NOTIFY. These tests check
that it happens, and attack it: a worker that offered and then froze or died, a start that
holds a slot in an open transaction, a hand-off read after its first lease (the worker
frozen, the transaction committed late, the run's row held by an operator), a worker that is
full when the run arrives, runs that must not be handed off (not due, under REPEATABLE READ,
too large, queued behind others), and notifications that are not what they claim.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import flowly
from flowly.worker.server_clock import ServerClock
from tests import workflows
from tests.support import offer_as, running_worker, scalar, wait_for, worker_process


def handed_off(db: psycopg.Connection[Any], run_id: str) -> bool:
    """Whether the run was claimed by the transaction that started it."""
    return bool(scalar(db, "select started_at = created_at from flowly.runs where id = %s",
                       run_id))


def offered(db: psycopg.Connection[Any], worker: str, at_least: int = 1) -> bool:
    return int(scalar(db, "select count(*) from flowly.handoff_slots where worker_id = %s",
                      worker)) >= at_least


def test_a_run_started_while_a_worker_waits_idle_is_handed_to_it(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flowly.worker")
    with running_worker(dsn, workflows=["echo"], poll_interval=5) as worker:
        wait_for(lambda: offered(db, worker.worker_id), what="an idle slot offered")
        run_id = client.start("echo", {"value": [1, "two", {"3": None}]})
        # claimed in the start's own transaction, under a new epoch, by that worker
        row = db.execute("select lease_epoch, started_at = created_at from flowly.runs"
                         " where id = %s", (run_id,)).fetchone()
        assert row == (1, True)
        run = client.wait(run_id, timeout=10)
        assert run.status == "completed" and run.output == [1, "two", {"3": None}]
        # from SQL alone, as psql or a trigger would
        wait_for(lambda: offered(db, worker.worker_id), what="the slot offered again")
        sql_run = scalar(db, "select flowly.start('echo', '{\"value\": \"from sql\"}')")
        assert client.wait(sql_run, timeout=10).output == "from sql"
        assert handed_off(db, sql_run)
        # and again
        wait_for(lambda: offered(db, worker.worker_id), what="the slot offered again")
        again = client.start("echo", {"value": 3})
        assert client.wait(again, timeout=10).output == 3 and handed_off(db, again)
    # a stopped worker withdraws its offer
    assert not offered(db, worker.worker_id)
    # each began at once: the worker knew from the server's clock that its lease held
    assert "handed to us late" not in caplog.text and "too late" not in caplog.text


def test_a_run_handed_to_a_worker_that_died_since_is_claimed_by_another_within_seconds(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    offer_as(db, "ghost", "echo", "1 hour")
    run_id = client.start("echo", {"value": "survived"})
    lease = db.execute("select locked_by, locked_until - created_at from flowly.runs"
                       " where id = %s", (run_id,)).fetchone()
    assert lease is not None and lease[0] == "ghost"
    # the short first lease (from the insert), not the worker's hour
    assert 5 <= lease[1].total_seconds() < 5.5
    started = time.monotonic()
    with running_worker(dsn, workflows=["echo"]):
        run = client.wait(run_id, timeout=15)
    assert run.status == "completed" and run.output == "survived"
    assert time.monotonic() - started < 10
    assert scalar(db, "select lease_epoch from flowly.runs where id = %s", run_id) == 2


def test_a_frozen_worker_that_was_handed_a_run_cannot_write_it_once_another_took_it(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    with worker_process(dsn, "--lease", "30") as frozen:
        worker_id = wait_for(lambda: scalar(db, "select worker_id from flowly.handoff_slots"),
                             what="an idle slot offered")
        frozen.signal(signal.SIGSTOP)
        run_id = client.start("three_steps", {"step_seconds": 0})
        assert scalar(db, "select locked_by from flowly.runs where id = %s", run_id) == worker_id
        with running_worker(dsn, workflows=["three_steps"]):
            run = client.wait(run_id, timeout=20)
        assert run.status == "completed"
        assert {step["pid"] for step in run.output.values()} == {os.getpid()}
        checkpoints = db.execute("select name, output from flowly.steps where run_id = %s",
                                 (run_id,)).fetchall()
        frozen.signal(signal.SIGCONT)  # it reads the hand-off only now, long after its lease
        time.sleep(1.5)
        said = frozen.stop()
    # it started no step of the run (the other worker had run them all), and wrote nothing
    assert scalar(db, "select count(*) from public.test_effects where run_id = %s and pid = %s",
                  run_id, frozen.pid) == 0
    assert "too late to run" in said
    assert client.get(run_id).output == run.output
    assert db.execute("select name, output from flowly.steps where run_id = %s",
                      (run_id,)).fetchall() == checkpoints


def test_a_run_handed_off_while_the_worker_s_listener_was_down_starts_once_it_is_back(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """start hands a run to an idle worker whose LISTEN connection has just been cut: the
    NOTIFY reaches nobody. The run, leased to that worker, waited for its first lease to lapse
    and then for the worker's next poll (30 s here). The worker now releases the runs handed
    to it that it does not hold as soon as it listens again, and claims them at once."""
    with worker_process(dsn, "--lease", "30", "--poll-interval", "30") as deaf:
        wait_for(lambda: scalar(db, "select channel from flowly.handoff_slots"),
                 what="an idle slot offered")
        deaf.signal(signal.SIGSTOP)  # so that it cannot withdraw its offer meanwhile
        assert scalar(db, "select count(pg_terminate_backend(listener_pid))"
                          " from flowly.workers where listener_pid is not null") == 1
        run_id = client.start("three_steps", {"step_seconds": 0})
        assert handed_off(db, run_id)
        deaf.signal(signal.SIGCONT)
        run = client.wait(run_id, timeout=15)
        said = deaf.stop()
    assert run.status == "completed", said
    assert [pid for _, pid in effects(db, run_id)] == [deaf.pid] * 3  # once, by that worker
    # released (epoch 2), then claimed (3): the hand-off's epoch is fenced off
    assert scalar(db, "select lease_epoch from flowly.runs where id = %s", run_id) == 3


def test_every_run_a_slot_took_while_the_listener_was_down_starts_once_it_is_back(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """A slot serves as many hand-offs as its worker has room for (0067), so a worker whose
    listener was cut can be handed several runs that nobody hears of. All of them are
    released when it listens again, each run once, none waiting for a lease or a poll."""
    with worker_process(dsn, "--lease", "30", "--poll-interval", "30",
                        "--concurrency", "4") as deaf:
        wait_for(lambda: scalar(db, "select room from flowly.handoff_slots") == 3,
                 what="an idle slot offered with room for three more runs")
        deaf.signal(signal.SIGSTOP)
        assert scalar(db, "select count(pg_terminate_backend(listener_pid))"
                          " from flowly.workers where listener_pid is not null") == 1
        run_ids = [client.start("three_steps", {"step_seconds": 0}) for _ in range(4)]
        assert all(handed_off(db, run_id) for run_id in run_ids)
        assert scalar(db, "select count(*) from flowly.handoff_slots") == 0  # used up
        deaf.signal(signal.SIGCONT)
        resumed = time.monotonic()
        runs = [client.wait(run_id, timeout=15) for run_id in run_ids]
        waited = time.monotonic() - resumed
        said = deaf.stop()
    assert [run.status for run in runs] == ["completed"] * 4, said
    assert waited < 4.5, said  # not after the 5 s first leases, nor the 30 s poll
    for run_id in run_ids:
        assert [pid for _, pid in effects(db, run_id)] == [deaf.pid] * 3
        assert scalar(db, "select lease_epoch from flowly.runs where id = %s", run_id) == 3


def test_a_handed_off_run_that_compensated_is_retried_by_the_idle_worker_at_once(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """A run handed off, dead-lettered after its compensations, then retried from SQL: the
    idle worker takes the retry at once (its poll is a minute), re-runs the undone steps,
    replays the one whose compensation failed, and undoes nothing twice."""
    with running_worker(dsn, workflows=["saga"], poll_interval=60) as worker:
        wait_for(lambda: offered(db, worker.worker_id), what="an idle slot offered")
        run_id = "handed-saga"
        workflows.SAGA_FAILS.add(run_id)
        assert client.start("saga", None, run_id=run_id) == run_id
        assert handed_off(db, run_id)
        assert client.wait(run_id, timeout=30).status == "dead_letter"
        log = workflows.CALLS[run_id]
        assert log[-3:] == ["undo:s3", "undo:s2", "undo:s1"]
        log.clear()
        workflows.SAGA_FAILS.discard(run_id)
        wait_for(lambda: offered(db, worker.worker_id), what="an idle slot offered")
        retried = time.monotonic()
        assert scalar(db, "select flowly.retry_dead_letter(run_id => %s)", run_id) == run_id
        run = client.wait(run_id, timeout=30)
        waited = time.monotonic() - retried
    assert run.status == "completed" and run.output == "ok" and run.generation == 2
    assert waited < 10
    assert log == ["do:s1", "do:s3", "do:s4"]
    assert [(s.name, s.compensation_status) for s in client.steps(run_id)] == [
        ("s1", None), ("s2", None), ("s3", None), ("s4", None)]


def test_a_late_hand_off_whose_row_an_operator_holds_waits_for_a_claim(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """The worker cannot confirm a run read after its first lease while another transaction
    holds the run's row: it leaves the run (no step starts), and a claim takes it once the
    row is free."""
    with worker_process(dsn, "--lease", "2") as frozen:
        wait_for(lambda: scalar(db, "select worker_id from flowly.handoff_slots"),
                 what="an idle slot offered")
        frozen.signal(signal.SIGSTOP)
        run_id = client.start("three_steps", {"step_seconds": 0})
        time.sleep(2.3)  # its first lease lapses while the worker is frozen
        with psycopg.connect(dsn) as operator:
            operator.execute("select from flowly.runs where id = %s for update", (run_id,))
            frozen.signal(signal.SIGCONT)
            time.sleep(3)  # it reads the hand-off within milliseconds, even on a busy machine
            assert scalar(db, "select count(*) from public.test_effects where run_id = %s",
                          run_id) == 0
        assert client.wait(run_id, timeout=20).status == "completed"
        said = frozen.stop()
    assert "its row is locked by another transaction" in said
    assert scalar(db, "select count(*) from public.test_effects where run_id = %s",
                  run_id) == 3


def test_a_run_handed_off_late_in_a_long_transaction_still_gets_its_whole_first_lease(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    """The first lease counts from the hand-off, not from the start of the transaction that
    makes it: a start in a transaction open for longer than that lease must not write a run
    whose lease has already lapsed (any claim could take it while the worker begins it)."""
    offer_as(db, "ghost", "echo", "3 seconds")
    with psycopg.connect(dsn) as tx:
        tx.execute("select pg_sleep(2)")
        run_id = scalar(tx, "select flowly.start('echo', '{\"value\": 1}')")
        lease = tx.execute("select locked_by, extract(epoch from locked_until - clock_timestamp())"
                           " from flowly.runs where id = %s", (run_id,)).fetchone()
    assert lease is not None and lease[0] == "ghost"
    assert 2.5 < lease[1] <= 3


def test_a_hand_off_committed_after_its_first_lease_is_confirmed_then_run(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client,
        caplog: pytest.LogCaptureFixture) -> None:
    """A hand-off whose transaction committed after the run's first lease lapsed is not run on
    trust: the worker first extends the lease (a heartbeat, which fails if another claim took
    the run meanwhile: see the frozen worker's test), then runs it, without waiting for a
    claim."""
    caplog.set_level(logging.INFO, logger="flowly.worker")
    with running_worker(dsn, workflows=["three_steps"], lease=2, poll_interval=5) as worker, \
            psycopg.connect(dsn) as tx:
        wait_for(lambda: offered(db, worker.worker_id), what="an idle slot offered")
        run_id = scalar(tx, "select flowly.start('three_steps', '{}')")
        time.sleep(2.3)  # the first lease (2 s) lapses before the commit sends the run
        tx.commit()
        committed = time.monotonic()
        assert client.wait(run_id, timeout=20).status == "completed"
        assert time.monotonic() - committed < 2.5  # not left for the next claim (5 s away)
    assert scalar(db, "select lease_epoch from flowly.runs where id = %s", run_id) == 1
    assert handed_off(db, run_id)
    assert "confirmed" in caplog.text


def test_a_start_holding_a_slot_in_an_open_transaction_holds_up_nobody(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    with running_worker(dsn, workflows=["echo"], poll_interval=5) as worker, \
            psycopg.connect(dsn) as open_tx:
        wait_for(lambda: offered(db, worker.worker_id), what="an idle slot offered")
        held = scalar(open_tx, "select flowly.start('echo', '{\"value\": \"late\"}')")
        # the worker's slot is held by that transaction: other runs go the claim's way, and
        # the worker's claims and heartbeats wait for nothing
        others = [client.start("echo", {"value": i}) for i in range(5)]
        for i, run_id in enumerate(others):
            assert client.wait(run_id, timeout=10).output == i
        assert scalar(db, "select count(*) from pg_stat_activity where datname ="
                          " current_database() and wait_event_type = 'Lock'") == 0
        open_tx.commit()
        run = client.wait(held, timeout=10)
        assert run.status == "completed" and run.output == "late" and handed_off(db, held)


def test_a_full_worker_gives_a_handed_run_back_and_runs_no_more_than_its_concurrency(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    with running_worker(dsn, workflows=["echo"], concurrency=1, poll_interval=5) as worker, \
            psycopg.connect(dsn) as open_tx:
        wait_for(lambda: offered(db, worker.worker_id), what="an idle slot offered")
        handed = scalar(open_tx, "select flowly.start('echo', '{\"value\": \"handed\"}')")
        busy = client.start("echo", {"value": "busy", "wait": 1.5})
        wait_for(lambda: client.get(busy).status == "running", what="the worker busy")
        open_tx.commit()  # the hand-off reaches a worker with no free slot
        run = client.wait(handed, timeout=15)
        assert run.status == "completed" and run.output == "handed"
        first_done = client.get(busy).finished_at
        assert first_done is not None
    # given back (a new epoch), then claimed again (another) once the busy run had
    # finished: never two at once
    handed_step = db.execute("select started_at from flowly.steps where run_id = %s",
                             (handed,)).fetchone()
    assert handed_step is not None and handed_step[0] >= first_done
    assert scalar(db, "select lease_epoch from flowly.runs where id = %s", handed) == 3


@pytest.mark.parametrize("held_back", ["claim_and_offer", "server_clock"])
def test_a_run_handed_off_while_a_claim_is_on_its_way_waits_for_the_room_it_takes(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client,
        monkeypatch: pytest.MonkeyPatch, held_back: str) -> None:
    """A claim counts its room when it sets off. A hand-off that reached the worker before
    the claim's answer did found that room still free, and began its run: with the claimed
    one, two runs at once on a worker of concurrency 1 (seen once in CI, on a loaded machine).
    Here the answer of the claim, or of the clock reading a claim makes first, is held back
    for a second, and the hand-off committed meanwhile."""
    call = flowly.Worker._call
    hold, holding = threading.Event(), threading.Event()

    async def slow_answer(worker: flowly.Worker, query: Any, params: Any) -> list[Any]:
        rows = await call(worker, query, params)
        if rows and query is getattr(worker._calls, held_back) and hold.is_set():
            hold.clear()
            holding.set()
            await asyncio.sleep(1)
        return rows

    monkeypatch.setattr(flowly.Worker, "_call", slow_answer)
    monkeypatch.setattr(ServerClock, "due", lambda clock, now: hold.is_set())
    with running_worker(dsn, workflows=["echo"], concurrency=1, poll_interval=60) as worker, \
            psycopg.connect(dsn) as open_tx:
        wait_for(lambda: offered(db, worker.worker_id), what="an idle slot offered")
        handed = scalar(open_tx, "select flowly.start('echo', '{\"value\": \"handed\"}')")
        hold.set()
        busy = client.start("echo", {"value": "busy", "wait": 1})
        wait_for(holding.is_set, what="the claim's answer held back")
        open_tx.commit()  # handed off meanwhile
        assert client.wait(handed, timeout=15).output == "handed"
        busy_done = client.get(busy).finished_at
        assert busy_done is not None, "the handed run ran beside the claimed one"
    handed_step = db.execute("select started_at from flowly.steps where run_id = %s",
                             (handed,)).fetchone()
    assert handed_step is not None and handed_step[0] >= busy_done


def test_runs_that_must_not_be_handed_off_go_the_claim_way(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    offer_as(db, "ghost", "echo", "1 hour")
    slot = scalar(db, "select id from flowly.handoff_slots")
    # not due yet
    later = client.start("echo", {"value": 1}, delay=60)
    # under REPEATABLE READ (the slot may have changed since the snapshot): no 40001 either
    with psycopg.connect(dsn) as rr:
        rr.execute("set transaction isolation level repeatable read")
        repeatable = scalar(rr, "select flowly.start('echo', '{\"value\": 2}')")
    # too large for a NOTIFY payload
    large = client.start("echo", {"value": "x" * 10_000})
    # an existing run id: the existing run, and the slot stays offered
    assert client.start("echo", {"value": 3}, run_id=later) == later
    for run_id in (later, repeatable, large):
        assert scalar(db, "select status from flowly.runs where id = %s", run_id) == "pending"
    assert scalar(db, "select id from flowly.handoff_slots") == slot
    # a run due at the same priority waits already (repeatable, large): claim order holds
    behind = client.start("echo", {"value": 4})
    assert scalar(db, "select status from flowly.runs where id = %s", behind) == "pending"
    # nothing waits at a higher priority: that one goes to the idle worker
    urgent = client.start("echo", {"value": 5}, priority=9)
    assert scalar(db, "select locked_by from flowly.runs where id = %s", urgent) == "ghost"
    assert scalar(db, "select count(*) from flowly.handoff_slots") == 0


def test_a_run_started_from_sql_with_a_null_input_is_handed_off_as_json_null(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """``select flowly.start('wf', null)`` stores the input JSON null, as 'null'::jsonb does,
    but start measured the SQL NULL for the NOTIFY payload: its size was NULL, the run was not
    handed off and waited for the worker's wake-up to be claimed. Both now go to the idle
    worker: to a slot offered by hand (the run is leased to it in the start's transaction),
    and to a running worker, which completes it without a claim of its own."""
    for run_input in ("null", "'null'::jsonb"):
        offer_as(db, "ghost", "echo", "1 hour")
        run_id = scalar(db, f"select flowly.start('echo', {run_input})")
        assert db.execute("select locked_by, started_at = created_at, input from flowly.runs"
                          " where id = %s", (run_id,)).fetchone() == ("ghost", True, None), (
            run_input)
    db.execute("delete from flowly.runs")
    db.execute("select flowly.unregister_worker('ghost')")
    with running_worker(dsn, workflows=["quick"], poll_interval=5) as worker:
        wait_for(lambda: offered(db, worker.worker_id), what="an idle slot offered")
        run_id = scalar(db, "select flowly.start('quick', null)")
        assert scalar(db, "select locked_by from flowly.runs where id = %s",
                      run_id) == worker.worker_id
        run = client.wait(run_id, timeout=10)
    assert run.status == "completed" and run.output == {"input": None, "total": 3}
    assert handed_off(db, run_id)


def test_a_start_of_a_run_already_handed_off_sends_nothing_and_leaves_the_slot_offered(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """A start takes a slot before it knows whether it can write its run; one that finds its
    run id taken (here by a run handed to the same worker, still on its first lease) gives
    the slot back: the slot stays offered, and the run the id names is not sent again, in
    autocommit or inside a longer transaction that starts another run after it."""
    offer_as(db, "ghost", "echo", "1 hour")
    first = client.start("echo", {"value": 1})
    assert scalar(db, "select locked_by from flowly.runs where id = %s", first) == "ghost"
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute('listen "ghost_channel"')
        offer_as(db, "ghost", "echo", "1 hour")
        slot = scalar(db, "select id from flowly.handoff_slots")
        assert client.start("echo", {"value": 2}, run_id=first) == first
        assert scalar(db, "select id from flowly.handoff_slots where handed_run_id is null") == slot
        with psycopg.connect(dsn) as tx:
            assert scalar(tx, "select flowly.start('echo', run_id => %s)", first) == first
            second = scalar(tx, "select flowly.start('echo', '{\"value\": 3}')")
        sent = [n.payload for n in listener.notifies(timeout=1.0)]
    assert len(sent) == 1 and second in sent[0] and first not in sent[0]
    assert scalar(db, "select count(*) from flowly.handoff_slots") == 0
    assert scalar(db, "select locked_by from flowly.runs where id = %s", second) == "ghost"


def test_notifications_that_are_not_hand_offs_do_not_hurt_a_worker(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client,
        caplog: pytest.LogCaptureFixture) -> None:
    with running_worker(dsn, workflows=["echo"], poll_interval=5) as worker:
        wait_for(lambda: offered(db, worker.worker_id), what="an idle slot offered")
        channel = scalar(db, "select channel from flowly.handoff_slots where worker_id = %s",
                         worker.worker_id)
        for payload in ("not json", "[1, 2]", '{"run_id": "x"}',
                        '{"run_id": "nope", "workflow": "unknown", "input": null, "attempt": 1,'
                        ' "generation": 1, "lease_epoch": 1, "lease_seconds": 5}'):
            db.execute("select pg_notify(%s, %s)", (channel, payload))
        time.sleep(0.3)
        run_id = client.start("echo", {"value": "fine"})
        assert client.wait(run_id, timeout=10).output == "fine"
    assert "not one" in caplog.text


def test_many_concurrent_starts_against_idle_workers_each_run_once(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """Starts racing each other for the slots of two idle workers: every run completes once,
    whichever way it went."""
    with running_worker(dsn, workflows=["echo"], concurrency=3, poll_interval=0.2) as a, \
            running_worker(dsn, workflows=["echo"], concurrency=3, poll_interval=0.2) as b:
        wait_for(lambda: offered(db, a.worker_id) and offered(db, b.worker_id),
                 what="both workers idle")
        ids: list[str] = []
        lock = threading.Lock()

        def start_some(n: int) -> None:
            with flowly.Client(dsn) as own:
                for i in range(n):
                    run_id = own.start("echo", {"value": i})
                    with lock:
                        ids.append(run_id)
                    time.sleep(0.005)

        threads = [threading.Thread(target=start_some, args=(20,)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for run_id in ids:
            assert client.wait(run_id, timeout=30).status == "completed"
    assert len(ids) == 80
    assert scalar(db, "select count(*) from flowly.runs where id = any(%s) and"
                      " started_at = created_at", ids) > 0  # some went by hand-off
    assert scalar(db, "select count(*) from flowly.steps where run_id = any(%s)", ids) == 80


def test_two_workers_sharing_a_worker_id_by_mistake_do_not_both_run_a_handed_run(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """A run is sent to the instance that offered the slot, not to every process using the
    worker id (say, the host name given to two processes on one host)."""
    with running_worker(dsn, workflows=["three_steps"], worker_id="same", poll_interval=5), \
            running_worker(dsn, workflows=["three_steps"], worker_id="same", poll_interval=5):
        wait_for(lambda: offered(db, "same"), what="an idle slot offered")
        ids = []
        for _ in range(10):
            wait_for(lambda: offered(db, "same"), what="an idle slot offered")
            ids.append(client.start("three_steps", {"step_seconds": 0}))
            assert client.wait(ids[-1], timeout=20).status == "completed"
    # the two instances take the one slot from each other at their claims, so a start may
    # find it locked and go the claim's way; most go by hand-off
    assert scalar(db, "select count(*) from flowly.runs where id = any(%s)"
                      " and started_at = created_at", ids) >= 3
    ran = db.execute("select run_id, count(*) from public.test_effects where run_id = any(%s)"
                     " group by run_id", (ids,)).fetchall()
    assert sorted(n for _, n in ran) == [3] * 10  # each step once


# --- what a hand-off carries and when it is sent (0036) -------------------------------------

def effects(db: psycopg.Connection[Any], run_id: str) -> list[tuple[str, int]]:
    """The recorded step starts of a run (tests.workflows.record_effect): step, pid."""
    return db.execute("select step, pid from public.test_effects where run_id = %s"
                      " order by at", (run_id,)).fetchall()


def test_a_run_cancelled_in_the_transaction_that_started_it_is_never_sent(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """The hand-off is sent at commit, as the transaction leaves the run: cancelled, it holds
    no lease, and the worker that had its slot must not begin it on the first lease's word
    (it did: the NOTIFY went out when start ran)."""
    with running_worker(dsn, workflows=["three_steps"], poll_interval=5) as worker:
        wait_for(lambda: offered(db, worker.worker_id), what="an idle slot offered")
        with psycopg.connect(dsn) as tx:
            run_id = scalar(tx, "select flowly.start('three_steps', '{\"step_seconds\": 0}')")
            assert scalar(tx, "select locked_by from flowly.runs where id = %s",
                          run_id) == worker.worker_id  # handed off
            assert scalar(tx, "select flowly.cancel(%s)", run_id) == "cancelled"
        # the slot is used up all the same, and the worker offers another
        wait_for(lambda: offered(db, worker.worker_id), what="a slot offered again")
        time.sleep(1.5)
        assert effects(db, run_id) == []
        # the next run is handed off and runs as ever
        again = client.start("three_steps", {"step_seconds": 0})
        assert client.wait(again, timeout=15).status == "completed"
        assert handed_off(db, again)
    assert client.get(run_id).status == "cancelled"
    assert effects(db, run_id) == []


def test_a_run_past_its_timeout_is_never_handed_out(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """Neither when start writes it (a start late in a long transaction, whose timeout counts
    from the transaction's start) nor when the transaction commits after the timeout passed:
    it times out as a claimed run would, without a step."""
    with running_worker(dsn, workflows=["three_steps"], poll_interval=5) as worker:
        wait_for(lambda: offered(db, worker.worker_id), what="an idle slot offered")
        with psycopg.connect(dsn) as tx:
            tx.execute("select pg_sleep(1.2)")
            at_start = scalar(tx, "select flowly.start('three_steps', '{}',"
                                  " timeout => '1 second')")
            assert scalar(tx, "select locked_by from flowly.runs where id = %s",
                          at_start) is None
        wait_for(lambda: offered(db, worker.worker_id), what="an idle slot offered")
        with psycopg.connect(dsn) as tx:
            at_commit = scalar(tx, "select flowly.start('three_steps', '{}',"
                                   " timeout => '1 second')")
            assert scalar(tx, "select locked_by from flowly.runs where id = %s",
                          at_commit) == worker.worker_id
            tx.execute("select pg_sleep(1.2)")
        for run_id in (at_start, at_commit):
            assert client.wait(run_id, timeout=20).status == "dead_letter"
    assert effects(db, at_start) == effects(db, at_commit) == []


def test_a_handed_off_run_keeps_its_scheduled_time(
        db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """A start with scheduled_for in the past is due and may be handed off, but its timeout
    counts from the time scheduled, as insert_run counts it: one already past it is not
    handed off (and times out), one within it keeps its scheduled_for and timeout_at."""
    offer_as(db, "ghost", "echo", "1 hour")
    late = scalar(db, "select flowly.start('echo', '{\"value\": 1}', scheduled_for =>"
                      " now() - interval '1 hour', timeout => '10 minutes')")
    within = scalar(db, "select flowly.start('echo', '{\"value\": 2}', scheduled_for =>"
                        " now() - interval '1 minute', timeout => '1 hour')")
    rows = db.execute("select id, locked_by, now() - scheduled_for, timeout_at - scheduled_for"
                      " from flowly.runs order by scheduled_for").fetchall()
    assert [(r[0], r[1]) for r in rows] == [(late, None), (within, "ghost")]
    assert [r[2] >= timedelta(minutes=1) for r in rows] == [True, True]
    assert [r[3] for r in rows] == [timedelta(minutes=10), timedelta(hours=1)]


def test_a_hand_off_never_overtakes_a_due_run_of_its_priority_or_above(
        db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """A claim takes the highest priority first across every queue and workflow the worker
    serves: a run due there at the new run's priority or above (its delay just passed, the
    worker not polled yet) goes first, so the new run is not handed off. Runs due below its
    priority, and runs not due yet, do not stop it."""
    db.execute("select flowly.register_worker('ghost', array['echo', 'quick'],"
               " array['default', 'other'], '1 hour')")

    def offer() -> None:
        db.execute("select * from flowly.claim_and_offer('ghost', array['echo', 'quick'],"
                   " array['default', 'other'], 4, '1 hour', 'ghost_channel')")

    def handed(priority: int) -> bool:
        run_id = client.start("echo", {"value": priority}, priority=priority)
        return scalar(db, "select locked_by from flowly.runs where id = %s", run_id) is not None

    def due_meanwhile(priority: int) -> None:
        client.start("quick", None, queue="other", priority=priority, delay=0.3)
        time.sleep(0.5)

    client.start("quick", None, queue="other", priority=9, delay=3600)  # not due
    offer()
    due_meanwhile(-1)
    assert handed(0)
    offer()  # claims the priority -1 run
    due_meanwhile(5)
    assert not handed(5)
    assert not handed(0)
    assert handed(6)


def lease_left(db: psycopg.Connection[Any], run_id: str) -> float:
    return float(scalar(db, "select extract(epoch from locked_until - clock_timestamp())"
                            " from flowly.runs where id = %s", run_id))


def test_a_handed_run_s_first_lease_is_extended_only_once_half_of_it_has_passed(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """A handed run begins on its first lease (5 s). Most runs end within it, so the worker
    extends it to a whole lease only for a run still running once half of it is left: a
    short run costs no heartbeat."""
    with running_worker(dsn, workflows=["three_steps"], lease=120, poll_interval=5) as worker:
        wait_for(lambda: offered(db, worker.worker_id), what="an idle slot offered")
        run_id = client.start("three_steps", {"step_seconds": 2})
        wait_for(lambda: effects(db, run_id), timeout=5, what="the first step begun")
        young = lease_left(db, run_id)
        time.sleep(3.5)
        grown = lease_left(db, run_id)
        assert client.wait(run_id, timeout=20).status == "completed"
    assert handed_off(db, run_id)
    assert young <= 5
    assert grown > 100


def test_a_handed_run_whose_first_extension_is_busy_is_not_run_twice_at_once(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """The extension of a handed run's first lease, half-way through it, may find the run's
    row busy (an operator's short transaction, say): it is tried again until it extends the
    lease, not left to the periodic beat a third of a whole lease later, after the first
    lease lapsed and another worker took the run and began the step that was still running
    here."""
    with worker_process(dsn, "--lease", "120") as first:
        wait_for(lambda: scalar(db, "select worker_id from flowly.handoff_slots"),
                 what="an idle slot offered")
        first.signal(signal.SIGSTOP)  # a short pause of the worker (its loop blocked, say)
        run_id = client.start("three_steps", {"step_seconds": 10})
        with psycopg.connect(dsn) as operator:
            operator.execute("select from flowly.runs where id = %s for update", (run_id,))
            first.signal(signal.SIGCONT)
            wait_for(lambda: effects(db, run_id), timeout=5, what="the first step begun")
            time.sleep(3)  # past half of the first lease: the extension, answered busy
        with running_worker(dsn, workflows=["three_steps"], lease=120):
            # past the first lease, with a second worker claiming (the step still running)
            time.sleep(4)
            ran = effects(db, run_id)
            epoch = scalar(db, "select lease_epoch from flowly.runs where id = %s", run_id)
        first.stop()
    assert [step for step, _ in ran] == ["a"]
    assert epoch == 1  # still the hand-off's lease: nobody claimed it


def test_inputs_around_the_payload_limit_are_handed_off_whole_or_not_at_all(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """The payload is built again at commit from the run as stored: inputs of 3-byte
    characters (and escapes) whose payload lands just under the limit arrive intact, those
    just over it go the claim's way, and no commit fails on a payload too long."""
    with running_worker(dsn, workflows=["echo"], poll_interval=5) as worker:
        handed = {}
        for chars in range(2530, 2580, 5):
            wait_for(lambda: offered(db, worker.worker_id), what="an idle slot offered")
            value = "\u20ac" * chars + "\"\n\u0001"
            run_id = client.start("echo", {"value": value})
            handed[chars] = handed_off(db, run_id)
            assert client.wait(run_id, timeout=15).output == value
    assert any(handed.values()) and not all(handed.values()), handed


def test_a_start_rolled_back_to_a_savepoint_hands_nothing_off(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """The slot taken in a subtransaction that rolls back is free again, and nothing is sent."""
    with running_worker(dsn, workflows=["three_steps"], poll_interval=5) as worker:
        wait_for(lambda: offered(db, worker.worker_id), what="an idle slot offered")
        with psycopg.connect(dsn) as tx:
            tx.execute("savepoint s")
            run_id = scalar(tx, "select flowly.start('three_steps', '{}')")
            tx.execute("rollback to savepoint s")
        assert scalar(db, "select count(*) from flowly.handoff_slots"
                          " where handed_run_id is not null") == 0
        time.sleep(1)
        assert effects(db, run_id) == []
        assert scalar(db, "select count(*) from flowly.runs where id = %s", run_id) == 0
        wait_for(lambda: offered(db, worker.worker_id), what="an idle slot offered")
        again = client.start("three_steps", {})
        assert client.wait(again, timeout=15).status == "completed"
        assert handed_off(db, again)


def test_at_a_steady_rate_handed_off_runs_set_off_no_claim(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At a rate a worker keeps up with, runs are handed off one by one. A claim would find
    nothing: a hand-off shows that no run was due ahead of it, and a run started meanwhile
    that could not be handed off comes with a wake-up of its own. So a slot serves as many
    hand-offs as the worker has room for, the worker offers another only when one is used
    up (0067), and a run that completes while the worker had room to spare sets off
    nothing."""
    calls: list[str] = []
    claim, offer = flowly.Worker._claim, flowly.Worker._offer_slot

    async def claimed(worker: flowly.Worker, limit: int) -> int:
        calls.append("claim")
        return await claim(worker, limit)

    async def offered_slot(worker: flowly.Worker, free: int) -> None:
        calls.append("offer")
        await offer(worker, free)

    monkeypatch.setattr(flowly.Worker, "_claim", claimed)
    monkeypatch.setattr(flowly.Worker, "_offer_slot", offered_slot)
    with running_worker(dsn, workflows=["echo"], concurrency=3, poll_interval=60) as worker:
        wait_for(lambda: offered(db, worker.worker_id), what="an idle slot offered")
        before = len(calls)
        run_ids = []
        for value in range(6):
            run_ids.append(client.start("echo", {"value": value}))
            assert client.wait(run_ids[-1], timeout=10).output == value
            wait_for(lambda: offered(db, worker.worker_id), what="the next slot offered")
        time.sleep(0.3)  # a call set off by the last completion would be counted
        made = calls[before:]
    assert all(handed_off(db, run_id) for run_id in run_ids)
    # room for three: a slot serves two or three runs before the worker offers another
    assert "claim" not in made and 1 <= len(made) <= len(run_ids) // 2, made


def test_a_full_worker_claims_the_runs_it_had_no_room_for_as_soon_as_one_completes(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """The runs started while the worker was full wait for a completion, not for its next
    poll (a minute here)."""
    with running_worker(dsn, workflows=["three_steps"], concurrency=1,
                        poll_interval=60) as worker:
        wait_for(lambda: offered(db, worker.worker_id), what="an idle slot offered")
        first = client.start("three_steps", {"step_seconds": 0.3})
        later = [client.start("three_steps", {}) for _ in range(3)]
        started = time.monotonic()
        for run_id in [first, *later]:
            assert client.wait(run_id, timeout=30).status == "completed"
        assert time.monotonic() - started < 15
    assert handed_off(db, first) and not any(handed_off(db, run_id) for run_id in later)


def test_offer_slot_from_sql_offers_keeps_and_withdraws_an_idle_slot(
        db: psycopg.Connection[Any]) -> None:
    """offer_slot, the offer half of claim_and_offer: a slot offered, kept while young, taken
    by a start, offered again, and withdrawn; a slot a start holds in an open transaction is
    skipped, not waited for; a lease that is no lease is refused as claim refuses it."""
    db.execute("select flowly.register_worker('w', array['echo'], array['default'],"
               " '30 seconds')")
    offer = ("select flowly.offer_slot('w', array['echo'], array['default'], '30 seconds',"
             " %s)")

    def slots() -> list[tuple[Any, ...]]:
        return db.execute("select id, channel, expires_at, handed_run_id from"
                          " flowly.handoff_slots where worker_id = 'w' order by id").fetchall()

    db.execute(offer, ("w_channel",))
    first = slots()
    assert [(channel, handed) for _, channel, _, handed in first] == [("w_channel", None)]
    db.execute(offer, ("w_channel",))
    assert slots() == first  # a young offer stands as it is
    run_id = scalar(db, "select flowly.start('echo', '{\"value\": 1}')")
    assert handed_off(db, run_id) and slots() == []  # its commit used the slot up
    db.execute(offer, ("w_channel",))
    (slot_id, *_), = slots()
    with psycopg.connect(db.info.dsn) as holder:
        held = scalar(holder, "select flowly.start('echo', '{\"value\": 2}')")
        db.execute("set lock_timeout = '2s'")
        db.execute(offer, (None,))  # skips the slot the open start holds
        assert [row[0] for row in slots()] == [slot_id]
    assert handed_off(db, held) and slots() == []
    db.execute(offer, ("w_channel",))
    db.execute(offer, (None,))
    assert slots() == []
    # with room for one more run: the first hand-off offers the slot again, the next uses it
    with psycopg.connect(db.info.dsn, autocommit=True) as listener:
        listener.execute('listen "w_channel"')
        db.execute("select flowly.offer_slot('w', array['echo'], array['default'],"
                   " '30 seconds', 'w_channel', 1)")
        (slot_id, *_), = slots()
        first = scalar(db, "select flowly.start('echo', '{\"value\": 3}')")
        assert [(row[0], row[3]) for row in slots()] == [(slot_id, None)]
        second = scalar(db, "select flowly.start('echo', '{\"value\": 4}')")
        assert slots() == []
        sent = [json.loads(n.payload) for n in listener.notifies(timeout=1.0, stop_after=2)]
    assert [(payload["run_id"], payload["room"]) for payload in sent] == [
        (first, 0), (second, -1)]
    with pytest.raises(psycopg.Error, match="lease must be a positive interval") as refused:
        db.execute("select flowly.offer_slot('w', array['echo'], array['default'],"
                   " '0 seconds', 'w_channel')")
    assert refused.value.sqlstate == "WF003"


def test_a_slot_s_room_is_at_most_seven_so_a_dead_worker_holds_few_runs(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """A worker with room for 64 offers a slot that takes 8 hand-offs, not 64: a worker that
    died with its slot offered holds at most 8 new runs on their 5 s first leases, and the
    next start goes the claim way."""
    db.execute("select flowly.register_worker('ghost', array['echo'], array['default'],"
               " '1 hour')")
    db.execute("select * from flowly.claim_and_offer('ghost', array['echo'],"
               " array['default'], 64, '1 hour', 'ghost_channel')")
    assert scalar(db, "select room from flowly.handoff_slots") == 7
    run_ids = [client.start("echo", {"value": value}) for value in range(9)]
    held = [run_id for run_id in run_ids
            if scalar(db, "select locked_by from flowly.runs where id = %s", run_id) == "ghost"]
    assert held == run_ids[:8]
    assert scalar(db, "select count(*) from flowly.handoff_slots") == 0
    assert scalar(db, "select status from flowly.runs where id = %s", run_ids[8]) == "pending"
