"""Attacks on the bounds added for a database that hangs (flowly.bounded_calls and its users)."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import flowly
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

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self.hang_next = threading.Event()
        self.hung_one = threading.Event()

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
        if self.hang_next.is_set() and not self.hung_one.is_set():
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
            try:
                run = client.wait(run_id, timeout=40)
            except flowly.RunTimeout:
                run = client.get(run_id)
            proxy.release_all()
    finally:
        proxy.close()
    assert proxy.hung_one.is_set()
    effects = db.execute("select step, count(*) from public.test_effects where run_id = %s"
                         " group by step order by step", (run_id,)).fetchall()
    assert run.status == "completed", (
        f"the run ended {run.status} ({run.error and run.error.get('type')}),"
        f" {run.takeovers} takeovers counted; steps executed: {effects}")

