"""The heartbeat: extends a worker's leases from a thread and a connection of its own.

Leases must not depend on the event loop being responsive: a workflow body that blocks it
(``time.sleep`` in an ``async def``, a CPU-bound loop) would otherwise let every run of the
worker lapse and be taken over, and the innocent ones would pile up takeovers as if their
worker had died. The thread beats every lease/3 whatever the loop does, tells the loop which
runs were lost (cancelled there once it runs again), and warns, naming the run, when the loop
has not turned for longer than a beat.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from ..bounded_calls import Cutoff
from ..db import Calls, seconds_interval, still_open
from . import session

logger = logging.getLogger(__name__)

# the least time a beat is given before it counts as hung, and the pause before the first
# beat after one that failed (see _run)
_BEAT_PATIENCE = 2.0
_RETRY_AT_ONCE = 0.05

HeldSnapshot = Callable[[], list[tuple[str, int, Any]]]
"""Returns the runs the worker holds now: (run id, epoch, the worker's token for the run)."""


def settle(held: list[tuple[str, int, Any]], rows: list[Any]) -> tuple[list[Any], list[Any]]:
    """The tokens of the runs whose lease a ``heartbeat`` call of ``held`` lost, and of those
    it extended. The call lists only the runs it did not extend; one whose row was locked
    elsewhere ('busy') is neither: a later beat extends it."""
    tokens = {h[0]: h[2] for h in held}
    lost = []
    for run_id, outcome in rows:
        token = tokens.pop(run_id)
        if outcome == "busy":
            logger.info("run %s busy: its lease was not extended this time", run_id)
        else:
            lost.append(token)
    return lost, list(tokens.values())


class Heartbeat:
    """Beats on a daemon thread until :meth:`stop`."""

    def __init__(
        self, *, dsn: str, calls: Calls, worker_id: str, lease: float,
        loop: asyncio.AbstractEventLoop, held: HeldSnapshot,
        on_lost: Callable[[Any], None], on_kept: Callable[[list[Any], float], None],
    ) -> None:
        self._dsn = dsn
        self._calls = calls
        self._worker_id = worker_id
        self._lease = lease
        self._loop = loop
        self._held = held
        self._on_lost = on_lost
        self._on_kept = on_kept
        self._stopping = threading.Event()
        self._loop_seen = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="flowly-heartbeat", daemon=True)
        self._conn: psycopg.Connection[Any] | None = None
        # over whatever connection the beat uses: connecting and configuring one is bounded too
        self._cutoff = Cutoff(lambda: (self._conn,))

    def start(self) -> None:
        self._thread.start()

    def loop_turned(self) -> None:
        """Called from the loop now and then: it is responsive."""
        self._loop_seen = time.monotonic()

    def stop(self) -> None:
        """Tell the thread to end; a beat in flight is cut off (the database may hang)."""
        self._stopping.set()
        self._cutoff.cut_if_armed()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        interval = self._lease / 3
        pause = interval
        try:
            while not self._stopping.wait(pause):
                self._warn_if_loop_blocked(interval)
                try:
                    # a beat that hangs (a stuck backend or pooler acknowledges the bytes, so
                    # no TCP timeout notices) is cut off after an interval, and the next one
                    # goes soon on a new connection: the leases last a lease after the last
                    # beat that got through. A beat gets at least _BEAT_PATIENCE: on a busy
                    # server a slow beat is no hung one, and cutting it would only lose it.
                    self._beat(cut_off_after=max(interval, _BEAT_PATIENCE))
                    pause = interval
                except (psycopg.Error, OSError) as exc:
                    if self._stopping.is_set():  # the stop cut the beat off: nothing failed
                        logger.debug("heartbeat cut off by the stop: %s", exc)
                        break
                    logger.warning("heartbeat failed: %s", exc)
                    self._close()
                    # the first try again at once (a new connection: the lease is running
                    # out), the next ones a little apart (the database may be down)
                    pause = _RETRY_AT_ONCE if pause == interval else interval / 4
        finally:
            self._close()

    def _connection(self) -> psycopg.Connection[Any]:
        # one the server ended between beats (idle_session_timeout, a restart) is replaced
        # before the beat, which would otherwise fail on it and go again after a warning
        if self._conn is None or not still_open(self._conn):
            self._close()
            self._conn = psycopg.connect(self._dsn, **session.connection_kwargs(self._lease))
            session.configure(self._conn, self._lease)
        return self._conn

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _beat(self, cut_off_after: float) -> None:
        held = self._held()
        with self._cutoff:
            self._cutoff.arm(cut_off_after)
            if self._stopping.is_set():  # stop() came before the arming: it cut nothing
                return
            self._beat_on(self._connection(), held)

    def _beat_on(self, conn: psycopg.Connection[Any], held: list[tuple[str, int, Any]]) -> None:
        sent = time.monotonic()  # the server extends the leases from a moment after this
        rows = conn.execute(
            self._calls.heartbeat,
            (self._worker_id, [h[0] for h in held], [h[1] for h in held],
             seconds_interval(self._lease)),
        ).fetchall()
        lost, kept = settle(held, rows)
        for token in lost:
            self._loop.call_soon_threadsafe(self._on_lost, token)
        self._on_kept(kept, sent + self._lease)
        for (worker,) in conn.execute(self._calls.end_stalled_listeners):
            logger.warning(
                "ended the listener of worker %s: frozen past its lease, it had stopped reading"
                " and so held the server's notification queue, which every session shares",
                worker)
        conn.execute(self._calls.fold_run_counts)  # upkeep of flowly.run_counts

    def _warn_if_loop_blocked(self, interval: float) -> None:
        blocked_for = time.monotonic() - self._loop_seen
        if blocked_for < interval:
            return
        task = asyncio.current_task(self._loop)
        culprit = task.get_name() if task is not None else "no task (loop code)"
        logger.warning(
            "the event loop has not turned for %.1fs, blocked by %s: async code must not"
            " block (use a sync step, which runs on a thread, or await asyncio.sleep);"
            " leases are kept meanwhile", blocked_for, culprit)
