"""The engine end to end through the public API, with a real worker in this process."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import flowly
from flowly.db import Calls, translated_errors
from flowly.group_commit import GroupCommitter
from tests import workflows
from tests.support import running_worker, scalar, wait_for


def test_completed_steps_are_replayed_not_executed(dsn: str, client: flowly.Client) -> None:
    """The body fails once after a step and a child start; the retry replays both."""
    run_id = client.start("replay", {})
    with running_worker(dsn):
        run = client.wait(run_id, timeout=30)
        assert run.status == "completed", run.error
    assert workflows.CALLS[run_id] == ["counted"]  # executed once over two attempts
    assert run.attempt == 2 and run.output["attempt"] == 2
    stored = client.steps(run_id)
    child = run.output["child"]
    # the child's start is recorded in the body's order, after the step
    assert [(s.name, s.kind, s.output) for s in stored][1:] == [
        (f"start:{child}", "start", child)]
    assert stored[0].name == "counted"
    assert run.output["first"] == stored[0].output  # the replay returned the stored output
    children = client.list_runs(workflow="quick")
    assert [c.id for c in children] == [child]  # started once, not twice
    assert children[0].parent_run_id == run_id


def test_step_retries_follow_each_backoff_kind(dsn: str, client: flowly.Client,
                                               db: psycopg.Connection[Any]) -> None:
    expected = {
        "fixed": [0.2, 0.2, 0.2],
        "linear": [0.2, 0.4, 0.6],
        "exponential": [0.2, 0.4, 0.8],
    }
    runs = {kind: client.start("flaky", {"failures": 3, "backoff": kind, "initial_delay": 0.2})
            for kind in expected}
    capped = client.start("flaky", {"failures": 3, "backoff": "exponential",
                                    "initial_delay": 0.2, "max_delay": 0.3})
    with running_worker(dsn):
        for run_id in [*runs.values(), capped]:
            assert client.wait(run_id, timeout=30).status == "completed"
    for kind, run_id in [*runs.items(), ("capped", capped)]:
        attempts = db.execute(
            "select extract(epoch from retry_at - failed_at)::float, started_at, retry_at"
            " from flowly.step_attempts where run_id = %s order by attempt", (run_id,)).fetchall()
        delays = [round(a[0], 3) for a in attempts]
        assert delays == (expected[kind] if kind != "capped" else [0.2, 0.3, 0.3]), kind
        final_start = scalar(db, "select started_at from flowly.steps where run_id = %s", run_id)
        next_starts = [a[1] for a in attempts[1:]] + [final_start]
        for (_, _, retry_at), started in zip(attempts, next_starts, strict=True):
            assert started >= retry_at - timedelta(milliseconds=20)  # never before its time
        step = client.steps(run_id)[0]
        assert step.attempts == 4 and step.output == 4


def test_exhausted_step_compensates_in_reverse_and_dead_letters(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    run_id = client.start("saga", None)
    workflows.SAGA_FAILS.add(run_id)
    with running_worker(dsn):
        run = client.wait(run_id, timeout=30)
    assert run.status == "dead_letter"
    assert run.compensation_ok is False  # s2's compensation failed
    assert run.error["step"] == "s4" and run.error["message"] == "s4 always fails"
    log = workflows.CALLS[run_id]
    assert log == ["do:s1", "do:s2", "do:s3", "do:s4", "do:s4", "undo:s3", "undo:s2", "undo:s1"]
    outcomes = {s.name: (s.status, s.compensation_status) for s in client.steps(run_id)}
    assert outcomes == {"s1": ("completed", "completed"), "s2": ("completed", "failed"),
                        "s3": ("completed", "completed"), "s4": ("failed", None)}
    assert client.steps(run_id)[1].compensation_error["message"] == "compensation of s2 failed"
    row = db.execute("select failed_step, compensation_ok from flowly.dead_letters"
                     " where run_id = %s", (run_id,)).fetchone()
    assert row == ("s4", False)

    # fixed: retrying re-runs the undone steps and the failed one, replays s2 (not undone)
    workflows.SAGA_FAILS.discard(run_id)
    log.clear()
    assert client.retry_dead_letter(run_id) == run_id
    with running_worker(dsn):
        run = client.wait(run_id, timeout=30)
    assert run.status == "completed" and run.output == "ok"
    assert log == ["do:s1", "do:s3", "do:s4"]
    assert {s.name: s.status for s in client.steps(run_id)} == {
        "s1": "completed", "s2": "completed", "s3": "completed", "s4": "completed"}


def test_retry_dead_letter_refuses_other_states(client: flowly.Client) -> None:
    run_id = client.start("quick", 1)
    with pytest.raises(flowly.InvalidState, match="only a dead_letter run"):
        client.retry_dead_letter(run_id)
    with pytest.raises(flowly.RunNotFound):
        client.retry_dead_letter("no-such-run")


def test_start_is_idempotent_on_run_id(client: flowly.Client, db: psycopg.Connection[Any]) -> None:
    first = client.start("quick", {"n": 1}, run_id="order-42")
    again = client.start("quick", {"n": 2}, run_id="order-42")
    from_sql = scalar(db, "select flowly.start('quick', '{\"n\": 3}', run_id => 'order-42')")
    assert first == again == from_sql == "order-42"
    assert scalar(db, "select count(*) from flowly.runs") == 1
    assert client.get("order-42").input == {"n": 1}


def test_concurrency_key_admits_one_live_run(dsn: str, client: flowly.Client) -> None:
    first = client.start("quick", 1, concurrency_key="customer-7")
    second = client.start("quick", 2, concurrency_key="customer-7")
    assert second == first  # the live run, not a duplicate
    with running_worker(dsn):
        client.wait(first, timeout=20)
        third = client.start("quick", 3, concurrency_key="customer-7")
        assert third != first  # admitted once the first finished
        assert client.wait(third, timeout=20).status == "completed"


def test_start_joins_the_callers_transaction(dsn: str, client: flowly.Client) -> None:
    with psycopg.connect(dsn) as app:
        rolled_back = client.start("quick", 1, conn=app)
        app.rollback()
        committed = client.start("quick", 2, conn=app)
        app.commit()
    with pytest.raises(flowly.RunNotFound):
        client.get(rolled_back)
    assert client.get(committed).status == "pending"


def test_start_from_a_trigger(dsn: str, client: flowly.Client,
                              db: psycopg.Connection[Any]) -> None:
    db.execute("""
        create table orders (id int primary key, sku text);
        create function enqueue_order() returns trigger language plpgsql as $$
        begin
            perform flowly.start('quick', to_jsonb(new), run_id => 'order-' || new.id);
            return new;
        end $$;
        create trigger orders_enqueue after insert on orders
            for each row execute function enqueue_order();
    """)
    db.execute("insert into orders values (1, 'book')")
    with running_worker(dsn):
        run = client.wait("order-1", timeout=20)
    assert run.status == "completed"
    assert run.output == {"input": {"id": 1, "sku": "book"}, "total": 3}


def test_cancel_a_running_run_stops_its_step(dsn: str, client: flowly.Client) -> None:
    run_id = client.start("slow", {"seconds": 30})
    with running_worker(dsn, lease=1.5):
        wait_for(lambda: client.get(run_id).status == "running", what="run claimed")
        time.sleep(0.2)
        assert client.cancel(run_id) == "cancelled"
        wait_for(lambda: run_id in workflows.CANCELLED, timeout=5, what="step task cancelled")
    assert client.get(run_id).status == "cancelled"
    assert client.steps(run_id) == []


def test_cancel_a_sleeping_run(dsn: str, client: flowly.Client,
                               db: psycopg.Connection[Any]) -> None:
    run_id = client.start("sleepy", {"seconds": 0.6})
    with running_worker(dsn):
        wait_for(lambda: scalar(db, "select count(*) from flowly.timers where run_id = %s",
                                run_id), what="timer written")
        assert client.cancel(run_id) == "cancelled"
        time.sleep(1.2)  # past the wake time: a worker must not resume it
    assert client.get(run_id).status == "cancelled"
    assert [s.name for s in client.steps(run_id)] == ["before"]
    assert client.cancel(run_id) == "cancelled"  # cancelling again changes nothing


def test_run_timeout_dead_letters_and_stops_the_run(dsn: str, client: flowly.Client) -> None:
    with running_worker(dsn, lease=1.5):  # started first: the timeout counts from the start
        run_id = client.start("slow", {"seconds": 30}, timeout=1)
        run = client.wait(run_id, timeout=10)
        wait_for(lambda: run_id in workflows.CANCELLED, timeout=5, what="timed-out step cancelled")
    assert run.status == "dead_letter"
    assert run.error["type"] == "Timeout"


def test_poison_step_outcomes_fail_the_run_not_the_worker(dsn: str,
                                                          client: flowly.Client) -> None:
    """A non-JSON output, a SystemExit, a StopIteration and a CancelledError of the step's own
    making each fail their run (not retried forever as if the worker were cancelling it)."""
    bad = client.start("bad_output", None)
    poison = client.start("poison", None)
    stopped = client.start("stop_iteration", None)
    cancelled = client.start("cancelled_inside", None)
    with running_worker(dsn):
        for run_id in (bad, poison, stopped, cancelled):
            assert client.wait(run_id, timeout=20).status == "dead_letter"
        good = client.start("quick", 1)
        assert client.wait(good, timeout=20).status == "completed"  # the worker lives on
    error = client.get(bad).error
    assert error["type"] == "StepOutputNotSerializable"
    assert "step 'make_object'" in error["message"]
    assert client.steps(bad)[0].attempts == 1  # not retried: it would fail the same way
    assert client.get(poison).error["type"] == "SystemExit"
    assert "StopIteration" in client.get(stopped).error["message"]
    assert client.get(cancelled).error["type"] == "CancelledError"


def test_values_jsonb_refuses_fail_their_own_run_only(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """What jsonb or the steps index refuses (a NUL character) in one run's output, error or
    step name fails that run with a clear error; the runs whose writes share its group commit
    complete once."""
    bad = client.start("nul_output", None)
    failing = client.start("nul_error", None)
    badly_named = client.start("nul_name", None, max_attempts=1)
    good = [client.start("three_steps", {}) for _ in range(20)]
    with running_worker(dsn):
        assert client.wait(bad, timeout=20).status == "dead_letter"
        assert client.wait(failing, timeout=20).status == "dead_letter"
        assert client.wait(badly_named, timeout=20).status == "dead_letter"
        assert all(client.wait(run_id, timeout=20).status == "completed" for run_id in good)
    error = client.get(bad).error
    assert error["type"] == "StepOutputNotSerializable"
    assert "step 'make_nul'" in error["message"] and "U+0000" in error["message"]
    assert client.get(failing).error["message"] == "bad\\x00message"
    assert "NUL" in client.get(badly_named).error["message"]
    assert scalar(db, "select max(takeovers) from flowly.runs") == 0
    assert scalar(db, "select count(*) from public.test_effects") == 3 * len(good)
    with pytest.raises(ValueError, match=r"U\+0000"):
        client.start("quick", {"text": "\x00"})


def test_a_huge_error_message_is_stored_cut_to_its_head_and_says_so(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """A step or a body failing with a 20 MB message (a response body, a whole file in an
    exception): each attempt's error, the run's error and the dashboards would carry it
    whole, once per attempt. The message is stored cut to its first 8,000 characters,
    saying how many were cut; short messages stay as they are."""
    length = 20_000_000
    in_step = client.start("long_error", {"where": "step", "length": length})
    in_body = client.start("long_error", {"where": "body", "length": length},
                           max_attempts=1)
    short = client.start("long_error", {"where": "step", "length": 10})
    with running_worker(dsn):
        for run_id in (in_step, in_body, short):
            assert client.wait(run_id, timeout=60).status == "dead_letter"
    cut = f" [message cut: {length + 5 - 8000:,} more characters]"
    assert client.get(in_step).error["message"] == "step " + "x" * 7995 + cut
    assert client.get(in_body).error["message"] == "body " + "y" * 7995 + cut
    attempts = client.failed_attempts(in_step)
    assert len(attempts) == 2
    assert all(a.error["message"] == "step " + "x" * 7995 + cut for a in attempts)
    assert client.get(short).error["message"] == "step " + "x" * 10
    assert scalar(db, "select max(length(error::text)) from flowly.runs") < 20_000


def test_sleep_cannot_be_swallowed_by_except_exception(dsn: str, client: flowly.Client) -> None:
    run_id = client.start("catches_everything", {"seconds": 0.3})
    with running_worker(dsn):
        assert client.wait(run_id, timeout=20).output == "slept"


def test_unknown_workflow_waits_for_a_worker_that_knows_it(dsn: str,
                                                           client: flowly.Client) -> None:
    stranger = client.start("not_registered_here", None)
    known = client.start("quick", 1)
    with running_worker(dsn, workflows=["quick"]):
        assert client.wait(known, timeout=20).status == "completed"
    assert client.get(stranger).status == "pending"


def test_bad_input_is_named(client: flowly.Client) -> None:
    with pytest.raises(flowly.InvalidArgument, match="not JSON serialisable"):
        client.start("quick", object())
    with pytest.raises(flowly.InvalidArgument, match="max_attempts"):
        client.start("quick", 1, max_attempts=0)
    with pytest.raises(flowly.RunNotFound):
        client.get("missing")
    with pytest.raises(ValueError, match="backoff"):
        flowly.Retry(backoff="random")  # type: ignore[arg-type]
    with pytest.raises(flowly.UnknownWorkflow):
        flowly.Worker("postgresql://unused", ["never_registered"])
    with pytest.raises(flowly.UnknownWorkflow, match="'never_registered' is not"):
        flowly.Worker("postgresql://unused", "never_registered")


def test_a_worker_given_one_workflow_alone_serves_it(dsn: str, client: flowly.Client) -> None:
    """Not the letters of its name: ``Worker(dsn, "quick")`` is ``Worker(dsn, ["quick"])``."""
    from tests.workflows import quick

    assert list(flowly.Worker(dsn, quick).workflows) == ["quick"]
    run_id = client.start("quick", 1)
    with running_worker(dsn, workflows="quick") as worker:
        assert list(worker.workflows) == ["quick"]
        assert client.wait(run_id, timeout=20).status == "completed"


@pytest.mark.parametrize("call", [
    "flowly.claim('w', array['quick'], array['default'], 1, null)",
    "flowly.claim('w', array['quick'], array['default'], 1, '-1 second')",
    "flowly.claim('w', array['quick'], array['default'], 0, '1 minute')",
    "flowly.claim('w', array['quick'], array['default'], null, '1 minute')",
    "flowly.heartbeat('w', array['r'], array[1::bigint], '0 seconds')",
])
def test_worker_functions_refuse_arguments_that_would_unprotect_a_run(
    db: psycopg.Connection[Any], call: str
) -> None:
    db.execute("select flowly.start('quick', run_id => 'r')")
    with pytest.raises(psycopg.Error, match=r"lease|limit") as refused:
        db.execute(f"select * from {call}")
    assert refused.value.sqlstate == "WF003"
    assert scalar(db, "select status from flowly.runs") == "pending"


@pytest.mark.parametrize(("call", "named"), [
    ("flowly.register_worker('w', null, array['default'], '1 minute')", "workflows"),
    ("flowly.register_worker('w', array['quick'], null, '1 minute')", "queues"),
    ("flowly.offer_slot(null, array['quick'], array['default'], '1 minute', 'c')", "worker"),
    ("flowly.offer_slot('w', null, array['default'], '1 minute', 'c')", "workflows"),
    ("flowly.offer_slot('w', array['quick'], null, '1 minute', 'c')", "queues"),
    ("flowly.claim_and_offer('w', array['quick'], null, 1, '1 minute', 'c')", "queues"),
    ("flowly.claim_and_offer(null, array['quick'], array['default'], 1, '1 minute', 'c')",
     "worker"),
    ("flowly.claim(null, array['quick'], array['default'], 1, '1 minute')", "worker"),
    ("flowly.claim('w', null, array['default'], 1, '1 minute')", "workflows"),
    ("flowly.claim('w', array['quick'], null, 1, '1 minute')", "queues"),
    ("flowly.heartbeat(null, array['r'], array[1::bigint], '1 minute')", "worker"),
])
def test_worker_functions_name_a_null_argument(
    db: psycopg.Connection[Any], call: str, named: str
) -> None:
    """A NULL worker, workflow list or queue list is an invalid argument that names itself
    (WF003), not the raw not-null violation of the row it would have written (23502). claim
    read a NULL list as an empty one and claimed nothing, and a NULL worker as a name: the
    run it claimed was held by nobody; heartbeat extended the leases of a NULL worker's
    runs. The due run is left as it was."""
    db.execute("select flowly.start('quick', run_id => 'r')")
    with pytest.raises(psycopg.Error, match=f"^{named} must not be null") as refused:
        db.execute(f"select * from {call}")
    assert refused.value.sqlstate == "WF003"
    assert db.execute("select status, locked_by, locked_until from flowly.runs").fetchone() == (
        "pending", None, None)


@pytest.mark.parametrize(("call", "named"), [
    ("flowly.fail_run('r', {epoch}, '{{}}', null)", "retryable"),
    ("flowly.fail_run('r', {epoch}, null)", "error"),
    ("flowly.fail_step('r', {epoch}, 's', '{{}}', now(), 3, 'fixed', 1, 1, null)", "retryable"),
    ("flowly.fail_step('r', {epoch}, 's', '{{}}', now(), null, 'fixed', 1, 1)", "max_attempts"),
    ("flowly.fail_step('r', {epoch}, 's', null, now(), 3, 'fixed', 1, 1)", "error"),
    ("flowly.fail_step('r', {epoch}, 's', '{{}}', null, 3, 'fixed', 1, 1)", "started_at"),
    ("flowly.sleep(null, {epoch}, 'nap', p_seconds => 60)", "run_id"),
    ("flowly.fail_run(null, {epoch}, '{{}}')", "run_id"),
    ("flowly.park(null, {epoch}, array['s'])", "run_id"),
    ("flowly.wait_for_event(null, {epoch}, 'w', 'go')", "run_id"),
])
def test_the_worker_protocol_names_a_null_argument_and_leaves_the_run_held(
    db: psycopg.Connection[Any], call: str, named: str
) -> None:
    """The worker's fenced calls typed by hand with a NULL: a NULL retryable flag or attempt
    limit dead-lettered a run whose failure could be retried, a NULL error was a raw 23502,
    and a NULL run id said "run <NULL> not found" (WF002). Each names its argument (WF003),
    and the run stays as its worker holds it."""
    db.execute("select flowly.start('quick', run_id => 'r')")
    epoch = scalar(db, "select lease_epoch from flowly.claim('w', array['quick'],"
                       " array['default'], 1, '1 minute')")
    with pytest.raises(psycopg.Error, match=f"^{named} must not be null") as refused:
        db.execute(f"select * from {call.format(epoch=epoch)}")
    assert refused.value.sqlstate == "WF003"
    assert db.execute("select status, lease_epoch, attempt from flowly.runs").fetchone() == (
        "running", epoch, 1)
    assert scalar(db, "select count(*) from flowly.step_attempts") == 0


@pytest.mark.parametrize("call", [
    "flowly.heartbeat('w', array['r'], array[]::bigint[], '1 minute')",
    "flowly.heartbeat('w', null, array[{epoch}], '1 minute')",
    "flowly.release(array['r', 'x'], array[{epoch}])",
    "flowly.complete_runs(array['r'], array[{epoch}], array[]::jsonb[])",
    "flowly.checkpoint_steps(array['r'], array[{epoch}], array['s'], array['1'::jsonb],"
    " array[now()], array[]::boolean[], array[0])",
])
def test_the_worker_s_batches_refuse_lists_of_different_lengths_leaving_the_run_held(
    db: psycopg.Connection[Any], call: str
) -> None:
    """The worker's batch calls pair their lists item by item, and unnest pads a shorter
    list with NULLs. checkpoint_steps and complete_runs refuse that since 0050; heartbeat and
    release, typed by hand with one list shorter, answered for a run id of NULL. Each is WF003
    naming itself, and the run stays as its worker holds it."""
    db.execute("select flowly.start('quick', run_id => 'r')")
    epoch = scalar(db, "select lease_epoch from flowly.claim('w', array['quick'],"
                       " array['default'], 1, '1 minute')")
    function = call.removeprefix("flowly.").split("(")[0]
    with pytest.raises(psycopg.Error, match=f"^{function} needs its arrays of one length, got "
                       ) as refused:
        db.execute(f"select * from {call.format(epoch=epoch)}")
    assert refused.value.sqlstate == "WF003"
    assert db.execute("select status, lease_epoch, output from flowly.runs").fetchone() == (
        "running", epoch, None)
    assert scalar(db, "select count(*) from flowly.step_attempts") == 0


@pytest.mark.parametrize("call", [
    "flowly.checkpoint('r1', null, 's', '1')",
    "flowly.complete('r1', null, '1')",
    "flowly.sleep('r1', null, 'nap', p_seconds => 60)",
    "flowly.fail_run('r1', null, '{}', false)",
    "flowly.fail_step('r1', null, 's', '{}', now(), 1, 'fixed', 1, 1)",
    "flowly.park('r1', null, array['s'])",
    "flowly.wait_for_event('r1', null, 'w', 'go')",
    "flowly.begin_transaction_step('r1', null)",
])
def test_a_write_without_a_fencing_token_is_refused_as_a_stale_lease(
    db: psycopg.Connection[Any], call: str,
) -> None:
    """A fenced call typed by hand with a NULL epoch (a forgotten argument) compared the run's
    epoch with NULL, which is not true: sleep, fail_run, fail_step, park, wait_for_event and
    begin_transaction_step released or ended the run its worker held."""
    db.execute("select flowly.start('quick', run_id => 'r1')")
    epoch = scalar(db, "select lease_epoch from flowly.claim('w1', array['quick'],"
                       " array['default'], 1, '30 seconds')")
    with pytest.raises(psycopg.Error) as info:
        db.execute(f"select * from {call}")
    assert info.value.sqlstate == "WF001", info.value
    assert db.execute("select status, locked_by, lease_epoch from flowly.runs").fetchone() == (
        "running", "w1", epoch)
    assert scalar(db, "select count(*) from flowly.steps") == 0


@pytest.mark.parametrize("call", [
    "flowly.complete_runs(array['r1', 'r2'], array[E1, E2], array['1'::jsonb])",
    "flowly.complete_runs(array['r1', 'r2'], array[E1, E2], array['1'::jsonb, null])",
    "flowly.complete_runs(array['r1', null], array[E1, E2], array['1'::jsonb, '2'])",
    "flowly.checkpoint_steps(array['r1', 'r2'], array[E1, E2], array['s', 's'],"
    " array['1'::jsonb, '2'], array[now()], array[false, false], array[1, 1])",
    "flowly.checkpoint_steps(array['r1', 'r2'], array[E1, E2], array['s', 's'],"
    " array['1'::jsonb, '2'], array[now(), null], array[false, false], array[1, 1])",
    "flowly.checkpoint_steps(array['r1', 'r2'], array[E1, E2], array['s', 's'],"
    " array['1'::jsonb, '2'], array[now(), now()], array[false, null], array[1, 1])",
    "flowly.checkpoint_steps(array['r1', 'r2'], array[E1, E2], array['s', 's'],"
    " array['1'::jsonb, null], array[now(), now()], array[false, false], array[1, 1])",
])
def test_a_batch_call_with_short_arrays_or_missing_values_is_refused_whole(
    db: psycopg.Connection[Any], call: str,
) -> None:
    """complete_runs and checkpoint_steps unnest their arrays side by side, which pads the
    short ones with NULLs: a missing output completed run r2 with none at all, a missing
    start time or flag failed with the table's 23502. Refused with WF003, nothing written."""
    db.execute("select flowly.start('quick', run_id => 'r1')")
    db.execute("select flowly.start('quick', run_id => 'r2')")
    epochs = dict(db.execute("select run_id, lease_epoch from flowly.claim('w1',"
                             " array['quick'], array['default'], 2, '30 seconds')").fetchall())
    call = call.replace("E1", str(epochs["r1"])).replace("E2", str(epochs["r2"]))
    with pytest.raises(psycopg.Error) as info:
        db.execute(f"select * from {call}")
    assert info.value.sqlstate == "WF003", info.value
    assert db.execute("select id, status, output from flowly.runs order by id").fetchall() == [
        ("r1", "running", None), ("r2", "running", None)]
    assert scalar(db, "select count(*) from flowly.steps") == 0


