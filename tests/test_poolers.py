"""flowly's clients behind a connection pooler in transaction mode (PgBouncer's
``pool_mode = transaction``, as hosted databases offer it to applications).

Such a pooler gives each transaction of a client session whichever server connection is free,
so whatever a session leaves on its server connection is met by other sessions. psycopg
prepares a statement run five times under a name of its own (``_pg3_0``...), and the next
session to prepare one on that server connection finds the name taken, or runs a statement
that has another's parameters. flowly's connections prepare only once they see that no
pooler stands between them and their server session. These tests put a real
PgBouncer (skipped where none is installed) with one server connection in front of the test
server, so every session takes turns on it. LISTEN does not work through such a pooler:
``Client.wait`` falls back to polling, and a worker, which should connect directly (see the
README), sees that its own notification never arrives and offers no slot to hand runs to.
"""

from __future__ import annotations

import asyncio
import getpass
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import flowly
from tests.support import running_worker, scalar, wait_for

ROUNDS = 8  # past psycopg's prepare threshold (5) for every statement a round makes


def _pgbouncer() -> str | None:
    return shutil.which("pgbouncer") or shutil.which("pgbouncer",
                                                     path="/usr/sbin:/usr/local/sbin")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def pooled_dsn(dsn: str) -> Iterator[str]:
    """``dsn`` through a PgBouncer in transaction mode with one server connection."""
    binary = _pgbouncer()
    if binary is None:
        pytest.skip("pgbouncer is not installed")
    params = conninfo_to_dict(dsn)
    host = str(params.get("host") or "")
    if not host or host.startswith("/"):
        pytest.skip("the pooler is put in front of a TCP server; the tests run on a socket")
    user = str(params.get("user") or getpass.getuser())
    server = {"host": host, "port": params.get("port", 5432), "dbname": params["dbname"],
              "user": user, "password": params.get("password")}
    # PgBouncer will not run as root; its files must be readable by the user it runs as
    folder = Path(tempfile.mkdtemp(prefix="flowly-pgbouncer-"))
    folder.chmod(0o755)
    port = _free_port()
    (folder / "users.txt").write_text(f'"{user}" ""\n')
    (folder / "pgbouncer.ini").write_text(f"""\
[databases]
{params['dbname']} = {make_conninfo(**{k: v for k, v in server.items() if v is not None})}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {folder / 'users.txt'}
pool_mode = transaction
default_pool_size = 1
max_client_conn = 50
""")
    for path in folder.iterdir():
        path.chmod(0o644)
    log = (folder / "pgbouncer.log").open("w")
    proc = subprocess.Popen([binary, str(folder / "pgbouncer.ini")], stdout=log, stderr=log,
                            user="nobody" if os.geteuid() == 0 else None)
    pooled = make_conninfo(dsn, host="127.0.0.1", port=port)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                with psycopg.connect(pooled, connect_timeout=2) as conn:
                    conn.execute("select 1")
                break
            except psycopg.OperationalError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("pgbouncer did not start: "
                                       + (folder / "pgbouncer.log").read_text()) from None
                time.sleep(0.1)
        yield pooled
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
        shutil.rmtree(folder, ignore_errors=True)


def test_clients_take_turns_on_one_server_connection_of_a_transaction_pooler(
        dsn: str, pooled_dsn: str, db: psycopg.Connection[Any]) -> None:
    first, second = flowly.Client(pooled_dsn), flowly.Client(pooled_dsn)
    try:
        for i in range(ROUNDS):
            for n, client in enumerate((first, second)):
                run_id = client.start("echo", {"value": [i, n]}, run_id=f"pooled-{i}-{n}",
                                      delay=3600)
                assert client.start("echo", {"value": "again"}, run_id=run_id) == run_id
                run = client.get(run_id)
                assert (run.status, run.input) == ("pending", {"value": [i, n]})
                assert client.steps(run_id) == [] and client.timers(run_id) == []
                assert client.cancel(run_id) == "cancelled"
        assert scalar(db, "select count(*) from flowly.runs where status = 'cancelled'") \
            == 2 * ROUNDS
    finally:
        first.close()
        second.close()


