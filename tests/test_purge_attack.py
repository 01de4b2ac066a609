"""Attacks on retention: flowly.purge (0023) racing the calls that depend on finished runs,
under the row-lock modes of 0024-0027.

Each race is driven by hand from several connections, a transaction held open at a chosen
point, in both orders: purge against a wait registering on (or recording) a run that just
finished, a park, send_event, retry_dead_letter of a run or of its parent (and of a child
under a cancelled parent, 0026), a cancel of a family, wake_missed_waiters with duplicate
missed_wakeups rows (0025), and a real worker replaying a dead-lettered parent that asks for
its child again. After each: purge waited for no lock (timed, lock_timeout set), deleted no
unfinished run or part of one's history, left no row whose run is gone in any flowly table
with a run_id column, kept every finished run an unfinished run still waits for, and
run_counts agrees with a count of runs. A test-only trigger (purge_audit) re-checks purge's
own rules with a fresh snapshot as each run is deleted. A seeded stress test ends with the
same checks and "no waiter parked with a satisfied wait".
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import psycopg
import pytest

import flowly
from tests.support import (
    LOST_WAKEUPS,
    claim_as,
    in_thread,
    park_on_run,
    running_worker,
    scalar,
    sqlstate_of,
    wait_for,
    waiting_on_lock,
)

BUSY = "WF005"
NOT_FOUND = "WF002"
REFUSED = "WF004"
LEASE_LOST = "WF001"
FINISHED = ("completed", "dead_letter", "cancelled")
LIVE = ("pending", "running", "compensating")
FAILED = '{"type": "ValueError", "message": "boom"}'
CHILD_FAILED = '{"type": "ChildFailed", "message": "a run it waited for failed"}'
# purge must never wait for a lock: it runs with this lock_timeout and must return within
# PURGE_LIMIT seconds (a lock wait shows as 55P03 or as a slow call). The locks are held in
# open transactions until the check is done, so a wait lasts the whole lock_timeout: the
# limit sits just below it, leaving a slow machine room for the call itself
PURGE_LOCK_TIMEOUT = "1s"
PURGE_LIMIT = 0.9
# in the seeded stress every other session writes in single statements, so a lock purge
# waited for would be let go within milliseconds: only a wait past lock_timeout shows, as
# 55P03. Its time limit is for a purge that hangs (a loaded machine took 1.5 s for a batch)
STRESS_PURGE_HANG = 5.0

# A row trigger on runs that re-checks, with a fresh snapshot, at the moment a run is deleted,
# what purge must keep: a run deleted while unfinished, while a run that is unfinished (or
# dead-lettered) waits for it, while an unfinished run holds its recorded failure (or a
# dead-lettered one whose retry asks for it again), while its unfinished or dead-lettered
# parent has not read it, or while a run it started is there and it is cancelled or the run
# that started it is there (a walk of the family passes through it, 0076). Purge holds the
# row FOR UPDATE, so no wait can register on the run after purge decided: a finding means
# purge decided on a state that was already stale.
_AUDIT = """
create table public.purge_audit (id text, status text, problem text,
                                 at timestamptz default clock_timestamp());
create function public.purge_audit_check() returns trigger language plpgsql as $$
begin
    insert into public.purge_audit (id, status, problem)
    select old.id, old.status, v.problem from (values
        (case when old.status not in ('completed', 'dead_letter', 'cancelled')
              then 'unfinished run deleted' end),
        (case when exists (
                select from flowly.waits w join flowly.runs waiter on waiter.id = w.run_id
                where w.target = old.id and w.kind = 'run'
                  and waiter.status in ('pending', 'running', 'compensating', 'dead_letter'))
              then 'a wait of an unfinished or dead-lettered run names it' end),
        ((select 'its failure is recorded by ' || waiter.id || ' (' || waiter.status
                 || ', generation ' || waiter.generation || '), which may ask for it again'
          from flowly.steps s join flowly.runs waiter on waiter.id = s.run_id
          where (s.output ->> 'run_id') = old.id and s.kind = 'run'
            and s.output ->> 'status' <> 'completed'
            -- never retried (a retried run may hold a failure it caught and replays,
            -- which purge keeps by its rule only while the run is unfinished)
            and (waiter.status in ('pending', 'running', 'compensating')
                 and waiter.generation = 1
                 or waiter.status = 'dead_letter'
                    and flowly.retired_by_retry(s, waiter))
          limit 1)),
        (case when exists (
                select from flowly.step_history h join flowly.runs waiter on waiter.id = h.run_id
                where (h.output ->> 'run_id') = old.id and h.kind = 'run'
                  and h.output ->> 'status' <> 'completed'
                  and waiter.status in ('pending', 'running', 'compensating', 'dead_letter')
                  and not exists (select from flowly.steps s
                                  where s.run_id = h.run_id and s.name = h.name))
              then 'a retried run will ask for its failure again' end),
        (case when exists (
                select from flowly.runs p
                where p.id = old.parent_run_id
                  and p.status in ('pending', 'running', 'compensating', 'dead_letter')
                  and not exists (select from flowly.steps s
                                  where s.run_id = p.id and s.kind = 'run'
                                    and s.name = 'run:' || old.id))
              then 'a child its parent has not read' end),
        (case when exists (select from flowly.runs c where c.parent_run_id = old.id)
                   and (old.status = 'cancelled'
                        or exists (select from flowly.runs p where p.id = old.parent_run_id))
              then 'a run it started is there, and a walk of the family passes through it'
              end)
    ) v (problem)
    where v.problem is not null;
    return null;
end
$$;
create trigger purge_audit after delete on flowly.runs
    for each row execute function public.purge_audit_check();
