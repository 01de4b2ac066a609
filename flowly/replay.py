"""A run's recorded history, read lazily in bounded pages for replay.

``claim`` hands a worker its runs without their history; the context asks this log for a
step or timer by name when the body reaches it, and the log reads further pages (in the order
they were recorded, each page bounded in rows and bytes) until it finds the name or the
history ends. A body that replays in order reads each page once, however long the run's
history; a run with no history costs no read at all.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar


@dataclass
class StoredStep:
    """A step outcome as the database holds it; ``kind`` is the call that recorded it:
    'step', 'transaction', 'start' (a child's id), 'event' or 'run' (a wait's outcome)."""

    status: str
    output: Any
    seq: int
    compensable: bool = False
    compensation_status: str | None = None
    position: int | None = None
    kind: str = "step"


@dataclass
class StoredTimer:
    """A durable timer: its wake time, and whether it had fired when the run was claimed."""

    wake_at: datetime
    due: bool
    kind: ClassVar[str] = "timer"


Entry = StoredStep | StoredTimer
PageReader = Callable[[int], Awaitable[Sequence[Sequence[Any]]]]
"""Reads the page of replay rows recorded after a sequence number (see SQL ``replay``)."""


class Unread(enum.Enum):
    """What :meth:`ReplayLog.peek` answers when pages not read yet may hold the name."""

    UNREAD = "unread"


UNREAD = Unread.UNREAD


class ReplayLog:
    """The history of one claimed run, as far as it has been read, plus what this execution
    recorded since."""

    def __init__(self, read_page: PageReader | None) -> None:
        self._read_page = read_page
        # whether anything was recorded before this execution (a run claimed for the first
        # time has nothing to read)
        self.may_have_records = read_page is not None
        self._entries: dict[str, Entry] = {}
        self._last_seq = 0
        self._exhausted = read_page is None
        self._reading = asyncio.Lock()  # parallel steps must not read the same page twice

    def peek(self, name: str) -> Entry | Unread | None:
        """The recorded outcome of ``name`` as far as the history has been read: ``UNREAD``
        when pages not read yet may hold it (then :meth:`get` reads them)."""
        entry = self._entries.get(name)
        if entry is None and not self._exhausted:
            return UNREAD
        return entry

    async def get(self, name: str) -> Entry | None:
        """The recorded outcome of ``name``, reading more pages while it is not found."""
        while name not in self._entries and not self._exhausted:
            await self._read_next_page()
        return self._entries.get(name)

    async def read_all(self) -> dict[str, Entry]:
        """Every recorded entry, by name (the saga needs all completed steps)."""
        while not self._exhausted:
            await self._read_next_page()
        return self._entries

    def record(self, name: str, entry: Entry) -> None:
        """Remember what this execution wrote, so the body sees it without a read."""
        self._entries[name] = entry

    async def _read_next_page(self) -> None:
        assert self._read_page is not None
        async with self._reading:
            if self._exhausted:
                return
            rows = await self._read_page(self._last_seq)
            for (kind, name, seq, position, status, output, compensable, compensation,
                 wake_at, due, _) in rows:
                self._last_seq = max(self._last_seq, seq)
                entry: Entry
                if kind == "timer":
                    entry = StoredTimer(wake_at, due)
                else:
                    entry = StoredStep(status, output, seq, compensable, compensation, position,
                                       kind)
                # what this execution recorded itself is at least as new as what a page says
                self._entries.setdefault(name, entry)
            # each row says whether more follow this page
            self._exhausted = not rows or not rows[-1][-1]
