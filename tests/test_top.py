"""``flowly top``: the live view of the engine, through ``--once`` (text and JSON) and through a
real pseudo-terminal (it draws, refreshes and quits on ``q``)."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from flowly.top import snapshot
from tests.support import ROOT
from tests.test_cli import flowly, ok


def _scene(db: psycopg.Connection[Any]) -> None:
    """Runs in every state the view shows, written straight into the tables."""
    db.execute("select flowly.register_worker('w-alive:42:host', array['order'],"
               " array['default'], interval '30 seconds')")
    for run_id in ("due-1", "due-2", "running-1", "expired-1", "retrying-1", "dead-1", "done-1"):
        db.execute("select flowly.start('order', '{}', run_id => %s)", (run_id,))
    db.execute("select flowly.start('order', '{}', run_id => 'later-1',"
               " scheduled_for => now() + interval '1 hour')")
    db.execute("update flowly.runs set created_at = now() - interval '90 seconds',"
               " scheduled_for = now() - interval '90 seconds' where id = 'due-1'")
    db.execute("update flowly.runs set status = 'running', started_at = now() - interval '5 s',"
               " locked_by = 'w-alive:42:host', locked_until = now() + interval '20 s'"
               " where id = 'running-1'")
    db.execute("insert into flowly.steps (run_id, name, seq, status, output, started_at,"
               " finished_at) values ('running-1', 'reserve_inventory', 1, 'completed', 'null',"
               " now() - interval '4 s', now() - interval '3 s')")
    db.execute("update flowly.runs set status = 'running', started_at = now() - interval '60 s',"
               " locked_by = 'w-dead:7:host', locked_until = now() - interval '10 s'"
               " where id = 'expired-1'")
    db.execute("update flowly.runs set scheduled_for = now() + interval '40 s'"
               " where id = 'retrying-1'")
    db.execute("insert into flowly.step_attempts (run_id, step_name, generation, attempt, error,"
               " started_at, failed_at, retry_at) values ('retrying-1', 'charge_payment', 1, 1,"
               " %s, now() - interval '2 s', now() - interval '1 s', now() + interval '40 s')",
               (Jsonb({"type": "RuntimeError", "message": "gateway timeout"}),))
    db.execute("update flowly.runs set status = 'dead_letter', finished_at = now(), error = %s"
               " where id = 'dead-1'",
               (Jsonb({"type": "RuntimeError", "message": "card 0000 declined",
                       "step": "charge_payment"}),))
    db.execute("update flowly.runs set status = 'completed', finished_at = now(),"
               " output = '{}' where id = 'done-1'")


def test_snapshot_reads_every_panel(dsn: str, db: psycopg.Connection[Any]) -> None:
    _scene(db)
    with psycopg.connect(dsn, autocommit=True) as conn:
        snap = snapshot(conn, "flowly")
    counts = snap["statuses"]
    assert counts["pending"]["runs"] == 4 and counts["running"]["runs"] == 2
    assert counts["completed"]["runs"] == 1 and counts["completed"]["per_minute"] == 1
    assert counts["dead_letter"]["runs"] == 1
    (queue,) = snap["queues"]
    assert (queue["queue"], queue["due"], queue["scheduled"], queue["in_flight"]) == (
        "default", 2, 2, 2)
    assert queue["oldest_due_age"] >= 89
    (worker,) = snap["workers"]
    assert worker["worker"] == "w-alive:42:host" and worker["held"] == ["running-1"]
    in_flight = {r["run_id"]: r for r in snap["in_flight"]}
    assert in_flight["running-1"]["last_step"] == "reserve_inventory"
    assert in_flight["running-1"]["steps_done"] == 1
    assert 2 <= in_flight["running-1"]["step_age"] < 60
    assert in_flight["expired-1"]["lease"] == "expired"
    assert snap["leases"] == {"held": 1, "expired": 1}
    (retry,) = snap["retries"]
    assert retry["run_id"] == "retrying-1" and retry["step"] == "charge_payment"
    assert 30 < retry["retry_in"] <= 40 and "gateway timeout" in retry["error"]
    (dead,) = snap["dead_letters"]
    assert dead["run_id"] == "dead-1" and "card 0000 declined" in dead["error"]
    stuck = {s["run_id"]: s["reason"] for s in snap["stuck"]}
    assert stuck["expired-1"] == "expired_lease"


def test_top_once_prints_every_panel(dsn: str, db: psycopg.Connection[Any]) -> None:
    _scene(db)
    out = ok(flowly("top", "--once", dsn=dsn, env={"COLUMNS": "120"}))
    for text in ("pending", "dead_letter", "default", "w-alive:42:host", "running-1",
                 "reserve_inventory", "retrying-1", "charge_payment", "gateway timeout",
                 "card 0000 declined", "expired", "Queues", "Workers", "Retries",
                 "Dead letters"):
        assert text in out, f"{text!r} missing from:\n{out}"
    assert "\x1b[" not in out  # no escape codes into a pipe


@pytest.mark.parametrize("columns", [40, 60])
def test_top_once_fits_a_narrow_terminal(dsn: str, db: psycopg.Connection[Any],
                                         columns: int) -> None:
    _scene(db)
    out = ok(flowly("top", "--once", dsn=dsn, env={"COLUMNS": str(columns)}))
    too_wide = [line for line in out.splitlines() if len(line) > columns]
    assert not too_wide, "\n".join(too_wide)
    assert "dead_letter" in out or "dead_let" in out


def test_top_once_json(dsn: str, db: psycopg.Connection[Any]) -> None:
    _scene(db)
    snap = json.loads(ok(flowly("--json", "top", "--once", dsn=dsn)))
    assert snap["statuses"]["dead_letter"]["runs"] == 1
    assert snap["workers"][0]["held"] == ["running-1"]


def test_top_on_an_empty_engine(dsn: str) -> None:
    out = ok(flowly("top", "--once", dsn=dsn))
    assert "no runs" in out.lower()


@pytest.mark.parametrize("term", ["xterm", "dumb"])
def test_top_in_a_terminal_refreshes_and_quits_on_q(dsn: str, db: psycopg.Connection[Any],
                                                    term: str) -> None:
    _scene(db)
    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("FLOWLY_DSN", "DATABASE_URL")}
    env.update(PYTHONPATH=str(ROOT), TERM=term, COLUMNS="100", LINES="40")
    proc = subprocess.Popen([sys.executable, "-m", "flowly", "--dsn", dsn, "top"],
                            stdin=follower, stdout=follower, stderr=follower, env=env,
                            cwd=ROOT, close_fds=True)
    os.close(follower)
    screen = b""

    def text() -> str:
        return re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", screen).decode(errors="replace")

    def read_for(seconds: float, until: int = 0) -> None:
        """Read the screen for ``seconds``, or until ``until`` frames were drawn."""
        nonlocal screen
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (until and text().count("flowly top")
                                                    >= until):
            ready, _, _ = select.select([leader], [], [], 0.1)
            if ready:
                try:
                    screen += os.read(leader, 65536)
                except OSError:
                    return

    try:
        read_for(20, until=1)  # start-up (slow on a busy machine)
        first = time.monotonic()
        read_for(5, until=2)
        assert "running-1" in text() and "Queues" in text(), text()[-2000:]
        assert text().count("flowly top") >= 2, "no refresh within 5 s"
        assert time.monotonic() - first < 3  # about a second apart
        assert proc.poll() is None
        # a dumb terminal gets frames one after the other, never the alternate screen
        assert (b"\x1b[?1049h" in screen) == (term != "dumb")
        os.write(leader, b"q")
        assert proc.wait(timeout=5) == 0
        read_for(0.3)
        assert b"Traceback" not in screen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
