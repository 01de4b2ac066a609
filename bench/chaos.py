"""Chaos: a mixed workload under killed, frozen and disconnected workers and a restarting server.

    python bench/chaos.py                    # bounded: about a minute (CI runs this)
    python bench/chaos.py --duration 600     # ten minutes of chaos

It starts an embedded PostgreSQL of its own (``flowly.embedded``, in a temporary directory:
never the shared server), installs flowly, and starts ``--workers`` worker processes
(``python -m flowly.worker --app bench.chaos_workflows --lease 2``). For ``--duration``
seconds it starts a mix of runs (``bench/chaos_workflows.py``: steps, durable sleeps, a step
that fails by design and is retried, sagas whose last step always fails, parents that start
children with ``ctx.start``, runs designed to time out; and, in an engine that has them,
transactional steps, waits for events it sends, and ``ctx.run`` of children, some failing)
while it

- SIGKILLs workers (and starts replacements),
- SIGSTOPs workers (mostly for longer than their lease), then SIGCONTs them,
- terminates worker connections (``pg_terminate_backend``),
- restarts the server (``pg_ctl stop -m fast`` or ``-m immediate``, a pause, a start).

Then it lets every run finish and checks, from the tables (``flowly.runs``, ``flowly.steps``,
``flowly.step_attempts``, and ``public.chaos_exec``, where every step and compensation
execution recorded itself with its lease epoch and the server's clock):

- every run reached its expected final state; none is left unfinished ("stuck"); no run that
  should complete was dead-lettered (``PoisonRun``, ``Timeout`` or otherwise) and only the
  runs designed to time out did; sagas compensated every step, last first;
- no checkpoint lost: a step whose checkpoint a body went past is still checkpointed with the
  output that body saw; completed runs return exactly the stored outputs;
- no checkpointed step executed again: an execution that began after the step's checkpoint
  row was written (``steps.finished_at``) under the epoch that wrote it or a later one is a
  duplicate (steps are at-least-once, so re-executions before the checkpoint, and executions
  by a fenced worker that was frozen past its lease, are counted but allowed);
- fencing never breached: no checkpoint landed after a newer claim of its run had begun
  executing, and no run completed under a stale epoch;
- parents started exactly their children, once each, and a parent waiting for a child got
  its output (or its failure);
- a transactional step's SQL committed exactly once, with its checkpoint;
- an event wait returned the payload sent, or timed out when none was sent;
- the dashboard's ``run_counts`` agrees with a count of ``flowly.runs`` per workflow and status.

It prints the figures (and the ERROR lines of the worker logs, by cause) and exits 1 if an
invariant failed, naming the runs (with their executions, checkpoints, the chaos around them
and their lines in the worker logs); ``--inject-faults`` breaks each invariant once in the
tables before checking, to show the checks catch them. Workers,
server and temporary directory are cleaned up however it ends (``--keep`` keeps the directory:
worker logs, the server log and the stopped cluster).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo
from psycopg.types.json import Jsonb

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import flowly  # noqa: E402
from bench.chaos_workflows import EXEC_TABLE  # noqa: E402
from flowly import embedded  # noqa: E402
from flowly.schema import install_dsn  # noqa: E402

APP = "bench.chaos_workflows"
# transactional steps, events and waits for other runs, in engines that have them
NEWER_APIS = all(hasattr(flowly.Context, a) for a in ("transaction", "wait_for_event", "run"))
WORKER_APP_NAME = "chaos-worker"  # the connections pg_terminate_backend aims at
TERMINAL = ("completed", "dead_letter", "cancelled")

EXPECTED_TABLE = """
create table if not exists public.chaos_expected (
    run_id text primary key,
    kind text not null,
    status text not null,
    error_type text,
    input jsonb not null
)
"""


class Interrupted(Exception):
    """SIGINT, SIGTERM or SIGHUP arrived: clean up and leave."""


def _on_signal(signum: int, _frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def _die_with_parent() -> None:
    """In a worker child, before exec: SIGKILL it if the driver dies (PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _ts(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S.%f")[:-3]


# -- workers ----------------------------------------------------------------------------------


class WorkerProc:
    """One ``python -m flowly.worker`` child, logging to its own file."""

    def __init__(self, label: str, dsn: str, recorder_dsn: str, log_dir: Path,
                 lease: float) -> None:
        self.label = label
        self.log_path = log_dir / f"worker-{label}.log"
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "PGHOST")}
        env.update(FLOWLY_DSN=dsn, CHAOS_DSN=recorder_dsn, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
        command = [sys.executable, "-m", "flowly.worker", "--app", APP, "--lease", str(lease),
                   "--poll-interval", "0.2", "--drain-timeout", "2", "--concurrency", "8",
                   "--max-connections", "4"]
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        self.pid = self.proc.pid
        self.killed = False  # by us
        self.stopped_until: float | None = None  # SIGSTOPped by us until then

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def served(self) -> bool:
        """Whether it got as far as serving runs (its start-up log line)."""
        try:
            return " serving " in self.log_path.read_text(errors="replace")
        except OSError:
            return False

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


# -- the driver -------------------------------------------------------------------------------


@dataclass
class Figures:
    runs: Counter[str] = field(default_factory=Counter)  # started, by kind
    kills: int = 0
    stops: int = 0
    restarts: Counter[str] = field(default_factory=Counter)  # by mode
    terminated: int = 0
    spawned: int = 0
    exits_ours: int = 0
    exits_other: list[str] = field(default_factory=list)
    events: int = 0  # sent to runs


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.tmp = Path(tempfile.mkdtemp(prefix="flowly-chaos-"))
        self.data_dir = self.tmp / "pgdata"
        self.log_dir = self.tmp / "logs"
        self.log_dir.mkdir()
        self.dsn = ""
        self.conn: psycopg.Connection[Any] | None = None
        self.workers: list[WorkerProc] = []
        self.retired: list[WorkerProc] = []
        self.respawn_at: list[float] = []
        self.figures = Figures()
        self.events: list[tuple[float, str]] = []
        self.pending_starts: list[tuple[str, str, str, str | None, dict[str, Any], float | None,
                                        str]] = []
        self.pending_events: list[tuple[float, str, Any]] = []
        self.seq = 0

    # -- server ---------------------------------------------------------------------------

    def start_server(self) -> None:
        self.dsn = embedded.embedded_dsn(self.data_dir, version=self.args.pg_version)

    def pg_ctl(self, *args: str, timeout: float = 60) -> None:
        version = embedded.pgdata_version(self.data_dir)
        binary = embedded.POSTGRES_VERSIONS[version] / "pg_ctl"
        # the server runs as pgserver's system user when we are root (see flowly/embedded.py)
        user = "pgserver" if os.geteuid() == 0 else None
        with (self.log_dir / "pg_ctl.log").open("a") as log:
            subprocess.run([str(binary), "-D", str(self.data_dir), *args], user=user, check=True,
                           stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                           timeout=timeout)

    def restart_server(self, mode: str) -> None:
        outage = self.rng.uniform(0.2, 3.0)
        self.event(f"server stop -m {mode}, down for {outage:.1f}s")
        self.close_conn()
        self.pg_ctl("-m", mode, "-w", "-t", "30", "stop")
        time.sleep(outage)
        self.start_server()
        self.event("server started again")
        self.figures.restarts[mode] += 1

    def stop_server(self) -> None:
        self.close_conn()
        try:
            embedded.stop(self.data_dir, timeout=20)
        except Exception as exc:
            print(f"chaos: fast shutdown failed ({exc}); immediate shutdown", file=sys.stderr)
            with contextlib.suppress(Exception):
                self.pg_ctl("-m", "immediate", "-w", "stop")

    # -- database -------------------------------------------------------------------------

    def close_conn(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
            self.conn = None

    def connect(self, patience: float = 60) -> psycopg.Connection[Any]:
        deadline = time.monotonic() + patience
        while self.conn is None or self.conn.closed or self.conn.broken:
            self.close_conn()
            try:
                self.conn = psycopg.connect(
                    make_conninfo(self.dsn, application_name="chaos-driver"),
                    autocommit=True, connect_timeout=5)
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        return self.conn

    def sql(self, query: str, params: Any = None, patience: float = 60) -> list[Any]:
        """Run one statement, reconnecting through outages for up to ``patience`` seconds."""
        deadline = time.monotonic() + patience
        while True:
            try:
                cursor = self.connect(patience).execute(query, params)
                return cursor.fetchall() if cursor.description else []
            except psycopg.OperationalError:
                self.close_conn()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    # -- events and workers ---------------------------------------------------------------

    def event(self, text: str) -> None:
        self.events.append((time.time(), text))
        if self.args.verbose:
            print(f"  {_ts(time.time())} {text}", flush=True)

    def spawn(self) -> None:
        self.figures.spawned += 1
        worker = WorkerProc(f"w{self.figures.spawned}", make_conninfo(
            self.dsn, application_name=WORKER_APP_NAME), make_conninfo(
            self.dsn, application_name="chaos-recorder"), self.log_dir, self.args.lease)
        self.workers.append(worker)
        self.event(f"worker {worker.label} started (pid {worker.pid})")

    def reap(self) -> None:
        for worker in list(self.workers):
            if worker.alive():
                continue
            self.workers.remove(worker)
            self.retired.append(worker)
            code = worker.proc.returncode
            if worker.killed:
                self.figures.exits_ours += 1
            else:
                when = "while serving" if worker.served() else "before serving (start-up)"
                self.figures.exits_other.append(
                    f"worker {worker.label} (pid {worker.pid}) exited by itself {when} with"
                    f" status {code}; its log ends:\n{worker.tail()}")
                self.event(f"worker {worker.label} (pid {worker.pid}) exited by itself ({code})")
            self.respawn_at.append(time.monotonic() + self.rng.uniform(0.2, 1.5))
        now = time.monotonic()
        for due in [t for t in self.respawn_at if t <= now]:
            self.respawn_at.remove(due)
            self.spawn()
        for worker in self.workers:
            if worker.stopped_until is not None and worker.stopped_until <= now:
                worker.signal(signal.SIGCONT)
                worker.stopped_until = None
                self.event(f"worker {worker.label} (pid {worker.pid}) SIGCONT")

    def kill_one(self) -> None:
        live = [w for w in self.workers if w.alive()]
        if not live:
            return
        worker = self.rng.choice(live)
        worker.killed = True
        worker.signal(signal.SIGKILL)
        worker.proc.wait()
        self.figures.kills += 1
        self.event(f"worker {worker.label} (pid {worker.pid}) SIGKILL")

    def stop_one(self) -> None:
        running = [w for w in self.workers if w.alive() and w.stopped_until is None]
        if not running:
            return
        worker = self.rng.choice(running)
        # mostly past the lease (a takeover), sometimes within it (the worker carries on)
        pause = self.rng.uniform(0.5, 3.0) * self.args.lease
        worker.signal(signal.SIGSTOP)
        worker.stopped_until = time.monotonic() + pause
        self.figures.stops += 1
        self.event(f"worker {worker.label} (pid {worker.pid}) SIGSTOP for {pause:.1f}s")

    def terminate_backends(self) -> None:
        rows = self.sql(
            "select count(*) filter (where t) from (select pg_terminate_backend(pid) t"
            " from (select pid from pg_stat_activity where application_name = %s"
            " order by random() limit greatest(1, (select count(*) from pg_stat_activity"
            " where application_name = %s) / 2)) s) k", (WORKER_APP_NAME, WORKER_APP_NAME))
        count = int(rows[0][0] or 0)
        self.figures.terminated += count
        self.event(f"pg_terminate_backend: {count} worker connection(s)")

    # -- load -----------------------------------------------------------------------------

    def plan_run(self) -> None:
        """Queue one run of a random kind, with its expected outcome."""
        self.seq += 1
        rng = self.rng
        kinds = {"steps": 20, "sleeper": 10, "retry": 12, "saga": 12, "parent": 10, "timeout": 4}
        if NEWER_APIS:
            kinds.update(txn=12, event=12, waiter=8)
        kind = rng.choices(list(kinds), weights=list(kinds.values()))[0]
        run_id = f"chaos-{kind}-{self.seq:05d}"
        work = round(rng.uniform(0.0, 0.15), 3)
        status, error_type, timeout = "completed", None, None
        inp: dict[str, Any]
        if kind == "steps":
            inp = {"seconds": [round(rng.uniform(0.0, 0.3), 3) for _ in range(rng.randint(2, 6))]}
        elif kind == "sleeper":
            inp = {"naps": [round(rng.uniform(0.2, 2.5), 2) for _ in range(rng.randint(1, 2))],
                   "work": work}
        elif kind == "retry":
            inp = {"failures": rng.randint(1, 3), "work": work}
        elif kind == "saga":
            inp = {"compensable": rng.randint(1, 3), "work": work}
            status, error_type = "dead_letter", "DesignedFailure"
        elif kind == "parent":
            inp = {"children": rng.randint(1, 2), "work": work,
                   "child_seconds": [round(rng.uniform(0.0, 0.1), 3) for _ in range(2)]}
        elif kind == "timeout":
            inp = {"sleep": 3600, "work": work}
            status, error_type, timeout = "dead_letter", "Timeout", 2.0
        elif kind == "txn":
            inp = {"transactions": rng.randint(1, 3), "work": work}
        elif kind == "event":
            sent = rng.random() < 0.8  # else the wait times out (1s), as designed
            inp = {"work": work, "send": {"n": self.seq} if sent else None,
                   "timeout": 120 if sent else 1.0, "delay": round(rng.uniform(0.0, 3.0), 2)}
        else:
            fails = rng.random() < 0.3
            inp = {"work": work, "child_fails": fails,
                   "child": ({"compensable": 1, "work": work} if fails
                             else {"seconds": [round(rng.uniform(0.0, 0.1), 3)] * 2})}
        self.pending_starts.append((run_id, kind, status, error_type, inp, timeout,
                                    f"chaos.{kind}"))

    def start_pending(self) -> None:
        """Start the queued runs, each in one transaction with its expectation; a start whose
        fate an outage made unknown is simply made again (both writes are idempotent)."""
        while self.pending_starts:
            run_id, kind, status, error_type, inp, timeout, workflow = self.pending_starts[0]
            try:
                conn = self.connect(patience=5)
                with conn.transaction():
                    conn.execute(
                        "insert into public.chaos_expected (run_id, kind, status, error_type,"
                        " input) values (%s, %s, %s, %s, %s) on conflict do nothing",
                        (run_id, kind, status, error_type, Jsonb(inp)))
                    conn.execute(
                        "select flowly.start(workflow => %s, input => %s, run_id => %s,"
                        " timeout => %s * interval '1 second')",
                        (workflow, Jsonb(inp), run_id, timeout))
            except psycopg.OperationalError:
                self.close_conn()
                return  # try again at the next tick
            self.pending_starts.pop(0)
            self.figures.runs[kind] += 1
            if kind == "event" and inp["send"] is not None:  # maybe before the run waits
                self.pending_events.append((time.monotonic() + inp["delay"], run_id, inp["send"]))

    def send_events(self) -> None:
        """Send the events that are due (again after an outage: a duplicate is never waited
        for, each wait consumes one)."""
        now = time.monotonic()
        for item in sorted(self.pending_events):
            due, run_id, payload = item
            if due > now:
                break
            try:
                self.connect(patience=5).execute("select flowly.send_event(%s, 'go', %s)",
                                                 (run_id, Jsonb(payload)))
            except psycopg.OperationalError:
                self.close_conn()
                return
            except psycopg.Error as exc:  # a resend after the run finished: WF004
                self.event(f"send_event {run_id}: {exc}")
            self.pending_events.remove(item)
            self.figures.events += 1

    def unfinished(self) -> int:
        rows = self.sql("select count(*) from flowly.runs where status not in"
                        " ('completed', 'dead_letter', 'cancelled')")
        return int(rows[0][0])

    # -- the whole thing ------------------------------------------------------------------

    def run(self) -> int:
        args = self.args
        print(f"chaos: seed {args.seed}, {args.duration:g}s of chaos, {args.workers} workers"
              f" (lease {args.lease:g}s), temporary directory {self.tmp}", flush=True)
        self.start_server()
        version = self.sql("show server_version")[0][0]
        install_dsn(self.dsn)
        self.sql(EXEC_TABLE)
        self.sql(EXPECTED_TABLE)
        print(f"chaos: embedded PostgreSQL {version} in {self.data_dir}", flush=True)
        for _ in range(args.workers):
            self.spawn()

        start = time.monotonic()
        end = start + args.duration
        mean = {"kill": 4.0, "stop": 6.0, "terminate": 3.0}
        due = {k: start + self.rng.uniform(1.0, 1.0 + m) for k, m in mean.items()}
        restarts = max(2, round(args.duration / 20))
        restart_times = [start + (i + self.rng.uniform(0.3, 0.7)) * args.duration / restarts
                         for i in range(restarts)]
        modes = ["fast", "immediate"] * restarts
        next_start = start
        while time.monotonic() < end:
            now = time.monotonic()
            self.reap()
            if now >= next_start:
                if not self.pending_starts and self.unfinished() < args.backlog:
                    for _ in range(max(1, round(args.rate / 4))):
                        self.plan_run()
                next_start = now + 0.25
            self.start_pending()
            self.send_events()
            for kind, at in due.items():
                if now >= at:
                    {"kill": self.kill_one, "stop": self.stop_one,
                     "terminate": self.terminate_backends}[kind]()
                    due[kind] = time.monotonic() + self.rng.expovariate(1 / mean[kind])
            if restart_times and now >= restart_times[0]:
                restart_times.pop(0)
                self.restart_server(modes.pop(0))
            time.sleep(0.05)

        self.event("chaos over: letting every run finish")
        for worker in self.workers:
            if worker.stopped_until is not None:
                worker.stopped_until = 0.0
        settle_end = time.monotonic() + args.settle
        while time.monotonic() < settle_end:
            self.reap()
            self.start_pending()
            self.send_events()
            if not self.pending_starts and self.unfinished() == 0:
                break
            time.sleep(0.5)
        settled = time.monotonic() - end
        self.stop_workers()
        print(f"chaos: chaos phase {args.duration:g}s, then {settled:.1f}s for the last runs"
              " to finish", flush=True)
        injected = inject_faults(self) if args.inject_faults else {}
        return report(self, check(self), injected)

    def stop_workers(self) -> None:
        for worker in self.workers:
            worker.signal(signal.SIGCONT)
            worker.signal(signal.SIGTERM)
        for worker in self.workers:
            try:
                code = worker.proc.wait(15)
                if code not in (0, -signal.SIGTERM):
                    self.figures.exits_other.append(
                        f"worker {worker.label} (pid {worker.pid}) exited with status {code}"
                        f" on SIGTERM; its log ends:\n{worker.tail()}")
            except subprocess.TimeoutExpired:
                worker.signal(signal.SIGKILL)
                worker.proc.wait()
                self.figures.exits_other.append(
                    f"worker {worker.label} (pid {worker.pid}) ignored SIGTERM for 15s")
        self.retired += self.workers
        self.workers = []

    def cleanup(self) -> None:
        for worker in self.workers:
            worker.signal(signal.SIGKILL)
            with contextlib.suppress(Exception):
                worker.proc.wait(5)
        self.workers = []
        if self.data_dir.exists():
            self.stop_server()
        if self.args.keep:
            print(f"chaos: kept {self.tmp}", file=sys.stderr)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


# -- checking ---------------------------------------------------------------------------------


@dataclass
class Exec:
    exec_id: str
    run_id: str
    step: str
    kind: str
    pid: int
    own_epoch: int | None
    cur_epoch: int | None
    cur_holder: str | None
    cur_status: str | None
    at: datetime

    @property
    def epoch(self) -> int | None:
        """The epoch this execution ran under: its own if known, else the run's epoch when it
        started if its process held the run then (worker ids are host:pid:suffix), else None
        (a fenced worker's)."""
        if self.own_epoch is not None:
            return self.own_epoch
        holder = (self.cur_holder or "").split(":")
        if len(holder) >= 3 and holder[-2] == str(self.pid):
            return self.cur_epoch
        return None

    def describe(self) -> str:
        return (f"{self.kind} {self.step} exec {self.exec_id[:8]} pid {self.pid}"
                f" epoch {self.own_epoch} (run at epoch {self.cur_epoch}, {self.cur_status},"
                f" held by {self.cur_holder}) at {self.at:%H:%M:%S.%f}")


@dataclass
class Results:
    runs: dict[str, dict[str, Any]]
    expected: dict[str, dict[str, Any]]
    outcomes: Counter[str] = field(default_factory=Counter)
    violations: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    counts: Counter[str] = field(default_factory=Counter)
    execs: dict[str, list[Exec]] = field(default_factory=dict)
    steps: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    fenced: list[str] = field(default_factory=list)  # executions a frozen worker made late

    def fail(self, run_id: str, what: str, counter: str | None = None) -> None:
        self.violations[run_id].append(what)
        if counter:
            self.counts[counter] += 1


def _body_steps(kind: str, inp: dict[str, Any]) -> list[str]:
    """The steps a completed run of ``kind`` checkpointed, in body order."""
    if kind == "steps":
        return [f"s{i}" for i in range(len(inp["seconds"]))]
    if kind == "sleeper":
        return [f"s{i}" for i in range(len(inp["naps"]))] + ["last"]
    if kind == "retry":
        return ["before", "flaky", "after"]
    if kind in ("parent", "txn", "event", "waiter"):
        return ["before", "after"]
    return []


def check(chaos: Chaos) -> Results:
    q = chaos.sql
    runs = {r[0]: dict(zip(["id", "workflow", "status", "error", "output", "compensation_ok",
                            "parent_run_id", "takeovers", "lease_epoch", "created_at",
                            "finished_at", "input", "started_at"], r, strict=True))
            for r in q("select id, workflow, status, error, output, compensation_ok,"
                       " parent_run_id, takeovers, lease_epoch, created_at, finished_at, input,"
                       " started_at"
                       " from flowly.runs")}
    expected = {r[0]: {"kind": r[1], "status": r[2], "error_type": r[3], "input": r[4]}
                for r in q("select run_id, kind, status, error_type, input"
                           " from public.chaos_expected")}
    res = Results(runs, expected)
    # children: started by their parents; a saga child fails by design
    for run in runs.values():
        if run["id"] not in expected and run["parent_run_id"] in expected:
            saga = run["workflow"] == "chaos.saga"
            expected[run["id"]] = {"kind": "saga" if saga else "steps", "child": True,
                                   "status": "dead_letter" if saga else "completed",
                                   "error_type": "DesignedFailure" if saga else None,
                                   "input": run["input"]}
    for run_id, step, status, output, seq, finished_at, comp_status, compensated_at in q(
            "select run_id, name, status, output, seq, finished_at, compensation_status,"
            " compensated_at from flowly.steps"):
        res.steps.setdefault(run_id, {})[step] = {
            "status": status, "output": output, "seq": seq, "finished_at": finished_at,
            "compensation_status": comp_status, "compensated_at": compensated_at}
    attempts = {(r[0], r[1]): int(r[2]) for r in q(
        "select run_id, step_name, count(*) from flowly.step_attempts group by 1, 2")}
    by_id: dict[str, Exec] = {}
    for row in q("select exec_id, run_id, step, kind, pid, own_epoch, cur_epoch, cur_holder,"
                 " cur_status, at from public.chaos_exec order by at"):
        e = Exec(*row)
        by_id[e.exec_id] = e
        res.execs.setdefault(e.run_id, []).append(e)
    res.counts["executions"] = len(by_id)
    # claimed by the transaction that started them (0030): the hand-off path is under test too
    res.counts["handed off"] = sum(1 for run in runs.values()
                                   if run["started_at"] == run["created_at"])

    for run_id, run in runs.items():
        if run_id not in expected:
            res.fail(run_id, f"a run nobody started: {run['workflow']} (parent"
                             f" {run['parent_run_id']})", "unexpected")
    for run_id, exp in expected.items():
        run = runs.get(run_id)
        if run is None:
            res.fail(run_id, "started (its expectation committed with it) but not in flowly.runs",
                     "lost runs")
            continue
        check_run(res, run, exp, attempts.get((run_id, "flaky"), 0))
    # transactional steps: their SQL committed exactly once, with the checkpoint it returned
    txn_rows: dict[tuple[str, str], list[int]] = defaultdict(list)
    for run_id, step, row_id in q("select run_id, step, id from public.chaos_txn order by id"):
        txn_rows[(run_id, step)].append(row_id)
    for run_id, exp in expected.items():
        if exp["kind"] == "txn":
            check_txn(res, run_id, exp["input"], txn_rows)
    for run_id, execs in res.execs.items():
        check_executions(res, run_id, execs, by_id)
    check_run_counts(res, q)
    return res


def check_run_counts(res: Results, q: Callable[..., list[Any]]) -> None:
    """The dashboard's run_counts (finished runs counted by triggers as they finish, cancel,
    dead-letter or retry, across the kills and restarts) agrees with a count of flowly.runs."""
    exact = {(w, s): n for w, s, n in q(
        "select workflow, status, count(*) from flowly.runs group by 1, 2")}
    viewed = {(w, s): n for w, s, n in q("select workflow, status, runs from flowly.run_counts")}
    for workflow, status in sorted(set(exact) | set(viewed)):
        got, want = viewed.get((workflow, status), 0), exact.get((workflow, status), 0)
        if got != want:
            res.fail(f"run_counts:{workflow}/{status}",
                     f"run_counts says {got} runs, flowly.runs holds {want}", "wrong run counts")


def check_run(res: Results, run: dict[str, Any], exp: dict[str, Any], flaky_attempts: int) -> None:
    run_id, status = run["id"], run["status"]
    error_type = (run["error"] or {}).get("type")
    if status not in TERMINAL:
        res.fail(run_id, f"stuck: still {status} (takeovers {run['takeovers']})", "stuck")
        return
    outcome = status if status != "dead_letter" else f"dead_letter/{error_type}"
    res.outcomes[outcome] += 1
    if status != exp["status"] or (exp["error_type"] and error_type != exp["error_type"]):
        counter = "innocent dead letters" if exp["status"] == "completed" else "wrong final state"
        res.fail(run_id, f"ended {outcome}, expected {exp['status']}"
                         f"{'/' + exp['error_type'] if exp['error_type'] else ''}"
                         f" (error: {(run['error'] or {}).get('message')!r},"
                         f" takeovers {run['takeovers']})", counter)
        return
    kind, inp = exp["kind"], exp["input"]
    steps = res.steps.get(run_id, {})
    if status == "completed":
        names = _body_steps(kind, inp)
        stored = []
        for name in names:
            step = steps.get(name)
            if step is None or step["status"] != "completed":
                res.fail(run_id, f"completed without a checkpoint of step {name}", "lost")
                return
            stored.append(step["output"]["exec"])
        output = run["output"] or {}
        if output.get("execs") != stored:
            res.fail(run_id, f"output {output.get('execs')} is not the checkpointed outputs"
                             f" {stored}: replay not exact", "inexact replay")
        epoch = output.get("epoch")
        if epoch is not None:
            late = [e for e in res.execs.get(run_id, [])
                    if e.epoch is not None and e.epoch > epoch]
            if late:
                res.fail(run_id, f"completed under epoch {epoch}, yet a later claim executed: "
                                 + "; ".join(e.describe() for e in late), "fencing breaches")
    if kind == "retry" and flaky_attempts > inp["failures"]:
        res.fail(run_id, f"step flaky failed {flaky_attempts} times, designed to fail at most"
                         f" {inp['failures']}: chaos made a step fail", "wrong final state")
    if kind == "parent":
        children = [f"{run_id}:chaos.steps:{i + 1}" for i in range(inp["children"])]
        actual = sorted(r["id"] for r in res.runs.values() if r["parent_run_id"] == run_id)
        if actual != sorted(children) or (run["output"] or {}).get("children") != children:
            res.fail(run_id, f"children {actual} (output says"
                             f" {(run['output'] or {}).get('children')}), expected {children}",
                     "wrong children")
    if kind == "event" and status == "completed":
        output = run["output"] or {}
        want = {"payload": inp["send"], "timed_out": inp["send"] is None}
        got = {"payload": output.get("payload"), "timed_out": output.get("timed_out")}
        if got != want:
            res.fail(run_id, f"event wait gave {got}, expected {want}", "wrong events")
    if kind == "waiter" and status == "completed":
        output = run["output"] or {}
        child_id = f"{run_id}:chaos.{'saga' if inp['child_fails'] else 'steps'}:1"
        child = res.runs.get(child_id)
        actual = sorted(r["id"] for r in res.runs.values() if r["parent_run_id"] == run_id)
        if actual != [child_id] or child is None:
            res.fail(run_id, f"children {actual}, expected [{child_id}]", "wrong children")
        elif inp["child_fails"]:
            if (output.get("child_failed"), output.get("child_error")) != (
                    "dead_letter", "DesignedFailure"):
                res.fail(run_id, f"waited for a failing child: got {output}", "wrong children")
        elif output.get("child") != child["output"]:
            res.fail(run_id, f"waited for child output {child['output']}, got"
                             f" {output.get('child')}", "wrong children")
    if kind == "saga":
        names = [f"c{i}" for i in range(inp["compensable"])]
        if run["compensation_ok"] is not True:
            res.fail(run_id, f"compensation_ok is {run['compensation_ok']}", "wrong final state")
        times = []
        for name in names:
            step = steps.get(name) or {}
            if step.get("compensation_status") != "completed":
                res.fail(run_id, f"step {name} compensation {step.get('compensation_status')}",
                         "wrong final state")
                return
            times.append(step["compensated_at"])
            if not any(e.kind == "compensate" and e.step == name
                       for e in res.execs.get(run_id, [])):
                res.fail(run_id, f"step {name} compensated, yet its compensation never ran",
                         "wrong final state")
        if times != sorted(times, reverse=True):
            order = list(zip(names, times, strict=True))
            res.fail(run_id, f"compensations not last-first: {order}", "wrong final state")
        if (steps.get("boom") or {}).get("status") != "failed":
            res.fail(run_id, "step boom is not recorded as failed", "wrong final state")


def check_txn(res: Results, run_id: str, inp: dict[str, Any],
              txn_rows: dict[tuple[str, str], list[int]]) -> None:
    run = res.runs.get(run_id) or {}
    steps = res.steps.get(run_id, {})
    ids = []
    for i in range(int(inp["transactions"])):
        name = f"t{i}"
        rows = txn_rows.get((run_id, name), [])
        step = steps.get(name)
        if len(rows) > 1:
            res.fail(run_id, f"transactional step {name} committed its SQL {len(rows)} times"
                             f" (rows {rows})", "duplicated")
        if step is not None and step["status"] == "completed":
            stored = (step["output"] or {}).get("txn")
            if rows != [stored]:
                res.fail(run_id, f"transactional step {name}: checkpoint says row {stored},"
                                 f" the table holds {rows}", "lost")
            ids.append(stored)
        elif rows:
            res.fail(run_id, f"transactional step {name} has no checkpoint, yet its SQL"
                             f" committed (rows {rows})", "lost")
    if run.get("status") == "completed" and (run.get("output") or {}).get("txns") != ids:
        res.fail(run_id, f"output txns {(run.get('output') or {}).get('txns')} are not the"
                         f" checkpoints {ids}", "inexact replay")


def check_executions(res: Results, run_id: str, execs: list[Exec], by_id: dict[str, Exec]) -> None:
    steps = res.steps.get(run_id, {})
    per_step: dict[str, list[Exec]] = defaultdict(list)
    for e in execs:
        if e.kind == "step":
            per_step[e.step].append(e)
    for name, step_execs in per_step.items():
        step = steps.get(name)
        if step is None or step["status"] != "completed":
            continue
        ckpt = by_id.get((step["output"] or {}).get("exec", ""))
        if ckpt is None:
            res.fail(run_id, f"step {name}'s checkpoint names no recorded execution",
                     "lost")
            continue
        for e in step_execs:
            if e is ckpt:
                continue
            if e.at <= step["finished_at"]:
                res.counts["re-executions before the checkpoint"] += 1
            elif (e.epoch is not None and ckpt.epoch is not None and e.epoch >= ckpt.epoch):
                res.fail(run_id, f"step {name} executed again after its checkpoint"
                                 f" ({step['finished_at']:%H:%M:%S.%f}, written by"
                                 f" {ckpt.describe()}): {e.describe()}", "duplicated")
            else:
                res.counts["fenced executions after the checkpoint"] += 1
                res.fenced.append(f"{run_id} step {name}: {e.describe()}; checkpoint written"
                                  f" {step['finished_at']:%H:%M:%S.%f} by {ckpt.describe()}")
        # a checkpoint can only land while its epoch is current: a newer claim that had
        # begun executing before it was written means a stale write got through
        if ckpt.epoch is not None:
            newer = [e for e in execs if e.epoch is not None and e.epoch > ckpt.epoch
                     and e.at < step["finished_at"]]
            if newer:
                res.fail(run_id, f"checkpoint of {name} by {ckpt.describe()} written at"
                                 f" {step['finished_at']:%H:%M:%S.%f}, after a newer claim"
                                 f" ran {newer[0].describe()}", "fencing breaches")
    # a body goes past a step only once its checkpoint committed: that checkpoint must stay,
    # with the output that body saw
    by_epoch: dict[int, list[Exec]] = defaultdict(list)
    for e in execs:
        if e.kind == "step" and e.own_epoch is not None:
            by_epoch[e.own_epoch].append(e)
    for epoch, chain in by_epoch.items():
        for x, y in itertools.pairwise(chain):
            if x.step == y.step:
                continue
            step = steps.get(x.step)
            stored = (step or {}).get("output") or {}
            if step is None or step["status"] != "completed" or stored.get("exec") != x.exec_id:
                res.fail(run_id, f"step {x.step} was acknowledged at epoch {epoch} (its body went"
                                 f" on to {y.step}) with output exec {x.exec_id[:8]}, yet the"
                                 f" checkpoint now holds {stored.get('exec', 'nothing')!s:.8}",
                         "lost")
    # compensations: one whose outcome was stored must not run again under a later claim
    for e in execs:
        if e.kind != "compensate":
            continue
        step = steps.get(e.step) or {}
        done = step.get("compensated_at")
        if done is None or e.at <= done:
            continue
        before = [c.epoch for c in execs if c.kind == "compensate" and c.step == e.step
                  and c.at <= done and c.epoch is not None]
        if e.epoch is not None and before and e.epoch > max(before):
            res.fail(run_id, f"compensation of {e.step} ran again after its outcome was stored"
                             f" ({done:%H:%M:%S.%f}): {e.describe()}", "duplicated")
        else:
            res.counts["fenced executions after the checkpoint"] += 1
            res.fenced.append(f"{run_id} compensation of {e.step}: {e.describe()}; outcome"
                              f" stored {done:%H:%M:%S.%f}")


def inject_faults(chaos: Chaos) -> dict[str, str]:
    """Break each invariant once in the tables (after the workers stopped), so a run with
    ``--inject-faults`` shows the checks catch what they claim to. Returns run id -> the
    counter that must flag it."""
    q = chaos.sql
    done = [r[0] for r in q(
        "select r.id from flowly.runs r join public.chaos_expected x on x.run_id = r.id"
        " where x.kind = 'steps' and r.status = 'completed'"
        " and jsonb_array_length(x.input -> 'seconds') >= 3 order by r.id limit 5")]
    if len(done) < 5:
        raise SystemExit("chaos: --inject-faults needs 5 completed chaos.steps runs of 3+ steps")
    dup, lost, poisoned, stuck, breach = done
    copy_exec = (
        "insert into public.chaos_exec (exec_id, run_id, step, kind, pid, own_epoch, at)"
        " select 'fake-' || e.exec_id, e.run_id, e.step, e.kind, e.pid, e.own_epoch + 1,"
        " s.finished_at + %s * interval '1 second' from flowly.steps s"
        " join public.chaos_exec e on e.exec_id = s.output ->> 'exec'"
        " where s.run_id = %s and s.name = %s")
    q(copy_exec, (1, dup, "s0"))  # s0 again, under a later claim, after its checkpoint
    q("delete from flowly.steps where run_id = %s and name = 's1'", (lost,))
    q("update flowly.runs set status = 'dead_letter', error = '{\"type\": \"PoisonRun\"}'"
      " where id = %s", (poisoned,))
    q("update flowly.runs set status = 'running' where id = %s", (stuck,))
    q(copy_exec, (-0.5, breach, "s1"))  # a newer claim ran before s1's checkpoint landed
    faults = {dup: "duplicated", lost: "lost", poisoned: "innocent dead letters",
              stuck: "stuck", breach: "fencing breaches"}
    txn = q("select r.id from flowly.runs r join public.chaos_expected x on x.run_id = r.id"
            " where x.kind = 'txn' and r.status = 'completed' order by r.id limit 1")
    if txn:  # a transactional step's SQL committed twice
        q("insert into public.chaos_txn (run_id, step, pid) values (%s, 't0', 0)", (txn[0][0],))
        faults[txn[0][0]] = "duplicated"
    # a finished run counted twice
    q("insert into flowly.run_count_deltas (workflow, status, delta)"
      " values ('chaos.steps', 'completed', 1)")
    faults["run_counts:chaos.steps/completed"] = "wrong run counts"
    for run_id, counter in faults.items():
        print(f"chaos: injected into {run_id}: {counter}")
    return faults


# -- reporting --------------------------------------------------------------------------------


_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d ")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*: ")


def logged_errors(chaos: Chaos) -> Counter[str]:
    """The ERROR lines of the worker logs, by message (the first exception line of the
    traceback that follows, if any): not invariants, but what the engine calls a failure."""
    found: Counter[str] = Counter()
    for worker in chaos.retired + chaos.workers:
        try:
            lines = worker.log_path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for i, line in enumerate(lines):
            if " ERROR " not in line or not _LOG_LINE.match(line):
                continue
            cause = re.sub(r"chaos-\w+-\d+\S*", "RUN", line.split(" ERROR ", 1)[1])
            for later in lines[i + 1:]:
                if _LOG_LINE.match(later):
                    break
                if _EXCEPTION_LINE.match(later):
                    cause = f"{cause} <- {later}"
                    break
            found[cause[:300]] += 1
    return found


def _exit_causes(exits: list[str]) -> str:
    """How many of the workers' own exits came at start-up, with the server down."""
    at_start = sum("before serving" in text and "cannot connect to the database" in text
                   for text in exits)
    return f" ({at_start} at start-up, the server down)" if at_start else ""


def report(chaos: Chaos, res: Results, injected: dict[str, str]) -> int:
    f = chaos.figures
    started = sum(f.runs.values())
    children = sum(1 for e in res.expected.values() if e.get("child"))
    print()
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(f.runs.items()))
    print(f"runs            {started} started ({kinds}) + {children} children;"
          f" {f.events} events sent; {res.counts['handed off']} handed to an idle worker by"
          f" their start")
    print(f"outcomes        {', '.join(f'{k} {v}' for k, v in sorted(res.outcomes.items()))}")
    print(f"chaos           kills {f.kills}, stops {f.stops}, restarts"
          f" {sum(f.restarts.values())} (fast {f.restarts['fast']},"
          f" immediate {f.restarts['immediate']}), terminated connections {f.terminated}")
    c = res.counts
    errors = logged_errors(chaos)
    print(f"executions      {c['executions']} recorded; re-executions before the checkpoint"
          f" (at-least-once) {c['re-executions before the checkpoint']}; fenced executions"
          f" after it {c['fenced executions after the checkpoint']}")
    print(f"workers         {f.spawned} started, {f.exits_ours} SIGKILLed by us,"
          f" {len(f.exits_other)} exits otherwise{_exit_causes(f.exits_other)}")
    print(f"worker errors   {sum(errors.values())} ERROR lines in the worker logs"
          + "".join(f"\n                {n}x {text}" for text, n in errors.most_common(5)))
    checks = ["lost", "stuck", "duplicated", "innocent dead letters", "wrong final state",
              "fencing breaches", "inexact replay", "wrong children", "wrong events",
              "unexpected", "lost runs", "wrong run counts"]
    print(f"invariants      {', '.join(f'{k} {c[k]}' for k in checks)}")
    if not NEWER_APIS:
        print("skipped         transactional steps, events and waits for runs (not in this"
              " engine yet)")
    if chaos.args.verbose:
        for text in res.fenced:
            print(f"fenced late     {text}")
    for text in f.exits_other:
        print(f"\nnote: {text}")
    if injected:
        missed = {run_id: counter for run_id, counter in injected.items()
                  if run_id not in res.violations or not res.counts[counter]}
        extra = sorted(set(res.violations) - set(injected))
        print(f"\nchaos: injected faults {len(injected)}, missed {missed or 'none'}, broken"
              f" runs besides them {extra or 'none'}")
        return 1 if missed or extra else 0
    if not res.violations:
        print("\nchaos: every invariant held")
        return 0
    print(f"\nchaos: INVARIANTS BROKEN in {len(res.violations)} run(s):")
    logs = {}
    for worker in chaos.retired + chaos.workers:
        with contextlib.suppress(OSError):
            logs[worker.label] = worker.log_path.read_text(errors="replace").splitlines()
    for shown, (run_id, problems) in enumerate(sorted(res.violations.items())):
        if shown >= 10:
            print(f"\n... and {len(res.violations) - shown} more run(s)")
            break
        run = res.runs.get(run_id, {})
        print(f"\n== run {run_id}: {run.get('workflow')} {run.get('status')}"
              f" epoch {run.get('lease_epoch')} takeovers {run.get('takeovers')}"
              f" created {run.get('created_at')} finished {run.get('finished_at')}")
        for problem in problems:
            print(f"  BROKEN: {problem}")
        for e in res.execs.get(run_id, []):
            print(f"  exec: {e.describe()}")
        for name, step in sorted(res.steps.get(run_id, {}).items(), key=lambda s: s[1]["seq"]):
            print(f"  step: {name} {step['status']} seq {step['seq']} output {step['output']}"
                  f" finished {step['finished_at']:%H:%M:%S.%f}"
                  f" compensation {step['compensation_status']}")
        created, finished = run.get("created_at"), run.get("finished_at")
        if created is not None:
            lo = created.timestamp() - 1
            hi = (finished.timestamp() if finished else time.time()) + 1
            for t, text in chaos.events:
                if lo <= t <= hi:
                    print(f"  chaos: {_ts(t)} {text}")
        for label, lines in logs.items():
            for line in [x for x in lines if run_id in x][:20]:
                print(f"  log {label}: {line}")
    return 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=45.0,
                        help="seconds of chaos (45: with startup and the final checks, about a"
                             " minute)")
    parser.add_argument("--settle", type=float, default=45.0,
                        help="seconds the runs get to finish after the chaos (45)")
    parser.add_argument("--workers", type=int, default=3, help="worker processes (3)")
    parser.add_argument("--lease", type=float, default=2.0, help="worker lease seconds (2)")
    parser.add_argument("--rate", type=float, default=4.0, help="runs started per second (4)")
    parser.add_argument("--backlog", type=int, default=40,
                        help="start no run while this many are unfinished (40)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    parser.add_argument("--pg-version", default=None, choices=embedded.SUPPORTED_VERSIONS,
                        help="embedded PostgreSQL major version (default: newest)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary directory (logs, stopped cluster)")
    parser.add_argument("--inject-faults", action="store_true",
                        help="test the checks: break each invariant once in the tables before"
                             " checking; exits 0 if every fault was caught")
    parser.add_argument("--verbose", "-v", action="store_true", help="print every chaos event")
    args = parser.parse_args()
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(10**6)
    logging.basicConfig(level=logging.WARNING)
    # SIGINT too: a shell starting us in the background may have set it to be ignored
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    chaos = Chaos(args)
    try:
        return chaos.run()
    except (KeyboardInterrupt, Interrupted) as exc:
        print(f"\nchaos: interrupted ({exc or 'SIGINT'}); cleaning up", file=sys.stderr)
        return 130
    finally:
        chaos.cleanup()


if __name__ == "__main__":
    sys.exit(main())
