"""Reading JSON that nests deeper than Python's recursion limit.

PostgreSQL stores a ``jsonb`` value nested thousands of levels deep (a run's input or an event
payload written from SQL), but ``json.loads`` recurses once per level and raises
``RecursionError`` past about a thousand. Raised while psycopg loads a row, that error fails
the whole fetch: a claim of many runs, one of them with such an input, crashed the worker, and
a replay page holding such a payload could never be read. :func:`loads` decodes those values
without recursion instead, so they reach the workflow like any other; :func:`use_on` makes a
connection load ``json`` and ``jsonb`` with it. :func:`dumps_without_recursion` writes such
values back (flowly.db's dumps falls back on it), and :func:`dumps` for the command line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from json.decoder import JSONDecodeError, scanstring  # type: ignore[attr-defined]
from json.scanner import NUMBER_RE
from typing import Any

import psycopg
from psycopg.types.json import set_json_loads

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_SCAN: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
_LITERALS = {"null": None, "true": True, "false": False, "NaN": float("nan"),
             "Infinity": float("inf"), "-Infinity": float("-inf")}


def use_on(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Load ``json`` and ``jsonb`` values on ``conn`` with :func:`loads`."""
    set_json_loads(loads, conn)


def loads(data: str | bytes) -> Any:
    """``json.loads``, but a value nested too deeply for it is decoded without recursion."""
    if isinstance(data, bytes):
        # decoded as json.loads decodes UTF-8 bytes, without first detecting that they are
        # (PostgreSQL sends JSON in the connection's encoding, UTF-8 for flowly's): that
        # detection cost as much as decoding a small value
        data = data.decode("utf-8", "surrogatepass")
    try:
        # the decoder's own scanner, without json.loads's wrapper (a type check, two regular
        # expressions for surrounding white space), which cost more than scanning a small
        # value; jsonb's text has no white space around it, and anything else (json text
        # with some, an error) goes through json.loads as before
        value, end = _SCAN(data, 0)
    except (StopIteration, ValueError):
        end = -1
    except RecursionError:
        return _loads_without_recursion(data)
    if end == len(data):
        return value
    try:
        return json.loads(data)
    except RecursionError:
        return _loads_without_recursion(data)


def dumps(value: Any, **options: Any) -> str:
    """``json.dumps(value, **options)``; a value nested too deeply for it is written by
    :func:`dumps_without_recursion`, compactly (``indent`` and ``separators`` are not
    followed; ``default``, ``ensure_ascii`` and ``allow_nan`` are)."""
    try:
        return json.dumps(value, **options)
    except RecursionError:
        return dumps_without_recursion(value, **{
            k: v for k, v in options.items() if k in ("default", "ensure_ascii", "allow_nan")})


class _Written(str):
    """Text to write as it is (a bracket, a comma, a key), among the values still to write."""


def dumps_without_recursion(value: Any, **scalar_options: Any) -> str:
    """``value`` as compact JSON text (no spaces), written without recursion; the options
    (``default``, ``ensure_ascii``, ``allow_nan``) apply as in ``json.dumps``."""
    parts: list[str] = []
    todo: list[Any] = [value]  # popped from the end: the next value, or _Written text
    while todo:
        item = todo.pop()
        if isinstance(item, _Written):
            parts.append(item)
        elif isinstance(item, (list, tuple)):
            parts.append("[")
            todo.append(_Written("]"))
            for index in reversed(range(len(item))):
                todo.append(item[index])
                if index:
                    todo.append(_Written(","))
        elif isinstance(item, dict):
            parts.append("{")
            todo.append(_Written("}"))
            entries = list(item.items())
            for index in reversed(range(len(entries))):
                key, entry = entries[index]
                todo.append(entry)
                text = key if isinstance(key, str) else json.dumps(key)
                todo.append(_Written(json.dumps(text, **scalar_options) + ":"))
                if index:
                    todo.append(_Written(","))
        else:
            parts.append(json.dumps(item, **scalar_options))
    return "".join(parts)


def _loads_without_recursion(text: str) -> Any:
    """Decode ``text`` as ``json.loads`` does, keeping the open arrays and objects on a list
    of its own instead of the call stack."""
    try:
        return _decode(text)
    except IndexError:
        raise JSONDecodeError("Unterminated JSON value", text, len(text)) from None


def _decode(text: str) -> Any:
    # the arrays and objects opened and not yet closed, each with the key of the value that
    # goes into it next (None in an array)
    open_: list[tuple[list[Any] | dict[str, Any], str | None]] = []
    at = _skip(text, 0)
    while True:
        char = text[at]
        if char in "[{":
            at = _skip(text, at + 1)
            if text[at] == ("]" if char == "[" else "}"):
                value: Any = [] if char == "[" else {}
                at += 1
            elif char == "[":
                open_.append(([], None))
                continue
            else:
                key, at = _key(text, at)
                open_.append(({}, key))
                continue
        elif char == '"':
            value, at = scanstring(text, at + 1)
        else:
            value, at = _scalar(text, at)
        # a value is complete: it goes into the innermost open container, and each container
        # it completes goes into the one around it
        while True:
            if not open_:
                if _skip(text, at) != len(text):
                    raise JSONDecodeError("Extra data", text, at)
                return value
            container, into = open_[-1]
            if isinstance(container, list):
                container.append(value)
            else:
                assert into is not None  # an object's entry always has its key
                container[into] = value
            at = _skip(text, at)
            if text[at] == ",":
                at = _skip(text, at + 1)
                if isinstance(container, dict):
                    into, at = _key(text, at)
                    open_[-1] = (container, into)
                break
            if text[at] != ("]" if isinstance(container, list) else "}"):
                raise JSONDecodeError("Expecting ',' delimiter", text, at)
            open_.pop()
            value = container
            at += 1


def _skip(text: str, at: int) -> int:
    return _WHITESPACE.match(text, at).end()  # type: ignore[union-attr]


def _key(text: str, at: int) -> tuple[str, int]:
    """An object's key at ``at`` and the position of its value."""
    if text[at] != '"':
        raise JSONDecodeError("Expecting property name enclosed in double quotes", text, at)
    key, at = scanstring(text, at + 1)
    at = _skip(text, at)
    if text[at] != ":":
        raise JSONDecodeError("Expecting ':' delimiter", text, at)
    return key, _skip(text, at + 1)


def _scalar(text: str, at: int) -> tuple[Any, int]:
    """A number or a literal at ``at``, and the position after it."""
    number = NUMBER_RE.match(text, at)
    if number is not None:
        integer, fraction, exponent = number.groups()
        if fraction or exponent:
            return float(integer + (fraction or "") + (exponent or "")), number.end()
        return int(integer), number.end()
    for literal, value in _LITERALS.items():
        if text.startswith(literal, at):
            return value, at + len(literal)
    raise JSONDecodeError("Expecting value", text, at)
