"""Cron schedules: start a workflow at every fire time of a cron expression in a time zone.

The schedules live in the ``schedules`` table and are parsed, advanced and fired in PL/pgSQL
(``sql/migrations/0006_schedules.sql``): ``schedule``, ``unschedule``, ``pause_schedule``,
``resume_schedule``, ``cron_next`` and ``tick_schedules``, which every worker calls about every
poll interval. This module only names those calls for a schema and maps their rows;
:class:`flowly.Client` and :class:`flowly.AsyncClient` expose them as methods.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime
from functools import cache, partial
from typing import Any

from .arguments import int4, text
from .db import check_schema_name, dumps_argument, schema_statement
from .workflow import WorkflowFn, lookup_argument

MISSED = ("skip", "run_once")
OVERLAP = ("allow", "skip")
TICK_BATCH = 100
"""Schedules one ``tick_schedules`` call handles; a worker calls again while it gets a full
batch that started something."""


@dataclass(frozen=True)
class Schedule:
    """A schedule as stored in ``schedules``."""

    name: str
    cron: str
    timezone: str
    workflow: str
    input: Any
    queue: str
    priority: int
    max_attempts: int
    missed: str
    overlap: str
    paused: bool
    next_fire_at: datetime | None
    last_fire_at: datetime | None
    last_run_id: str | None
    last_error: str | None
    created_at: datetime
    updated_at: datetime


def to_schedule(row: dict[str, Any]) -> Schedule:
    return Schedule(**{f.name: row[f.name] for f in fields(Schedule)})


class ScheduleCalls:
    """The schedule functions of one schema, rendered to SQL once (see ``db.rendered``)."""

    def __init__(self, schema: str) -> None:
        q = partial(schema_statement, check_schema_name(schema))

        self.schedule = q(
            "select * from {s}.schedule(name => %(name)s, cron => %(cron)s,"
            " workflow => %(workflow)s, input => %(input)s::jsonb, timezone => %(timezone)s,"
            " queue => %(queue)s, priority => %(priority)s, missed => %(missed)s,"
            " overlap => %(overlap)s, max_attempts => %(max_attempts)s)")
        self.unschedule = q("select {s}.unschedule(%s) as removed")
        self.pause = q("select * from {s}.pause_schedule(%s)")
        self.resume = q("select * from {s}.resume_schedule(%s)")
        self.list = q("select * from {s}.schedules order by name")
        self.cron_next = q(
            "select {s}.cron_next(%s, coalesce(%s::timestamptz, now()), %s) as fire_at")
        # starts the runs of the due schedules, at most TICK_BATCH of them (any worker may
        # call it at any time; the SQL takes each schedule with skip locked)
        self.tick = q("select * from {s}.tick_schedules({batch})", batch=TICK_BATCH)


@cache
def schedule_calls(schema: str) -> ScheduleCalls:
    """The schedule calls of ``schema``, made once per process."""
    return ScheduleCalls(schema)


def schedule_params(
    name: str, cron: str, workflow: str | WorkflowFn, input: Any, *, timezone: str,
    queue: str | None, priority: int, missed: str, overlap: str, max_attempts: int | None,
) -> dict[str, Any]:
    """Named parameters for ``schedule``: a workflow given by name or decorated function
    (whose registration gives the default queue and max_attempts); the SQL validates the
    rest (the expression, the zone, the names) and says which is wrong."""
    text("schedule name", name)
    workflow_name, defaults = lookup_argument(f"workflow of schedule {name!r}", workflow)
    for what, value in (("cron", cron), ("timezone", timezone), ("missed", missed),
                        ("overlap", overlap), ("queue", queue)):
        if value is not None:
            text(f"{what} of schedule {name!r}", value)
    if max_attempts is None:
        max_attempts = defaults.max_attempts if defaults else 3
    return {
        "name": name, "cron": cron, "workflow": workflow_name,
        "input": dumps_argument(input, f"input of schedule {name!r}"),
        "timezone": timezone,
        "queue": queue if queue is not None else (defaults.queue if defaults else "default"),
        "priority": int4(f"priority of schedule {name!r}", priority),
        "missed": missed, "overlap": overlap,
        "max_attempts": int4(f"max_attempts of schedule {name!r}", max_attempts),
    }


__all__ = ["MISSED", "OVERLAP", "TICK_BATCH", "Schedule", "ScheduleCalls", "schedule_calls",
           "schedule_params", "to_schedule"]
