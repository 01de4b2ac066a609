"""Cron schedules: flowly.schedule / unschedule / pause_schedule / resume_schedule and the
schedules table, tick_schedules (one run per slot, named after it; missed and overlap), three
workers racing on the same schedules, and the same from Python and the command line."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

import flowly
from tests import workflows
from tests.support import ROOT, running_worker, scalar, wait_for


def schedule(db: psycopg.Connection[Any], name: str, cron: str = "0 9 * * *",
             workflow: str = "quick", **options: Any) -> dict[str, Any]:
    named = "".join(f", {key} => %({key})s" for key in options)
    cursor = db.cursor(row_factory=psycopg.rows.dict_row)
    row = cursor.execute(
        f"select * from flowly.schedule(%(name)s, %(cron)s, %(workflow)s{named})",
        {"name": name, "cron": cron, "workflow": workflow, **options}).fetchone()
    assert row is not None
    return row


def tick(db: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return db.execute("select schedule, fire_at, run_id, outcome from flowly.tick_schedules()"
                      " order by schedule, fire_at").fetchall()


def set_next(db: psycopg.Connection[Any], name: str, when: str) -> datetime:
    row = db.execute("update flowly.schedules set next_fire_at = " + when +
                     " where name = %s returning next_fire_at", (name,)).fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def run_id(name: str, slot: datetime) -> str:
    return f"{name}@{slot.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}"


# --- the schedules table ---------------------------------------------------------------------

def test_schedule_upserts_by_name_with_its_next_fire_time(db: psycopg.Connection[Any]) -> None:
    row = schedule(db, "report", "0 9 * * MON-FRI", input='{"to": "ops"}',
                   timezone="europe/berlin", queue="emails", priority=5)
    assert row["timezone"] == "Europe/Berlin"  # the zone's own spelling
    expected = scalar(db, "select flowly.cron_next('0 9 * * MON-FRI', now(), 'Europe/Berlin')")
    assert row["next_fire_at"] == expected
    assert (row["input"], row["queue"], row["priority"], row["missed"], row["overlap"],
            row["paused"]) == ({"to": "ops"}, "emails", 5, "skip", "allow", False)
    # the same declaration again (a deploy script) keeps the schedule as it is
    again = schedule(db, "report", "0 9 * * MON-FRI", input='{"to": "ops"}',
                     timezone="Europe/Berlin", queue="emails", priority=5)
    assert again["next_fire_at"] == row["next_fire_at"]
    assert again["created_at"] == row["created_at"]
    # a new expression moves the next fire time; other options change in place
    changed = schedule(db, "report", "30 17 * * *", missed="run_once", overlap="skip")
    assert changed["next_fire_at"] == scalar(
        db, "select flowly.cron_next('30 17 * * *', now(), 'UTC')")
    assert (changed["queue"], changed["missed"], changed["overlap"]) == (
        "default", "run_once", "skip")
    assert scalar(db, "select count(*) from flowly.schedules") == 1


def test_unschedule_pause_and_resume(db: psycopg.Connection[Any]) -> None:
    schedule(db, "nightly", "0 3 * * *")
    paused = db.execute("select paused from flowly.pause_schedule('nightly')").fetchone()
    assert paused == (True,)
    set_next(db, "nightly", "now() - interval '1 second'")
    assert tick(db) == []  # a paused schedule does not fire
    # a paused schedule stays paused when its declaration runs again
    assert schedule(db, "nightly", "0 3 * * *")["paused"] is True
    resumed = db.execute("select paused, next_fire_at from flowly.resume_schedule('nightly')"
                         ).fetchone()
    assert resumed is not None and resumed[0] is False
    # the slots that passed while paused are not fired: the next one is ahead
    assert resumed[1] == scalar(db, "select flowly.cron_next('0 3 * * *', now(), 'UTC')")
    assert scalar(db, "select flowly.unschedule('nightly')") is True
    assert scalar(db, "select flowly.unschedule('nightly')") is False
    for function in ("pause_schedule", "resume_schedule"):
        with pytest.raises(psycopg.Error, match="no schedule named") as caught:
            db.execute(f"select flowly.{function}('nightly')")
        assert caught.value.sqlstate == "WF003"


@pytest.mark.parametrize(("options", "problem"), [
    ({"cron": "0 9 * * MOX"}, "day-of-week"),
    ({"cron": "0 9 * 0 *"}, "month"),
    ({"timezone": "Europe/Nowhere"}, "time zone"),
    ({"missed": "catch_up"}, "missed"),
    ({"overlap": "queue"}, "overlap"),
    ({"name": ""}, "name"),
    ({"name": "x" * 990}, "name"),
    ({"workflow": ""}, "workflow"),
    ({"queue": ""}, "queue"),
    ({"max_attempts": 0}, "max_attempts"),
])
def test_bad_schedules_are_refused(db: psycopg.Connection[Any], options: dict[str, Any],
                                   problem: str) -> None:
    arguments = {"name": "s", "cron": "0 9 * * *", "workflow": "quick", **options}
    name, cron, workflow = arguments.pop("name"), arguments.pop("cron"), arguments.pop("workflow")
    with pytest.raises(psycopg.Error) as caught:
        schedule(db, name, cron, workflow, **arguments)
    assert caught.value.sqlstate == "WF003"
    assert problem in str(caught.value.diag.message_primary)


# --- firing ----------------------------------------------------------------------------------

def test_a_due_slot_starts_one_run_named_after_it(db: psycopg.Connection[Any]) -> None:
    schedule(db, "report", "0 0 1 1 *", input='{"n": 1}', queue="reports", priority=3)
    assert tick(db) == []  # nothing due yet
    slot = set_next(db, "report", "date_trunc('second', now()) - interval '10 seconds'")
    fired = tick(db)
    assert fired == [("report", slot, run_id("report", slot), "started")]
    run = db.execute("select workflow, input, queue, priority, scheduled_for, status"
                     " from flowly.runs where id = %s", (fired[0][2],)).fetchone()
    assert run == ("quick", {"n": 1}, "reports", 3, slot, "pending")
    row = db.execute("select next_fire_at, last_fire_at, last_run_id from flowly.schedules"
                     ).fetchone()
    assert row == (scalar(db, "select flowly.cron_next('0 0 1 1 *', %s, 'UTC')", slot), slot,
                   fired[0][2])
    assert tick(db) == []  # fired once
    # a manual re-tick of the same slot (the row put back by hand, a restored backup) finds
    # the run of that slot and starts nothing
    set_next(db, "report", f"'{slot.isoformat()}'")
    assert tick(db) == [("report", slot, run_id("report", slot), "already_started")]
    assert scalar(db, "select count(*) from flowly.runs") == 1


def test_missed_skip_drops_slots_the_workers_were_down_for(db: psycopg.Connection[Any]) -> None:
    """missed => 'skip' (the default): a slot more than a minute old when a worker ticks is
    skipped; the schedule goes on with its next slot."""
    schedule(db, "every_minute", "* * * * *")
    old = set_next(db, "every_minute", "date_trunc('minute', now()) - interval '1 hour'")
    fired = tick(db)
    assert fired[0] == ("every_minute", old, None, "missed")
    # at most the slot of the last minute is still on time
    assert [f[3] for f in fired[1:]] in ([], ["started"])
    assert scalar(db, "select count(*) from flowly.runs") == len(fired) - 1
    assert scalar(db, "select next_fire_at > now() from flowly.schedules") is True


def test_missed_run_once_starts_one_run_for_all_missed_slots(
        db: psycopg.Connection[Any]) -> None:
    schedule(db, "yearly", "@yearly", missed="run_once")
    old = set_next(db, "yearly", "date_trunc('second', now()) - interval '3 days'")
    fired = tick(db)
    assert fired == [("yearly", old, run_id("yearly", old), "caught_up")]
    assert scalar(db, "select count(*) from flowly.runs") == 1
    assert scalar(db, "select next_fire_at from flowly.schedules") == scalar(
        db, "select flowly.cron_next('@yearly', now(), 'UTC')")


def test_overlap_skip_waits_for_the_previous_run(db: psycopg.Connection[Any]) -> None:
    schedule(db, "sync", "@yearly", overlap="skip", missed="run_once")
    schedule(db, "sync_all", "@yearly", missed="run_once")  # overlap => 'allow'
    first = {name: set_next(db, name, "date_trunc('second', now()) - interval '2 minutes'"
                            ) for name in ("sync", "sync_all")}
    assert {(f[0], f[3]) for f in tick(db)} == {("sync", "caught_up"),
                                               ("sync_all", "caught_up")}
    assert scalar(db, "select status from flowly.runs where id = %s",
                  run_id("sync", first["sync"])) == "pending"
    # the previous run of sync is unfinished: its next slot is skipped, sync_all's fires
    for name in ("sync", "sync_all"):
        set_next(db, name, "date_trunc('second', now()) - interval '1 second'")
    outcomes = {f[0]: f[3] for f in tick(db)}
    assert outcomes == {"sync": "overlap", "sync_all": "started"}
    # once it finished, the next slot fires again
    db.execute("select flowly.cancel(%s)", (run_id("sync", first["sync"]),))
    slot = set_next(db, "sync", "date_trunc('second', now())")
    assert tick(db) == [("sync", slot, run_id("sync", slot), "started")]


def test_one_broken_schedule_does_not_stop_the_others(db: psycopg.Connection[Any]) -> None:
    schedule(db, "a_broken", "0 9 * * *")
    schedule(db, "b_fine", "0 9 * * *")
    # a time zone that vanished from the server's tz database after it was scheduled
    db.execute("update flowly.schedules set timezone = 'Gone/Zone' where name = 'a_broken'")
    for name in ("a_broken", "b_fine"):
        set_next(db, name, "date_trunc('second', now())")
    outcomes = {f[0]: f[3] for f in tick(db)}
    assert outcomes == {"a_broken": "error", "b_fine": "started"}
    error = scalar(db, "select last_error from flowly.schedules where name = 'a_broken'")
    assert "Gone/Zone" in error


def test_tick_takes_due_schedules_through_an_index(db: psycopg.Connection[Any]) -> None:
    db.execute("insert into flowly.schedules (name, cron, workflow, next_fire_at)"
               " select 's' || i, '0 9 * * *', 'quick', now() + interval '1 day'"
               " from generate_series(1, 5000) i")
    db.execute("analyze flowly.schedules")
    plan = db.execute("explain (format json) select * from flowly.schedules s"
                      " where not s.paused and s.next_fire_at <= now()"
                      " order by s.next_fire_at limit 100").fetchone()
    assert plan is not None and "schedules_due" in json.dumps(plan[0])


# --- workers ---------------------------------------------------------------------------------

def test_three_workers_racing_fire_each_slot_exactly_once(dsn: str,
                                                          db: psycopg.Connection[Any]) -> None:
    """Three real workers tick the same 30 due schedules at once (and keep ticking): every
    on-time slot, and every run_once catch-up, starts exactly one run, which completes;
    skipped slots start none."""
    with ExitStack() as stack:
        for _ in range(3):
            stack.enter_context(running_worker(dsn, poll_interval=0.02))
        wait_for(lambda: scalar(db, "select count(*) from flowly.workers") == 3,
                 what="three workers")
        with db.transaction():
            for i in range(30):
                schedule(db, f"race{i:02}", "0 0 1 1 *",
                         missed="run_once" if i % 3 == 1 else "skip", input=json.dumps(i))
            db.execute("update flowly.schedules set next_fire_at = case"
                       " when name::text ~ '[02468]$' then date_trunc('second', now())"
                       " else date_trunc('second', now()) - interval '1 day' end")
        expected = {
            name: slot for name, slot, missed in db.execute(
                "select name, next_fire_at, missed from flowly.schedules")
            if slot > datetime.now(UTC) - timedelta(days=0.5) or missed == "run_once"}
        wait_for(lambda: scalar(db, "select count(*) from flowly.runs where status ="
                                    " 'completed'") == len(expected),
                 timeout=60, what="the scheduled runs")
        # the workers go on ticking: nothing more fires
        ticks = scalar(db, "select count(*) from flowly.schedules where next_fire_at > now()")
        assert ticks == 30
        runs = db.execute("select id from flowly.runs").fetchall()
    assert sorted(r[0] for r in runs) == sorted(run_id(n, s) for n, s in expected.items())
    assert 10 <= len(expected) < 30


def test_end_to_end_through_python(dsn: str, db: psycopg.Connection[Any]) -> None:
    with flowly.Client(dsn) as client:
        created = client.schedule("py_report", "0 4 * * *", "quick", {"n": 2},
                                  timezone="Europe/Berlin", overlap="skip")
        assert isinstance(created, flowly.Schedule)
        assert (created.name, created.cron, created.workflow, created.input,
                created.timezone, created.overlap) == (
            "py_report", "0 4 * * *", "quick", {"n": 2}, "Europe/Berlin", "skip")
        assert created.next_fire_at > datetime.now(UTC)
        # the workflow's registration gives the defaults (emailer: queue emails)
        mailer = client.schedule("mail", "@daily", workflows.emailer)
        assert (mailer.workflow, mailer.queue, mailer.max_attempts) == ("emailer", "emails", 7)
        assert client.pause_schedule("mail").paused is True
        assert client.resume_schedule("mail").paused is False
        assert [s.name for s in client.schedules()] == ["mail", "py_report"]
        assert client.unschedule("mail") is True
        assert client.unschedule("mail") is False
        with pytest.raises(flowly.InvalidArgument, match="day-of-month"):
            client.schedule("bad", "0 0 32 * *", "quick")
        with pytest.raises(flowly.InvalidArgument, match="no schedule named"):
            client.pause_schedule("nope")
        with running_worker(dsn):
            slot = set_next(db, "py_report", "date_trunc('second', now())")
            run = client.wait(wait_for(lambda: scalar(db, "select id from flowly.runs"),
                                       what="the scheduled run"), timeout=30)
        assert run.id == run_id("py_report", slot) and run.status == "completed"
        assert run.output == {"input": {"n": 2}, "total": 3}
        assert client.schedules()[0].last_run_id == run.id


def test_async_client(dsn: str) -> None:
    async def main() -> None:
        async with flowly.AsyncClient(dsn) as client:
            created = await client.schedule("a", "0 9 * * *", "quick", timezone="Asia/Tokyo")
            assert created.timezone == "Asia/Tokyo"
            assert (await client.pause_schedule("a")).paused
            assert not (await client.resume_schedule("a")).paused
            assert [s.name for s in await client.schedules()] == ["a"]
            assert await client.cron_next("0 9 * * *", datetime(2026, 1, 1, tzinfo=UTC),
                                          "Asia/Tokyo") == datetime(2026, 1, 2, 0, tzinfo=UTC)
            assert await client.unschedule("a")

    asyncio.run(main())


# --- command line ----------------------------------------------------------------------------

def cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flowly", "--dsn", dsn, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)


def test_command_line(dsn: str) -> None:
    added = cli(dsn, "schedule", "add", "nightly", "30 2 * * *", "quick", '{"n": 3}',
                "--timezone", "America/New_York", "--missed", "run_once")
    assert added.returncode == 0, added.stderr
    assert "nightly" in added.stdout and "next fire" in added.stdout
    listed = cli(dsn, "schedules")
    assert listed.returncode == 0, listed.stderr
    assert "nightly" in listed.stdout and "30 2 * * *" in listed.stdout
    assert "America/New_York" in listed.stdout
    as_json = json.loads(cli(dsn, "--json", "schedules").stdout)
    assert [(s["name"], s["input"], s["missed"]) for s in as_json] == [
        ("nightly", {"n": 3}, "run_once")]
    assert cli(dsn, "schedule", "pause", "nightly").returncode == 0
    assert json.loads(cli(dsn, "--json", "schedules").stdout)[0]["paused"] is True
    assert cli(dsn, "schedule", "resume", "nightly").returncode == 0
    bad = cli(dsn, "schedule", "add", "x", "0 9 * * *", "quick", "--timezone", "Mars/Base")
    assert bad.returncode == 2 and "time zone" in bad.stderr
    assert len(bad.stderr.splitlines()) == 1
    assert cli(dsn, "schedule", "remove", "nightly").returncode == 0
    missing = cli(dsn, "schedule", "remove", "nightly")
    assert missing.returncode == 1 and "no schedule named" in missing.stderr
    assert "no schedules" in cli(dsn, "schedules").stdout
