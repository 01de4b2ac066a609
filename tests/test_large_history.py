"""Large history: what finished runs cost the calls that should not depend on them.

Each test builds history with set-based inserts straight into flowly's tables (rows shaped as
the engine writes them), analyzes, and measures the pages a call reads (tests/support.py's
pages_read: heap and index pages, cache hits included) at two sizes of history. A call whose
cost should not depend on history reads about the same at both sizes.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import psycopg

from tests.support import offer_as, pages_read, running_worker, scalar, seq_scanned

# --- helpers ---------------------------------------------------------------------------------


def _finished_runs(db: psycopg.Connection[Any], prefix: str, count: int, *,
                   status: str = "completed", workflow: str = "order",
                   finished_ago: str = "2 days", created_ago: str | None = None,
                   steps: int = 0) -> None:
    """``count`` runs finished ``finished_ago`` (spread over the minute before), as complete_runs
    leaves them, each with ``steps`` completed steps."""
    created_ago = created_ago or finished_ago
    db.execute(
        "insert into flowly.runs (id, workflow, status, output, lease_epoch, created_at,"
        "                         started_at, finished_at)"
        " select %(prefix)s || g, %(workflow)s, %(status)s, '1', 1,"
        "        now() - %(created)s::interval - g * interval '1 ms',"
        "        now() - %(created)s::interval - g * interval '1 ms',"
        "        now() - %(finished)s::interval - g * interval '1 ms'"
        " from generate_series(1, %(n)s) g",
        {"prefix": prefix, "workflow": workflow, "status": status, "created": created_ago,
         "finished": finished_ago, "n": count})
    if steps:
        db.execute(
            "insert into flowly.steps (run_id, name, seq, position, status, output, started_at,"
            "                          finished_at)"
            " select %(prefix)s || g, 's' || p, nextval('flowly.step_seq'), p, 'completed', '1',"
            "        now() - %(created)s::interval, now() - %(created)s::interval"
            "            + p * interval '10 ms'"
            " from generate_series(1, %(n)s) g, generate_series(1, %(steps)s) p",
            {"prefix": prefix, "created": created_ago, "n": count, "steps": steps})


def _analyze(db: psycopg.Connection[Any]) -> None:
    db.execute("select flowly.fold_run_counts()")
    db.execute("vacuum analyze")


# --- purge -----------------------------------------------------------------------------------


def test_purging_one_status_does_not_read_the_older_runs_of_the_statuses_it_keeps(
    db: psycopg.Connection[Any]
) -> None:
    """`flowly purge --older-than 1d --status cancelled` (or purge(statuses => ...)) next to a
    longer retention of completed runs: each batch walks runs_finished_at from the oldest
    finished run and filters the status on the heap, so it reads every older completed run
    it keeps, at every call (and Client.purge loops until a call returns 0: that last call
    reads them all even when there is nothing left to purge). Where the planner goes by
    runs_status_created instead, it reads every cancelled run, due or not. One due cancelled
    run costs a few pages whatever the history behind it."""

    def purge_one_cancelled(tag: str, kept: int) -> int:
        # a day of runs: 5% cancelled (not due yet); one cancelled run due
        _finished_runs(db, f"recent-{tag}-", kept // 20, status="cancelled",
                       finished_ago="1 hour")
        _finished_runs(db, f"cancelled-{tag}-", 1, status="cancelled", finished_ago="1 day 1 hour")
        _analyze(db)
        pages, rows = pages_read(db, "flowly.runs",
                                 "select flowly.purge('1 day', array['cancelled'])")
        assert rows == [(1,)]
        return pages

    _finished_runs(db, "kept-a-", 20_000, finished_ago="20 days")
    small = purge_one_cancelled("a", 20_000)
    _finished_runs(db, "kept-b-", 100_000, finished_ago="25 days")
    large = purge_one_cancelled("b", 100_000)
    # nothing due of that status: the call Client.purge ends its loop with
    _analyze(db)
    idle, rows = pages_read(db, "flowly.runs", "select flowly.purge('1 day', array['cancelled'])")
    assert rows == [(0,)]
    assert scalar(db, "select count(*) from flowly.runs where status = 'completed'") == 120_000
    assert large < small + 100 and idle < 100, (
        f"purge of one due cancelled run read {small} pages of runs behind 20,000 kept"
        f" completed runs (and 1,000 cancelled ones not due), {large} behind 120,000 (and"
        f" 6,000); then a purge with nothing to do read {idle}")


def test_a_worker_s_background_purge_keeps_up_with_what_a_worker_finishes(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """Worker(purge_after=...) deletes at most 10 batches of 1,000 runs and then sleeps 60 s:
    10,000 runs a minute (167 a second), while one worker finishes about 2,000 runs a second
    (bench/RESULTS.md). A busy engine's history then grows without bound however short the
    retention. 30,000 runs past the retention (15 seconds of a worker's throughput, about a
    second of deletes) must be gone within the minute, not 10,000 a minute: within 45 s,
    which leaves room for a loaded machine (a quiet one takes a few seconds)."""
    _finished_runs(db, "old-", 30_000, finished_ago="2 days", steps=1)
    _analyze(db)
    with running_worker(dsn, purge_after=timedelta(days=1)):
        deadline = time.monotonic() + 45
        left = scalar(db, "select count(*) from flowly.runs")
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = scalar(db, "select count(*) from flowly.runs")
    assert left == 0, f"{30_000 - left} of 30,000 runs past the retention purged in 45 s"


# --- dashboards ------------------------------------------------------------------------------


def test_step_latency_reads_only_the_steps_of_the_last_day(db: psycopg.Connection[Any]) -> None:
    """step_latency covers the steps of runs created in the last 24 hours, but its plan hashes
    the recent runs and reads the whole steps table (a sequential scan of every step ever
    checkpointed) to find theirs: its cost grows with history, against the README's "none of
    which reads the whole history". The same 2,000 recent runs cost the same behind 30,000 or
    150,000 old ones."""
    _finished_runs(db, "recent-", 2_000, finished_ago="1 minute", created_ago="1 hour", steps=3)

    def steps_pages() -> tuple[int, set[str]]:
        _analyze(db)
        query = "select * from flowly.step_latency"
        scanned = seq_scanned(db, query)
        pages, rows = pages_read(db, "flowly.steps", query)
        assert sum(r[2] for r in rows) == 6_000
        return pages, scanned

    _finished_runs(db, "old-a-", 30_000, finished_ago="3 days", steps=3)
    small, _ = steps_pages()
    _finished_runs(db, "old-b-", 120_000, finished_ago="4 days", steps=3)
    large, scanned = steps_pages()
    assert "steps" not in scanned and large < 2 * small + 100, (
        f"step_latency read {small} pages of steps behind 30,000 old runs (90,000 steps),"
        f" {large} behind 150,000 (450,000 steps); sequential scans: {sorted(scanned)}")


# --- hand-off ---------------------------------------------------------------------------------


def _handed_off_starts_pages(dsn: str, count: int) -> int:
    """Pages of flowly.runs read by ``count`` starts of 'order' in one new session, each handed
    to a slot a ghost worker offered (past the fifth call, PL/pgSQL plans generically)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(count):
            offer_as(conn, f"ghost-{i}", "order", "1 minute")
    with psycopg.connect(dsn, autocommit=True) as conn:
        pages, _ = pages_read(
            conn, "flowly.runs",
            "select flowly.start('order', to_jsonb(g)) from generate_series(1, %s) g", count)
        handed = scalar(conn, "select count(*) from flowly.runs where status = 'running'"
                              " and started_at = created_at and workflow = 'order'")
    assert handed >= count, "the starts were not handed off"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("update flowly.runs set status = 'completed', locked_until = null,"
                     " finished_at = now() where status = 'running'")
    return pages


