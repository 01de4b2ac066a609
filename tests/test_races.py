"""Races between operators and workers, and between two workers, made deterministic: each
side's SQL function is called from its own connection, and one side is paused at a precise
point by an open transaction that holds what the other side needs."""

from __future__ import annotations

from typing import Any

import psycopg

from tests.support import claim_as, park_on_run, scalar


def _due(db: psycopg.Connection[Any], run_id: str) -> bool:
    return bool(scalar(db, "select status = 'pending' and scheduled_for <= now()"
                           " from flowly.runs where id = %s", run_id))


def test_a_wake_up_missed_in_a_fan_in_does_not_cut_a_later_retry_backoff_short(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """Fan-in: w waits for c1 and c2, which two workers complete at the same moment. The
    first completion's wake-up holds w's row, so the second one's finds it locked and is
    noted in missed_wakeups, although w is being woken anyway. w then runs on, and a step
    fails: the database decides a retry in an hour and releases w until then. The stale
    missed wake-up, applied at the next worker poll, makes w due at once: the backoff the
    database decided and stored is skipped (README, Retries: "The database decides and
    stores each delay; the run is released while it waits")."""
    db.execute("select flowly.start('fan_in', run_id => 'w')")
    db.execute("select flowly.start('leaf', run_id => 'c1', parent_run_id => 'w')")
    db.execute("select flowly.start('leaf', run_id => 'c2', parent_run_id => 'w')")
    w_epoch = claim_as(db, "fan_in")["w"]
    for child in ("c1", "c2"):
        assert scalar(db, "select outcome from flowly.wait_for_run('w', %s, %s, %s)",
                      w_epoch, f"run:{child}", child) == "waiting"
    assert scalar(db, "select flowly.park('w', %s, array['run:c1', 'run:c2'])", w_epoch) is None
    epochs = claim_as(db, "leaf")
    # two workers' completion batches, the first one still committing when the second runs
    with psycopg.connect(dsn) as first, psycopg.connect(dsn, autocommit=True) as second:
        first.execute("select flowly.complete('c1', %s, '1')", (epochs["c1"],))
        second.execute("select flowly.complete('c2', %s, '2')", (epochs["c2"],))
        first.commit()
    assert _due(db, "w")
    # a worker takes w, reads both children's results, and a step of w fails
    w_epoch = claim_as(db, "fan_in")["w"]
    for child in ("c1", "c2"):
        assert scalar(db, "select outcome from flowly.wait_for_run('w', %s, %s, %s)",
                      w_epoch, f"run:{child}", child) == "finished"
    decision, retry_at = db.execute(
        "select decision, retry_at from flowly.fail_step('w', %s, 'charge',"
        " '{\"message\": \"HTTP 503\"}', now(), 3, 'fixed', 3600, 3600)", (w_epoch,)).fetchone()
    assert decision == "retry"
    assert not _due(db, "w")
    db.execute("select flowly.wake_missed_waiters()")  # any worker's next poll
    scheduled = scalar(db, "select scheduled_for from flowly.runs where id = 'w'")
    assert not _due(db, "w"), (
        f"the step was to be retried at {retry_at}; a stale missed wake-up made the run due"
        f" now ({scheduled})")


def test_purge_keeps_a_failed_child_that_its_dead_lettered_parent_will_wait_for_again(
    db: psycopg.Connection[Any]
) -> None:
    """Parent p waits for child c; c dead-letters, p records that (ChildFailed) and
    dead-letters too. README: a finished run "named by a wait of a run that is unfinished or
    dead-lettered (a retry may wait again)" is kept, and retrying the child and then the
    parent lets the parent complete. But p's wait was recorded (its waits row deleted), and
    p is no longer unfinished, so purge takes c while p stays (a batch boundary, here
    batch => 1, oldest first). Retrying p then asks for c again: run not found."""
    db.execute("select flowly.start('parent', run_id => 'p', max_attempts => 1)")
    db.execute("select flowly.start('child', run_id => 'c', parent_run_id => 'p',"
               " max_attempts => 1)")
    epoch = claim_as(db, "parent")["p"]
    park_on_run(db, "p", epoch, "c")
    c_epoch = claim_as(db, "child")["c"]
    assert scalar(db, "select decision from flowly.fail_step('c', %s, 'work',"
                      " '{\"message\": \"broken\"}', now(), 1, 'fixed', 1, 1)",
                  c_epoch) == "dead_letter"
    assert _due(db, "p")
    epoch = claim_as(db, "parent")["p"]
    assert db.execute("select outcome, status from flowly.wait_for_run('p', %s, 'run:c', 'c')",
                      (epoch,)).fetchone() == ("finished", "dead_letter")
    # the body did not catch ChildFailed: the worker fails the run with it
    assert scalar(db, "select decision from flowly.fail_run('p', %s, %s, false)", epoch,
                  '{"type": "ChildFailed", "message": "run c ended dead_letter"}') == "dead_letter"

    scalar(db, "select flowly.purge('0 seconds', batch => 1)")
    left = {r[0] for r in db.execute("select id from flowly.runs").fetchall()}
    assert "p" not in left or "c" in left, (
        "purge deleted child c while its dead-lettered parent p, whose retry waits for c"
        " again, was kept")
    if "p" in left:
        db.execute("select flowly.retry_dead_letter('p')")
        epoch = claim_as(db, "parent")["p"]
        row = db.execute("select outcome, status from flowly.wait_for_run('p', %s, 'run:c',"
                         " 'c')", (epoch,)).fetchone()
        assert row == ("finished", "dead_letter")


def test_a_run_purged_while_a_wait_for_it_registers_does_not_park_the_waiter_for_ever(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """w's worker calls wait_for_run for x (x is running: the wait is registered) and has not
    committed yet; x completes (its wake-up cannot see the uncommitted wait) and a purge runs
    (it cannot see the wait either, so nothing keeps x). Then the worker commits and parks w.
    park finds no run x, neither busy nor finished, and parks w until 9999-12-31: nothing
    will ever wake it. The contract: a run named by a wait of an unfinished run is kept, and
    a wake-up is never lost. (Since 0024 x's completion reports x busy until the wait has
    committed, and then wakes w.)"""
    db.execute("select flowly.start('waiter', run_id => 'w')")
    db.execute("select flowly.start('other', run_id => 'x')")
    w_epoch = claim_as(db, "waiter")["w"]
    x_epoch = claim_as(db, "other")["x"]
    with psycopg.connect(dsn) as worker:
        assert scalar(worker, "select outcome from flowly.wait_for_run('w', %s, 'run:x', 'x')",
                      w_epoch) == "waiting"
        try:
            db.execute("select flowly.complete('x', %s, '42')", (x_epoch,))
            completed = True
        except psycopg.Error as exc:  # since 0024 the registering wait holds x's end off
            assert exc.sqlstate == "WF005", f"{exc.sqlstate}: {exc}"
            completed = False
        purged = scalar(db, "select flowly.purge('0 seconds')")
        worker.commit()
    if not completed:  # as its worker would, once the wait committed
        db.execute("select flowly.complete('x', %s, '42')", (x_epoch,))
    try:
        due = scalar(db, "select flowly.park('w', %s, array['run:x'])", w_epoch)
    except psycopg.Error as exc:
        # refusing to park on a run that is gone (so the body's wait fails) is fine too
        assert exc.sqlstate == "WF002", f"{exc.sqlstate}: {exc}"
        return
    scheduled = scalar(db, "select scheduled_for from flowly.runs where id = 'w'")
    assert due is not None, (
        f"purge deleted x ({purged} run) while w's wait for it was registering; w is parked"
        f" until {scheduled} and nothing will wake it")
