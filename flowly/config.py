"""Where flowly finds its database: ``--dsn``, then FLOWLY_DSN, then DATABASE_URL, then an
embedded PostgreSQL started on demand (so a machine without any server still works)."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def _given(value: str | None) -> str | None:
    """``value`` unless it is blank: an empty or all-space setting (an env file's
    ``FLOWLY_DSN=`` line) counts as unset, not as libpq's "every default", which reaches
    another server or database than the next setting names."""
    return value if value and not value.isspace() else None


def configured_dsn(explicit: str | None = None) -> str | None:
    """The DSN given explicitly or through the environment, if any (blank ones skipped)."""
    for value in (explicit, os.environ.get("FLOWLY_DSN"), os.environ.get("DATABASE_URL")):
        if _given(value):
            return value
    return None


def resolve_dsn(explicit: str | None = None) -> str:
    """The DSN to use, starting (or reusing) the embedded PostgreSQL when none is configured."""
    dsn = configured_dsn(explicit)
    if dsn:
        return dsn
    from .embedded import embedded_dsn

    dsn = embedded_dsn()
    logger.info("no DSN configured (--dsn, FLOWLY_DSN, DATABASE_URL): using embedded %s", dsn)
    return dsn
