"""The guarantees under attack: locked rows, refused batches, exact replay, big histories.

Each test reproduces a way the engine broke in ordinary situations (one run's data or one open
transaction hurting other runs, a replay that was not exact after retries), with real workers
and a real PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

import flowly
from flowly.worker.step_threads import StepThreads
from tests import workflows
from tests.support import pages_read, running_worker, scalar, seq_scanned, wait_for

# --- isolation: one run's trouble never hurts another --------------------------------------

def test_a_checkpoint_the_database_refuses_fails_only_its_own_run(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """30 runs checkpoint together; the database refuses one run's row (here a constraint of
    the operator's). Only that run fails, with its own error and no retries; the others'
    checkpoints land in the same flushes."""
    db.execute("alter table flowly.steps add constraint no_poison"
               " check (output is distinct from '\"poison\"')")
    good = [client.start("echo", {"value": i, "wait": 0.3}) for i in range(29)]
    bad = client.start("echo", {"value": "poison", "wait": 0.3})
    with running_worker(dsn, concurrency=64):
        runs = {r: client.wait(r, timeout=60) for r in [*good, bad]}
    assert all(runs[r].status == "completed" for r in good), {
        r: (runs[r].status, runs[r].error) for r in good if runs[r].status != "completed"}
    assert [runs[r].output for r in good] == list(range(29))
    culprit = runs[bad]
    assert culprit.status == "dead_letter"
    assert culprit.error["step"] == "echo"
    assert "no_poison" in culprit.error["message"]
    assert culprit.error["type"] == "CheckViolation"
    assert len(client.failed_attempts(bad)) == 1  # refused output: no retry can change it


def test_a_completion_the_database_refuses_fails_only_its_own_run(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """As for a checkpoint: the database refuses one run's output (an operator's constraint
    on runs) in a flush of completions. Only that run fails, with its own error and without
    retries; it was claimed again at every lease instead, its body run each time."""
    db.execute("alter table flowly.runs add constraint no_poison"
               " check (output is distinct from '\"poison\"')")
    good = [client.start("echo", {"value": i, "wait": 0.3}) for i in range(20)]
    bad = client.start("echo", {"value": "poison", "wait": 0.3})
    with running_worker(dsn, concurrency=64, lease=1.5):
        assert [client.wait(r, timeout=30).output for r in good] == list(range(20))
        culprit = client.wait(bad, timeout=30)
    assert culprit.status == "dead_letter"
    assert culprit.error["type"] == "CheckViolation"
    assert "no_poison" in culprit.error["message"]
    # one claim, then the dead letter's revocation of its lease
    assert scalar(db, "select lease_epoch from flowly.runs where id = %s", bad) == 2


@flowly.workflow("hardening.output_of")
async def output_of(ctx: flowly.Context, inp: dict[str, Any]) -> int:
    """One step returning ``chars`` characters, all runs' steps ending at the time ``at``."""
    async def give() -> str:
        await asyncio.sleep(max(0.0, inp["at"] - time.time()))
        return "x" * inp["chars"]

    return len(await ctx.step("give", give))


def test_large_outputs_that_end_together_are_flushed_apart(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """Outputs each within max_output_bytes add up: the group committer sent every write
    queued in one statement (128 of 8 MB: 1 GB), which outlasted the statement timeout and
    failed the whole batch. A flush now carries at most MAX_BATCH_CHARS of JSON (a larger
    output goes alone); an operator's statement trigger counts what each insert wrote."""
    from flowly.group_commit import MAX_BATCH_CHARS

    db.execute("create table public.step_inserts (rows bigint, chars bigint)")
    db.execute("""
        create function public.count_step_inserts() returns trigger language plpgsql as $$
        begin
            insert into public.step_inserts
            select count(*), sum(octet_length(n.output::text)) from new_steps n;
            return null;
        end $$""")
    db.execute("create trigger count_step_inserts after insert on flowly.steps"
               " referencing new table as new_steps for each statement"
               " execute function public.count_step_inserts()")
    chars = MAX_BATCH_CHARS * 3 // 4
    at = time.time() + 2
    runs = [client.start("hardening.output_of", {"chars": chars, "at": at}) for _ in range(6)]
    with running_worker(dsn, workflows=["hardening.output_of"], concurrency=8):
        assert [client.wait(r, timeout=60).output for r in runs] == [chars] * 6
    inserts = db.execute("select rows, chars from public.step_inserts"
                         " where chars > 0").fetchall()
    assert sum(rows for rows, _ in inserts) == 6
    assert max(written for _, written in inserts) < MAX_BATCH_CHARS


def test_a_flush_that_outlasts_the_statement_timeout_fails_only_the_slow_write(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any], caplog: Any
) -> None:
    """One write the database takes too long over (here an operator's trigger that sleeps on
    one run's output) cut the whole batch off at the statement timeout, and every run in it
    was abandoned until its lease lapsed. The batch is written again in halves: the others
    land, and only the slow run is abandoned."""
    db.execute("""
        create function public.slow_for_snail() returns trigger language plpgsql as $$
        begin
            if new.output = '"snail"' then perform pg_sleep(6); end if;
            return new;
        end $$""")
    db.execute("create trigger slow_for_snail before insert on flowly.steps for each row"
               " execute function public.slow_for_snail()")
    good = [client.start("echo", {"value": i, "wait": 0.5}) for i in range(7)]
    slow = client.start("echo", {"value": "snail", "wait": 0.5})
    with running_worker(dsn, concurrency=16, lease=2):
        assert [client.wait(r, timeout=60).output for r in good] == list(range(7))
    abandoned = {record.args[0] for record in caplog.records  # type: ignore[index]
                 if "abandoned until its lease expires" in str(record.msg)}
    # (a run whose row the slow batch held past its lease may still be taken over and its
    # step run again: steps are at-least-once; it is no longer given up with the batch)
    assert abandoned == {slow}, (abandoned, slow)


