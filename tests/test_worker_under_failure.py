"""The worker's lifecycle and its behaviour under failure: signals, crashes and
shutdowns in the middle of transactional steps, start-up against an older schema or before
its database can be reached.

The workflows below are served by worker subprocesses started with
``--app tests.test_worker_under_failure`` (they register when this module is imported)."""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import socket
import subprocess
import threading
import time
from contextlib import AbstractContextManager
from typing import Any

import psycopg
import pytest
from psycopg import sql

import flowly
from flowly.schema import INSTALL_LOCK_KEY
from tests.support import (
    WorkerProcess,
    claim_as,
    flood_notifications,
    freezable_proxy,
    notification_queue_usage,
    running_worker,
    scalar,
    wait_for,
)
from tests.support import worker_process as app_worker_process

# -- workflows ------------------------------------------------------------------------------


def _sql_sleep(conn: psycopg.Connection[Any], seconds: float) -> str:
    conn.execute("select pg_sleep(%s)", (seconds,))
    return "slept"


async def _sql_sleep_async(conn: psycopg.AsyncConnection[Any], seconds: float) -> str:
    await conn.execute("select pg_sleep(%s)", (seconds,))
    return "slept"


@flowly.workflow("wuf_tx_sql_sleep")
async def wuf_tx_sql_sleep(ctx: flowly.Context, inp: dict[str, Any]) -> Any:
    """One transactional step whose SQL runs ``seconds`` on the server (a long report, a
    big UPDATE), the first time only: a takeover finds it quick."""
    seconds = inp["seconds"] if ctx.attempt == 1 and not _taken_over(ctx) else 0
    fn = _sql_sleep_async if inp.get("async") else _sql_sleep
    return await ctx.transaction("report", fn, seconds)


def _taken_over(ctx: flowly.Context) -> bool:
    with psycopg.connect(os.environ["FLOWLY_DSN"], autocommit=True) as conn:
        row = conn.execute("select lease_epoch > 1 from flowly.runs where id = %s",
                           (ctx.run_id,)).fetchone()
    return bool(row and row[0])


@flowly.workflow("wuf_quick")
async def wuf_quick(ctx: flowly.Context, inp: Any) -> Any:
    return inp


# -- helpers --------------------------------------------------------------------------------


def worker_process(dsn: str, *args: str) -> AbstractContextManager[WorkerProcess]:
    """A worker process serving this module's workflows."""
    return app_worker_process(dsn, *args, app="tests.test_worker_under_failure")


def _run_row_locked(db: psycopg.Connection[Any], run_id: str) -> bool:
    """Whether some transaction holds the run's row (claim and release skip it then)."""
    try:
        with db.transaction():
            db.execute("select 1 from flowly.runs where id = %s for update nowait", (run_id,))
    except psycopg.errors.LockNotAvailable:
        return True
    return False


def _in_report(db: psycopg.Connection[Any]) -> bool:
    return bool(scalar(db, "select count(*) from pg_stat_activity where datname ="
                           " current_database() and query like 'select pg_sleep%%'"
                           " and state = 'active'"))


