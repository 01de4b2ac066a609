"""A client shared by threads or tasks, closed under a wait or a call, or reused across event
loops: one caller's timeout or close never ends another caller's call, a call's timeout counts
from its turn on the client's connection, and a client made in one event loop serves the
next."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest

import flowly
from tests.support import freezable_proxy, in_thread, scalar, wait_for, waiting_on_lock


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


def _hold_rows(dsn: str, *run_ids: str) -> list[psycopg.Connection[Any]]:
    """One operator per run, each holding its run's row in an open transaction."""
    operators = []
    for run_id in run_ids:
        operator = psycopg.connect(dsn)
        operator.execute("select 1 from flowly.runs where id = %s for update", (run_id,))
        operators.append(operator)
    return operators


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_call_queued_on_a_client_with_a_timeout_counts_its_time_from_its_turn(
        dsn: str, db: psycopg.Connection[Any], kind: str) -> None:
    """Client(timeout=2), two callers: the first's cancel waits for a row an operator holds
    and is ended by the server at 2 s; the second's, queued behind it, has its turn then and
    waits 1.5 s for its own row, which its operator lets go 3.5 s after the start. Its own
    call took 1.5 s, within the timeout: it must succeed, not be given up at 3 s (the timeout
    and its second of grace counted from when it queued) as a call whose effect is unknown."""
    with flowly.Client(dsn) as starter:
        first = starter.start("nobody-serves-this", {"first": kind})
        second = starter.start("nobody-serves-this", {"second": kind})
    operators = _hold_rows(dsn, first, second)
    try:
        if kind == "sync":
            with flowly.Client(dsn, timeout=2) as client:
                started = time.monotonic()
                thread, first_outcome = in_thread(client.cancel, first)
                wait_for(lambda: waiting_on_lock(db, "%cancel%"), what="the first call waiting")
                queued, second_outcome = in_thread(client.cancel, second)
                time.sleep(max(0.0, started + 3.5 - time.monotonic()))
                operators[1].rollback()
                thread.join(10)
                queued.join(10)
            outcomes: list[Any] = [first_outcome.get("error"), second_outcome.get("result",
                                   second_outcome.get("error"))]
        else:
            async def main() -> list[Any]:
                async with flowly.AsyncClient(dsn, timeout=2) as client:
                    started = time.monotonic()
                    calls = [asyncio.ensure_future(client.cancel(first))]
                    while not waiting_on_lock(db, "%cancel%"):
                        await asyncio.sleep(0.02)
                    calls.append(asyncio.ensure_future(client.cancel(second)))
                    await asyncio.sleep(max(0.0, started + 3.5 - time.monotonic()))
                    operators[1].rollback()
                    return await asyncio.gather(*calls, return_exceptions=True)

            outcomes = asyncio.run(main())
    finally:
        for operator in operators:
            operator.close()
    assert isinstance(outcomes[0], flowly.DatabaseTimeout), outcomes
    assert "took no effect" in str(outcomes[0]), outcomes
    assert outcomes[1] == "cancelled", outcomes
    assert scalar(db, "select status from flowly.runs where id = %s", first) == "pending"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_call_whose_turn_does_not_come_within_the_timeout_is_not_made(
        dsn: str, db: psycopg.Connection[Any], kind: str) -> None:
    """Client(timeout=1) on a database that stops answering: one caller's get is in flight
    (given up 2 s on, the effect unknown); another's start, queued behind it, never has its
    turn within its timeout. It must end at 1 s, saying the call was not made, and be so:
    no run is made once the database answers again."""
    run_id = f"never-made-{kind}"
    with freezable_proxy(dsn) as proxy:
        if kind == "sync":
            client = flowly.Client(proxy.dsn, timeout=1)
            known = client.start("nobody-serves-this", None)  # the connection is open
            proxy.freeze()
            thread, in_flight = in_thread(client.get, known)
            time.sleep(0.2)
            queued, outcome = in_thread(client.start, "nobody-serves-this", None, run_id=run_id)
            queued.join(10)
            thread.join(10)
            proxy.thaw()
            client.close()
            errors = [in_flight.get("error"), outcome.get("error")]
            took = outcome.get("took")
        else:
            async def main() -> tuple[list[Any], float]:
                async with flowly.AsyncClient(proxy.dsn, timeout=1) as client:
                    known = await client.start("nobody-serves-this", None)
                    proxy.freeze()
                    calls = [asyncio.ensure_future(client.get(known))]
                    await asyncio.sleep(0.2)
                    ended: list[float] = []
                    queued_at = time.monotonic()
                    start = asyncio.ensure_future(
                        client.start("nobody-serves-this", None, run_id=run_id))
                    start.add_done_callback(lambda _: ended.append(time.monotonic()))
                    calls.append(start)
                    outcomes = await asyncio.gather(*calls, return_exceptions=True)
                    proxy.thaw()
                    return outcomes, ended[0] - queued_at

            errors, took = asyncio.run(main())
    assert isinstance(errors[0], flowly.DatabaseTimeout), errors
    assert isinstance(errors[1], flowly.DatabaseTimeout), errors
    assert "was not made" in str(errors[1]), errors
    assert took is not None and took < 1.6, f"the queued call ended {took:.2f}s on"
    time.sleep(0.5)
    assert scalar(db, "select count(*) from flowly.runs where id = %s", run_id) == 0


