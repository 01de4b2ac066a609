"""Claims set off when runs come due by time.

A run released to sleep, to back off before a retry or to wait with a timeout, or started to
be due later, is claimed by whichever worker claims once its time has come. Without a timer,
that was at the next poll: a step's 50 ms backoff could take ``poll_interval`` (seconds, for
a worker that polls rarely). A release tells the worker that made it the due time, and a
start announces a run due within the hour with its time (migration 0069), so a worker wakes
its claim loop then. A run released by a worker that died since, or due further ahead, is
still found by the poll.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import math
from collections.abc import Callable

# due times further ahead than this, or beyond this many kept (a float each), are left to
# the poll, as before there was a timer: they bound what a worker that releases many runs,
# or runs that sleep for months, holds
DUE_HORIZON = 3600.0
MAX_DUE_TIMES = 100_000


class DueTimer:
    """Calls ``wake`` at each time given to :meth:`at` (the event loop's clock, which is
    ``time.monotonic``), with one timer handle armed for the earliest."""

    def __init__(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:
        self._loop = loop
        self._wake = wake
        self._due: list[float] = []
        self._handle: asyncio.TimerHandle | None = None

    def at(self, when: float) -> None:
        if len(self._due) >= MAX_DUE_TIMES or when - self._loop.time() > DUE_HORIZON:
            return
        heapq.heappush(self._due, when)
        if self._handle is None or when < self._handle.when():
            self._arm()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._due.clear()

    def __len__(self) -> int:
        return len(self._due)

    def _arm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._loop.call_at(self._due[0], self._fire)

    def _fire(self) -> None:
        self._handle = None
        now = self._loop.time()
        while self._due and self._due[0] <= now:
            heapq.heappop(self._due)
        if self._due:
            self._arm()
        self._wake()


def announced_due(payload: str) -> tuple[str, float] | None:
    """The queue and the due time (epoch seconds on the server's clock) of a wake-up that
    announces a run due later (0069); None for any other wake-up (a queue's name)."""
    if not payload.startswith("{"):
        return None
    try:
        fields = json.loads(payload)
        queue, due = str(fields["queue"]), float(fields["due"])
    except (ValueError, TypeError, KeyError):
        return None
    return (queue, due) if math.isfinite(due) else None
