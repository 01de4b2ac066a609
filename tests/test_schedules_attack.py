"""Attacks on cron schedules (tick_schedules, schedule, pause/resume/unschedule, cron_next)
and their Python surface. Each test states the guarantee it checks."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import psycopg
import pytest

import flowly
from tests.support import ROOT, running_worker, scalar, wait_for
from tests.test_schedules import schedule, tick

# --- Python argument checks -------------------------------------------------------------------

@pytest.mark.parametrize("options", [
    {"max_attempts": 2**31},   # does not fit the integer column
    {"max_attempts": 1.5},
    {"priority": True},
])
def test_out_of_range_schedule_options_are_invalid_argument(dsn: str,
                                                           options: dict[str, Any]) -> None:
    """client.start refuses these with flowly.InvalidArgument naming the option;
    client.schedule must too, not claim that flowly is not installed."""
    with flowly.Client(dsn) as client:
        with pytest.raises(flowly.InvalidArgument):
            client.start("quick", None, **options)
        with pytest.raises(flowly.InvalidArgument):
            client.schedule("s", "* * * * *", "quick", **options)


# --- one broken schedule does not hold up the others ----------------------------------------

def test_failing_schedules_do_not_starve_the_healthy_ones(db: psycopg.Connection[Any]) -> None:
    """README: a schedule that fails to fire 'keeps its fire time, shows why in last_error, and
    does not hold up the others'. A zone that vanished from the tz database fails every
    schedule of that zone (a tenant per schedule: a hundred of them); their fire times stay
    the oldest due ones, and every tick (batch 100, soonest first) spends its whole batch on
    them: a healthy schedule due a few seconds later never fires."""
    with db.transaction():
        for i in range(100):
            schedule(db, f"tenant{i:03}", "0 9 * * *")
        schedule(db, "healthy", "0 9 * * *")
        db.execute("update flowly.schedules set timezone = 'Gone/Zone',"
                   " next_fire_at = date_trunc('second', now()) - interval '20 seconds'"
                   " where name like 'tenant%'")
        db.execute("update flowly.schedules"
                   " set next_fire_at = date_trunc('second', now()) - interval '5 seconds'"
                   " where name = 'healthy'")
    outcomes: list[str] = []
    for _ in range(3):  # three workers' ticks in a row
        outcomes += [row[3] for row in tick(db) if row[0] == "healthy"]
    assert outcomes == ["started"], (
        f"healthy schedule outcomes over 3 ticks: {outcomes}; last_error of the broken:"
        f" {scalar(db, 'select last_error from flowly.schedules where name = %s', 'tenant000')}")
    assert scalar(db, "select count(*) from flowly.runs where starts_with(id, 'healthy@')") == 1


# --- a running worker never misses a fire time --------------------------------------------------

def test_a_running_worker_starts_every_fire_time_of_a_large_batch(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    """README: every worker ticks at least every 15 s whatever its poll_interval, and only a
    fire time more than a minute old when a worker ticks was missed ('no worker was running').
    But a tick handles at most 100 schedules and the worker calls it once per interval: with
    poll_interval=15 and 250 schedules due 50 s ago (the worker came up 50 s after the fire
    time, or 250 tenants share '0 * * * *' and ticks fall behind), the first tick starts 100
    and the next, 15 s later, finds the other 150 more than a minute old and skips them, while
    a worker was running all along. (With 500 schedules sharing a fire time the same happens
    with no downtime at all: 100 per 15 s is 400 a minute.)"""
    with db.transaction():
        for i in range(250):
            schedule(db, f"t{i:03}", "0 0 1 1 *", queue="nobody_serves_this")
        db.execute("update flowly.schedules"
                   " set next_fire_at = date_trunc('second', now()) - interval '50 seconds'")
    with running_worker(dsn, poll_interval=15):
        wait_for(lambda: scalar(db, "select count(*) from flowly.runs") >= 100,
                 what="the first tick")
        # the next tick is due 15 s after the first
        deadline = time.monotonic() + 17
        while time.monotonic() < deadline and scalar(
                db, "select count(*) from flowly.schedules where next_fire_at <= now()"):
            time.sleep(0.2)
    started = scalar(db, "select count(*) from flowly.runs")
    skipped = scalar(db, "select count(*) from flowly.schedules where last_run_id is null"
                         " and next_fire_at > now()")
    assert (started, skipped) == (250, 0), (
        f"{started} fire times started, {skipped} skipped as missed by a running worker")


def test_command_line_schedule_with_a_huge_max_attempts_says_what_is_wrong(dsn: str) -> None:
    """`flowly schedule add ... --max-attempts 9999999999` must name the bad option (exit 2, as
    for a bad zone), not tell the user that flowly is not installed and to run `flowly
    install` (exit 1)."""
    done = subprocess.run(
        [sys.executable, "-m", "flowly", "--dsn", dsn, "schedule", "add", "s", "* * * * *",
         "quick", "--max-attempts", "9999999999"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert "not installed" not in done.stderr, done.stderr
    assert done.returncode == 2 and "max_attempts" in done.stderr, done.stderr
