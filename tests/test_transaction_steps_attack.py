"""Attacks on transactional steps under the lock modes of 0024-0027.

A transactional step holds FOR KEY SHARE on its run for the whole user transaction; since
0024 only the FOR UPDATE writes (endings, park, claim) conflict with it, and every other
worker write (checkpoint, heartbeat, sleep, start, wait registration) goes on beside it.
These tests check, end to end and at the SQL level, that the step's effects still commit
exactly once with its checkpoint, never after its run ended, and that nothing on a worker's
path waits on the lock the step holds.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import flowly
from flowly.db import translated_errors
from tests import workflows
from tests.support import (
    claim_as,
    in_thread,
    kill_at_work,
    running_worker,
    scalar,
    wait_for,
    worker_process,
)
from tests.workflows import _move, _move_async, record_effect

APP = ("--app", "tests.test_transaction_steps_attack")
LOG_TABLE = """
create table if not exists public.tsa_log (
    run_id text not null, step text not null, at timestamptz not null default clock_timestamp()
)
"""


# -- workflows (run in-process and, with --app this module, in worker processes) ----------------

def _hold(conn: psycopg.Connection[Any], run_id: str, step: str, account: str, amount: int,
          seconds: float, server_side: bool = False) -> int:
    """A transactional step's function: says it is inside (a row committed on its own), logs
    and moves in the step's transaction, then holds the transaction open."""
    record_effect(run_id, step)
    conn.execute("insert into public.tsa_log (run_id, step) values (%s, %s)", (run_id, step))
    balance = _move(conn, account, amount)
    if server_side:
        conn.execute("select pg_sleep(%s)", (seconds,))
    else:
        time.sleep(seconds)
    return balance


async def _hold_async(conn: psycopg.AsyncConnection[Any], run_id: str, step: str, account: str,
                      amount: int, seconds: float, server_side: bool = False) -> int:
    await asyncio.to_thread(record_effect, run_id, step)
    await conn.execute("insert into public.tsa_log (run_id, step) values (%s, %s)",
                       (run_id, step))
    balance = await _move_async(conn, account, amount)
    if server_side:
        await conn.execute("select pg_sleep(%s)", (seconds,))
    else:
        await asyncio.sleep(seconds)
    return balance


@flowly.workflow("tsa_child", max_attempts=1)
async def tsa_child(ctx: flowly.Context, inp: Any) -> Any:
    return await ctx.step("work", lambda: f"child of {inp}")


@flowly.workflow("tsa_waiter", max_attempts=1)
async def tsa_waiter(ctx: flowly.Context, inp: Any) -> Any:
    return await ctx.wait_for_run(inp)


@flowly.workflow("tsa_gather")
async def tsa_gather(ctx: flowly.Context, inp: dict[str, Any]) -> Any:
    """A transactional step 'move' (a -> -1) in parallel with the ``extras`` (an ordinary
    step, a child start, a durable sleep, a wait for event 'go'), then 'credit' (b -> +1)."""
    hold = _hold_async if inp.get("async") else _hold
    parts: list[Any] = [ctx.transaction(
        "move", hold, ctx.run_id, "move", "a", -1, inp["hold"], inp.get("server_side", False),
        isolation=inp.get("isolation"))]
    extras = inp.get("extras", [])
    if "step" in extras:
        parts.append(ctx.step("plain", lambda: "plain"))
    if "child" in extras:
        parts.append(ctx.start("tsa_child", ctx.run_id))
    if "sleep" in extras:
        parts.append(ctx.sleep("nap", inp.get("nap", 0.2)))
    if "event" in extras:
        parts.append(ctx.wait_for_event("go"))
    results = await asyncio.gather(*parts)
    credit = await ctx.transaction("credit", _move, "b", 1)
    return {"move": results[0], "rest": list(results[1:]), "credit": credit}


@flowly.workflow("tsa_fanout")
async def tsa_fanout(ctx: flowly.Context, inp: dict[str, Any]) -> Any:
    """Three transactional steps, each adding 1 to its own account '<run>:<step>', in
    parallel with an ordinary step and a child start."""
    def move(conn: psycopg.Connection[Any], step: str) -> int:
        conn.execute("insert into public.tsa_log (run_id, step) values (%s, %s)",
                     (ctx.run_id, step))
        balance = _move(conn, f"{ctx.run_id}:{step}", 1)
        time.sleep(inp.get("pause", 0.05))
        return balance

    async def move_async(conn: psycopg.AsyncConnection[Any], step: str) -> int:
        await conn.execute("insert into public.tsa_log (run_id, step) values (%s, %s)",
                           (ctx.run_id, step))
        balance = await _move_async(conn, f"{ctx.run_id}:{step}", 1)
        await asyncio.sleep(inp.get("pause", 0.05))
        return balance

    return await asyncio.gather(
        ctx.transaction("m1", move, "m1"),
        ctx.transaction("m2", move_async, "m2", isolation="repeatable read"),
        ctx.step("plain", time.sleep, inp.get("pause", 0.05)),
        ctx.start("tsa_child", ctx.run_id),
        ctx.transaction("m3", move, "m3", isolation="serializable"),
    )


