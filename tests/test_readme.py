"""The README's commands work as written.

Every ```sql block runs against a fresh database, and every ``flowly``, ``psql`` and
``python -m flowly.worker`` line of the ```sh blocks runs as a real command (``make`` lines
are what CI runs). Comments after ``#`` are dropped; ``<run id>`` becomes the id printed by
the ``flowly start`` line before it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.support import ROOT, wait_for

README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.DOTALL)


def shell_lines() -> list[str]:
    lines = []
    for block in blocks("sh"):
        for line in block.splitlines():
            command = line.split("  #")[0].strip()
            if command and not command.startswith(("make ", "export ")):
                lines.append(command)
    return lines


def test_readme_sql_blocks_run(db: psycopg.Connection[Any]) -> None:
    db.execute("create table orders (id int primary key, sku text)")
    sql_blocks = blocks("sql")
    assert len(sql_blocks) >= 2
    for block in sql_blocks:
        db.execute(block)
    db.execute("insert into orders values (7, 'book')")
    ids = {row[0] for row in db.execute("select id from flowly.runs")}
    assert {"order-1001", "order-7"} <= ids


def test_readme_commands_run(dsn: str, db: psycopg.Connection[Any]) -> None:
    info = conninfo_to_dict(dsn)
    env = {**os.environ, "FLOWLY_DSN": dsn, "PYTHONPATH": str(ROOT),
           "PGHOST": str(info.get("host", "")), "PGPORT": str(info.get("port", "")),
           "PGUSER": str(info.get("user", "")), "PGDATABASE": str(info.get("dbname", ""))}
    bin_dir = os.path.dirname(sys.executable)
    env["PATH"] = bin_dir + os.pathsep + env["PATH"]
    lines = shell_lines()
    assert any(line.startswith("flowly start") for line in lines)
    run_id = ""
    worker: subprocess.Popen[str] | None = None
    try:
        for line in lines:
            argv = shlex.split(line.replace("<run id>", run_id))
            if argv[0] == "psql" and shutil.which("psql") is None:
                pytest.skip("psql is not installed")
            if argv[:3] == ["python", "-m", "flowly.worker"]:
                if worker is None:  # the `flowly worker` alternative is in the same comment
                    worker = subprocess.Popen([sys.executable, *argv[1:]], cwd=ROOT, env=env,
                                              text=True)
                continue
            done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=60)
            assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
            if argv[:2] == ["flowly", "start"]:
                run_id = done.stdout.strip()
                assert run_id
                wait_for(lambda started=run_id: db.execute(
                             "select status = 'completed' from flowly.runs where id = %s",
                             (started,)).fetchone()[0],
                         timeout=30, what="the README's order run to complete")
            if argv[:2] == ["flowly", "show"]:
                assert "reserve_inventory" in done.stdout and "completed" in done.stdout
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            worker.wait(30)
    assert worker is not None and worker.returncode == 0
    assert db.execute("select count(*) from jobs.schema_migrations").fetchone()[0] >= 2
