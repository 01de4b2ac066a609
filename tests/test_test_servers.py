"""The rule that picks the test suite's PostgreSQL (tests/servers.py), on a real server."""

from __future__ import annotations

import getpass
import os
from typing import Any

import psycopg

from tests.conftest import CHOICE
from tests.servers import LOCAL, can_log_in, choose_server, describe


def test_flowly_test_dsn_wins_then_embedded_flag_then_flowly_dsn() -> None:
    env = {"FLOWLY_TEST_DSN": "host=h1 port=1 user=u1", "FLOWLY_DSN": "host=h2 user=u2",
           "FLOWLY_TEST_EMBEDDED": "1"}
    assert choose_server(env).params == {"host": "h1", "port": "1", "user": "u1"}
    del env["FLOWLY_TEST_DSN"]
    assert choose_server(env).embedded
    del env["FLOWLY_TEST_EMBEDDED"]
    chosen = choose_server(env)
    assert chosen.source == "FLOWLY_DSN" and chosen.params == {"host": "h2", "user": "u2"}


def test_a_blank_variable_counts_as_unset() -> None:
    """FLOWLY_TEST_DSN set to spaces chose a server of libpq's defaults over FLOWLY_DSN."""
    for blank in ("", "  ", "\n"):
        chosen = choose_server({"FLOWLY_TEST_DSN": blank, "FLOWLY_DSN": "host=h2 user=u2"})
        assert chosen.source == "FLOWLY_DSN" and chosen.params == {"host": "h2", "user": "u2"}
        chosen = choose_server({"FLOWLY_DSN": blank}, user="flowly_no_such_role")
        assert chosen.source != "FLOWLY_DSN", chosen


def test_the_local_server_is_used_as_the_current_os_user_when_it_can_log_in() -> None:
    if can_log_in({**LOCAL, "user": getpass.getuser()}) is not None:
        return  # nothing at 127.0.0.1:5432 for this user: the fallback test below covers it
    chosen = choose_server({})
    assert chosen.source == "local" and chosen.params["user"] == getpass.getuser()


def test_a_role_the_local_server_does_not_know_falls_back_to_embedded() -> None:
    chosen = choose_server({}, user="flowly_no_such_role")
    assert chosen.embedded
    assert "flowly_no_such_role" in chosen.reason
    assert "127.0.0.1:5432" in describe(chosen, {"host": "/tmp/x", "port": 5432, "user": "p"}) \
        or "flowly_no_such_role" in describe(chosen, {"host": "/tmp/x", "user": "p"})


def test_the_session_uses_the_server_the_header_names(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
    assert CHOICE.source in ("FLOWLY_TEST_DSN", "FLOWLY_DSN", "local", "embedded")


def test_a_role_that_may_not_create_databases_falls_back_to_embedded(
        db: psycopg.Connection[Any]) -> None:
    role = f"flowly_test_no_createdb_{os.getpid()}"
    db.execute(f"drop role if exists {role}")
    db.execute(f"create role {role} login")
    try:
        info = db.info
        if info.host.startswith("/"):
            return  # the embedded server's socket: no 127.0.0.1:5432 to ask
        reason = can_log_in({"host": info.host, "port": info.port, "user": role})
        assert reason is not None  # (a server that wants a password for it says so instead)
        assert "may not create databases" in reason or "password" in reason, reason
    finally:
        db.execute(f"drop role {role}")