# -- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_sigterm_during_a_transactional_step_s_sql_releases_the_run_at_once(
    dsn: str, db: psycopg.Connection[Any], kind: str
) -> None:
    """README: on SIGTERM the worker "releases the rest so another worker takes them at once".
    A transactional step whose SQL is still running on the server when the drain timeout
    ends must be rolled back and its run released, whether its function is async or sync."""
    with flowly.Client(dsn) as client:
        run_id = client.start("wuf_tx_sql_sleep", {"seconds": 40, "async": kind == "async"})
    with worker_process(dsn, "--lease", "30", "--drain-timeout", "0.5") as leaving:
        wait_for(lambda: _in_report(db), what="the step's SQL running")
        leaving.proc.send_signal(signal.SIGTERM)
        assert leaving.proc.wait(15) == 0
        log = leaving.kill()
    # the run must be free (not locked by the dead worker's still-running SQL) and released
    time.sleep(1.0)
    assert not _run_row_locked(db, run_id), (
        "the worker exited, yet its transactional step's SQL still runs on the server and"
        f" holds the run's row: nobody can take it over\n{log}")
    run = db.execute("select status, locked_by from flowly.runs where id = %s",
                     (run_id,)).fetchone()
    assert run == ("pending", None), f"not released: {run}\n{log}"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_killed_worker_s_transactional_sql_does_not_hold_its_run_past_the_lease(
    dsn: str, db: psycopg.Connection[Any], kind: str
) -> None:
    """README (sessions): "a worker frozen or cut off in the middle of a commit holds its row
    locks for about a lease, not for hours"; leases: an expired lease makes the run claimable.
    A worker SIGKILLed while its transactional step's SQL runs (statement_timeout is lifted
    for it) leaves a backend that goes on running that SQL, holding the run's row, so claim
    skips the run for as long as the SQL runs (40 s here, hours for a real report)."""
    with flowly.Client(dsn) as client:
        run_id = client.start("wuf_tx_sql_sleep", {"seconds": 40, "async": kind == "async"})
        with worker_process(dsn, "--lease", "2") as first:
            wait_for(lambda: _in_report(db), what="the step's SQL running")
            first.proc.kill()
            first.proc.wait(10)
        killed_at = time.monotonic()
        with worker_process(dsn, "--lease", "2") as second:
            try:
                run = client.wait(run_id, timeout=12)
            except flowly.RunTimeout:
                pytest.fail(f"run not taken over {time.monotonic() - killed_at:.0f}s after its"
                            " worker died (lease 2s): the dead worker's SQL still holds the"
                            f" row: locked={_run_row_locked(db, run_id)}")
            assert run.status == "completed"
            second.proc.send_signal(signal.SIGTERM)
            second.proc.wait(15)


def test_sigterm_ends_a_worker_waiting_to_migrate_an_older_schema(
    empty_dsn: str, db: psycopg.Connection[Any]
) -> None:
    """A worker started against a database at an older schema version migrates it at start,
    under the install advisory lock. While another session holds that lock (another worker
    migrating, an operator's `flowly install` in an open transaction), SIGTERM must still end
    the worker within its drain timeout plus a few seconds (README: "each shutdown call is
    bounded"); it waits for the lock forever instead, deaf to SIGTERM and SIGINT."""
    flowly.install_dsn(empty_dsn, target=18)
    with psycopg.connect(empty_dsn, autocommit=True) as holder:
        holder.execute("select pg_advisory_lock(%s)", (INSTALL_LOCK_KEY,))
        with worker_process(empty_dsn, "--drain-timeout", "1", "--lease", "2") as worker:
            dbname = psycopg.conninfo.conninfo_to_dict(empty_dsn)["dbname"]
            wait_for(lambda: scalar(db, "select count(*) from pg_stat_activity where datname = %s"
                                        " and wait_event = 'advisory'", dbname),
                     what="the worker waiting for the install lock")
            started = time.monotonic()
            worker.proc.send_signal(signal.SIGTERM)
            try:
                worker.proc.wait(10)
            except subprocess.TimeoutExpired:
                pytest.fail("SIGTERM did not end a worker waiting to migrate the schema"
                            f" ({time.monotonic() - started:.0f}s)")


def _port_nothing_listens_on() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _dsn_at_port(dsn: str, port: int) -> str:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    for key in ("host", "hostaddr", "port"):
        params.pop(key, None)
    return psycopg.conninfo.make_conninfo(**params, host="127.0.0.1", port=str(port))


