"""What user code raises or does inside steps, transactional steps and compensations is that
step's own failure: never taken for the engine's (a lost connection, a busy row), never able to
stop a sibling's side effect from being undone, never committed outside flowly's transaction."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from typing import Any

import psycopg
import pytest

import flowly
from tests.support import running_worker, scalar, wait_for, worker_process

LOG: dict[str, list[str]] = defaultdict(list)


# --- a parallel sibling that starts while a failure is being decided ------------------------

@flowly.workflow("ucf_sibling_after_fast_failure")
async def ucf_sibling_after_fast_failure(ctx: flowly.Context, inp: Any) -> Any:
    log = LOG[ctx.run_id]

    async def fail_now() -> None:
        raise ValueError("declined at once")

    async def charge() -> str:
        log.append("charged")
        await asyncio.sleep(0.3)
        return "charge-1"

    def refund(output: str) -> None:
        log.append(f"refunded {output}")

    return await asyncio.gather(
        ctx.step("validate", fail_now, retry=flowly.Retry(max_attempts=1)),
        ctx.step("charge", charge, compensate=refund),
    )


def test_a_compensable_sibling_that_ran_while_the_failure_was_decided_is_compensated(
    dsn: str, client: flowly.Client
) -> None:
    """README: 'Steps running in parallel (asyncio.gather) when one fails are waited for before
    the run's fate is decided: a sibling that completes is checkpointed and compensated too.'
    Here the failing step fails before its sibling's task got its first turn: the sibling then
    runs its side effect anyway, while fail_step dead-letters the run (no compensable step was
    checkpointed yet), so the charge is neither checkpointed nor refunded."""
    run_id = client.start("ucf_sibling_after_fast_failure", None)
    with running_worker(dsn):
        run = client.wait(run_id, timeout=20)
        time.sleep(0.6)  # let the sibling finish whatever it does
    log = LOG[run_id]
    assert run.status == "dead_letter"
    if "charged" in log:  # the side effect happened: it must have been undone
        steps = {s.name: (s.status, s.compensation_status) for s in client.steps(run_id)}
        assert log == ["charged", "refunded charge-1"], (log, steps)
        assert steps.get("charge") == ("completed", "completed"), steps


# --- user errors inside a transactional step are taken for engine failures ------------------

@flowly.workflow("ucf_txn_user_error")
async def ucf_txn_user_error(ctx: flowly.Context, inp: dict[str, Any]) -> Any:
    log = LOG[ctx.run_id]

    def body(conn: psycopg.Connection[Any]) -> int:
        log.append("try")
        if inp["case"] == "timeout_error":  # e.g. an HTTP call inside fn timing out
            raise TimeoutError("the upstream service timed out")
        if inp["case"] == "connection_error":
            raise ConnectionRefusedError("the upstream service refused")
        if inp["case"] == "statement_timeout":  # the user's own statement_timeout
            conn.execute("set local statement_timeout = '50ms'")
            conn.execute("select pg_sleep(1)")
        raise AssertionError("unknown case")

    return await ctx.transaction("move", body, retry=flowly.Retry(max_attempts=2,
                                                                   initial_delay=0.1))


@pytest.mark.parametrize("case", ["timeout_error", "connection_error", "statement_timeout"])
def test_a_transactional_step_whose_fn_raises_an_os_or_timeout_error_fails_through_retry(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any], case: str
) -> None:
    """README: a transactional step that fails 'fails through `retry`' like any failure. An
    OSError (TimeoutError, ConnectionError) raised by the user's fn, or a statement timeout of
    the user's own SQL, is taken for a failed engine write instead: the run is abandoned until
    its lease expires, retaken, fails again... forever, never counting an attempt."""
    run_id = client.start("ucf_txn_user_error", {"case": case})
    with running_worker(dsn, lease=1.0):
        try:
            run = client.wait(run_id, timeout=6)
        except flowly.RunTimeout:
            run = client.get(run_id)
    attempts = scalar(db, "select count(*) from flowly.step_attempts where run_id = %s", run_id)
    assert run.status == "dead_letter", (run.status, LOG[run_id], attempts)
    assert attempts == 2 and LOG[run_id] == ["try", "try"]


@flowly.workflow("ucf_txn_compensation_error")
async def ucf_txn_compensation_error(ctx: flowly.Context, inp: Any) -> Any:
    log = LOG[ctx.run_id]

    def undo_txn(conn: psycopg.Connection[Any], output: Any) -> None:
        log.append("undo txn")
        raise ConnectionResetError("the ledger service hung up")

    def undo_plain(output: Any) -> None:
        log.append("undo plain")

    def fail() -> None:
        raise ValueError("the next step fails")

    await ctx.step("plain", lambda: "p", compensate=undo_plain)
    await ctx.transaction("txn", lambda conn: "t", compensate=undo_txn)
    await ctx.step("fails", fail, retry=flowly.Retry(max_attempts=1))


def test_a_transactional_compensation_raising_an_os_error_does_not_stop_the_saga(
    dsn: str, client: flowly.Client
) -> None:
    """README: 'each outcome is stored on its step; a failing one does not stop the rest'.
    A transactional compensation raising ConnectionResetError is taken for a lost database
    connection: the saga is abandoned, retaken after the lease, abandoned again, forever; the
    earlier step's compensation never runs and the run never lands in dead_letter."""
    run_id = client.start("ucf_txn_compensation_error", None)
    with running_worker(dsn, lease=1.0):
        try:
            run = client.wait(run_id, timeout=6)
        except flowly.RunTimeout:
            run = client.get(run_id)
    assert run.status == "dead_letter", (run.status, LOG[run_id])
    outcomes = {s.name: s.compensation_status for s in client.steps(run_id)}
    assert outcomes["txn"] == "failed" and outcomes["plain"] == "completed"
    assert run.compensation_ok is False
    assert LOG[run_id] == ["undo txn", "undo plain"]


