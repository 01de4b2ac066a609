"""The command line catches a user's mistakes in one clear line (issue 7): a broken ``--app``,
a file name given as ``--app``, errors under ``--json``; and ``install --print-sql`` /
``sql-path`` for psql users, ``show --full``, run-id prefixes, times with zones."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.support import ROOT
from tests.test_cli import UNREACHABLE, _env, flowly, ok, one_error_line


def _app_dir(tmp_path: Path, source: str) -> dict[str, str]:
    (tmp_path / "mywf.py").write_text(source)
    return {"PYTHONPATH": f"{tmp_path}:{ROOT}"}


def test_app_with_a_syntax_error_is_one_line_naming_file_and_line(dsn: str, tmp_path: Path
                                                                   ) -> None:
    env = _app_dir(tmp_path, "import flowly\n\ndef broken(:\n    pass\n")
    error = one_error_line(flowly("worker", "--app", "mywf", dsn=dsn, env=env), 2)
    assert "mywf.py" in error and "line 3" in error and "SyntaxError" in error, error


def test_app_that_raises_on_import_is_one_line(dsn: str, tmp_path: Path) -> None:
    env = _app_dir(tmp_path, "import flowly\nundefined_name\n")
    error = one_error_line(flowly("worker", "--app", "mywf", dsn=dsn, env=env), 2)
    assert "NameError" in error and "undefined_name" in error and "line 2" in error, error


def test_app_with_a_sync_workflow_is_one_line(dsn: str, tmp_path: Path) -> None:
    env = _app_dir(tmp_path, "import flowly\n\n@flowly.workflow('w')\ndef w(ctx, x):\n"
                             "    return x\n")
    error = one_error_line(flowly("worker", "--app", "mywf", dsn=dsn, env=env), 2)
    assert "async def" in error, error


@pytest.mark.parametrize("spec, hint", [("mywf.py", "--app mywf"),
                                        ("pkg/mywf.py", "--app pkg.mywf"),
                                        ("./mywf.py:order", "--app mywf:order")])
def test_app_given_as_a_file_name_suggests_the_module(dsn: str, spec: str, hint: str) -> None:
    error = one_error_line(flowly("worker", "--app", spec, dsn=dsn), 2)
    assert f"did you mean {hint}?" in error, error


def test_json_errors_are_json(dsn: str) -> None:
    cases = [
        (flowly("--json", "show", "no-such-run", dsn=dsn), 1, "run no-such-run not found"),
        (flowly("--json", "start", "order", "{bad", dsn=dsn), 2, "not valid JSON"),
        (flowly("--json", "runs", "--status", "bogus", dsn=dsn), 2, "invalid choice"),
        (flowly("--json", "runs", dsn=UNREACHABLE), 1, "cannot connect"),
        (flowly("runs", "--json", "--since", "yesterday", dsn=dsn), 2, "--since"),
    ]
    for result, code, text in cases:
        assert result.returncode == code, result
        assert result.stdout == "", result.stdout
        lines = result.stderr.splitlines()
        assert len(lines) == 1, result.stderr
        error = json.loads(lines[0])
        assert error["exit_code"] == code and text in error["error"], error


def test_install_print_sql_needs_no_database_and_psql_runs_it(empty_dsn: str) -> None:
    script = ok(flowly("install", "--print-sql", dsn=UNREACHABLE))
    assert "\\ir " not in script and "schema_migrations" in script
    if shutil.which("psql") is None:
        pytest.skip("psql is not installed")
    info = conninfo_to_dict(empty_dsn)
    psql = ["psql", "-q", "-v", "ON_ERROR_STOP=1", "-h", str(info.get("host", "")),
            "-p", str(info.get("port", "")), "-U", str(info.get("user", "")),
            "-d", str(info["dbname"])]
    subprocess.run(psql, input=script, text=True, check=True, capture_output=True)
    # the result is what `flowly install` makes: installing again applies nothing
    assert "up to date" in ok(flowly("install", dsn=empty_dsn))


def test_sql_path_names_the_folder_of_install_sql() -> None:
    path = Path(ok(flowly("sql-path", dsn=UNREACHABLE)).strip())
    assert (path / "install.sql").is_file() and (path / "migrations").is_dir()


# -- show --full, prefixes, time zones, the error column of runs -----------------------------


def _dead_letter(db: psycopg.Connection[Any], run_id: str, message: str) -> None:
    db.execute("select flowly.start('order', '{}', run_id => %s)", (run_id,))
    error = {"type": "RuntimeError", "message": message,
             "traceback": "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                          + "RuntimeError: " + message}
    db.execute("update flowly.runs set status = 'dead_letter', finished_at = now(),"
               " error = %s where id = %s", (psycopg.types.json.Jsonb(error), run_id))


def test_show_full_prints_everything_untruncated(dsn: str, db: psycopg.Connection[Any]) -> None:
    long_message = "declined because " + "very " * 60 + "long"
    _dead_letter(db, "full-1", long_message)
    db.execute("update flowly.runs set input = %s where id = 'full-1'",
               (psycopg.types.json.Jsonb({"note": "x" * 300}),))
    short = ok(flowly("show", "full-1", dsn=dsn))
    assert long_message not in short and "x" * 300 not in short
    full = ok(flowly("show", "full-1", "--full", dsn=dsn))
    assert long_message in full and "x" * 300 in full
    assert "Traceback (most recent call last)" in full and 'File "x.py", line 1' in full


def test_show_matches_a_unique_run_id_prefix(dsn: str, db: psycopg.Connection[Any]) -> None:
    for run_id in ("abc-111", "abc-222", "xyz-1"):
        db.execute("select flowly.start('order', '{}', run_id => %s)", (run_id,))
    assert "run abc-222" in ok(flowly("show", "abc-2", dsn=dsn))
    assert "run xyz-1" in ok(flowly("show", "xyz", dsn=dsn))
    error = one_error_line(flowly("show", "abc", dsn=dsn), 2)
    assert "ambiguous" in error and "abc-111" in error and "abc-222" in error, error
    one_error_line(flowly("show", "nope", dsn=dsn), 1)
    # an exact id wins over being the prefix of another
    db.execute("select flowly.start('order', '{}', run_id => 'abc')")
    assert "run abc\n" in ok(flowly("show", "abc", dsn=dsn))
    # a prefix is only a prefix: LIKE wildcards in it match nothing else
    assert "ambiguous" not in one_error_line(flowly("show", "a_c", dsn=dsn), 1)
    # cancel and retry take prefixes too
    assert "cancelled" in ok(flowly("cancel", "xyz", dsn=dsn))


def test_times_are_printed_with_their_time_zone(dsn: str, db: psycopg.Connection[Any]) -> None:
    db.execute("select flowly.start('order', '{}', run_id => 'tz-1')")
    env = {"TZ": "America/New_York"}
    shown = ok(flowly("show", "tz-1", dsn=dsn, env=env))
    created = next(line for line in shown.splitlines() if "created" in line)
    assert re.search(r"\d{2}:\d{2}:\d{2}\.\d{3} (EST|EDT)", created), created
    listed = ok(flowly("runs", dsn=dsn, env=env))
    assert re.search(r"\d{2}:\d{2}:\d{2}\.\d{3} (EST|EDT)", listed), listed


def test_runs_has_an_error_column(dsn: str, db: psycopg.Connection[Any]) -> None:
    _dead_letter(db, "err-1", "card 0000 declined")
    db.execute("select flowly.start('order', '{}', run_id => 'ok-1')")
    listed = ok(flowly("runs", dsn=dsn))
    header, *rows = listed.splitlines()
    assert "ERROR" in header.split()
    assert "RuntimeError: card 0000 declined" in next(r for r in rows if "err-1" in r)
    assert next(r for r in rows if "ok-1" in r).rstrip().endswith("-")


def test_runs_since_age_forms(dsn: str, db: psycopg.Connection[Any]) -> None:
    db.execute("select flowly.start('order', '{}', run_id => 'recent')")
    db.execute("select flowly.start('order', '{}', run_id => 'older')")
    db.execute("update flowly.runs set created_at = now() - %s where id = 'older'",
               (timedelta(hours=3),))
    listed = ok(flowly("runs", "--since", "2h", dsn=dsn))
    assert "recent" in listed and "older" not in listed


@pytest.mark.parametrize("timeout", ["3000000", "1e10"])
def test_a_db_timeout_the_server_cannot_take_is_a_bad_invocation(dsn: str, timeout: str) -> None:
    """It printed a raw database error (statement_timeout takes at most 2147483647 ms), and
    at 1e10 also a traceback of the watchdog thread."""
    error = one_error_line(flowly("--db-timeout", timeout, "runs", dsn=dsn), 2)
    assert "--db-timeout must be at most 2147483 seconds" in error, error


@pytest.mark.parametrize("command", [["runs", "--limit", "5000"], ["--json", "runs"],
                                     ["dead-letters"]])
def test_output_into_a_closed_pipe_ends_quietly(dsn: str, db: psycopg.Connection[Any],
                                                command: list[str]) -> None:
    """``flowly runs | head -1`` printed a BrokenPipeError traceback once head had exited."""
    for n in range(3):
        _dead_letter(db, f"r{n}", "boom")
    reader = subprocess.Popen([sys.executable, "-m", "flowly", "--dsn", dsn, *command],
                              cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    assert reader.stdout is not None
    reader.stdout.close()  # as head does once it has its line
    _, errors = reader.communicate(timeout=60)
    assert errors == ""
    assert reader.returncode == 1
