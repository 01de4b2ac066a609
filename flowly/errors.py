"""Named exceptions for the engine's SQL errors.

The PL/pgSQL functions raise domain errors with their own SQLSTATEs (class ``WF``);
:func:`translate` turns a psycopg error carrying one of them into the matching exception
below, so callers can ``except flowly.RunNotFound`` instead of parsing messages.
"""

from __future__ import annotations

import psycopg


class FlowlyError(Exception):
    """Base class of every error flowly raises."""


class LeaseLost(FlowlyError):
    """SQLSTATE WF001: the worker's fencing token for a run is stale.

    Another worker took the run over (this one was paused past its lease), or the run was
    cancelled, timed out or released. Nothing was written; the worker drops the run.
    """


class RunNotFound(FlowlyError, LookupError):
    """SQLSTATE WF002: no run has the given id."""


class InvalidArgument(FlowlyError, ValueError):
    """SQLSTATE WF003: an argument to an engine function is out of range or malformed."""


class InvalidState(FlowlyError):
    """SQLSTATE WF004: the run is not in a state that allows the operation."""


class RunBusy(FlowlyError):
    """SQLSTATE WF005: another transaction holds the run's row; try again.

    The engine never queues behind a lock on a run (an operator's open transaction, say):
    the worker retries the write shortly, and an operator's ``cancel`` gives up after its
    lock timeout with this error instead of hanging.
    """


class WorkflowCodeError(FlowlyError, ValueError):
    """The workflow's code misuses flowly: a step name used twice, a step, sleep or start not
    awaited, an unknown start option, a body that does not take ``(ctx, input)``.

    Every attempt would fail alike, so the run fails at once, without retries.
    """


class UnknownWorkflow(FlowlyError, LookupError):
    """A workflow name is not registered in this process."""


class StepOutputNotSerializable(FlowlyError, TypeError):
    """A step returned a value that cannot be stored as JSON."""


class OutputTooLarge(FlowlyError, ValueError):
    """A step's or workflow's output is larger than the worker's ``max_output_bytes``.

    Checked before anything is sent, so one huge value never stalls a batch of checkpoints;
    the run fails without retries (the same step would return the same size again).
    """


class EventTimeout(FlowlyError):
    """``ctx.wait_for_event`` reached its timeout with no event. An ordinary exception: the
    workflow may catch it; a replay raises it again at the same place."""


class ChildFailed(FlowlyError):
    """The run ``ctx.wait_for_run`` waited for ended ``dead_letter`` or ``cancelled``."""

    def __init__(self, run_id: str, status: str, error: object) -> None:
        message = error.get("message") if isinstance(error, dict) else error
        super().__init__(f"run {run_id} ended {status}" + (f": {message}" if message else ""))
        self.run_id = run_id
        self.status = status
        self.error = error


class SchemaError(FlowlyError):
    """The flowly schema is missing, outdated, or its name is unusable."""


class SchemaNotInstalled(SchemaError):
    """The database (or the chosen schema) has no flowly installed; run ``flowly install``."""


class RunTimeout(FlowlyError, TimeoutError):
    """A wait for a run ended before the run reached the awaited status."""


class DatabaseTimeout(FlowlyError, TimeoutError):
    """A client's call was not done within the client's ``timeout``.

    Either the server ended the statement at the timeout (it waited, most often for a lock
    another session holds): the call took no effect, as the message says; or the database
    did not answer at all, and the client gave up a second later: whether the call took
    effect is then unknown (the server may have committed it and hung before answering), so
    make it again once the database answers; a start with a ``run_id`` returns the run it
    already made.
    """


_BY_SQLSTATE: dict[str, type[FlowlyError]] = {
    "WF001": LeaseLost,
    "WF002": RunNotFound,
    "WF003": InvalidArgument,
    "WF004": InvalidState,
    "WF005": RunBusy,
}


# PostgreSQL's statement_too_complex: from an engine call, a value (an input, a payload)
# nested deeper than the server's parser takes (max_stack_depth; about 10,000 levels at 2 MB)
_TOO_DEEP = "54001"


def translate(error: psycopg.Error) -> Exception:
    """Return the named exception for a psycopg error raised by an engine function.

    Errors without one of flowly's SQLSTATEs are returned unchanged, but for a value nested
    too deeply for the server, which is the caller's InvalidArgument.
    """
    message = error.diag.message_primary or str(error)
    if error.sqlstate == _TOO_DEEP:
        cls: type[FlowlyError] | None = InvalidArgument
        message = f"a value nests too deeply for the database to store: {message}"
    else:
        cls = _BY_SQLSTATE.get(error.sqlstate or "")
    if cls is None:
        return error
    translated = cls(message)
    translated.__cause__ = error
    return translated
