"""A second pass of attacks on the hardening of migrations 0014-0020 and its Python side: retries
of parents that caught a child's failure, purge and stale waits, missed wake-ups behind busy
rows, exception context through transactional steps, start-up checks, tasks that steps start."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

import flowly
from tests.support import claim_as, park_on_run, running_worker, scalar

# -- retry_dead_letter retires a wait's recorded failure the body had caught ---------------

_BROKEN: dict[str, bool] = {"child_fails": True, "final_fails": True}
_FALLBACK_CALLS: list[str] = []


@flowly.workflow("sp_child", max_attempts=1)
async def sp_child(ctx: flowly.Context, inp: Any) -> Any:
    def work() -> str:
        if _BROKEN["child_fails"]:
            raise ValueError("child broken")
        return "child ok"

    return await ctx.step("work", work, retry=flowly.Retry(max_attempts=1))


@flowly.workflow("sp_tolerant_parent", max_attempts=1)
async def sp_tolerant_parent(ctx: flowly.Context, inp: Any) -> Any:
    child = await ctx.start(sp_child, None)
    try:
        got = await ctx.wait_for_run(child)
    except flowly.ChildFailed:
        def fallback() -> str:
            _FALLBACK_CALLS.append(ctx.run_id)
            return "fallback"

        got = await ctx.step("fallback", fallback)

    def final() -> Any:
        if _BROKEN["final_fails"]:
            raise RuntimeError("final broken")
        return got

    return await ctx.step("final", final, retry=flowly.Retry(max_attempts=1))


def test_retry_keeps_a_child_failure_the_parent_caught_and_went_on_from(
    dsn: str, db: psycopg.Connection[Any], client: flowly.Client
) -> None:
    """The parent catches ChildFailed, runs its fallback step (a side effect), and later
    dead-letters at an unrelated step. The child is then retried and completes; the parent is
    retried. What the body observed (the child failed) was recorded and acted on: the new
    generation must replay it, not take the other branch on top of the fallback it already
    ran (exact replay)."""
    _BROKEN.update(child_fails=True, final_fails=True)
    _FALLBACK_CALLS.clear()
    with running_worker(dsn, workflows=[sp_child, sp_tolerant_parent]):
        parent = client.start(sp_tolerant_parent, run_id="sp-p1")
        assert client.wait(parent, timeout=30).status == "dead_letter"
        child = scalar(db, "select id from flowly.runs where parent_run_id = %s", parent)
        assert client.get(child).status == "dead_letter"
        assert _FALLBACK_CALLS == [parent]
        _BROKEN["child_fails"] = False
        client.retry_dead_letter(child)
        assert client.wait(child, timeout=30).status == "completed"
        _BROKEN["final_fails"] = False
        client.retry_dead_letter(parent)
        run = client.wait(parent, timeout=30)
    assert run.status == "completed", run.error
    assert run.output == "fallback", (
        f"the retried parent took the other branch of a wait it had already acted on:"
        f" output {run.output!r}, though its fallback step ran ({_FALLBACK_CALLS})")


def test_retry_of_a_parent_that_caught_child_failed_survives_the_child_s_purge(
    dsn: str, db: psycopg.Connection[Any], client: flowly.Client
) -> None:
    """Same parent; the dead-lettered child is purged (its parent is finished, so purge may),
    then the operator fixes the final step and retries the parent. The recorded ChildFailed,
    which the body caught, replays and the parent completes through its fallback: the wait is
    not asked again for a run that no longer exists."""
    _BROKEN.update(child_fails=True, final_fails=True)
    _FALLBACK_CALLS.clear()
    with running_worker(dsn, workflows=[sp_child, sp_tolerant_parent]):
        parent = client.start(sp_tolerant_parent, run_id="sp-p2")
        assert client.wait(parent, timeout=30).status == "dead_letter"
        child = scalar(db, "select id from flowly.runs where parent_run_id = %s", parent)
        # the child finished first, so the oldest-first batch of one takes only it
        assert scalar(db, "select flowly.purge('0 seconds', batch => 1)") == 1
        assert scalar(db, "select count(*) from flowly.runs where id = %s", child) == 0
        _BROKEN["final_fails"] = False
        client.retry_dead_letter(parent)
        run = client.wait(parent, timeout=30)
    assert run.status == "completed", f"parent {run.status}: {run.error and run.error['message']}"
    assert run.output == "fallback"


# -- purge: a wait of a finished run pins its target for ever -------------------------------

def test_purge_removes_cancelled_runs_that_waited_for_each_other(
    db: psycopg.Connection[Any]
) -> None:
    """a waits for b and b for a (a mistake); the operator cancels both. Both are finished and
    nothing unfinished will ever read either, yet each one's leftover wait row names the
    other, so purge keeps both for ever (README: a run is kept "until that run finishes")."""
    db.execute("select flowly.start('wa', run_id => 'a')")
    db.execute("select flowly.start('wb', run_id => 'b')")
    park_on_run(db, "a", claim_as(db, "wa")["a"], "b")
    park_on_run(db, "b", claim_as(db, "wb")["b"], "a")
    assert scalar(db, "select flowly.cancel('a')") == "cancelled"
    assert scalar(db, "select flowly.cancel('b')") == "cancelled"
    purged = sum(scalar(db, "select flowly.purge('0 seconds')") for _ in range(3))
    left = db.execute("select id from flowly.runs order by id").fetchall()
    assert purged == 2, f"purge kept finished runs {left}: their finished waiters pin them"


def test_purge_does_not_keep_a_completed_run_for_a_cancelled_waiter(
    db: psycopg.Connection[Any]
) -> None:
    """w waited for x and was cancelled; x completed. The operator purges completed runs only
    (keeping cancelled ones for audit). x is needed by no unfinished run, but w's stale wait
    row keeps x as long as w exists."""
    db.execute("select flowly.start('ww', run_id => 'w')")
    db.execute("select flowly.start('wx', run_id => 'x')")
    park_on_run(db, "w", claim_as(db, "ww")["w"], "x")
    assert scalar(db, "select flowly.cancel('w')") == "cancelled"
    x_epoch = claim_as(db, "wx")["x"]
    db.execute("select flowly.complete('x', %s, '1')", (x_epoch,))
    purged = scalar(db, "select flowly.purge('0 seconds', statuses => array['completed'])")
    assert purged == 1, "a completed run stays pinned by the wait of a cancelled run"


def test_purge_does_not_keep_a_child_whose_outcome_the_parent_already_recorded(
    db: psycopg.Connection[Any]
) -> None:
    """p started c, read c's result (recorded in p's steps), and now waits for an approval
    event for days. Nothing will ever read c again, but the parent rule keeps every finished
    child of an unfinished parent: c lives as long as p waits."""
    db.execute("select flowly.start('parent', run_id => 'p')")
    db.execute("select flowly.start('child', run_id => 'c', parent_run_id => 'p')")
    c_epoch = claim_as(db, "child")["c"]
    db.execute("select flowly.complete('c', %s, '42')", (c_epoch,))
    epoch = claim_as(db, "parent")["p"]
    row = db.execute("select outcome from flowly.wait_for_run('p', %s, 'run:c', 'c')",
                     (epoch,)).fetchone()
    assert row == ("finished",)
    assert scalar(db, "select outcome from flowly.wait_for_event('p', %s, 'event:ok', 'ok')",
                  epoch) == "waiting"
    db.execute("select flowly.park('p', %s, array['event:ok'])", (epoch,))
    assert scalar(db, "select flowly.purge('0 seconds')") == 1, (
        "a child whose result its parent already recorded is kept until the parent finishes")


def _sync_raises_while_handling(conn: Any) -> None:
    try:
        {}["missing-key"]
    except KeyError:
        raise ValueError("boom while handling")  # noqa: B904 - implicit chaining on purpose


async def _async_raises_while_handling(conn: Any) -> None:
    try:
        {}["missing-key"]
    except KeyError:
        raise ValueError("boom while handling")  # noqa: B904 - implicit chaining on purpose


@flowly.workflow("sp_tx_chain", max_attempts=1)
async def sp_tx_chain(ctx: flowly.Context, inp: Any) -> Any:
    fn = _sync_raises_while_handling if inp == "sync" else _async_raises_while_handling
    return await ctx.transaction("tx", fn, retry=flowly.Retry(max_attempts=1))


@flowly.workflow("sp_step_chain", max_attempts=1)
async def sp_step_chain(ctx: flowly.Context, inp: Any) -> Any:
    return await ctx.step("s", lambda: _sync_raises_while_handling(None),
                          retry=flowly.Retry(max_attempts=1))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_transactional_step_s_failure_keeps_its_implicit_exception_context(
    dsn: str, client: flowly.Client, kind: str
) -> None:
    """fn raises ValueError while handling a KeyError (implicit chaining, __context__). An
    ordinary step records both in its traceback; a transactional step's failure is carried
    past run_write as UserCodeFailed and re-raised `from failed.error.__cause__`, which sets
    __suppress_context__: the KeyError (often the real cause) vanishes from the record."""
    with running_worker(dsn, workflows=[sp_tx_chain, sp_step_chain]):
        tx = client.start(sp_tx_chain, kind, run_id=f"sp-tx-{kind}")
        step = client.start(sp_step_chain, None, run_id=f"sp-step-{kind}")
        tx_run, step_run = client.wait(tx, timeout=30), client.wait(step, timeout=30)
    assert (tx_run.status, step_run.status) == ("dead_letter", "dead_letter")
    step_tb = client.failed_attempts(step)[0].error["traceback"]
    tx_tb = client.failed_attempts(tx)[0].error["traceback"]
    assert "KeyError" in step_tb
    assert "KeyError" in tx_tb, f"the transactional step's traceback lost its context:\n{tx_tb}"


# -- wake_missed_waiters: 1,000 busy wake-ups starve the rest ---------------------------------

def test_missed_wake_ups_of_busy_rows_do_not_starve_a_free_one(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """1,001 parked runs' wake-ups were missed because an operator's open transaction holds
    their rows (`begin; update flowly.runs set priority = 5 where workflow = ...`). Another
    parked run, z, missed its wake-up too, and its row is free. wake_missed_waiters takes the
    first 1,000 by run id, finds them all locked, and never reaches z while the operator's
    transaction lasts: one set of busy rows stalls an unrelated run."""
    db.execute("select flowly.start('held', run_id => 'a' || lpad(i::text, 5, '0'),"
               " scheduled_for => now() + interval '1 day') from generate_series(0, 1000) i")
    db.execute("select flowly.start('free', run_id => 'z',"
               " scheduled_for => now() + interval '1 day')")
    # z waits for an event that has arrived: its wake-up is due (0022 wakes only such runs)
    db.execute("select flowly.send_event('z', 'go', '1')")
    db.execute("insert into flowly.waits (run_id, step, kind, target)"
               " values ('z', 'event:go', 'event', 'go')")
    db.execute("insert into flowly.missed_wakeups (run_id) select id from flowly.runs")
    with psycopg.connect(dsn) as operator:
        operator.execute("update flowly.runs set priority = 5 where workflow = 'held'")
        for _ in range(3):  # three worker polls
            db.execute("select flowly.wake_missed_waiters()")
        due = scalar(db, "select scheduled_for <= now() from flowly.runs where id = 'z'")
        operator.rollback()
    assert due, "z's wake-up waits behind 1,001 wake-ups whose rows are busy"


# -- promises nothing tested yet: check_current, the task factory -----------------------------

@flowly.workflow("sp_plain")
async def sp_plain(ctx: flowly.Context, inp: Any) -> Any:
    return await ctx.step("s", lambda: inp)


def test_a_non_installing_worker_serves_a_custom_schema_a_newer_release_migrated(
    empty_dsn: str
) -> None:
    """install_schema=False checks only that no migration is missing: a schema with a
    migration this release does not know (a newer release migrated it first), under a custom
    name that needs quoting, is served."""
    from flowly.schema import install_dsn

    schema = "Flowly Ops"
    install_dsn(empty_dsn, schema)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute('insert into "Flowly Ops".schema_migrations (version, name)'
                     " values (9999, '9999_from_the_future')")
    with flowly.Client(empty_dsn, schema=schema) as client, \
            running_worker(empty_dsn, workflows=[sp_plain], schema=schema,
                           install_schema=False):
        run = client.wait(client.start(sp_plain, 7), timeout=30)
    assert (run.status, run.output) == ("completed", 7)


_PREVIOUS_FACTORY_CALLS: list[str] = []


@flowly.workflow("sp_tasks", max_attempts=1)
async def sp_tasks(ctx: flowly.Context, inp: Any) -> Any:
    import asyncio
    import sys

    async def exits() -> None:
        await asyncio.sleep(0)
        sys.exit(3)

    async def slow() -> str:
        await asyncio.sleep(5)
        return "late"

    async def tg_step() -> str:
        # a TaskGroup and a timeout inside a step behave as asyncio says
        try:
            async with asyncio.timeout(0.05):
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(slow())
        except TimeoutError:
            pass
        else:
            return "no timeout"
        own = asyncio.CancelledError("mine")
        try:
            async with asyncio.TaskGroup() as tg:
                async def cancels() -> None:
                    raise own
                tg.create_task(cancels())
        except BaseException as exc:
            return f"{type(exc).__name__}"
        return "nothing"

    async def gathers() -> None:
        await asyncio.gather(exits())

    got = await ctx.step("tg", tg_step)
    await ctx.step("exits", gathers, retry=flowly.Retry(max_attempts=1))
    return got


def test_tasks_a_step_starts_keep_asyncio_s_semantics_and_the_loop_s_own_factory(
    dsn: str, client: flowly.Client
) -> None:
    """A task factory installed on the worker's loop before flowly's still makes every task;
    TaskGroup and asyncio.timeout work inside a step; sys.exit in a gathered task fails the
    step (UserTaskExited), not the worker."""
    import asyncio

    worker = flowly.Worker(dsn, workflows=[sp_tasks], poll_interval=0.1)
    loop = asyncio.new_event_loop()

    def previous(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        _PREVIOUS_FACTORY_CALLS.append(getattr(coro, "__qualname__", "?"))
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(previous)
    import threading
    errors: list[BaseException] = []

    def run() -> None:
        try:
            loop.run_until_complete(worker.run())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        run_id = client.start(sp_tasks, None, run_id="sp-tasks")
        result = client.wait(run_id, timeout=30)
    finally:
        loop.call_soon_threadsafe(worker.stop)
        thread.join(30)
    assert not errors and not thread.is_alive()
    assert loop.get_task_factory() is previous
    loop.close()
    assert result.status == "dead_letter"
    assert result.error["type"] == "UserTaskExited", result.error
    tg = next(s for s in client.steps(run_id) if s.name == "tg")
    assert tg.output == "nothing"  # as plain asyncio: a child cancelled is not an error
    assert "_contained" in _PREVIOUS_FACTORY_CALLS
