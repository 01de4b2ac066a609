"""The README's commands work as written, from a checkout and from a pip install.

Every ```sql block runs against a fresh database, and every ``flowly``, ``psql`` and
``python -m flowly.worker`` line of the ```sh blocks runs as a real shell command (``make``
lines are what CI runs; ``pip install`` lines are what the wheel tests do). Comments after
``#`` are dropped; ``<run id>`` becomes the id printed by the ``flowly start`` line before it.
The lines run twice: in the checkout (its virtualenv, its folder) and with the built wheel
installed alone in a fresh virtualenv, from an empty folder, where lines whose comment says
"checkout" are left out.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.installed import clean_env
from tests.support import ROOT, wait_for

README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.DOTALL)


def shell_lines(mode: str = "checkout") -> list[str]:
    lines = []
    for block in blocks("sh"):
        for line in block.splitlines():
            command, _, comment = line.partition("  #")
            command = command.strip()
            if not command or command.startswith(("make ", "export ", "pip ")):
                continue
            if mode == "installed" and "checkout" in comment:
                continue
            lines.append(command)
    return lines


def test_readme_tells_how_to_install() -> None:
    install = [line.split("  #")[0].strip() for block in blocks("sh")
               for line in block.splitlines() if line.startswith("pip install")]
    assert "pip install flowly" in install and "pip install 'flowly[embedded]'" in install


def test_readme_sql_blocks_run(db: psycopg.Connection[Any]) -> None:
    db.execute("create table orders (id int primary key, sku text)")
    sql_blocks = blocks("sql")
    assert len(sql_blocks) >= 2
    for block in sql_blocks:
        db.execute(block)
    db.execute("insert into orders values (7, 'book')")
    ids = {row[0] for row in db.execute("select id from flowly.runs")}
    assert {"order-1001", "order-7"} <= ids


@pytest.mark.parametrize("mode", ["checkout",
                                  pytest.param("installed", marks=pytest.mark.packaging)])
def test_readme_commands_run(dsn: str, db: psycopg.Connection[Any], mode: str,
                             request: pytest.FixtureRequest, tmp_path: Path) -> None:
    info = conninfo_to_dict(dsn)
    pg = {"FLOWLY_DSN": dsn, "PGHOST": str(info.get("host", "")),
          "PGPORT": str(info.get("port", "")), "PGUSER": str(info.get("user", "")),
          "PGDATABASE": str(info.get("dbname", ""))}
    if mode == "installed":
        env, cwd = clean_env(request.getfixturevalue("installed"), **pg), tmp_path
    else:
        env = {**os.environ, **pg, "PYTHONPATH": str(ROOT)}
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
        cwd = ROOT
    lines = shell_lines(mode)
    assert any(line.startswith("flowly start") for line in lines)
    run_id = ""
    worker: subprocess.Popen[str] | None = None
    try:
        for line in lines:
            line = line.replace("<run id>", run_id)
            argv = shlex.split(line)
            if "psql" in argv and shutil.which("psql") is None:
                pytest.skip("psql is not installed")
            if argv[:3] == ["python", "-m", "flowly.worker"]:
                if worker is None:  # the `flowly worker` alternative is in the same comment
                    worker = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=cwd, env=env,
                                              text=True)
                continue
            done = subprocess.run(["bash", "-o", "pipefail", "-c", line], cwd=cwd, env=env,
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
            assert "Traceback" not in done.stderr, f"{line}\n{done.stderr}"
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