def _finished_since_analyzed(db: psycopg.Connection[Any], prefix: str, count: int) -> None:
    """``count`` runs of 'order' analyzed while pending, finished since and vacuumed (a drain
    that ended before autovacuum analyzed the table again): the statistics say they all wait,
    but no dead index entry is left to read."""
    db.execute("insert into flowly.runs (id, workflow) select %s || g, 'order'"
               " from generate_series(1, %s) g", (prefix, count))
    db.execute("analyze flowly.runs")
    db.execute("update flowly.runs set status = 'completed', output = '1', lease_epoch = 1,"
               " started_at = now(), finished_at = now() where id like %s || '%%'", (prefix,))
    db.execute("vacuum flowly.runs")


def test_a_hand_off_reads_no_finished_history(dsn: str, db: psycopg.Connection[Any]) -> None:
    """start's check that no run due at its priority waits ahead of the one it hands off reads
    the claim index, not the finished runs: about the same pages with 50,000 finished runs of
    the workflow as with 1,000, under statistics taken while they were still pending, however
    many starts a session makes."""
    _finished_since_analyzed(db, "small-", 1_000)
    small = _handed_off_starts_pages(dsn, 12)
    _finished_since_analyzed(db, "large-", 49_000)
    large = _handed_off_starts_pages(dsn, 12)
    assert large < small * 1.5 + 50, (small, large)


# --- missed wake-ups ---------------------------------------------------------------------------


