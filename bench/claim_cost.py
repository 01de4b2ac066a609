"""What a claim costs as history piles up: empty tables against 1M finished runs, 300k sleeping
runs in the claimed queue and 300k due runs of another queue; what a start handed off to an
idle worker costs over the same history (it looks for a due run ahead of it); and what
claiming a run with a 10,000-step history costs against a fresh run (and reading its first
replay page).

Two schemas of its own (dropped afterwards), one empty and one loaded, measured in turns, so
both see the same machine. Each figure is the median of many timed ``claim`` calls, each
handing out ``--limit`` freshly started runs.

    python bench/claim_cost.py [--finished 1000000 --sleeping 300000 --foreign 300000]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flowly
from flowly.config import resolve_dsn

EMPTY, LOADED = "flowly_bench_claim_empty", "flowly_bench_claim_loaded"


def _q(text: str, schema: str = LOADED) -> sql.Composed:
    return sql.SQL(text).format(s=sql.Identifier(schema))


def claim_ms(conn: psycopg.Connection[Any], schema: str, limit: int) -> float:
    """Start ``limit`` runs, claim them, complete them; how long the claim took, in ms."""
    conn.execute(_q("select {s}.start('bench') from generate_series(1, %s)", schema), (limit,))
    started = time.perf_counter()
    claimed = conn.execute(_q("select run_id, lease_epoch from {s}.claim('w', array['bench'],"
                              " array['default'], %s, '1 hour')", schema), (limit,)).fetchall()
    elapsed = (time.perf_counter() - started) * 1000
    assert len(claimed) == limit, claimed
    conn.execute(_q("select {s}.complete_runs(%s, %s, %s::jsonb[])", schema),
                 ([c[0] for c in claimed], [c[1] for c in claimed], ["null"] * limit))
    return elapsed


def handoff_start_ms(conn: psycopg.Connection[Any], schema: str) -> float:
    """Offer a slot as an idle worker does, start a run that takes it (checking first that no
    run is due ahead of it), complete the run; how long the start took, in ms. The worker is
    registered first: a start hands its run only to a registered worker's slot."""
    conn.execute(_q("select {s}.register_worker('idle', array['bench'], array['default'],"
                    " '1 hour')", schema))
    conn.execute(_q("select * from {s}.claim_and_offer('idle', array['bench'], array['default'],"
                    " 1, '1 hour', 'idle_channel')", schema)).fetchall()
    started = time.perf_counter()
    run_id = conn.execute(_q("select {s}.start('bench')", schema)).fetchone()[0]
    elapsed = (time.perf_counter() - started) * 1000
    handed = conn.execute(_q("select locked_by, lease_epoch from {s}.runs where id = %s",
                             schema), (run_id,)).fetchone()
    assert handed == ("idle", 1), f"the start was not handed off: {handed}"
    conn.execute(_q("select {s}.complete_runs(array[%s], array[1::bigint], array['null'::jsonb])",
                    schema), (run_id,))
    return elapsed


def load_history(conn: psycopg.Connection[Any], finished: int, sleeping: int,
                 foreign: int) -> None:
    conn.execute(_q("""
        insert into {s}.runs (id, workflow, status, created_at, started_at, finished_at, output)
        select 'done-' || g, 'bench', 'completed', now() - interval '1 day',
               now() - interval '1 day', now() - interval '1 day', '1'
        from generate_series(1, %s) g"""), (finished,))
    conn.execute(_q("""
        insert into {s}.runs (id, workflow, scheduled_for)
        select 'sleeping-' || g, 'bench', now() + interval '1 day'
        from generate_series(1, %s) g"""), (sleeping,))
    conn.execute(_q("""
        insert into {s}.runs (id, workflow, queue)
        select 'foreign-' || g, 'bench', 'other' from generate_series(1, %s) g"""), (foreign,))
    conn.execute(_q("vacuum analyze {s}.runs"))