@pytest.mark.parametrize("steps", ["'{}'::text[]", "null", "array[null]::text[]"])
def test_a_park_for_no_wait_is_refused_and_keeps_the_run_and_its_waits(
    db: psycopg.Connection[Any], steps: str,
) -> None:
    """park(p_steps => '{}') dropped the run's waits and parked it until 9999-12-31, where
    nothing wakes it; now WF003, the run still held with its wait."""
    db.execute("select flowly.start('quick', run_id => 'r1')")
    epoch = scalar(db, "select lease_epoch from flowly.claim('w1', array['quick'],"
                       " array['default'], 1, '30 seconds')")
    db.execute("select * from flowly.wait_for_event('r1', %s, 'wait:go', 'go')", (epoch,))
    with pytest.raises(psycopg.Error) as info:
        db.execute(f"select flowly.park('r1', %s, {steps})", (epoch,))
    assert info.value.sqlstate == "WF003", info.value
    assert db.execute("select status, locked_by from flowly.runs").fetchone() == ("running", "w1")
    assert scalar(db, "select count(*) from flowly.waits where run_id = 'r1'") == 1


def test_a_replay_page_of_the_largest_size_does_not_overflow(db: psycopg.Connection[Any]) -> None:
    db.execute("select flowly.start('quick', run_id => 'r1')")
    epoch = scalar(db, "select lease_epoch from flowly.claim('w1', array['quick'],"
                       " array['default'], 1, '30 seconds')")
    db.execute("select flowly.checkpoint('r1', %s, 's', '1'::jsonb)", (epoch,))
    rows = db.execute("select name, more from flowly.replay('r1', 0, 2147483647)").fetchall()
    assert rows == [("s", False)]


