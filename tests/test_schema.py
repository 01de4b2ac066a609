"""Installing the schema: Python installer and psql script agree, upgrades equal fresh
installs, installs are idempotent and safe to run concurrently, the schema name is
configurable and never injectable, the SQL files parse and pass the pglast lint rules, and
the claim query stays on its partial index however much history piles up."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pglast
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import flowly
from flowly.schema import INSTALL_LOCK_KEY, install, install_dsn, installed_versions, migrations
from tests import sqllint, workflows  # noqa: F401 (registers the workflows workers run)
from tests.support import plan_nodes, running_worker

requires_psql = pytest.mark.skipif(shutil.which("psql") is None, reason="psql is not on PATH")


# --- helpers -------------------------------------------------------------------------------

def run_psql(dsn: str, *variables: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``psql -X -v ON_ERROR_STOP=1 [-v var=value ...] -f sql/install.sql`` against ``dsn``'s
    server and database (host may be a socket directory)."""
    params = conninfo_to_dict(dsn)
    command = ["psql", "-X", "-v", "ON_ERROR_STOP=1",
               "-h", str(params.get("host", "127.0.0.1")), "-p", str(params.get("port", 5432)),
               "-U", str(params["user"]), "-d", str(params["dbname"])]
    for variable in variables:
        command += ["-v", variable]
    command += ["-f", str(sqllint.INSTALL_SQL)]
    env = {**os.environ}
    if params.get("password"):
        env["PGPASSWORD"] = str(params["password"])
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    if check:
        assert result.returncode == 0, f"psql failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture
def new_database(empty_dsn: str) -> Iterator[Callable[[], str]]:
    """A factory of fresh, empty databases (from template0) on the test server; all dropped
    afterwards."""
    created: list[str] = []

    def make() -> str:
        name = f"flowly_schema_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(empty_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("create database {} template template0").format(
                sql.Identifier(name)))
        created.append(name)
        return make_conninfo(empty_dsn, dbname=name)

    yield make
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        for name in created:
            conn.execute(sql.SQL("drop database if exists {} with (force)").format(
                sql.Identifier(name)))


CATALOG_QUERIES = {
    "relations": """
        select c.relname, c.relkind, c.relpersistence
        from pg_class c where c.relnamespace = %(ns)s and c.relkind <> 'i'""",
    "columns": """
        select c.relname, row_number() over (partition by c.oid order by a.attnum) as position,
               a.attname, format_type(a.atttypid, a.atttypmod) as type, a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid) as default, a.attgenerated, a.attidentity,
               a.attcollation::regcollation::text as collation
        from pg_class c
        join pg_attribute a on a.attrelid = c.oid and a.attnum > 0 and not a.attisdropped
        left join pg_attrdef d on d.adrelid = c.oid and d.adnum = a.attnum
        where c.relnamespace = %(ns)s and c.relkind in ('r', 'p', 'v', 'm', 'f')""",
    "constraints": """
        select c.relname, k.conname, k.contype, pg_get_constraintdef(k.oid, true)
        from pg_constraint k join pg_class c on c.oid = k.conrelid
        where c.relnamespace = %(ns)s""",
    "indexes": """
        select c.relname, i.relname, pg_get_indexdef(i.oid)
        from pg_index x
        join pg_class i on i.oid = x.indexrelid
        join pg_class c on c.oid = x.indrelid
        where c.relnamespace = %(ns)s""",
    "functions": """
        select p.proname, pg_get_function_identity_arguments(p.oid),
               pg_get_function_arguments(p.oid), pg_get_function_result(p.oid), p.prokind,
               p.provolatile, p.proisstrict, p.prosecdef, l.lanname, p.prosrc, p.proconfig
        from pg_proc p join pg_language l on l.oid = p.prolang
        where p.pronamespace = %(ns)s""",
    "sequences": """
        select c.relname, s.seqtypid::regtype::text, s.seqstart, s.seqincrement, s.seqmax,
               s.seqmin, s.seqcache, s.seqcycle
        from pg_sequence s join pg_class c on c.oid = s.seqrelid
        where c.relnamespace = %(ns)s""",
    "views": """
        select c.relname, pg_get_viewdef(c.oid, true)
        from pg_class c where c.relnamespace = %(ns)s and c.relkind in ('v', 'm')""",
    "triggers": """
        select c.relname, t.tgname, pg_get_triggerdef(t.oid)
        from pg_trigger t join pg_class c on c.oid = t.tgrelid
        where c.relnamespace = %(ns)s and not t.tgisinternal""",
    "types": """
        select t.typname, t.typtype from pg_type t
        where t.typnamespace = %(ns)s
          and not exists (select from pg_class c where c.oid = t.typrelid and c.relkind <> 'c')
          and t.typelem = 0""",
}


