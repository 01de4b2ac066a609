"""What flowly.start_trigger costs a bulk INSERT: 10,000 rows in one statement into a table with
no trigger, with the ready-made row trigger, with the statement trigger (a transition table),
and with the hand-written row trigger the README used to show (``perform flowly.start(...)``
per row), side by side as rows/s and as a ratio to the table with no trigger; and, for
reference, the floor: the same 10,000 runs inserted straight into flowly's runs table.

A fresh database of its own (dropped at exit), flowly in one schema and the tables in another;
the variants are measured in turns, each figure the median of ``--rounds`` INSERTs (each
committed, its runs then truncated), so all of them see the same machine.

    python bench/trigger_insert.py [--rows 10000 --rounds 7 --dsn ...]
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
from bench.common import fresh_database
from flowly.config import resolve_dsn

SCHEMA, APP = "flowly_bench_trigger", "flowly_bench_trigger_app"
FLOOR = "(the runs alone, one insert into runs)"

# variant -> the trigger on its table ({s}: flowly's schema, {t}: the table)
VARIANTS = {
    "no trigger": None,
    "start_trigger, for each row": """
        create trigger enqueue after insert on {t}
            for each row execute function {s}.start_trigger('process-order', 'id')""",
    "start_trigger, for each statement": """
        create trigger enqueue after insert on {t} referencing new table as new_rows
            for each statement execute function {s}.start_trigger('process-order', 'id')""",
    "hand-written row trigger (start)": """
        create trigger enqueue after insert on {t}
            for each row execute function {a}.enqueue_by_hand()""",
}


def setup(conn: psycopg.Connection[Any]) -> dict[str, sql.Composed]:
    """Install flowly, create one table per variant with its trigger; the tables by variant."""
    for schema in (SCHEMA, APP):
        conn.execute(sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(schema)))
    flowly.install(conn, SCHEMA)
    s, a = sql.Identifier(SCHEMA), sql.Identifier(APP)
    conn.execute(sql.SQL("create schema {}").format(a))
    conn.execute(sql.SQL("""
        create function {a}.enqueue_by_hand() returns trigger language plpgsql as $$
        begin
            perform {s}.start('process-order', to_jsonb(new),
                              run_id => 'process-order:' || new.id);
            return null;
        end $$""").format(a=a, s=s))
    tables = {}
    for number, (variant, trigger) in enumerate(VARIANTS.items()):
        table = sql.SQL("{}.{}").format(a, sql.Identifier(f"orders_{number}"))
        conn.execute(sql.SQL("""
            create table {t} (id bigint primary key, customer int not null, sku text not null,
                              qty int not null, created_at timestamptz not null default now())
            """).format(t=table))
        if trigger:
            conn.execute(sql.SQL(trigger).format(t=table, s=s, a=a))
        tables[variant] = table
    return tables


def insert_seconds(conn: psycopg.Connection[Any], table: sql.Composed, rows: int,
                   runs_expected: int) -> float:
    """One INSERT of ``rows`` rows into an emptied ``table``, committed; its wall time. Checks
    that it started ``runs_expected`` runs."""
    runs = sql.SQL("{}.runs").format(sql.Identifier(SCHEMA))
    conn.execute(sql.SQL("truncate {t}, {r} cascade").format(t=table, r=runs))
    started = time.perf_counter()
    with conn.transaction():
        conn.execute(sql.SQL("""
            insert into {t} (id, customer, sku, qty)
            select g, g %% 977, 'sku-' || (g %% 101), 1 + g %% 5 from generate_series(1, %s) g
            """).format(t=table), (rows,))
    elapsed = time.perf_counter() - started
    count = conn.execute(sql.SQL("select count(*) from {}").format(runs)).fetchone()
    assert count == (runs_expected,), (table, count)
    return elapsed


def direct_seconds(conn: psycopg.Connection[Any], rows: int) -> float:
    """The floor: the same runs (ids, inputs) inserted straight into flowly's runs table by
    one statement, no application table and no trigger; its wall time, committed."""
    runs = sql.SQL("{}.runs").format(sql.Identifier(SCHEMA))
    conn.execute(sql.SQL("truncate {} cascade").format(runs))
    started = time.perf_counter()
    with conn.transaction():
        conn.execute(sql.SQL("""
            insert into {r} (id, workflow, input)
            select 'process-order:' || g, 'process-order',
                   jsonb_build_object('id', g, 'customer', g %% 977, 'sku', 'sku-' || (g %% 101),
                                      'qty', 1 + g %% 5, 'created_at', now())
            from generate_series(1, %s) g""").format(r=runs), (rows,))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", default=os.environ.get("FLOWLY_DSN"))
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    dsn = fresh_database(resolve_dsn(args.dsn), "flowly_bench_trigger")
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            tables = setup(conn)
            timings: dict[str, list[float]] = {variant: [] for variant in [*VARIANTS, FLOOR]}
            for _ in range(args.rounds + 1):  # the first round warms up, not counted
                for variant, table in tables.items():
                    expected = args.rows if VARIANTS[variant] else 0
                    timings[variant].append(insert_seconds(conn, table, args.rows, expected))
                timings[FLOOR].append(direct_seconds(conn, args.rows))
        finally:
            for schema in (SCHEMA, APP):
                conn.execute(sql.SQL("drop schema if exists {} cascade").format(
                    sql.Identifier(schema)))
    base = statistics.median(timings["no trigger"][1:])
    print(f"{args.rows:,} rows in one INSERT (committed), median of {args.rounds}, in turns:")
    print(f"  {'variant':38} {'ms':>9} {'rows/s':>11} {'x no trigger':>13}")
    for variant, seconds in timings.items():
        median = statistics.median(seconds[1:])
        print(f"  {variant:38} {median * 1000:9.1f} {args.rows / median:11,.0f}"
              f" {median / base:13.2f}")


if __name__ == "__main__":
    main()
