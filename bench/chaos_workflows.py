"""The workflows ``bench/chaos.py`` runs while it kills, freezes and disconnects their workers.

Workers import this module (``python -m flowly.worker --app bench.chaos_workflows``, with the
repository root on ``PYTHONPATH``). Every execution of a step or a compensation first records
itself in ``public.chaos_exec`` of the same database (``CHAOS_DSN``), over a short connection
of its own that rides out a server restart, so the driver can tell afterwards what ran, where,
when (the server's clock) and under which lease epoch, and compare that with the checkpoints
in ``flowly.steps``. A step's output names its execution (``{"exec": id}``), so the checkpoint
says which execution it stored.

Expected outcomes, by workflow (the driver records them in ``public.chaos_expected`` in the
transaction that starts the run):

- ``chaos.steps``, ``chaos.sleeper``, ``chaos.retry``, ``chaos.parent``: ``completed``
  (``chaos.retry``'s flaky step fails its first executions by design, within its retries);
- ``chaos.saga``: its last step always fails, so ``dead_letter`` with every compensation
  done (``compensation_ok``);
- ``chaos.timeout``: started with a short timeout, it sleeps far longer: ``dead_letter``
  with error type ``Timeout``;
- ``chaos.txn``: transactional steps (``ctx.transaction``), each inserting one row into
  ``public.chaos_txn`` in the transaction of its checkpoint: ``completed``, with exactly one
  row per transactional step;
- ``chaos.event``: waits for event ``go`` (``ctx.wait_for_event``), which the driver sends
  (maybe before the wait) or not (then the wait times out, which the body catches):
  ``completed``, with the payload sent, or ``timed_out``;
- ``chaos.waiter``: ``ctx.run`` of a child (``chaos.steps``, or a ``chaos.saga`` that fails,
  whose ``ChildFailed`` the body catches): ``completed``, with the child's output or failure.

The last three need an engine with ``ctx.transaction``, ``ctx.wait_for_event`` and
``ctx.run``; the driver starts them only when ``flowly.Context`` has those.
"""

from __future__ import annotations

import os
import time
import uuid
from functools import partial
from typing import Any

import psycopg

import flowly

EXEC_TABLE = """
create table if not exists public.chaos_exec (
    exec_id text primary key,
    run_id text not null,
    step text not null,
    kind text not null,               -- 'step' or 'compensate'
    pid integer not null,
    own_epoch bigint,                 -- the lease epoch of the execution that ran it, if known
    cur_epoch bigint,                 -- the run's epoch in the database when it started
    cur_holder text,                  -- the run's holder (worker id) then
    cur_status text,
    at timestamptz not null default clock_timestamp()
);
create index if not exists chaos_exec_run_step on public.chaos_exec (run_id, step);
create table if not exists public.chaos_txn (
    id bigserial primary key,
    run_id text not null,
    step text not null,
    pid integer not null,
    at timestamptz not null default clock_timestamp()
);
"""

# how long an execution keeps trying to record itself while the server is away
RECORD_PATIENCE = 60.0


class DesignedFailure(Exception):
    """A failure the workload means to happen (a flaky step's first tries, a saga's last step)."""


def lease_epoch(ctx: flowly.Context) -> int | None:
    """The fencing token of the claim executing ``ctx``, if this engine version exposes it.

    It is internal state (``ctx._store._held.epoch``); without it the driver falls back to
    what the database said when the execution started (``cur_epoch``/``cur_holder``).
    """
    held = getattr(getattr(ctx, "_store", None), "_held", None)
    epoch = getattr(held, "epoch", None)
    return epoch if isinstance(epoch, int) else None


