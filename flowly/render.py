"""Runs as text and JSON: the tables and timelines ``flowly`` prints and the demo shows.

One rendering for both, so the demo shows exactly what ``flowly show`` prints.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from . import deep_json
from .client import Client, Run, Step, StepAttempt, Timer


def one_line(text: str) -> str:
    """Collapse a (possibly multi-line) message into one line."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Decimal):
        return float(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return fields_of(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def fields_of(record: Any) -> dict[str, Any]:
    """A dataclass record's fields by name, their values as they are (``dataclasses.asdict``
    copies nested values recursively, which an input nested thousands deep does not survive)."""
    return {field.name: getattr(record, field.name) for field in dataclasses.fields(record)}


def to_json(value: Any) -> str:
    """Serialise CLI output: datetimes as ISO 8601, intervals as seconds."""
    return deep_json.dumps(value, default=_json_default, indent=2, ensure_ascii=False)


def format_time(value: datetime | None) -> str:
    """A timestamp in local time with milliseconds and the zone's name, or ``-``:
    ``2026-11-30 21:05:09.123 CET`` (a numeric offset where the zone has no name)."""
    if value is None:
        return "-"
    local = value.astimezone()
    zone = local.strftime("%Z") or local.strftime("%z")
    if not zone or (zone[0] in "+-" and zone[1:].isdigit()):
        zone = f"UTC{local.strftime('%z')[:3]}:{local.strftime('%z')[3:]}"
    return f"{local.strftime('%Y-%m-%d %H:%M:%S.%f')[:-3]} {zone}"


def format_age(delta: timedelta) -> str:
    """A short human duration: ``850ms``, ``42s``, ``3m12s``, ``2h05m``, ``3d04h``."""
    seconds = delta.total_seconds()
    if seconds < 1:
        return f"{max(seconds, 0) * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def shorten(text: str, width: int = 60) -> str:
    text = one_line(text)
    return text if len(text) <= width else text[: width - 1] + "…"


def error_message(error: Any) -> str:
    """The message of a stored error object (``{"type", "message", ...}``), or ``-``."""
    if error is None:
        return "-"
    if isinstance(error, dict):
        message = str(error.get("message", "")) or json.dumps(error)
        kind = error.get("type")
        return f"{kind}: {message}" if kind else message
    return str(error)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "") -> str:
    """Left-aligned columns separated by two spaces; the last column is not padded."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        padded = [c.ljust(w) for c, w in zip(row[:-1], widths[:-1], strict=True)] + [row[-1]]
        lines.append(indent + "  ".join(padded).rstrip())
    return "\n".join(lines)


# PostgreSQL's reserved, type/function-name and column-name keywords (src/include/parser/kwlist.h
# of PostgreSQL 17, the categories a bare identifier cannot take everywhere): these need quotes.
# A static copy, so the CLI needs no SQL parser at run time; tests/test_packaging.py checks it
# against pglast's list.
KEYWORDS_NEEDING_QUOTES = frozenset("""
    all analyse analyze and any array as asc asymmetric authorization between bigint
    binary bit boolean both case cast char character check coalesce collate collation
    column concurrently constraint create cross current_catalog current_date
    current_role current_schema current_time current_timestamp current_user dec decimal
    default deferrable desc distinct do else end except exists extract false fetch float
    for foreign freeze from full grant greatest group grouping having ilike in initially
    inner inout int integer intersect interval into is isnull join json json_array
    json_arrayagg json_exists json_object json_objectagg json_query json_scalar
    json_serialize json_table json_value lateral leading least left like limit localtime
    localtimestamp merge_action national natural nchar none normalize not notnull null
    nullif numeric offset on only or order out outer overlaps overlay placing position
    precision primary real references returning right row select session_user setof
    similar smallint some substring symmetric system_user table tablesample then time
    timestamp to trailing treat trim true union unique user using values varchar
    variadic verbose when where window with xmlattributes xmlconcat xmlelement xmlexists
    xmlforest xmlnamespaces xmlparse xmlpi xmlroot xmlserialize xmltable
""".split())


def quote_ident(name: str) -> str:
    """``name`` as it must be typed in SQL: bare when it is a plain lower-case identifier that
    is not a keyword Postgres would read otherwise (``user``, ``select``, ...)."""
    if re.fullmatch(r"[a-z_][a-z0-9_$]*", name) and name not in KEYWORDS_NEEDING_QUOTES:
        return name
    return '"' + name.replace('"', '""') + '"'


def quote_literal(value: str) -> str:
    """``value`` as an SQL string literal."""
    return "'" + value.replace("'", "''") + "'"


# -- one run in detail (``flowly show``; reused by the demo) ----------------------------------


@dataclass(frozen=True)
class RunDetail:
    """Everything ``flowly show`` prints about a run."""

    run: Run
    steps: list[Step]
    timers: list[Timer]
    failed_attempts: list[StepAttempt]

    def as_json(self) -> dict[str, Any]:
        """The full structure, for ``--json``."""
        return {
            "run": fields_of(self.run),
            "steps": [
                {**fields_of(s),
                 "duration_ms": round(s.duration.total_seconds() * 1000, 3)}
                for s in self.steps
            ],
            "timers": [fields_of(t) for t in self.timers],
            "failed_attempts": [fields_of(a) for a in self.failed_attempts],
        }


def load_run(client: Client, run_id: str) -> RunDetail:
    """Read a run, its steps, its failed attempts and its timers (plain selects).

    Raises :class:`flowly.RunNotFound` when there is no such run.
    """
    run = client.get(run_id)
    return RunDetail(run, client.steps(run_id), client.timers(run_id),
                     client.failed_attempts(run_id))


def _compensation(step: Step, run: Run) -> str:
    if not step.compensable:
        return "-"
    if step.compensation_status == "completed":
        return "compensated"
    if step.compensation_status == "failed":
        return f"FAILED: {shorten(error_message(step.compensation_error), 40)}"
    return "pending" if run.status == "compensating" else "not needed"


def _full_error(error: Any, indent: str = "    ") -> list[str]:
    """An error object in full: type and message, then its traceback, indented."""
    if error is None:
        return []
    lines = [indent + line for line in error_message(error).splitlines() or [""]]
    if isinstance(error, dict):
        extra = {k: v for k, v in error.items() if k not in ("type", "message", "traceback")}
        if extra:
            lines.append(indent + json.dumps(extra, ensure_ascii=False, default=str))
        if error.get("traceback"):
            lines += [indent + "  " + line for line in str(error["traceback"]).splitlines()]
    return lines


def _full_json(value: Any, indent: str = "    ") -> list[str]:
    text = deep_json.dumps(value, indent=2, ensure_ascii=False, default=str)
    return [indent + line for line in text.splitlines()]


def render_run(detail: RunDetail, *, full: bool = False) -> str:
    """A run as text: its header, the step timeline, failed attempts and durable timers.

    ``full`` prints input, output and every error untruncated, with their tracebacks, after
    the tables.
    """
    run = detail.run
    now = datetime.now(UTC)
    header: list[tuple[str, str]] = [
        ("workflow", run.workflow),
        ("status", run.status),
        ("attempt", f"{run.attempt} of {run.max_attempts}"),
        ("queue", f"{run.queue} (priority {run.priority})"),
        ("created", format_time(run.created_at)),
    ]
    if run.status == "pending" and run.scheduled_for > now:
        due = f"{format_time(run.scheduled_for)} (in {format_age(run.scheduled_for - now)})"
        header.append(("due", due))
    header.append(("started", format_time(run.started_at)))
    if run.finished_at is not None:
        took = format_age(run.finished_at - run.created_at)
        header.append(("finished", f"{format_time(run.finished_at)} ({took} after creation)"))
    else:
        header.append(("age", format_age(now - run.created_at)))
    if run.locked_by is not None and run.locked_until is not None:
        state = "expired" if run.locked_until < now else "valid"
        header.append(("held by", f"{run.locked_by}, lease until "
                                  f"{format_time(run.locked_until)} ({state})"))
    if run.concurrency_key is not None:
        header.append(("concurrency key", run.concurrency_key))
    if run.parent_run_id is not None:
        header.append(("parent run", run.parent_run_id))
    if run.error is not None:
        where = run.error.get("step") if isinstance(run.error, dict) else None
        header.append(("error", shorten(error_message(run.error), 120)
                       + (f" (step {where})" if where else "")))
    if run.compensation_ok is not None or run.status in ("compensating", "dead_letter"):
        ok = run.compensation_ok
        header.append(("compensation_ok", "-" if ok is None else str(ok).lower()))
    if not full:
        header.append(("input", shorten(deep_json.dumps(run.input), 100)))
        if run.output is not None:
            header.append(("output", shorten(deep_json.dumps(run.output), 100)))
    width = max(len(k) for k, _ in header)
    lines = [f"run {run.id}"] + [f"  {k.ljust(width)}  {v}" for k, v in header]

    lines += ["", "steps"]
    if detail.steps:
        lines.append(table(
            ["#", "NAME", "STATUS", "ATTEMPTS", "DURATION_MS", "ERROR", "COMPENSATION"],
            [
                [position, s.name, s.status, s.attempts,
                 f"{s.duration.total_seconds() * 1000:.0f}",
                 shorten(error_message(s.error), 50), _compensation(s, run)]
                for position, s in enumerate(detail.steps, start=1)
            ],
            indent="  ",
        ))
    else:
        lines.append("  (no step has completed or failed yet)")
    if run.status == "running":
        lines.append("  (a step in progress appears once it completes or fails for good)")

    if detail.failed_attempts:
        lines += ["", "failed attempts"]
        lines.append(table(
            ["STEP", "GEN", "ATTEMPT", "FAILED_AT", "RETRY_AT", "ERROR"],
            [
                [a.step_name, a.generation, a.attempt, format_time(a.failed_at),
                 format_time(a.retry_at) if a.retry_at else "no retry",
                 shorten(error_message(a.error), 50)]
                for a in detail.failed_attempts
            ],
            indent="  ",
        ))

    if detail.timers:
        lines += ["", "timers"]
        lines.append(table(
            ["NAME", "WAKE_AT", "FIRED_AT"],
            [[t.name, format_time(t.wake_at),
              format_time(t.fired_at) if t.fired_at else "not yet"] for t in detail.timers],
            indent="  ",
        ))
    if full:
        lines += _render_full(detail)
    return "\n".join(lines)


def _render_full(detail: RunDetail) -> list[str]:
    """The ``--full`` sections: everything the tables shorten, in full."""
    run = detail.run
    lines = ["", "input", *_full_json(run.input, "  ")]
    if run.output is not None:
        lines += ["", "output", *_full_json(run.output, "  ")]
    if run.error is not None:
        lines += ["", "run error", *_full_error(run.error, "  ")]
    for step in detail.steps:
        if step.error is not None:
            lines += ["", f"step {step.name}: error", *_full_error(step.error, "  ")]
        if step.compensation_error is not None:
            lines += ["", f"step {step.name}: compensation error",
                      *_full_error(step.compensation_error, "  ")]
    for attempt in detail.failed_attempts:
        lines += ["", f"step {attempt.step_name}: failed attempt {attempt.attempt}"
                      f" (generation {attempt.generation}, {format_time(attempt.failed_at)})",
                  *_full_error(attempt.error, "  ")]
    return lines
