"""What an application sets up in psycopg for itself does not reach into flowly:

- adapters registered process-wide (``psycopg.adapters``): a float8 loaded as Decimal
  crashed the worker at once (its server-clock arithmetic), a bool loaded as text kept runs
  in ``running`` (heartbeat and claim results read as "f", which is true);
- dumpers of the application's own connection (``conn=``): an int dumped as numeric made
  ``start`` call a function that does not exist, reported as flowly not being installed.

Also: a ``conn=`` of the wrong kind is refused as an argument, and a ``list_runs(since=)``
at the ends of time is refused, or read, as an argument rather than failing in psycopg.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.numeric import IntNumericDumper
from psycopg.types.string import StrDumper

import flowly

_ROOT = Path(__file__).resolve().parent.parent

# a worker and a client in a process whose psycopg reads and writes types its own way
_GLOBAL_ADAPTERS_APP = textwrap.dedent("""
    import json, sys
    from decimal import Decimal
    from functools import partial
    import psycopg
    from psycopg.types import numeric
    from psycopg.types.json import set_json_loads
    from psycopg.types.string import TextLoader
    psycopg.adapters.register_loader("float8", numeric.NumericLoader)
    psycopg.adapters.register_loader("numeric", numeric.FloatLoader)
    psycopg.adapters.register_loader("bool", TextLoader)
    psycopg.adapters.register_loader("timestamptz", TextLoader)
    psycopg.adapters.register_loader("interval", TextLoader)
    psycopg.adapters.register_dumper(int, numeric.IntNumericDumper)
    set_json_loads(partial(json.loads, parse_float=Decimal))
    import flowly
    from tests import workflows
    from tests.support import running_worker
    dsn = sys.argv[1]
    with flowly.Client(dsn, timeout=10) as client, running_worker(
            dsn, workflows=[workflows.quick, workflows.sleepy], concurrency=4):
        runs = [client.start("quick", {"x": 1.5}, priority=2),
                client.start("sleepy", {"seconds": 0.3}, delay=0.2)]
        done = [client.wait(run, timeout=15) for run in runs]
    print(json.dumps([[run.status, type(run.created_at).__name__] for run in done]))
""")


def test_process_wide_adapters_do_not_reach_the_worker_or_client(dsn: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _GLOBAL_ADAPTERS_APP, dsn], cwd=_ROOT, capture_output=True,
        text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(_ROOT), "FLOWLY_DSN": dsn})
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[-1]) == [["completed", "datetime"]] * 2


@pytest.mark.parametrize("dumper", [(int, IntNumericDumper), (str, StrDumper)],
                         ids=["int-as-numeric", "str-as-text"])
def test_dumpers_of_the_callers_connection_call_the_same_functions(
        dsn: str, client: flowly.Client, dumper: tuple[type, type]) -> None:
    with psycopg.connect(dsn) as app_conn:
        app_conn.adapters.register_dumper(*dumper)
        run = client.start("never_served", {"a": 1}, priority=3, max_attempts=2, conn=app_conn)
        client.start("never_served", {"a": 1}, run_id="second", priority=1, timeout=5,
                     delay=timedelta(seconds=1), concurrency_key="k", conn=app_conn)
        assert client.send_event(run, "go", 1, conn=app_conn) == 1
    assert client.get(run).priority == 3


def test_dumpers_of_the_callers_async_connection_call_the_same_functions(dsn: str) -> None:
    asyncio.run(_start_and_send_on_async_connection(dsn))


async def _start_and_send_on_async_connection(dsn: str) -> None:
    async with flowly.AsyncClient(dsn) as client, \
            await psycopg.AsyncConnection.connect(dsn) as app_conn:
        app_conn.adapters.register_dumper(int, IntNumericDumper)
        run = await client.start("never_served", None, priority=3, max_attempts=2,
                                 conn=app_conn)
        assert await client.send_event(run, "go", 1, conn=app_conn) == 1
        await app_conn.commit()
        assert (await client.get(run)).max_attempts == 2


def test_the_wrong_kind_of_connection_is_refused_as_conn(
        dsn: str, client: flowly.Client) -> None:
    with psycopg.connect(dsn) as sync_conn:
        for wrong in ("postgresql://", sync_conn.cursor(), object()):
            with pytest.raises(flowly.InvalidArgument, match="conn"):
                client.start("never_served", conn=wrong)  # type: ignore[arg-type]
            with pytest.raises(flowly.InvalidArgument, match="conn"):
                client.send_event("r", "e", conn=wrong)  # type: ignore[arg-type]


def test_the_wrong_kind_of_connection_is_refused_as_conn_async(dsn: str) -> None:
    asyncio.run(_wrong_connections_async(dsn))


async def _wrong_connections_async(dsn: str) -> None:
    async with flowly.AsyncClient(dsn) as client, \
            await psycopg.AsyncConnection.connect(dsn) as async_conn:
        with psycopg.connect(dsn) as sync_conn:
            for wrong in (sync_conn, "postgresql://"):
                with pytest.raises(flowly.InvalidArgument, match=r"conn.*AsyncConnection"):
                    await client.start("never_served", conn=wrong)  # type: ignore[arg-type]
                with pytest.raises(flowly.InvalidArgument, match="conn"):
                    await client.send_event("r", "e", conn=wrong)  # type: ignore[arg-type]
            with pytest.raises(flowly.InvalidArgument, match=r"conn.*Connection"):
                flowly.Client(dsn).start("never_served", conn=async_conn)  # type: ignore[arg-type]


@pytest.mark.parametrize("since", [timedelta(days=3_000_000), "3000000d",
                                   timedelta(days=120_000_000), "120000000d"])
def test_an_age_before_the_year_1_is_refused(client: flowly.Client, since: Any) -> None:
    with pytest.raises(flowly.InvalidArgument, match=r"since.*before the year 1"):
        client.list_runs(since=since)


@pytest.mark.parametrize("since", [datetime(1, 1, 1), "0001-01-01", datetime(9999, 12, 31),
                                   timedelta(days=700_000), "700000d"])
def test_times_at_the_ends_of_the_calendar_are_read(client: flowly.Client, dsn: str,
                                                    since: Any) -> None:
    run = client.start("never_served")
    expected = [] if isinstance(since, datetime) and since.year == 9999 else [run]
    assert [r.id for r in client.list_runs(since=since)] == expected
