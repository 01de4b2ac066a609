"""Transactional steps: the user's SQL and the step's checkpoint in one transaction.

A transactional step borrows a connection from the worker's pool (an async one for an async
function; a sync one, from a second pool opened on first use, for a sync function, which runs
on a step thread), opens a transaction, locks the run and checks the lease
(``begin_transaction_step``), calls ``fn(conn, *args)``, writes the checkpoint
(``checkpoint_transaction``) and commits. Nothing of it commits if the lease was lost, the
function failed or the connection broke. A serialization failure or deadlock of the user's SQL
starts a fresh transaction, up to a few times. Whatever else the function raises (an OSError,
its own statement or lock timeout) is the step's failure, never taken for the engine's; a
function that ends the transaction itself fails its step without retries. Transactional
compensations work the same way with ``record_compensation`` in place of the checkpoint.

Why not group-commit them like ordinary checkpoints: the user's SQL runs in the transaction, so
one run's slow or failing SQL would hold up or roll back every other run in the batch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import psycopg
from psycopg import pq, sql
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from ..bounded_calls import Cutoff, within
from ..context import UserCodeFailed, serialise_output
from ..db import Calls, translated_errors
from ..errors import FlowlyError, WorkflowCodeError
from ..user_tasks import user_code
from ..workflow import is_async
from . import session
from .step_threads import StepThreads

logger = logging.getLogger(__name__)

# fresh transactions a step gets after its SQL lost a serialization race or a deadlock
SERIALIZATION_TRIES = 5
# the user's SQL may run as long as it needs (the heartbeat keeps the lease meanwhile), and
# pause between statements this many leases before the server ends the transaction (a
# frozen worker's locks must still die)
_IDLE_LEASES = 4
_RELAXED_TIMEOUTS = ("select set_config('statement_timeout', '0', true),"
                     " set_config('idle_in_transaction_session_timeout', %s, true)")
_SERIALIZATION_STATES = frozenset({"40001", "40P01"})


class TransactionConflict(FlowlyError):
    """A transactional step's SQL kept losing serialization races (or deadlocks): the step
    fails through its retry policy, like any failure."""


class Transactions:
    """Runs transactional steps and compensations for one worker."""

    def __init__(self, *, dsn: str, calls: Calls, pool: AsyncConnectionPool, lease: float,
                 max_connections: int, threads: StepThreads) -> None:
        self._dsn = dsn
        self._calls = calls
        self._pool = pool
        self._lease = lease
        # flowly's own statements around the function (not its SQL) are bounded like any
        # engine call: a connection that hangs at the checkpoint must not hold the run for ever
        self._call_timeout = session.call_timeout(lease)
        self._max_connections = max_connections
        self._threads = threads
        # the group commit, claims and heartbeats must always find a connection
        self._slots = asyncio.Semaphore(max(1, max_connections - 2))
        self._relaxed_timeouts = (str(int(lease * 1000 * _IDLE_LEASES)),)
        self._sync_pool: ConnectionPool | None = None
        self._sync_pool_lock = threading.Lock()
        # the connections of sync functions running on step threads, which cancelling a
        # step's task does not stop: stop_sync_transactions cancels their statements
        self._in_sync_transactions: set[psycopg.Connection[Any]] = set()
        self._sync_transactions_ended = threading.Condition()

    def close(self) -> None:
        if self._sync_pool is not None:
            self._sync_pool.close(timeout=1.0)

    def stop_sync_transactions(self, timeout: float) -> None:
        """Cancel the statements of the sync transactional functions still running (their
        tasks were cancelled, their threads run on) and wait up to ``timeout`` seconds for
        their transactions to roll back, so the runs' rows are free to be released."""
        with self._sync_transactions_ended:
            running = list(self._in_sync_transactions)
        for conn in running:
            conn.cancel_safe(timeout=timeout)
        with self._sync_transactions_ended:
            self._sync_transactions_ended.wait_for(
                lambda: not self._in_sync_transactions, timeout=timeout)

    async def step(
        self, run_id: str, epoch: int, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
        isolation: str | None, started_at: datetime, compensable: bool, position: int,
        max_output_bytes: int,
    ) -> tuple[Any, int, bool]:
        """Execute a transactional step; returns its stored output and sequence number, and
        whether the run's takeover count is to be restarted now that the step committed
        (which its own transaction cannot do: 0029)."""
        def finish(result: Any) -> tuple[sql.SQL, tuple[Any, ...]]:
            payload = serialise_output(result, f"step {name!r}", max_output_bytes)
            return self._calls.checkpoint_transaction, (
                run_id, epoch, name, payload, started_at, compensable, position)

        output, seq, taken_over = await self._run(
            self._calls.begin_transaction_step, (run_id, epoch), fn, args, isolation, finish)
        return output, seq, bool(taken_over)

    async def compensate(self, run_id: str, epoch: int, name: str, fn: Callable[..., Any],
                         output: Any) -> None:
        """Run a transactional compensation and record its success in one transaction."""
        def finish(_: Any) -> tuple[sql.SQL, tuple[Any, ...]]:
            return self._calls.record_compensation_transaction, (run_id, epoch, name)

        await self._run(self._calls.begin_compensation_transaction, (run_id, epoch), fn,
                        (output,), None, finish)

    async def _run(
        self, begin: sql.SQL, begin_args: tuple[Any, ...], fn: Callable[..., Any],
        args: tuple[Any, ...], isolation: str | None,
        finish: Callable[[Any], tuple[sql.SQL, tuple[Any, ...]]],
    ) -> Any:
        async with self._slots:
            for attempt in range(1, SERIALIZATION_TRIES + 1):
                try:
                    if is_async(fn):
                        return await self._run_async(begin, begin_args, fn, args, isolation,
                                                     finish)
                    return await self._threads.run(self._run_sync, begin, begin_args, fn, args,
                                                   isolation, finish)
                except UserCodeFailed as failed:
                    exc = failed.error
                    if not isinstance(exc, psycopg.Error) \
                            or exc.sqlstate not in _SERIALIZATION_STATES:
                        raise
                    if attempt == SERIALIZATION_TRIES:
                        raise TransactionConflict(
                            f"the transaction failed {attempt} times in a row: {exc}") from exc
            raise AssertionError("unreachable")

    async def _run_async(
        self, begin: sql.SQL, begin_args: tuple[Any, ...], fn: Callable[..., Any],
        args: tuple[Any, ...], isolation: str | None,
        finish: Callable[[Any], tuple[sql.SQL, tuple[Any, ...]]],
    ) -> Any:
        async with self._pool.connection() as conn:
            with Cutoff(conn) as cutoff:
                cutoff.arm(self._call_timeout)  # the BEGIN and what flowly sends after it
                async with conn.transaction():
                    if isolation is not None:
                        await conn.execute(_set_isolation(isolation))
                    await conn.execute(_RELAXED_TIMEOUTS, self._relaxed_timeouts)
                    with translated_errors(self._calls.schema):
                        await conn.execute(begin, begin_args)
                    cutoff.disarm()
                    try:
                        with user_code():
                            result = await fn(conn, *args)
                    except Exception as exc:
                        failure = _failure_of(conn, exc)
                        if failure is exc:
                            raise
                        raise failure from exc
                    finally:
                        if _ended_by_function(conn):
                            await self._set_back_async(conn)
                    query, params = finish(result)
                    cutoff.arm(self._call_timeout)  # the checkpoint, and the commit
                    with _made_read_only_by_function(), translated_errors(self._calls.schema):
                        cursor = await conn.execute(session.restoring(query, self._lease),
                                                    params)
                        return await cursor.fetchone()

    def _run_sync(
        self, begin: sql.SQL, begin_args: tuple[Any, ...], fn: Callable[..., Any],
        args: tuple[Any, ...], isolation: str | None,
        finish: Callable[[Any], tuple[sql.SQL, tuple[Any, ...]]],
    ) -> Any:
        with self._sync_connections().connection() as conn, Cutoff(conn) as cutoff:
            cutoff.arm(self._call_timeout)  # the BEGIN and what flowly sends after it
            with self._sync_transaction(conn):
                if isolation is not None:
                    conn.execute(_set_isolation(isolation))
                conn.execute(_RELAXED_TIMEOUTS, self._relaxed_timeouts)
                with translated_errors(self._calls.schema):
                    conn.execute(begin, begin_args)
                cutoff.disarm()
                try:
                    result = fn(conn, *args)
                except Exception as exc:
                    failure = _failure_of(conn, exc)
                    if failure is exc:
                        raise
                    raise failure from exc
                finally:
                    if _ended_by_function(conn):
                        self._set_back_sync(conn, cutoff)
                query, params = finish(result)
                cutoff.arm(self._call_timeout)  # the checkpoint, and the commit
                with _made_read_only_by_function(), translated_errors(self._calls.schema):
                    return conn.execute(session.restoring(query, self._lease),
                                        params).fetchone()

    async def _set_back_async(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Set back a session whose function ended flowly's transaction itself: what it set
        committed with it, and the step's checkpoint, which would set it back, is refused.
        A connection that does not take it is closed; the pool opens another."""
        try:
            await within(self._call_timeout, conn.execute(session.set_back(self._lease)))
        except Exception as exc:
            logger.warning("closing a connection a transactional step left unusable: %s", exc)
            await conn.close()

    def _set_back_sync(self, conn: psycopg.Connection[Any], cutoff: Cutoff) -> None:
        """:meth:`_set_back_async` for a sync function's connection."""
        try:
            cutoff.arm(self._call_timeout)
            conn.execute(session.set_back(self._lease))
        except Exception as exc:
            logger.warning("closing a connection a transactional step left unusable: %s", exc)
            conn.close()

    @contextmanager
    def _sync_transaction(self, conn: psycopg.Connection[Any]) -> Iterator[None]:
        """A transaction on ``conn``, which stop_sync_transactions may cancel meanwhile."""
        with self._sync_transactions_ended:
            self._in_sync_transactions.add(conn)
        try:
            with conn.transaction():
                yield
        finally:
            with self._sync_transactions_ended:
                self._in_sync_transactions.discard(conn)
                self._sync_transactions_ended.notify_all()

    def _sync_connections(self) -> ConnectionPool:
        """The pool for sync transactional functions, opened on first use (from a thread)."""
        with self._sync_pool_lock:
            if self._sync_pool is None:
                lease = self._lease
                self._sync_pool = ConnectionPool(
                    self._dsn, min_size=0, max_size=self._max_connections,
                    kwargs=session.connection_kwargs(lease), name="flowly-transactions",
                    configure=self._configure, open=True, timeout=max(lease, 5.0))
            return self._sync_pool

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        """A new connection's session setup, cut off if it does not answer in time: the pool
        opens connections in a few threads of its own, and a setup left hanging (a pooler's
        stuck server connection) holds one of them for ever."""
        with Cutoff(conn) as cutoff:
            cutoff.arm(self._call_timeout)
            session.configure(conn, self._lease)


def _failure_of(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
                exc: Exception) -> Exception:
    """What to raise when the function raised ``exc``: the step's failure, or ``exc`` itself
    when the connection broke under it (a server restart, a terminated backend: nothing
    committed, and it is the database's failure, not the step's, so the run is abandoned
    until its lease expires, as for any engine call). A function that ended flowly's
    transaction itself (COMMIT or ROLLBACK as SQL; psycopg refuses only ``conn.commit()``)
    may have committed its effects: trying it again could apply them twice, so it fails
    without retries. (One that went on in a new transaction and returned is refused by the
    checkpoint, which checks its transaction.)"""
    if conn.broken or conn.closed:
        return exc
    if _ended_by_function(conn):
        ended = WorkflowCodeError(
            f"the function ended the transaction flowly opened for it (a COMMIT or ROLLBACK in"
            f" its SQL) and then raised {exc!r}: let flowly commit")
        ended.__cause__ = exc
        return UserCodeFailed(ended)
    return UserCodeFailed(exc)


@contextmanager
def _made_read_only_by_function() -> Iterator[None]:
    """A checkpoint refused as a write in a read-only transaction: flowly's BEGIN of the step
    locked the run's row, so the transaction could write when the function began, and only
    the function's SQL (SET TRANSACTION READ ONLY) made it read-only since. Its step fails
    without retries, as the function's own mistake. Elsewhere a read-only error is the
    server's (a standby, a read-only default): the run waits for its lease, and is retried."""
    try:
        yield
    except psycopg.errors.ReadOnlySqlTransaction as exc:
        made = WorkflowCodeError(
            "the function made the transaction flowly opened for it read-only (SET TRANSACTION"
            " READ ONLY in its SQL), so its checkpoint cannot be written in it: leave the"
            " transaction read-write")
        made.__cause__ = exc
        raise UserCodeFailed(made) from exc


def _ended_by_function(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """Whether the function ended the transaction flowly opened for it (a COMMIT or ROLLBACK
    in its SQL) on a connection still open."""
    return not (conn.broken or conn.closed) \
        and conn.info.transaction_status == pq.TransactionStatus.IDLE


def _set_isolation(isolation: str) -> sql.Composed:
    # a fixed keyword checked by Context.transaction, never user text
    return sql.SQL("set transaction isolation level {}").format(sql.SQL(isolation))
