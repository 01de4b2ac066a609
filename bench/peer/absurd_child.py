"""Absurd (absurd-sdk, sync API) draining three-step tasks of no-op steps.

The schema is the ``absurd.sql`` that the ``absurdctl`` package bundles (what
``absurdctl init`` applies), run through psycopg, so no psql is needed.

    python -m bench.peer.absurd_child DSN RUNS CONCURRENCY
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

import psycopg
from absurd_sdk import Absurd
from absurdctl import BUNDLED_SCHEMA_SQL

from bench.common import child_protocol_ready

QUEUE = "bench"


def main() -> None:
    dsn, runs, concurrency = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("drop schema if exists absurd cascade")
        conn.execute(BUNDLED_SCHEMA_SQL)  # type: ignore[arg-type]
        conn.execute("select absurd.create_queue(%s)", (QUEUE,))
        conn.execute("select absurd.spawn_task(%s, 'three', '{}'::jsonb)"
                     " from generate_series(1, %s)", (QUEUE, runs))
        conn.execute(f"analyze absurd.t_{QUEUE}, absurd.r_{QUEUE}")

    app = Absurd(dsn, queue_name=QUEUE)

    @app.register_task(name="three")
    def three(params: Any, ctx: Any) -> int:
        total = 0
        for name in ("one", "two", "three"):
            total = ctx.step(name, lambda current=total: current + 1)
        return total

    child_protocol_ready()
    thread = threading.Thread(
        target=app.start_worker,
        kwargs={"concurrency": concurrency, "poll_interval": 0.05}, daemon=True)
    thread.start()
    sys.stdin.readline()
    app.stop_worker()
    thread.join(timeout=30)
    print(json.dumps({"ok": True}), flush=True)


if __name__ == "__main__":
    main()