def catalog(dsn: str, schema: str = "flowly") -> dict[str, Any]:
    """Everything that defines ``schema`` in ``dsn``'s database, as comparable sorted lists,
    plus its recorded migrations (version, name)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        # object names in definitions are printed relative to the search_path: fix it
        conn.execute("set search_path = pg_catalog")
        row = conn.execute("select oid from pg_namespace where nspname = %s", (schema,)).fetchone()
        assert row is not None, f"schema {schema!r} does not exist"
        snapshot: dict[str, Any] = {
            name: sorted(conn.execute(query, {"ns": row[0]}).fetchall(), key=repr)
            for name, query in CATALOG_QUERIES.items()
        }
        snapshot["migrations"] = conn.execute(
            sql.SQL("select version, name from {}.schema_migrations order by version").format(
                sql.Identifier(schema))).fetchall()
    return snapshot


def assert_same_catalog(left: dict[str, Any], right: dict[str, Any]) -> None:
    """Compare two catalogs section by section, so a failure names what differs."""
    assert left.keys() == right.keys()
    for section in left:
        only_left = [r for r in left[section] if r not in right[section]]
        only_right = [r for r in right[section] if r not in left[section]]
        assert left[section] == right[section], (
            f"{section} differ:\n  only in first: {only_left}\n  only in second: {only_right}")


def migration_rows() -> list[tuple[int, str]]:
    """The (version, name) rows a complete install records."""
    return [(m.version, m.name) for m in migrations()]


# --- equivalence of the install paths ------------------------------------------------------

@requires_psql
def test_step_by_step_equals_fresh_install_equals_psql(empty_dsn: str,
                                                        new_database: Callable[[], str]) -> None:
    """Applying the migrations one at a time (as upgrades do), installing them all at once,
    and running sql/install.sql with psql build identical schemas."""
    versions = [m.version for m in migrations()]
    assert versions, "no migrations found"
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        for version in versions:
            assert install(conn, target=version) == [version]
            assert installed_versions(conn) == versions[: versions.index(version) + 1]
    stepwise = catalog(empty_dsn)

    fresh_dsn = new_database()
    assert install_dsn(fresh_dsn) == versions
    fresh = catalog(fresh_dsn)

    psql_dsn = new_database()
    run_psql(psql_dsn)
    by_psql = catalog(psql_dsn)

    # the snapshot really covers the engine: a comparison of empty lists would prove nothing
    assert {"runs", "steps", "schema_migrations"} <= {r[0] for r in fresh["relations"]}
    assert {"start", "claim", "checkpoint"} <= {f[0] for f in fresh["functions"]}
    assert {"run_counts", "dead_letters"} <= {v[0] for v in fresh["views"]}
    assert "runs_claimable" in {i[1] for i in fresh["indexes"]}
    assert fresh["migrations"] == migration_rows()

    assert_same_catalog(stepwise, fresh)
    assert_same_catalog(fresh, by_psql)

    # and the comparison does notice a difference
    with psycopg.connect(psql_dsn, autocommit=True) as conn:
        conn.execute("alter table flowly.runs alter column priority set default 1")
    with pytest.raises(AssertionError, match="columns differ"):
        assert_same_catalog(fresh, catalog(psql_dsn))


def test_install_is_idempotent(empty_dsn: str) -> None:
    """A second ``flowly install`` applies nothing and leaves the catalog and the recorded
    migrations (with their applied_at) exactly as they were."""
    assert install_dsn(empty_dsn) == [m.version for m in migrations()]
    before = catalog(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        applied_at = conn.execute("select version, applied_at from flowly.schema_migrations"
                                  " order by version").fetchall()
        assert install(conn) == []
        assert conn.execute("select version, applied_at from flowly.schema_migrations"
                            " order by version").fetchall() == applied_at
    assert_same_catalog(before, catalog(empty_dsn))


@requires_psql
def test_psql_install_is_idempotent(empty_dsn: str) -> None:
    """Running sql/install.sql twice: the second run applies no migration (no CREATE FUNCTION,
    VIEW or INDEX and no INSERT in its output), records nothing new, and leaves the catalog
    unchanged; a later ``flowly install`` agrees that nothing is missing."""
    first = run_psql(empty_dsn)
    assert "CREATE FUNCTION" in first.stdout
    # one per migration recorded, plus the seed row of flowly.settings (0003)
    assert first.stdout.count("INSERT 0 1") == len(migrations()) + 1
    before = catalog(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        applied_at = conn.execute("select version, applied_at from flowly.schema_migrations"
                                  " order by version").fetchall()
    second = run_psql(empty_dsn)
    assert not re.search(r"^(CREATE (FUNCTION|VIEW|INDEX)|INSERT)", second.stdout, re.MULTILINE), (
        second.stdout)
    assert_same_catalog(before, catalog(empty_dsn))
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert conn.execute("select version, applied_at from flowly.schema_migrations"
                            " order by version").fetchall() == applied_at
        assert install(conn) == []


# --- schema names --------------------------------------------------------------------------

def start_and_claim(conn: psycopg.Connection[Any], schema: str) -> None:
    """Use the engine installed in ``schema`` end to end: start, claim, complete."""
    s = sql.Identifier(schema)
    run_id = conn.execute(sql.SQL("select {}.start('wf', '{{\"n\": 1}}')").format(s)).fetchone()
    assert run_id is not None and run_id[0]
    claimed = conn.execute(sql.SQL(
        "select run_id, lease_epoch, input from {}.claim('w', array['wf'], array['default'],"
        " 10, '1 minute')").format(s)).fetchall()
    assert [(r[0], r[2]) for r in claimed] == [(run_id[0], {"n": 1})]
    conn.execute(sql.SQL("select {}.complete(%s, %s, '\"ok\"')").format(s),
                 (run_id[0], claimed[0][1]))
    status = conn.execute(sql.SQL("select status, output from {}.runs where id = %s").format(s),
                          (run_id[0],)).fetchone()
    assert status == ("completed", "ok")


@requires_psql
def test_psql_install_into_a_schema_with_a_space(empty_dsn: str) -> None:
    """``psql -v schema='other schema'`` installs there (and nowhere else), records the
    migrations in that schema's schema_migrations, and the engine works there."""
    run_psql(empty_dsn, "schema=other schema")
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert installed_versions(conn, "other schema") == [m.version for m in migrations()]
        assert conn.execute(
            'select version, name from "other schema".schema_migrations order by version'
        ).fetchall() == migration_rows()
        assert installed_versions(conn, "flowly") == []
        assert conn.execute("select to_regnamespace('flowly')").fetchone() == (None,)
        # every function pins its own schema, quoted
        configs = conn.execute(
            "select distinct c from pg_proc, unnest(proconfig) c"
            " where pronamespace = to_regnamespace('\"other schema\"')"
            " and c like 'search_path=%'").fetchall()
        assert configs == [('search_path="other schema", pg_catalog, pg_temp',)]
        start_and_claim(conn, "other schema")
    assert catalog(empty_dsn, "other schema")["migrations"] == migration_rows()


