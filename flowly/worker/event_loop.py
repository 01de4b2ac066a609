"""The worker command's event loop: ``asyncio.run`` with an end to its shutdown, and a loop
that user code cannot stop.

Once ``main`` returns, ``asyncio.run`` cancels the tasks still running and waits for them,
without a limit. A run's task whose step (or body) catches every cancellation and goes on
never ends, so a worker that had stopped and released its runs never exited. Here the tasks
left get a grace period, and those still running after it are abandoned with the loop: a
process that has released its runs has nothing left to wait for.

A step or body runs on the worker's loop, and may stop it (``loop.stop()``, as code written
for a loop of its own does). ``run_until_complete`` then raised "Event loop stopped before
Future completed": the worker died with every run it held left to its lease, and under
``flowly worker --processes N`` a worker dying so soon after its start was taken for one that
could not start, which stopped them all. The loop is resumed instead, with a warning.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from ..bounded_calls import end_tasks

logger = logging.getLogger(__name__)

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], leftover_grace: float) -> T:
    """Run ``main`` on a new event loop, as ``asyncio.run`` does, then give the tasks it left
    ``leftover_grace`` seconds to end once cancelled (twice: see end_tasks) and close the loop
    whether they did or not."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return _until_done(loop, main)
    finally:
        try:
            left = [task for task in asyncio.all_tasks(loop) if not task.done()]
            if left:
                _until_done(loop, end_tasks(left, leftover_grace))
                deaf = [task.get_name() for task in left if not task.done()]
                if deaf:
                    logger.warning("%d task(s) ignored their cancellation and are abandoned"
                                   " as the worker exits: %s", len(deaf), ", ".join(deaf))
            _until_done(loop, loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _until_done(loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, T]) -> T:
    """``loop.run_until_complete(coroutine)``, resuming the loop whenever code running on it
    stopped it before the coroutine was done."""
    task = loop.create_task(coroutine)
    while True:
        try:
            return loop.run_until_complete(task)
        except RuntimeError as exc:
            # not the coroutine's own RuntimeError, nor one that says the loop could not run
            # at all (which resuming would only meet again, for ever)
            if task.done() or "stopped before" not in str(exc):
                raise
            logger.warning("the event loop was stopped (loop.stop() called by a step or a"
                           " workflow body?); the worker resumes it: code that runs on the"
                           " worker's loop must not stop it")
