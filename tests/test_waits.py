"""Waiting durably: for events sent to a run, and for other runs (fan-out, fan-in)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

import flowly
from tests.support import (
    database_default,
    flood_notifications,
    notification_queue_usage,
    running_worker,
    scalar,
    wait_for,
    worker_process,
)


def _parked(db: psycopg.Connection[Any], run_id: str) -> bool:
    """Waiting, and held by no worker."""
    return bool(scalar(db, "select status = 'pending' and locked_by is null from flowly.runs"
                           " where id = %s and exists (select from flowly.waits w"
                           " where w.run_id = %s)", run_id, run_id))


def test_events_sent_before_and_after_the_waits_are_consumed_in_order(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    run_id = client.start("awaits_events", None)
    client.send_event(run_id, "go", {"n": 1})  # before the run even started
    with running_worker(dsn, poll_interval=30):  # only NOTIFY can wake it in time
        wait_for(lambda: _parked(db, run_id), what="the run parked on its second wait")
        sent = time.monotonic()
        client.send_event(run_id, "go", {"n": 2})
        run = client.wait(run_id, timeout=10)
        woke_after = time.monotonic() - sent
    assert run.status == "completed" and run.output == [{"n": 1}, {"n": 2}]
    assert woke_after < 2, f"woke {woke_after:.2f}s after the event: not by NOTIFY"
    kinds = [(s.name, s.kind) for s in client.steps(run_id)]
    assert kinds == [("event:go", "event"), ("event:go#2", "event")]


def test_send_event_refuses_unknown_and_finished_runs(
    client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    with pytest.raises(flowly.RunNotFound):
        client.send_event("no-such-run", "go")
    run_id = client.start("quick", None)
    db.execute("select flowly.cancel(%s)", (run_id,))
    with pytest.raises(flowly.InvalidState, match="takes no more events"):
        client.send_event(run_id, "go")
    with pytest.raises(psycopg.Error) as info:
        db.execute("select flowly.send_event('nope', 'go')")
    assert info.value.sqlstate == "WF002"


def test_a_timeout_is_recorded_and_replayed_the_same_after_a_kill(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """The wait times out; the worker is SIGKILLed in the next step; the event arrives late;
    the next worker replays the timeout branch, it does not take the event."""
    run_id = client.start("event_or_timeout", {"timeout": 0.5, "after_seconds": 30})
    with worker_process(dsn, "--lease", "1") as first:
        wait_for(lambda: scalar(db, "select count(*) from public.test_effects"
                                    " where run_id = %s", run_id), what="the step after")
        first.signal(signal.SIGKILL)
    client.send_event(run_id, "approval", "late")
    db.execute("update flowly.runs set input = jsonb_set(input, '{after_seconds}', '0')"
               " where id = %s", (run_id,))
    with worker_process(dsn, "--lease", "1"):
        run = client.wait(run_id, timeout=30)
    assert run.status == "completed" and run.output == "timed out"
    branches = [r[0] for r in db.execute("select step from public.test_effects"
                                         " where run_id = %s order by at", (run_id,))]
    assert branches == ["timed out", "timed out"]


def test_an_event_within_the_timeout_takes_the_other_branch(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    run_id = client.start("event_or_timeout", {"timeout": 30})
    with running_worker(dsn):
        wait_for(lambda: _parked(db, run_id), what="parked")
        client.send_event(run_id, "approval", True)
        assert client.wait(run_id, timeout=10).output == "approved"


@flowly.workflow("tw_late_approval", max_attempts=1)
async def tw_late_approval(ctx: flowly.Context, timeout: float) -> Any:
    """A first wait whose timeout the body catches, then one it does not."""
    try:
        early = await ctx.wait_for_event("early", timeout=timeout)
    except flowly.EventTimeout:
        early = "no early event"
    return [early, await ctx.wait_for_event("approval", timeout=timeout)]


def test_retrying_a_run_that_failed_on_an_event_timeout_waits_for_the_event_again(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """An approval that did not come in time dead-letters the run (EventTimeout); the
    operator retries the run and sends the approval. The retry replayed the recorded timeout and
    failed again at once, whatever was sent. The wait that ended the run is asked again (with
    a new timeout); the one the body caught keeps its outcome, so the body takes the same
    branch."""
    run_id = client.start("tw_late_approval", 2)
    with running_worker(dsn, workflows=[tw_late_approval]):
        run = client.wait(run_id, timeout=20)
        assert (run.status, run.error and run.error["type"]) == ("dead_letter", "EventTimeout")
        client.retry_dead_letter(run_id)  # a dead_letter run takes no events: retried first
        client.send_event(run_id, "early", "too late")
        client.send_event(run_id, "approval", {"by": "ops"})
        run = client.wait(run_id, timeout=20)
    assert (run.status, run.output) == ("completed", ["no early event", {"by": "ops"}]), run
    assert [(s.name, s.output) for s in client.steps(run_id)] == [
        ("event:early", {"timeout": True}), ("event:approval", {"payload": {"by": "ops"}})]


@flowly.workflow("tw_gathered_approvals", max_attempts=1)
async def tw_gathered_approvals(ctx: flowly.Context, timeout: float) -> Any:
    """Three approvals waited for at once."""
    return list(await asyncio.gather(*(ctx.wait_for_event(name, timeout=timeout)
                                       for name in ("legal", "finance", "security"))))


def test_retrying_a_run_whose_gathered_event_waits_timed_out_waits_for_all_of_them_again(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """Three event waits gathered, all past their timeout when the run is replayed, so three
    timeouts are recorded and the run dead-letters on EventTimeout. The retry asked only the
    last recorded wait again: the others replayed their timeouts, so the run failed at once
    with the approvals sent, retry after retry. Every wait made beside the last one is asked
    again."""
    # 3 s: the worker stops well before the first deadline, even on a loaded machine (woken
    # at it, it would record that one timeout alone, the others a few ms short of theirs)
    run_id = client.start("tw_gathered_approvals", 3)
    with running_worker(dsn, workflows=[tw_gathered_approvals]):
        wait_for(lambda: _parked(db, run_id), what="parked on three waits")
        assert scalar(db, "select count(*) from flowly.waits where run_id = %s", run_id) == 3
    time.sleep(3.5)  # every deadline passes while no worker runs
    with running_worker(dsn, workflows=[tw_gathered_approvals]):
        run = client.wait(run_id, timeout=20)
        assert (run.status, run.error and run.error["type"]) == ("dead_letter", "EventTimeout")
        timed_out = [s.name for s in client.steps(run_id) if s.output == {"timeout": True}]
        assert len(timed_out) >= 2, timed_out  # the case: more than one timeout recorded
        client.retry_dead_letter(run_id)
        for name, payload in (("legal", "ok"), ("finance", 100), ("security", {"by": "ops"})):
            client.send_event(run_id, name, payload)
        run = client.wait(run_id, timeout=20)
    assert (run.status, run.output) == ("completed", ["ok", 100, {"by": "ops"}]), run


_CHILD_FAILS = [True]


@flowly.workflow("tw_failing_child", max_attempts=1)
async def tw_failing_child(ctx: flowly.Context, _: Any) -> str:
    if _CHILD_FAILS[0]:
        raise RuntimeError("the child's first run fails")
    return "child ok"


@flowly.workflow("tw_approval_beside_a_child", max_attempts=1)
async def tw_approval_beside_a_child(ctx: flowly.Context, args: dict[str, Any]) -> Any:
    """An approval and another run's outcome waited for at once."""
    return list(await asyncio.gather(ctx.wait_for_event("approval", timeout=args["timeout"]),
                                     ctx.wait_for_run(args["child"])))