def record(run_id: str, step: str, kind: str, epoch: int | None) -> tuple[str, int]:
    """Record one execution; returns its id and how many executions of the same step (and
    kind) of the run were recorded before it. Idempotent across reconnects (the id is fixed
    first), and patient with a server that is restarting."""
    exec_id = uuid.uuid4().hex
    deadline = time.monotonic() + RECORD_PATIENCE
    pause = 0.05
    while True:
        try:
            with psycopg.connect(os.environ["CHAOS_DSN"], autocommit=True,
                                 connect_timeout=5) as conn:
                conn.execute(
                    "insert into public.chaos_exec (exec_id, run_id, step, kind, pid, own_epoch,"
                    " cur_epoch, cur_holder, cur_status)"
                    " select %s, %s, %s, %s, %s, %s, r.lease_epoch, r.locked_by, r.status"
                    " from (select) one left join flowly.runs r on r.id = %s"
                    " on conflict (exec_id) do nothing",
                    (exec_id, run_id, step, kind, os.getpid(), epoch, run_id))
                row = conn.execute(
                    "select count(*) from public.chaos_exec e, public.chaos_exec me"
                    " where me.exec_id = %s and e.run_id = me.run_id and e.step = me.step"
                    " and e.kind = me.kind and e.at < me.at", (exec_id,)).fetchone()
                return exec_id, int(row[0]) if row else 0
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 1.0)


def execute(run_id: str, step: str, epoch: int | None, seconds: float = 0.0,
            fail_first: int = 0) -> dict[str, Any]:
    """A step: record the execution, work for ``seconds``, and fail if fewer than
    ``fail_first`` executions of this step came before."""
    exec_id, before = record(run_id, step, "step", epoch)
    if seconds:
        time.sleep(seconds)
    if before < fail_first:
        raise DesignedFailure(f"{step}: execution {before + 1} of {fail_first} that fail")
    return {"exec": exec_id, "step": step}


def undo(ctx: flowly.Context, output: dict[str, Any]) -> None:
    """A compensation: record its execution (under the epoch compensating the run)."""
    record(ctx.run_id, output["step"], "compensate", lease_epoch(ctx))


def _result(ctx: flowly.Context, outputs: list[Any], **extra: Any) -> dict[str, Any]:
    """A run's output: the step outputs its body saw and the epoch that completed it."""
    return {"execs": [o["exec"] for o in outputs], "epoch": lease_epoch(ctx), **extra}


async def _steps(ctx: flowly.Context, names: list[str], seconds: list[float]) -> list[Any]:
    return [await ctx.step(name, execute, ctx.run_id, name, lease_epoch(ctx), secs)
            for name, secs in zip(names, seconds, strict=True)]


@flowly.workflow("chaos.steps")
async def steps(ctx: flowly.Context, inp: dict[str, Any]) -> dict[str, Any]:
    """``len(seconds)`` steps in a row, step ``s<i>`` working ``seconds[i]``."""
    seconds = list(inp["seconds"])
    return _result(ctx, await _steps(ctx, [f"s{i}" for i in range(len(seconds))], seconds))


@flowly.workflow("chaos.sleeper")
async def sleeper(ctx: flowly.Context, inp: dict[str, Any]) -> dict[str, Any]:
    """Steps with durable sleeps between them (the run is released while it sleeps)."""
    outputs = []
    for i, nap in enumerate(inp["naps"]):
        outputs += await _steps(ctx, [f"s{i}"], [inp["work"]])
        await ctx.sleep(f"nap{i}", nap)
    outputs += await _steps(ctx, ["last"], [inp["work"]])
    return _result(ctx, outputs)


@flowly.workflow("chaos.retry")
async def retry(ctx: flowly.Context, inp: dict[str, Any]) -> dict[str, Any]:
    """A step, a flaky step that fails its first ``failures`` executions (retried with exactly
    enough attempts: chaos never fails a step, so it must still succeed), a step."""
    failures = int(inp["failures"])
    outputs = await _steps(ctx, ["before"], [inp["work"]])
    outputs.append(await ctx.step(
        "flaky", execute, ctx.run_id, "flaky", lease_epoch(ctx), inp["work"], failures,
        retry=flowly.Retry(max_attempts=failures + 1, backoff="fixed", initial_delay=0.1)))
    outputs += await _steps(ctx, ["after"], [inp["work"]])
    return _result(ctx, outputs)


