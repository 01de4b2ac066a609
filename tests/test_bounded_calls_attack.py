"""Attacks on the bounds added for a database that hangs (flowly.bounded_calls and its users)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
import threading
import time
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import flowly
from flowly.bounded_calls import within
from tests.support import (
    FreezableProxy,
    client_port_of,
    freezable_proxy,
    in_thread,
    running_worker,
    wait_for,
)


def test_a_second_client_wait_while_the_database_still_hangs_returns_in_time(dsn: str) -> None:
    """README: a wait "whose database stops answering" raises RunTimeout "about a second past
    its timeout". The first such wait closes the client's connections; a caller that tries
    again (a retry loop) while the database still hangs must be bounded the same way. The
    new connection's connect is not covered by the Cutoff (self._conn is None until
    psycopg.connect returns), so it blocks for libpq's connect timeout (130 s)."""
    import tests.workflows  # noqa: F401  (registers "quick")

    with freezable_proxy(dsn) as proxy:
        client = flowly.Client(proxy.dsn)
        run_id = client.start("quick", 1)
        with pytest.raises(flowly.RunTimeout):  # the connections are open
            client.wait(run_id, timeout=0.2)
        proxy.freeze()
        with pytest.raises(flowly.RunTimeout):  # cut off, the client's connections closed
            client.wait(run_id, timeout=1)
        thread, outcome = in_thread(client.wait, run_id, timeout=1)
        thread.join(12)
        hung = thread.is_alive()
        proxy.thaw()
        thread.join(15)
        client.close()
    assert not hung, ("the second wait(timeout=1) was still blocked 12s later while the"
                      " database hung (its reconnect is not bounded)")
    assert isinstance(outcome.get("error"), (flowly.RunTimeout, psycopg.OperationalError)), outcome


# -- the heartbeat's new connection ---------------------------------------------------------


class _HangNextConnectionProxy(FreezableProxy):
    """A FreezableProxy that can hang the next connection opened through it once the server
    said it is ready (its login done): the connect succeeds, its first statement never
    answers (a pooler handing out a stuck server connection)."""

    def __init__(self, dsn: str, connections_to_hang: int = 1) -> None:
        super().__init__(dsn)
        self.hang_next = threading.Event()
        self.hung_one = threading.Event()
        self._left_to_hang = connections_to_hang
        self._counting = threading.Lock()

    def _pump(self, pair: Any, source: socket.socket, sink: socket.socket) -> None:
        if source is pair.client:  # client -> server
            return self._pump_requests(pair, source, sink)
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                self._flowing.wait()
                pair.flowing.wait()
                sink.sendall(data)
                if b"Z\x00\x00\x00\x05" in data:
                    ready = getattr(pair, "ready", None)
                    if ready is not None:
                        ready.set()
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        return None

    def _pump_requests(self, pair: Any, source: socket.socket, sink: socket.socket) -> None:
        with self._counting:
            hang = self.hang_next.is_set() and self._left_to_hang > 0
            self._left_to_hang -= hang
        if hang:
            self.hung_one.set()
            pair.ready = threading.Event()
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                self._flowing.wait()
                pair.flowing.wait()
                ready = getattr(pair, "ready", None)
                if ready is not None and ready.is_set():
                    pair.flowing.clear()  # logged in: from now on this backend "hangs"
                    pair.flowing.wait()
                sink.sendall(data)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)



def _ended_or_as_it_stands(client: flowly.Client, run_id: str, timeout: float) -> flowly.Run:
    """The run once it ended, or as it stands after ``timeout`` seconds."""
    try:
        return client.wait(run_id, timeout=timeout)
    except flowly.RunTimeout:
        return client.get(run_id)


def _assert_completed(run: flowly.Run, detail: str = "") -> None:
    assert run.status == "completed", (
        f"the run ended {run.status} ({run.error and run.error.get('type')}),"
        f" {run.takeovers} takeovers counted{detail}")


