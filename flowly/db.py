"""The Python side of the SQL boundary: every engine function call, composed for a schema.

Each state transition is one call of one PL/pgSQL function (see ``sql/migrations``); this
module only names them, binds the schema identifier safely (never string-formatted) and turns
flowly's SQLSTATEs into named exceptions. Reads for clients go straight to the tables.
"""

from __future__ import annotations

import json
import logging
import re
import select
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from json.encoder import c_make_encoder, encode_basestring  # type: ignore[attr-defined]
from typing import Any

import psycopg
from psycopg import dbapi20, postgres, sql
from psycopg.adapt import AdaptersMap
from psycopg.rows import tuple_row
from psycopg.types import TypesRegistry
from psycopg.types.array import register_all_arrays

from . import deep_json
from .errors import InvalidArgument, RunBusy, SchemaError, SchemaNotInstalled, translate

logger = logging.getLogger(__name__)

DEFAULT_SCHEMA = "flowly"
NON_TERMINAL = ("pending", "running", "compensating")
TERMINAL = ("completed", "dead_letter", "cancelled")

# Postgres truncates longer identifiers silently, which would put objects in another schema.
_MAX_IDENTIFIER_BYTES = 63


def check_schema_name(schema: str) -> str:
    """Return ``schema`` if Postgres can use it as given, else raise :class:`SchemaError`.

    Any printable character is allowed (names are always quoted); empty names, names longer
    than 63 bytes, the reserved ``pg_`` prefix and control characters (a newline would end
    the psql meta-command that ``install --print-sql`` writes the name into) are refused
    with a message naming the problem.
    """
    if not isinstance(schema, str):
        raise SchemaError(f"schema name must be a string, got {type(schema).__name__}"
                          f" {schema!r}")
    if not schema:
        raise SchemaError("schema name must not be empty")
    if len(schema.encode()) > _MAX_IDENTIFIER_BYTES:
        raise SchemaError(f"schema name {schema!r} is longer than 63 bytes")
    if re.match(r"pg_", schema, re.IGNORECASE):
        raise SchemaError(
            f"schema name {schema!r} is reserved: names starting with pg_ belong to PostgreSQL")
    if any(ord(c) < 0x20 or ord(c) == 0x7f for c in schema):
        raise SchemaError(f"schema name {schema!r} contains a control character")
    return schema


_MISSING = (psycopg.errors.UndefinedFunction, psycopg.errors.UndefinedTable,
            psycopg.errors.InvalidSchemaName)


def _missing_from_flowly(error: psycopg.Error, schema: str) -> bool:
    """Whether ``error`` (one of _MISSING) says that flowly's schema, or a function or table
    in it, does not exist: raised by the statement flowly sent itself (an error raised in a
    function or trigger that statement ran carries a context), naming flowly's schema,
    which reads the same in every language of the server's messages."""
    message = error.diag.message_primary or ""
    return not error.diag.context and (f'"{schema}"' in message or f"{schema}." in message)


@contextmanager
def translated_errors(schema: str = DEFAULT_SCHEMA) -> Iterator[None]:
    """Re-raise flowly SQLSTATEs as named exceptions, and a function, table or schema of
    flowly's (in ``schema``) that does not exist as SchemaNotInstalled. What else is missing
    surfaces as itself: a function of the user's that their trigger on a flowly table calls
    is theirs to create, not a reason to install flowly."""
    try:
        yield
    except _MISSING as error:
        if not _missing_from_flowly(error, schema):
            raise
        raise SchemaNotInstalled(
            f"flowly is not installed in this database or schema ({error.diag.message_primary});"
            " run `flowly install`"
        ) from error
    except psycopg.Error as error:
        translated = translate(error)
        if translated is error:
            raise
        raise translated from error


