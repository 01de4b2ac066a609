"""The dashboard views of 0002_dashboard_views.sql, checked against a known mix of runs.

The mix is built through the SQL API only (start, claim, checkpoint, complete, fail_step,
record_compensation, finish_compensation, cancel, register_worker, heartbeat), the way a
worker or psql would drive the engine, then every view must report exactly the expected
figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

# Slack for durations measured by the server (a statement's own run time, a loaded CI box).
SLACK_MS = 100
# How long the oldest due run has waited, at least, when the views are read.
OLDEST_WAIT = 0.3


class Api:
    """Thin helpers over the SQL API of schema "flowly", on an autocommit connection (each
    call is its own transaction, as for a worker)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def call(self, function: str, *args: Any, **named: Any) -> list[tuple[Any, ...]]:
        """``select * from flowly.<function>(args..., name => value...)``; returns all rows."""
        parts = [sql.Placeholder() for _ in args]
        parts += [sql.SQL("{} => {}").format(sql.Identifier(k), sql.Placeholder()) for k in named]
        query = sql.SQL("select * from flowly.{}({})").format(
            sql.Identifier(function), sql.SQL(", ").join(parts))
        return self.conn.execute(query, [*args, *named.values()]).fetchall()

    def start(self, workflow: str, run_id: str, **options: Any) -> str:
        (started,), = self.call("start", workflow, run_id=run_id, **options)
        assert started == run_id
        return run_id

    def claim(self, worker: str, workflow: str, run_id: str, queue: str = "default",
              lease: timedelta = timedelta(hours=1)) -> int:
        """Claim exactly ``run_id`` (the only due run of top priority) and return its epoch."""
        rows = self.call("claim", worker, [workflow], [queue], 1, lease)
        assert [r[0] for r in rows] == [run_id], f"expected to claim {run_id}, got {rows}"
        return rows[0][5]

    def checkpoint(self, run_id: str, epoch: int, name: str, ms_ago: int | None = None,
                   compensable: bool = False) -> None:
        """Checkpoint step ``name``; with ``ms_ago`` the step started that long before now, so
        it lasted that long (finished_at is stamped by the engine)."""
        started = (sql.SQL("clock_timestamp() - make_interval(secs => {} / 1000.0)").format(
            sql.Literal(ms_ago)) if ms_ago is not None else sql.SQL("now()"))
        self.conn.execute(sql.SQL(
            "select flowly.checkpoint(%s, %s, %s, %s, p_started_at => {}, p_compensable => %s)"
        ).format(started), (run_id, epoch, name, Jsonb({"step": name}), compensable))

    def fail_step(self, run_id: str, epoch: int, name: str, error: Any,
                  max_attempts: int = 1, initial_delay: float = 60) -> str:
        (decision, _), = self.conn.execute(
            "select * from flowly.fail_step(%s, %s, %s, %s, now(), %s, 'fixed', %s, 300)",
            (run_id, epoch, name, Jsonb(error), max_attempts, initial_delay)).fetchall()
        return str(decision)


@dataclass
class Mix:
    """What the populated database holds, for the assertions."""

    epochs: dict[str, int]
    oldest_started: float  # time.monotonic() when the oldest due run was started


