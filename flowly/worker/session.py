"""The settings of a worker's database sessions, suited to its lease.

A worker that freezes (SIGSTOP, a paused VM) or loses its network in the middle of a commit
must not pin the rows it locked for hours: its transactions are cut after about a lease of
idleness, a statement may not run much past a lease, dead peers are noticed through TCP
keepalives within about a lease, a server running a statement for a worker that died (a
transactional step's long SQL, whose statement timeout is lifted) notices within a third of
a lease, and no call waits long for a lock (the hot path skips locked
rows anyway; this bounds the rest, such as a start behind an uncommitted concurrency key).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import psycopg
from psycopg import sql

from ..db import UNPREPARED, adapt_connection, connect_params, set_up_session, set_up_session_async

LOCK_TIMEOUT_MS = 2000
# a statement of the engine takes milliseconds; this only stops one that is stuck
_MIN_STATEMENT_TIMEOUT_MS = 5000


def connection_kwargs(lease: float) -> dict[str, Any]:
    """libpq parameters for a worker connection: autocommit, flowly's own (UTF-8, its
    application_name), and TCP keepalives that notice a dead server (or path to it) within
    about a lease. Unix sockets ignore the keepalives."""
    probe = max(1, int(lease / 3))
    return {
        "autocommit": True,
        "keepalives": 1,
        "keepalives_idle": probe,
        "keepalives_interval": probe,
        "keepalives_count": 3,
        "tcp_user_timeout": int(lease * 1000),
        "connect_timeout": max(2, int(lease)),
        **UNPREPARED,
        **connect_params("worker"),
    }


def call_timeout(lease: float) -> float:
    """How long a worker waits for one engine call, in seconds: a connection from the pool
    (its timeout), then a statement (the server's timeout), with room to spare."""
    return 2 * max(lease, _MIN_STATEMENT_TIMEOUT_MS / 1000) + 5


def settings(lease: float) -> dict[str, str]:
    """Session settings (GUCs) of a worker connection. READ COMMITTED whatever the database's
    or role's default: the engine's calls are written for it (a claim or a write that meets a
    row changed meanwhile re-reads it; under SERIALIZABLE they failed each other's commits,
    and a claim or a batch of writes failed with them), and a transactional step's default
    isolation is READ COMMITTED (ctx.transaction)."""
    lease_ms = int(lease * 1000)
    return {
        "lock_timeout": str(LOCK_TIMEOUT_MS),
        "statement_timeout": str(max(lease_ms, _MIN_STATEMENT_TIMEOUT_MS)),
        "idle_in_transaction_session_timeout": str(max(lease_ms, 1000)),
        "default_transaction_isolation": "read committed",
    }


# what set_up_session and connect_params gave the session, which a transactional step's SQL
# may change for good (a SET without LOCAL). Not its role: a SET ROLE to a role without
# flowly's grants fails the step's own checkpoint, and its rollback takes the role back.
_AS_OPENED = {"default_transaction_read_only": "off", "client_encoding": "UTF8",
              "datestyle": "ISO", "intervalstyle": "postgres"}


def _set_all(values: dict[str, str]) -> sql.Composed:
    """One statement that sets each of ``values`` for the session."""
    return sql.SQL("select ") + sql.SQL(", ").join(
        sql.SQL("set_config({}, {}, false)").format(sql.Literal(name), sql.Literal(value))
        for name, value in values.items())


def restoring(query: sql.Composable, lease: float) -> sql.Composed:
    """``query`` (a transactional step's checkpoint, run in its transaction) and, in the same
    statement, the session set back as flowly opened it: left as the step's SQL left it once
    the transaction commits, a statement_timeout of 1 ms, a read-only default or LATIN1 failed
    every later call on the connection, other runs' included. Rolled back, the transaction
    takes the step's settings back with it."""
    return sql.SQL("select done.* from ({}) done, ({}) restored").format(
        query, set_back(lease))


@functools.lru_cache(maxsize=8)
def set_back(lease: float) -> sql.Composed:
    """The statement that sets a worker session back as flowly opened it (see restoring)."""
    return _set_all({**_AS_OPENED, **settings(lease)})


# PostgreSQL 14+ on Linux, macOS and the BSDs; elsewhere the server refuses a value other than
# 0, and the worker goes without (a dead worker's statement then runs to its end)
_CHECK_CLIENT = "select set_config('client_connection_check_interval', %s, false)"


def _check_client_every(lease: float) -> tuple[str]:
    return (str(max(1000, int(lease * 1000 / 3))),)


async def configure_async(conn: psycopg.AsyncConnection[Any], lease: float) -> None:
    adapt_connection(conn)
    await set_up_session_async(conn)
    await conn.execute(_set_all(settings(lease)))
    with contextlib.suppress(psycopg.errors.InvalidParameterValue):
        await conn.execute(_CHECK_CLIENT, _check_client_every(lease))


def configure(conn: psycopg.Connection[Any], lease: float) -> None:
    adapt_connection(conn)
    set_up_session(conn)
    conn.execute(_set_all(settings(lease)))
    with contextlib.suppress(psycopg.errors.InvalidParameterValue):
        conn.execute(_CHECK_CLIENT, _check_client_every(lease))
