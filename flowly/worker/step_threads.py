"""Threads for synchronous step functions.

Sync steps run on a pool of reused daemon threads, at most ``limit`` at once. Reused, because
starting an OS thread per call costs more than a short step itself. Daemon, because a step
that never returns must not keep the worker process alive after the worker has stopped and
released its runs (a ``ThreadPoolExecutor`` joins its threads at interpreter exit, so one hung
``requests.get`` without a timeout would keep a SIGTERMed worker from ever exiting).

A slot is held until the thread is really done with the call, not merely until the awaiting
run gave up on it: a run cancelled (or taken over) while its step still runs does not free a
slot for yet another thread, so there are never more than ``limit`` threads. Such calls are
counted (``abandoned``), so that the worker does not begin runs that would wait for a thread.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

_Job = tuple[Callable[..., Any], tuple[Any, ...], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]
_STOP = None  # a thread that takes this from the queue ends


class StepThreads:
    """Runs blocking callables off the event loop, ``limit`` at a time, on reused threads."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._slots = asyncio.Semaphore(limit)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = 0
        self._idle = 0
        # calls still running on a thread whose awaiting task gave up on them
        self._abandoned = 0
        self._lock = threading.Lock()
        # calls finished on the threads, to settle on the loop (a delivery is scheduled
        # whenever this is not empty)
        self._finished: list[tuple[Callable[[Any], None], Any, asyncio.Future[Any]]] = []

    @property
    def abandoned(self) -> int:
        """How many slots calls that nobody awaits any more hold (a hung call of a cancelled
        run holds its slot until it returns)."""
        return self._abandoned

    @property
    def threads(self) -> int:
        """How many threads the pool has started (never more than its limit)."""
        return self._threads

    def close(self) -> None:
        """Let every thread end once it is idle (a thread still in a call ends after it)."""
        for _ in range(self._threads):
            self._jobs.put(_STOP)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call ``fn(*args)`` on a pool thread and return (or raise) what it does.

        If the awaiting task is cancelled, the call runs on unobserved (Python cannot stop a
        thread); its slot comes back when it returns.
        """
        await self._slots.acquire()
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[Any] = loop.create_future()
        self._submit((fn, args, loop, outcome))
        try:
            return await outcome
        except asyncio.CancelledError:
            if outcome.cancelled():  # the call runs on, holding its slot
                self._abandoned += 1
            raise

    def _submit(self, job: _Job) -> None:
        with self._lock:
            start_thread = self._idle == 0 and self._threads < self._limit
            if start_thread:
                self._threads += 1
            else:
                self._idle -= 1
        self._jobs.put(job)
        if start_thread:
            threading.Thread(target=self._serve, name="flowly-step", daemon=True).start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            fn, args, loop, outcome = job
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the step, which decides what it means
                error: BaseException = exc
                if isinstance(exc, (StopIteration, GeneratorExit)):
                    # a future refuses StopIteration (PEP 479), and GeneratorExit would be
                    # taken for the closing of the coroutine that awaits it
                    error = RuntimeError(f"step function raised {exc!r}")
                    error.__cause__ = exc
                settle, value = outcome.set_exception, error
            else:
                settle, value = outcome.set_result, result
            with self._lock:
                self._idle += 1
                wake_loop = not self._finished
                self._finished.append((settle, value, outcome))
            if wake_loop:
                try:
                    loop.call_soon_threadsafe(self._deliver)
                except RuntimeError:  # the loop is closed: the worker stopped without waiting
                    with self._lock:  # nobody awaits these any more
                        self._finished.clear()
                    return

    def _deliver(self) -> None:
        """On the loop: settle every call finished since the last delivery (steps that end
        together cost one wake-up of the loop, not one each)."""
        with self._lock:
            finished, self._finished = self._finished, []
        for settle, value, outcome in finished:
            self._slots.release()
            if outcome.cancelled():  # the run gave up on it meanwhile
                self._abandoned -= 1
            elif not outcome.done():
                settle(value)
