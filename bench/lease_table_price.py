"""The price of the runs redesign that bench/RESULTS.md proposes, before building it: what a
claim's write of the wide ``runs`` row costs, beside what a narrow table of claimable runs
(queue, workflow, priority, due time, lease) would cost for the same runs over their lives
(its row inserted at the start, updated by the claim, deleted at the completion).

Plain statements from psycopg, batches of ``--batch`` runs as the group committer sends them,
each in its own transaction, the two layouts in turns; µs per run, median of the rounds. The
wide completion is measured too: both layouts keep it (status, output and finished time stay
on ``runs``).

    python bench/lease_table_price.py --batch 128 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flowly
from bench.common import fresh_database
from flowly.config import resolve_dsn

NARROW_TABLE = """
create table flowly.claimable (
    run_id text primary key,  -- no foreign key: the cheapest form of the table
    queue text not null, workflow text not null, priority integer not null,
    available_at timestamptz not null, status text not null,
    lease_epoch bigint not null default 0, locked_by text, locked_until timestamptz
);
create index claimable_claim on flowly.claimable (queue, workflow, priority desc, available_at)
    where status = 'pending';
"""

STATEMENTS = {
    # what claim writes to runs today (its other reads and the sweep are left out)
    "wide claim update": (
        "update flowly.runs r set status = 'running', lease_epoch = r.lease_epoch + 1,"
        " locked_by = 'w', locked_until = now() + interval '1 hour',"
        " started_at = coalesce(r.started_at, now()) where r.id = any(%s)"),
    "narrow insert (start)": (
        "insert into flowly.claimable (run_id, queue, workflow, priority, available_at, status)"
        " select r.id, r.queue, r.workflow, r.priority, r.scheduled_for, 'pending'"
        " from flowly.runs r where r.id = any(%s)"),
    "narrow update (claim)": (
        "update flowly.claimable c set status = 'running', lease_epoch = c.lease_epoch + 1,"
        " locked_by = 'w', locked_until = now() + interval '1 hour' where c.run_id = any(%s)"),
    "narrow delete (completion)": "delete from flowly.claimable c where c.run_id = any(%s)",
    "wide completion update (both)": (
        "update flowly.runs r set status = 'completed', output = '{\"done\": true}',"
        " finished_at = now(), locked_by = null, locked_until = null where r.id = any(%s)"),
}


def one_round(conn: psycopg.Connection[tuple[object, ...]], batch: int, batches: int
              ) -> dict[str, float]:
    """µs per run of each statement over ``batches`` fresh batches of runs."""
    conn.execute("truncate flowly.runs cascade")
    conn.execute("select flowly.start('wf', '{\"a\": 1}'::jsonb) from generate_series(1, %s)",
                 (batch * batches,))
    conn.execute("vacuum analyze flowly.runs")
    ids = [r[0] for r in conn.execute("select id from flowly.runs order by created_at, id")]
    took: dict[str, list[float]] = {name: [] for name in STATEMENTS}
    for first in range(0, len(ids), batch):
        chunk = ids[first:first + batch]
        for name, statement in STATEMENTS.items():
            began = time.perf_counter()
            conn.execute(statement, (chunk,))
            took[name].append(time.perf_counter() - began)
    return {name: 1e6 * statistics.median(t) / batch for name, t in took.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default=os.environ.get("FLOWLY_DSN"))
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dsn = fresh_database(resolve_dsn(args.dsn), "flowly_lease_price")
    flowly.install_dsn(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(NARROW_TABLE)
        rounds = [one_round(conn, args.batch, args.batches) for _ in range(args.rounds)]
    print(f"µs per run, batches of {args.batch}, median of {args.rounds} rounds:")
    medians = {name: statistics.median(r[name] for r in rounds) for name in STATEMENTS}
    for name, value in medians.items():
        print(f"{value:8.1f}   {name}")
    narrow = sum(v for k, v in medians.items() if k.startswith("narrow"))
    print(f"{narrow:8.1f}   the narrow table over a run's life, against"
          f" {medians['wide claim update']:.1f} for the wide claim update it replaces")


if __name__ == "__main__":
    main()
