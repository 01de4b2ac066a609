"""Workflow registration: ``@flowly.workflow("name")`` on an ``async def wf(ctx, input)``."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from types import FunctionType
from typing import TYPE_CHECKING, Any, TypeVar

from .arguments import at_least, aware_time, int4, optional_text, text, time_ahead
from .db import dumps_argument, seconds_interval
from .errors import InvalidArgument, UnknownWorkflow

if TYPE_CHECKING:
    from .context import Context

WorkflowFn = Callable[["Context", Any], Awaitable[Any]]
F = TypeVar("F", bound=WorkflowFn)


@dataclass(frozen=True)
class Workflow:
    """A registered workflow: its name, its function and its defaults for new runs."""

    name: str
    fn: WorkflowFn
    queue: str = "default"
    max_attempts: int = 3

    @functools.cached_property
    def signature_error(self) -> str | None:
        """Why the body cannot be called as ``fn(ctx, input)``, or None; worked out once,
        not at every run (``inspect.signature`` is a large part of starting a body)."""
        try:
            inspect.signature(self.fn).bind(None, None)
        except TypeError as exc:
            return str(exc)
        except ValueError:  # no signature to check (a builtin): let the call tell
            pass
        return None


_registry: dict[str, Workflow] = {}


def workflow(name: str, *, queue: str = "default", max_attempts: int = 3) -> Callable[[F], F]:
    """Register ``fn`` as the workflow ``name``.

    ``queue`` and ``max_attempts`` (attempts of the whole run when the workflow body itself
    raises outside a step) are the defaults for runs started through the Python API.
    The decorated function is returned unchanged and stays directly callable.
    """
    if callable(name):
        raise TypeError("@flowly.workflow needs the workflow's name: write"
                        " @flowly.workflow(\"name\") (runs in the database refer to it by name,"
                        " so it must not change with the function's)")
    if not text("workflow name", name):
        raise InvalidArgument("workflow name must not be empty")
    text(f"queue of workflow {name!r}", queue)
    at_least(f"max_attempts of workflow {name!r}", max_attempts, 1)

    def register(fn: F) -> F:
        if not is_async(fn):
            what = getattr(fn, "__qualname__", None) or repr(fn)
            raise TypeError(
                f"workflow {name!r}: {what} must be an `async def` function taking (ctx, input);"
                " a plain function or a generator would fail every run")
        _registry[name] = Workflow(name, fn, queue, max_attempts)
        return fn

    return register


def is_async(fn: Any) -> bool:
    """``async def`` (also behind functools.partial or as an async ``__call__``)."""
    # asked at every step: a plain ``async def`` is told by its code's flags alone, before
    # the general answer, which looks through partials, methods and markers first
    if type(fn) is FunctionType and fn.__code__.co_flags & inspect.CO_COROUTINE:
        return True
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.iscoroutinefunction(fn):
        return True
    return callable(fn) and not inspect.isroutine(fn) and inspect.iscoroutinefunction(fn.__call__)


def registered() -> Mapping[str, Workflow]:
    """All workflows registered in this process, by name."""
    return dict(_registry)


def lookup(workflow: str | WorkflowFn) -> tuple[str, Workflow | None]:
    """The name of a workflow given by name or by its decorated function, and its
    registration in this process (whose queue and max_attempts are the defaults of a start)."""
    if isinstance(workflow, str):
        return workflow, registered().get(workflow)
    for wf in registered().values():
        if wf.fn is workflow:
            return wf.name, wf
    raise TypeError(f"{workflow!r} is not a registered workflow function")


def lookup_argument(what: str, workflow: Any) -> tuple[str, Workflow | None]:
    """:func:`lookup` for a client's argument ``what``: a value that is neither a name nor a
    function (None, a number) is refused as :class:`InvalidArgument` naming it, as the
    client's other arguments are, not as lookup's TypeError (which workflow code gets as a
    misuse of flowly)."""
    if not isinstance(workflow, str) and not callable(workflow):
        raise InvalidArgument(f"{what} must be a workflow's name or its decorated function,"
                              f" got {type(workflow).__name__} {workflow!r}")
    return lookup(workflow)


def resolve(workflows: Iterable[str | Workflow | WorkflowFn] | str | Workflow | WorkflowFn
            | None) -> dict[str, Workflow]:
    """Turn names, :class:`Workflow` objects or decorated functions into a name map.

    ``None`` means every registered workflow; one workflow alone (not in a list) means that
    one, not the letters of its name.
    """
    if workflows is None:
        return dict(_registry)
    if isinstance(workflows, (str, Workflow)) or callable(workflows):
        workflows = [workflows]
    by_fn = {wf.fn: wf for wf in _registry.values()}
    resolved: dict[str, Workflow] = {}
    for item in workflows:
        if isinstance(item, Workflow):
            wf = item
        elif isinstance(item, str):
            if item not in _registry:
                raise UnknownWorkflow(f"workflow {item!r} is not registered")
            wf = _registry[item]
        elif item in by_fn:
            wf = by_fn[item]
        else:
            raise UnknownWorkflow(f"{item!r} is not a registered workflow function")
        resolved[wf.name] = wf
    return resolved


START_OPTIONS = frozenset({
    "queue", "priority", "scheduled_for", "delay", "concurrency_key", "max_attempts", "timeout",
})
"""The options a start takes besides workflow, input and run id."""


def start_params(
    workflow: str,
    input: Any,
    run_id: str | None,
    options: dict[str, Any],
    defaults: Workflow | None = None,
) -> dict[str, Any]:
    """Named parameters for ``start``: the options a caller gave over the workflow's defaults."""
    unknown = set(options) - START_OPTIONS
    if unknown:
        raise TypeError(f"unknown start option(s): {', '.join(sorted(unknown))}")
    return {
        "workflow": optional_text(f"workflow of a {workflow!r} run", workflow),
        "input": dumps_argument(input, f"input of a {workflow!r} run"),
        "run_id": optional_text(f"run_id of a {workflow!r} run", run_id),
        "queue": optional_text(f"queue of a {workflow!r} run", _option(
            options, "queue", defaults.queue if defaults else "default")),
        "priority": int4(f"priority of a {workflow!r} run", _option(options, "priority", 0)),
        **_when(workflow, options),
        "concurrency_key": optional_text(f"concurrency_key of a {workflow!r} run",
                                         options.get("concurrency_key")),
        "max_attempts": int4(f"max_attempts of a {workflow!r} run", _option(
            options, "max_attempts", defaults.max_attempts if defaults else 3)),
        "timeout": _interval(workflow, "timeout", options.get("timeout"), positive=True),
        "parent_run_id": None,
        "parent_lease_epoch": None,
        "parent_step": None,
        "parent_position": None,
    }


def _option(options: dict[str, Any], name: str, default: Any) -> Any:
    """The caller's value when given (even a falsy one, which SQL then validates)."""
    value = options.get(name)
    return default if value is None else value


def _when(workflow: str, options: dict[str, Any]) -> dict[str, Any]:
    """``scheduled_for`` and ``delay``, at most one of them given."""
    scheduled_for, delay = options.get("scheduled_for"), options.get("delay")
    if scheduled_for is not None and delay is not None:
        raise InvalidArgument(f"a {workflow!r} run takes scheduled_for or delay, not both")
    return {
        "scheduled_for": None if scheduled_for is None else aware_time(
            f"scheduled_for of a {workflow!r} run", scheduled_for),
        "delay": _interval(workflow, "delay", delay),
    }


def _interval(workflow: str, name: str, value: Any, *, positive: bool = False) -> str | None:
    """``value``, seconds or a timedelta, if the run's times stay readable (years 1 to 9999)
    and if ``positive`` (a timeout), more than zero, as an interval of seconds alone: days in
    it would be calendar days of the session's TimeZone (see seconds_interval)."""
    return None if value is None else seconds_interval(
        time_ahead(f"{name} of a {workflow!r} run", value, positive=positive))