# --- an exception whose str() fails --------------------------------------------------------

class BadMessage(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message for you")


class InterruptingMessage(Exception):
    """Its __str__ raises a BaseException, which an `except Exception` lets through."""

    def __str__(self) -> str:
        raise KeyboardInterrupt


@flowly.workflow("ucf_bad_message", max_attempts=1)
async def ucf_bad_message(ctx: flowly.Context, unprintable: str) -> Any:
    log = LOG[ctx.run_id]

    def flaky() -> str:
        log.append("try")
        if len(log) < 3:
            raise BadMessage() if unprintable == "error" else InterruptingMessage()
        return "ok"

    try:
        return await ctx.step("flaky", flaky, retry=flowly.Retry(max_attempts=3,
                                                                  initial_delay=0.05))
    except Exception as exc:  # a step failure is never an ordinary exception in the body
        return f"swallowed {type(exc).__name__}"


@pytest.mark.parametrize("unprintable", ["error", "interrupt"])
def test_a_step_whose_exception_has_no_printable_message_is_retried(
    dsn: str, client: flowly.Client, unprintable: str
) -> None:
    """README: a failing step is retried per its `retry`; step failures end the body with
    interrupts (BaseException), so `except Exception` cannot swallow them. An exception whose
    __str__ raised made error_info fail inside the fail_step write, and the step was not
    retried (the body received an ordinary RefusedWrite it could swallow); one whose __str__
    raised a BaseException escaped error_info's guard and failed the whole run (one attempt
    here) with that BaseException's type instead of the step's."""
    run_id = client.start("ucf_bad_message", unprintable)
    with running_worker(dsn):
        run = client.wait(run_id, timeout=20)
    assert LOG[run_id] == ["try", "try", "try"], (run.status, run.output, run.error)
    assert run.status == "completed" and run.output == "ok"


# --- a user's lock wait inside a transactional step ------------------------------------------

@flowly.workflow("ucf_txn_nowait")
async def ucf_txn_nowait(ctx: flowly.Context, inp: Any) -> Any:
    log = LOG[ctx.run_id]

    def body(conn: psycopg.Connection[Any]) -> str:
        log.append("try")
        conn.execute("set local lock_timeout = '50ms'")
        conn.execute("select pg_advisory_xact_lock(4242)")  # held by the test: 55P03
        return "locked"

    return await ctx.transaction("lock", body, retry=flowly.Retry(max_attempts=2,
                                                                   initial_delay=0.1))


def test_a_transactional_step_whose_sql_gives_up_on_a_lock_fails_through_retry(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """The user's SQL fails with lock_not_available (55P03): for an ordinary step that is an
    ordinary failure, for a transactional one it is taken for 'the run's row is busy' and the
    whole step is run again every <= 1 s forever, never counting an attempt."""
    db.execute("select pg_advisory_lock(4242)")
    run_id = client.start("ucf_txn_nowait", None)
    with running_worker(dsn):
        try:
            run = client.wait(run_id, timeout=5)
        except flowly.RunTimeout:
            run = client.get(run_id)
    attempts = scalar(db, "select count(*) from flowly.step_attempts where run_id = %s", run_id)
    assert run.status == "dead_letter", (run.status, len(LOG[run_id]), attempts)


# --- a transactional step's fn that ends the transaction itself ------------------------------

@flowly.workflow("ucf_txn_ends_its_transaction")
async def ucf_txn_ends_its_transaction(ctx: flowly.Context, inp: dict[str, str]) -> Any:
    def body(conn: psycopg.Connection[Any]) -> str:
        conn.execute("insert into public.test_effects (run_id, step, pid) values (%s, 'x', 0)",
                     (ctx.run_id,))
        conn.execute(inp["ends_with"])  # say, a helper library that commits what it wrote
        if inp["then"] == "raises":
            raise ValueError("fails after ending the transaction")
        conn.execute("select 1")  # goes on in a transaction of its own
        return "done"

    return await ctx.transaction("write", body, retry=flowly.Retry(max_attempts=3,
                                                                    initial_delay=0.05))


@pytest.mark.parametrize("ends_with", ["commit", "rollback"])
@pytest.mark.parametrize("then", ["raises", "returns"])
def test_a_transactional_step_whose_fn_ends_the_transaction_fails_without_retries(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any], ends_with: str, then: str
) -> None:
    """README: fn runs 'in the transaction that also checks the run's lease and writes the
    step's checkpoint: both commit, or neither does'. A fn that ends that transaction itself
    (COMMIT or ROLLBACK as SQL; psycopg refuses only conn.commit()) fails its step at once,
    without retries: a retry could apply committed effects twice, and a checkpoint in a later
    transaction would record a step whose effects were rolled back."""
    run_id = client.start("ucf_txn_ends_its_transaction", {"ends_with": ends_with, "then": then})
    with running_worker(dsn):
        run = client.wait(run_id, timeout=20)
    effects = scalar(db, "select count(*) from public.test_effects where run_id = %s", run_id)
    assert run.status == "dead_letter", run.output
    assert effects == (1 if ends_with == "commit" else 0)
    assert "ended the transaction flowly opened" in run.error["message"]
    assert scalar(db, "select count(*) from flowly.step_attempts where run_id = %s",
                  run_id) == 1


# --- an async callable object as a transactional fn ------------------------------------------

class AsyncWriter:
    async def __call__(self, conn: psycopg.AsyncConnection[Any]) -> int:
        cursor = await conn.execute("select 41 + 1")
        row = await cursor.fetchone()
        assert row is not None
        return int(row[0])


@flowly.workflow("ucf_txn_async_callable")
async def ucf_txn_async_callable(ctx: flowly.Context, inp: Any) -> Any:
    plain = await ctx.step("plain", lambda: 1)
    return [plain, await ctx.transaction("txn", AsyncWriter())]


def test_an_async_callable_object_gets_an_async_connection(
    dsn: str, client: flowly.Client
) -> None:
    """README: conn is 'async for an async fn'; workflow registration and ctx.step accept an
    object with an async __call__ as async. ctx.transaction decides with
    inspect.iscoroutinefunction, so such an object runs on a thread with a sync connection and
    its coroutine is never awaited: the step fails as 'not JSON serialisable'."""
    run_id = client.start("ucf_txn_async_callable", None)
    with running_worker(dsn):
        run = client.wait(run_id, timeout=20)
    assert run.status == "completed", run.error
    assert run.output == [1, 42]


# --- BaseException raised in a task a step's fn created ---------------------------------------

@flowly.workflow("ucf_subtask_systemexit")
async def ucf_subtask_systemexit(ctx: flowly.Context, inp: Any) -> Any:
    async def helper() -> None:
        raise SystemExit("a library called sys.exit()")

    async def fan_out() -> Any:
        return await asyncio.gather(helper())

    return await ctx.step("fan_out", fan_out, retry=flowly.Retry(max_attempts=1))


@flowly.workflow("ucf_innocent")
async def ucf_innocent(ctx: flowly.Context, inp: Any) -> Any:
    await ctx.step("wait", asyncio.sleep, 1.0)
    return "fine"


def test_a_step_whose_own_task_raises_system_exit_fails_its_run_not_the_worker(
    dsn: str, client: flowly.Client
) -> None:
    """A step raising SystemExit fails its run, never the worker (test_engine's poison case).
    Raised in a task the async step created, asyncio's Task re-raises SystemExit out of the
    event loop: the whole worker stops, with every other run it held."""
    innocent = client.start("ucf_innocent", None)
    poisoned = None
    errors: list[BaseException] = []
    try:
        with running_worker(dsn):
            wait_for(lambda: client.get(innocent).status == "running", what="innocent running")
            poisoned = client.start("ucf_subtask_systemexit", None)
            run = client.wait(poisoned, timeout=10)
            assert run.status == "dead_letter"
            assert client.wait(innocent, timeout=10).status == "completed"
    except BaseException as exc:
        errors.append(exc)
    assert not errors, repr(errors[0])


@flowly.workflow("ucf_cancels_itself", max_attempts=2)
async def ucf_cancels_itself(ctx: flowly.Context, inp: Any) -> Any:
    async def cancel_own_task() -> None:
        LOG[ctx.run_id].append("try")
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(1)

    return await ctx.step("cancels", cancel_own_task, retry=flowly.Retry(max_attempts=1))


def test_a_body_that_cancels_its_own_task_fails_its_run_instead_of_looping(
    dsn: str, client: flowly.Client
) -> None:
    """A step that cancels the task it runs in (and nothing catches the CancelledError): the
    worker took the body's end for a cancel of its own, left the run to its lease and took
    it again when that expired, for ever, without counting an attempt (a lease that lapses
    under a live worker is no evidence against the run). It is a failure of the body now."""
    run_id = client.start("ucf_cancels_itself", None)
    with running_worker(dsn, lease=2):
        run = client.wait(run_id, timeout=20)
    assert (run.status, run.attempt) == ("dead_letter", 2), (run.status, run.attempt)
    assert run.error is not None and run.error["type"] == "CancelledError", run.error
    assert LOG[run_id] == ["try", "try"]


_HUNG_CALL = threading.Event()


@flowly.workflow("ucf_hangs_in_a_thread", max_attempts=1)
async def ucf_hangs_in_a_thread(ctx: flowly.Context, inp: Any) -> Any:
    await ctx.step("hang", _HUNG_CALL.wait)


@flowly.workflow("ucf_quick_sync", max_attempts=1)
async def ucf_quick_sync(ctx: flowly.Context, inp: Any) -> Any:
    return await ctx.step("quick", lambda: "ok")


def test_a_hung_sync_call_of_a_cancelled_run_does_not_trap_the_next_run(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """A sync step hangs; the operator cancels its run. The call keeps its thread (Python
    cannot stop one), and the worker, its run gone, claimed the next run, whose sync step
    then waited for a thread as long as the hung call lasted, its lease kept by heartbeats,
    so no other worker could take it. A worker now counts such calls against its room."""
    _HUNG_CALL.clear()
    workflows = [ucf_hangs_in_a_thread, ucf_quick_sync]
    try:
        with running_worker(dsn, workflows=workflows, concurrency=1, worker_id="trapped",
                            lease=1.5):
            hung = client.start("ucf_hangs_in_a_thread", None)
            wait_for(lambda: scalar(db, "select count(*) from flowly.steps where run_id = %s",
                                    hung) == 0 and client.get(hung).locked_by == "trapped",
                     what="the hung run held")
            time.sleep(0.3)  # its step begun
            client.cancel(hung)
            time.sleep(1.5)  # its worker's next heartbeat finds it cancelled, and lets it go
            innocent = client.start("ucf_quick_sync", None)
            time.sleep(1.0)  # the trapped worker's chance to take it: its wake-up, a poll
            with running_worker(dsn, workflows=workflows, worker_id="free"):
                run = client.wait(innocent, timeout=15)
        assert run.status == "completed", run
        assert scalar(db, "select locked_by is null from flowly.runs where id = %s", innocent)
    finally:
        _HUNG_CALL.set()


@flowly.workflow("ucf_compensation_cancels_itself", max_attempts=1)
async def ucf_compensation_cancels_itself(ctx: flowly.Context, inp: Any) -> Any:
    async def undo(_: Any) -> None:
        LOG[ctx.run_id].append("undo")
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(1)

    def decline() -> None:
        raise ValueError("declined")

    await ctx.step("book", lambda: "booked", compensate=undo)
    await ctx.step("pay", decline, retry=flowly.Retry(max_attempts=1))


def test_a_compensation_that_cancels_its_own_task_fails_instead_of_looping(
    dsn: str, client: flowly.Client
) -> None:
    """The compensation's twin of the case above: its CancelledError was taken for a stop of
    the worker's, and the run, left to its lease, was compensated again and again."""
    run_id = client.start("ucf_compensation_cancels_itself", None)
    with running_worker(dsn, lease=2):
        run = client.wait(run_id, timeout=20)
    assert (run.status, run.compensation_ok) == ("dead_letter", False), run
    assert LOG[run_id] == ["undo"]


# --- a step that stops the worker's event loop -----------------------------------------------

def test_a_step_that_stops_the_event_loop_does_not_end_its_worker_process(
    dsn: str, client: flowly.Client
) -> None:
    """``asyncio.get_running_loop().stop()`` in an async step ended ``flowly worker`` with
    "RuntimeError: Event loop stopped before Future completed", every run it held left to
    its lease. The worker resumes its loop (and says so): the run completes, and the same
    process serves the next run."""
    run_id = client.start("stops_its_loop", None)
    with worker_process(dsn) as worker:
        run = client.wait(run_id, timeout=30)
        assert client.wait(client.start("quick", 1), timeout=30).status == "completed"
        assert worker.proc.poll() is None, worker.proc.communicate()[0]
        log = worker.stop()
    assert worker.proc.returncode == 0, log
    assert (run.status, run.output, run.attempt) == ("completed", ["stopped", "went on"], 1), run
    assert "the event loop was stopped" in log, log
