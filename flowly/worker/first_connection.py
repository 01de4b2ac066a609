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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from typing import Any

import psycopg

from ..bounded_calls import on_daemon_thread
from ..db import connect_params
from ..render import one_line

logger = logging.getLogger(__name__)

FIRST_DELAY = 0.5
LONGEST_DELAY = 10.0

# what a server says when it refuses a connection for now (libpq reports a refusal at
# connection time as text: there is no SQLSTATE to go by)
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


def waiting_may_mend(exc: psycopg.OperationalError) -> bool:
    """Whether a failed connection attempt may succeed later without anyone changing the
    configuration: no server answered, or the one that did refused for now."""
    if exc.sqlstate is not None:  # a query failed on an open connection: not a connect
        return False
    text = str(exc)
    if "invalid " in text:  # libpq refused the DSN itself (a port that is not a number...)
        return False
    if "FATAL:" not in text:  # no server answered
        return True
    return any(reason in text for reason in _REFUSALS_FOR_NOW)


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
        connecting = on_daemon_thread(partial(
            psycopg.Connection.connect, dsn, autocommit=True, **connect_params("worker")))
        try:
            if not await unless_stopped(connecting):
                connecting.add_done_callback(close_if_opened)
                return None
        except psycopg.OperationalError as exc:
            if not waiting_may_mend(exc):
                raise
            failures += 1
            logger.warning("cannot reach the database yet (try %d: %s); trying again in %.1f s",
                           failures, one_line(str(exc)), delay)
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
