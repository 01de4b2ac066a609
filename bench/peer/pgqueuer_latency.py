"""pgqueuer's enqueue -> job start on an idle consumer, one job at a time (the consumer and
the enqueuer share this process; NOTIFY goes through the server all the same).

    python -m bench.peer.pgqueuer_latency URL RUNS
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import asyncpg
from pgqueuer import AsyncpgDriver, Job, Queries, QueueManager

from bench.common import child_protocol_ready


async def measure(url: str, runs: int) -> tuple[list[float], list[float]]:
    setup = await asyncpg.connect(url)
    await Queries(AsyncpgDriver(setup)).install()
    consumer = await asyncpg.connect(url)
    qm = QueueManager(Queries(AsyncpgDriver(consumer)))
    ran: asyncio.Queue[float] = asyncio.Queue()

    @qm.entrypoint("latency")
    async def latency(job: Job) -> None:
        ran.put_nowait(time.time())

    task = asyncio.create_task(qm.run(batch_size=10))
    await asyncio.sleep(1.0)  # idle and listening
    queries = Queries(AsyncpgDriver(setup))
    millis, enqueue_millis = [], []
    for _ in range(runs):
        before = time.time()
        await queries.enqueue("latency", None)
        enqueue_millis.append((time.time() - before) * 1000)
        started = await asyncio.wait_for(ran.get(), 30)
        millis.append((started - before) * 1000)
        await asyncio.sleep(0.01)
    qm.shutdown.set()
    await asyncio.wait_for(task, 30)
    await setup.close()
    return millis, enqueue_millis


def main() -> None:
    url, runs = sys.argv[1], int(sys.argv[2])
    child_protocol_ready()
    millis, enqueue_millis = asyncio.run(measure(url, runs))
    sys.stdin.readline()
    print(json.dumps({"ms": millis, "enqueue_ms": enqueue_millis}), flush=True)


if __name__ == "__main__":
    main()
