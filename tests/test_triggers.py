"""Atomic enqueue and flowly.start_trigger: a run commits or rolls back with the transaction
that starts it (Python ``conn=``, plain SQL, a trigger), and the ready-made trigger function
starts one run per row (row or statement level) with a deterministic run id from the key
columns, in flowly's own schema whatever it is called and whatever the caller's search_path."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

import flowly
from flowly.schema import install, setup_roles
from tests import workflows  # noqa: F401 (registers the workflows workers run)
from tests.support import ROOT, running_worker, scalar

LEVELS = ("row", "statement")


@pytest.fixture
def client(dsn: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[flowly.Client]:
    monkeypatch.setenv("FLOWLY_DSN", dsn)
    with flowly.Client(dsn) as c:
        yield c


def create_trigger(conn: psycopg.Connection[Any], table: str, level: str, *args: str,
                   schema: str = "flowly", event: str = "insert", when: str = "after",
                   name: str = "enqueue") -> None:
    """``create trigger`` on ``table`` calling ``<schema>.start_trigger(args...)`` for each row,
    or for each statement with the new rows as a transition table."""
    referencing = (sql.SQL("referencing new table as new_rows ") if level == "statement"
                   else sql.SQL(""))
    conn.execute(sql.SQL(
        "create trigger {name} {when} {event} on {table} {referencing}for each {level}"
        " execute function {schema}.start_trigger({args})").format(
            name=sql.Identifier(name), when=sql.SQL(when), event=sql.SQL(event),
            table=sql.SQL(table), referencing=referencing, level=sql.SQL(level),
            schema=sql.Identifier(schema), args=sql.SQL(", ").join(map(sql.Literal, args))))


def runs(conn: psycopg.Connection[Any], schema: str = "flowly") -> list[tuple[Any, ...]]:
    """(id, workflow, queue, priority, status, input) of every run, by id."""
    return conn.execute(sql.SQL(
        "select id, workflow, queue, priority, status, input from {}.runs order by id").format(
            sql.Identifier(schema))).fetchall()


def run_ids(conn: psycopg.Connection[Any], schema: str = "flowly") -> list[str]:
    return [r[0] for r in runs(conn, schema)]


def one(conn: psycopg.Connection[Any], query: sql.Composed) -> Any:
    """The one value ``query`` returns."""
    row = conn.execute(query).fetchone()
    assert row is not None
    return row[0]


def notifications(conn: psycopg.Connection[Any], wait: float = 0.3) -> list[tuple[str, str]]:
    """(channel, payload) of the notifications ``conn`` received within ``wait`` seconds."""
    return [(n.channel, n.payload) for n in conn.notifies(timeout=wait)]


# --- atomic enqueue: Python conn=, SQL, trigger --------------------------------------------

def test_python_start_with_conn_commits_or_rolls_back_with_the_caller(
        dsn: str, client: flowly.Client, db: psycopg.Connection[Any]) -> None:
    """``client.start(..., conn=app)``: invisible to others until the app commits; a rollback
    leaves no run, a commit leaves exactly one."""
    with psycopg.connect(dsn) as app:
        app.execute("create table orders (id int primary key)")
        app.commit()
        app.execute("insert into orders values (1)")
        gone = client.start("quick", 1, run_id="py-rolled-back", conn=app)
        assert gone == "py-rolled-back"
        assert run_ids(db) == []  # not visible outside the app's transaction
        app.rollback()
        app.execute("insert into orders values (2)")
        kept = client.start("quick", 2, run_id="py-committed", conn=app)
        assert run_ids(db) == []
        app.commit()
    assert run_ids(db) == [kept]
    assert scalar(db, "select count(*) from orders") == 1
    with pytest.raises(flowly.RunNotFound):
        client.get(gone)


def test_async_start_with_conn_commits_or_rolls_back_with_the_caller(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    async def scenario() -> None:
        async with flowly.AsyncClient(dsn) as client:
            async with await psycopg.AsyncConnection.connect(dsn) as app:
                await client.start("quick", 1, run_id="async-rolled-back", conn=app)
                await app.rollback()
                await client.start("quick", 2, run_id="async-committed", conn=app)
                assert run_ids(db) == []
                await app.commit()

    asyncio.run(scenario())
    assert run_ids(db) == ["async-committed"]


def test_sql_start_commits_or_rolls_back_with_the_transaction(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    """``select flowly.start(...)`` in a transaction (or a savepoint) that rolls back leaves no
    run and sends no wake-up; one that commits leaves one and wakes the listeners once."""
    db.execute("listen flowly_wakeup")
    with psycopg.connect(dsn, autocommit=True) as app:
        app.execute("begin")
        app.execute("select flowly.start('quick', '1', run_id => 'sql-rolled-back')")
        app.execute("rollback")
        assert notifications(db) == []
        app.execute("begin")
        app.execute("select flowly.start('quick', '2', run_id => 'sql-committed')")
        app.execute("savepoint s")
        app.execute("select flowly.start('quick', '3', run_id => 'sql-savepoint')")
        app.execute("rollback to savepoint s")
        assert run_ids(db) == []
        app.execute("commit")
    assert run_ids(db) == ["sql-committed"]
    assert notifications(db) == [("flowly_wakeup", "default")]


@pytest.mark.parametrize("level", LEVELS)
def test_trigger_runs_commit_or_roll_back_with_the_insert(
        dsn: str, db: psycopg.Connection[Any], level: str) -> None:
    """The trigger's runs belong to the inserting transaction: a rollback (or a rolled-back
    savepoint) leaves neither the rows nor their runs, and wakes nobody."""
    db.execute("create table orders (id int primary key, sku text)")
    create_trigger(db, "orders", level, "process-order", "id")
    db.execute("listen flowly_wakeup")
    with psycopg.connect(dsn) as app:
        app.execute("insert into orders values (1, 'book'), (2, 'pen')")
        assert run_ids(db) == []
        app.rollback()
        assert notifications(db) == []
        app.execute("insert into orders values (3, 'ink')")
        with pytest.raises(RuntimeError), app.transaction():  # a savepoint, rolled back
            app.execute("insert into orders values (4, 'cup')")
            raise RuntimeError("roll the savepoint back")
        with app.transaction():  # a savepoint, released
            app.execute("insert into orders values (5, 'mug')")
        assert run_ids(db) == []
        app.commit()
    assert run_ids(db) == ["process-order:3", "process-order:5"]
    assert scalar(db, "select array_agg(id order by id) from orders") == [3, 5]
    assert notifications(db) == [("flowly_wakeup", "default")]


# --- start_trigger: one run per row --------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_one_insert_of_1000_rows_starts_1000_runs_with_one_wakeup(
        db: psycopg.Connection[Any], level: str) -> None:
    """1,000 rows in one INSERT start 1,000 runs, each with its row as input and the run id
    ``<workflow>:<key>``; the listeners get one NOTIFY for the whole statement."""
    db.execute("create table orders (id int primary key, sku text, qty int)")
    create_trigger(db, "orders", level, "process-order", "id")
    db.execute("listen flowly_wakeup")
    db.execute("insert into orders select g, 'sku-' || g, g % 7 from generate_series(1, 1000) g")
    found = runs(db)
    assert len(found) == 1000
    expected = sorted((f"process-order:{g}", "process-order", "default", 0, "pending",
                       {"id": g, "sku": f"sku-{g}", "qty": g % 7}) for g in range(1, 1001))
    assert found == expected
    assert notifications(db) == [("flowly_wakeup", "default")]
    # the public helper computes the same ids from the rows
    assert scalar(db, "select count(*) from orders o join flowly.runs r"
                      " on r.id = flowly.trigger_run_id('process-order', 'id', to_jsonb(o))"
                      " and r.input = to_jsonb(o)") == 1000


@pytest.mark.parametrize("level", LEVELS)
def test_an_insert_of_no_rows_starts_nothing_and_wakes_nobody(db: psycopg.Connection[Any],
                                                              level: str) -> None:
    db.execute("create table orders (id int primary key)")
    create_trigger(db, "orders", level, "process-order", "id")
    db.execute("listen flowly_wakeup")
    db.execute("insert into orders select g from generate_series(1, 10) g where false")
    assert run_ids(db) == [] and notifications(db) == []


@pytest.mark.parametrize("level", LEVELS)
def test_reinserting_the_same_keys_starts_nothing(db: psycopg.Connection[Any],
                                                  level: str) -> None:
    """Deleting the rows and inserting them again (a replayed or re-fired trigger) while their
    runs are live starts none; nor after the runs finished: a key starts one run, ever."""
    db.execute("create table orders (id int primary key, sku text)")
    create_trigger(db, "orders", level, "process-order", "id")
    db.execute("insert into orders select g, 'first' from generate_series(1, 1000) g")
    before = runs(db)
    db.execute("delete from orders")
    db.execute("listen flowly_wakeup")
    db.execute("insert into orders select g, 'second' from generate_series(1, 1000) g")
    assert runs(db) == before  # no new run, and the inputs are the first rows'
    assert notifications(db) == []  # nothing started, nobody woken
    db.execute("update flowly.runs set status = 'completed', finished_at = now()"
               " where id like 'process-order:1%'")
    db.execute("delete from orders")
    db.execute("insert into orders select g, 'third' from generate_series(1, 1001) g")
    assert len(run_ids(db)) == 1001  # only key 1001 is new
    assert scalar(db, "select input from flowly.runs where id = 'process-order:1001'") == {
        "id": 1001, "sku": "third"}


@pytest.mark.parametrize("level", LEVELS)
def test_duplicate_keys_within_one_statement_start_one_run(db: psycopg.Connection[Any],
                                                           level: str) -> None:
    """Key columns need not be unique: rows sharing a key in one INSERT start one run."""
    db.execute("create table events (order_id int, kind text)")
    create_trigger(db, "events", level, "order-events", "order_id")
    db.execute("insert into events values (1, 'a'), (1, 'b'), (2, 'c')")
    assert run_ids(db) == ["order-events:1", "order-events:2"]


@pytest.mark.parametrize("level", LEVELS)
def test_queue_and_priority_arguments(db: psycopg.Connection[Any], level: str) -> None:
    db.execute("create table orders (id int primary key)")
    create_trigger(db, "orders", level, "process-order", "id", "orders", "-5")
    db.execute("listen flowly_wakeup")
    db.execute("insert into orders values (1), (2)")
    assert [(r[0], r[2], r[3]) for r in runs(db)] == [
        ("process-order:1", "orders", -5), ("process-order:2", "orders", -5)]
    assert notifications(db) == [("flowly_wakeup", "orders")]
    db.execute("create table refunds (id int primary key)")
    create_trigger(db, "refunds", level, "refund", "id", "refunds")
    db.execute("insert into refunds values (1)")
    assert scalar(db, "select queue || '/' || priority from flowly.runs"
                      " where id = 'refund:1'") == "refunds/0"


@pytest.mark.parametrize("level", LEVELS)
def test_composite_and_quoted_key_columns(db: psycopg.Connection[Any], level: str) -> None:
    """'tenant_id,id' gives ``<workflow>:<tenant_id>,<id>``; a comma or backslash inside a
    value is escaped with a backslash, so different keys never share an id; quoted names
    keep their case and may hold commas; unquoted ones fold to lower case, as in SQL."""
    db.execute('create table lines (tenant_id text, id int, "Line, No" int, note text)')
    create_trigger(db, "lines", level, "bill", ' Tenant_ID , id,"Line, No" ')
    db.execute("""insert into lines values ('acme', 42, 1, 'x'), ('a,b', 1, 2, 'y'),
                  ('a', 1, 2, 'z'), ('a\\b', 1, 2, 'w')""")
    assert run_ids(db) == ["bill:a,1,2", "bill:a\\,b,1,2", "bill:a\\\\b,1,2", "bill:acme,42,1"]
    assert scalar(db, "select input from flowly.runs where id = 'bill:a\\,b,1,2'") == {
        "tenant_id": "a,b", "id": 1, "Line, No": 2, "note": "y"}


@pytest.mark.parametrize("level", LEVELS)
def test_key_types_render_the_same_in_every_session(db: psycopg.Connection[Any],
                                                    level: str) -> None:
    """A timestamptz, float or interval key gives the same run id whatever the inserting
    session's TimeZone, DateStyle, IntervalStyle or extra_float_digits."""
    db.execute("create table readings (device uuid, at timestamptz, v float8, span interval)")
    create_trigger(db, "readings", level, "reading", "device,at,v,span")
    db.execute("set timezone = 'Asia/Kolkata'; set intervalstyle = 'iso_8601';"
               " set extra_float_digits = 3")
    db.execute("insert into readings values ('6f1c0cd5-2a39-4b8e-9d4e-3c6f7d0e2a11',"
               " '2026-01-02 03:04:05+00', 0.1, '1 day 2 hours')")
    first = run_ids(db)
    db.execute("delete from readings")
    db.execute("set timezone = 'America/New_York'; set intervalstyle = 'sql_standard';"
               " set extra_float_digits = 0; set datestyle = 'German'")
    db.execute("insert into readings values ('6f1c0cd5-2a39-4b8e-9d4e-3c6f7d0e2a11',"
               " '2026-01-02 03:04:05+00', 0.1, '1 day 2 hours')")
    assert run_ids(db) == first == [
        "reading:6f1c0cd5-2a39-4b8e-9d4e-3c6f7d0e2a11,2026-01-02T03:04:05+00:00,0.1,"
        "1 day 02:00:00"]
    # trigger_run_id renders the row the same way, whatever the session's settings
    assert scalar(db, "select flowly.trigger_run_id('reading', 'device,at,v,span', r)"
                      " from readings r") == first[0]


