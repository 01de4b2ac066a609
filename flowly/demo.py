"""``flowly demo``: kill a worker in the middle of a workflow and watch the run finish anyway.

Everything runs for real: worker subprocesses (``python -m flowly.worker --app
flowly.examples.order``, the workflow shipped in the package, so no checkout is needed) against
the configured database (or the embedded PostgreSQL). The demo

1. installs the schema and starts worker A;
2. starts an ``order`` run and waits until ``reserve_inventory`` is checkpointed, the durable
   ``cooling_period`` timer has fired and ``charge_payment`` is executing;
3. SIGKILLs worker A, and shows the run still ``running`` with its checkpoint intact;
4. starts worker B, which takes the run over once A's lease expires, replays the checkpoint
   and completes the run, and checks that ``reserve_inventory`` ran exactly once (its
   checkpoint row is unchanged, attempts = 1, one "reserved" line in the workers' logs);
5. starts a run whose card is declined: ``charge_payment`` fails, is retried, the reservation
   is compensated and the run is dead-lettered;
6. prints both timelines (the same rendering as ``flowly show``), the SQL to see the same in
   psql, and stops worker B with SIGTERM.

The demo's runs use their own queue, so workers of other deployments in the same database do
not pick them up. This module is the demo program itself: it writes its report to ``out``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TextIO, TypeVar

from psycopg import sql

from .client import Client, Step
from .config import redacted_dsn
from .db import DEFAULT_SCHEMA, schema_identifier
from .examples import order as order_module
from .render import RunDetail, format_time, load_run, quote_ident, quote_literal, render_run
from .schema import install_dsn, migrations

DEMO_QUEUE = "flowly-demo"
"""The queue the demo's runs and workers use, apart from any other deployment's."""

APP = "flowly.examples.order"
"""The workers' ``--app``: the order workflow shipped in the package, so no checkout is needed."""

LEASE_SECONDS = 2.0
"""The demo workers' lease: how long a killed worker's run stays held before a takeover."""

T = TypeVar("T")


class DemoFailed(Exception):
    """Something the demo expected did not happen; the message says what."""


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


