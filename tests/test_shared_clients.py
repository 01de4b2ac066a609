"""A client shared by threads or tasks, closed under a wait, or reused across event loops:
one caller's timeout or close never ends another caller's call, and a client made in one
event loop serves the next."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest

import flowly
from tests.support import in_thread, scalar, wait_for


def _client_sessions(db: psycopg.Connection[Any]) -> int:
    return int(scalar(db, "select count(*) from pg_stat_activity where datname ="
                          " current_database() and application_name = 'flowly client'"))


def test_a_wait_that_times_out_leaves_another_thread_s_call_on_the_client_alone(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    with flowly.Client(dsn) as client, psycopg.connect(dsn) as operator:
        held = client.start("nobody-serves-this", {"held": 1})
        other = client.start("nobody-serves-this", {"other": 1})
        operator.execute("select 1 from flowly.runs where id = %s for update", (held,))
        thread, cancelled = in_thread(client.cancel, held)
        wait_for(lambda: scalar(db, "select count(*) from pg_stat_activity where"
                                    " wait_event_type = 'Lock' and datname = current_database()"))
        started = time.monotonic()
        with pytest.raises(flowly.RunTimeout, match="still pending after 1"):
            client.wait(other, timeout=1)
        assert time.monotonic() - started < 1.8
        operator.rollback()
        thread.join(5)
        assert cancelled.get("result") == "cancelled", cancelled
        assert client.get(other).status == "pending"


def test_an_async_wait_that_times_out_leaves_another_task_s_call_on_the_client_alone(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    async def main() -> tuple[Any, str]:
        async with flowly.AsyncClient(dsn) as client:
            held = await client.start("nobody-serves-this", {"held": 1})
            other = await client.start("nobody-serves-this", {"other": 1})
            operator = await psycopg.AsyncConnection.connect(dsn)
            await operator.execute("select 1 from flowly.runs where id = %s for update", (held,))
            cancel = asyncio.ensure_future(client.cancel(held))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            with pytest.raises(flowly.RunTimeout, match="still pending after 1"):
                await client.wait(other, timeout=1)
            assert time.monotonic() - started < 1.8
            await operator.rollback()
            await operator.close()
            return await cancel, (await client.get(other)).status

    assert asyncio.run(main()) == ("cancelled", "pending")


def test_an_async_client_made_in_one_loop_serves_gathered_calls_in_the_next(dsn: str) -> None:
    client = flowly.AsyncClient(dsn)

    async def starts() -> list[str]:
        ids = await asyncio.gather(*(client.start("nobody-serves-this", i) for i in range(5)))
        return [(await client.get(run_id)).status for run_id in ids]

    async def waits() -> int:
        run_id = await client.start("nobody-serves-this", None)
        outcomes = await asyncio.gather(*(client.wait(run_id, timeout=0.3) for _ in range(3)),
                                        return_exceptions=True)
        return sum(isinstance(o, flowly.RunTimeout) for o in outcomes)

    try:
        for _ in range(2):
            assert asyncio.run(starts()) == ["pending"] * 5
            assert asyncio.run(waits()) == 3
    finally:
        asyncio.run(client.close())


def test_close_ends_a_wait_under_way_in_another_thread_and_opens_nothing(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    client = flowly.Client(dsn)
    run_id = client.start("nobody-serves-this", None)
    thread, waited = in_thread(client.wait, run_id, timeout=30)
    wait_for(lambda: _client_sessions(db) >= 2)
    time.sleep(0.2)
    closed_at = time.monotonic()
    client.close()
    thread.join(3)
    assert not thread.is_alive(), "the wait went on after close()"
    assert time.monotonic() - closed_at < 1.5
    assert isinstance(waited.get("error"), psycopg.OperationalError), waited
    assert "closed" in str(waited["error"])
    time.sleep(0.3)
    assert _client_sessions(db) == 0


def test_close_ends_an_async_wait_under_way_in_another_task(dsn: str) -> None:
    async def main() -> BaseException | None:
        client = flowly.AsyncClient(dsn)
        run_id = await client.start("nobody-serves-this", None)
        waiting = asyncio.ensure_future(client.wait(run_id, timeout=30))
        await asyncio.sleep(0.5)
        await client.close()
        done, _ = await asyncio.wait({waiting}, timeout=1.5)
        assert done, "the wait went on after close()"
        return waiting.exception()

    error = asyncio.run(main())
    assert isinstance(error, psycopg.OperationalError), error
    assert "closed" in str(error)


def test_calls_queued_on_a_shared_client_with_a_timeout_are_ended_by_the_server_not_cut_off(
        dsn: str) -> None:
    """Three threads' cancels queue on one Client(timeout=1) behind a row an operator holds:
    each is ended having done nothing, none is cut off mid-call (whose effect is unknown) nor
    fails on a connection another call's cut-off closed."""
    with flowly.Client(dsn, timeout=1) as client, psycopg.connect(dsn) as operator:
        held = client.start("nobody-serves-this", {"held": 1})
        operator.execute("select 1 from flowly.runs where id = %s for update", (held,))
        calls = [in_thread(client.cancel, held) for _ in range(3)]
        for thread, _ in calls:
            thread.join(10)
        operator.rollback()
        for _, outcome in calls:
            assert isinstance(outcome.get("error"), flowly.DatabaseTimeout), outcome
            assert "took no effect" in str(outcome["error"]), outcome
        assert client.get(held).status == "pending"
