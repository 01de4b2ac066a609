"""Attacks on 0024's row-lock modes: a wake-up is never lost, and no engine call deadlocks or
waits on a lock on a worker's path.

A run that waits (p) registers its waits (wait_for_run, wait_for_event) and parks; what it
waits for ends (complete_runs, fail_step, fail_run, finish_compensation, the timeout sweep,
cancel of the target or of its parent, purge, retry_dead_letter) or an event is sent to it.
Each pair is driven by hand with transactions held open at chosen points, in both orders; a
call that reports the run busy (WF005) is made again after the other side commits, as a
worker does. Then the invariant: after all commits and `flowly.wake_missed_waiters()`, no run
stays parked while one of its waits is satisfied. A randomized, seeded stress test does the
same with many runs and threads.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from tests.support import claim_as, lost_wakeups, scalar

BUSY = "WF005"
NOT_FOUND = "WF002"

def _state(db: psycopg.Connection[Any], run: str) -> Any:
    return db.execute("select status, scheduled_for <= now(), scheduled_for from flowly.runs"
                      " where id = %s", (run,)).fetchone()


class Waiter:
    """The worker's calls for a run that waits: register every wait, then park on those still
    waiting. Registration is idempotent (a recorded outcome is answered again), so a call
    that reports the run busy is answered by making the whole sequence again."""

    def __init__(self, run: str, epoch: int, waits: list[tuple[str, str, float | None]]):
        self.run, self.epoch, self.waits = run, epoch, waits
        self.outcomes: dict[str, str] = {}
        self.parked: str | None = None  # 'parked', 'due' or 'no park' once done

    @staticmethod
    def step(kind: str, target: str) -> str:
        return f"{kind}:{target}"

    def register(self, conn: psycopg.Connection[Any]) -> list[str]:
        """Registers every wait; the steps still waiting. Raises psycopg errors (WF005)."""
        waiting = []
        for kind, target, timeout in self.waits:
            step = self.step(kind, target)
            try:
                if kind == "run":
                    outcome = scalar(conn, "select outcome from flowly.wait_for_run(%s, %s, %s,"
                                           " %s)", self.run, self.epoch, step, target)
                else:
                    outcome = scalar(conn, "select outcome from flowly.wait_for_event(%s, %s,"
                                           " %s, %s, %s)", self.run, self.epoch, step, target,
                                     timeout)
            except psycopg.Error as exc:
                if exc.sqlstate != NOT_FOUND:
                    raise
                outcome = "gone"  # RunNotFound in the body: not a wait any more
                if not conn.autocommit:
                    raise
            self.outcomes[step] = outcome
            if outcome == "waiting":
                waiting.append(step)
        return waiting

    def park(self, conn: psycopg.Connection[Any], steps: list[str]) -> None:
        if not steps:
            self.parked = "no park"
            return
        due = scalar(conn, "select flowly.park(%s, %s, %s)", self.run, self.epoch, steps)
        self.parked = "parked" if due is None else "due"

    def advance(self, conn: psycopg.Connection[Any], park: bool = True) -> bool:
        """The whole sequence on an autocommit connection; False if the run was busy."""
        assert conn.autocommit
        try:
            waiting = self.register(conn)
            if park:
                self.park(conn, waiting)
        except psycopg.Error as exc:
            if exc.sqlstate == BUSY:
                return False
            raise
        return True


# --------------------------------------------------------------------------------------------
# the pairs: a waiter against each write that may satisfy its wait, in both orders

_TARGET_ENDINGS = ("complete_runs", "fail_step", "fail_run", "finish_compensation", "timeout",
                   "cancel", "cancel_parent", "purge", "retry_dead_letter", "send_event")
# the endings a worker makes: they must never wait for a lock
_WORKER_PATH = {"complete_runs", "fail_step", "fail_run", "finish_compensation", "timeout",
                "purge"}


class Pair:
    """Run g ('grand'), its child c ('child', the target), and p ('parent', the waiter),
    claimed as a worker would; c prepared for the ending under test."""

    def __init__(self, db: psycopg.Connection[Any], ending: str, phase: str) -> None:
        self.db, self.ending = db, ending
        db.execute("select flowly.start('grand', run_id => 'g')")
        db.execute("select flowly.start('child', run_id => 'c', parent_run_id => 'g')")
        db.execute("select flowly.start('parent', run_id => 'p')")
        self.p_epoch = claim_as(db, "parent")["p"]
        self.c_epoch = claim_as(db, "child")["c"]
        waits: list[tuple[str, str, float | None]] = (
            [("event", "go", None)] if ending == "send_event" else [("run", "c", None)])
        self.waiter = Waiter("p", self.p_epoch, waits)
        if phase == "park":  # the wait registered (and committed) before the race
            assert self.waiter.advance(db, park=False)
        if ending == "finish_compensation":
            db.execute("select flowly.checkpoint('c', %s, 'a', '1', now(), true)",
                       (self.c_epoch,))
            assert scalar(db, "select decision from flowly.fail_run('c', %s, '{}', false)",
                          self.c_epoch) == "compensate"
            db.execute("select flowly.record_compensation('c', %s, 'a')", (self.c_epoch,))
        elif ending == "timeout":
            db.execute("update flowly.runs set timeout_at = now() - interval '1 second'"
                       " where id = 'c'")
        elif ending == "purge":
            db.execute("select flowly.complete('c', %s, '42')", (self.c_epoch,))
        elif ending == "retry_dead_letter":
            assert scalar(db, "select decision from flowly.fail_run('c', %s, '{}', false)",
                          self.c_epoch) == "dead_letter"

    def end(self, conn: psycopg.Connection[Any]) -> bool:
        """The write under test, once; False if it found its run busy (to be made again)."""
        e, ep = self.ending, self.c_epoch
        try:
            if e == "complete_runs":
                busy = scalar(conn, "select busy from flowly.complete_runs(array['c'],"
                                    " array[%s::bigint], array['1'::jsonb])", ep)
                return not busy
            if e == "fail_step":
                conn.execute("select flowly.fail_step('c', %s, 'a', '{}', now(), 1, 'fixed',"
                             " 1, 1)", (ep,))
            elif e == "fail_run":
                conn.execute("select flowly.fail_run('c', %s, '{}', false)", (ep,))
            elif e == "finish_compensation":
                conn.execute("select flowly.finish_compensation('c', %s)", (ep,))
            elif e == "timeout":
                conn.execute("select flowly.dead_letter_stalled_runs()")
                return scalar(conn, "select status from flowly.runs where id = 'c'") != "running"
            elif e == "cancel":
                conn.execute("select flowly.cancel('c')")
            elif e == "cancel_parent":
                conn.execute("select flowly.cancel('g')")
            elif e == "purge":
                conn.execute("select flowly.purge('0 seconds')")
            elif e == "retry_dead_letter":
                conn.execute("select flowly.retry_dead_letter('c')")
            elif e == "send_event":
                conn.execute("select flowly.send_event('p', 'go', '7')")
            else:
                raise AssertionError(e)
        except psycopg.Error as exc:
            if exc.sqlstate == BUSY:
                if not conn.autocommit:
                    conn.rollback()
                return False
            raise
        return True

    def settle(self) -> None:
        """The invariant, then: end the target if it is still unfinished (a retry made it
        pending again), and check the waiter wakes and gets its outcome."""
        db = self.db
        lost = lost_wakeups(db)
        assert not lost, (f"{self.ending}: parked with a satisfied wait: {lost};"
                          f" p is {_state(db, 'p')}, c is {_state(db, 'c')}")
        if self.ending != "send_event":
            status = scalar(db, "select status from flowly.runs where id = 'c'")
            if status == "pending":
                epoch = claim_as(db, "child")["c"]
                db.execute("select flowly.complete('c', %s, '1')", (epoch,))
            elif status == "running":
                db.execute("select flowly.complete('c', %s, '1')",
                           (scalar(db, "select lease_epoch from flowly.runs where id = 'c'"),))
            elif status == "compensating":
                db.execute("select flowly.finish_compensation('c', %s)",
                           (scalar(db, "select lease_epoch from flowly.runs where id = 'c'"),))
        assert not lost_wakeups(db)
        status, due, _ = _state(db, "p")
        if self.waiter.parked in (None, "no park"):
            # the outcome was recorded (or the target is gone): the run goes on, not parked
            assert status == "running", f"p is {status} with outcomes {self.waiter.outcomes}"
            assert "waiting" not in self.waiter.outcomes.values()
            return
        assert (status, due) == ("pending", True), (
            f"{self.ending}: p parked and never woken: {_state(db, 'p')}")
        # the worker that claims p gets the outcome instead of parking again
        epoch = claim_as(db, "parent")["p"]
        again = Waiter("p", epoch, self.waiter.waits)
        assert again.advance(db, park=False)
        assert "waiting" not in again.outcomes.values(), again.outcomes


def _advance_until_done(pair: Pair, db: psycopg.Connection[Any], park: bool = True) -> None:
    for _ in range(20):
        if pair.waiter.advance(db, park=park):
            return
        time.sleep(0.05)
    raise AssertionError(f"p still busy after every write committed: {pair.waiter.outcomes}")


@pytest.mark.parametrize("phase", ["register", "park"])
@pytest.mark.parametrize("ending", _TARGET_ENDINGS)
def test_an_ending_in_flight_while_the_waiter_registers_or_parks(
    dsn: str, db: psycopg.Connection[Any], ending: str, phase: str
) -> None:
    """The write that ends the target (or sends the event) is made in a transaction left
    open; the waiter then registers and parks (phase register) or only parks (phase park, its
    wait registered before); the write commits; the waiter asks again if it was busy."""
    pair = Pair(db, ending, phase)
    with psycopg.connect(dsn) as ender:
        assert pair.end(ender), f"{ending} found its run busy with nothing else in flight"
        # busy (WF005) or not: both are fine while the write is open
        if phase == "park":  # the worker parks on what it registered earlier
            try:
                pair.waiter.park(db, [Waiter.step(k, t) for k, t, _ in pair.waiter.waits
                                      if pair.waiter.outcomes.get(Waiter.step(k, t))
                                      == "waiting"])
            except psycopg.Error as exc:
                assert exc.sqlstate == BUSY, f"{exc.sqlstate} {exc}"
        else:
            pair.waiter.advance(db)
        ender.commit()
    if pair.waiter.parked is None:
        _advance_until_done(pair, db)
    pair.settle()


@pytest.mark.parametrize("phase", ["register", "park", "both"])
@pytest.mark.parametrize("ending", _TARGET_ENDINGS)
def test_an_ending_made_while_the_waiter_s_transaction_is_open(
    dsn: str, db: psycopg.Connection[Any], ending: str, phase: str
) -> None:
    """The other order: the waiter's transaction registers (register), parks (park) or does
    both (both) and stays open; the write is made meanwhile from another session, as its
    worker or operator would, and made again after the waiter commits if it found its run
    busy. A worker's write must not wait for the waiter's locks; an operator's may."""
    pair = Pair(db, ending, "park" if phase == "park" else "register")
    committed = threading.Event()
    report: dict[str, Any] = {"attempts": [], "error": None}

    def ender() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("set lock_timeout = '2s'")  # as a worker's sessions have it
                for _ in range(40):
                    started, open_then = time.monotonic(), not committed.is_set()
                    done = pair.end(conn)
                    report["attempts"].append((done, time.monotonic() - started, open_then))
                    if done:
                        return
                    committed.wait(10)
                    time.sleep(0.05)
        except BaseException as exc:
            report["error"] = exc

    with psycopg.connect(dsn) as waiting:
        steps = pair.waiter.register(waiting) if phase != "park" else [
            Waiter.step(k, t) for k, t, _ in pair.waiter.waits]
        if phase != "register":
            pair.waiter.park(waiting, steps)
        thread = threading.Thread(target=ender, daemon=True)
        thread.start()
        time.sleep(0.3)
        waiting.commit()
    committed.set()
    thread.join(15)
    assert not thread.is_alive(), f"{ending} still running: {report}"
    error = report["error"]
    assert error is None, f"{ending}: {getattr(error, 'sqlstate', None)} {error}"
    assert report["attempts"][-1][0], f"{ending} never went through: {report}"
    if ending in _WORKER_PATH:
        # (went through, seconds, the waiter's transaction open when it began): only a call
        # begun while it was open can have waited for its locks (and ends at its commit)
        assert report["attempts"][0][2], f"{ending} was first made after the commit: {report}"
        slow = [a for a in report["attempts"] if a[2] and a[1] > 0.25]
        assert not slow, f"{ending} waited for the waiter's locks: {report['attempts']}"
    if pair.waiter.parked is None:
        _advance_until_done(pair, db)
    pair.settle()


