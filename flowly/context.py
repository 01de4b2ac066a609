"""The workflow context: what a workflow body calls to run steps, sleep and start runs.

A :class:`Context` replays: a step with a stored checkpoint returns its stored output and is
never executed again; a timer that already fired returns at once. Everything that must end
the body early (a durable sleep, a retry backoff, a lost lease, a saga) is signalled with an
:class:`Interrupt`, a ``BaseException``, so a user's ``except Exception`` cannot swallow it.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, NoReturn, Protocol, TypeVar

from . import arguments
from .branches import branch_label, current_path, engine_await
from .db import dumps, is_connection_failure, is_contention, jsonb_safe_text, utf8_size
from .errors import (
    ChildFailed,
    EventTimeout,
    InvalidArgument,
    LeaseLost,
    OutputTooLarge,
    StepOutputNotSerializable,
    WorkflowCodeError,
)
from .replay import UNREAD, Entry, ReplayLog, StoredStep, StoredTimer
from .retry import Retry
from .user_tasks import user_code
from .workflow import START_OPTIONS, Workflow, WorkflowFn, is_async, lookup

T = TypeVar("T")
Isolation = Literal["read committed", "repeatable read", "serializable"]
ISOLATION_LEVELS: tuple[Isolation, ...] = ("read committed", "repeatable read", "serializable")


class Interrupt(BaseException):
    """Ends a workflow body early on purpose; the worker knows what each kind means.

    A body that catches one anyway (a bare ``except:``) is still ended: the later ``ctx``
    calls of the task that caught it raise it again, and the worker acts on it however the
    body ended."""

    def again(self) -> Interrupt:
        """The same interrupt, raised anew (each raise adds to an instance's traceback)."""
        return type(self)(*self.args)


class SleepInterrupt(Interrupt):
    """The run sleeps on a durable timer (``Context.sleeping``); the worker releases it until
    the wake time once the body ended."""


class WaitInterrupt(Interrupt):
    """The run waits for an event or another run; the worker parks it once the body ended."""


class RetryInterrupt(Interrupt):
    """A step failed and will be retried after a backoff; the run was released until then."""


class CompensateInterrupt(Interrupt):
    """The run failed for good: its compensations must run (or it is already dead-lettered)."""

    def __init__(self, decision: str) -> None:
        super().__init__(decision)
        self.decision = decision

    def again(self) -> CompensateInterrupt:
        return CompensateInterrupt(self.decision)


class LeaseLostInterrupt(Interrupt):
    """This worker no longer holds the run; nothing more may be written for it."""


class RunAbandoned(Interrupt):
    """A write for the run failed in the database (connection lost, server restart...).

    Whether it committed is unknown, so the worker gives the run up: its lease expires and
    any worker resumes it from the last checkpoint. User code cannot catch this by mistake.
    """


class RunStore(Protocol):
    """The writes a running workflow makes, each fenced by the run's lease epoch."""

    async def checkpoint(
        self, name: str, payload: str, started_at: datetime, compensable: bool, position: int
    ) -> tuple[Any, int]: ...

    async def sleep(
        self, name: str, wake_at: datetime | None, seconds: float | None, position: int,
        release: bool,
    ) -> tuple[datetime, bool]: ...

    async def fail_step(
        self, name: str, error: dict[str, Any], started_at: datetime, retry: Retry,
        retryable: bool, position: int,
    ) -> str: ...

    async def start_run(
        self, workflow: str, input: Any, run_id: str, options: dict[str, Any],
        defaults: Workflow | None, record: str, position: int,
    ) -> str: ...

    async def transaction(
        self, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
        isolation: str | None, started_at: datetime, compensable: bool, position: int,
        max_output_bytes: int,
    ) -> tuple[Any, int]: ...

    async def wait_for_event(
        self, step: str, event: str, timeout: float | None, position: int
    ) -> tuple[str, Any]: ...

    async def wait_for_run(
        self, step: str, target: str, position: int
    ) -> tuple[str, str | None, Any, Any]: ...

    async def call_blocking(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    async def records_predate_branch_names(self) -> bool:
        """Whether the run's history was recorded before default names were counted per
        branch (flowly.branches): its replay must then count them as it did."""
        ...

    def check_lease(self) -> None:
        """Raise LeaseLostInterrupt if the lease may have lapsed (nothing renewed it for a
        lease): a step must not start under a lease another worker may hold by now."""


def code_checked(check: Callable[..., T], *args: Any) -> T:
    """``check(*args)`` on values the workflow's code gave: a value it refuses is a mistake of
    that code, which every attempt would make again (WorkflowCodeError, no retry)."""
    try:
        return check(*args)
    except InvalidArgument as exc:
        raise WorkflowCodeError(str(exc)) from None


def _check_step(what: str, fn: Any, compensate: Any, retry: Any) -> None:
    """A step's function, compensation and retry policy as the body gave them: each is
    used only later (a policy once the step fails, a compensation in the saga), where a
    wrong one would fail far from the mistake."""
    if not callable(fn):
        raise WorkflowCodeError(f"{what}: the function must be callable, got {fn!r}")
    if compensate is not None and not callable(compensate):
        raise WorkflowCodeError(f"{what}: compensate must be callable, got {compensate!r}")
    if retry is not None and not isinstance(retry, Retry):
        raise WorkflowCodeError(f"{what}: retry must be a flowly.Retry, got {retry!r}")


# names key a btree index (run id, name), whose entries must stay under about 2.7 kB; the
# database enforces the same limit (max_name_bytes())
_MAX_NAME_BYTES = 1000
# how long a write waits before it tries a busy run again, at first and at most
_BUSY_PAUSE_FIRST, _BUSY_PAUSE_MAX = 0.02, 1.0


# what is kept of a failure's message (its head) and of its traceback (its tail): an
# exception carrying a whole response body would otherwise be stored once per attempt
_MESSAGE_CHARS = _TRACEBACK_CHARS = 8000


def error_info(exc: BaseException) -> dict[str, Any]:
    """The JSON stored for a failure: exception type, a bounded message and traceback."""
    tb = "".join(traceback.format_exception(exc))
    try:
        message = str(exc)
    except BaseException as unprintable:  # its own __str__ failed, with whatever it raised
        message = f"<{type(exc).__qualname__}: str() raised {unprintable!r}>"
    if len(message) > _MESSAGE_CHARS:
        message = (f"{message[:_MESSAGE_CHARS]} [message cut:"
                   f" {len(message) - _MESSAGE_CHARS:,} more characters]")
    return {"type": type(exc).__qualname__, "message": jsonb_safe_text(message),
            "traceback": jsonb_safe_text(tb[-_TRACEBACK_CHARS:])}


def cancel_requested(exc: BaseException) -> bool:
    """Whether ``exc`` is this task being cancelled (lease lost, cancel, shutdown), rather than
    a CancelledError that user code raised or let escape from a future of its own; the
    latter is an ordinary failure of the step, body or compensation."""
    task = asyncio.current_task()
    return isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling() > 0


def serialise_output(value: Any, owner: str, max_bytes: int) -> str:
    """JSON text of a step's or workflow's output; a clear error naming ``owner`` if it has
    none, or if it is larger than ``max_bytes``."""
    try:
        text = dumps(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise StepOutputNotSerializable(
            f"{owner} returned a {type(value).__name__} that is not JSON serialisable: {exc}"
        ) from exc
    size = utf8_size(text)
    if size > max_bytes:
        raise OutputTooLarge(
            f"{owner} returned {size:,} bytes of JSON; the limit is {max_bytes:,}"
            " (Worker max_output_bytes): store large data elsewhere and return a reference")
    return text


def now() -> datetime:
    return datetime.now(UTC)


async def call_user_function(store: RunStore, fn: Callable[..., Any], *args: Any) -> Any:
    """Await an async callable on the loop; run a sync one on the worker's threads.

    Async callables (``async def``, also behind functools.partial or as an async
    ``__call__``) get no thread hop; a sync callable that returns an awaitable (a lambda
    around an async call) has that awaitable awaited on the loop.
    """
    with user_code():
        if is_async(fn):
            return await fn(*args)
        result = await store.call_blocking(fn, *args)
        if inspect.isawaitable(result):
            return await result
        return result


class UserCodeFailed(Exception):
    """What user code run inside an engine call raised (a transactional step's function):
    carried past run_write, which would otherwise take a user's OSError or lock timeout for
    the database failing, so that it fails the step like any step's exception."""

    def __init__(self, error: Exception) -> None:
        super().__init__(type(error).__qualname__)
        self.error = error


class RefusedWrite(Exception):
    """The database refused a write for what it held (a value it cannot store, a limit), as
    opposed to a lost lease, a busy row or a failed connection."""


async def run_write(
    run_id: str, call: Callable[[], Awaitable[T]], *, refused_raises: bool = False,
    interrupted: Callable[[Interrupt], Interrupt] | None = None,
) -> T:
    """Make one engine call for run ``run_id``, and sort out how it failed.

    A busy run (its row locked elsewhere, a lost serialization race) is tried again after a
    pause that grows, holding no connection meanwhile; a stale lease ends the body
    (LeaseLostInterrupt); a failed connection abandons the run until its lease expires
    (RunAbandoned). What user code inside the call raised (:class:`UserCodeFailed`) is raised
    as itself. Any other database error refused the call for its content: it is raised
    as :class:`RefusedWrite` (a step fails with it, without retries), or as itself with
    ``refused_raises`` (a sleep or a start the body asked for). An interrupt is passed through
    ``interrupted`` (the body's context, which remembers it) before it is raised.
    """
    pause = _BUSY_PAUSE_FIRST
    while True:
        try:
            return await call()
        except UserCodeFailed as failed:
            # raised below, outside this handler, which would otherwise become its context
            user_error = failed.error
        except LeaseLost as exc:
            lost = LeaseLostInterrupt(str(exc))
            raise (interrupted(lost) if interrupted else lost) from None
        except Exception as exc:
            if is_contention(exc):
                await asyncio.sleep(pause)
                pause = min(pause * 2, _BUSY_PAUSE_MAX)
                continue
            if is_connection_failure(exc):
                # not this run's fault: another try after the lease expires may succeed
                abandoned = RunAbandoned(f"run {run_id}: {exc}")
                raise (interrupted(abandoned) if interrupted else abandoned) from exc
            if refused_raises or isinstance(exc, RefusedWrite):
                raise
            raise RefusedWrite(str(exc)) from exc
        raise user_error


NOT_RETRYABLE = (WorkflowCodeError, StepOutputNotSerializable, OutputTooLarge, InvalidArgument,
                 RefusedWrite)
"""Failures that every attempt would meet again: no retry, the run fails (or compensates)."""


class _Call:
    """The awaitable a ``ctx`` call returns; it notes whether the body awaited it."""

    __slots__ = ("awaited", "coroutine", "label")

    def __init__(self, label: str, coroutine: Coroutine[Any, Any, Any]) -> None:
        self.label = label
        self.coroutine = coroutine
        self.awaited = False

    def __await__(self) -> Generator[Any, None, Any]:
        self.awaited = True
        return engine_await(self.coroutine.__await__())


class _DefaultName:
    """A name made by counting (a child's id, a repeated wait's record): as counted in the
    branch the call was made in, and as counted across the body before branches counted
    apart, which runs recorded before then still replay with."""

    __slots__ = ("body_wide", "per_branch")

    def __init__(self, per_branch: str, body_wide: str) -> None:
        self.per_branch = per_branch
        self.body_wide = body_wide


# the call each kind of record comes from, as an error names it
_KIND_CALLS = {"step": "a step", "transaction": "a transaction", "timer": "a sleep",
               "start": "a child's start", "event": "a wait for an event",
               "run": "a wait for a run"}


def _record_name(kind: str, key: str) -> str:
    """The step name under which a run records what it observed (a child it started, an
    event, another run's outcome): readable, or a digest of ``key`` when too long."""
    name = f"{kind}:{key}"
    if len(name.encode("utf-8", "surrogatepass")) <= _MAX_NAME_BYTES:
        return name
    return f"{kind}:sha256:{hashlib.sha256(key.encode('utf-8', 'surrogatepass')).hexdigest()}"


def _fitted_id(run_id: str, workflow: str) -> str:
    """A default child id as made (``<parent id>:<workflow>:<n>``), or its digest when that
    is longer than an id may be: each level of a chain of children adds to its parent's id,
    and an id the engine made must not be refused as too long."""
    encoded = run_id.encode("utf-8", "surrogatepass")
    if len(encoded) <= _MAX_NAME_BYTES:
        return run_id
    digest = f"sha256:{hashlib.sha256(encoded).hexdigest()}"
    named = f"{workflow}:{digest}"
    return named if len(named.encode("utf-8", "surrogatepass")) <= _MAX_NAME_BYTES else digest


class Context:
    """Handed to a workflow body as ``ctx``; one per execution of a run."""

    def __init__(
        self,
        *,
        run_id: str,
        workflow: str,
        attempt: int,
        generation: int,
        store: RunStore,
        history: ReplayLog,
        compensating: bool,
        default_retry: Retry,
        max_output_bytes: int,
        undone: Mapping[str, int] | None = None,
    ) -> None:
        self.run_id = run_id
        # how many times a compensation undid each step, in earlier generations
        self._undone: Mapping[str, int] = undone or {}
        self.max_output_bytes = max_output_bytes
        self.workflow = workflow
        self.attempt = attempt
        self.generation = generation
        self.history = history
        self._store = store
        self._default_retry = default_retry
        # why steps must stop executing: the decision a failed step got, 'retry' (the run was
        # released), 'compensate' (the saga runs) or 'dead_letter'
        self._halted: str | None = "compensate" if compensating else None
        # failed steps whose decision is being asked for: nothing new starts meanwhile
        self._deciding = 0
        self.compensations: dict[str, Callable[..., Any]] = {}
        self._names_used: set[str] = set()
        # calls counted for default names: per (branch path, key), and across the body as
        # runs recorded before flowly.branches count them (None: not asked yet)
        self._branch_counts: dict[tuple[tuple[int, ...], str], int] = {}
        self._body_counts: dict[str, int] = {}
        self._body_wide_names: bool | None = None if history.may_have_records else False
        # steps executing their function or checkpoint, and steps anywhere past their replay
        # check (failing included): a failure waits for the first to reach 0 before it decides
        # the run's fate, and the worker waits for the second before it compensates
        self._executing = 0
        self._in_flight = 0
        # set when any of those counts changes, for whoever waits on them (made on demand:
        # most executions never wait)
        self._changed: asyncio.Event | None = None
        self._calls: list[_Call] = []
        # the waits this execution reached that must wait (the run is parked on them)
        self.waiting: list[str] = []
        # the sleep this execution reached whose wake time is ahead: (name, wake time, position)
        self.sleeping: tuple[str, datetime, int] | None = None
        # the first interrupt (sleep, wait, lost lease or connection) a call raised in each
        # task of the body: that task is over even if it caught the interrupt (a bare
        # except), so its later calls raise it again rather than start what the run is not
        # to run now; the body's other tasks go on (steps beside a wait) until the body ends
        self._interrupts: dict[asyncio.Task[Any] | None, Interrupt] = {}
        # set once the body ended: a call from a task it left running starts nothing
        self._ended: Interrupt | None = None

    @property
    def decided(self) -> str | None:
        """What a failed step decided for the run, if one did: "retry" (the database released
        the run until its backoff ends) or what its saga must do."""
        return self._halted

    def idempotency_key(self, step: str) -> str:
        """A key that is the same on every attempt and replay of ``step`` in this run.

        Steps are at-least-once: pass this to external APIs so they de-duplicate a call
        repeated after a crash between the side effect and the checkpoint. A step whose effect
        a compensation undid, and that runs again in a generation ``retry_dead_letter``
        started, must not be de-duplicated against the undone call: its key then ends in
        ``:g2`` (then ``:g3``, one more per undoing). Any other step keeps its key across
        generations, so a call repeated after a timeout or a failure is still recognised.
        """
        undone = self._undone.get(step, 0)
        if undone == 0:
            return f"{self.run_id}:{step}"
        return f"{self.run_id}:{step}:g{undone + 1}"

    def _claim_name(self, name: str) -> int:
        """Reserve ``name`` for this execution; returns its position in the body."""
        if not isinstance(name, str) or not name:
            raise WorkflowCodeError(
                f"step and sleep names must be non-empty strings, got {name!r}")
        try:
            size: int | None = len(name.encode("utf-8"))
        except UnicodeEncodeError:  # an unpaired surrogate
            size = None
        if size is None or size > _MAX_NAME_BYTES or "\x00" in name:
            raise WorkflowCodeError(f"step or sleep name {name[:80]!r} must be text of at"
                                    f" most {_MAX_NAME_BYTES} bytes with no NUL character")
        if name in self._names_used:
            raise WorkflowCodeError(
                f"name {name!r} is used twice in run {self.run_id}: every step and sleep of a"
                " run needs its own name, since checkpoints are keyed by it"
            )
        self._names_used.add(name)
        return len(self._names_used)

    def _replayed(self, name: str, entry: Entry | None, kind: str) -> Entry | None:
        """The record of ``name``, if any, once it is known that the same kind of call made it.

        Records of every kind share one name space (a step "x" and a sleep "x", a step
        "event:go" and the wait for event "go"). A body that reaches a recorded name with
        another kind of call than its earlier executions did (new code deployed under a run
        in flight, a branch on something not recorded) would otherwise be handed the other
        call's record, or write a second one beside it: a mistake of the code, which every
        attempt would make again."""
        if entry is None or entry.kind == kind:
            return entry
        raise WorkflowCodeError(
            f"record {name!r} of run {self.run_id} was recorded by {_KIND_CALLS[entry.kind]},"
            f" but the workflow now reaches it as {_KIND_CALLS[kind]}: a replay must make"
            " the same kind of call under a name as the run's earlier executions did")

    def _track(self, label: str, coroutine: Coroutine[Any, Any, T]) -> Awaitable[T]:
        call = _Call(label, coroutine)
        self._calls.append(call)
        return call

    def unawaited(self) -> list[str]:
        """The calls the body made without awaiting them (closed here, so they never run)."""
        missing = [call for call in self._calls if not call.awaited]
        for call in missing:
            call.coroutine.close()
        return [call.label for call in missing]

    def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        compensate: Callable[[Any], Any] | None = None,
        retry: Retry | None = None,
    ) -> Awaitable[Any]:
        """Run ``fn(*args)`` once for this run and return its (JSON) output.

        A step with a checkpoint returns the stored output without running. A failure is
        retried per ``retry`` (backoff decided by the database; the run is released in
        between); when attempts run out, ``compensate(output)`` of every completed step runs
        in reverse order and the run lands in ``dead_letter``. The output must be JSON
        serialisable; the value returned is the one stored (so replays see the same thing).
        Steps running in parallel (``asyncio.gather``) when one fails are waited for first,
        so every step that completed is checkpointed, and compensated, before the saga.
        """
        label = f"step {name!r}"  # made once: the checks, the tracking and the output name it
        _check_step(label, fn, compensate, retry)
        return self._track(label, self._step(name, label, fn, args, compensate, retry))

    def _step(
        self, name: str, label: str, fn: Callable[..., Any], args: tuple[Any, ...],
        compensate: Callable[[Any], Any] | None, retry: Retry | None,
    ) -> Coroutine[Any, Any, Any]:
        async def execute(started_at: datetime, position: int) -> tuple[Any, int]:
            result = await call_user_function(self._store, fn, *args)
            payload = serialise_output(result, label, self.max_output_bytes)
            return await self._write(lambda: self._store.checkpoint(
                name, payload, started_at, compensate is not None, position))

        # _run_step's coroutine itself, not one awaiting it: a layer less at every resume
        return self._run_step(name, compensate, retry, "step", execute)

    def transaction(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        isolation: Isolation | None = None,
        compensate: Callable[[Any, Any], Any] | None = None,
        retry: Retry | None = None,
    ) -> Awaitable[Any]:
        """Run ``fn(conn, *args)`` inside the transaction that also writes this step's
        checkpoint: its database effects and the checkpoint commit together or not at all,
        so they happen exactly once. ``conn`` is a psycopg connection (async for an async
        ``fn``, sync for a sync one, which runs on a thread) from the worker's pool, with the
        application's search_path; the transaction first locks the run and checks the lease,
        so a worker that lost the run commits nothing. ``isolation`` is ``"read committed"``
        (default), ``"repeatable read"`` or ``"serializable"``: a serialization failure or
        deadlock starts a fresh transaction, a few times, before the step fails through
        ``retry``. ``compensate(conn, output)`` runs in a transaction of its own that also
        records its outcome. The output must be JSON, as for :meth:`step`. What ``fn`` sets
        for its session (``SET`` without ``LOCAL``) ends with the step: the worker sets the
        connection back before it serves anything else.
        """
        if isolation is not None and isolation not in ISOLATION_LEVELS:
            raise WorkflowCodeError(f"transaction {name!r}: isolation must be one of"
                                    f" {', '.join(ISOLATION_LEVELS)}, got {isolation!r}")
        label = f"transaction {name!r}"
        _check_step(label, fn, compensate, retry)
        return self._track(label, self._transaction(name, fn, args, isolation, compensate, retry))

    async def _transaction(
        self, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
        isolation: Isolation | None, compensate: Callable[[Any, Any], Any] | None,
        retry: Retry | None,
    ) -> Any:
        async def execute(started_at: datetime, position: int) -> tuple[Any, int]:
            return await self._write(lambda: self._store.transaction(
                name, fn, args, isolation, started_at, compensate is not None, position,
                self.max_output_bytes), refused_raises=True)

        return await self._run_step(name, compensate, retry, "transaction", execute)

    async def _run_step(
        self, name: str, compensate: Callable[..., Any] | None, retry: Retry | None,
        kind: str, execute: Callable[[datetime, int], Awaitable[tuple[Any, int]]],
    ) -> Any:
        """Replay a step, or execute it and checkpoint it, failing it per its retry policy."""
        position = self._claim_name(name)
        if compensate is not None:
            self.compensations[name] = compensate
        stored = self.history.peek(name)  # no call, and no await, for a run's new steps
        if stored is UNREAD:
            stored = await self._write(lambda: self.history.get(name))
        try:
            stored = self._replayed(name, stored, kind)
        except WorkflowCodeError:
            # the saga must not call this compensation for the other kind of record
            self.compensations.pop(name, None)
            raise
        if isinstance(stored, StoredStep):
            if stored.status == "completed":
                return stored.output
            raise CompensateInterrupt("compensate")
        if self._deciding or self._halted is not None or self._interrupts or self._ended:
            await self._stop_if_ended()
        self._store.check_lease()

        policy = retry or self._default_retry
        started_at = now()
        self._in_flight += 1
        self._executing += 1
        executing = True
        try:
            try:
                output, seq = await execute(started_at, position)
            except Interrupt:
                raise
            except BaseException as exc:  # a poison step fails its run, never the worker
                if cancel_requested(exc):
                    raise
                # an output that was refused (not JSON, too large, not storable), a mistake
                # in the code: no retry can change it
                retryable = not isinstance(exc, NOT_RETRYABLE)
                self._executing -= 1
                executing = False
                self._notify()
                await self._fail_step(name, exc, started_at, policy, retryable, position)
            self.history.record(name, StoredStep("completed", output, seq, compensate is not None,
                                                 position=position, kind=kind))
            return output
        finally:
            self._in_flight -= 1
            if executing:
                self._executing -= 1
            self._notify()

    async def _fail_step(
        self, name: str, exc: BaseException, started_at: datetime, policy: Retry,
        retryable: bool, position: int,
    ) -> NoReturn:
        """Store a failed attempt (once parallel siblings settled) and end the body."""
        await self._until(lambda: self._executing == 0)
        cause = exc.__cause__ if isinstance(exc, RefusedWrite) and exc.__cause__ else exc
        error = error_info(cause)
        self._deciding += 1
        try:
            decision = await self._write(lambda: self._store.fail_step(
                name, error, started_at, policy, retryable, position))
        finally:
            self._deciding -= 1
            self._notify()
        self._halted = decision
        if decision == "retry":
            raise RetryInterrupt(name) from None
        raise CompensateInterrupt(decision) from None

    async def _stop_if_ended(self) -> None:
        """End the body if a failed step decided the run's fate, waiting for a decision being
        asked for, or if a call interrupted it: a step, sleep, wait or child that would start
        after it must not (a sibling that started before the failure was decided is waited
        for and joins the saga)."""
        await self._until(lambda: self._deciding == 0)
        self._raise_if_decided()
        interrupt = self._ended or self._interrupts.get(asyncio.current_task())
        if interrupt is not None:
            raise interrupt.again()

    def _raise_if_decided(self) -> None:
        if self._halted == "retry":
            raise RetryInterrupt(self._halted)
        if self._halted is not None:
            raise CompensateInterrupt(self._halted)

    def end(self) -> None:
        """The body returned or raised: from now on no call starts anything (one from a task
        the body left running), while the worker acts on how the body ended."""
        self._ended = LeaseLostInterrupt(f"run {self.run_id}: its body ended")

    def raise_if_interrupted(self) -> None:
        """For a body that returned: raise what must end the run instead of its output, a
        failed step's decision or the first interrupt any of its tasks met, which the body
        caught (a bare except, ``gather(..., return_exceptions=True)``)."""
        self._raise_if_decided()
        for interrupt in self._interrupts.values():
            raise interrupt.again()

    def _interrupt(self, interrupt: Interrupt) -> Interrupt:
        """``interrupt``, remembered as the running task's if it is its first."""
        self._interrupts.setdefault(asyncio.current_task(), interrupt)
        return interrupt

    async def settled(self) -> None:
        """Wait until no step of this execution is running or failing (the body ended, but
        parallel steps it left may still be finishing)."""
        await self._until(lambda: self._in_flight == 0)

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()

    def sleep(self, name: str, seconds: float | timedelta) -> Awaitable[None]:
        """Sleep durably for ``seconds``, measured from the first time this sleep is reached.

        The wake time is stored once; the run is released while it sleeps and resumes at
        that time, on any worker, even after restarts.
        """
        delay = code_checked(arguments.seconds_ahead, f"sleep {name!r}", seconds)
        return self._track(f"sleep {name!r}", self._sleep(name, None, delay))

    def sleep_until(self, name: str, when: datetime) -> Awaitable[None]:
        """Sleep durably until ``when`` (a timezone-aware datetime)."""
        code_checked(arguments.aware_time, f"sleep_until {name!r}: 'when'", when)
        return self._track(f"sleep {name!r}", self._sleep(name, when, None))

    async def _sleep(self, name: str, wake_at: datetime | None, seconds: float | None) -> None:
        position = self._claim_name(name)
        timer = self._replayed(name, await self._write(lambda: self.history.get(name)), "timer")
        if isinstance(timer, StoredTimer) and timer.due:
            return
        await self._stop_if_ended()
        # the wake time is stored now, as the sleep is reached; the worker releases the run
        # once the steps running beside it landed (under a release their checkpoints would be
        # stale, and they would run again)
        stored_wake_at, ahead = await self._registered(
            lambda: self._store.sleep(name, wake_at, seconds, position, False))
        if ahead:
            self.sleeping = (name, stored_wake_at, position)
            raise self._interrupt(SleepInterrupt(name))
        self.history.record(name, StoredTimer(stored_wake_at, True))

    def start(
        self,
        workflow: str | WorkflowFn,
        input: Any = None,
        run_id: str | None = None,
        **options: Any,
    ) -> Awaitable[str]:
        """Start another run and return its id; the same id on every replay.

        Without ``run_id`` the child's id is derived from this run's id, the workflow name and
        how many runs of that workflow this branch of the body started before (see
        :mod:`flowly.branches`): ``<run id>:<workflow>:<n>`` in the body's own task,
        ``<run id>:<workflow>:<branch>/<n>`` in a task it created; an id that would be longer
        than 1,000 bytes (a deep chain of children) is ``<workflow>:sha256:<its digest>``.
        The id that ``start`` returned (the child's, or the live run holding its concurrency
        key) is recorded in this run's steps in the same transaction, and replays return the
        record. ``workflow`` is a name or a decorated function; ``options`` are those of
        :meth:`flowly.Client.start` (queue, priority, ...), over the child workflow's own
        defaults when it is registered in this process.
        """
        return self._track(f"start of {workflow!r}", self._start(
            workflow, input, run_id, options, self._child_id(workflow)))

    def _child_id(self, workflow: str | WorkflowFn) -> _DefaultName | None:
        """The default id of a child of ``workflow`` started here (counted as the call is
        made, in the branch making it); None for a workflow ``_start`` refuses."""
        try:
            name, _ = lookup(workflow)
        except TypeError:
            return None

        def child_id(path: tuple[int, ...], count: int) -> str:
            at = f"{branch_label(path)}/{count}" if path else str(count)
            return _fitted_id(f"{self.run_id}:{name}:{at}", name)

        return self._counted(name, child_id)

    async def _start(
        self, workflow: str | WorkflowFn, input: Any, run_id: str | None, options: dict[str, Any],
        default_id: _DefaultName | None,
    ) -> str:
        unknown = set(options) - START_OPTIONS
        if unknown:
            raise WorkflowCodeError(f"unknown start option(s): {', '.join(sorted(unknown))}")
        try:
            name, defaults = lookup(workflow)
        except TypeError as exc:  # a function that is not a registered workflow
            raise WorkflowCodeError(str(exc)) from None
        assert default_id is not None  # made for every workflow lookup knows
        child_id = run_id or await self._named(default_id)
        record = _record_name("start", child_id)
        position = self._claim_name(record)
        stored = self._replayed(record, await self._write(lambda: self.history.get(record)),
                                "start")
        if isinstance(stored, StoredStep):
            return str(stored.output)
        await self._stop_if_ended()
        started = await self._write(lambda: self._store.start_run(
            name, input, child_id, options, defaults, record, position), refused_raises=True)
        self.history.record(record, StoredStep("completed", started, 0, position=position,
                                               kind="start"))
        return started

    def wait_for_event(self, name: str, timeout: float | timedelta | None = None
                       ) -> Awaitable[Any]:
        """The payload of the next event ``name`` sent to this run (``flowly.send_event``).

        An event sent before the wait is not lost; each wait consumes one, oldest first. The
        run holds no worker while it waits and wakes as soon as the event is sent. After
        ``timeout`` (measured from the first time the wait is reached) it raises
        :class:`flowly.EventTimeout`. The outcome is recorded, so a replay sees the same.
        """
        code_checked(arguments.text, "event name", name)
        seconds = None if timeout is None else code_checked(
            arguments.seconds_ahead, f"timeout of wait for event {name!r}", timeout)
        return self._track(f"wait for event {name!r}", self._wait_for_event(
            name, seconds, self._wait_record("event", name)))

    async def _wait_for_event(self, name: str, timeout: float | None, record: _DefaultName
                              ) -> Any:
        outcome = await self._wait_outcome(
            "event", record,
            lambda record, position: self._store.wait_for_event(record, name, timeout, position),
            lambda answer: {"payload": answer[1]} if answer[0] == "received" else {"timeout": True})
        if "payload" not in outcome:
            raise EventTimeout(f"no event {name!r} within {timeout}s")
        return outcome["payload"]

    def wait_for_run(self, run_id: str) -> Awaitable[Any]:
        """The output of run ``run_id`` once it completed; raises :class:`flowly.ChildFailed`
        if it ended ``dead_letter`` or ``cancelled``. The run holds no worker while it waits
        and wakes when the other run finishes. The outcome is recorded once."""
        code_checked(arguments.text, "the run_id waited for", run_id)
        return self._track(f"wait for run {run_id!r}", self._wait_for_run(
            run_id, self._wait_record("run", run_id)))

    async def _wait_for_run(self, run_id: str, record: _DefaultName) -> Any:
        if run_id == self.run_id:
            # it would park until the year 9999 (a ctx.run(run_id=ctx.run_id) comes here too)
            raise WorkflowCodeError(f"run {run_id} cannot wait for itself")
        outcome = await self._wait_outcome(
            "run", record,
            lambda record, position: self._store.wait_for_run(record, run_id, position),
            lambda answer: {"status": answer[1], "output": answer[2], "error": answer[3]})
        if outcome["status"] != "completed":
            raise ChildFailed(run_id, outcome["status"], outcome["error"])
        return outcome["output"]

    def run(self, workflow: str | WorkflowFn, input: Any = None, run_id: str | None = None,
            **options: Any) -> Awaitable[Any]:
        """Start another run and wait for its output: :meth:`start` then :meth:`wait_for_run`."""
        default_id = self._child_id(workflow)

        async def start_and_wait() -> Any:
            child = await self._start(workflow, input, run_id, options, default_id)
            return await self._wait_for_run(child, self._wait_record("run", child))

        return self._track(f"run of {workflow!r}", start_and_wait())

    async def _wait_outcome(
        self, kind: str, name: _DefaultName,
        register: Callable[[str, int], Awaitable[tuple[Any, ...]]],
        outcome_of: Callable[[tuple[Any, ...]], dict[str, Any]],
    ) -> dict[str, Any]:
        """The outcome of a wait (for an event or a run): as recorded, or as the database
        answers ``register``; a wait that must go on parks the run (WaitInterrupt)."""
        record = await self._named(name)
        position = self._claim_name(record)
        stored = self._replayed(record, await self._write(lambda: self.history.get(record)),
                                kind)
        if isinstance(stored, StoredStep):
            recorded: dict[str, Any] = stored.output
            return recorded
        await self._stop_if_ended()
        answer = await self._registered(lambda: register(record, position))
        if answer[0] == "waiting":
            self.waiting.append(record)
            raise self._interrupt(WaitInterrupt(record))
        outcome = outcome_of(answer)
        self.history.record(record, StoredStep("completed", outcome, 0, position=position,
                                               kind=kind))
        return outcome

    def _wait_record(self, kind: str, key: str) -> _DefaultName:
        """The record of a wait for ``key`` made here: the first in the body's own task is
        ``<kind>:<key>``, the n-th ``<kind>:<key>#n``; in a task the body created,
        ``<kind>:<key>#<branch>/<n>``."""
        # a '#' of the key doubled, so that a '#' the count adds is never part of a key: the
        # first wait for event "go#2" and the second for "go" are recorded apart
        escaped = key.replace("#", "##")

        def record(path: tuple[int, ...], count: int) -> str:
            if path:
                return _record_name(kind, f"{escaped}#{branch_label(path)}/{count}")
            return _record_name(kind, escaped if count == 1 else f"{escaped}#{count}")

        return self._counted(f"{kind}:{key}", record)

    def _counted(self, key: str, name: Callable[[tuple[int, ...], int], str]) -> _DefaultName:
        """Count one more call for ``key`` in the running branch, and across the body."""
        path = current_path()
        in_branch = self._branch_counts.get((path, key), 0) + 1
        self._branch_counts[(path, key)] = in_branch
        in_body = self._body_counts.get(key, 0) + 1
        self._body_counts[key] = in_body
        return _DefaultName(name(path, in_branch), name((), in_body))

    async def _named(self, name: _DefaultName) -> str:
        """The name to use: counted per branch, unless the run was recorded before that."""
        if name.per_branch == name.body_wide:
            return name.per_branch
        if self._body_wide_names is None:
            self._body_wide_names = await self._write(self._store.records_predate_branch_names)
        return name.body_wide if self._body_wide_names else name.per_branch

    async def _registered(self, call: Callable[[], Awaitable[T]]) -> T:
        """A wait's or a sleep's engine call, counted as in flight so the run is parked (or
        released) only once every wait and sleep of a parallel fan-in was stored: a parked
        run wakes at the earliest of them."""
        self._in_flight += 1
        try:
            return await self._write(call, refused_raises=True)
        finally:
            self._in_flight -= 1
            self._notify()

    def _write(
        self, call: Callable[[], Awaitable[T]], *, refused_raises: bool = False
    ) -> Coroutine[Any, Any, T]:
        return run_write(self.run_id, call, refused_raises=refused_raises,
                         interrupted=self._interrupt)
