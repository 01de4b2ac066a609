"""Database calls that end in bounded time, even when the server does not answer.

psycopg answers the cancellation of a task in the middle of a query by asking the server to
cancel the query and then waiting for it: up to 5 s to deliver the request, 5 s more for the
query to end. A server that hangs (or a network that drops packets) thus turns a timeout or a
shutdown into a wait of up to 10 s. A second cancellation makes psycopg close the connection
at once instead; end_tasks and within give the server a moment to confirm the first, then send
it. A call that waits in a thread, where nothing can cancel it, is bounded by a Cutoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import psycopg

logger = logging.getLogger(__name__)

T = TypeVar("T")
_Conn = psycopg.Connection[Any] | psycopg.AsyncConnection[Any]

# how long a cancelled call gets to end by itself (a live server confirms a cancel in
# milliseconds) before its connection is closed under it
CONFIRM_CANCEL = 1.0


async def end_tasks(tasks: Iterable[asyncio.Future[Any]], timeout: float) -> None:
    """Cancel ``tasks`` and wait until they end, for at most ``timeout`` seconds in all: those
    still running after :data:`CONFIRM_CANCEL` (or half the timeout), or when the caller is
    cancelled meanwhile, are cancelled again."""
    running = [task for task in tasks if not task.done()]
    if not running:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    for task in running:
        task.cancel()
    try:
        _, running_on = await asyncio.wait(running, timeout=min(CONFIRM_CANCEL, timeout / 2))
    finally:
        for task in running:
            if not task.done():
                task.cancel()
    if running_on:
        await asyncio.wait(running_on, timeout=max(0.0, deadline - loop.time()))


async def within(timeout: float | None, call: Awaitable[T]) -> T:
    """Await ``call``; after ``timeout`` seconds (None: no limit) end it (:func:`end_tasks`)
    and raise TimeoutError. A cancellation of the caller ends the call the same way, and is
    never lost (on Python 3.11 ``asyncio.wait_for`` returned the result of a call that
    finished as its caller was cancelled)."""
    task = asyncio.ensure_future(call)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.add_done_callback(_read_outcome)
        await end_tasks([task], CONFIRM_CANCEL * 2)
        raise
    if not done:
        task.add_done_callback(_read_outcome)
        await end_tasks([task], CONFIRM_CANCEL * 2)
        raise TimeoutError(f"no answer within {timeout:g}s")
    return task.result()


def _read_outcome(task: asyncio.Future[Any]) -> None:
    """What a call given up on raised as it ended (its connection closed under it, say) is
    moot: its caller was cancelled or told it timed out. Read, so that asyncio does not log it
    as an error nobody retrieved."""
    if not task.cancelled():
        task.exception()


class _Watchdog:
    """One daemon thread that cuts connections off at their deadlines, for every Cutoff of the
    process: a thread started per call cost more than many a call it bounded (0.2 ms of a
    0.6 ms ``Client.start``).

    Deadlines sit in a heap; a disarmed one is only marked dead (its entry loses its
    Cutoff) and dropped when it comes up, or when dead entries outnumber live ones.
    """

    def __init__(self) -> None:
        self._wake = threading.Condition(threading.Lock())
        self._heap: list[list[Any]] = []  # [deadline, sequence, Cutoff or None]
        self._live = 0
        self._sequence = 0
        self._thread: threading.Thread | None = None

    def add(self, deadline: float, cutoff: Cutoff) -> list[Any]:
        with self._wake:
            self._sequence += 1
            entry = [deadline, self._sequence, cutoff]
            heapq.heappush(self._heap, entry)
            self._live += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="flowly-cutoff", daemon=True)
                self._thread.start()
            elif self._heap[0] is entry:
                self._wake.notify()
            return entry

    def remove(self, entry: list[Any]) -> None:
        with self._wake:
            if entry[2] is not None:
                entry[2] = None
                self._live -= 1
                if len(self._heap) > 2 * self._live + 64:
                    self._heap = [e for e in self._heap if e[2] is not None]
                    heapq.heapify(self._heap)

    def after_fork(self) -> None:
        """In a forked child: the thread did not come along, nor did the calls it bounded."""
        self._wake = threading.Condition(threading.Lock())
        self._heap, self._live, self._thread = [], 0, None

    def _watch(self) -> None:
        while True:
            with self._wake:
                due = self._due()
                if due is None:
                    # a lock's wait takes at most TIMEOUT_MAX (about 292 years); a deadline
                    # may lie further ahead (a Client.wait of 1e300 s), and is waited for in
                    # turns (a longer wait killed this thread, and no call was cut off after)
                    pause = (min(self._heap[0][0] - time.monotonic(), threading.TIMEOUT_MAX)
                             if self._heap else None)
                    self._wake.wait(pause)
                    continue
            try:
                due._expire()
            except Exception:  # the thread bounds every call of the process: it goes on
                logger.exception("cutting a connection off failed")

    def _due(self) -> Cutoff | None:
        """The Cutoff of the first deadline passed, taken off the heap; dead entries go too."""
        now = time.monotonic()
        while self._heap and (self._heap[0][2] is None or self._heap[0][0] <= now):
            entry = heapq.heappop(self._heap)
            cutoff: Cutoff | None = entry[2]
            if cutoff is not None:
                entry[2] = None
                self._live -= 1
                return cutoff
        return None


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=_WATCHDOG.after_fork)


class Cutoff:
    """Shuts a connection's socket down when a call on it outlasts its time.

    libpq has no client-side timeout, and a server, pooler or path that hangs while its
    kernel still acknowledges the bytes never answers: neither TCP keepalives nor
    ``tcp_user_timeout`` notice. With the socket shut down the call fails as on a lost
    connection, and the connection is discarded. Armed around flowly's own statements,
    disarmed around user code (whose SQL may run long); the connection must not be closed
    while armed (its descriptor could be reused).
    """

    def __init__(self, conn: _Conn | Callable[[], Iterable[_Conn | None]]) -> None:
        """``conn``: the connection, or a function giving those to cut off when it is time."""
        self._conns = conn if callable(conn) else lambda: (conn,)
        self._lock = threading.Lock()
        self._deadline: list[Any] | None = None  # the watchdog's entry while armed
        self._cut_off = False

    def __enter__(self) -> Cutoff:
        return self

    def __exit__(self, *_: object) -> None:
        self.disarm()

    def arm(self, seconds: float) -> None:
        """Cut the connection off ``seconds`` from now, unless disarmed first."""
        with self._lock:
            if self._deadline is not None:
                _WATCHDOG.remove(self._deadline)
            self._cut_off = False
            self._deadline = _WATCHDOG.add(time.monotonic() + seconds, self)

    def disarm(self) -> None:
        with self._lock:
            if self._deadline is not None:
                _WATCHDOG.remove(self._deadline)
                self._deadline = None

    def cut_if_armed(self) -> None:
        """Cut the connection off now if a call on it is under way (a stop that must not
        wait for it)."""
        with self._lock:
            if self._deadline is not None:
                _WATCHDOG.remove(self._deadline)
                self._deadline = None
                self._cut()

    def _expire(self) -> None:
        """Called by the watchdog once the deadline passed (unless disarmed or armed again
        since: then it has no entry, or another one)."""
        with self._lock:
            if self._deadline is not None and self._deadline[2] is None:
                self._deadline = None
                self._cut()

    @property
    def expired(self) -> bool:
        """Whether the connections were cut off (since armed)."""
        return self._cut_off

    def _cut(self) -> None:
        self._cut_off = True
        for conn in self._conns():
            if conn is not None:
                shut_down(conn)


def shut_down(conn: _Conn) -> None:
    """Shut ``conn``'s socket down: a call on it (in another thread, say) fails at once as on
    a lost connection, and the connection is left for its user to close (closing it under
    that call could hand its descriptor to another socket)."""
    if conn.closed:
        return
    with contextlib.suppress(OSError, psycopg.Error):
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()


def on_daemon_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """Call ``fn(*args)`` on a daemon thread of its own: a blocking call that may never return
    (a connection to a database that hangs) and that the caller may stop waiting for, without
    the thread keeping the process alive (``asyncio.to_thread``'s would, at exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def call() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=call, name="flowly-blocking-call", daemon=True).start()
    return future