def test_a_worker_started_before_its_database_listens_waits_for_it_and_serves(
    dsn: str, client: flowly.Client
) -> None:
    """A worker started while its database cannot be reached yet (a compose file starting
    both, a server restarting): it exited at once with "cannot connect to the database"
    (status 1), though once serving it rides out outages. It must wait, say so, and serve
    as soon as the database answers."""
    port = _port_nothing_listens_on()
    with app_worker_process(_dsn_at_port(dsn, port), "--lease", "2") as worker:
        # its first refused try logged (a loaded machine may take seconds to start it)
        logged = ""
        deadline = time.monotonic() + 30
        while "cannot reach the database yet" not in logged:
            assert worker.proc.poll() is None, f"the worker exited:\n{logged}{worker.kill()}"
            assert time.monotonic() < deadline, f"no refused try logged:\n{logged}"
            assert worker.proc.stdout is not None
            if select.select([worker.proc.stdout], [], [], 0.1)[0]:
                logged += worker.proc.stdout.readline()
        time.sleep(1.0)  # a refused try every 0.5, 1 s...
        assert worker.proc.poll() is None, f"the worker exited:\n{logged}{worker.kill()}"
        run_id = client.start("quick", "early")
        with freezable_proxy(dsn, port):
            run = client.wait(run_id, timeout=30)
            assert run.status == "completed", run
            output = logged + worker.stop()
    assert "cannot reach the database yet (try 1:" in output, output
    assert "Connection refused" in output, output
    assert "reached the database after" in output, output
    assert worker.proc.returncode == 0, output


