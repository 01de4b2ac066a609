"""Throughput of three-step workflows on one worker process.

Enqueues N runs of ``bench.three_steps`` with one SQL statement, starts a worker in this
process and measures how long it takes until every run is completed, for each concurrency
given. Prints runs/s and steps/s per setting so settings compare side by side in one run.

    python bench/throughput.py --runs 5000 --concurrency 64 256
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flowly
from flowly.config import resolve_dsn


async def _step(value: int) -> int:
    return value + 1


@flowly.workflow("bench.three_steps")
async def three_steps(ctx: flowly.Context, inp: Any) -> int:
    total = 0
    for name in ("one", "two", "three"):
        total = await ctx.step(name, _step, total)
    return int(total)


async def measure(dsn: str, runs: int, concurrency: int) -> float:
    # an async connection, so watching for the end never blocks the worker's event loop
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("delete from flowly.runs where workflow = 'bench.three_steps'")
        await conn.execute(
            "select flowly.start('bench.three_steps') from generate_series(1, %s)", (runs,))
        worker = flowly.Worker(dsn, ["bench.three_steps"], concurrency=concurrency,
                               poll_interval=0.05)
        started = time.perf_counter()
        task = asyncio.create_task(worker.run())
        while True:
            await asyncio.sleep(0.05)
            cursor = await conn.execute(
                "select exists (select from flowly.runs where workflow = 'bench.three_steps'"
                " and status <> 'completed')")
            row = await cursor.fetchone()
            if row is not None and not row[0]:
                break
        elapsed = time.perf_counter() - started
        worker.stop()
        await task
        return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", default=os.environ.get("FLOWLY_DSN"))
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    dsn = resolve_dsn(args.dsn)
    flowly.install_dsn(dsn)
    print(f"{'concurrency':>11} {'runs':>6} {'seconds':>8} {'runs/s':>8} {'steps/s':>8}")
    for concurrency in args.concurrency:
        elapsed = asyncio.run(measure(dsn, args.runs, concurrency))
        print(f"{concurrency:>11} {args.runs:>6} {elapsed:>8.2f} {args.runs / elapsed:>8.0f}"
              f" {3 * args.runs / elapsed:>8.0f}")


if __name__ == "__main__":
    main()