def populate(api: Api) -> Mix:
    """Build the known mix (see each view's test for the figures it implies).

    Runs to be claimed are started with priority 100 and claimed one at a time (limit 1), so
    each claim takes exactly that run while the priority-0 pending runs stay pending. The
    claim with a 1 ms lease comes last, since once expired its run is claimable again.
    """
    epochs: dict[str, int] = {}
    api.call("register_worker", "w-live", ["orders", "emails"], ["default"],
             timedelta(hours=1))
    api.call("register_worker", "w-gone", ["reports"], ["default"], timedelta(milliseconds=1))

    # due pending runs that a live worker serves: never stuck
    api.start("orders", "o-oldest")
    oldest_started = time.monotonic()
    time.sleep(OLDEST_WAIT)
    api.start("orders", "o-pending")

    # two completed orders with known step durations
    for run_id, mixed_ms in (("o-done-1", 100), ("o-done-2", 300)):
        api.start("orders", run_id, priority=100)
        epoch = api.claim("w-live", "orders", run_id)
        api.checkpoint(run_id, epoch, "validate", ms_ago=100)
        api.checkpoint(run_id, epoch, "charge", ms_ago=300)
        api.checkpoint(run_id, epoch, "mixed", ms_ago=mixed_ms)
        api.call("complete", run_id, epoch, Jsonb({"ok": True}))

    # a saga whose compensation succeeded
    api.start("orders", "o-saga-ok", priority=100)
    epoch = api.claim("w-live", "orders", "o-saga-ok")
    api.checkpoint("o-saga-ok", epoch, "reserve", compensable=True)
    assert api.fail_step("o-saga-ok", epoch, "charge",
                         {"type": "CardDeclined", "message": "card declined"}) == "compensate"
    api.call("record_compensation", "o-saga-ok", epoch, "reserve")
    assert api.call("finish_compensation", "o-saga-ok", epoch) == [(True,)]

    # a saga where one of two compensations failed
    api.start("orders", "o-saga-bad", priority=100)
    epoch = api.claim("w-live", "orders", "o-saga-bad")
    api.checkpoint("o-saga-bad", epoch, "reserve", compensable=True)
    api.checkpoint("o-saga-bad", epoch, "notify", compensable=True)
    assert api.fail_step("o-saga-bad", epoch, "ship",
                         {"type": "NoCourier", "message": "no courier"}) == "compensate"
    api.call("record_compensation", "o-saga-bad", epoch, "notify",
             Jsonb({"type": "Boom", "message": "undo failed"}))
    api.call("record_compensation", "o-saga-bad", epoch, "reserve")
    assert api.call("finish_compensation", "o-saga-bad", epoch) == [(False,)]

    # a saga still compensating, held by the live worker
    api.start("orders", "o-compensating", priority=100)
    epochs["o-compensating"] = epoch = api.claim("w-live", "orders", "o-compensating")
    api.checkpoint("o-compensating", epoch, "reserve", compensable=True)
    assert api.fail_step("o-compensating", epoch, "charge",
                         {"type": "CardDeclined", "message": "card declined"}) == "compensate"

    # a running order held by the live worker
    api.start("orders", "o-running", priority=100)
    epochs["o-running"] = api.claim("w-live", "orders", "o-running")

    # emails: dead-lettered without compensations, waiting for a retry, cancelled twice
    api.start("emails", "e-dead", priority=100)
    epoch = api.claim("w-live", "emails", "e-dead")
    assert api.fail_step("e-dead", epoch, "send",
                         {"type": "SMTPError", "message": "mailbox full"}) == "dead_letter"
    api.start("emails", "e-retry", priority=100)
    epoch = api.claim("w-live", "emails", "e-retry")
    assert api.fail_step("e-retry", epoch, "send", {"type": "SMTPError", "message": "busy"},
                         max_attempts=3, initial_delay=60) == "retry"
    api.start("emails", "e-cancel")
    assert api.call("cancel", "e-cancel") == [("cancelled",)]
    api.start("emails", "e-cancel-running", priority=100)
    epochs["e-cancel-running"] = api.claim("w-live", "emails", "e-cancel-running")
    assert api.call("cancel", "e-cancel-running") == [("cancelled",)]

    # last claim: a worker that will never heartbeat, with a lease that expires at once
    api.start("orders", "o-expired", priority=100)
    api.claim("w-crashed", "orders", "o-expired", lease=timedelta(milliseconds=1))

    # pending runs: scheduled for later; due in a queue nobody serves; due for a workflow
    # whose only worker is gone; and one that times out before anyone takes it
    (in_one_hour,) = api.conn.execute("select now() + interval '1 hour'").fetchone()
    api.start("orders", "o-later", scheduled_for=in_one_hour)
    api.start("orders", "o-bulk", queue="bulk")
    api.start("reports", "r-pending")
    api.start("emails", "e-timeout", timeout=timedelta(milliseconds=1))

    time.sleep(0.2)  # leases of 1 ms expire, w-gone stops being live, e-timeout times out
    # the live worker extends its two leases; the cancelled run is reported as not held
    not_held = api.call("heartbeat", "w-live",
                        ["o-running", "o-compensating", "e-cancel-running"],
                        [epochs["o-running"], epochs["o-compensating"],
                         epochs["e-cancel-running"]], timedelta(hours=1))
    assert not_held == [("e-cancel-running", "lost")]
    return Mix(epochs, oldest_started)


