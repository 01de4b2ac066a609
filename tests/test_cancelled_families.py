"""A cancelled family stays cancelled, however deep: no run anywhere under a cancelled run is
retried or started by hand, and a cancel of a cancelled run again cancels what its family
left unfinished.

The family a cancel ends is every descendant of the run, through finished runs too
(family_to_cancel). Before 0071, retry_dead_letter and a start by hand looked only at the
direct parent: under a cancelled g, a dead-lettered p was refused but its dead-lettered child
c was retried and ran (and started children of its own), a child could be started by hand
under the finished p, and a second cancel('g') answered 'cancelled' and left those runs
pending.
"""

from __future__ import annotations

import time
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
    unfinished_descendants,
    wait_for,
    waiting_on_lock,
)

UNFINISHED = ("pending", "running", "compensating")

def _status(db: psycopg.Connection[Any], run: str) -> str:
    return str(scalar(db, "select status from flowly.runs where id = %s", run))


def _running(db: psycopg.Connection[Any], run: str, parent: tuple[str, int] | None = None
             ) -> int:
    """Starts ``run`` with a workflow of its own (as a child of ``parent``, the way the
    parent's worker does, when given) and claims it; its lease epoch."""
    workflow = f"wf_{run}"
    if parent is None:
        db.execute("select flowly.start(%s, run_id => %s)", (workflow, run))
    else:
        db.execute("select flowly.start(%s, run_id => %s, parent_run_id => %s,"
                   " parent_lease_epoch => %s, parent_step => %s)",
                   (workflow, run, parent[0], parent[1], f"start:{run}"))
    return claim_as(db, workflow)[run]


def _dead_letter(db: psycopg.Connection[Any], run: str, epoch: int) -> None:
    assert scalar(db, "select decision from flowly.fail_run(%s, %s, '{}', false)",
                  run, epoch) == "dead_letter"


def _complete(db: psycopg.Connection[Any], run: str, epoch: int) -> None:
    db.execute("select flowly.complete_runs(array[%s], array[%s::bigint], array['1'::jsonb])",
               (run, epoch))


def _refused(db: psycopg.Connection[Any], call: str, *params: Any) -> str:
    """The message of the WF004 (flowly.InvalidState) that ``call`` raises."""
    with pytest.raises(flowly.InvalidState) as refused, translated_errors():
        db.execute(call, params)
    return str(refused.value)


def _cancelled_family(db: psycopg.Connection[Any], p_ends: str) -> None:
    """g (running) started p, p started c; c dead-lettered, p ended ``p_ends``
    ('dead_letter' or 'completed'), then g was cancelled."""
    g = _running(db, "g")
    p = _running(db, "p", parent=("g", g))
    c = _running(db, "c", parent=("p", p))
    _dead_letter(db, "c", c)
    if p_ends == "dead_letter":
        _dead_letter(db, "p", p)
    else:
        _complete(db, "p", p)
    assert scalar(db, "select flowly.cancel('g')") == "cancelled"
    assert _status(db, "p") == p_ends


# --- at rest ------------------------------------------------------------------------------


@pytest.mark.parametrize("p_ends", ["dead_letter", "completed"])
def test_a_retry_of_a_grandchild_of_a_cancelled_run_is_refused_naming_it(
    db: psycopg.Connection[Any], p_ends: str
) -> None:
    _cancelled_family(db, p_ends)
    if p_ends == "dead_letter":
        message = _refused(db, "select flowly.retry_dead_letter('p')")
        assert "its parent run g was cancelled" in message, message
    message = _refused(db, "select flowly.retry_dead_letter('c')")
    assert "run c cannot be retried: its ancestor run g was cancelled" in message, message
    assert _status(db, "c") == "dead_letter"
    assert unfinished_descendants(db, "g") == []


@pytest.mark.parametrize("p_ends", ["dead_letter", "completed"])
def test_a_child_started_by_hand_under_a_finished_run_of_a_cancelled_family_is_refused(
    db: psycopg.Connection[Any], p_ends: str
) -> None:
    _cancelled_family(db, p_ends)
    for parent in ("p", "c"):
        message = _refused(db, "select flowly.start('wf_d', run_id => 'd', parent_run_id => %s)",
                           parent)
        assert f"run {parent} takes no more children: its ancestor run g was cancelled" \
            in message, message
    assert scalar(db, "select count(*) from flowly.runs where id = 'd'") == 0


