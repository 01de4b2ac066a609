"""Operator and enqueue calls racing live workers: start / cancel / retry_dead_letter /
send_event against open transactions, frozen workers and run timeouts.

Workflows here are served by in-process workers and by worker subprocesses
(``app="tests.test_operator_races"``).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psycopg
import pytest

import flowly
from flowly.db import translated_errors
from tests.support import (
    checkpoint_as,
    in_thread,
    running_worker,
    scalar,
    wait_for,
    worker_process,
)

# -- workflows ------------------------------------------------------------------------------------


def _effect(run_id: str, step: str) -> str:
    with psycopg.connect(os.environ["FLOWLY_DSN"], autocommit=True) as conn:
        conn.execute("insert into public.test_effects (run_id, step, pid) values (%s, %s, %s)",
                     (run_id, step, os.getpid()))
    return step


def _slow_effect(run_id: str, step: str, seconds: float) -> str:
    _effect(run_id, step)
    time.sleep(seconds)
    return step


@flowly.workflow("op_two_steps")
async def op_two_steps(ctx: flowly.Context, inp: dict[str, Any]) -> str:
    """Step a, then step b that records itself and takes ``seconds``."""
    await ctx.step("a", _effect, ctx.run_id, "a")
    await ctx.step("b", _slow_effect, ctx.run_id, "b", inp.get("seconds", 0))
    return "done"


def _effects(db: psycopg.Connection[Any], run_id: str) -> list[str]:
    return [r[0] for r in db.execute(
        "select step from public.test_effects where run_id = %s order by at", (run_id,))]


def _start_timed_run_once_served(db: psycopg.Connection[Any]) -> None:
    """Run r of op_two_steps with a 2 s timeout, started once the worker process is up: its
    timeout counts from the start, and a loaded machine can take longer than that to start a
    Python process."""
    wait_for(lambda: scalar(db, "select count(*) from flowly.workers"), timeout=60,
             what="the worker to register")
    db.execute("select flowly.start('op_two_steps', '{\"seconds\": 1}', run_id => 'r',"
               " timeout => '2 seconds')")


# -- run timeout: a stale worker's writes must be fenced -----------------------------------------


def test_writes_made_after_the_run_timeout_are_refused_whether_or_not_a_sweep_ran(
    db: psycopg.Connection[Any],
) -> None:
    """README: "A run not finished `timeout` after its scheduled start moves to dead_letter
    with error type Timeout; a worker still running it is stopped". The holder of the run
    checkpoints and completes it after timeout_at, before any claim or heartbeat swept it:
    both writes must be refused (WF001 / lease lost) and the run end Timeout, not completed."""
    db.execute("select flowly.start('op_two_steps', run_id => 'r', timeout => '1 second')")
    epoch = scalar(db, "select lease_epoch from flowly.claim('w', array['op_two_steps'],"
                       " array['default'], 1, '1 hour')")
    wait_for(lambda: scalar(db, "select clock_timestamp() > timeout_at + interval '200 ms'"
                                " from flowly.runs where id = 'r'"), what="the run's timeout")
    checkpoint = checkpoint_as(db, "r", epoch, step="a")[:2]
    completion = db.execute(
        "select lease_lost, busy from flowly.complete_runs(array['r'], array[%s::bigint],"
        " array['\"done\"'::jsonb])", (epoch,)).fetchone()
    db.execute("select flowly.dead_letter_stalled_runs()")
    status, error_type = db.execute(
        "select status, error ->> 'type' from flowly.runs where id = 'r'").fetchone()
    assert (checkpoint, completion, status, error_type) == (
        (True, False), (True, False), "dead_letter", "Timeout"), (
        f"writes after the timeout: checkpoint (lease_lost, busy) = {checkpoint},"
        f" completion = {completion}; the run ended {status} ({error_type})")


def test_a_run_past_its_timeout_is_refused_alone_in_a_batch_of_good_ones(
    db: psycopg.Connection[Any],
) -> None:
    """The group commit writes many runs in one call: the run past its timeout is refused
    (lease lost), the others' checkpoints and completions are stored as usual."""
    db.execute("select flowly.start('op_two_steps', run_id => 'late', timeout => '1 second')")
    for good in ("g1", "g2"):
        db.execute("select flowly.start('op_two_steps', run_id => %s)", (good,))
    epochs = dict(db.execute("select run_id, lease_epoch from flowly.claim('w',"
                             " array['op_two_steps'], array['default'], 10, '1 hour')"))
    wait_for(lambda: scalar(db, "select clock_timestamp() > timeout_at from flowly.runs"
                                " where id = 'late'"), what="the run's timeout")
    ids = ["g1", "late", "g2"]
    epoch_list = [epochs[i] for i in ids]
    checkpoints = db.execute(
        "select run_id, lease_lost, busy from flowly.checkpoint_steps(%s, %s::bigint[],"
        " array['a', 'a', 'a'], array['1', '1', '1']::jsonb[], array[now(), now(), now()],"
        " array[false, false, false], array[1, 1, 1])", (ids, epoch_list)).fetchall()
    completions = db.execute(
        "select run_id, lease_lost, busy from flowly.complete_runs(%s, %s::bigint[],"
        " array['1', '1', '1']::jsonb[])", (ids, epoch_list)).fetchall()
    assert checkpoints == completions == [
        ("g1", False, False), ("late", True, False), ("g2", False, False)]
    assert dict(db.execute("select id, status from flowly.runs")) == {
        "g1": "completed", "g2": "completed", "late": "running"}
    assert scalar(db, "select count(*) from flowly.steps where run_id = 'late'") == 0