def test_python_install_into_a_schema_with_quotes(empty_dsn: str) -> None:
    """``install(conn, 'my "odd" schema')`` works, and ``start``/``claim``/``complete`` are
    callable there through a quoted identifier."""
    schema = 'my "odd" schema'
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert install(conn, schema) == [m.version for m in migrations()]
        assert installed_versions(conn, schema) == [m.version for m in migrations()]
        assert conn.execute("select nspname from pg_namespace where nspname like 'my%'"
                            ).fetchall() == [(schema,)]
        start_and_claim(conn, schema)
        # the NOTIFY channel is derived from the schema as well
        channel = conn.execute(sql.SQL("select {}.wakeup_channel()").format(
            sql.Identifier(schema))).fetchone()
        assert channel == (f"{schema}_wakeup",)


def test_a_schema_name_with_percent_signs_quotes_and_a_backslash_serves_clients(
        empty_dsn: str) -> None:
    """psycopg reads a ``%`` in a query with parameters as a placeholder, inside quotes too:
    with a name holding one every client call failed ("only '%s', '%b', '%t' are allowed as
    placeholders"). The name reaches the server intact, next to a quote and a backslash."""
    schema = '5% "off\\ 100%s'
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        install(conn, schema)
        assert installed_versions(conn, schema) == [m.version for m in migrations()]
    with flowly.Client(empty_dsn, schema=schema) as client:
        run_id = client.start("quick", {"n": 1})
        assert [run.id for run in client.list_runs()] == [run_id]
        assert client.get(run_id).input == {"n": 1}
        assert client.cancel(run_id) == "cancelled"