def test_a_retry_and_a_start_by_hand_outside_a_cancelled_family_are_still_accepted(
    db: psycopg.Connection[Any],
) -> None:
    """The walk up the family refuses only under a cancelled run: a cancelled sibling, or a
    cancelled descendant, refuses nothing."""
    g = _running(db, "g")
    p = _running(db, "p", parent=("g", g))
    c = _running(db, "c", parent=("p", p))
    _running(db, "s", parent=("g", g))
    _running(db, "n", parent=("c", c))
    _dead_letter(db, "c", c)
    assert scalar(db, "select flowly.cancel('s')") == "cancelled"
    assert scalar(db, "select flowly.cancel('n')") == "cancelled"
    assert scalar(db, "select flowly.retry_dead_letter('c')") == "c"
    assert scalar(db, "select flowly.start('wf_d', run_id => 'd', parent_run_id => 'c')") == "d"
    assert _status(db, "c") == "pending"


def test_a_deep_chain_under_a_wide_family_is_walked_by_index_and_refused_at_once(
    db: psycopg.Connection[Any],
) -> None:
    """A dead letter 100 generations below a cancelled run, whose root has 1,000 other
    children: the retry walks up the chain, one index lookup a generation, and names the
    nearest cancelled ancestor; the siblings cost nothing."""
    db.execute("select flowly.start('wf_chain', run_id => 'd0')")
    db.execute("select flowly.start('wf_kid', run_id => 'k' || g, parent_run_id => 'd0')"
               " from generate_series(1, 1000) g")
    db.execute("""
        do $$
        begin
            for i in 1..100 loop
                perform flowly.start('wf_chain', run_id => 'd' || i,
                                     parent_run_id => 'd' || (i - 1));
            end loop;
        end
        $$""")
    db.execute("analyze flowly.runs")
    epoch = claim_as(db, "wf_chain", limit=200)["d100"]
    _dead_letter(db, "d100", epoch)
    # every other run of the chain ends; d3, far above, is cancelled
    db.execute("update flowly.runs set status = 'completed', finished_at = now(),"
               " locked_by = null, locked_until = null"
               " where id like 'd%' and id not in ('d3', 'd100')")
    assert scalar(db, "select flowly.cancel('d3')") == "cancelled"
    reads = ("select sum(heap_blks_hit + heap_blks_read + idx_blks_hit + idx_blks_read)"
             " from pg_statio_user_tables where relid = 'flowly.runs'::regclass")
    db.execute("select pg_stat_force_next_flush()")
    before = scalar(db, reads)
    started = time.monotonic()
    message = _refused(db, "select flowly.retry_dead_letter('d100')")
    took = time.monotonic() - started
    db.execute("select pg_stat_force_next_flush()")
    pages = int(scalar(db, reads) - before)
    assert "its ancestor run d3 was cancelled" in message, message
    assert took < 1, took
    # some 8 pages a generation (its row looked up three times: walked, locked, checked);
    # a scan of the table (about 40 pages) a generation would read some 3,700
    assert pages < 1500, pages


def test_cancelling_a_cancelled_run_again_cancels_what_its_family_left_unfinished(
    db: psycopg.Connection[Any],
) -> None:
    """A family left with unfinished runs under a cancelled run (by an engine before 0071,
    written here by hand) is ended by cancelling that run again: 'cancelled', as the first
    time, and every unfinished descendant cancelled with its lease revoked."""
    _cancelled_family(db, "dead_letter")
    db.execute("update flowly.runs set status = 'pending', finished_at = null"
               " where id = 'c'")
    epoch = int(scalar(db, "select lease_epoch from flowly.runs where id = 'c'"))
    finished_g = scalar(db, "select finished_at from flowly.runs where id = 'g'")
    assert [run for run, _ in unfinished_descendants(db, "g")] == ["c"]

    assert scalar(db, "select flowly.cancel('g')") == "cancelled"

    assert unfinished_descendants(db, "g") == []
    assert _status(db, "c") == "cancelled"
    assert scalar(db, "select lease_epoch from flowly.runs where id = 'c'") == epoch + 1
    assert _status(db, "p") == "dead_letter"  # a finished run stays as it ended
    assert scalar(db, "select finished_at from flowly.runs where id = 'g'") == finished_g
    assert scalar(db, "select flowly.cancel('g')") == "cancelled"  # and again: nothing left


