"""flowly and its peers side by side: the same workloads, the same server, one sitting.

- three-step workflows of no-op async steps: flowly and DBOS Transact (dbos);
- three-step workflows of no-op sync steps: flowly and Absurd (absurd-sdk's sync worker);
- one-step jobs: flowly (one-step workflows) and pgqueuer (asyncpg driver, batched dequeue).

Each engine gets a fresh database on the same server and a worker process of its own; N
jobs are enqueued first (untimed), then the worker is told to start and the drain is timed
from here, by polling the engine's tables, until the last job finished. A peer that has not
finished after ``--timeout`` seconds is rated by the jobs it finished by then. Engines take
turns within each repetition, so a noisy neighbour hits them alike.

    python bench/peers.py --runs 2000 --concurrency 64 --repeat 3
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import throughput
from bench.common import Child, CpuMeter, Sample, dsn_to_url, fresh_database, ratio
from flowly.config import resolve_dsn


@dataclass
class Peer:
    name: str
    module: str
    database: str
    done: str  # true once every job finished
    finished: str  # how many jobs finished
    args: Callable[[str, int, int], list[str]]


PEERS = {
    "dbos": Peer(
        "DBOS Transact", "bench.peer.dbos_child", "flowly_bench_dbos",
        "select not exists (select from dbos.workflow_status"
        " where status in ('ENQUEUED', 'PENDING'))",
        "select count(*) from dbos.workflow_status where status = 'SUCCESS'",
        lambda dsn, runs, c: [dsn_to_url(dsn), str(runs), str(c)]),
    "absurd": Peer(
        "Absurd", "bench.peer.absurd_child", "flowly_bench_absurd",
        "select not exists (select from absurd.t_bench where state <> 'completed')",
        "select count(*) from absurd.t_bench where state = 'completed'",
        lambda dsn, runs, c: [dsn, str(runs), str(c)]),
    "pgqueuer": Peer(
        "pgqueuer", "bench.peer.pgqueuer_child", "flowly_bench_pgqueuer",
        "select not exists (select from pgqueuer)",
        "select count(*) from pgqueuer_log where status = 'successful'",
        # pgqueuer's dequeue batch (its concurrency is not bounded otherwise): 128, its best
        # of 10, 16, 64, 128 and 256 here (1,500 jobs/s at 16, about 9,000 at 64 to 256)
        lambda dsn, runs, c: [dsn_to_url(dsn), str(runs), "128"]),
}


def available(name: str) -> str | None:
    """None if the peer's packages import here, else why not."""
    modules = {"dbos": ["dbos"], "absurd": ["absurd_sdk", "absurdctl"],
               "pgqueuer": ["pgqueuer", "asyncpg"]}[name]
    for module in modules:
        try:
            __import__(module)
        except ImportError as exc:
            return f"{module} not installed ({exc}); pip install -e '.[peers]'"
    return None


def drain_peer(server: str, name: str, runs: int, concurrency: int,
               timeout: float) -> throughput.Drain:
    peer = PEERS[name]
    dsn = fresh_database(server, peer.database)
    child = Child(["-m", peer.module, *peer.args(dsn, runs, concurrency)])
    try:
        child.wait_ready(timeout=900)
        cpu = CpuMeter([child.pid])
        with psycopg.connect(dsn, autocommit=True) as conn:
            started = time.perf_counter()
            child.send("go")
            deadline = time.monotonic() + timeout
            while True:
                row = conn.execute(peer.done).fetchone()
                now = time.perf_counter()
                if (row is not None and row[0]) or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            done = bool(row and row[0])
            finished = runs
            if not done:
                count = conn.execute(peer.finished).fetchone()
                finished = count[0] if count else 0
        result = throughput.Drain(finished, now - started, done)
        result.worker_cores, result.machine_busy = cpu.read(result.seconds)
        child.finish()
        return result
    finally:
        child.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", default=os.environ.get("FLOWLY_DSN"))
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--peers", nargs="+", default=list(PEERS))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    server = resolve_dsn(args.dsn)
    flowly_dsn = fresh_database(server, "flowly_bench")
    throughput.prepare(flowly_dsn)
    pairs = {"dbos": "bench.three_async", "absurd": "bench.three_sync",
             "pgqueuer": "bench.one_async"}
    results: dict[str, tuple[Sample, Sample]] = {}
    for _ in range(args.repeat):
        for name in args.peers:
            why = available(name)
            if why:
                print(f"{name}: skipped, {why}")
                continue
            ours, theirs = results.setdefault(name, (Sample(), Sample()))
            ours.add(throughput.drain(flowly_dsn, pairs[name], args.runs,
                                      args.concurrency).rate)
            theirs.add(drain_peer(server, name, args.runs, args.concurrency,
                                  args.timeout).rate)
    print(f"{'workload':>18} {'peer':>14} {'flowly runs/s':>20} {'peer runs/s':>20}"
          f" {'flowly/peer':>11}")
    for name, (ours, theirs) in results.items():
        print(f"{pairs[name]:>18} {PEERS[name].name:>14} {ours.fmt():>20} {theirs.fmt():>20}"
              f" {ratio(ours, theirs):>10.2f}x")


if __name__ == "__main__":
    main()
