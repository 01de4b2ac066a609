"""DBOS Transact draining three-step workflows of no-op async steps from a queue.

Enqueued through DBOSClient.enqueue before the queue is registered; registering it (on go)
starts the dequeuing, like a flowly worker's start.

    python -m bench.peer.dbos_child URL RUNS CONCURRENCY
"""

from __future__ import annotations

import asyncio
import json
import sys

from dbos import DBOS, DBOSClient

from bench.common import child_protocol_ready

url, runs, concurrency = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
DBOS(config={"name": "flowly-bench-peer", "system_database_url": url,
             "log_level": "WARNING", "application_version": "bench"})


@DBOS.step()
async def add_one(value: int) -> int:
    return value + 1


@DBOS.workflow()
async def three_steps() -> int:
    total = 0
    for _ in range(3):
        total = await add_one(total)
    return total


async def main() -> None:
    DBOS.launch()
    client = DBOSClient(system_database_url=url)
    options = {"queue_name": "bench", "workflow_name": three_steps.__qualname__,
               "app_version": "bench"}
    for _ in range(runs):
        client.enqueue(options)  # type: ignore[arg-type]
    client.destroy()
    await asyncio.to_thread(child_protocol_ready)
    await DBOS.register_queue_async("bench", worker_concurrency=concurrency,
                                    polling_interval_sec=0.05)
    await asyncio.to_thread(sys.stdin.readline)


asyncio.run(main())
print(json.dumps({"ok": True}), flush=True)
DBOS.destroy()
