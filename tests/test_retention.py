"""Retention: purging finished history in bounded batches, from SQL, Python, the CLI and the
worker, without touching live work."""

from __future__ import annotations

import json
import logging
import time
import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import flowly
from tests import workflows
from tests.support import (
    checkpoint_as,
    claim_as,
    in_thread,
    pages_read,
    running_worker,
    scalar,
    wait_for,
    waiting_on_lock,
)
from tests.test_cli import flowly as flowly_cli
from tests.test_cli import ok


def _history(db: psycopg.Connection[Any], count: int, age: str = "2 days") -> None:
    """``count`` finished runs (a third each completed, cancelled, dead-lettered) that
    finished ``age`` ago, each with a step, a failed attempt and a timer."""
    db.execute("""
        insert into flowly.runs (id, workflow, status, finished_at, created_at)
        select 'old-' || g, 'wf', (array['completed', 'cancelled', 'dead_letter'])[g %% 3 + 1],
               now() - %(age)s::interval, now() - %(age)s::interval
        from generate_series(1, %(n)s) g""", {"n": count, "age": age})
    db.execute("""
        insert into flowly.steps (run_id, name, seq, status, started_at)
        select id, 's', nextval('flowly.step_seq'), 'completed', now() from flowly.runs
        where id like 'old-%'""")
    db.execute("""
        insert into flowly.step_attempts (run_id, step_name, generation, attempt, error,
                                          started_at)
        select id, 's', 1, 1, '{}', now() from flowly.runs where id like 'old-%'""")
    db.execute("""
        insert into flowly.timers (run_id, name, wake_at)
        select id, 't', now() from flowly.runs where id like 'old-%'""")


def _claim_buffers(db: psycopg.Connection[Any]) -> int:
    """Buffers one warm claim of one run touches (a first call also plans its queries)."""
    db.execute("select flowly.start('wf') from generate_series(1, 2)")
    db.execute("select flowly.claim('w', array['wf'], array['default'], 1, '1 hour')")
    plan = db.execute("explain (analyze, buffers, format json) select * from flowly.claim("
                      "'w', array['wf'], array['default'], 1, '1 hour')").fetchone()[0]
    plan = plan if isinstance(plan, list) else json.loads(plan)
    return int(plan[0]["Plan"].get("Shared Hit Blocks", 0)
               + plan[0]["Plan"].get("Shared Read Blocks", 0))


def test_purge_deletes_old_finished_runs_in_batches_and_nothing_live(
    dsn: str, db: psycopg.Connection[Any], client: flowly.Client
) -> None:
    _history(db, 3000)
    live = [client.start("quick", None) for _ in range(3)]
    running = scalar(db, "select run_id from flowly.claim('w', array['quick'], array['default'],"
                         " 1, '1 hour')")
    recent = client.start("quick", None, run_id="recent")
    db.execute("select flowly.cancel('recent')")  # finished, but not old enough
    before = _claim_buffers(db)

    assert client.purge(timedelta(days=1), statuses=["completed"], batch=300) == 1000
    assert scalar(db, "select count(*) from flowly.runs where status = 'completed'") == 0
    assert scalar(db, "select flowly.purge('1 day', batch => 1500)") == 1500
    assert client.purge(86400) == 500
    assert client.purge(timedelta(days=1)) == 0
    assert scalar(db, "select count(*) from flowly.runs where id like 'old-%%'") == 0
    for table in ("steps", "step_attempts", "timers"):
        assert scalar(db, f"select count(*) from flowly.{table}") == 0, table
    assert {r.id for r in client.list_runs(limit=100)} >= {*live, recent}
    assert client.get(running).status == "running"
    counts = {(w, s): n for w, s, n in db.execute("select * from flowly.run_counts")}
    assert counts == {(w, s): n for w, s, n in db.execute(
        "select workflow, status, count(*) from flowly.runs group by 1, 2")}

    db.execute("vacuum analyze flowly.runs")
    assert _claim_buffers(db) <= before * 1.5  # claim cost is about what it was