@pytest.mark.parametrize("level", LEVELS)
def test_a_null_key_fails_the_insert_naming_the_column(db: psycopg.Connection[Any],
                                                       level: str) -> None:
    db.execute("create table lines (tenant_id text, id int)")
    create_trigger(db, "lines", level, "bill", "tenant_id,id")
    with pytest.raises(psycopg.Error) as failed:
        db.execute("insert into lines values ('acme', 1), ('acme', null)")
    assert failed.value.sqlstate == "WF003"
    message = str(failed.value)
    assert 'key column "id" is null' in message and "public.lines" in message, message
    assert run_ids(db) == [] and scalar(db, "select count(*) from lines") == 0


@pytest.mark.parametrize("level", LEVELS)
def test_a_key_column_the_table_lacks_fails_the_insert(db: psycopg.Connection[Any],
                                                       level: str) -> None:
    db.execute("create table orders (id int)")
    create_trigger(db, "orders", level, "process-order", "order_id")
    with pytest.raises(psycopg.Error) as failed:
        db.execute("insert into orders values (1)")
    assert failed.value.sqlstate == "WF003"
    assert 'has no column "order_id"' in str(failed.value), str(failed.value)
    assert run_ids(db) == []


@pytest.mark.parametrize("level", LEVELS)
def test_a_key_too_long_for_a_run_id_gets_a_digest(db: psycopg.Connection[Any],
                                                   level: str) -> None:
    """A run id over flowly's 1,000-byte limit becomes ``<workflow>:sha256:<hex>``, the
    SHA-256 of the UTF-8 key part, so the row goes in and a replay still finds its run."""
    db.execute("create table docs (path text primary key)")
    create_trigger(db, "docs", level, "index-doc", "path")
    long_key = "é/" * 500  # 1,500 bytes
    short_key = "a" * (1000 - len("index-doc:"))  # exactly 1,000 bytes of id: kept as is
    db.execute("insert into docs values (%s), (%s)", (long_key, short_key))
    digest = hashlib.sha256(long_key.encode()).hexdigest()
    assert run_ids(db) == [f"index-doc:{short_key}", f"index-doc:sha256:{digest}"]
    db.execute("delete from docs")
    db.execute("insert into docs values (%s)", (long_key,))
    assert len(run_ids(db)) == 2
    assert scalar(db, "select flowly.trigger_run_id('index-doc', 'path', %s)",
                  psycopg.types.json.Jsonb({"path": long_key})) == f"index-doc:sha256:{digest}"


