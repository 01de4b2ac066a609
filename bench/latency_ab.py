"""Idle latency of two checkouts of flowly, call by call in turns.

Each checkout gets a database of its own on one server, installed by its own code, and an idle
worker process run from its own code (bench/flowly_child.py, poll interval 5 s: the hand-off's
NOTIFY is what wakes it). This process starts one run of ``bench.first_async_step_time`` at a
time on each, the two in a random order every round, and waits for it, as bench/latency.py
does. The turns are taken call by call, not batch by batch, so a shared machine whose speed
drifts weighs on both alike: on this one, that is what tells a change of a tenth of a
millisecond from the noise. The client is this checkout's for both: a change to the client
itself is not measured here.

    python bench/latency_ab.py --runs 400 /tmp/other-checkout
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flowly
from bench.common import ROOT, Child, fresh_database
from bench.latency import ASYNC_STEP, quantiles
from flowly.config import resolve_dsn


def install(root: Path, dsn: str) -> None:
    """The schema of the checkout at ``root``, installed by its own code."""
    subprocess.run([sys.executable, "-c", "import sys, flowly; flowly.install_dsn(sys.argv[1])",
                    dsn], check=True, capture_output=True, cwd=root,
                   env={**os.environ, "PYTHONPATH": str(root)})


def in_turns(server: str, roots: dict[str, Path], runs: int
             ) -> dict[str, tuple[list[float], list[float]]]:
    """(enqueue -> first step ms, the ``start`` call alone ms) of ``runs`` runs on each
    checkout, named as in ``roots``."""
    dsns = {name: fresh_database(server, f"flowly_bench_ab_{name}") for name in roots}
    children: dict[str, Child] = {}
    clients: dict[str, flowly.Client] = {}
    samples: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in roots}
    try:
        for name, root in roots.items():
            install(root, dsns[name])
            children[name] = Child(["-m", "bench.flowly_child", "--dsn", dsns[name],
                                    "--workflow", ASYNC_STEP, "--concurrency", "8",
                                    "--poll-interval", "5"], root=root)
            children[name].wait_ready()
            children[name].send("go")
            clients[name] = flowly.Client(dsns[name])
        time.sleep(1.0)  # the workers are up, listening and idle
        names = list(roots)
        for _ in range(runs):
            random.shuffle(names)
            for name in names:
                time.sleep(0.01)
                before = time.time()
                run_id = clients[name].start(ASYNC_STEP)
                samples[name][1].append((time.time() - before) * 1000)
                run = clients[name].wait(run_id, timeout=30)
                assert run.status == "completed", run
                samples[name][0].append((float(run.output) - before) * 1000)
        for child in children.values():
            child.finish()
    finally:
        for client in clients.values():
            client.close()
        for child in children.values():
            child.kill()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("other", type=Path, help="the other checkout (its root folder)")
    parser.add_argument("--dsn", default=os.environ.get("FLOWLY_DSN"))
    parser.add_argument("--runs", type=int, default=400)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    roots = {"this": ROOT, "other": args.other.resolve()}
    samples = in_turns(resolve_dsn(args.dsn), roots, args.runs)
    print(f"{'ms, in turns call by call':<34} {'p50':>7} {'p95':>7} {'start() p50':>12}")
    for name, (first, started) in samples.items():
        q = quantiles(first)
        print(f"{name + ' ' + str(roots[name]):<34.34} {q['p50']:>7.2f} {q['p95']:>7.2f}"
              f" {statistics.median(started):>12.2f}")
    this, other = (statistics.median(samples[n][0]) for n in ("this", "other"))
    print(f"enqueue -> first step p50, this / other: {this / other:.3f}")


if __name__ == "__main__":
    main()
