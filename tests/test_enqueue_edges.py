"""Edges of enqueueing and claiming: priorities that are not due, keys rendered in any session,
times past what clients can read, odd arguments to the Client, cron ticks of a slow-polling
worker, a concurrency key handed over, a schedule re-declared while a tick holds it."""

from __future__ import annotations

import math
import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import flowly
import flowly.worker as flowly_worker
from tests.support import offer_as, running_worker, scalar, wait_for


def sqlstate_of(db: psycopg.Connection[Any], query: str, *params: Any) -> str | None:
    try:
        db.execute(query, params)
    except psycopg.Error as exc:
        return exc.sqlstate
    return None


def entries_read(db: psycopg.Connection[Any], query: str) -> tuple[int, list[Any]]:
    """Run ``query`` (autocommit); return how many entries of runs_claimable it read."""
    reads = ("select idx_tup_read from pg_stat_user_indexes"
             " where indexrelid = 'flowly.runs_claimable'::regclass")
    db.execute("set stats_fetch_consistency = none")
    db.execute("select pg_stat_force_next_flush()")
    before = scalar(db, reads)
    rows = db.execute(query).fetchall()
    db.execute("select pg_stat_force_next_flush()")
    return int(scalar(db, reads) - before), rows


# --- priorities: sleeping runs of a higher priority ------------------------------------------

def test_claim_does_not_read_sleeping_runs_of_a_higher_priority(
        db: psycopg.Connection[Any]) -> None:
    """README: "Claim reads only due runs ... so sleeping runs ... cost it nothing". 5,000 runs
    at priority 1 that are not due for an hour (or parked on an event: scheduled_for
    9999-12-31) sit above one due run at priority 0. A claim of that one run must not read
    past all of them; it reads every one (the level query's "v_priority is null or
    priority < v_priority" is a filter, not an index condition, in the generic plan)."""
    db.execute("insert into flowly.runs (id, workflow, priority, scheduled_for)"
               " select 'later-' || g, 'quick', 1, now() + interval '1 hour'"
               " from generate_series(1, 5000) g")
    db.execute("select flowly.start('quick', run_id => 'due', priority => 0)")
    db.execute("analyze flowly.runs")
    entries, rows = entries_read(db, "select run_id from flowly.claim('w', array['quick'],"
                                 " array['default'], 1, '1 minute')")
    assert rows == [("due",)]
    assert entries < 100, f"one claim read {entries} index entries for 5,000 sleeping runs"


def test_claim_cost_is_not_quadratic_in_priority_levels_of_sleeping_runs(
        db: psycopg.Connection[Any]) -> None:
    """One sleeping run at each of 1,000 priority levels: claim walks the levels one by one
    (by design, one index range per level), but each level's look-up scans the index from
    the top again, so the claim reads ~levels^2/2 entries (20,000 levels: 80 s a claim)."""
    db.execute("insert into flowly.runs (id, workflow, priority, scheduled_for)"
               " select 'later-' || g, 'quick', g, now() + interval '1 hour'"
               " from generate_series(1, 1000) g")
    db.execute("select flowly.start('quick', run_id => 'due', priority => 0)")
    db.execute("analyze flowly.runs")
    entries, rows = entries_read(db, "select run_id from flowly.claim('w', array['quick'],"
                                 " array['default'], 1, '1 minute')")
    assert rows == [("due",)]
    # linear: an entry or two per level; quadratic: ~500,000
    assert entries < 10 * 1000, f"one claim read {entries} index entries over 1,000 levels"


# --- start_trigger: run ids independent of the session ---------------------------------------

def test_trigger_run_id_of_a_bytea_key_does_not_depend_on_bytea_output(
        db: psycopg.Connection[Any]) -> None:
    """README: key values are read as to_jsonb renders them "under fixed settings ... so a
    session's settings never change an id", and "a row deleted and inserted again ... start
    nothing new". to_jsonb renders bytea with the session's bytea_output, which start_trigger
    does not pin: the same key gives 'blob:\\\\x0102' or 'blob:\\\\001\\\\002'."""
    db.execute("create table blobs (k bytea primary key, v int)")
    db.execute("create trigger blobs_start after insert on blobs"
               " for each row execute function flowly.start_trigger('blob', 'k')")
    db.execute("insert into blobs values ('\\x0102'::bytea, 1)")
    db.execute("delete from blobs")
    db.execute("set bytea_output = 'escape'")
    db.execute("insert into blobs values ('\\x0102'::bytea, 1)")
    db.execute("reset bytea_output")
    ids = [r[0] for r in db.execute("select id from flowly.runs where workflow = 'blob'")]
    assert len(ids) == 1, f"one key, two runs: {ids}"


