"""The embedded PostgreSQL: one data directory per project, ``flowly embedded status|stop``, and
``make clean`` stopping servers before deleting their data (issue 7)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil  # type: ignore[import-untyped]
import psycopg
import pytest

from flowly.embedded import embedded_dsn, resolve_data_dir, status, stop
from tests.support import ROOT
from tests.test_cli import flowly, ok


@pytest.fixture
def no_dir_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.delenv("FLOWLY_EMBEDDED_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    return tmp_path


def test_the_data_directory_is_the_projects_wherever_a_command_runs(no_dir_override: Path
                                                                    ) -> None:
    project = no_dir_override / "shop"
    (project / "src" / "deep").mkdir(parents=True)
    (project / "pyproject.toml").write_text("[project]\nname = 'shop'\n")
    expected = project.resolve() / ".flowly" / "pgdata"
    assert resolve_data_dir(cwd=project) == expected
    assert resolve_data_dir(cwd=project / "src" / "deep") == expected
    # a git checkout without pyproject.toml is a project too
    repo = no_dir_override / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / "app").mkdir()
    assert resolve_data_dir(cwd=repo / "app") == repo.resolve() / ".flowly" / "pgdata"
    # an existing .flowly/pgdata above wins over a nearer project marker
    (project / "src" / "setup.py").write_text("")
    (project / ".flowly" / "pgdata").mkdir(parents=True)
    assert resolve_data_dir(cwd=project / "src" / "deep") == expected
    # outside any project: one per user, not one per folder
    loose = no_dir_override / "loose" / "a"
    loose.mkdir(parents=True)
    user_dir = resolve_data_dir(cwd=loose)
    assert user_dir == resolve_data_dir(cwd=loose.parent)
    assert str(user_dir).startswith(str((no_dir_override / "xdg").resolve()))


def test_flowly_embedded_dir_overrides_the_rule(no_dir_override: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOWLY_EMBEDDED_DIR", str(no_dir_override / "mine"))
    assert resolve_data_dir(cwd=ROOT) == (no_dir_override / "mine").resolve()


@pytest.fixture(scope="module")
def server_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A data directory of our own (never the project's or another session's server)."""
    data_dir = tmp_path_factory.mktemp("embedded") / "pgdata"
    yield data_dir
    stop(data_dir)


def test_status_and_stop_from_the_command_line(server_dir: Path) -> None:
    env = {"FLOWLY_EMBEDDED_DIR": str(server_dir)}
    first = ok(flowly("embedded", "status", env=env))
    assert f"data directory: {server_dir}" in first and "none yet" in first

    dsn = embedded_dsn(server_dir)
    with psycopg.connect(dsn) as conn:
        conn.execute("select 1")
    pid = status(server_dir).pid
    assert pid is not None and psutil.pid_exists(pid)
    running = ok(flowly("embedded", "status", env=env))
    assert f"pid {pid}" in running and "running" in running and "dsn:" in running
    as_json = json.loads(ok(flowly("--json", "embedded", "status", env=env)))
    assert as_json["running"] is True and as_json["pid"] == pid

    stopped = ok(flowly("embedded", "stop", env=env))
    assert f"pid {pid}" in stopped
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert "stopped" in ok(flowly("embedded", "status", env=env))
    assert "no embedded PostgreSQL is running" in ok(flowly("embedded", "stop", env=env))
    # and it starts again on the same data (nothing was lost)
    with psycopg.connect(embedded_dsn(server_dir)) as conn:
        conn.execute("select 1")
    assert ok(flowly("embedded", "stop", "--data-dir", str(server_dir)))
    assert not status(server_dir).running


@pytest.mark.parametrize("with_venv", [True, False])
def test_make_clean_stops_the_servers_before_deleting_their_data(tmp_path: Path,
                                                                 with_venv: bool) -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    data_dir = tmp_path / ".flowly" / "test-pg18"
    embedded_dsn(data_dir)
    pid = status(data_dir).pid
    assert pid is not None
    # a stand-in venv whose flowly is this checkout's (clean deletes the stand-in, not ours)
    # (without it, clean stops them by signal)
    if with_venv:
        bin_dir = tmp_path / "venv" / "bin"
        bin_dir.mkdir(parents=True)
        (bin_dir / "flowly").write_text(
            f"#!/bin/sh\nPYTHONPATH={ROOT} exec {sys.executable} -m flowly \"$@\"\n")
        (bin_dir / "flowly").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    done = subprocess.run(["make", "clean", "VENV=venv"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        assert not (tmp_path / ".flowly").exists() and not (tmp_path / "venv").exists()
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        if psutil.pid_exists(pid):
            psutil.Process(pid).kill()


def test_stop_without_a_server_creates_nothing(tmp_path: Path) -> None:
    data_dir = tmp_path / "project" / ".flowly" / "pgdata"
    out = ok(flowly("embedded", "stop", env={"FLOWLY_EMBEDDED_DIR": str(data_dir)}))
    assert "no embedded PostgreSQL is running" in out
    assert not (tmp_path / "project").exists()
