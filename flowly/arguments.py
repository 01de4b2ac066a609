"""Checks of the values callers hand the client, made before anything reaches the database.

A value of the wrong type would otherwise fail there as something else: an int as a name
makes PostgreSQL look for a function that does not exist (read as "flowly is not
installed"), a list is sent as an array and stored as the text ``{ev}``, a NUL character
fails as a raw data error, a negative limit as a bare SQL error; an unpaired surrogate cannot
even be sent (UnicodeEncodeError), nor a number too large for a float (OverflowError). Each
check raises :class:`InvalidArgument` naming the argument and the value.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from typing import Any

from .db import NON_TERMINAL, TERMINAL
from .errors import InvalidArgument

STATUSES = (*NON_TERMINAL, *TERMINAL)

MAX_STATEMENT_SECONDS = 2_147_483
"""The longest client timeout in whole seconds: the client sets it as the server's
``statement_timeout``, which takes at most 2147483647 ms (about 24.8 days)."""


def _shown(value: Any) -> str:
    """``value`` for a message: a number in short (an integer too long to print, or to make a
    float of, by its power of ten), a timedelta as it prints, anything else as its repr."""
    if isinstance(value, timedelta):
        return str(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, float):
        return f"{value:.10g}"
    if abs(value) >= 10**16:
        return f"{'-' if value < 0 else ''}about 10**{math.floor(math.log10(abs(value)))}"
    return str(value)


def text(what: str, value: Any) -> str:
    """``value`` if it is text the database can hold (lengths are checked in SQL): no NUL
    character, and UTF-8 (an unpaired surrogate is not, and cannot be sent)."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a string, got {type(value).__name__} {value!r}")
    if "\x00" in value:
        raise InvalidArgument(f"{what} must not contain the NUL character, got {value!r}")
    if not value.isascii():  # ASCII text (most of it) holds no surrogate
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument(f"{what} must not contain an unpaired surrogate (it is not"
                                  f" UTF-8 text), got {value!r}") from None
    return value


def optional_text(what: str, value: Any) -> str | None:
    return None if value is None else text(what, value)


def int4(what: str, value: Any) -> int:
    """``value`` if the database's integer can hold it (the SQL checks its range of meaning)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(f"{what} must be an integer, got {type(value).__name__}")
    if not -2**31 <= value < 2**31:
        raise InvalidArgument(f"{what} is out of range: {_shown(value)}")
    return value


def at_least(what: str, value: Any, least: int) -> int:
    """``value`` if it is an integer of ``least`` or more."""
    checked = int4(what, value)
    if checked < least:
        raise InvalidArgument(f"{what} must be at least {least}, got {value}")
    return checked


def limit(value: Any) -> int:
    """A listing's ``limit``: how many rows at most, zero or more."""
    checked = int4("limit", value)
    if checked < 0:
        raise InvalidArgument(f"limit must be zero or more, got {value}")
    return checked