def test_a_purge_older_than_the_first_time_deletes_nothing(
    db: psycopg.Connection[Any], client: flowly.Client,
) -> None:
    """older_than past the year 1 made now() - older_than overflow (22008): no run finished
    that long ago, so nothing is deleted (SQL and Client alike)."""
    db.execute("select flowly.start('quick', run_id => 'r1')")
    db.execute("select flowly.cancel('r1')")
    assert scalar(db, "select flowly.purge(older_than => '100000 years')") == 0
    assert client.purge(1e12) == 0 and client.purge(timedelta(days=999_999_999)) == 0
    assert client.purge(0) == 1


def test_stale_fencing_token_is_refused_with_its_own_sqlstate(
    db: psycopg.Connection[Any],
) -> None:
    db.execute("select flowly.start('quick', run_id => 'r1')")
    epoch = scalar(db, "select lease_epoch from flowly.claim('w1', array['quick'],"
                       " array['default'], 1, '1 millisecond')")
    time.sleep(0.01)
    taken = scalar(db, "select lease_epoch from flowly.claim('w2', array['quick'],"
                       " array['default'], 1, '30 seconds')")
    assert taken == epoch + 1  # expired lease taken over, attempt not burnt
    assert scalar(db, "select attempt from flowly.runs where id = 'r1'") == 1
    with pytest.raises(psycopg.Error) as info:
        db.execute("select flowly.checkpoint('r1', %s, 's', '1')", (epoch,))
    assert info.value.sqlstate == "WF001"
    assert scalar(db, "select flowly.checkpoint('r1', %s, 's', '2')", taken) == 2
    assert scalar(db, "select flowly.checkpoint('r1', %s, 's', '3')", taken) == 2  # first wins
    lost = db.execute("select * from flowly.heartbeat('w1', array['r1'], array[%s]::bigint[],"
                      " '30 seconds')", (epoch,)).fetchall()
    assert lost == [("r1", "lost")]