@pytest.mark.parametrize("level", LEVELS)
def test_a_workflow_name_too_long_for_digest_ids_is_refused(db: psycopg.Connection[Any],
                                                            level: str) -> None:
    """A key that needs a digest under a workflow name so long that even the digest id passes
    1,000 bytes: WF003 saying so (a short key under the same name still works)."""
    db.execute("create table docs (path text primary key)")
    create_trigger(db, "docs", level, "w" * 990, "path")
    db.execute("insert into docs values ('a')")
    with pytest.raises(psycopg.Error) as failed:
        db.execute("insert into docs values (%s)", ("b" * 20,))
    assert failed.value.sqlstate == "WF003"
    assert "too long to make run ids from keys" in str(failed.value), str(failed.value)
    assert run_ids(db) == ["w" * 990 + ":a"]


@pytest.mark.parametrize(("call", "message"), [
    ("flowly.key_run_id('bill', null, '{\"id\": 1}', 'psql')",
     "psql: key columns must be a non-empty list of column names, got null"),
    ("flowly.key_run_id('bill', '{}', '{\"id\": 1}', 'psql')",
     "psql: key columns must be a non-empty list of column names, got {}"),
    ("flowly.key_run_id('bill', array[null], '{\"id\": 1}', 'psql')",
     "psql: key columns must be a non-empty list of column names, got {NULL}"),
    ("flowly.key_run_id(null, array['id'], '{\"id\": 1}', 'psql')",
     "psql: workflow must not be null"),
    ("flowly.key_run_id('bill', array['id'], null, 'psql')", "psql: input must not be null"),
    ("flowly.key_run_id('bill', array['id'], '{}', null)",
     'key_run_id: the row has no column "id"'),
    ("flowly.trigger_run_id(null, 'f1', row(1))", "trigger_run_id: workflow must not be null"),
    ("flowly.trigger_run_id('bill', 'id', null::int)", "trigger_run_id: input must not be null"),
])
def test_a_run_id_asked_for_with_a_null_argument_is_refused_naming_it(
        db: psycopg.Connection[Any], call: str, message: str) -> None:
    """key_run_id (which trigger_run_id calls, and callers may call) failed with a raw 22004
    ("FOREACH expression must not be null") for a NULL column list, returned a NULL id for a
    NULL workflow or an empty list, and blamed a column for a NULL input. Each is WF003 that
    names the argument, prefixed with the caller's name (key_run_id's own if it gives none)."""
    with pytest.raises(psycopg.Error) as refused:
        db.execute(f"select {call}")
    assert refused.value.sqlstate == "WF003", refused.value
    assert str(refused.value).startswith(message), refused.value


