"""A transactional step's SQL runs on a connection of the worker's pools, and what it sets for
its session without LOCAL (``set statement_timeout``, ``set client_encoding``, ...) outlives
its transaction once it commits. The connection then served flowly's claims, checkpoints and
completions, and other runs' transactional steps, under those settings: a statement_timeout
of 1 ms, a read-only default or LATIN1 failed every later call on it, so one run's SQL
failed or stalled other runs. The worker puts the session back after each transactional
step (flowly.worker.session.restore)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

import flowly
from tests.support import running_worker, scalar, wait_for

TEXT = "caf\u00e9 \U0001F600"  # beyond LATIN1
SESSION_CHANGES = [
    "set statement_timeout = 1",
    "set default_transaction_read_only = on",
    "set client_encoding = 'LATIN1'",
    # and a function that commits flowly's transaction itself, which fails its step at once
    # (the checkpoint that would set the session back is refused): what it set committed
    "set default_transaction_read_only = on; commit",
    "set client_encoding = 'LATIN1'; commit",
]


def _run_sql(conn: psycopg.Connection[Any], statement: str) -> str:
    conn.execute(statement)
    return "done"


async def _run_sql_async(conn: psycopg.AsyncConnection[Any], statement: str) -> str:
    await conn.execute(statement)
    return "done"


@flowly.workflow("tss_sql")
async def tss_sql(ctx: flowly.Context, inp: dict[str, Any]) -> Any:
    """One transactional step running ``statement``, sync or async, then a plain step
    returning ``echo``."""
    fn = _run_sql if inp["sync"] else _run_sql_async
    done = await ctx.transaction("sql", fn, inp["statement"])

    async def echo() -> Any:
        return inp["echo"]

    return [done, await ctx.step("echo", echo)]


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize("change", SESSION_CHANGES)
def test_what_a_transactional_step_sets_for_its_session_reaches_no_other_run(
        dsn: str, db: psycopg.Connection[Any], change: str, sync: bool) -> None:
    start = "select flowly.start('tss_sql', %s::jsonb) from generate_series(1, %s)"
    with running_worker(dsn, workflows=["tss_sql"], concurrency=16, max_connections=4):
        db.execute(start, (psycopg.types.json.Jsonb(
            {"sync": sync, "statement": change, "echo": "changed"}), 4))
        db.execute(start, (psycopg.types.json.Jsonb(
            {"sync": sync, "statement": f"select '{TEXT}'", "echo": TEXT}), 100))
        wait_for(lambda: scalar(db, "select count(*) from flowly.runs where input->>'echo' = %s"
                                    " and status = 'completed'", TEXT) == 100, timeout=60)
    outputs = db.execute("select output from flowly.runs where input->>'echo' = %s",
                         (TEXT,)).fetchall()
    assert outputs == [(["done", TEXT],)] * 100
