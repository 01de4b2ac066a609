"""Crash, pause and shutdown behaviour with real worker processes and real signals."""

from __future__ import annotations

import signal
import time
from typing import Any

import psycopg
import pytest

import flowly
from tests.support import scalar, wait_for, worker_process


@pytest.fixture
def client(dsn: str) -> Any:
    with flowly.Client(dsn) as c:
        yield c


def effects(db: psycopg.Connection[Any], run_id: str) -> list[tuple[str, int]]:
    return db.execute("select step, pid from public.test_effects where run_id = %s order by at",
                      (run_id,)).fetchall()


def step_rows(db: psycopg.Connection[Any], run_id: str) -> dict[str, tuple[Any, ...]]:
    rows = db.execute("select name, output, finished_at from flowly.steps where run_id = %s",
                      (run_id,)).fetchall()
    return {name: (output, finished) for name, output, finished in rows}


def wait_until_step_b_runs(db: psycopg.Connection[Any], run_id: str) -> None:
    """Step a is checkpointed and step b is executing (it records its effect first)."""
    wait_for(lambda: [s for s, _ in effects(db, run_id)] == ["a", "b"], what="b started")


def test_sigkill_mid_workflow_resumes_at_last_checkpoint(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    run_id = client.start("three_steps", {"step_seconds": 1.0})
    with worker_process(dsn, "--lease", "2") as first:
        wait_until_step_b_runs(db, run_id)  # and kill it in the middle of b
        assert "a" in step_rows(db, run_id) and "b" not in step_rows(db, run_id)
        first.signal(signal.SIGKILL)
        first.proc.wait(10)
    before = step_rows(db, run_id)
    assert client.get(run_id).status == "running"  # held by the dead worker until lease expiry
    with worker_process(dsn) as second:
        run = client.wait(run_id, timeout=30)
        second.stop()
    assert run.status == "completed"
    ran = [s for s, _ in effects(db, run_id)]
    assert ran.count("a") == 1  # checkpointed before the kill: never again
    assert ran.count("b") == 2  # in flight at the kill: at-least-once
    assert ran.count("c") == 1
    assert step_rows(db, run_id)["a"] == before["a"]  # the checkpoint is untouched
    assert run.attempt == 1  # a crash does not burn a retry attempt
    assert run.output["a"]["pid"] == first.pid and run.output["c"]["pid"] == second.pid


def test_paused_worker_is_fenced_off_after_takeover(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    run_id = client.start("three_steps", {"step_seconds": 1.0})
    with worker_process(dsn, "--lease", "1.5") as paused:
        wait_until_step_b_runs(db, run_id)
        paused.signal(signal.SIGSTOP)
        time.sleep(2.0)  # its lease expires while it is frozen mid-step
        with worker_process(dsn) as successor:
            run = client.wait(run_id, timeout=30)
            assert run.status == "completed"
            outcome = step_rows(db, run_id)
            paused.signal(signal.SIGCONT)  # it finishes step b and tries to write it
            time.sleep(2.5)
            successor.stop()
        log = paused.stop()
    assert "lease lost" in log
    assert step_rows(db, run_id) == outcome  # nothing of the paused worker's landed
    final = client.get(run_id)
    assert final.status == "completed" and final.output == run.output
    assert run.output["b"]["pid"] == successor.pid and run.output["c"]["pid"] == successor.pid


def test_several_workers_complete_each_run_once(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    db.execute("select flowly.start('three_steps', '{}') from generate_series(1, 300)")
    with worker_process(dsn, "--concurrency", "16") as w1, \
            worker_process(dsn, "--concurrency", "16") as w2:
        wait_for(lambda: scalar(db, "select count(*) = 300 from flowly.runs"
                                    " where status = 'completed'"),
                 timeout=120, interval=0.2, what="300 runs completed")
        w1.stop()
        w2.stop()
    per_run = db.execute("select run_id, count(*), count(distinct step) from public.test_effects"
                         " group by run_id").fetchall()
    assert len(per_run) == 300
    assert all(count == 3 and distinct == 3 for _, count, distinct in per_run)
    pids = {pid for (pid,) in db.execute("select distinct pid from public.test_effects")}
    assert pids == {w1.pid, w2.pid}  # both took a share


def test_durable_sleep_survives_a_restart_and_wakes_on_time(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    run_id = client.start("sleepy", {"seconds": 3})
    with worker_process(dsn) as first:
        wake_at = wait_for(lambda: scalar(db, "select wake_at from flowly.timers"
                                              " where run_id = %s", run_id), what="timer")
        # released while it sleeps: the timer is stored first and the run released by a
        # second call (a worker killed between the two: tests/test_children_attack.py)
        wait_for(lambda: client.get(run_id).status == "pending", what="the run released")
        first.signal(signal.SIGKILL)
        first.proc.wait(10)
    time.sleep(1)
    with worker_process(dsn) as second:  # a restarted worker must not restart the nap
        wait_for(lambda: scalar(db, "select count(*) from flowly.workers where id like %s",
                                f"%:{second.pid}:%"), what="the restarted worker up")
        up = time.time()
        run = client.wait(run_id, timeout=30)
        second.stop()
    assert run.status == "completed"
    assert scalar(db, "select wake_at from flowly.timers where run_id = %s", run_id) == wake_at
    woke = run.output["woke"]
    # on time, or as soon as the restarted worker was up where the machine was slow to start
    # it (past the wake time): a nap begun again would end its 3 s after that
    assert wake_at.timestamp() - 0.05 <= woke <= max(wake_at.timestamp(), up) + 1.5
    assert [s for s, _ in effects(db, run_id)] == ["before"]


@pytest.mark.parametrize("workflow", ["slow", "stuck", "stubborn", "deaf"])
def test_graceful_shutdown_releases_leases_at_once(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any], workflow: str
) -> None:
    """SIGTERM: the run still in flight after the drain timeout is released and taken over at
    once, and the worker exits even when that run's sync step never returns ("stuck") or its
    async step ignores the cancellation ("stubborn"), however often ("deaf": asyncio.run,
    which waited for every task left once the worker had stopped, never returned)."""
    run_id = client.start(workflow, {"seconds": 60})
    with worker_process(dsn, "--lease", "30", "--drain-timeout", "0.5") as leaving:
        holder = wait_for(lambda: scalar(db, "select locked_by from flowly.runs where id = %s",
                                         run_id), what="run claimed")
        with worker_process(dsn, "--lease", "30", "--drain-timeout", "0.5") as staying:
            wait_for(lambda: scalar(db, "select count(*) = 2 from flowly.workers"),
                     what="second worker registered")
            leaving.signal(signal.SIGTERM)
            assert leaving.proc.wait(15) == 0
            released_at = time.monotonic()
            new_holder = wait_for(
                lambda: scalar(db, "select locked_by from flowly.runs where id = %s"
                                   " and locked_by is distinct from %s", run_id, holder),
                timeout=5, interval=0.02, what="run taken over")
            takeover = time.monotonic() - released_at
            staying.stop()
    log = leaving.stop()
    assert "released 1 of the 1 run(s) in flight" in log
    assert new_holder != holder
    assert takeover < 1.0, f"took {takeover:.2f}s, a lease expiry would take 30s"


def test_a_step_that_kills_every_worker_ends_as_poison_not_a_crash_loop(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    run_id = client.start("kills_its_worker", None)
    limit = scalar(db, "select flowly.max_takeovers()")
    deaths = 0
    for _ in range(limit + 1):  # the first claim and `limit` takeovers each kill a worker
        with worker_process(dsn, "--lease", "1") as worker:
            # on a loaded machine a worker may also lose its 1 s lease before the step
            # starts and take the run over again: a takeover without a death, so the run is
            # poison after fewer deaths, and a later worker finds it so and lives
            wait_for(lambda: worker.proc.poll() is not None
                     or client.get(run_id).status == "dead_letter",
                     timeout=30, what="the worker killed by the step, or the run poison")
            if worker.proc.poll() is None:
                break
            assert worker.proc.returncode == 3
            deaths += 1
    else:
        assert client.get(run_id).status == "running"  # held by the last dead worker
    assert 1 <= deaths <= limit + 1
    with worker_process(dsn, "--lease", "1") as survivor:
        run = client.wait(run_id, timeout=20)
        assert client.wait(client.start("quick", 1), timeout=20).status == "completed"
        assert survivor.proc.poll() is None  # the next worker is not handed the poison
    assert run.status == "dead_letter"
    assert run.error["type"] == "PoisonRun" and run.attempt == 1