def test_a_worker_frozen_past_the_run_timeout_cannot_complete_the_run_when_thawed(
    dsn: str, db: psycopg.Connection[Any],
) -> None:
    """The brief's scenario with a real process: the only worker (one slot, a 30 s lease, so
    no claim and no heartbeat sweeps meanwhile) is SIGSTOPped in step b of a run with a 2 s
    timeout, and SIGCONTed 3 s past it. The thawed worker must be fenced: the run ends
    dead_letter / Timeout, not completed late."""
    with worker_process(dsn, "--concurrency", "1", "--lease", "30",
                        app="tests.test_operator_races") as worker:
        _start_timed_run_once_served(db)
        wait_for(lambda: "b" in _effects(db, "r"), timeout=20, what="step b under way")
        worker.signal(signal.SIGSTOP)
        try:
            wait_for(lambda: scalar(db, "select clock_timestamp() > timeout_at + interval '3 s'"
                                        " from flowly.runs where id = 'r'"),
                     timeout=20, what="3 s past the run's timeout")
        finally:
            worker.signal(signal.SIGCONT)
        wait_for(lambda: scalar(db, "select status not in ('pending', 'running')"
                                    " from flowly.runs where id = 'r'"),
                 timeout=20, what="the run to end")
        worker.stop()
    status, error_type, late = db.execute(
        "select status, error ->> 'type', finished_at > timeout_at from flowly.runs"
        " where id = 'r'").fetchone()
    steps = [r[0] for r in db.execute(
        "select name from flowly.steps where run_id = 'r' and finished_at > ("
        " select timeout_at from flowly.runs where id = 'r') order by seq")]
    assert (status, error_type) == ("dead_letter", "Timeout"), (
        f"the run ended {status} ({error_type}), finished after its timeout: {late};"
        f" checkpoints written after the timeout: {steps}")


# -- operator calls on a row another session holds ----------------------------------------------


def test_send_event_to_a_run_an_operator_holds_answers_busy_in_bounded_time(
    dsn: str, db: psycopg.Connection[Any],
) -> None:
    """An operator runs `begin; select flowly.cancel('r')` in psql and leaves the transaction
    open. cancel and retry_dead_letter on such a row give up after 5 s with WF005 (RunBusy);
    an application's client.send_event (also `flowly send-event`) must not hang for as long
    as the operator's transaction stays open."""
    db.execute("select flowly.start('op_two_steps', run_id => 'r')")
    with psycopg.connect(dsn) as operator:
        operator.execute("select flowly.cancel('r')")

        def send() -> int:
            with flowly.Client(dsn) as app:
                return app.send_event("r", "go", 1)

        thread, outcome = in_thread(send)
        thread.join(12)
        hung = thread.is_alive()
        operator.rollback()
        thread.join(10)
    assert not hung and isinstance(outcome.get("error"), flowly.RunBusy), (
        f"send_event still waiting after 12 s: {hung}; outcome once the operator rolled"
        f" back: {outcome!r}")


# -- a child start behind an uncommitted concurrency key ----------------------------------------


@flowly.workflow("op_child")
async def op_child(ctx: flowly.Context, inp: Any) -> Any:
    return inp