# --------------------------------------------------------------------------------------------
# a write that does not end the target, then one that does, in one transaction of its worker

_NON_ENDING = {
    "checkpoint": "select flowly.checkpoint('c', %(epoch)s, 'a', '1')",
    "heartbeat": "select flowly.heartbeat('w', array['c'], array[%(epoch)s::bigint], '1 hour')",
    "start of a grandchild": "select flowly.start('leaf', parent_run_id => 'c',"
                             " parent_lease_epoch => %(epoch)s)",
    "compensable checkpoint": "select flowly.checkpoint('c', %(epoch)s, 'a', '1', now(), true)",
}


@pytest.mark.parametrize("waiter_open", [False, True])
@pytest.mark.parametrize("write", sorted(_NON_ENDING))
def test_a_worker_that_writes_then_ends_its_run_in_one_transaction_wakes_the_waiter(
    dsn: str, db: psycopg.Connection[Any], write: str, waiter_open: bool
) -> None:
    """c's worker holds c FOR NO KEY UPDATE (a checkpoint, ...), which a wait does not
    conflict with, so p registers and parks meanwhile (committed, or still open with
    waiter_open). The same transaction of c's worker then completes c (upgrading its lock):
    p must be due once everything committed, whichever way the upgrade went."""
    pair = Pair(db, "complete_runs", "register")
    with psycopg.connect(dsn) as worker, psycopg.connect(dsn) as waiting:
        worker.execute(_NON_ENDING[write], {"epoch": pair.c_epoch})
        steps = pair.waiter.register(waiting)
        pair.waiter.park(waiting, steps)
        assert pair.waiter.parked == "parked"
        if not waiter_open:
            waiting.commit()
        done = pair.end(worker)
        if waiter_open:
            assert not done, "c completed while p's park, which holds c, was in flight"
            worker.commit()
            waiting.commit()
            assert pair.end(worker)
        worker.commit()
    pair.settle()


