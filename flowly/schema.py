"""Installing and upgrading the flowly schema from the numbered files in ``sql/``.

``install`` applies, in one transaction and under an advisory lock (the same one
``sql/install.sql`` takes), every migration the schema does not have yet, and records each in
``schema_migrations``. Running it again is a no-op, and two processes installing at once
apply each migration exactly once. The schema name is always passed as a quoted identifier
or a bound parameter, never formatted into SQL text.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

import psycopg
from psycopg import sql

from .db import DEFAULT_SCHEMA, check_schema_name, connect_params, schema_identifier
from .errors import SchemaError, SchemaNotInstalled

logger = logging.getLogger(__name__)

# Shared with sql/install.sql: serialises concurrent installers of any schema.
INSTALL_LOCK_KEY = 7237142851620390001


@dataclass(frozen=True)
class Migration:
    """One numbered file of ``sql/migrations``."""

    version: int
    name: str
    sql: str


def migrations() -> list[Migration]:
    """Every migration shipped with the package, in version order."""
    folder = resources.files("flowly") / "sql" / "migrations"
    found = []
    for entry in folder.iterdir():
        match = re.fullmatch(r"(\d{4})_(\w+)\.sql", entry.name)
        if match:
            found.append(Migration(int(match[1]), entry.name[:-4], entry.read_text()))
    return sorted(found, key=lambda m: m.version)


def sql_path() -> str:
    """The folder holding ``install.sql`` and the migrations, for ``psql -f``.

    A real directory in an installed package (a zip import has none: then use
    :func:`install_script`).
    """
    return str(resources.files("flowly") / "sql")


def install_script(schema: str | None = None) -> str:
    """``sql/install.sql`` with every ``\\ir`` include inlined: one script for ``psql`` on
    standard input (``flowly install --print-sql | psql``), applying what ``flowly install``
    applies. With ``schema``, the script installs there unless ``psql -v schema=...`` says
    otherwise; without, into ``flowly`` by the same rule.
    """
    folder = resources.files("flowly") / "sql"
    lines = []
    if schema is not None:
        check_schema_name(schema)
        # psql reads '' as a quote and backslash escapes inside single quotes
        value = schema.replace("\\", "\\\\").replace("'", "''")
        lines += ["\\if :{?schema}", "\\else", f"    \\set schema '{value}'", "\\endif"]
    for line in (folder / "install.sql").read_text().splitlines():
        match = re.fullmatch(r"(\s*)\\ir\s+(\S+)\s*", line)
        if match is None:
            lines.append(line)
            continue
        included = folder.joinpath(*match[2].split("/")).read_text()
        lines += [f"-- begin {match[2]}", included.rstrip("\n"), f"-- end {match[2]}"]
    return "\n".join(lines) + "\n"


def _versions_sql() -> str:
    return (resources.files("flowly") / "sql" / "versions.sql").read_text()


def install(
    conn: psycopg.Connection[Any], schema: str = DEFAULT_SCHEMA, *, target: int | None = None
) -> list[int]:
    """Apply the missing migrations (up to ``target``) to ``schema``; return their versions.

    Runs in one transaction of ``conn`` (committed here unless the caller already opened one,
    whose settings it leaves as they were). A schema already up to date is only read, so a
    role without the privilege to create anything (a worker's, say) can call it. The worker
    calls it in a thread at start-up, so it needs no async twin.
    """
    check_schema_name(schema)
    wanted = {m.version for m in migrations() if target is None or m.version <= target}
    applied: list[int] = []
    with conn.transaction():
        if wanted <= set(installed_versions(conn, schema)):
            return applied
        # set local lasts until the caller's transaction ends (this block may be a savepoint
        # in it), so put these back after; a rollback to the savepoint puts them back itself
        saved = conn.execute("select current_setting('search_path'),"
                             " current_setting('client_min_messages')").fetchone()
        conn.execute("set local client_min_messages = warning")
        conn.execute("select pg_advisory_xact_lock(%s)", (INSTALL_LOCK_KEY,))
        conn.execute(sql.SQL("create schema if not exists {}").format(schema_identifier(schema)))
        conn.execute(
            "select set_config('search_path', format('%%I, pg_catalog, pg_temp', %s::text), true)",
            (schema,),
        )
        conn.execute(_versions_sql().encode())
        done = {row[0] for row in conn.execute("select version from schema_migrations")}
        for migration in migrations():
            if migration.version in done or (target is not None and migration.version > target):
                continue
            conn.execute(migration.sql.encode())
            conn.execute(
                "insert into schema_migrations (version, name) values (%s, %s)",
                (migration.version, migration.name),
            )
            applied.append(migration.version)
            logger.info("applied migration %s to schema %r", migration.name, schema)
        # roles set up with setup_roles get their rights on whatever the migrations added
        has_roles = conn.execute("select to_regproc('apply_roles') is not null").fetchone()
        if has_roles and has_roles[0]:
            conn.execute("select apply_roles()")
        conn.execute("select set_config('search_path', %s, true),"
                     " set_config('client_min_messages', %s, true)", saved)
    return applied


def setup_roles(conn: psycopg.Connection[Any], schema: str = DEFAULT_SCHEMA, *,
                worker: str = "flowly_worker", reader: str = "flowly_reader") -> None:
    """Create (when missing) the ``worker`` and ``reader`` roles and give them their rights
    on ``schema`` (see ``setup_roles`` in sql/migrations/0010_roles.sql)."""
    with conn.transaction():
        conn.execute(sql.SQL("select {}.setup_roles(%s, %s)").format(schema_identifier(schema)),
                     (worker, reader))


def install_dsn(dsn: str, schema: str = DEFAULT_SCHEMA, *, target: int | None = None) -> list[int]:
    """Connect to ``dsn`` and :func:`install`."""
    with psycopg.connect(dsn, autocommit=True, **connect_params("install")) as conn:
        return install(conn, schema, target=target)


def installed_versions(conn: psycopg.Connection[Any], schema: str = DEFAULT_SCHEMA) -> list[int]:
    """The migration versions recorded in ``schema`` (empty when flowly is not installed)."""
    exists = conn.execute(
        "select to_regclass(format('%%I.schema_migrations', %s::text)) is not null", (schema,)
    ).fetchone()
    if not exists or not exists[0]:
        return []
    query = sql.SQL("select version from {}.schema_migrations order by version").format(
        schema_identifier(schema))
    return [row[0] for row in conn.execute(query)]


def check_current(conn: psycopg.Connection[Any], schema: str = DEFAULT_SCHEMA) -> None:
    """Raise unless ``schema`` has every migration this flowly ships: a worker that does not
    install must not serve a schema whose functions are older than its code expects."""
    installed = set(installed_versions(conn, schema))
    if not installed:
        raise SchemaNotInstalled(
            f"flowly is not installed in schema {schema!r}; run `flowly install`")
    missing = [m.name for m in migrations() if m.version not in installed]
    if missing:
        raise SchemaError(
            f"schema {schema!r} lacks {len(missing)} migration(s) this flowly needs"
            f" ({', '.join(missing)}): run `flowly install` to apply them, then start the"
            " worker again")