@flowly.workflow("chaos.saga")
async def saga(ctx: flowly.Context, inp: dict[str, Any]) -> dict[str, Any]:
    """Compensable steps, then one that always fails: compensated in reverse, dead-lettered."""
    outputs = []
    for i in range(int(inp["compensable"])):
        name = f"c{i}"
        outputs.append(await ctx.step(name, execute, ctx.run_id, name, lease_epoch(ctx),
                                      inp["work"], compensate=partial(undo, ctx)))
    await ctx.step("boom", execute, ctx.run_id, "boom", lease_epoch(ctx), inp["work"], 10**9,
                   retry=flowly.Retry(max_attempts=2, backoff="fixed", initial_delay=0.1))
    return _result(ctx, outputs)  # never reached


@flowly.workflow("chaos.parent")
async def parent(ctx: flowly.Context, inp: dict[str, Any]) -> dict[str, Any]:
    """A step, children started with ``ctx.start`` (``chaos.steps`` runs), a step."""
    outputs = await _steps(ctx, ["before"], [inp["work"]])
    children = [await ctx.start("chaos.steps", {"seconds": inp["child_seconds"]})
                for _ in range(int(inp["children"]))]
    outputs += await _steps(ctx, ["after"], [inp["work"]])
    return _result(ctx, outputs, children=children)


@flowly.workflow("chaos.timeout")
async def timeout(ctx: flowly.Context, inp: dict[str, Any]) -> dict[str, Any]:
    """A step, then a sleep far past the run's timeout: it must end ``Timeout``."""
    outputs = await _steps(ctx, ["before"], [inp["work"]])
    await ctx.sleep("forever", inp["sleep"])
    outputs += await _steps(ctx, ["after"], [inp["work"]])
    return _result(ctx, outputs)


def txn_insert(conn: psycopg.Connection[Any], run_id: str, step: str, seconds: float
               ) -> dict[str, Any]:
    """A transactional step's SQL: one row, committed with the checkpoint or not at all."""
    row = conn.execute("insert into public.chaos_txn (run_id, step, pid) values (%s, %s, %s)"
                       " returning id", (run_id, step, os.getpid())).fetchone()
    if seconds:
        time.sleep(seconds)  # the transaction stays open meanwhile: a window for the chaos
    assert row is not None
    return {"txn": row[0]}


@flowly.workflow("chaos.txn")
async def txn(ctx: flowly.Context, inp: dict[str, Any]) -> dict[str, Any]:
    """A step, ``transactions`` transactional steps, a step."""
    outputs = await _steps(ctx, ["before"], [inp["work"]])
    ids = [(await ctx.transaction(f"t{i}", txn_insert, ctx.run_id, f"t{i}", inp["work"]))["txn"]
           for i in range(int(inp["transactions"]))]
    outputs += await _steps(ctx, ["after"], [inp["work"]])
    return _result(ctx, outputs, txns=ids)


@flowly.workflow("chaos.event")
async def event(ctx: flowly.Context, inp: dict[str, Any]) -> dict[str, Any]:
    """A step, a wait for event ``go`` (its timeout caught), a step."""
    outputs = await _steps(ctx, ["before"], [inp["work"]])
    try:
        payload, timed_out = await ctx.wait_for_event("go", timeout=inp["timeout"]), False
    except flowly.EventTimeout:
        payload, timed_out = None, True
    outputs += await _steps(ctx, ["after"], [inp["work"]])
    return _result(ctx, outputs, payload=payload, timed_out=timed_out)


@flowly.workflow("chaos.waiter")
async def waiter(ctx: flowly.Context, inp: dict[str, Any]) -> dict[str, Any]:
    """A step, ``ctx.run`` of a child (a failing saga's ChildFailed caught), a step."""
    outputs = await _steps(ctx, ["before"], [inp["work"]])
    child_workflow = "chaos.saga" if inp["child_fails"] else "chaos.steps"
    try:
        result = {"child": await ctx.run(child_workflow, inp["child"])}
    except flowly.ChildFailed as exc:
        error = exc.error if isinstance(exc.error, dict) else {}
        result = {"child_failed": exc.status, "child_error": error.get("type")}
    outputs += await _steps(ctx, ["after"], [inp["work"]])
    return _result(ctx, outputs, **result)
