"""A database whose TimeZone has daylight saving time (``alter database ... set timezone``, as
an application sets it for its own sessions) does not move flowly's times:

- a run's ``delay`` and ``timeout`` given in seconds (or a timedelta) from Python count that
  many seconds. psycopg sent a timedelta's whole days as the interval's day field, which
  ``timestamptz + interval`` adds as calendar days in the session's TimeZone: a timeout of
  86,400 s across a spring-forward ended after 82,800 s;
- a timeout given from SQL counts its days as 24 hours and its months as calendar months in
  UTC, through start and through a hand-off to an idle worker;
- ``purge``'s age and the worker's lease count seconds too; given from SQL, an age counts
  as a timeout from SQL does and a lease as the seconds it compares to;
- start checks where a timeout ends, not its length read with a month as 30 days: ``'1 month'``
  from 9999-12-01 ended in the year 10000 (every listing then failed to read the run), and
  ``'1 mon -29 days'`` from 2027-02-01 ended a day before the run was due.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

import flowly
from tests import workflows
from tests.support import (
    database_default,
    offer_as,
    running_worker,
    scalar,
    sqlstate_of,
    wait_for,
)

DAY = 86_400
# Berlin moves its clocks forward at 2027-03-28 01:00 UTC and back at 2027-10-31 01:00 UTC
BEFORE_SPRING_FORWARD = datetime(2027, 3, 27, 12, tzinfo=UTC)
BEFORE_FALL_BACK = datetime(2027, 10, 30, 12, tzinfo=UTC)


def _zone_changing_in(db: psycopg.Connection[Any], days: int) -> str:
    """A POSIX time zone whose clocks go forward an hour at 00:00 UTC ``days`` days from the
    server's today (UTC), and back half a year later: a DST change at a time the test picks,
    whatever the date it runs on."""
    change = scalar(db, "select (now() at time zone 'UTC')::date + %s", days)
    # the zero-based day of the year (Feb 29 counted), at 00:00 of the standard time, UTC+0
    start = change.timetuple().tm_yday - 1
    return f"FTS0FTD,{start}/0,{(start + 180) % 365}/0"


def _run_times(db: psycopg.Connection[Any], run_id: str) -> tuple[Any, ...]:
    row = db.execute("select created_at, scheduled_for, timeout_at from flowly.runs"
                     " where id = %s", (run_id,)).fetchone()
    assert row is not None
    return tuple(row)


def test_a_timeout_in_seconds_from_python_ends_that_many_seconds_later_across_dst(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    database_default(db, "timezone", "Europe/Berlin")
    with flowly.Client(dsn) as client:
        for name, due in (("spring", BEFORE_SPRING_FORWARD), ("fall", BEFORE_FALL_BACK)):
            for kind, timeout in (("seconds", DAY), ("timedelta", timedelta(days=3, seconds=1))):
                run_id = client.start("tz_unserved", None, run_id=f"{name}-{kind}",
                                      scheduled_for=due, timeout=timeout)
                _, scheduled_for, timeout_at = _run_times(db, run_id)
                seconds = timeout if isinstance(timeout, int) else timeout.total_seconds()
                assert scheduled_for == due
                assert timeout_at == due + timedelta(seconds=seconds), run_id


def test_a_delay_in_seconds_from_python_is_that_many_seconds_across_dst(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    database_default(db, "timezone", _zone_changing_in(db, 1))
    with flowly.Client(dsn) as client:
        for delay in (2 * DAY, timedelta(days=2, hours=1)):
            run_id = client.start("tz_unserved", None, delay=delay)
            created_at, scheduled_for, _ = _run_times(db, run_id)
            expected = delay if isinstance(delay, timedelta) else timedelta(seconds=delay)
            # scheduled_for counts from the statement's clock, created_at from its start
            assert timedelta(0) <= scheduled_for - created_at - expected < timedelta(seconds=5)


@flowly.workflow("tz_starts_a_child")
async def tz_starts_a_child(ctx: flowly.Context, inp: Any) -> str:
    return await ctx.start("tz_unserved", None, run_id="tz-child",
                           scheduled_for=BEFORE_SPRING_FORWARD, timeout=DAY)


def test_a_timeout_in_seconds_from_ctx_start_ends_that_many_seconds_later_across_dst(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    database_default(db, "timezone", "Europe/Berlin")
    with running_worker(dsn, workflows=["tz_starts_a_child"]):
        parent = client.start("tz_starts_a_child", None)
        assert client.wait(parent, timeout=20).status == "completed"
    _, scheduled_for, timeout_at = _run_times(db, "tz-child")
    assert timeout_at - scheduled_for == timedelta(seconds=DAY)


def test_a_timeout_from_sql_counts_days_as_24_hours_and_months_in_utc(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    database_default(db, "timezone", "Europe/Berlin")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for run_id, due, timeout, ends in (
            ("day", BEFORE_SPRING_FORWARD, "1 day", "2027-03-28 12:00+00"),
            ("days", BEFORE_FALL_BACK, "2 days 1 hour", "2027-11-01 13:00+00"),
            # a calendar month in UTC: in Berlin's time it would end an hour earlier
            ("month", datetime(2027, 3, 15, 12, tzinfo=UTC), "1 month", "2027-04-15 12:00+00"),
        ):
            conn.execute("select flowly.start('tz_unserved', run_id => %s, scheduled_for => %s,"
                         " timeout => %s)", (run_id, due, timeout))
            assert scalar(db, "select timeout_at = %s::timestamptz from flowly.runs"
                              " where id = %s", ends, run_id), (run_id, _run_times(db, run_id))


def test_a_timeout_from_sql_handed_to_an_idle_worker_counts_days_as_24_hours(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    database_default(db, "timezone", _zone_changing_in(db, 1))
    with psycopg.connect(dsn, autocommit=True) as conn:
        offer_as(conn, "tz_idle", "tz_unserved", "1 minute")
        run_id = scalar(conn, "select flowly.start('tz_unserved', timeout => '2 days')")
    assert scalar(db, "select locked_by from flowly.runs where id = %s", run_id) == "tz_idle"
    _, scheduled_for, timeout_at = _run_times(db, run_id)
    assert timeout_at - scheduled_for == timedelta(days=2)


def test_purge_counts_an_age_in_seconds_across_dst(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    database_default(db, "timezone", _zone_changing_in(db, -1))
    db.execute("""
        insert into flowly.runs (id, workflow, status, created_at, finished_at)
        values ('older', 'wf', 'completed', now() - interval '48:30:00',
                now() - interval '48:30:00'),
               ('younger', 'wf', 'completed', now() - interval '47:30:00',
                now() - interval '47:30:00')""")
    with flowly.Client(dsn) as client:
        assert client.purge(2 * DAY) == 1
    assert [r[0] for r in db.execute("select id from flowly.runs")] == ["younger"]


def test_purge_from_sql_counts_an_age_s_days_as_24_hours_and_months_in_utc_across_dst(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    """``select flowly.purge('2 days')`` in a session whose zone moved its clocks forward
    yesterday purged the runs finished over 47 hours ago: PostgreSQL subtracted calendar days
    of the zone. An age from SQL counts as start's timeout does (0070): days of 24 hours,
    months of UTC's calendar."""
    database_default(db, "timezone", _zone_changing_in(db, -1))
    db.execute("""
        insert into flowly.runs (id, workflow, status, created_at, finished_at)
        select id, 'wf', 'completed', finished_at, finished_at
        from (values ('days-older', now() - interval '48:30:00'),
                     ('days-younger', now() - interval '47:30:00'),
                     ('month-older', now() - interval '1 month' - interval '30 minutes'),
                     ('month-younger', now() - interval '1 month' + interval '30 minutes'))
             as r (id, finished_at)""")
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert scalar(conn, "select flowly.purge('1 month')") == 1
        assert scalar(conn, "select flowly.purge('2 days')") == 2
    assert [r[0] for r in db.execute("select id from flowly.runs")] == ["days-younger"]