def _compensating_run(db: psycopg.Connection[Any], run_id: str, timeout: str) -> int:
    """A run held by worker w whose compensable step completed and whose next step exhausted
    its retries: it is compensating. Returns its epoch."""
    db.execute("select flowly.start('quick', run_id => %s, timeout => %s::interval)",
               (run_id, timeout))
    epoch = scalar(db, "select lease_epoch from flowly.claim('w', array['quick'],"
                       " array['default'], 1, '1 hour')")
    db.execute("select flowly.checkpoint(%s, %s, 'undoable', '1', now(), true)", (run_id, epoch))
    decision = scalar(db, "select decision from flowly.fail_step(%s, %s, 'fails',"
                          " '{\"type\": \"E\"}', now(), 1, 'fixed', 1, 1)", run_id, epoch)
    assert decision == "compensate"
    assert scalar(db, "select status from flowly.runs where id = %s", run_id) == "compensating"
    return int(epoch)


def test_a_compensating_run_finishes_its_saga_past_its_timeout(
    db: psycopg.Connection[Any],
) -> None:
    # a timeout the setup's four calls fit in on a loaded machine, then waited out
    epoch = _compensating_run(db, "late", "2 seconds")
    wait_for(lambda: scalar(db, "select clock_timestamp() > timeout_at from flowly.runs"),
             what="the run past its timeout")
    assert db.execute("select * from flowly.heartbeat('w', array['late'], array[%s::bigint],"
                      " '1 hour')", (epoch,)).fetchall() == []  # still held, not timed out
    db.execute("select flowly.record_compensation('late', %s, 'undoable', null)", (epoch,))
    assert scalar(db, "select flowly.finish_compensation('late', %s)", epoch) is True
    assert db.execute("select status, compensation_ok from flowly.runs").fetchone() == (
        "dead_letter", True)


