"""What one engine call costs per run, at a batch size the group committer reaches under load:
claim, checkpoint_steps and complete_runs called straight from psycopg (no worker), batches
of ``--batch`` runs, median per run. Compare schemas or settings side by side, e.g. with the
finished-run trigger disabled:

    python bench/batch_cost.py --batch 128
    python bench/batch_cost.py --sql \
        "alter table flowly.runs disable trigger runs_note_finished"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flowly
from bench.common import fresh_database
from flowly.config import resolve_dsn


def measure(conn: psycopg.Connection[tuple[object, ...]], batch: int,
            batches: int) -> tuple[float, float, float]:
    """Median µs per run of claim, per item of checkpoint_steps, per run of complete_runs."""
    conn.execute("truncate flowly.runs cascade")
    conn.execute("select flowly.register_worker('w', array['wf'], array['default'], '1 hour')")
    conn.execute("select flowly.start('wf', '{\"a\": 1}'::jsonb)"
                 " from generate_series(1, %s)", (batch * batches,))
    conn.execute("analyze flowly.runs")
    claims, checkpoints, completions = [], [], []
    now = datetime.now(UTC)
    for _ in range(batches):
        began = time.perf_counter()
        rows = conn.execute("select run_id, lease_epoch from flowly.claim('w', array['wf'],"
                            " array['default'], %s, '1 hour')", (batch,)).fetchall()
        claims.append(time.perf_counter() - began)
        ids, epochs = [r[0] for r in rows], [r[1] for r in rows]
        for step in range(3):
            began = time.perf_counter()
            conn.execute("select * from flowly.checkpoint_steps(%s, %s, %s, %s, %s, %s, %s)",
                         (ids, epochs, [f"s{step}"] * batch, [json.dumps(step)] * batch,
                          [now] * batch, [False] * batch, [step + 1] * batch)).fetchall()
            checkpoints.append(time.perf_counter() - began)
        began = time.perf_counter()
        conn.execute("select * from flowly.complete_runs(%s, %s, %s)",
                     (ids, epochs, ['{"done": true}'] * batch)).fetchall()
        completions.append(time.perf_counter() - began)
    return tuple(1e6 * statistics.median(t) / batch  # type: ignore[return-value]
                 for t in (claims, checkpoints, completions))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default=os.environ.get("FLOWLY_DSN"))
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--sql", help="a statement to run after the first measurement,"
                                      " before the second")
    args = parser.parse_args()
    dsn = fresh_database(resolve_dsn(args.dsn), "flowly_batch_cost")
    flowly.install_dsn(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        rounds = [("as installed", None), ("as installed", None)]
        if args.sql:
            rounds += [(args.sql, args.sql), (args.sql, None)]
        print(f"µs per run, batches of {args.batch}: claim, checkpoint_steps (per item),"
              " complete_runs")
        for label, statement in rounds:
            if statement:
                conn.execute(statement)
            claim, checkpoint, complete = measure(conn, args.batch, args.batches)
            print(f"{claim:8.1f} {checkpoint:8.1f} {complete:8.1f}   {label[:60]}")


if __name__ == "__main__":
    main()