@flowly.workflow("tsa_saga", max_attempts=1)
async def tsa_saga(ctx: flowly.Context, inp: dict[str, Any]) -> Any:
    """'move' (a -1, compensable by a transactional undo that holds its transaction
    ``undo_hold`` s) beside a step that fails for good: the saga undoes 'move' once."""
    def undo(conn: psycopg.Connection[Any], output: Any) -> None:
        record_effect(ctx.run_id, "undo")
        conn.execute("insert into public.tsa_log (run_id, step) values (%s, 'undo')",
                     (ctx.run_id,))
        _move(conn, "a", 1)
        time.sleep(inp.get("undo_hold", 0))

    def fails() -> None:
        raise ValueError("the sibling fails for good")

    await asyncio.gather(
        ctx.transaction("move", _hold, ctx.run_id, "move", "a", -1, inp.get("hold", 0.3),
                        compensate=undo),
        ctx.step("fails", fails, retry=flowly.Retry(max_attempts=1)),
    )


# -- fixtures and helpers ------------------------------------------------------------------------

@pytest.fixture
def accounts(db: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    db.execute(workflows.ACCOUNTS_TABLE)
    db.execute("insert into public.accounts values ('a', 1000), ('b', 1000)")
    db.execute(LOG_TABLE)
    return db


def balances(db: psycopg.Connection[Any]) -> dict[str, int]:
    return dict(db.execute("select name, balance from public.accounts").fetchall())


def logged(db: psycopg.Connection[Any], run_id: str, step: str) -> int:
    """How many times the step's transaction committed its effect."""
    return int(scalar(db, "select count(*) from public.tsa_log where run_id = %s and step = %s",
                      run_id, step))


def entered(db: psycopg.Connection[Any], run_id: str, step: str) -> int:
    """How many times the step's function started (committed outside its transaction)."""
    return int(scalar(db, "select count(*) from public.test_effects"
                          " where run_id = %s and step = %s", run_id, step))


def checkpointed(db: psycopg.Connection[Any], run_id: str, step: str) -> int:
    return int(scalar(db, "select count(*) from flowly.steps where run_id = %s and name = %s"
                          " and status = 'completed'", run_id, step))


def assert_effects_match_checkpoints(db: psycopg.Connection[Any], run_id: str,
                                     *steps: str) -> None:
    for step in steps:
        assert logged(db, run_id, step) == checkpointed(db, run_id, step) <= 1, (
            f"{run_id}/{step}: effects committed {logged(db, run_id, step)} times,"
            f" checkpoint rows {checkpointed(db, run_id, step)}")


def assert_nothing_committed_after_the_end(db: psycopg.Connection[Any], run_id: str) -> None:
    late = db.execute(
        "select s.name, s.finished_at, r.finished_at from flowly.steps s"
        " join flowly.runs r on r.id = s.run_id"
        " where s.run_id = %s and r.finished_at is not null and s.finished_at > r.finished_at",
        (run_id,)).fetchall()
    assert not late, f"steps recorded after run {run_id} ended: {late}"
    late_log = db.execute(
        "select l.step, l.at from public.tsa_log l join flowly.runs r on r.id = l.run_id"
        " where l.run_id = %s and r.finished_at is not null and l.at > r.finished_at",
        (run_id,)).fetchall()
    assert not late_log, f"effects committed after run {run_id} ended: {late_log}"


def _rows(cursor: psycopg.Cursor[Any]) -> list[Any]:
    return cursor.fetchall() if cursor.description else []


def waited(client: flowly.Client, db: psycopg.Connection[Any], run_id: str,
           timeout: float = 20) -> flowly.Run:
    """client.wait, which on a timeout reports the run's row, steps, timers and row locks."""
    try:
        return client.wait(run_id, timeout=timeout)
    except flowly.RunTimeout as exc:
        state = {
            "run": db.execute("select status, lease_epoch, locked_by, locked_until,"
                              " scheduled_for, now() from flowly.runs where id = %s",
                              (run_id,)).fetchall(),
            "steps": db.execute("select name, kind, status, finished_at from flowly.steps"
                                " where run_id = %s", (run_id,)).fetchall(),
            "timers": db.execute("select name, wake_at, fired_at from flowly.timers"
                                 " where run_id = %s", (run_id,)).fetchall(),
            "effects": db.execute("select step, at from public.test_effects where run_id = %s",
                                  (run_id,)).fetchall(),
            "sessions": db.execute("select state, wait_event_type, left(query, 80)"
                                   " from pg_stat_activity where datname = current_database()"
                                   " and pid <> pg_backend_pid()").fetchall(),
        }
        raise AssertionError(f"{exc}; state: {state}") from exc


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    started = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - started


@pytest.fixture
def worker_conn(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection set up as a worker's, except that a lock wait fails after 1 s (a worker
    call that waits on a lock shows up as an error, not as a slow test)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("set lock_timeout = '1s'")
        conn.execute("set statement_timeout = '5s'")
        yield conn


# -- SQL level ------------------------------------------------------------------------------------

def _open_step(dsn: str, run_id: str, epoch: int, isolation: str | None = None
               ) -> psycopg.Connection[Any]:
    """A connection inside a transactional step's transaction, as the worker opens it:
    begin_transaction_step, then the user's SQL (a log row and a move)."""
    conn = psycopg.connect(dsn)
    try:
        if isolation:
            conn.execute(f"set transaction isolation level {isolation}")
        conn.execute("select set_config('statement_timeout', '0', true)")
        with translated_errors():
            conn.execute("select flowly.begin_transaction_step(%s, %s)", (run_id, epoch))
        conn.execute("insert into public.tsa_log (run_id, step) values (%s, 'move')",
                     (run_id,))
        _move(conn, "a", -1)
    except BaseException:
        conn.close()
        raise
    return conn


def _checkpoint_step(conn: psycopg.Connection[Any], run_id: str, epoch: int) -> None:
    """The worker's end of a transactional step: checkpoint, commit, and once committed, when
    the run had been taken over, restart its takeover count (0029)."""
    with translated_errors():
        row = conn.execute("select taken_over from flowly.checkpoint_transaction(%s, %s,"
                           " 'move', '999'::jsonb, now(), false, 1)", (run_id, epoch)).fetchone()
    conn.commit()
    if row is not None and row[0]:
        conn.execute("select flowly.restart_takeovers(%s, %s)", (run_id, epoch))
        conn.commit()


def test_no_worker_write_waits_on_an_open_transactional_step(
    dsn: str, accounts: psycopg.Connection[Any], worker_conn: psycopg.Connection[Any]
) -> None:
    """While run r's transactional step is open: every write of r's own worker that does not
    end or park r goes through at once (checkpoint, heartbeat, start, wait registration);
    those that end or park it report busy at once; another run's wait for r, an event to r,
    the timeout sweep, a claim of its expired lease and a purge neither wait nor touch it.
    The step then commits its effect and checkpoint together, once."""
    db = accounts
    db.execute("select flowly.start('tsa_gather', run_id => 'r')")
    db.execute("select flowly.start('tsa_waiter', run_id => 'w')")
    db.execute("select flowly.register_worker('w', array['tsa_gather'], array['default'],"
               " '1 hour')")
    epoch = claim_as(db, "tsa_gather")["r"]
    w_epoch = claim_as(db, "tsa_waiter")["w"]
    step = _open_step(dsn, "r", epoch)
    try:
        calls: dict[str, float] = {}

        def call(what: str, query: str, *params: Any) -> Any:
            with translated_errors():
                rows, took = timed(lambda: _rows(worker_conn.execute(query, params)))
            calls[what] = took
            return rows

        call("checkpoint", "select flowly.checkpoint('r', %s, 'plain', '1'::jsonb)", epoch)
        beat = call("heartbeat", "select * from flowly.heartbeat('w', array['r'], array[%s]::"
                    "bigint[], '1 hour')", epoch)
        assert beat == [], f"the heartbeat did not extend r's lease: {beat}"
        call("start", "select flowly.start('tsa_child', run_id => 'c', parent_run_id => 'r',"
             " parent_lease_epoch => %s, parent_step => 'start:c', parent_position => 2)",
             epoch)
        assert call("wait registration", "select outcome from flowly.wait_for_event('r', %s,"
                    " 'event:go', 'go', null, 3)", epoch) == [("waiting",)]
        assert call("wait for r", "select outcome from flowly.wait_for_run('w', %s, 'run:r',"
                    " 'r', 1)", w_epoch) == [("waiting",)]
        call("park on r", "select flowly.park('w', %s, array['run:r'])", w_epoch)
        call("send_event", "select flowly.send_event('r', 'go', '7'::jsonb)")
        # its timeout passed and its lease expired (a no-key update: not held up either)
        call("expire", "update flowly.runs set timeout_at = now() - interval '1 s',"
             " locked_until = now() - interval '1 s' where id = 'r'")
        call("sweep", "select flowly.dead_letter_stalled_runs()")
        claimed = call("claim", "select run_id from flowly.claim('other', array['tsa_gather'],"
                       " array['default'], 10, '1 hour')")
        assert claimed == [], "a claim took over r while its transactional step was open"
        call("purge", "select flowly.purge('0 s')")
        for what, query in (
            ("park", "select flowly.park('r', %s, array['event:go'])"),
            ("complete", "select * from flowly.complete_runs(array['r'], array[%s]::bigint[],"
                         " array['1'::jsonb])"),
        ):
            try:
                rows = call(what, query, epoch)
            except flowly.RunBusy:
                continue
            # r is past its timeout: its completion is refused as a stale lease's is
            assert what == "complete" and rows == [("r", True, False)], (what, rows)
        assert scalar(db, "select status from flowly.runs where id = 'r'") == "running"
        slow = {what: took for what, took in calls.items() if took > 0.9}
        assert not slow, f"worker calls waited on the open step: {slow}"
        # the sweep left r alone while the step was open; nothing of it is visible yet
        assert logged(db, "r", "move") == 0 and balances(db)["a"] == 1000
        # past its timeout the step's checkpoint would be refused (its effect with it): the
        # timeout moved on, the step commits
        db.execute("update flowly.runs set timeout_at = now() + interval '1 hour'"
                   " where id = 'r'")
        _checkpoint_step(step, "r", epoch)
    finally:
        step.close()
    assert logged(db, "r", "move") == checkpointed(db, "r", "move") == 1
    assert balances(db)["a"] == 999
    # now the sweep may end it (its timeout passed)
    db.execute("update flowly.runs set timeout_at = now() - interval '1 s' where id = 'r'")
    db.execute("select flowly.dead_letter_stalled_runs()")
    assert scalar(db, "select status from flowly.runs where id = 'r'") == "dead_letter"
    assert_nothing_committed_after_the_end(db, "r")


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read", "serializable"])
def test_a_sleep_that_releases_the_run_under_an_open_step_lets_it_commit_at_most_once(
    dsn: str, accounts: psycopg.Connection[Any], worker_conn: psycopg.Connection[Any],
    isolation: str,
) -> None:
    """The body's parallel ctx.sleep no longer waits for the open step (FOR NO KEY UPDATE):
    it releases the run (epoch + 1, pending) under it. Whatever the step's isolation, a claim
    cannot take the run while the step is open, and the step's effect is either refused with
    its checkpoint, or committed with it and then replayed, never run a second time."""
    db = accounts
    db.execute("select flowly.start('tsa_gather', run_id => 'r')")
    epoch = claim_as(db, "tsa_gather")["r"]
    step = _open_step(dsn, "r", epoch, isolation)
    try:
        (_wake, released), = worker_conn.execute(
            "select * from flowly.sleep('r', %s, 'nap', null, 0.01, 2)", (epoch,)).fetchall()
        assert released
        time.sleep(0.05)  # the run is due again
        assert claim_as(db, "tsa_gather") == {}, "claimed while its step is open"
        try:
            _checkpoint_step(step, "r", epoch)
            committed = True
        except (flowly.LeaseLost, psycopg.errors.SerializationFailure):
            step.rollback()
            committed = False
    finally:
        step.close()
    assert logged(db, "r", "move") == checkpointed(db, "r", "move") == int(committed)
    assert balances(db)["a"] == 1000 - int(committed)
    # the next holder replays the checkpoint if there is one, or runs the step afresh
    epoch2 = claim_as(db, "tsa_gather")["r"]
    assert epoch2 > epoch
    if not committed:
        again = _open_step(dsn, "r", epoch2, isolation)
        _checkpoint_step(again, "r", epoch2)
        again.close()
    else:
        with pytest.raises(flowly.LeaseLost):
            with translated_errors():
                db.execute("select flowly.begin_transaction_step('r', %s)", (epoch,))
    assert logged(db, "r", "move") == checkpointed(db, "r", "move") == 1
    assert balances(db)["a"] == 999


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
def test_a_step_whose_snapshot_predates_a_cancel_cannot_commit(
    dsn: str, accounts: psycopg.Connection[Any], isolation: str
) -> None:
    """The fence against the run's ending: a cancel commits between the step's snapshot
    (its first statement) and begin_transaction_step's lock. Under REPEATABLE READ the lock
    reads the row as of the snapshot: begin must still refuse (lease lost, or a
    serialization failure that a fresh transaction turns into lease lost), and the step's
    checkpoint must never land on the cancelled run."""
    db = accounts
    db.execute("select flowly.start('tsa_gather', run_id => 'r')")
    epoch = claim_as(db, "tsa_gather")["r"]
    conn = psycopg.connect(dsn)
    try:
        conn.execute(f"set transaction isolation level {isolation}")
        conn.execute("select set_config('statement_timeout', '0', true)")  # the snapshot
        assert db.execute("select flowly.cancel('r')").fetchone() == ("cancelled",)
        with pytest.raises((flowly.LeaseLost, psycopg.errors.SerializationFailure)):
            with translated_errors():
                conn.execute("select flowly.begin_transaction_step('r', %s)", (epoch,))
                conn.execute("insert into public.tsa_log (run_id, step) values ('r', 'move')")
                _checkpoint_step(conn, "r", epoch)
    finally:
        conn.close()
    assert logged(db, "r", "move") == checkpointed(db, "r", "move") == 0


def test_a_step_whose_snapshot_predates_a_sleep_and_a_takeover_cannot_commit(
    dsn: str, accounts: psycopg.Connection[Any]
) -> None:
    """A REPEATABLE READ step of epoch e takes its snapshot; its run's parallel sleep releases
    the run (no-key update) and another worker claims it (epoch e + 2) before the step's
    begin locks the row as of its snapshot: the begin must not pass the fence on the row its
    snapshot shows (running at e)."""
    db = accounts
    db.execute("select flowly.start('tsa_gather', run_id => 'r')")
    epoch = claim_as(db, "tsa_gather")["r"]
    conn = psycopg.connect(dsn)
    try:
        conn.execute("set transaction isolation level repeatable read")
        conn.execute("select set_config('statement_timeout', '0', true)")  # the snapshot
        db.execute("select * from flowly.sleep('r', %s, 'nap', null, 0.01, 2)", (epoch,))
        time.sleep(0.05)
        assert claim_as(db, "tsa_gather")["r"] == epoch + 2
        with pytest.raises((flowly.LeaseLost, psycopg.errors.SerializationFailure)):
            with translated_errors():
                conn.execute("select flowly.begin_transaction_step('r', %s)", (epoch,))
                conn.execute("insert into public.tsa_log (run_id, step) values ('r', 'move')")
                _checkpoint_step(conn, "r", epoch)
    finally:
        conn.close()
    assert logged(db, "r", "move") == checkpointed(db, "r", "move") == 0


# Before 0029: checkpoint_transaction did not reset runs.takeovers, although the README says
# "a new checkpoint starts the count again" (checkpoint/checkpoint_steps do reset it).
# Sequence, with max_takeovers = 1: start r; claim r as worker w (not registered, so not
# alive); let its lease expire; claim r again (takeovers = 1); begin_transaction_step +
# checkpoint_transaction + commit (progress); let the lease expire; dead_letter_stalled_runs()
# dead-lettered r as PoisonRun, while a run that made the same progress through an ordinary
# checkpoint was left to the next worker. (Resetting the count inside the step's transaction
# livelocks a REPEATABLE READ step, so the worker restarts it after the commit.)
def test_a_transactional_checkpoint_is_progress_for_the_poison_count(
    dsn: str, accounts: psycopg.Connection[Any]
) -> None:
    db = accounts
    db.execute("update flowly.settings set max_takeovers = 1")
    for run_id in ("tx", "plain"):
        db.execute("select flowly.start('tsa_gather', run_id => %s)", (run_id,))
    claim_as(db, "tsa_gather")
    db.execute("update flowly.runs set locked_until = now() - interval '1 s'")
    epochs = claim_as(db, "tsa_gather")  # taken over from a worker that is not alive
    assert scalar(db, "select min(takeovers) from flowly.runs") == 1
    db.execute("select flowly.checkpoint('plain', %s, 'plain', '1'::jsonb)", (epochs["plain"],))
    step = _open_step(dsn, "tx", epochs["tx"])
    try:
        _checkpoint_step(step, "tx", epochs["tx"])
    finally:
        step.close()
    assert checkpointed(db, "tx", "move") == checkpointed(db, "plain", "plain") == 1
    db.execute("update flowly.runs set locked_until = now() - interval '1 s'")
    db.execute("select flowly.dead_letter_stalled_runs()")
    status = dict(db.execute("select id, status from flowly.runs").fetchall())
    assert status["plain"] == "running"  # the control: progress reset its count
    assert status["tx"] == "running", (
        "a run whose transactional step checkpointed since its last takeover was dead-lettered"
        f" as a poison run: {scalar(db, 'select error from flowly.runs where id = %s', 'tx')}")


def test_a_worker_restarts_the_takeover_count_after_a_transactional_checkpoint(
    dsn: str, client: flowly.Client, accounts: psycopg.Connection[Any]
) -> None:
    """The same through a real worker: it takes over a transfer from a worker that died, and
    once the transactional debit has committed, the count is 0 again, long before the next
    ordinary step (a 4 s pause) could restart it."""
    db = accounts
    run_id = client.start("transfer", {"from": "a", "to": "b", "amount": 1, "pause": 4})
    claim_as(db, "transfer")  # held by worker w, which is not alive
    db.execute("update flowly.runs set locked_until = now() - interval '1 s' where id = %s",
               (run_id,))
    with worker_process(dsn, "--lease", "2", *APP):
        wait_for(lambda: checkpointed(db, run_id, "debit"), what="the debit")
        assert scalar(db, "select started_at is not null from flowly.runs where id = %s", run_id)
        wait_for(lambda: scalar(db, "select takeovers from flowly.runs where id = %s",
                                run_id) == 0, timeout=2.5,
                 what="the takeover count restarted after the transactional checkpoint")
        assert checkpointed(db, run_id, "pause") == 0, "the pause ended first: no proof"
        assert client.wait(run_id, timeout=30).status == "completed"


def test_a_cancel_waits_for_the_open_step_and_the_step_never_commits_after_it(
    dsn: str, accounts: psycopg.Connection[Any]
) -> None:
    """A cancel arriving while the step is open waits for it (FOR UPDATE) within its 5 s lock
    timeout, then ends the run: the step commits before the cancel or not at all, and after
    the cancel its epoch is refused."""
    db = accounts
    db.execute("select flowly.start('tsa_gather', run_id => 'r')")
    epoch = claim_as(db, "tsa_gather")["r"]
    step = _open_step(dsn, "r", epoch)
    try:
        thread, outcome = in_thread(lambda: db.execute("select flowly.cancel('r')").fetchone())
        time.sleep(0.5)
        assert thread.is_alive(), f"the cancel did not wait for the open step: {outcome}"
        _checkpoint_step(step, "r", epoch)
        thread.join(10)
        assert outcome.get("result") == ("cancelled",), outcome
        assert outcome["took"] < 5.5
    finally:
        step.close()
    assert logged(db, "r", "move") == checkpointed(db, "r", "move") == 1
    late = _open_step_or_refused(dsn, "r", epoch)
    assert late == "refused"
    assert logged(db, "r", "move") == 1 and balances(db)["a"] == 999


# Before 0026 took clock_timestamp(): cancel stamped the run's finished_at with now(), the
# start of its transaction, before it waits (up to its 5 s lock timeout) for the key-share
# lock of an open transactional step.
# Sequence: claim r; open r's step (begin_transaction_step, user SQL); flowly.cancel('r') in
# another session (it waits); 0.5 s later the step writes checkpoint_transaction and commits;
# the cancel then ends r. r.finished_at is ~0.5 s *earlier* than the finished_at of step
# 'move', which committed before the cancel took effect: the history says a step finished
# after its run ended (the same transaction-start stamp 0027 removed from send_event's
# sent_at). Expected: finished_at no earlier than the commit of anything the run recorded,
# i.e. clock_timestamp() once the cancel holds its locks.
def test_a_cancel_that_waited_for_a_step_is_not_stamped_before_the_step_finished(
    dsn: str, accounts: psycopg.Connection[Any]
) -> None:
    db = accounts
    db.execute("select flowly.start('tsa_gather', run_id => 'r')")
    epoch = claim_as(db, "tsa_gather")["r"]
    step = _open_step(dsn, "r", epoch)
    try:
        thread, outcome = in_thread(lambda: db.execute("select flowly.cancel('r')").fetchone())
        time.sleep(0.5)
        assert thread.is_alive()
        _checkpoint_step(step, "r", epoch)
        thread.join(10)
        assert outcome.get("result") == ("cancelled",), outcome
    finally:
        step.close()
    assert checkpointed(db, "r", "move") == 1
    assert_nothing_committed_after_the_end(db, "r")


def _open_step_or_refused(dsn: str, run_id: str, epoch: int) -> str:
    try:
        conn = _open_step(dsn, run_id, epoch)
    except flowly.LeaseLost:
        return "refused"
    conn.close()
    return "opened"


# -- in-process workers ---------------------------------------------------------------------------

@pytest.mark.parametrize(("extras", "asynchronous", "isolation"), [
    (["step", "child", "sleep"], False, None),
    (["step", "child", "sleep"], True, "repeatable read"),
    (["step", "child", "event"], False, "serializable"),
], ids=["sleep-sync-rc", "sleep-async-rr", "event-sync-serializable"])
def test_a_transactional_step_beside_steps_sleeps_children_and_waits_commits_once(
    dsn: str, client: flowly.Client, accounts: psycopg.Connection[Any], extras: list[str],
    asynchronous: bool, isolation: str | None,
) -> None:
    """asyncio.gather of a transactional step holding its transaction 2 s with an ordinary
    step, a child start and a sleep (which releases the run under the open step) or a wait
    for an event (sent while the step is open, without waiting on it)."""
    db = accounts
    run_id = client.start("tsa_gather", {"hold": 2.0, "extras": extras, "async": asynchronous,
                                         "isolation": isolation})
    with running_worker(dsn, workflows=["tsa_gather", "tsa_child"], lease=2):
        wait_for(lambda: entered(db, run_id, "move"), what="the step's transaction open")
        if "event" in extras:
            _, took = timed(client.send_event, run_id, "go", {"n": 1})
            assert took < 0.9, f"send_event waited {took:.2f}s on the open step"
            assert logged(db, run_id, "move") == 0  # still open
        run = waited(client, db, run_id)
        child = waited(client, db, f"{run_id}:tsa_child:1")
    assert run.status == "completed", run.error
    assert child.status == "completed"
    assert_effects_match_checkpoints(db, run_id, "move")
    assert logged(db, run_id, "move") == 1
    assert balances(db) == {"a": 999, "b": 1001}
    assert run.output["move"] == 999 and run.output["credit"] == 1001
    assert scalar(db, "select count(*) from flowly.runs where parent_run_id = %s", run_id) == 1
    if "event" in extras:
        assert run.output["rest"][-1] == {"n": 1}


def test_a_wait_for_run_and_an_event_do_not_wait_for_the_open_step(
    dsn: str, client: flowly.Client, accounts: psycopg.Connection[Any]
) -> None:
    """Another run waits for r while r's step holds its transaction 2 s: the waiter
    registers and parks at once (the key-share locks do not conflict), and is woken with r's
    output when r ends."""
    db = accounts
    target = client.start("tsa_gather", {"hold": 2.0, "extras": ["event"]})
    with running_worker(dsn, workflows=["tsa_gather", "tsa_waiter"], lease=2):
        wait_for(lambda: entered(db, target, "move"), what="the step's transaction open")
        started = time.monotonic()
        waiter = client.start("tsa_waiter", target)
        wait_for(lambda: scalar(db, "select status = 'pending' and scheduled_for > now()"
                                    " + interval '1 day' from flowly.runs where id = %s",
                                waiter),
                 timeout=5, what="the waiter parked")
        parked_after = time.monotonic() - started
        still_open = logged(db, target, "move") == 0
        _, sent_in = timed(client.send_event, target, "go", "now")
        assert still_open, "the step ended before the waiter parked: the test proved nothing"
        assert parked_after < 2.0, f"the waiter took {parked_after:.2f}s to park"
        assert sent_in < 0.9, f"send_event waited {sent_in:.2f}s on the open step"
        run = client.wait(target, timeout=20)
        waited = client.wait(waiter, timeout=20)
    assert run.status == "completed"
    assert waited.status == "completed" and waited.output == run.output
    assert logged(db, target, "move") == 1 and balances(db) == {"a": 999, "b": 1001}


def test_a_cancel_during_an_open_step_ends_the_run_without_a_late_commit(
    dsn: str, client: flowly.Client, accounts: psycopg.Connection[Any]
) -> None:
    db = accounts
    # held long enough that the cancel is sure to come while the step is open, also on a
    # loaded machine (held 1.5 s, the run had once completed before the cancel was sent)
    run_id = client.start("tsa_gather", {"hold": 3.0, "extras": ["step"]})
    with running_worker(dsn, workflows=["tsa_gather"], lease=2):
        wait_for(lambda: entered(db, run_id, "move"), what="the step's transaction open")
        status, took = timed(client.cancel, run_id)
        # "completed" when the cancel, waiting for the step's transaction, lost the row to
        # the run's next steps (a key share lock taken on a free row does not queue behind a
        # waiting FOR UPDATE): the run ended before the cancel, which reports that truly
        assert status in ("cancelled", "completed")
        assert took < 5.5
        at_the_end = (logged(db, run_id, "move"), balances(db), client.steps(run_id))
        time.sleep(1.0)  # whatever the worker still tries for it
        assert (logged(db, run_id, "move"), balances(db), client.steps(run_id)) == \
            at_the_end, "the run's steps or effects changed after it was cancelled"
    assert client.get(run_id).status == status
    assert_effects_match_checkpoints(db, run_id, "move")
    # 'credit' may have slipped in between the step's commit and the cancel's lock
    assert balances(db)["b"] == 1000 + checkpointed(db, run_id, "credit")
    assert balances(db)["a"] == 1000 - logged(db, run_id, "move")


def test_a_cancel_of_a_step_held_past_its_lock_timeout_reports_busy(
    dsn: str, client: flowly.Client, accounts: psycopg.Connection[Any]
) -> None:
    """A step holding its transaction past cancel's 5 s lock timeout: the cancel gives up
    (RunBusy) within its bound instead of hanging, and the run completes normally."""
    db = accounts
    run_id = client.start("tsa_gather", {"hold": 5.8, "server_side": True})
    with running_worker(dsn, workflows=["tsa_gather"], lease=2):
        wait_for(lambda: entered(db, run_id, "move"), what="the step's transaction open")
        started = time.monotonic()
        with pytest.raises(flowly.RunBusy):
            client.cancel(run_id)
        assert time.monotonic() - started < 5.8
        run = client.wait(run_id, timeout=20)
    assert run.status == "completed"
    assert logged(db, run_id, "move") == 1 and balances(db) == {"a": 999, "b": 1001}


def test_the_timeout_sweep_skips_an_open_step_and_ends_the_run_after_it(
    dsn: str, client: flowly.Client, accounts: psycopg.Connection[Any]
) -> None:
    """The run's timeout passes while its step is open: the sweep (every heartbeat) skips the
    run, the step commits, and the run ends, completed or dead-lettered for its timeout, with
    the step's effect and checkpoint together and nothing recorded after the end."""
    db = accounts
    with running_worker(dsn, workflows=["tsa_gather"], lease=1):
        run_id = client.start("tsa_gather", {"hold": 2.5, "extras": ["step"]}, timeout=1.0)
        wait_for(lambda: entered(db, run_id, "move"), what="the step's transaction open")
        time.sleep(1.2)
        assert scalar(db, "select timeout_at < now() from flowly.runs where id = %s", run_id)
        assert client.get(run_id).status == "running", "ended under its open step"
        run = client.wait(run_id, timeout=20)
        time.sleep(0.5)
    assert run.status in ("completed", "dead_letter"), run.status
    if run.status == "dead_letter":
        assert run.error["type"] == "Timeout"
    assert_effects_match_checkpoints(db, run_id, "move")
    assert_nothing_committed_after_the_end(db, run_id)
    assert logged(db, run_id, "move") == 1
    assert balances(db)["b"] == 1000 + checkpointed(db, run_id, "credit")


def test_a_purge_during_an_open_step_does_not_wait_or_touch_it(
    dsn: str, client: flowly.Client, accounts: psycopg.Connection[Any]
) -> None:
    db = accounts
    done = [client.start("tsa_child", f"old-{i}") for i in range(5)]
    with running_worker(dsn, workflows=["tsa_gather", "tsa_child"], lease=2):
        for run_id in done:
            assert client.wait(run_id, timeout=20).status == "completed"
        run_id = client.start("tsa_gather", {"hold": 3.0, "extras": ["child"]})
        wait_for(lambda: entered(db, run_id, "move"), what="the step's transaction open")
        purged, took = timed(client.purge, 0)
        assert took < 1.0
        assert purged >= 5
        assert logged(db, run_id, "move") == 0
        run = client.wait(run_id, timeout=20)
        client.purge(0)
    assert run.status == "completed"
    assert logged(db, run_id, "move") == 1 and balances(db) == {"a": 999, "b": 1001}


def test_a_transactional_compensation_runs_once_beside_a_failing_sibling(
    dsn: str, client: flowly.Client, accounts: psycopg.Connection[Any]
) -> None:
    db = accounts
    run_id = client.start("tsa_saga", {"hold": 0.5})
    with running_worker(dsn, workflows=["tsa_saga"], lease=2):
        run = client.wait(run_id, timeout=20)
    assert run.status == "dead_letter" and run.compensation_ok is True
    assert logged(db, run_id, "move") == 1 and logged(db, run_id, "undo") == 1
    assert balances(db)["a"] == 1000
    move = next(s for s in client.steps(run_id) if s.name == "move")
    assert (move.kind, move.compensation_status) == ("transaction", "completed")


# -- worker processes -----------------------------------------------------------------------------

def test_a_worker_killed_inside_a_transactional_compensation_undoes_once(
    dsn: str, client: flowly.Client, accounts: psycopg.Connection[Any]
) -> None:
    """SIGKILL while the compensation's transaction is open: nothing of it commits; the next
    worker runs it again and records it in the same transaction, so the undo lands once."""
    db = accounts
    run_id = client.start("tsa_saga", {"hold": 0.2, "undo_hold": 2})
    with worker_process(dsn, "--lease", "1", *APP) as first:
        wait_for(lambda: entered(db, run_id, "undo"), what="the compensation open")
        first.kill()
    assert logged(db, run_id, "undo") == 0
    with worker_process(dsn, "--lease", "1", *APP) as second:
        # the second undo holds its transaction 2 s too
        run = client.wait(run_id, timeout=30)
        second.stop()
    assert run.status == "dead_letter" and run.compensation_ok is True, run
    assert entered(db, run_id, "undo") == 2
    assert logged(db, run_id, "undo") == 1 and logged(db, run_id, "move") == 1
    assert balances(db)["a"] == 1000


def test_a_frozen_worker_inside_server_side_sql_cannot_commit_after_a_takeover(
    dsn: str, client: flowly.Client, accounts: psycopg.Connection[Any]
) -> None:
    """Worker A is SIGSTOPped while its async REPEATABLE READ step's SQL still runs on the
    server (pg_sleep), beside an ordinary step: no other worker takes the run while the
    statement runs; once A's session is ended B takes over and commits the step; A, thawed,
    commits nothing."""
    db = accounts
    run_id = client.start("tsa_gather", {"hold": 2.5, "server_side": True, "async": True,
                                         "isolation": "repeatable read", "extras": ["step"]})
    with worker_process(dsn, "--lease", "1", *APP) as frozen:
        wait_for(lambda: entered(db, run_id, "move"), what="A inside")
        frozen.signal(signal.SIGSTOP)
        with worker_process(dsn, "--lease", "1", *APP) as taker:
            time.sleep(1.5)  # A's lease expired; its statement still runs
            assert entered(db, run_id, "move") == 1, "taken over under the open step"
            run = client.wait(run_id, timeout=40)
            frozen.signal(signal.SIGCONT)
            time.sleep(2)
            taker.stop()
        frozen.stop()
    assert run.status == "completed"
    assert entered(db, run_id, "move") == 2
    assert logged(db, run_id, "move") == 1
    assert balances(db) == {"a": 999, "b": 1001}


def test_parallel_transactional_steps_stay_exact_while_workers_are_killed(
    dsn: str, client: flowly.Client, accounts: psycopg.Connection[Any]
) -> None:
    """Runs of three parallel transactional steps (read committed, repeatable read,
    serializable; sync and async) beside an ordinary step and a child start, while worker
    processes are SIGKILLed at random moments: each step's effect lands exactly once."""
    db = accounts
    n = 20
    runs = [f"f-{i}" for i in range(n)]
    for run_id in runs:
        for step in ("m1", "m2", "m3"):
            db.execute("insert into public.accounts values (%s, 0)", (f"{run_id}:{step}",))
        client.start("tsa_fanout", {"pause": 0.05}, run_id=run_id)
    def all_completed() -> bool:
        return bool(scalar(db, "select count(*) = %s from flowly.runs"
                               " where status = 'completed' and workflow = 'tsa_fanout'", n))

    chance = random.Random(20261201)
    for _ in range(4):
        kill_at_work(dsn, db, "--lease", "1", "--concurrency", "8", *APP,
                     pause=chance.uniform(0.0, 0.7), done=all_completed)
    with worker_process(dsn, "--lease", "1", "--concurrency", "16", *APP):
        wait_for(all_completed, timeout=60, what="every run completed")
    final = balances(db)
    for run_id in runs:
        assert_effects_match_checkpoints(db, run_id, "m1", "m2", "m3")
        for step in ("m1", "m2", "m3"):
            assert final[f"{run_id}:{step}"] == 1, (run_id, step, final[f"{run_id}:{step}"])
        assert client.get(run_id).output[:3] == [1, 1, None]
    assert scalar(db, "select count(*) from public.tsa_log") == 3 * n
    # the kills interrupted runs (else the test proved nothing)
    assert scalar(db, "select count(*) from flowly.runs where workflow = 'tsa_fanout'"
                      " and lease_epoch > 1") > 0
    assert scalar(db, "select count(*) from flowly.runs where workflow = 'tsa_child'") == n


def test_a_worker_stopped_inside_server_side_sql_rolls_the_step_back_and_hands_it_on(
    dsn: str, client: flowly.Client, accounts: psycopg.Connection[Any]
) -> None:
    """SIGTERM while a sync step's SQL runs on the server (pg_sleep 20 s): the worker cancels
    the statement, so the transaction rolls back, and exits within its drain bound; the next
    worker runs the step again, and its effect lands once."""
    db = accounts
    run_id = client.start("tsa_gather", {"hold": 20, "server_side": True, "extras": ["step"]})
    with worker_process(dsn, "--lease", "2", "--drain-timeout", "1", *APP) as first:
        wait_for(lambda: entered(db, run_id, "move"), what="the step's SQL running")
        time.sleep(0.3)
        started = time.monotonic()
        first.stop(timeout=15)
        stopped_in = time.monotonic() - started
    assert stopped_in < 8, f"the worker took {stopped_in:.1f}s to stop"
    assert logged(db, run_id, "move") == 0 and balances(db)["a"] == 1000
    wait_for(lambda: not scalar(
        db, "select count(*) from pg_stat_activity where datname = current_database()"
            " and query like '%%pg_sleep%%' and pid <> pg_backend_pid()"),
        timeout=5, what="the step's statement gone")
    db.execute("update flowly.runs set input = jsonb_set(input, '{hold}', '0.2')"
               " where id = %s", (run_id,))
    with worker_process(dsn, "--lease", "2", *APP):
        run = client.wait(run_id, timeout=20)
    assert run.status == "completed"
    assert entered(db, run_id, "move") == 2
    assert logged(db, run_id, "move") == 1 and balances(db) == {"a": 999, "b": 1001}
