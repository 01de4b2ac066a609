"""Clients: start, inspect, wait for, cancel and retry runs from application code.

:class:`Client` (blocking) and :class:`AsyncClient` share the statements in :mod:`flowly.db`
and the row mapping here. ``start(..., conn=app_conn)`` runs on the caller's own connection
and so commits or rolls back with the caller's transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import threading
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from . import arguments
from .bounded_calls import Cutoff, shut_down, within
from .config import checked_dsn, resolve_dsn
from .db import (
    TERMINAL,
    Calls,
    adapt_connection,
    check_schema_name,
    connect_params,
    dumps_argument,
    listen_to,
    purge_age_interval,
    schema_identifier,
    seconds_interval,
    set_up_session,
    set_up_session_async,
    still_open,
    translated_errors,
)
from .errors import (
    DatabaseTimeout,
    FlowlyError,
    InvalidArgument,
    InvalidState,
    RunNotFound,
    RunTimeout,
)
from .schedules import Schedule, ScheduleCalls, schedule_calls, schedule_params, to_schedule
from .workflow import WorkflowFn, lookup_argument, start_params

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Run:
    """A run as stored in ``runs``."""

    id: str
    workflow: str
    queue: str
    status: str
    input: Any
    output: Any
    error: Any
    priority: int
    attempt: int
    max_attempts: int
    concurrency_key: str | None
    parent_run_id: str | None
    compensation_ok: bool | None
    scheduled_for: datetime
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    locked_by: str | None
    locked_until: datetime | None
    # 1, plus one per retry_dead_letter (idempotency keys name it from 2 on)
    generation: int = 1
    # takeovers in a row from workers that stopped heartbeating (PoisonRun at max_takeovers)
    takeovers: int = 0

    @property
    def done(self) -> bool:
        """Whether the run reached a terminal status."""
        return self.status in TERMINAL


@dataclass(frozen=True)
class Step:
    """A step outcome as stored in ``steps``."""

    name: str
    seq: int
    status: str
    output: Any
    error: Any
    attempts: int
    started_at: datetime
    finished_at: datetime
    compensable: bool
    compensation_status: str | None
    compensation_error: Any
    compensated_at: datetime | None
    # where the body reached it ('step', or 'start' for the record of a child run it started)
    position: int | None = None
    kind: str = "step"

    @property
    def duration(self) -> timedelta:
        return self.finished_at - self.started_at


@dataclass(frozen=True)
class Timer:
    """A durable timer of a run, as stored in ``timers``."""

    name: str
    wake_at: datetime
    created_at: datetime
    fired_at: datetime | None


@dataclass(frozen=True)
class StepAttempt:
    """A failed attempt of a step and the retry the database decided for it."""

    step_name: str
    generation: int
    attempt: int
    error: Any
    started_at: datetime
    failed_at: datetime
    retry_at: datetime | None


def _from_row(cls: type[Any], row: dict[str, Any]) -> Any:
    return cls(**{f.name: row[f.name] for f in fields(cls)})


def _run_id(value: Any) -> str:
    """A run id as the database keys runs: text (an order id passed as an int would reach
    the server as a number and fail there as a missing function)."""
    return arguments.text("run_id", value)


def _wait_args(status: str | Collection[str] | None, timeout: float | None
               ) -> tuple[Collection[str], float | None]:
    return (arguments.statuses("status", status) or TERMINAL,
            arguments.seconds("timeout", timeout, zero=True))


def _event_args(run_id: Any, name: Any, payload: Any) -> tuple[str, str, str]:
    return (_run_id(run_id), arguments.text("event name", name),
            dumps_argument(payload, "event payload"))


def _purge_args(older_than: Any, statuses: Any, batch: Any) -> tuple[str, list[str], int]:
    return (purge_age_interval(arguments.age("older_than", older_than)),
            list(arguments.statuses("statuses", statuses, TERMINAL) or ()),
            arguments.int4("batch", batch))


def _served_args(workflow: Any, queue: Any) -> tuple[str, str]:
    return arguments.text("workflow", workflow), arguments.text("queue", queue)


def _schedule_name(name: Any) -> tuple[str]:
    return (arguments.text("schedule name", name),)


def _cron_next_args(cron: Any, after: datetime | None, timezone: Any) -> tuple[Any, ...]:
    return (arguments.text("cron", cron),
            None if after is None else arguments.aware_time("after", after),
            arguments.text("timezone", timezone))


# statuses no engine call moves a run out of (retry_dead_letter moves a dead_letter run on)
_FINAL = ("completed", "cancelled")


def _reached(run: Run, wanted: Collection[str]) -> bool:
    """Whether ``wait`` is over: the run is in a wanted status. A run in a final status that
    is not wanted can never reach one, which raises :class:`InvalidState` rather than waiting
    until the timeout (or for ever)."""
    if run.status in wanted:
        return True
    if run.status in _FINAL:
        raise InvalidState(f"run {run.id} ended {run.status}; it can never be"
                           f" {' or '.join(sorted(wanted))}")
    return False


_POLL_FIRST, _POLL_MAX = 0.02, 0.5


def _poll_pauses(timeout: float | None) -> Iterator[float]:
    """The pauses of ``wait`` between two looks at a run: doubling from 20 ms to 0.5 s, cut
    short at the deadline, ending there."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = _POLL_FIRST
    while True:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            pause = min(pause, left)
        yield pause
        pause = min(pause * 2, _POLL_MAX)


# A wait listens only while it waits. A backend left listening is sent every finished-run
# NOTIFY of the database; with its client reading none, it stalls once the socket is full, and
# the server's notification queue, shared by every session, cannot be cleared past it: it
# grows until NOTIFY fails everywhere. A listener that cannot be told to stop is closed.
_UNLISTEN = sql.SQL("unlisten *")