INJECTION = 'x"; drop table y; --'


def test_injection_in_schema_name_is_harmless(empty_dsn: str) -> None:
    """A schema name built to break out of quoting either installs as a literal name or is
    refused with SchemaError; table ``y`` survives either way."""
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("create table public.y (id int)")
        try:
            applied = install(conn, INJECTION)
        except flowly.SchemaError:
            applied = None
        assert conn.execute("select to_regclass('public.y')").fetchone() == ("y",)
        if applied is not None:
            assert applied == [m.version for m in migrations()]
            assert installed_versions(conn, INJECTION) == applied
            start_and_claim(conn, INJECTION)
        assert conn.execute("select to_regclass('public.y')").fetchone() == ("y",)


@requires_psql
def test_injection_in_psql_schema_variable_is_harmless(empty_dsn: str) -> None:
    """The same hostile name through ``psql -v schema=...`` installs as a literal name (psql's
    ``:"schema"`` / ``:'schema'`` quote it) or fails; table ``y`` survives."""
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("create table public.y (id int)")
    result = run_psql(empty_dsn, f"schema={INJECTION}", check=False)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert conn.execute("select to_regclass('public.y')").fetchone() == ("y",)
        if result.returncode == 0:
            assert installed_versions(conn, INJECTION) == [m.version for m in migrations()]
            start_and_claim(conn, INJECTION)


@pytest.mark.parametrize(("schema", "problem"), [
    ("", "empty"),
    ("s" * 64, "63 bytes"),
    ("é" * 32, "63 bytes"),  # 32 characters, but 64 bytes in UTF-8
    ("pg_foo", "pg_"),
    (5, "must be a string, got int"),  # was an AttributeError
])
def test_unusable_schema_names_are_refused(empty_dsn: str, schema: Any, problem: str) -> None:
    """Empty names, names Postgres would truncate (over 63 bytes) and the reserved ``pg_``
    prefix raise SchemaError naming the problem, before anything is created."""
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        with pytest.raises(flowly.SchemaError, match=re.escape(problem)):
            install(conn, schema)
        assert conn.execute("select count(*) from pg_namespace where nspname not like 'pg\\_%'"
                            " and nspname not in ('public', 'information_schema')"
                            ).fetchone() == (0,)


@requires_psql
@pytest.mark.parametrize("schema", ["", "s" * 64, "pg_foo"], ids=["empty", "64-bytes", "pg_"])
def test_psql_install_refuses_unusable_schema_names(empty_dsn: str, schema: str) -> None:
    """install.sql refuses the names ``flowly install`` refuses: it fails (non-zero exit) and
    creates nothing; in particular a name over 63 bytes is not silently truncated into
    another schema (which ``flowly install`` / ``Client`` would then never find)."""
    result = run_psql(empty_dsn, f"schema={schema}", check=False)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        created = conn.execute("select nspname from pg_namespace where nspname not like 'pg\\_%'"
                               " and nspname not in ('public', 'information_schema')").fetchall()
    assert created == [], f"install.sql created {created} for schema {schema!r}"
    assert result.returncode != 0, result.stdout


def test_a_worker_role_that_may_not_create_anything_can_start(empty_dsn: str) -> None:
    """Install checks before it locks or creates: a worker whose role may only use the schema
    (no CREATE on the database) starts against an up-to-date install."""
    install_dsn(empty_dsn)
    role = f"flowly_app_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(empty_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL(
            "create role {r} login; revoke create on database {d} from public;"
            " grant usage on schema flowly to {r};"
            " grant select, insert, update, delete on all tables in schema flowly to {r};"
            " grant usage on all sequences in schema flowly to {r}").format(
                r=sql.Identifier(role),
                d=sql.Identifier(conninfo_to_dict(empty_dsn)["dbname"])))
        try:
            app_dsn = make_conninfo(empty_dsn, user=role)
            with psycopg.connect(app_dsn, autocommit=True) as app:
                assert install(app) == []
            with flowly.Client(app_dsn) as client:
                run_id = client.start("quick", 1)
                with running_worker(app_dsn):  # installs at start, as every worker does
                    assert client.wait(run_id, timeout=20).status == "completed"
        finally:
            admin.execute(sql.SQL("drop owned by {r}; drop role {r}").format(
                r=sql.Identifier(role)))