# SQLSTATE classes of failures of the connection or the server, not of what was asked:
# connection exceptions, insufficient resources, operator intervention (shutdown, statement
# timeout, cancel), system errors
_CONNECTION_CLASSES = frozenset({"08", "53", "57", "58"})
# ... the session ended by the server for idling in a transaction (a frozen client), and a
# server that takes no writes for now: a standby a failover endpoint still points at, or a
# storage guard that set default_transaction_read_only (flowly's own sessions never make
# their transactions read-only; a transactional step's SQL may, see worker/transactions.py)
_CONNECTION_STATES = frozenset({"25P03", "25006"})
# the row or the transaction was contended: the same call, made again, may well succeed
_CONTENTION_STATES = frozenset({"55P03", "40001", "40P01"})


def is_contention(exc: BaseException) -> bool:
    """Whether ``exc`` says "busy, try again": the run's row was locked (WF005, a lock
    timeout) or the transaction lost a serialization conflict or a deadlock."""
    if isinstance(exc, RunBusy):
        return True
    return isinstance(exc, psycopg.Error) and exc.sqlstate in _CONTENTION_STATES


def is_connection_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is the connection or the server failing (whether a write committed is
    then unknown) or taking no writes for now, rather than the database refusing what was
    asked."""
    if isinstance(exc, (psycopg.InterfaceError, OSError)):
        return True
    if not isinstance(exc, psycopg.Error) or is_contention(exc):
        return False
    if exc.sqlstate is None:  # raised by the client: the connection failed
        return isinstance(exc, psycopg.OperationalError)
    return exc.sqlstate[:2] in _CONNECTION_CLASSES or exc.sqlstate in _CONNECTION_STATES


def _has_nul_escape(text: str) -> bool:
    """Whether JSON text holds a U+0000, escaped as \\u0000. Every backslash of JSON text
    begins an escape, so dropping the escaped backslashes (their pairs, left to right, as a
    parser reads them) leaves a \\u0000 only where one is a NUL, not text. Two scans at C
    speed: a regular expression with a look-behind, tried at every position, took seconds
    for one large output, on the worker's event loop."""
    return "\\u0000" in text and "\\u0000" in text.replace("\\\\", "")


# one encoder for every call: json.dumps with options builds a new one each time
_ENCODER = json.JSONEncoder(allow_nan=False, ensure_ascii=False, separators=(",", ":"))


def _encode(value: Any) -> str:
    """``_ENCODER.encode(value)``, as it runs it (the C encoder, given fresh circular-reference
    markers), without the closures it builds at every call, which cost as much as writing a
    small value. A C encoder is not reused from call to call: its markers would be shared
    between threads, and keep stale entries after a failure."""
    if c_make_encoder is None or isinstance(value, str):
        return _ENCODER.encode(value)
    return "".join(c_make_encoder(
        {}, _ENCODER.default, encode_basestring, None, ":", ",", False, False, False)(value, 0))


def dumps(value: Any) -> str:
    """Serialise a value to JSON text that Postgres jsonb accepts, or raise ValueError.

    JSON allows, and jsonb refuses, NaN and Infinity, the character U+0000 and unpaired
    surrogates; catching them here names the culprit instead of failing a whole batch of
    writes in the database.
    """
    try:
        text = _encode(value)
    except RecursionError:  # nested too deeply for json (read by deep_json, say)
        text = deep_json.dumps_without_recursion(value, allow_nan=False, ensure_ascii=False)
    if _has_nul_escape(text):
        raise ValueError("jsonb cannot store the character U+0000 (NUL)")
    if not text.isascii():  # ASCII text (most of it) can hold no surrogate
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"jsonb cannot store an unpaired surrogate: {exc}") from None
    return text


