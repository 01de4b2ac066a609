"""``flowly worker --processes N``: N worker processes under one supervisor, as real processes
(a worker killed with SIGKILL, a supervisor killed with SIGKILL, signals passed on)."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import psycopg
import pytest

import flowly
from tests.support import WorkerProcess, scalar, wait_for
from tests.test_cli import flowly as flowly_command
from tests.test_cli import one_error_line


def _serving(db: psycopg.Connection[Any], supervisor: WorkerProcess) -> set[int]:
    """The pids of the supervisor's live worker processes that registered in
    flowly.workers."""
    registered = {int(worker_id.rsplit(":", 2)[1]) for (worker_id,) in
                  db.execute("select id from flowly.workers").fetchall()}
    children = {child.pid for child in psutil.Process(supervisor.pid).children()
                if child.status() != psutil.STATUS_ZOMBIE}
    return registered & children


def _drained(db: psycopg.Connection[Any], client: flowly.Client, runs: int) -> None:
    run_ids = [client.start("quick", {"n": n}) for n in range(runs)]
    for run_id in run_ids:
        assert client.wait(run_id, timeout=30).status == "completed"


@contextmanager
def _supervisor(dsn: str, *args: str) -> Iterator[WorkerProcess]:
    """``flowly worker --processes 2`` serving the test database; killed if a test fails."""
    supervisor = WorkerProcess(dsn, "--processes", "2", *args)
    try:
        yield supervisor
    finally:
        if supervisor.proc.poll() is None:
            sys.stderr.write(supervisor.kill())


def _stopped(supervisor: WorkerProcess) -> str:
    """SIGTERM: the supervisor exits 0 once its workers have; returns what they all logged."""
    supervisor.signal(signal.SIGTERM)
    assert supervisor.proc.wait(30) == 0
    return supervisor.stop()


def _gone(pids: set[int]) -> bool:
    return not any(psutil.pid_exists(pid) and psutil.Process(pid).status()
                   != psutil.STATUS_ZOMBIE for pid in pids)


def test_processes_serve_together_a_killed_one_is_replaced_and_sigterm_stops_all(
    dsn: str, db: psycopg.Connection[Any], client: flowly.Client
) -> None:
    with _supervisor(dsn) as supervisor:
        first = wait_for(lambda: len(pids := _serving(db, supervisor)) == 2 and pids,
                         what="two worker processes registered")
        _drained(db, client, 20)

        killed = min(first)
        psutil.Process(killed).send_signal(signal.SIGKILL)
        second = wait_for(lambda: len(pids := _serving(db, supervisor)) == 2
                          and killed not in pids and pids, what="the killed one replaced")
        assert len(second & first) == 1  # the other one served on
        assert supervisor.proc.poll() is None
        _drained(db, client, 20)
        log = _stopped(supervisor)
    assert wait_for(lambda: _gone(second), what="the workers gone")
    assert f"started (pid {killed})" in log and f"(pid {killed}) was killed by SIGKILL" in log, log
    # each live worker drained and unregistered itself; only the killed one's row is left
    ids = [row[0] for row in db.execute("select id from flowly.workers").fetchall()]
    assert [int(worker_id.rsplit(":", 2)[1]) for worker_id in ids] == [killed], log
    assert scalar(db, "select count(*) from flowly.runs where status <> 'completed'") == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="workers follow their supervisor's death on Linux only")
def test_a_supervisor_killed_with_sigkill_leaves_no_worker_running(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    supervisor = WorkerProcess(dsn, "--processes", "2")
    workers: set[int] = set()
    try:
        workers = wait_for(lambda: len(pids := _serving(db, supervisor)) == 2 and pids,
                           what="two worker processes registered")
        supervisor.proc.kill()
        supervisor.proc.wait(10)
        assert wait_for(lambda: _gone(workers), timeout=30, what="the orphaned workers gone")
    finally:  # not communicate(): workers left running would hold its pipe open
        for pid in workers:
            if psutil.pid_exists(pid):
                psutil.Process(pid).kill()
        if supervisor.proc.poll() is None:
            supervisor.proc.kill()
        assert supervisor.proc.stdout is not None
        supervisor.proc.stdout.close()
    # they stopped as on SIGTERM: drained and unregistered, not killed
    assert scalar(db, "select count(*) from flowly.workers") == 0


def test_a_worker_that_cannot_start_stops_the_others_with_its_status(dsn: str) -> None:
    """A worker that exits with an error of its own as it starts (here, a database that does
    not exist) met what every copy would meet again: the supervisor stops the others and exits
    with its status, at once."""
    missing = psycopg.conninfo.make_conninfo(dsn, dbname="flowly_no_such_database")
    began = time.monotonic()
    result = flowly_command("worker", "--app", "tests.workflows", "--processes", "3",
                            dsn=missing, timeout=60)
    assert result.returncode == 1, result.stderr
    assert time.monotonic() - began < 30
    assert 'database "flowly_no_such_database" does not exist' in result.stderr
    assert "could not start (exit status 1); stopping the others" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_run_that_kills_every_worker_ends_as_poison_and_the_others_serve_on(
    dsn: str, db: psycopg.Connection[Any], client: flowly.Client
) -> None:
    """A step that ends its worker's process (os._exit(3), as a C library's exit would) is not
    a worker that cannot start: each worker it kills is replaced, the run ends as poison, and
    the supervisor never stops serving the other runs."""
    with _supervisor(dsn, "--lease", "1") as supervisor:
        wait_for(lambda: len(_serving(db, supervisor)) == 2, what="two workers registered")
        run_id = client.start("kills_its_worker", None)
        run = client.wait(run_id, timeout=90)
        assert supervisor.proc.poll() is None
        wait_for(lambda: len(_serving(db, supervisor)) == 2, timeout=60,
                 what="two workers serving again")
        _drained(db, client, 10)
        log = _stopped(supervisor)
    assert run.status == "dead_letter" and run.error["type"] == "PoisonRun", run
    assert "exited with status 3; another starts in 0.5s" in log, log
    assert "could not start" not in log, log


def test_a_step_that_stops_the_event_loop_neither_ends_its_worker_nor_the_others(
    dsn: str, db: psycopg.Connection[Any], client: flowly.Client
) -> None:
    """An async step calls ``asyncio.get_running_loop().stop()`` right after the workers
    started. Before, its worker died of "Event loop stopped before Future completed", and the
    supervisor, seeing a worker fail within seconds of its start, took it for one that could
    not start and stopped them all. Now the worker resumes its loop, the run completes, and
    both workers go on serving."""
    with _supervisor(dsn) as supervisor:
        run_id = client.start("stops_its_loop", None)
        run = client.wait(run_id, timeout=30)
        assert supervisor.proc.poll() is None
        wait_for(lambda: len(_serving(db, supervisor)) == 2, what="two workers serving")
        _drained(db, client, 10)
        log = _stopped(supervisor)
    assert (run.status, run.output, run.attempt) == ("completed", ["stopped", "went on"], 1), run
    assert "Event loop stopped before Future completed" not in log, log
    assert "exited with status" not in log and "could not start" not in log, log
    assert "the event loop was stopped" in log, log


def test_processes_below_one_is_a_usage_error(dsn: str) -> None:
    error = one_error_line(flowly_command("worker", "--app", "tests.workflows", "--processes",
                                          "0", dsn=dsn), 2)
    assert error == "error: --processes must be at least 1, got 0"


def test_a_second_signal_ends_a_supervisor_whose_worker_does_not_stop(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """One worker frozen (SIGSTOP: a paused container, a debugger) never acts on its SIGTERM.
    The supervisor sent each worker SIGTERM once and waited for ever, a second SIGTERM or
    SIGINT ignored: only SIGKILL ended it. A second signal now kills the workers left."""
    with _supervisor(dsn) as supervisor:
        workers = wait_for(lambda: len(pids := _serving(db, supervisor)) == 2 and pids,
                           what="two worker processes registered")
        frozen = min(workers)
        psutil.Process(frozen).send_signal(signal.SIGSTOP)
        supervisor.signal(signal.SIGTERM)
        wait_for(lambda: _gone(workers - {frozen}), what="the other worker stopped")
        time.sleep(0.5)
        assert supervisor.proc.poll() is None  # waiting for the frozen one, as it should
        supervisor.signal(signal.SIGTERM)
        status = supervisor.proc.wait(10)
        log = supervisor.stop()
    assert wait_for(lambda: _gone({frozen}), what="the frozen worker killed")
    assert status == 0, log
    assert f"worker process 1 (pid {frozen})" in log or f"(pid {frozen})" in log, log
    assert "killing" in log, log
