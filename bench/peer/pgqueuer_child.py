"""pgqueuer (asyncpg driver, batched dequeue) draining one-step jobs of a no-op function.

    python -m bench.peer.pgqueuer_child URL RUNS BATCH_SIZE
"""

from __future__ import annotations

import asyncio
import json
import sys

import asyncpg
from pgqueuer import AsyncpgDriver, Job, Queries, QueueManager

from bench.common import child_protocol_ready


async def setup(url: str, runs: int) -> None:
    conn = await asyncpg.connect(url)
    try:
        queries = Queries(AsyncpgDriver(conn))
        await queries.install()
        step = 5000
        for start in range(0, runs, step):
            n = min(step, runs - start)
            await queries.enqueue(["one"] * n, [None] * n, [0] * n)
        await conn.execute("analyze pgqueuer")
    finally:
        await conn.close()


async def serve(url: str, batch_size: int) -> None:
    conn = await asyncpg.connect(url)
    qm = QueueManager(Queries(AsyncpgDriver(conn)))

    @qm.entrypoint("one")
    async def one(job: Job) -> None:
        return None

    loop = asyncio.get_running_loop()
    stop = loop.run_in_executor(None, sys.stdin.readline)
    run = asyncio.create_task(qm.run(batch_size=batch_size))
    done, _ = await asyncio.wait({run, stop}, return_when=asyncio.FIRST_COMPLETED)
    if run in done:
        run.result()
        return
    qm.shutdown.set()
    await asyncio.wait_for(run, 30)


def main() -> None:
    url, runs, batch_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    asyncio.run(setup(url, runs))
    child_protocol_ready()
    asyncio.run(serve(url, batch_size))
    print(json.dumps({"ok": True}), flush=True)


if __name__ == "__main__":
    main()
