"""Where flowly finds its database: ``--dsn``, then FLOWLY_DSN, then DATABASE_URL, then an
embedded PostgreSQL started on demand (so a machine without any server still works)."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def configured_dsn(explicit: str | None = None) -> str | None:
    """The DSN given explicitly or through the environment, if any."""
    return explicit or os.environ.get("FLOWLY_DSN") or os.environ.get("DATABASE_URL") or None


def resolve_dsn(explicit: str | None = None) -> str:
    """The DSN to use, starting (or reusing) the embedded PostgreSQL when none is configured."""
    dsn = configured_dsn(explicit)
    if dsn:
        return dsn
    from .embedded import embedded_dsn

    dsn = embedded_dsn()
    logger.info("no DSN configured (--dsn, FLOWLY_DSN, DATABASE_URL): using embedded %s", dsn)
    return dsn