@flowly.workflow("op_keyed_parent")
async def op_keyed_parent(ctx: flowly.Context, inp: dict[str, Any]) -> str:
    return await ctx.start("op_child", {"parent": ctx.run_id}, concurrency_key=inp["key"])


async def _one() -> int:
    return 1


@flowly.workflow("op_quick")
async def op_quick(ctx: flowly.Context, inp: Any) -> int:
    total = 0
    for name in ("one", "two", "three"):
        total += await ctx.step(name, _one)
    return total


def test_children_behind_an_uncommitted_concurrency_key_do_not_delay_other_runs(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any],
) -> None:
    """An application transaction started a run with concurrency key k and stays open for
    seconds. Four runs of a worker start a child with key k (ctx.start): they must wait for
    that transaction (its run may commit), but "one run's lock wait must never delay another
    run": the worker's other runs must go on at their usual pace. Observed: each child start
    holds a pool connection (and its parent's row) for the 2 s lock timeout, again and again,
    so the other runs' claims and checkpoints queue for connections (three-step runs take
    1-4 s instead of 0.04 s), and the parents' own heartbeats find their rows busy until their
    leases lapse ("taken over from ourselves")."""
    def batch() -> float:
        started = time.monotonic()
        runs = [client.start("op_quick", None) for _ in range(5)]
        for run_id in runs:
            assert client.wait(run_id, timeout=30).status == "completed"
        return time.monotonic() - started

    with running_worker(dsn, concurrency=16, lease=3):
        batch()
        baseline = max(batch() for _ in range(2))
        with psycopg.connect(dsn) as app:
            app.execute("select flowly.start('op_child', run_id => 'app-child',"
                        " concurrency_key => 'k')")
            parents = [client.start("op_keyed_parent", {"key": "k"}) for _ in range(4)]
            wait_for(lambda: scalar(db, "select count(*) = 4 from flowly.runs where"
                                        " workflow = 'op_keyed_parent' and status = 'running'"),
                     what="the parents running")
            time.sleep(0.5)
            contended = [batch() for _ in range(3)]
            app.commit()
        # each parent got the app's run, or (once that one finished) a child of its own
        assert all(client.wait(p, timeout=30).status == "completed" for p in parents)
    assert max(contended) < max(1.0, 5 * baseline), (
        f"5 three-step runs took {baseline:.2f}s, then {[round(t, 2) for t in contended]}s"
        " while 4 runs of the same worker waited on an uncommitted concurrency key")


# -- sagas: cancel mid-compensation, retry twice at once -----------------------------------------

FAIL_S4: set[str] = set()


def _undo(run_id: str, step: str, seconds: float) -> None:
    _effect(run_id, f"undo:{step}")
    time.sleep(seconds)


@flowly.workflow("op_saga")
async def op_saga(ctx: flowly.Context, inp: dict[str, Any]) -> str:
    """s1..s3 compensable (undo s3 takes ``undo_seconds``); s4 fails while the run is in
    FAIL_S4."""
    slow = inp.get("undo_seconds", 0)
    for name in ("s1", "s2", "s3"):
        await ctx.step(name, _effect, ctx.run_id, name,
                       compensate=lambda _out, n=name: _undo(ctx.run_id, n, slow if n == "s3"
                                                             else 0))

    def final() -> str:
        _effect(ctx.run_id, "s4")
        if ctx.run_id in FAIL_S4:
            raise ValueError("s4 fails")
        return "ok"

    return str(await ctx.step("s4", final, retry=flowly.Retry(max_attempts=1)))


def test_cancel_in_the_middle_of_compensations_runs_no_further_compensation(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any],
) -> None:
    run_id = client.start("op_saga", {"undo_seconds": 2})
    FAIL_S4.add(run_id)
    with running_worker(dsn, lease=3):
        wait_for(lambda: "undo:s3" in _effects(db, run_id), what="undo s3 under way")
        assert client.cancel(run_id) == "cancelled"
        time.sleep(3)  # undo s3 ends; the worker must then stop, not go on to s2 and s1
    run = client.get(run_id)
    assert (run.status, run.compensation_ok) == ("cancelled", False)
    assert _effects(db, run_id) == ["s1", "s2", "s3", "s4", "undo:s3"]