def test_cancelling_a_saga_midway_records_compensation_not_ok(
    db: psycopg.Connection[Any],
) -> None:
    _compensating_run(db, "midway", "1 hour")
    assert scalar(db, "select flowly.cancel('midway')") == "cancelled"
    assert scalar(db, "select compensation_ok from flowly.runs") is False


def test_a_racing_duplicate_checkpoint_returns_the_first_output(
    dsn: str, db: psycopg.Connection[Any],
) -> None:
    """Two writers of the same step at the same epoch: the second is told the run is busy
    (WF005, it never queues behind the first), and once the first committed it gets the
    stored output back (not null, not its own)."""
    db.execute("select flowly.start('quick', run_id => 'r1')")
    epoch = scalar(db, "select lease_epoch from flowly.claim('w', array['quick'],"
                       " array['default'], 1, '1 hour')")
    with psycopg.connect(dsn) as first:
        first.execute("select flowly.checkpoint('r1', %s, 's', '\"first\"')", (epoch,))
        with pytest.raises(flowly.RunBusy):
            with translated_errors():
                db.execute("select flowly.checkpoint('r1', %s, 's', '\"second\"')", (epoch,))
        first.commit()
    assert scalar(db, "select flowly.checkpoint('r1', %s, 's', '\"second\"')", epoch) == "first"