class _Worker:
    """A ``python -m flowly.worker --app flowly.examples.order`` child, logging to a file."""

    def __init__(self, label: str, dsn: str, schema: str, log_dir: Path) -> None:
        self.label = label
        self.log_path = log_dir / f"worker-{label}.log"
        env = dict(os.environ)
        env["FLOWLY_DSN"] = dsn  # not on the command line, where ps would show its password
        command = [
            sys.executable, "-m", "flowly.worker", "--app", APP,
            "--schema", schema, "--queue", DEMO_QUEUE,
            "--lease", str(LEASE_SECONDS), "--poll-interval", "0.1", "--drain-timeout", "5",
        ]
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(command, cwd=log_dir, env=env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: no drain, no release, no goodbye; the run stays held under its lease."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait (SIGKILL after ``timeout``); returns the exit status."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def _poll(condition: Callable[[], T | None], timeout: float, what: str,
          worker: _Worker | None = None, interval: float = 0.02) -> T:
    """Call ``condition`` until it returns a value; DemoFailed after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value is not None:
            return value
        if worker is not None and not worker.alive():
            raise DemoFailed(f"worker {worker.label} exited ({worker.proc.returncode}) while"
                             f" waiting for {what}")
        if time.monotonic() > deadline:
            raise DemoFailed(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class _Demo:
    def __init__(self, dsn: str, schema: str, out: TextIO, log_dir: Path) -> None:
        self.dsn = dsn
        self.schema = schema
        self.out = out
        self.log_dir = log_dir
        self.client = Client(dsn, schema=schema)
        self.workers: list[_Worker] = []
        self.token = uuid.uuid4().hex[:6]
        self.started = time.monotonic()

    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def step(self, text: str) -> None:
        self.say()
        self.say(f"[{time.monotonic() - self.started:5.1f}s] {text}")

    def show(self, run_id: str) -> RunDetail:
        detail = load_run(self.client, run_id)
        self.say(_indent(render_run(detail)))
        return detail

    def start_worker(self, label: str) -> _Worker:
        worker = _Worker(label, self.dsn, self.schema, self.log_dir)
        self.workers.append(worker)
        pattern = f"%:{worker.pid}:%"
        query = sql.SQL("select 1 from {}.workers where id like %s").format(
            schema_identifier(self.schema))

        def registered() -> bool | None:
            return True if self.client.connection.execute(query, (pattern,)).fetchone() else None

        _poll(registered, 30, f"worker {label} to start", worker, interval=0.05)
        return worker

    def reserved_lines(self, run_id: str) -> dict[str, int]:
        """How many times each worker logged executing reserve_inventory for ``run_id``."""
        needle = f"(key {run_id}:reserve_inventory)"
        return {w.label: w.log().count(needle) for w in self.workers}

    # -- the story --------------------------------------------------------------------------

    def run(self) -> None:
        self.say("flowly demo: a workflow that survives its worker being killed")
        self.say(f"database: {redacted_dsn(self.dsn)}    schema: {self.schema}")
        self.say(f"workflow: 'order' from {order_module.__file__}:"
                 " reserve_inventory -> durable sleep 'cooling_period' -> charge_payment")

        applied = install_dsn(self.dsn, self.schema)
        names = {m.version: m.name for m in migrations()}
        self.step(f"schema {quote_ident(self.schema)}: " + (
            f"installed {', '.join(names[v] for v in applied)}" if applied
            else f"already up to date (version {max(names)})"))

        a = self.start_worker("A")
        self.step(f"worker A started (pid {a.pid}), queue {DEMO_QUEUE!r},"
                  f" lease {LEASE_SECONDS:g}s")

        ok_id = self.client.start(
            "order", {"sku": "book", "qty": 1, "card": "4242", "cooling_seconds": 1},
            run_id=f"demo-{self.token}-ok", queue=DEMO_QUEUE)
        self.step(f"started run {ok_id} (card 4242, 1s cooling period)")
        self.say("    waiting until reserve_inventory is checkpointed, the cooling timer has"
                 " fired and charge_payment is running ...")
        before = self.wait_mid_charge(ok_id, a)

        a.kill()
        self.step(f"kill -9 worker A (pid {a.pid}) while charge_payment is running")
        after_kill = self.show(ok_id)
        if after_kill.run.status != "running":
            raise DemoFailed(f"expected the killed worker's run to stay running, it is"
                             f" {after_kill.run.status}")
        killed_mid_step = "charge_payment" not in {s.name for s in after_kill.steps}
        self.say(f"    -> still 'running' and held by the dead worker until its lease expires"
                 f" ({format_time(after_kill.run.locked_until)}); reserve_inventory's checkpoint"
                 " is intact.")
        if not killed_mid_step:
            self.say("    (the kill landed just after charge_payment's checkpoint committed;"
                     " the takeover below replays it instead of running it again)")

        b = self.start_worker("B")
        self.step(f"worker B started (pid {b.pid}); it takes the run over when A's lease"
                  " expires: no sweeper, the next claim does it")
        done = self.client.wait(ok_id, timeout=30)
        self.step(f"run {ok_id} is {done.status}")
        final = self.show(ok_id)
        if done.status != "completed":
            raise DemoFailed(f"run {ok_id} ended {done.status}, expected completed")
        self.check_reserved_once(ok_id, before, final)
        if killed_mid_step:
            self.say("    charge_payment was in flight on worker A when it was killed, so worker B"
                     " ran it from the start: ordinary steps are at-least-once. Its idempotency key"
                     f" ({ok_id}:charge_payment) lets a payment API drop the duplicate.")

        bad_id = self.client.start(
            "order", {"sku": "lamp", "qty": 2, "card": "0000", "cooling_seconds": 0},
            run_id=f"demo-{self.token}-declined", queue=DEMO_QUEUE)
        self.step(f"started run {bad_id} with card 0000: charge_payment is declined, retried"
                  " once, then reserve_inventory is compensated")
        failed = self.client.wait(bad_id, timeout=30)
        self.step(f"run {bad_id} is {failed.status}")
        detail = self.show(bad_id)
        self.check_dead_letter(detail)

        self.step("the same from psql:")
        self.say(_indent(self.psql_hint([ok_id, bad_id])))

        code = b.terminate()
        self.step(f"worker B stopped (SIGTERM, exit status {code})")
        self.say()
        self.say(f"demo finished in {time.monotonic() - self.started:.1f}s: the killed"
                 " worker's run resumed from its checkpoint and completed; the declined run"
                 " was compensated and dead-lettered (`flowly retry <id>` restarts it).")

    def wait_mid_charge(self, run_id: str, worker: _Worker) -> Step:
        """Wait until charge_payment is executing; return reserve_inventory's checkpoint."""
        def mid_charge() -> Step | None:
            run = self.client.get(run_id)
            if run.done:
                raise DemoFailed(f"run {run_id} finished ({run.status}) before the kill")
            steps = {s.name: s for s in self.client.steps(run_id)}
            fired = any(t.name == "cooling_period" and t.fired_at is not None
                        for t in self.client.timers(run_id))
            if (run.status == "running" and run.locked_by is not None
                    and f":{worker.pid}:" in run.locked_by and "reserve_inventory" in steps
                    and "charge_payment" not in steps and fired):
                return steps["reserve_inventory"]
            return None

        return _poll(mid_charge, 30, "charge_payment to start", worker, interval=0.01)

    def check_reserved_once(self, run_id: str, before: Step, final: RunDetail) -> None:
        after = next(s for s in final.steps if s.name == "reserve_inventory")
        if (after.finished_at, after.attempts, after.output) != (
                before.finished_at, 1, before.output):
            raise DemoFailed(f"reserve_inventory's checkpoint changed: {before} -> {after}")
        counts = self.reserved_lines(run_id)
        total = sum(counts.values())
        if total > 1:
            raise DemoFailed(f"reserve_inventory ran {total} times: {counts}")
        self.say("    verified: reserve_inventory executed exactly once:")
        self.say(f"      - its checkpoint row is unchanged (finished_at"
                 f" {format_time(after.finished_at)} before the kill and now, attempts"
                 f" {after.attempts})")
        per_worker = ", ".join(f"worker {k}: {v}" for k, v in counts.items())
        if total == 1:
            self.say(f"      - the workers logged executing it once ({per_worker})")
        else:
            self.say("      - (its log line was not found in the workers' logs to cross-check)")

    def check_dead_letter(self, detail: RunDetail) -> None:
        steps = {s.name: s for s in detail.steps}
        reserve, charge = steps.get("reserve_inventory"), steps.get("charge_payment")
        if detail.run.status != "dead_letter":
            raise DemoFailed(f"run {detail.run.id} is {detail.run.status}, expected dead_letter")
        if reserve is None or reserve.compensation_status != "completed":
            raise DemoFailed("reserve_inventory was not compensated")
        if charge is None or charge.status != "failed":
            raise DemoFailed("charge_payment is not recorded as failed")
        self.say(f"    verified: dead_letter after {charge.attempts} attempts of charge_payment;"
                 f" reserve_inventory compensated (release_inventory ran);"
                 f" compensation_ok = {str(detail.run.compensation_ok).lower()}")

    def psql_hint(self, run_ids: list[str]) -> str:
        s = quote_ident(self.schema)
        ids = ", ".join(quote_literal(r) for r in run_ids)
        return "\n".join([
            f"psql {quote_literal(redacted_dsn(self.dsn))}",
            "select id, status, attempt, error ->> 'message' as error, compensation_ok",
            f"  from {s}.runs where id in ({ids});",
            "select run_id, seq, name, status, attempts,",
            "       round(extract(epoch from finished_at - started_at) * 1000) as ms,",
            "       error ->> 'message' as error, compensation_status",
            f"  from {s}.steps where run_id in ({ids}) order by run_id, seq;",
            f"select * from {s}.timers where run_id in ({ids});",
            f"select run_id, failed_step, last_error, compensation_ok from {s}.dead_letters;",
        ])

    def close(self, failed: bool) -> None:
        for worker in self.workers:
            if worker.alive():
                worker.terminate()
        if failed:
            for worker in self.workers:
                tail = "\n".join(worker.log().splitlines()[-15:])
                self.say(f"--- last lines of worker {worker.label}'s log ---")
                self.say(tail)
        self.client.close()


def main(dsn: str, *, schema: str = DEFAULT_SCHEMA, out: TextIO | None = None) -> int:
    """Run the demo against ``dsn``; returns 0 when everything it showed checked out."""
    stream = out or sys.stdout
    with tempfile.TemporaryDirectory(prefix="flowly-demo-") as log_dir:
        demo = _Demo(dsn, schema, stream, Path(log_dir))
        failed = True
        try:
            demo.run()
            failed = False
        except DemoFailed as exc:
            demo.say(f"demo failed: {exc}")
        finally:
            demo.close(failed)
    return 1 if failed else 0