@pytest.fixture
def mix(db: psycopg.Connection[Any]) -> Mix:
    """The database of ``db`` populated with the known mix."""
    return populate(Api(db))


def rows(db: psycopg.Connection[Any], query: str) -> list[dict[str, Any]]:
    """The rows of ``query`` as dicts."""
    with db.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute(query).fetchall()


# --- run_counts ----------------------------------------------------------------------------

def test_run_counts(db: psycopg.Connection[Any], mix: Mix) -> None:
    """One row per (workflow, status) with the number of runs in it."""
    counts = {(r["workflow"], r["status"]): r["runs"]
              for r in rows(db, "select * from flowly.run_counts")}
    assert counts == {
        ("orders", "pending"): 4,        # o-oldest, o-pending, o-later, o-bulk
        ("orders", "running"): 2,        # o-running, o-expired
        ("orders", "compensating"): 1,
        ("orders", "completed"): 2,
        ("orders", "dead_letter"): 2,    # the two sagas
        ("emails", "pending"): 1,        # e-retry, waiting for its backoff
        ("emails", "dead_letter"): 2,    # e-dead, e-timeout
        ("emails", "cancelled"): 2,
        ("reports", "pending"): 1,
    }


# --- dead_letters --------------------------------------------------------------------------

def test_dead_letters(db: psycopg.Connection[Any], mix: Mix) -> None:
    """Each dead-lettered run with the step that failed, its last error message and whether
    its compensations all succeeded (null when it had none)."""
    found = {r["run_id"]: r for r in rows(db, "select * from flowly.dead_letters")}
    assert set(found) == {"o-saga-ok", "o-saga-bad", "e-dead", "e-timeout"}
    summary = {run_id: (r["workflow"], r["failed_step"], r["last_error"], r["compensation_ok"])
               for run_id, r in found.items() if run_id != "e-timeout"}
    assert summary == {
        "o-saga-ok": ("orders", "charge", "card declined", True),
        "o-saga-bad": ("orders", "ship", "no courier", False),
        "e-dead": ("emails", "send", "mailbox full", None),
    }
    timed_out = found["e-timeout"]
    assert timed_out["failed_step"] is None
    assert timed_out["last_error"].startswith("run exceeded its timeout")
    assert timed_out["error"]["type"] == "Timeout"
    assert timed_out["compensation_ok"] is None
    for r in found.values():
        assert r["queue"] == "default"
        assert r["attempt"] == 1
        assert r["finished_at"] is not None and r["finished_at"] >= r["created_at"]


@pytest.mark.parametrize("error", [
    {"type": "ValueError", "message": "bad input", "step": "something else"},
    "plain text error",
], ids=["error-object-with-step-key", "error-not-an-object"])
def test_dead_letters_name_the_failed_step_whatever_the_error_json(
        db: psycopg.Connection[Any], error: Any) -> None:
    """fail_step's p_error is caller-supplied JSON (psql, triggers, other languages): the
    dead_letters view must still name the step that failed, not a ``step`` key of the error,
    and must not lose it when the error is not a JSON object."""
    api = Api(db)
    api.start("wf", "r1", priority=100)
    epoch = api.claim("w", "wf", "r1")
    assert api.fail_step("r1", epoch, "the-step", error) == "dead_letter"
    (row,) = rows(db, "select failed_step from flowly.dead_letters")
    assert row["failed_step"] == "the-step"


