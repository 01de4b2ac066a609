"""A record replays only into the kind of call that made it.

Steps, transactions, sleeps, child starts and waits are recorded by name (waits and starts
under a name their kind prefixes, ``event:<name>``, ``start:<id>``). A body whose call under a
recorded name changes kind between executions (new code deployed while the run was in
flight, a branch that depends on something not recorded) must not be handed the other call's
record: a step's output taken as an event's payload, a sleep taken for a step that then runs
again, a step's compensation called as a transaction's. The run fails with a code error that
names the record and both kinds.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

import psycopg
import pytest

import flowly
from tests.support import running_worker, scalar

Call = Callable[[flowly.Context], Awaitable[Any]]


async def _wait_for_go(ctx: flowly.Context) -> Any:
    with suppress(flowly.EventTimeout):  # a timeout is recorded too, and replayed
        return await ctx.wait_for_event("go", timeout=0)


def _child(ctx: flowly.Context) -> str:
    return f"{ctx.run_id}-kid"


# what the first attempt calls, what the second calls under the same record, and the kinds
# the error must name: (recorded, reached)
KIND_CHANGES: dict[str, tuple[Call, Call, str, str, str]] = {
    "step then sleep": (
        lambda ctx: ctx.step("x", lambda: 41),
        lambda ctx: ctx.sleep("x", 0),
        "x", "a step", "a sleep"),
    "sleep then step": (
        lambda ctx: ctx.sleep("x", 0),
        lambda ctx: ctx.step("x", lambda: 41),
        "x", "a sleep", "a step"),
    "step then transaction": (
        lambda ctx: ctx.step("x", lambda: 41),
        lambda ctx: ctx.transaction("x", lambda conn: 41),
        "x", "a step", "a transaction"),
    "transaction then step": (
        lambda ctx: ctx.transaction("x", lambda conn: 41),
        lambda ctx: ctx.step("x", lambda: 41),
        "x", "a transaction", "a step"),
    "step then wait for an event": (
        lambda ctx: ctx.step("event:go", lambda: 41),
        _wait_for_go,
        "event:go", "a step", "a wait for an event"),
    "wait for an event then step": (
        _wait_for_go,
        lambda ctx: ctx.step("event:go", lambda: 41),
        "event:go", "a wait for an event", "a step"),
    "step then child start": (
        lambda ctx: ctx.step(f"start:{_child(ctx)}", lambda: 41),
        lambda ctx: ctx.start("quick", None, run_id=_child(ctx)),
        "start:{run}-kid", "a step", "a child's start"),
    "child start then sleep": (
        lambda ctx: ctx.start("quick", None, run_id=_child(ctx)),
        lambda ctx: ctx.sleep(f"start:{_child(ctx)}", 0),
        "start:{run}-kid", "a child's start", "a sleep"),
}


@flowly.workflow("rk_kind_changes")
async def rk_kind_changes(ctx: flowly.Context, case: str) -> Any:
    first, second, *_ = KIND_CHANGES[case]
    if ctx.attempt == 1:
        await first(ctx)
        raise RuntimeError("fails once, so that the second attempt replays the record")
    return await second(ctx)


@pytest.mark.parametrize("case", list(KIND_CHANGES))
def test_a_record_reached_by_another_kind_of_call_fails_the_run_naming_both(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any], case: str,
) -> None:
    *_, record, recorded, reached = KIND_CHANGES[case]
    run_id = client.start("rk_kind_changes", case, max_attempts=3)
    with running_worker(dsn):
        run = client.wait(run_id, timeout=30)
    assert (run.status, run.attempt) == ("dead_letter", 2), (run.status, run.output, run.error)
    assert run.error["type"] == "WorkflowCodeError", run.error
    message = run.error["message"]
    assert repr(record.format(run=run_id)) in message, message
    assert f"recorded by {recorded}" in message and f"reaches it as {reached}" in message, message
    # nothing was written under the name by the second call: the record stays the first's
    assert scalar(db, "select (select count(*) from flowly.steps where run_id = %s)"
                      " + (select count(*) from flowly.timers where run_id = %s)",
                  run_id, run_id) == 1
