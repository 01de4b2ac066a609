"""The workflow context: what a workflow body calls to run steps, sleep and start runs.

A :class:`Context` replays: a step with a stored checkpoint returns its stored output and is
never executed again; a timer that already fired returns at once. Everything that must end
the body early (a durable sleep, a retry backoff, a lost lease, a saga) is signalled with an
:class:`Interrupt`, a ``BaseException``, so a user's ``except Exception`` cannot swallow it.
"""

from __future__ import annotations

import asyncio
import inspect
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import psycopg

from .db import dumps, jsonb_safe_text
from .errors import LeaseLost, StepOutputNotSerializable
from .retry import Retry
from .workflow import Workflow, WorkflowFn, lookup


class Interrupt(BaseException):
    """Ends a workflow body early on purpose; the worker knows what each kind means."""


class SleepInterrupt(Interrupt):
    """The run sleeps on a durable timer; it was released and resumes at wake time."""


class RetryInterrupt(Interrupt):
    """A step failed and will be retried after a backoff; the run was released until then."""


class CompensateInterrupt(Interrupt):
    """The run failed for good: its compensations must run (or it is already dead-lettered)."""

    def __init__(self, decision: str) -> None:
        super().__init__(decision)
        self.decision = decision


class LeaseLostInterrupt(Interrupt):
    """This worker no longer holds the run; nothing more may be written for it."""


class RunAbandoned(Interrupt):
    """A write for the run failed in the database (connection lost, server restart...).

    Whether it committed is unknown, so the worker gives the run up: its lease expires and
    any worker resumes it from the last checkpoint. User code cannot catch this by mistake.
    """


@dataclass
class StoredStep:
    """A step outcome as the database holds it."""

    status: str
    output: Any
    seq: int
    compensable: bool = False
    compensation_status: str | None = None


class RunStore(Protocol):
    """The writes a running workflow makes, each fenced by the run's lease epoch."""

    async def checkpoint(
        self, name: str, payload: str, started_at: datetime, compensable: bool
    ) -> tuple[Any, int]: ...

    async def sleep(
        self, name: str, wake_at: datetime | None, seconds: float | None
    ) -> tuple[datetime, bool]: ...

    async def fail_step(
        self, name: str, error: dict[str, Any], started_at: datetime, retry: Retry,
        retryable: bool,
    ) -> str: ...

    async def start_run(
        self, workflow: str, input: Any, run_id: str, options: dict[str, Any],
        defaults: Workflow | None,
    ) -> str: ...

    async def call_blocking(self, fn: Callable[..., Any], *args: Any) -> Any: ...


# names key a btree index (run id, name), whose entries must stay under about 2.7 kB
_MAX_NAME_BYTES = 1000


def error_info(exc: BaseException) -> dict[str, Any]:
    """The JSON stored for a failure: exception type, message and a bounded traceback."""
    tb = "".join(traceback.format_exception(exc))
    return {"type": type(exc).__qualname__, "message": jsonb_safe_text(str(exc)),
            "traceback": jsonb_safe_text(tb[-8000:])}


def cancel_requested(exc: BaseException) -> bool:
    """Whether ``exc`` is this task being cancelled (lease lost, cancel, shutdown), rather than
    a CancelledError that user code raised or let escape from a future of its own; the
    latter is an ordinary failure of the step, body or compensation."""
    task = asyncio.current_task()
    return isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling() > 0


def serialise_output(value: Any, owner: str) -> str:
    """JSON text of a step's or workflow's output; a clear error naming ``owner`` if it has none."""
    try:
        return dumps(value)
    except (TypeError, ValueError) as exc:
        raise StepOutputNotSerializable(
            f"{owner} returned a {type(value).__name__} that is not JSON serialisable: {exc}"
        ) from exc


def now() -> datetime:
    return datetime.now(UTC)


async def call_user_function(store: RunStore, fn: Callable[..., Any], *args: Any) -> Any:
    """Await an async callable on the loop; run a sync one on the worker's threads.

    Coroutine functions get no thread hop; a sync callable that returns an awaitable (a
    lambda around an async call) has that awaitable awaited on the loop.
    """
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    result = await store.call_blocking(fn, *args)
    if inspect.isawaitable(result):
        return await result
    return result