def test_many_runs_share_a_handful_of_connections(dsn: str, client: flowly.Client,
                                                  db: psycopg.Connection[Any]) -> None:
    """Concurrency 200, 2,000 runs: the worker holds max_connections, a listener and a
    heartbeat connection (README)."""
    db.execute("select flowly.start('io_bound', jsonb_build_object('seconds', 0.05))"
               " from generate_series(1, 2000)")
    peak = 0
    with running_worker(dsn, concurrency=200, max_connections=4):
        def done() -> bool:
            nonlocal peak
            # client backends only: an autovacuum worker on this database counts there too
            # (7 were seen on a server with autovacuum on)
            peak = max(peak, scalar(
                db, "select count(*) from pg_stat_activity"
                    " where datname = current_database() and pid <> pg_backend_pid()"
                    " and backend_type = 'client backend'"))
            return bool(scalar(db, "select count(*) = 2000 from flowly.runs"
                                   " where status = 'completed'"))
        wait_for(done, timeout=90, interval=0.02, what="2,000 runs completed")
    assert 2 <= peak <= 4 + 1 + 1  # pool + listener + heartbeat


def test_sleep_until_wakes_at_the_given_time(dsn: str, client: flowly.Client) -> None:
    at = time.time() + 0.8
    run_id = client.start("alarm", {"at": at})
    with running_worker(dsn):
        run = client.wait(run_id, timeout=20)
    assert run.status == "completed"
    assert at <= run.output <= at + 1.0


def test_worker_survives_a_dropped_listener(dsn: str, client: flowly.Client,
                                            db: psycopg.Connection[Any]) -> None:
    """NOTIFY wakes an idle worker at once; if the LISTEN connection dies, the listener comes
    back and wakes it again."""
    # the worker's listener, as it records itself
    listeners = ("select w.listener_pid from flowly.workers w"
                 " join pg_stat_activity a on a.pid = w.listener_pid")
    # a poll interval far above what a loaded machine takes to run a run woken by NOTIFY
    # (2.1 s was seen under load against a 2 s bound with polls every 3 s)
    with running_worker(dsn, poll_interval=30):
        first = wait_for(lambda: scalar(db, listeners), what="listener connected")
        time.sleep(0.3)  # idle: the next run must be woken by NOTIFY, well before a poll
        started = time.monotonic()
        assert client.wait(client.start("quick", 1), timeout=20).status == "completed"
        assert time.monotonic() - started < 15
        db.execute("select pg_terminate_backend(%s)", (first,))
        wait_for(lambda: scalar(db, listeners) not in (None, first), what="listener reconnected")
        started = time.monotonic()
        assert client.wait(client.start("quick", 2), timeout=20).status == "completed"
        assert time.monotonic() - started < 15


def test_async_client(dsn: str) -> None:
    async def scenario() -> tuple[flowly.Run, list[flowly.Step], str]:
        async with flowly.AsyncClient(dsn) as client:
            run_id = await client.start("quick", {"n": 1}, run_id="async-1")
            assert await client.start("quick", {"n": 2}, run_id="async-1") == run_id
            with running_worker(dsn):
                run = await client.wait(run_id, timeout=20)
            assert (await client.wait(run_id, timeout=0)).status == "completed"  # no wait needed
            other = await client.start("slow", {"seconds": 30})
            with pytest.raises(flowly.RunTimeout):
                await client.wait(other, "completed", timeout=0.2)
            return run, await client.steps(run_id), await client.cancel(other)

    run, steps, cancelled = asyncio.run(scenario())
    assert run.status == "completed" and run.output == {"input": {"n": 1}, "total": 3}
    assert [s.name for s in steps] == ["one", "two", "three"]
    assert cancelled == "cancelled"


def test_retry_dead_letter_respects_the_concurrency_key(dsn: str, client: flowly.Client) -> None:
    failed = client.start("saga", None, concurrency_key="k")
    workflows.SAGA_FAILS.add(failed)
    with running_worker(dsn):
        assert client.wait(failed, timeout=30).status == "dead_letter"
    live = client.start("slow", {"seconds": 30}, concurrency_key="k")
    with pytest.raises(flowly.InvalidState, match=f"run {live} of concurrency key k is live"):
        client.retry_dead_letter(failed)
    client.cancel(live)
    assert client.retry_dead_letter(failed) == failed


