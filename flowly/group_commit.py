"""Group commit: the checkpoints and completions of concurrent runs share statements and commits.

Every run waits for its own write to be durable before it goes on, but the writes that pile
up while one flush is in flight go to the database together as one ``checkpoint_steps`` and
one ``complete_runs`` call, pipelined in one round trip. Under load that turns hundreds of
commits into a few, while an idle worker still commits a lone write at once (no batching
delay).

One run's trouble stays its own: a run whose row another transaction holds comes back busy
(the database never waits for it) and is queued again after a short pause; a batch the
database refuses for one item's content is written again item by item, so only the culprit
gets the error.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from psycopg import AsyncConnection, AsyncCursor
from psycopg.errors import QueryCanceled
from psycopg_pool import AsyncConnectionPool

from .bounded_calls import CONFIRM_CANCEL, end_tasks, within
from .db import Calls, is_connection_failure, is_contention, translated_errors
from .errors import LeaseLost, RunBusy

logger = logging.getLogger(__name__)


@dataclass
class _Checkpoint:
    run_id: str
    epoch: int
    name: str
    payload: str
    started_at: datetime
    compensable: bool
    position: int
    done: asyncio.Future[tuple[Any, int]] = field(repr=False)
    tries: int = 0


@dataclass
class _Completion:
    run_id: str
    epoch: int
    payload: str
    done: asyncio.Future[None] = field(repr=False)
    tries: int = 0


_Write = _Checkpoint | _Completion
# the pause before a busy write is queued again: first, growth per try, at most
_BUSY_PAUSE_FIRST, _BUSY_PAUSE_MAX = 0.02, 1.0
# the JSON text one flush sends at most (an output larger than this goes alone): large outputs
# that are each allowed must not add up to a statement that outlasts the statement timeout
MAX_BATCH_CHARS = 4 * 1024 * 1024
# the JSON text above which a flush's two calls go one after the other, not pipelined: a
# pipeline whose messages outgrow the socket's buffer was left half sent (seen on a unix
# socket with a 3 MB checkpoint: the server waited for the rest of it until the call timed out)
_PIPELINE_MAX_CHARS = 64 * 1024


class GroupCommitter:
    """Queues fenced writes and flushes them in batches from ``flushers`` concurrent tasks."""

    def __init__(
        self, pool: AsyncConnectionPool, calls: Calls, *, flushers: int = 2, max_batch: int = 128,
        timeout: float | None = None,
    ) -> None:
        self._pool = pool
        # a flush that does not answer in time fails its writes as a lost connection would
        self._timeout = timeout
        self._calls = calls
        self._max_batch = max_batch
        self._flushers = flushers
        self._pending: list[_Write] = []
        self._wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._closed = False

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._flush_loop(), name=f"flowly-commit-{i}")
            for i in range(self._flushers)
        ]

    async def close(self, timeout: float | None = None) -> None:
        """Flush what is queued, then stop the flush tasks; after ``timeout`` seconds stop
        them anyway (the database may be gone), failing what was not flushed."""
        self._closing = True
        self._wakeup.set()
        if self._tasks:
            _, unfinished = await asyncio.wait(self._tasks, timeout=timeout)
            await end_tasks(unfinished, CONFIRM_CANCEL * 2)
        self._closed = True
        _fail_all(self._pending, ConnectionError("the worker stopped before this write was"
                                                 " flushed"))
        self._pending.clear()

    async def checkpoint(
        self, run_id: str, epoch: int, name: str, payload: str, started_at: datetime,
        compensable: bool, position: int,
    ) -> tuple[Any, int]:
        """Store a step's output; returns the stored output and its sequence number.

        Raises :class:`LeaseLost` if the run's fencing token is stale.
        """
        done: asyncio.Future[tuple[Any, int]] = asyncio.get_running_loop().create_future()
        self._enqueue(_Checkpoint(run_id, epoch, name, payload, started_at, compensable,
                                  position, done))
        return await done

    async def complete(self, run_id: str, epoch: int, payload: str) -> None:
        """Mark a run completed with its output; raises :class:`LeaseLost` if stale."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._enqueue(_Completion(run_id, epoch, payload, done))
        await done

    def _enqueue(self, item: _Write) -> None:
        if self._closed:
            raise RuntimeError("the worker's group committer is closed")
        self._pending.append(item)
        self._wakeup.set()

    def _retry_later(self, item: _Write) -> None:
        """Queue a busy write again after a pause that grows with its tries."""
        item.tries += 1
        if self._closing:  # nobody will flush it: its run is abandoned, its lease expires
            item.done.set_exception(RunBusy(f"run {item.run_id} still busy at shutdown"))
            return
        # the exponent bounded: a row held for a thousand tries must not overflow a float
        pause = min(_BUSY_PAUSE_FIRST * 2 ** min(item.tries - 1, 16), _BUSY_PAUSE_MAX)
        asyncio.get_running_loop().call_later(pause, self._requeue, item)

    def _requeue(self, item: _Write) -> None:
        if item.done.done():  # its run was cancelled meanwhile
            return
        if self._closing:
            item.done.set_exception(RunBusy(f"run {item.run_id} still busy at shutdown"))
            return
        self._enqueue(item)

    async def _flush_loop(self) -> None:
        while True:
            if not self._pending:
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = self._next_batch()
            await self._write(batch)

    def _next_batch(self) -> list[_Write]:
        """The oldest pending writes, at most ``max_batch`` of them and, but for the first,
        at most MAX_BATCH_CHARS of JSON in all."""
        size = 0
        taken = 0
        for item in self._pending[: self._max_batch]:
            size += len(item.payload)
            if taken and size > MAX_BATCH_CHARS:
                break
            taken += 1
        batch = self._pending[:taken]
        del self._pending[:taken]
        return batch

    async def _write(self, batch: list[_Write]) -> None:
        """Flush ``batch``, and settle what the database's answer means for each write."""
        try:
            await within(self._timeout, self._flush(batch))
        except Exception as exc:
            if len(batch) > 1 and isinstance(exc, QueryCanceled):
                # the batch outlasted the statement timeout: its halves go one after the
                # other, so a write too slow on its own fails only its run
                logger.warning("group commit of %d writes cut off (%s); writing them in halves",
                               len(batch), exc)
                half = len(batch) // 2
                await self._write(batch[:half])
                await self._write(batch[half:])
            elif is_contention(exc) or is_connection_failure(exc):
                # the connection failed (or, rarely, the batch lost a deadlock): each run
                # sorts that out as for any write of its own
                logger.warning("group commit of %d writes failed: %s", len(batch), exc)
                _fail_all(batch, exc)
            elif len(batch) > 1:
                # the database refused the batch for one item's content: write them one by
                # one, so only the culprit gets the error
                logger.warning("group commit of %d writes refused (%s); writing them one by"
                               " one", len(batch), exc)
                for item in batch:
                    await self._write([item])
            else:
                _fail_all(batch, exc)

    async def _flush(self, batch: list[_Write]) -> None:
        checkpoints = [item for item in batch if isinstance(item, _Checkpoint)]
        completions = [item for item in batch if isinstance(item, _Completion)]
        checkpoint_rows: list[Any] = []
        completion_rows: list[Any] = []
        async with self._pool.connection() as conn:
            with translated_errors(self._calls.schema):
                if checkpoints and completions and _chars(batch) <= _PIPELINE_MAX_CHARS:
                    # the two calls touch different runs, so each commits on its own: the
                    # sync between them ends the first's transaction; pipelined, they still
                    # cost one round trip together (a lone call skips the pipeline's toll)
                    async with conn.pipeline() as pipeline:
                        checkpoint_cursor = await self._checkpoint_steps(conn, checkpoints)
                        await pipeline.sync()
                        completion_cursor = await self._complete_runs(conn, completions)
                        checkpoint_rows = await checkpoint_cursor.fetchall()
                        completion_rows = await completion_cursor.fetchall()
                else:
                    if checkpoints:
                        checkpoint_rows = await (
                            await self._checkpoint_steps(conn, checkpoints)).fetchall()
                    if completions:
                        completion_rows = await (
                            await self._complete_runs(conn, completions)).fetchall()
        # rows come back in input order, one per item
        for item, (_, _, lease_lost, busy, output, seq) in zip(
                checkpoints, checkpoint_rows, strict=True):
            self._settle(item, lease_lost, busy, (output, seq))
        for completion, (_, lease_lost, busy) in zip(
                completions, completion_rows, strict=True):
            self._settle(completion, lease_lost, busy, None)

    async def _checkpoint_steps(
        self, conn: AsyncConnection[Any], checkpoints: list[_Checkpoint]
    ) -> AsyncCursor[Any]:
        return await conn.execute(
            self._calls.checkpoint_steps,
            (
                [c.run_id for c in checkpoints],
                [c.epoch for c in checkpoints],
                [c.name for c in checkpoints],
                [c.payload for c in checkpoints],
                [c.started_at for c in checkpoints],
                [c.compensable for c in checkpoints],
                [c.position for c in checkpoints],
            ),
        )

    async def _complete_runs(
        self, conn: AsyncConnection[Any], completions: list[_Completion]
    ) -> AsyncCursor[Any]:
        return await conn.execute(
            self._calls.complete_runs,
            (
                [c.run_id for c in completions],
                [c.epoch for c in completions],
                [c.payload for c in completions],
            ),
        )

    def _settle(self, item: _Write, lease_lost: bool, busy: bool, value: Any) -> None:
        if item.done.done():  # the run's task was cancelled meanwhile
            return
        if busy:
            self._retry_later(item)
        elif lease_lost:
            what = (f"checkpoint of step {item.name!r}" if isinstance(item, _Checkpoint)
                    else "completion")
            item.done.set_exception(LeaseLost(f"{what} of run {item.run_id} refused: lease lost"))
        else:
            item.done.set_result(value)


def _chars(batch: list[_Write]) -> int:
    return sum(len(item.payload) for item in batch)


def _fail_all(batch: list[_Write], exc: BaseException) -> None:
    for item in batch:
        if not item.done.done():
            item.done.set_exception(exc)
