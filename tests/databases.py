"""Fresh databases for the tests, made ahead of them and dropped behind them.

Every test that needs a database gets one of its own, cloned from a template (flowly installed,
or nothing). On a server busy with five other pytest processes, cloning the template took a
test about 0.35 s and dropping the database about 0.55 s (PostgreSQL 15 forces a checkpoint at
every DROP DATABASE): a third of the suite's time, spent waiting. Per template, a thread now
clones the next databases while a test runs and another drops the finished ones behind it, so
a test waits for neither unless the cloning has fallen behind.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

logger = logging.getLogger(__name__)

# a file copy of the template costs the server a third less CPU, with its drop, than a copy
# through shared buffers and the WAL (PostgreSQL 15's default), whose dirty pages the drop's
# checkpoint must write; and the suite is bound by the CPU. PostgreSQL 14 knows only the
# file copy, and not the word.
STRATEGY = sql.SQL("strategy file_copy")

# databases made before a test asks: more only piles up unused clones while drops wait
AHEAD = 2


class Databases:
    """Clones of ``template`` named ``<prefix>_<n>``: ``take()`` one, ``give_back()`` it when
    its test ends, ``close()`` at the end of the session (drops every clone left).

    One thread makes clones, another drops them: a drop waits for a checkpoint, and a test
    waiting for its clone must not wait for that too. Each connects only for what it does,
    so an idle session holds none of the server's connections."""

    def __init__(self, server: Mapping[str, Any], template: str, prefix: str) -> None:
        self._server = {k: v for k, v in server.items() if v is not None}
        self._template = template
        self._prefix = prefix
        self._ready: deque[str] = deque()
        self._used: deque[str] = deque()
        self._failure: BaseException | None = None
        self._closing = False
        self._made_all = False
        self._changed = threading.Condition()
        self._threads = [threading.Thread(target=target, name=f"{prefix}-{target.__name__}",
                                          daemon=True)
                         for target in (self._make_ahead, self._drop_behind)]
        for thread in self._threads:
            thread.start()

    def take(self) -> str:
        """The name of a fresh clone, waiting for one if none is ready."""
        with self._changed:
            while not self._ready:
                if self._failure is not None:
                    raise RuntimeError(f"cloning {self._template} failed") from self._failure
                self._changed.wait()
            name = self._ready.popleft()
            self._changed.notify_all()
            return name

    def dsn(self, name: str) -> str:
        """The DSN of clone ``name``."""
        return make_conninfo(**self._server, dbname=name)

    def give_back(self, name: str) -> None:
        """End the connections a test left to ``name`` (a frozen process's, a worker still
        retrying), as dropping it at once did, and have it dropped while the next tests run."""
        with self._connect() as conn:
            try:
                conn.execute(sql.SQL("alter database {} with allow_connections false").format(
                    sql.Identifier(name)))
            except psycopg.errors.InvalidCatalogName:
                return  # the test dropped it
            _end_sessions(conn, name)
        with self._changed:
            self._used.append(name)
            self._changed.notify_all()

    def close(self) -> None:
        """Drop every clone left, ready or used, and end the threads."""
        maker, dropper = self._threads
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        maker.join()
        with self._changed:
            self._used.extend(self._ready)
            self._ready.clear()
            self._made_all = True
            self._changed.notify_all()
        dropper.join()

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(**{**self._server, "dbname": "postgres"}, autocommit=True)

    def _make_ahead(self) -> None:
        try:
            for made in itertools.count(1):
                with self._changed:
                    while len(self._ready) >= AHEAD and not self._closing:
                        self._changed.wait()
                    if self._closing:
                        return
                name = f"{self._prefix}_{made}"
                with self._connect() as conn:
                    # a clone fails while anyone is connected to its template: nobody should be
                    _end_sessions(conn, self._template)
                    strategy = STRATEGY if conn.info.server_version >= 150000 else sql.SQL("")
                    conn.execute(sql.SQL("create database {} template {} {}").format(
                        sql.Identifier(name), sql.Identifier(self._template), strategy))
                with self._changed:
                    self._ready.append(name)
                    self._changed.notify_all()
        except psycopg.Error as exc:
            with self._changed:
                self._failure = exc
                self._changed.notify_all()

    def _drop_behind(self) -> None:
        while True:
            with self._changed:
                while not self._used and not self._made_all:
                    self._changed.wait()
                if not self._used:
                    return
                name = self._used.popleft()
            try:
                with self._connect() as conn:
                    conn.execute(sql.SQL("drop database if exists {} with (force)").format(
                        sql.Identifier(name)))
            except psycopg.Error as exc:
                logger.warning("test database %s is left behind: %s", name, exc)


def _end_sessions(conn: psycopg.Connection[Any], dbname: str) -> None:
    """End every session connected to ``dbname`` (``conn`` is connected to another)."""
    conn.execute("select pg_terminate_backend(pid) from pg_stat_activity where datname = %s",
                 (dbname,))
