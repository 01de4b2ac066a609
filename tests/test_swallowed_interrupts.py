"""A body that swallows what ends it (a bare ``except:`` or ``except BaseException``) still
ends there: sleeps, waits, retries, cancels and lost leases stop the run's execution however
the body treats the interrupt, and no step starts after it."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import Any

import psycopg

import flowly
from tests.support import running_worker, scalar, wait_for

LOG: dict[str, list[tuple[str, float]]] = defaultdict(list)


def _note(run_id: str, what: str) -> str:
    LOG[run_id].append((what, time.monotonic()))
    return what


def _events(run_id: str) -> list[str]:
    return [what for what, _ in LOG[run_id]]


def _at(run_id: str, what: str) -> float:
    return next(at for name, at in LOG[run_id] if name == what)


def _run_to_its_end(dsn: str, client: flowly.Client, workflow: str) -> tuple[str, flowly.Run]:
    """Start a run of ``workflow`` and serve it until it finished."""
    run_id = client.start(workflow, None)
    with running_worker(dsn):
        return run_id, client.wait(run_id, timeout=20)


@flowly.workflow("swallows_sleep")
async def swallows_sleep(ctx: flowly.Context, inp: Any) -> Any:
    await ctx.step("first", _note, ctx.run_id, "first")
    try:
        await ctx.sleep("nap", 1.0)
    except BaseException:  # the mistake under test
        _note(ctx.run_id, "swallowed")
    return await ctx.step("after", _note, ctx.run_id, "after")


def test_a_step_after_a_swallowed_sleep_waits_out_the_sleep(
    dsn: str, client: flowly.Client
) -> None:
    """Without the fix the step after the sleep ran at once and the run completed 1 s early."""
    run_id, run = _run_to_its_end(dsn, client, "swallows_sleep")
    assert run.status == "completed" and run.output == "after", (run.status, run.error)
    assert _events(run_id) == ["first", "swallowed", "after"]
    assert _at(run_id, "after") - _at(run_id, "first") >= 1.0


@flowly.workflow("returns_in_a_sleep")
async def returns_in_a_sleep(ctx: flowly.Context, inp: Any) -> Any:
    try:
        await ctx.sleep("nap", 1.0)
    except BaseException:  # the mistake under test
        return "returned early"
    return "slept"


def test_a_body_that_returns_from_a_swallowed_sleep_completes_after_the_sleep(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    run_id, run = _run_to_its_end(dsn, client, "returns_in_a_sleep")
    assert run.status == "completed" and run.output == "slept", (run.status, run.output)
    assert scalar(db, "select extract(epoch from finished_at - started_at) from flowly.runs"
                      " where id = %s", run_id) >= 1.0


@flowly.workflow("swallows_wait")
async def swallows_wait(ctx: flowly.Context, inp: Any) -> Any:
    try:
        payload = await ctx.wait_for_event("go")
    except BaseException:  # the mistake under test
        payload = "never sent"
    return await ctx.step("use", _note, ctx.run_id, f"use {payload}")


def test_a_step_after_a_swallowed_wait_runs_with_the_event(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    run_id = client.start("swallows_wait", None)
    with running_worker(dsn):
        wait_for(lambda: scalar(db, "select locked_by is null from flowly.runs where id = %s"
                                    " and exists (select from flowly.waits w where w.run_id = %s)",
                                run_id, run_id) or _events(run_id))
        assert _events(run_id) == []  # nothing used an event that was never sent
        client.send_event(run_id, "go", "sent")
        run = client.wait(run_id, timeout=20)
    assert run.status == "completed" and run.output == "use sent", (run.status, run.output)
    assert _events(run_id) == ["use sent"]


@flowly.workflow("swallows_retry")
async def swallows_retry(ctx: flowly.Context, inp: Any) -> Any:
    def flaky() -> str:
        _note(ctx.run_id, "try")
        if len(LOG[ctx.run_id]) == 1:
            raise ValueError("first try fails")
        return "second try"

    try:
        return await ctx.step("flaky", flaky, retry=flowly.Retry(
            max_attempts=2, backoff="fixed", initial_delay=0.3))
    except BaseException:  # the mistake under test
        return "swallowed the retry"


def test_a_body_that_swallows_a_step_s_retry_gets_the_retried_step_s_output(
    dsn: str, client: flowly.Client
) -> None:
    run_id, run = _run_to_its_end(dsn, client, "swallows_retry")
    assert run.status == "completed" and run.output == "second try", (run.status, run.output)
    assert _events(run_id) == ["try", "try"]


@flowly.workflow("swallows_a_final_failure")
async def swallows_a_final_failure(ctx: flowly.Context, inp: Any) -> Any:
    def fail() -> None:
        raise ValueError("declined")

    await ctx.step("book", _note, ctx.run_id, "book",
                   compensate=lambda _: _note(ctx.run_id, "unbook"))
    try:
        await ctx.step("pay", fail, retry=flowly.Retry(max_attempts=1))
    except BaseException:  # the mistake under test
        pass
    return await ctx.step("ship", _note, ctx.run_id, "ship")


def test_a_body_that_swallows_a_final_failure_is_compensated_and_ships_nothing(
    dsn: str, client: flowly.Client
) -> None:
    run_id, run = _run_to_its_end(dsn, client, "swallows_a_final_failure")
    assert run.status == "dead_letter" and run.compensation_ok, (run.status, run.error)
    assert _events(run_id) == ["book", "unbook"]


@flowly.workflow("swallows_its_cancel")
async def swallows_its_cancel(ctx: flowly.Context, inp: Any) -> Any:
    async def long() -> str:
        _note(ctx.run_id, "long")
        await asyncio.sleep(inp)
        return "long"

    try:
        await ctx.step("long", long)
    except BaseException:  # the mistake under test
        _note(ctx.run_id, "swallowed")
    return await ctx.step("charge", _note, ctx.run_id, "charge")


def test_a_body_that_swallows_its_cancellation_starts_no_step_after_it(
    dsn: str, client: flowly.Client
) -> None:
    """The heartbeat finds the run cancelled and cancels the body's task; the body goes on."""
    run_id = client.start("swallows_its_cancel", 30)
    with running_worker(dsn, lease=1.5):
        wait_for(lambda: "long" in _events(run_id))
        client.cancel(run_id)
        wait_for(lambda: "swallowed" in _events(run_id))
        time.sleep(0.5)
    assert _events(run_id) == ["long", "swallowed"]
    assert client.get(run_id).status == "cancelled"


def test_a_body_that_swallows_a_refused_checkpoint_starts_no_step_after_it(
    dsn: str, client: flowly.Client
) -> None:
    """The step ends before any heartbeat: its checkpoint is refused (the lease was revoked,
    WF001), the body swallows the lost lease and goes on."""
    run_id = client.start("swallows_its_cancel", 0.5)
    with running_worker(dsn, lease=30):
        wait_for(lambda: "long" in _events(run_id))
        client.cancel(run_id)
        wait_for(lambda: "swallowed" in _events(run_id))
        time.sleep(0.5)
    assert _events(run_id) == ["long", "swallowed"]
    assert client.get(run_id).status == "cancelled"
