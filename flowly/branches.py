"""Branches: where in a workflow body's tree of tasks a ``ctx`` call was made.

A child started without ``run_id``, and a second wait for the same event or run, are named
by counting. Counted across the whole body, in the order calls are reached, parallel branches
(``asyncio.gather(branch("a"), branch("b"))``, each reaching its call after a step of its own)
could swap numbers between the first execution and a replay, and a replay then handed a
branch its sibling's child or event payload. Counted per branch instead, the numbers follow
the body's code, not timing: a branch is a task the body (or one of its branches) created,
numbered by the order its creator created tasks, which the body's code fixes.

Only tasks created by workflow code count. Tasks the engine creates while it serves a ``ctx``
call (and tasks a step's own function creates) happen in one execution and not in a replay,
so they are not numbered and do not shift the numbers of the tasks the body creates next.
"""

from __future__ import annotations

import contextvars
from collections.abc import Generator
from typing import Any


class Branch:
    """One task of a workflow body: its path from the body's own task (``()``), and how many
    tasks it has created so far."""

    __slots__ = ("created", "path")

    def __init__(self, path: tuple[int, ...]) -> None:
        self.path = path
        self.created = 0

    def child(self) -> Branch:
        self.created += 1
        return Branch((*self.path, self.created))


_BRANCH: contextvars.ContextVar[Branch | None] = contextvars.ContextVar(
    "flowly_branch", default=None)
_IN_ENGINE = contextvars.ContextVar("flowly_in_engine", default=False)


def enter_body() -> None:
    """Mark the current task as a workflow body's own task (the root branch)."""
    _BRANCH.set(Branch(()))


def current_path() -> tuple[int, ...]:
    """The branch path of the running task: ``()`` in the body's own task, or outside any."""
    branch = _BRANCH.get()
    return branch.path if branch is not None else ()


def branch_label(path: tuple[int, ...]) -> str:
    """A path as default names carry it: '2.1' is the first task created by the second task
    the body created."""
    return ".".join(map(str, path))


def engine_await(awaitable: Generator[Any, None, Any]) -> Generator[Any, None, Any]:
    """Drive ``awaitable`` (a coroutine's ``__await__``) as engine code: tasks created
    meanwhile are not branches of the body."""
    before = _IN_ENGINE.get()
    _IN_ENGINE.set(True)
    try:
        return (yield from awaitable)
    finally:
        # set back, not reset with a token: a coroutine closed by the garbage collector runs
        # this in whatever context is current, where a token would not be valid
        _IN_ENGINE.set(before)


def new_task_context(kwargs: dict[str, Any]) -> None:
    """For a task factory: if the task is created by workflow code, give it a context of its
    own (in ``kwargs``) in which it is the next branch of its creator."""
    parent = _BRANCH.get()
    if parent is None or _IN_ENGINE.get():
        return
    given = kwargs.get("context")
    context = given.copy() if given is not None else contextvars.copy_context()
    context.run(_BRANCH.set, parent.child())
    kwargs["context"] = context
