"""Stalls that must not happen: a huge output, a blocked event loop, a frozen session, a
database that is gone at shutdown; and bad input that must get a clear error."""

from __future__ import annotations

import json
import logging
import math
import secrets
import signal
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

import flowly
from flowly.context import serialise_output
from flowly.db import Calls, dumps, is_connection_failure
from flowly.worker import session
from flowly.worker.handoff import ClaimedRun
from tests.support import running_worker, scalar, wait_for, worker_process


def test_an_output_over_the_limit_fails_its_run_before_anything_is_sent(
    dsn: str, client: flowly.Client
) -> None:
    big = client.start("echo", {"value": "x" * (9 * 1024 * 1024), "wait": 0.2})
    small = [client.start("echo", {"value": i, "wait": 0.2}) for i in range(10)]
    with running_worker(dsn):
        run = client.wait(big, timeout=60)
        assert [client.wait(r, timeout=30).output for r in small] == list(range(10))
    assert run.status == "dead_letter"
    assert run.error["type"] == "OutputTooLarge"
    assert "step 'echo' returned 9,437,186 bytes of JSON; the limit is 8,388,608" in (
        run.error["message"])
    assert len(client.failed_attempts(big)) == 1  # no retry


def _incompressible(megabytes: int) -> dict[str, list[str]]:
    return {"blob": [secrets.token_hex(32) for _ in range(megabytes * 1024 * 1024 // 68)]}


def test_a_claim_answers_without_a_large_input(
    client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """One run's large input (jsonb takes up to 255 MB) travelled in the answer of the claim
    that took it, so every run claimed in the same call waited for it to arrive and be
    parsed: about a second for 100 MB, on the worker's event loop. A claim answers with the
    inputs stored in 64 kB or less; a larger one is marked for its run to read itself."""
    big = client.start("quick", _incompressible(3))
    small = [client.start("quick", i) for i in range(5)]
    answer = db.execute(Calls().claim_and_offer, ("w", ["quick"], ["default"], 10,
                                                   timedelta(hours=1), None)).fetchall()
    claimed = {run.run_id: run for run in (ClaimedRun(*row) for row in answer)}
    assert set(claimed) == {big, *small}
    assert claimed[big].input is None and claimed[big].input_deferred
    assert [(claimed[r].input, claimed[r].input_deferred) for r in small] == [
        (i, False) for i in range(5)]


def test_a_large_input_is_read_past_a_held_row_and_only_under_its_lease(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """The run whose claim left its input out reads it after the claim committed, when an
    operator's transaction may hold its row: that read takes no lock, so it is not held up
    (the read is bounded here by a statement timeout). It names the lease it was claimed
    under: once the run is claimed again, the old holder's read finds nothing."""
    big_input = _incompressible(1)
    big = client.start("quick", big_input)
    answer = db.execute(Calls().claim_and_offer, ("w", ["quick"], ["default"], 10,
                                                   timedelta(hours=1), None)).fetchall()
    (run,) = [ClaimedRun(*row) for row in answer]
    assert run.input_deferred
    with psycopg.connect(dsn) as operator, psycopg.connect(dsn, autocommit=True) as reader:
        operator.execute("select from flowly.runs where id = %s for update", (big,))
        reader.execute("set statement_timeout = '5s'")
        read = reader.execute(Calls().claimed_input, (big, run.epoch)).fetchall()
        assert read == [(big_input,)]
        operator.rollback()
    db.execute("select flowly.release(array[%s], array[%s::bigint])", (big, run.epoch))
    answer = db.execute(Calls().claim_and_offer, ("w2", ["quick"], ["default"], 10,
                                                   timedelta(hours=1), None)).fetchall()
    (again,) = [ClaimedRun(*row) for row in answer]
    assert again.epoch > run.epoch
    assert db.execute(Calls().claimed_input, (big, run.epoch)).fetchall() == []
    assert db.execute(Calls().claimed_input, (big, again.epoch)).fetchall() == [(big_input,)]


def test_a_run_with_a_large_input_reads_it_whole_beside_runs_with_small_ones(
    dsn: str, client: flowly.Client
) -> None:
    """Through a worker: the run whose input its claim left out reads it under its lease and
    gets it exactly; the runs claimed with it get theirs from the claim."""
    big_input = _incompressible(3)
    big = client.start("quick", big_input)
    small = [client.start("quick", i) for i in range(20)]
    with running_worker(dsn):
        assert [client.wait(r, timeout=30).output["input"] for r in small] == list(range(20))
        run = client.wait(big, timeout=60)
    assert run.status == "completed", run.error
    assert run.output["input"] == big_input


def test_the_output_limit_counts_bytes_and_what_jsonb_refuses_is_still_refused() -> None:
    """The size limit is in bytes of UTF-8, whether or not the text is ASCII (only non-ASCII
    text is encoded to tell); an unpaired surrogate is refused, NaN too."""
    limit = 1000
    assert serialise_output("x" * (limit - 2), "step 'a'", limit) == json.dumps("x" * (limit - 2))
    with pytest.raises(flowly.OutputTooLarge, match="1,001 bytes"):
        serialise_output("x" * (limit - 1), "step 'a'", limit)
    accented = "é" * (limit // 2)  # 500 characters, 1,000 bytes, 1,002 bytes of JSON
    with pytest.raises(flowly.OutputTooLarge, match="1,002 bytes"):
        serialise_output(accented, "step 'a'", limit)
    assert serialise_output(accented, "step 'a'", limit + 2) == f'"{accented}"'
    with pytest.raises(ValueError, match="surrogate"):
        dumps({"text": "ok \ud800"})
    with pytest.raises(ValueError):
        dumps(float("nan"))


def _best_of_three(fn: Callable[[], Any]) -> float:
    took = []
    for _ in range(3):
        started = time.perf_counter()
        fn()
        took.append(time.perf_counter() - started)
    return min(took)


def test_a_large_output_is_checked_for_a_nul_in_about_the_time_it_takes_to_serialise() -> None:
    """Every output, input and event payload is checked for what jsonb refuses (U+0000) on
    the worker's event loop or the caller's thread. The check scanned the JSON text with a
    regular expression tried at every position: 6 s for one run's 100 MB output, during
    which every other run of that worker stood still (300 runs beside it took 8.6 s instead
    of 0.4 s). For a large output of ordinary text (before: 14 times the serialising) it
    must cost about what serialising the value costs."""
    value = {"big": "x" * 20_000_000}
    serialised = _best_of_three(lambda: json.dumps(value, ensure_ascii=False,
                                                   separators=(",", ":")))
    checked = _best_of_three(lambda: dumps(value))
    assert checked < 8 * serialised + 0.3, (
        f"checking took {checked:.2f}s, serialising {serialised:.2f}s")


@pytest.mark.parametrize("text", ["\\" * 1001 + "u0000", "\\u0000" * 1000, "\\" + "\\u0000"],
                         ids=["backslashes", "escaped_nul_letters", "escaped_backslash"])
def test_a_nul_is_told_from_the_letters_of_its_escape_in_text_full_of_backslashes(
    text: str,
) -> None:
    """Text that holds a NUL's escape as letters (a backslash, then u0000) is stored; a NUL
    beside it is refused. The check drops escaped backslashes in pairs, as a parser reads
    them: an odd run of them followed by u0000 would be an escape, an even one is text."""
    assert json.loads(dumps(text)) == text
    with pytest.raises(ValueError, match="U\\+0000"):
        dumps([text, "a\x00b"])
    with pytest.raises(ValueError, match="U\\+0000"):
        dumps(text + "\x00")


def test_dumps_writes_what_json_dumps_writes_and_refuses_the_same_values() -> None:
    """flowly's dumps drives the C encoder itself: every value must come out as json.dumps
    writes it with the same options, and every value json.dumps refuses is refused alike."""
    import random

    rng = random.Random(13)

    def document(depth: int = 0) -> Any:
        roll = rng.random()
        if depth > 3 or roll < 0.4:
            return rng.choice([None, True, False, rng.randint(-10**20, 10**20), rng.random() * 1e9,
                               -0.0, "quote \" back \\ é \u2028 \U0001f600", "", 7])
        if roll < 0.7:
            return [document(depth + 1) for _ in range(rng.randint(0, 4))]
        if roll < 0.8:
            return tuple(document(depth + 1) for _ in range(rng.randint(0, 3)))
        return {rng.choice(["k", "é", 1, 2.5, None, True]): document(depth + 1)
                for _ in range(rng.randint(0, 4))}

    for _ in range(1000):
        value = document()
        assert dumps(value) == json.dumps(value, allow_nan=False, ensure_ascii=False,
                                          separators=(",", ":")), value
    circular: list[Any] = []
    circular.append(circular)
    for bad in [float("inf"), [1, float("nan")], {"a": object()}, {(1, 2): 3}, circular]:
        with pytest.raises((TypeError, ValueError)) as refused:
            dumps(bad)
        with pytest.raises((TypeError, ValueError)) as expected:
            json.dumps(bad, allow_nan=False)
        assert (type(refused.value), str(refused.value)) == (
            type(expected.value), str(expected.value))
    # the containers a failed call was inside are not taken for circular by the next call
    holder: list[Any] = [1, object()]
    with pytest.raises(TypeError):
        dumps({"x": holder})
    holder.pop()
    assert dumps({"x": holder}) == '{"x":[1]}'


def test_a_blocked_event_loop_keeps_the_leases_and_names_the_culprit(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A body blocks the loop for three leases: the worker's other runs keep their leases (the
    heartbeat has a thread of its own), nobody takes anything over, and a warning names the
    run that blocks."""
    caplog.set_level(logging.WARNING, logger="flowly")
    others = [client.start("slow", {"seconds": 4}) for _ in range(3)]
    with running_worker(dsn, lease=1.0):
        wait_for(lambda: scalar(db, "select count(*) = 3 from flowly.runs"
                                    " where status = 'running'"), what="three running")
        blocker = client.start("blocks_loop", {"seconds": 3})
        for run_id in [blocker, *others]:
            assert client.wait(run_id, timeout=30).status == "completed"
    epochs = dict(db.execute("select id, lease_epoch from flowly.runs").fetchall())
    assert {epochs[r] for r in [blocker, *others]} == {1}  # nothing was taken over
    warnings = [r.getMessage() for r in caplog.records if "has not turned" in r.getMessage()]
    assert any(f"flowly-run-{blocker}" in w for w in warnings), warnings


def test_a_frozen_session_loses_its_locks_within_about_a_lease(dsn: str) -> None:
    """A worker session left idle in a transaction (its process frozen mid-commit) is ended by
    the server after about a lease, so its row locks do not outlive it."""
    with psycopg.connect(dsn, **session.connection_kwargs(1.0)) as frozen:
        session.configure(frozen, 1.0)
        frozen.autocommit = False
        frozen.execute("select 1")  # a transaction is open; then nothing more comes
        time.sleep(1.5)
        with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout) as ended:
            frozen.execute("select 1")
        assert is_connection_failure(ended.value)  # the worker abandons, it does not fail runs


def test_sigterm_ends_a_worker_whose_database_is_gone(
    empty_dsn: str, db: psycopg.Connection[Any]
) -> None:
    """The worker's database is dropped under it; SIGTERM still ends it within its drain
    timeout plus the bounded shutdown (a few seconds), not after connection retries."""
    flowly.install_dsn(empty_dsn)
    dbname = psycopg.conninfo.conninfo_to_dict(empty_dsn)["dbname"]
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("create table if not exists public.test_effects (run_id text, step text,"
                     " pid integer, at timestamptz default now())")
    with worker_process(empty_dsn, "--drain-timeout", "1", "--lease", "2") as worker:
        wait_for(lambda: scalar(db, "select count(*) from pg_stat_activity where datname = %s",
                                dbname), what="worker connected")
        time.sleep(0.5)
        db.execute(sql.SQL("drop database {} with (force)").format(sql.Identifier(dbname)))
        time.sleep(1)
        started = time.monotonic()
        worker.signal(signal.SIGTERM)
        worker.proc.wait(20)
        assert time.monotonic() - started < 10


def test_a_sync_step_raising_generator_exit_fails_its_step(
    dsn: str, client: flowly.Client
) -> None:
    run_id = client.start("generator_exit", None)
    with running_worker(dsn):
        run = client.wait(run_id, timeout=30)
        # the worker is healthy afterwards
        assert client.wait(client.start("quick", 1), timeout=30).status == "completed"
    assert run.status == "dead_letter"
    assert run.error["type"] == "RuntimeError" and "GeneratorExit" in run.error["message"]


@pytest.mark.parametrize(("options", "problem"), [
    ({"run_id": 123}, "run_id .*must be a string"),
    ({"priority": 1.5}, "priority .*must be an integer"),
    ({"priority": "high"}, "priority .*must be an integer"),
    ({"queue": 5}, "queue .*must be a string"),
    ({"concurrency_key": 7}, "concurrency_key .*must be a string"),
    ({"max_attempts": "3"}, "max_attempts .*must be an integer"),
    ({"run_id": "a\x00b"}, "run_id .*must not contain the NUL character"),
    # read in the database session's time zone, not the caller's
    ({"scheduled_for": datetime(2030, 1, 1, 12)}, "scheduled_for .*must be timezone-aware"),
    ({"scheduled_for": "2030-01-01"}, "scheduled_for .*must be a datetime, got str"),
    ({"scheduled_for": 5}, "scheduled_for .*must be a datetime, got int"),
    ({"delay": "10"}, "delay .*must be seconds or a timedelta, got str"),
    ({"delay": True}, "delay .*must be seconds or a timedelta, got bool"),
    ({"timeout": "5"}, "timeout .*must be seconds or a timedelta, got str"),
    ({"timeout": math.nan}, "timeout .*must be a finite number of seconds"),
    ({"delay": 5, "scheduled_for": datetime(2030, 1, 1, tzinfo=UTC)},
     "takes scheduled_for or delay, not both"),
])
def test_wrong_argument_types_name_the_argument(
    client: flowly.Client, options: dict[str, Any], problem: str
) -> None:
    with pytest.raises(flowly.InvalidArgument, match=problem):
        client.start("quick", None, **options)


def test_a_deeply_nested_input_is_refused_clearly(client: flowly.Client) -> None:
    """Past json's depth the input is written without recursion (flowly.deep_json), but
    100,000 levels are more than the server's jsonb parser takes: an InvalidArgument, not
    psycopg's StatementTooComplex."""
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(flowly.InvalidArgument, match="nests too deeply for the database"):
        client.start("quick", deep)


def test_a_non_finite_schedule_is_refused(db: psycopg.Connection[Any]) -> None:
    for value in ("infinity", "-infinity"):
        with pytest.raises(psycopg.Error) as info:
            db.execute("select flowly.start('quick', scheduled_for => %s::timestamptz)",
                       (value,))
        assert info.value.sqlstate == "WF003" and "finite" in str(info.value)
    assert scalar(db, "select count(*) from flowly.runs") == 0
