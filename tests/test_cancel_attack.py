"""Attacks on 0024's cancel: the run and its unfinished family (the runs it started, and
theirs) are locked for update in id order, the family is read again until stable, then the
unfinished ones are cancelled.

The guarantee attacked: once cancel returns 'cancelled' and commits, no descendant of the run
is pending, running or compensating, whatever the family's workers do at the same moment
(start children, claim, heartbeat, checkpoint, complete, fail, retry); two cancels of
overlapping families never deadlock (each returns or raises WF005); a cancel never makes a
worker's call wait on a lock; the leases of cancelled runs are fenced; and nothing outside the
family changes. Each interleaving is driven by hand, with transactions held open at chosen
points and threads for the calls that block.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

from tests.support import (
    claim_as,
    in_thread,
    scalar,
    sqlstate_of,
    unfinished_descendants,
    wait_for,
    waiting_on_lock,
)

LOST, NOT_FOUND, BUSY = "WF001", "WF002", "WF005"
UNFINISHED = ("pending", "running", "compensating")

def _status(db: psycopg.Connection[Any], run: str) -> str:
    return str(scalar(db, "select status from flowly.runs where id = %s", run))


def _epoch(db: psycopg.Connection[Any], run: str) -> int:
    return int(scalar(db, "select lease_epoch from flowly.runs where id = %s", run))


def _running(db: psycopg.Connection[Any], run: str, workflow: str | None = None,
             parent: tuple[str, int] | None = None) -> int:
    """Starts ``run`` (as a child of ``parent``, the way its running worker does, when given)
    with a workflow of its own, claims it; its lease epoch."""
    wf = workflow or f"wf_{run}"
    _start(db, run, wf, parent)
    epochs = claim_as(db, wf)
    return epochs[run]


def _start(db: psycopg.Connection[Any], run: str, workflow: str,
           parent: tuple[str, int] | None = None) -> Any:
    if parent is None:
        return scalar(db, "select flowly.start(%s, run_id => %s)", workflow, run)
    return scalar(db, "select flowly.start(%s, run_id => %s, parent_run_id => %s,"
                      " parent_lease_epoch => %s, parent_step => %s)",
                  workflow, run, parent[0], parent[1], f"start:{run}")


def _wait_blocked(db: psycopg.Connection[Any], like: str, count: int = 1) -> None:
    """Until ``count`` backends of this database whose query is like ``like`` wait on a lock."""
    wait_for(lambda: waiting_on_lock(db, like) >= count,
             timeout=10, what=f"{count} backend(s) running {like!r} to wait on a lock")


def _cancel_in_thread(dsn: str, run: str, *settings: str) -> tuple[threading.Thread,
                                                                    dict[str, Any]]:
    """cancel(run) on a connection of its own (autocommit), on a thread."""

    def call() -> Any:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for setting in settings:
                conn.execute(setting)
            return scalar(conn, "select flowly.cancel(%s)", run)

    return in_thread(call)


@contextmanager
def _session(dsn: str, autocommit: bool = False) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=autocommit) as conn:
        yield conn


def _world(db: psycopg.Connection[Any], family: list[str]) -> list[Any]:
    """Every row of every engine table that belongs to runs outside ``family``."""
    rows: list[Any] = list(db.execute(
        "select to_jsonb(r) from flowly.runs r where r.id <> all(%s) order by r.id",
        (family,)).fetchall())
    for table in ("steps", "step_attempts", "step_history", "timers", "waits", "events"):
        rows += db.execute(
            f"select to_jsonb(t)::text from flowly.{table} t where t.run_id <> all(%s)"
            " order by 1", (family,)).fetchall()
    return rows


# --- the family at rest ---------------------------------------------------------------------


def test_cancel_cancels_every_unfinished_descendant_and_nothing_else(
    db: psycopg.Connection[Any],
) -> None:
    p = _running(db, "p")
    c_run = _running(db, "c_run", parent=("p", p))
    _start(db, "c_pend", "wf_pend", ("p", p))
    c_done = _running(db, "c_done", parent=("p", p))
    db.execute("select flowly.complete_runs(array['c_done'], array[%s::bigint],"
               " array['1']::jsonb[])", (c_done,))
    c_dl = _running(db, "c_dl", parent=("p", p))
    assert scalar(db, "select decision from flowly.fail_run('c_dl', %s, '{}', false)",
                  c_dl) == "dead_letter"
    _start(db, "g1", "wf_g", ("c_run", c_run))  # grandchild under a running child
    # a grandchild under a finished child is still a descendant (started by a client that
    # names the parent)
    db.execute("select flowly.start('wf_g2', run_id => 'g2', parent_run_id => 'c_done')")
    # outsiders: a sibling tree, a run whose id sorts among the family's
    q = _running(db, "q")
    _start(db, "q_child", "wf_qc", ("q", q))
    _running(db, "c_out")
    db.execute("select flowly.checkpoint('c_out', %s, 's', '1')", (_epoch(db, "c_out"),))
    family = ["p", "c_run", "c_pend", "c_done", "c_dl", "g1", "g2"]
    before = _world(db, family)
    finished_before = db.execute("select id, to_jsonb(r) from flowly.runs r"
                                 " where id in ('c_done', 'c_dl')").fetchall()
    epochs_before = {r: _epoch(db, r) for r in family}

    assert scalar(db, "select flowly.cancel('p')") == "cancelled"

    assert unfinished_descendants(db, "p") == []
    for run in ("p", "c_run", "c_pend", "g1", "g2"):
        assert _status(db, run) == "cancelled", run
        assert _epoch(db, run) == epochs_before[run] + 1, run
        assert scalar(db, "select locked_by is null and finished_at is not null"
                          " from flowly.runs where id = %s", run)
    assert db.execute("select id, to_jsonb(r) from flowly.runs r"
                      " where id in ('c_done', 'c_dl')").fetchall() == finished_before
    assert _world(db, family) == before
    # a finished run answers its status, unchanged; an unknown one WF002
    assert scalar(db, "select flowly.cancel('p')") == "cancelled"
    assert scalar(db, "select flowly.cancel('c_dl')") == "dead_letter"
    assert sqlstate_of(db.execute, "select flowly.cancel('nope')") == NOT_FOUND


def test_a_deep_chain_and_a_wide_family_are_cancelled_in_a_few_seconds(
    db: psycopg.Connection[Any],
) -> None:
    # depth 50: each link started by its running parent
    parent = ("d0", _running(db, "d0"))
    for i in range(1, 51):
        parent = (f"d{i:02d}", _running(db, f"d{i:02d}", workflow="chain", parent=parent))
    # 2,000 children, inserted in bulk through start
    w = _running(db, "w")
    db.execute("select flowly.start('wide', run_id => 'w' || to_char(i, 'FM00000'),"
               " parent_run_id => 'w', parent_lease_epoch => %s) from generate_series(1, 2000) i",
               (w,))
    db.execute("analyze flowly.runs")
    started = time.monotonic()
    assert scalar(db, "select flowly.cancel('d0')") == "cancelled"
    took_chain = time.monotonic() - started
    started = time.monotonic()
    assert scalar(db, "select flowly.cancel('w')") == "cancelled"
    took_wide = time.monotonic() - started
    assert unfinished_descendants(db, "d0") == []
    assert unfinished_descendants(db, "w") == []
    assert scalar(db, "select count(*) from flowly.runs where status = 'cancelled'") == 51 + 2001
    assert took_chain < 3, f"cancel of a 50-deep chain took {took_chain:.1f}s"
    assert took_wide < 3, f"cancel of 2,000 children took {took_wide:.1f}s"


# --- children started around the cancel ----------------------------------------------------


def test_a_child_started_in_a_transaction_in_flight_during_the_family_read_is_cancelled(
    dsn: str, db: psycopg.Connection[Any],
) -> None:
    p = _running(db, "p")
    _start(db, "c0", "wf_c", ("p", p))
    with _session(dsn) as worker:
        _start(worker, "c1", "wf_c", ("p", p))  # holds p, c1 not yet visible
        thread, out = _cancel_in_thread(dsn, "p")
        _wait_blocked(db, "select flowly.cancel%")
        worker.commit()
    thread.join(10)
    assert out.get("result") == "cancelled", out
    assert unfinished_descendants(db, "p") == []
    assert _status(db, "c1") == "cancelled"


def test_a_child_started_after_cancel_locked_the_parent_is_refused_at_once_then_fenced(
    dsn: str, db: psycopg.Connection[Any],
) -> None:
    p = _running(db, "p")
    with _session(dsn) as operator, _session(dsn, autocommit=True) as worker:
        worker.execute("set lock_timeout = '2s'")
        assert scalar(operator, "select flowly.cancel('p')") == "cancelled"  # still open
        started = time.monotonic()
        state = sqlstate_of(_start, worker, "c1", "wf_c", ("p", p))
        took = time.monotonic() - started
        assert state == BUSY and took < 1, (state, took)
        operator.commit()
        assert sqlstate_of(_start, worker, "c1", "wf_c", ("p", p)) == LOST
    assert scalar(db, "select count(*) from flowly.runs where parent_run_id = 'p'") == 0


def test_a_repeatable_read_cancel_sees_a_child_started_while_it_waited(
    dsn: str, db: psycopg.Connection[Any],
) -> None:
    # Before 0026: cancel's "read the family again once locked" relies on each statement
    # taking a new snapshot, which only READ COMMITTED does. Called in a REPEATABLE READ transaction
    # (or with default_transaction_isolation = 'repeatable read', even from autocommit):
    #   1. the parent's worker runs flowly.start(child c1, parent p, epoch) in a transaction:
    #      p is locked FOR NO KEY UPDATE, c1 inserted, not committed;
    #   2. cancel('p') takes its snapshot, reads the family {p} (c1 invisible) and waits to
    #      lock p FOR UPDATE;
    #   3. the worker commits; cancel gets p (only locked, not updated: no 40001), reads the
    #      family again with the SAME snapshot -> {p} again, stable; cancels p alone and
    #      returns 'cancelled'.
    # c1 was left pending under a cancelled parent (a worker would claim and run it). Since
    # 0026 start writes a new version of p's row, and the cancel fails with 40001.
    p = _running(db, "p")
    with _session(dsn) as worker:
        _start(worker, "c1", "wf_c", ("p", p))
        thread, out = _cancel_in_thread(
            dsn, "p", "set default_transaction_isolation = 'repeatable read'")
        _wait_blocked(db, "select flowly.cancel%")
        worker.commit()
        thread.join(10)
    assert out.get("result") == "cancelled" or (
        "error" in out and out["error"].sqlstate == "40001"), out
    if out.get("result") == "cancelled":
        assert unfinished_descendants(db, "p") == [], (
            "cancel returned 'cancelled' under repeatable read but left a child unfinished")


# --- the family's workers writing at the same moment ------------------------------------------

_WRITES_IN_FLIGHT = {
    "claim": ("select flowly.claim('w2', array['wf_c'], array['default'], 10, '1 hour')",
              "cancelled"),
    "heartbeat": ("select flowly.heartbeat('w', array['c'], array[%(epoch)s::bigint],"
                  " '1 hour')", "cancelled"),
    "checkpoint": ("select flowly.checkpoint('c', %(epoch)s, 's', '1')", "cancelled"),
    "retrying failure": ("select flowly.fail_run('c', %(epoch)s, '{}', true)", "cancelled"),
    "completion": ("select flowly.complete_runs(array['c'], array[%(epoch)s::bigint],"
                   " array['1']::jsonb[])", "completed"),
    "final failure": ("select flowly.fail_run('c', %(epoch)s, '{}', false)", "dead_letter"),
    "grandchild start": ("select flowly.start('wf_g', run_id => 'g', parent_run_id => 'c',"
                         " parent_lease_epoch => %(epoch)s, parent_step => 'start:g')",
                         "cancelled"),
}


@pytest.mark.parametrize("write", list(_WRITES_IN_FLIGHT))
def test_a_family_write_in_flight_delays_cancel_then_nothing_is_left_unfinished(
    dsn: str, db: psycopg.Connection[Any], write: str,
) -> None:
    p = _running(db, "p")
    if write == "claim":
        _start(db, "c", "wf_c", ("p", p))
        epoch = 0
    else:
        epoch = _running(db, "c", parent=("p", p))
    query, child_ends = _WRITES_IN_FLIGHT[write]
    with _session(dsn) as worker:
        worker.execute(query, {"epoch": epoch})
        if write == "claim":
            epoch = _epoch(worker, "c")
        thread, out = _cancel_in_thread(dsn, "p")
        _wait_blocked(db, "select flowly.cancel%")
        assert _status(db, "p") == "running"
        worker.commit()
    thread.join(10)
    assert out.get("result") == "cancelled", out
    assert unfinished_descendants(db, "p") == []
    assert _status(db, "c") == child_ends
    # the worker's token is fenced: its next checkpoint reports the lease lost
    state = sqlstate_of(db.execute, "select flowly.checkpoint('c', %s, 'next', '1')", (epoch,))
    assert state == LOST


def test_a_dead_lettered_child_retried_at_the_same_moment_is_not_left_pending(
    dsn: str, db: psycopg.Connection[Any],
) -> None:
    # Before 0026: the family cancel locks is the *unfinished* runs of the family as its
    # snapshot shows them; a dead-lettered child was neither locked nor read again after a
    # retry that was in flight. Interleaving:
    #   1. child c (started by running parent p) has dead-lettered;
    #   2. an operator's retry_dead_letter('c') locks c FOR UPDATE and sets it pending, not
    #      yet committed;
    #   3. cancel('p') reads the family: c is dead_letter in its snapshot, so it is not
    #      locked (no wait on the retry at all); p is cancelled, 'cancelled' returned,
    #      committed;
    #   4. the retry commits: c is pending, a live child of a cancelled run, and a worker
    #      claims and runs it. (retry_dead_letter never looks at the parent either, so the
    #      same happens when the retry starts just after the cancel.)
    p = _running(db, "p")
    c = _running(db, "c", parent=("p", p))
    assert scalar(db, "select decision from flowly.fail_run('c', %s, '{}', false)",
                  c) == "dead_letter"
    with _session(dsn) as operator:
        assert scalar(operator, "select flowly.retry_dead_letter('c')") == "c"
        thread, out = _cancel_in_thread(dsn, "p")
        thread.join(1)  # since 0026 the cancel waits for the retry, which holds p (key share)
        operator.commit()
    thread.join(10)
    assert out.get("result") == "cancelled", out
    assert unfinished_descendants(db, "p") == [], (
        "a child retried while its parent was cancelled is left unfinished")
    with pytest.raises(psycopg.Error) as refused:  # and a retry after the cancel is refused
        db.execute("update flowly.runs set status = 'dead_letter' where id = 'c'")
        db.execute("select flowly.retry_dead_letter('c')")
    assert refused.value.sqlstate == "WF004", refused.value


# --- worker calls never wait on a cancel ----------------------------------------------------


def test_worker_calls_on_a_family_held_by_cancel_answer_at_once_then_lease_lost(
    dsn: str, db: psycopg.Connection[Any],
) -> None:
    p = _running(db, "p")
    c = _running(db, "c", parent=("p", p))
    _start(db, "c_pend", "wf_pend", ("p", p))
    _start(db, "t", "wf_t")  # a run p may wait for
    calls: dict[str, tuple[str, tuple[Any, ...]]] = {
        "heartbeat": ("select outcome from flowly.heartbeat('w', array['p', 'c'],"
                      " array[%s, %s]::bigint[], '1 hour')", (p, c)),
        "checkpoint parent": ("select flowly.checkpoint('p', %s, 's', '1')", (p,)),
        "checkpoint child": ("select flowly.checkpoint('c', %s, 's', '1')", (c,)),
        "complete child": ("select busy or lease_lost from flowly.complete_runs(array['c'],"
                           " array[%s::bigint], array['1']::jsonb[])", (c,)),
        "fail child": ("select decision from flowly.fail_run('c', %s, '{}', true)", (c,)),
        "start grandchild": ("select flowly.start('wf_g', run_id => 'g', parent_run_id => 'c',"
                             " parent_lease_epoch => %s, parent_step => 'start:g')", (c,)),
        "wait for run": ("select outcome from flowly.wait_for_run('p', %s, 'run:t', 't')", (p,)),
        "park": ("select flowly.park('p', %s, array['run:t'])", (p,)),
        "claim": ("select count(*) from flowly.claim('w2', array['wf_pend', 'wf_p', 'wf_c'],"
                  " array['default'], 10, '1 hour')", ()),
    }
    with _session(dsn) as operator, _session(dsn, autocommit=True) as worker:
        worker.execute("set lock_timeout = '2s'")
        assert scalar(operator, "select flowly.cancel('p')") == "cancelled"  # held open
        held: dict[str, Any] = {}
        for name, (query, params) in calls.items():
            started = time.monotonic()
            try:
                held[name] = worker.execute(query, params).fetchall()
            except psycopg.Error as exc:
                held[name] = exc.sqlstate
            took = time.monotonic() - started
            assert took < 1, f"{name} waited {took:.1f}s on the cancel's locks"
            assert held[name] != "55P03", f"{name} hit lock_timeout"
        assert held["heartbeat"] == [("busy",), ("busy",)]
        assert held["checkpoint parent"] == held["checkpoint child"] == BUSY
        assert held["complete child"] == [(True,)]
        assert held["fail child"] == held["start grandchild"] == BUSY
        assert held["wait for run"] == held["park"] == BUSY
        assert held["claim"] == [(0,)]
        operator.commit()
        after: dict[str, Any] = {}
        for name, (query, params) in calls.items():
            try:
                after[name] = worker.execute(query, params).fetchall()
            except psycopg.Error as exc:
                after[name] = exc.sqlstate
    assert after["heartbeat"] == [("lost",), ("lost",)]
    for name in ("checkpoint parent", "checkpoint child", "fail child", "start grandchild",
                 "wait for run", "park"):
        assert after[name] == LOST, (name, after[name])
    assert after["complete child"] == [(True,)]
    assert after["claim"] == [(0,)]
    assert unfinished_descendants(db, "p") == []
    assert scalar(db, "select count(*) from flowly.runs where id = 'g'") == 0


# --- cancels of overlapping families --------------------------------------------------------


def test_cancels_of_nested_families_at_once_never_deadlock(
    dsn: str, db: psycopg.Connection[Any],
) -> None:
    rng = random.Random(24)
    for round_ in range(4):
        runs = [f"r{round_}_{i:02d}" for i in range(12)]
        rng.shuffle(runs)  # ids sort in no relation to the tree
        epochs = {runs[0]: _running(db, runs[0])}
        for i, run in enumerate(runs[1:], 1):
            parent = runs[rng.randrange(i)]
            epochs[run] = _running(db, run, parent=(parent, epochs[parent]))
        targets = [runs[0], *rng.sample(runs[1:], 3)]
        barrier = threading.Barrier(len(targets))
        outcomes: dict[str, Any] = {}

        def cancel(run: str, barrier: threading.Barrier, outcomes: dict[str, Any]) -> None:
            with _session(dsn, autocommit=True) as conn:
                barrier.wait()
                try:
                    outcomes[run] = scalar(conn, "select flowly.cancel(%s)", run)
                except psycopg.Error as exc:
                    outcomes[run] = exc.sqlstate

        threads = [threading.Thread(target=cancel, args=(t, barrier, outcomes))
                   for t in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert all(o == "cancelled" for o in outcomes.values()), outcomes
        assert unfinished_descendants(db, runs[0]) == []


def test_two_cancels_whose_family_grew_while_one_waited_do_not_deadlock(
    dsn: str, db: psycopg.Connection[Any],
) -> None:
    # Before 0026: cancel locked in id order only within one pass; a child found on the re-read is
    # locked after rows of higher ids it already holds, so two cancels can take the same rows
    # in opposite orders. Ids sort a_new < m_child < p. Interleaving:
    #   1. a worker's checkpoint of m_child is in flight (m_child locked FOR NO KEY UPDATE);
    #   2. p's worker starts a_new under p in a transaction (p locked FOR NO KEY UPDATE);
    #   3. cancel #1 of p reads {m_child, p} and waits for m_child (step 1);
    #   4. the start commits; cancel #2 of p reads {a_new, m_child, p}, locks a_new, waits for
    #      m_child behind cancel #1;
    #   5. the checkpoint commits; cancel #1 locks m_child and p, reads the family again,
    #      finds a_new and waits for it -- held by cancel #2, which waits for cancel #1.
    # PostgreSQL reports 40P01 (deadlock_detected) to one of them, which cancel does not turn
    # into WF005.
    p = _running(db, "p")
    m = _running(db, "m_child", parent=("p", p))
    with _session(dsn) as slow_checkpoint, _session(dsn) as starter:
        slow_checkpoint.execute("select flowly.checkpoint('m_child', %s, 's', '1')", (m,))
        _start(starter, "a_new", "wf_a", ("p", p))
        first, out1 = _cancel_in_thread(dsn, "p")
        _wait_blocked(db, "select flowly.cancel%")
        starter.commit()
        second, out2 = _cancel_in_thread(dsn, "p")
        _wait_blocked(db, "select flowly.cancel%", count=2)
        slow_checkpoint.commit()
        first.join(15)
        second.join(15)
    states = [o.get("result") or getattr(o.get("error"), "sqlstate", o.get("error"))
              for o in (out1, out2)]
    assert all(s in ("cancelled", BUSY) for s in states), f"cancel outcomes: {states}"
    assert unfinished_descendants(db, "p") == []


class _ChildStarters:
    """Sessions that keep starting children of running family members (``parents``: run id to
    lease epoch, shared with the test) until the block ends; with ``claim``, each child is
    claimed as it starts, so that it can start its own. Errors whose SQLSTATE is not in
    ``expected`` are kept in ``errors`` for the test to assert on."""

    def __init__(self, dsn: str, parents: dict[str, int], *, lock_timeout: str,
                 expected: tuple[str, ...], claim: bool, sessions: int = 3) -> None:
        self.dsn, self.parents = dsn, parents
        self.lock_timeout, self.expected, self.claim = lock_timeout, expected, claim
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._seq = iter(range(10**6))
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._keep_starting, args=(s,), daemon=True)
                         for s in range(sessions)]

    def __enter__(self) -> _ChildStarters:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)

    def _keep_starting(self, seed: int) -> None:
        local = random.Random(seed)
        with _session(self.dsn, autocommit=True) as conn:
            conn.execute("select set_config('lock_timeout', %s, false)", (self.lock_timeout,))
            while not self._stop.is_set():
                with self._lock:
                    parent = local.choice(sorted(self.parents))
                    run = f"k{next(self._seq):06d}"
                try:
                    _start(conn, run, "wf_k", (parent, self.parents[parent]))
                    if self.claim:
                        got = claim_as(conn, "wf_k", 1)
                        with self._lock:
                            self.parents.update(got)
                except psycopg.Error as exc:
                    if exc.sqlstate not in self.expected:
                        self.errors.append(exc)


def test_cancels_racing_a_family_that_keeps_starting_children(
    dsn: str, db: psycopg.Connection[Any],
) -> None:
    """Seeded stress: workers of running runs keep starting children (and claiming them, so
    that they start their own) while cancels of several family members run at once. Every
    cancel returns or raises WF005; every 'cancelled' leaves no unfinished descendant."""
    rng = random.Random(15)
    root = _running(db, "root")
    epochs = {"root": root}
    for i in range(6):
        parent = rng.choice(list(epochs))
        epochs[f"n{i}"] = _running(db, f"n{i}", parent=(parent, epochs[parent]))
    with _ChildStarters(dsn, epochs, lock_timeout="2s", expected=(BUSY, LOST),
                        claim=True) as starters:
        time.sleep(0.3)
        targets = ["root", *rng.sample(sorted(epochs), 3)]
        outcomes: dict[str, Any] = {}

        def cancel(run: str) -> None:
            with _session(dsn, autocommit=True) as conn:
                time.sleep(rng.random() * 0.1)
                try:
                    outcomes[run] = scalar(conn, "select flowly.cancel(%s)", run)
                except psycopg.Error as exc:
                    outcomes[run] = exc.sqlstate
                if outcomes[run] == "cancelled":
                    outcomes[run + " left"] = unfinished_descendants(conn, run)

        cancels = [threading.Thread(target=cancel, args=(t,)) for t in targets]
        for t in cancels:
            t.start()
        for t in cancels:
            t.join(20)
        time.sleep(0.2)
    assert not starters.errors, starters.errors
    for run in targets:
        assert outcomes[run] in ("cancelled", BUSY), outcomes
        if outcomes[run] == "cancelled":
            assert outcomes[run + " left"] == [], outcomes
            assert unfinished_descendants(db, run) == []


def test_a_cancel_of_a_family_that_grows_faster_than_it_can_be_locked_ends_in_time(
    dsn: str, db: psycopg.Connection[Any],
) -> None:
    """cancel locks the family, reads it again, and starts over when it grew meanwhile. A
    large family whose running members keep starting children grows within every pass: the
    cancel must still end (cancelled, or WF005 once it has tried for its lock timeout), not
    loop for as long as the children keep coming."""
    root = _running(db, "root")
    parents = {"root": root}
    for i in range(20):
        parents[f"m{i}"] = _running(db, f"m{i}", parent=("root", root))
    db.execute("""
        insert into flowly.runs (id, workflow, parent_run_id)
        select 'bulk-' || g, 'wf_bulk', 'm' || (g % 20) from generate_series(1, 3000) g""")
    # busy, or a parent cancelled or its lease moved on: the cancel won
    with _ChildStarters(dsn, parents, lock_timeout="100ms",
                        expected=(BUSY, LOST, "WF004", "55P03"), claim=False) as starters:
        time.sleep(0.3)
        with _session(dsn, autocommit=True) as conn:
            began = time.monotonic()
            try:
                outcome = scalar(conn, "select flowly.cancel('root')")
            except psycopg.Error as exc:
                outcome = exc.sqlstate
            took = time.monotonic() - began
    assert not starters.errors, starters.errors
    assert outcome in ("cancelled", BUSY), outcome
    # its passes stop after its lock timeout (5 s); the last may wait for a lock that long
    assert took < 12, took
    if outcome == "cancelled":
        assert unfinished_descendants(db, "root") == []
