"""Attacks on the idle-worker latency path, as production would make them: workers frozen,
killed or stopped with a slot offered, starts whose transactions roll back or stay open, a
burst of starts against several worker processes, and runs announced due later whose start
or worker connections misbehave. Each test checks what the README promises: the run executes
once (never twice at once), none is lost, none waits for a poll it was promised not to."""

from __future__ import annotations

import signal
import time
from typing import Any

import psycopg

import flowly
from tests.support import running_worker, scalar, wait_for, worker_process


def handed_off(db: psycopg.Connection[Any], run_id: str) -> bool:
    return bool(scalar(db, "select started_at = created_at from flowly.runs where id = %s",
                       run_id))


def offered(db: psycopg.Connection[Any], worker: str) -> bool:
    return bool(scalar(db, "select count(*) from flowly.handoff_slots where worker_id = %s",
                       worker))


def effects(db: psycopg.Connection[Any], run_id: str) -> list[tuple[str, int]]:
    return db.execute("select step, pid from public.test_effects where run_id = %s"
                      " order by at", (run_id,)).fetchall()


def test_a_slot_a_start_held_while_its_worker_stopped_takes_no_more_runs(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """A worker that stops withdraws its offer, but a slot a start holds in an open
    transaction is skipped, not waited for. That start's commit must not offer the slot of a
    worker that is gone again (the starts after it would be handed to nobody, each waiting
    out its first lease while a live worker sits idle), nor leave its own run to that lease."""
    open_tx = psycopg.connect(dsn)
    with running_worker(dsn, workflows=["echo"], concurrency=4, poll_interval=0.2) as gone:
        wait_for(lambda: offered(db, gone.worker_id), what="an idle slot offered")
        held = scalar(open_tx, "select flowly.start('echo', '{\"value\": \"held\"}')")
        assert scalar(open_tx, "select locked_by from flowly.runs where id = %s",
                      held) == gone.worker_id
    # the worker has stopped (and unregistered); the start commits only now
    with open_tx, running_worker(dsn, workflows=["echo"], concurrency=4,
                                 poll_interval=0.2) as live:
        wait_for(lambda: offered(db, live.worker_id), what="the live worker's slot offered")
        open_tx.commit()
        committed = time.monotonic()
        assert client.wait(held, timeout=15).output == "held"
        waits = [time.monotonic() - committed]
        for value in range(3):
            started = time.monotonic()
            run_id = client.start("echo", {"value": value})
            assert client.wait(run_id, timeout=15).output == value
            waits.append(time.monotonic() - started)
    # neither the held run nor those after it wait out a 5 s first lease for the worker gone
    assert max(waits) < 2, waits
    assert scalar(db, "select count(*) from flowly.handoff_slots where worker_id = %s",
                  gone.worker_id) == 0
