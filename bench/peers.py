"""flowly and DBOS Transact side by side: the same three-step workflows, the same database.

Each engine gets a fresh database on the same server. N workflows of three no-op async steps
are enqueued one by one through the engine's own client API (timed: enqueues/s), then one
worker of the engine, at the same concurrency, drains them (timed from worker start to the
last completion: runs/s). DBOS runs in a child process (it keeps global state).

    python bench/peers.py --runs 2000 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flowly
from bench.throughput import three_steps
from flowly.config import resolve_dsn


def fresh_database(dsn: str, name: str) -> str:
    """Drop and create database ``name`` on the server of ``dsn``; return its DSN."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("drop database if exists {} with (force)").format(
            sql.Identifier(name)))
        conn.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    return make_conninfo(dsn, dbname=name)


def wait_until_done(dsn: str, query: str, runs: int) -> float:
    """Poll ``query`` (a count of finished runs) until it reaches ``runs``; returns the time."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            row = conn.execute(query).fetchone()
            if row is not None and row[0] >= runs:
                return time.perf_counter()
            time.sleep(0.02)


def run_flowly(dsn: str, runs: int, concurrency: int) -> tuple[float, float]:
    """Enqueue ``runs`` through Client.start (timed), then time one worker draining them."""
    flowly.install_dsn(dsn)
    with flowly.Client(dsn) as client:
        started = time.perf_counter()
        for _ in range(runs):
            client.start(three_steps)
        enqueue_seconds = time.perf_counter() - started

    async def drain() -> float:
        worker = flowly.Worker(dsn, [three_steps], concurrency=concurrency, poll_interval=0.05)
        started = time.perf_counter()
        task = asyncio.create_task(worker.run())
        finished = await asyncio.to_thread(
            wait_until_done, dsn,
            "select count(*) from flowly.runs where status = 'completed'", runs)
        worker.stop()
        await task
        return finished - started

    return enqueue_seconds, asyncio.run(drain())


DBOS_CHILD = """
import asyncio, json, sys, time
import psycopg
from dbos import DBOS, DBOSClient

url, dsn, runs, concurrency = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
DBOS(config={"name": "flowly-bench-peer", "system_database_url": url, "log_level": "WARNING",
             "application_version": "bench"})

@DBOS.step()
async def add_one(value: int) -> int:
    return value + 1

@DBOS.workflow()
async def three_steps() -> int:
    total = 0
    for _ in range(3):
        total = await add_one(total)
    return total

def finished() -> float:
    with psycopg.connect(dsn, autocommit=True) as conn:
        while conn.execute("select count(*) from dbos.workflow_status"
                           " where status = 'SUCCESS'").fetchone()[0] < runs:
            time.sleep(0.02)
    return time.perf_counter()

async def main() -> tuple[float, float]:
    DBOS.launch()
    client = DBOSClient(system_database_url=url)
    options = {"queue_name": "bench", "workflow_name": three_steps.__qualname__,
               "app_version": "bench"}
    started = time.perf_counter()
    for _ in range(runs):
        client.enqueue(options)
    enqueue_seconds = time.perf_counter() - started
    started = time.perf_counter()
    # the queue starts dequeuing once registered, like a flowly worker once started
    await DBOS.register_queue_async("bench", worker_concurrency=concurrency,
                                    polling_interval_sec=0.05)
    return enqueue_seconds, await asyncio.to_thread(finished) - started

print(json.dumps(asyncio.run(main())))
DBOS.destroy()
"""


def run_dbos(dsn: str, runs: int, concurrency: int) -> tuple[float, float]:
    """The same in a DBOS child process: DBOSClient.enqueue (timed), then one queue worker."""
    params = conninfo_to_dict(dsn)
    host = str(params.get("host", "127.0.0.1"))
    user = params.get("user", "postgres")
    port = params.get("port", 5432)
    url = (f"postgresql://{user}@/{params['dbname']}?host={host}&port={port}"
           if host.startswith("/") else f"postgresql://{user}@{host}:{port}/{params['dbname']}")
    done = subprocess.run(
        [sys.executable, "-c", DBOS_CHILD, url, dsn, str(runs), str(concurrency)],
        capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the DBOS run failed:\n{done.stderr[-3000:]}")
    enqueue_seconds, drain_seconds = json.loads(done.stdout.strip().splitlines()[-1])
    return float(enqueue_seconds), float(drain_seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", default=os.environ.get("FLOWLY_DSN"))
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    server = resolve_dsn(args.dsn)
    results = {
        "flowly": run_flowly(fresh_database(server, "flowly_bench_peer_flowly"), args.runs,
                             args.concurrency),
        "dbos": run_dbos(fresh_database(server, "flowly_bench_peer_dbos"), args.runs,
                         args.concurrency),
    }
    print(f"{'engine':>8} {'runs':>6} {'enqueue/s':>10} {'runs/s':>8}")
    for name, (enqueue_seconds, drain_seconds) in results.items():
        print(f"{name:>8} {args.runs:>6} {args.runs / enqueue_seconds:>10.0f}"
              f" {args.runs / drain_seconds:>8.0f}")
    (flowly_enqueue, flowly_drain), (dbos_enqueue, dbos_drain) = results.values()
    print(f"flowly / dbos: enqueue {dbos_enqueue / flowly_enqueue:.2f}x,"
          f" runs {dbos_drain / flowly_drain:.2f}x")


if __name__ == "__main__":
    main()