@pytest.mark.parametrize("timeout", [None, 5.0])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_close_lets_the_call_in_flight_end_and_refuses_the_calls_after_it(
        dsn: str, db: psycopg.Connection[Any], kind: str, timeout: float | None) -> None:
    """close() while another caller's cancel waits for a row an operator holds: the cancel
    must end as it would have (cancelled once the operator lets go), not have its connection
    closed under it (its effect then unknown); close() returns at once; a call queued behind
    it and every call after close() are not made, and say the client is closed; the
    client's connection is closed once the call in flight ended."""
    with flowly.Client(dsn) as starter:
        held = starter.start("nobody-serves-this", {"held": kind})
        other = starter.start("nobody-serves-this", {"other": kind})
    operators = _hold_rows(dsn, held)
    try:
        if kind == "sync":
            client = flowly.Client(dsn, timeout=timeout)
            thread, in_flight = in_thread(client.cancel, held)
            wait_for(lambda: waiting_on_lock(db, "%cancel%"), what="the cancel waiting")
            queued, behind = in_thread(client.cancel, other)
            time.sleep(0.2)
            closing = time.monotonic()
            client.close()
            close_took = time.monotonic() - closing
            time.sleep(0.3)
            still_waiting = thread.is_alive()
            operators[0].rollback()
            thread.join(10)
            queued.join(10)
            outcomes = [in_flight.get("result", in_flight.get("error")),
                        behind.get("result", behind.get("error"))]
            try:
                later: Any = client.get(other)
            except psycopg.Error as exc:
                later = exc
        else:
            async def main() -> tuple[list[Any], Any, float, bool]:
                client = flowly.AsyncClient(dsn, timeout=timeout)
                calls = [asyncio.ensure_future(client.cancel(held))]
                while not waiting_on_lock(db, "%cancel%"):
                    await asyncio.sleep(0.02)
                calls.append(asyncio.ensure_future(client.cancel(other)))
                await asyncio.sleep(0.2)
                closing = time.monotonic()
                await client.close()
                close_took = time.monotonic() - closing
                await asyncio.sleep(0.3)
                waiting = not calls[0].done()
                operators[0].rollback()
                outcomes = await asyncio.gather(*calls, return_exceptions=True)
                try:
                    later: Any = await client.get(other)
                except psycopg.Error as exc:
                    later = exc
                return outcomes, later, close_took, waiting

            outcomes, later, close_took, still_waiting = asyncio.run(main())
    finally:
        for operator in operators:
            operator.close()
    assert close_took < 0.5, f"close() took {close_took:.2f}s"
    assert still_waiting, f"the call in flight ended when the client was closed: {outcomes}"
    assert outcomes[0] == "cancelled", outcomes
    assert isinstance(outcomes[1], psycopg.OperationalError), outcomes
    assert "client is closed" in str(outcomes[1]), outcomes
    assert isinstance(later, psycopg.OperationalError), later
    assert "client is closed" in str(later), later
    assert scalar(db, "select status from flowly.runs where id = %s", held) == "cancelled"
    assert scalar(db, "select status from flowly.runs where id = %s", other) == "pending"
    wait_for(lambda: _client_sessions(db) == 0, timeout=5,
             what="the closed client's connection to end")
