"""Latency of one three-step workflow on an idle worker, from enqueue to completion.

Starts runs one at a time (each after the previous finished) so every run wakes an idle
worker through NOTIFY, and reads the end-to-end time from the database's own timestamps
(``finished_at - created_at``), so client polling does not distort it.

    python bench/latency.py --runs 200
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flowly
from bench.throughput import three_steps
from flowly.config import resolve_dsn


async def measure(dsn: str, runs: int) -> list[float]:
    worker = flowly.Worker(dsn, [three_steps], concurrency=8, poll_interval=5)
    task = asyncio.create_task(worker.run())
    async with flowly.AsyncClient(dsn) as client:
        await asyncio.sleep(0.5)  # the worker is up and idle
        ids = []
        for _ in range(runs):
            run_id = await client.start(three_steps)
            await client.wait(run_id, timeout=30)
            ids.append(run_id)
    worker.stop()
    await task
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cursor = await conn.execute(
            "select extract(epoch from finished_at - created_at) * 1000 from flowly.runs"
            " where id = any(%s)", (ids,))
        return [float(row[0]) for row in await cursor.fetchall()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", default=os.environ.get("FLOWLY_DSN"))
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    dsn = resolve_dsn(args.dsn)
    flowly.install_dsn(dsn)
    millis = sorted(asyncio.run(measure(dsn, args.runs)))
    quantiles = statistics.quantiles(millis, n=100)
    print(f"{'runs':>6} {'p50_ms':>8} {'p95_ms':>8} {'p99_ms':>8} {'max_ms':>8}")
    print(f"{len(millis):>6} {quantiles[49]:>8.1f} {quantiles[94]:>8.1f} {quantiles[98]:>8.1f}"
          f" {millis[-1]:>8.1f}")


if __name__ == "__main__":
    main()
