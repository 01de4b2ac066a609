"""``flowly top``: a live view of the engine in the terminal, refreshed every second.

Everything it shows is read from the dashboard views (``run_counts``, ``queue_backlog``,
``live_workers``, ``stuck_runs``, ``dead_letters``) and plain, bounded selects on ``runs``,
``steps`` and ``step_attempts``, so a SQL dashboard can show the same. :func:`snapshot` reads
one frame as plain data (``flowly --json top --once`` prints it); :func:`render` lays it out
with ``rich`` (tables that shrink to a narrow terminal, no colours a pipe would see);
:func:`run` draws it full-screen until ``q`` (or Ctrl-C), or once with ``once=True``.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .bounded_calls import Cutoff
from .db import (
    DEFAULT_SCHEMA,
    NON_TERMINAL,
    TERMINAL,
    UNPREPARED,
    check_schema_name,
    connect_params,
    schema_identifier,
    set_up_session,
    translated_errors,
)
from .render import error_message, format_age, one_line, to_json

STATUSES = (*NON_TERMINAL, *TERMINAL)
LIMIT = 10
"""Rows per list panel (workers, in-flight runs, retries, stuck runs, dead letters)."""

_QUERIES: dict[str, str] = {
    "now": "select now() as now",
    "statuses": "select status, sum(runs)::bigint as runs from {s}.run_counts group by status",
    "finished": """
        select status, count(*) as runs from {s}.runs
        where status in ('completed', 'dead_letter', 'cancelled')
          and finished_at > now() - interval '1 minute' group by status""",
    "created": """
        select count(*) as runs from {s}.runs where created_at > now() - interval '1 minute'""",
    "queues": """
        select queue, due, scheduled, in_flight,
               extract(epoch from oldest_due_age)::float8 as oldest_due_age
        from {s}.queue_backlog order by due desc, queue limit %(limit)s""",
    "workers": """
        select w.worker, w.workflows, w.queues, w.runs_held,
               extract(epoch from now() - w.last_seen_at)::float8 as seen_ago,
               array(select r.id from {s}.runs r
                     where r.locked_by = w.worker and r.status in ('running', 'compensating')
                     order by r.id limit 5) as held
        from {s}.live_workers w order by w.runs_held desc, w.worker limit %(limit)s""",
    "in_flight": """
        select r.id as run_id, r.workflow, r.status, r.locked_by,
               case when r.locked_until >= now() then 'held' else 'expired' end as lease,
               extract(epoch from r.locked_until - now())::float8 as lease_left,
               (select count(*) from (select from {s}.steps s where s.run_id = r.id limit 1000) n
               ) as steps_done,
               last.name as last_step,
               extract(epoch from now() - greatest(r.started_at, last.finished_at))::float8
                   as step_age
        from {s}.runs r
        left join lateral (select s.name, s.finished_at from {s}.steps s
                           where s.run_id = r.id order by s.seq desc limit 1) last on true
        where r.status in ('running', 'compensating')
        order by r.started_at nulls last, r.id limit %(limit)s""",
    "leases": """
        select count(*) filter (where locked_until >= now()) as held,
               count(*) filter (where locked_until < now()) as expired
        from {s}.runs where status in ('running', 'compensating')""",
    "retries": """
        select r.id as run_id, r.workflow, a.step_name as step, a.attempt, a.error,
               extract(epoch from a.retry_at - now())::float8 as retry_in
        from {s}.runs r
        cross join lateral (select * from {s}.step_attempts a where a.run_id = r.id
                            order by a.failed_at desc limit 1) a
        where r.status = 'pending' and r.scheduled_for > now() and a.retry_at > now()
        order by a.retry_at limit %(limit)s""",
    "stuck": """
        select run_id, workflow, queue, reason, locked_by,
               extract(epoch from stuck_for)::float8 as stuck_for
        from {s}.stuck_runs order by stuck_for desc limit %(limit)s""",
    "dead_letters": """
        select run_id, workflow, failed_step, error,
               extract(epoch from now() - finished_at)::float8 as age
        from {s}.dead_letters order by created_at desc limit %(limit)s""",
}


def snapshot(conn: psycopg.Connection[Any], schema: str = DEFAULT_SCHEMA,
             limit: int = LIMIT) -> dict[str, Any]:
    """One frame of ``flowly top`` as plain data (ages and countdowns in seconds).

    All reads run in one read-only transaction, so the panels agree with each other.
    """
    ident = schema_identifier(check_schema_name(schema))
    rows: dict[str, list[dict[str, Any]]] = {}
    with translated_errors(schema), conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
        cur.execute("set transaction isolation level repeatable read, read only")
        for name, text in _QUERIES.items():
            cur.execute(sql.SQL(text).format(s=ident), {"limit": limit})
            rows[name] = cur.fetchall()
    finished = {r["status"]: r["runs"] for r in rows["finished"]}
    counts = {r["status"]: r["runs"] for r in rows["statuses"]}
    statuses = {
        status: {"runs": counts.get(status, 0),
                 "per_minute": finished.get(status, 0) if status in TERMINAL else None}
        for status in STATUSES
    }
    for row in rows["retries"]:
        row["error"] = error_message(row["error"])
    for row in rows["dead_letters"]:
        row["error"] = error_message(row["error"])
    for row in rows["workers"]:
        row["held"] = list(row["held"])
    return {
        "schema": schema,
        "now": rows["now"][0]["now"],
        "statuses": statuses,
        "created_per_minute": rows["created"][0]["runs"],
        "queues": rows["queues"],
        "workers": rows["workers"],
        "in_flight": rows["in_flight"],
        "leases": rows["leases"][0],
        "retries": rows["retries"],
        "stuck": rows["stuck"],
        "dead_letters": rows["dead_letters"],
    }


# -- layout -----------------------------------------------------------------------------------


NARROW = 72
"""Below this many columns the panels drop their optional columns."""


def _table(title: str, narrow: bool, *columns: str) -> Table:
    """A panel. A column name ending in ``?`` is optional (dropped when ``narrow``); ``#`` marks
    a number and ``~`` an age (right-aligned, never shortened); ``*`` text that shrinks first.
    Rows must then be added through :func:`_row` with the same column list."""
    table = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD,
                  pad_edge=False, expand=False, show_edge=False, collapse_padding=True)
    for column in columns:
        if narrow and column.endswith("?"):
            continue
        name = column.rstrip("?#~*")
        fixed = "#" in column or "~" in column
        table.add_column(name, justify="right" if fixed else "left", no_wrap=True,
                         overflow="ellipsis",
                         min_width=(max(len(name), 6 if "~" in column else 1) if fixed
                                    else 4 if "*" in column else 10),
                         ratio=1 if "*" in column else None)
    return table


def _row(table: Table, narrow: bool, columns: tuple[str, ...], *cells: str) -> None:
    table.add_row(*(cell for column, cell in zip(columns, cells, strict=True)
                    if not (narrow and column.endswith("?"))))


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else format_age(timedelta(seconds=max(seconds, 0)))


def _clock(value: datetime) -> str:
    local = value.astimezone()
    return f"{local:%H:%M:%S} {local.strftime('%Z') or local.strftime('%z')}"


def render(snap: dict[str, Any], *, width: int = 80, error: str | None = None
           ) -> RenderableType:
    """The frame for ``snap`` on a terminal ``width`` columns wide: a header line, then one
    table per panel (panels with nothing to show are left out)."""
    narrow = width < NARROW
    parts: list[RenderableType] = [Text.assemble(
        ("flowly top", "bold"), f"  schema {snap['schema']}  ", _clock(snap["now"]),
        "  (q quits)")]
    if error:
        parts.append(Text(f"refresh failed: {error}", style="bold red"))

    def panel(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]],
              empty: str | None = None) -> None:
        if not rows and empty is None:
            return
        table = _table(title, narrow, *columns)
        for cells in rows or [(empty or "", *[""] * (len(columns) - 1))]:
            _row(table, narrow, columns, *cells)
        parts.append(table)

    statuses = snap["statuses"]
    if sum(s["runs"] for s in statuses.values()) == 0:
        parts.append(Text("no runs yet: start one with `flowly start WORKFLOW`"))
    leases = snap["leases"]
    panel(f"Runs ({snap['created_per_minute']} created/min)", ("STATUS", "RUNS#", "/MIN#"), [
        (status, str(entry["runs"]),
         "" if entry["per_minute"] is None else str(entry["per_minute"]))
        for status, entry in statuses.items()
    ])
    parts.append(Text(f"leases: {leases['held'] or 0} held, {leases['expired'] or 0} expired"))
    panel("Queues", ("QUEUE*", "DUE#", "LATER#", "FLIGHT#", "OLDEST DUE~"), [
        (q["queue"], str(q["due"]), str(q["scheduled"]), str(q["in_flight"]),
         _age(q["oldest_due_age"]))
        for q in snap["queues"]
    ], empty="(no unfinished runs)")
    panel("Workers", ("WORKER*", "HELD#", "SEEN~?", "HOLDS*?"), [
        (w["worker"], str(w["runs_held"]), _age(w["seen_ago"]),
         ", ".join(w["held"]) + (", ..." if w["runs_held"] > len(w["held"]) else "") or "-")
        for w in snap["workers"]
    ], empty="(no live worker)")
    panel("In flight", ("RUN", "WORKFLOW?", "STEPS#?", "LAST STEP*?", "FOR~", "LEASE"), [
        (r["run_id"], r["workflow"], str(r["steps_done"]), r["last_step"] or "-",
         _age(r["step_age"]),
         f"{_age(r['lease_left'])} left" if r["lease"] == "held"
         else f"EXPIRED {_age(-(r['lease_left'] or 0))}")
        for r in snap["in_flight"]
    ])
    panel("Retries", ("RUN", "STEP*", "TRY#?", "IN~", "ERROR*?"), [
        (r["run_id"], r["step"], str(r["attempt"]), _age(r["retry_in"]), one_line(r["error"]))
        for r in snap["retries"]
    ])
    panel("Stuck", ("RUN", "REASON", "FOR~", "WORKFLOW/QUEUE*?"), [
        (r["run_id"], r["reason"], _age(r["stuck_for"]), f"{r['workflow']}/{r['queue']}")
        for r in snap["stuck"]
    ])
    panel("Dead letters", ("RUN", "AGO~", "STEP*?", "ERROR*"), [
        (r["run_id"], _age(r["age"]), r["failed_step"] or "-", one_line(r["error"]))
        for r in snap["dead_letters"]
    ])
    return Group(*parts)


# -- the program ------------------------------------------------------------------------------


@contextlib.contextmanager
def _keys() -> Iterator[Any]:
    """Single key presses from the terminal on stdin (cbreak mode, restored on exit); a reader
    ``read(timeout) -> str`` that returns "" when no key came. Without a terminal: no keys."""
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    if fd is None:
        def wait(timeout: float) -> str:
            time.sleep(timeout)
            return ""

        yield wait
        return
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def read(timeout: float) -> str:
        ready, _, _ = select.select([fd], [], [], timeout)
        return os.read(fd, 32).decode(errors="replace") if ready else ""

    try:
        yield read
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


# how long one frame's reads may take before the database counts as not answering
_FRAME_LIMIT = 5.0


def _frame_within(conn: psycopg.Connection[Any], schema: str, seconds: float,
                  new: bool = False) -> dict[str, Any]:
    """:func:`snapshot` (on a ``new`` connection, its session set up first), cut off after
    ``seconds``: a database that hangs (its bytes acknowledged, so no TCP timeout notices)
    must not keep ``q`` from being read."""
    with Cutoff(conn) as cutoff:
        cutoff.arm(seconds)
        try:
            if new:
                set_up_session(conn)
            return snapshot(conn, schema)
        except psycopg.OperationalError as exc:
            if cutoff.expired:
                raise psycopg.OperationalError(
                    f"the database did not answer within {seconds:g}s") from exc
            raise


def _connect(dsn: str, **params: Any) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=True, **UNPREPARED, **connect_params("top"),
                           **params)


def run(dsn: str, schema: str = DEFAULT_SCHEMA, *, once: bool = False, as_json: bool = False,
        interval: float = 1.0) -> int:
    """Draw ``flowly top`` until ``q``; with ``once`` (or no terminal), print one frame."""
    console = Console(highlight=False)
    first = _connect(dsn)
    try:
        set_up_session(first)
        snap = snapshot(first, schema)
    except BaseException:
        first.close()
        raise
    conn: psycopg.Connection[Any] | None = first  # reused for the refreshes
    if as_json or once or not console.is_terminal:
        first.close()
        if as_json:
            print(to_json(snap))
        else:
            console.print(render(snap, width=console.width))
        return 0

    error: str | None = None
    # a terminal that cannot move the cursor (TERM=dumb) gets one frame after the other
    screen = (Live(console=console, screen=True, auto_refresh=False, redirect_stdout=False,
                   redirect_stderr=False)
              if not console.is_dumb_terminal else contextlib.nullcontext(None))
    try:
        with _keys() as read_key, screen as live:
            while True:
                frame = render(snap, width=console.width, error=error)
                if live is None:
                    console.print(frame, "")
                else:
                    live.update(frame, refresh=True)
                deadline = time.monotonic() + interval
                while (left := deadline - time.monotonic()) > 0:
                    if "q" in read_key(left).lower():
                        return 0
                try:
                    if conn is None or conn.closed:
                        conn, new = _connect(dsn, connect_timeout=int(_FRAME_LIMIT)), True
                    else:
                        new = False
                    snap, error = _frame_within(conn, schema, _FRAME_LIMIT, new), None
                except psycopg.OperationalError as exc:  # keep drawing, say why it is stale
                    error = one_line(str(exc))
                    if conn is not None:
                        conn.close()
    except KeyboardInterrupt:
        return 0
    finally:
        if conn is not None:
            conn.close()
