"""A worker's first connection: wait for a database that cannot be reached yet.

A worker is often started beside its database (a compose file, a deploy that restarts both,
a server restarting for an upgrade); once serving, it rides out an outage, so it waits at
start-up too instead of exiting: every try that fails for a reason time may mend (nothing
listens yet, no route, a host name that does not resolve yet, the server starting up or
shutting down, no connection slot free, a role's connection limit reached) is logged and
tried again, 0.5 s after the first and doubling up to 10 s, until a try succeeds or the
worker is stopped. A refusal that waiting cannot mend (the database or the role does not
exist, authentication failed, an option libpq finds invalid) is raised at once, so a
mistyped DSN fails loudly instead of looping.

A refusal is judged by its SQLSTATE, not its words: a server speaks the language of its
lc_messages (German keeps the severity FATAL, Russian says ВАЖНО), and matching English text
let a German server's "too many connections" end the worker and a Russian server's "database
does not exist" keep it waiting for ever. libpq keeps only the text of a failed connection,
so the SQLSTATE is read from its trace of one more try (libpq 14 and later, on Linux, where
psycopg can trace); elsewhere the English text is all there is to go by.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import select
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import psycopg
from psycopg import pq
from psycopg.conninfo import make_conninfo

from ..bounded_calls import on_daemon_thread
from ..db import connect_params
from ..render import one_line

logger = logging.getLogger(__name__)

FIRST_DELAY = 0.5
LONGEST_DELAY = 10.0

# SQLSTATEs of a server's refusals that time may mend: cannot_connect_now (starting up, shutting
# down, in recovery, not accepting connections yet), the server shutting down or crashing as
# the session started, and class 53, insufficient resources (too_many_connections: no slot
# free, a role's or a database's connection limit reached; out of memory or disk)
_REFUSED_FOR_NOW = frozenset({"57P01", "57P02", "57P03"})
_RESOURCES_SHORT = "53"
# libpq (14 and later) traces each message it reads, an ErrorResponse's fields quoted one by
# one: the severity (S, then V, the same not translated), then the SQLSTATE (C)
_TRACED_REFUSAL = re.compile(rb'\tErrorResponse\t S "[^"\n]*"(?: V "[^"\n]*")? C "([0-9A-Z]{5})"')
# how long the try that reads the SQLSTATE may take (a server that answered a moment ago)
_PROBE_SECONDS = 10.0

# Where the refusal cannot be read from a trace: what a server says, in English, when it
# refuses a connection for now
_REFUSALS_FOR_NOW = (
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "the database system is not yet accepting connections",
    "the database system is not accepting connections",
    "sorry, too many clients already",
    "too many connections for",  # a role's or a database's connection limit, reached
    "remaining connection slots are reserved",
)


class _NotYet(Exception):
    """A try that failed for a reason waiting may mend (the OperationalError is its cause)."""


def waiting_may_mend(exc: psycopg.OperationalError, dsn: str) -> bool:
    """Whether a failed connection attempt to ``dsn`` may succeed later without anyone
    changing the configuration: no server answered, or the one that did refused for now.
    May try to connect once more (see _judged): call it off the event loop."""
    if exc.sqlstate is not None:  # a query failed on an open connection: not a connect
        return False
    return _judged(str(exc), dsn)


@functools.lru_cache(maxsize=64)
def _judged(message: str, dsn: str) -> bool:
    """:func:`waiting_may_mend` for a failure that said ``message``: judged by the SQLSTATE a
    traced try of its own reads (once per message: the same outage says the same each time,
    and psycopg leaves the trace's stream open), else by the words."""
    if pq.version() < 140000:  # no trace format to read, or no trace flags to set
        return _judged_by_words(message)
    pgconn = pq.PGconn.connect_start(
        make_conninfo(dsn, fallback_application_name="flowly worker").encode())
    try:
        if pgconn.status == pq.ConnStatus.BAD:  # libpq refused the connection string itself
            return False
        with tempfile.TemporaryFile() as trace:
            try:
                pgconn.trace(trace.fileno())
            except psycopg.NotSupportedError:  # psycopg traces on Linux only
                return _judged_by_words(message)
            pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
            status = _connect_within(pgconn, _PROBE_SECONDS)
            pgconn.untrace()
            trace.seek(0)
            refusals = _TRACED_REFUSAL.findall(trace.read())
    finally:
        pgconn.finish()
    if status != pq.PollingStatus.FAILED or not refusals:
        return True  # it connected now, no server answered, or none answered in time
    refusal = refusals[-1].decode()
    return refusal in _REFUSED_FOR_NOW or refusal.startswith(_RESOURCES_SHORT)


def _connect_within(pgconn: pq.abc.PGconn, seconds: float) -> pq.PollingStatus:
    """Drive ``pgconn``'s connection attempt for up to ``seconds``: how it ended (READING or
    WRITING when it did not end in time)."""
    deadline = time.monotonic() + seconds
    while True:
        status = pq.PollingStatus(pgconn.connect_poll())
        if status not in (pq.PollingStatus.READING, pq.PollingStatus.WRITING):
            return status
        left = deadline - time.monotonic()
        if left <= 0:
            return status
        if status == pq.PollingStatus.READING:
            select.select([pgconn.socket], [], [], left)
        else:
            select.select([], [pgconn.socket], [], left)


def _judged_by_words(message: str) -> bool:
    """:func:`_judged` by the English words of libpq and of a server (another language of
    the server's messages misleads it: see the module's docstring)."""
    if "invalid " in message:  # libpq refused the DSN itself (a port that is not a number...)
        return False
    if "FATAL:" not in message:  # no server answered
        return True
    return any(reason in message for reason in _REFUSALS_FOR_NOW)


def _try_connecting(dsn: str) -> psycopg.Connection[Any]:
    """One try, on a daemon thread: the connection, or _NotYet when it failed for a reason
    waiting may mend."""
    try:
        return psycopg.Connection.connect(dsn, autocommit=True, **connect_params("worker"))
    except psycopg.OperationalError as exc:
        if waiting_may_mend(exc, dsn):
            raise _NotYet() from exc
        raise


def delays() -> Iterator[float]:
    """The pauses between tries: doubling from FIRST_DELAY, then LONGEST_DELAY for ever."""
    delay = FIRST_DELAY
    while True:
        yield delay
        delay = min(delay * 2, LONGEST_DELAY)


async def connect_when_reachable(
    dsn: str,
    unless_stopped: Callable[[asyncio.Future[Any]], Awaitable[bool]],
    stopped_within: Callable[[float], Awaitable[bool]],
) -> psycopg.Connection[Any] | None:
    """An autocommit connection to ``dsn`` once one can be opened; None if the worker was
    stopped first (``unless_stopped`` waits for a call unless the worker stops,
    ``stopped_within`` sleeps unless it stops). Each try runs on a daemon thread with no
    timeout of its own: a slow start is no reason to give up, a stop is what ends the wait."""
    failures = 0
    for delay in delays():
        connecting = on_daemon_thread(_try_connecting, dsn)
        try:
            if not await unless_stopped(connecting):
                connecting.add_done_callback(close_if_opened)
                return None
        except _NotYet as not_yet:
            failures += 1
            logger.warning("cannot reach the database yet (try %d: %s); trying again in %.1f s",
                           failures, one_line(str(not_yet.__cause__)), delay)
            if await stopped_within(delay):
                return None
            continue
        if failures:
            logger.info("reached the database after %d failed tries", failures)
        conn: psycopg.Connection[Any] = connecting.result()
        return conn
    raise AssertionError("delays() never ends")


def close_if_opened(connecting: asyncio.Future[psycopg.Connection[Any]]) -> None:
    """Close the connection a call given up on opened after all."""
    if not connecting.cancelled() and connecting.exception() is None:
        connecting.result().close()