@pytest.mark.parametrize("level", LEVELS)
def test_a_row_whose_json_cannot_be_built_fails_the_insert(db: psycopg.Connection[Any],
                                                           level: str) -> None:
    """A json column holding \\u0000 cannot become jsonb: the INSERT fails with an error that
    names the table, the row's key and the cause; no row and no run is left."""
    db.execute("create table orders (id int primary key, payload json)")
    create_trigger(db, "orders", level, "process-order", "id")
    with pytest.raises(psycopg.Error) as failed:
        db.execute("""insert into orders values (1, '{"ok": true}'), (2, '{"bad": "\\u0000"}')""")
    message = str(failed.value)
    assert "public.orders" in message and "id=2" in message, message
    assert "to_jsonb" in message and "\\u0000" in message, message
    assert failed.value.sqlstate == "22P05"  # the cause's own SQLSTATE (untranslatable)
    assert run_ids(db) == [] and scalar(db, "select count(*) from orders") == 0


@pytest.mark.parametrize("args, problem", [
    ((), "takes 2 to 4 arguments"),
    (("process-order",), "takes 2 to 4 arguments"),
    (("process-order", "id", "q", "1", "extra"), "takes 2 to 4 arguments"),
    (("process-order", "id", "default", "high"), "priority must be an integer"),
    (("process-order", "id", "default", "99999999999"), "priority must be an integer"),
    (("process-order", ""), "at least one column"),
    (("process-order", "id,,sku"), "empty"),
    (("process-order", "id,id"), "more than once"),
    (("process-order", 'id,"sku'), "unbalanced"),
    (("process-order", "order id"), "quote"),
    (("", "id"), "workflow must be a non-empty text"),
    (("process-order", "id", ""), "queue must be a non-empty text"),
])
def test_bad_trigger_arguments_fail_with_wf003(db: psycopg.Connection[Any], args: tuple[str],
                                               problem: str) -> None:
    db.execute('create table orders (id int primary key, sku text, "order id" int)')
    create_trigger(db, "orders", "row", *args)
    with pytest.raises(psycopg.Error) as failed:
        db.execute("insert into orders values (1, 'x', 1)")
    assert failed.value.sqlstate == "WF003", failed.value
    assert problem in str(failed.value), str(failed.value)
    assert run_ids(db) == []