def test_a_lease_of_a_day_given_from_sql_lasts_24_hours_across_dst(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    """A worker that calls flowly's functions from SQL with a lease of '1 day' held its run,
    its slot and its liveness for 23 hours when the session's zone moved its clocks forward
    within the day: the lease's day was a calendar day of the zone. Each now lasts 24 hours."""
    database_default(db, "timezone", _zone_changing_in(db, 1))
    db.execute("select flowly.start('tz_unserved', run_id => 'r')")
    day = timedelta(days=1)
    with psycopg.connect(dsn) as conn:
        conn.execute("select flowly.register_worker('w', array['tz_unserved'], array['default'],"
                     " '1 day')")
        assert scalar(conn, "select last_seen_at + lease - last_seen_at from flowly.workers") == day
        conn.commit()
        epoch = scalar(conn, "select lease_epoch from flowly.claim_and_offer('w',"
                             " array['tz_unserved'], array['default'], 2, '1 day', 'w_channel')")
        assert scalar(conn, "select locked_until - now() from flowly.runs") == day
        assert scalar(conn, "select expires_at - now() from flowly.handoff_slots") == day
        conn.commit()
        conn.execute("select * from flowly.heartbeat('w', array['r'], array[%s], '1 day')",
                     (epoch,))
        assert scalar(conn, "select locked_until - now() from flowly.runs") == day
        conn.commit()
        conn.execute("select flowly.offer_slot('w', array['tz_unserved'], array['default'],"
                     " '1 day', 'w_other_channel')")
        assert scalar(conn, "select expires_at - now() from flowly.handoff_slots") == day


def test_a_worker_s_lease_of_a_day_lasts_a_day_across_dst(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    database_default(db, "timezone", _zone_changing_in(db, 1))
    run_id = client.start("gated", None)
    try:
        with running_worker(dsn, workflows=["gated"], lease=DAY):
            wait_for(lambda: scalar(db, "select count(*) from test_effects where run_id = %s"
                                        " and step = 'b'", run_id), what="the gated step")
            left = scalar(db, "select locked_until - clock_timestamp() from flowly.runs"
                              " where id = %s", run_id)
            workflows.GATES[run_id].set()
            assert client.wait(run_id, timeout=20).status == "completed"
    finally:
        workflows.GATES[run_id].set()
    assert timedelta(days=1) - timedelta(seconds=60) < left <= timedelta(days=1)


# --- where a timeout ends ---------------------------------------------------------------------

@pytest.mark.parametrize(("due", "timeout"), [
    ("9999-12-01 00:00+00", "1 month"),  # ends 10000-01-01: no client could read the run
    ("2027-02-01 00:00+00", "1 mon -29 days"),  # ends 2027-01-31, before the run is due
    ("2027-02-01 00:00+00", "1 mon -28 days"),  # ends when the run is due
    # a month read as 30 days makes these short; counted, they pass the first time PostgreSQL
    # holds (4714 BC): 22008, timestamp out of range
    ("0001-01-02 00:00+00", "-5000 years 1830000 days"),
    ("2027-02-01 00:00+00", "-547000 years 197000000 days"),
])
def test_a_timeout_that_does_not_end_after_the_run_is_due_and_before_the_year_10000_is_wf003(
        db: psycopg.Connection[Any], due: str, timeout: str) -> None:
    assert sqlstate_of(db.execute, "select flowly.start('tz_unserved', scheduled_for => %s,"
                                   " timeout => %s)", (due, timeout)) == "WF003"
    assert scalar(db, "select count(*) from flowly.runs") == 0


def test_a_timeout_in_months_is_accepted_where_it_ends_in_bounds(
        db: psycopg.Connection[Any], client: flowly.Client) -> None:
    for run_id, due, timeout, ends in (
        ("nov", "9999-11-30 00:00+00", "1 month", "9999-12-30 00:00+00"),
        ("feb", "2027-02-01 00:00+00", "1 mon -27 days", "2027-02-02 00:00+00"),
    ):
        db.execute("select flowly.start('tz_unserved', run_id => %s, scheduled_for => %s,"
                   " timeout => %s)", (run_id, due, timeout))
        assert scalar(db, "select timeout_at = %s::timestamptz from flowly.runs where id = %s",
                      ends, run_id), run_id
    assert {r.id for r in client.list_runs()} == {"nov", "feb"}


def _retried(dsn: str, run_id: str, due: str | None, timeout: str) -> None:
    """Start ``run_id`` from SQL, dead-letter it as a run whose retries ran out, retry it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("select flowly.start('tz_unserved', run_id => %s, scheduled_for => %s,"
                     " timeout => %s)", (run_id, due, timeout))
        conn.execute("update flowly.runs set status = 'dead_letter', finished_at = now()"
                     " where id = %s", (run_id,))
        conn.execute("select flowly.retry_dead_letter(%s)", (run_id,))


def test_a_retried_run_s_timeout_counts_again_from_the_retry_in_utc(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    database_default(db, "timezone", _zone_changing_in(db, 1))
    _retried(dsn, "day", None, "2 days")
    _, scheduled_for, timeout_at = _run_times(db, "day")
    assert timeout_at - scheduled_for == timedelta(days=2)


def test_a_retried_run_s_timeout_that_would_end_past_the_year_9999_ends_before_it(
        db: psycopg.Connection[Any], dsn: str, client: flowly.Client) -> None:
    _retried(dsn, "long", "2000-01-01 00:00+00", "7999 years 11 months")
    assert _run_times(db, "long")[2] == datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
    assert client.get("long").status == "pending"
    assert [r.id for r in client.list_runs()] == ["long"]