def test_async_clients_take_turns_on_one_server_connection_of_a_transaction_pooler(
        pooled_dsn: str, db: psycopg.Connection[Any]) -> None:
    async def main() -> None:
        async with flowly.AsyncClient(pooled_dsn) as first, \
                flowly.AsyncClient(pooled_dsn) as second:
            for i in range(ROUNDS):
                for n, client in enumerate((first, second)):
                    run_id = await client.start("echo", {"value": [i, n]}, delay=3600)
                    assert (await client.get(run_id)).input == {"value": [i, n]}
                    assert await client.cancel(run_id) == "cancelled"

    asyncio.run(main())
    assert scalar(db, "select count(*) from flowly.runs where status = 'cancelled'") \
        == 2 * ROUNDS


def test_runs_started_through_the_pooler_reach_a_worker_connected_directly(
        dsn: str, pooled_dsn: str) -> None:
    # the NOTIFY a start sends at commit reaches the worker's own LISTEN; the clients'
    # waits, whose LISTEN the pooler loses, find the ending by polling
    async def wait_async() -> None:
        async with flowly.AsyncClient(pooled_dsn) as client:
            for i in range(ROUNDS):
                run = await client.wait(await client.start("echo", {"value": -i}), timeout=30)
                assert (run.status, run.output) == ("completed", -i)

    with running_worker(dsn, workflows=["echo"]), flowly.Client(pooled_dsn) as client:
        for i in range(ROUNDS):
            run_id = client.start("echo", {"value": i})
            run = client.wait(run_id, timeout=30)
            assert (run.status, run.output) == ("completed", i)
        asyncio.run(wait_async())


def test_a_worker_behind_a_transaction_pooler_offers_no_slot_and_says_why(
        pooled_dsn: str, db: psycopg.Connection[Any], client: flowly.Client,
        caplog: pytest.LogCaptureFixture) -> None:
    # a run handed to it would wait out its 5 s first lease: the notification is lost
    caplog.set_level(logging.WARNING, logger="flowly.worker")
    with running_worker(pooled_dsn, workflows=["echo"], lease=6, poll_interval=0.2) as worker:
        wait_for(lambda: "did not reach its listener" in caplog.text, timeout=30,
                 what="the warning that notifications do not reach the worker")
        for i in range(3):
            run_id = client.start("echo", {"value": i})
            run = client.wait(run_id, timeout=30)
            assert (run.status, run.output) == ("completed", i)
            # claimed by the worker's polling, not handed off by the start
            assert scalar(db, "select started_at > created_at from flowly.runs where id = %s",
                          run_id)
        assert scalar(db, "select count(*) from flowly.handoff_slots where worker_id = %s",
                      worker.worker_id) == 0
    assert "Connection poolers" in caplog.text


def test_a_held_run_and_bad_input_through_the_pooler_fail_alone_in_bounded_time(
        dsn: str, pooled_dsn: str, db: psycopg.Connection[Any]) -> None:
    # the lock timeout a cancel waits with is the function's own, so it holds through a
    # pooler that keeps no session setting; the error leaves the shared server connection
    # fit for the next client's call
    with flowly.Client(pooled_dsn) as first, flowly.Client(pooled_dsn) as second:
        held = first.start("echo", {"value": "held"}, delay=3600)
        with psycopg.connect(dsn) as operator:
            operator.execute("select 1 from flowly.runs where id = %s for update", (held,))
            began = time.monotonic()
            with pytest.raises(flowly.RunBusy, match=held):
                first.cancel(held)
            assert time.monotonic() - began < 20
            with pytest.raises(flowly.InvalidArgument):
                second.start("echo", {"value": float("nan")})
            other = second.start("echo", {"value": "other"}, delay=3600)
            assert second.cancel(other) == "cancelled"
        assert first.cancel(held) == "cancelled"
    assert scalar(db, "select count(*) from flowly.runs where status = 'cancelled'") == 2
    assert scalar(db, "select count(*) from flowly.runs") == 2


def test_a_client_behind_the_pooler_prepares_no_statement(pooled_dsn: str) -> None:
    # the backend that answers is not the one the pooler said the connection was opened with
    with flowly.Client(pooled_dsn) as pooled:
        assert pooled.connection.prepare_threshold is None


def test_clients_connected_directly_prepare_statements(dsn: str) -> None:
    # the backend that answers is the one the connection was opened with; prepared
    # statements save an idle start 0.15-0.25 ms, on the enqueue path of a hand-off
    with flowly.Client(dsn) as client:
        assert client.connection.prepare_threshold is not None

    async def threshold() -> int | None:
        async with flowly.AsyncClient(dsn) as client:
            await client.start("echo", {"value": 1}, delay=3600)
            assert client._conn is not None
            return client._conn.prepare_threshold

    assert asyncio.run(threshold()) is not None
