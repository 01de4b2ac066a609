"""A flowly worker process for the benchmarks (see bench/common.py for the protocol).

    python -m bench.flowly_child --dsn DSN --workflow bench.three_async --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import threading

import flowly
from bench import workloads  # noqa: F401  (registers the workflows)
from bench.common import child_protocol_ready


async def serve(args: argparse.Namespace) -> None:
    worker = flowly.Worker(args.dsn, args.workflow, concurrency=args.concurrency,
                           poll_interval=args.poll_interval, install_schema=False)
    task = asyncio.create_task(worker.run())
    loop = asyncio.get_running_loop()
    stop: asyncio.Future[str] = loop.create_future()

    def read_stop() -> None:
        line = sys.stdin.readline()
        loop.call_soon_threadsafe(stop.set_result, line)

    # a daemon thread, not the loop's executor: asyncio.run waits for its executor's threads,
    # so a worker that failed (a schema it refuses, say) hung until stdin said stop, and the
    # failure was not printed until then
    threading.Thread(target=read_stop, daemon=True).start()
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
