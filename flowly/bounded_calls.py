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
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import psycopg

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
        await end_tasks([task], CONFIRM_CANCEL * 2)
        raise
    if not done:
        await end_tasks([task], CONFIRM_CANCEL * 2)
        raise TimeoutError(f"no answer within {timeout:g}s")
    return task.result()


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
        self._timer: threading.Timer | None = None
        self._cut_off = False

    def __enter__(self) -> Cutoff:
        return self

    def __exit__(self, *_: object) -> None:
        self.disarm()

    def arm(self, seconds: float) -> None:
        """Cut the connection off ``seconds`` from now, unless disarmed first."""
        timer = threading.Timer(seconds, self._expire)
        timer.daemon = True
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = timer
            self._cut_off = False
        timer.start()

    def disarm(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def cut_if_armed(self) -> None:
        """Cut the connection off now if a call on it is under way (a stop that must not
        wait for it)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
                self._cut()

    def _expire(self) -> None:
        with self._lock:
            if self._timer is not None and self._timer is threading.current_thread():
                self._timer = None
                self._cut()

    @property
    def expired(self) -> bool:
        """Whether the connections were cut off (since armed)."""
        return self._cut_off

    def _cut(self) -> None:
        self._cut_off = True
        for conn in self._conns():
            if conn is not None and not conn.closed:
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