def test_applying_missed_wake_ups_reads_no_history_when_none_was_missed(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    """Every worker applies missed wake-ups every second (wake_missed_waiters). With none
    missed, as nearly always, the call reads no run: the same pages with 50,000 finished runs
    as with 1,000. (Its plan may hash the runs against missed_wakeups, whose size the planner
    does not know; the hash join reads its empty outer side first and never builds it.)"""
    def pages() -> int:
        with psycopg.connect(dsn, autocommit=True) as conn:
            read, _ = pages_read(conn, "flowly.runs", "select flowly.wake_missed_waiters()")
        return read

    _finished_runs(db, "small-", 1_000)
    small = pages()
    _finished_runs(db, "large-", 49_000)
    large = pages()
    assert large < small + 20, (small, large)


# --- retries ---------------------------------------------------------------------------------


def _retry_pages_per_step(db: psycopg.Connection[Any], run_id: str, steps: int) -> float:
    """The pages of flowly.steps a retry of a run dead-lettered on EventTimeout reads, per
    step of its history (every tenth step an event wait whose timeout the body caught), with
    no statistics taken since its history grew."""
    db.execute("insert into flowly.runs (id, workflow, status, error, lease_epoch, finished_at)"
               " values (%s, 'order', 'dead_letter',"
               " '{\"type\": \"EventTimeout\", \"message\": \"no event\"}', 1, now())",
               (run_id,))
    db.execute(
        "insert into flowly.steps (run_id, name, seq, position, kind, status, output,"
        "                          started_at, finished_at)"
        " select %(run)s, 's' || p, nextval('flowly.step_seq'), p,"
        "        case when p %% 10 = 0 then 'event' else 'step' end, 'completed',"
        "        case when p %% 10 = 0 then '{\"timeout\": true}'::jsonb else '1' end,"
        "        now() - interval '1 hour' + p * interval '10 ms',"
        "        now() - interval '1 hour' + p * interval '10 ms'"
        " from generate_series(1, %(steps)s) p", {"run": run_id, "steps": steps})
    read, _ = pages_read(db, "flowly.steps", "select flowly.retry_dead_letter(%s)", run_id)
    return read / steps


def test_a_retry_reads_a_long_history_once_not_once_per_failed_wait(
        db: psycopg.Connection[Any]) -> None:
    """retry_dead_letter asks of every step whether the retry retires it, and for a failed
    wait that needs the wait that ended the run. That look-up read the run's whole history
    for each failed wait when the statistics predate it (minutes for 20,000 steps); it reads
    an index of failed waits now, so a history four times as long costs about the same per
    step (the first run's steps stay in the table the second retry scans: 0.7 and 1.0 pages
    a step)."""
    short = _retry_pages_per_step(db, "short-history", 1_000)
    long = _retry_pages_per_step(db, "long-history", 4_000)
    assert long < short * 2, (short, long)  # 4.4 times when it read the history per wait


# --- cancels -------------------------------------------------------------------------------


def _cancel_pages_per_run(dsn: str, db: psycopg.Connection[Any], parent: str, children: int,
                          depth: int) -> float:
    """The pages of flowly.runs a cancel of ``parent`` reads, per run of its family:
    ``children`` children, the first of them starting a chain ``depth`` runs deep, all
    unfinished, and no statistics taken since they were written."""
    db.execute("insert into flowly.runs (id, workflow) values (%s, 'order')", (parent,))
    db.execute("insert into flowly.runs (id, workflow, parent_run_id)"
               " select %(p)s || '-child-' || g, 'order', %(p)s"
               " from generate_series(1, %(n)s) g", {"p": parent, "n": children})
    db.execute("insert into flowly.runs (id, workflow, parent_run_id)"
               " select %(p)s || '-chain-' || g, 'order', case when g = 1"
               " then %(p)s || '-child-1' else %(p)s || '-chain-' || (g - 1) end"
               " from generate_series(1, %(d)s) g", {"p": parent, "d": depth})
    with psycopg.connect(dsn, autocommit=True) as conn:
        read, _ = pages_read(conn, "flowly.runs", "select flowly.cancel(%s)", parent)
    return read / (1 + children + depth)


def test_a_cancel_walks_a_deep_family_by_index_even_without_statistics(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    """cancel finds a family by walking parent_run_id one generation at a time. Without
    statistics (a table that grew since its last analyze) the planner joined each generation
    to the whole table by a sequential scan: a chain 2,000 deep under 20,000 children took
    7 s. It walks the index from generation to generation now, so a family four times as
    deep costs about the same per run."""
    shallow = _cancel_pages_per_run(dsn, db, "shallow", 1_000, 250)
    deep = _cancel_pages_per_run(dsn, db, "deep", 1_000, 1_000)
    assert deep < shallow * 1.8, (shallow, deep)
