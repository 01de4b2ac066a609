"""The cyclic garbage collector paced for a worker while it runs.

A worker keeps the objects of every run in flight (its task, its context, the futures of its
writes) for the milliseconds the run takes, and frees them by reference count when it ends.
At CPython's default first threshold (a collection every 700 new container objects) those
live objects are traversed again and again, and promoted into older generations that full
collections traverse again, for nothing found: it took 13 % of a worker's CPU in a drain of
three-step runs (bench/RESULTS.md, sixteenth pass). While at least one worker runs in the
process, the first threshold is raised to :data:`FIRST_THRESHOLD`; the thresholds the
process had are put back when the last worker ends. A process that set a higher first
threshold, or turned automatic collection off, is left as it is.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Generator
from contextlib import contextmanager

FIRST_THRESHOLD = 10_000

_lock = threading.Lock()
_running = 0
# the thresholds to put back when the last worker ends; None: nothing was changed
_saved: tuple[int, int, int] | None = None


@contextmanager
def collector_paced_for_runs() -> Generator[None, None, None]:
    """For the duration of a worker's run: the collector's first threshold raised."""
    global _running, _saved
    with _lock:
        _running += 1
        if _running == 1:
            first, second, third = gc.get_threshold()
            if gc.isenabled() and 0 < first < FIRST_THRESHOLD:
                _saved = (first, second, third)
                gc.set_threshold(FIRST_THRESHOLD, second, third)
    try:
        yield
    finally:
        with _lock:
            _running -= 1
            if _running == 0 and _saved is not None:
                # unless the process set thresholds of its own meanwhile
                if gc.get_threshold()[0] == FIRST_THRESHOLD:
                    gc.set_threshold(*_saved)
                _saved = None