def seconds(what: str, value: Any, *, zero: bool = False) -> float | None:
    """``value`` if it is None or a finite number of seconds, positive (or ``zero``), that a
    float can hold (the callers compute deadlines with it)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not (0 <= value if zero else 0 < value) or not value < math.inf:
        least = "zero or more" if zero else "a positive number of"
        raise InvalidArgument(f"{what} must be {least} seconds, got {_shown(value)}")
    if value > sys.float_info.max:  # an integer; a float cannot hold it
        raise InvalidArgument(f"{what} is out of range: {_shown(value)} seconds")
    return value


def statement_seconds(what: str, value: Any) -> float | None:
    """A client's ``timeout``: :func:`seconds`, at most :data:`MAX_STATEMENT_SECONDS` (a
    longer one would fail every call of the client at the server)."""
    if isinstance(value, (int, float)) and MAX_STATEMENT_SECONDS < value < math.inf:
        raise InvalidArgument(f"{what} must be at most {MAX_STATEMENT_SECONDS} seconds (about"
                              " 24.8 days: the database's statement_timeout takes no more),"
                              f" got {_shown(value)}")
    return seconds(what, value)


def status(what: str, value: Any) -> str:
    """``value`` if it is a run status: a misspelt one would match no run."""
    checked = text(what, value)
    if checked not in STATUSES:
        raise InvalidArgument(f"{what} must be one of {', '.join(STATUSES)}, got {value!r}")
    return checked


def statuses(what: str, value: str | Collection[str] | None, allowed: Collection[str] = STATUSES,
             ) -> tuple[str, ...] | None:
    """``value`` (one status or several) as a tuple of known run statuses: a misspelt one
    would otherwise match no run, and a wait for it would wait for ever."""
    if value is None:
        return None
    given = (value,) if isinstance(value, str) else value
    if not isinstance(given, Collection) or not given:
        raise InvalidArgument(f"{what} must be one of {', '.join(allowed)}, or a collection"
                              f" of them, got {value!r}")
    unknown = [s for s in given if s not in allowed]
    if unknown:
        raise InvalidArgument(f"{what} must be among {', '.join(allowed)}, got {unknown[0]!r}")
    return tuple(given)


def _seconds_or_timedelta(what: str, value: Any) -> float | timedelta:
    """``value`` if it is a finite number of seconds (an integer of any size) or a
    timedelta."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{what} must be seconds or a timedelta, got"
                              f" {type(value).__name__} {value!r}")
    # an integer is finite, however large (and math.isfinite cannot take one past a float)
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgument(f"{what} must be a finite number of seconds, got {value}")
    return value


def duration(what: str, value: Any) -> timedelta:
    """``value``, seconds or a timedelta, as a timedelta."""
    checked = _seconds_or_timedelta(what, value)
    if isinstance(checked, timedelta):
        return checked
    try:
        return timedelta(seconds=checked)
    except OverflowError:
        raise InvalidArgument(f"{what} is out of range: {_shown(value)} seconds") from None


def age(what: str, value: Any) -> timedelta:
    """An age given as seconds or a timedelta, zero or more."""
    result = duration(what, value)
    if result < timedelta(0):
        raise InvalidArgument(f"{what} must be zero or more, got {value}")
    return result


def time_ahead(what: str, value: Any, *, positive: bool = False) -> timedelta:
    """``value``, seconds or a timedelta from now, if now plus it stays a readable time (in
    the years 1 to 9999; a negative value is a time already past), and if ``positive``, more
    than zero."""
    delta = duration(what, value)
    if positive and delta <= timedelta(0):
        raise InvalidArgument(f"{what} must be positive, got {_shown(value)}")
    try:
        datetime.now(UTC) + delta
    except OverflowError:
        bound = ("end before the year 10000" if delta > timedelta(0)
                 else "not reach back before the year 1")
        raise InvalidArgument(f"{what} must {bound}, got {_shown(value)}") from None
    return delta


def seconds_ahead(what: str, value: Any) -> float:
    """:func:`time_ahead` in seconds, for a sleep or a wait's timeout: zero or fewer seconds,
    however many fewer, are a time already due, so zero."""
    checked = _seconds_or_timedelta(what, value)
    past = checked <= timedelta(0) if isinstance(checked, timedelta) else checked <= 0
    if past:
        return 0.0
    return time_ahead(what, checked).total_seconds()


def aware_time(what: str, value: Any) -> datetime:
    """``value`` if it is a timezone-aware datetime: a naive one would be read in the
    database session's time zone, which need not be the caller's."""
    if not isinstance(value, datetime):
        raise InvalidArgument(f"{what} must be a datetime, got {type(value).__name__} {value!r}")
    if value.utcoffset() is None:
        raise InvalidArgument(f"{what} must be timezone-aware (a naive datetime would be read"
                              f" in the database's time zone), got {value}")
    return value


__all__ = ["MAX_STATEMENT_SECONDS", "STATUSES", "age", "at_least", "aware_time", "duration",
           "int4", "limit", "optional_text", "seconds", "seconds_ahead", "statement_seconds",
           "status", "statuses", "text", "time_ahead"]