@pytest.mark.parametrize("when, event, level, problem", [
    ("before", "insert", "row", "an AFTER trigger"),
    ("after", "delete", "row", "INSERT or UPDATE"),
    ("after", "delete", "statement", "INSERT or UPDATE"),
])
def test_misplaced_triggers_fail_with_wf003(db: psycopg.Connection[Any], when: str,
                                            event: str, level: str, problem: str) -> None:
    db.execute("create table orders (id int primary key)")
    db.execute("insert into orders values (1)")
    if level == "statement":
        db.execute("create trigger enqueue after delete on orders referencing old table as o"
                   " for each statement execute function flowly.start_trigger('wf', 'id')")
    else:
        create_trigger(db, "orders", level, "wf", "id", when=when, event=event)
    with pytest.raises(psycopg.Error) as failed:
        db.execute("insert into orders values (2)" if event == "insert"
                   else "delete from orders")
    assert failed.value.sqlstate == "WF003"
    assert problem in str(failed.value), str(failed.value)


@pytest.mark.parametrize("level", LEVELS)
def test_other_errors_pass_through_unchanged(db: psycopg.Connection[Any], level: str) -> None:
    """An error that is not about the row's JSON (here: a trigger on flowly.runs) fails the
    INSERT with its own SQLSTATE and message."""
    db.execute("create table orders (id int primary key)")
    create_trigger(db, "orders", level, "process-order", "id")
    db.execute("""
        create function public.refuse() returns trigger language plpgsql as $$
        begin raise exception 'runs are closed today' using errcode = '55000'; end $$;
        create trigger refuse before insert on flowly.runs
            for each row execute function public.refuse();""")
    with pytest.raises(psycopg.Error) as failed:
        db.execute("insert into orders values (1)")
    assert failed.value.sqlstate == "55000"
    assert str(failed.value).startswith("runs are closed today"), str(failed.value)