"""


@pytest.fixture
def audited(db: psycopg.Connection[Any]) -> Iterator[psycopg.Connection[Any]]:
    """The db connection, with the purge_audit trigger installed in the test database."""
    db.execute(_AUDIT)
    yield db


# --------------------------------------------------------------------------------------------
# helpers


def _start(db: psycopg.Connection[Any], run: str, parent: str | None = None,
           **options: Any) -> None:
    """Starts run ``run`` of its own workflow (wf_<run>), so claims take it alone."""
    db.execute("select flowly.start(%s, run_id => %s, parent_run_id => %s,"
               " max_attempts => %s, timeout => %s::interval)",
               (f"wf_{run}", run, parent, options.get("max_attempts", 1),
                options.get("timeout")))


def _claim(db: psycopg.Connection[Any], run: str) -> int:
    db.execute("update flowly.runs set scheduled_for = now() where id = %s"
               " and status = 'pending'", (run,))
    epochs = claim_as(db, f"wf_{run}")
    assert run in epochs, f"{run} could not be claimed: {_status(db, run)}"
    return epochs[run]


def _status(db: psycopg.Connection[Any], run: str) -> str | None:
    status: str | None = scalar(db, "select status from flowly.runs where id = %s", run)
    return status


def _epoch(db: psycopg.Connection[Any], run: str) -> int:
    return int(scalar(db, "select lease_epoch from flowly.runs where id = %s", run))


def _complete(db: psycopg.Connection[Any], run: str, output: str = "1") -> None:
    epoch = _epoch(db, run) if _status(db, run) == "running" else _claim(db, run)
    db.execute("select flowly.complete(%s, %s, %s)", (run, epoch, output))
    assert _status(db, run) == "completed"


def _dead_letter(db: psycopg.Connection[Any], run: str, error: str = FAILED) -> None:
    epoch = _epoch(db, run) if _status(db, run) == "running" else _claim(db, run)
    assert scalar(db, "select decision from flowly.fail_run(%s, %s, %s::jsonb, false)",
                  run, epoch, error) == "dead_letter"


def _with_history(db: psycopg.Connection[Any], run: str) -> int:
    """Claims ``run`` and writes a checkpoint and a failed attempt; its epoch."""
    epoch = _claim(db, run)
    db.execute("select flowly.checkpoint(%s, %s, 'a', '1')", (run, epoch))
    db.execute("select flowly.fail_step(%s, %s, 'b', '{}', now(), 3, 'fixed', 3600, 3600)",
               (run, epoch))  # a retry in an hour: a row in step_attempts, run released
    db.execute("update flowly.runs set scheduled_for = now() where id = %s", (run,))
    return _claim(db, run)


def _age(db: psycopg.Connection[Any], run: str, seconds: float) -> None:
    db.execute("update flowly.runs set finished_at = now() - make_interval(secs => %s)"
               " where id = %s", (seconds, run))


def _purge(conn: psycopg.Connection[Any], older: str = "0 seconds",
           statuses: list[str] | None = None, batch: int = 1000) -> int:
    """One purge call, which must not wait for a lock."""
    conn.execute(f"set lock_timeout = '{PURGE_LOCK_TIMEOUT}'")
    started = time.monotonic()
    try:
        n = scalar(conn, "select flowly.purge(%s::interval, %s::text[], %s)", older,
                   statuses or list(FINISHED), batch)
    except psycopg.Error as exc:
        pytest.fail(f"purge failed after {time.monotonic() - started:.2f}s:"
                    f" {exc.sqlstate} {exc}")
    took = time.monotonic() - started
    assert took < PURGE_LIMIT, f"purge took {took:.2f}s: it waited for a lock"
    return int(n)


def _purge_all(conn: psycopg.Connection[Any], older: str = "0 seconds",
               statuses: list[str] | None = None, batch: int = 1000) -> int:
    total = 0
    for _ in range(10_000):
        n = _purge(conn, older, statuses, batch)
        assert n <= batch, f"purge deleted {n} runs with batch {batch}"
        if n == 0:
            return total
        total += n
    raise AssertionError("purge never returned 0")


def _on_new_conn(dsn: str, query: str) -> Callable[[], Any]:
    """A call of ``query`` on a connection of its own (for in_thread)."""
    def call() -> Any:
        with psycopg.connect(dsn, autocommit=True) as conn:
            cur = conn.execute(query)
            return cur.fetchall() if cur.description else None
    return call


def _orphans(db: psycopg.Connection[Any]) -> dict[str, int]:
    """Rows, in every flowly table with a run_id column, whose run is gone (missed_wakeups
    after a wake_missed_waiters, which settles the entries of runs that are gone)."""
    db.execute("select flowly.wake_missed_waiters()")
    tables = [r[0] for r in db.execute(
        "select c.table_name from information_schema.columns c"
        " join information_schema.tables t using (table_schema, table_name)"
        " where c.table_schema = 'flowly' and c.column_name = 'run_id'"
        " and t.table_type = 'BASE TABLE' order by 1").fetchall()]
    assert {"steps", "step_history", "step_attempts", "timers", "waits", "events",
            "missed_wakeups"} <= set(tables), tables
    found = {}
    for table in tables:
        n = scalar(db, f"select count(*) from flowly.{table} x"
                       " where not exists (select from flowly.runs r where r.id = x.run_id)")
        if n:
            found[table] = n
    return found


def _awaited_but_gone(db: psycopg.Connection[Any]) -> list[tuple[str, str]]:
    """Waits of unfinished runs for runs that no longer exist."""
    return [tuple(r) for r in db.execute(
        "select w.run_id, w.target from flowly.waits w"
        " join flowly.runs waiter on waiter.id = w.run_id"
        " where w.kind = 'run' and waiter.status in ('pending', 'running', 'compensating')"
        " and not exists (select from flowly.runs t where t.id = w.target)"
        " order by 1, 2").fetchall()]


def _count_mismatch(db: psycopg.Connection[Any]) -> tuple[dict[Any, int], dict[Any, int]]:
    db.execute("select flowly.fold_run_counts()")
    view = {(w, s): int(n) for w, s, n in db.execute(
        "select workflow, status, runs from flowly.run_counts").fetchall()}
    actual = {(w, s): int(n) for w, s, n in db.execute(
        "select workflow, status, count(*) from flowly.runs group by 1, 2").fetchall()}
    if view == actual:
        return {}, {}
    keys = set(view) | set(actual)
    return ({k: view.get(k, 0) for k in keys if view.get(k, 0) != actual.get(k, 0)},
            {k: actual.get(k, 0) for k in keys if view.get(k, 0) != actual.get(k, 0)})


def _audit(db: psycopg.Connection[Any]) -> list[tuple[str, str, str]]:
    if not scalar(db, "select to_regclass('public.purge_audit') is not null"):
        return []
    return [tuple(r) for r in db.execute(
        "select id, status, problem from public.purge_audit order by at").fetchall()]


def _check(db: psycopg.Connection[Any], what: str = "") -> None:
    """The invariants every test ends with (purge_audit's findings last)."""
    orphans = _orphans(db)
    assert not orphans, f"{what}: rows whose run is gone: {orphans}"
    gone = _awaited_but_gone(db)
    assert not gone, f"{what}: unfinished runs wait for runs that were purged: {gone}"
    lost = [tuple(r) for r in db.execute(LOST_WAKEUPS).fetchall()]
    assert not lost, f"{what}: parked with a satisfied wait: {lost}"
    view, actual = _count_mismatch(db)
    assert not view, f"{what}: run_counts {view} but the runs are {actual}"
    audit = _audit(db)
    assert not audit, f"{what}: purge deleted runs it must keep: {audit}"


def _history(db: psycopg.Connection[Any], run: str) -> dict[str, int]:
    return {t: int(scalar(db, f"select count(*) from flowly.{t} where run_id = %s", run))
            for t in ("steps", "step_history", "step_attempts", "timers", "waits", "events")}


def _fillers(db: psycopg.Connection[Any], n: int = 3, age: float = 30) -> list[str]:
    """Completed runs nothing depends on, finished ``age`` s ago and older."""
    runs = [f"f{i}" for i in range(n)]
    for i, run in enumerate(runs):
        _start(db, run)
        _complete(db, run)
        _age(db, run, age + i)
    return runs


# --------------------------------------------------------------------------------------------
# a wait registering on (or recording) a run that just finished


@pytest.mark.parametrize("batch", [1, 2, 1000])
@pytest.mark.parametrize("ended", ["completed", "dead_letter"])
@pytest.mark.parametrize("order", ["purge first", "wait first"])
def test_purge_and_a_wait_for_a_run_that_just_finished(
    dsn: str, audited: psycopg.Connection[Any], order: str, ended: str, batch: int
) -> None:
    """w's worker asks for t (ctx.wait_for_run) just after t finished, while a purge runs.
    purge first (its transaction open, t deleted): the wait reports w busy at once (WF005),
    then, once the purge committed, RunNotFound (t was purged before anything asked for it).
    wait first (its transaction open, t's outcome recorded): purge skips t without waiting;
    after the commit a purge deletes a completed t (w has its outcome) but keeps a failed one
    while w may end with it, and after w dead-letters with ChildFailed and is retried, until
    the retried w asked again: it must never get RunNotFound."""
    db = audited
    _start(db, "w")
    _start(db, "t")
    w_epoch = _claim(db, "w")
    (_complete if ended == "completed" else _dead_letter)(db, "t")
    _age(db, "t", 3600)  # the oldest: in every batch
    fillers = _fillers(db)
    db.execute("set lock_timeout = '2s'")
    ask = "select outcome, status from flowly.wait_for_run('w', %s, 'run:t', 't')"
    if order == "purge first":
        with psycopg.connect(dsn) as purger:
            assert _purge(purger, batch=batch) == min(batch, 4)
            assert _status(db, "t") == ended  # not committed yet
            started = time.monotonic()
            assert sqlstate_of(lambda: db.execute(ask, (w_epoch,))) == BUSY
            assert time.monotonic() - started < PURGE_LIMIT, "wait_for_run waited for purge"
            purger.commit()
        assert sqlstate_of(lambda: db.execute(ask, (w_epoch,))) == NOT_FOUND
        assert _status(db, "w") == "running"
        _purge_all(db, batch=batch)
        _check(db, order)
        return
    with psycopg.connect(dsn) as waiter:
        assert waiter.execute(ask, (w_epoch,)).fetchone() == ("finished", ended)
        purged = _purge(db, batch=batch)
        assert _status(db, "t") == ended, "purge deleted t under a wait recording it"
        assert purged == min(batch, len(fillers))
        waiter.commit()
    _purge_all(db, batch=batch)
    if ended == "completed":
        assert _status(db, "t") is None, "t kept although w recorded its outcome"
        assert db.execute(ask, (w_epoch,)).fetchone() == ("finished", "completed")
        _check(db, order)
        return
    assert _status(db, "t") == "dead_letter", "t purged while running w holds its failure"
    _dead_letter(db, "w", CHILD_FAILED)
    _purge_all(db, batch=batch, older="1 hour")  # w is not old enough: t is the question
    assert _status(db, "t") == "dead_letter", "t purged: the dead-lettered w's retry needs it"
    db.execute("select flowly.retry_dead_letter('w')")
    _purge_all(db, batch=batch)
    w_epoch = _claim(db, "w")
    try:
        row = db.execute(ask, (w_epoch,)).fetchone()
    except psycopg.Error as exc:
        pytest.fail(f"the retried w asks for t again: {exc.sqlstate} {exc}")
    assert row == ("finished", "dead_letter")
    _check(db, order)


def test_a_failure_recorded_while_purge_scans_is_not_purged_under_the_recording_run(
    dsn: str, audited: psycopg.Connection[Any]
) -> None:
    """purge decides with its statement's snapshot and then locks each run it deletes, skipping
    locked ones. wait_for_run key-share-locks the run it asks for, so a recording in flight
    makes purge skip the run; but one that commits after purge's snapshot and before purge
    reaches the run's row leaves no lock behind, and purge deletes a run whose failure a
    running run has just recorded (the rule of 0023 purge itself states: "a run whose failure
    an unfinished run recorded (it may yet end that run)"). Then that run dead-letters with
    ChildFailed and its retry gets RunNotFound.

    The window is the time purge spends before it reaches the run: here 20,000 older
    dead-lettered children of a running run (kept: not read yet) make it wide; w's worker
    records t's failure while purge is scanning them. Tried up to five times (a fresh w and t
    each), with the recording at a different point of the scan."""
    db = audited
    _start(db, "holder")
    db.execute("""
        insert into flowly.runs (id, workflow, status, parent_run_id, created_at, finished_at)
        select 'old' || i, 'wf_old', 'dead_letter', 'holder', now() - interval '3 hours',
               now() - interval '2 hours' + i * interval '1 ms'
        from generate_series(1, 20000) i""")
    db.execute("analyze flowly.runs")
    scalar(db, "select flowly.purge('0 seconds')")  # warm-up
    started = time.monotonic()
    assert scalar(db, "select flowly.purge('0 seconds')") == 0
    scan = time.monotonic() - started
    hits = []
    for attempt in range(5):
        w, t = f"w{attempt}", f"t{attempt}"
        _start(db, w)
        _start(db, t)
        w_epoch = _claim(db, w)
        _dead_letter(db, t)
        with psycopg.connect(dsn, autocommit=True) as purger:
            pid = purger.info.backend_pid
            thread, out = in_thread(partial(scalar, purger,
                                             "select flowly.purge('0 seconds')"))
            # purge's statement is running (its snapshot taken) before w's worker records
            wait_for(lambda p=pid: scalar(db, "select state = 'active' and query like"
                                              " '%%flowly.purge(%%' from pg_stat_activity"
                                              " where pid = %s", p), 5, 0.0005,
                     what="purge to start")
            time.sleep(scan * (0.1 + 0.15 * attempt))
            try:
                row = db.execute("select outcome, status from flowly.wait_for_run(%s, %s, %s,"
                                 " %s)", (w, w_epoch, f"run:{t}", t)).fetchone()
            except psycopg.Error as exc:  # purge holds t (busy) or took it (gone): fine
                assert exc.sqlstate in (BUSY, NOT_FOUND), f"{exc.sqlstate} {exc}"
                row = None
            thread.join(10)
        assert "error" not in out, out
        if row != ("finished", "dead_letter"):  # purge took t first: legitimately gone
            continue
        if _status(db, t) is None:
            hits.append((attempt, t))
            break
    if hits:
        attempt, t = hits[0]
        w = f"w{attempt}"
        # what follows for w: it ends with ChildFailed, is retried, and asks for t again
        _dead_letter(db, w, CHILD_FAILED)
        db.execute("select flowly.retry_dead_letter(%s)", (w,))
        w_epoch = _claim(db, w)
        state = sqlstate_of(lambda: db.execute("select flowly.wait_for_run(%s, %s, %s, %s)",
                                             (w, w_epoch, f"run:{t}", t)))
        # DEFECT: purge('0 seconds') starts (snapshot S) and scans older candidates; w's
        # worker: wait_for_run(w, 'run:t', 't') records t's failure (dead_letter) and commits;
        # purge reaches t (no lock left on it), locks and deletes it. w: fail_run ChildFailed
        # -> dead_letter; retry_dead_letter(w); wait_for_run(w, 'run:t', 't') -> WF002.
        pytest.fail(f"purge deleted {t}, whose failure running {w} had recorded (after purge's"
                    f" snapshot, before purge locked it; scan {scan:.2f}s); the retried {w}"
                    f" then asks for it again: {state}. audit: {_audit(db)}")
    _check(db)


# --------------------------------------------------------------------------------------------
# a park


@pytest.mark.parametrize("target", ["other run", "child"])
@pytest.mark.parametrize("order", ["purge first", "park first"])
def test_purge_and_a_park_on_a_run_that_just_finished(
    dsn: str, audited: psycopg.Connection[Any], order: str, target: str
) -> None:
    """w registered its wait for t (committed); t completed while w was still running (so
    nothing woke it); now w parks while a purge runs. Purge must keep t (a wait of a running
    run names it) and lock nothing park needs: park is neither busy nor slow, and w is due at
    once. Then w's worker reads t's outcome, and t may go."""
    db = audited
    _start(db, "w")
    _start(db, "t", parent="w" if target == "child" else None)
    w_epoch = _claim(db, "w")
    assert scalar(db, "select outcome from flowly.wait_for_run('w', %s, 'run:t', 't')",
                  w_epoch) == "waiting"
    _complete(db, "t")
    _age(db, "t", 3600)
    _fillers(db)
    park = "select flowly.park('w', %s, array['run:t'])"
    with psycopg.connect(dsn) as other:
        other.execute("set lock_timeout = '2s'")
        if order == "purge first":
            assert _purge(other) == 3
            started = time.monotonic()
            due = scalar(db, park, w_epoch)
            assert time.monotonic() - started < PURGE_LIMIT, "park waited for purge"
        else:
            due = scalar(other, park, w_epoch)
            assert _purge(db) == 3
        assert _status(db, "t") == "completed"
        other.commit()
    assert due is not None, "w parked for ever with t finished"
    assert _purge_all(db) == 0
    assert _status(db, "t") == "completed", "t purged while w waits for it"
    w_epoch = _claim(db, "w")
    assert db.execute("select outcome, status from flowly.wait_for_run('w', %s, 'run:t', 't')",
                      (w_epoch,)).fetchone() == ("finished", "completed")
    assert _purge_all(db) == 1
    _check(db, order)


# --------------------------------------------------------------------------------------------
# send_event to a run that just finished


@pytest.mark.parametrize("order", ["purge first", "event first", "finish first"])
def test_purge_and_an_event_sent_to_a_run_that_just_finished(
    dsn: str, audited: psycopg.Connection[Any], order: str
) -> None:
    """purge first: r completed and its purge is open; send_event(r) waits for it (an
    application's call may) and then reports r not found, storing nothing. event first: an
    event to running r is open (r key-share locked): r's completion reports r busy, purge
    leaves r alone; after the commits r completes and goes with its events. finish first:
    r's completion is open; send_event waits and is refused (WF004, 0027); purge takes r."""
    db = audited
    _start(db, "r")
    epoch = _claim(db, "r")
    send = "select flowly.send_event('r', 'go', '7')"
    if order == "purge first":
        _complete(db, "r")
        with psycopg.connect(dsn) as purger:
            assert _purge(purger) == 1
            thread, out = in_thread(_on_new_conn(dsn, send))
            wait_for(lambda: waiting_on_lock(db, "%send_event%"), 5, what="send_event to wait")
            purger.commit()
        thread.join(10)
        assert out.get("sqlstate") == NOT_FOUND, out
    elif order == "event first":
        with psycopg.connect(dsn) as app:
            app.execute(send)
            busy = db.execute("select busy from flowly.complete_runs(array['r'],"
                              " array[%s::bigint], array['1'::jsonb])", (epoch,)).fetchone()
            assert busy == (True,), "r completed under an event being sent to it"
            assert _purge(db) == 0
            app.commit()
        _complete(db, "r")
        assert scalar(db, "select count(*) from flowly.events where run_id = 'r'") == 1
        assert _purge(db) == 1
    else:
        with psycopg.connect(dsn) as worker:
            worker.execute("select flowly.complete('r', %s, '1')", (epoch,))
            thread, out = in_thread(_on_new_conn(dsn, send))
            wait_for(lambda: waiting_on_lock(db, "%send_event%"), 5, what="send_event to wait")
            assert _purge(db) == 0  # r's completion is not committed
            worker.commit()
        thread.join(10)
        assert out.get("sqlstate") == REFUSED, out
        assert scalar(db, "select count(*) from flowly.events where run_id = 'r'") == 0
        assert _purge(db) == 1
    assert _status(db, "r") is None
    _check(db, order)


# --------------------------------------------------------------------------------------------
# retry_dead_letter of a run, of its parent, of a child under a cancelled parent


@pytest.mark.parametrize("batch", [1, 2, 1000])
@pytest.mark.parametrize("order", ["purge first", "retry first"])
def test_purge_and_a_retry_of_the_dead_letter_it_deletes(
    dsn: str, audited: psycopg.Connection[Any], order: str, batch: int
) -> None:
    """c is a dead letter with history (a checkpoint, failed attempts, a failed step).
    purge first: the operator's retry waits for the open purge and then finds no run
    (WF002), and c's history is gone with it. retry first: purge skips c without waiting;
    after the retry c is pending and keeps all its history through any purge."""
    db = audited
    _start(db, "c")
    epoch = _with_history(db, "c")
    assert scalar(db, "select decision from flowly.fail_step('c', %s, 'b', '{}', now(), 1,"
                      " 'fixed', 1, 1)", epoch) == "dead_letter"
    _age(db, "c", 3600)
    _fillers(db)
    before = _history(db, "c")
    retry = "select flowly.retry_dead_letter('c')"
    if order == "purge first":
        with psycopg.connect(dsn) as purger:
            assert _purge(purger, batch=batch) == min(batch, 4)
            thread, out = in_thread(_on_new_conn(dsn, retry))
            wait_for(lambda: waiting_on_lock(db, "%retry_dead_letter%"), 5,
                     what="the retry to wait")
            purger.commit()
        thread.join(10)
        assert out.get("sqlstate") == NOT_FOUND, out
        _purge_all(db, batch=batch)
        assert _status(db, "c") is None
        _check(db, order)
        return
    with psycopg.connect(dsn) as operator:
        operator.execute(retry)
        assert _purge(db, batch=batch) == min(batch, 3)
        operator.commit()
    _purge_all(db, batch=batch)
    assert _status(db, "c") == "pending"
    after = _history(db, "c")
    moved = before["steps"] - after["steps"]
    assert after["step_history"] == before["step_history"] + moved
    assert after["step_attempts"] == before["step_attempts"], (before, after)
    _complete(db, "c")
    _purge_all(db, batch=batch)
    _check(db, order)


@pytest.mark.parametrize("batch", [1, 2, 1000])
@pytest.mark.parametrize("order", ["purge first", "retry first"])
def test_purge_and_a_retry_of_a_parent_that_failed_with_its_child(
    dsn: str, audited: psycopg.Connection[Any], order: str, batch: int
) -> None:
    """p waited for its child c; c dead-lettered, p recorded that and dead-lettered with
    ChildFailed. retry first: the operator's open retry of p holds p, and a purge keeps c
    (whatever its snapshot shows); the retried p asks for c again and gets its outcome, not
    RunNotFound. purge first: purge takes p (a dead letter too) and keeps c in the same
    statement; the retry of p then finds no run, and c goes in a later statement (0076: of
    the same call, when its batch has room)."""
    db = audited
    _start(db, "p")
    _start(db, "c", parent="p")
    park_on_run(db, "p", _claim(db, "p"), "c")
    _dead_letter(db, "c")
    p_epoch = _claim(db, "p")
    assert db.execute("select outcome, status from flowly.wait_for_run('p', %s, 'run:c', 'c')",
                      (p_epoch,)).fetchone() == ("finished", "dead_letter")
    _dead_letter(db, "p", CHILD_FAILED)
    _age(db, "c", 7200)
    _age(db, "p", 3600)
    retry = "select flowly.retry_dead_letter('p')"
    if order == "purge first":
        with psycopg.connect(dsn) as purger:
            # p, then c, which was kept for p only, as far as the batch goes
            first = _purge(purger, batch=batch)
            assert first == min(batch, 2)
            assert _audit(purger) == []
            thread, out = in_thread(_on_new_conn(dsn, retry))
            wait_for(lambda: waiting_on_lock(db, "%retry_dead_letter%"), 5,
                     what="the retry to wait")
            purger.commit()
        thread.join(10)
        assert out.get("sqlstate") == NOT_FOUND, out
        assert _status(db, "c") == ("dead_letter" if first == 1 else None)
        assert _purge_all(db, batch=batch) == 2 - first
        _check(db, order)
        return
    with psycopg.connect(dsn) as operator:
        operator.execute(retry)
        assert _purge(db, batch=batch) == 0
        operator.commit()
    assert _purge_all(db, batch=batch) == 0, "purge deleted c (or p) after p's retry"
    p_epoch = _claim(db, "p")
    try:
        row = db.execute("select outcome, status from flowly.wait_for_run('p', %s, 'run:c',"
                         " 'c')", (p_epoch,)).fetchone()
    except psycopg.Error as exc:
        pytest.fail(f"the retried parent asks for its child again: {exc.sqlstate} {exc}")
    assert row == ("finished", "dead_letter")
    # p dead-letters again (just now: a purge of runs older than an hour is about c), the
    # operator fixes and retries the child, then the parent: it completes
    _dead_letter(db, "p", CHILD_FAILED)
    assert _purge_all(db, "1 hour", batch=batch) == 0, "c purged under dead-lettered p"
    db.execute("select flowly.retry_dead_letter('c')")
    _complete(db, "c", '"ok"')
    assert _purge_all(db, "1 hour", batch=batch) == 0
    db.execute(retry)
    p_epoch = _claim(db, "p")
    assert db.execute("select outcome, status from flowly.wait_for_run('p', %s, 'run:c', 'c')",
                      (p_epoch,)).fetchone() == ("finished", "completed")
    _complete(db, "p")
    assert _purge_all(db, batch=batch) == 2
    _check(db, order)


def _cancelled_family_with_a_dead_lettered_child(db: psycopg.Connection[Any]) -> None:
    """g running; its child c dead-lettered; then g's family is cancelled (c stays a dead
    letter: it was finished). retry_dead_letter(c) is refused (0026)."""
    _start(db, "g")
    _claim(db, "g")
    _start(db, "c", parent="g")
    _dead_letter(db, "c")
    assert scalar(db, "select flowly.cancel('g')") == "cancelled"
    assert _status(db, "c") == "dead_letter"
    assert sqlstate_of(lambda: db.execute("select flowly.retry_dead_letter('c')")) == REFUSED


@pytest.mark.parametrize("how", ["cancelled only", "default statuses, c awaited",
                                 "retry during the purge"])
def test_purging_a_cancelled_parent_does_not_let_its_dead_lettered_child_run_again(
    dsn: str, audited: psycopg.Connection[Any], how: str
) -> None:
    """0026: "a cancelled family stays cancelled: ... retry_dead_letter of a child of one, is
    refused (WF004)". retry_dead_letter reads the parent's status; once purge deleted the
    cancelled parent it reads nothing and lets the child run again, though its family was
    cancelled. The parent goes first when the operator purges cancelled runs only (dead
    letters kept for inspection), or when c is kept because another run waits for it; in
    the race, the retry waits for the open purge of the parent and then goes through."""
    db = audited
    _cancelled_family_with_a_dead_lettered_child(db)
    retry = "select flowly.retry_dead_letter('c')"
    # since 0028 purge keeps g while c is a dead letter, and the retry stays refused
    if how == "cancelled only":
        assert _purge_all(db, statuses=["cancelled"]) == 0
        outcome = sqlstate_of(lambda: db.execute(retry))
    elif how == "default statuses, c awaited":
        # w waited for c, was woken by its end, and has not been claimed yet
        _start(db, "w")
        w_epoch = _claim(db, "w")
        assert scalar(db, "select outcome from flowly.wait_for_run('w', %s, 'run:c', 'c')",
                      w_epoch) == "finished"
        assert _purge_all(db) == 0  # c is kept: running w recorded its failure; g for c
        assert _status(db, "c") == "dead_letter"
        outcome = sqlstate_of(lambda: db.execute(retry))
    else:
        with psycopg.connect(dsn) as purger:
            assert _purge(purger, statuses=["cancelled"]) == 0
            thread, out = in_thread(_on_new_conn(dsn, retry))
            thread.join(10)
            purger.commit()
        outcome = out.get("sqlstate")
    status = _status(db, "c")
    # Before 0028: g running, child c of g dead-lettered, cancel('g') (c stays dead_letter),
    # purge('0 seconds', array['cancelled']) deleted g, retry_dead_letter('c') -> c pending
    # (0026's refusal reads g's status, and found no row: not 'cancelled').
    assert outcome == REFUSED, (
        f"{how}: retry_dead_letter of c, whose parent g was cancelled and then purged,"
        f" returned {outcome or 'success'}; c is {status}: a run of a cancelled family"
        " runs again")
    _check(db, how)


# --------------------------------------------------------------------------------------------
# a cancel of a family


def test_purging_a_finished_middle_run_does_not_cut_its_descendants_out_of_a_cancel(
    audited: psycopg.Connection[Any]
) -> None:
    """g (running) started m; m started leaf (fire and forget) and completed; g read m's
    outcome. README: "Cancelling a run cancels its unfinished descendants too"; leaf is one
    (family_to_cancel walks through finished runs). purge keeps a child only until its
    parent read it, so it deletes m, and leaf's link to g's family goes with it: cancel('g')
    then leaves leaf running."""
    db = audited
    _start(db, "g")
    g_epoch = _claim(db, "g")
    _start(db, "m", parent="g")
    m_epoch = _claim(db, "m")
    db.execute("select flowly.start('wf_leaf', run_id => 'leaf', parent_run_id => 'm',"
               " parent_lease_epoch => %s, parent_step => 'start:leaf')", (m_epoch,))
    _claim(db, "leaf")
    _complete(db, "m")
    assert db.execute("select outcome, status from flowly.wait_for_run('g', %s, 'run:m', 'm')",
                      (g_epoch,)).fetchone() == ("finished", "completed")
    assert "leaf" in scalar(db, "select flowly.family_to_cancel('g')")
    purged = _purge_all(db)
    assert scalar(db, "select flowly.cancel('g')") == "cancelled"
    leaf = _status(db, "leaf")
    # DEFECT: g running; m (child of g) starts leaf and completes; g records 'run:m';
    # purge('0 seconds') deletes m; cancel('g') -> g cancelled, leaf still running.
    assert leaf == "cancelled", (
        f"purge deleted {purged} run(s) (m: {_status(db, 'm')}); cancel('g') then left g's"
        f" grandchild leaf {leaf}")
    _check(db)


@pytest.mark.parametrize("order", ["purge first", "cancel first"])
def test_purge_and_a_cancel_of_a_family(
    dsn: str, audited: psycopg.Connection[Any], order: str
) -> None:
    """g running with children: c1 completed (not read), c2 dead-lettered (not read), c3
    running with a pending child gc, c4 completed and read by g. The cancel of g's family
    and a purge race, either one's transaction open. purge keeps c1 and c2 (g has not read
    them), takes c4, locks nothing the cancel needs, and never waits; after both commit the
    whole family is finished and a purge loop takes all of it."""
    db = audited
    _start(db, "g")
    g_epoch = _claim(db, "g")
    for child in ("c1", "c2", "c3", "c4"):
        _start(db, child, parent="g")
    _complete(db, "c1")
    _dead_letter(db, "c2")
    c3_epoch = _claim(db, "c3")
    db.execute("select flowly.start('wf_gc', run_id => 'gc', parent_run_id => 'c3',"
               " parent_lease_epoch => %s, parent_step => 'start:gc')", (c3_epoch,))
    _complete(db, "c4")
    assert scalar(db, "select outcome from flowly.wait_for_run('g', %s, 'run:c4', 'c4')",
                  g_epoch) == "finished"
    cancel = "select flowly.cancel('g')"
    with psycopg.connect(dsn) as other:
        other.execute("set lock_timeout = '2s'")
        if order == "purge first":
            assert _purge(other) == 1
            started = time.monotonic()
            assert scalar(db, cancel) == "cancelled"
            assert time.monotonic() - started < PURGE_LIMIT, "cancel waited for the purge"
        else:
            assert scalar(other, cancel) == "cancelled"
            assert _purge(db) == 1
        other.commit()
    assert _status(db, "c4") is None
    unfinished = db.execute("select id, status from flowly.runs where status in"
                            " ('pending', 'running', 'compensating')").fetchall()
    assert not unfinished, f"left unfinished under a cancelled family: {unfinished}"
    assert _purge_all(db) == 5
    _check(db, order)


# --------------------------------------------------------------------------------------------
# wake_missed_waiters with duplicate missed_wakeups rows


def _duplicate_missed_wakeups(dsn: str, db: psycopg.Connection[Any]) -> None:
    """w and w2 wait for t1 and t2 and are parked. Both finish while w's and w2's rows are
    held by operators (w's cancel is open): each finish notes a missed wake-up for each
    waiter (0025: a row each). w's cancel commits, w2's holder rolls back: w is cancelled
    with two missed_wakeups rows, w2 parked with two and both its waits satisfied."""
    for run in ("w", "w2", "t1", "t2"):
        _start(db, run)
    for waiter in ("w", "w2"):
        epoch = _claim(db, waiter)
        for target in ("t1", "t2"):
            assert scalar(db, "select outcome from flowly.wait_for_run(%s, %s, %s, %s)",
                          waiter, epoch, f"run:{target}", target) == "waiting"
        assert scalar(db, "select flowly.park(%s, %s, array['run:t1', 'run:t2'])",
                      waiter, epoch) is None
    with psycopg.connect(dsn) as holder_w, psycopg.connect(dsn) as holder_w2:
        holder_w.execute("select flowly.cancel('w')")
        holder_w2.execute("select from flowly.runs where id = 'w2' for no key update")
        _complete(db, "t1")
        _complete(db, "t2")
        holder_w.commit()
        holder_w2.rollback()
    missed = dict(db.execute("select run_id, count(*) from flowly.missed_wakeups"
                             " group by 1").fetchall())
    assert missed == {"w": 2, "w2": 2}, missed
    assert _status(db, "w") == "cancelled"


@pytest.mark.parametrize("order", ["purge first", "wake first"])
def test_purge_and_wake_missed_waiters_with_duplicate_rows(
    dsn: str, audited: psycopg.Connection[Any], order: str
) -> None:
    """purge first: the purge of cancelled w is open; a worker's wake_missed_waiters must
    neither wait for it nor lose w2's wake-up, and w's entries are settled once w is gone.
    wake first: wake_missed_waiters is open (it holds w and w2); purge skips w without
    waiting, and takes it later. t1 and t2 stay while parked w2 waits for them."""
    db = audited
    _duplicate_missed_wakeups(dsn, db)
    wake = "select flowly.wake_missed_waiters()"
    with psycopg.connect(dsn) as other:
        other.execute("set lock_timeout = '2s'")
        if order == "purge first":
            assert _purge(other) == 1  # w; t1 and t2 are kept for w2
            db.execute("set lock_timeout = '2s'")
            started = time.monotonic()
            settled = scalar(db, wake)
            assert time.monotonic() - started < PURGE_LIMIT, "wake_missed_waiters waited"
            assert settled == 2, "w2's two entries"
        else:
            assert scalar(other, wake) == 4
            assert _purge(db) == 0, "purge took w, which wake_missed_waiters holds"
        other.commit()
    _purge_all(db)
    assert _status(db, "w") is None
    assert set(r[0] for r in db.execute("select id from flowly.runs").fetchall()) == {
        "w2", "t1", "t2"}
    assert scalar(db, wake) >= 0
    assert scalar(db, "select count(*) from flowly.missed_wakeups") == 0
    assert db.execute("select status, scheduled_for <= now() from flowly.runs"
                      " where id = 'w2'").fetchone() == ("pending", True), "w2 not woken"
    _check(db, order)
    epoch = _claim(db, "w2")
    for target in ("t1", "t2"):
        assert scalar(db, "select outcome from flowly.wait_for_run('w2', %s, %s, %s)",
                      epoch, f"run:{target}", target) == "finished"
    _complete(db, "w2")
    assert _purge_all(db) == 3
    _check(db, order)


# --------------------------------------------------------------------------------------------
# purge never waits for a worker's locks; batch sizes


@pytest.mark.parametrize("batch", [1, 2, 1000])
def test_purge_never_waits_for_locks_that_workers_and_operators_hold(
    dsn: str, audited: psycopg.Connection[Any], batch: int
) -> None:
    """Open transactions hold what workers and operators hold mid-call: a claim, a
    checkpoint, a heartbeat, a transactional step, a completion batch, a failed step, a park
    and a wait recording finished runs, an event being sent, wake_missed_waiters, a folding
    of run counts, the timeout sweep, a retry, a child started by hand under a completed
    run. purge (lock_timeout 1 s) must return at once each time, deleting only runs no one
    holds, and afterwards everything."""
    db = audited
    for run in ("claimed", "ckpt", "hb", "txn", "done", "fstep", "parker", "recorder",
                "evt", "stall", "dl", "parent_done", "free1", "free2", "free3",
                "parked_on", "recorded"):
        _start(db, run)
    epochs = {run: _claim(db, run) for run in (
        "ckpt", "hb", "txn", "done", "fstep", "parker", "recorder", "evt", "stall")}
    assert scalar(db, "select outcome from flowly.wait_for_run('parker', %s, 'run:x',"
                      " 'parked_on')", epochs["parker"]) == "waiting"
    for run in ("free1", "free2", "free3", "parked_on", "recorded", "parent_done"):
        _complete(db, run)
        _age(db, run, 600)
    _dead_letter(db, "dl")
    _age(db, "dl", 600)
    db.execute("update flowly.runs set timeout_at = now() - interval '1 second'"
               " where id = 'stall'")
    conns = [psycopg.connect(dsn) for _ in range(14)]
    try:
        held = iter(conns)
        statements = [
            ("claim", "select * from flowly.claim('w9', array['wf_claimed'], array['default'],"
                      " 1, '1 hour')", None),
            ("checkpoint", "select flowly.checkpoint('ckpt', %s, 's', '1')", epochs["ckpt"]),
            ("heartbeat", "select flowly.heartbeat('w', array['hb'], array[%s::bigint],"
                          " '1 hour')", epochs["hb"]),
            ("transaction step", "select flowly.begin_transaction_step('txn', %s)",
             epochs["txn"]),
            ("completion", "select * from flowly.complete_runs(array['done'],"
                           " array[%s::bigint], array['1'::jsonb])", epochs["done"]),
            ("failed step", "select flowly.fail_step('fstep', %s, 'x', '{}', now(), 3,"
                            " 'fixed', 60, 60)", epochs["fstep"]),
            ("park", "select flowly.park('parker', %s, array['run:x'])", epochs["parker"]),
            ("recording", "select flowly.wait_for_run('recorder', %s, 'run:r', 'recorded')",
             epochs["recorder"]),
            ("event", "select flowly.send_event('evt', 'go', '1')", None),
            ("wake_missed_waiters", "select flowly.wake_missed_waiters()", None),
            ("fold", "select flowly.fold_run_counts()", None),
            ("sweep", "select flowly.dead_letter_stalled_runs()", None),
            ("retry", "select flowly.retry_dead_letter('dl')", None),
            ("start under a finished run", "select flowly.start('wf_kid', run_id => 'kid',"
                                           " parent_run_id => 'parent_done')", None),
        ]
        for what, query, param in statements:
            conn = next(held)
            try:
                conn.execute(query, (param,) if param is not None else None)
            except psycopg.Error as exc:
                pytest.fail(f"{what}: {exc.sqlstate} {exc}")
        assert _status(db, "stall") == "running"  # the sweep's dead letter is not committed
        # the loop `flowly purge` and client.purge make, until a call returns 0
        with flowly.Client(dsn) as client:
            thread, out = in_thread(partial(client.purge, 0, batch=batch))
            thread.join(10)
        assert not thread.is_alive(), "client.purge waits for a lock"
        assert "error" not in out, out
        assert out["took"] < 2 * PURGE_LIMIT, f"client.purge took {out['took']:.2f}s"
        deleted = out["result"] + _purge_all(db, batch=batch)
        # free1-3 only: parked_on, recorded, parent_done and dl are held
        assert deleted == 3, deleted
        left = {r[0] for r in db.execute("select id from flowly.runs").fetchall()}
        assert {"parked_on", "recorded", "parent_done", "dl"} <= left
        for conn in conns:
            conn.commit()
    finally:
        for conn in conns:
            conn.close()
    assert _status(db, "stall") == "dead_letter"
    assert _status(db, "dl") == "pending"
    _purge_all(db, batch=batch)
    left = {r[0] for r in db.execute("select id from flowly.runs").fetchall()}
    assert "parked_on" in left, "purge took the run parked parker waits for"
    # parent_done, completed with nothing above it, goes although the child started under
    # it is unfinished (0028 kept it): cancelling it would change nothing, and no walk of
    # the family needs it (0076)
    assert "parent_done" not in left and "kid" in left, left
    assert not ({"recorded", "stall", "done"} & left), ({"recorded", "stall", "done"} & left)
    _check(db)


def _population(db: psycopg.Connection[Any]) -> tuple[list[str], set[str]]:
    """Finished runs purge may take (in the order it should, oldest first) and the runs that
    must be left at the end (unfinished, and finished ones an unfinished run needs)."""
    ages: dict[str, float] = {}

    def finished(run: str, how: str, age: float, **kw: Any) -> None:
        _start(db, run, **kw)
        {"completed": _complete, "dead_letter": _dead_letter,
         "cancelled": lambda d, r: d.execute("select flowly.cancel(%s)", (r,))}[how](db, run)
        _age(db, run, age)
        ages[run] = age

    finished("x1", "completed", 900)
    finished("x2", "cancelled", 890)
    finished("x3", "dead_letter", 880)
    finished("x4", "completed", 870)
    finished("x5", "cancelled", 860)
    finished("x6", "dead_letter", 850)
    # kept for good: a child its running parent has not read, a run a parked run waits for
    _start(db, "p")
    _claim(db, "p")
    finished("kc", "completed", 2000, parent="p")
    _start(db, "w")
    _start(db, "kt")
    park_on_run(db, "w", _claim(db, "w"), "kt")
    _complete(db, "kt")
    _age(db, "kt", 1900)
    ages.pop("kc")
    # kept until the run that needs it is gone: dw dead-lettered (the sweep) while it waited
    # for t2; f failed, and dead-lettered w2 recorded that (ChildFailed)
    _start(db, "dw")
    _start(db, "t2")
    park_on_run(db, "dw", _claim(db, "dw"), "t2")
    db.execute("update flowly.runs set timeout_at = now() - interval '1 second'"
               " where id = 'dw'")
    db.execute("select flowly.dead_letter_stalled_runs()")
    assert _status(db, "dw") == "dead_letter"
    _complete(db, "t2")
    _age(db, "t2", 1800)
    _age(db, "dw", 100)
    ages["t2"], ages["dw"] = 1800, 100
    _start(db, "w2")
    _start(db, "f")
    w2_epoch = _claim(db, "w2")
    _dead_letter(db, "f")
    assert scalar(db, "select outcome from flowly.wait_for_run('w2', %s, 'run:f', 'f')",
                  w2_epoch) == "finished"
    _dead_letter(db, "w2", CHILD_FAILED)
    _age(db, "f", 1700)
    _age(db, "w2", 90)
    ages["f"], ages["w2"] = 1700, 90
    # unfinished
    _start(db, "pend")
    _start(db, "comp")
    epoch = _claim(db, "comp")
    db.execute("select flowly.checkpoint('comp', %s, 'a', '1', now(), true)", (epoch,))
    assert scalar(db, "select decision from flowly.fail_run('comp', %s, '{}', false)",
                  epoch) == "compensate"
    order = sorted(ages, key=lambda r: -ages[r])
    return order, {"p", "kc", "w", "kt", "pend", "comp"}


@pytest.mark.parametrize("batch", [1, 2, 1000])
def test_purge_batches_take_the_same_runs_oldest_first(
    audited: psycopg.Connection[Any], batch: int
) -> None:
    """The same population purged with batches of 1, 2 and 1000: every call deletes at most
    the batch, the oldest runs it may take first, runs freed by an earlier batch (a dead
    letter's target once the dead letter is gone) in a later one; at the end the same runs
    are left, with their history, and run_counts agrees."""
    db = audited
    order, kept = _population(db)
    history = {run: _history(db, run) for run in kept}
    # what the first call may take: not t2 (dw names it) nor f (w2 may ask for it)
    first_eligible = [r for r in order if r not in ("t2", "f")]
    rounds = []
    while True:
        before = {r[0] for r in db.execute("select id from flowly.runs").fetchall()}
        n = _purge(db, batch=batch)
        after = {r[0] for r in db.execute("select id from flowly.runs").fetchall()}
        assert len(before - after) == n <= batch
        rounds.append(sorted(before - after, key=order.index))
        if n == 0:
            break
        assert len(rounds) < 100
    assert rounds[0] == first_eligible[:batch], rounds
    left = {r[0] for r in db.execute("select id from flowly.runs").fetchall()}
    assert left == kept, f"left {sorted(left)}, expected {sorted(kept)}"
    assert {run: _history(db, run) for run in kept} == history
    _check(db, f"batch {batch}")


# --------------------------------------------------------------------------------------------
# a real worker replaying a dead-lettered parent while purge loops

_PA_CHILD_FAILS = {"on": True}


@flowly.workflow("pa_child", max_attempts=1)
async def pa_child(ctx: flowly.Context, inp: Any) -> Any:
    def work() -> str:
        if _PA_CHILD_FAILS["on"]:
            raise ValueError("child broken")
        return "child ok"

    return await ctx.step("work", work, retry=flowly.Retry(max_attempts=1))


@flowly.workflow("pa_parent", max_attempts=1)
async def pa_parent(ctx: flowly.Context, inp: Any) -> Any:
    got = await ctx.run("pa_child", inp)
    return {"child": got}


def test_a_worker_replaying_a_dead_lettered_parent_finds_its_kept_child(
    dsn: str, audited: psycopg.Connection[Any]
) -> None:
    """A worker with purge_after=0 runs pa_parent, whose child fails: both dead-letter. A
    thread purges ('0 seconds', batches of 1, 2 or 1000) all along; run pa-x (running, not
    served by the worker) waits for the parent, so purge keeps the parent, and the question
    is the child alone. The parent is retried (the child still broken): the replay asks for
    the child again and fails with ChildFailed, never RunNotFound. Then the child is fixed
    and retried, the parent retried: it completes with the child's output."""
    db = audited
    _PA_CHILD_FAILS["on"] = True
    with flowly.Client(dsn) as client:
        parent = client.start(pa_parent, "x", run_id="pa-p")
    _start(db, "pa-x")
    x_epoch = _claim(db, "pa-x")
    assert scalar(db, "select outcome from flowly.wait_for_run('pa-x', %s, 'run:pa-p',"
                      " 'pa-p')", x_epoch) == "waiting"
    stop = threading.Event()
    errors: list[str] = []
    rng = random.Random(7)

    def purger() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                try:
                    _purge(conn, batch=rng.choice([1, 2, 1000]))
                except BaseException as exc:  # reported below
                    errors.append(repr(exc))
                    return
                time.sleep(0.005)

    thread = threading.Thread(target=purger, daemon=True)
    thread.start()
    try:
        with running_worker(dsn, workflows=[pa_child, pa_parent], purge_after=0), \
                flowly.Client(dsn) as client:
            run = client.wait(parent, timeout=30)
            assert run.status == "dead_letter", run
            assert run.error and run.error["type"] == "ChildFailed", run.error
            child = scalar(db, "select id from flowly.runs where parent_run_id = 'pa-p'")
            assert child is not None, "the failed child was purged under its dead parent"
            time.sleep(0.2)  # purge rounds
            client.retry_dead_letter(parent)
            run = client.wait(parent, "dead_letter", timeout=30)
            assert run.error and run.error["type"] == "ChildFailed", run.error
            assert _status(db, child) == "dead_letter"
            _PA_CHILD_FAILS["on"] = False
            time.sleep(0.2)
            client.retry_dead_letter(child)
            assert client.wait(child, timeout=30).status == "completed"
            time.sleep(0.2)
            client.retry_dead_letter(parent)
            run = client.wait(parent, "completed", timeout=30)
            assert run.output == {"child": "child ok"}, run
    finally:
        stop.set()
        thread.join(10)
    assert not errors, errors
    assert scalar(db, "select flowly.cancel('pa-x')") == "cancelled"
    _purge_all(db)
    assert scalar(db, "select count(*) from flowly.runs") == 0
    _check(db)


# --------------------------------------------------------------------------------------------
# seeded stress


class _Stress:
    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.slow: list[str] = []
        self.lock = threading.Lock()
        self.purged = 0
        self.next_id = 0

    def new_id(self, prefix: str) -> str:
        with self.lock:
            self.next_id += 1
            return f"{prefix}{self.next_id:05d}"

    def note(self, what: str, exc: BaseException) -> None:
        with self.lock:
            self.errors.append(f"{what}: {getattr(exc, 'sqlstate', None)}"
                               f" {str(exc).splitlines()[0] if str(exc) else repr(exc)}")


# what each thread may legitimately get: busy, lease lost, run gone (purged), refused
_EXPECTED = {BUSY, LEASE_LOST, NOT_FOUND, REFUSED}


@pytest.mark.parametrize("seed", [3, 2026])
def test_seeded_stress_of_purge_against_everything(
    dsn: str, audited: psycopg.Connection[Any], seed: int
) -> None:
    """Threads start runs (some children of live runs), claim them and complete, fail
    (steps, bodies), checkpoint, wait for other runs and park, record finished runs'
    outcomes (a failure ends the waiter with ChildFailed), cancel runs and families, retry
    dead letters, wake missed waiters, while purge('0 seconds') loops with batches of 1, 2
    and 1000 under lock_timeout. Then: no purge call hung or failed, purge deleted
    nothing it must keep (audit), no row is orphaned, no unfinished run waits for a purged
    one, no waiter is parked with a satisfied wait, run_counts agrees with the runs."""
    db = audited
    stress = _Stress(dsn)
    master = random.Random(seed)

    def guarded(name: str, body: Callable[[random.Random], None]) -> threading.Thread:
        rng = random.Random(master.random())

        def run() -> None:
            try:
                body(rng)
            except BaseException as exc:
                stress.note(name, exc)

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        return t

    def attempt(conn: psycopg.Connection[Any], query: str, params: Any = None) -> Any:
        try:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else None
        except psycopg.Error as exc:
            if exc.sqlstate not in _EXPECTED:
                raise
            return exc.sqlstate

    def starter(rng: random.Random) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stress.stop.is_set():
                run = stress.new_id("s")
                parent = None
                if rng.random() < 0.3:
                    parent = scalar(conn, "select id from flowly.runs where status in"
                                          " ('pending', 'running') order by random() limit 1")
                attempt(conn, "select flowly.start('st', run_id => %s, parent_run_id => %s,"
                              " max_attempts => 1)", (run, parent))
                time.sleep(rng.uniform(0.002, 0.01))

    def worker(rng: random.Random) -> None:
        me = stress.new_id("worker")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("set lock_timeout = '2s'")
            while not stress.stop.is_set():
                rows = attempt(conn, "select run_id, lease_epoch from flowly.claim(%s,"
                                     " array['st'], array['default'], 3, '1 hour')", (me,))
                if not isinstance(rows, list) or not rows:
                    time.sleep(0.01)
                    continue
                for run, epoch in rows:
                    act = rng.random()
                    if act < 0.3:
                        attempt(conn, "select flowly.complete(%s, %s, '1')", (run, epoch))
                    elif act < 0.4:
                        attempt(conn, "select flowly.fail_step(%s, %s, 'a', '{}', now(), 1,"
                                      " 'fixed', 1, 1)", (run, epoch))
                    elif act < 0.5:
                        attempt(conn, "select flowly.checkpoint(%s, %s, 'c', '1')",
                                (run, epoch))
                        attempt(conn, "select flowly.fail_run(%s, %s, %s::jsonb, false)",
                                (run, epoch, FAILED))
                    else:  # wait for 1-2 other runs, record or park
                        targets = [r[0] for r in conn.execute(
                            "select id from flowly.runs where id <> %s order by random()"
                            " limit %s", (run, rng.randint(1, 2))).fetchall()]
                        outcomes = {}
                        for target in targets:
                            got = attempt(conn, "select outcome, status from"
                                                " flowly.wait_for_run(%s, %s, %s, %s)",
                                          (run, epoch, f"run:{target}", target))
                            outcomes[target] = got
                        if any(not isinstance(o, list) for o in outcomes.values()):
                            continue  # busy or gone: left running under its lease
                        got = {t: o[0] for t, o in outcomes.items()}
                        waiting = [f"run:{t}" for t, (o, _) in got.items() if o == "waiting"]
                        if waiting:
                            attempt(conn, "select flowly.park(%s, %s, %s)",
                                    (run, epoch, waiting))
                        elif any(status != "completed" for _, status in got.values()):
                            attempt(conn, "select flowly.fail_run(%s, %s, %s::jsonb, false)",
                                    (run, epoch, CHILD_FAILED))
                        else:
                            attempt(conn, "select flowly.complete(%s, %s, '2')", (run, epoch))
                time.sleep(rng.uniform(0, 0.01))

    def operator(rng: random.Random) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stress.stop.is_set():
                time.sleep(rng.uniform(0.005, 0.03))
                if rng.random() < 0.5:
                    run = scalar(conn, "select id from flowly.runs where status in"
                                       " ('pending', 'running') order by random() limit 1")
                    if run:
                        attempt(conn, "select flowly.cancel(%s)", (run,))
                else:
                    run = scalar(conn, "select id from flowly.runs where status ="
                                       " 'dead_letter' order by random() limit 1")
                    if run:
                        attempt(conn, "select flowly.retry_dead_letter(%s)", (run,))

    def purger(rng: random.Random) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            # the two purgers take turns on purge_positions (one writer of the positions at a
            # time), so one may wait for the other's whole batch: 1.2 s once on a loaded
            # machine, past the 1 s of PURGE_LOCK_TIMEOUT. A hang still shows, as 55P03.
            conn.execute(f"set lock_timeout = '{STRESS_PURGE_HANG}s'")
            while not stress.stop.is_set():
                started = time.monotonic()
                n = scalar(conn, "select flowly.purge('0 seconds', batch => %s)",
                           rng.choice([1, 2, 1000]))
                took = time.monotonic() - started
                with stress.lock:
                    stress.purged += int(n)
                    if took > STRESS_PURGE_HANG:
                        stress.slow.append(f"purge took {took:.2f}s")
                attempt(conn, "select flowly.wake_missed_waiters()")
                if rng.random() < 0.2:
                    attempt(conn, "select flowly.fold_run_counts()")
                time.sleep(rng.uniform(0, 0.01))

    threads = [guarded("starter", starter), guarded("worker1", worker),
               guarded("worker2", worker), guarded("operator", operator),
               guarded("purger1", purger), guarded("purger2", purger)]
    time.sleep(4)
    stress.stop.set()
    for t in threads:
        t.join(15)
    assert not [t.name for t in threads if t.is_alive()], "a stress thread hung"
    assert not stress.errors, stress.errors
    assert not stress.slow, stress.slow
    assert stress.purged > 0, "the stress purged nothing"
    _purge_all(db)
    # DEFECT (most runs of this test; see
    # test_a_failure_recorded_while_purge_scans_is_not_purged_under_the_recording_run): the
    # audit finds runs purge deleted although a running run (generation 1) had recorded
    # their failure: wait_for_run(w, 'run:t', t) committed after purge's snapshot and before
    # purge locked t. The other invariants are checked first.
    _check(db, f"seed {seed}")
