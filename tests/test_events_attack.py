"""Attacks on durable events: concurrent senders, senders in open transactions, deadlines,
races with cancel and the timeout sweep, replays after SIGKILL, malformed payloads and names.

Worker processes run the workflows of tests/workflows.py ("awaits_events",
"event_or_timeout"); the in-process worker also runs "ea_loop" below.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import flowly
from flowly.db import translated_errors
from tests.support import (
    claim_as,
    in_thread,
    running_worker,
    scalar,
    sqlstate_of,
    wait_for,
    worker_process,
)


@flowly.workflow("ea_pair", max_attempts=1)
async def ea_pair(ctx: flowly.Context, inp: Any) -> list[Any]:
    """Two waits for "go" reached together (asyncio.gather)."""
    return list(await asyncio.gather(ctx.wait_for_event("go"), ctx.wait_for_event("go")))


# gates a run of ea_gated_wait waits for before its wait, by run id
_GATES: dict[str, threading.Event] = {}


@flowly.workflow("ea_gated_wait", max_attempts=1)
async def ea_gated_wait(ctx: flowly.Context, inp: Any) -> Any:
    """A step that blocks until the test opens the run's gate, then a wait for "go"."""
    def gate() -> None:
        if not _GATES[ctx.run_id].wait(30):
            raise TimeoutError("the test never opened the gate")

    await ctx.step("gate", gate)
    return await ctx.wait_for_event("go")


@flowly.workflow("ea_retried_after_wait", max_attempts=2)
async def ea_retried_after_wait(ctx: flowly.Context, inp: Any) -> Any:
    """Receives "go", then its body fails on the first attempt: the retry replays the wait."""
    got = await ctx.wait_for_event("go")
    if ctx.attempt == 1:
        raise RuntimeError("the body fails after its wait")
    return [got, ctx.attempt]


@flowly.workflow("ea_hash_names", max_attempts=1)
async def ea_hash_names(ctx: flowly.Context, inp: Any) -> list[Any]:
    """Two waits for "go", then one for the distinct event name "go#2"."""
    return [await ctx.wait_for_event("go"), await ctx.wait_for_event("go"),
            await ctx.wait_for_event("go#2")]


@flowly.workflow("ea_loop", max_attempts=1)
async def ea_loop(ctx: flowly.Context, inp: dict[str, Any]) -> list[Any]:
    """Waits for ``n`` events named "tick", one after another."""
    got = []
    for _ in range(inp["n"]):
        got.append(await ctx.wait_for_event("tick"))
    return got


def _parked(db: psycopg.Connection[Any], run_id: str) -> bool:
    return bool(scalar(db, "select status = 'pending' and locked_by is null from flowly.runs"
                           " where id = %s and exists (select from flowly.waits w"
                           " where w.run_id = %s)", run_id, run_id))


def _sqlstate(conn: psycopg.Connection[Any], query: str, *params: Any) -> str | None:
    return sqlstate_of(conn.execute, query, params)


def _events(db: psycopg.Connection[Any], run_id: str) -> list[tuple[Any, ...]]:
    """(seq, name, payload, consumed_by, sent_at) of the run's events, oldest first."""
    return db.execute("select seq, name, payload, consumed_by, sent_at from flowly.events"
                      " where run_id = %s order by seq", (run_id,)).fetchall()


def client_send(dsn: str, run_id: str, name: str, payload: Any) -> int:
    with flowly.Client(dsn) as c:
        return c.send_event(run_id, name, payload)


def _start_sql(db: psycopg.Connection[Any], run_id: str, **extra: str) -> int:
    """A run of an unregistered workflow (no worker takes it), claimed as worker w."""
    timeout = extra.get("timeout")
    if timeout:
        db.execute("select flowly.start('ea_sql', run_id => %s, timeout => %s::interval)",
                   (run_id, timeout))
        return 0
    db.execute("select flowly.start('ea_sql', run_id => %s)", (run_id,))
    return claim_as(db, "ea_sql")[run_id]


# -- many senders, exactly once, in order -------------------------------------------------------

