"""The ``flowly`` command line, run as a real subprocess (``python -m flowly``).

Runs that must execute are served by ``flowly worker --app examples.order`` in another
subprocess, so these tests cover the same path a user takes from a shell.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from flowly.schema import migrations
from tests.support import READER, WORKER, drop_roles, wait_for

ROOT = Path(__file__).resolve().parent.parent
UNREACHABLE = "postgresql://root@127.0.0.1:1/x"
OK_ORDER = {"sku": "book", "qty": 1, "card": "4242", "cooling_seconds": 0}
DECLINED_ORDER = {"sku": "lamp", "qty": 2, "card": "0000", "cooling_seconds": 0}


def _env() -> dict[str, str]:
    """The caller's environment without any database configuration (tests pass --dsn)."""
    env = {k: v for k, v in os.environ.items() if k not in ("FLOWLY_DSN", "DATABASE_URL")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def flowly(*args: str, dsn: str | None = None, stdin: str | None = None,
           timeout: float = 60, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess[str]:
    """Run ``python -m flowly [--dsn DSN] ARGS`` and capture its output."""
    command = [sys.executable, "-m", "flowly", *(["--dsn", dsn] if dsn else []), *args]
    return subprocess.run(command, cwd=ROOT, env={**_env(), **(env or {})}, input=stdin,
                          capture_output=True, text=True, timeout=timeout, check=False)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    """Assert a command succeeded; return its stdout."""
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stderr
    return result.stdout


def one_error_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    """Assert the command failed with ``code`` and exactly one ``error:`` line on stderr."""
    assert result.returncode == code, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), result.stderr
    return lines[0]


def status_of(db: psycopg.Connection[Any], run_id: str) -> str | None:
    row = db.execute("select status from flowly.runs where id = %s", (run_id,)).fetchone()
    return None if row is None else str(row[0])


def wait_status(db: psycopg.Connection[Any], run_id: str, *statuses: str) -> str:
    return str(wait_for(lambda: status_of(db, run_id) in statuses and status_of(db, run_id),
                        what=f"run {run_id} to be {' or '.join(statuses)}"))


@pytest.fixture
def worker(dsn: str, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``flowly worker --app examples.order`` serving the test database."""
    log_path = tmp_path / "worker.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flowly", "--dsn", dsn, "worker", "--app", "examples.order",
             "--poll-interval", "0.1", "--lease", "5", "--drain-timeout", "2"],
            cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- install / migrate ------------------------------------------------------------------------


def test_install_twice_second_is_a_no_op(empty_dsn: str) -> None:
    first = ok(flowly("install", dsn=empty_dsn))
    assert "applied 0001_engine to schema flowly" in first
    assert "applied 0002_dashboard_views" in first
    second = ok(flowly("install", dsn=empty_dsn))
    assert "up to date" in second and "applied" not in second
    again = json.loads(ok(flowly("--json", "install", dsn=empty_dsn)))
    shipped = [m.version for m in migrations()]  # every migration, however many there are
    assert again["applied"] == [] and again["versions"] == shipped
    with psycopg.connect(empty_dsn) as conn:
        rows = conn.execute("select version from flowly.schema_migrations order by 1").fetchall()
    assert [v for (v,) in rows] == shipped


def test_migrate_step_by_step_with_target(empty_dsn: str) -> None:
    first = json.loads(ok(flowly("migrate", "--target", "1", "--json", dsn=empty_dsn)))
    assert first["applied"] == [1] and first["versions"] == [1]
    rest = ok(flowly("migrate", dsn=empty_dsn))
    assert "applied 0002_dashboard_views" in rest and "0001" not in rest
    error = one_error_line(flowly("migrate", "--target", "99", dsn=empty_dsn), 2)
    assert "no such migration" in error


def test_install_into_a_schema_with_quotes_and_spaces(empty_dsn: str) -> None:
    schema = 'my "odd" schema'
    out = ok(flowly("install", "--schema", schema, dsn=empty_dsn))
    assert "applied 0001_engine" in out
    run_id = ok(flowly("start", "order", "--schema", schema, dsn=empty_dsn)).strip()
    with psycopg.connect(empty_dsn) as conn:
        row = conn.execute(sql.SQL("select workflow from {}.runs where id = %s").format(
            sql.Identifier(schema)), (run_id,)).fetchone()
    assert row == ("order",)
    listed = json.loads(ok(flowly("runs", "--schema", schema, "--json", dsn=empty_dsn)))
    assert [r["id"] for r in listed] == [run_id]


# names PostgreSQL must quote: a space (README's own example), upper case, a semicolon, and
# a percent sign, which psycopg would read as a placeholder in a query that has parameters
QUOTED_SCHEMAS = ["my app", "Upper", "a;b", "100%"]


@pytest.mark.parametrize("schema", QUOTED_SCHEMAS)
def test_every_command_works_in_a_schema_whose_name_needs_quotes(
        empty_dsn: str, schema: str) -> None:
    """README: flowly in another schema works the same through its name, quoted when it needs
    quotes. ``install --roles``, ``start``, ``runs``, ``cancel`` and ``purge`` from the
    command line and ``purge`` from SQL all work there (they failed with "invalid name
    syntax", or acted on the lower-cased name, or read a ``%`` as a placeholder)."""
    worker, reader = f"{WORKER}_q", f"{READER}_q"
    try:
        ok(flowly("--schema", schema, "install", "--roles", "--worker-role", worker,
                  "--reader-role", reader, dsn=empty_dsn))
        run_id = ok(flowly("--schema", schema, "start", "order", dsn=empty_dsn)).strip()
        assert run_id in ok(flowly("--schema", schema, "runs", dsn=empty_dsn))
        ok(flowly("--schema", schema, "cancel", run_id, dsn=empty_dsn))
        assert "purged 1 run(s)" in ok(flowly("--schema", schema, "purge", "--older-than", "0s",
                                              dsn=empty_dsn))
        assert run_id not in ok(flowly("--schema", schema, "runs", dsn=empty_dsn))
        with psycopg.connect(empty_dsn, autocommit=True) as conn:
            assert conn.execute(sql.SQL("select {}.purge('1 day')").format(
                sql.Identifier(schema))).fetchone() == (0,)
            assert conn.execute(
                "select has_function_privilege(%s, p.oid, 'execute') from pg_proc p"
                " join pg_namespace n on n.oid = p.pronamespace"
                " where n.nspname = %s and p.proname = 'start'", (worker, schema)
            ).fetchone() == (True,)
    finally:
        drop_roles(empty_dsn, worker, reader)


def test_schema_name_with_sql_in_it_is_only_a_name(empty_dsn: str) -> None:
    schema = 'x"; drop table y; --'
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("create table public.y (id int)")
    result = flowly("install", "--schema", schema, dsn=empty_dsn)
    with psycopg.connect(empty_dsn) as conn:
        assert conn.execute("select to_regclass('public.y') is not null").fetchone() == (True,)
        created = conn.execute("select count(*) from pg_namespace where nspname = %s",
                               (schema,)).fetchone()
    if result.returncode == 0:  # accepted: it must be that exact schema, quoted
        assert created == (1,)
    else:
        one_error_line(result, 2)
        assert created == (0,)


def test_schema_names_postgres_cannot_use_are_refused_in_one_line(empty_dsn: str) -> None:
    assert "reserved" in one_error_line(flowly("install", "--schema", "pg_flowly",
                                               dsn=empty_dsn), 2)
    assert "63 bytes" in one_error_line(flowly("install", "--schema", "s" * 64, dsn=empty_dsn), 2)
    with psycopg.connect(empty_dsn) as conn:
        assert conn.execute("select count(*) from pg_namespace where nspname like 'pg_flowly%'"
                            " or nspname like 'sss%'").fetchone() == (0,)


def test_commands_on_a_database_without_flowly_say_install(empty_dsn: str) -> None:
    for args in (["runs"], ["show", "r1"], ["start", "order"], ["dead-letters"]):
        assert "flowly install" in one_error_line(flowly(*args, dsn=empty_dsn), 1), args


# -- start ------------------------------------------------------------------------------------


def test_start_with_bad_json_exits_2_with_one_line(dsn: str, db: psycopg.Connection[Any]
                                                    ) -> None:
    error = one_error_line(flowly("start", "order", '{"sku": ', dsn=dsn), 2)
    assert "not valid JSON" in error
    assert db.execute("select count(*) from flowly.runs").fetchone() == (0,)


def test_start_passes_every_option_to_the_engine(dsn: str, db: psycopg.Connection[Any]) -> None:
    result = flowly("start", "order", json.dumps(OK_ORDER), "--run-id", "r-opts",
                    "--queue", "slow", "--priority", "7", "--delay", "3600",
                    "--concurrency-key", "cust-1", "--max-attempts", "5", "--timeout", "90",
                    dsn=dsn)
    assert ok(result) == "r-opts\n"
    assert "no live worker serves workflow 'order'" in result.stderr
    row = db.execute(
        "select workflow, input, queue, priority, concurrency_key, max_attempts,"
        " extract(epoch from timeout), status,"
        " extract(epoch from scheduled_for - created_at) from flowly.runs where id = 'r-opts'"
    ).fetchone()
    assert row is not None
    assert row[:8] == ("order", OK_ORDER, "slow", 7, "cust-1", 5, 90, "pending")
    assert 3590 < float(row[8]) < 3610
    # idempotent: the same run id returns the existing run
    assert ok(flowly("start", "order", "--run-id", "r-opts", dsn=dsn)) == "r-opts\n"
    assert db.execute("select count(*) from flowly.runs").fetchone() == (1,)


def test_start_json_output_and_input_from_stdin(dsn: str) -> None:
    run = json.loads(ok(flowly("--json", "start", "order", "-", stdin=json.dumps(OK_ORDER),
                               dsn=dsn)))
    assert run["workflow"] == "order" and run["status"] == "pending"
    assert run["input"] == OK_ORDER


def test_start_refuses_out_of_range_options(dsn: str) -> None:
    assert "--delay" in one_error_line(flowly("start", "order", "--delay", "-1", dsn=dsn), 2)
    assert "--max-attempts" in one_error_line(
        flowly("start", "order", "--max-attempts", "0", dsn=dsn), 2)
    assert "priority" in one_error_line(
        flowly("start", "order", "--priority", "99999999999", dsn=dsn), 2)
    assert "timeout" in one_error_line(flowly("start", "order", "--timeout", "nan", dsn=dsn), 2)
    assert "delay" in one_error_line(flowly("start", "order", "--delay", "inf", dsn=dsn), 2)


def test_other_out_of_range_arguments_get_one_line(dsn: str) -> None:
    assert "--since" in one_error_line(flowly("runs", "--since", "1000000d", dsn=dsn), 2)
    assert "--limit" in one_error_line(flowly("dead-letters", "--limit", "0", dsn=dsn), 2)
    bad_level = flowly("worker", "--app", "examples.order", "--log-level", "bogus", dsn=dsn)
    assert bad_level.returncode == 2 and "invalid choice" in bad_level.stderr
    assert "Traceback" not in bad_level.stderr


def test_an_embedded_database_that_cannot_start_is_one_error_line() -> None:
    result = flowly("runs", env={"FLOWLY_EMBEDDED_DIR": "/proc/flowly-cannot-be-here/pgdata"})
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        "error: cannot start the embedded PostgreSQL"), result.stderr


# -- runs / show / cancel / retry / dead-letters on real runs ---------------------------------


def test_runs_lists_filters_and_emits_json(dsn: str) -> None:
    first = ok(flowly("start", "order", "--run-id", "run-a", dsn=dsn)).strip()
    second = ok(flowly("start", "other", "--run-id", "run-b", dsn=dsn)).strip()
    out = ok(flowly("runs", dsn=dsn))
    header, *rows = out.splitlines()
    assert header.split() == ["ID", "WORKFLOW", "STATUS", "ATTEMPT", "CREATED", "FINISHED/AGE",
                              "ERROR"]
    assert [r.split()[0] for r in rows] == [second, first]  # newest first
    assert header.index("WORKFLOW") == rows[0].index("other")  # aligned columns
    only = ok(flowly("runs", "--workflow", "other", dsn=dsn))
    assert "run-b" in only and "run-a" not in only
    assert ok(flowly("runs", "--status", "completed", dsn=dsn)) == "no runs match\n"
    recent = json.loads(ok(flowly("runs", "--since", "10m", "--json", dsn=dsn)))
    assert {r["id"] for r in recent} == {"run-a", "run-b"}
    future = json.loads(ok(flowly("runs", "--since", "2999-01-01T00:00:00", "--json", dsn=dsn)))
    assert future == []
    assert len(json.loads(ok(flowly("runs", "--limit", "1", "--json", dsn=dsn)))) == 1
    assert "--since" in one_error_line(flowly("runs", "--since", "yesterday", dsn=dsn), 2)


def test_show_a_completed_run_with_its_timeline(dsn: str, db: psycopg.Connection[Any],
                                                worker: subprocess.Popen[bytes]) -> None:
    run_id = ok(flowly("start", "order", json.dumps(OK_ORDER), dsn=dsn)).strip()
    assert wait_status(db, run_id, "completed", "dead_letter") == "completed"
    out = ok(flowly("show", run_id, dsn=dsn))
    assert out.startswith(f"run {run_id}\n")
    assert "status    completed" in out
    steps = out.split("\nsteps\n")[1].split("\ntimers\n")
    lines = steps[0].splitlines()
    assert lines[0].split() == ["#", "NAME", "STATUS", "ATTEMPTS", "DURATION_MS", "ERROR",
                                "COMPENSATION"]
    assert lines[1].split()[:4] == ["1", "reserve_inventory", "completed", "1"]
    assert lines[2].split()[:4] == ["2", "charge_payment", "completed", "1"]
    assert int(lines[1].split()[4]) >= 400  # the example step sleeps 0.5s
    assert "cooling_period" in steps[1]

    detail = json.loads(ok(flowly("show", run_id, "--json", dsn=dsn)))
    assert detail["run"]["status"] == "completed"
    assert detail["run"]["output"]["charge"] == f"ch-{run_id}:charge_payment"
    assert [s["name"] for s in detail["steps"]] == ["reserve_inventory", "charge_payment"]
    assert detail["steps"][0]["duration_ms"] >= 400
    assert [t["name"] for t in detail["timers"]] == ["cooling_period"]
    assert detail["timers"][0]["fired_at"] is not None
    assert detail["failed_attempts"] == []


def test_dead_letter_show_list_and_retry(dsn: str, db: psycopg.Connection[Any],
                                         worker: subprocess.Popen[bytes]) -> None:
    run_id = ok(flowly("start", "order", json.dumps(DECLINED_ORDER), dsn=dsn)).strip()
    wait_status(db, run_id, "dead_letter")

    out = ok(flowly("show", run_id, dsn=dsn))
    assert "error            RuntimeError: card 0000 declined (step charge_payment)" in out
    assert "compensation_ok  true" in out
    timeline = out.split("\nsteps\n")[1].splitlines()
    assert timeline[1].split()[:4] == ["1", "reserve_inventory", "completed", "1"]
    assert timeline[1].split()[-1] == "compensated"
    assert timeline[2].split()[:4] == ["2", "charge_payment", "failed", "2"]
    assert "card 0000 declined" in timeline[2]
    assert "failed attempts" in out

    listed = ok(flowly("dead-letters", dsn=dsn)).splitlines()
    assert listed[0].split() == ["ID", "WORKFLOW", "FAILED_STEP", "LAST_ERROR",
                                 "COMPENSATION_OK", "FINISHED"]
    assert listed[1].split()[:3] == [run_id, "order", "charge_payment"]
    assert "card 0000 declined" in listed[1] and " true " in listed[1]
    as_json = json.loads(ok(flowly("--json", "dead-letters", dsn=dsn)))
    assert [(r["run_id"], r["compensation_ok"]) for r in as_json] == [(run_id, True)]

    restarted = ok(flowly("retry", run_id, dsn=dsn))
    assert restarted.startswith(f"run {run_id} restarted")
    generation = db.execute("select generation from flowly.runs where id = %s",
                            (run_id,)).fetchone()
    assert generation == (2,)
    # the card is still declined: it fails and is compensated again, then can be retried again
    wait_status(db, run_id, "dead_letter")
    assert one_error_line(flowly("cancel", run_id, dsn=dsn), 1) == (
        f"error: run {run_id} is already dead_letter; it cannot be cancelled")


def test_retry_of_a_run_that_is_not_dead_lettered_fails_in_one_line(dsn: str) -> None:
    run_id = ok(flowly("start", "order", "--delay", "3600", dsn=dsn)).strip()
    error = one_error_line(flowly("retry", run_id, dsn=dsn), 1)
    assert "pending" in error and "dead_letter" in error


def test_cancel_pending_then_again_then_a_completed_run(dsn: str, db: psycopg.Connection[Any],
                                                        worker: subprocess.Popen[bytes]) -> None:
    pending = ok(flowly("start", "order", json.dumps(OK_ORDER), "--delay", "3600",
                        dsn=dsn)).strip()
    assert ok(flowly("cancel", pending, dsn=dsn)) == f"run {pending} cancelled (was pending)\n"
    assert status_of(db, pending) == "cancelled"
    assert ok(flowly("cancel", pending, dsn=dsn)) == f"run {pending} was already cancelled\n"
    other = ok(flowly("start", "order", "--delay", "3600", dsn=dsn)).strip()
    as_json = json.loads(ok(flowly("cancel", other, "--json", dsn=dsn)))
    assert (as_json["id"], as_json["status"]) == (other, "cancelled")
    assert as_json["finished_at"] is not None

    done = ok(flowly("start", "order", json.dumps(OK_ORDER), dsn=dsn)).strip()
    wait_status(db, done, "completed")
    error = one_error_line(flowly("cancel", done, dsn=dsn), 1)
    assert error == f"error: run {done} is already completed; it cannot be cancelled"
    assert status_of(db, done) == "completed"


@pytest.mark.parametrize("command", ["show", "cancel", "retry"])
def test_unknown_run_exits_1_with_one_line(dsn: str, command: str) -> None:
    assert one_error_line(flowly(command, "no-such-run", dsn=dsn), 1) == (
        "error: run no-such-run not found")


def test_unreachable_database_exits_1_with_one_line() -> None:
    for args in (["runs"], ["install"], ["show", "r1"]):
        error = one_error_line(flowly(*args, dsn=UNREACHABLE, timeout=30), 1)
        assert error.startswith("error: cannot connect to the database:"), error
        assert "port 1" in error


def test_without_a_dsn_the_embedded_database_is_used_and_named(dsn: str) -> None:
    """Only when the tests themselves run on the embedded server (FLOWLY_TEST_EMBEDDED=1 or
    no server at 127.0.0.1:5432), so that this test never starts a PostgreSQL of its own."""
    data_dir = ROOT / ".flowly" / f"test-pg{os.environ.get('FLOWLY_TEST_PG_VERSION', '18')}"
    if not str(conninfo_to_dict(dsn).get("host", "")).startswith("/") or not data_dir.is_dir():
        pytest.skip("the tests run on a TCP server, not on the embedded PostgreSQL")
    result = flowly("runs", "--schema", "flowly_cli_absent",
                    env={"FLOWLY_EMBEDDED_DIR": str(data_dir)})
    notice, *_ = result.stderr.splitlines()
    assert notice.startswith("flowly: no database configured")
    assert f"using the embedded PostgreSQL in {data_dir}" in notice
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        "error: flowly is not installed in schema flowly_cli_absent of this database;"
        " run `flowly install`")


def test_global_options_work_after_the_command_name(dsn: str) -> None:
    run = json.loads(ok(flowly("start", "order", "--json", "--dsn", dsn)))
    assert run["status"] == "pending"
    assert "Traceback" not in flowly("--version").stderr
    assert ok(flowly("--version")).startswith("flowly ")


# -- worker -----------------------------------------------------------------------------------


def test_worker_command_serves_runs_and_stops_on_sigterm(
    dsn: str, db: psycopg.Connection[Any], worker: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    run_id = ok(flowly("start", "order", json.dumps(OK_ORDER), dsn=dsn)).strip()
    wait_status(db, run_id, "completed")
    assert db.execute("select count(*) from flowly.workers").fetchone() == (1,)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    log = (tmp_path / "worker.log").read_text()
    assert db.execute("select count(*) from flowly.workers").fetchone() == (0,), log
    assert "overran" not in log


def test_worker_with_an_unimportable_app_exits_2_with_one_line(dsn: str) -> None:
    error = one_error_line(flowly("worker", "--app", "no_such_module_xyz", dsn=dsn), 2)
    assert "no_such_module_xyz" in error
    error = one_error_line(flowly("worker", "--app", "examples.order:nope", dsn=dsn), 2)
    assert "nope" in error


# -- demo -------------------------------------------------------------------------------------


def test_demo_runs_end_to_end(dsn: str, db: psycopg.Connection[Any]) -> None:
    began = time.monotonic()
    result = flowly("demo", dsn=dsn, timeout=90)
    elapsed = time.monotonic() - began
    out = ok(result)
    assert elapsed < 60, f"the demo took {elapsed:.1f}s"
    assert "kill -9 worker A" in out
    assert "status    running" in out  # the run right after the kill
    assert "verified: reserve_inventory executed exactly once" in out
    assert "the workers logged executing it once (worker A: 1, worker B: 0)" in out
    assert "verified: dead_letter after 2 attempts of charge_payment" in out
    assert "compensation_ok = true" in out
    assert "select * from flowly.timers" in out
    assert "worker B stopped (SIGTERM, exit status 0)" in out
    rows = db.execute(
        "select input ->> 'card', status, compensation_ok from flowly.runs"
        " where queue = 'flowly-demo' order by created_at").fetchall()
    assert rows == [("4242", "completed", None), ("0000", "dead_letter", True)]
    reserve = db.execute(
        "select count(*), min(attempts) from flowly.steps s join flowly.runs r on r.id = s.run_id"
        " where r.input ->> 'card' = '4242' and s.name = 'reserve_inventory'").fetchone()
    assert reserve == (1, 1)
    # worker B unregistered on SIGTERM; only the SIGKILLed worker A left its row behind
    assert db.execute("select count(*) from flowly.workers").fetchone() == (1,)


@pytest.mark.parametrize("schema", ["user", "select", "Jobs", 'we"ird name'])
def test_printed_sql_names_the_schema_as_psql_reads_it(empty_dsn: str, schema: str) -> None:
    """The queries flowly prints for psql (show, demo) quote the schema only when needed,
    which includes keywords such as user."""
    from flowly.render import quote_ident
    from flowly.schema import install

    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        install(conn, schema)
        assert conn.execute(f"select count(*) from {quote_ident(schema)}.runs").fetchone() == (0,)


def test_a_postmaster_pid_that_another_postgres_reused_is_not_trusted(
    tmp_path: Path, db: psycopg.Connection[Any]
) -> None:
    """After a reboot the PID in the embedded cluster's postmaster.pid may belong to another
    postgres (here: a backend of the test server): it is stale, not a server to reuse."""
    import psutil

    from flowly.embedded import _running_info

    backend = db.info.backend_pid
    if os.geteuid() != 0 and psutil.Process(backend).username() != psutil.Process().username():
        pytest.skip("another user's postgres: its working directory cannot be read")
    pgdata = tmp_path / "pgdata"
    pgdata.mkdir()
    (pgdata / "postmaster.pid").write_text(
        f"{backend}\n{pgdata}\n1700000000\n5432\n{tmp_path}\n127.0.0.1\n  1 2\nready   \n")
    assert _running_info(pgdata) is None
    assert not (pgdata / "postmaster.pid").exists()
