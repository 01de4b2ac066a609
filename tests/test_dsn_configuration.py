"""Where flowly finds its database, and what it shows of the DSN it was given.

A blank FLOWLY_DSN (an empty ``FLOWLY_DSN=`` line in an env file, or spaces) counts as unset:
spaces won over DATABASE_URL, and libpq read them as "all defaults" (another server, another
database). A DSN libpq cannot parse fails naming the problem, never showing the password in
it: libpq's message quotes a malformed URI whole, and a token of it (a bad percent escape in
the password), and Client, AsyncClient, the worker and the command line passed it on.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

import flowly
from tests.support import scalar, worker_process
from tests.test_cli import flowly as run_flowly

BLANKS = ["", "   ", "\t\n"]


@pytest.mark.parametrize("blank", BLANKS)
def test_a_blank_flowly_dsn_leaves_the_command_line_to_database_url(
        dsn: str, db: psycopg.Connection[Any], blank: str) -> None:
    run_id = flowly.Client(dsn).start("nobody-serves-this", None,
                                      run_id=f"blank-{BLANKS.index(blank)}")
    result = run_flowly("runs", "--json", env={"FLOWLY_DSN": blank, "DATABASE_URL": dsn})
    assert result.returncode == 0, result.stderr
    assert run_id in result.stdout, result.stdout


@pytest.mark.parametrize("blank", BLANKS)
def test_a_blank_flowly_dsn_leaves_a_client_to_database_url(
        dsn: str, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch,
        blank: str) -> None:
    monkeypatch.setenv("FLOWLY_DSN", blank)
    monkeypatch.setenv("DATABASE_URL", dsn)
    with flowly.Client() as client:
        run_id = client.start("nobody-serves-this", None)
    assert scalar(db, "select count(*) from flowly.runs where id = %s", run_id) == 1

    async def start() -> str:
        async with flowly.AsyncClient() as client:
            return await client.start("nobody-serves-this", None)

    run_id = asyncio.run(start())
    assert scalar(db, "select count(*) from flowly.runs where id = %s", run_id) == 1


# malformed DSNs, and the password each holds
MALFORMED = [
    ("postgresql://u:secret@[::1:5432/db", "secret"),  # libpq quotes the URI whole
    ("postgresql://u:secret@[::1]x/db", "secret"),
    ("postgresql://u:sec%ret@127.0.0.1:5432/db", "sec%ret"),  # ... or the bad token
    ("postgresql://u:secret@127.0.0.1:5432/db?bogus", "secret"),
    ("postgresql://127.0.0.1/db?password=s%zzecret", "s%zzecret"),
    ("host=127.0.0.1 password=secret bogus", "secret"),
    ("host=127.0.0.1 password='secret", "secret"),
]


def _everything_told(exc: BaseException) -> str:
    """What a traceback of ``exc`` shows, chained exceptions included."""
    return "".join(traceback.format_exception(exc))


def _raised(call: Callable[[], Any]) -> BaseException:
    try:
        call()
    except Exception as exc:
        return exc
    raise AssertionError("no error raised")


@pytest.mark.parametrize(("bad", "password"), MALFORMED)
def test_a_malformed_dsn_fails_without_showing_its_password_in_a_client(
        bad: str, password: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    def sync_call() -> Any:
        with flowly.Client(bad) as client:
            return client.get("r")

    async def async_call() -> Any:
        async with flowly.AsyncClient(bad) as client:
            return await client.get("r")

    for call in (sync_call, lambda: asyncio.run(async_call())):
        error = _raised(call)
        assert isinstance(error, flowly.InvalidArgument), _everything_told(error)
        assert "dsn" in str(error), error
        assert password not in _everything_told(error), _everything_told(error)
    assert password not in caplog.text, caplog.text


@pytest.mark.parametrize(("bad", "password"), MALFORMED)
def test_a_malformed_dsn_fails_without_showing_its_password_in_a_worker(
        bad: str, password: str, caplog: pytest.LogCaptureFixture) -> None:
    import tests.workflows  # noqa: F401  (registers "quick")

    caplog.set_level(logging.DEBUG)

    def run_worker() -> None:
        asyncio.run(flowly.Worker(bad, ["quick"]).run())

    error = _raised(run_worker)
    assert isinstance(error, flowly.InvalidArgument), _everything_told(error)
    assert password not in _everything_told(error), _everything_told(error)
    assert password not in caplog.text, caplog.text


# the command line checks its DSN as the client does: a URI quoted whole and a key=value token
# stand for every case above (three processes each)
@pytest.mark.parametrize(("bad", "password"), [MALFORMED[0], MALFORMED[-1]])
def test_a_malformed_dsn_fails_without_showing_its_password_on_the_command_line(
        bad: str, password: str) -> None:
    for result in (run_flowly("runs", dsn=bad), run_flowly("runs", env={"FLOWLY_DSN": bad})):
        assert result.returncode == 2, result
        assert "dsn" in result.stderr, result.stderr
        assert password not in result.stdout + result.stderr, result.stderr
    with worker_process(bad) as worker:
        worker.proc.wait(30)
        output = worker.stop()
    assert worker.proc.returncode == 2, output
    assert password not in output, output