def test_a_worker_whose_role_has_no_connection_free_waits_for_one(
    roles: tuple[str, str], db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A refusal from a server that answered, yet one that time mends: the worker's role is
    at its connection limit (other workers of the same role hold them all)."""
    worker_dsn = roles[0]
    login = psycopg.conninfo.conninfo_to_dict(worker_dsn)["user"]
    db.execute(sql.SQL("alter role {} connection limit 0").format(sql.Identifier(login)))
    try:
        with flowly.Client(db.info.dsn) as client, running_worker(worker_dsn,
                                                                   install_schema=False):
            run_id = client.start("quick", "limited")
            wait_for(lambda: "too many connections for role" in caplog.text,
                     what="the worker refused a connection")
            time.sleep(1.0)
            assert client.get(run_id).status == "pending"
            db.execute(sql.SQL("alter role {} connection limit -1").format(sql.Identifier(login)))
            assert client.wait(run_id, timeout=30).status == "completed"
    finally:
        db.execute(sql.SQL("alter role {} connection limit -1").format(sql.Identifier(login)))
    assert "cannot reach the database yet (try 2:" in caplog.text, caplog.text


def test_a_worker_that_cannot_register_yet_waits_instead_of_exiting(
    dsn: str, client: flowly.Client, caplog: pytest.LogCaptureFixture
) -> None:
    """Between the first connection and the registration the server may restart, or another
    release's migration may hold flowly.workers for longer than a lock timeout: the worker
    exited with that error. It must wait as it does for its first connection."""
    with psycopg.connect(dsn) as holder:  # its transaction stays open: the lock is held
        holder.execute("lock table flowly.workers in exclusive mode")  # reads still pass
        with running_worker(dsn, lease=2):
            run_id = client.start("quick", "registered late")
            wait_for(lambda: "could not register worker" in caplog.text, timeout=30,
                     what="a registration refused for the lock")
            assert client.get(run_id).status == "pending"
            holder.rollback()
            assert client.wait(run_id, timeout=30).status == "completed"
    assert "due to lock timeout" in caplog.text, caplog.text


def _catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` handles SIGTERM itself yet (its caught signals, on Linux; True
    elsewhere, where a test can only wait)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            caught = next(line for line in status if line.startswith("SigCgt:"))
    except OSError:
        return True
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)))


def test_sigterm_ends_a_worker_waiting_for_its_database_at_once(dsn: str) -> None:
    """The pause between two tries is no reason to keep a stopped worker alive."""
    with app_worker_process(_dsn_at_port(dsn, _port_nothing_listens_on())) as worker:
        # on a loaded machine the interpreter may take seconds to start: a SIGTERM before the
        # worker handles it would end the process by default, which tells nothing
        wait_for(lambda: _catches_sigterm(worker.pid), what="the worker handling SIGTERM")
        time.sleep(2.5)  # past the first pauses: it now sleeps 2 s between tries
        started = time.monotonic()
        output = worker.stop()
        took = time.monotonic() - started
    assert worker.proc.returncode == 0, output
    assert took < 3.0, f"SIGTERM took {took:.1f}s to end a worker waiting for its database"
    assert "cannot reach the database yet" in output, output


@pytest.mark.parametrize(("change", "error"), [
    ({"dbname": "flowly_no_such_database"},
     'database "flowly_no_such_database" does not exist'),
    ({"port": "54x2"}, 'invalid integer value "54x2" for connection option "port"'),
])
def test_a_worker_given_a_dsn_that_waiting_cannot_mend_exits_at_once_naming_why(
    dsn: str, change: dict[str, str], error: str
) -> None:
    """Waiting cannot mend a refusal from a server that answered, nor a DSN libpq finds
    invalid: a mistyped database name or port must fail loudly, not loop."""
    params = {**psycopg.conninfo.conninfo_to_dict(dsn), **change}
    with app_worker_process(psycopg.conninfo.make_conninfo(**params)) as worker:
        try:
            worker.proc.wait(20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"a worker given {change} kept running")
        output = worker.stop()
    assert worker.proc.returncode == 1, output
    assert error in output, output
    assert "cannot reach the database yet" not in output, output


@flowly.workflow("wuf_fails_first_generation", max_attempts=1)
async def wuf_fails_first_generation(ctx: flowly.Context, inp: Any) -> Any:
    def once() -> str:
        if ctx.generation == 1:
            raise ValueError("first generation fails")
        return "ok"

    return await ctx.step("once", once, retry=flowly.Retry(max_attempts=1))


def test_a_worker_that_does_not_migrate_refuses_an_older_schema_instead_of_spinning(
    empty_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Worker(install_schema=False) against a database one migration behind (an operator
    migrates by hand and rolled out the new release first). The worker must either refuse to
    start, naming the versions and `flowly migrate`, or serve runs correctly. It does
    neither: it starts, and a retried dead letter (generation 2) calls undone_steps, which
    the older schema lacks; the run is abandoned, claimed again by the same live worker,
    abandoned again, forever (no takeover is counted: its worker is alive)."""
    flowly.install_dsn(empty_dsn, target=18)
    worker = flowly.Worker(empty_dsn, ["wuf_fails_first_generation"], install_schema=False,
                           poll_interval=0.1, lease=1)
    outcome: list[BaseException | None] = []
    loop = asyncio.new_event_loop()

    def serve() -> None:
        try:
            loop.run_until_complete(worker.run())
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)
        finally:
            loop.close()

    def status_of(run_id: str) -> Any:
        with psycopg.connect(empty_dsn, autocommit=True) as conn:
            return scalar(conn, "select status from flowly.runs where id = %s", run_id)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    status = None
    try:
        with flowly.Client(empty_dsn) as client:
            run_id = client.start("wuf_fails_first_generation", None)
            wait_for(lambda: outcome or status_of(run_id) == "dead_letter", timeout=8,
                     what="generation 1 dead-lettered")
            if not outcome:
                client.retry_dead_letter(run_id)
                deadline = time.monotonic() + 6
                while time.monotonic() < deadline and not outcome:
                    status = status_of(run_id)
                    if status == "completed":
                        break
                    time.sleep(0.2)
    finally:
        if not loop.is_closed():
            loop.call_soon_threadsafe(worker.stop)
        thread.join(20)
    if outcome and outcome[0] is not None:  # refused to start: fine if it says why
        assert "migrat" in str(outcome[0]), outcome[0]
        return
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        epoch = scalar(conn, "select lease_epoch from flowly.runs where id = %s", run_id)
    internal = caplog.text.count("interrupted by an internal error")
    assert status == "completed", (
        f"the worker served an older schema: the run is {status!r} 6s after its retry, claimed"
        f" {epoch} times, {internal} internal errors")