class Context:
    """Handed to a workflow body as ``ctx``; one per execution of a run."""

    def __init__(
        self,
        *,
        run_id: str,
        workflow: str,
        attempt: int,
        store: RunStore,
        steps: dict[str, StoredStep],
        timers: dict[str, tuple[datetime, bool]],
        compensating: bool,
        default_retry: Retry,
    ) -> None:
        self.run_id = run_id
        self.workflow = workflow
        self.attempt = attempt
        self._store = store
        self._steps = steps
        self._timers = timers
        self._default_retry = default_retry
        self.compensating = compensating
        self.compensations: dict[str, Callable[[Any], Any]] = {}
        self._names_used: set[str] = set()
        self._child_counts: dict[str, int] = {}

    @property
    def steps(self) -> dict[str, StoredStep]:
        """Step outcomes known to this execution (replayed and new), by name."""
        return self._steps

    def idempotency_key(self, step: str) -> str:
        """A key that is the same on every attempt and replay of ``step`` in this run.

        Steps are at-least-once: pass this to external APIs so they de-duplicate a call
        repeated after a crash between the side effect and the checkpoint.
        """
        return f"{self.run_id}:{step}"

    def _claim_name(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"step and sleep names must be non-empty strings, got {name!r}")
        try:
            size: int | None = len(name.encode("utf-8"))
        except UnicodeEncodeError:  # an unpaired surrogate
            size = None
        if size is None or size > _MAX_NAME_BYTES or "\x00" in name:
            raise ValueError(f"step or sleep name {name[:80]!r} must be text of at most"
                             f" {_MAX_NAME_BYTES} bytes with no NUL character")
        if name in self._names_used:
            raise ValueError(
                f"name {name!r} is used twice in run {self.run_id}: every step and sleep of a"
                " run needs its own name, since checkpoints are keyed by it"
            )
        self._names_used.add(name)

    async def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        compensate: Callable[[Any], Any] | None = None,
        retry: Retry | None = None,
    ) -> Any:
        """Run ``fn(*args)`` once for this run and return its (JSON) output.

        A step with a checkpoint returns the stored output without running. A failure is
        retried per ``retry`` (backoff decided by the database; the run is released in
        between); when attempts run out, ``compensate(output)`` of every completed step runs
        in reverse order and the run lands in ``dead_letter``. The output must be JSON
        serialisable; the value returned is the one stored (so replays see the same thing).
        """
        self._claim_name(name)
        if compensate is not None:
            self.compensations[name] = compensate
        stored = self._steps.get(name)
        if stored is not None:
            if stored.status == "completed":
                return stored.output
            raise CompensateInterrupt("compensate")
        if self.compensating:
            raise CompensateInterrupt("compensate")

        policy = retry or self._default_retry
        started_at = now()
        try:
            result = await call_user_function(self._store, fn, *args)
            payload = serialise_output(result, f"step {name!r}")
        except Interrupt:
            raise
        except BaseException as exc:  # a poison step fails its run, never the worker
            if cancel_requested(exc):
                raise
            retryable = not isinstance(exc, StepOutputNotSerializable)
            decision = await self._fenced(
                self._store.fail_step(name, error_info(exc), started_at, policy, retryable)
            )
            if decision == "retry":
                raise RetryInterrupt(name) from None
            raise CompensateInterrupt(decision) from None

        output, seq = await self._fenced(
            self._store.checkpoint(name, payload, started_at, compensate is not None)
        )
        self._steps[name] = StoredStep("completed", output, seq, compensate is not None)
        return output

    async def sleep(self, name: str, seconds: float | timedelta) -> None:
        """Sleep durably for ``seconds``, measured from the first time this sleep is reached.

        The wake time is stored once; the run is released while it sleeps and resumes at
        that time, on any worker, even after restarts.
        """
        delay = seconds.total_seconds() if isinstance(seconds, timedelta) else float(seconds)
        await self._sleep(name, None, delay)

    async def sleep_until(self, name: str, when: datetime) -> None:
        """Sleep durably until ``when`` (a timezone-aware datetime)."""
        if when.tzinfo is None:
            raise ValueError(f"sleep_until {name!r}: 'when' must be timezone-aware")
        await self._sleep(name, when, None)

    async def _sleep(self, name: str, wake_at: datetime | None, seconds: float | None) -> None:
        self._claim_name(name)
        timer = self._timers.get(name)
        if timer is not None and timer[1]:
            return
        if self.compensating:
            raise CompensateInterrupt("compensate")
        stored_wake_at, released = await self._fenced(self._store.sleep(name, wake_at, seconds))
        if released:
            raise SleepInterrupt(name)
        self._timers[name] = (stored_wake_at, True)

    async def start(
        self,
        workflow: str | WorkflowFn,
        input: Any = None,
        run_id: str | None = None,
        **options: Any,
    ) -> str:
        """Start another run and return its id; idempotent across replays.

        Without ``run_id`` the child's id is derived from this run's id, the workflow name and
        how many runs of that workflow this body started before, so a replay starts nothing
        new. ``workflow`` is a name or a decorated function; ``options`` are those of
        :meth:`flowly.Client.start` (queue, priority, ...), over the child workflow's own
        defaults when it is registered in this process.
        """
        name, defaults = lookup(workflow)
        count = self._child_counts.get(name, 0) + 1
        self._child_counts[name] = count
        child_id = run_id or f"{self.run_id}:{name}:{count}"
        return str(await self._fenced(
            self._store.start_run(name, input, child_id, options, defaults)))

    async def _fenced(self, write: Awaitable[Any]) -> Any:
        try:
            return await write
        except LeaseLost as exc:
            raise LeaseLostInterrupt(str(exc)) from None
        except (psycopg.OperationalError, psycopg.InterfaceError, OSError) as exc:
            # the connection or server failed (or a deadlock victim): not this run's fault, so
            # another try after the lease expires may well succeed; any other database error is
            # about what the run asked for and fails it like an exception of its own
            raise RunAbandoned(f"run {self.run_id}: {exc}") from exc