def test_a_checkpoint_busy_for_a_thousand_tries_is_still_tried_again(
    dsn: str, client: flowly.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pause before a busy write's next try grows with its tries: past 1,024 of them (17
    minutes of a held row) it overflowed a float, and the run failed with OverflowError. The
    pauses are cut to a millisecond here so that the thousand tries take seconds."""
    import flowly.group_commit as group_commit

    monkeypatch.setattr(group_commit, "_BUSY_PAUSE_MAX", 0.001)
    run_id = client.start("echo", {"value": 1, "wait": 1.0})
    with running_worker(dsn, concurrency=4), psycopg.connect(dsn) as holder:
        wait_for(lambda: client.get(run_id).status == "running", what="the run claimed")
        holder.execute("select 1 from flowly.runs where id = %s for update", (run_id,))
        time.sleep(10)  # more than 1,025 tries of 1 ms and a round trip each
        holder.rollback()
        run = client.wait(run_id, timeout=20)
    assert run.status == "completed", (run.status, run.error)


def test_ids_and_names_too_long_to_checkpoint_are_refused_up_front(
    client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """A run id that could not be checkpointed is refused when the run is created (WF003,
    naming the field and the limit), from Python and SQL alike."""
    for field, options in [("run_id", {"run_id": "r" * 1001}), ("queue", {"queue": "q" * 1001}),
                           ("concurrency_key", {"concurrency_key": "k" * 1001})]:
        with pytest.raises(flowly.InvalidArgument, match=f"{field} is 1001 bytes long; the"
                                                         " limit is 1000 bytes"):
            client.start("quick", None, **options)
    with pytest.raises(psycopg.Error) as info:
        db.execute("select flowly.start(repeat('w', 2000))")
    assert info.value.sqlstate == "WF003" and "workflow is 2000 bytes" in str(info.value)
    epoch = _claim_one(db, "quick", "r1")
    with pytest.raises(psycopg.Error) as info:
        db.execute("select flowly.checkpoint('r1', %s, repeat('s', 1001), '1')", (epoch,))
    assert info.value.sqlstate == "WF003"
    assert scalar(db, "select count(*) from flowly.runs") == 1


def _claim_one(db: psycopg.Connection[Any], workflow: str, run_id: str,
               lease: str = "1 hour", worker: str = "w", input: str = "{}") -> int:
    db.execute("select flowly.start(%s, %s, run_id => %s)", (workflow, input, run_id))
    return int(scalar(db, "select lease_epoch from flowly.claim(%s, array[%s], array['default'],"
                          " 1, %s::interval)", worker, workflow, lease))


def test_a_run_locked_by_an_open_transaction_delays_only_itself(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """An operator's open transaction holds one run's row longer than the lease. The worker's
    other runs keep their leases (never taken over, never re-executed); the locked run waits,
    is taken over once the lock is gone, and that takeover is no poison evidence (the worker
    was alive)."""
    # a lease of 2 s: with 1 s, a loaded machine (the heartbeat starved of CPU) let the healthy
    # runs' leases lapse after the lock was gone, and the worker took them over from itself
    runs = [client.start("slow", {"seconds": 7}) for _ in range(5)]
    locked, others = runs[0], runs[1:]
    with running_worker(dsn, lease=2.0, concurrency=8):
        wait_for(lambda: scalar(db, "select count(*) = 5 from flowly.runs"
                                    " where status = 'running'"), what="all five running")
        with psycopg.connect(dsn) as operator:
            operator.execute("select * from flowly.runs where id = %s for update", (locked,))
            time.sleep(5)  # 2.5 leases
            for run_id in others:
                assert scalar(db, "select locked_until > now() from flowly.runs where id = %s",
                              run_id), "a healthy run's lease lapsed"
        for run_id in runs:
            assert client.wait(run_id, timeout=30).status == "completed"
    epochs = dict(db.execute("select id, lease_epoch from flowly.runs").fetchall())
    assert {epochs[r] for r in others} == {1}  # claimed once, never taken over
    assert scalar(db, "select takeovers from flowly.runs where id = %s", locked) == 0


def test_heartbeat_skips_a_locked_run_and_says_so(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """heartbeat never waits: a run whose row is locked elsewhere comes back 'busy', the others
    are extended, a stale one comes back 'lost'."""
    epochs = {r: _claim_one(db, "quick", r, "1 second") for r in ("a", "b", "c")}
    db.execute("select flowly.register_worker('w', array['quick'], array['default'], '1s')")
    with psycopg.connect(dsn) as operator:
        operator.execute("select * from flowly.runs where id = 'b' for update")
        started = time.monotonic()
        rows = db.execute("select * from flowly.heartbeat('w', array['a', 'b', 'c'], %s,"
                          " '1 hour')", ([epochs["a"], epochs["b"], epochs["c"] - 1],)).fetchall()
        assert time.monotonic() - started < 1
    assert sorted(rows) == [("b", "busy"), ("c", "lost")]
    assert scalar(db, "select locked_until > now() + interval '50 minutes' from flowly.runs"
                      " where id = 'a'")


def test_cancel_of_a_locked_run_reports_busy_instead_of_hanging(
    dsn: str, client: flowly.Client
) -> None:
    run_id = client.start("quick", None)
    with psycopg.connect(dsn) as other:
        other.execute("select * from flowly.runs where id = %s for update", (run_id,))
        started = time.monotonic()
        with pytest.raises(flowly.RunBusy, match="busy"):
            client.cancel(run_id)
        assert time.monotonic() - started < 15
    assert client.cancel(run_id) == "cancelled"


def test_only_takeovers_from_dead_workers_count_towards_poison(
    db: psycopg.Connection[Any]
) -> None:
    """A lease that lapsed under a worker that still heartbeats is no evidence; one whose
    worker stopped heartbeating is. The limit is the max_takeovers setting."""
    db.execute("update flowly.settings set max_takeovers = 2")
    db.execute("select flowly.register_worker('alive', array['quick'], array['default'], '1h')")
    db.execute("select flowly.register_worker('dead', array['echo'], array['default'], '1s')")
    db.execute("update flowly.workers set last_seen_at = now() - interval '1 minute'"
               " where id = 'dead'")
    _claim_one(db, "quick", "held-by-alive", "1 millisecond", "alive")
    _claim_one(db, "echo", "held-by-dead", "1 millisecond", "dead")
    time.sleep(0.01)
    claim_all = ("select flowly.claim('other', array['quick', 'echo'], array['default'], 10,"
                 " '1 ms')")
    db.execute(claim_all)
    takeovers = dict(db.execute("select id, takeovers from flowly.runs").fetchall())
    assert takeovers == {"held-by-alive": 0, "held-by-dead": 1}

    # 'other' never heartbeats: two more lapses make the run dead to the limit of 2
    for _ in range(2):
        time.sleep(0.01)
        db.execute("update flowly.workers set last_seen_at = now() - interval '1 minute'")
        db.execute(claim_all)
    row = db.execute("select status, error ->> 'type' from flowly.runs"
                     " where id = 'held-by-dead'").fetchone()
    assert row == ("dead_letter", "PoisonRun")


def test_worker_shutdown_does_not_wait_for_a_locked_run(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    run_id = client.start("slow", {"seconds": 30})
    with psycopg.connect(dsn) as operator:
        with running_worker(dsn, drain_timeout=0.2) as worker:
            wait_for(lambda: scalar(db, "select status = 'running' from flowly.runs"
                                        " where id = %s", run_id), what="the run running")
            operator.execute("select * from flowly.runs where id = %s for update", (run_id,))
            started = time.monotonic()
            worker.stop()
        assert time.monotonic() - started < 10  # the context manager joined the worker
        operator.rollback()



def test_runs_of_a_workflow_nobody_serves_do_not_slow_other_claims(
    db: psycopg.Connection[Any]
) -> None:
    """50,000 due runs of a workflow no worker serves (a typo in a start, a workflow only a
    newer release knows) wait at the head of the queue, before 2,000 runs of a served one. A
    claim for the served workflows reads past none of them (it did, every claim: 20 ms a
    claim at 100,000), and it hands out the served runs oldest first across queues and
    workflows."""
    db.execute("insert into flowly.runs (id, workflow, scheduled_for)"
               " select 'typo-' || g, 'typo', now() - interval '1 hour'"
               " from generate_series(1, 50000) g")
    served = [scalar(db, "select flowly.start(%s, queue => %s, scheduled_for => now()"
                         " - make_interval(mins => %s))", wf, queue, 5 - i)
              for i, (wf, queue) in enumerate([("quick", "default"), ("echo", "other"),
                                               ("quick", "other"), ("echo", "default")])]
    db.execute("insert into flowly.runs (id, workflow, scheduled_for)"
               " select 'backlog-' || g, 'quick', now() from generate_series(1, 2000) g")
    db.execute("analyze flowly.runs")
    pages, _ = pages_read(db, "flowly.runs", "select flowly.claim('w', array['quick', 'echo'],"
                          " array['default', 'other'], 3, '1 minute')")
    assert pages < 400  # over 1,000 when it read past the typos
    claimed = db.execute("select id from flowly.runs where locked_by = 'w'"
                         " order by scheduled_for").fetchall()
    assert [c[0] for c in claimed] == served[:3]
    assert scalar(db, "select count(*) from flowly.runs where status = 'pending'"
                      " and workflow = 'typo'") == 50000


def test_a_worker_s_writes_do_not_read_the_runs_other_workers_hold(
    db: psycopg.Connection[Any]
) -> None:
    """3,000 runs held by other workers, statistics taken while none was running (as in a
    database whose running runs are a sliver of its history). One run's heartbeat, checkpoint,
    completion and release reach its row by key: they read a few pages. They read every running run,
    each call, through the status index (and its dead entries until a vacuum) while that index
    looked cheaper to the planner than the primary key."""
    db.execute("insert into flowly.runs (id, workflow) select 'other-' || g, 'elsewhere'"
               " from generate_series(1, 20000) g")
    db.execute("analyze flowly.runs")
    db.execute("update flowly.runs set status = 'running', locked_by = 'others', lease_epoch = 1,"
               " locked_until = now() + interval '1 hour' where id like 'other-%%'"
               " and right(id, 1) in ('1', '4', '7')")
    epoch = _claim_one(db, "quick", "mine")

    def runs_pages_read(call: str, *params: Any) -> int:
        return pages_read(db, "flowly.runs", call, *params)[0]

    assert runs_pages_read("select * from flowly.heartbeat('w', array['mine'],"
                           " array[%s::bigint], '1 hour')", epoch) < 100
    assert runs_pages_read("select flowly.checkpoint('mine', %s, 'a', '1')", epoch) < 100
    assert runs_pages_read("select flowly.complete('mine', %s, '2')", epoch) < 100
    assert scalar(db, "select status from flowly.runs where id = 'mine'") == "completed"
    epoch = _claim_one(db, "quick", "mine too")
    assert runs_pages_read("select flowly.release(array['mine too'], array[%s::bigint])",
                           epoch) < 100
    assert scalar(db, "select status from flowly.runs where id = 'mine too'") == "pending"


def _index_scans(db: psycopg.Connection[Any], table: str) -> int:
    """How many index scans of ``table`` the statistics have counted so far."""
    db.execute("select pg_stat_force_next_flush()")
    return int(scalar(db, "select idx_scan from pg_stat_user_tables where relid = %s::regclass",
                      table))


def test_batch_writes_look_up_each_run_and_step_only_as_often_as_they_write_it(
    db: psycopg.Connection[Any]
) -> None:
    """A checkpoint_steps or complete_runs batch of 40 runs, none busy, no step stored before:
    besides finding and locking its runs, each item's write costs one lookup of its run (the
    steps foreign key, or the update) and one of its step (the duplicate check). Both looked
    up each run again, and each step, to answer for a busy row or a stored step that were not
    there (an index scan per item per question, in every batch)."""
    n = 40
    db.execute("select flowly.register_worker('w', array['quick'], array['default'], '1h')")
    db.execute("select flowly.start('quick', run_id => 'r' || g) from generate_series(1, %s) g",
               (n,))
    claimed = db.execute("select run_id, lease_epoch from flowly.claim('w', array['quick'],"
                         " array['default'], %s, '1 hour')", (n,)).fetchall()
    ids, epochs = [c[0] for c in claimed], [c[1] for c in claimed]
    runs, steps = _index_scans(db, "flowly.runs"), _index_scans(db, "flowly.steps")
    written = db.execute("select * from flowly.checkpoint_steps(%s, %s, %s, %s, %s, %s, %s)",
                         (ids, epochs, ["a"] * n, ["1"] * n, [datetime.now(UTC)] * n,
                          [False] * n, [1] * n)).fetchall()
    assert [(w[0], w[2], w[3], w[4]) for w in written] == [(i, False, False, 1) for i in ids]
    assert _index_scans(db, "flowly.runs") - runs <= 2 * n + 2
    assert _index_scans(db, "flowly.steps") - steps <= n + 2
    runs = _index_scans(db, "flowly.runs")
    completed = db.execute("select * from flowly.complete_runs(%s, %s, %s)",
                           (ids, epochs, ["2"] * n)).fetchall()
    assert completed == [(i, False, False) for i in ids]
    assert _index_scans(db, "flowly.runs") - runs <= 2 * n + 2


def test_a_plan_made_on_empty_tables_does_not_scan_them_once_they_grow(
    db: psycopg.Connection[Any]
) -> None:
    """A worker that connects to a new install plans its batch writes on empty tables and
    keeps those plans: they must not read the tables through, once 20,000 steps are in them
    (one drain used to read 3 million rows of steps, a sequential scan per checkpoint)."""
    epoch = _claim_one(db, "quick", "early")
    db.execute("select flowly.checkpoint('early', %s, 'a', '1')", (epoch,))  # plans it
    _write_finished_history(db)
    pages, _ = pages_read(db, "flowly.steps", "select flowly.checkpoint('early', %s, 'b', '2')",
                          epoch)
    assert pages < 50
    assert scalar(db, "select count(*) from flowly.steps where run_id = 'early'") == 2


def test_a_claim_planned_on_empty_tables_reads_only_its_runs_history(
    db: psycopg.Connection[Any]
) -> None:
    """claim tells the worker whether each run has history to replay. Planned while steps
    was small, that look was a hash of every step of every run, built at every claim: the
    claims of a drain grew slower with every step the drain wrote."""
    db.execute("select flowly.register_worker('w', array['quick'], array['default'], '1h')")
    claim = "select * from flowly.claim('w', array['quick'], array['default'], 10, '1 hour')"
    db.execute("select flowly.start('quick', run_id => 'early')")
    db.execute(claim)  # plans it
    _write_finished_history(db)
    for i in range(3):
        db.execute("select flowly.start('quick', run_id => %s)", (f"new-{i}",))
    # new-0 was claimed before (its first lease's epoch), wrote a step, and was released
    db.execute("update flowly.runs set lease_epoch = 1 where id = 'new-0'")
    db.execute("insert into flowly.steps (run_id, name, seq, status, output, started_at)"
               " values ('new-0', 'a', nextval('flowly.step_seq'), 'completed', '1', now())")
    pages, claimed = pages_read(db, "flowly.steps", claim)
    assert pages < 50
    assert {r[0]: r[-1] for r in claimed} == {"new-0": True, "new-1": False, "new-2": False}


def test_a_claim_of_runs_never_claimed_before_reads_no_history(
    db: psycopg.Connection[Any]
) -> None:
    """A run claimed for the first time can have written nothing (only a lease holder writes
    steps and timers, and a lease epoch only grows), so claim does not look: it probed steps
    and timers once per run, in every batch of new runs."""
    db.execute("select flowly.register_worker('w', array['quick'], array['default'], '1h')")
    db.execute("select flowly.start('quick', run_id => 'r' || g) from generate_series(1, 50) g")
    _write_finished_history(db)
    claim = "select * from flowly.claim('w', array['quick'], array['default'], 50, '1 hour')"
    before = _index_scans(db, "flowly.steps")
    claimed = db.execute(claim).fetchall()
    assert len(claimed) == 50 and not any(r[-1] for r in claimed)
    assert _index_scans(db, "flowly.steps") == before
    db.execute("select flowly.release(array_agg(id), array_agg(lease_epoch)) from flowly.runs"
               " where locked_by = 'w'")
    claimed = db.execute(claim).fetchall()
    assert len(claimed) == 50 and not any(r[-1] for r in claimed)
    assert _index_scans(db, "flowly.steps") >= before + 50  # claimed before: history looked for


def _write_finished_history(db: psycopg.Connection[Any]) -> None:
    """5,000 finished runs with 20,000 steps."""
    db.execute("insert into flowly.runs (id, workflow, status, finished_at)"
               " select 'old-' || g, 'quick', 'completed', now() from generate_series(1, 5000) g")
    db.execute("insert into flowly.steps (run_id, name, seq, status, output, started_at)"
               " select 'old-' || (g % 5000 + 1), 's' || g, nextval('flowly.step_seq'),"
               " 'completed', '1', now() from generate_series(1, 20000) g")


# --- exact replay ---------------------------------------------------------------------------

def test_a_checkpoint_committed_while_claim_runs_is_replayed(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """The former holder of a run (lease expired, token still current) writes a checkpoint
    while a worker's claim is in progress (held up by another run's row). Either the claim
    already holds the run and the write is refused (busy, then lost), or the write commits and
    the new holder replays it: a committed checkpoint never runs again. (A claim that read the
    run's steps before it locked the run missed such a checkpoint and ran the step twice.)"""
    db.execute("""
        create function public.slow_first_claim() returns trigger language plpgsql as $$
        begin
            if new.id = 'r0' and old.status = 'pending' and new.status = 'running' then
                perform pg_sleep(1.5);
            end if;
            return new;
        end $$""")
    db.execute("create trigger slow_first_claim before update on flowly.runs"
               " for each row execute function public.slow_first_claim()")
    epoch = _claim_one(db, "three_steps", "r1", "1 millisecond", "former")
    time.sleep(0.01)
    db.execute("select flowly.start('three_steps', '{}', run_id => 'r0', priority => 1)")
    with running_worker(dsn):
        wait_for(lambda: scalar(db, "select count(*) from pg_stat_activity"
                                    " where datname = current_database()"
                                    " and wait_event = 'PgSleep'"), what="claim under way")
        try:
            db.execute("select flowly.checkpoint('r1', %s, 'a', '{\"step\": \"a\", \"pid\": 0}')",
                       (epoch,))
            committed = True
        except psycopg.Error as exc:
            assert exc.sqlstate in ("WF005", "WF001"), exc
            committed = False
        run = client.wait("r1", timeout=30)
        client.wait("r0", timeout=30)
    assert run.status == "completed", run.error
    executed = [r[0] for r in db.execute("select step from public.test_effects"
                                         " where run_id = 'r1' order by at")]
    if committed:
        assert run.output["a"] == {"step": "a", "pid": 0} and executed == ["b", "c"]
    else:
        assert run.output["a"]["pid"] != 0 and executed == ["a", "b", "c"]


def test_a_child_start_replays_the_recorded_id(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """start under a concurrency key held by another run returns that run; the retried body
    (the key free by then) must get the same id back, not start a new child."""
    holder = client.start("unserved", None, concurrency_key="k1")
    run_id = client.start("keyed_parent", {"key": "k1", "holder": holder})
    with running_worker(dsn, workflows=["keyed_parent", "quick"]):
        run = client.wait(run_id, timeout=30)
    assert run.status == "completed" and run.attempt == 2, run.error
    assert run.output == holder
    assert scalar(db, "select count(*) from flowly.runs where concurrency_key = 'k1'") == 1


def test_a_parallel_sibling_that_finishes_after_a_failure_is_compensated(
    dsn: str, client: flowly.Client
) -> None:
    run_id = client.start("parallel_saga", None)
    with running_worker(dsn):
        run = client.wait(run_id, timeout=30)
    assert run.status == "dead_letter" and run.error["step"] == "fails"
    outcomes = {s.name: (s.status, s.compensation_status) for s in client.steps(run_id)}
    assert outcomes == {"first": ("completed", "completed"), "late": ("completed", "completed"),
                        "fails": ("failed", None)}
    assert workflows.CALLS[run_id] == ["do:late", "undo:late", "undo:first"]
    assert run.compensation_ok is True


def test_after_retry_compensations_and_listings_follow_body_order(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """s1 and s3 are undone and re-run by retry_dead_letter, s2 is replayed: the second saga
    still undoes s3, s2, s1 (body order, not checkpoint order), steps list in body order, and
    the first saga's outcomes (s2's compensation error) stay in step_history."""
    run_id = client.start("saga", None)
    workflows.SAGA_FAILS.add(run_id)
    log = workflows.CALLS[run_id]
    with running_worker(dsn):
        assert client.wait(run_id, timeout=30).status == "dead_letter"
        log.clear()
        client.retry_dead_letter(run_id)
        run = client.wait(run_id, timeout=30)
    assert run.status == "dead_letter"
    assert log == ["do:s1", "do:s3", "do:s4", "do:s4", "undo:s3", "undo:s2", "undo:s1"]
    assert [s.name for s in client.steps(run_id)] == ["s1", "s2", "s3", "s4"]
    history = db.execute("select generation, name, compensation_status,"
                         " compensation_error ->> 'message' from flowly.step_history"
                         " where run_id = %s order by position", (run_id,)).fetchall()
    assert history == [(1, "s1", "completed", None),
                       (1, "s2", "failed", "compensation of s2 failed"),
                       (1, "s3", "completed", None), (1, "s4", None, None)]


def test_retry_re_arms_the_sleep_between_re_run_steps_and_renews_undone_steps_keys(
    dsn: str, client: flowly.Client
) -> None:
    run_id = client.start("cooling_saga", {"cooling": 1.0})
    workflows.SAGA_FAILS.add(run_id)
    log = workflows.CALLS[run_id]
    with running_worker(dsn):
        assert client.wait(run_id, timeout=30).status == "dead_letter"
        workflows.SAGA_FAILS.discard(run_id)
        log.clear()
        client.retry_dead_letter(run_id)
        run = client.wait(run_id, timeout=30)
    assert run.status == "completed" and run.generation == 2
    reserve, charge = (line.split() for line in log)
    assert reserve[0] == "reserve" and charge[0] == "charge"
    assert float(charge[1]) - float(reserve[1]) >= 0.9  # the cooling period lasted again
    # reserve was undone (released) and runs again: a new key; the failed charge was never
    # undone: the provider must be able to recognise its repeat
    assert reserve[2] == f"{run_id}:reserve:g2" and charge[2] == f"{run_id}:charge"


@flowly.workflow("charge_in_flight_at_timeout")
async def charge_in_flight_at_timeout(ctx: flowly.Context, inp: Any) -> Any:
    log = workflows.CALLS[ctx.run_id]

    def charge(key: str) -> str:
        log.append(key)  # the payment provider saw this key and charged the card
        if len(log) == 1:
            time.sleep(2.5)  # the run's timeout passes while the charge is in flight
        return "charged"

    return await ctx.step("charge", charge, ctx.idempotency_key("charge"))


def test_a_step_never_undone_keeps_its_idempotency_key_in_the_next_generation(
    dsn: str, client: flowly.Client
) -> None:
    """The charge is in flight when the run times out (dead_letter, no compensation: nothing
    was checkpointed); retry_dead_letter runs it again in generation 2. It was never undone,
    so it must charge under the same key, which the provider de-duplicates."""
    with running_worker(dsn, lease=1):  # started first: the timeout counts from the start
        run_id = client.start("charge_in_flight_at_timeout", None, timeout=1)
        run = client.wait(run_id, timeout=20)
        assert run.status == "dead_letter" and run.error["type"] == "Timeout"
        client.retry_dead_letter(run_id)
        run = client.wait(run_id, timeout=20)
    assert run.status == "completed" and run.generation == 2
    first, second = workflows.CALLS[run_id]
    assert first == second == f"{run_id}:charge"


# --- bounded work per call ------------------------------------------------------------------

def test_a_long_history_is_replayed_in_pages(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """A run whose 2,000 steps are checkpointed resumes and replays all of them (read page by
    page, never as one value), executing only the step it had not reached."""
    n = 2000
    epoch = _claim_one(db, "many_steps", "long", "1 millisecond", "former", json.dumps({"n": n}))
    db.execute("select flowly.checkpoint_steps(array_fill('long'::text, array[%(n)s]),"
               " array_fill(%(e)s::bigint, array[%(n)s]),"
               " array(select 's' || i from generate_series(0, %(n)s - 1) i),"
               " array(select to_jsonb(i) from generate_series(0, %(n)s - 1) i),"
               " array_fill(now(), array[%(n)s]), array_fill(false, array[%(n)s]),"
               " array(select i + 1 from generate_series(0, %(n)s - 1) i))",
               {"n": n, "e": epoch})
    assert scalar(db, "select has_history from flowly.claim('w', array['many_steps'],"
                      " array['default'], 10, '1 millisecond')") is True
    time.sleep(0.01)
    with running_worker(dsn):
        run = client.wait("long", timeout=60)
    assert run.status == "completed" and run.output == n * (n - 1) // 2 - 1
    assert workflows.CALLS["long"] == ["s-1"]


def test_replay_pages_are_bounded_in_rows_and_bytes(db: psycopg.Connection[Any]) -> None:
    epoch = _claim_one(db, "quick", "big")
    for i in range(6):
        db.execute("select flowly.checkpoint('big', %s, %s, to_jsonb((select string_agg("
                   "md5(random()::text), '') from generate_series(1, 4096))))", (epoch, f"s{i}"))
    budget = scalar(db, "select sum(pg_column_size(output)) from flowly.steps"
                        " where name in ('s0', 's1')")
    # a row goes in while the bytes before it fit the budget: s2 does, s3 does not
    page = db.execute("select name, more from flowly.replay('big', 0, 100, %s)",
                      (budget,)).fetchall()
    assert [p[0] for p in page] == ["s0", "s1", "s2"] and page[-1][1] is True
    assert db.execute("select name from flowly.replay('big', 0, 100, 1)").fetchall() == [
        ("s0",)]  # however large, one row always fits
    rows = db.execute("select name, more from flowly.replay('big', 0, 4)").fetchall()
    assert len(rows) == 4 and rows[-1][1] is True
    last = db.execute("select name, more from flowly.replay('big', (select seq from flowly.steps"
                      " where name = 's4'), 4)").fetchall()
    assert last == [("s5", False)]


# --- smaller defects ------------------------------------------------------------------------

def test_a_run_past_its_timeout_is_never_claimed(db: psycopg.Connection[Any]) -> None:
    """Even when the sweep does not get to it (here: disabled), claim skips a timed-out run."""
    db.execute("create or replace function flowly.dead_letter_stalled_runs() returns void"
               " language sql as 'select'")
    db.execute("select flowly.start('quick', run_id => 'late', timeout => '10 ms')")
    time.sleep(0.05)
    assert db.execute("select * from flowly.claim('w', array['quick'], array['default'], 5,"
                      " '1 hour')").fetchall() == []


def test_start_in_a_repeatable_read_transaction(dsn: str, db: psycopg.Connection[Any]) -> None:
    """An existing run id or a live concurrency key the snapshot can see: returned, no error.
    One committed after the snapshot: 40001 with a message that says to retry."""
    db.execute("select flowly.start('quick', run_id => 'seen', concurrency_key => 'k')")
    with psycopg.connect(dsn) as app:
        app.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        assert scalar(app, "select flowly.start('quick', run_id => 'seen')") == "seen"
        assert scalar(app, "select flowly.start('quick', concurrency_key => 'k')") == "seen"
        db.execute("select flowly.start('quick', run_id => 'unseen')")
        with pytest.raises(psycopg.errors.SerializationFailure, match="retry the transaction"):
            app.execute("select flowly.start('quick', run_id => 'unseen')")
        app.rollback()
        assert scalar(app, "select flowly.start('quick', run_id => 'unseen')") == "unseen"


def test_sync_step_threads_never_exceed_the_limit() -> None:
    """A cancelled wait does not free its thread's slot while the thread still runs."""
    async def scenario() -> tuple[int, bool]:
        threads = StepThreads(2)
        release = threading.Event()
        blocked = [asyncio.ensure_future(threads.run(release.wait)) for _ in range(2)]
        await asyncio.sleep(0.1)
        for task in blocked:
            task.cancel()
        third = asyncio.ensure_future(threads.run(lambda: "third"))
        await asyncio.sleep(0.2)
        running = threads.threads
        waited = not third.done()
        release.set()
        assert await asyncio.wait_for(third, 5) == "third"
        threads.close()
        return running, waited

    running, waited = asyncio.run(scenario())
    assert running <= 2 and waited


def _assert_run_counts_exact(db: psycopg.Connection[Any]) -> dict[tuple[str, str], int]:
    """Check that the run_counts view says what a count of flowly.runs says; return the counts
    per (workflow, status)."""
    exact = {(w, s): n for w, s, n in db.execute(
        "select workflow, status, count(*) from flowly.runs group by 1, 2")}
    viewed = {(w, s): n for w, s, n in db.execute("select * from flowly.run_counts")}
    assert viewed == exact
    return exact


def _waiting_on(db: psycopg.Connection[Any], target: str) -> None:
    """Start run ``waits-on-<target>``, parked on run ``target`` (due only when woken)."""
    waiter = f"waits-on-{target}"
    db.execute("select flowly.start('waiter', run_id => %s,"
               " scheduled_for => now() + interval '1 day')", (waiter,))
    db.execute("insert into flowly.waits (run_id, step, kind, target)"
               " values (%s, 'wait', 'run', %s)", (waiter, target))


@contextlib.contextmanager
def _listening_for_finished_runs(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection listening on the channel that announces finished runs."""
    with psycopg.connect(dsn, autocommit=True) as listener:
        channel = scalar(listener, "select flowly.finished_channel()")
        listener.execute(psycopg.sql.SQL("listen {}").format(psycopg.sql.Identifier(channel)))
        yield listener


def test_run_counts_stay_exact_without_reading_finished_history(
    db: psycopg.Connection[Any]
) -> None:
    """run_counts agrees with a full count through every kind of transition (completion,
    cancel, dead letter, retry, a purge, rows inserted finished), before and after the
    counters are folded, and its plan never scans runs."""
    db.execute("""
        insert into flowly.runs (id, workflow, status, created_at, finished_at, output)
        select 'old-' || g, 'wf', 'completed', now() - interval '2 days',
               now() - interval '2 days', '1'
        from generate_series(1, 20000) g""")
    for i in range(6):
        db.execute("select flowly.start('wf', run_id => %s)", (f"r{i}",))
    epochs = dict(db.execute("select run_id, lease_epoch from flowly.claim('w', array['wf'],"
                             " array['default'], 5, '1 hour')").fetchall())
    _assert_run_counts_exact(db)
    db.execute("select flowly.complete_runs(%s, %s, %s::jsonb[])",
               (["r0", "r1", "r2"], [epochs[r] for r in ("r0", "r1", "r2")], ["1"] * 3))
    db.execute("select flowly.cancel('r3')")
    db.execute("select flowly.fail_step('r4', %s, 's', '{\"message\": \"no\"}', now(), 1,"
               " 'fixed', 1, 1)", (epochs["r4"],))
    _assert_run_counts_exact(db)
    db.execute("select flowly.fold_run_counts()")
    _assert_run_counts_exact(db)
    db.execute("select flowly.retry_dead_letter('r4')")
    db.execute("delete from flowly.runs where id like 'old-1%'")
    _assert_run_counts_exact(db)
    db.execute("select flowly.fold_run_counts()")
    _assert_run_counts_exact(db)
    assert scalar(db, "select count(*) from flowly.run_count_deltas") == 0

    db.execute("analyze flowly.runs")
    for view in ("run_counts", "queue_backlog", "throughput", "step_latency", "dead_letters"):
        assert "runs" not in seq_scanned(db, f"select * from flowly.{view}"), view


def test_runs_finished_together_are_booked_together(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """One complete_runs of 30 runs: one count delta per workflow, not one per run; the runs
    waiting on any of them all woken; one finished notification per run, for Client.wait."""
    ids = [f"r{i}" for i in range(30)]
    for run_id in ids:
        db.execute("select flowly.start(%s, run_id => %s)",
                   ("wf-odd" if int(run_id[1:]) % 2 else "wf-even", run_id))
    for target in ("r3", "r4", "r5"):
        _waiting_on(db, target)
    epochs = dict(db.execute(
        "select run_id, lease_epoch from flowly.claim('w', array['wf-even', 'wf-odd'],"
        " array['default'], 30, '1 hour')").fetchall())
    db.execute("delete from flowly.run_count_deltas")
    with _listening_for_finished_runs(dsn) as listener:
        rows = db.execute("select * from flowly.complete_runs(%s, %s, %s::jsonb[])",
                          (ids, [epochs[r] for r in ids], ["1"] * 30)).fetchall()
        assert all(not lost and not busy for _, lost, busy in rows)
        notified = [n.payload for n in listener.notifies(timeout=2, stop_after=30)]
    assert sorted(notified) == sorted(ids)
    deltas = db.execute("select workflow, delta from flowly.run_count_deltas"
                        " order by workflow").fetchall()
    assert deltas == [("wf-even", 15), ("wf-odd", 15)]
    woken = db.execute("select id from flowly.runs where id like 'waits-on-%%'"
                       " and scheduled_for <= now() order by id").fetchall()
    assert woken == [("waits-on-r3",), ("waits-on-r4",), ("waits-on-r5",)]


def test_a_run_held_by_another_session_stays_out_of_its_batch_s_bookkeeping(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """An operator's open transaction holds one run's row while complete_runs finishes a
    batch: the held run comes back busy and is neither counted, announced nor allowed to wake
    its waiter; the others are. The operator then cancels it: the worker's next try is refused
    as lost, and the run is counted once, as cancelled."""
    ids = [f"r{i}" for i in range(6)]
    for run_id in ids:
        db.execute("select flowly.start('wf', run_id => %s)", (run_id,))
    for target in ("r0", "r1"):
        _waiting_on(db, target)
    epochs = dict(db.execute("select run_id, lease_epoch from flowly.claim('w', array['wf'],"
                             " array['default'], 6, '1 hour')").fetchall())
    with _listening_for_finished_runs(dsn) as listener, psycopg.connect(dsn) as operator:
        operator.execute("select from flowly.runs where id = 'r0' for update")
        rows = db.execute("select * from flowly.complete_runs(%s, %s, %s::jsonb[])",
                          (ids, [epochs[r] for r in ids], ["1"] * 6)).fetchall()
        assert {r: (lost, busy) for r, lost, busy in rows} == {
            "r0": (False, True), **{r: (False, False) for r in ids[1:]}}
        notified = [n.payload for n in listener.notifies(timeout=1, stop_after=6)]
        assert sorted(notified) == ids[1:]
        _assert_run_counts_exact(db)
        woken = db.execute("select id from flowly.runs where id like 'waits-on-%%'"
                           " and scheduled_for <= now()").fetchall()
        assert woken == [("waits-on-r1",)]

        operator.execute("select flowly.cancel('r0')")
        operator.commit()
        rows = db.execute("select * from flowly.complete_runs(array['r0'], %s::bigint[],"
                          " array['1'::jsonb])", ([epochs["r0"]],)).fetchall()
        assert rows == [("r0", True, False)]
    assert scalar(db, "select status from flowly.runs where id = 'r0'") == "cancelled"
    counts = _assert_run_counts_exact(db)
    assert counts[("wf", "cancelled")] == 1 and counts[("wf", "completed")] == 5


def test_the_hot_calls_run_no_update_of_runs_that_changes_nothing(
    db: psycopg.Connection[Any]
) -> None:
    """Every update statement of runs calls the finished-run trigger, even one that changes
    no row. A checkpoint and the stalled-run sweep (every claim and heartbeat runs one) used
    to run such an update at every call; now only the statements that change runs do."""
    db.execute("create schema probe")
    db.execute("create table probe.update_statements (n serial)")
    db.execute("create function probe.count_update_statement() returns trigger"
               " language plpgsql as $$ begin"
               " insert into probe.update_statements default values; return null; end $$")
    db.execute("create trigger count_updates after update on flowly.runs"
               " for each statement execute function probe.count_update_statement()")

    def updates(call: str, *params: Any) -> int:
        db.execute("truncate probe.update_statements")
        db.execute(call, params)
        return int(scalar(db, "select count(*) from probe.update_statements"))

    db.execute("select flowly.start('wf', run_id => 'r')")
    db.execute("select flowly.register_worker('w', array['wf'], array['default'], '1 hour')")
    assert updates("select flowly.claim('w', array['wf'], array['default'], 1,"
                   " '1 hour')") == 1
    epoch = scalar(db, "select lease_epoch from flowly.runs")
    assert updates("select flowly.dead_letter_stalled_runs()") == 0
    assert updates("select flowly.checkpoint_steps(array['r'], array[%s]::bigint[],"
                   " array['s'], array['1'::jsonb], array[now()], array[false], array[1])",
                   epoch) == 0
    assert updates("select flowly.heartbeat('w', array['r'], array[%s]::bigint[],"
                   " '1 hour')", epoch) == 1
    assert updates("select flowly.complete_runs(array['r'], array[%s]::bigint[],"
                   " array['1'::jsonb])", epoch) == 1


def test_stopping_a_busy_worker_always_ends_its_background_loops(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """The worker's periodic loops (schedule ticks, claims) call the database all the time.
    A stop that lands just as one of those calls returns must still end the loop: on Python
    3.11 ``asyncio.wait_for`` returned the call's result instead of the cancellation, the
    loop went on, the shutdown overran and was cut short before the worker unregistered."""
    for _ in range(40):
        with running_worker(dsn, poll_interval=0.0001, drain_timeout=0.1) as worker:
            wait_for(lambda: scalar(db, "select count(*) = 1 from flowly.workers"),
                     what="the worker registered")
            time.sleep(0.05)
            started = time.monotonic()
            worker.stop()
        # a lost cancellation always overruns (drain_timeout + 5 s); a call that waits for
        # the disk may take a moment
        assert time.monotonic() - started < 5, "the shutdown overran"
        assert scalar(db, "select count(*) from flowly.workers") == 0
