"""Database calls that end in bounded time, even when the server does not answer.

psycopg answers the cancellation of a task in the middle of a query by asking the server to
cancel the query and then waiting for it: up to 5 s to deliver the request, 5 s more for the
query to end. A server that hangs (or a network that drops packets) thus turns a timeout or a
shutdown into a wait of up to 10 s. A second cancellation makes psycopg close the connection
at once instead; these helpers give the server a moment to confirm the first, then send it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

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
