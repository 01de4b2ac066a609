"""Where one run depends on another (waits for events and other runs, children): races of
waking and parking, and what purge, cancel and retry_dead_letter do to the runs that depend."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

import flowly
from flowly.db import translated_errors
from tests.support import claim_as, park_on_run, running_worker, scalar

# whether dep_child fails, per run of dep_parent
_CHILD_FAILS: dict[str, bool] = {}


@flowly.workflow("dep_child", max_attempts=1)
async def dep_child(ctx: flowly.Context, inp: Any) -> Any:
    def work() -> str:
        if _CHILD_FAILS.get(inp):
            raise ValueError("child broken")
        return "child ok"

    return await ctx.step("work", work, retry=flowly.Retry(max_attempts=1))


@flowly.workflow("dep_parent", max_attempts=1)
async def dep_parent(ctx: flowly.Context, inp: Any) -> Any:
    return await ctx.run("dep_child", ctx.run_id)


def _due(db: psycopg.Connection[Any], run_id: str) -> bool:
    return bool(scalar(db, "select status = 'pending' and scheduled_for <= now()"
                           " from flowly.runs where id = %s", run_id))


def test_a_child_finished_by_a_transaction_in_flight_still_wakes_its_waiting_parent(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """An operator cancels the child in an open transaction (`begin; select flowly.cancel(..)`)
    while the parent, its wait registered, parks: the trigger that wakes waiters finds the
    parent running (not parked yet), and park cannot see the finish. park reports the parent
    busy while the child's row is held; once the operator commits, park sees the child
    finished and the parent is due, not parked until 9999-12-31. Registering the wait itself
    reports the parent busy while the child's row is held (0022)."""
    db.execute("select flowly.start('parent', run_id => 'p')")
    db.execute("select flowly.start('child', run_id => 'c')")
    epoch = claim_as(db, "parent")["p"]
    assert scalar(db, "select outcome from flowly.wait_for_run('p', %s, 'run:c', 'c')",
                  epoch) == "waiting"
    with psycopg.connect(dsn) as operator:
        operator.execute("select flowly.cancel('c')")  # the parent is not parked yet
        with pytest.raises(flowly.RunBusy, match="which it waits for"):
            with translated_errors():
                db.execute("select flowly.wait_for_run('p', %s, 'run:c#2', 'c')", (epoch,))
        with pytest.raises(flowly.RunBusy, match="a run it waits for"):
            with translated_errors():
                db.execute("select flowly.park('p', %s, array['run:c'])", (epoch,))
        operator.commit()
    assert scalar(db, "select status from flowly.runs where id = 'c'") == "cancelled"
    assert scalar(db, "select flowly.park('p', %s, array['run:c'])", epoch) is not None
    assert _due(db, "p")


