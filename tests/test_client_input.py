"""Bad values handed to Client and AsyncClient are refused before they reach the database,
with InvalidArgument naming the argument (flowly/arguments.py).

Before, a value of the wrong type failed as something else or did something else: an int
as an event name or a schedule name raised SchemaNotInstalled ("flowly is not installed"),
a list as an event name was stored as the event ``{ev}``, a NUL character failed as a raw
psycopg DataError, list_runs(limit=-1) as a bare SQL error, purge(batch="x") as a raw
InvalidTextRepresentation, purge("10") as a TypeError, wait(timeout=-1) as a RunTimeout
saying the database did not answer, and wait(status="complete") (misspelt) waited until its
timeout, or for ever without one.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from datetime import date, datetime
from typing import Any

import psycopg
import pytest

import flowly

# (what is called, the call on a client given a real run's id, what the error names)
CASES: list[tuple[str, Callable[[Any, str], Any], str]] = [
    ("get NUL", lambda c, r: c.get("a\x00b"), "run_id must not contain the NUL"),
    ("cancel NUL", lambda c, r: c.cancel("a\x00b"), "run_id must not contain the NUL"),
    ("send_event list name", lambda c, r: c.send_event(r, ["ev"]),
     "event name must be a string, got list"),
    ("send_event int name", lambda c, r: c.send_event(r, 3), "event name must be a string"),
    ("send_event NUL name", lambda c, r: c.send_event(r, "e\x00v"),
     "event name must not contain the NUL"),
    ("list_runs limit -1", lambda c, r: c.list_runs(limit=-1), "limit must be zero or more"),
    ("list_runs limit text", lambda c, r: c.list_runs(limit="5"), "limit must be an integer"),
    ("list_runs status int", lambda c, r: c.list_runs(status=3), "status must be a string"),
    ("list_runs status misspelt", lambda c, r: c.list_runs(status="complete"),
     "status must be one of .*got 'complete'"),
    ("list_runs workflow NUL", lambda c, r: c.list_runs(workflow="w\x00"),
     "workflow must not contain the NUL"),
    ("dead_letters limit -5", lambda c, r: c.dead_letters(limit=-5),
     "limit must be zero or more"),
    ("wait timeout -1", lambda c, r: c.wait(r, timeout=-1),
     "timeout must be zero or more seconds, got -1"),
    ("wait timeout nan", lambda c, r: c.wait(r, timeout=math.nan), "timeout must be zero or more"),
    ("wait status misspelt", lambda c, r: c.wait(r, status="complete"),
     "status must be among .*got 'complete'"),
    ("wait no status", lambda c, r: c.wait(r, status=[]), "status must be one of"),
    ("purge older_than text", lambda c, r: c.purge("10"),
     "older_than must be seconds or a timedelta, got str"),
    ("purge older_than inf", lambda c, r: c.purge(math.inf), "older_than must be a finite"),
    ("purge older_than negative", lambda c, r: c.purge(-1), "older_than must be zero or more"),
    ("purge batch text", lambda c, r: c.purge(10, batch="x"), "batch must be an integer"),
    ("purge status unfinished", lambda c, r: c.purge(10, statuses=["running"]),
     "statuses must be among completed, dead_letter, cancelled, got 'running'"),
    ("is_served int", lambda c, r: c.is_served(3), "workflow must be a string"),
    ("is_served queue NUL", lambda c, r: c.is_served("wf", "q\x00"),
     "queue must not contain the NUL"),
    ("schedule name NUL", lambda c, r: c.schedule("s\x00", "* * * * *", "wf"),
     "schedule name must not contain the NUL"),
    ("schedule timezone int", lambda c, r: c.schedule("s", "* * * * *", "wf", timezone=1),
     "timezone of schedule 's' must be a string"),
    ("unschedule int", lambda c, r: c.unschedule(3), "schedule name must be a string"),
    ("pause_schedule NUL", lambda c, r: c.pause_schedule("s\x00"),
     "schedule name must not contain the NUL"),
    ("cron_next int", lambda c, r: c.cron_next(5), "cron must be a string"),
    # numbers too large for a float raised OverflowError; a delay reaching back before the
    # year 1 was said to end after the year 10000
    ("start delay 10**400", lambda c, r: c.start("wf", delay=10**400),
     "delay of a 'wf' run is out of range: about 10\\*\\*400 seconds"),
    ("start timeout 10**400", lambda c, r: c.start("wf", timeout=10**400),
     "timeout of a 'wf' run is out of range"),
    ("start delay -1e11", lambda c, r: c.start("wf", delay=-1e11),
     "delay of a 'wf' run must not reach back before the year 1, got -1e"),
    ("start timeout -1e11", lambda c, r: c.start("wf", timeout=-1e11),
     "timeout of a 'wf' run must be positive, got -1e"),
    ("list_runs limit 10**5000", lambda c, r: c.list_runs(limit=10**5000),
     "limit is out of range: about 10\\*\\*5000"),
    # psycopg's CannotCoerce and InvalidDatetimeFormat; a naive time was read in the
    # session's time zone
    ("cron_next after int", lambda c, r: c.cron_next("* * * * *", after=123),
     "after must be a datetime, got int 123"),
    ("cron_next after text", lambda c, r: c.cron_next("* * * * *", after="garbage"),
     "after must be a datetime, got str 'garbage'"),
    ("cron_next after naive", lambda c, r: c.cron_next("0 9 * * *", after=datetime(2026, 1, 1)),
     "after must be timezone-aware"),
    ("cron_next after date", lambda c, r: c.cron_next("0 9 * * *", after=date(2026, 1, 1)),
     "after must be a datetime, got date"),
    # None where a value is needed; a None workflow raised TypeError ("None is not a registered
    # workflow function"); a schedule's None cron or zone is refused by the SQL, naming it
    ("start workflow None", lambda c, r: c.start(None),
     "workflow must be a workflow's name or its decorated function, got NoneType None"),
    ("schedule workflow None", lambda c, r: c.schedule("s", "* * * * *", None),
     "workflow of schedule 's' must be a workflow's name or its decorated function"),
    ("start workflow int", lambda c, r: c.start(7), "workflow must be a workflow's name"),
    ("cancel None", lambda c, r: c.cancel(None), "run_id must be a string, got NoneType"),
    ("retry_dead_letter None", lambda c, r: c.retry_dead_letter(None),
     "run_id must be a string, got NoneType"),
    ("send_event run_id None", lambda c, r: c.send_event(None, "ev"),
     "run_id must be a string, got NoneType"),
    ("unschedule None", lambda c, r: c.unschedule(None), "schedule name must be a string"),
    ("schedule cron None", lambda c, r: c.schedule("s", None, "wf"),
     "cron expression must not be null"),
    ("schedule timezone None", lambda c, r: c.schedule("s", "* * * * *", "wf", timezone=None),
     "timezone must be an IANA time zone name"),
    ("cron_next timezone None", lambda c, r: c.cron_next("* * * * *", timezone=None),
     "timezone must be a string, got NoneType"),
    # UnicodeEncodeError: text that cannot be sent as UTF-8
    *((f"{label} surrogate", call, f"{what} must not contain an unpaired surrogate")
      for label, call, what in [
          ("send_event name", lambda c, r: c.send_event(r, "\ud800"), "event name"),
          ("send_event run_id", lambda c, r: c.send_event("\ud800", "x"), "run_id"),
          ("cancel", lambda c, r: c.cancel("\ud800"), "run_id"),
          ("get", lambda c, r: c.get("\ud800"), "run_id"),
          ("retry_dead_letter", lambda c, r: c.retry_dead_letter("\ud800"), "run_id"),
          ("start run_id", lambda c, r: c.start("wf", run_id="\ud800"),
           "run_id of a 'wf' run"),
      ]),
]


def _nothing_written(db: psycopg.Connection[Any], run_id: str) -> None:
    assert db.execute("select count(*) from flowly.events").fetchone() == (0,)
    assert db.execute("select count(*) from flowly.schedules").fetchone() == (0,)
    assert db.execute("select status from flowly.runs").fetchall() == [("pending",)]


@pytest.mark.parametrize(("call", "message"), [(c, m) for _, c, m in CASES],
                         ids=[label for label, _, _ in CASES])
def test_the_client_refuses_a_bad_argument_naming_it(
    dsn: str, db: psycopg.Connection[Any], call: Callable[[Any, str], Any], message: str
) -> None:
    with flowly.Client(dsn) as client:
        run_id = client.start("wf")
        with pytest.raises(flowly.InvalidArgument, match=message):
            call(client, run_id)
    _nothing_written(db, run_id)


@pytest.mark.parametrize(("call", "message"), [(c, m) for _, c, m in CASES],
                         ids=[label for label, _, _ in CASES])
def test_the_async_client_refuses_a_bad_argument_naming_it(
    dsn: str, db: psycopg.Connection[Any], call: Callable[[Any, str], Any], message: str
) -> None:
    async def attempt() -> str:
        async with flowly.AsyncClient(dsn) as client:
            run_id = await client.start("wf")
            with pytest.raises(flowly.InvalidArgument, match=message):
                await call(client, run_id)
            return run_id

    _nothing_written(db, asyncio.run(attempt()))


def test_good_arguments_of_the_same_calls_still_work(dsn: str) -> None:
    """The checks let through what the calls always took: one status or several, a purge
    of one status given as text, a limit of zero."""
    with flowly.Client(dsn) as client:
        run_id = client.start("wf")
        assert client.send_event(run_id, "ev") == 1
        assert client.list_runs(limit=0) == []
        assert [r.id for r in client.list_runs(status="pending", workflow="wf")] == [run_id]
        assert client.wait(run_id, status=("pending", "running"), timeout=1).id == run_id
        assert client.purge(0, statuses="completed") == 0
        assert client.is_served("wf") is False


@pytest.mark.parametrize("make", [flowly.Client, flowly.AsyncClient])
@pytest.mark.parametrize(("timeout", "shown"), [
    (10**400, "about 10\\*\\*400"), (3e6, "3000000"), (2_147_483.5, "2147483.5")],
    ids=["10**400", "3e6", "just over"])
def test_a_client_timeout_the_server_cannot_take_is_refused_as_the_client_is_made(
    dsn: str, make: Callable[..., Any], timeout: float, shown: str
) -> None:
    """Client(timeout=10**400) raised OverflowError; Client(timeout=3e6) was taken, and every
    call then failed with psycopg's InvalidParameterValue: the server's statement_timeout
    takes at most 2147483647 ms."""
    with pytest.raises(flowly.InvalidArgument,
                       match=f"timeout must be at most 2147483 seconds .*got {shown}"):
        make(dsn, timeout=timeout)


def test_the_longest_client_timeout_the_server_takes_works(dsn: str) -> None:
    with flowly.Client(dsn, timeout=2_147_483) as client:
        assert client.list_runs() == []