# --- step_latency --------------------------------------------------------------------------

def test_step_latency(db: psycopg.Connection[Any], mix: Mix) -> None:
    """Counts of completed steps per (workflow, step) (failed steps excluded) and duration
    percentiles that match the durations the checkpoints were given."""
    latency = {(r["workflow"], r["step"]): r
               for r in rows(db, "select * from flowly.step_latency")}
    assert {k: r["completed"] for k, r in latency.items()} == {
        ("orders", "validate"): 2,
        ("orders", "charge"): 2,   # the two failed 'charge' steps are not counted
        ("orders", "mixed"): 2,
        ("orders", "reserve"): 3,  # the three sagas
        ("orders", "notify"): 1,
    }

    def near(value: Any, expected: float) -> bool:
        return expected <= float(value) <= expected + SLACK_MS

    validate, charge, mixed = (latency["orders", s] for s in ("validate", "charge", "mixed"))
    for stats, ms in ((validate, 100), (charge, 300)):
        for column in ("p50_ms", "p95_ms", "p99_ms", "max_ms"):
            assert near(stats[column], ms), (stats["step"], column, stats[column])
    assert validate["p50_ms"] < charge["p50_ms"]
    # 100 ms and 300 ms: linear interpolation puts p50 at 200, p95 at 290, p99 at 298
    assert near(mixed["p50_ms"], 200), mixed
    assert near(mixed["p95_ms"], 290), mixed
    assert near(mixed["p99_ms"], 298), mixed
    assert near(mixed["max_ms"], 300), mixed
    for stats in latency.values():
        # max_ms is numeric, the percentiles double precision: compare as floats, with an
        # epsilon for the percentiles' rounding
        p50, p95, p99, top = (float(stats[c]) for c in ("p50_ms", "p95_ms", "p99_ms", "max_ms"))
        assert 0 <= p50 <= p95 + 1e-6 and p95 <= p99 + 1e-6 and p99 <= top + 1e-6, stats


# --- throughput ----------------------------------------------------------------------------

def test_throughput(db: psycopg.Connection[Any], mix: Mix) -> None:
    """Finished runs per (minute, workflow, final status): every finished run counted once,
    in the minute it finished, unfinished runs not at all."""
    found = rows(db, "select * from flowly.throughput")
    totals: dict[tuple[str, str], int] = {}
    for r in found:
        totals[r["workflow"], r["status"]] = totals.get((r["workflow"], r["status"]), 0) + r["runs"]
    assert totals == {
        ("orders", "completed"): 2,
        ("orders", "dead_letter"): 2,
        ("emails", "dead_letter"): 2,
        ("emails", "cancelled"): 2,
    }
    (now,) = db.execute("select now()").fetchone()
    for r in found:
        minute = r["minute"]
        assert minute.second == 0 and minute.microsecond == 0, minute
        assert now - timedelta(minutes=5) < minute <= now
    # the minutes are those the runs finished in
    expected = rows(db, "select date_trunc('minute', finished_at) as minute, workflow, status,"
                        " count(*) as runs from flowly.runs where finished_at is not null"
                        " group by 1, 2, 3")
    assert sorted(found, key=repr) == sorted(expected, key=repr)