# --- after a purge ------------------------------------------------------------------------
# The walk up a family ends where a parent_run_id names a run that is gone. Before 0076 purge
# kept a finished run only while a run it started was unfinished (or, for a cancelled run,
# dead-lettered): it deleted a finished middle run of a family, and what lay below it was
# cut off from the cancelled run above.

FINISHED_BUT_DEAD_LETTERS = "array['completed', 'cancelled']"


def _purge_all(db: psycopg.Connection[Any], older_than: str = "0 seconds",
               statuses: str = "array['completed', 'cancelled', 'dead_letter']") -> int:
    """Purge calls until one deletes nothing (as Client.purge loops); how many it deleted."""
    total = 0
    while (deleted := int(scalar(db, f"select flowly.purge(%s, {statuses})", older_than))):
        total += deleted
    return total


def _age(db: psycopg.Connection[Any], *runs: str) -> None:
    """Make ``runs`` finish two hours ago (a purge older than an hour takes them, not the
    others)."""
    db.execute("update flowly.runs set finished_at = now() - interval '2 hours'"
               " where id = any(%s)", (list(runs),))


@pytest.mark.parametrize("shape", ["middle completed", "completed under a cancelled middle",
                                   "middle dead letter purged first"])
def test_a_retry_under_a_cancelled_family_stays_refused_after_a_purge(
    db: psycopg.Connection[Any], shape: str
) -> None:
    """The dead letter c lies under the cancelled g through finished runs purge may take:
    a completed p (dead letters kept for inspection: purged are completed and cancelled
    runs); a completed q under a p cancelled with g; a dead-lettered p purged while c,
    which finished later, is not old enough yet. The retry of c stays refused, naming the
    cancelled run above it."""
    if shape == "middle completed":
        _cancelled_family(db, "completed")
        _purge_all(db, statuses=FINISHED_BUT_DEAD_LETTERS)
        cancelled = "g"
    elif shape == "completed under a cancelled middle":
        g = _running(db, "g")
        p = _running(db, "p", parent=("g", g))
        q = _running(db, "q", parent=("p", p))
        c = _running(db, "c", parent=("q", q))
        _dead_letter(db, "c", c)
        _complete(db, "q", q)
        assert scalar(db, "select flowly.cancel('g')") == "cancelled"
        assert _status(db, "p") == "cancelled"
        _purge_all(db, statuses=FINISHED_BUT_DEAD_LETTERS)
        cancelled = "p"
    else:
        _cancelled_family(db, "dead_letter")
        _age(db, "g", "p")
        _purge_all(db, "1 hour")
        cancelled = "g"
    # Before 0076 ("middle completed"): purge deleted p (completed, its child c finished)
    # and g (cancelled, its child p not a dead letter); the walk up from c ended at the
    # missing p, and the retry was accepted: c pending under a cancelled family.
    message = _refused(db, "select flowly.retry_dead_letter('c')")
    assert f"its ancestor run {cancelled} was cancelled" in message, message
    assert _status(db, "c") == "dead_letter"


@pytest.mark.parametrize("parent", ["p", "c"])
def test_a_child_started_by_hand_in_a_cancelled_family_stays_refused_after_a_purge(
    db: psycopg.Connection[Any], parent: str
) -> None:
    """g cancelled over a completed p and a dead-lettered c; the operator purges cancelled
    runs only. A child started by hand under p or c stays refused, naming g."""
    _cancelled_family(db, "completed")
    _purge_all(db, statuses="array['cancelled']")
    # Before 0076: purge deleted g (cancelled, its child p completed, not a dead letter),
    # and a start under p or c found no cancelled run above it: it was accepted.
    message = _refused(db, "select flowly.start('wf_d', run_id => 'd', parent_run_id => %s)",
                       parent)
    assert f"run {parent} takes no more children: its ancestor run g was cancelled" \
        in message, message
    assert scalar(db, "select count(*) from flowly.runs where id = 'd'") == 0


def test_a_dead_letter_below_a_purged_middle_run_is_still_found_by_a_later_cancel(
    db: psycopg.Connection[Any],
) -> None:
    """g still running; p, its child, completed over its dead-lettered child c, and g read
    p's outcome. A purge before g is cancelled keeps p, through which c belongs to g's
    family, and c's retry is refused after the cancel."""
    g = _running(db, "g")
    p = _running(db, "p", parent=("g", g))
    c = _running(db, "c", parent=("p", p))
    _dead_letter(db, "c", c)
    _complete(db, "p", p)
    assert scalar(db, "select outcome from flowly.wait_for_run('g', %s, 'run:p', 'p')",
                  g) == "finished"
    _purge_all(db, statuses=FINISHED_BUT_DEAD_LETTERS)
    assert scalar(db, "select flowly.cancel('g')") == "cancelled"
    # Before 0076: purge deleted p (completed, read by g, its child c finished), so g's
    # family no longer reached c, and c's retry was accepted after g's cancel.
    message = _refused(db, "select flowly.retry_dead_letter('c')")
    assert "its ancestor run g was cancelled" in message, message
    assert _status(db, "p") == "completed"


