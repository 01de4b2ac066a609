"""Checks of the values callers hand the client, made before anything reaches the database.

A value of the wrong type would otherwise fail there as something else: an int as a name
makes PostgreSQL look for a function that does not exist (read as "flowly is not
installed"), a list is sent as an array and stored as the text ``{ev}``, a NUL character
fails as a raw data error, a negative limit as a bare SQL error. Each check raises
:class:`InvalidArgument` naming the argument and the value.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from typing import Any

from .db import NON_TERMINAL, TERMINAL
from .errors import InvalidArgument

STATUSES = (*NON_TERMINAL, *TERMINAL)


def text(what: str, value: Any) -> str:
    """``value`` if it is text the database can hold (lengths are checked in SQL)."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a string, got {type(value).__name__} {value!r}")
    if "\x00" in value:
        raise InvalidArgument(f"{what} must not contain the NUL character, got {value!r}")
    return value


def optional_text(what: str, value: Any) -> str | None:
    return None if value is None else text(what, value)


def int4(what: str, value: Any) -> int:
    """``value`` if the database's integer can hold it (the SQL checks its range of meaning)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(f"{what} must be an integer, got {type(value).__name__}")
    if not -2**31 <= value < 2**31:
        raise InvalidArgument(f"{what} is out of range: {value}")
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
    """``value`` if it is None or a finite number of seconds, positive (or ``zero``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not (0 <= value if zero else 0 < value) or not value < math.inf:
        shown = f"{value:g}" if isinstance(value, (int, float)) else repr(value)
        least = "zero or more" if zero else "a positive number of"
        raise InvalidArgument(f"{what} must be {least} seconds, got {shown}")
    return value


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


def duration(what: str, value: Any) -> timedelta:
    """``value``, seconds or a timedelta, as a timedelta."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{what} must be seconds or a timedelta, got"
                              f" {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise InvalidArgument(f"{what} must be a finite number of seconds, got {value}")
    try:
        return timedelta(seconds=value)
    except OverflowError:
        raise InvalidArgument(f"{what} is out of range: {value} seconds") from None


def age(what: str, value: Any) -> timedelta:
    """An age given as seconds or a timedelta, zero or more."""
    result = duration(what, value)
    if result < timedelta(0):
        raise InvalidArgument(f"{what} must be zero or more, got {value}")
    return result


def time_ahead(what: str, value: Any) -> timedelta:
    """``value``, seconds or a timedelta from now, if now plus it stays a readable time
    (before the year 10000; a negative value is a time already past)."""
    delta = duration(what, value)
    try:
        datetime.now(UTC) + delta
    except OverflowError:
        raise InvalidArgument(f"{what} must end before the year 10000, got {value}") from None
    return delta


def seconds_ahead(what: str, value: Any) -> float:
    """:func:`time_ahead` in seconds."""
    return time_ahead(what, value).total_seconds()


def aware_time(what: str, value: Any) -> datetime:
    """``value`` if it is a timezone-aware datetime: a naive one would be read in the
    database session's time zone, which need not be the caller's."""
    if not isinstance(value, datetime):
        raise InvalidArgument(f"{what} must be a datetime, got {type(value).__name__} {value!r}")
    if value.utcoffset() is None:
        raise InvalidArgument(f"{what} must be timezone-aware (a naive datetime would be read"
                              f" in the database's time zone), got {value}")
    return value


__all__ = ["STATUSES", "age", "at_least", "aware_time", "duration", "int4", "limit",
           "optional_text", "seconds", "seconds_ahead", "status", "statuses", "text",
           "time_ahead"]
