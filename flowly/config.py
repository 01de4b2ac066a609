"""Where flowly finds its database: ``--dsn``, then FLOWLY_DSN, then DATABASE_URL, then an
embedded PostgreSQL started on demand (so a machine without any server still works); and the
check of a DSN, whose errors never show its password."""

from __future__ import annotations

import logging
import os
import re
import urllib.parse
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from .errors import InvalidArgument

logger = logging.getLogger(__name__)


def given(value: str | None) -> str | None:
    """``value`` unless it is blank: an empty or all-space setting (an env file's
    ``FLOWLY_DSN=`` line) counts as unset, not as libpq's "every default", which reaches
    another server or database than the next setting names."""
    return value if value and not value.isspace() else None


def configured_dsn(explicit: str | None = None) -> str | None:
    """The DSN given explicitly or through the environment, if any (blank ones skipped)."""
    for value in (explicit, os.environ.get("FLOWLY_DSN"), os.environ.get("DATABASE_URL")):
        if given(value):
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


_MASK = "********"
# where libpq reads a password in a DSN: a URI's user info (user:password@, which ends at the
# first @ or /), a URI's query (password=...), a key=value string's password (quoted, with
# backslash escapes, or up to a space); looked for in the text, since a DSN libpq cannot parse
# is what must be told about
_PASSWORDS = (
    re.compile(r"^\s*postgres(?:ql)?://[^@/:]*:(?P<password>[^@/]*)@"),
    re.compile(r"[?&]password=(?P<password>[^&]*)"),
    re.compile(r"(?:^|\s)password\s*=\s*(?P<password>'(?:[^'\\]|\\.)*'?|(?:[^\s\\]|\\.)+)"),
)


def _password_spans(dsn: str) -> list[tuple[int, int]]:
    return [match.span("password") for pattern in _PASSWORDS for match in pattern.finditer(dsn)
            if match.group("password")]


def redacted_dsn(dsn: str) -> str:
    """``dsn`` with every password in it masked."""
    for start, end in sorted(_password_spans(dsn), reverse=True):
        dsn = dsn[:start] + _MASK + dsn[end:]
    return dsn


def _password_forms(written: str) -> set[str]:
    """A password as written in a DSN, and as libpq may quote it: unquoted, unescaped,
    percent-decoded."""
    unquoted = written[1:].removesuffix("'") if written.startswith("'") else written
    forms = {written, unquoted, re.sub(r"\\(.)", r"\1", unquoted),
             urllib.parse.unquote(unquoted)}
    return {form for form in forms if form}


def redacted_message(message: str, dsn: str) -> str:
    """libpq's ``message`` about ``dsn`` with the password masked: libpq quotes a malformed URI
    whole, or the token it stumbled on (a password with a stray %). A message that still shows
    the password after that is withheld."""
    passwords = set().union(*(_password_forms(dsn[start:end])
                              for start, end in _password_spans(dsn)))
    if not passwords:
        return message
    message = message.replace(dsn, redacted_dsn(dsn))
    for password in passwords:
        message = message.replace(f'"{password}"', f'"{_MASK}"')
    if any(password in message for password in passwords):
        return "libpq cannot parse it (its message is withheld: it would show the password)"
    return message


def checked_dsn(dsn: Any) -> str:
    """``dsn`` if libpq can parse it; else :class:`InvalidArgument` naming what is wrong, with
    any password in it masked (libpq's own error quoted it, and flowly showed that error as
    the client's, the worker's and the command line's). What libpq finds wrong only when it
    connects (a port that is not a number, say) is a value, never the password."""
    if not isinstance(dsn, str):
        raise InvalidArgument(f"dsn must be a string, got {type(dsn).__name__}")
    if "\x00" in dsn:
        raise InvalidArgument("dsn must not contain the NUL character")
    try:
        dsn.encode("utf-8")
        conninfo_to_dict(dsn)
    except UnicodeEncodeError:
        raise InvalidArgument("dsn must not contain an unpaired surrogate (it is not UTF-8"
                              " text)") from None
    except psycopg.ProgrammingError as exc:
        raise InvalidArgument(
            f"dsn: {redacted_message(str(exc).strip(), dsn)}") from None
    return dsn