def test_install_inside_the_callers_transaction_leaves_its_settings(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn) as conn:
        conn.execute("create table public.orders (id int)")
        before = conn.execute("select current_setting('search_path')").fetchone()
        assert install(conn, "jobs") == [m.version for m in migrations()]
        assert conn.execute("select current_setting('search_path')").fetchone() == before
        conn.execute("insert into orders values (1)")  # still resolves to public.orders
        conn.commit()
    with psycopg.connect(empty_dsn) as conn:
        assert installed_versions(conn, "jobs") == [m.version for m in migrations()]


@pytest.mark.parametrize("schema", ["s" * 63, "é" * 31])
def test_a_63_byte_schema_name_is_accepted(empty_dsn: str, schema: str) -> None:
    """The limit is exact: a name of up to 63 bytes is used as given, not truncated, and runs
    start in it (its wake-up channel, too long to derive from the name, is a digest)."""
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert install(conn, schema) == [m.version for m in migrations()]
        assert installed_versions(conn, schema) == [m.version for m in migrations()]
        conn.execute(sql.SQL("select {}.start('quick', run_id => 'r')").format(
            sql.Identifier(schema)))
        channel = conn.execute(sql.SQL("select {}.wakeup_channel()").format(
            sql.Identifier(schema))).fetchone()
        assert channel is not None and len(channel[0].encode()) <= 63


# --- concurrency ---------------------------------------------------------------------------