def test_a_heartbeat_whose_new_connection_hangs_at_its_session_setup_recovers(
    dsn: str, db: psycopg.Connection[Any], client: flowly.Client
) -> None:
    """The heartbeat's backend hangs; its beat is cut off and it reconnects, as designed. The
    new connection logs in, then hangs too (the pooler handed out another stuck server
    connection). Heartbeat._connection runs session.configure (two statements) before the
    Cutoff is armed (and builds the Cutoff only after connecting): nothing bounds it, so
    the heartbeat thread blocks for ever, no lease is extended again, and runs whose steps
    outlast a lease are dropped and taken over until dead-lettered (PoisonRun) under a live
    worker. A beat whose connection hangs at any point must be given up, and the next one
    (on yet another connection, which answers) must keep the leases."""
    import tests.workflows  # noqa: F401  (registers "three_steps")
    dbname = str(conninfo_to_dict(dsn)["dbname"])
    db.execute("update flowly.settings set max_takeovers = 3")
    proxy = _HangNextConnectionProxy(dsn)
    try:
        if proxy.upstream_is_unix_socket:
            pytest.skip("the server (reached over a unix socket) sees no client port")
        with running_worker(make_conninfo(proxy.dsn, sslmode="disable"), lease=4):
            port = wait_for(lambda: client_port_of(db, "%fold_run_counts%", dbname),
                            what="the heartbeat's connection")
            proxy.hang_next.set()  # the next connection opened (the heartbeat's) hangs too
            proxy.hang_backend(port)
            run_id = client.start("three_steps", {"step_seconds": 5})
            run = _ended_or_as_it_stands(client, run_id, timeout=40)
            proxy.release_all()
    finally:
        proxy.close()
    assert proxy.hung_one.is_set()
    effects = db.execute("select step, count(*) from public.test_effects where run_id = %s"
                         " group by step order by step", (run_id,)).fetchall()
    _assert_completed(run, f"; steps executed: {effects}")


def test_a_stop_while_a_new_pool_connection_hangs_in_its_session_setup_ends_in_time(
    dsn: str, db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's pool replaces a lost connection; the new one logs in, then its session
    setup (session.configure_async) never answers; then the whole server hangs (a pooler's
    stuck connection, then an outage). The worker is stopped: run() returns after its bounded
    shutdown, leaving the pool's task in that setup, which the event loop's teardown
    (asyncio.run's, or the thread's in running_worker) cancels once. psycopg answers a single
    cancel of a query by asking the server to cancel it and waiting: 10 s more on a hung
    server, past the README's promise that a stopped worker "still exits within drain_timeout
    plus about 15 seconds" (24 s in all here, 10 s of them after run() returned; seen under
    CPU load in the test of a stop while the database hangs, too)."""
    dbname = str(conninfo_to_dict(dsn)["dbname"])
    proxy = _HangNextConnectionProxy(dsn)
    caplog.set_level(logging.INFO, logger="flowly.worker")
    try:
        if proxy.upstream_is_unix_socket:
            pytest.skip("the server (reached over a unix socket) sees no client port")
        with running_worker(make_conninfo(proxy.dsn, sslmode="disable"), lease=2,
                            drain_timeout=0.1, poll_interval=0.05):
            wait_for(lambda: db.execute("select count(*) = 1 from flowly.workers"
                                        ).fetchone() == (True,), what="the worker registered")
            proxy.hang_next.set()
            # the pool's connections (not the listener's, nor the heartbeat thread's): the
            # pool opens a new one at its next call, which hangs once logged in
            db.execute("select pg_terminate_backend(pid) from pg_stat_activity"
                       " where datname = %s and pid <> pg_backend_pid()"
                       " and pid not in (select listener_pid from flowly.workers"
                       " where listener_pid is not null) and query not like '%%heartbeat(%%'",
                       (dbname,))
            wait_for(proxy.hung_one.is_set, what="the pool's new connection")
            time.sleep(1)  # logged in, its setup sent
            proxy.freeze()
        ended = time.time()
    finally:
        proxy.close()
    # what run() takes is bounded by the shutdown's own timeouts (the test of a stop while
    # the database hangs); what comes after it is the teardown
    run_returned = [r.created for r in caplog.records if r.getMessage().endswith(" stopped")]
    assert run_returned, "the worker did not log that it stopped"
    assert ended - run_returned[0] < 3, (
        f"the event loop's teardown after run() returned took {ended - run_returned[0]:.1f}s")


def test_sync_transactional_steps_run_on_although_new_connections_hang_at_their_setup(
    dsn: str, db: psycopg.Connection[Any], client: flowly.Client
) -> None:
    """A sync transactional step opens the worker's pool for sync functions; its first
    connections log in, then their session setup (session.configure) never answers (a
    pooler handing out stuck server connections). The pool opens connections in a few
    threads of its own: a setup nobody bounds holds one for ever, and once every one is held
    no sync transactional step of the worker can run again. The setups must be given up, and
    the run must complete on a connection that answers."""
    import tests.workflows  # registers "transfer"
    db.execute(tests.workflows.ACCOUNTS_TABLE)
    db.execute("insert into public.accounts values ('a', 1000), ('b', 1000)")
    proxy = _HangNextConnectionProxy(dsn, connections_to_hang=3)
    try:
        if proxy.upstream_is_unix_socket:
            pytest.skip("the server (reached over a unix socket) sees no client port")
        with running_worker(make_conninfo(proxy.dsn, sslmode="disable"), lease=2):
            wait_for(lambda: db.execute("select count(*) = 1 from flowly.workers"
                                        ).fetchone() == (True,), what="the worker registered")
            proxy.hang_next.set()
            run_id = client.start("transfer", {"from": "a", "to": "b", "amount": 30})
            run = _ended_or_as_it_stands(client, run_id, timeout=60)
            proxy.release_all()
    finally:
        proxy.close()
    assert proxy.hung_one.is_set()
    _assert_completed(run)
    assert db.execute("select balance from public.accounts order by name").fetchall() == [
        (970,), (1030,)]


def test_bounded_calls_share_one_watchdog_thread_and_are_still_cut_off(
        dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Client with a timeout bounds each call with a Cutoff: one thread for the process
    watches every deadline (a thread started per call cost a third of a ``start``), and a
    call that outlasts its time is still cut off."""
    started: list[str] = []
    start = threading.Thread.start

    def counted(thread: threading.Thread) -> None:
        started.append(thread.name)
        start(thread)

    with flowly.Client(dsn, timeout=30) as client:
        client.start("quick", 0)  # connected, and the watchdog running if it was not
        monkeypatch.setattr(threading.Thread, "start", counted)
        for _ in range(50):
            client.start("quick", 0)
        monkeypatch.undo()
    assert started == [], started
    with freezable_proxy(dsn) as proxy, flowly.Client(proxy.dsn, timeout=0.5) as client:
        client.start("quick", 0)
        proxy.freeze()
        began = time.monotonic()
        with pytest.raises(flowly.DatabaseTimeout):
            client.start("quick", 0)
        took = time.monotonic() - began
        proxy.thaw()
    assert took < 5, took


