"""A database that is read-only for a while: a storage guard that sets
``default_transaction_read_only`` (managed servers do when the disk fills), or a failover
endpoint that still points at a standby. Nothing flowly calls can write then. It is the
server's state, not any run's fault: a worker must neither exit nor fail a run because of it,
and once the database is writable again every run must come out as it would have."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import psycopg
import pytest

import flowly
import tests.workflows  # noqa: F401  (registers "three_steps")
from tests.support import database_default, end_other_sessions, running_worker, scalar, wait_for


def _read_only(db: psycopg.Connection[Any], on: bool) -> None:
    """New sessions of the test's database begin read-only (or not any more); the sessions
    others have open are ended, so that theirs are new too (the test's ``db`` stays)."""
    database_default(db, "default_transaction_read_only", "on" if on else "off")
    end_other_sessions(db)


def _flowly_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("flowly") and r.levelno >= logging.ERROR]


@flowly.workflow("rod_three_naps")
async def rod_three_naps(ctx: flowly.Context, inp: Any) -> Any:
    """Three steps that write nothing of their own: a step failure recorded here would be
    flowly's own write refused and taken for the step's (three_steps records its effects on
    a connection of its own, which a read-only database refuses: a failure of the step)."""
    async def nap(n: int) -> int:
        await asyncio.sleep(0.2)
        return n

    return [await ctx.step(f"nap{n}", nap, n) for n in range(3)]


def test_runs_in_flight_when_the_database_turns_read_only_complete_once_it_is_writable(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client,
        caplog: pytest.LogCaptureFixture) -> None:
    """A refused checkpoint was taken for a write the database refused for its content: the
    run was "interrupted by an internal error" (an ERROR with a traceback), and had its
    failure record gone through on a connection still writable, the step would have failed
    without retries. It is abandoned until its lease ends, as after a lost connection."""
    caplog.set_level(logging.WARNING, logger="flowly")
    with running_worker(dsn, workflows=["rod_three_naps"], lease=4):
        run_ids = [client.start("rod_three_naps", None) for _ in range(20)]
        wait_for(lambda: scalar(db, "select count(*) from flowly.steps"), what="steps begun")
        _read_only(db, True)
        time.sleep(3)
        _read_only(db, False)
        runs = [client.wait(run_id, timeout=60) for run_id in run_ids]
    assert [(r.status, r.output) for r in runs] == [("completed", [0, 1, 2])] * 20
    assert scalar(db, "select count(*) from flowly.step_attempts") == 0
    assert _flowly_errors(caplog) == []
    abandoned = [r.getMessage() for r in caplog.records if "abandoned until" in r.getMessage()]
    assert any("read-only" in message for message in abandoned), abandoned


def test_a_worker_started_on_a_read_only_database_waits_and_serves_once_it_is_writable(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client,
        caplog: pytest.LogCaptureFixture) -> None:
    """It exited with "database error: cannot execute DELETE in a read-only transaction"
    (its registration): under a supervisor, a crash loop for as long as the guard lasts."""
    caplog.set_level(logging.WARNING, logger="flowly")
    run_id = client.start("three_steps", {})
    _read_only(db, True)
    with running_worker(dsn, workflows=["three_steps"]):
        wait_for(lambda: any("could not register worker" in r.getMessage()
                             and "read-only" in r.getMessage() for r in caplog.records),
                 what="the worker waiting to register")
        _read_only(db, False)
        assert client.wait(run_id, timeout=30).status == "completed"


@flowly.workflow("rod_read_only_transaction")
async def rod_read_only_transaction(ctx: flowly.Context, inp: dict[str, Any]) -> Any:
    def made_read_only(conn: psycopg.Connection[Any]) -> str:
        conn.execute("set transaction read only")
        return "read"

    async def made_read_only_async(conn: psycopg.AsyncConnection[Any]) -> str:
        await conn.execute("set transaction read only")
        return "read"

    fn = made_read_only_async if inp["async"] else made_read_only
    return await ctx.transaction("read", fn, retry=flowly.Retry(max_attempts=3,
                                                                initial_delay=0.05))


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_transactional_step_that_makes_its_transaction_read_only_fails_without_retries(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client, is_async: bool) -> None:
    """Its own SQL made the transaction read-only: that is no read-only server to wait out
    (waiting, the run would be taken over again and again until it counted as poison), but
    the step's mistake, named."""
    run_id = client.start("rod_read_only_transaction", {"async": is_async})
    with running_worker(dsn, workflows=["rod_read_only_transaction"]):
        run = client.wait(run_id, timeout=20)
    assert run.status == "dead_letter"
    assert run.error is not None and "made the transaction flowly opened for it read-only" \
        in run.error["message"]
    assert scalar(db, "select count(*) from flowly.step_attempts where run_id = %s",
                  run_id) == 1
