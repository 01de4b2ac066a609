"""What an operator's call costs on a large run: ``cancel`` of a run with a large unfinished
family, and ``retry_dead_letter`` of a run with a long history. Both should grow with the size,
not with its square.

- cancel: a parent with ``--children`` unfinished children, one of which starts a chain of
  ``--depth`` runs, each the child of the one before (statistics taken);
- retry: a run dead-lettered on EventTimeout with ``--steps`` steps, every tenth an event
  wait whose timeout the body caught, retried before any statistics cover its history (as
  right after it grew) and again after ``analyze``.

Each size in a fresh database of its own; the runs are written straight into flowly's tables,
shaped as the engine writes them. Times in ms (cancels: medians of ``--rounds``), and per run
of the family or step of the history.

    python bench/operator_cost.py --children 5000 20000 80000 --steps 5000 20000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flowly
from bench.common import fresh_database
from flowly.config import resolve_dsn


def _timed(conn: psycopg.Connection[Any], query: str, *params: Any) -> float:
    started = time.perf_counter()
    conn.execute(query, params)
    return (time.perf_counter() - started) * 1000


def cancel_ms(dsn: str, children: int, depth: int, rounds: int) -> float:
    """Median ms of cancelling the parent of ``children`` children and a chain ``depth`` deep
    (every run of the family set unfinished again between rounds)."""
    dsn = fresh_database(dsn, "flowly_bench_cancel")
    times = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        flowly.install(conn)
        conn.execute("insert into flowly.runs (id, workflow) values ('parent', 'w')")
        conn.execute("insert into flowly.runs (id, workflow, parent_run_id)"
                     " select 'child-' || g, 'w', 'parent' from generate_series(1, %s) g",
                     (children,))
        conn.execute("insert into flowly.runs (id, workflow, parent_run_id)"
                     " select 'chain-' || g, 'w', case when g = 1 then 'child-1'"
                     " else 'chain-' || (g - 1) end from generate_series(1, %s) g", (depth,))
        conn.execute("analyze flowly.runs")
        for _ in range(rounds):
            times.append(_timed(conn, "select flowly.cancel('parent')"))
            conn.execute("update flowly.runs set status = 'pending', finished_at = null")
    return statistics.median(times)


def retry_ms(dsn: str, steps: int, analyzed: bool) -> float:
    """ms of retrying a run with ``steps`` steps dead-lettered on EventTimeout."""
    dsn = fresh_database(dsn, "flowly_bench_retry")
    with psycopg.connect(dsn, autocommit=True) as conn:
        flowly.install(conn)
        conn.execute("insert into flowly.runs (id, workflow, status, error, finished_at)"
                     " values ('long', 'w', 'dead_letter',"
                     " '{\"type\": \"EventTimeout\", \"message\": \"no event\"}', now())")
        conn.execute(
            "insert into flowly.steps (run_id, name, seq, position, kind, status, output,"
            "                          started_at, finished_at)"
            " select 'long', 's' || p, nextval('flowly.step_seq'), p,"
            "        case when p %% 10 = 0 then 'event' else 'step' end, 'completed',"
            "        case when p %% 10 = 0 then '{\"timeout\": true}'::jsonb else '1' end,"
            "        now() - interval '1 hour' + p * interval '10 ms',"
            "        now() - interval '1 hour' + p * interval '10 ms'"
            " from generate_series(1, %s) p", (steps,))
        if analyzed:
            conn.execute("analyze flowly.steps")
        return _timed(conn, "select flowly.retry_dead_letter('long')")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("FLOWLY_DSN"))
    parser.add_argument("--children", type=int, nargs="+", default=[5_000, 20_000, 80_000])
    parser.add_argument("--depth", type=int, default=1_000)
    parser.add_argument("--steps", type=int, nargs="+", default=[5_000, 20_000])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dsn = resolve_dsn(args.dsn)
    print(f"{'call':<44}{'size':>8}{'ms':>10}{'µs each':>10}")
    for children in args.children:
        runs = children + args.depth + 1
        ms = cancel_ms(dsn, children, args.depth, args.rounds)
        print(f"{'cancel of a family':<44}{runs:>8}{ms:>10.1f}{ms * 1000 / runs:>10.1f}")
    for steps in args.steps:
        for analyzed in (False, True):
            label = "retry, " + ("statistics taken" if analyzed else "no statistics yet")
            ms = retry_ms(dsn, steps, analyzed)
            print(f"{label:<44}{steps:>8}{ms:>10.1f}{ms * 1000 / steps:>10.1f}")


if __name__ == "__main__":
    main()