def test_concurrent_senders_each_event_is_consumed_once_by_the_wait_it_was_recorded_for(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """Four connections send 12 "tick" events each, with seeded jitter, to one run that waits
    for 48 in a loop: every event is consumed exactly once, each sender's events arrive in the
    order it sent them, and the k-th wait's recorded payload is the event marked consumed by
    it."""
    senders, per_sender = 4, 12
    run_id = client.start("ea_loop", {"n": senders * per_sender})
    rng = random.Random(1234)
    delays = [[rng.uniform(0, 0.03) for _ in range(per_sender)] for _ in range(senders)]
    errors: list[BaseException] = []

    def send(sender: int) -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                for k in range(per_sender):
                    time.sleep(delays[sender][k])
                    conn.execute("select flowly.send_event(%s, 'tick', %s::jsonb)",
                                 (run_id, f'{{"s": {sender}, "k": {k}}}'))
        except BaseException as exc:
            errors.append(exc)

    with running_worker(dsn, poll_interval=0.2):
        threads = [threading.Thread(target=send, args=(s,)) for s in range(senders)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        run = client.wait(run_id, timeout=30)
    assert run.status == "completed", run
    output = run.output
    assert len(output) == senders * per_sender
    assert sorted((p["s"], p["k"]) for p in output) == [
        (s, k) for s in range(senders) for k in range(per_sender)], "lost or duplicated"
    for s in range(senders):
        assert [p["k"] for p in output if p["s"] == s] == list(range(per_sender)), (
            f"sender {s}'s events were received out of the order sent")
    events = _events(db, run_id)
    assert len(events) == senders * per_sender
    consumers = [e[3] for e in events]
    assert None not in consumers and len(set(consumers)) == len(consumers)
    for _seq, _name, payload, consumed_by, _at in events:
        index = 1 if consumed_by == "event:tick" else int(consumed_by.split("#")[1])
        assert output[index - 1] == payload, f"{consumed_by} recorded another payload"
    assert len(client.steps(run_id)) == senders * per_sender


def test_sigkill_mid_stream_loses_and_duplicates_no_event(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """Six runs of awaits_events (two waits for "go"); three connections each send the events
    of two runs; the worker is SIGKILLed while the second round is being sent; a new worker
    finishes. Each run gets its first two events in the order sent; the third stays
    unconsumed; no wait is recorded twice; a fourth event to a finished run is refused."""
    runs = [client.start("awaits_events", None) for _ in range(6)]

    def send_round(*ns: int) -> None:
        def send(sender: int) -> None:
            with psycopg.connect(dsn, autocommit=True) as conn:
                for run_id in runs[sender::3]:
                    for n in ns:
                        conn.execute("select flowly.send_event(%s, 'go', %s::jsonb)",
                                     (run_id, f'{{"run": "{run_id}", "n": {n}}}'))
        threads = [threading.Thread(target=send, args=(s,)) for s in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)

    with worker_process(dsn, "--lease", "1") as first:
        send_round(1)
        wait_for(lambda: scalar(db, "select count(*) from flowly.steps"
                                    " where name = 'event:go'") >= 1,
                 what="a first event consumed")
        killer = threading.Timer(0.05, first.signal, args=(signal.SIGKILL,))
        killer.start()
        send_round(2, 3)
        killer.join()
        first.proc.wait(10)
    with worker_process(dsn, "--lease", "1"):
        finished = [client.wait(r, timeout=30) for r in runs]
    for run_id, run in zip(runs, finished, strict=True):
        assert run.status == "completed", run
        assert run.output == [{"run": run_id, "n": 1}, {"run": run_id, "n": 2}]
        events = _events(db, run_id)
        assert [(e[2]["n"], e[3]) for e in events] == [
            (1, "event:go"), (2, "event:go#2"), (3, None)]
        assert scalar(db, "select count(*) from flowly.steps where run_id = %s"
                          " and kind = 'event'", run_id) == 2
        with pytest.raises(flowly.InvalidState):
            client.send_event(run_id, "go", 4)
        assert len(_events(db, run_id)) == 3


# -- senders in open transactions ---------------------------------------------------------------

def test_events_in_open_transactions_rolled_back_never_consumed_committed_wake_the_run(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    run_id = client.start("awaits_events", None)
    with running_worker(dsn, poll_interval=0.2):
        wait_for(lambda: _parked(db, run_id), what="the run parked on its first wait")
        with psycopg.connect(dsn) as app:
            client.send_event(run_id, "go", "rolled back", conn=app)
            time.sleep(1.5)
            assert _parked(db, run_id)
            app.rollback()
        time.sleep(0.5)
        assert _parked(db, run_id), "a rolled-back event woke the run and it did not park"
        with psycopg.connect(dsn) as app:
            client.send_event(run_id, "go", "kept", conn=app)
            time.sleep(1.5)
            assert not scalar(db, "select count(*) from flowly.steps where run_id = %s",
                              run_id), "an uncommitted event was consumed"
            app.commit()
        wait_for(lambda: scalar(db, "select output from flowly.steps where run_id = %s"
                                    " and name = 'event:go'", run_id), timeout=10,
                 what="the committed event consumed")
        wait_for(lambda: _parked(db, run_id), what="the run parked on its second wait")
        client.send_event(run_id, "go", "second")
        run = client.wait(run_id, timeout=15)
    assert run.status == "completed" and run.output == ["kept", "second"]
    assert [(e[2], e[3]) for e in _events(db, run_id)] == [
        ("kept", "event:go"), ("second", "event:go#2")]


def test_park_is_busy_while_an_event_is_in_flight_then_sees_its_outcome(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """SQL level: the wait registers, an application sends the event in an open transaction,
    park reports the run busy (WF005); after a rollback park parks for ever and nothing is
    due; an event sent in an open transaction to the parked run keeps the run from being
    claimed until the commit, after which the run is due and receives it."""
    epoch = _start_sql(db, "r")
    assert scalar(db, "select outcome from flowly.wait_for_event('r', %s, 'event:go', 'go')",
                  epoch) == "waiting"
    with psycopg.connect(dsn) as app:
        app.execute("select flowly.send_event('r', 'go', '\"x\"')")
        assert _sqlstate(db, "select flowly.park('r', %s, array['event:go'])", epoch) == "WF005"
        app.rollback()
    assert scalar(db, "select flowly.park('r', %s, array['event:go'])", epoch) is None
    assert not scalar(db, "select flowly.parked_run_is_due('r')")
    assert _events(db, "r") == []
    with psycopg.connect(dsn) as app:
        app.execute("select flowly.send_event('r', 'go', '\"y\"')")
        assert claim_as(db, "ea_sql") == {}, "claimed while the waking event is uncommitted"
        app.commit()
    epoch = claim_as(db, "ea_sql")["r"]
    row = db.execute("select outcome, payload from flowly.wait_for_event("
                     "'r', %s, 'event:go', 'go')", (epoch,)).fetchone()
    assert row == ("received", "y")


# -- deadlines ----------------------------------------------------------------------------------

def test_an_event_sent_exactly_at_the_deadline_counts_one_a_microsecond_later_does_not(
    db: psycopg.Connection[Any]
) -> None:
    epoch = _start_sql(db, "r")
    assert scalar(db, "select outcome from flowly.wait_for_event("
                      "'r', %s, 'event:go', 'go', 1.0)", epoch) == "waiting"
    deadline = scalar(db, "select timeout_at from flowly.waits where run_id = 'r'")
    db.execute("select flowly.send_event('r', 'go', '\"late\"')")
    db.execute("select flowly.send_event('r', 'go', '\"on time\"')")
    db.execute("update flowly.events set sent_at = %s + interval '1 microsecond'"
               " where payload = '\"late\"'", (deadline,))
    db.execute("update flowly.events set sent_at = %s where payload = '\"on time\"'",
               (deadline,))
    wait_for(lambda: scalar(db, "select now() > %s", deadline), what="the deadline")
    assert scalar(db, "select flowly.park('r', %s, array['event:go'])", epoch) is not None
    epoch = claim_as(db, "ea_sql")["r"]
    row = db.execute("select outcome, payload from flowly.wait_for_event("
                     "'r', %s, 'event:go', 'go', 1.0)", (epoch,)).fetchone()
    assert row == ("received", "on time"), "the older event past the deadline was taken"
    assert scalar(db, "select timeout_at from flowly.waits where run_id = 'r'") is None
    # the late one belongs to the next wait, whose deadline is later
    row = db.execute("select outcome, payload from flowly.wait_for_event("
                     "'r', %s, 'event:go#2', 'go', 5.0)", (epoch,)).fetchone()
    assert row == ("received", "late")


# Before 0027: send_event stamped sent_at with now(), the start of the sender's transaction, not
# the time the event is sent. Sequence: an application transaction begins (any statement);
# the run's wait registers with a 1 s timeout and parks; 1.3 s later, past the deadline, the
# application calls send_event and commits; the worker reaches the wait after that.
# wait_for_event compares sent_at (the transaction's start, before the deadline) with
# timeout_at and returns 'received' with the payload instead of 'timeout', although README
# says "only events sent by then count (a worker that reaches the wait later still times it
# out)". (parked_run_is_due and park use the same comparison.)
def test_an_event_sent_after_the_deadline_from_an_older_transaction_does_not_count(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    with psycopg.connect(dsn) as app:
        app.execute("select 1")  # the application's transaction begins
        epoch = _start_sql(db, "r")
        assert scalar(db, "select outcome from flowly.wait_for_event("
                          "'r', %s, 'event:go', 'go', 1.0)", epoch) == "waiting"
        deadline = scalar(db, "select timeout_at from flowly.waits where run_id = 'r'")
        scalar(db, "select flowly.park('r', %s, array['event:go'])", epoch)
        wait_for(lambda: scalar(db, "select clock_timestamp() > %s + interval '0.3 s'",
                                deadline), what="the deadline")
        app.execute("select flowly.send_event('r', 'go', '\"after the deadline\"')")
        app.commit()
    sent_at = _events(db, "r")[0][4]
    epoch = claim_as(db, "ea_sql")["r"]
    row = db.execute("select outcome, payload from flowly.wait_for_event("
                     "'r', %s, 'event:go', 'go', 1.0)", (epoch,)).fetchone()
    assert row == ("timeout", None), (
        f"an event sent past the deadline {deadline} (stamped {sent_at}) was received")


def test_a_worker_reaching_the_wait_after_the_deadline_times_it_out_despite_a_late_event(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """The run parks with a 1 s timeout; its worker is SIGKILLed; an event arrives past the
    deadline before any worker runs; the next worker times the wait out (the deadline did
    not move) and leaves the late event unconsumed."""
    run_id = client.start("event_or_timeout", {"timeout": 1.0})
    with worker_process(dsn, "--lease", "1") as first:
        wait_for(lambda: _parked(db, run_id), what="the run parked")
        deadline = scalar(db, "select timeout_at from flowly.waits where run_id = %s", run_id)
        first.kill()
    wait_for(lambda: scalar(db, "select now() > %s + interval '0.3 s'", deadline),
             what="past the deadline")
    client.send_event(run_id, "approval", "late")
    assert scalar(db, "select timeout_at from flowly.waits where run_id = %s",
                  run_id) == deadline, "the deadline moved"
    with worker_process(dsn, "--lease", "1"):
        run = client.wait(run_id, timeout=20)
    assert run.status == "completed" and run.output == "timed out"
    assert [(e[2], e[3]) for e in _events(db, run_id)] == [("late", None)]


def test_events_sent_around_their_runs_deadlines_take_a_consistent_branch(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """Sixteen runs wait with a 1 s timeout; each gets one event at a seeded random moment
    between 0.3 s before and 0.3 s after its deadline while an in-process worker sweeps
    timeouts. A run took the approved branch exactly when it consumed its event, and only an
    event sent by the deadline was consumed."""
    rng = random.Random(99)
    runs = [client.start("event_or_timeout", {"timeout": 1.0}) for _ in range(16)]
    with running_worker(dsn, poll_interval=0.1):
        wait_for(lambda: all(_parked(db, r) for r in runs), what="all runs parked")
        deadlines = {r: scalar(db, "select extract(epoch from timeout_at - clock_timestamp())"
                                   " from flowly.waits where run_id = %s", r) for r in runs}
        timeout_at = {r: scalar(db, "select timeout_at from flowly.waits where run_id = %s",
                                r) for r in runs}
        base = time.monotonic()
        plan = sorted((float(deadlines[r]) + rng.uniform(-0.3, 0.3), r) for r in runs)
        refused = set()
        with psycopg.connect(dsn, autocommit=True) as sender:
            for at, run_id in plan:
                time.sleep(max(0.0, at - (time.monotonic() - base)))
                try:
                    sender.execute("select flowly.send_event(%s, 'approval', '\"yes\"')",
                                   (run_id,))
                except psycopg.Error as exc:  # the run timed out and finished already
                    assert exc.sqlstate == "WF004", exc
                    refused.add(run_id)
        finished = {r: client.wait(r, timeout=20) for r in runs}
    outcomes: list[str] = []
    for run_id, run in finished.items():
        assert run.status == "completed", run
        if run_id in refused:
            assert run.output == "timed out" and _events(db, run_id) == []
            continue
        (event,) = _events(db, run_id)
        outcomes.append(run.output)
        if run.output == "approved":
            assert event[3] == "event:approval", f"{run_id} approved without its event"
            assert event[4] <= timeout_at[run_id], f"{run_id} took an event past its deadline"
        else:
            assert run.output == "timed out"
            assert event[3] is None, f"{run_id} timed out yet consumed its event"
            # an event committed well before the deadline must have been received
            assert event[4] > timeout_at[run_id] - timedelta(milliseconds=50), (
                f"{run_id} timed out although its event was sent at {event[4]},"
                f" before its deadline {timeout_at[run_id]}")
    step_of = {r: scalar(db, "select output from flowly.steps where run_id = %s"
                             " and kind = 'event'", r) for r in runs}
    for run_id, run in finished.items():
        assert ("payload" in step_of[run_id]) == (run.output == "approved")
    assert "approved" in outcomes and "timed out" in outcomes + ["timed out"] * len(refused)


# -- replay after a crash -----------------------------------------------------------------------

def test_a_received_event_is_replayed_after_sigkill_and_a_second_event_is_left_alone(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    run_id = client.start("event_or_timeout", {"timeout": 30, "after_seconds": 30})
    with worker_process(dsn, "--lease", "1") as first:
        wait_for(lambda: _parked(db, run_id), what="the run parked")
        client.send_event(run_id, "approval", "first")
        wait_for(lambda: scalar(db, "select count(*) from public.test_effects"
                                    " where run_id = %s", run_id), what="the step after")
        first.signal(signal.SIGKILL)
        first.proc.wait(10)
    client.send_event(run_id, "approval", "second")
    db.execute("update flowly.runs set input = jsonb_set(input, '{after_seconds}', '0')"
               " where id = %s", (run_id,))
    with worker_process(dsn, "--lease", "1"):
        run = client.wait(run_id, timeout=30)
    assert run.status == "completed" and run.output == "approved"
    branches = [r[0] for r in db.execute("select step from public.test_effects"
                                         " where run_id = %s order by at", (run_id,))]
    assert branches == ["approved", "approved"]
    assert [(e[2], e[3]) for e in _events(db, run_id)] == [
        ("first", "event:approval"), ("second", None)]


# -- runs that end while an event is sent -------------------------------------------------------

# Before 0027: send_event read the run's status without a lock. Sequence: an operator runs
# `begin; select flowly.cancel('r')` and keeps the transaction open; an application calls
# client.send_event('r', ...): it reads the committed status ('pending'), its insert's
# foreign key check (KEY SHARE) waits for cancel's FOR UPDATE lock; the operator commits;
# the insert then succeeds, so send_event returns a sequence number and stores an event for
# a run that is cancelled, instead of raising WF004 (InvalidState) and storing nothing.
def test_send_event_racing_a_cancel_in_flight_is_refused_and_stores_nothing(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    _start_sql(db, "r")
    with psycopg.connect(dsn) as operator:
        operator.execute("select flowly.cancel('r')")

        def send() -> int:
            with flowly.Client(dsn) as other:
                return other.send_event("r", "go", "too late")

        thread, outcome = in_thread(send)
        time.sleep(0.5)
        operator.commit()
        thread.join(15)
    assert scalar(db, "select status from flowly.runs where id = 'r'") == "cancelled"
    stored = _events(db, "r")
    assert isinstance(outcome.get("error"), flowly.InvalidState), (
        f"send_event to a run cancelled meanwhile returned {outcome!r}; stored {stored!r}")
    assert stored == []


# Before 0027: as with cancel. The timeout sweep (dead_letter_stalled_runs, run by every claim
# and heartbeat) dead-letters a run past its run timeout, holding its row FOR UPDATE until
# its transaction commits; a send_event called meanwhile reads the old status ('pending'),
# blocks in its insert's foreign key check, and once the sweep commits stores its event and
# returns a sequence number for a dead_letter run instead of raising WF004.
def test_send_event_racing_the_timeout_sweep_is_refused_and_stores_nothing(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    _start_sql(db, "r", timeout="1 second")
    wait_for(lambda: scalar(db, "select now() > timeout_at from flowly.runs where id = 'r'"),
             what="the run's timeout")
    with psycopg.connect(dsn) as sweeper:
        sweeper.execute("select flowly.dead_letter_stalled_runs()")

        def send() -> Any:
            with psycopg.connect(dsn, autocommit=True) as app:
                return scalar(app, "select flowly.send_event('r', 'go', '\"too late\"')")

        thread, outcome = in_thread(send)
        time.sleep(0.5)
        sweeper.commit()
        thread.join(15)
    assert scalar(db, "select status from flowly.runs where id = 'r'") == "dead_letter"
    stored = _events(db, "r")
    error = outcome.get("error")
    assert isinstance(error, psycopg.Error) and error.sqlstate == "WF004", (
        f"send_event to a run dead-lettered meanwhile returned {outcome!r}; stored {stored!r}")
    assert stored == []


def test_send_event_to_finished_runs_is_refused_and_an_open_sender_holds_up_cancel(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    epoch = _start_sql(db, "done")
    db.execute("select * from flowly.complete_runs(array['done'], array[%s::bigint],"
               " array['1'::jsonb])", (epoch,))
    assert scalar(db, "select status from flowly.runs where id = 'done'") == "completed"
    with pytest.raises(flowly.InvalidState, match="completed: it takes no more events"):
        client.send_event("done", "go", 1)
    assert _sqlstate(db, "select flowly.send_event('done', 'go')") == "WF004"
    with pytest.raises(flowly.RunNotFound):
        client.send_event("nobody", "go", 1)
    assert _events(db, "done") == []
    # an event sent first in an open transaction: cancel waits for it, then both stand
    _start_sql(db, "open")
    with psycopg.connect(dsn) as app:
        app.execute("select flowly.send_event('open', 'go', '1')")
        def cancel() -> Any:
            with psycopg.connect(dsn, autocommit=True) as operator:
                return scalar(operator, "select flowly.cancel('open')")

        thread, outcome = in_thread(cancel)
        time.sleep(0.5)
        assert thread.is_alive(), f"cancel did not wait for the event's lock: {outcome!r}"
        app.commit()
        thread.join(15)
    assert outcome.get("result") == "cancelled", outcome
    assert len(_events(db, "open")) == 1
    with pytest.raises(flowly.InvalidState, match="cancelled"):
        client.send_event("open", "go", 2)
    assert len(_events(db, "open")) == 1


# -- payloads and names -------------------------------------------------------------------------

def test_huge_and_odd_payloads_round_trip_and_bad_ones_are_refused_storing_nothing(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    run_id = client.start("awaits_events", None)
    circular: list[Any] = []
    circular.append(circular)
    bad = {
        "nul": "a\x00b",
        "nested nul": {"k": ["\x00"]},
        "nan": float("nan"),
        "infinity": [float("inf")],
        "object": object(),
        "set": {1, 2},
        "bytes": b"x",
        "circular": circular,
        "surrogate": "\ud800",
    }
    for what, payload in bad.items():
        with pytest.raises(flowly.InvalidArgument, match="event payload") as info:
            client.send_event(run_id, "go", payload)
        assert "Traceback" not in str(info.value), what
    with pytest.raises(flowly.InvalidArgument, match="NUL"):
        client.send_event(run_id, "go", "\x00")
    # SQL: jsonb itself refuses \u0000, before send_event runs
    assert _sqlstate(db, "select flowly.send_event(%s, 'go', '\"\\u0000\"')",
                     run_id) in {"22P05", "22P02"}
    assert _events(db, run_id) == []
    huge = {"blob": "x" * 1_000_000, "tail": "é€𝄞"}
    client.send_event(run_id, "go", huge)
    db.execute("select flowly.send_event(%s, 'go', null)", (run_id,))
    with running_worker(dsn, poll_interval=0.2):
        run = client.wait(run_id, timeout=20)
    assert run.status == "completed"
    assert run.output[0] == huge and run.output[1] is None
    assert [e[3] for e in _events(db, run_id)] == ["event:go", "event:go#2"]


def test_event_names_empty_too_long_or_with_nul_are_refused_storing_nothing(
    client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    _start_sql(db, "r")
    with pytest.raises(flowly.InvalidArgument, match="event name must be a non-empty text"):
        client.send_event("r", "", 1)
    with pytest.raises(flowly.InvalidArgument, match="1001 bytes long; the limit is 1000"):
        client.send_event("r", "n" * 1001, 1)
    with pytest.raises(flowly.InvalidArgument, match="1002 bytes"):
        client.send_event("r", "é" * 501, 1)
    for query in ("select flowly.send_event('r', '', '1')",
                  "select flowly.send_event('r', null, '1')",
                  "select flowly.send_event('r', repeat('n', 1001), '1')"):
        assert _sqlstate(db, query) == "WF003", query
    with pytest.raises((flowly.InvalidArgument, psycopg.DataError)) as info:
        with translated_errors():
            client.send_event("r", "a\x00b", 1)
    assert "NUL" in str(info.value) or "0x00" in str(info.value), info.value
    assert _events(db, "r") == []
    client.send_event("r", "é" * 500, 1)  # exactly the limit
    assert [e[1] for e in _events(db, "r")] == ["é" * 500]


def test_an_event_for_a_null_run_id_is_refused_naming_the_argument(
    client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """send_event(NULL, ...) from SQL said "run <NULL> not found" (WF002), as for a run that
    is gone: it is an invalid argument (WF003) that names run_id, as a NULL name names the
    event name. From Python, None is refused before the database as an invalid argument."""
    _start_sql(db, "r")
    with pytest.raises(psycopg.Error, match=r"^run_id must not be null") as info:
        db.execute("select flowly.send_event(null, 'go', '1')")
    assert info.value.sqlstate == "WF003"
    with pytest.raises(psycopg.Error, match=r"^event name must be a non-empty text") as info:
        db.execute("select flowly.send_event('r', null, '1')")
    assert info.value.sqlstate == "WF003"
    with pytest.raises(flowly.InvalidArgument, match="run_id must be a string, got NoneType"):
        client.send_event(None, "go", 1)  # type: ignore[arg-type]
    with pytest.raises(flowly.InvalidArgument, match="event name must be a string, got NoneType"):
        client.send_event("r", None, 1)  # type: ignore[arg-type]
    assert _events(db, "r") == []


# -- more races ---------------------------------------------------------------------------------

def test_parallel_waits_for_one_name_take_distinct_events(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """Two waits for "go" in asyncio.gather; two events sent from two connections at once
    (plus a third): the waits get different events, the oldest two, each recorded once."""
    run_id = client.start("ea_pair", None)
    with running_worker(dsn, poll_interval=0.2):
        wait_for(lambda: _parked(db, run_id), what="the run parked on both waits")
        assert scalar(db, "select count(*) from flowly.waits where run_id = %s", run_id) == 2
        barrier = threading.Barrier(2)

        def send(n: int) -> None:
            with psycopg.connect(dsn, autocommit=True) as conn:
                barrier.wait(5)
                conn.execute("select flowly.send_event(%s, 'go', %s::jsonb)", (run_id, str(n)))

        threads = [threading.Thread(target=send, args=(n,)) for n in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        run = client.wait(run_id, timeout=15)
    assert run.status == "completed" and sorted(run.output) == [1, 2], run
    events = _events(db, run_id)
    assert sorted(e[3] for e in events) == ["event:go", "event:go#2"]
    by_wait = {e[3]: e[2] for e in events}
    assert run.output == [by_wait["event:go"], by_wait["event:go#2"]]


def test_an_event_whose_wake_up_found_the_run_locked_still_wakes_it(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """A real worker process; the parked run's row is held FOR NO KEY UPDATE by an operator's
    open transaction for 2 s while both events are sent (autocommit: the events' key-share
    locks do not wait). The wake-up is noted in missed_wakeups; once the row is free a worker
    applies it within about a second and the run completes."""
    run_id = client.start("awaits_events", None)
    with worker_process(dsn) as _worker:
        wait_for(lambda: _parked(db, run_id), what="the run parked")
        with psycopg.connect(dsn) as operator:
            operator.execute("select 1 from flowly.runs where id = %s for no key update",
                             (run_id,))
            thread, outcome = in_thread(lambda: [
                client_send(dsn, run_id, "go", n) for n in (1, 2)])
            thread.join(10)
            assert "error" not in outcome and outcome["took"] < 2, outcome
            assert scalar(db, "select count(*) from flowly.missed_wakeups"
                              " where run_id = %s", run_id) >= 1
            time.sleep(1.5)
            assert _parked(db, run_id), "the run woke while its row was held"
            operator.rollback()
            released = time.monotonic()
        run = client.wait(run_id, timeout=15)
        woke_after = time.monotonic() - released
    assert run.status == "completed" and run.output == [1, 2]
    assert woke_after < 8, f"completed {woke_after:.1f}s after the row was free"


def test_names_match_exactly_and_a_replayed_wait_keeps_its_first_deadline(
    db: psycopg.Connection[Any]
) -> None:
    epoch = _start_sql(db, "r")
    for name in ("Go", "go ", " go", "g"):
        db.execute("select flowly.send_event('r', %s, '\"wrong\"')", (name,))
    assert scalar(db, "select outcome from flowly.wait_for_event("
                      "'r', %s, 'event:go', 'go', 1.0)", epoch) == "waiting"
    deadline = scalar(db, "select timeout_at from flowly.waits where run_id = 'r'")
    # asked again with a longer timeout (a replay, new code): the deadline stays
    assert scalar(db, "select outcome from flowly.wait_for_event("
                      "'r', %s, 'event:go', 'go', 100.0)", epoch) == "waiting"
    assert scalar(db, "select timeout_at from flowly.waits where run_id = 'r'") == deadline
    assert scalar(db, "select flowly.park('r', %s, array['event:go'])", epoch) == deadline
    wait_for(lambda: scalar(db, "select now() > %s", deadline), what="the deadline")
    epoch = claim_as(db, "ea_sql")["r"]
    assert scalar(db, "select outcome from flowly.wait_for_event("
                      "'r', %s, 'event:go', 'go', 100.0)", epoch) == "timeout"
    # a recorded timeout stays a timeout, even with a matching event present now
    db.execute("select flowly.send_event('r', 'go', '\"right\"')")
    assert db.execute("select outcome, payload from flowly.wait_for_event("
                      "'r', %s, 'event:go', 'go', 100.0)", (epoch,)).fetchone() == (
        "timeout", None)
    assert [e[3] for e in _events(db, "r")] == [None] * 5


def test_an_event_in_an_open_transaction_while_the_run_registers_its_wait(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """Runs are running (in a step) when applications send their "go" in transactions left
    open 2.5 s; the step ends, the wait registers, park reports the run busy (WF005) and the
    worker asks again. Committed: the run receives the event. Rolled back: the run parks and
    never sees it; a later event completes it."""
    committed = client.start("ea_gated_wait", None)
    rolled = client.start("ea_gated_wait", None)
    _GATES[committed], _GATES[rolled] = threading.Event(), threading.Event()
    with running_worker(dsn, poll_interval=0.2):
        wait_for(lambda: scalar(db, "select count(*) from flowly.runs where status = 'running'"
                                    " and workflow = 'ea_gated_wait'") == 2,
                 what="both runs running their step")
        with psycopg.connect(dsn) as app_commit, psycopg.connect(dsn) as app_rollback:
            client.send_event(committed, "go", "committed", conn=app_commit)
            client.send_event(rolled, "go", "rolled back", conn=app_rollback)
            _GATES[committed].set()
            _GATES[rolled].set()
            wait_for(lambda: scalar(db, "select count(*) from flowly.waits w join flowly.runs r"
                                        " on r.id = w.run_id where r.workflow = 'ea_gated_wait'"
                                        ) == 2, what="both waits registered")
            time.sleep(2.5)
            assert scalar(db, "select count(*) from flowly.runs where status = 'completed'"
                              " and workflow = 'ea_gated_wait'") == 0
            app_commit.commit()
            app_rollback.rollback()
        run = client.wait(committed, timeout=15)
        assert run.status == "completed" and run.output == "committed"
        wait_for(lambda: _parked(db, rolled), what="the rolled-back run parked")
        assert not scalar(db, "select flowly.parked_run_is_due(%s)", rolled)
        client.send_event(rolled, "go", "later")
        run = client.wait(rolled, timeout=15)
    assert run.status == "completed" and run.output == "later"
    assert [(e[2], e[3]) for e in _events(db, rolled)] == [("later", "event:go")]


def test_a_retried_run_replays_its_received_event_and_consumes_no_other(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    run_id = client.start("ea_retried_after_wait", None)
    client.send_event(run_id, "go", "first")
    client.send_event(run_id, "go", "second")
    with running_worker(dsn, poll_interval=0.2):
        run = client.wait(run_id, timeout=20)
    assert run.status == "completed" and run.output == ["first", 2], run
    assert [(e[2], e[3]) for e in _events(db, run_id)] == [
        ("first", "event:go"), ("second", None)]


# Before a '#' in a key was doubled: the step name a wait is recorded under was
# "event:<name>" for the first wait of a name and "event:<name>#<n>" for the n-th, so an event
# name that itself ends in "#<n>" collided with the n-th wait of another name. Sequence: a body
# waits for "go", "go" again, then for the distinct name "go#2"; events go=1, go=2, go#2=3 are
# sent. The third wait's record name was "event:go#2", the same as the second wait's: the run
# ended in dead_letter ("name 'event:go#2' is used twice") instead of returning [1, 2, 3].
def test_an_event_name_ending_in_a_wait_number_does_not_collide_with_repeated_waits(
    dsn: str, client: flowly.Client
) -> None:
    run_id = client.start("ea_hash_names", None)
    client.send_event(run_id, "go", 1)
    client.send_event(run_id, "go", 2)
    client.send_event(run_id, "go#2", 3)
    with running_worker(dsn, poll_interval=0.2):
        run = client.wait(run_id, timeout=20)
    assert run.status == "completed" and run.output == [1, 2, 3], (run.status, run.error)


def test_the_shell_refuses_bad_payloads_and_names_with_one_line_storing_nothing(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    _start_sql(db, "r")
    cases = {("go", "not json"): "not valid JSON", ("go", '{"a": NaN}'): "event payload",
             ("go", '"\\u0000"'): "NUL", ("", "1"): "event name",
             ("n" * 1001, "1"): "1001 bytes"}
    for (name, payload), expected in cases.items():
        result = subprocess.run(
            [sys.executable, "-m", "flowly", "--dsn", dsn, "send-event", "r", name, payload],
            capture_output=True, text=True, timeout=30)
        assert result.returncode != 0, (name[:10], payload)
        assert expected in result.stderr, (name[:10], payload, result.stderr)
        assert "Traceback" not in result.stderr, result.stderr
    assert _events(db, "r") == []
    result = subprocess.run(
        [sys.executable, "-m", "flowly", "--dsn", dsn, "send-event", "r", "go", '{"ok": 1}'],
        capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert [e[2] for e in _events(db, "r")] == [{"ok": 1}]
