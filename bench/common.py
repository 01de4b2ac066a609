"""What every benchmark shares: fresh databases, child worker processes driven by a tiny
stdin protocol, timing a drain, and medians with ranges.

A *child* is a Python process that sets its engine up, prints ``ready``, waits for a ``go``
line on stdin, serves until a ``stop`` line (or end of input), then prints one JSON line and
exits. The parent times from ``go`` to the moment its own poll of the database sees the
last job finished, so every engine is timed the same way, from outside.
"""

from __future__ import annotations

import atexit
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

ROOT = Path(__file__).resolve().parent.parent


_created: dict[str, str] = {}  # database name -> the server DSN it was created through


def fresh_database(dsn: str, name: str) -> str:
    """Create database ``name``_<pid> afresh on the server of ``dsn``; return its DSN.

    The pid keeps two benchmarks on one shared server out of each other's databases; the
    databases go when this process exits."""
    name = f"{name}_{os.getpid()}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("drop database if exists {} with (force)").format(
            sql.Identifier(name)))
        conn.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    if not _created:
        atexit.register(_drop_created)
    _created[name] = dsn
    return make_conninfo(dsn, dbname=name)


def _drop_created() -> None:
    for name, dsn in _created.items():
        try:
            drop_database(dsn, name)
        except psycopg.Error:
            pass


def drop_database(dsn: str, name: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("drop database if exists {} with (force)").format(
            sql.Identifier(name)))


def dsn_to_url(dsn: str) -> str:
    """A postgresql:// URL for libraries that take only URLs (SQLAlchemy, asyncpg)."""
    params = conninfo_to_dict(dsn)
    host = str(params.get("host", "127.0.0.1"))
    user = params.get("user") or os.environ.get("USER", "postgres")
    port = params.get("port", 5432)
    if host.startswith("/"):
        return f"postgresql://{user}@/{params['dbname']}?host={host}&port={port}"
    return f"postgresql://{user}@{host}:{port}/{params['dbname']}"


def server_version(dsn: str) -> str:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("show server_version").fetchone()
    return str(row[0]) if row else "?"


class Child:
    """A worker process speaking the ready/go/stop protocol."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None,
                 root: Path = ROOT) -> None:
        """``root``: the checkout whose code the child runs (this one by default)."""
        self.proc = subprocess.Popen(
            [sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, cwd=root,
            env={**os.environ, "PYTHONPATH": str(root), **(env or {})})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 300) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"child {self.proc.args} died:\n{self._stderr()}")
            if line.strip() == "ready":
                return
        raise RuntimeError("child not ready in time")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = 120) -> dict[str, Any]:
        """Send stop; return the JSON the child printed last (or {})."""
        try:
            self.send("stop")
        except BrokenPipeError:
            pass
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        if self.proc.returncode not in (0, None):
            raise RuntimeError(f"child {self.proc.args} exited {self.proc.returncode}:\n"
                               f"{err[-3000:]}")
        for line in reversed(out.strip().splitlines()):
            if line.startswith("{"):
                result: dict[str, Any] = json.loads(line)
                return result
        return {}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _stderr(self) -> str:
        self.kill()
        assert self.proc.stderr is not None
        return self.proc.stderr.read()[-3000:]


def child_protocol_ready() -> None:
    """In a child: say ready, block until the parent says go."""
    print("ready", flush=True)
    line = sys.stdin.readline()
    if line.strip() != "go":
        raise SystemExit(0)


def wait_done(dsn: str, query: str, deadline: float, interval: float = 0.02,
              on_poll: Any = None) -> tuple[float, bool]:
    """Poll ``query`` (true when all work is done) until true or ``deadline`` (monotonic
    seconds); return (the perf_counter at that moment, whether it was done)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            row = conn.execute(query).fetchone()
            now = time.perf_counter()
            if row is not None and row[0]:
                return now, True
            if time.monotonic() > deadline:
                return now, False
            if on_poll is not None:
                on_poll(conn)
            time.sleep(interval)


class CpuMeter:
    """CPU used from its creation to :meth:`read` by some processes (the engine's workers)
    and by the whole machine (the server's backends too): the cost of a drain, not its
    speed, so two engines can be compared per job as well as per second."""

    def __init__(self, pids: Sequence[int]) -> None:
        self._procs = [psutil.Process(pid) for pid in pids]
        self._before = [sum(p.cpu_times()[:2]) for p in self._procs]
        psutil.cpu_percent()  # starts the machine-wide interval

    def read(self, seconds: float) -> tuple[float, float]:
        """(the processes' CPU in cores, the machine's busy share 0..1) over ``seconds``."""
        machine_busy = psutil.cpu_percent() / 100
        used = sum(sum(p.cpu_times()[:2]) - before
                   for p, before in zip(self._procs, self._before, strict=True))
        return used / seconds, machine_busy


@dataclass
class Sample:
    """Repeated measurements of one figure."""

    values: list[float] = field(default_factory=list)

    def add(self, value: float) -> None:
        self.values.append(value)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    def fmt(self, digits: int = 0) -> str:
        if not self.values:
            return "-"
        if len(self.values) == 1:
            return f"{self.values[0]:,.{digits}f}"
        return (f"{self.median:,.{digits}f} ({min(self.values):,.{digits}f}"
                f"-{max(self.values):,.{digits}f})")


def ratio(a: Sample | float, b: Sample | float) -> float:
    x = a.median if isinstance(a, Sample) else a
    y = b.median if isinstance(b, Sample) else b
    return x / y if y else float("nan")
