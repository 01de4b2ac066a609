"""Where flowly finds its database.

A blank FLOWLY_DSN (an empty ``FLOWLY_DSN=`` line in an env file, or spaces) counts as unset:
spaces won over DATABASE_URL, and libpq read them as "all defaults" (another server, another
database).
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

import flowly
from tests.support import scalar
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