def test_two_retries_of_one_dead_letter_at_once_make_one_generation(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any],
) -> None:
    run_id = client.start("op_saga", {})
    FAIL_S4.add(run_id)
    with running_worker(dsn):
        assert client.wait(run_id, timeout=20).status == "dead_letter"
        FAIL_S4.discard(run_id)
        db.execute("delete from public.test_effects")
        with psycopg.connect(dsn) as holder:  # both retries queue behind the same lock
            holder.execute("select * from flowly.runs where id = %s for update", (run_id,))

            def retry() -> str:
                with flowly.Client(dsn) as other:
                    return other.retry_dead_letter(run_id)

            calls = [in_thread(retry) for _ in range(2)]
            time.sleep(0.5)
            holder.commit()
            for thread, _ in calls:
                thread.join(15)
        outcomes = [o for _, o in calls]
        run = client.wait(run_id, timeout=20)
    assert sorted(type(o.get("error", o.get("result"))).__name__ for o in outcomes) == [
        "InvalidState", "str"], outcomes
    assert (run.status, run.generation, run.output) == ("completed", 2, "ok")
    # the undone steps and the failed one ran again, once; no compensation ran again
    assert sorted(_effects(db, run_id)) == ["s1", "s2", "s3", "s4"]


# -- enqueue in open transactions ----------------------------------------------------------------


def test_a_start_held_open_then_rolled_back_stalls_no_worker_and_leaves_nothing(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any],
) -> None:
    """The app starts a run while the worker waits idle (the start takes its hand-off slot),
    keeps the transaction open for 3 s, then rolls back. Meanwhile the worker serves other
    runs at once; afterwards there is no run, and the same run id starts and runs."""
    with running_worker(dsn, lease=3):
        assert client.wait(client.start("op_quick", None), timeout=10).status == "completed"
        time.sleep(0.3)  # idle again: a slot is offered
        with psycopg.connect(dsn) as app:
            app.execute("select flowly.start('op_quick', run_id => 'held')")
            for _ in range(3):
                started = time.monotonic()
                other = client.start("op_quick", None)
                assert client.wait(other, timeout=10).status == "completed"
                assert time.monotonic() - started < 1.0
                time.sleep(0.7)
            app.rollback()
        assert scalar(db, "select count(*) from flowly.runs where id = 'held'") == 0
        assert client.start("op_quick", None, run_id="held") == "held"
        assert client.wait("held", timeout=10).status == "completed"
    assert scalar(db, "select count(*) from flowly.steps where run_id = 'held'") == 3


@pytest.mark.parametrize("ending", ["commit", "rollback"])
def test_two_starts_of_one_concurrency_key_in_open_transactions(
    dsn: str, db: psycopg.Connection[Any], ending: str,
) -> None:
    """The second start waits for the first transaction; then it returns the first's run
    (commit) or makes its own (rollback): never two live runs of the key, never an error."""
    with psycopg.connect(dsn) as first:
        assert scalar(first, "select flowly.start('op_quick', run_id => 'one',"
                             " concurrency_key => 'k')") == "one"

        def second() -> Any:
            with psycopg.connect(dsn) as conn:
                got = scalar(conn, "select flowly.start('op_quick', run_id => 'two',"
                                   " concurrency_key => 'k')")
                conn.commit()
                return got

        thread, outcome = in_thread(second)
        time.sleep(0.5)
        assert thread.is_alive(), outcome
        getattr(first, ending)()
        thread.join(10)
    assert outcome.get("result") == ("one" if ending == "commit" else "two"), outcome
    assert [r[0] for r in db.execute("select id from flowly.runs")] == [outcome["result"]]


def test_operators_open_cancel_delays_only_its_run(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any],
) -> None:
    """`begin; select flowly.cancel(r)` left open for 3 s (over a lease) while the worker runs
    r: other runs are served as usual; once committed, r is cancelled and stays so."""
    victim = client.start("op_two_steps", {"seconds": 2})
    with running_worker(dsn, lease=1.5):
        wait_for(lambda: "b" in _effects(db, victim), what="step b under way")
        with psycopg.connect(dsn) as operator:
            assert scalar(operator, "select flowly.cancel(%s)", victim) == "cancelled"
            for _ in range(3):
                started = time.monotonic()
                assert client.wait(client.start("op_quick", None),
                                   timeout=10).status == "completed"
                assert time.monotonic() - started < 1.0
                time.sleep(0.8)
            operator.commit()
        time.sleep(1)
    run = client.get(victim)
    assert run.status == "cancelled" and run.output is None
    assert [s.name for s in client.steps(victim)] == ["a"]