def test_retrying_a_run_whose_gathered_event_and_run_waits_both_failed_waits_for_both_again(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """An event wait and a wait for another run, gathered: the event did not come in time and
    the other run dead-lettered, both recorded in one replay, so the run dead-letters on
    whichever the body met first. The operator retries the other run (it completes), sends
    the event and retries this one. The retry asked again only the waits of the kind the body
    raised (EventTimeout or ChildFailed) and replayed the other failure, so the run failed
    again at once. Both are asked again."""
    _CHILD_FAILS[0] = True
    child = client.start("tw_failing_child", None, run_id="tw-gathered-child", queue="kids")
    run_id = client.start("tw_approval_beside_a_child", {"timeout": 3, "child": child})
    with running_worker(dsn, workflows=[tw_approval_beside_a_child]):
        wait_for(lambda: _parked(db, run_id), what="parked on the event and the child")
    with running_worker(dsn, workflows=[tw_failing_child], queues=["kids"]):
        assert client.wait(child, timeout=20).status == "dead_letter"
    time.sleep(3.5)  # the event's deadline passes too while no worker serves the run
    with running_worker(dsn, workflows=[tw_approval_beside_a_child, tw_failing_child],
                        queues=["default", "kids"]):
        run = client.wait(run_id, timeout=20)
        assert run.status == "dead_letter", run
        assert run.error and run.error["type"] in ("EventTimeout", "ChildFailed"), run.error
        outcomes = sorted(s.kind for s in client.steps(run_id)
                          if s.output == {"timeout": True}
                          or (s.kind == "run" and s.output["status"] == "dead_letter"))
        assert outcomes == ["event", "run"]  # the case: both failures recorded
        _CHILD_FAILS[0] = False
        client.retry_dead_letter(child)
        assert client.wait(child, timeout=20).status == "completed"
        client.retry_dead_letter(run_id)  # a dead_letter run takes no events: retried first
        client.send_event(run_id, "approval", {"by": "ops"})
        run = client.wait(run_id, timeout=20)
    assert (run.status, run.output) == ("completed", [{"by": "ops"}, "child ok"]), run


_FLAKY_BESIDE_A_WAIT: list[float] = []


def _flaky_beside_a_wait() -> str:
    _FLAKY_BESIDE_A_WAIT.append(time.monotonic())
    if len(_FLAKY_BESIDE_A_WAIT) == 1:
        time.sleep(0.3)  # the wait beside it has answered "wait" by then
        raise RuntimeError("first attempt fails")
    return "charged"


@flowly.workflow("tw_step_beside_a_wait")
async def tw_step_beside_a_wait(ctx: flowly.Context, backoff: float) -> Any:
    return list(await asyncio.gather(
        ctx.step("charge", _flaky_beside_a_wait,
                 retry=flowly.Retry(max_attempts=2, backoff="fixed", initial_delay=backoff)),
        ctx.wait_for_event("receipt", timeout=60)))


@flowly.workflow("tw_step_beside_a_sleep")
async def tw_step_beside_a_sleep(ctx: flowly.Context, _: Any) -> Any:
    return list(await asyncio.gather(
        ctx.step("charge", _flaky_beside_a_wait,
                 retry=flowly.Retry(max_attempts=2, backoff="fixed", initial_delay=0.5)),
        ctx.sleep("cool-down", 1)))


def test_a_step_retried_beside_a_pending_sleep_is_not_reported_as_a_lost_lease(
    dsn: str, client: flowly.Client, caplog: pytest.LogCaptureFixture
) -> None:
    """As below, for a durable sleep beside the step: its timer was written under the lease
    the step's release had ended."""
    _FLAKY_BESIDE_A_WAIT.clear()
    caplog.set_level(logging.INFO, logger="flowly")
    run_id = client.start("tw_step_beside_a_sleep")
    with running_worker(dsn, workflows=[tw_step_beside_a_sleep]):
        run = client.wait(run_id, timeout=20)
    assert (run.status, run.output) == ("completed", ["charged", None]), run
    assert not [r.getMessage() for r in caplog.records
                if r.name.startswith("flowly.worker") and r.levelno >= logging.WARNING]


def test_a_step_retried_beside_a_pending_wait_is_not_reported_as_a_lost_lease(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture
) -> None:
    """A step fails while a wait beside it is pending: the database releases the run for the
    step's backoff, and the worker then parked it under the lease that release had ended,
    which failed and logged a WARNING that the run was dropped, its lease lost. The run was
    fine. The step's decision now ends the execution, nothing is written under the old
    lease, and the run goes on after the backoff as before."""
    _FLAKY_BESIDE_A_WAIT.clear()
    caplog.set_level(logging.INFO, logger="flowly")
    run_id = client.start("tw_step_beside_a_wait", 0.5)
    with running_worker(dsn, workflows=[tw_step_beside_a_wait]):
        wait_for(lambda: len(_FLAKY_BESIDE_A_WAIT) == 2, what="the retry of the step")
        wait_for(lambda: _parked(db, run_id), what="parked on the wait after the retry")
        client.send_event(run_id, "receipt", "r-1")
        run = client.wait(run_id, timeout=20)
    assert (run.status, run.output) == ("completed", ["charged", "r-1"]), run
    assert _FLAKY_BESIDE_A_WAIT[1] - _FLAKY_BESIDE_A_WAIT[0] >= 0.5  # after its backoff
    assert not [r.getMessage() for r in caplog.records
                if r.name.startswith("flowly.worker") and r.levelno >= logging.WARNING]


def test_an_event_sent_during_a_step_s_backoff_does_not_cut_the_backoff_short(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """A step beside a pending event wait fails and is released for a 4 s backoff; an event
    for the wait comes a moment later. It woke the run at once, and the replay tried the step
    again within the second. The event is kept for the wait and read when the backoff ends;
    the step is tried again only then."""
    _FLAKY_BESIDE_A_WAIT.clear()
    run_id = client.start("tw_step_beside_a_wait", 4)
    with running_worker(dsn, workflows=[tw_step_beside_a_wait]):
        wait_for(lambda: client.failed_attempts(run_id), what="the step's first failure")
        client.send_event(run_id, "receipt", "r-1")
        run = client.wait(run_id, timeout=30)
    assert (run.status, run.output) == ("completed", ["charged", "r-1"]), run
    (failure,) = client.failed_attempts(run_id)
    assert failure.retry_at is not None
    retried = next(s for s in client.steps(run_id) if s.name == "charge")
    # a step's start is the worker's clock, retry_at the database's: a second for their skew
    assert retried.started_at >= failure.retry_at - timedelta(seconds=1), (
        retried.started_at, failure.retry_at)


_BODY_STARTS: list[float] = []
_BODY_FAILURES: list[float] = []


def _wait_registered(run_id: str) -> bool:
    with psycopg.connect(os.environ["FLOWLY_DSN"], autocommit=True) as conn:
        return bool(scalar(conn, "select count(*) from flowly.waits where run_id = %s", run_id))


@flowly.workflow("tw_body_fails_beside_a_wait", max_attempts=3)
async def tw_body_fails_beside_a_wait(ctx: flowly.Context, _: Any) -> Any:
    """Waits for a receipt in a task of its own, and fails (outside any step) meanwhile."""
    _BODY_STARTS.append(time.monotonic())

    async def receipt() -> Any:
        return await ctx.wait_for_event("receipt", timeout=60)

    waiting = asyncio.create_task(receipt())
    if len(_BODY_STARTS) < 3:
        while not await asyncio.to_thread(_wait_registered, ctx.run_id):
            await asyncio.sleep(0.05)
        _BODY_FAILURES.append(time.monotonic())
        raise RuntimeError(f"attempt {len(_BODY_STARTS)} fails")
    return await waiting


def test_an_event_sent_during_the_run_s_own_retry_backoff_does_not_cut_it_short(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """As above, for a retry of the whole run: the body fails outside a step while its event
    wait (which has a deadline, so it stays registered) is pending, and the run is released
    for its 2 s backoff (the second). An event sent for the wait woke the run at once (0055
    only knew a step's backoff). It waits for the backoff's end now."""
    _BODY_STARTS.clear()
    _BODY_FAILURES.clear()
    run_id = client.start("tw_body_fails_beside_a_wait")
    with running_worker(dsn, workflows=[tw_body_fails_beside_a_wait]):
        wait_for(lambda: len(_BODY_FAILURES) == 2 and scalar(
            db, "select status = 'pending' and attempt = 3 from flowly.runs where id = %s",
            run_id), what="the second failure released for its backoff")
        # the case: the wait is still registered during the backoff
        assert scalar(db, "select count(*) from flowly.waits where run_id = %s", run_id) == 1
        client.send_event(run_id, "receipt", "r-1")
        run = client.wait(run_id, timeout=30)
    assert (run.status, run.output) == ("completed", "r-1"), run
    assert len(_BODY_STARTS) == 3
    assert _BODY_STARTS[2] - _BODY_FAILURES[1] >= 1.5, _BODY_STARTS[2] - _BODY_FAILURES[1]


def test_fan_out_and_in_with_one_failing_child(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """20 children started and awaited with asyncio.gather; child 7 fails and is caught as
    ChildFailed; the parent holds no lease while it waits; a worker is SIGKILLed meanwhile.

    The children wait for a gate file, so that none finishes before the parent parks: a
    parent that finds a child finished when it parks is due at once and runs on, which on a
    slow machine left no moment at which to see it parked."""
    gate = tmp_path / "gate"
    run_id = client.start("fan_out", {"n": 20, "fail": 7, "seconds": 0.2, "gate": str(gate)})
    # a lease of 2 s, not 1: on a loaded machine a parent that starts 20 children and waits
    # for them, with seven sync steps beside it, could lose a 1 s lease again and again
    with worker_process(dsn, "--lease", "2", "--concurrency", "8") as first:
        wait_for(lambda: scalar(db, "select count(*) = 20 from flowly.runs"
                                    " where parent_run_id = %s", run_id), what="20 children")
        wait_for(lambda: _parked(db, run_id), what="the parent parked")
        first.signal(signal.SIGKILL)
    gate.touch()
    with worker_process(dsn, "--lease", "1", "--concurrency", "8"):
        run = client.wait(run_id, timeout=60)
    assert run.status == "completed", run.error
    expected: list[Any] = [i * i for i in range(20)]
    expected[7] = {"failed": "dead_letter"}
    assert run.output == expected
    assert scalar(db, "select count(*) from flowly.runs where parent_run_id = %s",
                  run_id) == 20  # the replays started nothing new


def test_cancelling_a_parent_cancels_its_unfinished_children(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    run_id = client.start("runs_a_child", {"seconds": 30})
    with running_worker(dsn):
        wait_for(lambda: _parked(db, run_id), what="the parent waiting for its child")
        assert client.get(run_id).status == "pending"  # a run parked for good is readable
        child = scalar(db, "select id from flowly.runs where parent_run_id = %s", run_id)
        wait_for(lambda: client.get(child).status == "running", what="child running")
        assert client.cancel(run_id) == "cancelled"
        assert client.wait(child, timeout=10).status == "cancelled"
    # parking on a wait without a timeout (due never) is no error
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


@pytest.mark.parametrize("asynchronous", [False, True])
def test_client_wait_returns_when_the_run_finishes_not_at_the_next_poll(
    dsn: str, client: flowly.Client, asynchronous: bool
) -> None:
    """Three runs that take 1.5 s each (so polling would be at its 0.5 s pace): each wait
    returns within 100 ms of the run's finished_at."""
    import asyncio
    from datetime import UTC, datetime

    delays = []
    with running_worker(dsn):
        for _ in range(3):
            run_id = client.start("slow", {"seconds": 1.5})
            if asynchronous:
                async def wait(run_id: str) -> tuple[flowly.Run, datetime]:
                    async with flowly.AsyncClient(dsn) as aclient:
                        run = await aclient.wait(run_id, timeout=30)
                        # read here: closing the client after the wait is not the wait
                        return run, datetime.now(UTC)
                run, returned = asyncio.run(wait(run_id))
            else:
                run = client.wait(run_id, timeout=30)
                returned = datetime.now(UTC)
            assert run.status == "completed" and run.finished_at is not None
            delays.append((returned - run.finished_at).total_seconds())
    assert max(delays) < 0.1, delays


def _notification_queue_held(other: psycopg.Connection[Any]) -> float:
    """Send a flood of notifications on the finished-run channel, then the share of the
    server's notification queue still held once nudges have let it be cleared. The queue is
    the whole server's: another test may hold it for a few seconds (the frozen worker of
    test_worker_under_failure's, until a live worker ends its listener), hence the patience."""
    flood_notifications(other, scalar(other, "select flowly.finished_channel()"))
    usage = 1.0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        usage = notification_queue_usage(other)
        if usage < 0.0005:
            break
        time.sleep(0.1)
    return usage


@pytest.mark.xdist_group("notification_queue")  # the server's queue is shared: measured alone
@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_client_that_waited_once_does_not_hold_back_the_database_s_notifications(
    dsn: str, asynchronous: bool
) -> None:
    """A client keeps its listener connection between waits. Left listening, its backend is
    sent every finished-run notification of the database while the client reads none: once
    the socket is full the backend stalls, and the server's notification queue (8 GB, shared
    by every session) can no longer be cleared past it, until NOTIFY fails everywhere. Held,
    the 28 MB flood below stays queued: a share of about 0.003."""
    with psycopg.connect(dsn, autocommit=True) as other:
        if asynchronous:
            async def scenario() -> float:
                async with flowly.AsyncClient(dsn) as client:
                    run_id = await client.start("nobody-serves-this")
                    with pytest.raises(flowly.RunTimeout):
                        await client.wait(run_id, timeout=0.2)
                    return _notification_queue_held(other)
            usage = asyncio.run(scenario())
        else:
            with flowly.Client(dsn) as client:
                run_id = client.start("nobody-serves-this")
                with pytest.raises(flowly.RunTimeout):
                    client.wait(run_id, timeout=0.2)
                usage = _notification_queue_held(other)
    assert usage < 0.0005, f"{usage:.5f} of the notification queue held"


@pytest.mark.xdist_group("notification_queue")  # the server's queue is shared: measured alone
def test_waits_of_one_async_client_run_side_by_side_and_one_cancelled_leaves_the_rest(
    dsn: str,
) -> None:
    """Gathered waits share the client's listener: each returns its run, a wait cancelled
    midway does not cut the others off (it closed the shared listener under them once), and
    when the last one is done the listener no longer listens."""
    async def scenario() -> tuple[list[flowly.Run], float]:
        async with flowly.AsyncClient(dsn) as client:
            runs = [await client.start("slow", {"seconds": s}) for s in (1.0, 1.5, 2.0)]
            forever = await client.start("slow", {"seconds": 60})
            waits = [asyncio.ensure_future(client.wait(r, timeout=30)) for r in runs]
            abandoned = asyncio.ensure_future(client.wait(forever, timeout=30))
            await asyncio.sleep(0.3)
            abandoned.cancel()
            done = await asyncio.gather(*waits)
            with psycopg.connect(dsn, autocommit=True) as other:
                return done, _notification_queue_held(other)

    with running_worker(dsn, concurrency=8):
        done, usage = asyncio.run(scenario())
    assert [run.status for run in done] == ["completed"] * 3
    assert usage < 0.0005, f"{usage:.5f} of the notification queue held"


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_wait_that_outlasts_the_server_s_idle_session_timeout_returns_the_run(
    dsn: str, db: psycopg.Connection[Any], asynchronous: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With ``idle_session_timeout`` set (managed servers set it), the server ends a session
    idle for that long, and a listener waiting for a notification is idle: the wait failed
    with "server closed the connection unexpectedly" once its run outlasted the timeout. It
    listens anew and goes on waiting. The worker's heartbeat, idle between beats, failed
    each beat and logged it; it opens a new connection first. The worker's own listener was
    ended each second, and came back with a warning each time; it shows itself alive more
    often than the timeout now."""
    database_default(db, "idle_session_timeout", "1000")

    async def wait_async(run_id: str) -> flowly.Run:
        async with flowly.AsyncClient(dsn) as aclient:
            return await aclient.wait(run_id, timeout=30)

    with running_worker(dsn, lease=4.5), flowly.Client(dsn) as client:  # a beat each 1.5 s
        run_id = client.start("slow", {"seconds": 3.5})
        run = asyncio.run(wait_async(run_id)) if asynchronous else client.wait(run_id, timeout=30)
    assert run.status == "completed", run
    assert "heartbeat failed" not in caplog.text, caplog.text
    assert "wake-up listener lost" not in caplog.text, caplog.text


_REMINDED: dict[str, float] = {}


@flowly.workflow("tw_reminder_beside_an_approval", max_attempts=1)
async def tw_reminder_beside_an_approval(ctx: flowly.Context, wait_first: bool) -> Any:
    """A reminder sent after a durable sleep, beside a wait for the approval it reminds of."""

    async def remind() -> Any:
        await ctx.sleep("reminder delay", 1)
        return await ctx.step("remind", lambda: _REMINDED.setdefault(ctx.run_id,
                                                                      time.monotonic()) and "sent")

    async def approve() -> Any:
        return await ctx.wait_for_event("approval")

    if wait_first:
        approval, reminder = await asyncio.gather(approve(), remind())
    else:
        reminder, approval = await asyncio.gather(remind(), approve())
    return [reminder, approval]


@pytest.mark.parametrize("wait_first", [True, False], ids=["wait-first", "sleep-first"])
def test_a_sleep_beside_a_wait_ends_at_its_time_while_the_wait_goes_on(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any], wait_first: bool
) -> None:
    """The body ended on whichever interrupt came first. Parked on the wait, the run slept
    until the event: the sleep's wake time was stored but not counted (or its write not yet
    answered when the run parked), so the reminder waited for the approval it reminds of."""
    run_id = client.start("tw_reminder_beside_an_approval", wait_first)
    started = time.monotonic()
    with running_worker(dsn, workflows=[tw_reminder_beside_an_approval]):
        wait_for(lambda: run_id in _REMINDED, timeout=10, what="the reminder, with no event")
        assert _REMINDED[run_id] - started >= 1.0
        wait_for(lambda: _parked(db, run_id), what="parked on the approval again")
        client.send_event(run_id, "approval", "granted")
        run = client.wait(run_id, timeout=20)
    assert (run.status, run.output) == ("completed", ["sent", "granted"]), run