def test_a_call_given_up_on_that_fails_as_it_ends_is_not_logged_as_never_retrieved(
        caplog: pytest.LogCaptureFixture) -> None:
    """within() gives up on a call (out of time, or its caller cancelled) and cancels it. A
    call whose connection breaks as it is cancelled ends with that error, not with
    CancelledError, and nobody read it: asyncio logged "Task exception was never retrieved"
    at ERROR, as a chaos run found in a worker's log (AdminShutdown, its connection
    terminated)."""
    async def breaks_as_it_is_cancelled() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise psycopg.OperationalError("the connection broke as the call was cancelled"
                                           ) from None

    async def give_up() -> None:
        with pytest.raises(TimeoutError):
            await within(0.05, breaks_as_it_is_cancelled())
        caller = asyncio.ensure_future(within(None, breaks_as_it_is_cancelled()))
        await asyncio.sleep(0.05)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller

    caplog.set_level(logging.ERROR, logger="asyncio")
    asyncio.run(give_up())
    gc.collect()
    assert "never retrieved" not in caplog.text


def test_a_wait_with_a_timeout_far_in_the_future_leaves_the_watchdog_working(
        dsn: str, client: flowly.Client) -> None:
    """client.wait(run_id, timeout=1e300) killed the one watchdog thread of the process
    ("OverflowError: timestamp out of range for platform time_t" as it went to sleep until
    the deadline) while the wait went on: no call of the process was cut off any more."""
    run_id = client.start("quick", 0)

    def cancel_run() -> None:
        with flowly.Client(dsn) as canceller:
            canceller.cancel(run_id)

    cancel = threading.Timer(0.5, cancel_run)
    cancel.start()
    with pytest.raises(flowly.InvalidState, match="ended cancelled"):
        client.wait(run_id, "completed", timeout=1e300)
    cancel.join()
    assert [t for t in threading.enumerate() if t.name == "flowly-cutoff" and t.is_alive()]
    with freezable_proxy(dsn) as proxy, flowly.Client(proxy.dsn, timeout=0.5) as bounded:
        bounded.start("quick", 0)
        proxy.freeze()
        began = time.monotonic()
        with pytest.raises(flowly.DatabaseTimeout):
            bounded.start("quick", 0)
        took = time.monotonic() - began
        proxy.thaw()
    assert took < 5, took
