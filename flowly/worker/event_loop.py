"""The worker command's event loop: ``asyncio.run`` with an end to its shutdown.

Once ``main`` returns, ``asyncio.run`` cancels the tasks still running and waits for them,
without a limit. A run's task whose step (or body) catches every cancellation and goes on
never ends, so a worker that had stopped and released its runs never exited. Here the tasks
left get a grace period, and those still running after it are abandoned with the loop: a
process that has released its runs has nothing left to wait for.
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
        return loop.run_until_complete(main)
    finally:
        try:
            left = [task for task in asyncio.all_tasks(loop) if not task.done()]
            if left:
                loop.run_until_complete(end_tasks(left, leftover_grace))
                deaf = [task.get_name() for task in left if not task.done()]
                if deaf:
                    logger.warning("%d task(s) ignored their cancellation and are abandoned"
                                   " as the worker exits: %s", len(deaf), ", ".join(deaf))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
