"""Threads for synchronous step functions.

A sync step runs on a daemon thread of its own, at most ``limit`` at once. Daemon, because a
step that never returns must not keep the worker process alive after the worker has stopped
and released its runs: a ``ThreadPoolExecutor`` joins its threads at interpreter exit, so one
hung ``requests.get`` without a timeout would keep a SIGTERMed worker from ever exiting.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


class StepThreads:
    """Runs blocking callables off the event loop, ``limit`` at a time."""

    def __init__(self, limit: int) -> None:
        self._slots = asyncio.Semaphore(limit)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call ``fn(*args)`` on a daemon thread and return (or raise) what it does.

        If the awaiting task is cancelled, the thread runs on unobserved (Python cannot stop a
        thread) and its slot is freed, so a hung step cannot starve the other runs.
        """
        async with self._slots:
            loop = asyncio.get_running_loop()
            outcome: asyncio.Future[Any] = loop.create_future()

            def deliver(settle: Callable[[Any], None], value: Any) -> None:
                if not outcome.done():  # the run may have been cancelled meanwhile
                    settle(value)

            def target() -> None:
                try:
                    result = fn(*args)
                except BaseException as exc:  # handed to the step, which decides what it means
                    error: BaseException = exc
                    if isinstance(exc, StopIteration):  # a future refuses it, as PEP 479 does
                        error = RuntimeError(f"step function raised StopIteration: {exc!r}")
                        error.__cause__ = exc
                    settle, value = outcome.set_exception, error
                else:
                    settle, value = outcome.set_result, result
                try:
                    loop.call_soon_threadsafe(deliver, settle, value)
                except RuntimeError:  # the loop is closed: the worker stopped without waiting
                    pass

            threading.Thread(target=target, name="flowly-step", daemon=True).start()
            return await outcome