def test_a_statement_trigger_without_its_transition_table_says_what_to_add(
        db: psycopg.Connection[Any]) -> None:
    db.execute("create table orders (id int primary key)")
    db.execute("create trigger enqueue after insert on orders for each statement"
               " execute function flowly.start_trigger('process-order', 'id')")
    with pytest.raises(psycopg.Error) as failed:
        db.execute("insert into orders values (1)")
    assert failed.value.sqlstate == "WF003"
    assert "referencing new table as" in str(failed.value), str(failed.value)


@pytest.mark.parametrize("name", ['"Fresh"', "runs", "pg_trigger", "t", "n"])
@pytest.mark.parametrize("level", LEVELS)
def test_any_transition_table_name_works(db: psycopg.Connection[Any], level: str,
                                         name: str) -> None:
    """The trigger finds its transition table by the name create trigger gave it, even one
    that shadows a table it reads or writes (a row trigger may have one too)."""
    db.execute("create table orders (id int primary key)")
    db.execute(f"create trigger enqueue after insert on orders referencing new table as {name}"
               f" for each {level} execute function flowly.start_trigger('process-order', 'id')")
    db.execute("insert into orders values (1), (2)")
    assert run_ids(db) == ["process-order:1", "process-order:2"]


@pytest.mark.parametrize("level", LEVELS)
def test_update_trigger_starts_runs_for_new_keys_only(db: psycopg.Connection[Any],
                                                      level: str) -> None:
    """On UPDATE the new row is the input; a key that already started a run starts none."""
    db.execute("create table orders (id int primary key, status text)")
    create_trigger(db, "orders", level, "ship", "id", event="update")
    db.execute("insert into orders values (1, 'new'), (2, 'new')")
    assert run_ids(db) == []
    db.execute("update orders set status = 'paid' where id = 1")
    db.execute("update orders set status = 'paid again'")
    assert runs(db) == [
        ("ship:1", "ship", "default", 0, "pending", {"id": 1, "status": "paid"}),
        ("ship:2", "ship", "default", 0, "pending", {"id": 2, "status": "paid again"})]