# --------------------------------------------------------------------------------------------
# defects


def test_cancels_of_a_run_and_of_its_parent_do_not_deadlock(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """Two cancels of nested families: the family of the grandparent includes the run and
    its children. Ids: g (grandparent), m (its child), a (m's child; 'a' < 'm').

    Before 0024's cancel: a 40P01 deadlock between two cancels. The interleaving:
      1. m's worker holds m's row in an open transaction (a checkpoint of m);
      2. operator A: `select flowly.cancel('m')` waits for m's row (lock_run_for_operator);
      3. operator B: `select flowly.cancel('g')` locks g, then in id order a, then waits for
         m behind A;
      4. m's worker commits: A gets m, then wants a (held by B); B waits for m (held by A):
         deadlock detected, one cancel fails with 40P01 instead of cancelling or reporting
         WF005. cancel locked the run it was given before the rest, in id order; it now locks
         them all in id order."""
    db.execute("select flowly.start('grand', run_id => 'g')")
    db.execute("select flowly.start('child', run_id => 'm', parent_run_id => 'g')")
    db.execute("select flowly.start('leaf', run_id => 'a', parent_run_id => 'm')")
    m_epoch = claim_as(db, "child")["m"]
    results: dict[str, Any] = {}

    def cancel(run: str) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            try:
                results[run] = scalar(conn, "select flowly.cancel(%s)", run)
            except psycopg.Error as exc:
                results[run] = exc.sqlstate

    with psycopg.connect(dsn) as worker:
        worker.execute("select flowly.checkpoint('m', %s, 's', '1')", (m_epoch,))
        first = threading.Thread(target=cancel, args=("m",), daemon=True)
        first.start()
        time.sleep(0.3)
        second = threading.Thread(target=cancel, args=("g",), daemon=True)
        second.start()
        time.sleep(0.3)
        worker.commit()
    first.join(15)
    second.join(15)
    assert "40P01" not in results.values(), f"cancels deadlocked: {results}"
    assert set(results.values()) <= {"cancelled", BUSY}, results


def test_a_completion_does_not_wait_for_another_transaction_s_missed_wake_up(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """p waits for t1 and t2 and is parked. An operator holds p's row (an open cancel of p,
    rolled back later), and another operator's open transaction cancels t1: its wake-up of p
    finds p's row held and notes p in missed_wakeups, uncommitted. t2's worker then completes
    t2: its wake-up of p also finds the row held and inserts p into missed_wakeups.

    Before 0025: that insert (`on conflict do nothing`) waited for the operator's transaction
    that inserted the same key, so the worker's complete_runs waited on a lock (here until its
    2 s lock_timeout: 55P03) although every engine call on a worker's path skips locked rows.
    Exact sequence: operator A `begin; select flowly.cancel('p')`; operator B
    `begin; select flowly.cancel('t1')`; worker `select * from flowly.complete_runs(
    array['t2'], ...)` blocks in wake_waiters' insert into missed_wakeups."""
    db.execute("select flowly.start('child', run_id => 't1')")
    db.execute("select flowly.start('child', run_id => 't2')")
    db.execute("select flowly.start('parent', run_id => 'p')")
    p_epoch = claim_as(db, "parent")["p"]
    epochs = claim_as(db, "child")
    waiter = Waiter("p", p_epoch, [("run", "t1", None), ("run", "t2", None)])
    assert waiter.advance(db) and waiter.parked == "parked"
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn) as operator, \
            psycopg.connect(dsn, autocommit=True) as worker:
        holder.execute("select flowly.cancel('p')")
        operator.execute("select flowly.cancel('t1')")
        worker.execute("set lock_timeout = '2s'")  # as the worker's sessions have it
        started = time.monotonic()
        try:
            worker.execute("select * from flowly.complete_runs(array['t2'], %s::bigint[],"
                           " array['1']::jsonb[])", ([epochs["t2"]],))
            error = None
        except psycopg.Error as exc:
            error = exc
        took = time.monotonic() - started
        operator.commit()
        holder.rollback()
    assert error is None and took < 1, (
        f"complete_runs of t2 waited {took:.1f}s for another transaction's missed wake-up:"
        f" {getattr(error, 'sqlstate', None)} {str(error).splitlines()[0] if error else ''}")
    assert not lost_wakeups(db)
    assert _state(db, "p")[:2] == ("pending", True)


def test_a_finish_during_wake_missed_waiters_is_not_settled_away(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """w waits for t1, an event and t2. t1 completes while an operator holds w's row: the
    wake-up is noted in missed_wakeups. The event then wakes w, whose worker records t1 and
    the event and parks on t2 alone: the noted wake-up is stale (0022). Now a worker's poll
    runs wake_missed_waiters (M) while t2's worker completes t2 (X).

    Before 0025: a lost wake-up. M locks w's row, decides with its statement's snapshot (t2 not
    finished yet) that w is not due, and deletes w's missed_wakeups row as settled. X commits
    t2's completion after M's snapshot; its wake-up finds w's row locked by M and inserts w
    into missed_wakeups `on conflict do nothing`: the row M is about to delete is still there,
    so nothing is inserted. M then deletes it: w stays parked until 9999-12-31 with t2
    completed, and no later wake_missed_waiters can see it. Exact sequence: M's statement
    takes its snapshot and locks w's row; X: complete_runs(t2) commits (its insert of w is a
    no-op); M deletes missed_wakeups(w), does not wake w, commits.
    Without help the window is the time M takes between locking w and deleting its row (it
    lost w in about 1 of 130 tries with 1,000 noted wake-ups); here a transaction holding
    w's missed_wakeups row (as M's delete would find it locked by any other transaction)
    keeps M inside that window while X runs."""
    for run in ("t1", "t2"):
        db.execute("select flowly.start('child', run_id => %s)", (run,))
    db.execute("select flowly.start('parent', run_id => 'w')")
    epochs = claim_as(db, "child")
    waits: list[tuple[str, str, float | None]] = [
        ("run", "t1", None), ("event", "poke", None), ("run", "t2", None)]
    waiter = Waiter("w", claim_as(db, "parent")["w"], waits)
    assert waiter.advance(db) and waiter.parked == "parked"
    with psycopg.connect(dsn) as operator:  # holds w while t1 completes: a missed wake-up
        operator.execute("select flowly.cancel('w')")
        db.execute("select flowly.complete('t1', %s, '1')", (epochs["t1"],))
        operator.rollback()
    assert scalar(db, "select count(*) from flowly.missed_wakeups where run_id = 'w'") == 1
    db.execute("select flowly.send_event('w', 'poke', '1')")  # wakes w otherwise
    waiter = Waiter("w", claim_as(db, "parent")["w"], waits)
    assert waiter.advance(db) and waiter.parked == "parked", waiter.outcomes
    assert waiter.outcomes == {"run:t1": "finished", "event:poke": "received",
                               "run:t2": "waiting"}
    report: dict[str, Any] = {}

    def poll() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            report["settled"] = scalar(conn, "select flowly.wake_missed_waiters()")

    with psycopg.connect(dsn) as holder, psycopg.connect(dsn, autocommit=True) as worker:
        holder.execute("select from flowly.missed_wakeups where run_id = 'w' for update")
        m = threading.Thread(target=poll, daemon=True)
        m.start()
        time.sleep(0.3)  # M has its snapshot and w's row, and waits to delete its entry
        worker.execute("set lock_timeout = '2s'")
        assert worker.execute("select run_id, lease_lost, busy from flowly.complete_runs("
                              "array['t2'], %s::bigint[], array['1']::jsonb[])",
                              ([epochs["t2"]],)).fetchall() == [("t2", False, False)]
        holder.rollback()
        m.join(10)
    assert scalar(db, "select status from flowly.runs where id = 't2'") == "completed"
    lost = lost_wakeups(db)
    assert not lost, (f"w parked with t2 completed: {_state(db, 'w')}, missed_wakeups"
                      f" {db.execute('select * from flowly.missed_wakeups').fetchall()}")


# --------------------------------------------------------------------------------------------
# randomized stress


class _Stress:
    """Shared state of the stress test: what went wrong, and when to stop."""

    def __init__(self, dsn: str, seed: int) -> None:
        self.dsn = dsn
        self.rng = random.Random(seed)
        self.errors: list[str] = []
        self.slow: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.counts: dict[str | None, int] = {}

    def note(self, what: str, exc: BaseException) -> None:
        with self.lock:
            self.errors.append(f"{what}: {getattr(exc, 'sqlstate', None)}"
                               f" {str(exc).splitlines()[0] if str(exc) else exc!r}")

    def timed(self, what: str, conn: psycopg.Connection[Any], query: str,
              params: Any = None, limit: float = 1.0) -> Any:
        started = time.monotonic()
        try:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else None
        finally:
            took = time.monotonic() - started
            if took > limit:
                with self.lock:
                    self.slow.append(f"{what} took {took:.2f}s")


def _stress_thread(stress: _Stress, name: str, body: Callable[[random.Random], None],
                   seed: int) -> threading.Thread:
    def run() -> None:
        try:
            body(random.Random(seed))
        except BaseException as exc:
            stress.note(name, exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("seed", [24, 1024])
def test_randomized_waiters_targets_and_events_lose_no_wake_up(
    dsn: str, db: psycopg.Connection[Any], seed: int
) -> None:
    """30 waiters each wait for 1-3 of 24 targets and/or an event (some with a timeout).
    Threads, each with its own connection, do concurrently what workers, operators and the
    application do: waiters register and park (sometimes in one transaction held open a few
    ms), targets end every way there is (completion batches, failed steps, failed bodies,
    finished compensations, timeouts, cancels of the target or its parent, sometimes after
    a checkpoint in the same transaction), dead-lettered targets are retried, events are sent
    in transactions held open, purge and wake_missed_waiters run all along. Every WF005 is
    made again. At the end every target is ended and every event sent; then no run may be
    parked with a satisfied wait, every waiter must be due or have its outcomes, and no call
    may have deadlocked or (on a worker's path) waited for a lock."""
    stress = _Stress(dsn, seed)
    rng = stress.rng
    parents = [f"g{i}" for i in range(6)]
    targets = [f"t{i:02d}" for i in range(24)]
    waiters = [f"w{i:02d}" for i in range(30)]
    for g in parents:
        db.execute("select flowly.start('grand', run_id => %s)", (g,))
    endings = ["complete_runs", "fail_step", "fail_run", "finish_compensation", "timeout",
               "cancel", "cancel_parent"]
    plan: dict[str, str] = {}
    parent_of: dict[str, str | None] = {}
    for t in targets:
        plan[t] = rng.choice(endings)
        parent = rng.choice(parents) if plan[t] == "cancel_parent" or rng.random() < 0.3 \
            else None
        if plan[t] == "cancel_parent" and parent is None:
            parent = parents[0]
        parent_of[t] = parent
        db.execute("select flowly.start('child', run_id => %s, parent_run_id => %s,"
                   " timeout => %s::interval)",
                   (t, parent, f"{rng.uniform(0.5, 3):.2f} seconds"
                    if plan[t] == "timeout" else None))
    for w in waiters:
        db.execute("select flowly.start('parent', run_id => %s)", (w,))
    t_epochs = claim_as(db, "child", limit=100)
    w_epochs = claim_as(db, "parent", limit=100)
    assert len(t_epochs) == len(targets) and len(w_epochs) == len(waiters)
    waits: dict[str, list[tuple[str, str, float | None]]] = {}
    for w in waiters:
        chosen: list[tuple[str, str, float | None]] = [
            ("run", t, None) for t in rng.sample(targets, rng.randint(0, 3))]
        if not chosen or rng.random() < 0.4:
            chosen.append(("event", "go", rng.choice([None, None, round(rng.uniform(1, 4),
                                                                           2)])))
        waits[w] = chosen
    for t in targets:
        if plan[t] == "finish_compensation":
            db.execute("select flowly.checkpoint(%s, %s, 'a', '1', now(), true)",
                       (t, t_epochs[t]))
            db.execute("select flowly.fail_run(%s, %s, '{}', false)", (t, t_epochs[t]))
            db.execute("select flowly.record_compensation(%s, %s, 'a')", (t, t_epochs[t]))
    done_waiters: set[str] = set()
    ended: set[str] = set()

    def worker_of_waiters(share: list[str], me: str) -> Callable[[random.Random], None]:
        def body(r: random.Random) -> None:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("set lock_timeout = '2s'")
                todo = [(w, w_epochs[w]) for w in share]
                r.shuffle(todo)
                while not stress.stop.is_set():
                    if not todo:  # the runs woken meanwhile: claimed again, asked again
                        rows = stress.timed("claim", conn, "select run_id, lease_epoch from"
                                            " flowly.claim(%s, array['parent'],"
                                            " array['default'], 3, '1 hour')", (me,))
                        todo = [(w, e) for w, e in rows or []]
                        if not todo:
                            time.sleep(0.02)
                        continue
                    w, epoch = todo.pop(0)
                    waiter = Waiter(w, epoch, waits[w])
                    time.sleep(r.uniform(0, 0.05))
                    if r.random() < 0.5:
                        ok = waiter.advance(conn)
                    else:  # register and park in one transaction held open a little
                        conn.autocommit = False
                        try:
                            waiter.park(conn, waiter.register(conn))
                            time.sleep(r.uniform(0, 0.03))
                            conn.commit()
                            ok = True
                        except psycopg.Error as exc:
                            conn.rollback()
                            if exc.sqlstate not in (BUSY, NOT_FOUND):
                                raise
                            ok = False
                        finally:
                            conn.autocommit = True
                    outcome = waiter.parked if ok else "waiter busy"
                    with stress.lock:
                        stress.counts[outcome] = stress.counts.get(outcome, 0) + 1
                        if ok:
                            done_waiters.add(w)
                    if not ok:
                        todo.append((w, epoch))
        return body

    def ender_of_targets(share: list[str]) -> Callable[[random.Random], None]:
        def body(r: random.Random) -> None:
            with psycopg.connect(dsn) as conn:
                conn.execute("set lock_timeout = '2s'")
                conn.commit()
                todo = [t for t in share if plan[t] not in ("cancel", "cancel_parent",
                                                            "timeout")]
                r.shuffle(todo)
                while todo and not stress.stop.is_set():
                    t = todo.pop(0)
                    time.sleep(r.uniform(0, 0.08))
                    ep = t_epochs[t]
                    try:
                        if r.random() < 0.3 and plan[t] != "finish_compensation":
                            stress.timed("checkpoint", conn, "select flowly.checkpoint(%s, %s,"
                                         " 'pre', '1')", (t, ep))
                        kind = plan[t]
                        if kind == "complete_runs":
                            batch = [t, *[x for x in todo if plan[x] == "complete_runs"][:2]]
                            rows = stress.timed(kind, conn, "select run_id, busy from"
                                                " flowly.complete_runs(%s, %s::bigint[], %s)",
                                                (batch, [t_epochs[x] for x in batch],
                                                 ["1"] * len(batch)))
                            busy = {x for x, b in rows if b}
                            for x, _ in rows:
                                if x != t and x not in busy:
                                    todo.remove(x)
                            retry = [x for x in batch if x in busy]
                        else:
                            query = {
                                "fail_step": "select flowly.fail_step(%s, %s, 'a', '{}',"
                                             " now(), 1, 'fixed', 1, 1)",
                                "fail_run": "select flowly.fail_run(%s, %s, '{}', false)",
                                "finish_compensation": "select flowly.finish_compensation("
                                                       "%s, %s)",
                            }[kind]
                            stress.timed(kind, conn, query, (t, ep))
                            retry = []
                        time.sleep(r.uniform(0, 0.03))  # a group commit held open a little
                        conn.commit()
                        todo.extend(retry)
                    except psycopg.Error as exc:
                        conn.rollback()
                        if exc.sqlstate in ("WF001", NOT_FOUND):
                            continue  # ended meanwhile (its parent cancelled), maybe purged
                        if exc.sqlstate != BUSY:
                            raise
                        todo.append(t)
        return body

    def operator(r: random.Random) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            cancelled_parents = {str(parent_of[t]) for t in targets
                                 if plan[t] == "cancel_parent"}
            todo = [t for t in targets if plan[t] == "cancel"] + sorted(cancelled_parents)
            r.shuffle(todo)
            retried = 0
            give_up = time.monotonic() + 3
            while not stress.stop.is_set():
                time.sleep(r.uniform(0.02, 0.1))
                if todo:
                    run = todo.pop(0)
                    try:
                        conn.execute("select flowly.cancel(%s)", (run,))
                    except psycopg.Error as exc:
                        if exc.sqlstate == NOT_FOUND and parent_of.get(run) in cancelled_parents:
                            continue  # cancelled with its family first, and purged since
                        if exc.sqlstate != BUSY:
                            raise
                        todo.append(run)
                    continue
                dead = scalar(conn, "select id from flowly.runs where status = 'dead_letter'"
                                    " and workflow = 'child' order by random() limit 1")
                if dead is not None and retried < 4:
                    try:
                        conn.execute("select flowly.retry_dead_letter(%s)", (dead,))
                        retried += 1
                    except psycopg.Error as exc:
                        # busy, retried by now, or purged since (the sweeper purges all along)
                        if exc.sqlstate not in (BUSY, "WF004", NOT_FOUND):
                            raise
                    continue
                if retried >= 4 or time.monotonic() > give_up:
                    return

    def app(r: random.Random) -> None:
        with psycopg.connect(dsn) as conn:
            todo = [w for w in waiters if any(k == "event" for k, _, _ in waits[w])]
            r.shuffle(todo)
            for w in todo:
                if stress.stop.is_set():
                    return
                time.sleep(r.uniform(0, 0.15))
                conn.execute("select flowly.send_event(%s, 'go', '1')", (w,))
                time.sleep(r.uniform(0, 0.03))
                conn.commit()
                with stress.lock:
                    ended.add(w)

    def sweeper(r: random.Random) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("set lock_timeout = '2s'")
            while not stress.stop.is_set():
                stress.timed("sweep", conn, "select flowly.dead_letter_stalled_runs()")
                stress.timed("wake_missed_waiters", conn, "select flowly.wake_missed_waiters()")
                if r.random() < 0.3:
                    stress.timed("purge", conn, "select flowly.purge('0 seconds')")
                time.sleep(r.uniform(0.01, 0.05))

    share = [waiters[i::3] for i in range(3)]
    tshare = [targets[i::2] for i in range(2)]
    threads = [
        *[_stress_thread(stress, f"waiters{i}", worker_of_waiters(s, f"w{i}"), seed + i)
          for i, s in enumerate(share)],
        *[_stress_thread(stress, f"targets{i}", ender_of_targets(s), seed + 10 + i)
          for i, s in enumerate(tshare)],
        _stress_thread(stress, "operator", operator, seed + 20),
        _stress_thread(stress, "app", app, seed + 30),
        _stress_thread(stress, "sweeper", sweeper, seed + 40),
    ]
    deadline = time.monotonic() + 5
    for thread in threads:
        if thread.name.startswith(("targets", "operator", "app")):
            thread.join(max(0.1, deadline - time.monotonic()))
    time.sleep(1)  # the waiters woken last are claimed and asked again
    stress.stop.set()
    for thread in threads:
        thread.join(10)
    assert not [t.name for t in threads if t.is_alive()], "a stress thread hung"
    assert not stress.errors, stress.errors
    assert not stress.slow, f"calls on a worker's path waited for locks: {stress.slow}"
    assert done_waiters == set(waiters), f"never got through: {set(waiters) - done_waiters}"
    lost = lost_wakeups(db)
    assert not lost, f"parked with a satisfied wait: {lost}"
    # end every target still unfinished (retried, or not ended in time), send what is unsent
    for t in targets:
        status, epoch = db.execute("select status, lease_epoch from flowly.runs where id = %s",
                                   (t,)).fetchone() or (None, None)
        if status == "pending":
            db.execute("update flowly.runs set scheduled_for = now() where id = %s", (t,))
            epoch = claim_as(db, "child", limit=100).get(t, epoch)
            status = "running"
        if status == "running":
            db.execute("select flowly.complete(%s, %s, '1')", (t, epoch))
        elif status == "compensating":
            db.execute("select flowly.finish_compensation(%s, %s)", (t, epoch))
    for w in waiters:
        if any(k == "event" for k, _, _ in waits[w]) and w not in ended:
            db.execute("select flowly.send_event(%s, 'go', '1')", (w,))
    lost = lost_wakeups(db)
    assert not lost, f"parked with a satisfied wait: {lost}"
    stuck = db.execute("select id, scheduled_for from flowly.runs where workflow = 'parent'"
                       " and not (status = 'running' or scheduled_for <= now())"
                       " order by id").fetchall()
    assert not stuck, f"waiters parked after all they wait for happened: {stuck}"
