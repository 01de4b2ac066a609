"""The database server's clock as this worker's monotonic clock sees it.

Times that the database decides are on its clock: when a handed-off run's first lease ends
(``handoff``), when a run released to sleep, to back off or to wait, or started to be due
later, comes due (``due_timer``). The worker acts on them with its own monotonic clock,
which may differ from the server's wall clock by any amount (another machine, a stepped
clock).
"""

from __future__ import annotations

import math
import time


class ServerClock:
    """A reading pairs the monotonic times a query was sent and answered with the server's
    ``clock_timestamp()`` in its answer. The server read its clock between the two, so the
    offset taken from the send is at least the true one and the offset taken from the answer
    at most: a server time mapped with the first comes out early, never late (a lease's end),
    and with the second late, never early (a due time, which a claim made before it would
    miss). Readings are due every ``every`` seconds and trusted for twice that, so a drifting
    or stepped clock on either side is not trusted for long.
    """

    def __init__(self, every: float) -> None:
        self.every = every
        self._offset: float | None = None
        self._round_trip = 0.0
        self._read_at = -math.inf

    def due(self, now: float) -> bool:
        return now - self._read_at >= self.every

    def record(self, sent: float, server_epoch: float, answered: float) -> None:
        self._offset = server_epoch - sent
        self._round_trip = answered - sent
        self._read_at = sent

    def local(self, server_epoch: float | None) -> float | None:
        """The monotonic time at or before which the server's clock shows ``server_epoch``;
        None if that cannot be told (no recent reading, or no time given)."""
        if (server_epoch is None or self._offset is None
                or time.monotonic() - self._read_at > 2 * self.every):
            return None
        return server_epoch - self._offset

    def local_after(self, server_epoch: float) -> float | None:
        """The monotonic time at or after which the server's clock shows ``server_epoch``;
        None if that cannot be told (no recent reading)."""
        early = self.local(server_epoch)
        return None if early is None else early + self._round_trip