# --- start: out-of-range arguments are WF003 / InvalidArgument --------------------------------

def test_a_timeout_past_the_end_of_time_is_wf003(db: psycopg.Connection[Any]) -> None:
    """start checks "timeout must be a positive, finite interval" with
    isfinite(scheduled_for + timeout), but the addition overflows first: 22008 (timestamp out
    of range) instead of WF003 (README: an argument out of range is WF003)."""
    assert sqlstate_of(db, "select flowly.start('quick', timeout => '200000000 days')") == "WF003"


def test_a_python_delay_or_timeout_past_the_end_of_time_is_invalid_argument(dsn: str) -> None:
    with flowly.Client(dsn) as client:
        for option in ("delay", "timeout"):
            with pytest.raises(flowly.InvalidArgument):
                client.start("quick", {}, **{option: timedelta(days=999_999_999)})


# start's arguments on each side of each bound: (arguments, refused). Names count bytes, not
# characters ('é' is two); times are readable from the year 1 to before the year 10000.
START_BOUNDS = [
    ("workflow => repeat('é', 500)", False),
    ("workflow => repeat('é', 500) || 'x'", True),
    ("workflow => ''", True),
    ("workflow => null", True),
    ("workflow => 'quick', run_id => repeat('é', 500)", False),
    ("workflow => 'quick', run_id => repeat('é', 501)", True),
    ("workflow => 'quick', run_id => ''", True),
    ("workflow => 'quick', queue => repeat('é', 500)", False),
    ("workflow => 'quick', queue => repeat('é', 500) || 'x'", True),
    ("workflow => 'quick', queue => ''", True),
    ("workflow => 'quick', concurrency_key => repeat('é', 500)", False),
    ("workflow => 'quick', concurrency_key => repeat('é', 500) || 'x'", True),
    ("workflow => 'quick', concurrency_key => ''", True),
    ("workflow => 'quick', scheduled_for => '0001-01-02 00:00+00'", False),
    ("workflow => 'quick', scheduled_for => '0001-01-01 23:59:59.999999+00'", True),
    ("workflow => 'quick', scheduled_for => '9999-12-31 23:59:59.999999+00'", False),
    ("workflow => 'quick', scheduled_for => '10000-01-01 00:00+00'", True),
    ("workflow => 'quick', scheduled_for => 'infinity'", True),
    ("workflow => 'quick', max_attempts => 1", False),
    ("workflow => 'quick', max_attempts => 0", True),
    ("workflow => 'quick', max_attempts => null", True),
    ("workflow => 'quick', timeout => '1 microsecond'", False),
    ("workflow => 'quick', timeout => '0'", True),
    ("workflow => 'quick', timeout => '-1 second'", True),
    ("workflow => 'quick', scheduled_for => '9999-12-31 00:00+00', timeout => '23:59:59'", False),
    ("workflow => 'quick', scheduled_for => '9999-12-31 00:00+00', timeout => '24:00:00'", True),
    ("workflow => 'quick', parent_step => 's'", True),
]


@pytest.mark.parametrize("arguments, refused", START_BOUNDS)
@pytest.mark.parametrize("idle_worker", [False, True])
def test_start_refuses_each_argument_just_past_its_bound_and_takes_it_just_within(
    db: psycopg.Connection[Any], arguments: str, refused: bool, idle_worker: bool
) -> None:
    """start tells most starts valid by one expression (0065) and checks the others one by
    one: a value just past a bound must take the checks' way (WF003, nothing written), a
    value just within it is a run, with a worker's idle slot to take or none."""
    if idle_worker:
        offer_as(db, "ghost", "quick", "1 hour")
    state = sqlstate_of(db, f"select flowly.start({arguments})")
    assert (state, scalar(db, "select count(*) from flowly.runs")) == (
        ("WF003", 0) if refused else (None, 1))


