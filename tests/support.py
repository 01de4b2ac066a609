"""Running real workers for tests: in a thread of this process, or as a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import flowly

ROOT = Path(__file__).resolve().parent.parent
# the worker and reader roles setup_roles makes for the tests of this process (the roles fixture)
WORKER, READER = f"fw_worker_{os.getpid()}", f"fw_reader_{os.getpid()}"


@contextmanager
def running_worker(dsn: str, **options: Any) -> Iterator[flowly.Worker]:
    """A Worker running on its own event loop in a thread; stopped gracefully on exit."""
    options.setdefault("poll_interval", 0.1)
    worker = flowly.Worker(dsn, **options)
    loop = asyncio.new_event_loop()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            loop.run_until_complete(worker.run())
        except BaseException as exc:  # surfaced to the test below
            errors.append(exc)
        finally:  # as asyncio.run does: a step that ignored its cancellation is ended here
            leftovers = asyncio.all_tasks(loop)
            for task in leftovers:
                task.cancel()
            if leftovers:
                loop.run_until_complete(asyncio.wait(leftovers))
            loop.close()

    thread = threading.Thread(target=run, name="test-worker", daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        if not loop.is_closed():
            loop.call_soon_threadsafe(worker.stop)
        thread.join(60)
        assert not thread.is_alive(), "worker did not stop"
        assert not errors, f"worker crashed: {errors!r}"


class WorkerProcess:
    """``python -m flowly.worker --app tests.workflows`` (or another ``app``) as a real child
    process."""

    def __init__(self, dsn: str, *args: str, app: str = "tests.workflows") -> None:
        env = {**os.environ, "FLOWLY_DSN": dsn, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flowly.worker", "--app", app, "--dsn", dsn,
             "--poll-interval", "0.1", *args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30) -> str:
        """SIGTERM (or SIGKILL if it does not exit in time); returns everything it logged."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out

    def kill(self) -> str:
        self.proc.kill()
        out, _ = self.proc.communicate()
        return out


@contextmanager
def worker_process(dsn: str, *args: str, app: str = "tests.workflows"
                   ) -> Iterator[WorkerProcess]:
    process = WorkerProcess(dsn, *args, app=app)
    try:
        yield process
    except BaseException:  # what the worker said belongs in the failure's report
        if process.proc.poll() is None:
            sys.stderr.write(f"worker {process.pid} logged:\n{process.kill()}")
        raise
    finally:
        if process.proc.poll() is None:
            process.kill()


