"""A user's mistakes are caught at once with a clear message, from Python (issue 7)."""

from __future__ import annotations

import asyncio
import logging
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

import flowly
from flowly.client import list_runs_query
from tests.support import end_other_sessions


def test_a_workflow_that_is_not_async_def_is_refused_at_registration() -> None:
    def plain(ctx: flowly.Context, order: Any) -> Any:
        return order

    with pytest.raises(TypeError, match=r"workflow 'not-async'.*plain.*async def"):
        flowly.workflow("not-async")(plain)  # type: ignore[type-var]
    assert "not-async" not in flowly.workflow.__globals__["_registry"]

    def generator(ctx: flowly.Context, order: Any) -> Any:
        yield order

    with pytest.raises(TypeError, match="async def"):
        flowly.workflow("not-async")(generator)  # type: ignore[type-var]

    async def fine(ctx: flowly.Context, order: Any) -> Any:
        return order

    assert flowly.workflow("usability-async")(fine) is fine


def test_start_of_a_workflow_no_live_worker_serves_logs_a_warning(
        dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    with flowly.Client(dsn) as client, caplog.at_level(logging.WARNING, logger="flowly"):
        run_id = client.start("nobody-serves-this", {"x": 1}, queue="lonely")
        for _ in range(3):  # a loop of starts warns once, not once per run
            client.start("nobody-serves-this", {"x": 2}, queue="lonely")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    message = warnings[0].getMessage()
    assert "nobody-serves-this" in message and "lonely" in message and run_id in message


def test_async_start_of_an_unserved_workflow_logs_a_warning(
        dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with flowly.AsyncClient(dsn) as client:
            await client.start("nobody-serves-this-either")

    with caplog.at_level(logging.WARNING, logger="flowly"):
        asyncio.run(scenario())
    assert "nobody-serves-this-either" in caplog.text


def test_start_of_a_served_workflow_logs_nothing(
        dsn: str, db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture) -> None:
    db.execute("select flowly.register_worker('w:1:h', array['served'], array['default'],"
               " interval '30 seconds')")
    with flowly.Client(dsn) as client, caplog.at_level(logging.WARNING, logger="flowly"):
        client.start("served")
    assert not caplog.records, caplog.text


def test_start_inside_the_callers_transaction_also_warns(
        dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    with flowly.Client(dsn) as client, psycopg.connect(dsn) as conn:
        with caplog.at_level(logging.WARNING, logger="flowly"):
            client.start("unserved-in-tx", conn=conn)
        conn.rollback()  # the check must not have broken or committed the caller's transaction
        assert conn.execute("select count(*) from flowly.runs").fetchone() == (0,)
    assert "unserved-in-tx" in caplog.text


def test_wait_timing_out_on_an_unserved_run_says_why(dsn: str) -> None:
    with flowly.Client(dsn) as client:
        run_id = client.start("nobody-serves-this", queue="lonely")
        with pytest.raises(flowly.RunTimeout) as caught:
            client.wait(run_id, timeout=0.2)
    message = str(caught.value)
    assert "still pending" in message
    assert "no live worker serves workflow 'nobody-serves-this' on queue 'lonely'" in message


def test_async_wait_timing_out_on_an_unserved_run_says_why(dsn: str) -> None:
    async def scenario() -> None:
        async with flowly.AsyncClient(dsn) as client:
            run_id = await client.start("nobody-serves-this", queue="lonely")
            await client.wait(run_id, timeout=0.1)

    with pytest.raises(flowly.RunTimeout, match="no live worker serves"):
        asyncio.run(scenario())


def _aged(db: psycopg.Connection[Any], run_id: str, age: timedelta) -> None:
    db.execute("update flowly.runs set created_at = now() - %s where id = %s", (age, run_id))


def test_list_runs_since_takes_a_timedelta_an_age_or_a_time(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    with flowly.Client(dsn) as client:
        old = client.start("listing", run_id="old")
        new = client.start("listing", run_id="new")
        _aged(db, old, timedelta(hours=3))
        _aged(db, new, timedelta(minutes=5))
        assert [r.id for r in client.list_runs(since=timedelta(minutes=10))] == [new]
        assert [r.id for r in client.list_runs(since="10m")] == [new]
        assert [r.id for r in client.list_runs(since="4h")] == [new, old]
        assert [r.id for r in client.list_runs(since="1d")] == [new, old]
        assert [r.id for r in client.list_runs(
            since=datetime.now(UTC) - timedelta(hours=1))] == [new]
        iso = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
        assert [r.id for r in client.list_runs(since=iso)] == [new]
        assert [r.id for r in client.list_runs(workflow="listing", status="pending",
                                               limit=1)] == [new]
        with pytest.raises(flowly.InvalidArgument, match="10m"):
            client.list_runs(since="ten minutes")


def test_async_list_runs_since_an_age(dsn: str, db: psycopg.Connection[Any]) -> None:
    async def scenario() -> tuple[list[str], list[str]]:
        async with flowly.AsyncClient(dsn) as client:
            old = await client.start("listing", run_id="old")
            _aged(db, old, timedelta(hours=3))
            await client.start("listing", run_id="new")
            return ([r.id for r in await client.list_runs(since="2h")],
                    [r.id for r in await client.list_runs(since=timedelta(days=1))])

    assert asyncio.run(scenario()) == (["new"], ["new", "old"])


def test_list_runs_query_has_only_the_filters_given(db: psycopg.Connection[Any]) -> None:
    def text(**filters: Any) -> tuple[str, dict[str, Any]]:
        query, params = list_runs_query("flowly", limit=10, **filters)
        return query.as_string(db), params

    bare, params = text()
    assert "where" not in bare and " is null" not in bare
    by_status, params = text(status="dead_letter")
    assert "status =" in by_status and "workflow" not in by_status and "is null" not in by_status
    assert "dead_letter" in params.values()
    every, _ = text(status="pending", workflow="w", since=datetime.now(UTC))
    assert "status =" in every and "workflow =" in every and "created_at >=" in every
    assert " is null" not in every


def generic_plan(db: psycopg.Connection[Any], query: psycopg.sql.Composable,
                 params: dict[str, Any]) -> str:
    """The plan of ``query`` as a prepared statement planned once for any parameter values (what
    psycopg's automatic preparing ends up with), not for the values at hand."""
    text = query.as_string(db)
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", text)))
    for number, name in enumerate(names, start=1):
        text = text.replace(f"%({name})s", f"${number}")
    db.execute("set plan_cache_mode = force_generic_plan")
    # on a tiny table the planner would read it whole and sort; ask whether an index can serve
    for setting in ("enable_seqscan", "enable_bitmapscan", "enable_sort"):
        db.execute(f"set {setting} = off")
    db.execute("deallocate all")
    db.execute(f"prepare list_runs as {text}")
    values = psycopg.sql.SQL(", ").join(psycopg.sql.Literal(params[n]) for n in names)
    explain = psycopg.sql.SQL("explain execute list_runs({})").format(values)
    return "\n".join(row[0] for row in db.execute(explain))


@pytest.mark.parametrize("filters, index_cond", [
    ({"status": "dead_letter"}, "status ="),
    ({"workflow": "w"}, "workflow ="),
    ({"since": timedelta(minutes=10)}, "created_at >="),
])
def test_list_runs_filters_are_index_conditions(db: psycopg.Connection[Any],
                                                filters: dict[str, Any], index_cond: str) -> None:
    """Each filter given reaches an index, also in a generic plan (a ``%s is null or col = %s``
    pattern could not: its plan must hold for null too)."""
    query, params = list_runs_query("flowly", limit=50, **filters)
    plan = generic_plan(db, query, params)
    assert "Index Cond:" in plan and index_cond in plan.split("Index Cond:", 1)[1], plan
    assert "Sort" not in plan, plan  # the index gives the newest first




def test_a_client_whose_connections_the_server_dropped_while_idle_opens_new_ones(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """A server restart (or a failover, a pooler's restart, a terminated backend) ends the
    connections a long-lived client holds idle. Its next call went out on the dead
    connection and failed ("terminating connection due to administrator command"), and so
    did the next wait. Each was told by the closed socket before anything was sent."""
    with flowly.Client(dsn) as client:
        run_id = client.start("nobody-serves-this")
        with pytest.raises(flowly.RunTimeout):
            client.wait(run_id, timeout=0.1)
        end_other_sessions(db)
        assert client.get(run_id).status == "pending"
        with pytest.raises(flowly.RunTimeout):
            client.wait(run_id, timeout=0.1)
        end_other_sessions(db)
        assert client.start("nobody-serves-this", run_id=run_id) == run_id


def test_an_async_client_whose_connections_the_server_dropped_while_idle_opens_new_ones(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    async def scenario() -> None:
        async with flowly.AsyncClient(dsn) as client:
            run_id = await client.start("nobody-serves-this")
            with pytest.raises(flowly.RunTimeout):
                await client.wait(run_id, timeout=0.1)
            end_other_sessions(db)
            assert (await client.get(run_id)).status == "pending"
            with pytest.raises(flowly.RunTimeout):
                await client.wait(run_id, timeout=0.1)

    asyncio.run(scenario())


def test_one_client_shared_by_threads_serves_them_all(dsn: str) -> None:
    """A client shared by a web server's threads: their calls take turns on its connection
    (psycopg's lock), and the look for a connection the server ended leaves one that another
    thread is using alone."""
    from concurrent.futures import ThreadPoolExecutor

    with flowly.Client(dsn) as client:
        def calls(n: int) -> list[str]:
            ids = [client.start("nobody-serves-this", {"n": n, "i": i}) for i in range(30)]
            return [client.get(run_id).status for run_id in ids]

        with ThreadPoolExecutor(8) as pool:
            statuses = [s for batch in pool.map(calls, range(8)) for s in batch]
    assert statuses == ["pending"] * 240
