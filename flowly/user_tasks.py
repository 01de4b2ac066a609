"""Tasks that user code starts inside a step: what they raise fails the step, never the worker.

asyncio's Task lets ``SystemExit`` and ``KeyboardInterrupt`` out of the event loop, whichever
task raised them. Raised by a step's own coroutine they fail that step (the worker catches
them there); raised in a task the step started (``asyncio.gather(helper())`` of a library
that calls ``sys.exit()``), they would stop the worker and every run it holds. While a worker
runs, its loop's task factory wraps the coroutines of tasks created inside user code (a
context variable set around the step's call, which tasks inherit) so that these two arrive
as an ordinary exception, :class:`UserTaskExited`, at whatever awaits the task.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine, Generator
from contextlib import contextmanager
from typing import Any

from .branches import new_task_context

_IN_USER_CODE = contextvars.ContextVar("flowly_in_user_code", default=False)


class UserTaskExited(Exception):
    """A task started by a step raised SystemExit or KeyboardInterrupt (its ``__cause__``)."""


class user_code:  # lowercase: it reads as a function, ``with user_code():``
    """Mark the code run inside as user code: tasks it creates are contained.

    A class, not a generator context manager: it wraps every step call and every body."""

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = _IN_USER_CODE.set(True)

    def __exit__(self, *exc_info: object) -> None:
        _IN_USER_CODE.reset(self._token)


async def _contained(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        return await coro
    except (SystemExit, KeyboardInterrupt) as exc:
        raise UserTaskExited(f"{type(exc).__name__} raised in a task the step started:"
                             f" {exc}") from exc


@contextmanager
def containing_user_tasks(loop: asyncio.AbstractEventLoop) -> Generator[None, None, None]:
    """Install, for the duration, a task factory on ``loop`` that contains the tasks user
    code creates, and numbers those a workflow body creates as its branches
    (:mod:`flowly.branches`); any factory already there still makes the tasks."""
    previous = loop.get_task_factory()

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        if _IN_USER_CODE.get() and asyncio.iscoroutine(coro):
            coro = _contained(coro)
        new_task_context(kwargs)
        if previous is not None:
            return previous(loop, coro, **kwargs)
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(factory)
    try:
        yield
    finally:
        loop.set_task_factory(previous)