# psycopg names the statements it prepares per connection (_pg3_0, _pg3_1, ...), so behind a
# pooler in transaction mode, which hands a session's transactions to whichever server
# connection is free, one client's statement finds another's name taken or missing there
# (DuplicatePreparedStatement, ProtocolViolation), or runs another's statement that takes as
# many parameters. A connection prepares nothing until it is seen to talk to its own server
# session (set_up_session): unprepared, an idle start takes 0.15-0.25 ms longer.
UNPREPARED: dict[str, Any] = {"prepare_threshold": None}
_PREPARE_THRESHOLD = 5  # psycopg's default: a statement's fifth run prepares it
# psycopg reads dates and intervals as text only in PostgreSQL's default styles: a database
# or role set to another (DateStyle 'SQL, DMY', IntervalStyle 'iso_8601') failed every read
# of a time, a run's replay included. Set only where they differ, so that a session passed
# through a pooler to other clients keeps the styles it had.
_SESSION_SETUP = (
    "select pg_backend_pid(),"
    " case when current_setting('datestyle') not like 'ISO%' then"
    " set_config('datestyle', 'ISO', false) end,"
    " case when current_setting('intervalstyle') <> 'postgres' then"
    " set_config('intervalstyle', 'postgres', false) end")


def _psycopg_default_adapters() -> AdaptersMap:
    """The adapters psycopg starts with, in a map of their own, as psycopg builds its
    process-wide ``psycopg.adapters`` (which is the application's to change)."""
    types = TypesRegistry()
    postgres.register_default_types(types)
    adapters = AdaptersMap(types=types)
    postgres.register_default_adapters(adapters)
    dbapi20.register_dbapi20_adapters(adapters)
    register_all_arrays(adapters)
    return adapters


# what flowly's own connections dump and load by: an application's loaders registered on
# psycopg.adapters (a float8 as Decimal, a bool as text) crashed the worker's clock
# arithmetic and kept its runs in `running`. Each connection copies the map, and deep_json
# then sets its json loaders on that copy.
_FLOWLY_ADAPTERS = _psycopg_default_adapters()


def connect_params(who: str) -> dict[str, Any]:
    """What every connection flowly opens asks for: UTF-8, whatever the database's or role's
    client_encoding (under LATIN1, say, a run whose input held a character outside it failed
    every claim of the worker that served it, and its hand-off broke the worker's listener),
    ``flowly <who>`` as its application_name in ``pg_stat_activity``, unless the DSN or
    PGAPPNAME gives one, and psycopg's default adapters, whatever the application registered
    process-wide."""
    return {"client_encoding": "utf8", "fallback_application_name": f"flowly {who}",
            "context": _FLOWLY_ADAPTERS}


def _prepare_if(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
                serving_pid: int) -> None:
    # a pooler answers the connection's start-up with a key of its own (PgBouncer's pid part
    # is random), so the pid it gave is not the pid of the backend that serves the statement
    if conn.info.backend_pid == serving_pid:
        conn.prepare_threshold = _PREPARE_THRESHOLD


def set_up_session(conn: psycopg.Connection[Any]) -> None:
    """Make ``conn``'s session one that flowly can read (dates and intervals in the styles
    psycopg reads), and let it prepare statements when no pooler stands between it and its
    server session: the backend that answers is the one the connection was opened with."""
    with conn.cursor(row_factory=tuple_row) as cursor:
        row = cursor.execute(_SESSION_SETUP).fetchone()
    if row is not None:
        _prepare_if(conn, row[0])


async def set_up_session_async(conn: psycopg.AsyncConnection[Any]) -> None:
    """:func:`set_up_session` for an async connection."""
    async with conn.cursor(row_factory=tuple_row) as cursor:
        row = await (await cursor.execute(_SESSION_SETUP)).fetchone()
    if row is not None:
        _prepare_if(conn, row[0])