@pytest.mark.parametrize("level", LEVELS)
def test_a_partitioned_table(db: psycopg.Connection[Any], level: str) -> None:
    """On a partitioned table the trigger starts one run per row whatever the partition."""
    db.execute("create table orders (id int primary key, region text) partition by list (id)")
    db.execute("create table orders_low partition of orders for values in (1, 2)")
    db.execute("create table orders_high partition of orders default")
    create_trigger(db, "orders", level, "process-order", "id")
    db.execute("insert into orders values (1, 'eu'), (2, 'us'), (3, 'eu')")
    assert run_ids(db) == ["process-order:1", "process-order:2", "process-order:3"]


@pytest.mark.parametrize("level", LEVELS)
def test_a_key_started_after_a_repeatable_read_snapshot_is_a_serialization_failure(
        dsn: str, db: psycopg.Connection[Any], level: str) -> None:
    """Under REPEATABLE READ the trigger cannot see a run for the same key committed after the
    snapshot, so it cannot return it: the INSERT fails with 40001 (retry the transaction),
    never a duplicate or a unique violation; the retry starts nothing new."""
    db.execute("create table orders (id int primary key)")
    create_trigger(db, "orders", level, "process-order", "id")
    with psycopg.connect(dsn) as app:
        app.execute("set transaction isolation level repeatable read")
        app.execute("select 1 from orders")  # takes the snapshot
        db.execute("select flowly.start('process-order', run_id => 'process-order:1')")
        with pytest.raises(psycopg.errors.SerializationFailure):
            app.execute("insert into orders values (1)")
        app.rollback()
        app.execute("set transaction isolation level repeatable read")
        app.execute("insert into orders values (1)")
        app.commit()
    assert run_ids(db) == ["process-order:1"]
    assert scalar(db, "select input from flowly.runs") is None


def test_trigger_runs_complete_under_a_worker(dsn: str, client: flowly.Client,
                                              db: psycopg.Connection[Any]) -> None:
    db.execute("create table orders (id int primary key, sku text)")
    create_trigger(db, "orders", "statement", "quick", "id")
    db.execute("insert into orders values (1, 'book'), (2, 'pen')")
    with running_worker(dsn):
        done = [client.wait(run_id, timeout=30) for run_id in ("quick:1", "quick:2")]
    assert [(r.status, r.output) for r in done] == [
        ("completed", {"input": {"id": 1, "sku": "book"}, "total": 3}),
        ("completed", {"input": {"id": 2, "sku": "pen"}, "total": 3})]


# --- least privilege ------------------------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_start_trigger_under_least_privilege_roles(dsn: str, db: psycopg.Connection[Any],
                                                   level: str) -> None:
    """With ``setup_roles`` (flowly's functions run with their owner's rights, PUBLIC may not
    call them): an application role with INSERT on the table and no right on flowly at all
    starts runs through a trigger the table's owner created; the role cannot create such a
    trigger itself, nor write flowly's tables."""
    tag = f"{os.getpid()}_{level}"
    worker, reader, app = f"ft_worker_{tag}", f"ft_reader_{tag}", f"ft_app_{tag}"
    try:
        setup_roles(db, worker=worker, reader=reader)
    except psycopg.errors.InsufficientPrivilege:
        pytest.skip("the test database's user may not create roles")
    try:
        db.execute(sql.SQL("create role {} login").format(sql.Identifier(app)))
        db.execute("create table orders (id int primary key, sku text)")
        create_trigger(db, "orders", level, "process-order", "id")
        db.execute(sql.SQL("grant insert on orders to {app}; grant create on schema public"
                           " to {app}").format(app=sql.Identifier(app)))
        with psycopg.connect(make_conninfo(dsn, user=app), autocommit=True) as conn:
            conn.execute("insert into orders values (1, 'book'), (2, 'pen')")
            conn.execute("create table mine (id int)")
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                create_trigger(conn, "mine", level, "process-order", "id")
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("insert into flowly.runs (id, workflow) values ('x', 'y')")
        assert run_ids(db) == ["process-order:1", "process-order:2"]
    finally:
        for role in (app, worker, reader):
            db.execute(sql.SQL("drop owned by {} cascade").format(sql.Identifier(role)))
            db.execute(sql.SQL("drop role if exists {}").format(sql.Identifier(role)))


