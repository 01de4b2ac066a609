"""The worker: claims runs, executes workflow bodies, heartbeats leases, shuts down cleanly.

One asyncio loop runs up to ``concurrency`` runs at once over a small, bounded connection
pool: runs share connections (claims, heartbeats and group-committed writes each borrow one
briefly), plus one connection that LISTENs for wake-ups. All decisions (retry or give up,
backoff, lease validity) are made by the SQL functions; this loop only carries them out.

Run it with ``python -m flowly.worker --app module[:attr]`` or :meth:`Worker.run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from .. import arguments
from ..bounded_calls import end_tasks, on_daemon_thread, within
from ..branches import enter_body
from ..config import checked_dsn
from ..context import (
    NOT_RETRYABLE,
    CompensateInterrupt,
    Context,
    Interrupt,
    LeaseLostInterrupt,
    RefusedWrite,
    RunAbandoned,
    SleepInterrupt,
    WaitInterrupt,
    call_user_function,
    cancel_requested,
    code_checked,
    error_info,
    run_write,
    serialise_output,
)
from ..db import (
    Calls,
    is_connection_failure,
    is_contention,
    listen_to,
    purge_age_interval,
    seconds_interval,
    translated_errors,
)
from ..errors import InvalidArgument, LeaseLost, WorkflowCodeError
from ..group_commit import GroupCommitter
from ..render import one_line
from ..replay import ReplayLog, StoredStep
from ..retry import Retry
from ..schedules import TICK_BATCH, schedule_calls
from ..schema import check_current, install
from ..user_tasks import containing_user_tasks, user_code
from ..workflow import Workflow, WorkflowFn, resolve, start_params
from . import session
from .collector import collector_paced_for_runs
from .due_timer import DueTimer, announced_due
from .first_connection import connect_when_reachable, delays
from .handoff import ClaimedRun, HandOff, ListenerProbe, parse_handoff
from .heartbeat import Heartbeat, settle
from .server_clock import ServerClock
from .step_threads import StepThreads
from .transactions import Transactions

logger = logging.getLogger(__name__)

# how long cancelled runs get to unwind at shutdown before they are released anyway
_CANCEL_GRACE = 2.0
# the largest step or workflow output (JSON bytes) a worker sends: far below what jsonb and the
# driver's pipeline handle, and a size no checkpoint should have (store a reference instead)
DEFAULT_MAX_OUTPUT_BYTES = 8 * 1024 * 1024
# the longest lease (seconds), as the engine's check_lease allows: a run held by a worker that
# died is taken over at most this long after its last heartbeat
MAX_LEASE = 86_400.0
# the shortest lease (seconds): the worker's sessions are not cut sooner whatever the lease
# (session.settings: a frozen worker's transaction still lives a second), a run handed off is
# stopped half a second before its first lease ends, and a connection's TCP user timeout is
# the lease, which a lost packet's retransmissions (0.2 s apart, then doubling) soon use up.
# A lease of 0.01 s made healthy runs look expired almost at once: taken over again and
# again, they ended as poison
MIN_LEASE = 1.0
# how long a worker cancelled while a claim was on its way waits for its answer, to hold (and
# so release) the runs it took: an answer is milliseconds away unless the database hangs, and
# less than the moment after which the cancellation of the worker's tasks is repeated
_CLAIM_ANSWER_GRACE = 0.5
# how long each database call at shutdown (release, unregister) may take before the worker
# exits anyway: a database that is gone must not keep a stopping worker alive
_SHUTDOWN_CALL_TIMEOUT = 3.0
# how long a listener's own notification may take to reach it before the worker says none
# does (a busy server delivers one in milliseconds); it asks again at every ping meanwhile
_PROBE_WAIT = 5.0
# the periodic purge (purge_after): how often a round starts, and the runs of one batch (a
# round deletes batch after batch until one comes back short)
_PURGE_EVERY = 60.0
_PURGE_BATCH = 1000
# the longest pause between two cron ticks, whatever poll_interval says: a fire time more than
# a minute old counts as missed
_SCHEDULE_TICK_MAX = 15.0
# how long past the drain timeout a stopping worker's orderly shutdown may take in all
_SHUTDOWN_GRACE = 5.0
# rows and bytes of replay data one read fetches
_REPLAY_PAGE_ROWS = 500
# a handed-off run's first lease whose extension was answered busy (or failed) is tried
# again after these pauses (first, at most); its execution here stops this long before that
# lease ends unextended
_EXTEND_RETRY_FIRST, _EXTEND_RETRY_MAX = 0.05, 0.5
_FIRST_LEASE_MARGIN = 0.5

__all__ = ["DEFAULT_MAX_OUTPUT_BYTES", "Worker"]


def _seconds(what: str, value: Any, *, zero: bool = False) -> float:
    """An option given as seconds or a timedelta, in seconds: positive (or ``zero``)."""
    seconds = arguments.duration(what, value).total_seconds()
    if seconds < 0 or (seconds == 0 and not zero):
        least = "zero or more" if zero else "a positive number of"
        raise InvalidArgument(f"{what} must be {least} seconds, got {value}")
    return seconds


def _queues(queues: Iterable[str] | str) -> list[str]:
    """The queues a worker serves: one queue alone (not in a list) is that queue, not the
    letters of its name."""
    if isinstance(queues, (bytes, bytearray)):  # iterated, it would be the queues 120, 121...
        raise InvalidArgument("queues must be a queue name or an iterable of them, got"
                              f" {type(queues).__name__} {queues!r}")
    given = [queues] if isinstance(queues, str) else list(queues)
    if not given:
        raise InvalidArgument("a worker needs at least one queue to serve")
    for queue in given:
        if not arguments.text("queue", queue):
            raise InvalidArgument("queue must be a non-empty text")
    return list(dict.fromkeys(given))


@dataclass
class _Held:
    """A run this worker holds: its fencing token and the task executing it."""

    run_id: str
    epoch: int
    # until when (time.monotonic()) the lease is known to hold: a claim or a heartbeat that
    # extended it was sent before then minus a lease (the server counts from later)
    lease_until: float
    task: asyncio.Task[None] | None = None
    # its completion was written: the run left nothing behind for a claim to take
    completed: bool = False
    # why this worker stopped executing it (its task was cancelled): a body that caught
    # the cancellation must not start another step
    stopped: str | None = None

    def stop(self, why: str) -> None:
        """Cancel the execution; no step of it starts from now on."""
        self.stopped = why
        if self.task is not None:
            self.task.cancel()


class _RunStore:
    """The fenced writes of one claimed run, as the workflow context makes them."""

    def __init__(self, worker: Worker, held: _Held) -> None:
        self._worker = worker
        self._held = held

    def check_lease(self) -> None:
        if self._held.stopped is not None:
            raise LeaseLostInterrupt(f"run {self._held.run_id}: {self._held.stopped}")
        if time.monotonic() > self._held.lease_until:
            raise LeaseLostInterrupt(
                f"run {self._held.run_id}: no claim or heartbeat answered for more than the"
                f" lease ({self._worker.lease:g}s), so another worker may hold it now")

    def checkpoint(
        self, name: str, payload: str, started_at: datetime, compensable: bool, position: int
    ) -> Coroutine[Any, Any, tuple[Any, int]]:
        # the committer's own coroutine, not one around it: every step awaits this
        return self._worker._committer.checkpoint(
            self._held.run_id, self._held.epoch, name, payload, started_at, compensable, position
        )

    async def sleep(
        self, name: str, wake_at: datetime | None, seconds: float | None, position: int,
        release: bool,
    ) -> tuple[datetime, bool]:
        row = await self._worker._call_one(
            self._worker._calls.sleep,
            (self._held.run_id, self._held.epoch, name, wake_at, seconds, position, release),
        )
        return row[0], row[1]

    async def fail_step(
        self, name: str, error: dict[str, Any], started_at: datetime, retry: Retry,
        retryable: bool, position: int,
    ) -> str:
        row = await self._worker._call_one(
            self._worker._calls.fail_step,
            (
                self._held.run_id, self._held.epoch, name, Jsonb(error),
                started_at, retry.max_attempts, retry.backoff, retry.initial_delay_seconds,
                retry.max_delay_seconds, retryable, position,
            ),
        )
        logger.info("run %s step %r failed (%s): %s", self._held.run_id, name, row[0],
                    error["message"])
        if row[0] == "retry":
            await self._worker._claim_when_due(row[1])
        return str(row[0])

    async def start_run(
        self, workflow: str, input: Any, run_id: str, options: dict[str, Any],
        defaults: Workflow | None, record: str, position: int,
    ) -> str:
        params = code_checked(start_params, workflow, input, run_id, options, defaults)
        params["parent_run_id"] = self._held.run_id
        params["parent_lease_epoch"] = self._held.epoch
        params["parent_step"] = record
        params["parent_position"] = position
        row = await self._worker._call_one(self._worker._calls.start_child, params)
        return str(row[0])

    async def transaction(
        self, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
        isolation: str | None, started_at: datetime, compensable: bool, position: int,
        max_output_bytes: int,
    ) -> tuple[Any, int]:
        output, seq, taken_over = await self._worker._transactions.step(
            self._held.run_id, self._held.epoch, name, fn, args, isolation, started_at,
            compensable, position, max_output_bytes)
        if taken_over:  # a committed checkpoint is progress: the takeover count restarts
            try:
                await self._worker._call(self._worker._calls.restart_takeovers,
                                         (self._held.run_id, self._held.epoch))
            except (psycopg.Error, OSError) as exc:  # the next checkpoint restarts it
                logger.warning("run %s: could not restart its takeover count: %s",
                               self._held.run_id, exc)
        return output, seq

    async def wait_for_event(
        self, step: str, event: str, timeout: float | None, position: int
    ) -> tuple[str, Any]:
        row = await self._worker._call_one(
            self._worker._calls.wait_for_event,
            (self._held.run_id, self._held.epoch, step, event, timeout, position))
        return str(row[0]), row[1]

    async def wait_for_run(
        self, step: str, target: str, position: int
    ) -> tuple[str, str | None, Any, Any]:
        row = await self._worker._call_one(
            self._worker._calls.wait_for_run,
            (self._held.run_id, self._held.epoch, step, target, position))
        return str(row[0]), row[1], row[2], row[3]

    async def read_page(self, after_seq: int) -> list[Any]:
        return await self._worker._call(
            self._worker._calls.replay, (self._held.run_id, after_seq, _REPLAY_PAGE_ROWS))

    async def call_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._worker._step_threads.run(fn, *args)

    async def records_predate_branch_names(self) -> bool:
        return bool((await self._worker._call_one(
            self._worker._calls.records_predate_branch_names, (self._held.run_id,)))[0])


class Worker:
    """Executes runs of the given workflows until stopped.

    ``workflows``: names, decorated functions or :class:`flowly.Workflow` objects (default:
    every workflow registered in this process). ``concurrency`` bounds runs in flight;
    ``max_connections`` bounds the pool whatever the concurrency (one more connection
    LISTENs). ``lease`` is how long a claimed run stays ours without a heartbeat (from a
    second to a day); heartbeats go every ``lease/3``. ``poll_interval`` is the fallback when
    no NOTIFY arrives (also how soon a run is seen that comes due by time over an hour ahead,
    or whose worker died: a run started to be due later, or released to sleep, back off or
    wait, is claimed when it comes due, see due_timer). On stop, in-flight runs get up to
    ``drain_timeout`` seconds to finish; the rest are released for other workers at once.
    ``max_output_bytes`` bounds a step's or workflow's JSON output (a larger one fails its run
    before anything is sent). With ``purge_after`` the worker deletes runs that finished
    longer ago than that, with their history, a bounded batch at a time every minute.
    """

    def __init__(
        self,
        dsn: str,
        workflows: Iterable[str | Workflow | WorkflowFn] | str | Workflow | WorkflowFn
        | None = None,
        *,
        schema: str = "flowly",
        queues: Iterable[str] = ("default",),
        concurrency: int = 32,
        lease: float | timedelta = 30.0,
        poll_interval: float | timedelta = 0.5,
        drain_timeout: float | timedelta = 10.0,
        max_connections: int = 4,
        default_retry: Retry | None = None,
        install_schema: bool = True,
        worker_id: str | None = None,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        purge_after: float | timedelta | None = None,
    ) -> None:
        self.dsn = checked_dsn(dsn)
        self.workflows = resolve(workflows)
        if not self.workflows:
            raise ValueError("a worker needs at least one registered workflow")
        self.queues = _queues(queues)
        self.concurrency = arguments.at_least("concurrency", concurrency, 1)
        self.lease = _seconds("lease", lease)
        self.poll_interval = _seconds("poll_interval", poll_interval)
        self.drain_timeout = _seconds("drain_timeout", drain_timeout, zero=True)
        if self.lease > MAX_LEASE:
            raise InvalidArgument(f"lease must be at most {MAX_LEASE:g} seconds (a day),"
                                  f" got {self.lease:g}")
        if self.lease < MIN_LEASE:
            raise InvalidArgument(f"lease must be at least {MIN_LEASE:g} second, got"
                                  f" {self.lease:g}")
        self._lease_interval = seconds_interval(self.lease)
        self.max_connections = arguments.at_least("max_connections", max_connections, 2)
        if default_retry is not None and not isinstance(default_retry, Retry):
            raise InvalidArgument("default_retry must be a flowly.Retry, got"
                                  f" {type(default_retry).__name__} {default_retry!r}")
        self.default_retry = default_retry or Retry()
        if not isinstance(install_schema, bool):
            raise InvalidArgument("install_schema must be True or False, got"
                                  f" {type(install_schema).__name__} {install_schema!r}")
        self.install_schema = install_schema
        self.max_output_bytes = arguments.at_least("max_output_bytes", max_output_bytes, 1)
        self.purge_after = None if purge_after is None else _seconds(
            "purge_after", purge_after, zero=True)
        if worker_id is not None and not (isinstance(worker_id, str) and worker_id.strip()
                                          and "\x00" not in worker_id):
            raise InvalidArgument(f"worker_id must be a non-empty text, got {worker_id!r}")
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._calls = Calls(schema)
        self._held: dict[str, _Held] = {}
        self._wakeup = asyncio.Event()
        # whether the last claim may have left claimable runs behind (see _forget)
        self._runs_may_wait = True
        # whether the claim loop was woken to claim, not only to offer an idle slot
        self._claim_due = True
        # whether the listener is up: only then may the worker offer an idle slot, since a
        # run handed to it arrives by NOTIFY, on a channel of this instance alone
        self._listening = False
        self._handoff_channel = f"flowly_handoff_{uuid.uuid4().hex}"
        # calls made beside the claim loop: for runs handed to this worker (confirming,
        # extending or releasing them), and reading the clock to time a claim
        self._side_calls: set[asyncio.Task[None]] = set()
        # the room a claim in flight counted on, and the hand-offs that found no other room
        # meanwhile: they are taken (or given back) once the claim's runs have begun
        self._claiming = 0
        self._handoffs_behind_claim: list[str] = []
        # the runs handed to it that it released when it last began to listen (0054): a
        # notification of one read since is stale
        self._released_handoffs: set[str] = set()
        # read while the worker offers slots (how much of a handed run's lease is left), and
        # when it times a claim for a run it released or one announced due later (due_timer)
        self._server_clock = ServerClock(every=self.lease)
        self._clock_reading: asyncio.Task[None] | None = None
        self._due_timer: DueTimer | None = None
        self._stopping = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._step_threads = StepThreads(concurrency)
        self._pool: AsyncConnectionPool | None = None
        self._committer: GroupCommitter
        self._transactions: Transactions

    # -- public -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the worker to stop: claim nothing more, drain, release what is left. May be
        called from any thread."""
        loop = self._loop
        if loop is not None and not loop.is_closed() and not _on_loop(loop):
            loop.call_soon_threadsafe(self.stop)
            return
        self._stopping.set()
        self._wake()

    async def run(self) -> None:
        """Run until :meth:`stop` (or SIGTERM/SIGINT when on the main thread).

        However it ends (stopped, cancelled, or failing), runs still in flight are cancelled
        here and released, so other workers take them at once.
        """
        loop = self._loop = asyncio.get_running_loop()
        on_main_thread = threading.current_thread() is threading.main_thread()
        if on_main_thread:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
        try:
            if not await self._schema_ready():
                return
            lease = self.lease

            async def configure(conn: psycopg.AsyncConnection[Any]) -> None:
                # bounded, and ended at once when cancelled (see bounded_calls): a setup on a
                # hung server that the pool leaves behind at close is cancelled once, by the
                # event loop's teardown, which a plain query would hold up 10 s
                await within(session.call_timeout(lease), session.configure_async(conn, lease))

            self._pool = AsyncConnectionPool(
                self.dsn, min_size=1, max_size=self.max_connections, open=False,
                kwargs=session.connection_kwargs(lease), name="flowly-worker",
                configure=configure, timeout=max(lease, 5.0),
            )
            await self._pool.open()
            try:
                with containing_user_tasks(loop), collector_paced_for_runs():
                    await self._serve_until_stopped(self._pool)
            finally:
                await self._unregister()
                await self._pool.close(timeout=_SHUTDOWN_CALL_TIMEOUT)
        finally:
            if on_main_thread:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
            logger.info("worker %s stopped", self.worker_id)

    async def _schema_ready(self) -> bool:
        """Apply the missing migrations (install_schema) or check there are none; False when
        the worker was stopped meanwhile. The database may not be reachable yet: the worker
        waits for it (see first_connection). An install may wait for the install lock
        (another worker migrating) or for a lock a migration needs (a dashboard's open
        transaction): a stop cancels that wait on the server, so SIGTERM is heard. The
        connection and the check run on daemon threads, given up on at a stop: a database
        that hangs must not keep the worker from exiting either."""
        conn = await connect_when_reachable(self.dsn, self._unless_stopped, self._stopped_within)
        if conn is None:
            return False
        if not self.install_schema:
            checking = on_daemon_thread(check_current, conn, self._calls.schema)
            checking.add_done_callback(lambda _: conn.close())
            return await self._unless_stopped(checking)
        installing = on_daemon_thread(install, conn, self._calls.schema)
        if await self._unless_stopped(installing):
            await asyncio.to_thread(conn.close)
            return True
        logger.info("stopped while installing the schema: cancelling the install")
        with contextlib.suppress(psycopg.Error):
            await asyncio.to_thread(conn.cancel_safe, timeout=_SHUTDOWN_CALL_TIMEOUT)
        # its transaction rolled back; the connection is closed once the install has ended
        # (closing it under the install's thread is not safe), or with the process
        installing.add_done_callback(lambda _: conn.close())
        return False

    async def _unless_stopped(self, call: asyncio.Future[Any]) -> bool:
        """Wait for ``call`` (raising what it raised), unless the worker is stopped first:
        then False, and ``call`` goes on unobserved."""
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({call, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if not call.done():
            call.add_done_callback(_consume_outcome)
            return False
        call.result()
        return True

    async def _stopped_within(self, seconds: float) -> bool:
        """Sleep ``seconds``, or less if the worker is stopped meanwhile: whether it was."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)
        return self._stopping.is_set()

    async def _register(self) -> bool:
        """Enter flowly.workers; False if the worker was stopped first. A failure time may
        mend (the server restarting since the first connection, the table locked by another
        release's migration) is waited for as the first connection is (first_connection);
        any other refusal (a role that may not register) ends the worker."""
        params = (self.worker_id, list(self.workflows), self.queues, self._lease_interval)
        for delay in delays():
            try:
                await self._call(self._calls.register_worker, params)
                return True
            except Exception as exc:
                if not (is_connection_failure(exc) or is_contention(exc)):
                    raise
                logger.warning("could not register worker %s yet (%s); trying again in %.1f s",
                               self.worker_id, one_line(str(exc)), delay)
            if await self._stopped_within(delay):
                return False
        raise AssertionError("delays() never ends")

    async def _unregister(self) -> None:
        """Leave flowly.workers, also after a shutdown that was cut short: a row left behind
        looks like a live worker to dashboards and to poison detection until it expires."""
        try:
            async with asyncio.timeout(_SHUTDOWN_CALL_TIMEOUT):
                await self._call(self._calls.unregister_worker, (self.worker_id,))
        except Exception as exc:  # the worker row expires by itself
            logger.warning("could not unregister worker %s: %s", self.worker_id, exc)

    async def _serve_until_stopped(self, pool: AsyncConnectionPool) -> None:
        """Serve; once asked to stop, give the orderly shutdown (drain, release) its time and
        then end it, whatever the database is doing (an outage must not keep SIGTERM waiting
        on connection attempts)."""
        serving = asyncio.ensure_future(self._serve(pool))
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not serving.done():
                await asyncio.wait({serving}, timeout=self.drain_timeout + _SHUTDOWN_GRACE)
            if not serving.done():
                logger.warning("worker %s: shutdown overran its %.1fs; ending it now",
                               self.worker_id, self.drain_timeout + _SHUTDOWN_GRACE)
                await end_tasks([serving], _SHUTDOWN_CALL_TIMEOUT)
        finally:
            stopping.cancel()
            if not serving.done():  # run() itself was cancelled
                await end_tasks([serving], _SHUTDOWN_CALL_TIMEOUT)
        if serving.done() and not serving.cancelled() and serving.exception() is not None:
            raise serving.exception()  # type: ignore[misc]

    async def _serve(self, pool: AsyncConnectionPool) -> None:
        self._committer = GroupCommitter(pool, self._calls,
                                         timeout=session.call_timeout(self.lease))
        self._committer.start()
        self._transactions = Transactions(
            dsn=self.dsn, calls=self._calls, pool=pool, lease=self.lease,
            max_connections=self.max_connections, threads=self._step_threads)
        background: list[asyncio.Task[None]] = []
        heartbeat: Heartbeat | None = None
        self._due_timer = DueTimer(asyncio.get_running_loop(), self._wake)
        try:
            if not await self._register():
                return
            logger.info("worker %s serving %s on queues %s (concurrency %d)", self.worker_id,
                        ", ".join(self.workflows), ", ".join(self.queues), self.concurrency)
            heartbeat = Heartbeat(
                dsn=self.dsn, calls=self._calls, worker_id=self.worker_id, lease=self.lease,
                loop=asyncio.get_running_loop(),
                held=lambda: [(h.run_id, h.epoch, h) for h in list(self._held.values())],
                on_lost=self._lost, on_kept=_leases_kept,
            )
            heartbeat.start()
            background = [
                asyncio.create_task(self._listen(), name="flowly-listen"),
                asyncio.create_task(self._tell_heartbeat_the_loop_turns(heartbeat),
                                    name="flowly-loop-ticks"),
            ]
            if self.purge_after is not None:
                background.append(asyncio.create_task(self._periodically(
                    _PURGE_EVERY, "purging finished runs",
                    partial(self._purge, purge_age_interval(self.purge_after))),
                    name="flowly-purge"))
            # at least every _SCHEDULE_TICK_MAX, well within the minute after which a fire
            # time counts as missed, whatever the poll interval
            background.append(asyncio.create_task(self._periodically(
                min(self.poll_interval, _SCHEDULE_TICK_MAX), "ticking the cron schedules",
                partial(self._tick_schedules, schedule_calls(self._calls.schema).tick)),
                name="flowly-schedules"))
            # at most once a second: such wake-ups are rare, and a worker polling very often
            # need not ask that often
            background.append(asyncio.create_task(self._periodically(
                max(self.poll_interval, 1.0), "applying missed wake-ups",
                self._apply_missed_wakeups), name="flowly-missed-wakeups"))
            await self._claim_loop()
            await self._drain()
        finally:
            try:
                await self._release_unfinished()
                # a hand-off given back or confirmed after this is not waited for: its short
                # first lease lapses, and any claim takes the run
                await end_tasks([*background, *self._side_calls], _CANCEL_GRACE)
            finally:
                # the threads are told to end before anything else is awaited, so they end
                # even if this shutdown is cut short (it overran while the database hung): a
                # heartbeat left behind would beat on for a worker that is gone
                if heartbeat is not None:
                    heartbeat.stop()
                self._due_timer.close()
                self._step_threads.close()
                closing_transactions = asyncio.ensure_future(
                    asyncio.to_thread(self._transactions.close))
                if heartbeat is not None:
                    await asyncio.to_thread(heartbeat.join, _SHUTDOWN_CALL_TIMEOUT)
                await self._committer.close(_SHUTDOWN_CALL_TIMEOUT)
                await closing_transactions

    # -- claiming ---------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        while not self._stopping.is_set():
            self._wakeup.clear()  # before claiming: a NOTIFY during the claim is not lost
            claim, self._claim_due = self._claim_due or self._runs_may_wait, False
            free = self._room()
            claimed = 0
            # whether runs may be left behind: with no room to claim, or a claim that took as
            # many runs as it had room for, or one that failed (a run that ends claims again)
            runs_may_wait = free <= 0
            if free > 0:
                try:
                    if claim:
                        claimed = await self._claim(free)
                        runs_may_wait = claimed >= free
                    else:
                        await self._offer_slot(free)
                except (psycopg.Error, OSError) as exc:
                    runs_may_wait = True
                    logger.warning("claim failed, retrying in %.1fs: %s", self.poll_interval, exc)
            self._runs_may_wait = runs_may_wait
            if claimed and claimed == free:
                await asyncio.sleep(0)  # let finished runs free their slots, then claim again
                continue
            try:
                async with asyncio.timeout(self.poll_interval):
                    await self._wakeup.wait()
            except TimeoutError:
                self._claim_due = True  # the poll: runs come due by time, leases lapse

    def _wake(self, claim: bool = True) -> None:
        """Wake the claim loop: to claim, or only to offer the next idle slot (a hand-off
        used its slot up, and showed that no run was due ahead of it)."""
        self._claim_due = self._claim_due or claim
        self._wakeup.set()

    def _offering(self) -> bool:
        """Whether the worker offers idle slots now (see handoff.py)."""
        return self._listening and not self._stopping.is_set()

    async def _read_server_clock_if_due(self, offering: bool) -> None:
        if offering and self._server_clock.due(time.monotonic()):
            await self._read_server_clock()

    async def _offer_slot(self, free: int) -> None:
        """Offer an idle slot without claiming, with the room the worker has besides it (of
        ``free`` in all; withdraw the offers when not offering)."""
        offering = self._offering()
        await self._read_server_clock_if_due(offering)
        await self._call(self._calls.offer_slot, (
            self.worker_id, list(self.workflows), self.queues, self._lease_interval,
            self._handoff_channel if offering else None, free - 1))

    async def _claim(self, limit: int) -> int:
        self._claiming = limit
        try:
            offering = self._offering()
            await self._read_server_clock_if_due(offering)
            sent = time.monotonic()
            claiming = asyncio.ensure_future(self._call(
                self._calls.claim_and_offer,
                (self.worker_id, list(self.workflows), self.queues, limit,
                 self._lease_interval, self._handoff_channel if offering else None),
            ))
            try:
                rows = await asyncio.shield(claiming)
            except asyncio.CancelledError:
                await self._hold_what_a_cancelled_claim_took(claiming, sent + self.lease)
                raise
            for row in rows:
                self._begin(ClaimedRun(*row), lease_until=sent + self.lease)
        finally:
            self._claiming = 0
            behind, self._handoffs_behind_claim = self._handoffs_behind_claim, []
            for payload in behind:
                self._take_handoff(payload)
        return len(rows)

    async def _hold_what_a_cancelled_claim_took(
            self, claiming: asyncio.Future[list[Any]], lease_until: float) -> None:
        """The worker was cancelled (``Worker.run()``'s task) while a claim was on its way.
        The claim may have committed: its runs are this worker's, and only their release
        frees them before their lease ends. Its answer is waited for a moment, not for a
        database that hangs; the runs it brings are held, not begun: only the worker's end
        cancels the claim loop, and ``_serve`` then releases every run held."""
        try:
            await asyncio.wait({claiming}, timeout=_CLAIM_ANSWER_GRACE)
        finally:  # also when cancelled again meanwhile
            if not claiming.done():
                claiming.cancel()
                claiming.add_done_callback(_consume_outcome)
        if not claiming.done() or claiming.cancelled() or claiming.exception() is not None:
            return
        for row in claiming.result():
            self._hold(ClaimedRun(*row), lease_until)

    def _hold(self, run: ClaimedRun, lease_until: float) -> _Held:
        """Hold a run just claimed (or handed to us) under its new epoch."""
        stale = self._held.get(run.run_id)
        if stale is not None and stale.task is not None:
            # our own run, whose lease expired while its heartbeats failed (a database
            # outage longer than the lease): the old execution is fenced off, stop it
            logger.warning("run %s taken over from ourselves: cancelling the old execution",
                           run.run_id)
            stale.stop("taken over by a later claim of this worker")
        held = _Held(run.run_id, run.epoch, lease_until=lease_until)
        self._held[run.run_id] = held
        return held

    def _begin(self, run: ClaimedRun, lease_until: float) -> _Held:
        """Hold a run just claimed (or handed to us) and start executing it."""
        held = self._hold(run, lease_until)
        held.task = asyncio.create_task(
            self._execute(held, self.workflows[run.workflow], run),
            name=f"flowly-run-{run.run_id}",
        )
        # a callback, not a finally in _execute: it runs even if the task is cancelled
        # before it starts
        held.task.add_done_callback(partial(self._forget, held))
        return held

    def _take_handoff(self, payload: str) -> None:
        """Begin a run that start handed to this worker (see handoff.py), then claim again:
        that offers the next idle slot, if one is free."""
        handed = parse_handoff(payload)
        if handed is not None and handed.run.run_id in self._released_handoffs:
            handed = None  # released (and so claimable) since it was handed off
        if handed is None:
            self._wake()
        elif self._claiming and self._room() <= 0:
            # whether the claim leaves it room is known when its answer comes
            self._handoffs_behind_claim.append(payload)
        elif not self._accept_handoff(handed):
            # given back: claimable again; begun: its slot offered again, or used up (then
            # only offer the next)
            given_back = self._held.get(handed.run.run_id) is None
            if given_back or handed.slot_used_up:
                self._wake(claim=given_back)

    def _accept_handoff(self, handed: HandOff) -> bool:
        """Begin the run while enough of its first lease is known to be left; confirm it first
        when that cannot be told (read late: another claim may have taken it); give it back
        at once when it cannot run here now. True while a confirmation is under way: it
        claims again once it is done, not meanwhile (the claim would take the run itself)."""
        run = handed.run
        if not self._may_begin(run):
            return False
        lease_end = self._server_clock.local(handed.lease_until)
        if lease_end is None or lease_end - time.monotonic() < handed.lease_seconds / 2:
            self._side_call(self._confirm_handoff(handed))
            return True
        self._begin_handed(run, lease_end)
        return False

    def _begin_handed(self, run: ClaimedRun, lease_until: float) -> None:
        held = self._begin(run, lease_until)
        self._side_call(self._extend_handed_lease(held))

    def _room(self) -> int:
        """How many more runs this worker may begin: its concurrency, less the runs it holds,
        the room a claim in flight counted on (its runs begin when its answer comes: a run
        handed off meanwhile would run beside them), and the sync calls of runs it gave up on
        that still hold a step thread (a hung call of a cancelled run: a run begun in its
        place would wait for a thread for as long, its lease kept, where another worker could
        run it)."""
        return (self.concurrency - len(self._held) - self._claiming
                - self._step_threads.abandoned)

    def _may_begin(self, run: ClaimedRun) -> bool:
        """Whether a run handed to this worker may begin here now; if not, it is given back
        (full, stopping, or a workflow not served) or dropped (a late notification of a run
        claimed again since)."""
        current = self._held.get(run.run_id)
        if current is not None and current.epoch >= run.epoch:
            return False
        if (self._stopping.is_set() or self._room() <= 0
                or run.workflow not in self.workflows):
            self._side_call(self._give_back(run))
            return False
        return True

    def _side_call(self, call: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(call)
        self._side_calls.add(task)
        task.add_done_callback(self._side_calls.discard)
        return task

    async def _read_server_clock(self) -> None:
        """Read the server's clock; a call made while a reading is under way waits for that
        one. Announcements of runs due later that arrive together would each read it, and a
        busy worker's pool would queue those reads ahead of its writes."""
        if self._clock_reading is None:
            self._clock_reading = self._side_call(self._take_clock_reading())
            self._clock_reading.add_done_callback(self._clock_read)
        await asyncio.shield(self._clock_reading)

    def _clock_read(self, _: asyncio.Task[None]) -> None:
        self._clock_reading = None

    async def _take_clock_reading(self) -> None:
        sent = time.monotonic()
        try:
            (server_epoch,) = await self._call_one(self._calls.server_clock, ())
        except (psycopg.Error, OSError) as exc:  # runs handed off meanwhile are confirmed
            # the claim that follows fails too, and says so
            logger.debug("could not read the database server's clock: %s", exc)
            return
        self._server_clock.record(sent, server_epoch, time.monotonic())

    async def _claim_when_due(self, due: datetime | None) -> None:
        """Claim again when a run this worker just released (to sleep, to back off, to wait
        with a timeout) comes due at ``due`` on the server's clock: then, not at the next
        poll (see due_timer)."""
        if due is not None:
            await self._claim_at(due.timestamp())

    async def _claim_at(self, server_epoch: float) -> None:
        """Claim once the server's clock shows ``server_epoch`` (at once if it does)."""
        if self._due_timer is None:
            return
        when = self._server_clock.local_after(server_epoch)
        if when is None:
            await self._read_server_clock()
            when = self._server_clock.local_after(server_epoch)
        if when is not None:
            self._due_timer.at(when)

    async def _confirm_handoff(self, handed: HandOff) -> None:
        """Renew the first lease of a run handed to this worker before beginning it: that
        lease may have lapsed and the run been claimed by another worker since. Renewed for
        as long as a first lease, not a whole one: a worker that stops meanwhile leaves the
        run to any claim within seconds, as for any hand-off."""
        run = handed.run
        sent = time.monotonic()
        try:
            rows = await self._heartbeat_one(run.run_id, run.epoch, handed.lease_seconds)
        except Exception as exc:  # its lease lapses, and any claim takes it
            logger.warning("could not confirm run %s handed to us late: %s", run.run_id, exc)
            return
        finally:
            self._wake()
        if rows:
            why = ("its row is locked by another transaction (a claim takes it once its lease"
                   " lapses)" if rows[0][1] == "busy" else "it was claimed again since")
            logger.warning("run %s was handed to us too late to run: %s", run.run_id, why)
        elif self._may_begin(run):
            logger.info("run %s handed to us late: lease confirmed, running it", run.run_id)
            self._begin_handed(run, sent + handed.lease_seconds)

    async def _extend_handed_lease(self, held: _Held) -> None:
        """Extend a handed-off run's short first lease to a whole one, if the run still runs
        here once half of that lease is left: most runs end sooner, and need no call. A
        heartbeat of it, tried again at short pauses while the run's row is busy (an
        operator's transaction may hold it) or the call fails. The periodic beat may come
        only a third of a whole lease later, after a first lease has lapsed: a run still
        unextended shortly before its first lease ends is stopped here, as a lost one, since
        any claim may take it from then on."""
        pause = _EXTEND_RETRY_FIRST
        first_lease_end = held.lease_until
        await asyncio.sleep((first_lease_end - time.monotonic()) / 2)
        while self._held.get(held.run_id) is held and held.lease_until <= first_lease_end:
            sent = time.monotonic()
            try:
                rows = await self._heartbeat_one(held.run_id, held.epoch, self.lease)
            except Exception as exc:
                logger.warning("could not extend the lease of run %s handed to us: %s",
                               held.run_id, exc)
            else:
                lost, kept = settle([(held.run_id, held.epoch, held)], rows)
                for token in lost:
                    self._lost(token)
                _leases_kept(kept, sent + self.lease)
                if lost or kept:
                    return
            if time.monotonic() + pause > first_lease_end - _FIRST_LEASE_MARGIN:
                logger.warning("run %s handed to us: its first lease ends before it could be"
                               " extended (its row busy, or the database not answering)",
                               held.run_id)
                self._lost(held)
                return
            await asyncio.sleep(pause)
            pause = min(pause * 2, _EXTEND_RETRY_MAX)

    async def _heartbeat_one(self, run_id: str, epoch: int, lease: float) -> list[Any]:
        """Extend one run's lease: no rows if it did; else whether it was lost or busy."""
        return await self._call(self._calls.heartbeat, (
            self.worker_id, [run_id], [epoch], seconds_interval(lease)))

    async def _give_back(self, run: ClaimedRun) -> None:
        try:
            await self._call(self._calls.release, ([run.run_id], [run.epoch]))
        except Exception as exc:  # its short lease expires, and any claim takes it
            logger.warning("could not give back run %s handed to us: %s", run.run_id, exc)

    def _forget(self, held: _Held, _task: asyncio.Task[None]) -> None:
        """Drop a finished run from the held set, unless it was claimed again meanwhile; claim
        again when its slot may find a run: one the last claim had no room for, or this run
        itself (released to sleep, failed for a retry, lost). A run that completed while the
        worker had room to spare leaves nothing to claim: a run started since came by its
        own notification."""
        if self._held.get(held.run_id) is held:
            del self._held[held.run_id]
        if self._runs_may_wait or not held.completed:
            self._wake()

    async def _listen(self) -> None:
        """Wake the claim loop on NOTIFY; reconnect after a dropped or hung connection."""
        backoff = 0.1
        probing: asyncio.Task[None] | None = None
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                        self.dsn, **session.connection_kwargs(self.lease)) as conn:
                    ping_every = await within(max(self.lease, 2.0),
                                              self._start_listening(conn))
                    await self._release_missed_handoffs()
                    self._side_call(self._time_claims_missed_meanwhile())
                    backoff = 0.1
                    self._wake()  # catch up on anything started while we were away
                    # slots are offered once a notification is seen to reach this listener;
                    # sent from a task, so a database that hangs holds up no ping
                    probe, warned = ListenerProbe(), False
                    probing = asyncio.create_task(self._send_probe(probe))
                    while True:
                        wait = ping_every if self._listening else min(ping_every, _PROBE_WAIT)
                        async for notification in conn.notifies(timeout=wait):
                            await self._on_notification(notification, probe)
                        # every lease, the connection must answer (in a couple of seconds
                        # at least, a busy server is no hung one): a hung backend or pooler
                        # acknowledges the bytes, so no TCP timeout would tell it is gone;
                        # more often where the server ends sessions idle for less
                        await within(max(self.lease, 2.0), conn.execute("select 1"))
                        if not self._listening:
                            if not warned:
                                warned = True
                                logger.warning(
                                    "a notification sent to this worker did not reach its"
                                    " listener within %.1f s (a pooler in transaction mode in"
                                    " between? workers need a session: see the README,"
                                    " 'Connection poolers'); it takes no runs handed off until"
                                    " one does, and finds new runs by polling every %.1f s",
                                    wait, self.poll_interval)
                            if probing.done():
                                probing = asyncio.create_task(self._send_probe(probe))
            except (psycopg.Error, OSError) as exc:
                logger.warning("wake-up listener lost (%s); polling every %.1fs until it is back",
                               exc, self.poll_interval)
            finally:
                if probing is not None:
                    probing.cancel()
                    probing = None
                self._listening = False
                self._wake()  # a claim now withdraws the offer of an idle slot
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _on_notification(self, notification: psycopg.Notify,
                               probe: ListenerProbe) -> None:
        """A wake-up, this listener's probe (slots may be offered now), or a hand-off."""
        if notification.channel != self._handoff_channel:
            announced = announced_due(notification.payload)
            if announced is None:
                self._wake()
            elif announced[0] in self.queues:  # a run due later (0069): claim it then
                self._side_call(self._claim_at(announced[1]))
        elif ListenerProbe.is_probe(notification.payload):
            if notification.payload == probe.payload and not self._listening:
                self._listening = True
                self._wake()  # a claim now offers the idle slots
        else:
            self._take_handoff(notification.payload)
            # the run's task goes first, up to its first step begun: before the listener
            # sets its next read up, not after
            await asyncio.sleep(0)

    async def _send_probe(self, probe: ListenerProbe) -> None:
        """NOTIFY this worker's hand-off channel from a pooled session; one that fails only
        leaves the slots unoffered until the next probe gets through."""
        try:
            await self._call(self._calls.notify, (self._handoff_channel, probe.payload))
        except Exception as exc:
            logger.warning("could not send this worker's listener its probe: %s", exc)

    async def _start_listening(self, conn: psycopg.AsyncConnection[Any]) -> float:
        """LISTEN for wake-ups and for the runs handed to this worker, and record the
        listening backend: other workers end it if this worker freezes (0062). Returns how
        often the listener must show it is alive: every lease, and twice as often as the
        server's ``idle_session_timeout`` where that is shorter (a listener is idle between
        notifications, and the server would end it, over and over)."""
        await session.configure_async(conn, self.lease)  # its record_listener writes
        wakeup = await (await conn.execute(self._calls.wakeup_channel)).fetchone()
        assert wakeup is not None
        for channel in (wakeup[0], self._handoff_channel):
            await conn.execute(listen_to(channel))
        row = await (await conn.execute(self._calls.idle_session_timeout)).fetchone()
        idle_timeout = float(row[0]) if row is not None and row[0] else 0.0
        await conn.execute(self._calls.record_listener, (self.worker_id,))
        return min(self.lease, idle_timeout / 2) if idle_timeout > 0 else self.lease

    async def _release_missed_handoffs(self) -> None:
        """Release the runs handed to this worker that it does not hold: handed off while it
        was not listening, their notification reached nobody (0054). Released, the claim that
        the new listener wakes takes them at once, not once their first lease has lapsed.
        Called once the listener listens, before it reads a notification."""
        try:
            rows = await self._call(self._calls.release_missed_handoffs,
                                    (self.worker_id, list(self._held)))
        except Exception as exc:  # they start once their first lease lapses, as before
            logger.warning("could not release the runs handed to this worker while it was"
                           " not listening: %s", exc)
            return
        self._released_handoffs = {row[0] for row in rows}
        if self._released_handoffs:
            logger.info("released %d run(s) handed to this worker while it was not listening",
                        len(self._released_handoffs))

    async def _time_claims_missed_meanwhile(self) -> None:
        """Time a claim for each run that comes due within the hour: announced while this
        worker did not listen, it was announced to nobody here (0077). Those due further
        ahead are the poll's, as ever."""
        try:
            rows = await self._call(self._calls.due_within_the_hour,
                                    (list(self.workflows), self.queues))
        except Exception as exc:  # they are claimed at the poll, as before
            logger.warning("could not read when the runs announced while this worker was not"
                           " listening come due: %s", exc)
            return
        for (due,) in rows:
            await self._claim_at(due.timestamp())

    # -- leases -----------------------------------------------------------------------------

    def _lost(self, held: _Held) -> None:
        """A heartbeat found the run's lease lost: stop executing it here."""
        # the run may have been released and claimed again, with a new epoch, while that
        # heartbeat was in flight: only the execution it was sent for is lost
        if self._held.get(held.run_id) is held and held.task is not None:
            logger.warning("lease lost on run %s: cancelling it here", held.run_id)
            held.stop("its lease was lost (a heartbeat found it cancelled or taken over)")

    async def _tell_heartbeat_the_loop_turns(self, heartbeat: Heartbeat) -> None:
        while True:
            heartbeat.loop_turned()
            await asyncio.sleep(min(0.5, self.lease / 6))

    @staticmethod
    async def _periodically(every: float, what: str,
                            one_round: Callable[[], Awaitable[None]]) -> None:
        """Run ``one_round`` every ``every`` seconds until cancelled; a round that fails is
        logged, and the next may get through."""
        while True:
            try:
                await one_round()
            except Exception as exc:
                logger.warning("%s failed: %s", what, exc)
            await asyncio.sleep(every)

    async def _purge(self, older_than: str) -> None:
        """Delete old finished runs, a batch at a time until none is left: each statement
        stays short, and a backlog (a worker finishes thousands of runs a second) is worked
        off in one round rather than a few batches a minute."""
        purged = 0
        while True:
            (deleted,), = await self._call(
                self._calls.purge,
                (older_than, ["completed", "cancelled", "dead_letter"], _PURGE_BATCH))
            purged += deleted
            # a short batch may only mean that a table of the application references some
            # of its runs (purge keeps those): nothing is left once a batch deletes none
            if deleted == 0:
                break
        if purged:
            logger.info("purged %d finished run(s) older than %s", purged, older_than)

    async def _tick_schedules(self, tick: psycopg.sql.SQL) -> None:
        """Start the runs of due cron schedules (``tick``, ScheduleCalls'). Any worker may:
        tick_schedules takes each schedule with skip locked and names each run after its fire
        time, so workers ticking at once never start a fire time twice.

        A tick handles a batch of schedules: while one comes back full and not all failed
        (those that failed are taken last), more may be due, and they must fire within the
        minute after which a fire time counts as missed, so the worker ticks again at once.
        """
        while True:
            handled, failed = set(), set()
            for name, fire_at, _run_id, outcome in await self._call(tick, None):
                handled.add(name)
                if outcome == "error":
                    failed.add(name)
                logger.log(logging.WARNING if outcome == "error" else logging.INFO,
                           "schedule %s, fire time %s: %s", name, fire_at, outcome)
            if len(handled) < TICK_BATCH or failed == handled:
                return

    async def _apply_missed_wakeups(self) -> None:
        """Make due the parked runs whose wake-up found their row locked by another
        transaction (wake_missed_waiters). Any worker may: each wake-up is taken with skip
        locked."""
        (settled,), = await self._call(self._calls.wake_missed_waiters, None)
        if settled:
            logger.info("applied %d wake-up(s) that had found their run busy", settled)

    async def _drain(self) -> None:
        tasks = [h.task for h in self._held.values() if h.task is not None]
        if tasks:
            logger.info("draining %d run(s) for up to %.1fs", len(tasks), self.drain_timeout)
            await asyncio.wait(tasks, timeout=self.drain_timeout)

    async def _release_unfinished(self) -> None:
        """Cancel the runs still in flight and release them for other workers."""
        unfinished = list(self._held.values())
        if not unfinished:
            return
        for held in unfinished:
            held.stop("the worker is stopping")
            if held.task is None:  # held, never begun: a claim answered as the worker ended
                del self._held[held.run_id]
        tasks = [h.task for h in unfinished if h.task is not None]
        if tasks:
            # a step that ignores its cancellation must not hold the shutdown up: the release
            # bumps the epoch, so nothing it writes afterwards can land
            await asyncio.wait(tasks, timeout=_CANCEL_GRACE)
            # a sync transactional function runs on in its thread, its transaction holding
            # the run's row: its statement is cancelled so the row is free to release
            await asyncio.to_thread(self._transactions.stop_sync_transactions, _CANCEL_GRACE)
        try:
            async with asyncio.timeout(_SHUTDOWN_CALL_TIMEOUT):
                (released,), = await self._call(self._calls.release, (
                    [h.run_id for h in unfinished], [h.epoch for h in unfinished]))
        except Exception as exc:
            logger.warning("could not release %d run(s); other workers take them when their"
                           " leases expire: %s", len(unfinished), exc)
            return
        logger.info("released %d of the %d run(s) in flight for other workers (the others"
                    " finished meanwhile, or their rows were busy: those go when their leases"
                    " expire)", released, len(unfinished))

    # -- executing --------------------------------------------------------------------------

    async def _execute(self, held: _Held, workflow: Workflow, run: ClaimedRun) -> None:
        store = _RunStore(self, held)
        try:
            input = await self._read_input(held) if run.input_deferred else run.input
            # only a retried generation can have steps a compensation undid
            undone = dict(await run_write(held.run_id, partial(
                self._call, self._calls.undone_steps, (held.run_id,)))
            ) if run.generation > 1 else {}
            ctx = Context(
                run_id=held.run_id,
                workflow=workflow.name,
                attempt=run.attempt,
                generation=run.generation,
                store=store,
                history=ReplayLog(store.read_page if run.has_history else None),
                compensating=run.status == "compensating",
                default_retry=self.default_retry,
                max_output_bytes=self.max_output_bytes,
                undone=undone,
            )
            if await self._run_body(held, workflow, ctx, input) == "compensate":
                await self._compensate(held, ctx)
        except (LeaseLost, LeaseLostInterrupt) as exc:
            logger.warning("run %s dropped: %s", held.run_id, exc)
        except RunAbandoned as exc:
            logger.warning("run %s abandoned until its lease expires: %s", held.run_id,
                           exc.__cause__)
        except asyncio.CancelledError:
            logger.info("run %s cancelled in this worker", held.run_id)
        except Exception:  # the database went away mid-run: the lease expires, another takes it
            logger.exception("run %s interrupted by an internal error", held.run_id)

    async def _read_input(self, held: _Held) -> Any:
        """The input of a run whose claim left it out (too large to come with the claim), read
        under the run's lease."""
        async def read() -> Any:
            rows = await self._call(self._calls.claimed_input, (held.run_id, held.epoch))
            if not rows:
                raise LeaseLost(f"run {held.run_id} was claimed again before it read its input")
            return rows[0][0]

        return await run_write(held.run_id, read)

    async def _run_body(self, held: _Held, workflow: Workflow, ctx: Context, input: Any) -> str:
        """Run the workflow body; returns 'compensate' when the saga must run, else 'done'.

        Only failures of the body itself (or an output that is not JSON, or that the database
        refuses) go to ``fail_run``; a lost lease or connection propagates to
        :meth:`_execute` as an interrupt. A body that returns although a call interrupted it
        (it caught the interrupt: a bare ``except:``, ``gather(..., return_exceptions=True)``)
        is interrupted all the same; one that fails instead has failed (a retry of the run
        replays up to the interrupt again).
        """
        try:
            try:
                result = await _call_body(workflow, ctx, input)
            finally:
                ctx.end()
            await ctx.settled()  # parallel steps the body left behind land first
            ctx.raise_if_interrupted()
            unawaited = ctx.unawaited()
            if unawaited:
                raise WorkflowCodeError(
                    f"workflow {workflow.name!r} returned without awaiting its"
                    f" {', '.join(unawaited)}: write `await ctx.step(...)`")
            payload = serialise_output(result, f"workflow {workflow.name!r}",
                                       self.max_output_bytes)
        except CompensateInterrupt as interrupt:
            await ctx.settled()  # siblings that were still finishing join the saga
            return interrupt.decision
        except (LeaseLostInterrupt, RunAbandoned):
            raise
        except WaitInterrupt:
            # every wait of a fan-in registered, every step landed; a step beside the wait
            # that failed decided instead, and the run is not parked
            if (decided := await _settled_decision(ctx)) is not None:
                return decided
            (timeout_at,), = await run_write(held.run_id, partial(
                self._call, self._calls.park, (held.run_id, held.epoch, ctx.waiting)))
            await self._claim_when_due(timeout_at)
            return "done"
        except SleepInterrupt:
            # steps running beside the sleep land before the release; one that failed decides
            if (decided := await _settled_decision(ctx)) is not None:
                return decided
            assert ctx.sleeping is not None
            name, wake_at, position = ctx.sleeping
            (stored_wake_at, released), = await run_write(held.run_id, partial(
                self._call, self._calls.sleep,
                (held.run_id, held.epoch, name, wake_at, None, position, True)))
            if released:
                await self._claim_when_due(stored_wake_at)
            else:  # its wake time passed meanwhile: a replay goes on at once
                await run_write(held.run_id, partial(
                    self._call, self._calls.release, ([held.run_id], [held.epoch])))
            return "done"
        except Interrupt:
            return "done"
        except BaseException as exc:  # the body itself failed: the database decides what next
            if _stopped_here(held, exc):
                raise
            if (decided := await _settled_decision(ctx)) is not None:
                return decided  # a step that failed meanwhile decided first
            return await self._fail_run(held, exc, not isinstance(exc, NOT_RETRYABLE))
        try:
            await run_write(held.run_id,
                            partial(self._committer.complete, held.run_id, held.epoch, payload))
        except RefusedWrite as refused:
            # the database refused the output itself (an operator's constraint, a number
            # jsonb cannot hold): every attempt would meet the same refusal
            return await self._fail_run(held, refused.__cause__ or refused, False)
        held.completed = True
        return "done"

    async def _fail_run(self, held: _Held, exc: BaseException, retryable: bool) -> str:
        """Store the body's failure; returns what the database decided for the run."""
        logger.info("run %s failed outside a step%s: %r", held.run_id,
                    "" if retryable else " (not retryable)", exc)
        row = await run_write(held.run_id, partial(
            self._call_one, self._calls.fail_run,
            (held.run_id, held.epoch, Jsonb(error_info(exc)), retryable)))
        if row[0] == "retry":
            await self._claim_when_due(row[1])
        return str(row[0])

    async def _compensate(self, held: _Held, ctx: Context) -> None:
        """Run the compensations of completed steps, last reached first (body order, which a
        retried generation keeps), storing each outcome."""
        recorded = await ctx.history.read_all()
        pending = sorted(
            (
                (name, step) for name, step in recorded.items()
                if isinstance(step, StoredStep) and step.status == "completed"
                and step.compensable and step.compensation_status is None
            ),
            key=lambda item: (item[1].position or 0, item[1].seq),
            reverse=True,
        )
        store = _RunStore(self, held)
        for name, step in pending:
            fn = ctx.compensations.get(name)
            error: dict[str, Any] | None = None
            if fn is None:
                error = {"type": "CompensationUnavailable",
                         "message": f"the workflow did not reach step {name!r} on replay, so its"
                                    " compensation is unknown"}
            else:
                store.check_lease()
                try:
                    if step.kind == "transaction":  # its success is recorded in its transaction
                        await run_write(held.run_id, partial(
                            self._transactions.compensate, held.run_id, held.epoch, name, fn,
                            step.output), refused_raises=True)
                        continue
                    await call_user_function(store, fn, step.output)
                except (LeaseLostInterrupt, RunAbandoned):
                    raise
                except BaseException as exc:  # one failing compensation must not stop the rest
                    if _stopped_here(held, exc):
                        raise
                    error = error_info(exc)
                    logger.warning("compensation of step %r in run %s failed: %s",
                                   name, held.run_id, exc)
            await run_write(held.run_id, partial(
                self._call, self._calls.record_compensation,
                (held.run_id, held.epoch, name, None if error is None else Jsonb(error))))
        ok = await run_write(held.run_id, partial(
            self._call_one, self._calls.finish_compensation, (held.run_id, held.epoch)))
        logger.info("run %s dead-lettered after compensation (all succeeded: %s)",
                    held.run_id, ok[0])

    # -- database ---------------------------------------------------------------------------

    async def _call(self, query: Any, params: Any) -> list[Any]:
        """One engine call on a pooled connection. A call that does not answer within
        ``call_timeout`` (the server bounds statements itself; this also bounds a connection
        or a client that hangs) raises TimeoutError, an OSError: the run is abandoned, and the
        connection, returned mid-call, is discarded by the pool."""
        assert self._pool is not None
        return await within(session.call_timeout(self.lease),
                            self._call_now(self._pool, query, params))

    async def _call_now(self, pool: AsyncConnectionPool, query: Any, params: Any) -> list[Any]:
        async with pool.connection() as conn:
            with translated_errors(self._calls.schema):
                cursor = await conn.execute(query, params)
                return await cursor.fetchall() if cursor.description else []

    async def _call_one(self, query: Any, params: Any) -> Any:
        rows = await self._call(query, params)
        return rows[0]


def _stopped_here(held: _Held, exc: BaseException) -> bool:
    """Whether ``exc`` is this worker stopping the run's execution (Held.stop). A cancellation
    of the running task that user code asked for (a step's or a compensation's
    ``current_task().cancel()``) is withdrawn instead, so that it fails what asked for it:
    taken for a stop, it left the run to its lease, to be claimed again and cancel itself
    again, for ever, never counted as an attempt."""
    if not cancel_requested(exc):
        return False
    if held.stopped is not None:
        return True
    task = asyncio.current_task()
    while task is not None and task.uncancel() > 0:
        pass
    return False


async def _settled_decision(ctx: Context) -> str | None:
    """Once the run's steps in flight have landed: what ``_run_body`` returns if a failed step
    decided the run's fate meanwhile ("done" after a retry, which released the run, so nothing
    more is written under this lease; else the saga's decision), or None if none did."""
    await ctx.settled()
    if ctx.decided is None:
        return None
    return "done" if ctx.decided == "retry" else ctx.decided


def _leases_kept(held: list[_Held], until: float) -> None:
    """A heartbeat extended these leases (called on its thread: a float is set at once)."""
    for run in held:
        run.lease_until = max(run.lease_until, until)


def _consume_outcome(call: asyncio.Future[Any]) -> None:
    """Retrieve the outcome of a call nobody waits for any more (asyncio logs one never
    retrieved)."""
    if not call.cancelled():
        call.exception()


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the calling thread runs ``loop`` (asyncio's objects are not thread-safe)."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


async def _call_body(workflow: Workflow, ctx: Context, input: Any) -> Any:
    """Call the workflow body; a body that does not take ``(ctx, input)`` is a code error."""
    if workflow.signature_error is not None:
        raise WorkflowCodeError(
            f"workflow {workflow.name!r} must take (ctx, input): {workflow.signature_error}")
    enter_body()
    with user_code():
        return await workflow.fn(ctx, input)