def test_purge_reads_the_runs_it_keeps_once_a_round_not_at_every_batch(
    db: psycopg.Connection[Any], client: flowly.Client
) -> None:
    """2,000 old children of a running parent that has not read them (purge keeps them) are
    the oldest finished runs, 2,000 deletable ones come after them. Each batch read and
    checked all the kept ones again before it reached a run it could delete; a batch now
    goes on where the last one stopped, for the children's status too, although it deleted
    none of them. A loop until a short batch still deletes everything it may, and once the
    parent has finished, a new loop goes round from the oldest and deletes the children
    too."""
    db.execute("select flowly.register_worker('w', array['fan'], array['default'], '1h')")
    db.execute("select flowly.start('fan', run_id => 'parent')")
    (epoch,) = db.execute("select lease_epoch from flowly.claim('w', array['fan'],"
                          " array['default'], 1, '1 hour')").fetchone()
    db.execute("""
        insert into flowly.runs (id, workflow, status, parent_run_id, finished_at, created_at)
        select 'kid-' || g, 'kid', 'cancelled', 'parent',
               now() - interval '10 days' + g * interval '1 ms', now() - interval '11 days'
        from generate_series(1, 2000) g""")
    db.execute("""
        insert into flowly.runs (id, workflow, status, finished_at, created_at)
        select 'old-' || g, 'old', 'completed',
               now() - interval '9 days' + (g / 10) * interval '1 ms', now() - interval '11 days'
        from generate_series(1, 2000) g""")  # ten at a time finished together
    db.execute("analyze flowly.runs")
    purge = "select flowly.purge('1 day', batch => 100)"
    first, deleted = pages_read(db, "flowly.runs", purge)
    assert deleted == [(100,)]
    second, deleted = pages_read(db, "flowly.runs", purge)
    assert deleted == [(100,)]
    assert second < first / 3, (first, second)  # 2,000 kept runs read or 100 deletable

    assert client.purge(timedelta(days=1), batch=100) == 1800
    assert scalar(db, "select count(*) from flowly.runs where id like 'old-%%'") == 0
    assert scalar(db, "select count(*) from flowly.runs where id like 'kid-%%'") == 2000
    assert scalar(db, "select count(*) from flowly.purge_positions") == 0
    db.execute("select flowly.complete('parent', %s, 'null')", (epoch,))
    assert client.purge(timedelta(days=1), batch=300) == 2000
    assert scalar(db, "select count(*) from flowly.runs where id like 'kid-%%'") == 0
    assert client.get("parent").status == "completed"


def test_purges_at_once_share_the_positions_and_delete_everything_they_may(dsn: str) -> None:
    """Three loops of small batches at once, over 3,000 deletable runs of three statuses
    between and after 600 kept ones: they take different runs (skip locked), write the same
    positions in turn, and between them delete every deletable run and no kept one, with
    no error and no deadlock."""
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute("select flowly.register_worker('w', array['fan'], array['default'], '1h')")
        db.execute("select flowly.start('fan', run_id => 'parent')")
        db.execute("select flowly.claim('w', array['fan'], array['default'], 1, '1 hour')")
        db.execute("""
            insert into flowly.runs (id, workflow, status, parent_run_id, finished_at)
            select 'r-' || g, 'wf', (array['completed', 'cancelled', 'dead_letter'])[g % 3 + 1],
                   case when g % 6 = 0 then 'parent' end,
                   now() - interval '5 days' + (g / 7) * interval '1 ms'
            from generate_series(1, 3600) g""")

    def loop() -> int:
        deleted = 0
        with psycopg.connect(dsn, autocommit=True) as conn:
            while (n := scalar(conn, "select flowly.purge('1 day', batch => 25)")) > 0:
                deleted += n
        return deleted

    loops = [in_thread(loop) for _ in range(3)]
    for thread, _ in loops:
        thread.join(120)
    outcomes = [outcome for _, outcome in loops]
    assert all("error" not in o for o in outcomes), outcomes
    with psycopg.connect(dsn, autocommit=True) as db:
        assert scalar(db, "select flowly.purge('1 day')") == 0
        left = {r[0] for r in db.execute("select id from flowly.runs where id like 'r-%%'")}
    assert left == {f"r-{g}" for g in range(6, 3601, 6)}
    assert sum(o["result"] for o in outcomes) == 3000