def test_throughput_buckets_by_minute(db: psycopg.Connection[Any], mix: Mix) -> None:
    """Runs that finished in different minutes land in different rows. The API stamps
    finished_at with now(), so this test moves one finished run 5 minutes into the past."""
    db.execute("update flowly.runs set finished_at = finished_at - interval '5 minutes'"
               " where id = 'o-done-1'")
    completed = rows(db, "select minute, runs from flowly.throughput"
                         " where workflow = 'orders' and status = 'completed' order by minute")
    assert [r["runs"] for r in completed] == [1, 1]
    assert completed[1]["minute"] - completed[0]["minute"] >= timedelta(minutes=4)


# --- stuck_runs ----------------------------------------------------------------------------

def test_stuck_runs(db: psycopg.Connection[Any], mix: Mix) -> None:
    """Runs held under an expired lease, and due pending runs no live worker serves (its
    workflow's worker is gone, or nobody serves its queue); not the runs a live worker serves,
    not runs scheduled for later, not runs under a valid lease."""
    found = {r["run_id"]: r for r in rows(db, "select * from flowly.stuck_runs")}
    assert {k: (r["reason"], r["status"], r["locked_by"]) for k, r in found.items()} == {
        "o-expired": ("expired_lease", "running", "w-crashed"),
        "o-bulk": ("no_live_worker", "pending", None),
        "r-pending": ("no_live_worker", "pending", None),
    }
    assert found["o-bulk"]["queue"] == "bulk"
    assert found["r-pending"]["workflow"] == "reports"
    for r in found.values():
        assert timedelta(0) < r["stuck_for"] < timedelta(minutes=5), r


def test_stuck_runs_notices_a_worker_that_comes_and_goes(db: psycopg.Connection[Any],
                                                        mix: Mix) -> None:
    """A worker registering for 'reports' makes r-pending not stuck any more; once it is gone
    (its lease ran out without a heartbeat), the run is stuck again."""
    api = Api(db)
    stuck = "select run_id from flowly.stuck_runs where reason = 'no_live_worker' order by 1"
    api.call("register_worker", "w-reports", ["reports"], ["default"],
             timedelta(seconds=1))
    assert db.execute(stuck).fetchall() == [("o-bulk",)]
    time.sleep(1.1)
    assert db.execute(stuck).fetchall() == [("o-bulk",), ("r-pending",)]


# --- queue_backlog -------------------------------------------------------------------------

def test_queue_backlog(db: psycopg.Connection[Any], mix: Mix) -> None:
    """Per queue: due pending runs, pending runs scheduled for later (including a retry's
    backoff), runs in flight (running or compensating, expired lease or not), and the age of
    the oldest due run."""
    elapsed = time.monotonic() - mix.oldest_started
    backlog = {r["queue"]: r for r in rows(db, "select * from flowly.queue_backlog")}
    assert {q: (r["due"], r["scheduled"], r["in_flight"]) for q, r in backlog.items()} == {
        # due: o-oldest, o-pending, r-pending; scheduled: o-later, e-retry;
        # in flight: o-running, o-compensating, o-expired
        "default": (3, 2, 3),
        "bulk": (1, 0, 0),
    }
    oldest = backlog["default"]["oldest_due_age"]
    assert timedelta(seconds=OLDEST_WAIT) <= oldest <= timedelta(seconds=elapsed + 1), oldest
    assert timedelta(0) <= backlog["bulk"]["oldest_due_age"] < oldest


# --- live_workers --------------------------------------------------------------------------

def test_live_workers(db: psycopg.Connection[Any], mix: Mix) -> None:
    """Only workers seen within their lease, with what they serve and how many runs they
    hold (running or compensating, locked by them)."""
    found = rows(db, "select * from flowly.live_workers")
    assert [(r["worker"], r["workflows"], r["queues"], r["runs_held"]) for r in found] == [
        ("w-live", ["orders", "emails"], ["default"], 2),  # o-running, o-compensating
    ]
    assert found[0]["last_seen_at"] >= found[0]["started_at"]
    # the heartbeat refreshed last_seen_at after registration
    assert found[0]["last_seen_at"] > found[0]["started_at"]
