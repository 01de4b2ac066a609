"""Least privilege: a worker role that acts only through flowly's functions, and a read-only
role for dashboards (``flowly install --roles``)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql

import flowly
from flowly.schema import install_dsn
from tests.support import READER, WORKER, running_worker
from tests.test_cli import flowly as flowly_cli
from tests.test_cli import ok


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