def test_a_finished_family_goes_whole_in_one_purge(db: psycopg.Connection[Any]) -> None:
    """Control for the rule that keeps a run while a run it started is there (0076): a
    completed family (a root, three children, a grandchild under one, its parent having
    finished before it) is deleted by one call, as before, and nothing of it is left."""
    db.execute("""
        insert into flowly.runs (id, workflow, status, parent_run_id, finished_at, created_at)
        values ('root', 'wf', 'completed', null, now() - interval '2 days 1 minute',
                now() - interval '3 days'),
               ('kid-1', 'wf', 'completed', 'root', now() - interval '2 days 2 minutes',
                now() - interval '3 days'),
               ('kid-2', 'wf', 'cancelled', 'root', now() - interval '2 days 2 minutes',
                now() - interval '3 days'),
               ('kid-3', 'wf', 'completed', 'root', now() - interval '2 days 3 minutes',
                now() - interval '3 days'),
               ('grandkid', 'wf', 'completed', 'kid-3', now() - interval '2 days',
                now() - interval '3 days')""")
    assert scalar(db, "select flowly.purge('1 day')") == 5
    assert scalar(db, "select count(*) from flowly.runs") == 0


@pytest.mark.parametrize("finished", ["top first", "end first"])
def test_a_chain_deeper_than_a_batch_goes_a_batch_a_call(
    db: psycopg.Connection[Any], finished: str
) -> None:
    """A chain of 2,500 completed runs, each the child of the one before, finished from its
    top down (each run started the next and completed) or from its end up (each waited for
    the one it started). purge may delete a run only once the run it started is gone, or
    the run that started it: one generation a statement, through the chain from where it
    began, a batch a call (1,000, 1,000, 500), not a generation a call."""
    step = "+" if finished == "top first" else "-"
    db.execute(f"""
        insert into flowly.runs (id, workflow, status, parent_run_id, finished_at, created_at)
        select 'link-' || g, 'wf', 'completed', case when g > 1 then 'link-' || (g - 1) end,
               now() - interval '2 days' {step} g * interval '1 ms', now() - interval '3 days'
        from generate_series(1, 2500) g""")
    db.execute("analyze flowly.runs")
    deleted = []
    while n := scalar(db, "select flowly.purge('1 day')"):
        deleted.append(n)
        assert len(deleted) < 10, deleted
    assert deleted == [1000, 1000, 500]
    assert scalar(db, "select count(*) from flowly.runs") == 0


def test_a_chain_of_runs_each_starting_the_next_is_purged_up_to_its_live_end(
    db: psycopg.Connection[Any],
) -> None:
    """A run that starts its successor and completes, 300 times over, the last one still
    running: every completed run of the chain goes (nothing above any of them can be
    cancelled, so no walk of the family needs them), in one call; the running end stays."""
    db.execute("""
        insert into flowly.runs (id, workflow, status, parent_run_id, finished_at, created_at)
        select 'tick-' || g, 'wf', case when g = 300 then 'running' else 'completed' end,
               case when g > 1 then 'tick-' || (g - 1) end,
               case when g < 300 then now() - interval '2 days' + g * interval '1 ms' end,
               now() - interval '3 days'
        from generate_series(1, 300) g""")
    assert scalar(db, "select flowly.purge('1 day')") == 299
    assert [r[0] for r in db.execute("select id from flowly.runs")] == ["tick-300"]


