"""Every argument of every SQL function users call by hand, given as SQL NULL.

A NULL argument of a function users call from psql, a trigger or their own SQL must do what
its documented default does, or be refused as WF003 (``flowly.InvalidArgument``) with a
message naming the argument: never a raw PostgreSQL error (22004, 23502, 42883), never a
domain error that misleads (``cancel(NULL)`` answering "run <NULL> not found"), never a
silent no-op (``tick_schedules(NULL)`` firing nothing), never a row holding NULL where the
schema means a value.

The functions swept are written down below with why each is user-facing; their arguments
come from the catalog, so an argument added later without a sample value fails the sweep.
Each call runs in a savepoint that is rolled back, against the state SETUP leaves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from tests.support import scalar

ROOT = Path(__file__).resolve().parent.parent

# What the calls below need: a pending run, a running run (epoch 1) that may start children,
# an old dead letter and an old completed run, a paused schedule and a due one, and a table
# whose rows trigger_run_id reads.
SETUP = """
select flowly.start('sweep_wf', '{}', run_id => 'sweep-pending');
select flowly.start('sweep_parent', '{}', run_id => 'sweep-parent');
select * from flowly.claim('sweep-worker', array['sweep_parent'], array['default'], 1, '1 hour');
select flowly.start('sweep_wf', '{}', run_id => 'sweep-dead');
update flowly.runs set status = 'dead_letter', error = '{"type": "Boom", "message": "boom"}',
    finished_at = now() - interval '40 days' where id = 'sweep-dead';
select flowly.start('sweep_wf', '{}', run_id => 'sweep-done');
update flowly.runs set status = 'completed', output = '1',
    finished_at = now() - interval '40 days' where id = 'sweep-done';
select flowly.schedule('sweep-paused', '0 * * * *', 'sweep_wf');
select flowly.pause_schedule('sweep-paused');
select flowly.schedule('sweep-due', '* * * * *', 'sweep_wf');
update flowly.schedules set next_fire_at = now() - interval '5 seconds' where name = 'sweep-due';
create table public.sweep_orders (tenant text, id integer);
"""


@dataclass(frozen=True)
class Swept:
    """A user-facing function: why it is one, a valid SQL value for each argument, and what
    a call leaves behind (``observe``, run in the call's savepoint with the call's result as
    ``%(result)s``, a JSON array of its rows), which a NULL taken as a default must leave
    exactly as the default does. ``null_means`` names arguments without a default in the
    catalog whose NULL stands for a value (the SQL of that value), and why. ``result_varies``
    says why two equal calls may return different results (a generated id, a sequence
    number): then only what they left is compared."""

    reason: str
    samples: dict[str, str]
    observe: str = "select null"
    null_means: dict[str, tuple[str, str]] = field(default_factory=dict)
    result_varies: str = ""


RUN_ROWS = """
select jsonb_build_object(
    'run', (select to_jsonb(r) - 'id' from flowly.runs r where r.id = %(result)s::jsonb ->> 0),
    'parent_steps', (select jsonb_agg(to_jsonb(s) - 'seq' - 'output' - 'finished_at'
                                      order by s.name)
                     from flowly.steps s where s.run_id = 'sweep-parent'))
