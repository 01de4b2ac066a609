"""A database or role whose session defaults are not PostgreSQL's (``alter database ... set``,
as an application sets them for its own sessions):

- a default isolation of REPEATABLE READ or SERIALIZABLE: the worker's sessions keep to READ
  COMMITTED, which the engine's calls are written for. Under SERIALIZABLE they failed each
  other's commits: claims failed again and again, and a batch of checkpoints failed as a
  whole, its runs abandoned until their leases expired;
- a DateStyle or IntervalStyle that psycopg does not read: every read of a time failed, a
  run's replay included (its run dead-lettered);
- a client_encoding short of UTF-8: a run whose input held a character outside it failed
  every claim of the worker that served it.

Also: a Client's own call that the database chose to fail under SERIALIZABLE is made again,
and flowly's sessions name themselves in pg_stat_activity.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import flowly
from tests.support import database_default, running_worker, scalar, wait_for
from tests.test_cli import flowly as flowly_cli
from tests.test_cli import ok

STRICTER = ["repeatable read", "serializable"]
# what the worker logs when one of its calls failed: what a stricter isolation set off
_CALLS_FAILED = ("claim failed", "group commit of", "abandoned until", "listener lost",
                 "heartbeat failed")


def _isolation(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("select current_setting('transaction_isolation')").fetchone()
    assert row is not None
    return str(row[0])


@flowly.workflow("iso_transaction_isolation")
async def iso_transaction_isolation(ctx: flowly.Context, inp: Any) -> Any:
    """The isolation of a transactional step that names none, and of one that does."""
    return [await ctx.transaction("default", _isolation),
            await ctx.transaction("named", _isolation, isolation="serializable")]




def _finished(db: psycopg.Connection[Any], runs: int) -> list[str]:
    """The statuses of all ``runs`` runs once each has finished (read in this test's own
    session, opened before the default changed: a SERIALIZABLE read may fail on its own)."""
    wait_for(lambda: scalar(db, "select count(*) from flowly.runs where status in"
                                " ('completed', 'dead_letter', 'cancelled')") == runs,
             timeout=60)
    return [row[0] for row in db.execute("select status from flowly.runs")]


@pytest.mark.parametrize("isolation", STRICTER)
def test_runs_complete_without_a_failed_call_under_a_stricter_default_isolation(
        dsn: str, db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch, isolation: str) -> None:
    monkeypatch.setenv("FLOWLY_DSN", dsn)  # where the steps record their effects
    database_default(db, "default_transaction_isolation", isolation)
    caplog.set_level(logging.WARNING, logger="flowly")
    with psycopg.connect(dsn) as fresh:
        assert _isolation(fresh) == isolation
    with running_worker(dsn, workflows=["three_steps", "work_nap_work"], concurrency=32):
        db.execute("select flowly.start('three_steps', '{}') from generate_series(1, 150)")
        db.execute("select flowly.start('work_nap_work', '{\"first\": 0, \"second\": 0}')"
                   " from generate_series(1, 50)")
        statuses = _finished(db, 200)
    assert statuses == ["completed"] * 200
    assert scalar(db, "select count(*) from public.test_effects") == 3 * 150
    assert scalar(db, "select max(takeovers) from flowly.runs") == 0
    failed = [record.getMessage() for record in caplog.records
              if any(failure in record.getMessage() for failure in _CALLS_FAILED)]
    assert failed == []


def test_a_transactional_step_that_names_no_isolation_is_read_committed_whatever_the_default(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    database_default(db, "default_transaction_isolation", "serializable")
    with running_worker(dsn, workflows=["iso_transaction_isolation"]):
        db.execute("select flowly.start('iso_transaction_isolation')")
        assert _finished(db, 1) == ["completed"]
    assert scalar(db, "select output from flowly.runs") == ["read committed", "serializable"]


TEXT = "caf\u00e9 \u2603 \U0001F600"  # beyond LATIN1 and beyond the BMP
ODD_STYLES = [("datestyle", "SQL, DMY"), ("datestyle", "German"),
              ("intervalstyle", "iso_8601"), ("intervalstyle", "sql_standard"),
              ("client_encoding", "LATIN1")]


@pytest.mark.parametrize(("setting", "value"), ODD_STYLES)
def test_the_worker_the_client_and_top_read_a_session_of_other_styles_and_encoding(
        dsn: str, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch,
        setting: str, value: str) -> None:
    monkeypatch.setenv("FLOWLY_DSN", dsn)
    database_default(db, setting, value)
    with flowly.Client(dsn) as client, running_worker(dsn, workflows=["sleepy", "echo"]):
        napping = client.start("sleepy", {"seconds": 0.2}, timeout=60)
        echoed = client.start("echo", {"value": TEXT}, timeout=60)
        assert client.wait(napping, timeout=20).status == "completed"
        run = client.wait(echoed, timeout=20)
        assert (run.status, run.input["value"], run.output) == ("completed", TEXT, TEXT)
        assert [step.output for step in client.steps(echoed)] == [TEXT]
        assert client.timers(napping)[0].fired_at is not None

        async def read_async() -> Any:
            async with flowly.AsyncClient(dsn) as async_client:
                return (await async_client.get(echoed)).output

        assert asyncio.run(read_async()) == TEXT
    frame = json.loads(ok(flowly_cli("--json", "top", "--once", dsn=dsn)))
    assert frame


_FAIL_INSERTS = """
create sequence public.runs_to_fail;
create function public.fail_the_first_runs() returns trigger language plpgsql as $$
begin
    if nextval('public.runs_to_fail') <= %s then
        raise exception 'chosen to fail for another transaction''s sake' using errcode = '40001';
    end if;
    return new;
