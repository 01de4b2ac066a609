"""The wheel users install carries the SQL migrations and the type marker."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from tests.support import ROOT


def test_wheel_carries_migrations_and_py_typed(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--wheel-dir", str(tmp_path), str(ROOT)], check=True, timeout=300)
    (wheel,) = tmp_path.glob("flowly-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"flowly/sql/{p.relative_to(ROOT / 'sql')}" for p in (ROOT / "sql").rglob("*.sql")}
    assert shipped and shipped <= names
    assert {"flowly/py.typed", "flowly/sql/install.sql"} <= names
