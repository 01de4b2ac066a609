"""What a run costs at a steady rate a worker keeps up with, the way most deployments run.

A drain (bench/throughput.py) finds every run enqueued before the worker starts, so every run
is claimed. At a steady rate below what a worker drains, the worker waits idle between runs
and most runs are handed to it by ``start`` (migration 0030): a different path, with costs
of its own. This starts one-step runs at ``--rate`` a second from this process for
``--seconds``, against one idle worker process, and reports the CPU a run costs the worker
and the whole machine (the server's backends included; this process's own CPU, the load's,
left out), and the share of runs handed off.

With ``--other``, a second checkout's worker takes turns with this one's (A B B A, each on a
database of its own installed by its own code), so a change is compared with the code before
it in one sitting:

    python bench/steady_rate.py --rate 200 --seconds 10 --rounds 3 --other /tmp/base
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import psutil
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flowly
from bench.common import ROOT, Child, CpuMeter, fresh_database, wait_done
from bench.latency_ab import install
from bench.throughput import UNFINISHED
from flowly.config import resolve_dsn

WORKFLOW = "bench.one_async"


def one_round(dsn: str, root: Path, rate: float, seconds: float) -> tuple[float, float, float]:
    """(worker CPU µs a run, machine CPU µs a run, share handed off) of runs started at
    ``rate`` a second for ``seconds`` against a worker of the checkout at ``root``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("truncate flowly.runs cascade")
    child = Child(["-m", "bench.flowly_child", "--dsn", dsn, "--workflow", WORKFLOW,
                   "--concurrency", "64", "--poll-interval", "5"], root=root)
    me = psutil.Process()
    try:
        child.wait_ready()
        child.send("go")
        with flowly.Client(dsn) as client, psycopg.connect(dsn, autocommit=True) as conn:
            time.sleep(1.0)  # the worker is up, listening and idle
            runs = int(rate * seconds)
            mine = sum(me.cpu_times()[:2])
            cpu = CpuMeter([child.pid])
            began = time.perf_counter()
            for number in range(runs):
                pause = began + number / rate - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                client.start(WORKFLOW)
            finished, done = wait_done(dsn, UNFINISHED, time.monotonic() + 60, interval=0.01)
            if not done:
                raise RuntimeError(f"runs of {WORKFLOW} still unfinished a minute after the"
                                   " last start")
            elapsed = finished - began
            worker_cores, machine_busy = cpu.read(elapsed)
            load = sum(me.cpu_times()[:2]) - mine
            handed = conn.execute("select avg((started_at = created_at)::int)::float8"
                                  " from flowly.runs").fetchone()
        child.finish()
    finally:
        child.kill()
    machine = machine_busy * psutil.cpu_count() * elapsed - load
    return (worker_cores * elapsed / runs * 1e6, machine / runs * 1e6,
            handed[0] if handed else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", default=os.environ.get("FLOWLY_DSN"))
    parser.add_argument("--rate", type=float, default=200, help="runs started a second (200)")
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--other", type=Path, help="a second checkout to take turns with")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    server = resolve_dsn(args.dsn)
    roots = {"this": ROOT} | ({"other": args.other.resolve()} if args.other else {})
    dsns = {name: fresh_database(server, f"flowly_bench_rate_{name}") for name in roots}
    for name, root in roots.items():
        install(root, dsns[name])
    order = list(roots) + list(reversed(roots))
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in roots}
    for _ in range(args.rounds):
        for name in order:
            results[name].append(one_round(dsns[name], roots[name], args.rate, args.seconds))
    print(f"{args.rate:.0f} one-step runs a second for {args.seconds:.0f} s, medians of"
          f" {2 * args.rounds if args.other else args.rounds}")
    print(f"{'checkout':<36} {'worker µs/run':>14} {'machine µs/run':>15} {'handed off':>11}")
    for name, rows in results.items():
        worker, machine, handed = (statistics.median(column) for column in zip(*rows, strict=True))
        print(f"{name + ' ' + str(roots[name]):<36.36} {worker:>14.0f} {machine:>15.0f}"
              f" {handed:>11.0%}")


if __name__ == "__main__":
    main()
