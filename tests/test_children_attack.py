"""Attacks on child runs and waits (ctx.start / ctx.run / ctx.wait_for_run /
ctx.wait_for_event / ctx.sleep): retries, cancels, takeovers and replays of what a wait
returned."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg

import flowly
from tests.support import checkpoint_as, running_worker, scalar, wait_for

# -- workflows -------------------------------------------------------------------------------

@flowly.workflow("tc_flaky", max_attempts=1)
async def tc_flaky(ctx: flowly.Context, inp: Any) -> Any:
    """Fails in its first generation, completes once retry_dead_letter restarted it."""
    if ctx.generation == 1:
        raise ValueError(f"{inp}: broken in generation 1")
    return f"{inp} ok"


@flowly.workflow("tc_gather_waiter", max_attempts=1)
async def tc_gather_waiter(ctx: flowly.Context, inp: list[str]) -> Any:
    """Fan-in over runs that already exist."""
    return await asyncio.gather(*(ctx.wait_for_run(r) for r in inp))


@flowly.workflow("tc_echo", max_attempts=1)
async def tc_echo(ctx: flowly.Context, inp: Any) -> Any:
    return inp


def _pause(label: str, seconds: float) -> str:
    time.sleep(seconds)
    return label


@flowly.workflow("tc_branch_children", max_attempts=1)
async def tc_branch_children(ctx: flowly.Context, inp: Any) -> Any:
    """Two parallel branches, each a step then a child of the same workflow: the branch
    listed first reaches its child last in the first execution."""
    async def branch(label: str, seconds: float) -> Any:
        await ctx.step(f"prep-{label}", _pause, label, seconds)
        got = await ctx.run("tc_echo", label)
        return {"branch": label, "child said": got}

    return await asyncio.gather(branch("slow", 0.6), branch("fast", 0.0))


@flowly.workflow("tc_branch_events", max_attempts=1)
async def tc_branch_events(ctx: flowly.Context, inp: Any) -> Any:
    """Two parallel branches, each a step then a wait for event 'x', then a step that uses the
    payload; then a wait for 'go' so that the run replays."""
    async def branch(label: str, seconds: float) -> Any:
        await ctx.step(f"prep-{label}", _pause, label, seconds)
        payload = await ctx.wait_for_event("x")
        used = await ctx.step(f"use-{label}", lambda: payload)
        return {"branch": label, "payload now": payload, "payload used": used}

    got = await asyncio.gather(branch("slow", 0.6), branch("fast", 0.0))
    await ctx.wait_for_event("go")
    return got


# -- helpers ---------------------------------------------------------------------------------

def _status(db: psycopg.Connection[Any], run_id: str) -> str:
    return str(scalar(db, "select status from flowly.runs where id = %s", run_id))


def _parked(db: psycopg.Connection[Any], run_id: str) -> bool:
    return bool(scalar(db, "select status = 'pending' and locked_by is null"
                           " and scheduled_for > now() + interval '1 hour'"
                           " from flowly.runs where id = %s", run_id))


# -- tests -----------------------------------------------------------------------------------

def test_retrying_a_fan_in_parent_after_both_failed_runs_were_retried_completes(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """A parent gathers two runs that both dead-lettered: both failures are recorded in one
    execution, and the parent dead-letters (ChildFailed). The operator retries both runs,
    which complete, then the parent: README says the retried parent asks for the outcome
    again, so it must complete now, in one retry."""
    for name in ("a", "b"):
        client.start("tc_flaky", name, run_id=f"tc-{name}")
    with running_worker(dsn, workflows=[tc_flaky, tc_gather_waiter]):
        for name in ("a", "b"):
            assert client.wait(f"tc-{name}", timeout=20).status == "dead_letter"
        parent = client.start("tc_gather_waiter", ["tc-a", "tc-b"], run_id="tc-p")
        assert client.wait(parent, timeout=20).status == "dead_letter"
        # both failures were recorded by the parent
        assert scalar(db, "select count(*) from flowly.steps where run_id = %s and kind = 'run'"
                          " and output->>'status' = 'dead_letter'", parent) == 2
        for name in ("a", "b"):
            client.retry_dead_letter(f"tc-{name}")
            assert client.wait(f"tc-{name}", timeout=20).status == "completed"
        client.retry_dead_letter(parent)
        run = client.wait(parent, timeout=20)
    assert run.status == "completed", (
        f"parent {run.status} again after both runs it waits for completed: {run.error}")
    assert run.output == ["a ok", "b ok"]


def test_parallel_branches_get_their_own_child_back_on_replay(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """Branch 'slow' (listed first in gather) starts its child after branch 'fast' did in the
    first execution. The parent parks; when it replays, each branch must get back the child
    it started (the id ctx.start returned is 'recorded once and replayed'), not its
    sibling's."""
    parent = client.start("tc_branch_children", None, run_id="tc-bc")
    with running_worker(dsn, workflows=[tc_branch_children, tc_echo]):
        run = client.wait(parent, timeout=30)
    assert run.status == "completed", run.error
    children = dict(db.execute("select input #>> '{}', id from flowly.runs"
                               " where parent_run_id = %s", (parent,)).fetchall())
    assert run.output == [{"branch": "slow", "child said": "slow"},
                          {"branch": "fast", "child said": "fast"}], (
        f"children by input: {children}; output {run.output}")


