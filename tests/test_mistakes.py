"""Mistakes in a workflow's code fail the run at once, with a message that names them.

Retrying cannot help when the code itself is wrong (a step not awaited, a name used twice, an
output that is not JSON, an unknown start option, a body that does not take (ctx, input)),
so such a run fails on its first attempt instead of three.
"""

from __future__ import annotations

import math
import re
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

import flowly
from flowly.workflow import registered
from tests.support import running_worker, scalar


@pytest.mark.parametrize(("workflow", "error_type", "message"), [
    ("forgets_await", "WorkflowCodeError", "returned without awaiting its step 'never'"),
    ("name_twice", "WorkflowCodeError", "name 'same' is used twice"),
    ("object_output", "StepOutputNotSerializable", "workflow 'object_output' returned a object"),
    ("bad_start_option", "WorkflowCodeError", "unknown start option(s): priorty"),
    ("no_input", "WorkflowCodeError", "must take (ctx, input)"),
])
def test_a_mistake_in_workflow_code_fails_the_run_at_once(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any], workflow: str,
    error_type: str, message: str,
) -> None:
    run_id = client.start(workflow, None, max_attempts=3)
    with running_worker(dsn, workflows=[workflow, "quick"]):
        run = client.wait(run_id, timeout=30)
    assert run.status == "dead_letter"
    assert run.attempt == 1, "retried a run that could never succeed"
    assert run.error["type"] == error_type
    assert message in run.error["message"]
    # the un-awaited step never ran
    assert scalar(db, "select count(*) from public.test_effects where run_id = %s", run_id) == 0


# what a body hands ctx.sleep, ctx.wait_for_event and ctx.start: each would be wrong on every
# attempt
_ODD_CALLS: dict[str, Any] = {
    "event name int": lambda ctx: ctx.wait_for_event(42),
    "event name NUL": lambda ctx: ctx.wait_for_event("e\x00v"),
    "event timeout bool": lambda ctx: ctx.wait_for_event("ev", timeout=True),
    "event timeout text": lambda ctx: ctx.wait_for_event("ev", timeout="30s"),
    "event timeout nan": lambda ctx: ctx.wait_for_event("ev", timeout=math.nan),
    "event timeout inf": lambda ctx: ctx.wait_for_event("ev", timeout=math.inf),
    "event timeout 1e15": lambda ctx: ctx.wait_for_event("ev", timeout=1e15),
    "sleep nan": lambda ctx: ctx.sleep("nap", math.nan),
    "sleep inf": lambda ctx: ctx.sleep("nap", math.inf),
    "sleep 1e15": lambda ctx: ctx.sleep("nap", 1e15),
    "event timeout 3e11": lambda ctx: ctx.wait_for_event("ev", timeout=3e11),
    "sleep 3e11 s as days": lambda ctx: ctx.sleep("nap", timedelta(days=3e11 / 86400)),
    "sleep text": lambda ctx: ctx.sleep("nap", "10"),
    "start naive time": lambda ctx: ctx.start("quick", scheduled_for=datetime(2030, 1, 1)),
    "start delay text": lambda ctx: ctx.start("quick", delay="10"),
    "step not callable": lambda ctx: ctx.step("s", 42),
    "step retry int": lambda ctx: ctx.step("s", _fails, retry=3),
    "step compensate text": lambda ctx: ctx.step("s", lambda: 1, compensate="undo"),
    "transaction retry int": lambda ctx: ctx.transaction("t", lambda conn: 1, retry=3),
    "step name NUL": lambda ctx: ctx.step("a\x00", lambda: 1),
    "sleep_until naive": lambda ctx: ctx.sleep_until("n", datetime(2030, 1, 1)),
    "sleep_until text": lambda ctx: ctx.sleep_until("n", "2030-01-01"),
    "wait_for_run int": lambda ctx: ctx.wait_for_run(5),
    # OverflowError, retried until dead_letter
    "sleep 10**400": lambda ctx: ctx.sleep("nap", 10**400),
    "event timeout 10**400": lambda ctx: ctx.wait_for_event("ev", timeout=10**400),
    # a WorkflowCodeError about a "step or sleep name 'event:\ud800'"
    "event name surrogate": lambda ctx: ctx.wait_for_event("\ud800"),
}


def _fails() -> None:
    raise RuntimeError("a step that fails, so that its retry policy is read")


@flowly.workflow("odd_call")
async def odd_call(ctx: flowly.Context, inp: str) -> Any:
    return await _ODD_CALLS[inp](ctx)