def test_a_run_running_two_completed_generations_down_is_still_cancelled_after_a_purge(
    db: psycopg.Connection[Any],
) -> None:
    """g running started m1 and read its outcome; m1 started m2 and completed, m2 started
    leaf and completed; leaf runs. After a purge, cancelling g still cancels leaf."""
    g = _running(db, "g")
    m1 = _running(db, "m1", parent=("g", g))
    m2 = _running(db, "m2", parent=("m1", m1))
    _running(db, "leaf", parent=("m2", m2))
    _complete(db, "m2", m2)
    _complete(db, "m1", m1)
    assert scalar(db, "select outcome from flowly.wait_for_run('g', %s, 'run:m1', 'm1')",
                  g) == "finished"
    _purge_all(db)
    assert scalar(db, "select flowly.cancel('g')") == "cancelled"
    # Before 0076: purge kept m2 (a run it started is unfinished) but deleted m1 (completed,
    # read by g, its child m2 finished); cancel('g') no longer reached leaf, left running.
    assert _status(db, "leaf") == "cancelled"
    assert unfinished_descendants(db, "g") == []


def test_a_cancelled_family_goes_in_one_purge_once_its_dead_letter_is_purged(
    db: psycopg.Connection[Any],
) -> None:
    """What purge keeps for a dead letter (the runs above it) goes with it: the purge that
    deletes c deletes p and g in the same call."""
    _cancelled_family(db, "completed")
    assert _purge_all(db, statuses=FINISHED_BUT_DEAD_LETTERS) == 0
    assert scalar(db, "select flowly.purge('0 seconds')") == 3
    assert scalar(db, "select count(*) from flowly.runs") == 0


# --- in flight ----------------------------------------------------------------------------


def test_a_grandchild_retried_while_its_grandparent_is_cancelled_is_cancelled_with_it(
    dsn: str, db: psycopg.Connection[Any],
) -> None:
    """The retry of c is in flight (c pending, not committed) when cancel('g') reads g's
    family: the cancel waits for the retry (which holds g, key share), then finds c pending
    and cancels it. Before 0071 the retry held only p, which the cancel does not lock: the
    cancel committed, then the retry, leaving c pending under a cancelled g."""
    g = _running(db, "g")
    p = _running(db, "p", parent=("g", g))
    c = _running(db, "c", parent=("p", p))
    _dead_letter(db, "c", c)
    _dead_letter(db, "p", p)
    with psycopg.connect(dsn) as operator:
        assert scalar(operator, "select flowly.retry_dead_letter('c')") == "c"

        def cancel() -> Any:
            with psycopg.connect(dsn, autocommit=True) as conn:
                return scalar(conn, "select flowly.cancel('g')")

        thread, out = in_thread(cancel)
        thread.join(1)
        operator.commit()
    thread.join(10)
    assert out.get("result") == "cancelled", out
    assert unfinished_descendants(db, "g") == [], "a grandchild retried meanwhile ran on"


def test_a_grandchild_retried_while_a_cancel_of_its_grandparent_is_in_flight_is_refused(
    dsn: str, db: psycopg.Connection[Any],
) -> None:
    """cancel('g') holds g (not committed) when c's retry comes: the retry waits for it,
    then refuses, naming g."""
    g = _running(db, "g")
    p = _running(db, "p", parent=("g", g))
    c = _running(db, "c", parent=("p", p))
    _dead_letter(db, "c", c)
    _dead_letter(db, "p", p)
    with psycopg.connect(dsn) as operator:
        assert scalar(operator, "select flowly.cancel('g')") == "cancelled"

        def retry() -> Any:
            with psycopg.connect(dsn, autocommit=True) as conn, translated_errors():
                return scalar(conn, "select flowly.retry_dead_letter('c')")

        thread, out = in_thread(retry)
        wait_for(lambda: waiting_on_lock(db, "%retry_dead_letter%") == 1 or not
                 thread.is_alive(), timeout=10, what="the retry to wait for the cancel")
        operator.commit()
    thread.join(10)
    assert isinstance(out.get("error"), flowly.InvalidState), out
    assert "its ancestor run g was cancelled" in str(out["error"])
    assert _status(db, "c") == "dead_letter"


