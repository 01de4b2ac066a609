"""The wheel users install, built once per session, and a fresh virtualenv holding it alone
(with its declared dependencies from the package index, no extras, no source checkout)."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.support import ROOT


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--wheel-dir", str(out), str(ROOT)], check=True, timeout=300)
    (built,) = out.glob("flowly-*.whl")
    return built


@pytest.fixture(scope="session")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtualenv holding the wheel and its declared dependencies; its bin folder."""
    home = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True).create(home)
    bin_dir = home / "bin"
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet",
                    "--disable-pip-version-check", str(wheel)],
                   check=True, timeout=300, cwd=home)
    return bin_dir


def clean_env(bin_dir: Path, **extra: str) -> dict[str, str]:
    """No source checkout on the path, no database configured, the venv's bin first."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "FLOWLY_DSN", "DATABASE_URL", "VIRTUAL_ENV",
                        "FLOWLY_EMBEDDED_DIR")}
    env["PATH"] = str(bin_dir) + os.pathsep + env.get("PATH", "")
    return {**env, **extra}
