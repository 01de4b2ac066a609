"""Least privilege: a worker role that acts only through flowly's functions, and a read-only
role for dashboards (``flowly install --roles``)."""

from __future__ import annotations

import re
import threading
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

import flowly
from flowly.db import Calls
from flowly.schedules import ScheduleCalls
from flowly.schema import install, install_dsn, setup_roles
from tests import workflows  # noqa: F401 (registers the workflows workers run)
from tests.support import READER, WORKER, drop_roles, running_worker
from tests.test_cli import QUOTED_SCHEMAS, ok
from tests.test_cli import flowly as flowly_cli


def test_the_worker_role_runs_workflows_through_functions_only(
    roles: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker_dsn, _ = roles
    monkeypatch.setenv("FLOWLY_DSN", worker_dsn)
    assert install_dsn(worker_dsn) == []  # up to date: a worker role may start a worker
    with flowly.Client(worker_dsn) as client, running_worker(worker_dsn):
        runs = [client.start("three_steps", {}), client.start("saga", None),
                client.start("sleepy", {"seconds": 0.2})]
        assert [client.wait(r, timeout=30).status for r in runs] == ["completed"] * 3
        # not yet due, so the worker cannot finish it before the cancel lands
        assert client.cancel(client.start("quick", None, delay=3600)) == "cancelled"
        assert client.list_runs(limit=10)
    with psycopg.connect(worker_dsn, autocommit=True) as conn:
        for statement in ("delete from flowly.runs", "update flowly.runs set status = 'x'",
                          "insert into flowly.steps (run_id, name, seq, status, started_at)"
                          " values ('r', 's', 1, 'completed', now())",
                          "select flowly.setup_roles('x', 'y')"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)
        # a hostile search_path of the caller changes nothing: every function pins its own
        conn.execute("set search_path = pg_temp, public")
        conn.execute("create temporary table runs (id text)")
        run_id = conn.execute("select flowly.start('quick')").fetchone()[0]
        assert conn.execute("select count(*) from flowly.runs where id = %s",
                            (run_id,)).fetchone() == (1,)
        assert conn.execute("select count(*) from pg_temp.runs").fetchone() == (0,)


def test_the_reader_role_reads_and_cannot_write(roles: tuple[str, str]) -> None:
    _, reader_dsn = roles
    with psycopg.connect(reader_dsn, autocommit=True) as conn:
        for view in ("run_counts", "dead_letters", "queue_backlog", "live_workers",
                     "stuck_runs", "throughput", "step_latency", "runs", "steps"):
            conn.execute(f"select * from flowly.{view}").fetchall()
        for statement in ("select flowly.start('quick')", "select flowly.cancel('x')",
                          "delete from flowly.runs", "select flowly.purge('1 day')"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)


def test_runs_are_listed_without_their_data_by_a_role_that_may_not_read_it(
    dsn: str, roles: tuple[str, str], db: psycopg.Connection[Any]
) -> None:
    """`flowly runs` shows no input or output, so it must not read them (50 runs with 100 MB
    inputs would be 5 GB for a table of ids): a reader denied those two columns lists runs
    with the table and with ``list_runs(data=False)``, and is refused only where the data is
    asked for (``--json``, ``list_runs()``)."""
    _, reader_dsn = roles
    with flowly.Client(dsn) as admin:
        run_id = admin.start("quick", {"secret": "pii"})
    columns = [name for (name,) in db.execute(
        "select column_name from information_schema.columns where table_schema = 'flowly'"
        " and table_name = 'runs' and column_name not in ('input', 'output')")]
    db.execute(sql.SQL("revoke select on flowly.runs from {}").format(sql.Identifier(READER)))
    db.execute(sql.SQL("grant select ({}) on flowly.runs to {}").format(
        sql.SQL(", ").join(map(sql.Identifier, columns)), sql.Identifier(READER)))
    assert run_id in ok(flowly_cli("runs", dsn=reader_dsn))
    refused = flowly_cli("runs", "--json", dsn=reader_dsn)
    assert refused.returncode != 0 and "permission denied" in refused.stderr
    with flowly.Client(reader_dsn) as reader:
        [run] = reader.list_runs(data=False)
        assert (run.id, run.status, run.input, run.output) == (run_id, "pending", None, None)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            reader.list_runs()
    with flowly.Client(dsn) as admin:
        assert admin.list_runs()[0].input == {"secret": "pii"}


def test_install_roles_from_the_command_line(dsn: str, db: psycopg.Connection[Any]) -> None:
    try:
        out = ok(flowly_cli("install", "--roles", "--worker-role", WORKER, "--reader-role",
                            READER, dsn=dsn))
    except AssertionError:
        if "permission denied to create role" in flowly_cli(
                "install", "--roles", "--worker-role", WORKER, dsn=dsn).stderr:
            pytest.skip("the test database's user may not create roles")
        raise
    try:
        assert f"roles {WORKER}" in out
        assert db.execute("select worker_role, reader_role from flowly.settings").fetchone() == (
            WORKER, READER)
        assert db.execute("select has_function_privilege(%s, 'flowly.start(text, jsonb, text,"
                          " text, integer, timestamptz, text, integer, interval, text, bigint,"
                          " text, integer)', 'execute')", (READER,)).fetchone() == (False,)
    finally:
        for role in (WORKER, READER):
            db.execute(sql.SQL("drop owned by {} cascade").format(sql.Identifier(role)))
            db.execute(sql.SQL("drop role {}").format(sql.Identifier(role)))


# README, "SQL functions and errors": what users, triggers and workers call by hand
DOCUMENTED_FUNCTIONS = {
    "start", "cancel", "retry_dead_letter", "send_event", "purge", "schedule", "unschedule",
    "pause_schedule", "resume_schedule", "cron_next", "trigger_run_id", "tick_schedules",
    "claim", "replay", "heartbeat", "checkpoint_steps", "checkpoint", "complete_runs",
    "complete", "sleep", "wait_for_event", "wait_for_run", "park", "fail_step", "fail_run",
    "record_compensation", "finish_compensation", "release", "begin_transaction_step",
    "checkpoint_transaction"}
# trigger_run_id runs with its caller's rights (see Least privilege), so the caller calls these
CALLED_BY_TRIGGER_RUN_ID = {"key_run_id", "trigger_key_columns"}


def functions_flowly_calls() -> set[str]:
    """The names of the functions flowly's own statements call (db.Calls, ScheduleCalls)."""
    statements = [*vars(Calls("flowly")).values(), *vars(ScheduleCalls("flowly")).values()]
    return {name for statement in statements if isinstance(statement, sql.Composable)
            for name in re.findall(r'"flowly"\.(\w+)\(', statement.as_string(None))}


def test_the_worker_role_may_call_what_flowly_and_its_users_call_and_nothing_else(
        roles: tuple[str, str], db: psycopg.Connection[Any]) -> None:
    """The worker role may execute every function a worker or client calls and those the
    README documents; internal helpers that trust their caller (insert_run,
    release_held_run, ...) stay the owner's, called only from inside flowly's functions."""
    called = functions_flowly_calls()
    assert {"start", "claim_and_offer", "offer_slot", "tick_schedules"} <= called
    executable = {name for (name,) in db.execute(
        "select distinct p.proname from pg_proc p where p.pronamespace = 'flowly'::regnamespace"
        " and has_function_privilege(%s, p.oid, 'execute')", (WORKER,))}
    assert executable == called | DOCUMENTED_FUNCTIONS | CALLED_BY_TRIGGER_RUN_ID
    assert not {name for (name,) in db.execute(
        "select distinct p.proname from pg_proc p where p.pronamespace = 'flowly'::regnamespace"
        " and has_function_privilege('public', p.oid, 'execute')")}


def test_the_worker_role_cannot_write_runs_past_the_checks_through_internal_helpers(
        roles: tuple[str, str], db: psycopg.Connection[Any]) -> None:
    """insert_run and release_held_run check nothing (start and the fenced calls do): a run
    due at 'infinity', or a finished run released to '-infinity', made every listing fail
    with "timestamp too large". The worker role may call neither; the listings still work."""
    worker_dsn, _ = roles
    db.execute("select flowly.start('quick', run_id => 'ok1')")
    db.execute("select flowly.cancel('ok1')")
    with psycopg.connect(worker_dsn, autocommit=True) as conn:
        for statement in (
                "select flowly.insert_run('w1', 'quick', 'default', '{}', 0, 'infinity', null,"
                " 3, null, null)",
                "select flowly.release_held_run('ok1', '-infinity')",
                "select flowly.release_for_retry('ok1', '-infinity')"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)
    assert "ok1" in ok(flowly_cli("runs", dsn=worker_dsn))
    assert "cancelled" in ok(flowly_cli("show", "ok1", dsn=worker_dsn))


def test_role_setups_at_once_all_succeed(empty_dsn: str) -> None:
    """README, Install and upgrade: installers running at once each succeed. Four
    ``install --roles`` released together at their role setup: the roles were created by
    one and the others failed with a duplicate key on pg_authid (or a grant's "tuple
    concurrently updated"). Now each succeeds, and the roles get their rights once."""
    worker, reader = f"{WORKER}_c", f"{READER}_c"
    count = 4
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def installer() -> None:
        try:
            with psycopg.connect(empty_dsn, autocommit=True) as conn:
                install(conn)
                barrier.wait(timeout=30)
                setup_roles(conn, worker=worker, reader=reader)
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=installer) for _ in range(count)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        if any(isinstance(e, psycopg.errors.InsufficientPrivilege) for e in errors):
            pytest.skip("the test database's user may not create roles")
        assert not errors, errors
        with psycopg.connect(empty_dsn, autocommit=True) as conn:
            assert conn.execute("select has_function_privilege(%s, 'flowly.cancel(text)',"
                                " 'execute')", (worker,)).fetchone() == (True,)
    finally:
        drop_roles(empty_dsn, worker, reader)