# --- other schemas and search_paths --------------------------------------------------------

@pytest.mark.parametrize("schema", ['my "odd" schema', "other schema"])
@pytest.mark.parametrize("level", LEVELS)
def test_start_and_start_trigger_in_a_non_default_schema(empty_dsn: str, schema: str,
                                                          level: str) -> None:
    """flowly installed in a schema with a space or quotes in its name: start and
    start_trigger work through the quoted name, from a table in another schema, for a
    session whose search_path holds look-alikes (runs, start, check_name...) that must not be
    used; the wake-up goes to that schema's channel."""
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        install(conn, schema)
        s = sql.Identifier(schema)
        conn.execute("create schema app")
        conn.execute("create table app.runs (id text, note text)")  # a look-alike
        for name in ("start", "insert_run", "check_name", "trigger_key_columns",
                     "trigger_run_id"):
            conn.execute(sql.SQL(
                "create function app.{}() returns void language plpgsql"
                " as $$ begin raise exception 'hijacked'; end $$").format(sql.Identifier(name)))
        conn.execute("set search_path = app")
        conn.execute("create table orders (id int primary key, sku text)")
        create_trigger(conn, "orders", level, "process-order", "id", schema=schema)
        channel = one(conn, sql.SQL("select {}.wakeup_channel()").format(s))
        conn.execute(sql.SQL("listen {}").format(sql.Identifier(channel)))
        conn.execute("insert into orders values (1, 'book')")
        started = one(conn, sql.SQL("select {}.start('quick', '{{\"n\": 1}}',"
                                    " run_id => 'by-hand')").format(s))
        assert started == "by-hand"
        assert runs(conn, schema) == [
            ("by-hand", "quick", "default", 0, "pending", {"n": 1}),
            ("process-order:1", "process-order", "default", 0, "pending",
             {"id": 1, "sku": "book"})]
        assert scalar(conn, "select count(*) from app.runs") == 0
        assert {n for n in notifications(conn)} == {(channel, "default")}


def test_row_and_statement_triggers_agree(db: psycopg.Connection[Any]) -> None:
    """The two levels give the same runs for the same rows (ids, inputs, queue, priority)."""
    found = {}
    for level in LEVELS:
        db.execute("truncate flowly.runs cascade")
        db.execute(f"create table t_{level} (a text, b int, c jsonb, d timestamptz)")
        create_trigger(db, f"t_{level}", level, "same", "a,b", "q", "3")
        db.execute(f"""insert into t_{level} select 'k' || g % 10, g, jsonb_build_object('g', g),
                       '2026-01-01'::timestamptz + g * interval '1 hour'
                       from generate_series(1, 200) g""")
        found[level] = runs(db)
    assert found["row"] == found["statement"] and len(found["row"]) == 200


def test_bulk_insert_is_not_slow(db: psycopg.Connection[Any]) -> None:
    """10,000 rows in one INSERT: with the statement trigger well under 10 s on a busy test
    machine (bench/trigger_insert.py measures properly; this only catches a collapse)."""
    db.execute("create table orders (id int primary key, sku text)")
    create_trigger(db, "orders", "statement", "process-order", "id")
    started = time.monotonic()
    db.execute("insert into orders select g, 'sku' from generate_series(1, 10000) g")
    assert time.monotonic() - started < 10
    assert scalar(db, "select count(*) from flowly.runs") == 10000


def test_readme_other_schema_example_runs(empty_dsn: str) -> None:
    """The README's ```sql other-schema block (test_readme runs the plain ```sql blocks against
    schema "flowly") works against flowly installed in schema "my app"."""
    readme = (ROOT / "README.md").read_text()
    [block] = re.findall(r"```sql other-schema\n(.*?)```", readme, re.DOTALL)
    assert "installed with: flowly install --schema 'my app'" in block
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        install(conn, "my app")
        conn.execute("create table orders (id int primary key, sku text)")
        conn.execute(block)
        conn.execute("insert into orders values (7, 'book'), (8, 'pen')")
        assert run_ids(conn, "my app") == ["order-1002", "order:7", "order:8"]