def _until_finished(listener: psycopg.Connection[Any], run_id: str, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for the NOTIFY that says ``run_id`` finished."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        for notice in listener.notifies(timeout=left, stop_after=1):
            if notice.payload == run_id:
                return


async def _until_finished_async(listener: psycopg.AsyncConnection[Any], run_id: str,
                                timeout: float) -> None:
    """See :func:`_until_finished`."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        async for notice in listener.notifies(timeout=left, stop_after=1):
            if notice.payload == run_id:
                return


# how long past its timeout a wait may go on for the database's answer before it is cut off
_ANSWER_GRACE = 1.0
_CONNECT = connect_params("client")
# times a call on a client's own connection is made in all when it loses a serialization race:
# where the database's default isolation is stricter than READ COMMITTED, its one statement
# may be chosen to fail for another transaction's sake (40001), and nothing of it committed
_SERIALIZATION_TRIES = 3


def _connect_bound(timeout: float | None) -> dict[str, Any]:
    """libpq's bound on opening a connection for a client with this timeout (whole seconds,
    2 at least: libpq's own floor)."""
    return {} if timeout is None else {"connect_timeout": max(2, math.ceil(timeout))}


def _unanswered_message(timeout: float) -> str:
    return (f"the database did not answer within the client's timeout ({timeout:g}s); whether"
            " the call took effect is unknown: make it again once the database answers")


# The client's own connection has the server end a statement still running at the client's
# timeout (most often one waiting for a lock an open transaction holds), so that the call
# takes no effect, rather than one the client gave up on committing later. The client itself
# gives up _ANSWER_GRACE later, on a server that does not answer at all.
_BOUND_STATEMENTS = "select set_config('statement_timeout', %s, false)"


def _busy_message(timeout: float) -> str:
    return (f"the client's connection stayed busy with other calls for the client's timeout"
            f" ({timeout:g}s); the call was not made, so it took no effect: make it again")


async def _take_turn(turn: asyncio.Lock, timeout: float | None) -> bool:
    """Take ``turn`` within ``timeout`` seconds (None: however long it takes); whether it was
    taken (asyncio.Lock gives a turn handed over as its waiter was cancelled to the next)."""
    try:
        async with asyncio.timeout(timeout):
            await turn.acquire()
    except TimeoutError:
        return False
    return True


def _statement_timeout(timeout: float) -> str:
    return f"{math.ceil(timeout * 1000)}ms"


def _ended_by_timeout(exc: psycopg.Error, deadline: float) -> bool:
    """Whether the server ended the statement at the client's timeout (statement_timeout),
    not at an operator's request: told by the time (``deadline`` on the monotonic clock),
    since the server's words are in its language."""
    return isinstance(exc, psycopg.errors.QueryCanceled) and time.monotonic() >= deadline


def _ended_message(timeout: float) -> str:
    return (f"the database did not complete the call within the client's timeout"
            f" ({timeout:g}s) and ended it (it was most likely waiting for a lock another"
            " session holds): the call took no effect; make it again")


def _closed_error() -> psycopg.OperationalError:
    return psycopg.OperationalError("the client is closed: the call was not made")


def _closed_under_wait() -> psycopg.OperationalError:
    return psycopg.OperationalError("the client was closed while this wait was under way")


def _silent_message(run_id: str, timeout: float) -> str:
    return (f"run {run_id}: the database did not answer within {timeout}s"
            f" (and {_ANSWER_GRACE:g}s of grace)")


def _timeout_message(run: Run, timeout: float | None, served: bool | None) -> str:
    message = f"run {run.id} is still {run.status} after {timeout}s"
    if served is False:
        message += (f": no live worker serves workflow {run.workflow!r} on queue {run.queue!r}"
                    " (start a worker with --app for it, or check its --queue)")
    return message


_WARN_EVERY = 60.0
"""Seconds between two warnings of one client about the same unserved workflow and queue."""


def _unserved_note(warned: dict[tuple[str, str], float], run_id: str, workflow: str,
                   queue: str) -> None:
    """Log that nobody serves the run, once a minute per workflow and queue (a loop of starts
    while the workers are down must not flood the log)."""
    now = time.monotonic()
    last = warned.get((workflow, queue))
    if last is not None and now - last < _WARN_EVERY:
        return
    warned[(workflow, queue)] = now
    logger.warning("run %s: no live worker serves workflow %r on queue %r right now; the run"
                   " waits until one does", run_id, workflow, queue)


# -- list_runs: its since= forms and a query with only the filters given ----------------------

_AGE = re.compile(r"(\d+(?:\.\d+)?)\s*(s|m|h|d|w)")
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}

Since = datetime | timedelta | str


def parse_since(since: Since) -> datetime | timedelta:
    """``since`` as a point in time or an age: a datetime (local time when naive), a
    timedelta, or text: an age like ``10m``, ``2h``, ``1d`` (units s, m, h, d, w) or an ISO
    8601 time. Raises :class:`InvalidArgument` for anything else, and for an age that
    reaches before the year 1 (or, negative, past the year 9999)."""
    if isinstance(since, timedelta):
        return _checked_age(since, since)
    if isinstance(since, datetime):
        return _aware(since)
    if not isinstance(since, str):
        raise InvalidArgument(f"since: expected a datetime, a timedelta or text like 10m,"
                              f" got {type(since).__name__}")
    text = since.strip()
    match = _AGE.fullmatch(text)
    if match:
        try:
            age = timedelta(seconds=float(match[1]) * _AGE_UNITS[match[2]])
        except OverflowError:
            raise InvalidArgument(f"since: {since!r} reaches before the year 1") from None
        return _checked_age(age, since)
    try:
        point = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidArgument(f"since: expected an age like 10m, 2h, 1d or an ISO time,"
                              f" got {since!r}") from None
    return _aware(point)


def _checked_age(age: timedelta, since: Since) -> timedelta:
    """``age``, if it reaches back to a time of the calendar: the database failed on one
    that did not (a date or interval out of range), and the CLI, which counts it back from
    now, refused it as reaching before the year 1."""
    try:
        datetime.now(UTC) - age
    except OverflowError:
        where = "before the year 1" if age > timedelta(0) else "past the year 9999"
        raise InvalidArgument(f"since: {since!r} reaches {where}") from None
    return age


def _aware(point: datetime) -> datetime:
    """``point`` in the local time zone when it is naive. At the ends of the calendar, where
    that zone moves it out of datetime's range (0001-01-01 in UTC is the year 0), it is read
    in UTC instead: no run was made within a day of either end."""
    if point.tzinfo is not None:
        return point
    try:
        return point.astimezone()
    except (ValueError, OverflowError):
        return point.replace(tzinfo=UTC)