# -- the command line on a busy run ---------------------------------------------------------------


@pytest.mark.parametrize("command", ["cancel", "retry"])
def test_cli_on_a_run_another_session_holds_is_one_busy_line_not_a_traceback(
    dsn: str, db: psycopg.Connection[Any], command: str,
) -> None:
    """`flowly cancel RUN` / `flowly retry RUN` while an operator's open transaction holds the
    run's row: the engine answers WF005 (RunBusy) after 5 s; the command must exit 1 with one
    `error: ... busy ...` line (README: "Bad input exits non-zero with a one-line error"), and
    with --json one JSON object, not a Python traceback."""
    from tests.test_cli import flowly as run_cli

    db.execute("select flowly.start('op_quick', run_id => 'r')")
    if command == "retry":
        db.execute("update flowly.runs set status = 'dead_letter', finished_at = now()")
    with psycopg.connect(dsn) as operator:
        operator.execute("select * from flowly.runs where id = 'r' for update")
        plain = run_cli(command, "r", dsn=dsn, timeout=30)
        as_json = run_cli("--json", command, "r", dsn=dsn, timeout=30)
    assert (plain.returncode, as_json.returncode) == (1, 1)
    assert "Traceback" not in plain.stderr + as_json.stderr, plain.stderr[-600:]
    lines = plain.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "busy" in lines[0], lines
    import json
    assert "busy" in json.loads(as_json.stderr)["error"]


def test_a_worker_frozen_past_the_run_timeout_is_fenced_once_another_worker_swept_it(
    dsn: str, db: psycopg.Connection[Any],
) -> None:
    """As above, but another worker is alive: its claims sweep the run to dead_letter /
    Timeout while the first is frozen, and the thawed worker writes nothing for it."""
    with worker_process(dsn, "--concurrency", "1", "--lease", "30",
                        app="tests.test_operator_races") as frozen:
        _start_timed_run_once_served(db)
        wait_for(lambda: "b" in _effects(db, "r"), timeout=20, what="step b under way")
        frozen.signal(signal.SIGSTOP)
        try:
            with running_worker(dsn, lease=2):
                wait_for(lambda: scalar(db, "select status = 'dead_letter' from flowly.runs"
                                            " where id = 'r'"), what="the timeout sweep")
        finally:
            frozen.signal(signal.SIGCONT)
        time.sleep(2)
        frozen.stop()
    run = db.execute("select status, error ->> 'type' from flowly.runs").fetchone()
    assert run == ("dead_letter", "Timeout")
    assert [r[0] for r in db.execute("select name from flowly.steps where run_id = 'r'")] == ["a"]


def test_a_child_started_by_hand_under_a_run_an_operator_holds_answers_busy_in_bounded_time(
    dsn: str, db: psycopg.Connection[Any],
) -> None:
    """`select flowly.start('child', parent_run_id => 'p')` from psql while an operator's
    open transaction holds the parent's row (an uncommitted cancel): the start must give up
    with WF005 (RunBusy), as cancel and send_event do, not wait as long as the operator's
    transaction stays open."""
    db.execute("select flowly.start('op_two_steps', run_id => 'p')")
    with psycopg.connect(dsn) as operator:
        operator.execute("select flowly.cancel('p')")

        def start_child() -> Any:
            with psycopg.connect(dsn, autocommit=True) as app, translated_errors():
                return app.execute("select flowly.start('op_child', parent_run_id => 'p')"
                                   ).fetchone()

        thread, outcome = in_thread(start_child)
        thread.join(12)
        hung = thread.is_alive()
        operator.rollback()
        thread.join(10)
    assert not hung and isinstance(outcome.get("error"), flowly.RunBusy), (
        f"start still waiting after 12 s: {hung}; outcome once the operator rolled back:"
        f" {outcome!r}")
    assert scalar(db, "select count(*) from flowly.runs where parent_run_id = 'p'") == 0


def test_a_child_started_by_hand_under_a_run_that_does_not_exist_is_refused(
    db: psycopg.Connection[Any],
) -> None:
    """A parent_run_id naming no run (a typo, a purged run) must not make a child of nobody."""
    with pytest.raises(flowly.RunNotFound, match="run nobody not found"), translated_errors():
        db.execute("select flowly.start('op_child', parent_run_id => 'nobody')")
    assert scalar(db, "select count(*) from flowly.runs") == 0
