"""Attacks on migrations 0021-0023: purge and the waits it must keep answering."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from flowly.schema import install_dsn
from tests.support import claim_as, park_on_run, scalar

FAILED = '{"type": "ValueError", "message": "boom"}'
CHILD_FAILED = '{"type": "ChildFailed", "message": "run c ended dead_letter"}'


def _dead_letter(db: psycopg.Connection[Any], run_id: str, epoch: int, error: str) -> None:
    db.execute("select flowly.fail_run(%s, %s, %s::jsonb, false)", (run_id, epoch, error))
    assert scalar(db, "select status from flowly.runs where id = %s", run_id) == "dead_letter"


def _waiter_dead_lettered_by(db: psycopg.Connection[Any]) -> None:
    """Run p waits (ctx.wait_for_run) for run c, an independent run (not its child); c
    dead-letters, p records that failure and dead-letters with ChildFailed."""
    db.execute("select flowly.start('waiter', run_id => 'p')")
    db.execute("select flowly.start('target', run_id => 'c')")
    c_epoch = claim_as(db, "target")["c"]
    p_epoch = claim_as(db, "waiter")["p"]
    park_on_run(db, "p", p_epoch, "c")
    _dead_letter(db, "c", c_epoch, FAILED)
    p_epoch = claim_as(db, "waiter")["p"]
    row = db.execute("select outcome, status from flowly.wait_for_run('p', %s, 'run:c', 'c')",
                     (p_epoch,)).fetchone()
    assert row == ("finished", "dead_letter")
    _dead_letter(db, "p", p_epoch, CHILD_FAILED)
    # c finished long ago, p just now: a purge of runs older than an hour is about c alone
    db.execute("update flowly.runs set finished_at = now() - interval '2 hours' where id = 'c'")


def test_purge_right_after_a_retry_keeps_the_run_whose_failure_the_retry_asks_for_again(
    db: psycopg.Connection[Any]
) -> None:
    """0023 keeps c while the dead-lettered p holds the recorded failure that ended it. But
    retry_dead_letter moves that record to step_history at once, and until a worker claims
    the new generation and registers its wait again nothing names c: a purge in that moment
    deletes c, and the retried p fails with RunNotFound - the very loss 0023 set out to
    prevent (for a child, the parent rule covers it; for any other awaited run it does not)."""
    _waiter_dead_lettered_by(db)
    db.execute("select flowly.purge('1 hour')")
    assert scalar(db, "select count(*) from flowly.runs where id = 'c'") == 1  # kept: fine
    db.execute("select flowly.retry_dead_letter('p')")
    db.execute("select flowly.purge('1 hour')")  # before a worker gets to p
    epoch = claim_as(db, "waiter")["p"]
    try:
        outcome = scalar(db, "select outcome from flowly.wait_for_run('p', %s, 'run:c', 'c')",
                         epoch)
    except psycopg.Error as exc:
        pytest.fail(f"the retried waiter's wait fails: {exc.sqlstate} {exc}")
    assert outcome == "finished"


def test_purge_keeps_a_failure_recorded_before_the_upgrade_that_a_retry_asks_for_again(
    empty_dsn: str
) -> None:
    """A wait outcome recorded before 0022 has no run_id (0009's wait_for_run wrote status,
    output and error only). The upgrade to 0023 must name the run in such records, or for
    every run dead-lettered before the upgrade the new rule finds nothing and purge deletes
    the failed run its retry needs."""
    install_dsn(empty_dsn, target=21)
    with psycopg.connect(empty_dsn, autocommit=True) as db:
        _waiter_dead_lettered_by(db)
        assert scalar(db, "select output ? 'run_id' from flowly.steps"
                          " where run_id = 'p' and kind = 'run'") is False
        install_dsn(empty_dsn)  # the upgrade
        db.execute("select flowly.purge('1 hour')")
        db.execute("select flowly.retry_dead_letter('p')")
        epoch = claim_as(db, "waiter")["p"]
        try:
            scalar(db, "select outcome from flowly.wait_for_run('p', %s, 'run:c', 'c')", epoch)
        except psycopg.Error as exc:
            pytest.fail(f"the retried waiter's wait fails: {exc.sqlstate} {exc}")