@pytest.mark.parametrize(("case", "message"), [
    ("event name int", "event name must be a string, got int"),
    ("event name NUL", "event name must not contain the NUL"),
    ("event timeout bool", "timeout of wait for event 'ev' must be seconds or a timedelta"),
    ("event timeout text", "timeout of wait for event 'ev' must be seconds or a timedelta"),
    ("event timeout nan", "timeout of wait for event 'ev' must be a finite"),
    ("event timeout inf", "timeout of wait for event 'ev' must be a finite"),
    ("event timeout 1e15", "timeout of wait for event 'ev' is out of range"),
    ("event timeout 3e11", "timeout of wait for event 'ev' must end before the year 10000"),
    ("sleep nan", "sleep 'nap' must be a finite"),
    ("sleep inf", "sleep 'nap' must be a finite"),
    ("sleep 1e15", "sleep 'nap' is out of range"),
    ("sleep 3e11 s as days", "sleep 'nap' must end before the year 10000"),
    ("sleep text", "sleep 'nap' must be seconds or a timedelta, got str"),
    ("start naive time", "scheduled_for of a 'quick' run must be timezone-aware"),
    ("start delay text", "delay of a 'quick' run must be seconds or a timedelta"),
    ("step not callable", "step 's': the function must be callable, got 42"),
    ("step retry int", "step 's': retry must be a flowly.Retry, got 3"),
    ("step compensate text", "step 's': compensate must be callable"),
    ("transaction retry int", "transaction 't': retry must be a flowly.Retry"),
    ("step name NUL", "must be text of at most 1000 bytes with no NUL"),
    ("sleep_until naive", "sleep_until 'n': 'when' must be timezone-aware"),
    ("sleep_until text", "sleep_until 'n': 'when' must be a datetime, got str"),
    ("wait_for_run int", "the run_id waited for must be a string, got int"),
    ("sleep 10**400", "sleep 'nap' is out of range: about 10\\*\\*400 seconds"),
    ("event timeout 10**400", "timeout of wait for event 'ev' is out of range"),
    ("event name surrogate", "event name must not contain an unpaired surrogate"),
])
def test_a_value_every_attempt_would_pass_again_fails_the_run_at_once_naming_it(
    dsn: str, client: flowly.Client, case: str, message: str
) -> None:
    """These reached the database (a raw 22008 or a WF003 retried as if it could pass next
    time), were taken as something else (True as one second, "10" as ten) or named nothing."""
    run_id = client.start("odd_call", case, max_attempts=3)
    with running_worker(dsn, workflows=["odd_call", "quick"]):
        run = client.wait(run_id, timeout=30)
    assert run.status == "dead_letter"
    assert run.attempt == 1, "retried a run that could never succeed"
    assert (run.error["type"], message) == ("WorkflowCodeError", message)
    assert re.search(message, run.error["message"]), run.error["message"]


async def _body(ctx: flowly.Context, inp: Any) -> None:
    return None


@pytest.mark.parametrize(("decorate", "error", "message"), [
    (lambda: flowly.workflow(_body), TypeError,  # type: ignore[arg-type]
     r'write @flowly.workflow\("name"\)'),
    (lambda: flowly.workflow(5)(_body), flowly.InvalidArgument,  # type: ignore[arg-type]
     "workflow name must be a string"),
    (lambda: flowly.workflow("w", queue=5)(_body), flowly.InvalidArgument,  # type: ignore[arg-type]
     "queue of workflow 'w' must be a string"),
    (lambda: flowly.workflow("w", max_attempts=0)(_body), flowly.InvalidArgument,
     "max_attempts of workflow 'w' must be at least 1"),
])
def test_a_bad_registration_fails_where_it_is_written(
    decorate: Any, error: type[Exception], message: str
) -> None:
    """Before, a bare @flowly.workflow replaced the function by the decorator's closure, and
    the other three registered a workflow every start of which failed (or, for max_attempts
    0, was refused by the database) far from the mistake."""
    with pytest.raises(error, match=message):
        decorate()
    assert "w" not in registered()


@pytest.mark.parametrize(("options", "message"), [
    ({"max_attempts": "3"}, "Retry.max_attempts must be an integer, got str"),  # TypeError
    ({"max_attempts": True}, "Retry.max_attempts must be an integer, got bool"),
    # past the database's integer: the step's failure write itself failed
    ({"max_attempts": 2**40}, "Retry.max_attempts is out of range"),
    ({"initial_delay": "5"}, "Retry.initial_delay must be seconds or a timedelta, got str"),
    ({"initial_delay": True}, "Retry.initial_delay must be seconds or a timedelta, got bool"),
    ({"max_delay": math.nan}, "Retry.max_delay must be a finite number of seconds"),
])
def test_a_bad_retry_policy_is_refused_where_it_is_written(options: dict[str, Any],
                                                           message: str) -> None:
    with pytest.raises(flowly.InvalidArgument, match=message):
        flowly.Retry(**options)


@flowly.workflow("sleeps_into_the_past")
async def sleeps_into_the_past(ctx: flowly.Context, inp: Any) -> str:
    await ctx.sleep("long ago", -1e11)
    await ctx.sleep("before any float", -10**400)
    await ctx.sleep("the least timedelta", timedelta.min)
    try:
        await ctx.wait_for_event("never sent", timeout=-1e11)
    except flowly.EventTimeout:
        return "woke at once"
    return "received"


def test_a_sleep_or_an_event_timeout_of_any_negative_size_is_due_at_once(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """A sleep of -1e11 s (or timedelta.min, or an event timeout of -1e11 s) failed the run
    as "must end before the year 10000", and one of -10**400 s was retried until dead_letter
    with OverflowError; the README says a sleep of zero or fewer seconds is due at once."""
    run_id = client.start("sleeps_into_the_past")
    with running_worker(dsn, workflows=["sleeps_into_the_past"]):
        run = client.wait(run_id, timeout=30)
    assert (run.status, run.output, run.attempt) == ("completed", "woke at once", 1), run.error
    assert scalar(db, "select count(*) from flowly.timers where run_id = %s", run_id) == 3