def test_an_output_of_exactly_the_limit_lands_in_a_batch_of_small_ones(
    dsn: str, client: flowly.Client
) -> None:
    """An output of exactly max_output_bytes of JSON is allowed (only a larger one fails); as a
    checkpoint and as the run's output it is group-committed together with small ones."""
    import tests.workflows  # noqa: F401  (registers "echo")
    limit = 1024 * 1024
    value = "x" * (limit - 2)  # its JSON: the value in quotes, exactly `limit` bytes
    big = client.start("echo", {"value": value, "wait": 0.3})
    small = [client.start("echo", {"value": i, "wait": 0.3}) for i in range(30)]
    with running_worker(dsn, max_output_bytes=limit, concurrency=64):
        run = client.wait(big, timeout=30)
        assert [client.wait(r, timeout=30).output for r in small] == list(range(30))
    assert run.status == "completed", run.error
    assert run.output == value


@flowly.workflow("wuf_tx_once")
async def wuf_tx_once(ctx: flowly.Context, inp: dict[str, Any]) -> Any:
    """A transactional step allowed one attempt, whose SQL takes a while the first time."""
    seconds = inp["seconds"] if ctx.attempt == 1 and not _taken_over(ctx) else 0
    fn = _sql_sleep_async if inp.get("async") else _sql_sleep
    return await ctx.transaction("report", fn, seconds, retry=flowly.Retry(max_attempts=1))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_dropped_connection_under_a_transactional_step_abandons_it_rather_than_failing_it(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any], kind: str
) -> None:
    """The worker's connection is terminated (a failover, pg_terminate_backend) while a
    transactional step's SQL runs. Nothing committed, so the run must be resumed as after any
    lost engine connection (README: a failed engine write abandons the run, and any worker
    resumes it from the last checkpoint). Instead the lost connection is taken for the user
    function's own failure: the step fails through its retry policy, so a step allowed one
    attempt dead-letters its run because of a database blip."""
    # the client fixture sets FLOWLY_DSN, which _taken_over reads
    run_id = client.start("wuf_tx_once", {"seconds": 30, "async": kind == "async"})
    with running_worker(dsn, lease=2):
        wait_for(lambda: _in_report(db), what="the step's SQL running")
        db.execute("select pg_terminate_backend(pid) from pg_stat_activity where datname ="
                   " current_database() and query like 'select pg_sleep%%'")
        run = client.wait(run_id, timeout=12)
    assert run.status == "completed", (run.status, run.error)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_transactional_steps_that_fill_the_pool_leave_room_for_other_runs_and_heartbeats(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any], kind: str
) -> None:
    """max_connections=2: transactional steps whose SQL outlasts two leases take what the
    pool allows them; ordinary runs still claim and commit meanwhile, and the heartbeat keeps
    the long steps' leases (nothing is taken over)."""
    long = [client.start("wuf_tx_sql_sleep", {"seconds": 3.5, "async": kind == "async"})
            for _ in range(2)]
    with running_worker(dsn, lease=1.5, max_connections=2):
        wait_for(lambda: _in_report(db), what="a step's SQL running")
        started = time.monotonic()
        quick = [client.start("wuf_quick", i) for i in range(5)]
        assert [client.wait(r, timeout=10).output for r in quick] == list(range(5))
        assert time.monotonic() - started < 3
        for run_id in long:
            assert client.wait(run_id, timeout=20).status == "completed"
    epochs = {scalar(db, "select lease_epoch from flowly.runs where id = %s", r) for r in long}
    assert epochs == {1}  # no takeover


