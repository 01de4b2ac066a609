"""flowly's throughput: N runs enqueued with one SQL statement, then drained by one or more
worker processes (timed from the worker's start to the last run completed, polled from here).

Also what a worker holds while it drains: its connections to the database (sampled from
pg_stat_activity) and its resident memory (sampled with psutil), for the memory check over
many runs.

    python bench/throughput.py --runs 10000 --concurrency 16 64 256 --workflow bench.three_async
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flowly
from bench.common import Child, CpuMeter, fresh_database
from flowly.config import resolve_dsn

UNFINISHED = ("select not exists (select from flowly.runs"
              " where status in ('pending', 'running', 'compensating'))")
STEPS = {"bench.three_async": 3, "bench.three_sync": 3, "bench.one_async": 1}


@dataclass
class Drain:
    runs: int
    seconds: float
    done: bool
    max_connections: int = 0
    rss: list[tuple[int, int]] = field(default_factory=list)  # (completed runs, bytes)
    worker_cores: float = 0.0  # CPU the worker processes used, in cores
    machine_busy: float = 0.0  # the whole machine's CPU use, 0..1 (the server's share too)

    @property
    def rate(self) -> float:
        return self.runs / self.seconds

    @property
    def worker_us_per_run(self) -> float:
        """The engine's worker processes' CPU per run finished, in microseconds."""
        return self.worker_cores / self.rate * 1e6

    @property
    def machine_us_per_run(self) -> float:
        """The whole machine's CPU (workers, server backends, everything else) per run."""
        return self.machine_busy * (os.cpu_count() or 1) / self.rate * 1e6


def prepare(dsn: str) -> None:
    flowly.install_dsn(dsn)


def enqueue(dsn: str, workflow: str, runs: int, inp: Any = None) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("truncate flowly.runs cascade")
        conn.execute("select flowly.start(%s, input => %s::jsonb) from generate_series(1, %s)",
                     (workflow, psycopg.types.json.Jsonb(inp), runs))
        conn.execute("analyze flowly.runs")


def drain(dsn: str, workflow: str, runs: int, concurrency: int, processes: int = 1,
          timeout: float = 600, sample_rss: bool = False, inp: Any = None) -> Drain:
    """Enqueue ``runs`` runs of ``workflow``, then time ``processes`` worker processes
    draining them. Runs not finished after ``timeout`` seconds: the rate counts those done."""
    enqueue(dsn, workflow, runs, inp)
    children = [Child(["-m", "bench.flowly_child", "--dsn", dsn, "--workflow", workflow,
                       "--concurrency", str(concurrency)]) for _ in range(processes)]
    try:
        for child in children:
            child.wait_ready()
        watched = psutil.Process(children[0].pid)
        result = Drain(runs, 0.0, False)
        last_rss = 0.0

        cpu = CpuMeter([child.pid for child in children])
        with psycopg.connect(dsn, autocommit=True) as conn:
            started = time.perf_counter()
            for child in children:
                child.send("go")
            deadline = time.monotonic() + timeout
            while True:
                row = conn.execute(UNFINISHED).fetchone()
                now = time.perf_counter()
                if row is not None and row[0]:
                    result.done = True
                    break
                if time.monotonic() > deadline:
                    break
                active = conn.execute("select count(*) from pg_stat_activity"
                                      " where datname = current_database()").fetchone()
                result.max_connections = max(result.max_connections,
                                             (active[0] if active else 0) - 1)
                if sample_rss and now - last_rss >= 0.5:
                    last_rss = now
                    completed = conn.execute("select count(*) from flowly.runs"
                                             " where status = 'completed'").fetchone()
                    result.rss.append((completed[0] if completed else 0,
                                       watched.memory_info().rss))
                time.sleep(0.02)
            result.seconds = now - started
            result.worker_cores, result.machine_busy = cpu.read(result.seconds)
            if not result.done:
                row = conn.execute("select count(*) from flowly.runs"
                                   " where status = 'completed'").fetchone()
                result.runs = row[0] if row else 0
            else:
                row = conn.execute("select count(*) from flowly.runs"
                                   " where status <> 'completed'").fetchone()
                if row and row[0]:
                    raise RuntimeError(f"{row[0]} runs of {workflow} did not complete")
            if sample_rss:
                result.rss.append((result.runs, watched.memory_info().rss))
        for child in children:
            child.finish()
        return result
    finally:
        for child in children:
            child.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", default=os.environ.get("FLOWLY_DSN"))
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--workflow", nargs="+",
                        default=["bench.three_async", "bench.three_sync", "bench.one_async"])
    parser.add_argument("--processes", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    dsn = fresh_database(resolve_dsn(args.dsn), "flowly_bench")
    prepare(dsn)
    print(f"{'workflow':>18} {'procs':>5} {'concurrency':>11} {'runs':>6} {'seconds':>8}"
          f" {'runs/s':>8} {'steps/s':>8} {'conns':>5} {'worker CPU':>10} {'machine':>7}")
    for workflow in args.workflow:
        for concurrency in args.concurrency:
            d = drain(dsn, workflow, args.runs, concurrency, args.processes)
            print(f"{workflow:>18} {args.processes:>5} {concurrency:>11} {d.runs:>6}"
                  f" {d.seconds:>8.2f} {d.rate:>8.0f} {STEPS[workflow] * d.rate:>8.0f}"
                  f" {d.max_connections:>5} {d.worker_cores:>10.2f} {d.machine_busy:>7.0%}")


if __name__ == "__main__":
    main()