def test_parallel_waits_for_one_event_replay_the_payload_each_branch_used(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """Two events 'x' are sent before the run starts. Branch 'fast' reaches its wait first and
    receives event 1, and checkpoints a step with it; branch 'slow' receives event 2. The run
    then parks on 'go'; the replay must give each branch the payload it received (its step
    used it), not swap them."""
    parent = client.start("tc_branch_events", None, run_id="tc-be")
    client.send_event(parent, "x", 1)
    client.send_event(parent, "x", 2)
    with running_worker(dsn, workflows=[tc_branch_events]):
        wait_for(lambda: _parked(db, parent), what="the run parked on 'go'")
        client.send_event(parent, "go", None)
        run = client.wait(parent, timeout=30)
    assert run.status == "completed", run.error
    for branch in run.output:
        assert branch["payload now"] == branch["payload used"], run.output


@flowly.workflow("tc_gated", max_attempts=1)
async def tc_gated(ctx: flowly.Context, inp: Any) -> Any:
    return await ctx.wait_for_event("go")


_FLAKY_CALLS: list[float] = []


def _flaky() -> str:
    _FLAKY_CALLS.append(time.monotonic())
    if len(_FLAKY_CALLS) == 1:
        time.sleep(0.5)  # the sibling's wait registers first
        raise RuntimeError("the first call fails")
    return "flaky ok"


@flowly.workflow("tc_wait_beside_backoff", max_attempts=1)
async def tc_wait_beside_backoff(ctx: flowly.Context, inp: Any) -> Any:
    """A fan-in whose one branch waits for a child while the other's step fails and must
    wait 30 s (its stored backoff) before its next attempt."""
    child = await ctx.start("tc_gated", None)
    return await asyncio.gather(
        ctx.wait_for_run(child),
        ctx.step("flaky", _flaky, retry=flowly.Retry(max_attempts=2, backoff="fixed",
                                                     initial_delay=30)))


def test_a_child_finishing_does_not_cut_short_the_backoff_of_a_sibling_step(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """The step 'flaky' fails; the database stores its next attempt 30 s later and releases
    the run until then. The child the other branch waits for finishes meanwhile: that must not
    make the run due at once and run 'flaky' again within a second (README: 'The database
    decides and stores each delay; the run is released while it waits')."""
    _FLAKY_CALLS.clear()
    parent = client.start("tc_wait_beside_backoff", None, run_id="tc-wb")
    with running_worker(dsn, workflows=[tc_wait_beside_backoff, tc_gated]):
        wait_for(lambda: scalar(db, "select count(*) from flowly.step_attempts"
                                    " where run_id = %s and step_name = 'flaky'", parent),
                 what="the first failure of 'flaky'")
        wait_for(lambda: scalar(db, "select status = 'pending' and locked_by is null"
                                    " and scheduled_for > now() + interval '20 s'"
                                    " from flowly.runs where id = %s", parent),
                 what="the parent released until its backoff ends")
        retry_at = scalar(db, "select retry_at from flowly.step_attempts where run_id = %s",
                          parent)
        waits = db.execute("select step, kind, target from flowly.waits where run_id = %s",
                           (parent,)).fetchall()
        child = scalar(db, "select id from flowly.runs where parent_run_id = %s", parent)
        client.send_event(child, "go", "child ok")
        assert client.wait(child, timeout=20).status == "completed"
        time.sleep(3)
        scheduled = scalar(db, "select scheduled_for from flowly.runs where id = %s", parent)
        calls = len(_FLAKY_CALLS)
        status = _status(db, parent)
    assert calls == 1, (
        f"'flaky' ran {calls} times within 3 s of the child finishing; its next attempt was"
        f" stored for {retry_at}; the parent is {status}, due {scheduled}; waits left while"
        f" it was released for the backoff: {waits}")


@flowly.workflow("tc_long_sleep", max_attempts=1)
async def tc_long_sleep(ctx: flowly.Context, inp: Any) -> Any:
    await ctx.sleep("nap", inp)
    return "woke"


@flowly.workflow("tc_long_wait", max_attempts=1)
async def tc_long_wait(ctx: flowly.Context, inp: Any) -> Any:
    try:
        return await ctx.wait_for_event("x", timeout=inp)
    except flowly.EventTimeout:
        return "timed out"


def _listing_and_reading_work(client: flowly.Client, run_id: str) -> list[str]:
    problems = []
    for what, call in (("list_runs()", client.list_runs), ("get()", lambda: client.get(run_id))):
        try:
            call()
        except Exception as exc:
            problems.append(f"{what}: {type(exc).__module__}.{type(exc).__name__}: {exc}")
    return problems


def test_a_sleep_past_the_year_10000_leaves_every_run_readable(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """ctx.sleep('nap', 1e12) (about 31,700 years). README: a run's scheduled_for must come
    before the year 10000, the last time clients can read back (WF003 / InvalidArgument).
    A sleep that sets it beyond must be refused, not store a time that makes client.get, and
    client.list_runs / `flowly runs` for every run, fail."""
    other = client.start("tc_echo", "unrelated", run_id="tc-other")
    run_id = client.start("tc_long_sleep", 1e12, run_id="tc-ls")
    with running_worker(dsn, workflows=[tc_long_sleep, tc_echo]):
        wait_for(lambda: scalar(db, "select status <> 'running' and (locked_by is null)"
                                    " and (scheduled_for > now() or finished_at is not null)"
                                    " from flowly.runs where id = %s", run_id),
                 what="the run slept or failed")
        assert client.wait(other, timeout=20).status == "completed"
    stored = scalar(db, "select scheduled_for::text from flowly.runs where id = %s", run_id)
    problems = _listing_and_reading_work(client, run_id)
    assert not problems, f"scheduled_for stored: {stored}; {problems}"


def test_an_event_timeout_past_the_year_10000_leaves_every_run_readable(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """ctx.wait_for_event('x', timeout=1e12): park sets scheduled_for at the timeout, past the
    year 10000 (the readable end README promises to keep)."""
    run_id = client.start("tc_long_wait", 1e12, run_id="tc-lw")
    with running_worker(dsn, workflows=[tc_long_wait]):
        wait_for(lambda: scalar(db, "select status <> 'running' and locked_by is null"
                                    " and (scheduled_for > now() or finished_at is not null)"
                                    " from flowly.runs where id = %s", run_id),
                 what="the run parked or failed")
    stored = scalar(db, "select scheduled_for::text from flowly.runs where id = %s", run_id)
    problems = _listing_and_reading_work(client, run_id)
    assert not problems, f"scheduled_for stored: {stored}; {problems}"


@flowly.workflow("tc_catching_parent", max_attempts=1)
async def tc_catching_parent(ctx: flowly.Context, inp: Any) -> Any:
    child = await ctx.start("tc_gated", None)
    try:
        return {"child said": await ctx.wait_for_run(child)}
    except flowly.ChildFailed as failed:
        return {"failed": failed.status, "run": failed.run_id}


def test_a_child_cancelled_while_its_parent_waits_wakes_it_with_child_failed(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    parent = client.start("tc_catching_parent", None, run_id="tc-cp")
    with running_worker(dsn, workflows=[tc_catching_parent, tc_gated], poll_interval=30):
        wait_for(lambda: _parked(db, parent), what="the parent parked")
        child = scalar(db, "select id from flowly.runs where parent_run_id = %s", parent)
        wait_for(lambda: _parked(db, child), what="the child parked on its event")
        started = time.monotonic()
        assert client.cancel(child) == "cancelled"
        run = client.wait(parent, timeout=10)
        took = time.monotonic() - started
    assert run.status == "completed", run.error
    assert run.output == {"failed": "cancelled", "run": child}
    assert took < 5  # woken by NOTIFY, not by the 30 s poll


def _claimed(db: psycopg.Connection[Any], workflow: str) -> Any:
    """The lease epoch of the run of ``workflow`` a claim took."""
    return scalar(db, "select lease_epoch from flowly.claim('w', array[%s], array['default'],"
                      " 10, '1 hour')", workflow)


def _park_p_on_c(db: psycopg.Connection[Any], p_epoch: Any) -> None:
    assert scalar(db, "select outcome from flowly.wait_for_run('p', %s, 'run:c', 'c')",
                  p_epoch) == "waiting"
    assert scalar(db, "select flowly.park('p', %s, array['run:c'])", p_epoch) is None


def test_a_dead_lettered_target_retried_before_its_waiter_reads_it_is_waited_for_again(
    db: psycopg.Connection[Any]
) -> None:
    """p waits for c (parked). c dead-letters, which makes p due; before any worker takes p,
    the operator retries c. p, claimed then, must wait for the retried c (parking for good,
    not due at once) and receive its output once it completes."""
    db.execute("select flowly.start('tc_sql_p', run_id => 'p')")
    db.execute("select flowly.start('tc_sql_c', run_id => 'c', max_attempts => 1)")
    p_epoch = _claimed(db, "tc_sql_p")
    _park_p_on_c(db, p_epoch)
    c_epoch = _claimed(db, "tc_sql_c")
    db.execute("select flowly.fail_run('c', %s, '{\"type\": \"E\", \"message\": \"m\"}', false)",
               (c_epoch,))
    assert _status(db, "c") == "dead_letter"
    assert scalar(db, "select scheduled_for <= now() from flowly.runs where id = 'p'")
    db.execute("select flowly.retry_dead_letter('c')")
    p_epoch = _claimed(db, "tc_sql_p")
    _park_p_on_c(db, p_epoch)
    c_epoch = _claimed(db, "tc_sql_c")
    db.execute("select flowly.complete('c', %s, '\"done\"')", (c_epoch,))
    p_epoch = _claimed(db, "tc_sql_p")
    assert p_epoch is not None, "p was not woken by c completing"
    row = db.execute("select outcome, status, output from flowly.wait_for_run('p', %s,"
                     " 'run:c', 'c')", (p_epoch,)).fetchone()
    assert row == ("finished", "completed", "done")


def _slow_square(n: int) -> int:
    time.sleep(0.3)
    return n * n


@flowly.workflow("tc_slow_square", max_attempts=3)
async def tc_slow_square(ctx: flowly.Context, inp: int) -> Any:
    return await ctx.step("square", _slow_square, inp)


@flowly.workflow("tc_fan", max_attempts=3)
async def tc_fan(ctx: flowly.Context, inp: int) -> Any:
    got = await asyncio.gather(*(ctx.run("tc_slow_square", i) for i in range(inp)))
    await ctx.sleep("breathe", 0.5)
    again = await asyncio.gather(*(ctx.wait_for_run(f"{ctx.run_id}:tc_slow_square:{i + 1}")
                                   for i in range(inp)))
    return {"first": got, "again": again}


def test_sigkilled_workers_mid_fan_in_replay_exactly_what_the_waits_returned(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """A parent fans out 6 children and gathers them, sleeps, then waits for each child a
    second time; workers are SIGKILLed three times meanwhile. The output must be exact, and
    no child started twice."""
    from tests.support import worker_process

    parent = client.start("tc_fan", 6, run_id="tc-fan")
    for pause in (0.4, 0.9, 1.3):
        with worker_process(dsn, "--lease", "1", "--concurrency", "4",
                            app="tests.test_children_attack") as worker:
            wait_for(lambda: scalar(db, "select count(*) from flowly.steps") > 0,
                     what="work")
            time.sleep(pause)
            worker.kill()
    with worker_process(dsn, "--lease", "1", "--concurrency", "4",
                        app="tests.test_children_attack"):
        run = client.wait(parent, timeout=40)
    assert run.status == "completed", run.error
    squares = [i * i for i in range(6)]
    assert run.output == {"first": squares, "again": squares}
    assert scalar(db, "select count(*) from flowly.runs where parent_run_id = %s", parent) == 6


_WORK_CALLS: list[float] = []


def _slow_work() -> str:
    _WORK_CALLS.append(time.monotonic())
    time.sleep(0.5)
    return "worked"


@flowly.workflow("tc_sleep_beside_step", max_attempts=1)
async def tc_sleep_beside_step(ctx: flowly.Context, inp: Any) -> Any:
    _, worked = await asyncio.gather(ctx.sleep("nap", 1.5), ctx.step("work", _slow_work))
    return worked


def test_a_sleep_in_one_branch_does_not_throw_away_a_sibling_step_in_flight(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """gather(ctx.sleep('nap', 1.5), ctx.step('work', ...)): the sleep releases the run while
    'work' is executing; its checkpoint is then refused (lease lost) and 'work' runs again
    after the nap. A wait in the same place lets its siblings land first (ctx.settled before
    park); a sleep should too, so that 'work' runs once."""
    _WORK_CALLS.clear()
    run_id = client.start("tc_sleep_beside_step", None, run_id="tc-sbs")
    with running_worker(dsn, workflows=[tc_sleep_beside_step]):
        run = client.wait(run_id, timeout=20)
    assert run.status == "completed", run.error
    assert len(_WORK_CALLS) == 1, f"'work' executed {len(_WORK_CALLS)} times"


@flowly.workflow("tc_waits_for_itself", max_attempts=1)
async def tc_waits_for_itself(ctx: flowly.Context, inp: Any) -> Any:
    return await ctx.wait_for_run(ctx.run_id)


def test_a_run_that_waits_for_itself_fails_with_a_clear_error_instead_of_parking_for_ever(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """ctx.wait_for_run(ctx.run_id) can never be satisfied; a mistake like this (a child
    started with run_id=ctx.run_id, which start answers with the run itself) should fail the
    run with an error that says so, not park it until 9999-12-31."""
    run_id = client.start("tc_waits_for_itself", None, run_id="tc-self")
    with running_worker(dsn, workflows=[tc_waits_for_itself]):
        time.sleep(2)
        state = db.execute("select status, scheduled_for::text from flowly.runs where id = %s",
                           (run_id,)).fetchone()
    assert state is not None and state[0] == "dead_letter", f"run is {state}"


def test_a_worker_lost_between_storing_a_sleep_and_releasing_the_run_leaves_it_resumable(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """The state a worker leaves when it dies (or the database restarts) between a sleep's two
    calls: the timer stored with p_release => false, the sibling step 'work' checkpointed, the
    run still held under a lease that then lapses. Another worker must take it over without
    running 'work' again, keep the stored wake time ('restarts never move it') and complete
    the run only once it has passed."""
    _WORK_CALLS.clear()
    run_id = client.start("tc_sleep_beside_step", None, run_id="tc-lost")
    epoch = scalar(db, "select lease_epoch from flowly.claim('gone', array['tc_sleep_beside_step'],"
                       " array['default'], 1, '1 second')")
    released = scalar(db, "select released from flowly.sleep(%s, %s, 'nap', p_seconds => 3,"
                          " p_position => 1, p_release => false)", run_id, epoch)
    assert released  # the wake time is ahead: the dead worker would have released the run
    checkpoint_as(db, run_id, epoch, step="work", output='"worked"', position=2)
    wake_at = scalar(db, "select wake_at from flowly.timers where run_id = %s", run_id)
    with running_worker(dsn, workflows=[tc_sleep_beside_step]):
        run = client.wait(run_id, timeout=30)
    assert run.status == "completed" and run.output == "worked", run.error
    assert _WORK_CALLS == [], "'work' ran again although its checkpoint was stored"
    assert scalar(db, "select wake_at from flowly.timers where run_id = %s", run_id) == wake_at
    assert run.finished_at is not None and run.finished_at >= wake_at


def test_a_run_recorded_before_branches_counted_apart_replays_the_names_it_recorded(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """A run of tc_branch_children whose branches started their children before the upgrade
    to per-branch names (0044): they were named by counting across the body, tc-old:tc_echo:1
    and :2. Its replay after the upgrade must find those records, not start two more
    children under the new names."""
    parent = client.start("tc_branch_children", None, run_id="tc-old")
    epoch = scalar(db, "select lease_epoch from flowly.claim('old', array['tc_branch_children'],"
                       " array['default'], 1, '1 hour')")
    db.execute("select * from flowly.checkpoint_steps(array[%s, %s], array[%s, %s]::bigint[],"
               " array['prep-slow', 'prep-fast'], array['\"slow\"', '\"fast\"']::jsonb[],"
               " array[now(), now()], array[false, false], array[1, 2])",
               (parent, parent, epoch, epoch))
    for count, label in ((1, "fast"), (2, "slow")):  # 'fast' reached its child first
        child = f"{parent}:tc_echo:{count}"
        db.execute("select flowly.start('tc_echo', %s, run_id => %s, parent_run_id => %s,"
                   " parent_lease_epoch => %s, parent_step => %s, parent_position => %s)",
                   (f'"{label}"', child, parent, epoch, f"start:{child}", count + 2))
    db.execute("select flowly.release(array[%s], array[%s::bigint])", (parent, epoch))
    # the upgrade came after those records
    db.execute("update flowly.schema_migrations set applied_at = clock_timestamp()"
               " where version = 44")
    with running_worker(dsn, workflows=[tc_branch_children, tc_echo]):
        run = client.wait(parent, timeout=30)
    assert run.status == "completed", run.error
    children = sorted(r[0] for r in db.execute(
        "select id from flowly.runs where parent_run_id = %s", (parent,)))
    assert children == ["tc-old:tc_echo:1", "tc-old:tc_echo:2"], children


def test_branches_name_their_children_and_waits_by_branch(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """The names the README gives: a child started without run_id in the body's own task is
    <run>:<workflow>:<n>; in the k-th task the body created, <run>:<workflow>:<k>/<n>; the
    wait for it is recorded as run:<child id> (and #<k>/<n> after the key in a branch)."""
    parent = client.start("tc_branch_children", None, run_id="tc-names")
    with running_worker(dsn, workflows=[tc_branch_children, tc_echo]):
        run = client.wait(parent, timeout=30)
    assert run.status == "completed", run.error
    names = sorted(r[0] for r in db.execute(
        "select name from flowly.steps where run_id = %s and kind in ('start', 'run')",
        (parent,)))
    assert names == ["run:tc-names:tc_echo:1/1#1/1", "run:tc-names:tc_echo:2/1#2/1",
                     "start:tc-names:tc_echo:1/1", "start:tc-names:tc_echo:2/1"], names


@flowly.workflow("tc_chain", max_attempts=1)
async def tc_chain(ctx: flowly.Context, depth: int) -> Any:
    """A chain of default-named children, each a level deeper."""
    if depth == 0:
        return ctx.run_id
    return await ctx.run("tc_chain", depth - 1)


def test_a_default_child_id_longer_than_ids_may_be_is_digested_not_refused(
    dsn: str, client: flowly.Client
) -> None:
    """Each level's default id adds `:<workflow>:<n>` to its parent's: a chain about 90 deep
    (or a parent whose own id is near the limit) reached 1,000 bytes, and the child's start
    was refused with InvalidArgument for an id the engine made itself, failing every run of
    the chain."""
    parent = client.start("tc_chain", 3, run_id="p" * 980)
    with running_worker(dsn, workflows=[tc_chain]):
        run = client.wait(parent, timeout=30)
        assert run.status == "completed", run.error
        deepest = run.output
        assert len(deepest.encode()) <= 1000
        assert deepest.startswith("tc_chain:sha256:"), deepest
        # a replay of the chain's runs finds the same ids: each level is recorded once
        chain = [r.id for r in client.list_runs(workflow="tc_chain", limit=10)]
        assert len(chain) == 4 and deepest in chain