@pytest.mark.parametrize("call", [
    "flowly.start('quick', run_id => 'bc', scheduled_for => '0001-01-01 00:00+00'::timestamptz"
    " - interval '1 day')",
    "flowly.start('quick', run_id => 'bc', scheduled_for => '-infinity')",
    "flowly.sleep('r', EPOCH, 'nap', p_seconds => 1e15)",
    "flowly.sleep('r', EPOCH, 'nap', p_seconds => 'NaN')",
    "flowly.sleep('r', EPOCH, 'nap', p_seconds => 'Infinity')",
    "flowly.sleep('r', EPOCH, 'nap', p_wake_at => '0001-01-01 00:00+00'::timestamptz"
    " - interval '1 day')",
    "flowly.fail_step('r', EPOCH, 's', '{}', now(), 3, 'fixed', null, 1)",
    "flowly.fail_step('r', EPOCH, 's', '{}', now(), 3, 'fixed', 'NaN', 1)",
    "flowly.fail_step('r', EPOCH, 's', '{}', now(), 3, 'fixed', 1e15, 1e15)",
])
def test_times_before_the_year_1_or_out_of_range_delays_are_wf003(
    db: psycopg.Connection[Any], client: flowly.Client, call: str
) -> None:
    """A run scheduled (or a sleep set) before the year 1 was stored, and then every listing
    of runs failed in the client (Python's datetime starts at the year 1); a sleep of 10^15 s,
    NaN or infinity and a retry delay past the year 10000 failed with PostgreSQL's 22008, a
    NULL retry delay as an "unknown backoff kind". Each is WF003 and the run is untouched."""
    client.start("quick", run_id="r")
    epoch = scalar(db, "select lease_epoch from flowly.claim('w', array['quick'],"
                       " array['default'], 1, '30 seconds')")
    assert sqlstate_of(db, "select * from " + call.replace("EPOCH", str(epoch))) == "WF003"
    assert db.execute("select id, status, lease_epoch from flowly.runs").fetchall() == [
        ("r", "running", epoch)]
    assert [run.id for run in client.list_runs()] == ["r"]


def test_a_retry_policy_with_delays_beyond_a_year_is_refused_where_it_is_written() -> None:
    for delays in ({"max_delay": 1e15}, {"initial_delay": math.inf}, {"max_delay": math.nan},
                   {"initial_delay": timedelta(days=366)}):
        with pytest.raises(ValueError, match="Retry"):
            flowly.Retry(**delays)  # type: ignore[arg-type]


# --- Client API on odd run ids ---------------------------------------------------------------

def test_client_calls_with_a_non_text_run_id_do_not_claim_flowly_is_missing(dsn: str) -> None:
    """client.get(42) (an order id passed as is) raised SchemaNotInstalled: "flowly is not
    installed in this database or schema ... run `flowly install`" (the text = smallint
    operator is an UndefinedFunction, which translated_errors maps to a missing install).
    start refuses a non-text run_id with InvalidArgument; get, wait, cancel,
    retry_dead_letter and send_event should say the same or find no run."""
    with flowly.Client(dsn) as client:
        calls = {
            "get": lambda: client.get(42),  # type: ignore[arg-type]
            "wait": lambda: client.wait(42, timeout=0.1),  # type: ignore[arg-type]
            "cancel": lambda: client.cancel(42),  # type: ignore[arg-type]
            "retry_dead_letter": lambda: client.retry_dead_letter(42),  # type: ignore[arg-type]
            "send_event": lambda: client.send_event(42, "e"),  # type: ignore[arg-type]
        }
        wrong = {}
        for name, call in calls.items():
            try:
                call()
            except (flowly.RunNotFound, flowly.InvalidArgument, TypeError):
                continue
            except Exception as exc:
                wrong[name] = f"{type(exc).__name__}: {exc}"
        assert not wrong, wrong


# --- cron: a worker ticking every poll_interval ----------------------------------------------

