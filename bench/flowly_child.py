"""A flowly worker process for the benchmarks (see bench/common.py for the protocol).

    python -m bench.flowly_child --dsn DSN --workflow bench.three_async --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

import flowly
from bench import workloads  # noqa: F401  (registers the workflows)
from bench.common import child_protocol_ready


async def serve(args: argparse.Namespace) -> None:
    worker = flowly.Worker(args.dsn, args.workflow, concurrency=args.concurrency,
                           poll_interval=args.poll_interval, install_schema=False)
    task = asyncio.create_task(worker.run())
    loop = asyncio.get_running_loop()
    stop = loop.run_in_executor(None, sys.stdin.readline)
    done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()  # a worker that died says why
        return
    worker.stop()
    await task


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--workflow", nargs="+", required=True)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--poll-interval", type=float, default=0.5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    child_protocol_ready()
    asyncio.run(serve(args))
    print(json.dumps({"ok": True}), flush=True)


if __name__ == "__main__":
    main()