def test_concurrent_installers_apply_each_migration_once(empty_dsn: str) -> None:
    """Four installers released together by a barrier, each on its own connection: all
    succeed, each migration is applied by exactly one of them and recorded once."""
    count = 4
    barrier = threading.Barrier(count)
    results: list[list[int]] = []
    errors: list[BaseException] = []

    def installer() -> None:
        try:
            with psycopg.connect(empty_dsn, autocommit=True) as conn:
                barrier.wait(timeout=30)
                results.append(install(conn))
        except BaseException as exc:  # reported by the assertions below
            errors.append(exc)

    threads = [threading.Thread(target=installer) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert len(results) == count
    assert sorted(v for applied in results for v in applied) == [m.version for m in migrations()]
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert conn.execute("select version, name from flowly.schema_migrations order by version"
                            ).fetchall() == migration_rows()


@requires_psql
def test_python_and_psql_installers_serialise_on_the_same_lock(empty_dsn: str) -> None:
    """``flowly install`` and ``psql -f install.sql`` queued on the install lock at the same
    time (we hold it until both wait) both succeed and apply each migration once."""
    with psycopg.connect(empty_dsn, autocommit=True) as holder:
        holder.execute("select pg_advisory_lock(%s)", (INSTALL_LOCK_KEY,))
        python_result: list[Any] = []
        thread = threading.Thread(target=lambda: python_result.append(install_dsn(empty_dsn)))
        thread.start()
        psql_result: list[subprocess.CompletedProcess[str]] = []
        psql_thread = threading.Thread(
            target=lambda: psql_result.append(run_psql(empty_dsn, check=False)))
        psql_thread.start()
        deadline = time.monotonic() + 30
        waiting = 0
        while time.monotonic() < deadline:
            waiting = holder.execute(
                "select count(*) from pg_locks where locktype = 'advisory' and not granted"
                " and database = (select oid from pg_database where datname = current_database())"
            ).fetchone()[0]
            if waiting == 2:
                break
            time.sleep(0.05)
        assert waiting == 2, "both installers should be waiting on the install lock"
        holder.execute("select pg_advisory_unlock(%s)", (INSTALL_LOCK_KEY,))
        thread.join(60)
        psql_thread.join(60)
        assert psql_result and psql_result[0].returncode == 0, psql_result
        assert python_result and python_result[0] in ([], [m.version for m in migrations()])
        # exactly one of them applied the migrations
        psql_applied = "CREATE FUNCTION" in psql_result[0].stdout
        assert psql_applied != bool(python_result[0]), (python_result, psql_result[0].stdout)
        assert holder.execute("select version, name from flowly.schema_migrations"
                              " order by version").fetchall() == migration_rows()


# --- the SQL files, read with pglast -------------------------------------------------------

def test_every_sql_file_parses() -> None:
    """Every .sql file under sql/ parses with pglast, including the PL/pgSQL bodies of its
    functions; install.sql parses once its psql meta-commands and variables are replaced."""
    files = sorted(sqllint.SQL_DIR.rglob("*.sql"))
    assert sqllint.INSTALL_SQL in files and len(files) >= 3
    for path in files:
        text = path.read_text()
        if path == sqllint.INSTALL_SQL:
            text = sqllint.psql_script_as_sql(text)
            assert ":" + '"schema"' not in text and "\\" not in text
        try:
            parsed = sqllint.statements(text)
            for statement in parsed:
                for body in sqllint.bodies(statement):
                    assert body.unreadable is None, f"{body.owner}: {body.unreadable}"
        except pglast.parser.ParseError as error:
            pytest.fail(f"{path.relative_to(sqllint.SQL_DIR)} does not parse: {error}")
        assert parsed, f"{path} has no statements"


def test_install_sql_includes_every_migration_in_order() -> None:
    """install.sql includes each file of sql/migrations (in version order), records it in
    schema_migrations with the same version and name ``flowly install`` uses, and guards it
    by that version; the files it includes exist."""
    text = sqllint.INSTALL_SQL.read_text()
    includes = sqllint.psql_includes(text)
    for include in includes:
        assert (sqllint.SQL_DIR / include).is_file(), f"install.sql includes missing {include}"
    files = [f"migrations/{p.name}" for p in sqllint.migration_files()]
    assert [i for i in includes if i.startswith("migrations/")] == files

    recorded = []
    for statement in sqllint.statements(sqllint.psql_script_as_sql(text)):
        node = statement.node
        if isinstance(node, pglast.ast.InsertStmt) and node.relation.relname == "schema_migrations":
            values = node.selectStmt.valuesLists[0]
            recorded.append((values[0].val.ival, values[1].val.sval))
    assert recorded == migration_rows()
    # python's view of the migrations is the same set of files, numbered 1..n without gaps
    assert [f"migrations/{m.name}.sql" for m in migrations()] == files
    assert [m.version for m in migrations()] == list(range(1, len(files) + 1))
    for version, _ in recorded:
        assert f"where version = {version})" in text, f"migration {version} is not guarded"


def test_lint_rules_catch_violations() -> None:
    """The lint rules below are not vacuous: they flag a function without SET search_path and
    hard-coded ``flowly.`` names in statements, SQL bodies and PL/pgSQL bodies."""
    bad = """
        create view v as select * from flowly.runs;
        create function f() returns int language sql set search_path from current
            as $$ select count(*)::int from flowly.steps $$;
        create function g() returns void language plpgsql as $$
        begin perform flowly.claim('w', array['a'], array['b'], 1, '1 s'); end $$;
        create function h() returns bigint language plpgsql set search_path = pg_catalog as $$
        declare v bigint := nextval('flowly.step_seq'); begin return v; end $$;
    """
    assert sqllint.functions_without_search_path(bad) == ["g"]
    assert sqllint.hard_coded_schema_references(bad) == [
        "ViewStmt: flowly.runs", "f body: flowly.steps", "g body: flowly.claim",
        "h body: flowly.step_seq"]


@pytest.mark.parametrize("path", sqllint.migration_files(), ids=lambda p: p.name)
def test_migration_functions_pin_search_path(path: Any) -> None:
    """Every CREATE FUNCTION in a migration has ``SET search_path`` (FROM CURRENT or a fixed
    value), so no function depends on its caller's search_path."""
    text = path.read_text()
    assert sqllint.functions_without_search_path(text) == []


@pytest.mark.parametrize("path", sqllint.migration_files(), ids=lambda p: p.name)
def test_migrations_do_not_hard_code_the_schema(path: Any) -> None:
    """No statement of a migration, nor any function body in it, qualifies a name with
    ``flowly.``: the schema is configurable, objects are created in the installer's."""
    text = path.read_text()
    assert sqllint.hard_coded_schema_references(text) == []


def test_functions_in_the_database_pin_search_path(db: psycopg.Connection[Any]) -> None:
    """As installed, every flowly function carries its own search_path setting."""
    rows = db.execute("select proname, proconfig from pg_proc"
                      " where pronamespace = 'flowly'::regnamespace").fetchall()
    assert rows
    unpinned = [name for name, config in rows
                if not any(c.startswith("search_path=") for c in config or ())]
    assert unpinned == []
    assert {c for _, config in rows for c in config if c.startswith("search_path=")} == {
        "search_path=flowly, pg_catalog, pg_temp"}


def test_functions_that_refuse_sequential_scans_are_never_jit_compiled(
        db: psycopg.Connection[Any]) -> None:
    """A function set to refuse sequential scans still runs some (a small table without an
    index for its query: settings, which max_takeovers() reads inside every heartbeat), at the
    cost of a disabled scan, 10^10: above jit_above_cost, so each execution was JIT-compiled,
    about 100 ms of server CPU a heartbeat. Each such function turns JIT off too (nested calls
    inherit both)."""
    rows = db.execute("select proname, proconfig from pg_proc"
                      " where pronamespace = 'flowly'::regnamespace"
                      " and 'enable_seqscan=off' = any(proconfig)").fetchall()
    assert {name for name, _ in rows} >= {"claim", "heartbeat", "checkpoint_steps",
                                           "complete_runs", "run_due_ahead"}
    assert [name for name, config in rows if "jit=off" not in config] == []


# --- behaviour under a foreign search_path -------------------------------------------------

def exercise_engine(conn: psycopg.Connection[Any]) -> str:
    """Drive one run through the qualified SQL API: start, register, claim, checkpoint (and
    its replay), heartbeat, sleep (wake time already passed), complete; return its id."""
    run_id = conn.execute("select flowly.start('wf', '{\"a\": 1}', run_id => 'r1')").fetchone()[0]
    assert conn.execute("select flowly.start('wf', run_id => 'r1')").fetchone() == ("r1",)
    conn.execute("select flowly.register_worker('w', array['wf'], array['default'], '1 minute')")
    claimed = conn.execute("select run_id, lease_epoch from flowly.claim('w', array['wf'],"
                           " array['default'], 5, '1 minute')").fetchall()
    assert [r[0] for r in claimed] == [run_id]
    epoch = claimed[0][1]
    assert conn.execute("select flowly.checkpoint(%s, %s, 's1', '1')",
                        (run_id, epoch)).fetchone() == (1,)
    assert conn.execute("select flowly.checkpoint(%s, %s, 's1', '2')",
                        (run_id, epoch)).fetchone() == (1,)
    assert conn.execute("select * from flowly.heartbeat('w', array[%s], array[%s]::bigint[],"
                        " '1 minute')", (run_id, epoch)).fetchall() == []
    released = conn.execute(
        "select released from flowly.sleep(%s, %s, 'nap', p_wake_at => now() - interval '1 s')",
        (run_id, epoch)).fetchone()
    assert released == (False,)
    conn.execute("select flowly.complete(%s, %s, '\"done\"')", (run_id, epoch))
    assert conn.execute("select status, output from flowly.runs where id = %s",
                        (run_id,)).fetchone() == ("completed", "done")
    return run_id


def test_api_works_without_flowly_on_the_search_path(dsn: str) -> None:
    """With ``search_path = public`` (flowly not in it), the qualified API works end to end."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("set search_path = public")
        exercise_engine(conn)
        assert conn.execute("select count(*) from flowly.steps").fetchone() == (1,)


def test_api_ignores_shadowing_objects_on_the_callers_search_path(dsn: str) -> None:
    """A caller whose search_path leads to hostile look-alikes (a ``public.runs``/``steps``
    table, temp tables, and a ``public`` twin of every flowly function that raises) still
    gets flowly's own objects: the twins never run and the fake tables stay empty."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        functions = conn.execute(
            "select proname, pg_get_function_identity_arguments(oid),"
            " pg_get_function_result(oid) from pg_proc"
            " where pronamespace = 'flowly'::regnamespace and prokind = 'f'").fetchall()
        assert len(functions) > 10
        for table in ("runs", "steps", "timers", "workers", "step_attempts"):
            conn.execute(sql.SQL("create table public.{t} (like flowly.{t} including all)").format(
                t=sql.Identifier(table)))
            conn.execute(sql.SQL("create temp table {t} (like flowly.{t} including all)").format(
                t=sql.Identifier(table)))
        for name, arguments, result in functions:
            conn.execute(sql.SQL(
                "create function public.{name}({arguments}) returns {result} language plpgsql"
                " as $$ begin raise exception 'hijacked: public.%', {literal}; end $$").format(
                    name=sql.Identifier(name), arguments=sql.SQL(arguments),
                    result=sql.SQL(result), literal=sql.Literal(name)))
        conn.execute("set search_path = pg_temp, public")
        assert conn.execute("select count(*) from runs").fetchone() == (0,)  # the temp twin

        exercise_engine(conn)

        for table in ("runs", "steps", "timers", "workers"):
            assert conn.execute(sql.SQL("select count(*) from public.{}").format(
                sql.Identifier(table))).fetchone() == (0,), table
            assert conn.execute(sql.SQL("select count(*) from pg_temp.{}").format(
                sql.Identifier(table))).fetchone() == (0,), table
        assert conn.execute("select count(*) from flowly.timers").fetchone() == (1,)