end
$$;
create trigger fail_the_first_runs before insert on flowly.runs
    for each row execute function public.fail_the_first_runs();
"""


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_client_s_own_call_that_loses_a_serialization_race_is_made_again_a_few_times(
        dsn: str, db: psycopg.Connection[Any], asynchronous: bool) -> None:
    # a stand-in for SERIALIZABLE's choice of a victim (40001), which no test can time: the
    # first two inserts of a run fail so, and the third one succeeds
    db.execute(_FAIL_INSERTS % 2)

    async def start_async(run_id: str) -> str:
        async with flowly.AsyncClient(dsn) as async_client:
            return await async_client.start("quick", None, run_id=run_id)

    def start(run_id: str) -> str:
        if asynchronous:
            return asyncio.run(start_async(run_id))
        with flowly.Client(dsn) as client:
            return client.start("quick", None, run_id=run_id)

    assert start("third time lucky") == "third time lucky"
    assert scalar(db, "select count(*) from flowly.runs") == 1
    db.execute("create or replace function public.fail_the_first_runs() returns trigger"
               " language plpgsql as $$ begin raise exception 'always the victim'"
               " using errcode = '40001'; end $$")
    with pytest.raises(psycopg.errors.SerializationFailure, match="always the victim"):
        start("never")
    assert scalar(db, "select count(*) from flowly.runs") == 1


def _session_names(db: psycopg.Connection[Any], besides: list[int]) -> set[str]:
    return {row[0] for row in db.execute(
        "select application_name from pg_stat_activity"
        " where datname = current_database() and pid <> all(%s)", (besides,))}


def test_flowly_s_sessions_name_themselves_in_pg_stat_activity_unless_the_dsn_does(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    before = [row[0] for row in db.execute(  # this test's own
        "select pid from pg_stat_activity where datname = current_database()")]
    with flowly.Client(dsn) as client, running_worker(dsn, workflows=["quick"]):
        assert client.wait(client.start("quick", None), timeout=20).status == "completed"
        assert _session_names(db, before) == {"flowly worker", "flowly client"}
    wait_for(lambda: _session_names(db, before) == set())
    named = make_conninfo(dsn, application_name="billing")
    with flowly.Client(named) as client, running_worker(named, workflows=["quick"]):
        assert client.wait(client.start("quick", None), timeout=20).status == "completed"
        assert _session_names(db, before) == {"billing"}
