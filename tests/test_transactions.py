"""Transactional steps: the step's SQL and its checkpoint commit together, exactly once."""

from __future__ import annotations

import random
import signal
import time
from typing import Any

import psycopg
import pytest

import flowly
from tests import workflows
from tests.support import kill_at_work, running_worker, scalar, wait_for, worker_process


@pytest.fixture
def accounts(db: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """public.accounts with a and b at 1,000 each; found by the steps through the
    application's search_path (the pool's default), not flowly's."""
    db.execute(workflows.ACCOUNTS_TABLE)
    db.execute("insert into public.accounts values ('a', 1000), ('b', 1000)")
    return db


def balances(db: psycopg.Connection[Any]) -> dict[str, int]:
    return dict(db.execute("select name, balance from public.accounts").fetchall())


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_transfer_commits_each_move_with_its_checkpoint(
    dsn: str, client: flowly.Client, accounts: psycopg.Connection[Any], asynchronous: bool
) -> None:
    run_id = client.start("transfer", {"from": "a", "to": "b", "amount": 30,
                                       "async": asynchronous})
    with running_worker(dsn):
        run = client.wait(run_id, timeout=30)
    assert run.status == "completed" and run.output == [970, 1030]
    assert balances(accounts) == {"a": 970, "b": 1030}
    assert [(s.name, s.kind) for s in client.steps(run_id)] == [
        ("debit", "transaction"), ("pause", "step"), ("credit", "transaction")]


def test_a_failing_transaction_rolls_back_its_sql(
    dsn: str, client: flowly.Client, accounts: psycopg.Connection[Any]
) -> None:
    run_id = client.start("transaction_cases", {"case": "fails"})
    with running_worker(dsn):
        run = client.wait(run_id, timeout=30)
    assert run.status == "dead_letter" and run.error["message"] == "changed my mind"
    assert balances(accounts)["a"] == 1000


def test_serialization_failures_get_fresh_transactions_then_fail_the_step(
    dsn: str, client: flowly.Client, accounts: psycopg.Connection[Any]
) -> None:
    recovers = client.start("transaction_cases", {"case": "conflicts", "conflicts": 2})
    gives_up = client.start("transaction_cases", {"case": "conflicts", "conflicts": 99})
    with running_worker(dsn):
        recovered = client.wait(recovers, timeout=30)
        given_up = client.wait(gives_up, timeout=30)
    assert recovered.status == "completed" and recovered.output == 3
    assert workflows.CALLS[recovers] == ["try"] * 3
    assert given_up.status == "dead_letter"
    assert given_up.error["type"] == "TransactionConflict"
    assert len(workflows.CALLS[gives_up]) == 5
    assert balances(accounts)["a"] == 1001  # each rolled-back try left nothing


def test_a_transactional_compensation_undoes_its_step_once(
    dsn: str, client: flowly.Client, accounts: psycopg.Connection[Any]
) -> None:
    run_id = client.start("transaction_cases", {"case": "saga"})
    with running_worker(dsn):
        run = client.wait(run_id, timeout=30)
    assert run.status == "dead_letter" and run.compensation_ok is True
    assert balances(accounts)["a"] == 1000  # +5, then -5
    move = next(s for s in client.steps(run_id) if s.name == "move")
    assert (move.kind, move.compensation_status) == ("transaction", "completed")


def test_a_worker_that_lost_its_lease_cannot_commit_its_transaction(
    dsn: str, client: flowly.Client, accounts: psycopg.Connection[Any]
) -> None:
    """Worker A is frozen (SIGSTOP) inside its transactional step, past its lease; its session
    is ended, worker B takes the run over and commits the step; A, thawed, commits nothing."""
    run_id = client.start("transaction_cases", {"case": "slow", "seconds": 2})
    with worker_process(dsn, "--lease", "1") as frozen:
        wait_for(lambda: scalar(accounts, "select count(*) from public.test_effects"
                                          " where run_id = %s", run_id), what="A inside")
        frozen.signal(signal.SIGSTOP)
        with worker_process(dsn, "--lease", "1") as taker:
            run = client.wait(run_id, timeout=60)
            frozen.signal(signal.SIGCONT)
            time.sleep(3)  # A wakes up, finishes its sleep and tries to commit
            taker.stop()
        frozen.stop()
    assert run.status == "completed"
    assert scalar(accounts, "select count(*) from public.test_effects where run_id = %s",
                  run_id) == 2  # both workers ran it
    assert balances(accounts)["a"] == 1001  # the effect landed once


def test_transfers_stay_exact_while_workers_are_killed(
    dsn: str, client: flowly.Client, accounts: psycopg.Connection[Any]
) -> None:
    """200 transfers with transactional steps and 200 with ordinary steps, while the worker is
    SIGKILLed at random moments 30 times: the transactional balances are exact; the ordinary
    ones double-apply (which shows the test can tell the difference)."""
    accounts.execute("insert into public.accounts values ('c', 1000), ('d', 1000)")
    n = 200
    for i in range(n):
        client.start("transfer", {"from": "a", "to": "b", "amount": 1, "pause": 0.01},
                     run_id=f"tx-{i}")
        client.start("transfer_untransacted", {"from": "c", "to": "d", "amount": 1,
                                               "pause": 0.05}, run_id=f"plain-{i}")
    def all_completed() -> bool:
        return bool(scalar(accounts, "select count(*) = %s from flowly.runs"
                                     " where status = 'completed'", 2 * n))

    chance = random.Random(7)
    kills = 0
    while kills < 30:
        kill_at_work(dsn, accounts, "--lease", "1", "--concurrency", "16",
                     pause=chance.uniform(0.0, 0.4), done=all_completed)
        kills += 1
    with worker_process(dsn, "--lease", "1", "--concurrency", "32"):
        wait_for(all_completed, timeout=120, what="every transfer completed")
    final = balances(accounts)
    assert final["a"] == 1000 - n and final["b"] == 1000 + n, final
    assert final["c"] + final["d"] != 2000 or final["c"] < 1000 - n, final  # double-applied