def wait_for(condition: Callable[[], Any], timeout: float = 20, interval: float = 0.05,
             what: str = "condition") -> Any:
    """Poll ``condition`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def scalar(conn: psycopg.Connection[Any], query: str, *params: Any) -> Any:
    row = conn.execute(query, params).fetchone()
    return None if row is None else row[0]


def database_default(db: psycopg.Connection[Any], setting: str, value: str) -> None:
    """Sessions of the test's database opened from now on begin with ``setting`` at
    ``value`` (``alter database ... set``)."""
    db.execute(sql.SQL("alter database {} set {} = {}").format(
        sql.Identifier(db.info.dbname), sql.Identifier(setting), sql.Literal(value)))


def end_other_sessions(db: psycopg.Connection[Any]) -> None:
    """End every other session of the test's database, as a server restart or a failover
    does, and wait until they are gone."""
    pids = [pid for (pid,) in db.execute(
        "select pid from pg_stat_activity where datname = current_database()"
        " and pid <> pg_backend_pid()")]
    assert pids, "no other session is connected to end"
    db.execute("select pg_terminate_backend(pid) from unnest(%s::int[]) pid", (pids,))
    wait_for(lambda: not db.execute("select from pg_stat_activity where pid = any(%s)",
                                    (pids,)).fetchall(), what="the sessions ended")
    time.sleep(0.1)  # their farewells reach the client's sockets


def kill_at_work(dsn: str, db: psycopg.Connection[Any], *args: str, pause: float,
                 done: Callable[[], bool]) -> None:
    """Start a worker process and SIGKILL it ``pause`` seconds after it stored a step (or at
    once when ``done``): a crash test that kills a worker on a timer from its start may, on a
    loaded machine, kill one that has not begun work, and prove nothing."""
    def steps() -> int:
        return int(scalar(db, "select count(*) from flowly.steps"))

    before = steps()
    with worker_process(dsn, *args) as worker:
        wait_for(lambda: steps() > before or done(), timeout=30, what="the worker at work")
        time.sleep(pause)
        worker.kill()


def flood_notifications(conn: psycopg.Connection[Any], channel: str) -> None:
    """28 MB of notifications on ``channel``, far more than the socket buffers between a
    backend and its client hold; distinct, since the server sends equal ones of one
    transaction once."""
    for _ in range(40):
        conn.execute("select pg_notify(%s, %s || g) from generate_series(1, 100) g",
                     (channel, "x" * 7000))


def notification_queue_usage(conn: psycopg.Connection[Any]) -> float:
    """The share of the server's notification queue in use, once a nudge has let the server
    clear what every listener has read."""
    conn.execute("select pg_notify('flowly_test_nudge', '')")
    return float(scalar(conn, "select pg_notification_queue_usage()"))


def claim_as(db: psycopg.Connection[Any], workflow: str, limit: int = 10) -> dict[str, int]:
    """Claim up to ``limit`` runs of ``workflow`` for a worker named w, as a worker would from
    SQL (a lease of an hour); their lease epochs by run id."""
    return dict(db.execute(
        "select run_id, lease_epoch from flowly.claim('w', array[%s], array['default'], %s,"
        " '1 hour')", (workflow, limit)).fetchall())


def checkpoint_as(conn: psycopg.Connection[Any], run_id: str, epoch: int, step: str = "s",
                  output: str = "1", position: int = 1) -> tuple[Any, ...]:
    """Checkpoint one step of ``run_id`` (``output`` as JSON text) as a worker's group
    committer would, with the lease epoch its claim gave; lease_lost, busy and seq."""
    row = conn.execute(
        "select lease_lost, busy, seq from flowly.checkpoint_steps(array[%s], array[%s::bigint],"
        " array[%s], array[%s::jsonb], array[now()], array[false], array[%s])",
        (run_id, epoch, step, output, position)).fetchone()
    assert row is not None
    return tuple(row)


def offer_as(db: psycopg.Connection[Any], worker: str, workflow: str, lease: str) -> None:
    """Register a worker and offer an idle slot for ``workflow``, as a worker's claim would:
    the claim of a worker with room for one run, whose slot one hand-off uses up."""
    db.execute("select flowly.register_worker(%s, array[%s], array['default'], %s)",
               (worker, workflow, lease))
    db.execute("select * from flowly.claim_and_offer(%s, array[%s], array['default'], 1, %s,"
               " %s)", (worker, workflow, lease, f"{worker}_channel"))


def park_on_run(db: psycopg.Connection[Any], waiter: str, epoch: int, target: str) -> Any:
    """The worker's two calls for `await ctx.wait_for_run(target)`: register, then park;
    what park returns (when the waiter is due, None for never)."""
    outcome = scalar(db, "select outcome from flowly.wait_for_run(%s, %s, %s, %s)",
                     waiter, epoch, f"run:{target}", target)
    assert outcome == "waiting"
    return scalar(db, "select flowly.park(%s, %s, array[%s])", waiter, epoch, f"run:{target}")


def plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) plan, depth first."""
    yield plan
    for child in plan.get("Plans", ()):
        yield from plan_nodes(child)


def seq_scanned(conn: psycopg.Connection[Any], query: str, *params: Any) -> set[str]:
    """The tables the plan of ``query`` reads with a sequential scan."""
    plan = conn.execute(f"explain (format json) {query}", params).fetchone()
    assert plan is not None
    return {node["Relation Name"] for node in plan_nodes(plan[0][0]["Plan"])
            if node["Node Type"] == "Seq Scan"}