# --- the claim query and its partial index -------------------------------------------------

# The candidate query of flowly.claim, copied from its body (the test checks it still is).
CLAIM_CANDIDATES = """
                    select r.id, r.available_at from runs r
                    where r.queue = q.name and r.workflow = w.name and r.priority = v_priority
                      and r.status in ('pending', 'running', 'compensating')
                      and r.available_at <= now()
                      and (r.timeout_at is null or r.timeout_at >= now()
                           or r.status = 'compensating')
                      and r.id <> all(v_tried)
                    order by r.available_at
                    limit p_limit - cardinality(v_ids)
"""
CLAIM_LEVELS = """
            select r.priority from runs r
            where r.queue = q.name and r.workflow = w.name
              and r.status in ('pending', 'running', 'compensating')
              and r.priority < v_below
            order by r.priority desc
            limit 1
"""


def _squash(text: str) -> str:
    return " ".join(text.split())


def _explain(db: psycopg.Connection[Any], query: str, params: tuple[Any, ...]) -> dict[str, Any]:
    plan = db.execute(f"explain (analyze, buffers, format json) {query}", params).fetchone()[0]
    plan = plan if isinstance(plan, list) else json.loads(plan)
    return plan[0]["Plan"]  # type: ignore[no-any-return]


def test_claim_reads_only_due_runs_of_its_queues(db: psycopg.Connection[Any]) -> None:
    """With 100k finished runs, 50k sleeping runs in the claimed queue and 50k due runs of
    another queue (analyzed), claim's two queries (the next priority level; the due runs of
    one level) read index runs_claimable for a handful of buffers, never a sequential scan;
    claim hands out exactly the due pending runs, highest priority first."""
    body = _squash(db.execute("select prosrc from pg_proc where oid = 'flowly.claim'::regproc"
                              ).fetchone()[0])
    for query in (CLAIM_CANDIDATES, CLAIM_LEVELS):
        assert _squash(query) in body, "flowly.claim changed: update CLAIM_CANDIDATES/LEVELS"

    db.execute("""
        insert into flowly.runs (id, workflow, status, created_at, started_at, finished_at,
                                 output)
        select 'done-' || g, 'wf', 'completed', now() - interval '1 day',
               now() - interval '1 day', now() - interval '1 day' + g * interval '1 ms', '1'
        from generate_series(1, 100000) g""")
    db.execute("""
        insert into flowly.runs (id, workflow, scheduled_for)
        select 'sleeping-' || g, 'wf', now() + interval '1 hour'
        from generate_series(1, 50000) g""")
    db.execute("""
        insert into flowly.runs (id, workflow, queue)
        select 'foreign-' || g, 'wf', 'other' from generate_series(1, 50000) g""")
    pending = [db.execute("select flowly.start('wf', to_jsonb(%s::int), priority => %s)",
                          (i, i % 3)).fetchone()[0] for i in range(5)]
    db.execute("analyze flowly.runs")

    candidates = (_squash(CLAIM_CANDIDATES).replace("from runs r", "from flowly.runs r")
                  .replace("q.name", "%s").replace("w.name", "%s").replace("v_priority", "%s")
                  .replace("v_tried", "%s::text[]")
                  .replace("p_limit - cardinality(v_ids)", "%s"))
    levels = (_squash(CLAIM_LEVELS).replace("from runs r", "from flowly.runs r")
              .replace("q.name", "%s").replace("w.name", "%s")
              .replace("v_below", "%s::bigint"))
    for query, params in [(candidates, ("default", "wf", 0, [], 10)),
                          (levels, ("default", "wf", 2**31))]:
        plan = _explain(db, query, params)
        nodes = list(plan_nodes(plan))
        assert [n for n in nodes if n["Node Type"] == "Seq Scan"] == [], plan
        assert "runs_claimable" in {n.get("Index Name") for n in nodes}, plan
        touched = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
        assert touched < 50, (touched, plan)

    claimed = db.execute("select run_id, status from flowly.claim('w', array['wf'],"
                         " array['default'], 100, '1 minute')").fetchall()
    assert [r[0] for r in claimed] == [pending[2], pending[1], pending[4], pending[0], pending[3]]
    assert {r[1] for r in claimed} == {"running"}
