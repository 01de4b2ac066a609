"""A database that stops answering (a hung server, a stuck backend, a partition whose
middlebox still acknowledges packets): the worker, the client and the CLI must keep the
bounds the README promises, and the runs must come out right once the database answers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

import flowly
from tests.support import (
    ROOT,
    FreezableProxy,
    client_port_of,
    freezable_proxy,
    in_thread,
    running_worker,
    scalar,
    wait_for,
    worker_process,
)

# -- helpers --------------------------------------------------------------------------------


class _EitherClient:
    """flowly.Client, or flowly.AsyncClient with each call run to its end on a loop of its
    own (from any thread): one test body for both clients."""

    def __init__(self, kind: str, dsn: str, **options: Any) -> None:
        import asyncio

        self._loop = asyncio.new_event_loop() if kind == "async" else None
        self._client: Any = (flowly.AsyncClient if self._loop else flowly.Client)(dsn, **options)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)
        if self._loop is None:
            return method
        loop = self._loop
        return lambda *args, **kwargs: loop.run_until_complete(method(*args, **kwargs))

    def close(self) -> None:
        self.__getattr__("close")()
        if self._loop is not None:
            self._loop.close()


@contextmanager
def hanging_proxy(dsn: str) -> Iterator[FreezableProxy]:
    """A proxy whose connections are hung one by one (``hang_backend``); skips the test on a
    server reached over a unix socket (the embedded one), which sees no client port."""
    with freezable_proxy(dsn) as proxy:
        if proxy.upstream_is_unix_socket:
            pytest.skip("the server (reached over a unix socket) sees no client port, by"
                        " which the connection to hang is told")
        yield proxy



# -- the worker's shutdown ------------------------------------------------------------------


def test_sigterm_ends_a_worker_whose_database_hangs_as_it_starts(dsn: str) -> None:
    """README: on SIGTERM "each shutdown call is bounded, so a worker whose database is gone
    or hangs still exits within drain_timeout plus about 15 seconds". A worker started while
    the database hangs (its schema check or install is the first thing it asks) must hear
    SIGTERM too."""
    with freezable_proxy(dsn) as proxy:
        proxy.freeze()
        with worker_process(proxy.dsn, "--drain-timeout", "1", "--lease", "3") as worker:
            time.sleep(2)  # importing the app, then connecting for the schema
            assert worker.proc.poll() is None
            worker.signal(signal.SIGTERM)
            started = time.monotonic()
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(timeout=20)
            took = time.monotonic() - started
            still_running = worker.proc.poll() is None
            proxy.thaw()
        assert not still_running, (
            f"the worker did not exit {took:.0f}s after SIGTERM while its database hung"
            f" (promised: drain_timeout 1s plus about 15s)")


def test_sigterm_ends_a_worker_whose_database_hangs_while_it_migrates(
    empty_dsn: str, db: psycopg.Connection[Any]
) -> None:
    """(Passes today; kept because nothing else covers the bound while the database hangs.)
    The worker waits for the install lock (another worker migrating) when the database
    stops answering, and is sent SIGTERM. Its cancel request cannot get through either; the
    README still promises an exit within drain_timeout plus about 15 seconds."""
    from flowly.schema import INSTALL_LOCK_KEY

    flowly.install_dsn(empty_dsn, target=18)
    dbname = str(conninfo_to_dict(empty_dsn)["dbname"])
    with psycopg.connect(empty_dsn, autocommit=True) as holder, \
            freezable_proxy(empty_dsn) as proxy:
        holder.execute("select pg_advisory_lock(%s)", (INSTALL_LOCK_KEY,))
        with worker_process(proxy.dsn, "--drain-timeout", "1", "--lease", "3") as worker:
            wait_for(lambda: scalar(db, "select count(*) from pg_stat_activity where datname = %s"
                                        " and wait_event = 'advisory'", dbname),
                     what="the worker waiting for the install lock")
            proxy.freeze()
            worker.signal(signal.SIGTERM)
            started = time.monotonic()
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(timeout=25)
            took = time.monotonic() - started
            still_running = worker.proc.poll() is None
            proxy.thaw()
        assert not still_running, (
            f"the worker did not exit {took:.0f}s after SIGTERM while its database hung in the"
            " middle of its install (promised: drain_timeout 1s plus about 15s)")


# -- the client -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_client_wait_with_a_timeout_returns_in_time_while_the_database_hangs(
    dsn: str, kind: str
) -> None:
    """Client.wait(run_id, timeout=2) "raises RunTimeout after timeout seconds" (AsyncClient's
    likewise). When the database stops answering it must still come back in about that time
    (RunTimeout, or an error saying the database does not answer), not block its caller for
    as long as the database hangs."""
    import asyncio

    import tests.workflows  # noqa: F401  (registers "quick")
    with freezable_proxy(dsn) as proxy:
        if kind == "sync":
            client = flowly.Client(proxy.dsn)
            run_id = client.start("quick", 1)
            with pytest.raises(flowly.RunTimeout):  # the client's connections are open
                client.wait(run_id, timeout=0.2)
            proxy.freeze()
            thread, outcome = in_thread(client.wait, run_id, timeout=2)
        else:
            async_client = flowly.AsyncClient(proxy.dsn)
            loop = asyncio.new_event_loop()
            run_id = loop.run_until_complete(async_client.start("quick", 1))
            with pytest.raises(flowly.RunTimeout):
                loop.run_until_complete(async_client.wait(run_id, timeout=0.2))
            proxy.freeze()
            thread, outcome = in_thread(loop.run_until_complete,
                                         async_client.wait(run_id, timeout=2))
        thread.join(10)
        hung = thread.is_alive()
        proxy.thaw()
        thread.join(15)
        if kind == "sync":
            client.close()
        else:
            loop.run_until_complete(async_client.close())
            loop.close()
    assert not hung, "wait(timeout=2) was still blocked 10s later while the database hung"
    assert isinstance(outcome.get("error"), (flowly.RunTimeout, psycopg.OperationalError)), outcome


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_client_with_a_timeout_gives_up_on_a_hung_database_and_works_once_it_answers(
    dsn: str, db: psycopg.Connection[Any], kind: str
) -> None:
    """Client(timeout=1): a call on a database that stops answering raises DatabaseTimeout in
    about that time instead of blocking its caller (a web request starting a run) for as
    long as the database hangs. Once it answers, the same client works again, and a start
    made again with its run_id returns the run the lost call may have made after all."""
    import tests.workflows  # noqa: F401  (registers "quick")
    with freezable_proxy(dsn) as proxy:
        client = _EitherClient(kind, proxy.dsn, timeout=1)
        before = client.start("quick", 1)  # the client's connection is open
        proxy.freeze()
        thread, outcome = in_thread(client.start, "quick", 2, run_id=f"hung-start-{kind}")
        thread.join(10)
        hung = thread.is_alive()
        proxy.thaw()
        thread.join(15)
        assert not hung, "start on a client with timeout=1 still blocked 10s into the hang"
        assert isinstance(outcome.get("error"), flowly.DatabaseTimeout), outcome
        assert outcome["took"] < 4.0, outcome
        assert "did not answer within the client's timeout (1s)" in str(outcome["error"])
        assert client.start("quick", 2, run_id=f"hung-start-{kind}") == f"hung-start-{kind}"
        assert client.get(before).id == before
        client.close()
    assert scalar(db, "select count(*) from flowly.runs where id = %s", f"hung-start-{kind}") == 1


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_client_call_behind_a_held_lock_ends_at_the_client_s_timeout_having_done_nothing(
    dsn: str, db: psycopg.Connection[Any], kind: str
) -> None:
    """Client(timeout=1).cancel of a run whose row an operator's open transaction holds: the
    database answers but the call waits for the lock. It must raise DatabaseTimeout in about
    the timeout, saying the call took no effect, and keep that promise: the cancel must not
    go on waiting in the server and cancel the run once the operator commits."""
    import tests.workflows  # noqa: F401  (registers "quick")
    client = _EitherClient(kind, dsn, timeout=1)
    run_id = client.start("quick", 1, run_id=f"held-{kind}")
    with psycopg.connect(dsn) as operator:
        operator.execute("select 1 from flowly.runs where id = %s for update", (run_id,))
        started = time.monotonic()
        with pytest.raises(flowly.DatabaseTimeout, match="took no effect") as raised:
            client.cancel(run_id)
        took = time.monotonic() - started
        time.sleep(0.5)  # a statement the server still ran would wait for the lock here
    assert took < 3.0, f"the cancel behind a held lock took {took:.1f}s with timeout=1"
    assert "within the client's timeout (1s)" in str(raised.value)
    time.sleep(0.5)
    assert scalar(db, "select status from flowly.runs where id = %s", run_id) == "pending"
    assert client.cancel(run_id) == "cancelled"  # the same client works on once it is free
    client.close()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_client_call_whose_backend_dies_is_no_timeout_and_the_next_call_is_bounded_again(
    dsn: str, db: psycopg.Connection[Any], kind: str
) -> None:
    """The server goes away under a client call with a timeout (a restart, a failover, an
    operator's pg_terminate_backend): the caller gets the lost connection, not a
    DatabaseTimeout claiming the client's timeout ran out, and the run is as it was. The
    same client then calls on a new connection, and that one carries the timeout too: a
    call behind a held lock still ends at the timeout having done nothing."""
    import tests.workflows  # noqa: F401  (registers "quick")
    client = _EitherClient(kind, dsn, timeout=3)
    run_id = client.start("quick", 1, run_id=f"backend-dies-{kind}")
    waiting = ("select pid from pg_stat_activity where datname = current_database()"
               " and wait_event_type = 'Lock' and query like '%%cancel%%'")
    with psycopg.connect(dsn) as operator:
        operator.execute("select 1 from flowly.runs where id = %s for update", (run_id,))
        thread, outcome = in_thread(client.cancel, run_id)
        backend = wait_for(lambda: scalar(db, waiting), what="the cancel waiting")
        db.execute("select pg_terminate_backend(%s)", (backend,))
        thread.join(10)
    assert not thread.is_alive(), "the call went on after its backend was terminated"
    error = outcome.get("error")
    assert isinstance(error, psycopg.OperationalError), outcome
    assert not isinstance(error, flowly.DatabaseTimeout), outcome
    assert scalar(db, "select status from flowly.runs where id = %s", run_id) == "pending"

    with psycopg.connect(dsn) as operator:
        operator.execute("select 1 from flowly.runs where id = %s for update", (run_id,))
        thread, outcome = in_thread(client.cancel, run_id)
        renewed = wait_for(lambda: scalar(db, waiting), what="the cancel waiting again")
        thread.join(10)
    assert renewed != backend
    assert isinstance(outcome.get("error"), flowly.DatabaseTimeout), outcome
    assert "took no effect" in str(outcome["error"])
    assert outcome["took"] < 6.0, outcome
    assert scalar(db, "select status from flowly.runs where id = %s", run_id) == "pending"
    assert client.cancel(run_id) == "cancelled"
    client.close()


def test_a_client_call_an_operator_cancels_before_the_timeout_is_no_timeout(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """Client(timeout=30).cancel behind a held lock, cancelled by an operator
    (pg_cancel_backend) after half a second: the server's QueryCanceled, as without a
    timeout, not a DatabaseTimeout claiming the client's timeout ran out."""
    import tests.workflows  # noqa: F401  (registers "quick")
    client = flowly.Client(dsn, timeout=30)
    run_id = client.start("quick", 1, run_id="cancelled-by-an-operator")
    backend = client.connection.info.backend_pid
    with psycopg.connect(dsn) as operator:
        operator.execute("select 1 from flowly.runs where id = %s for update", (run_id,))
        thread, outcome = in_thread(client.cancel, run_id)
        wait_for(lambda: scalar(db, "select wait_event_type = 'Lock' from pg_stat_activity"
                                    " where pid = %s", backend), what="the cancel waiting")
        db.execute("select pg_cancel_backend(%s)", (backend,))
        thread.join(10)
    assert type(outcome.get("error")) is psycopg.errors.QueryCanceled, outcome
    assert scalar(db, "select status from flowly.runs where id = %s", run_id) == "pending"
    client.close()


def test_the_command_line_with_a_db_timeout_gives_up_on_a_hung_database(dsn: str) -> None:
    """`flowly --db-timeout 1 runs` (a script's or an operator's) exits 1 with one line
    saying the database did not answer, instead of hanging with it; `--db-timeout 0` is a
    bad invocation."""
    from tests.test_cli import flowly as flowly_cli
    from tests.test_cli import one_error_line

    with freezable_proxy(dsn) as proxy:
        proxy.freeze()
        started = time.monotonic()
        result = flowly_cli("--db-timeout", "1", "runs", dsn=proxy.dsn, timeout=30)
        took = time.monotonic() - started
        proxy.thaw()
    line = one_error_line(result, 1)
    assert "did not answer within the client's timeout (1s)" in line, line
    assert took < 15, f"took {took:.1f}s"
    line = one_error_line(flowly_cli("--db-timeout", "0", "runs", dsn=dsn), 2)
    assert line == "error: --db-timeout must be a positive number of seconds, got 0", line


def test_the_command_line_with_a_db_timeout_ends_a_cancel_behind_a_held_lock(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """`flowly --db-timeout 1 cancel RUN` while an operator's transaction holds the run's row:
    exit 1 saying the call took no effect, and the run is not cancelled afterwards."""
    import tests.workflows  # noqa: F401  (registers "quick")
    from tests.test_cli import flowly as flowly_cli
    from tests.test_cli import one_error_line
    run_id = flowly.Client(dsn).start("quick", 1, run_id="held-by-an-operator")
    with psycopg.connect(dsn) as operator:
        operator.execute("select 1 from flowly.runs where id = %s for update", (run_id,))
        line = one_error_line(flowly_cli("--db-timeout", "1", "cancel", run_id, dsn=dsn), 1)
    assert "did not complete the call within the client's timeout (1s)" in line, line
    assert "took no effect" in line, line
    time.sleep(0.5)
    assert scalar(db, "select status from flowly.runs where id = %s", run_id) == "pending"


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf")])
def test_a_client_timeout_must_be_a_positive_number_of_seconds(dsn: str, timeout: float) -> None:
    for make in (flowly.Client, flowly.AsyncClient):
        with pytest.raises(flowly.InvalidArgument, match="timeout must be a positive number"):
            make(dsn, timeout=timeout)


# -- the heartbeat --------------------------------------------------------------------------



def test_a_heartbeat_whose_backend_hangs_is_given_up_and_leases_are_still_kept(
    dsn: str, db: psycopg.Connection[Any], client: flowly.Client
) -> None:
    """The backend serving the worker's heartbeat connection stops answering (a stuck
    backend, a pooler's stuck server connection: the bytes are acknowledged, so neither TCP
    keepalives nor tcp_user_timeout notice), while the rest of the database answers. README:
    "Workers heartbeat all their runs in one call every lease/3"; a lease may lapse under a
    live worker only for "a database outage shorter than the worker's lease". A beat that
    does not answer must be given up (its connection dropped, a new one opened) so that the
    next beats keep the leases: a run whose steps outlast a lease must still complete, not be
    taken over again and again and dead-lettered as a PoisonRun of a worker that never died."""
    import tests.workflows  # noqa: F401  (registers "three_steps")
    dbname = str(conninfo_to_dict(dsn)["dbname"])
    db.execute("update flowly.settings set max_takeovers = 3")
    # a lease of 4 s: a beat every 1.3 s, cut off after 2 s (the least a beat is given), the
    # next one 0.3 s later: within the lease
    with hanging_proxy(dsn) as proxy, running_worker(proxy.dsn, lease=4):
        port = wait_for(lambda: client_port_of(db, "%fold_run_counts%", dbname),
                        what="the heartbeat's connection")
        proxy.hang_backend(port)
        run_id = client.start("three_steps", {"step_seconds": 5})
        try:
            run = client.wait(run_id, timeout=40)
        except flowly.RunTimeout:
            run = client.get(run_id)
        proxy.release_all()
    effects = db.execute("select step, count(*) from public.test_effects where run_id = %s"
                         " group by step order by step", (run_id,)).fetchall()
    assert run.status == "completed", (
        f"the run ended {run.status} ({run.error and run.error.get('type')}),"
        f" {run.takeovers} takeovers counted; steps executed: {effects}")


# -- transactional steps --------------------------------------------------------------------

# the proxy of the running test, which a transactional step hangs its own connection through
_PROXY: dict[str, FreezableProxy] = {}
_HUNG_ONCE: set[str] = set()


def _effect_then_hang(conn: psycopg.Connection[Any], run_id: str) -> str:
    """Insert an effect in the step's transaction; the first time, hang the connection
    before flowly writes the checkpoint and commits."""
    conn.execute("insert into public.test_effects (run_id, step, pid) values (%s, 'tx', 0)",
                 (run_id,))
    if run_id not in _HUNG_ONCE:
        _HUNG_ONCE.add(run_id)
        port = conn.execute("select inet_client_port()").fetchone()[0]  # type: ignore[index]
        _PROXY["proxy"].hang_backend(port)
    return "done"


async def _effect_then_hang_async(conn: psycopg.AsyncConnection[Any], run_id: str) -> str:
    await conn.execute("insert into public.test_effects (run_id, step, pid)"
                       " values (%s, 'tx', 0)", (run_id,))
    if run_id not in _HUNG_ONCE:
        _HUNG_ONCE.add(run_id)
        row = await (await conn.execute("select inet_client_port()")).fetchone()
        _PROXY["proxy"].hang_backend(row[0])  # type: ignore[index]
    return "done"


@flowly.workflow("hd_tx_hangs_before_commit")
async def hd_tx_hangs_before_commit(ctx: flowly.Context, inp: dict[str, Any]) -> Any:
    fn = _effect_then_hang_async if inp.get("async") else _effect_then_hang
    return await ctx.transaction("tx", fn, ctx.run_id)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_transactional_step_whose_connection_hangs_at_its_checkpoint_is_resumed(
    dsn: str, db: psycopg.Connection[Any], client: flowly.Client, kind: str
) -> None:
    """A transactional step's function returns, and the connection stops answering just as
    flowly sends the checkpoint and COMMIT (nothing reaches the server, whose session ends its
    idle transaction after 4 leases, rolling the step back). README: "a failed engine write
    (the connection dropped mid-checkpoint): the worker abandons the run, and once its lease
    expires any worker resumes it from the last checkpoint"; engine calls are bounded
    (call_timeout) for ordinary steps. The run must complete, its SQL effect committed once;
    instead the worker waits on that connection for ever while its heartbeat keeps the
    run's lease: the run is stuck, and no other worker may take it."""
    with hanging_proxy(dsn) as proxy:
        _PROXY["proxy"] = proxy
        run_id = client.start("hd_tx_hangs_before_commit", {"async": kind == "async"})
        with running_worker(proxy.dsn, lease=1.5):
            try:
                run = client.wait(run_id, timeout=28)
            except flowly.RunTimeout:
                run = client.get(run_id)
            held_by_live_worker = scalar(
                db, "select locked_until > now() from flowly.runs where id = %s", run_id)
            proxy.release_all()  # let the hung connection go before the worker stops
    effects = scalar(db, "select count(*) from public.test_effects where run_id = %s", run_id)
    assert run.status == "completed", (
        f"28s after the hang the run is {run.status}, its lease still kept by the worker:"
        f" {held_by_live_worker}, attempts {run.attempt}")
    assert effects == 1


# -- answers lost: the server commits, the worker never hears ------------------------------


def _slow_write(db: psycopg.Connection[Any], table: str, when: str, seconds: float) -> None:
    """A trigger that makes writes to flowly.``table`` matching ``when`` (SQL over NEW) take
    ``seconds``, so the test can stop the answer of a commit the server is about to make."""
    db.execute(f"""
        create function public.hd_slow() returns trigger language plpgsql as $$
        begin
            if {when} then perform pg_sleep({seconds}); end if;
            return new;
        end $$""")
    db.execute(f"create trigger hd_slow before insert or update on flowly.{table}"
               " for each row execute function public.hd_slow()")


def _sleeping_in_trigger(db: psycopg.Connection[Any], dbname: str) -> bool:
    return bool(scalar(db, "select count(*) from pg_stat_activity where datname = %s"
                           " and wait_event = 'PgSleep'", dbname))


def test_a_checkpoint_committed_while_the_database_hangs_is_replayed_not_run_again(
    dsn: str, db: psycopg.Connection[Any], client: flowly.Client
) -> None:
    """(Passes today; kept: no other test loses a committed checkpoint's answer.)
    The database hangs after committing step a's checkpoint, before its answer reaches the
    worker, for longer than the worker's call timeout and lease. Once it answers again the
    worker (no restart) must resume the run: step a replayed from its checkpoint (never
    executed again once its checkpoint committed), the run completed once."""
    import tests.workflows  # noqa: F401  (registers "three_steps")
    dbname = str(conninfo_to_dict(dsn)["dbname"])
    _slow_write(db, "steps", "new.name = 'a' and tg_op = 'INSERT'", 1.5)
    with freezable_proxy(dsn) as proxy, running_worker(proxy.dsn, lease=2):
        run_id = client.start("three_steps", {"step_seconds": 0})
        wait_for(lambda: _sleeping_in_trigger(db, dbname), what="the checkpoint of a in flight")
        proxy.freeze()
        wait_for(lambda: scalar(db, "select count(*) from flowly.steps where run_id = %s"
                                    " and name = 'a'", run_id), what="a's checkpoint committed")
        time.sleep(17)  # past the worker's call timeout (15s for a lease of 2s) and lease
        proxy.thaw()
        run = client.wait(run_id, timeout=15)
    effects = dict(db.execute("select step, count(*) from public.test_effects where run_id = %s"
                              " group by step", (run_id,)).fetchall())
    assert run.status == "completed", run.error
    assert effects == {"a": 1, "b": 1, "c": 1}


def test_a_worker_whose_lease_lapsed_while_the_database_hung_does_not_run_steps_checkpointed_since(
    dsn: str, db: psycopg.Connection[Any], client: flowly.Client
) -> None:
    """Worker A (through the proxy) has step a's checkpoint committed when the database stops
    answering it, for longer than its lease but shorter than its call timeout. Worker B takes
    the run over once A's lease expired and completes it: steps b and c run and are
    checkpointed. When A hears back, it knows it has not heard from the database for more
    than a lease (its heartbeats went unanswered), so its lease may be gone. README: "A step
    with a checkpoint is never executed again for that run"; A must not start step b, whose
    checkpoint B committed meanwhile."""
    import tests.workflows  # noqa: F401  (registers "three_steps")
    dbname = str(conninfo_to_dict(dsn)["dbname"])
    _slow_write(db, "steps", "new.name = 'a' and tg_op = 'INSERT'"
                             " and (select lease_epoch from flowly.runs where id = new.run_id) = 1",
                1.5)
    with freezable_proxy(dsn) as proxy, running_worker(proxy.dsn, lease=2):
        run_id = client.start("three_steps", {"step_seconds": 0})
        wait_for(lambda: _sleeping_in_trigger(db, dbname), what="the checkpoint of a in flight")
        proxy.freeze()
        with running_worker(dsn, lease=2):
            run = client.wait(run_id, timeout=15)
        proxy.thaw()
        time.sleep(3)  # A hears its checkpoint's answer and its heartbeat's
    assert run.status == "completed", run.error
    effects = db.execute("select step, at > %s from public.test_effects where run_id = %s"
                         " order by at", (run.finished_at, run_id)).fetchall()
    steps = [step for step, _ in effects]
    after_the_end = [step for step, late in effects if late]
    assert steps == ["a", "b", "c"], (
        f"steps executed {steps}, {after_the_end} after the run completed: a worker whose lease"
        " had lapsed ran a step the worker that took over had already checkpointed")


def test_a_claim_committed_while_the_database_hangs_is_served_after_the_thaw(
    dsn: str, db: psycopg.Connection[Any], client: flowly.Client
) -> None:
    """(Passes today; kept: no other test loses a claim's answer.)
    The claim commits, its answer is lost (the database hangs past the worker's call
    timeout). Once the database answers the worker, without a restart, must claim the run
    again (its lease lapsed) and complete it once, without counting an attempt."""
    import tests.workflows  # noqa: F401  (registers "three_steps")
    dbname = str(conninfo_to_dict(dsn)["dbname"])
    _slow_write(db, "runs", "tg_op = 'UPDATE' and old.status = 'pending'"
                            " and new.status = 'running'", 1.5)
    # started before the worker, so a claim takes it (an idle worker would be handed it)
    run_id = client.start("three_steps", {"step_seconds": 0})
    with freezable_proxy(dsn) as proxy, running_worker(proxy.dsn, lease=2):
        wait_for(lambda: _sleeping_in_trigger(db, dbname), what="the claim in flight")
        proxy.freeze()
        time.sleep(17)
        proxy.thaw()
        run = client.wait(run_id, timeout=20)
    effects = db.execute("select step from public.test_effects where run_id = %s order by at",
                         (run_id,)).fetchall()
    assert run.status == "completed", run.error
    assert [e[0] for e in effects] == ["a", "b", "c"]
    assert run.attempt == 1


def test_a_stop_while_a_heartbeat_hangs_still_ends_the_heartbeat_thread(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """README: "a worker whose database is gone or hangs still exits within drain_timeout
    plus about 15 seconds, its threads ended". tests/test_worker_under_failure.py checks this
    with a lease of 60s, so that no heartbeat is in flight; with an ordinary lease one is
    (a beat goes every lease/3), and the heartbeat thread must end all the same: left behind
    it beats again for a worker that is gone as soon as the database answers."""
    before = {t for t in threading.enumerate() if t.name.startswith("flowly-")}
    with freezable_proxy(dsn) as proxy:
        with running_worker(proxy.dsn, drain_timeout=0.1, lease=1.5):
            wait_for(lambda: scalar(db, "select count(*) = 1 from flowly.workers"),
                     what="the worker registered")
            time.sleep(1)
            proxy.freeze()
            time.sleep(1)  # a beat is in flight by now (one every 0.5s)
            started = time.monotonic()
        took = time.monotonic() - started
        left = {t.name for t in threading.enumerate() if t.name.startswith("flowly-")
                and t not in before and t.is_alive()}
        proxy.thaw()
    assert took < 16, f"the shutdown took {took:.1f}s"
    assert not left, f"threads left running {took:.0f}s after the worker stopped: {left}"


def test_a_beat_cut_off_by_a_stop_is_no_failed_heartbeat(
    dsn: str, db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A stop cuts off a beat in flight (it must not wait for a database that may hang). That
    beat then fails as on a lost connection; the worker logged it as "heartbeat failed", a
    warning on every graceful stop that met a slow beat (a CI run met one under load). The
    stop asked for the cut: nothing failed."""
    caplog.set_level(logging.WARNING, logger="flowly")
    with running_worker(dsn, lease=6, drain_timeout=0.1):  # a beat every 2 s
        wait_for(lambda: scalar(db, "select count(*) = 1 from flowly.workers"),
                 what="the worker registered")
        with psycopg.connect(dsn) as holder:
            # the beat's update of the worker's row waits for the table's lock
            holder.execute("lock table flowly.workers in access exclusive mode")
            wait_for(lambda: scalar(db, "select count(*) from pg_stat_activity"
                                        " where datname = current_database()"
                                        " and wait_event_type = 'Lock'"
                                        " and query like '%%heartbeat(%%'"),
                     timeout=10, what="a beat waiting for the lock")
            holder.rollback()
    failed = [r.getMessage() for r in caplog.records if "heartbeat failed" in r.getMessage()]
    assert failed == []


# -- the command line -----------------------------------------------------------------------


def test_top_quits_on_q_while_the_database_hangs(dsn: str) -> None:
    """README: `flowly top` is "a live view ...; `q` quits", and it keeps drawing its last
    frame, saying why it is stale, when the database is unreachable. When the database
    hangs, q must still quit it (within a couple of its refresh intervals), not only once the
    database answers again."""
    import pty

    with freezable_proxy(dsn) as proxy:
        master, slave = pty.openpty()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm", "COLUMNS": "120",
               "LINES": "40"}
        env.pop("FLOWLY_DSN", None)
        proc = subprocess.Popen(
            [sys.executable, "-m", "flowly", "--dsn", proxy.dsn, "top", "--interval", "0.2"],
            stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ROOT, close_fds=True)
        os.close(slave)
        drawn = bytearray()

        def drain() -> None:
            with contextlib.suppress(OSError):
                while chunk := os.read(master, 65536):
                    drawn.extend(chunk)

        threading.Thread(target=drain, daemon=True).start()
        try:
            wait_for(lambda: b"worker" in drawn.lower() or b"runs" in drawn.lower(),
                     what="top's first frame")
            time.sleep(1)
            proxy.freeze()
            time.sleep(1.5)  # a refresh is waiting for the database now
            os.write(master, b"q")
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            quit_in_time = proc.poll() is not None
        finally:
            proxy.thaw()
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            os.close(master)
    assert quit_in_time, "flowly top did not quit 10s after q while the database hung"


# -- the wake-up listener -------------------------------------------------------------------


def test_a_hung_wakeup_listener_is_noticed_and_replaced(
    dsn: str, db: psycopg.Connection[Any], client: flowly.Client
) -> None:
    """README: a waiting run "wakes within milliseconds (NOTIFY), not at the next poll", and
    poll_interval is only "the fallback when no NOTIFY arrives". When the backend of the
    worker's LISTEN connection stops answering (the rest of the database answers), the
    worker must notice and listen again on a new connection, rather than fall back to its
    poll interval for ever without a word."""
    import tests.workflows  # noqa: F401  (registers "quick")
    dbname = str(conninfo_to_dict(dsn)["dbname"])
    with hanging_proxy(dsn) as proxy, running_worker(proxy.dsn, lease=2, poll_interval=20):
        port = wait_for(lambda: client_port_of(db, "%record_listener(%", dbname),
                        what="the worker's LISTEN connection")
        proxy.hang_backend(port)
        time.sleep(6)  # a couple of leases: time enough to notice a connection that is hung
        started = time.monotonic()
        run_id = client.start("quick", 1)
        try:
            run = client.wait(run_id, timeout=6)
        except flowly.RunTimeout:
            run = client.get(run_id)
        took = time.monotonic() - started
        proxy.release_all()
    assert run.status == "completed", (
        f"{took:.0f}s after its start the run is {run.status}: the worker, its listener hung,"
        " waits for its 20s poll")
