"""Installation and upgrade, least-privilege roles, the command line and top, attacked: what a
role may do through flowly's functions, names that reach psql, bad options and arguments."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

import flowly
from flowly.schema import install, installed_versions, migrations, setup_roles
from tests import workflows as _workflows  # noqa: F401  (registers the test workflows)
from tests.support import READER, WORKER, running_worker, wait_for
from tests.test_cli import flowly as flowly_cli
from tests.test_cli import ok, one_error_line

requires_psql = pytest.mark.skipif(shutil.which("psql") is None, reason="needs psql")


# A type of the caller's own whose cast to json is the caller's code: to_jsonb calls it.
_HOSTILE_TYPE = """
create type pg_temp.sneaky as enum ('x');
create function pg_temp.sneaky_json(pg_temp.sneaky) returns json language plpgsql as $$
begin
    -- what only the schema's owner may do: the worker role has no DELETE on runs
    delete from {schema}.runs;
    return to_json(current_user::text);
end $$;
create cast (pg_temp.sneaky as json) with function pg_temp.sneaky_json(pg_temp.sneaky);
"""


def test_the_worker_role_cannot_run_its_code_as_the_owner_through_trigger_run_id(
        roles: tuple[str, str], db: psycopg.Connection[Any]) -> None:
    """README, Least privilege: the worker role may call flowly's functions "and nothing
    else; it has no INSERT, UPDATE or DELETE on any flowly table". trigger_run_id is made
    SECURITY DEFINER by apply_roles and calls to_jsonb on a value of any type the caller
    chooses, which runs the type's cast to json with the owner's rights."""
    worker_dsn, _ = roles
    victim = db.execute("select flowly.start('quick', run_id => 'victim')").fetchone()[0]
    login = conninfo_to_dict(worker_dsn)["user"]
    with psycopg.connect(worker_dsn, autocommit=True) as conn:
        conn.execute(_HOSTILE_TYPE.format(schema="flowly"))
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("delete from flowly.runs")  # the direct way is refused
        seen_as = None
        try:
            seen_as = conn.execute(
                "select flowly.trigger_run_id('wf', 'k', t) from"
                " (select 1 as k, 'x'::pg_temp.sneaky as s) t").fetchone()[0]
        except psycopg.errors.InsufficientPrivilege:
            pass  # the cast ran with the caller's own rights: what least privilege means
    assert db.execute("select count(*) from flowly.runs where id = %s",
                      (victim,)).fetchone() == (1,), (
        f"the worker role's cast deleted every run, running as the owner ({seen_as})")
    assert seen_as is None or login in seen_as


def test_the_worker_role_cannot_run_its_code_as_the_owner_through_start_trigger(
        roles: tuple[str, str], db: psycopg.Connection[Any]) -> None:
    """The same through start_trigger, which README lets the worker role attach: a row whose
    column has the caller's type runs the caller's cast as the owner (a superuser, typically:
    `alter role ... superuser` works the same way)."""
    worker_dsn, _ = roles
    victim = db.execute("select flowly.start('quick', run_id => 'victim')").fetchone()[0]
    with psycopg.connect(worker_dsn, autocommit=True) as conn:
        conn.execute(_HOSTILE_TYPE.format(schema="flowly"))
        conn.execute("create temporary table orders (id int, s pg_temp.sneaky)")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):  # only the owner attaches it
            conn.execute("create trigger orders_start after insert on orders for each row"
                         " execute function flowly.start_trigger('quick', 'id')")
    assert db.execute("select count(*) from flowly.runs where id = %s",
                      (victim,)).fetchone() == (1,), (
        "a row inserted by the worker role ran its cast as the owner and deleted every run")


# -- the install script printed for psql ----------------------------------------------------


@pytest.mark.parametrize("command", [["install", "--print-sql"], ["install"]])
def test_a_schema_name_with_a_control_character_is_refused(
        empty_dsn: str, command: list[str]) -> None:
    """`install --print-sql --schema` writes the name into a psql `\\set` line: a newline in
    it would end the meta-command, and psql would run the rest of the name as SQL. Names
    with control characters are refused (exit 2, one line), by every command alike."""
    schema = "x\ncreate table public.injected_by_the_schema_name (); --"
    result = flowly_cli(*command, "--schema", schema, dsn=empty_dsn)
    assert "contains a control character" in one_error_line(result, 2)
    assert result.stdout == ""
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert installed_versions(conn, schema) == []


# -- worker options on the command line ------------------------------------------------------


@pytest.mark.parametrize("option, value", [
    ("lease", 0), ("lease", -1), ("lease", math.nan), ("lease", 86_401), ("lease", 1e13),
    ("poll_interval", -1),
    ("poll_interval", math.nan), ("drain_timeout", -1),
])
def test_worker_refuses_unusable_durations(dsn: str, option: str, value: float) -> None:
    """Worker refuses concurrency 0 and max_connections 1 with ValueError (the CLI's exit 2),
    but takes a lease of 0, negative or NaN and starts, to fail every heartbeat forever."""
    with pytest.raises(ValueError, match=option.split("_")[0]):
        flowly.Worker(dsn, ["quick"], **{option: value})


@pytest.mark.parametrize("worker_id", ["", "  ", "a\x00b"])
def test_worker_refuses_a_worker_id_that_names_nothing(dsn: str, worker_id: str) -> None:
    with pytest.raises(ValueError, match="worker_id"):
        flowly.Worker(dsn, ["quick"], worker_id=worker_id)


@pytest.mark.parametrize("call", [
    "flowly.register_worker('huge', array['quick'], array['default'], '115740740 days')",
    "flowly.register_worker('', array['quick'], array['default'], '30 seconds')",
    "flowly.register_worker(null, array['quick'], array['default'], '30 seconds')",
    "flowly.claim('huge', array['quick'], array['default'], 1, '115740740 days')",
    "flowly.heartbeat('huge', array['r'], array[1]::bigint[], '115740740 days')",
])
def test_a_lease_beyond_a_day_or_a_nameless_worker_is_refused(
    db: psycopg.Connection[Any], call: str
) -> None:
    """A worker registered with a lease of 10^13 s (a unit mistake) made `last_seen_at +
    lease` overflow: every other worker's claims (their sweep asks which workers are alive)
    and the live_workers view failed. Refused with WF003; a healthy worker still claims."""
    db.execute("select flowly.start('quick', run_id => 'r')")
    with pytest.raises(psycopg.Error) as refused:
        db.execute(f"select * from {call}")
    assert refused.value.sqlstate == "WF003", refused.value
    assert "lease" in str(refused.value) or "worker" in str(refused.value)
    db.execute("select flowly.register_worker('ok', array['quick'], array['default'],"
               " '30 seconds')")
    assert db.execute("select run_id from flowly.claim('ok', array['quick'], array['default'],"
                      " 1, '30 seconds')").fetchall() == [("r",)]
    assert db.execute("select worker from flowly.live_workers").fetchall() == [("ok",)]


def test_worker_command_with_a_zero_lease_exits_2(dsn: str) -> None:
    """README: bad input exits non-zero with a one-line error, 2 for a bad invocation.
    `flowly worker --lease 0` starts and logs "heartbeat failed: lease must be a positive
    interval" forever instead."""
    try:
        result = flowly_cli("worker", "--app", "examples.order", "--lease", "0", dsn=dsn,
                            timeout=15)
    except subprocess.TimeoutExpired:
        pytest.fail("flowly worker --lease 0 was still running after 15 s")
    one_error_line(result, 2)


# -- run id prefixes -------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["cancel", "show", "send-event"])
def test_an_empty_run_id_is_a_bad_invocation(dsn: str, db: psycopg.Connection[Any],
                                             command: str) -> None:
    """`RUN is a run id or a unique prefix of one`: the empty string is a prefix of every id,
    so with one run in the database `flowly cancel ""` (an unset shell variable) cancels it."""
    run_id = db.execute("select flowly.start('quick', run_id => 'only-run',"
                        " scheduled_for => now() + interval '1 hour')").fetchone()[0]
    args = [command, ""] + (["ev"] if command == "send-event" else [])
    result = flowly_cli(*args, dsn=dsn)
    assert result.returncode != 0, f"{command} '' acted on {run_id}: {result.stdout}"
    assert db.execute("select status from flowly.runs where id = %s",
                      (run_id,)).fetchone() == ("pending",)
    assert db.execute("select count(*) from flowly.events").fetchone() == (0,)


# -- upgrade with runs in flight -------------------------------------------------------------


def test_upgrade_from_an_old_migration_with_runs_in_flight(
        empty_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs started, finished and dead-lettered under migration 3 survive the upgrade: the
    counters added by 0004 count the runs finished before, and the pending ones complete."""
    monkeypatch.setenv("FLOWLY_DSN", empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert install(conn, target=3) == [1, 2, 3]
        from tests.workflows import EFFECTS_TABLE
        conn.execute(EFFECTS_TABLE)
        pending = [conn.execute("select flowly.start(%s, %s)", (wf, "{}")).fetchone()[0]
                   for wf in ("quick", "three_steps", "mailing")]
        cancelled = conn.execute("select flowly.start('quick')").fetchone()[0]
        conn.execute("select flowly.cancel(%s)", (cancelled,))
        later = conn.execute("select flowly.start('quick', scheduled_for => now()"
                             " + interval '1 second')").fetchone()[0]
        applied = install(conn)
        assert applied == [m.version for m in migrations()][3:]
        counts = dict(((w, s), n) for w, s, n in conn.execute(
            "select workflow, status, runs from flowly.run_counts"))
        assert counts == {("quick", "cancelled"): 1, ("quick", "pending"): 2,
                          ("three_steps", "pending"): 1, ("mailing", "pending"): 1}
    with running_worker(empty_dsn, queues=("default", "emails")), \
            psycopg.connect(empty_dsn, autocommit=True) as conn:
        def done() -> bool:
            return conn.execute("select count(*) from flowly.runs where status = 'completed'"
                                ).fetchone()[0] == len(pending) + 2
        wait_for(done, timeout=30, what="the runs started before the upgrade to complete")
        statuses = dict(conn.execute("select id, status from flowly.runs"))
        assert statuses[later] == "completed" and statuses[cancelled] == "cancelled"


@requires_psql
def test_psql_upgrade_of_a_schema_with_roles_gives_them_the_new_functions(
        empty_dsn: str) -> None:
    """Roles set up at migration 10, upgraded with psql -f install.sql: the worker role may
    call what 0011-0019 added (undone_steps, 0019) and the reader read what they added
    (missed_wakeups, 0014); PUBLIC may call none of it."""
    from tests.test_schema import run_psql
    worker, reader = f"{WORKER}_u", f"{READER}_u"
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        install(conn, target=10)
        try:
            setup_roles(conn, worker=worker, reader=reader)
        except psycopg.errors.InsufficientPrivilege:
            pytest.skip("the test database's user may not create roles")
        try:
            run_psql(empty_dsn)
            assert installed_versions(conn) == [m.version for m in migrations()]
            newest = conn.execute(
                "select p.oid::regprocedure::text from pg_proc p"
                " where p.pronamespace = 'flowly'::regnamespace and p.proname = 'undone_steps'"
            ).fetchone()[0]
            rights = conn.execute(
                "select has_function_privilege(%s, %s, 'execute'),"
                " has_function_privilege(%s, %s, 'execute'),"
                " has_function_privilege('public', %s, 'execute'),"
                " has_table_privilege(%s, 'flowly.missed_wakeups', 'select'),"
                " (select prosecdef from pg_proc where oid = %s::regprocedure)",
                (worker, newest, reader, newest, newest, reader, newest)).fetchone()
            assert rights == (True, False, False, True, True)
        finally:
            for role in (worker, reader):
                conn.execute(sql.SQL("drop owned by {} cascade").format(sql.Identifier(role)))
                conn.execute(sql.SQL("drop role {}").format(sql.Identifier(role)))


# -- the reader role and the worker role after every migration --------------------------------


def test_the_reader_role_can_use_every_read_command_and_top(
        roles: tuple[str, str], db: psycopg.Connection[Any]) -> None:
    """README: flowly_reader is for dashboards; `flowly top` is one. Every read command works
    with it (install only reads an up-to-date schema)."""
    _, reader_dsn = roles
    run_id = db.execute("select flowly.start('quick')").fetchone()[0]
    frame = json.loads(ok(flowly_cli("--json", "top", "--once", dsn=reader_dsn)))
    assert frame["statuses"]["pending"]["runs"] == 1
    for args in (["runs"], ["show", run_id], ["dead-letters"], ["schedules"], ["install"]):
        ok(flowly_cli(*args, dsn=reader_dsn))
    one_error_line(flowly_cli("cancel", run_id, dsn=reader_dsn), 1)


def test_the_worker_role_uses_events_children_and_purge(
        roles: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """What a worker and a client do after every migration, as the worker role: a child run
    (0009, 0015), an event sent to a run (0014), schedules ticked, a purge (0015)."""
    worker_dsn, _ = roles
    monkeypatch.setenv("FLOWLY_DSN", worker_dsn)
    with flowly.Client(worker_dsn) as client, running_worker(worker_dsn):
        parent = client.start("mailing", None)
        assert client.wait(parent, timeout=30).status == "completed"
        with psycopg.connect(worker_dsn, autocommit=True) as conn:
            conn.execute("select flowly.schedule('atk', '* * * * *', 'quick')")
            later = client.start("quick", None, delay=3600)
            conn.execute("select flowly.send_event(%s, 'ev', '1')", (later,))
            conn.execute("select flowly.unschedule('atk')")
            client.cancel(later)
        time.sleep(0.2)
        assert client.purge(timedelta(0)) >= 1


# -- top at scale ------------------------------------------------------------------------------


def test_top_does_not_read_every_dead_letter(db: psycopg.Connection[Any], dsn: str) -> None:
    """README: the dashboard views "stay fast at millions of runs", and `flowly top` is built
    on them. top's dead-letter panel orders the dead_letters view by finished_at, which no
    index serves: every refresh reads every dead-lettered run (here a sequential scan of the
    whole runs table) to show 10 of them."""
    from flowly.top import snapshot
    db.execute("""
        insert into flowly.runs (id, workflow, status, created_at, finished_at, error)
        select 'old-' || g, 'wf', case when g % 2 = 0 then 'dead_letter' else 'completed' end,
               now() - interval '2 days' - g * interval '1 second',
               now() - interval '2 days' - g * interval '1 second',
               case when g % 2 = 0 then '{"step": "s", "message": "boom"}'::jsonb end
        from generate_series(1, 40000) g""")
    db.execute("select flowly.fold_run_counts()")
    db.execute("analyze flowly.runs")
    with psycopg.connect(dsn, autocommit=True) as conn:
        snapshot(conn)  # warm the catalog caches
        reads = ("select sum(heap_blks_hit + heap_blks_read + idx_blks_hit + idx_blks_read)"
                 " from pg_statio_user_tables where relid = 'flowly.runs'::regclass")
        db.execute("select pg_stat_force_next_flush()")
        before = db.execute(reads).fetchone()[0]
        frame = snapshot(conn)
        conn.execute("select pg_stat_force_next_flush()")
        after = db.execute(reads).fetchone()[0]
    assert len(frame["dead_letters"]) == 10
    total = db.execute("select pg_relation_size('flowly.runs') / 8192").fetchone()[0]
    assert after - before < 200, f"one frame of top read {after - before} pages of runs" \
                                 f" (the table has {total})"


@pytest.mark.parametrize("statement", ["delete from flowly.settings",
                                       "truncate flowly.settings"])
def test_the_settings_row_cannot_be_deleted_only_changed(
    db: psycopg.Connection[Any], statement: str
) -> None:
    """`flowly.settings` holds one row (max_takeovers, the roles setup_roles made). Deleted
    (an operator resetting it), max_takeovers() read NULL and turned poison-run detection
    off without a word, and the roles' grants were no longer applied on upgrade."""
    with pytest.raises(psycopg.Error) as refused:
        db.execute(statement)
    assert refused.value.sqlstate == "WF004"
    assert "flowly.settings keeps its one row: update it" in str(refused.value)
    db.execute("update flowly.settings set max_takeovers = 5")
    assert db.execute("select flowly.max_takeovers()").fetchone() == (5,)