def test_a_failed_engine_write_abandons_the_run_until_its_lease_expires(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The worker's pool connections are killed mid-step: the checkpoint fails, the run is
    abandoned (not failed, not swallowed by user code) and resumed after lease expiry."""
    run_id = client.start("gated")
    with running_worker(dsn, lease=3, poll_interval=5):
        # b has started and cannot finish before its connections are gone
        wait_for(lambda: scalar(db, "select count(*) from public.test_effects where step = 'b'"),
                 what="b started")
        db.execute("select pg_terminate_backend(pid) from pg_stat_activity"
                   " where datname = current_database() and pid <> pg_backend_pid()"
                   " and pid <> %s and pid not in (select listener_pid from flowly.workers"
                   " where listener_pid is not null)",
                   (client.connection.info.backend_pid,))
        workflows.GATES[run_id].set()
        run = client.wait(run_id, timeout=30)
    assert run.status == "completed" and run.attempt == 1
    assert "abandoned until its lease expires" in caplog.text
    ran = [step for (step,) in db.execute(
        "select step from public.test_effects where run_id = %s order by at", (run_id,))]
    assert ran.count("a") == 1 and ran.count("b") == 2 and ran.count("c") == 1


def test_a_late_heartbeat_does_not_cancel_a_newer_claim_of_the_run(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A heartbeat sent for epoch N is held up while the run sleeps and is claimed again by the
    same worker (epoch N+2); when it reports epoch N lost, the new execution must go on."""
    with running_worker(dsn, lease=4), psycopg.connect(dsn) as blocker:
        wait_for(lambda: scalar(db, "select count(*) from flowly.workers"), what="registered")
        run_id = client.start("work_nap_work", {"first": 2, "second": 1})
        wait_for(lambda: scalar(db, "select lease_epoch = 1 from flowly.runs"), what="claimed")
        # the next heartbeat (its runs snapshotted now, at epoch 1) waits on the table's lock
        blocker.execute("lock table flowly.workers in exclusive mode")
        wait_for(lambda: scalar(db, "select lease_epoch >= 3 and status = 'running'"
                                    " from flowly.runs"), what="claimed again after the nap")
        blocker.commit()
        run = client.wait(run_id, timeout=30)
    assert run.status == "completed"
    assert scalar(db, "select takeovers from flowly.runs") == 0
    assert "lease lost" not in caplog.text


def test_a_cancelled_worker_releases_its_runs(dsn: str, client: flowly.Client,
                                              db: psycopg.Connection[Any]) -> None:
    """Cancelling Worker.run() (an embedding application shutting down) releases the runs in
    flight at once, as a stop does, instead of leaving them locked for a whole lease."""
    run_id = client.start("slow", {"seconds": 60})

    async def claimed() -> None:
        while not await asyncio.to_thread(
                scalar, db, "select locked_by is not null from flowly.runs"):
            await asyncio.sleep(0.05)

    _run_worker_then_cancel(dsn, claimed)
    run = client.get(run_id)
    assert (run.status, run.locked_by) == ("pending", None)
    assert run_id in workflows.CANCELLED


def test_a_worker_cancelled_while_its_claim_is_answered_releases_the_claimed_runs(
        dsn: str, client: flowly.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """The claim commits on the server, and Worker.run() is cancelled before its answer has
    reached the worker (the test above failed so once in a full suite run: it cancels as soon
    as the claim is visible). The worker never learnt of the run, so it released nothing, and
    the run stayed locked for its whole lease. Here the answer is held back for 0.3 s."""
    run_id = client.start("slow", {"seconds": 60})
    call = flowly.Worker._call
    answering = asyncio.Event()

    async def late_answer(worker: flowly.Worker, query: Any, params: Any) -> list[Any]:
        rows = await call(worker, query, params)
        if rows and query is worker._calls.claim_and_offer:
            answering.set()
            await asyncio.sleep(0.3)
        return rows

    monkeypatch.setattr(flowly.Worker, "_call", late_answer)
    _run_worker_then_cancel(dsn, lambda: asyncio.wait_for(answering.wait(), timeout=20))
    run = client.get(run_id)
    assert (run.status, run.locked_by) == ("pending", None)


def _run_worker_then_cancel(dsn: str, ready: Callable[[], Awaitable[Any]]) -> None:
    """Run a worker until ``ready()`` returns, then cancel its task (an embedding application
    shutting down): the task ends cancelled."""
    async def run_then_cancel() -> None:
        task = asyncio.create_task(flowly.Worker(dsn, lease=60, poll_interval=0.1).run())
        await ready()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run_then_cancel())


def test_a_child_run_gets_its_workflows_defaults_and_a_fenced_parent(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any],
) -> None:
    parent = client.start("mailing", None)
    with running_worker(dsn):
        child_id = client.wait(parent, timeout=20).output
    child = client.get(child_id)
    assert (child.workflow, child.queue, child.max_attempts) == ("emailer", "emails", 7)
    assert scalar(db, "select parent_run_id from flowly.runs where id = %s", child_id) == parent
    # a parent's stale lease epoch starts nothing
    db.execute("select flowly.start('quick', run_id => 'p')")
    epoch = scalar(db, "select lease_epoch from flowly.claim('w', array['quick'],"
                       " array['default'], 1, '1 hour')")
    with pytest.raises(psycopg.Error) as refused:
        db.execute("select flowly.start('quick', run_id => 'orphan', parent_run_id => 'p',"
                   " parent_lease_epoch => %s)", (epoch - 1,))
    assert refused.value.sqlstate == "WF001"
    assert scalar(db, "select count(*) from flowly.runs where id = 'orphan'") == 0


def test_a_database_error_about_the_run_fails_it_rather_than_abandoning_it(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any],
) -> None:
    run_id = client.start("bad_sleep", None, max_attempts=1)
    with running_worker(dsn):
        run = client.wait(run_id, timeout=20)
    assert run.status == "dead_letter" and "forever" in run.error["message"], run.error
    assert scalar(db, "select takeovers from flowly.runs") == 0