# what a listing without data reads of a run: every field of Run but its input and output
_RUN_WITHOUT_DATA = sql.SQL(", ").join(
    [sql.Identifier(f.name) for f in fields(Run) if f.name not in ("input", "output")]
    + [sql.SQL("null::jsonb as input, null::jsonb as output")])


def list_runs_query(
    schema: str, *, status: str | None = None, workflow: str | None = None,
    since: Since | None = None, limit: int = 100, data: bool = True,
) -> tuple[sql.Composed, dict[str, Any]]:
    """The ``list_runs`` select with a condition for each filter given and none for the others,
    so the planner can use the indexes on ``runs`` (a ``%s is null or ...`` pattern cannot);
    without ``data``, it reads no input or output."""
    conditions: list[sql.Composable] = []
    params: dict[str, Any] = {"limit": arguments.limit(limit)}
    if status is not None:
        conditions.append(sql.SQL("status = %(status)s"))
        params["status"] = arguments.status("status", status)
    if workflow is not None:
        conditions.append(sql.SQL("workflow = %(workflow)s"))
        params["workflow"] = arguments.text("workflow", workflow)
    if since is not None:
        point = parse_since(since)
        if isinstance(point, timedelta):  # an age counts on the database's clock, like delay=
            params["since"] = seconds_interval(point)
            conditions.append(sql.SQL("created_at >= now() - %(since)s::interval"))
        else:
            params["since"] = point
            conditions.append(sql.SQL("created_at >= %(since)s::timestamptz"))
    where = sql.SQL(" where ") + sql.SQL(" and ").join(conditions) if conditions else sql.SQL("")
    query = sql.SQL("select {} from {}.runs{} order by created_at desc, id limit %(limit)s").format(
        sql.SQL("*") if data else _RUN_WITHOUT_DATA, schema_identifier(check_schema_name(schema)),
        where)
    return query, params


def _check_connection(conn: object, expected: type, client: str) -> None:
    """Refuse a ``conn=`` that is not a connection of the client's kind (an async one given to
    the sync Client, a cursor, a DSN), before anything is sent: psycopg's own error, raised
    half-way through, named neither ``conn`` nor what it should have been."""
    if not isinstance(conn, expected):
        raise InvalidArgument(f"conn: {client} takes a psycopg.{expected.__name__},"
                              f" got {type(conn).__module__}.{type(conn).__qualname__}")