def pages_read(conn: psycopg.Connection[Any], table: str, query: str,
               *params: Any) -> tuple[int, list[Any]]:
    """Run ``query``; return how many pages of ``table`` (heap and indexes, cache hits
    included) it read, and its rows."""
    reads = ("select sum(heap_blks_hit + heap_blks_read + idx_blks_hit + idx_blks_read)"
             " from pg_statio_user_tables where relid = %s::regclass")
    conn.execute("select pg_stat_force_next_flush()")
    before = scalar(conn, reads, table)
    cursor = conn.execute(query, params)
    rows = cursor.fetchall() if cursor.description else []
    conn.execute("select pg_stat_force_next_flush()")
    return int(scalar(conn, reads, table) - before), rows


class _Pair:
    """One proxied connection: the client's socket, the server's, and whether its bytes flow."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self.flowing = threading.Event()
        self.flowing.set()

    @property
    def server_side_port(self) -> int:
        """The port the server sees this connection come from (pg_stat_activity.client_port)."""
        return int(self.server.getsockname()[1])


def server_address(host: str, port: int) -> tuple[int, Any]:
    """The socket family and address a proxy reaches the server at: a unix socket in a
    directory ``host`` (the embedded server's), else TCP."""
    if host.startswith("/"):
        return socket.AF_UNIX, f"{host}/.s.PGSQL.{port}"
    return socket.AF_INET, (host, port)


def connect_to(address: tuple[int, Any]) -> socket.socket:
    """A socket connected to ``address`` (as :func:`server_address` gives it)."""
    family, where = address
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.connect(where)
    return sock


class FreezableProxy:
    """A TCP proxy in front of the test server whose traffic can be stopped while the
    connections stay open and the kernel still acknowledges the bytes, so no TCP timeout
    notices: all of it (``freeze``: the server hangs; connections opened meanwhile, cancel
    requests included, wait for the thaw), or one connection (``hang_backend``: one backend
    hangs, or a pooler in between has a stuck server connection). ``listen_port``: listen there
    (a port a process was told to reach before anything listened on it)."""

    def __init__(self, dsn: str, listen_port: int = 0) -> None:
        with psycopg.connect(dsn) as conn:
            self._upstream = server_address(conn.info.host, conn.info.port)
        # a server reached over a unix socket sees no client port to tell a connection by
        self.upstream_is_unix_socket = self._upstream[0] == socket.AF_UNIX
        self._flowing = threading.Event()
        self._flowing.set()
        self._pairs: list[_Pair] = []
        self._listener = socket.create_server(("127.0.0.1", listen_port))
        params = conninfo_to_dict(dsn)
        for key in ("host", "hostaddr", "port"):
            params.pop(key, None)
        self.dsn = make_conninfo(**params, host="127.0.0.1",
                                 port=str(self._listener.getsockname()[1]))
        threading.Thread(target=self._accept, name="test-proxy", daemon=True).start()

    def freeze(self) -> None:
        self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()

    def hang_backend(self, client_port: int) -> None:
        """Hang the connection the server sees coming from ``client_port``."""
        for pair in self._pairs:
            if pair.server_side_port == client_port:
                pair.flowing.clear()
                return
        raise AssertionError(f"no proxied connection from port {client_port}")

    def release_all(self) -> None:
        """Let every hung connection go on (what piled up is delivered)."""
        for pair in self._pairs:
            pair.flowing.set()

    def close(self) -> None:
        self.thaw()
        self.release_all()
        for sock in [self._listener] + [s for p in self._pairs for s in (p.client, p.server)]:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            self._flowing.wait()
            server = connect_to(self._upstream)
            pair = _Pair(client, server)
            self._pairs.append(pair)
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(pair, source, sink),
                                 daemon=True).start()

    def _pump(self, pair: _Pair, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                self._flowing.wait()
                pair.flowing.wait()
                sink.sendall(data)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


@contextmanager
def freezable_proxy(dsn: str, listen_port: int = 0) -> Iterator[FreezableProxy]:
    proxy = FreezableProxy(dsn, listen_port)
    try:
        yield proxy
    finally:
        proxy.close()


def in_thread(fn: Any, *args: Any, **kwargs: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Call ``fn`` on a daemon thread; the dict gets its 'result' or 'error' (and the
    'sqlstate' of a database error), and 'took'."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        started = time.monotonic()
        try:
            outcome["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # reported to the test
            outcome["error"] = exc
            if isinstance(exc, psycopg.Error):
                outcome["sqlstate"] = exc.sqlstate
        outcome["took"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def sqlstate_of(fn: Any, *args: Any) -> str | None:
    """The SQLSTATE of the database error ``fn(*args)`` raises; None if it raises none."""
    try:
        fn(*args)
    except psycopg.Error as exc:
        return exc.sqlstate
    return None


def waiting_on_lock(db: psycopg.Connection[Any], query_like: str) -> int:
    """How many backends of this database whose query is like ``query_like`` wait on a lock."""
    return int(scalar(db, "select count(*) from pg_stat_activity where datname ="
                          " current_database() and wait_event_type = 'Lock'"
                          " and query like %s", query_like))


def client_port_of(db: psycopg.Connection[Any], query_like: str, dbname: str) -> int | None:
    """The client port of the newest connection to ``dbname`` whose last query is like
    ``query_like`` (FreezableProxy.hang_backend takes it)."""
    port: int | None = scalar(db, "select client_port from pg_stat_activity where datname = %s"
                              " and query like %s and client_port is not null"
                              " order by backend_start desc limit 1", dbname, query_like)
    return port


# parked runs (pending, not due) with a wait that is satisfied: 0022's parked_run_is_due,
# written out again here so that a check does not trust the engine's own rule
LOST_WAKEUPS = """
select r.id, w.step from flowly.runs r
join flowly.waits w on w.run_id = r.id
where r.status = 'pending' and r.scheduled_for > now()
  and (w.timeout_at <= now()
       or (w.kind = 'event' and exists (
               select from flowly.events e
               where e.run_id = r.id and e.name = w.target and e.consumed_by is null
                 and (w.timeout_at is null or e.sent_at <= w.timeout_at)))
       or (w.kind = 'run' and not exists (
               select from flowly.runs t
               where t.id = w.target and t.status in ('pending', 'running', 'compensating'))))
order by 1, 2
"""


def lost_wakeups(db: psycopg.Connection[Any]) -> list[tuple[str, str]]:
    """The parked runs (and their satisfied waits) once the missed wake-ups are applied: a
    wake-up is lost if any is left."""
    db.execute("select flowly.wake_missed_waiters()")
    return [tuple(r) for r in db.execute(LOST_WAKEUPS).fetchall()]


# the unfinished descendants of a run, written out here so that a check does not trust the
# engine's own family query
_UNFINISHED_DESCENDANTS = """
with recursive d as (
    select c.id, c.status from flowly.runs c where c.parent_run_id = %s
    union
    select c.id, c.status from flowly.runs c join d on c.parent_run_id = d.id
)
select id, status from d where status in ('pending', 'running', 'compensating') order by id
"""


def unfinished_descendants(db: psycopg.Connection[Any], run: str) -> list[tuple[str, str]]:
    """The (id, status) of every unfinished run below ``run``, through finished ones too."""
    return [(row[0], row[1]) for row in db.execute(_UNFINISHED_DESCENDANTS, (run,)).fetchall()]


def drop_roles(dsn: str, *roles: str) -> None:
    """Drop ``roles`` where they exist, with what they own."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for role in roles:
            if conn.execute("select 1 from pg_roles where rolname = %s", (role,)).fetchone():
                conn.execute(sql.SQL("drop owned by {r}; drop role {r}").format(
                    r=sql.Identifier(role)))