def test_a_stop_while_the_database_hangs_still_ends_every_thread_of_the_worker(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """The database stops answering (a hung server, a partition) and the worker is stopped:
    its calls in flight answer neither to the end of their statement nor to a cancel request.
    The shutdown is cut short after its grace, but whatever it was waiting for then, the
    heartbeat and step threads must end with it: a heartbeat thread left behind beats for a
    worker that is gone (and warned, for minutes, that its event loop had stopped turning)."""
    before = {t for t in threading.enumerate() if t.name.startswith("flowly-")}
    with freezable_proxy(dsn) as proxy:
        # a lease long enough that no heartbeat is in flight when the database hangs
        with running_worker(proxy.dsn, poll_interval=0.01, drain_timeout=0.1, lease=60):
            wait_for(lambda: scalar(db, "select count(*) = 1 from flowly.workers"),
                     what="the worker registered")
            proxy.freeze()
            time.sleep(0.3)  # the claim loop and the periodic calls are in flight by now
            started = time.monotonic()
        took = time.monotonic() - started
        left = {t for t in threading.enumerate() if t.name.startswith("flowly-")} - before
        assert not left, f"threads left running after the worker stopped: {left}"
        # drain_timeout, the grace of the orderly shutdown, then unregister and pool close
        assert took < 16, f"the shutdown took {took:.1f}s"


_LONG_STEP_CALLS: list[float] = []


async def _four_seconds() -> str:
    _LONG_STEP_CALLS.append(time.monotonic())
    await asyncio.sleep(4)
    return "done"


@flowly.workflow("wuf_four_second_step")
async def wuf_four_second_step(ctx: flowly.Context, _: Any) -> Any:
    return await ctx.step("long", _four_seconds)


def test_a_heartbeat_does_not_wait_for_another_transaction_holding_the_worker_s_row(
    db: psycopg.Connection[Any], dsn: str
) -> None:
    """heartbeat updated the worker's row in flowly.workers (its last_seen_at) before it
    extended any lease, so another transaction holding that row (an admin's open `update
    flowly.workers ...`, a `select ... for update`) stopped the extension of every run the
    worker held: the call waited for the lock. It leaves the row for a later beat now."""
    db.execute("select flowly.start('wuf_quick')")
    epochs = claim_as(db, "wuf_quick")
    db.execute("select flowly.register_worker('w', array['wuf_quick'], array['default'],"
               " '1 hour')")
    with psycopg.connect(dsn) as holder:
        holder.execute("select * from flowly.workers where id = 'w' for update")
        with psycopg.connect(dsn, autocommit=True) as worker:
            worker.execute("set lock_timeout = '2s'")
            lost = worker.execute("select * from flowly.heartbeat('w', %s, %s, '1 hour')",
                                  (list(epochs), list(epochs.values()))).fetchall()
    assert lost == []
    assert scalar(db, "select bool_and(locked_until > now() + interval '50 minutes')"
                      " from flowly.runs")


def test_a_worker_starts_while_another_transaction_holds_a_dead_worker_s_row(
    db: psycopg.Connection[Any], dsn: str
) -> None:
    """register_worker deletes workers unseen for 100 leases; it waited for a lock on such a
    row, so a worker's start hung behind an admin's open transaction on it. The clean-up skips
    a held row now (a later start deletes it)."""
    db.execute("select flowly.register_worker('dead', array['wuf_quick'], array['default'],"
               " '1 s')")
    db.execute("update flowly.workers set last_seen_at = now() - interval '1 hour'")
    with psycopg.connect(dsn) as holder:
        holder.execute("select * from flowly.workers where id = 'dead' for update")
        with psycopg.connect(dsn, autocommit=True) as worker:
            worker.execute("set lock_timeout = '2s'")
            worker.execute("select flowly.register_worker('alive', array['wuf_quick'],"
                           " array['default'], '30 s')")
    assert [r[0] for r in db.execute("select id from flowly.workers order by id")] == [
        "alive", "dead"]
    db.execute("select flowly.register_worker('later', array['wuf_quick'], array['default'],"
               " '30 s')")
    assert [r[0] for r in db.execute("select id from flowly.workers order by id")] == [
        "alive", "later"]


@pytest.mark.parametrize("hold", [
    # 0059: the worker's row held for longer than its lease: its heartbeats failed, its
    # run's lease lapsed and the worker took the run over from itself again and again,
    # running its step each time (4 times in a probe)
    "select * from flowly.workers where id = 'held' for update",
    # 0064: each beat folds the finished-run counters into run_count_totals after it
    # extends the leases; with that table locked the fold waited, the beat was cut off after
    # 2 s and the next came on a new connection: beats 2 s apart, so the 1.5 s lease lapsed
    # under a live worker and the step ran 3 times
    "lock table flowly.run_count_totals in exclusive mode",
])
def test_a_worker_keeps_its_runs_while_another_transaction_holds_what_its_beat_writes(
    dsn: str, hold: str,
) -> None:
    """As above, end to end: a 4 s step under a 1.5 s lease runs once, whatever another
    transaction holds for three leases."""
    _LONG_STEP_CALLS.clear()
    client = flowly.Client(dsn)
    run_id = client.start("wuf_four_second_step")
    with running_worker(dsn, workflows=[wuf_four_second_step], lease=1.5, worker_id="held"):
        wait_for(lambda: _LONG_STEP_CALLS, what="the step started")
        with psycopg.connect(dsn) as holder:
            holder.execute(hold)
            time.sleep(4.5)  # three leases
        run = client.wait(run_id, timeout=20)
    assert run.status == "completed", run
    assert len(_LONG_STEP_CALLS) == 1, f"the step ran {len(_LONG_STEP_CALLS)} times"


@pytest.mark.xdist_group("notification_queue")  # the server's queue is shared: measured alone
def test_a_frozen_worker_s_listener_does_not_hold_the_notification_queue_for_ever(
    dsn: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker frozen whole (SIGSTOP; a paused container, a stopped VM) stops reading its
    listener. The server goes on sending that backend every NOTIFY of the database; once
    the socket is full the backend stalls, and the server's notification queue, shared by
    every session, cannot be cleared past it: it grows until NOTIFY fails everywhere, every
    start with it. A live worker ends the listener of a worker past its lease once that
    backend is stalled, and the frozen worker listens anew when it wakes."""
    client = flowly.Client(dsn)
    with app_worker_process(dsn, "--lease", "1.5") as frozen, \
            psycopg.connect(dsn, autocommit=True) as other:
        assert client.wait(client.start("echo", {"value": 1}), timeout=20).status == "completed"
        frozen_id = scalar(other, "select id from flowly.workers")
        first_listener = scalar(other, "select listener_pid from flowly.workers")
        frozen.signal(signal.SIGSTOP)
        flood_notifications(other, scalar(other, "select flowly.wakeup_channel()"))
        time.sleep(0.5)
        held = notification_queue_usage(other)
        assert held > 0.002, f"the frozen worker held only {held:.5f} of the queue"
        with running_worker(dsn, lease=1.5):
            wait_for(lambda: notification_queue_usage(other) < 0.0005, timeout=30,
                     what="the frozen worker's listener ended, the queue cleared")
        frozen.signal(signal.SIGCONT)
        assert client.wait(client.start("echo", {"value": 2}), timeout=20).status == "completed"
        # it reads the flood its socket held before the end of its listener: seconds on a
        # loaded machine, while its polls (every 0.1 s) claimed the run; wait for that
        wait_for(lambda: scalar(other, "select listener_pid from flowly.workers where id = %s",
                                frozen_id) not in (None, first_listener),
                 what="the woken worker listening anew")
        logged = frozen.stop()
    assert "wake-up listener lost" in logged, logged
    assert f"ended the listener of worker {frozen_id}" in caplog.text, caplog.text


def test_a_worker_whose_claims_fail_tries_again_at_its_poll_not_at_once(
        dsn: str, db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture) -> None:
    """A claim that fails (here a function every claim calls raises) is tried again at the
    next poll: the failure must not read as a claim that filled every free slot, which loops
    at once and floods the server and the log."""
    caplog.set_level(logging.WARNING, logger="flowly.worker")
    with running_worker(dsn, workflows=["quick"], poll_interval=0.3) as worker:
        wait_for(lambda: scalar(db, "select count(*) from flowly.handoff_slots"
                                    " where worker_id = %s", worker.worker_id),
                 what="an idle slot offered")
        db.execute("create or replace function flowly.dead_letter_stalled_runs()"
                   " returns void language plpgsql as"
                   " $$ begin raise exception 'claims fail in this test'; end $$")
        time.sleep(1.5)
        failures = caplog.text.count("claim failed")
    assert 2 <= failures <= 10, failures