def adapt_connection(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """What every connection flowly opens gets: ``json``/``jsonb`` read by deep_json (a value
    nested past json's depth would fail the whole fetch), the server's warnings logged
    (purge's about runs it had to keep, say), which psycopg drops when nobody handles them,
    and no server-side prepared statements until :func:`set_up_session` allows them."""
    deep_json.use_on(conn)
    conn.add_notice_handler(_log_if_warning)
    conn.prepare_threshold = UNPREPARED["prepare_threshold"]


def listen_to(channel: str) -> sql.Composed:
    """``LISTEN`` on ``channel`` (a name of flowly's, quoted as an identifier)."""
    return sql.SQL("listen {}").format(sql.Identifier(channel))


def still_open(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """Whether an idle connection can take a call: not closed, and not ended by the server
    meanwhile (a restart, a failover or a terminated backend sends its farewell and closes
    the socket). Told from what already arrived, without a round trip, so a call is never
    sent on a connection known to be dead, nor a live one made slower. A connection busy
    with a call of another thread or task is left alone: that call learns what became of it."""
    if conn.closed:
        return False
    if isinstance(conn, psycopg.AsyncConnection):
        # the loop's one thread: nothing else uses the connection until this returns
        return conn.lock.locked() or _not_ended(conn.pgconn)
    if not conn.lock.acquire(blocking=False):
        return True
    try:
        return _not_ended(conn.pgconn)
    finally:
        conn.lock.release()


def _not_ended(pgconn: psycopg.pq.abc.PGconn) -> bool:
    try:
        # a farewell is read first and the end of the stream by the read after it; a live
        # connection has nothing left to read after one (a notification, a notice)
        for _ in range(3):
            if not select.select([pgconn.socket], [], [], 0)[0]:
                break
            pgconn.consume_input()
    except (psycopg.OperationalError, OSError, ValueError):
        return False
    return pgconn.status == psycopg.pq.ConnStatus.OK


def _log_if_warning(notice: psycopg.errors.Diagnostic) -> None:
    if notice.severity_nonlocalized == "WARNING":
        logger.warning("database: %s", notice.message_primary)


def utf8_size(text: str) -> int:
    """How many bytes ``text`` takes in UTF-8 (ASCII text is not encoded to tell)."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def dumps_argument(value: Any, what: str) -> str:
    """:func:`dumps` for a value a caller passed in (a run's input, an event's payload):
    what cannot be stored is the caller's mistake, an InvalidArgument naming ``what``."""
    try:
        return dumps(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidArgument(f"{what} is not JSON serialisable: {exc}") from exc


def jsonb_safe_text(text: str) -> str:
    """``text`` with what jsonb refuses (NUL, unpaired surrogates) spelled as escapes."""
    return text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


def rendered(query: sql.Composable) -> sql.SQL:
    """``query`` as plain SQL text, rendered once: psycopg renders a ``Composed`` again at
    every execute, about 10 us a call, and ten times that on a CPU that was idle (the first
    call a worker or client makes after a pause is on the latency path)."""
    return sql.SQL(query.as_string())


def schema_identifier(schema: str) -> sql.Composable:
    """``schema`` quoted as an identifier, fit for a query that also has parameters.

    psycopg reads every ``%`` of such a query as a placeholder, inside quotes too, so a name
    with one is spelled as a Unicode escape identifier instead (``100%`` as
    ``U&"100\\0025"``): the same name to the server, with no ``%`` in the text.
    """
    if "%" not in schema:
        return sql.Identifier(schema)
    escaped = schema.replace("\\", "\\\\").replace('"', '""').replace("%", "\\0025")
    return sql.SQL(f'U&"{escaped}"')


def schema_statement(schema: str, text: str, **literals: Any) -> sql.SQL:
    """``text`` with ``{s}`` the schema's quoted name and each ``{name}`` of ``literals`` its
    value as a literal, rendered once."""
    return rendered(sql.SQL(text).format(
        s=schema_identifier(schema), **{name: sql.Literal(v) for name, v in literals.items()}))


def seconds_interval(duration: timedelta | float) -> str:
    """``duration`` (a timedelta, or seconds) as interval text in hours, minutes and seconds
    alone, exact to the microsecond, which ``timestamptz + interval`` adds as that many
    seconds whatever the session's TimeZone. psycopg sends a timedelta's whole days as the
    interval's day field, and PostgreSQL adds days as calendar days in the session's TimeZone:
    a day given as 86,400 s lasted 23 or 25 hours across a change of daylight saving time.
    PostgreSQL reads this text alike under every IntervalStyle."""
    if not isinstance(duration, timedelta):
        duration = timedelta(seconds=duration)
    micro = duration // timedelta(microseconds=1)
    sign = "-" if micro < 0 else ""
    seconds, micro = divmod(abs(micro), 1_000_000)
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{sign}{hours}:{minutes:02d}:{seconds:02d}.{micro:06d}"


# older than any run: a run's times lie between the years 1 and 10000
_OLDER_THAN_ANY_RUN = timedelta(days=3_660_000)


def purge_age_interval(age: timedelta | float) -> str:
    """``purge``'s ``older_than`` (zero or more) as :func:`seconds_interval` gives it, an age
    past ten thousand years as ten thousand years: both are older than any run, and an
    interval of seconds holds no more than 290,000 years (a timedelta up to 2.7 million)."""
    if not isinstance(age, timedelta):
        age = timedelta(seconds=age)
    return seconds_interval(min(age, _OLDER_THAN_ANY_RUN))


CLAIMED_INPUT_BYTES = 64 * 1024
CHILD_LOCK_WAIT = "50ms"


class Calls:
    """The engine's SQL statements for one schema, ready to execute."""

    def __init__(self, schema: str = DEFAULT_SCHEMA) -> None:
        self.schema = check_schema_name(schema)

        q = partial(schema_statement, self.schema)

        self.finished_channel = q("select {s}.finished_channel()")
        # every parameter of a call that may run on the caller's connection (conn=) is cast
        # to the type the function takes: that connection's dumpers are the application's
        # (an int dumped as numeric made this a call of a start(..., numeric, ...) that
        # does not exist)
        self.start = q(
            "select {s}.start(workflow => %(workflow)s::text, input => %(input)s::jsonb,"
            " run_id => %(run_id)s::text, queue => %(queue)s::text,"
            " priority => %(priority)s::integer,"
            " scheduled_for => coalesce(%(scheduled_for)s::timestamptz,"
            "                           clock_timestamp() + %(delay)s::interval),"
            " concurrency_key => %(concurrency_key)s::text,"
            " max_attempts => %(max_attempts)s::integer, timeout => %(timeout)s::interval,"
            " parent_run_id => %(parent_run_id)s::text,"
            " parent_lease_epoch => %(parent_lease_epoch)s::bigint,"
            " parent_step => %(parent_step)s::text,"
            " parent_position => %(parent_position)s::integer)"
        )
        # a worker's ctx.start: it holds a pooled connection and the parent's row while it
        # waits for a lock (another transaction's uncommitted run of the same concurrency
        # key), so it waits briefly; the busy error makes it try again after a pause
        # holding neither. The setting ends with the statement's transaction.
        self.start_child = rendered(
            q("with brief_lock_waits as materialized"
              " (select set_config('lock_timeout', {wait}, true)) ", wait=CHILD_LOCK_WAIT)
            + self.start + q(" from brief_lock_waits"))
        # start and, in the same round trip, whether a live worker serves the run
        self.start_and_served = rendered(self.start + q(
            ", exists (select from {s}.workers w where w.last_seen_at + w.lease > now()"
            " and %(workflow)s::text = any(w.workflows) and %(queue)s::text = any(w.queues))"
            " as served"))
        self.cancel = q("select {s}.cancel(%s)")
        self.purge = q("select {s}.purge(%s, %s, %s)")
        self.retry_dead_letter = q("select {s}.retry_dead_letter(%s)")
        self.wakeup_channel = q("select {s}.wakeup_channel()")
        self.server_clock = rendered(
            sql.SQL("select extract(epoch from clock_timestamp())::float8"))
        self.register_worker = q("select {s}.register_worker(%s, %s, %s, %s)")
        self.unregister_worker = q("select {s}.unregister_worker(%s)")
        # a claimed run's input comes with the claim when it is stored in CLAIMED_INPUT_BYTES
        # or less; a larger one is left out (its flag set) and read by the run's own task,
        # so the runs claimed with it do not wait for it to arrive and be parsed
        self.claim_and_offer = q(
            "select c.run_id, c.workflow, c.status,"
            " case when not l.deferred then c.input end,"
            " c.attempt, c.generation, c.lease_epoch, c.has_history, l.deferred"
            " from {s}.claim_and_offer(%s, %s, %s, %s, %s, %s) c,"
            " lateral (select coalesce(pg_column_size(c.input) > {most}, false) as deferred) l",
            most=CLAIMED_INPUT_BYTES)
        self.offer_slot = q("select {s}.offer_slot(%s, %s, %s, %s, %s, %s)")
        self.claimed_input = q("select r.input from {s}.runs r"
                               " where r.id = %s and r.lease_epoch = %s")
        self.replay = q("select * from {s}.replay(%s, %s, %s)")
        self.records_predate_branch_names = q("select {s}.records_predate_branch_names(%s)")
        self.heartbeat = q("select * from {s}.heartbeat(%s, %s, %s, %s)")
        self.fold_run_counts = q("select {s}.fold_run_counts()")
        self.end_stalled_listeners = q("select * from {s}.end_stalled_listeners()")
        self.record_listener = q("select {s}.record_listener(%s)")
        self.notify = rendered(sql.SQL("select pg_notify(%s, %s)"))
        # seconds; 0 when the server ends no idle session (or predates the setting, 14)
        self.idle_session_timeout = sql.SQL(
            "select extract(epoch from coalesce(nullif(current_setting("
            "'idle_session_timeout', true), ''), '0')::interval)")
        self.release = q("select {s}.release(%s, %s)")
        self.release_missed_handoffs = q("select {s}.release_missed_handoffs(%s, %s)")
        self.due_within_the_hour = q("select {s}.due_within_the_hour(%s, %s)")
        # the group-committed batches go in binary: psycopg dumps a long text array
        # element by element with a regex test for quoting, a tenth of the time in binary
        self.checkpoint_steps = q(
            "select * from {s}.checkpoint_steps(%b, %b, %b, %b::jsonb[], %b, %b, %b)"
        )
        self.complete_runs = q("select * from {s}.complete_runs(%b, %b, %b::jsonb[])")
        self.sleep = q("select * from {s}.sleep(%s, %s, %s, %s, %s, %s, %s)")
        self.fail_step = q(
            "select * from {s}.fail_step(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)")
        self.begin_transaction_step = q("select {s}.begin_transaction_step(%s, %s)")
        self.checkpoint_transaction = q(
            "select * from {s}.checkpoint_transaction(%s, %s, %s, %s::jsonb, %s, %s, %s)")
        self.begin_compensation_transaction = q(
            "select {s}.begin_compensation_transaction(%s, %s)")
        self.restart_takeovers = q("select {s}.restart_takeovers(%s, %s)")
        self.record_compensation_transaction = q(
            "select {s}.record_compensation_transaction(%s, %s, %s)")
        self.wait_for_event = q("select * from {s}.wait_for_event(%s, %s, %s, %s, %s, %s)")
        self.wait_for_run = q("select * from {s}.wait_for_run(%s, %s, %s, %s, %s)")
        self.park = q("select {s}.park(%s, %s, %s)")
        self.wake_missed_waiters = q("select {s}.wake_missed_waiters()")
        self.undone_steps = q("select * from {s}.undone_steps(%s)")
        self.send_event = q("select {s}.send_event(%s::text, %s::text, %s::jsonb)")
        self.fail_run = q("select * from {s}.fail_run(%s, %s, %s, %s)")
        self.record_compensation = q("select {s}.record_compensation(%s, %s, %s, %s)")
        self.finish_compensation = q("select {s}.finish_compensation(%s, %s)")
        self.get_run = q("select * from {s}.runs where id = %s")
        self.get_steps = q(
            "select * from {s}.steps where run_id = %s order by position nulls first, seq")
        self.get_step_attempts = q(
            "select step_name, generation, attempt, error, started_at, failed_at, retry_at"
            " from {s}.step_attempts where run_id = %s order by failed_at"
        )
        self.get_timers = q(
            "select name, wake_at, created_at, fired_at from {s}.timers"
            " where run_id = %s order by created_at, name"
        )
        self.is_served = q(
            "select exists (select from {s}.workers w where w.last_seen_at + w.lease > now()"
            " and %s = any(w.workflows) and %s = any(w.queues))"
        )
