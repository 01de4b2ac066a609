"""Fixtures: a fresh PostgreSQL database per test, with flowly installed.

The server is chosen by tests/servers.py (FLOWLY_TEST_DSN, FLOWLY_TEST_EMBEDDED=1, FLOWLY_DSN,
127.0.0.1:5432 as the current OS user, else the embedded PostgreSQL) and named in pytest's
header. pytest-postgresql builds a template database with flowly installed once per session;
tests/databases.py clones it for every test, ahead of the test, and drops the clone behind it.
"""

from __future__ import annotations

import gc
import getpass
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pytest_postgresql import factories

import flowly

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flowly.schema import setup_roles  # noqa: E402
from tests.databases import Databases  # noqa: E402
from tests.servers import choose_server, describe  # noqa: E402
from tests.support import READER, WORKER  # noqa: E402

CHOICE = choose_server(os.environ)

# the wheel and a virtualenv holding it alone (tests/installed.py), shared by the tests
pytest_plugins = ["tests.installed"]


def _server() -> dict[str, Any]:
    if not CHOICE.embedded:
        return CHOICE.params
    from flowly.embedded import embedded_dsn

    version = os.environ.get("FLOWLY_TEST_PG_VERSION", "18")
    data_dir = ROOT / ".flowly" / f"test-pg{version}"
    return conninfo_to_dict(embedded_dsn(data_dir, version=version))


SERVER = _server()


def _install(host: str, port: int, user: str, dbname: str, password: str | None = None,
             **_: Any) -> None:
    from flowly.schema import install_dsn
    from tests.workflows import EFFECTS_TABLE

    conninfo = make_conninfo(host=host, port=port, user=user, dbname=dbname, password=password)
    install_dsn(conninfo)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(EFFECTS_TABLE)


# database names carry the pid, so pytest sessions running side by side do not collide
_SERVER_ARGS: dict[str, Any] = {
    "host": str(SERVER.get("host", "127.0.0.1")),
    "port": int(SERVER.get("port", 5432)),
    "user": SERVER.get("user") or os.environ.get("PGUSER") or getpass.getuser(),
    "password": SERVER.get("password"),
}
postgresql_noproc = factories.postgresql_noproc(
    **_SERVER_ARGS, dbname=f"flowly_test_{os.getpid()}", load=[_install]
)
bare_noproc = factories.postgresql_noproc(**_SERVER_ARGS, dbname=f"flowly_bare_{os.getpid()}")


def _clones(request: pytest.FixtureRequest, template_fixture: str) -> Iterator[Databases]:
    template = request.getfixturevalue(template_fixture).template_dbname
    databases = Databases(_SERVER_ARGS, template, prefix=template.removesuffix("_tmpl"))
    try:
        yield databases
    finally:
        databases.close()


@pytest.fixture(scope="session")
def flowly_databases(request: pytest.FixtureRequest) -> Iterator[Databases]:
    """Clones of the template with flowly installed, made ahead (tests/databases.py)."""
    yield from _clones(request, "postgresql_noproc")


@pytest.fixture(scope="session")
def bare_databases(request: pytest.FixtureRequest) -> Iterator[Databases]:
    """Clones of an empty template, made ahead."""
    yield from _clones(request, "bare_noproc")


def _fresh(databases: Databases) -> Iterator[str]:
    name = databases.take()
    try:
        yield databases.dsn(name)
    finally:
        databases.give_back(name)


@pytest.fixture
def dsn(flowly_databases: Databases) -> Iterator[str]:
    """DSN of a fresh database with flowly installed in schema "flowly"."""
    yield from _fresh(flowly_databases)


@pytest.fixture
def empty_dsn(bare_databases: Databases) -> Iterator[str]:
    """DSN of a fresh database without flowly."""
    yield from _fresh(bare_databases)


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to the test database, for SQL-level checks."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def client(dsn: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[flowly.Client]:
    """A Client of the test database, which FLOWLY_DSN names too (for code that reads it)."""
    monkeypatch.setenv("FLOWLY_DSN", dsn)
    with flowly.Client(dsn) as c:
        yield c


@pytest.fixture
def roles(dsn: str, db: psycopg.Connection[Any]) -> Iterator[tuple[str, str]]:
    """Login roles that are members of the worker and reader roles; DSNs for each."""
    try:
        setup_roles(db, worker=WORKER, reader=READER)
    except psycopg.errors.InsufficientPrivilege:
        pytest.skip("the test database's user may not create roles")
    logins = {WORKER: f"{WORKER}_login", READER: f"{READER}_login"}
    for role, login in logins.items():
        db.execute(sql.SQL("create role {} login in role {}").format(
            sql.Identifier(login), sql.Identifier(role)))
    db.execute(sql.SQL("grant insert, select on public.test_effects to {}").format(
        sql.Identifier(logins[WORKER])))
    try:
        yield (make_conninfo(dsn, user=logins[WORKER]), make_conninfo(dsn, user=logins[READER]))
    finally:
        for role in (*logins.values(), WORKER, READER):
            db.execute(sql.SQL("drop owned by {} cascade").format(sql.Identifier(role)))
            db.execute(sql.SQL("drop role {}").format(sql.Identifier(role)))


def pytest_report_header(config: pytest.Config) -> str:
    return describe(CHOICE, _SERVER_ARGS)


@pytest.fixture(autouse=True)
def _collect_garbage_after_each_test() -> Iterator[None]:
    """Collect a test's cyclic garbage (connections, coroutines, tasks) when it ends, not in
    the middle of a later test: on Python 3.11 before 3.11.8, a finalizer that runs while
    pytest rewrites a lazily imported module (hypothesis imports some as it goes) raises
    "SystemError: AST constructor recursion depth mismatch", seen once in this suite.

    What survives is frozen out of later collections: a full collection over the session's
    modules (hypothesis among them) took 36 ms a test, one over what a test made takes 1."""
    yield
    gc.collect()
    gc.freeze()