def test_a_worker_that_takes_its_own_run_over_stops_the_old_execution(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any],
) -> None:
    """Heartbeats fail past the lease (here: blocked on a lock of the workers table, which
    claims only read); the worker's own claim takes the expired run over and must cancel the
    execution it already had."""
    with running_worker(dsn, lease=1.5), psycopg.connect(dsn) as blocker:
        wait_for(lambda: scalar(db, "select count(*) from flowly.workers"), what="registered")
        run_id = client.start("slow", {"seconds": 4})
        wait_for(lambda: scalar(db, "select lease_epoch = 1 from flowly.runs"), what="claimed")
        blocker.execute("lock table flowly.workers in exclusive mode")
        wait_for(lambda: scalar(db, "select lease_epoch = 2 from flowly.runs"), timeout=10,
                 what="taken over")
        wait_for(lambda: run_id in workflows.CANCELLED, timeout=1, what="old execution stopped")
        blocker.commit()
        assert client.wait(run_id, timeout=20).status == "completed"


def test_a_run_whose_workers_keep_dying_is_dead_lettered_as_poison(
    db: psycopg.Connection[Any],
) -> None:
    """Ten takeovers after lease expiry are allowed (a crash does not burn an attempt); the
    next expiry dead-letters the run instead of handing it to an eleventh worker to crash."""
    db.execute("select flowly.start('quick', run_id => 'poison')")
    limit = scalar(db, "select flowly.max_takeovers()")
    claim = ("select count(*) from flowly.claim('w', array['quick'], array['default'], 1,"
             " '1 millisecond')")
    for _ in range(limit + 1):  # the first claim and `limit` takeovers
        time.sleep(0.005)
        assert scalar(db, claim) == 1
    assert scalar(db, "select (takeovers, attempt) = (%s, 1) from flowly.runs", limit)
    time.sleep(0.005)
    assert scalar(db, claim) == 0
    status, error = db.execute("select status, error from flowly.runs").fetchone()
    assert status == "dead_letter" and error["type"] == "PoisonRun"
    db.execute("select flowly.retry_dead_letter('poison')")
    assert scalar(db, "select takeovers from flowly.runs") == 0


def test_a_checkpoint_restarts_the_takeover_count(db: psycopg.Connection[Any]) -> None:
    """Poison means takeovers in a row with no progress: a long run that outlives a few
    unrelated worker crashes, checkpointing in between, never reaches the limit."""
    db.execute("select flowly.start('quick', run_id => 'long')")
    claim = ("select lease_epoch from flowly.claim('w', array['quick'], array['default'], 1,"
             " '1 millisecond')")
    for step in range(2 * scalar(db, "select flowly.max_takeovers()")):
        time.sleep(0.005)
        epoch = scalar(db, claim)
        assert epoch is not None, f"dead-lettered after {step} takeovers with progress"
        db.execute("select flowly.checkpoint('long', %s, %s, '1')", (epoch, f"step-{step}"))
    assert db.execute("select status, takeovers from flowly.runs").fetchone() == ("running", 0)


def test_a_flush_commits_its_checkpoints_and_completions_apart(
    dsn: str, db: psycopg.Connection[Any],
) -> None:
    """One flush pipelines a checkpoint_steps and a complete_runs call; each must commit on
    its own (one transaction would lock their runs out of id order and could deadlock with a
    heartbeat). Seen here: the completion fails, the checkpoint still lands."""
    db.execute("select flowly.start('quick', run_id => 'r' || i) from generate_series(1, 2) i")
    epochs = dict(db.execute("select run_id, lease_epoch from flowly.claim("
                             "'w', array['quick'], array['default'], 2, '1 hour')").fetchall())

    async def flush_both() -> list[Any]:
        async with AsyncConnectionPool(dsn, kwargs={"autocommit": True}) as pool:
            committer = GroupCommitter(pool, Calls())
            # both queued before the flushers start, so they go in one flush
            writes = [
                asyncio.ensure_future(committer.checkpoint(
                    "r1", epochs["r1"], "s", "1", datetime.now(UTC), False, 1)),
                asyncio.ensure_future(committer.complete("r2", epochs["r2"], "not json")),
            ]
            await asyncio.sleep(0)
            committer.start()
            results = await asyncio.gather(*writes, return_exceptions=True)
            await committer.close()
            return results

    results = asyncio.run(flush_both())
    # the batch is refused for the completion's content; written again one by one, only the
    # completion fails
    assert isinstance(results[1], psycopg.DataError), results
    assert results[0][0] == 1, results
    assert scalar(db, "select count(*) from flowly.steps where run_id = 'r1'") == 1
    assert scalar(db, "select status from flowly.runs where id = 'r2'") == "running"


def test_batch_writes_of_one_worker_do_not_deadlock(dsn: str, db: psycopg.Connection[Any]) -> None:
    """A worker's heartbeat, group-committed checkpoints and completions share its runs; each
    locks them in id order, so however the batches are ordered they never deadlock (40P01)."""
    count = 60
    db.execute("select flowly.start('quick', run_id => 'r' || i) from generate_series(1, %s) i",
               (count,))
    held = dict(db.execute("select run_id, lease_epoch from flowly.claim("
                           "'w', array['quick'], array['default'], %s, '1 hour')",
                           (count,)).fetchall())
    deadline = time.monotonic() + 4
    errors: list[BaseException] = []
    calls = [0]

    def loop(kind: str, seed: int) -> None:
        shuffled = random.Random(seed)
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                n = 0
                while time.monotonic() < deadline:
                    ids = list(held)
                    shuffled.shuffle(ids)
                    epochs = [held[i] for i in ids]
                    if kind == "heartbeat":
                        conn.execute("select flowly.heartbeat('w', %s, %s, '1 hour')",
                                     (ids, epochs))
                    else:
                        n += 1
                        conn.execute(
                            "select count(*) from flowly.checkpoint_steps(%s, %s, %s, %s::jsonb[],"
                            " %s, %s, %s)",
                            (ids, epochs, [f"{kind}-{n}"] * len(ids), ["1"] * len(ids),
                             [datetime.now(UTC)] * len(ids), [False] * len(ids),
                             [n] * len(ids)))
                    calls[0] += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(kind, seed))
               for seed, kind in enumerate(["heartbeat", "heartbeat", "steps-a", "steps-b"])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert calls[0] > 100
    lost = db.execute("select count(*) from flowly.complete_runs(%s, %s, %s::jsonb[])"
                      " where lease_lost", (list(held), list(held.values()),
                                            ["1"] * len(held))).fetchone()
    assert lost == (0,)