def test_a_finish_that_starts_after_park_locked_its_target_sees_the_wait(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """The other order: park share-locks the child's row first, so a completion batch racing
    it reports the child busy and finishes it after park committed, waking the parent."""
    db.execute("select flowly.start('parent', run_id => 'p')")
    db.execute("select flowly.start('child', run_id => 'c')")
    epoch = claim_as(db, "parent")["p"]
    c_epoch = claim_as(db, "child")["c"]
    assert scalar(db, "select outcome from flowly.wait_for_run('p', %s, 'run:c', 'c')",
                  epoch) == "waiting"
    with psycopg.connect(dsn) as parking, psycopg.connect(dsn, autocommit=True) as worker:
        assert scalar(parking, "select flowly.park('p', %s, array['run:c'])", epoch) is None
        busy = worker.execute("select busy from flowly.complete_runs(array['c'], %s::bigint[],"
                              " array['1']::jsonb[])", ([c_epoch],)).fetchone()
        assert busy == (True,)
        parking.commit()
        worker.execute("select flowly.complete_runs(array['c'], %s::bigint[],"
                       " array['1']::jsonb[])", ([c_epoch],))
    assert _due(db, "p")


# what the child's own worker may have in flight on the child's row (run c, claimed as w);
# not a claim, which locks for update so as not to take over a run whose transactional step is
# still open in a stalled worker's session
_CHILD_WRITES = {
    "checkpoint": "select flowly.checkpoint('c', %(epoch)s, 'a', '1')",
    "batched checkpoint": "select flowly.checkpoint_steps(array['c'], array[%(epoch)s::bigint],"
                          " array['a'], array['1'::jsonb], array[now()], array[false],"
                          " array[null::integer])",
    "heartbeat": "select flowly.heartbeat('w', array['c'], array[%(epoch)s::bigint], '1 hour')",
    "starting a grandchild": "select flowly.start('child', parent_run_id => 'c',"
                             " parent_lease_epoch => %(epoch)s)",
    "sleep": "select flowly.sleep('c', %(epoch)s, 'nap', p_seconds => 60)",
}


@pytest.mark.parametrize("write", sorted(_CHILD_WRITES))
def test_a_wait_registers_and_parks_while_its_target_s_worker_writes_to_it(
    dsn: str, db: psycopg.Connection[Any], write: str
) -> None:
    """Waiting for a run must not find it busy because its own worker is writing to it (a
    claim, a checkpoint, a heartbeat, ...): in a fan-in over busy children one of them nearly
    always is, and the parent went on asking (WF005) instead of parking, holding its lease and
    its worker's slot, until the children were done. Only a write that ends the child is
    worth waiting for (the test below)."""
    db.execute("select flowly.start('parent', run_id => 'p')")
    db.execute("select flowly.start('child', run_id => 'c')")
    epoch = claim_as(db, "parent")["p"]
    c_epoch = claim_as(db, "child")["c"]
    if write == "sleep":  # a step first, so that the sleep is not the run's first call
        db.execute("select flowly.checkpoint('c', %s, 'before', '0')", (c_epoch,))
    with psycopg.connect(dsn) as child_worker:
        child_worker.execute(_CHILD_WRITES[write], {"epoch": c_epoch})
        with translated_errors():
            parked_until = park_on_run(db, "p", epoch, "c")
        child_worker.commit()
    assert parked_until is None
    assert not _due(db, "p")


# writes that end run c (claimed as w), in flight while a run that waits for c parks
_ENDING_WRITES = {
    "completion": "select flowly.complete_runs(array['c'], array[%(epoch)s::bigint],"
                  " array['1'::jsonb])",
    "last failed attempt of a step": "select flowly.fail_step('c', %(epoch)s, 'a', '{}', now(),"
                                     " 1, 'fixed', 1, 1)",
    "failure of the body": "select flowly.fail_run('c', %(epoch)s, '{}', false)",
    "timeout": "select flowly.dead_letter_stalled_runs()",
    "cancel of its parent": "select flowly.cancel('g')",
}


@pytest.mark.parametrize("write", sorted(_ENDING_WRITES))
def test_a_wait_parks_only_after_a_write_that_ends_its_target_commits(
    dsn: str, db: psycopg.Connection[Any], write: str
) -> None:
    """The other side of the test above: a write that ends the child, in flight while the
    parent parks, is invisible to park and has already looked for waiters; park must report
    the parent busy until it commits, and then make the parent due."""
    db.execute("select flowly.start('parent', run_id => 'p')")
    db.execute("select flowly.start('child', run_id => 'g')")
    db.execute("select flowly.start('child', run_id => 'c', parent_run_id => 'g')")
    epoch = claim_as(db, "parent")["p"]
    c_epoch = claim_as(db, "child")["c"]
    assert scalar(db, "select outcome from flowly.wait_for_run('p', %s, 'run:c', 'c')",
                  epoch) == "waiting"
    if write == "timeout":
        db.execute("update flowly.runs set timeout_at = now() where id = 'c'")
    with psycopg.connect(dsn) as child_worker:
        child_worker.execute(_ENDING_WRITES[write], {"epoch": c_epoch})
        with pytest.raises(flowly.RunBusy):
            with translated_errors():
                db.execute("select flowly.park('p', %s, array['run:c'])", (epoch,))
        child_worker.commit()
    assert scalar(db, "select status from flowly.runs where id = 'c'") != "running"
    assert scalar(db, "select flowly.park('p', %s, array['run:c'])", epoch) is not None
    assert _due(db, "p")


def test_a_waiter_locked_elsewhere_does_not_stall_completions_of_other_runs(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """Run W waits for run C. An operator holds W's row (an open `select flowly.cancel('W')`).
    A worker's group commit then completes C and an unrelated run X: no engine call on the
    worker's path may wait for a lock on a run, so X (and C) complete at once."""
    db.execute("select flowly.start('wf', run_id => 'c')")
    db.execute("select flowly.start('wf', run_id => 'x')")
    db.execute("select flowly.start('waiter', run_id => 'w')")
    epochs = claim_as(db, "wf")
    w_epoch = claim_as(db, "waiter")["w"]
    park_on_run(db, "w", w_epoch, "c")
    with psycopg.connect(dsn) as operator, psycopg.connect(dsn, autocommit=True) as worker:
        operator.execute("select flowly.cancel('w')")
        worker.execute("set lock_timeout = '2s'")  # as the worker's sessions have it
        started = time.monotonic()
        try:
            rows = worker.execute(
                "select * from flowly.complete_runs(array['c', 'x'], %s::bigint[],"
                " array['1', '2']::jsonb[])", ([epochs["c"], epochs["x"]],)).fetchall()
            error = None
        except psycopg.Error as exc:
            rows, error = [], exc
        took = time.monotonic() - started
        operator.rollback()
    assert error is None, (f"complete_runs of c and x failed after {took:.1f}s:"
                           f" {error.sqlstate} {error}")
    assert took < 1, f"complete_runs waited {took:.1f}s for the waiter's row"
    assert {r[0]: (r[1], r[2]) for r in rows} == {"c": (False, False), "x": (False, False)}
    # the wake-up that found w's row locked is applied once the row is free
    assert not _due(db, "w")
    assert scalar(db, "select flowly.wake_missed_waiters()") == 1
    assert _due(db, "w")
    assert scalar(db, "select count(*) from flowly.missed_wakeups") == 0


def test_purge_keeps_a_finished_run_that_an_unfinished_run_waits_for(
    db: psycopg.Connection[Any]
) -> None:
    """Parent p waits for child c; c completes (p is woken); purge runs before a worker gets
    to p. Purge must not take the result p is about to read: p's wait must still answer."""
    db.execute("select flowly.start('parent', run_id => 'p')")
    db.execute("select flowly.start('child', run_id => 'c', parent_run_id => 'p')")
    epoch = claim_as(db, "parent")["p"]
    park_on_run(db, "p", epoch, "c")
    c_epoch = claim_as(db, "child")["c"]
    db.execute("select flowly.complete('c', %s, '42')", (c_epoch,))
    assert _due(db, "p")
    purged = scalar(db, "select flowly.purge('0 seconds')")
    epoch = claim_as(db, "parent")["p"]
    try:
        row = db.execute("select outcome, status, output from flowly.wait_for_run('p', %s,"
                         " 'run:c', 'c')", (epoch,)).fetchone()
    except psycopg.Error as exc:
        pytest.fail(f"purge deleted {purged} run(s); the waiting parent's wait then fails:"
                    f" {exc.sqlstate} {exc}")
    assert row == ("finished", "completed", 42)


def test_an_event_sent_after_the_wait_timed_out_does_not_count(
    db: psycopg.Connection[Any]
) -> None:
    """A wait with a 0.2 s timeout is registered and parked; no worker is around until well
    after the deadline, and an event is sent after it. The wait timed out (its deadline is
    written once and never moves): the late event must not be taken as arriving in time."""
    db.execute("select flowly.start('waiter', run_id => 'r')")
    epoch = claim_as(db, "waiter")["r"]
    assert scalar(db, "select outcome from flowly.wait_for_event('r', %s, 'event:go', 'go',"
                      " 0.2)", epoch) == "waiting"
    db.execute("select flowly.park('r', %s, array['event:go'])", (epoch,))
    time.sleep(0.5)  # the deadline passes; no worker claims the run meanwhile
    db.execute("select flowly.send_event('r', 'go', '\"late\"')")
    assert scalar(db, "select timeout_at < now() from flowly.waits where run_id = 'r'")
    epoch = claim_as(db, "waiter")["r"]
    outcome = db.execute("select * from flowly.wait_for_event('r', %s, 'event:go', 'go', 0.2)",
                         (epoch,)).fetchone()
    assert outcome == ("timeout", None), (
        f"an event sent after the deadline was received: {outcome}")


def test_cancel_of_a_parent_whose_child_row_is_held_reports_run_busy(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """cancel waits at most 5 s for a row another transaction holds, then raises WF005
    (flowly.RunBusy). That holds for the descendants it cancels too, not only the run named."""
    db.execute("select flowly.start('parent', run_id => 'p')")
    db.execute("select flowly.start('child', run_id => 'c', parent_run_id => 'p')")
    with psycopg.connect(dsn) as operator:
        operator.execute("select from flowly.runs where id = 'c' for update")
        started = time.monotonic()
        with pytest.raises(psycopg.Error) as info:
            db.execute("select flowly.cancel('p')")
        took = time.monotonic() - started
        operator.rollback()
    assert took < 7
    assert info.value.sqlstate == "WF005", f"{info.value.sqlstate}: {info.value}"


def test_retrying_a_parent_after_its_failed_child_was_retried_can_succeed(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """The child dead-letters, so the parent (ChildFailed) does too. The operator fixes the
    cause and retries the child, which completes, then retries the parent: the new generation
    must be able to see the child's result instead of replaying the old failure forever."""
    with flowly.Client(dsn) as client:
        parent = client.start("dep_parent", None, run_id="dep-p")
        _CHILD_FAILS[parent] = True
        with running_worker(dsn, workflows=[dep_parent, dep_child]):
            assert client.wait(parent, timeout=30).status == "dead_letter"
            child = scalar(db, "select id from flowly.runs where parent_run_id = %s", parent)
            assert client.get(child).status == "dead_letter"
            _CHILD_FAILS[parent] = False
            client.retry_dead_letter(child)
            assert client.wait(child, timeout=30).status == "completed"
            client.retry_dead_letter(parent)
            run = client.wait(parent, timeout=30)
    message = run.error and run.error["message"]
    assert run.status == "completed", f"parent {run.status} again: {message}"
    assert run.output == "child ok"


def test_a_wait_recorded_as_timed_out_never_consumes_a_later_event(
    db: psycopg.Connection[Any]
) -> None:
    """wait_for_event called again for a wait whose timeout is already recorded (a runtime
    replaying from SQL) must answer the recorded timeout and leave a later event alone for the
    next wait of that name."""
    db.execute("select flowly.start('waiter', run_id => 'r')")
    epoch = claim_as(db, "waiter")["r"]
    assert scalar(db, "select outcome from flowly.wait_for_event('r', %s, 'event:go', 'go',"
                      " 0)", epoch) == "timeout"
    db.execute("select flowly.send_event('r', 'go', '\"for the next wait\"')")
    again = db.execute("select * from flowly.wait_for_event('r', %s, 'event:go', 'go', 0)",
                       (epoch,)).fetchone()
    consumed = scalar(db, "select consumed_by from flowly.events where run_id = 'r'")
    recorded = scalar(db, "select output from flowly.steps where run_id = 'r'")
    assert (again, consumed) == (("timeout", None), None), (
        f"replayed wait answered {again}, recorded {recorded}, event consumed by {consumed}")


def test_an_event_sent_in_an_open_transaction_between_wait_and_park_is_not_lost(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """The wait is registered; the application sends the event in a transaction it has not
    committed yet; the worker parks. After the commit the run must be due, not parked."""
    db.execute("select flowly.start('waiter', run_id => 'r')")
    epoch = claim_as(db, "waiter")["r"]
    assert scalar(db, "select outcome from flowly.wait_for_event('r', %s, 'event:go', 'go')",
                  epoch) == "waiting"
    with psycopg.connect(dsn) as app:
        app.execute("select flowly.send_event('r', 'go', '1')")
        with pytest.raises(psycopg.Error) as info:  # the event's row holds the run: busy
            db.execute("select flowly.park('r', %s, array['event:go'])", (epoch,))
        assert info.value.sqlstate == "WF005"
        app.commit()
    db.execute("select flowly.park('r', %s, array['event:go'])", (epoch,))
    assert _due(db, "r")


_RELEASE_CHILD = threading.Event()


@flowly.workflow("dep_slow_child")
async def dep_slow_child(ctx: flowly.Context, inp: Any) -> Any:
    return await ctx.step("wait", lambda: _RELEASE_CHILD.wait(20) and "child done")


@flowly.workflow("dep_waiting_parent")
async def dep_waiting_parent(ctx: flowly.Context, inp: Any) -> Any:
    return await ctx.run(dep_slow_child)


def test_a_worker_applies_the_wake_up_that_found_the_parent_s_row_held(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """End to end: the parent is parked on its child; an operator holds the parent's row while
    the child completes, then rolls back. The child's completion is not held up, and a
    worker's poll wakes the parent once its row is free: the parent completes."""
    _RELEASE_CHILD.clear()
    with flowly.Client(dsn) as client, \
            running_worker(dsn, workflows=[dep_waiting_parent, dep_slow_child]):
        parent = client.start(dep_waiting_parent, run_id="dep-wp")
        deadline = time.monotonic() + 20
        while scalar(db, "select scheduled_for > now() + interval '1 day' from flowly.runs"
                         " where id = %s", parent) is not True:
            assert time.monotonic() < deadline, "the parent never parked on its child"
            time.sleep(0.05)
        child = scalar(db, "select id from flowly.runs where parent_run_id = %s", parent)
        with psycopg.connect(dsn) as operator:
            operator.execute("select from flowly.runs where id = %s for update", (parent,))
            _RELEASE_CHILD.set()
            assert client.wait(child, timeout=20).status == "completed"
            assert scalar(db, "select count(*) from flowly.missed_wakeups") == 1
            operator.rollback()
        run = client.wait(parent, timeout=20)
    assert (run.status, run.output) == ("completed", "child done")
    assert scalar(db, "select count(*) from flowly.missed_wakeups") == 0


def test_a_cancelled_run_takes_no_more_children(db: psycopg.Connection[Any]) -> None:
    """A cancelled family stays cancelled: a child started by hand under a cancelled run, and
    a retry of a dead-lettered child of one, are refused (WF004), naming the parent."""
    db.execute("select flowly.start('parent', run_id => 'p')")
    db.execute("select flowly.start('child', run_id => 'old', parent_run_id => 'p')")
    db.execute("update flowly.runs set status = 'dead_letter', finished_at = now()"
               " where id = 'old'")
    assert scalar(db, "select flowly.cancel('p')") == "cancelled"
    for call in ("select flowly.start('child', run_id => 'new', parent_run_id => 'p')",
                 "select flowly.retry_dead_letter('old')"):
        with pytest.raises(flowly.InvalidState, match="run p was cancelled"):
            with translated_errors():
                db.execute(call)
    assert scalar(db, "select count(*) from flowly.runs where parent_run_id = 'p'"
                      " and status in ('pending', 'running')") == 0


@pytest.mark.parametrize("failure", ["step", "body"])
def test_a_run_released_for_a_retry_backoff_is_not_woken_by_what_it_waited_for(
    db: psycopg.Connection[Any], failure: str
) -> None:
    """The body registered a wait for run 'c' in one branch of a gather; a step (or the body)
    failed in another and the database released the run until its retry time. 'c' finishing
    must not make it due before then: the backoff is the database's decision (README)."""
    db.execute("select flowly.start('parent', run_id => 'p')")
    db.execute("select flowly.start('child', run_id => 'c')")
    epoch = claim_as(db, "parent")["p"]
    assert scalar(db, "select outcome from flowly.wait_for_run('p', %s, 'run:c', 'c')",
                  epoch) == "waiting"
    if failure == "step":
        decision = scalar(db, "select decision from flowly.fail_step('p', %s, 'flaky', '{}',"
                              " now(), 2, 'fixed', 30, 30)", epoch)
    else:
        decision = scalar(db, "select decision from flowly.fail_run('p', %s, '{}')", epoch)
    assert decision == "retry"
    retry_at = scalar(db, "select scheduled_for from flowly.runs where id = 'p'")
    db.execute("select flowly.cancel('c')")
    assert scalar(db, "select scheduled_for from flowly.runs where id = 'p'") == retry_at
    assert not _due(db, "p")
