"""Where the database's time goes during a drain: per engine function, its calls and its own
time (pg_stat_user_functions with track_functions = 'pl'), per run drained.

Needs a role that may set track_functions (a superuser); it is set for the benchmark's own
database only.

    python bench/profile_functions.py --runs 6000 --concurrency 256 --workflow bench.three_async
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import fresh_database
from bench.throughput import drain, prepare
from flowly.config import resolve_dsn

FUNCTIONS = """
    select f.funcname, f.calls, f.total_time, f.self_time
    from pg_stat_user_functions f
    where f.schemaname = 'flowly' and f.calls > 0
    order by f.self_time desc
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", default=os.environ.get("FLOWLY_DSN"))
    parser.add_argument("--runs", type=int, default=6000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--workflow", default="bench.three_async")
    parser.add_argument("--setup-sql", action="append", default=[], metavar="SQL",
                        help="run this after the install, before the drains (to price a"
                             " change of an engine function side by side); repeatable")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    dsn = fresh_database(resolve_dsn(args.dsn), "flowly_profile")
    with psycopg.connect(dsn, autocommit=True) as conn:
        name = conn.info.dbname
        conn.execute(sql.SQL("alter database {} set track_functions = 'pl'").format(
            sql.Identifier(name)))
    prepare(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in args.setup_sql:
            conn.execute(statement)
    drain(dsn, args.workflow, min(args.runs, 1000), args.concurrency)  # warm up
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("select pg_stat_reset()")
    result = drain(dsn, args.workflow, args.runs, args.concurrency)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("select pg_stat_force_next_flush()")
        rows = conn.execute(FUNCTIONS).fetchall()
    print(f"{args.runs} runs of {args.workflow} at concurrency {args.concurrency}:"
          f" {result.rate:,.0f} runs/s, {result.seconds:.2f} s (start and insert_run: the"
          f" untimed enqueue)")
    print(f"{'function':>28} {'calls':>8} {'µs/call':>9} {'self µs/run':>12}"
          f" {'total ms':>9} {'self ms':>9}")
    for funcname, calls, total, self_time in rows:
        print(f"{funcname:>28} {calls:>8} {1000 * total / calls:>9.0f}"
              f" {1000 * self_time / args.runs:>12.1f} {total:>9.0f} {self_time:>9.0f}")


if __name__ == "__main__":
    main()