def test_retries_and_cancels_racing_in_a_deep_family_neither_deadlock_nor_leave_it_unfinished(
    dsn: str, db: psycopg.Connection[Any],
) -> None:
    """Rounds of a retry of a dead letter three generations down racing a cancel of the top
    while the generations between are still running, ids sorted against the family's order
    (the retry locks upwards from the run, the cancel downwards from the top): every call
    ends in 'cancelled', the run's id or WF004, never a deadlock, and no round leaves an
    unfinished run under the cancelled top."""
    for n in range(15):
        top, mid, low, leaf = f"z{n}", f"y{n}", f"x{n}", f"w{n}"
        t = _running(db, top)
        m = _running(db, mid, parent=(top, t))
        lo = _running(db, low, parent=(mid, m))
        w = _running(db, leaf, parent=(low, lo))
        _dead_letter(db, leaf, w)

        def call(query: str, run: str) -> Any:
            with psycopg.connect(dsn, autocommit=True) as conn:
                return scalar(conn, query, run)

        calls = [in_thread(call, "select flowly.retry_dead_letter(%s)", leaf),
                 in_thread(call, "select flowly.cancel(%s)", top)]
        for thread, _ in calls:
            thread.join(15)
        (_, retried), (_, cancelled) = calls
        assert cancelled.get("result") == "cancelled", cancelled
        assert retried.get("result") == leaf or retried.get("sqlstate") == "WF004", retried
        assert unfinished_descendants(db, top) == [], n


# --- end to end ---------------------------------------------------------------------------


@flowly.workflow("cf_top", max_attempts=1)
async def cf_top(ctx: flowly.Context, inp: Any) -> Any:
    """Starts cf_middle and waits for an event that never comes."""
    await ctx.start("cf_middle", None)
    return await ctx.wait_for_event("never")


@flowly.workflow("cf_middle", max_attempts=1)
async def cf_middle(ctx: flowly.Context, inp: Any) -> Any:
    return await ctx.run("cf_bottom", None)


@flowly.workflow("cf_bottom", max_attempts=1)
async def cf_bottom(ctx: flowly.Context, inp: Any) -> Any:
    """Fails in its first generation; once retried, starts a child of its own."""
    if ctx.generation == 1:
        raise ValueError("broken in generation 1")
    return await ctx.start("cf_leaf", None)


@flowly.workflow("cf_leaf", max_attempts=1)
async def cf_leaf(ctx: flowly.Context, inp: Any) -> Any:
    return "leaf done"


def test_a_worker_runs_nothing_more_of_a_cancelled_family(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any],
) -> None:
    """The attack as a user meets it: top started middle, middle ran bottom, bottom and
    middle dead-lettered, top was cancelled. Neither dead letter is retried, nothing is
    started by hand under them, and the worker runs nothing of the family."""
    top = client.start("cf_top", None, run_id="cf")
    with running_worker(dsn, workflows=[cf_top, cf_middle, cf_bottom, cf_leaf]):
        middle = wait_for(lambda: scalar(db, "select id from flowly.runs where parent_run_id"
                                             " = %s and status = 'dead_letter'", top),
                          what="the middle run to dead-letter")
        bottom = scalar(db, "select id from flowly.runs where parent_run_id = %s", middle)
        assert _status(db, bottom) == "dead_letter"
        assert client.cancel(top) == "cancelled"
        with pytest.raises(flowly.InvalidState, match=f"parent run {top} was cancelled"):
            client.retry_dead_letter(middle)
        with pytest.raises(flowly.InvalidState, match=f"ancestor run {top} was cancelled"):
            client.retry_dead_letter(bottom)
        with pytest.raises(flowly.InvalidState, match=f"ancestor run {top} was cancelled"):
            with translated_errors():
                db.execute("select flowly.start('cf_leaf', parent_run_id => %s)", (middle,))
        time.sleep(1)  # what the worker would run, it has had time to
        assert client.cancel(top) == "cancelled"
    assert _status(db, bottom) == "dead_letter"
    assert unfinished_descendants(db, top) == []
    assert scalar(db, "select count(*) from flowly.runs where workflow = 'cf_leaf'") == 0
