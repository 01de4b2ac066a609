"""What one engine call costs per run, at a batch size the group committer reaches under load:
claim, checkpoint_steps and complete_runs called straight from psycopg (no worker), batches
of ``--batch`` runs, median per run.

With ``--sql``, a second schema installed beside the first gets those statements (a file's
name, or SQL text; run with that schema on the search path): the two are measured in turns,
``--rounds`` times, so a change is compared with the functions as installed in one sitting.
For instance, a function rewritten, or the finished-run trigger disabled:

    python bench/batch_cost.py --batch 128
    python bench/batch_cost.py --sql my_claim.sql
    python bench/batch_cost.py --sql "alter table runs disable trigger runs_note_finished"
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flowly
from bench.common import fresh_database
from flowly.config import resolve_dsn


def measure(conn: psycopg.Connection[tuple[object, ...]], schema: str, batch: int,
            batches: int) -> tuple[float, float, float]:
    """Median µs per run of claim, per item of checkpoint_steps, per run of complete_runs."""

    def call(text: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        return conn.execute(sql.SQL(text).format(s=sql.Identifier(schema)), params).fetchall()

    conn.execute(sql.SQL("truncate {}.runs cascade").format(sql.Identifier(schema)))
    call("select {s}.register_worker('w', array['wf'], array['default'], '1 hour')")
    call("select {s}.start('wf', '{{\"a\": 1}}'::jsonb) from generate_series(1, %s)",
         (batch * batches,))
    conn.execute(sql.SQL("vacuum analyze {}.runs").format(sql.Identifier(schema)))
    claims, checkpoints, completions = [], [], []
    now = datetime.now(UTC)
    for _ in range(batches):
        began = time.perf_counter()
        rows = call("select run_id, lease_epoch from {s}.claim('w', array['wf'],"
                    " array['default'], %s, '1 hour')", (batch,))
        claims.append(time.perf_counter() - began)
        ids, epochs = [r[0] for r in rows], [r[1] for r in rows]
        for step in range(3):
            began = time.perf_counter()
            call("select * from {s}.checkpoint_steps(%s, %s, %s, %s, %s, %s, %s)",
                 (ids, epochs, [f"s{step}"] * batch, [str(step)] * batch, [now] * batch,
                  [False] * batch, [step + 1] * batch))
            checkpoints.append(time.perf_counter() - began)
        began = time.perf_counter()
        call("select * from {s}.complete_runs(%s, %s, %s)",
             (ids, epochs, ['{"done": true}'] * batch))
        completions.append(time.perf_counter() - began)
    return tuple(1e6 * statistics.median(t) / batch  # type: ignore[return-value]
                 for t in (claims, checkpoints, completions))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default=os.environ.get("FLOWLY_DSN"))
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sql", help="statements for the second schema: a file, or SQL text")
    args = parser.parse_args()
    dsn = fresh_database(resolve_dsn(args.dsn), "flowly_batch_cost")
    schemas = {"as installed": "flowly"}
    if args.sql:
        schemas[args.sql[-60:]] = "flowly_changed"
    for schema in schemas.values():
        flowly.install_dsn(dsn, schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        if args.sql:
            path = Path(args.sql)
            text = path.read_text() if path.is_file() else args.sql
            conn.execute(sql.SQL("set search_path to flowly_changed; {}").format(sql.SQL(text)))
            conn.execute("reset search_path")
        results: dict[str, list[tuple[float, float, float]]] = {label: [] for label in schemas}
        for _ in range(args.rounds):
            for label, schema in schemas.items():
                results[label].append(measure(conn, schema, args.batch, args.batches))
        print(f"µs per run, batches of {args.batch}, median of {args.rounds} rounds in turns:"
              " claim, checkpoint_steps (per item), complete_runs")
        for label, rounds in results.items():
            claim, checkpoint, complete = (statistics.median(r) for r in zip(*rounds, strict=True))
            print(f"{claim:8.1f} {checkpoint:8.1f} {complete:8.1f}   {label}")


if __name__ == "__main__":
    main()