"""
RUN_STATUSES = """
select jsonb_object_agg(r.id, jsonb_build_array(r.status, r.generation, r.lease_epoch))
from flowly.runs r
"""
SCHEDULE_ROWS = """
select jsonb_object_agg(s.name, to_jsonb(s) - 'created_at' - 'updated_at')
from flowly.schedules s
"""

SWEPT: dict[str, Swept] = {
    "start": Swept(
        "README: starts a run from psql, a trigger function or the application's SQL",
        {"workflow": "'sweep_wf'", "input": "'{\"sku\": \"pen\"}'", "run_id": "'sweep-child'",
         "queue": "'sweep_queue'", "priority": "5",
         "scheduled_for": "now() + interval '1 minute'", "concurrency_key": "'sweep-key'",
         "max_attempts": "2", "timeout": "interval '1 hour'", "parent_run_id": "'sweep-parent'",
         "parent_lease_epoch": "1", "parent_step": "'start-child'", "parent_position": "3"},
        RUN_ROWS, result_varies="a run id it makes up when run_id is NULL"),
    "cancel": Swept("README: cancels a run and its unfinished descendants",
                    {"run_id": "'sweep-pending'"}, RUN_STATUSES),
    "retry_dead_letter": Swept("README: restarts a dead-lettered run",
                               {"run_id": "'sweep-dead'"}, RUN_STATUSES),
    "send_event": Swept(
        "README: sends an event to a run from SQL",
        {"run_id": "'sweep-pending'", "name": "'approved'", "payload": "'{\"by\": \"ann\"}'"},
        "select jsonb_agg(jsonb_build_array(e.name, e.payload) order by e.seq)"
        " from flowly.events e", result_varies="the event's sequence number"),
    "purge": Swept(
        "README: deletes finished runs in batches",
        {"older_than": "interval '30 days'", "statuses": "array['completed']", "batch": "10"},
        "select jsonb_agg(r.id order by r.id) from flowly.runs r"),
    "schedule": Swept(
        "README: creates or replaces a cron schedule",
        {"name": "'sweep-new'", "cron": "'*/5 * * * *'", "workflow": "'sweep_wf'",
         "input": "'{\"sku\": \"ink\"}'", "timezone": "'Europe/Berlin'", "queue": "'sweep_queue'",
         "priority": "5", "missed": "'run_once'", "overlap": "'skip'", "max_attempts": "2"},
        SCHEDULE_ROWS),
    "unschedule": Swept("README: deletes a schedule", {"name": "'sweep-paused'"}, SCHEDULE_ROWS),
    "pause_schedule": Swept("README: pauses a schedule", {"name": "'sweep-due'"},
                            SCHEDULE_ROWS),
    "resume_schedule": Swept("README: resumes a paused schedule", {"name": "'sweep-paused'"},
                             SCHEDULE_ROWS),
    "cron_next": Swept(
        "README: the next fire time of a cron expression",
        {"cron": "'*/5 * * * *'", "after": "now()", "timezone": "'Europe/Berlin'"}),
    "tick_schedules": Swept(
        "README: workers call it, and anyone may from SQL (a database's own scheduler)",
        {"batch": "10"},
        "select jsonb_agg(r.id order by r.id) from flowly.runs r"),
    "trigger_run_id": Swept(
        "README: the run id start_trigger gives a row",
        {"workflow": "'order'", "key_columns": "'tenant, id'",
         "input": "row('acme', 7)::public.sweep_orders"}),
    "key_run_id": Swept(
        "granted to the worker role: the run id of a key, which trigger_run_id computes",
        {"p_workflow": "'order'", "p_columns": "array['id']", "p_input": "'{\"id\": 7}'",
         "p_source": "'sweep'"},
        null_means={"p_source": ("'key_run_id'", "errors are prefixed with key_run_id's own"
                                                 " name when the caller gives none")}),
    "setup_roles": Swept(
        "README: `select flowly.setup_roles(worker => ..., reader => ...)` by an administrator",
        {"worker": "'sweep_worker_role'", "reader": "'sweep_reader_role'"},
        "select jsonb_agg(r.rolname order by r.rolname) from pg_roles r"
        " where r.rolname like '%%sweep%%' or r.rolname like 'flowly%%'"),
}

# Functions the README or the worker role's grants name that the sweep leaves out, and why.
NOT_SWEPT: dict[str, str] = {
    "start_trigger": "a trigger function: its arguments are CREATE TRIGGER's string"
                     " literals, which cannot be NULL",
    "trigger_key_columns": "parses the key_columns of trigger_run_id and start_trigger: swept"
                           " through trigger_run_id",
    "finished_channel": "takes no argument",
    "wakeup_channel": "takes no argument",
    "end_stalled_listeners": "takes no argument",
    "fold_run_counts": "takes no argument",
    "wake_missed_waiters": "takes no argument",
    "records_predate_branch_names": "the worker's replay reads it for a run it holds",
    "undone_steps": "the worker's replay reads it for a run it holds",
}
WORKER_PROTOCOL = (
    "begin_compensation_transaction", "begin_transaction_step", "checkpoint",
    "checkpoint_steps", "checkpoint_transaction", "claim", "claim_and_offer", "complete",
    "complete_runs", "due_within_the_hour", "fail_run", "fail_step", "finish_compensation",
    "heartbeat", "offer_slot", "park", "record_compensation", "record_compensation_transaction",
    "record_listener", "register_worker", "release", "release_missed_handoffs", "replay",
    "restart_takeovers", "sleep", "unregister_worker", "wait_for_event", "wait_for_run")
NOT_SWEPT.update(dict.fromkeys(
    WORKER_PROTOCOL, "the worker's protocol: called by flowly's worker with values it builds,"
                     " each write fenced by the lease epoch its claim gave"))


@dataclass(frozen=True)
class Argument:
    name: str
    type: str
    has_default: bool


def arguments(db: psycopg.Connection[Any], function: str) -> list[Argument]:
    """The arguments of flowly's one function named ``function``, from pg_proc: the last
    pronargdefaults of them have defaults."""
    rows = db.execute(
        "select p.proargnames, array(select format_type(t, null) from unnest(p.proargtypes) t),"
        " p.pronargs, p.pronargdefaults"
        " from pg_proc p join pg_namespace n on n.oid = p.pronamespace"
        " where n.nspname = 'flowly' and p.proname = %s", (function,)).fetchall()
    assert len(rows) == 1, f"flowly.{function} should exist once, found {len(rows)}"
    names, types, count, defaults = rows[0]
    return [Argument(names[i], types[i], i >= count - defaults) for i in range(count)]


def typed_null(db: psycopg.Connection[Any], argument: Argument, sample: str) -> str:
    """SQL NULL of the argument's type; of the sample's type for a polymorphic argument
    (an untyped NULL there fails in PostgreSQL's resolution, before flowly runs)."""
    if argument.type.startswith("any"):
        return f"null::{scalar(db, f'select pg_typeof({sample})::text')}"
    return f"null::{argument.type}"


def call(db: psycopg.Connection[Any], function: str, values: dict[str, str], observe: str
         ) -> tuple[str | None, str, Any]:
    """Call ``flowly.function`` by named arguments (SQL text of each value) in a savepoint
    rolled back afterwards: its SQLSTATE (None when it succeeded), its message or result,
    and what ``observe`` then sees."""
    query = sql.SQL("select coalesce(jsonb_agg(to_jsonb(t)), '[]') from flowly.{}({}) t").format(
        sql.Identifier(function),
        sql.SQL(", ").join(sql.SQL("{} => {}").format(sql.Identifier(name), sql.SQL(value))
                           for name, value in values.items()))
    try:
        with db.transaction(force_rollback=True):
            row = db.execute(query).fetchone()
            assert row is not None
            seen = db.execute(observe, {"result": Jsonb(row[0])}).fetchone()
            return None, repr(row[0]), seen[0] if seen else None
    except psycopg.Error as exc:
        return exc.sqlstate, str(exc).splitlines()[0], None


def differences(seen: Any, expected: Any, path: str = "") -> str:
    """Where ``seen`` differs from ``expected`` (JSON values), path by path."""
    if isinstance(seen, dict) and isinstance(expected, dict):
        return "; ".join(filter(None, (differences(seen.get(k), expected.get(k), f"{path}.{k}")
                                       for k in sorted(seen.keys() | expected.keys()))))
    if isinstance(seen, list) and isinstance(expected, list) and len(seen) == len(expected):
        pairs = enumerate(zip(seen, expected, strict=True))
        return "; ".join(filter(None, (differences(a, b, f"{path}[{i}]") for i, (a, b) in pairs)))
    return "" if seen == expected else f"{path or 'it'}: {seen!r} where the default leaves" \
                                       f" {expected!r}"


def names_argument(message: str, argument: str) -> bool:
    """Whether ``message`` names ``argument`` as a word (``name``, not ``named``), as the
    user spells it (key_run_id's p_workflow is "workflow")."""
    plain = argument.removeprefix("p_")
    return re.search(rf"(?<![\w]){re.escape(plain)}(?![\w])", message) is not None


@pytest.mark.parametrize("function", sorted(SWEPT))
def test_a_null_argument_acts_as_its_default_or_is_refused_naming_it(
        db: psycopg.Connection[Any], function: str) -> None:
    """For each argument from the catalog, the call with that argument NULL and the others
    valid either is refused with WF003 naming the argument, or (where the argument has a
    default, or NULL stands for a value written down in ``null_means``) leaves exactly what
    the call with the default leaves."""
    swept = SWEPT[function]
    db.execute(SETUP)
    args = arguments(db, function)
    assert [a.name for a in args] == list(swept.samples), \
        f"flowly.{function}'s arguments are {[a.name for a in args]}: give each a sample"
    db.execute("set lock_timeout = '10s'")
    with db.transaction():
        valid = call(db, function, swept.samples, swept.observe)
    if function == "setup_roles" and valid[0] == "42501":
        pytest.skip("the test database's user may not create roles")
    assert valid[0] is None, f"flowly.{function} refuses its sample values: {valid}"
    wrong = []
    for argument in args:
        nulled = dict(swept.samples, **{argument.name: typed_null(
            db, argument, swept.samples[argument.name])})
        with db.transaction():
            state, said, seen = call(db, function, nulled, swept.observe)
            if state == "WF003" and names_argument(said, argument.name):
                continue
            if state is not None:
                wrong.append(f"{argument.name} => NULL: {state} {said}")
                continue
            if argument.name in swept.null_means:
                reference = dict(swept.samples,
                                 **{argument.name: swept.null_means[argument.name][0]})
            elif argument.has_default:
                reference = {k: v for k, v in swept.samples.items() if k != argument.name}
            else:
                wrong.append(f"{argument.name} => NULL (no default): accepted, gave {said}")
                continue
            expected = call(db, function, reference, swept.observe)
            if expected[0] is not None or seen != expected[2] \
                    or (said != expected[1] and not swept.result_varies):
                wrong.append(f"{argument.name} => NULL: gave {said}, where its default gives"
                             f" {expected[1]}; left {differences(seen, expected[2])}")
    assert not wrong, f"flowly.{function}:\n" + "\n".join(wrong)


def test_every_function_users_or_the_worker_role_may_call_is_swept_or_said_why_not(
        db: psycopg.Connection[Any]) -> None:
    """The functions the README names (``flowly.<name>(``) and those apply_roles grants the
    worker role are each in the sweep or in NOT_SWEPT with a reason, and each exists."""
    functions = {r[0] for r in db.execute(
        "select p.proname from pg_proc p join pg_namespace n on n.oid = p.pronamespace"
        " where n.nspname = 'flowly'")}
    source = scalar(db, "select prosrc from pg_proc p join pg_namespace n"
                        " on n.oid = p.pronamespace where n.nspname = 'flowly'"
                        " and p.proname = 'apply_roles'")
    whitelist = re.search(r"v_worker_calls constant text\[\] := array\[(.*?)\];", source, re.S)
    assert whitelist is not None, "apply_roles no longer lists the worker role's functions"
    granted = set(re.findall(r"'(\w+)'", whitelist.group(1)))
    documented = set(re.findall(r"flowly\.(\w+)\(", (ROOT / "README.md").read_text())) \
        & functions
    assert not SWEPT.keys() & NOT_SWEPT.keys()
    assert SWEPT.keys() | NOT_SWEPT.keys() <= functions
    assert granted | documented <= SWEPT.keys() | NOT_SWEPT.keys(), \
        sorted((granted | documented) - SWEPT.keys() - NOT_SWEPT.keys())