class Client:
    """Blocking client over one autocommit connection (opened lazily).

    ``timeout``: how many seconds a call may wait for the database (None, the default: as
    long as it takes). A call on the client's own connection not done in time raises
    :class:`DatabaseTimeout`: the server ends a statement still running at the timeout (its
    ``statement_timeout`` is set on that connection), so the call took no effect; a database
    that does not answer at all (the server, a pooler or the path to them hangs) is given up
    a second later, and the connection dropped, to be opened again by the next call. Calls
    made in the caller's transaction (``conn=``) are the caller's to bound; :meth:`wait`
    takes its own timeout. Threads sharing the client take turns on its connection, and a
    call's timeout counts from its turn: a call whose turn does not come within it is not
    made (:class:`DatabaseTimeout` says so).
    """

    def __init__(self, dsn: str | None = None, *, schema: str = "flowly",
                 timeout: float | None = None) -> None:
        self.dsn = checked_dsn(resolve_dsn() if dsn is None else dsn)
        self.calls = Calls(schema)
        self.timeout = arguments.statement_seconds("timeout", timeout)
        self._conn: psycopg.Connection[dict[str, Any]] | None = None
        # the connection whose statements the server ends at the timeout (_BOUND_STATEMENTS)
        self._bounded: psycopg.Connection[Any] | None = None
        # the turn on self._conn: held by the call under way on it, so that a call's timeout
        # and Cutoff start once the connection is its own (a Cutoff that came while the call
        # still queued would end another thread's call), and close() leaves that call alone
        self._calls = threading.Lock()
        self._closed = False
        # Each wait under way reads and LISTENs on a connection of its own, so that a wait
        # cut off at its timeout, or ended by close(), ends no other thread's call (a call
        # queued behind another on self._conn could only be cut off with it). Kept idle, not
        # listening, for the next wait.
        self._wait_conns = threading.Lock()
        self._idle_waits: list[psycopg.Connection[Any]] = []
        self._busy_waits: set[psycopg.Connection[Any]] = set()
        self._listen_statement: sql.Composed | None = None
        self._warned: dict[tuple[str, str], float] = {}

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the client, at once. A call under way on its connection (in another thread)
        ends as it would have, its outcome told to its caller, and the connection is closed
        as it ends: closed under it, the call would fail with its effect unknown. A wait
        under way ends at once with ``psycopg.OperationalError`` ("the client was closed
        while this wait was under way"): it changes nothing. A call still waiting for its
        turn, and every later call, is not made: ``psycopg.OperationalError`` says the client
        is closed."""
        with self._wait_conns:
            self._closed = True
            idle, self._idle_waits = self._idle_waits, []
            busy = list(self._busy_waits)
        for conn in busy:
            shut_down(conn)  # its wait closes it
        for conn in idle:
            conn.close()
        self._close_if_no_call()

    def _close_if_no_call(self) -> None:
        """Close the client's own connection unless a call holds the turn on it: that call
        does as its turn ends (_end_turn). Either the turn is free here, or its holder sees
        _closed set once it lets the turn go."""
        if self._calls.acquire(blocking=False):
            try:
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
            finally:
                self._calls.release()

    def _end_turn(self) -> None:
        self._calls.release()
        if self._closed:
            self._close_if_no_call()

    @property
    def connection(self) -> psycopg.Connection[dict[str, Any]]:
        """The client's own connection, opened if need be (``psycopg.OperationalError`` once
        the client is closed)."""
        if self._closed:
            raise _closed_error()
        conn = self._conn
        if conn is None or not still_open(conn):
            if conn is not None:
                conn.close()
            conn = self._conn = psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row,
                                                **_CONNECT, **_connect_bound(self.timeout))
            adapt_connection(conn)
            set_up_session(conn)
        if self.timeout is not None and self._bounded is not conn:
            # made on self._conn, so that a caller's Cutoff can cut it off if it hangs
            conn.execute(_BOUND_STATEMENTS, (_statement_timeout(self.timeout),))
            self._bounded = conn
        return conn

    def _fetch(self, query: Any, params: Any, conn: psycopg.Connection[Any] | None = None
               ) -> list[dict[str, Any]]:
        if conn is not None:
            _check_connection(conn, psycopg.Connection, "Client")
            with translated_errors(self.calls.schema), conn.cursor(row_factory=dict_row) as cursor:
                return cursor.execute(query, params).fetchall()
        # threads sharing the client take turns here, not in psycopg's lock (see _calls)
        if not self._calls.acquire(timeout=-1 if self.timeout is None else self.timeout):
            assert self.timeout is not None
            raise DatabaseTimeout(_busy_message(self.timeout))
        try:
            if self._closed:
                raise _closed_error()
            if self.timeout is None:
                with translated_errors(self.calls.schema):
                    return self._fetch_own(query, params)
            return self._fetch_bounded(query, params, self.timeout)
        finally:
            self._end_turn()

    def _fetch_bounded(self, query: Any, params: Any, timeout: float) -> list[dict[str, Any]]:
        """A call on the client's own connection, ended by the server at ``timeout`` or cut
        off a second later."""
        deadline = time.monotonic() + timeout
        with Cutoff(lambda: (self._conn,)) as cutoff:
            cutoff.arm(timeout + _ANSWER_GRACE)
            try:
                with translated_errors(self.calls.schema):
                    return self._fetch_own(query, params)
            except psycopg.errors.QueryCanceled as exc:
                if _ended_by_timeout(exc, deadline):
                    raise DatabaseTimeout(_ended_message(timeout)) from exc
                raise
            except psycopg.OperationalError as exc:
                # cut off, or a connection that could not be made in time (libpq's
                # connect_timeout counts whole seconds); an error the server sent is its own
                late = exc.sqlstate is None and time.monotonic() >= deadline
                if not (cutoff.expired or late):
                    raise
                silence = exc
        # disarmed: the connection may be closed now
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        raise DatabaseTimeout(_unanswered_message(timeout)) from silence

    def _fetch_own(self, query: Any, params: Any) -> list[dict[str, Any]]:
        """A call on the client's own connection, made again if it lost a serialization race
        (see _SERIALIZATION_TRIES)."""
        for _ in range(_SERIALIZATION_TRIES - 1):
            with contextlib.suppress(psycopg.errors.SerializationFailure):
                return self.connection.execute(query, params).fetchall()
        return self.connection.execute(query, params).fetchall()

    def start(
        self,
        workflow: str | WorkflowFn,
        input: Any = None,
        *,
        run_id: str | None = None,
        conn: psycopg.Connection[Any] | None = None,
        **options: Any,
    ) -> str:
        """Start a run and return its id (the existing run's id if it already exists).

        ``options``: queue, priority, scheduled_for (a timezone-aware datetime) or delay
        (seconds or timedelta, on the database's clock), concurrency_key, max_attempts,
        timeout (seconds or timedelta). With ``conn``, the run is created in that
        connection's current transaction and is only visible to workers once the caller
        commits.
        """
        name, defaults = lookup_argument("workflow", workflow)
        params = start_params(name, input, run_id, options, defaults)
        row = self._fetch(self.calls.start_and_served, params, conn)[0]
        if not row["served"]:
            _unserved_note(self._warned, row["start"], name, params["queue"])
        return str(row["start"])

    def get(self, run_id: str) -> Run:
        """The run with this id; :class:`RunNotFound` if there is none."""
        rows = self._fetch(self.calls.get_run, (_run_id(run_id),))
        if not rows:
            raise RunNotFound(f"run {run_id} not found")
        return _from_row(Run, rows[0])  # type: ignore[no-any-return]

    def steps(self, run_id: str) -> list[Step]:
        """The run's step outcomes in the order they were reached."""
        rows = self._fetch(self.calls.get_steps, (_run_id(run_id),))
        return [_from_row(Step, row) for row in rows]

    def timers(self, run_id: str) -> list[Timer]:
        """The run's durable timers."""
        rows = self._fetch(self.calls.get_timers, (_run_id(run_id),))
        return [_from_row(Timer, row) for row in rows]

    def failed_attempts(self, run_id: str) -> list[StepAttempt]:
        """Every failed step attempt of the run, oldest first."""
        rows = self._fetch(self.calls.get_step_attempts, (_run_id(run_id),))
        return [_from_row(StepAttempt, row) for row in rows]

    def is_served(self, workflow: str, queue: str = "default") -> bool:
        """Whether a live worker serves ``workflow`` on ``queue`` right now."""
        return bool(self._fetch(self.calls.is_served, _served_args(workflow, queue))[0]["exists"])

    def wait(
        self, run_id: str, status: str | Collection[str] | None = None,
        timeout: float | None = None,
    ) -> Run:
        """Wait until the run reaches ``status`` (default: any terminal status): woken by the
        NOTIFY its finishing sends, with polling (every 0.5 s at most) as the fallback.

        Raises :class:`RunTimeout` after ``timeout`` seconds (also when the database stops
        answering: the wait's own connection is cut off a second later), and
        :class:`InvalidState` as soon as the run ended ``completed`` or ``cancelled`` when that
        is not a status waited for (it can never reach one; a ``dead_letter`` run may still be
        retried). :meth:`close` ends it with ``psycopg.OperationalError``."""
        wanted, timeout = _wait_args(status, timeout)
        if self._closed:
            raise _closed_error()
        # the wait's connection, in a list: one the server ends is replaced under way
        own = [self._take_wait_connection(timeout)]
        in_order = False
        try:
            if timeout is None:
                run = self._wait(own, run_id, wanted, None)
            else:
                run = self._wait_bounded(own, run_id, wanted, timeout)
            in_order = True
            return run
        except FlowlyError as exc:
            # the wait's own verdict (its connection stopped listening), not a cut-off one
            in_order = not isinstance(exc.__cause__, psycopg.Error)
            raise
        except psycopg.Error as exc:
            if self._closed:
                raise _closed_under_wait() from exc
            raise
        finally:
            self._give_back_wait_connection(own[0], in_order and not self._closed)

    def _wait_bounded(self, own: list[psycopg.Connection[Any]], run_id: str,
                      wanted: Collection[str], timeout: float) -> Run:
        """The wait with a timeout: a database that stops answering (the bytes acknowledged,
        so no TCP timeout notices) must not hold the caller past it, so the wait's own
        connection (no other) is cut off a second later."""
        with Cutoff(lambda: own) as cutoff:
            cutoff.arm(timeout + _ANSWER_GRACE)
            try:
                return self._wait(own, run_id, wanted, timeout)
            except psycopg.Error as exc:
                if not cutoff.expired or self._closed:
                    raise
                raise RunTimeout(_silent_message(run_id, timeout)) from exc

    def _wait(self, own: list[psycopg.Connection[Any]], run_id: str, wanted: Collection[str],
              timeout: float | None) -> Run:
        run = self._read_run(own[0], run_id)
        if _reached(run, wanted):
            return run
        self._listen_on(own[0])
        try:
            run = self._watch(own, run_id, wanted, timeout)
        except FlowlyError:  # RunTimeout, InvalidState: the connection is sound
            own[0].execute(_UNLISTEN)
            raise
        own[0].execute(_UNLISTEN)
        return run

    def _watch(self, own: list[psycopg.Connection[Any]], run_id: str, wanted: Collection[str],
               timeout: float | None) -> Run:
        """Read the run at every NOTIFY of a finished run, or pause of the polling, until it
        reached a wanted status; RunTimeout at the timeout."""
        pauses = _poll_pauses(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._closed:  # a connection made as close() came
                raise _closed_under_wait()
            # read again once listening: a finish before the LISTEN notified nobody here
            run = self._read_run(own[0], run_id)
            if _reached(run, wanted):
                break
            pause = next(pauses, None)
            if pause is None:
                served = (bool(self._fetch(self.calls.is_served, (run.workflow, run.queue),
                                           own[0])[0]["exists"])
                          if run.status == "pending" else None)
                raise RunTimeout(_timeout_message(run, timeout, served))
            try:
                _until_finished(own[0], run_id, pause)
            except psycopg.OperationalError:
                # shut down by close(), or past the deadline by the wait's Cutoff; else the
                # server ended it (idle_session_timeout ends a listener that waits longer,
                # as does a pooler or a restart): listen anew, read again
                if (self._closed or not own[0].closed
                        or (deadline is not None and time.monotonic() >= deadline)):
                    raise
                own[0] = self._replace_wait_connection(own[0], timeout)
                self._listen_on(own[0])
        return run

    def _read_run(self, conn: psycopg.Connection[Any], run_id: str) -> Run:
        rows = self._fetch(self.calls.get_run, (_run_id(run_id),), conn)
        if not rows:
            raise RunNotFound(f"run {run_id} not found")
        return _from_row(Run, rows[0])  # type: ignore[no-any-return]

    def _listen_on(self, conn: psycopg.Connection[Any]) -> None:
        """LISTEN for finished runs on a wait's connection (see _UNLISTEN)."""
        if self._listen_statement is None:
            row = conn.execute(self.calls.finished_channel).fetchone()
            assert row is not None
            self._listen_statement = listen_to(row[0])
        conn.execute(self._listen_statement)

    def _take_wait_connection(self, timeout: float | None) -> psycopg.Connection[Any]:
        """An idle wait connection still open, or a new one: made within about ``timeout``
        (libpq counts whole seconds) so that a database that hangs does not hold the wait
        past it."""
        with self._wait_conns:
            while self._idle_waits:
                conn = self._idle_waits.pop()
                if still_open(conn):
                    self._busy_waits.add(conn)
                    return conn
                conn.close()
        bound = (_connect_bound(self.timeout) if timeout is None
                 else {"connect_timeout": max(2, math.ceil(timeout + _ANSWER_GRACE))})
        conn = psycopg.connect(self.dsn, autocommit=True, **_CONNECT, **bound)
        adapt_connection(conn)
        with self._wait_conns:
            self._busy_waits.add(conn)
        try:
            set_up_session(conn)
        except BaseException:
            self._give_back_wait_connection(conn, False)
            raise
        return conn

    def _give_back_wait_connection(self, conn: psycopg.Connection[Any], reusable: bool) -> None:
        """The end of a wait: its connection, no longer listening, is kept for the next one;
        closed when the wait ended in disorder (cut off: it may hang, or still listen) or
        the client was closed meanwhile."""
        with self._wait_conns:
            self._busy_waits.discard(conn)
            if reusable and not conn.closed:
                self._idle_waits.append(conn)
                return
        conn.close()

    def _replace_wait_connection(self, conn: psycopg.Connection[Any],
                                 timeout: float | None) -> psycopg.Connection[Any]:
        self._give_back_wait_connection(conn, False)
        return self._take_wait_connection(timeout)

    def cancel(self, run_id: str) -> str:
        """Cancel an unfinished run; returns its status afterwards."""
        return str(self._fetch(self.calls.cancel, (_run_id(run_id),))[0]["cancel"])

    def retry_dead_letter(self, run_id: str) -> str:
        """Restart a dead-lettered run from its last good checkpoint."""
        rows = self._fetch(self.calls.retry_dead_letter, (_run_id(run_id),))
        return str(rows[0]["retry_dead_letter"])

    def send_event(self, run_id: str, name: str, payload: Any = None, *,
                   conn: psycopg.Connection[Any] | None = None) -> int:
        """Send event ``name`` with a JSON ``payload`` to a run (its next
        ``ctx.wait_for_event(name)`` receives it); returns the event's sequence number.
        ``conn`` joins the caller's transaction."""
        rows = self._fetch(self.calls.send_event, _event_args(run_id, name, payload), conn)
        return int(rows[0]["send_event"])

    def purge(self, older_than: float | timedelta, *, statuses: Collection[str] = TERMINAL,
              batch: int = 1000) -> int:
        """Delete runs that finished (with one of ``statuses``) over ``older_than`` ago, with
        their steps, attempts and timers, ``batch`` runs per transaction so live work never
        waits long; returns how many were deleted. Unfinished runs are never touched."""
        args = _purge_args(older_than, statuses, batch)
        total = 0
        while (deleted := int(self._fetch(self.calls.purge, args)[0]["purge"])) > 0:
            total += deleted
        return total

    def list_runs(
        self, *, status: str | None = None, workflow: str | None = None,
        since: Since | None = None, limit: int = 100, data: bool = True,
    ) -> list[Run]:
        """Runs, newest first, filtered by status, workflow and creation time.

        ``since``: a datetime, a timedelta (created within that age), or text: an age like
        ``10m``, ``2h``, ``1d`` or an ISO 8601 time. ``data=False`` leaves out each run's
        input and output (they are None): a listing that shows neither then costs the same
        whatever their size, and needs no right to read those two columns.
        """
        query, params = list_runs_query(self.calls.schema, status=status, workflow=workflow,
                                        since=since, limit=limit, data=data)
        return [_from_row(Run, row) for row in self._fetch(query, params)]

    def dead_letters(self, *, workflow: str | None = None, limit: int = 100) -> list[Run]:
        """Runs in ``dead_letter``, newest first."""
        return self.list_runs(status="dead_letter", workflow=workflow, limit=limit)

    # -- cron schedules (flowly.schedules) ------------------------------------------------------

    def schedule(
        self, name: str, cron: str, workflow: str | WorkflowFn, input: Any = None, *,
        timezone: str = "UTC", queue: str | None = None, priority: int = 0,
        missed: str = "skip", overlap: str = "allow", max_attempts: int | None = None,
    ) -> Schedule:
        """Create or replace (by name) a schedule that starts ``workflow`` with ``input`` at
        every fire time of ``cron`` (five fields or a macro such as ``@daily``) in
        ``timezone`` (an IANA name). ``missed``: ``skip`` or ``run_once`` (fire times the
        workers were down for); ``overlap``: ``allow`` or ``skip`` (a fire time while the
        previous run is unfinished). A bad expression or zone raises :class:`InvalidArgument`
        naming it. Queue and max_attempts default to the workflow's registration."""
        params = schedule_params(name, cron, workflow, input, timezone=timezone, queue=queue,
                                 priority=priority, missed=missed, overlap=overlap,
                                 max_attempts=max_attempts)
        return to_schedule(self._fetch(self._schedule_calls.schedule, params)[0])

    def unschedule(self, name: str) -> bool:
        """Delete a schedule (its runs stay); whether there was one."""
        rows = self._fetch(self._schedule_calls.unschedule, _schedule_name(name))
        return bool(rows[0]["removed"])

    def pause_schedule(self, name: str) -> Schedule:
        """Stop firing a schedule until :meth:`resume_schedule`."""
        return to_schedule(self._fetch(self._schedule_calls.pause, _schedule_name(name))[0])

    def resume_schedule(self, name: str) -> Schedule:
        """Fire a paused schedule again, from its next fire time after now."""
        return to_schedule(self._fetch(self._schedule_calls.resume, _schedule_name(name))[0])

    def schedules(self) -> list[Schedule]:
        """Every schedule, by name."""
        return [to_schedule(row) for row in self._fetch(self._schedule_calls.list, None)]

    def cron_next(self, cron: str, after: datetime | None = None,
                  timezone: str = "UTC") -> datetime | None:
        """The first fire time of ``cron`` in ``timezone`` strictly after ``after`` (default:
        now), as the schedules compute it."""
        rows = self._fetch(self._schedule_calls.cron_next, _cron_next_args(cron, after, timezone))
        return rows[0]["fire_at"]  # type: ignore[no-any-return]

    @property
    def _schedule_calls(self) -> ScheduleCalls:
        return schedule_calls(self.calls.schema)


class AsyncClient:
    """The asyncio twin of :class:`Client` (``timeout`` likewise)."""

    def __init__(self, dsn: str | None = None, *, schema: str = "flowly",
                 timeout: float | None = None) -> None:
        self.dsn = checked_dsn(resolve_dsn() if dsn is None else dsn)
        self.calls = Calls(schema)
        self.timeout = arguments.statement_seconds("timeout", timeout)
        self._conn: psycopg.AsyncConnection[dict[str, Any]] | None = None
        self._bounded: psycopg.AsyncConnection[Any] | None = None
        # the waits read here, not on self._conn, where they could queue behind a call held
        # up by a lock (one task's wait must end at its timeout, and no other task's call)
        self._reader: psycopg.AsyncConnection[Any] | None = None
        self._listener: psycopg.AsyncConnection[Any] | None = None
        self._listen_statement: sql.Composed | None = None
        self._waits = 0  # waits under way that listen on self._listener
        self._listening = asyncio.Lock()
        self._calls = asyncio.Lock()  # the turn on self._conn (see Client._calls)
        # the event loop the connections and the locks above belong to
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._warned: dict[tuple[str, str], float] = {}

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """See :meth:`Client.close`."""
        self._closed = True
        await self._drop_waits()
        if not self._calls.locked():  # else the call under way closes it as its turn ends
            await self._drop_own()

    async def _drop_own(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    async def _drop_waits(self) -> None:
        waits = (self._reader, self._listener)
        self._reader = self._listener = None
        for conn in waits:
            if conn is not None:
                await conn.close()

    async def _drop_connections(self) -> None:
        await self._drop_own()
        await self._drop_waits()

    async def _follow_loop(self) -> None:
        """Connections made in an event loop that has ended (``asyncio.run`` called again
        with this client, as tests and command lines do) belong to it, as does the lock of the
        waits: make new ones in the running loop. Closing the old ones needs no loop."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        self._loop = loop
        self._listening = asyncio.Lock()
        self._calls = asyncio.Lock()
        self._waits = 0  # those of the old loop ended with it
        await self._drop_connections()

    async def _fetch(self, query: Any, params: Any,
                     conn: psycopg.AsyncConnection[Any] | None = None) -> list[dict[str, Any]]:
        if conn is not None:
            _check_connection(conn, psycopg.AsyncConnection, "AsyncClient")
            with translated_errors(self.calls.schema):
                async with conn.cursor(row_factory=dict_row) as cursor:
                    return await (await cursor.execute(query, params)).fetchall()
        await self._follow_loop()
        # tasks sharing the client take turns here, not in psycopg's lock (see Client._calls)
        if not await _take_turn(self._calls, self.timeout):
            assert self.timeout is not None
            raise DatabaseTimeout(_busy_message(self.timeout))
        try:
            if self._closed:
                raise _closed_error()
            return await self._fetch_in_turn(query, params)
        finally:
            if self._closed:  # close() left the connection to the call under way on it
                await self._drop_own()
            self._calls.release()

    async def _fetch_in_turn(self, query: Any, params: Any) -> list[dict[str, Any]]:
        """A call on the client's own connection, bounded by the client's timeout."""
        if self.timeout is None:
            return await self._fetch_own(query, params)
        deadline = time.monotonic() + self.timeout
        try:
            return await within(self.timeout + _ANSWER_GRACE, self._fetch_own(query, params))
        except psycopg.errors.QueryCanceled as exc:
            if _ended_by_timeout(exc, deadline):
                raise DatabaseTimeout(_ended_message(self.timeout)) from exc
            raise
        except TimeoutError as exc:
            # the call was cancelled: psycopg closed the connection under a call that did not
            # end (the next call opens another)
            if isinstance(exc, FlowlyError):
                raise
            raise DatabaseTimeout(_unanswered_message(self.timeout)) from exc

    async def _fetch_own(self, query: Any, params: Any) -> list[dict[str, Any]]:
        """A call on the client's own connection, opened if need be."""
        with translated_errors(self.calls.schema):
            conn = self._conn
            if conn is None or not still_open(conn):
                if conn is not None:
                    await conn.close()
                conn = self._conn = await psycopg.AsyncConnection.connect(
                    self.dsn, autocommit=True, row_factory=dict_row, **_CONNECT,
                    **_connect_bound(self.timeout))
                adapt_connection(conn)
                await set_up_session_async(conn)
            if self.timeout is not None and self._bounded is not conn:
                await conn.execute(_BOUND_STATEMENTS, (_statement_timeout(self.timeout),))
                self._bounded = conn
            for _ in range(_SERIALIZATION_TRIES - 1):
                with contextlib.suppress(psycopg.errors.SerializationFailure):
                    return await (await conn.execute(query, params)).fetchall()
            return await (await conn.execute(query, params)).fetchall()

    async def start(
        self,
        workflow: str | WorkflowFn,
        input: Any = None,
        *,
        run_id: str | None = None,
        conn: psycopg.AsyncConnection[Any] | None = None,
        **options: Any,
    ) -> str:
        """See :meth:`Client.start`."""
        name, defaults = lookup_argument("workflow", workflow)
        params = start_params(name, input, run_id, options, defaults)
        row = (await self._fetch(self.calls.start_and_served, params, conn))[0]
        if not row["served"]:
            _unserved_note(self._warned, row["start"], name, params["queue"])
        return str(row["start"])

    async def get(self, run_id: str) -> Run:
        """See :meth:`Client.get`."""
        rows = await self._fetch(self.calls.get_run, (_run_id(run_id),))
        if not rows:
            raise RunNotFound(f"run {run_id} not found")
        return _from_row(Run, rows[0])  # type: ignore[no-any-return]

    async def steps(self, run_id: str) -> list[Step]:
        """See :meth:`Client.steps`."""
        rows = await self._fetch(self.calls.get_steps, (_run_id(run_id),))
        return [_from_row(Step, row) for row in rows]

    async def timers(self, run_id: str) -> list[Timer]:
        """See :meth:`Client.timers`."""
        rows = await self._fetch(self.calls.get_timers, (_run_id(run_id),))
        return [_from_row(Timer, row) for row in rows]

    async def failed_attempts(self, run_id: str) -> list[StepAttempt]:
        """See :meth:`Client.failed_attempts`."""
        rows = await self._fetch(self.calls.get_step_attempts, (_run_id(run_id),))
        return [_from_row(StepAttempt, row) for row in rows]

    async def is_served(self, workflow: str, queue: str = "default") -> bool:
        """See :meth:`Client.is_served`."""
        rows = await self._fetch(self.calls.is_served, _served_args(workflow, queue))
        return bool(rows[0]["exists"])

    async def wait(
        self, run_id: str, status: str | Collection[str] | None = None,
        timeout: float | None = None,
    ) -> Run:
        """See :meth:`Client.wait`."""
        wanted, timeout = _wait_args(status, timeout)
        await self._follow_loop()
        if self._closed:
            raise _closed_error()
        try:
            if timeout is None:
                return await self._wait(run_id, wanted, None)
            try:
                return await within(timeout + _ANSWER_GRACE,
                                    self._wait(run_id, wanted, timeout))
            except TimeoutError as exc:
                # cancelled: psycopg closed the wait's connection if its call did not end
                if isinstance(exc, FlowlyError):  # RunTimeout, or DatabaseTimeout of one call
                    raise
                raise RunTimeout(_silent_message(run_id, timeout)) from exc
        except psycopg.Error as exc:
            if self._closed:
                raise _closed_under_wait() from exc
            raise

    async def _read(self, query: Any, params: Any) -> list[dict[str, Any]]:
        """A read of a wait, on the waits' connection (opened if need be, unless the client
        was closed since the wait began)."""
        if self._closed:
            raise _closed_under_wait()
        conn = self._reader
        if conn is None or not still_open(conn):
            if conn is not None:
                await conn.close()
            conn = self._reader = await psycopg.AsyncConnection.connect(
                self.dsn, autocommit=True, **_CONNECT, **_connect_bound(self.timeout))
            adapt_connection(conn)
            await set_up_session_async(conn)
        return await self._fetch(query, params, conn)

    async def _read_run(self, run_id: str) -> Run:
        rows = await self._read(self.calls.get_run, (_run_id(run_id),))
        if not rows:
            raise RunNotFound(f"run {run_id} not found")
        return _from_row(Run, rows[0])  # type: ignore[no-any-return]

    async def _wait(self, run_id: str, wanted: Collection[str], timeout: float | None) -> Run:
        """See :meth:`Client._wait`."""
        run = await self._read_run(run_id)
        if _reached(run, wanted):
            return run
        pauses = _poll_pauses(timeout)
        listener: psycopg.AsyncConnection[Any] | None = await self._listen()
        try:
            while True:
                run = await self._read_run(run_id)
                if _reached(run, wanted):
                    break
                pause = next(pauses, None)
                if pause is None:
                    served = (bool((await self._read(self.calls.is_served,
                                                     (run.workflow, run.queue)))[0]["exists"])
                              if run.status == "pending" else None)
                    raise RunTimeout(_timeout_message(run, timeout, served))
                assert listener is not None
                try:
                    await _until_finished_async(listener, run_id, pause)
                except psycopg.OperationalError:
                    if not listener.closed or self._closed:
                        raise
                    await self._stop_listening(listener, orderly=False)
                    listener = None
                    listener = await self._listen()
        except BaseException as exc:
            if listener is not None:
                await self._stop_listening(listener, orderly=isinstance(exc, RunTimeout))
            raise
        assert listener is not None
        await self._stop_listening(listener, orderly=True)
        return run

    async def _listen(self) -> psycopg.AsyncConnection[Any]:
        """The listener connection (opened on first use), listening for finished runs: the
        first of the waits under way tells it to (see _UNLISTEN). Waits gathered on one client
        take turns here, so they share one listener and its LISTEN and UNLISTEN come in
        order."""
        async with self._listening:
            listener = self._listener
            opened = (listener is None or listener.closed
                      or not (self._waits or still_open(listener)))
            if opened:
                if listener is not None:
                    await listener.close()
                listener = self._listener = await psycopg.AsyncConnection.connect(
                    self.dsn, autocommit=True, **_CONNECT)
                adapt_connection(listener)
            assert listener is not None
            if opened or not self._waits:
                try:
                    if self._listen_statement is None:
                        cursor = await listener.execute(self.calls.finished_channel)
                        row = await cursor.fetchone()
                        assert row is not None
                        self._listen_statement = listen_to(row[0])
                    await listener.execute(self._listen_statement)
                except BaseException:
                    if not self._waits:
                        await self._drop_listener()
                    raise
            self._waits += 1
            return listener

    async def _stop_listening(self, listener: psycopg.AsyncConnection[Any],
                              orderly: bool) -> None:
        """The end of one wait: the last of those under way tells the listener to stop, or
        closes it when the wait ended in disorder (cut off: it may hang, or still listen)."""
        async with self._listening:
            self._waits -= 1
            if self._waits or listener is not self._listener:
                return
            if orderly:
                try:
                    await listener.execute(_UNLISTEN)
                    return
                except psycopg.Error:
                    pass
            await self._drop_listener()

    async def _drop_listener(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            await listener.close()

    async def cancel(self, run_id: str) -> str:
        """See :meth:`Client.cancel`."""
        return str((await self._fetch(self.calls.cancel, (_run_id(run_id),)))[0]["cancel"])

    async def retry_dead_letter(self, run_id: str) -> str:
        """See :meth:`Client.retry_dead_letter`."""
        rows = await self._fetch(self.calls.retry_dead_letter, (_run_id(run_id),))
        return str(rows[0]["retry_dead_letter"])

    async def send_event(self, run_id: str, name: str, payload: Any = None, *,
                         conn: psycopg.AsyncConnection[Any] | None = None) -> int:
        """See :meth:`Client.send_event`."""
        rows = await self._fetch(self.calls.send_event, _event_args(run_id, name, payload), conn)
        return int(rows[0]["send_event"])

    async def purge(self, older_than: float | timedelta, *,
                    statuses: Collection[str] = TERMINAL, batch: int = 1000) -> int:
        """See :meth:`Client.purge`."""
        args = _purge_args(older_than, statuses, batch)
        total = 0
        while (deleted := int((await self._fetch(self.calls.purge, args))[0]["purge"])) > 0:
            total += deleted
        return total

    async def list_runs(
        self, *, status: str | None = None, workflow: str | None = None,
        since: Since | None = None, limit: int = 100, data: bool = True,
    ) -> list[Run]:
        """See :meth:`Client.list_runs`."""
        query, params = list_runs_query(self.calls.schema, status=status, workflow=workflow,
                                        since=since, limit=limit, data=data)
        return [_from_row(Run, r) for r in await self._fetch(query, params)]

    async def dead_letters(self, *, workflow: str | None = None, limit: int = 100) -> list[Run]:
        """See :meth:`Client.dead_letters`."""
        return await self.list_runs(status="dead_letter", workflow=workflow, limit=limit)

    async def schedule(
        self, name: str, cron: str, workflow: str | WorkflowFn, input: Any = None, *,
        timezone: str = "UTC", queue: str | None = None, priority: int = 0,
        missed: str = "skip", overlap: str = "allow", max_attempts: int | None = None,
    ) -> Schedule:
        """See :meth:`Client.schedule`."""
        params = schedule_params(name, cron, workflow, input, timezone=timezone, queue=queue,
                                 priority=priority, missed=missed, overlap=overlap,
                                 max_attempts=max_attempts)
        return to_schedule((await self._fetch(self._schedule_calls.schedule, params))[0])

    async def unschedule(self, name: str) -> bool:
        """See :meth:`Client.unschedule`."""
        rows = await self._fetch(self._schedule_calls.unschedule, _schedule_name(name))
        return bool(rows[0]["removed"])

    async def pause_schedule(self, name: str) -> Schedule:
        """See :meth:`Client.pause_schedule`."""
        return to_schedule((await self._fetch(self._schedule_calls.pause, _schedule_name(name)))[0])

    async def resume_schedule(self, name: str) -> Schedule:
        """See :meth:`Client.resume_schedule`."""
        rows = await self._fetch(self._schedule_calls.resume, _schedule_name(name))
        return to_schedule(rows[0])

    async def schedules(self) -> list[Schedule]:
        """See :meth:`Client.schedules`."""
        return [to_schedule(r) for r in await self._fetch(self._schedule_calls.list, None)]

    async def cron_next(self, cron: str, after: datetime | None = None,
                        timezone: str = "UTC") -> datetime | None:
        """See :meth:`Client.cron_next`."""
        rows = await self._fetch(self._schedule_calls.cron_next,
                                 _cron_next_args(cron, after, timezone))
        return rows[0]["fire_at"]  # type: ignore[no-any-return]

    @property
    def _schedule_calls(self) -> ScheduleCalls:
        return schedule_calls(self.calls.schema)


__all__ = ["AsyncClient", "Client", "Run", "Step", "StepAttempt", "Timer", "list_runs_query",
           "parse_since"]
