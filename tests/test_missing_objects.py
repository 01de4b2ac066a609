"""A missing function, table or schema is "flowly is not installed" only when it is flowly's.

translated_errors turned every UndefinedFunction, UndefinedTable and InvalidSchemaName into
SchemaNotInstalled ("run `flowly install`"): a trigger of the user's on a flowly table that
calls a function of theirs that is missing told them to install flowly, which was installed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

import flowly
from tests.support import running_worker


@flowly.workflow("tmo_missing_in_transaction", max_attempts=1)
async def tmo_missing_in_transaction(ctx: flowly.Context, inp: Any) -> Any:
    def missing(conn: psycopg.Connection[Any]) -> Any:
        return conn.execute("select public.tmo_no_such_function()").fetchone()

    return await ctx.transaction("missing", missing)


_MISSING_IN_TRIGGER = {
    "function": (psycopg.errors.UndefinedFunction, "perform public.tmo_no_such_function()"),
    "table": (psycopg.errors.UndefinedTable, "perform 1 from public.tmo_no_such_table"),
    "schema": (psycopg.errors.InvalidSchemaName, "perform tmo_no_such_schema.f()"),
}


@pytest.mark.parametrize("missing", sorted(_MISSING_IN_TRIGGER))
def test_what_a_user_s_trigger_on_a_flowly_table_misses_surfaces_as_itself(
        dsn: str, db: psycopg.Connection[Any], missing: str) -> None:
    error_type, statement = _MISSING_IN_TRIGGER[missing]
    db.execute(f"create function public.tmo_on_run() returns trigger language plpgsql as $$"
               f" begin {statement}; return new; end $$")
    db.execute("create trigger tmo_on_run after insert on flowly.runs for each row"
               " execute function public.tmo_on_run()")

    async def start_async() -> str:
        async with flowly.AsyncClient(dsn) as client:
            return await client.start("nobody-serves-this", None)

    with flowly.Client(dsn) as client:
        for call in (lambda: client.start("nobody-serves-this", None),
                     lambda: asyncio.run(start_async())):
            with pytest.raises(error_type) as raised:
                call()
            assert not isinstance(raised.value, flowly.SchemaNotInstalled)


def test_a_transactional_step_s_missing_function_fails_the_step_as_itself(
        dsn: str, client: flowly.Client) -> None:
    run_id = client.start(tmo_missing_in_transaction, None)
    with running_worker(dsn, workflows=[tmo_missing_in_transaction]):
        run = client.wait(run_id, timeout=30)
    assert run.status == "dead_letter", run
    assert run.error["type"] == "UndefinedFunction", run.error


def test_flowly_s_own_missing_schema_or_function_is_still_not_installed(
        empty_dsn: str, dsn: str, db: psycopg.Connection[Any]) -> None:
    with flowly.Client(empty_dsn) as bare, pytest.raises(flowly.SchemaNotInstalled):
        bare.start("nobody-serves-this", None)
    with flowly.Client(dsn, schema="tmo_absent") as elsewhere, \
            pytest.raises(flowly.SchemaNotInstalled):
        elsewhere.get("r")
    run_id = flowly.Client(dsn).start("nobody-serves-this", None)
    db.execute("drop function flowly.cancel(text)")  # an install a release behind, say
    with flowly.Client(dsn) as client, pytest.raises(flowly.SchemaNotInstalled):
        client.cancel(run_id)