def long_run_claim_ms(conn: psycopg.Connection[Any], steps: int,
                      rounds: int) -> tuple[float, float, float]:
    """Claim (taking over an expired lease) of a run with ``steps`` checkpoints against the
    same for a run with no history, in turns; and reading the long run's first replay page.
    Medians in ms."""
    conn.execute(_q("select {s}.start('long', run_id => 'long')"))
    epoch = conn.execute(_q("select lease_epoch from {s}.claim('w', array['long'],"
                            " array['default'], 1, '1 hour')")).fetchone()[0]
    conn.execute(_q("""
        select {s}.checkpoint_steps(array_fill('long'::text, array[%(n)s]),
            array_fill(%(e)s::bigint, array[%(n)s]),
            array(select 'step-' || i from generate_series(1, %(n)s) i),
            array(select jsonb_build_object('i', i, 'pad', repeat('x', 300))
                  from generate_series(1, %(n)s) i),
            array_fill(now(), array[%(n)s]), array_fill(false, array[%(n)s]),
            array(select i from generate_series(1, %(n)s) i))"""), {"n": steps, "e": epoch})
    conn.execute(_q("vacuum analyze {s}.steps"))

    conn.execute(_q("select {s}.start('fresh', run_id => 'fresh')"))
    # a live holder: taking its runs over is no poison evidence, however often
    conn.execute(_q("select {s}.register_worker('w', array['long', 'fresh'], array['default'],"
                    " '1 day')"))

    def claim_one(run_id: str, workflow: str) -> float:
        conn.execute(_q("update {s}.runs set locked_until = now() - interval '1 s'"
                        " where id = %s"), (run_id,))
        started = time.perf_counter()
        claimed = conn.execute(_q("select run_id from {s}.claim('w', array[%s],"
                                  " array['default'], 1, '1 hour')"), (workflow,)).fetchall()
        elapsed = (time.perf_counter() - started) * 1000
        assert claimed == [(run_id,)], claimed
        return elapsed

    def first_page() -> float:
        started = time.perf_counter()
        conn.execute(_q("select * from {s}.replay('long', 0, 500)")).fetchall()
        return (time.perf_counter() - started) * 1000

    long_ms, fresh_ms, page_ms = [], [], []
    for _ in range(rounds):
        long_ms.append(claim_one("long", "long"))
        fresh_ms.append(claim_one("fresh", "fresh"))
        page_ms.append(first_page())
    return statistics.median(long_ms), statistics.median(fresh_ms), statistics.median(page_ms)


def measure(dsn: str, finished: int = 1_000_000, sleeping: int = 300_000,
            foreign: int = 300_000, steps: int = 10_000, rounds: int = 200,
            limit: int = 10) -> dict[str, float]:
    """Median claim times in ms: ``empty``, ``loaded`` (history of ``finished`` runs and
    more), ``fresh`` and ``long`` (one run, ``steps`` checkpoints), ``page``; and of a start
    handed off to an idle worker: ``start_empty``, ``start_loaded``."""
    schemas = (EMPTY, LOADED)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for schema in schemas:
            conn.execute(sql.SQL("drop schema if exists {} cascade").format(
                sql.Identifier(schema)))
            flowly.install(conn, schema)
        try:
            load_history(conn, finished, sleeping, foreign)
            timings: dict[str, list[float]] = {schema: [] for schema in schemas}
            handoffs: dict[str, list[float]] = {schema: [] for schema in schemas}
            for _ in range(rounds):
                for schema in schemas:
                    timings[schema].append(claim_ms(conn, schema, limit))
                    handoffs[schema].append(handoff_start_ms(conn, schema))
            empty, loaded = (statistics.median(timings[schema]) for schema in schemas)
            start_empty, start_loaded = (statistics.median(handoffs[schema])
                                         for schema in schemas)
            long_ms, fresh_ms, page_ms = long_run_claim_ms(conn, steps, rounds)
        finally:
            for schema in schemas:
                conn.execute(sql.SQL("drop schema if exists {} cascade").format(
                    sql.Identifier(schema)))
    return {"empty": empty, "loaded": loaded, "fresh": fresh_ms, "long": long_ms,
            "page": page_ms, "start_empty": start_empty, "start_loaded": start_loaded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", default=os.environ.get("FLOWLY_DSN"))
    parser.add_argument("--finished", type=int, default=1_000_000)
    parser.add_argument("--sleeping", type=int, default=300_000)
    parser.add_argument("--foreign", type=int, default=300_000)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--limit", type=int, default=10)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    m = measure(resolve_dsn(args.dsn), args.finished, args.sleeping, args.foreign, args.steps,
                args.rounds, args.limit)
    empty, loaded, fresh_ms, long_ms, page_ms = (
        m["empty"], m["loaded"], m["fresh"], m["long"], m["page"])
    print(f"claim of {args.limit} runs, median of {args.rounds}, measured in turns:")
    print(f"  empty tables                     {empty:8.2f} ms")
    print(f"  {args.finished:,} finished, {args.sleeping:,} sleeping and {args.foreign:,}"
          f" other-queue runs")
    print(f"                                   {loaded:8.2f} ms   ratio {loaded / empty:.2f}")
    print(f"a start handed off to an idle worker, median of {args.rounds}:")
    print(f"  empty tables                     {m['start_empty']:8.2f} ms")
    print(f"  the same history                 {m['start_loaded']:8.2f} ms"
          f"   ratio {m['start_loaded'] / m['start_empty']:.2f}")
    print(f"claim of one run (an expired lease taken over), median of {args.rounds}:")
    print(f"  fresh run                        {fresh_ms:8.2f} ms")
    print(f"  run with {args.steps:,} checkpoints     {long_ms:8.2f} ms"
          f"   ratio {long_ms / fresh_ms:.2f}")
    print(f"  its first replay page (500 rows) {page_ms:8.2f} ms")


if __name__ == "__main__":
    main()