@pytest.mark.parametrize("schema", QUOTED_SCHEMAS)
def test_the_worker_role_runs_workflows_in_a_schema_whose_name_needs_quotes(
        dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker and a client logged in with the worker role serve and start runs in a schema
    whose name needs quotes (a ``%`` in it too), calling only what the role may call."""
    worker, reader = f"{WORKER}_s", f"{READER}_s"
    login = f"{worker}_login"
    with psycopg.connect(dsn, autocommit=True) as conn:
        install(conn, schema)
        try:
            setup_roles(conn, schema, worker=worker, reader=reader)
            conn.execute(sql.SQL("create role {l} login in role {w};"
                                 " grant insert, select on public.test_effects to {l}").format(
                l=sql.Identifier(login), w=sql.Identifier(worker)))
            worker_dsn = make_conninfo(dsn, user=login)
            monkeypatch.setenv("FLOWLY_DSN", worker_dsn)  # the steps' own connections
            with flowly.Client(worker_dsn, schema=schema) as client, \
                    running_worker(worker_dsn, schema=schema):
                runs = [client.start("three_steps", {}), client.start("sleepy", {"seconds": 0.1})]
                assert [client.wait(r, timeout=30).status for r in runs] == ["completed"] * 2
                assert {run.id for run in client.list_runs(limit=10)} == set(runs)
                assert client.purge(timedelta(0)) == 2
        finally:
            drop_roles(dsn, login, worker, reader)