def test_a_live_worker_with_a_long_poll_interval_still_ticks_within_the_grace(
    dsn: str, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: "A fire time more than a minute old when a worker ticks was missed (no worker
    was running)". A worker with poll_interval=90 that is up all along must not skip fire
    times: it ticks at least every _SCHEDULE_TICK_MAX (15 s; shortened here) whatever its
    poll interval."""
    monkeypatch.setattr(flowly_worker, "_SCHEDULE_TICK_MAX", 0.2)
    # yearly, so that the only fire time is the one set below (with an every-minute schedule,
    # a minute that began during the test fired too, and the count was 2)
    db.execute("select flowly.schedule('yearly', '0 0 1 1 *', 'quick')")
    with running_worker(dsn, workflows=["quick"], poll_interval=90):
        time.sleep(0.5)  # the first tick, at start, is done
        db.execute("update flowly.schedules set next_fire_at = now()")
        try:
            wait_for(lambda: scalar(db, "select count(*) from flowly.runs"
                                        " where id like 'yearly@%%'") == 1,
                     what="the schedule fired by a tick well before the poll interval")
        except AssertionError as exc:
            state = db.execute("select now(), s.*, array(select id from flowly.runs)"
                               " from flowly.schedules s").fetchall()
            raise AssertionError(f"{exc}; schedules and runs: {state}") from None


# --- held: concurrency key handed over, then the old holder retried ---------------------------

def test_retrying_a_dead_letter_whose_key_another_run_took_is_refused_until_it_finishes(
        db: psycopg.Connection[Any]) -> None:
    """README: at most one unfinished run per key. The holder is dead-lettered, a new run
    takes the key; retry_dead_letter of the old holder must not make two live runs: WF004
    naming the live run, and it works once that one finished."""
    db.execute("select flowly.start('quick', run_id => 'old', concurrency_key => 'k')")
    db.execute("update flowly.runs set status = 'dead_letter', finished_at = now()"
               " where id = 'old'")
    assert scalar(db, "select flowly.start('quick', run_id => 'new',"
                      " concurrency_key => 'k')") == "new"
    with pytest.raises(psycopg.Error) as caught:
        db.execute("select flowly.retry_dead_letter('old')")
    assert caught.value.sqlstate == "WF004"
    assert "new" in str(caught.value.diag.message_primary)
    db.execute("select flowly.cancel('new')")
    assert scalar(db, "select flowly.retry_dead_letter('old')") == "old"
    assert scalar(db, "select flowly.start('quick', run_id => 'third',"
                      " concurrency_key => 'k')") == "old"


# --- held: editing a schedule while a tick holds it ------------------------------------------

def test_redeclaring_a_schedule_while_a_tick_holds_it_keeps_the_advanced_fire_time(
        dsn: str) -> None:
    """A deploy script re-declares a schedule (unchanged) while a worker's tick holds it: the
    re-declaration waits, then keeps the fire time the tick moved to, so the slot the tick
    fired is not fired again by the next tick."""
    # the test takes well under a second, but a minute that turns during it makes its last
    # tick fire the next minute's slot, rightly: start where no minute turns soon
    with psycopg.connect(dsn, autocommit=True) as db:
        seconds = scalar(db, "select extract(second from clock_timestamp())::float")
    if seconds > 50:
        time.sleep(60.5 - seconds)
    with psycopg.connect(dsn, autocommit=True) as db, \
            psycopg.connect(dsn) as ticker, psycopg.connect(dsn, autocommit=True) as deploy:
        db.execute("select flowly.schedule('r', '* * * * *', 'quick')")
        db.execute("update flowly.schedules set next_fire_at = date_trunc('minute', now())")
        fired = ticker.execute("select run_id, outcome from flowly.tick_schedules()").fetchall()
        assert [f[1] for f in fired] == ["started"]
        result: list[Any] = []
        thread = threading.Thread(target=lambda: result.append(deploy.execute(
            "select next_fire_at from flowly.schedule('r', '* * * * *', 'quick')").fetchone()))
        thread.start()
        thread.join(0.3)
        assert thread.is_alive()  # waits for the tick's lock
        ticker.commit()
        thread.join(5)
        advanced = scalar(db, "select next_fire_at from flowly.schedules where name = 'r'")
        assert result == [(advanced,)]
        assert [r[3] for r in db.execute("select * from flowly.tick_schedules()")] == []
        assert scalar(db, "select count(*) from flowly.runs") == 1


def test_waiting_for_a_status_a_finished_run_can_never_reach_raises_at_once(
    client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """wait(status="completed") on a cancelled run used to wait out its timeout (or for ever
    without one): cancelled and completed are final, so it raises InvalidState at once. A
    dead_letter run may still be retried: waiting for completed goes on until the timeout."""
    cancelled = client.start("quick", None)
    client.cancel(cancelled)
    started = time.monotonic()
    with pytest.raises(flowly.InvalidState, match="ended cancelled; it can never be completed"):
        client.wait(cancelled, status="completed")
    assert time.monotonic() - started < 5
    dead = client.start("quick", None)
    db.execute("update flowly.runs set status = 'dead_letter', finished_at = now()"
               " where id = %s", (dead,))
    with pytest.raises(flowly.RunTimeout):
        client.wait(dead, status="completed", timeout=0.3)
    assert client.wait(dead).status == "dead_letter"