def test_purge_skips_a_locked_run_and_never_waits(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    _history(db, 3)
    with psycopg.connect(dsn) as other:
        other.execute("select * from flowly.runs where id = 'old-1' for update")
        started = time.monotonic()
        assert scalar(db, "select flowly.purge('1 day')") == 2
        assert time.monotonic() - started < 2
    assert scalar(db, "select flowly.purge('1 day')") == 1


def test_purge_keeps_a_run_a_table_of_the_application_references_and_deletes_the_rest(
    db: psycopg.Connection[Any]
) -> None:
    """An application's table with a foreign key to flowly.runs (an order pointing at the run
    that handled it, without ON DELETE CASCADE) refused the batch's one delete: every purge
    failed on the oldest batch, and nothing was ever purged again. The referenced run is kept
    (with a warning) and the others go."""
    _history(db, 5)
    db.execute("create table public.orders (id int, run_id text references flowly.runs (id))")
    db.execute("insert into public.orders values (1, 'old-2'), (2, 'old-4')")
    notices: list[str] = []
    db.add_notice_handler(lambda notice: notices.append(str(notice.message_primary)))
    assert scalar(db, "select flowly.purge('1 day')") == 3
    assert [r[0] for r in db.execute("select id from flowly.runs order by id")] == [
        "old-2", "old-4"]
    assert notices == ["purge kept 2 finished run(s) that other tables still reference"
                       " (foreign keys without on delete cascade), such as old-2"]
    db.execute("delete from public.orders where id = 1")
    assert scalar(db, "select flowly.purge('1 day')") == 1
    assert scalar(db, "select flowly.purge('1 day')") == 0


@pytest.mark.parametrize("deferred", ["initially deferred", "initially immediate"])
def test_purge_keeps_a_run_a_deferrable_foreign_key_references_and_deletes_the_rest(
    db: psycopg.Connection[Any], deferred: str
) -> None:
    """The same with the key DEFERRABLE (as Django makes every foreign key): checked at
    commit, the violation came after purge could catch it, and failed the whole transaction,
    so every purge failed on the same oldest batch. Purge checks such keys at once within
    its own statements, and leaves the key's mode as it was for the rest of the
    transaction."""
    _history(db, 5)
    db.execute("create table public.orders (id int, run_id text references flowly.runs (id)"
               f" deferrable {deferred})")
    db.execute("insert into public.orders values (1, 'old-2')")
    assert scalar(db, "select flowly.purge('1 day')") == 4
    assert [r[0] for r in db.execute("select id from flowly.runs")] == ["old-2"]
    inserted = False
    with pytest.raises(psycopg.errors.ForeignKeyViolation), db.transaction():
        assert scalar(db, "select flowly.purge('1 day')") == 0
        db.execute("insert into public.orders values (2, 'no-such-run')")
        inserted = True
    # a deferred key is still checked at the commit, an immediate one at the statement
    assert inserted == (deferred == "initially deferred")


@pytest.mark.parametrize(("call", "problem"), [
    ("flowly.purge(null)", "older_than"),
    ("flowly.purge('-1 day')", "older_than"),
    ("flowly.purge('1 day', array['running'])", "statuses must be finished statuses"),
    ("flowly.purge('1 day', batch => 0)", "batch must be a positive"),
])
def test_purge_refuses_bad_arguments(db: psycopg.Connection[Any], call: str,
                                     problem: str) -> None:
    with pytest.raises(psycopg.Error) as info:
        db.execute(f"select {call}")
    assert info.value.sqlstate == "WF003" and problem in str(info.value)


def test_flowly_purge_on_the_command_line(dsn: str, db: psycopg.Connection[Any]) -> None:
    _history(db, 30)
    out = ok(flowly_cli("purge", "--older-than", "1d", "--status", "cancelled", dsn=dsn))
    assert "purged 10 run(s)" in out
    out = ok(flowly_cli("--json", "purge", "--older-than", "1d", dsn=dsn))
    assert json.loads(out)["deleted"] == 20
    bad = flowly_cli("purge", "--older-than", "soon", dsn=dsn)
    assert bad.returncode != 0 and "soon" in bad.stderr


def test_a_worker_purges_old_history_when_asked(
    dsn: str, db: psycopg.Connection[Any], client: flowly.Client
) -> None:
    _history(db, 50)
    with running_worker(dsn, purge_after=timedelta(hours=1)):
        fresh = client.wait(client.start("quick", 1), timeout=30)
        deadline = time.monotonic() + 20
        while scalar(db, "select count(*) from flowly.runs where id like 'old-%%'") and (
                time.monotonic() < deadline):
            time.sleep(0.1)
    assert scalar(db, "select count(*) from flowly.runs where id like 'old-%%'") == 0
    assert client.get(fresh.id).status == "completed"  # finished, but not old enough


def test_a_worker_purges_past_a_run_the_application_references(
    dsn: str, db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A batch short of a run a foreign key keeps is not the end: the worker went on only a
    minute later, a batch a minute while such runs came up. It logs purge's warning."""
    _history(db, 2_500)
    db.execute("create table public.orders (id int, run_id text references flowly.runs (id))")
    db.execute("insert into public.orders"
               " select g, 'old-' || g from generate_series(1, 2500, 100) g")
    with running_worker(dsn, purge_after=timedelta(hours=1)):
        # a batch a minute would take 25 minutes; a loaded machine may take more than 20 s
        deadline = time.monotonic() + 60
        while scalar(db, "select count(*) from flowly.runs where id like 'old-%%'") > 25 and (
                time.monotonic() < deadline):
            time.sleep(0.1)
    assert scalar(db, "select count(*) from flowly.runs where id like 'old-%%'") == 25
    assert any("purge kept" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records if r.name.startswith("flowly")), caplog.text


@flowly.workflow("fresh_token")
async def fresh_token(ctx: flowly.Context, inp: Any) -> str:
    """One step whose output differs at every execution: a replay shows as the same token."""
    return await ctx.step("token", _new_token)


async def _new_token() -> str:
    return uuid.uuid4().hex


@pytest.mark.parametrize("removal", [
    "delete from flowly.runs where id = 'reused'",
    "truncate flowly.runs cascade",
])
def test_a_run_removed_by_hand_takes_its_checkpoints_and_its_id_starts_afresh(
    dsn: str, db: psycopg.Connection[Any], client: flowly.Client, removal: str
) -> None:
    with running_worker(dsn):
        first = client.wait(client.start("fresh_token", None, run_id="reused"), timeout=30)
        assert scalar(db, "select count(*) from flowly.steps where run_id = 'reused'") == 1
        db.execute(removal)
        assert scalar(db, "select count(*) from flowly.steps") == 0
        again = client.wait(client.start("fresh_token", None, run_id="reused"), timeout=30)
    assert again.status == first.status == "completed"
    assert again.output != first.output  # run, not replayed from the deleted run's step


def _execute(dsn: str, statement: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(statement)


def _transactional_checkpoint(conn: psycopg.Connection[Any], run_id: str, epoch: int) -> None:
    """A transactional step's checkpoint, in the transaction flowly opened for it (its lock on
    the run is the weakest of the writers of steps: for key share)."""
    conn.execute("select set_config('flowly.step_transaction_of', %s, true)", (run_id,))
    row = conn.execute(
        "select seq from flowly.checkpoint_transaction(%s, %s, 't', '1', now(), false, 1)",
        (run_id, epoch)).fetchone()
    assert row is not None and row[0] is not None


@pytest.mark.parametrize("kind", ["step", "transaction"])
def test_a_delete_waiting_on_a_checkpoint_deletes_the_step_it_committed(
    dsn: str, db: psycopg.Connection[Any], kind: str
) -> None:
    """The checkpoint's lock on the run holds the delete back until its step is committed; the
    delete then takes that step too, leaving none behind for the run's id."""
    db.execute("select flowly.start('wf', run_id => 'doomed')")
    epoch = claim_as(db, "wf")["doomed"]
    with psycopg.connect(dsn) as checkpointing:
        if kind == "step":
            lease_lost, busy, seq = checkpoint_as(checkpointing, "doomed", epoch)
            assert (lease_lost, busy) == (False, False) and seq is not None
        else:
            _transactional_checkpoint(checkpointing, "doomed", epoch)
        thread, result = in_thread(_execute, dsn, "delete from flowly.runs where id = 'doomed'")
        wait_for(lambda: waiting_on_lock(db, "delete from flowly.runs%"))
        checkpointing.commit()
    thread.join(10)
    assert not thread.is_alive() and "error" not in result, result
    assert scalar(db, "select count(*) from flowly.steps where run_id = 'doomed'") == 0


def test_a_checkpoint_of_a_deleted_run_is_lost_and_writes_nothing(
    db: psycopg.Connection[Any]
) -> None:
    db.execute("select flowly.start('wf', run_id => 'gone')")
    epoch = claim_as(db, "wf")["gone"]
    db.execute("delete from flowly.runs where id = 'gone'")
    assert checkpoint_as(db, "gone", epoch) == (True, False, None)
    assert scalar(db, "select count(*) from flowly.steps") == 0


def test_a_deleted_run_in_a_batch_of_checkpoints_is_lost_alone(
    db: psycopg.Connection[Any]
) -> None:
    """One run deleted by hand among the runs of a group-committed batch: its item is lost
    and writes no step; the others are written as if it were not there."""
    for run_id in ("before", "gone", "after"):
        db.execute("select flowly.start('wf', run_id => %s)", (run_id,))
    epochs = claim_as(db, "wf")
    db.execute("delete from flowly.runs where id = 'gone'")
    ids = ["before", "gone", "after"]
    rows = db.execute(
        "select run_id, lease_lost, busy, seq is not null from flowly.checkpoint_steps("
        "%s, %s, array['s', 's', 's'], array['1', '2', '3']::jsonb[],"
        " array[now(), now(), now()], array[false, false, false], array[1, 1, 1])",
        (ids, [epochs[i] for i in ids])).fetchall()
    assert rows == [("before", False, False, True), ("gone", True, False, False),
                    ("after", False, False, True)]
    assert db.execute("select run_id, output from flowly.steps order by run_id").fetchall() \
        == [("after", 3), ("before", 1)]


def test_a_retried_saga_deleted_takes_its_whole_history_and_its_id_starts_afresh(
    dsn: str, db: psycopg.Connection[Any], client: flowly.Client
) -> None:
    """A run that compensated, was retried and compensated again, then deleted: its steps
    (by trigger), failed attempts and compensation history all go, and a run started again
    under its id runs every step anew instead of replaying or compensating the old ones."""
    run_id = "saga-again"
    workflows.SAGA_FAILS.add(run_id)
    try:
        with running_worker(dsn):
            client.start("saga", None, run_id=run_id)
            assert client.wait(run_id, timeout=30).status == "dead_letter"
            client.retry_dead_letter(run_id)
            assert client.wait(run_id, timeout=30).status == "dead_letter"
            history = ("steps", "step_attempts", "step_history")
            before = {t: scalar(db, f"select count(*) from flowly.{t} where run_id = %s",
                                run_id) for t in history}
            assert all(before.values()), before  # a history in each table to delete
            db.execute("delete from flowly.runs where id = %s", (run_id,))
            assert {t: scalar(db, f"select count(*) from flowly.{t} where run_id = %s",
                              run_id) for t in history} == dict.fromkeys(history, 0)
            workflows.SAGA_FAILS.discard(run_id)
            workflows.CALLS[run_id].clear()
            client.start("saga", None, run_id=run_id)
            run = client.wait(run_id, timeout=30)
    finally:
        workflows.SAGA_FAILS.discard(run_id)
    assert run.status == "completed" and run.output == "ok" and run.generation == 1
    assert workflows.CALLS[run_id] == ["do:s1", "do:s2", "do:s3", "do:s4"]
