"""The floor under the enqueue -> first step latency: how long this machine takes from a
client's call to a NOTIFY reaching a listening connection in another process (as a worker's
listener is), for what the call writes before it notifies.

Kinds of call, taken in turns, each after a pause (as a start on an idle system is):

- a bare NOTIFY (no write, so no WAL flush at commit);
- a one-row insert into a small table, then the NOTIFY;
- the row a hand-off writes, inserted straight into ``flowly.runs``, then the NOTIFY;
- ``flowly.start`` with no worker offering a slot (it notifies the wake-up channel);
- ``flowly.start`` handed off to an offered slot (it notifies the slot's channel).

    python bench/latency_floor.py --rounds 150
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flowly
from bench.common import fresh_database
from flowly.config import resolve_dsn

FLOOR_CHANNEL, SLOT_CHANNEL = "flowly_bench_floor", "flowly_bench_slot"

# the listener: prints "ready", then one JSON line of (payload, arrival time) at "stop"
LISTENER = f"""
import json, sys, time
import psycopg
conn = psycopg.connect(sys.argv[1], autocommit=True)
wakeup = conn.execute("select flowly.wakeup_channel()").fetchone()[0]
for channel in ({FLOOR_CHANNEL!r}, {SLOT_CHANNEL!r}, wakeup):
    conn.execute(f'listen "{{channel}}"')
print("ready", flush=True)
arrivals = []
for notification in conn.notifies():
    if notification.payload == "stop":
        break
    arrivals.append(time.time())
print(json.dumps(arrivals), flush=True)
"""

CALLS = {
    "a bare NOTIFY": f"select pg_notify('{FLOOR_CHANNEL}', 'n')",
    "a small-table insert + NOTIFY":
        "with i as (insert into bench_floor_rows (at) values (now()))"
        f" select pg_notify('{FLOOR_CHANNEL}', 'n')",
    "a flowly.runs insert + NOTIFY":
        "with i as (insert into flowly.runs (id, workflow, queue, input, priority,"
        " scheduled_for, max_attempts, status, lease_epoch, locked_by, locked_until, started_at)"
        " values (gen_random_uuid()::text, 'bench.floor', 'default', 'null', 0, now(), 3,"
        " 'running', 1, 'bench-floor', now() + interval '5 seconds', now()))"
        f" select pg_notify('{FLOOR_CHANNEL}', 'n')",
    "flowly.start, no hand-off": "select flowly.start('bench.floor')",
    # another workflow: the runs the start above leaves pending would be due ahead of it,
    # and start hands off no run that would overtake a due one
    "flowly.start, handed off": "select flowly.start('bench.floor.handed')",
}


def measure(dsn: str, rounds: int, pause: float) -> dict[str, list[float]]:
    """ms from each call to its NOTIFY's arrival in the listener, by kind of call."""
    listener = subprocess.Popen([sys.executable, "-c", LISTENER, dsn], stdout=subprocess.PIPE,
                                text=True)
    assert listener.stdout is not None
    try:
        assert listener.stdout.readline().strip() == "ready"
        with psycopg.connect(dsn, autocommit=True) as conn, \
                psycopg.connect(dsn, autocommit=True) as worker:
            conn.execute("create table bench_floor_rows (at timestamptz)")
            worker.execute("select flowly.register_worker('bench-floor',"
                           " array['bench.floor.handed'], array['default'], '1 minute')")
            called: list[tuple[str, float]] = []
            handed = 0
            for _ in range(rounds):
                for kind, call in CALLS.items():
                    if kind.endswith("handed off"):  # a slot offered, as an idle worker does
                        worker.execute("select * from flowly.claim_and_offer('bench-floor',"
                                       " array['bench.floor.handed'], array['default'], 8,"
                                       " '1 minute', %s)", (SLOT_CHANNEL,)).fetchall()
                    else:
                        worker.execute("delete from flowly.handoff_slots")
                    time.sleep(pause)
                    called.append((kind, time.time()))
                    row = conn.execute(call).fetchone()
                    if kind.endswith("handed off"):
                        # it was, and it goes: its lease must not lapse, making it due ahead
                        # of the next one
                        assert row is not None
                        handed += worker.execute(
                            "delete from flowly.runs where id = %s and started_at = created_at",
                            row).rowcount
            conn.execute(f"select pg_notify('{FLOOR_CHANNEL}', 'stop')")
        assert handed == rounds, f"{handed} of {rounds} starts were handed off"
        arrivals = json.loads(listener.stdout.readline())
    finally:
        listener.kill()
    assert len(arrivals) == len(called), "a call's NOTIFY went missing"
    millis: dict[str, list[float]] = {kind: [] for kind in CALLS}
    for (kind, at), arrived in zip(called, arrivals, strict=True):
        millis[kind].append((arrived - at) * 1000)
    return millis


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", default=os.environ.get("FLOWLY_DSN"))
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--pause", type=float, default=0.01, help="seconds before each call")
    args = parser.parse_args()
    dsn = fresh_database(resolve_dsn(args.dsn), "flowly_bench_floor")
    flowly.install_dsn(dsn)
    print(f"{'call -> NOTIFY in another process, ms':<40} {'p50':>7} {'p95':>7}")
    for kind, values in measure(dsn, args.rounds, args.pause).items():
        cuts = statistics.quantiles(values, n=20)
        print(f"{kind:<40} {statistics.median(values):>7.3f} {cuts[18]:>7.3f}")


if __name__ == "__main__":
    main()
