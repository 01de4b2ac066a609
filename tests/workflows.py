"""Workflows the tests run, in-process or in worker subprocesses (``--app tests.workflows``).

Side effects that must be counted across processes go to the ``test_effects`` table of the
test database (FLOWLY_DSN); in-process tests also use the module-level ``CALLS`` log.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
from collections import defaultdict
from datetime import UTC
from typing import Any

import psycopg

import flowly

CALLS: dict[str, list[str]] = defaultdict(list)
CANCELLED: set[str] = set()
SAGA_FAILS: set[str] = set()
# per-run gates an in-process test opens when it is ready for the gated step to finish
GATES: dict[str, threading.Event] = defaultdict(threading.Event)

EFFECTS_TABLE = """
create table if not exists public.test_effects (
    run_id text not null, step text not null, pid integer not null,
    at timestamptz not null default clock_timestamp()
)
"""


def record_effect(run_id: str, step: str) -> int:
    """Insert a row into test_effects (visible to the test whatever process ran the step)."""
    with psycopg.connect(os.environ["FLOWLY_DSN"], autocommit=True) as conn:
        conn.execute("insert into public.test_effects (run_id, step, pid) values (%s, %s, %s)",
                     (run_id, step, os.getpid()))
    return os.getpid()


def slow_effect(run_id: str, step: str, seconds: float) -> dict[str, Any]:
    pid = record_effect(run_id, step)
    time.sleep(seconds)
    return {"step": step, "pid": pid}


@flowly.workflow("three_steps")
async def three_steps(ctx: flowly.Context, inp: dict[str, Any]) -> dict[str, Any]:
    """Three recorded steps, each taking ``step_seconds``."""
    outputs = {}
    for name in ("a", "b", "c"):
        outputs[name] = await ctx.step(name, slow_effect, ctx.run_id, name,
                                       inp.get("step_seconds", 0))
    return outputs


@flowly.workflow("gated")
async def gated(ctx: flowly.Context, inp: Any) -> list[str]:
    """Steps a, b, c; b is recorded as started, then waits until the test opens its gate."""
    def wait_for_gate() -> None:
        record_effect(ctx.run_id, "b")
        if not GATES[ctx.run_id].wait(timeout=60):
            raise TimeoutError("the test never opened the gate")

    await ctx.step("a", record_effect, ctx.run_id, "a")
    await ctx.step("b", wait_for_gate)
    await ctx.step("c", record_effect, ctx.run_id, "c")
    return ["a", "b", "c"]


@flowly.workflow("work_nap_work")
async def work_nap_work(ctx: flowly.Context, inp: dict[str, Any]) -> None:
    """A step, a short durable sleep (the run is released and claimed again), a step."""
    await ctx.step("first", time.sleep, inp["first"])
    await ctx.sleep("nap", 0.2)
    await ctx.step("second", time.sleep, inp["second"])


@flowly.workflow("quick")
async def quick(ctx: flowly.Context, inp: Any) -> Any:
    """Three async steps that only yield to the loop; for throughput and many-run tests."""
    total = 0
    for name in ("one", "two", "three"):
        total += await ctx.step(name, _add_one, total)
    return {"input": inp, "total": total}


async def _add_one(value: int) -> int:
    await asyncio.sleep(0)
    return 1


@flowly.workflow("io_bound")
async def io_bound(ctx: flowly.Context, inp: dict[str, Any]) -> int:
    """One step that waits ``seconds`` on the loop, like a network call."""
    async def wait() -> int:
        await asyncio.sleep(inp.get("seconds", 0.05))
        return 1

    return int(await ctx.step("wait", wait))


@flowly.workflow("sleepy")
async def sleepy(ctx: flowly.Context, inp: dict[str, Any]) -> dict[str, Any]:
    """A step, a durable sleep, a step that reports when it ran."""
    await ctx.step("before", record_effect, ctx.run_id, "before")
    await ctx.sleep("nap", inp["seconds"])
    woke = await ctx.step("after", lambda: time.time())
    return {"woke": woke}


@flowly.workflow("flaky")
async def flaky(ctx: flowly.Context, inp: dict[str, Any]) -> int:
    """A step that fails ``failures`` times, then succeeds, under the given backoff."""
    def attempt() -> int:
        CALLS[ctx.run_id].append("attempt")
        if len(CALLS[ctx.run_id]) <= inp["failures"]:
            raise ConnectionError(f"transient failure {len(CALLS[ctx.run_id])}")
        return len(CALLS[ctx.run_id])

    retry = flowly.Retry(max_attempts=inp.get("max_attempts", 5), backoff=inp["backoff"],
                         initial_delay=inp["initial_delay"], max_delay=inp.get("max_delay", 60))
    return int(await ctx.step("call", attempt, retry=retry))


@flowly.workflow("saga")
async def saga(ctx: flowly.Context, inp: Any) -> str:
    """Three compensable steps (the second's compensation fails), then one that fails while
    the run id is in SAGA_FAILS."""
    log = CALLS[ctx.run_id]

    def do(name: str) -> str:
        log.append(f"do:{name}")
        return name

    def undo(output: str) -> None:
        log.append(f"undo:{output}")
        if output == "s2":
            raise RuntimeError("compensation of s2 failed")

    for name in ("s1", "s2", "s3"):
        await ctx.step(name, do, name, compensate=undo)

    def final() -> str:
        log.append("do:s4")
        if ctx.run_id in SAGA_FAILS:
            raise ValueError("s4 always fails")
        return "ok"

    return str(await ctx.step("s4", final, retry=flowly.Retry(max_attempts=2, initial_delay=0.05)))


@flowly.workflow("replay")
async def replay(ctx: flowly.Context, inp: Any) -> dict[str, Any]:
    """A counted step and a child run, then a body failure on the first attempt only."""
    def counted() -> dict[str, Any]:
        CALLS[ctx.run_id].append("counted")
        return {"at": time.time()}

    first = await ctx.step("counted", counted)
    child = await ctx.start("quick", {"parent": ctx.run_id})
    if ctx.attempt == 1:
        raise RuntimeError("the body fails once, outside any step")
    return {"first": first, "child": child, "attempt": ctx.attempt}


@flowly.workflow("slow")
async def slow(ctx: flowly.Context, inp: dict[str, Any]) -> str:
    """One async step that waits ``seconds`` and notes if it was cancelled."""
    async def wait() -> str:
        try:
            await asyncio.sleep(inp.get("seconds", 30))
        except asyncio.CancelledError:
            CANCELLED.add(ctx.run_id)
            raise
        return "waited"

    return str(await ctx.step("wait", wait))


@flowly.workflow("stuck")
async def stuck(ctx: flowly.Context, inp: Any) -> None:
    """A sync step that never returns, like a network call without a timeout."""
    await ctx.step("hang", threading.Event().wait)


@flowly.workflow("stubborn")
async def stubborn(ctx: flowly.Context, inp: Any) -> None:
    """An async step that ignores its first cancellation and carries on for a while."""
    async def hold_on() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(30)

    await ctx.step("hold_on", hold_on)


@flowly.workflow("deaf")
async def deaf(ctx: flowly.Context, inp: Any) -> None:
    """An async step that ignores every cancellation, for ever."""
    async def never_ends() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue

    await ctx.step("never_ends", never_ends)


@flowly.workflow("bad_output")
async def bad_output(ctx: flowly.Context, inp: Any) -> Any:
    """A step whose output is not JSON."""
    return await ctx.step("make_object", lambda: object())


@flowly.workflow("nul_output")
async def nul_output(ctx: flowly.Context, inp: Any) -> Any:
    """A step whose output is JSON but not jsonb: the NUL character."""
    return await ctx.step("make_nul", lambda: "bad\x00")


@flowly.workflow("nul_error")
async def nul_error(ctx: flowly.Context, inp: Any) -> Any:
    """A step that fails with a NUL in its message, on its only attempt."""
    def fail() -> None:
        raise ValueError("bad\x00message")

    return await ctx.step("fail", fail, retry=flowly.Retry(max_attempts=1))


@flowly.workflow("long_error")
async def long_error(ctx: flowly.Context, inp: Any) -> Any:
    """Fails with a message of ``inp["length"]`` characters: in a step (two attempts) when
    ``inp["where"]`` is "step", else in the body."""
    def fail() -> None:
        raise ValueError("step " + "x" * inp["length"])

    if inp["where"] == "step":
        return await ctx.step("fail", fail, retry=flowly.Retry(max_attempts=2, initial_delay=0.1))
    raise ValueError("body " + "y" * inp["length"])


@flowly.workflow("stop_iteration")
async def stop_iteration(ctx: flowly.Context, inp: Any) -> Any:
    """A sync step that raises StopIteration (next() on an empty iterator), on its only attempt."""
    return await ctx.step("next", next, iter([]), retry=flowly.Retry(max_attempts=1))


@flowly.workflow("cancelled_inside")
async def cancelled_inside(ctx: flowly.Context, inp: Any) -> Any:
    """An async step awaiting a future that something else cancelled, on its only attempt."""
    async def await_cancelled_future() -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.cancel()
        await future

    return await ctx.step("await_it", await_cancelled_future, retry=flowly.Retry(max_attempts=1))


@flowly.workflow("nul_name")
async def nul_name(ctx: flowly.Context, inp: Any) -> Any:
    """A step named with a NUL character (say, from data the name was built from)."""
    return await ctx.step("charge-\x00", lambda: 1)


@flowly.workflow("emailer", queue="emails", max_attempts=7)
async def emailer(ctx: flowly.Context, inp: Any) -> Any:
    """A workflow with its own queue and attempts, started as a child by ``mailing``."""
    return inp


@flowly.workflow("mailing")
async def mailing(ctx: flowly.Context, inp: Any) -> str:
    """Starts an ``emailer`` child, given by its function."""
    return await ctx.start(emailer, {"to": "someone"})


@flowly.workflow("bad_sleep")
async def bad_sleep(ctx: flowly.Context, inp: Any) -> None:
    """A sleep the database cannot represent: the run fails, it is not abandoned."""
    await ctx.sleep("forever", 1e300)


@flowly.workflow("poison")
async def poison(ctx: flowly.Context, inp: Any) -> Any:
    """A step that raises SystemExit, which must fail the run and not the worker."""
    def die() -> None:
        raise SystemExit("poison step")

    return await ctx.step("die", die, retry=flowly.Retry(max_attempts=1))


@flowly.workflow("catches_everything")
async def catches_everything(ctx: flowly.Context, inp: dict[str, Any]) -> str:
    """A body that swallows Exception around a durable sleep: the sleep must still work."""
    try:
        await ctx.sleep("nap", inp["seconds"])
    except Exception:
        return "swallowed"
    return "slept"


@flowly.workflow("alarm")
async def alarm(ctx: flowly.Context, inp: dict[str, Any]) -> float:
    """Sleeps until an absolute time given as a POSIX timestamp, then reports the time."""
    from datetime import datetime

    await ctx.sleep_until("alarm", datetime.fromtimestamp(inp["at"], UTC))
    return float(await ctx.step("rang", lambda: time.time()))


@flowly.workflow("kills_its_worker")
async def kills_its_worker(ctx: flowly.Context, inp: Any) -> None:
    """A step that ends the worker process itself, as a segfault or the OOM killer would."""
    await ctx.step("die", lambda: os._exit(3))


@flowly.workflow("stops_its_loop")
async def stops_its_loop(ctx: flowly.Context, inp: Any) -> Any:
    """An async step that stops the event loop it runs on (``loop.stop()``, as a library
    written for a loop of its own might), then a step after it."""
    async def stop_the_loop() -> str:
        asyncio.get_running_loop().stop()
        await asyncio.sleep(0.05)  # the loop stops at the end of this iteration
        return "stopped"

    stopped = await ctx.step("stop", stop_the_loop)
    return [stopped, await ctx.step("after", lambda: "went on")]


@flowly.workflow("echo")
async def echo(ctx: flowly.Context, inp: dict[str, Any]) -> Any:
    """One async step that waits ``wait`` seconds and returns ``value``."""
    async def give() -> Any:
        await asyncio.sleep(inp.get("wait", 0))
        return inp["value"]

    return await ctx.step("echo", give)


@flowly.workflow("keyed_parent")
async def keyed_parent(ctx: flowly.Context, inp: dict[str, Any]) -> str:
    """Starts a child under a concurrency key another run holds (so start returns that run);
    on its first attempt it then frees the key (cancels the holder) and fails, so the retry
    replays the start with the key free."""
    child = await ctx.start("quick", None, concurrency_key=inp["key"])
    if ctx.attempt == 1:
        def free_the_key() -> None:
            with psycopg.connect(os.environ["FLOWLY_DSN"], autocommit=True) as conn:
                conn.execute("select flowly.cancel(%s)", (inp["holder"],))

        await ctx.step("free_the_key", free_the_key)
        raise RuntimeError("fail once, after the key was freed")
    return child


@flowly.workflow("parallel_saga")
async def parallel_saga(ctx: flowly.Context, inp: Any) -> Any:
    """A compensable step, then two in parallel: one fails for good once its compensable
    sibling has started, and the sibling finishes later. Both completed steps must be
    compensated."""
    log = CALLS[ctx.run_id]

    def undo(output: str) -> None:
        log.append(f"undo:{output}")

    async def fail_now() -> None:
        await asyncio.sleep(0.05)  # the sibling is running by then
        raise ValueError("fails at once")

    async def finish_later() -> str:
        await asyncio.sleep(0.5)
        log.append("do:late")
        return "late"

    await ctx.step("first", lambda: "first", compensate=undo)
    return await asyncio.gather(
        ctx.step("fails", fail_now, retry=flowly.Retry(max_attempts=1)),
        ctx.step("late", finish_later, compensate=undo),
    )


@flowly.workflow("cooling_saga")
async def cooling_saga(ctx: flowly.Context, inp: dict[str, Any]) -> str:
    """reserve (compensable), a durable cooling sleep, charge (fails while the run id is in
    SAGA_FAILS); every execution logs its time and its idempotency key."""
    log = CALLS[ctx.run_id]

    def reserve() -> str:
        log.append(f"reserve {time.time()} {ctx.idempotency_key('reserve')}")
        return "reserved"

    def charge() -> str:
        log.append(f"charge {time.time()} {ctx.idempotency_key('charge')}")
        if ctx.run_id in SAGA_FAILS:
            raise ValueError("card declined")
        return "charged"

    await ctx.step("reserve", reserve, compensate=lambda out: log.append(f"release {out}"))
    await ctx.sleep("cooling", inp["cooling"])
    return str(await ctx.step("charge", charge, retry=flowly.Retry(max_attempts=1)))


@flowly.workflow("many_steps")
async def many_steps(ctx: flowly.Context, inp: dict[str, Any]) -> int:
    """``n`` numbered steps, then a final one; executions are logged in CALLS."""
    log = CALLS[ctx.run_id]

    async def numbered(i: int) -> int:
        log.append(f"s{i}")
        return i

    total = 0
    for i in range(inp["n"]):
        total += await ctx.step(f"s{i}", numbered, i)
    return total + int(await ctx.step("final", numbered, -1))


@flowly.workflow("forgets_await")
async def forgets_await(ctx: flowly.Context, inp: Any) -> Any:
    """Calls a step without awaiting it (a common slip)."""
    ctx.step("never", record_effect, ctx.run_id, "never")
    return "done"


@flowly.workflow("name_twice")
async def name_twice(ctx: flowly.Context, inp: Any) -> Any:
    await ctx.step("same", lambda: 1)
    return await ctx.step("same", lambda: 2)


@flowly.workflow("object_output")
async def object_output(ctx: flowly.Context, inp: Any) -> Any:
    return object()


@flowly.workflow("bad_start_option")
async def bad_start_option(ctx: flowly.Context, inp: Any) -> Any:
    return await ctx.start("quick", None, priorty=5)


@flowly.workflow("no_input")
async def no_input(ctx: flowly.Context) -> Any:  # type: ignore[misc]
    return "never"


@flowly.workflow("blocks_loop")
async def blocks_loop(ctx: flowly.Context, inp: dict[str, Any]) -> str:
    """An async step that blocks the event loop (time.sleep in async code, a common slip)."""
    async def block() -> str:
        time.sleep(inp["seconds"])
        return "unblocked"

    return str(await ctx.step("block", block))


@flowly.workflow("generator_exit")
async def generator_exit(ctx: flowly.Context, inp: Any) -> Any:
    """A sync step that raises GeneratorExit, on its only attempt."""
    def leak() -> None:
        raise GeneratorExit("from a closed generator")

    return await ctx.step("leak", leak, retry=flowly.Retry(max_attempts=1))


ACCOUNTS_TABLE = """
create table if not exists public.accounts (name text primary key, balance bigint not null)
"""


def _move(conn: psycopg.Connection[Any], account: str, amount: int) -> int:
    row = conn.execute("update accounts set balance = balance + %s where name = %s"
                       " returning balance", (amount, account)).fetchone()
    assert row is not None, f"no account {account}"
    return int(row[0])


async def _move_async(conn: psycopg.AsyncConnection[Any], account: str, amount: int) -> int:
    cursor = await conn.execute("update accounts set balance = balance + %s where name = %s"
                                " returning balance", (amount, account))
    row = await cursor.fetchone()
    assert row is not None, f"no account {account}"
    return int(row[0])


@flowly.workflow("transfer")
async def transfer(ctx: flowly.Context, inp: dict[str, Any]) -> list[int]:
    """Debit and credit as transactional steps (sync or async functions)."""
    move = _move_async if inp.get("async") else _move
    debit = await ctx.transaction("debit", move, inp["from"], -inp["amount"])
    await ctx.step("pause", time.sleep, inp.get("pause", 0))
    credit = await ctx.transaction("credit", move, inp["to"], inp["amount"])
    return [debit, credit]


@flowly.workflow("transfer_untransacted")
async def transfer_untransacted(ctx: flowly.Context, inp: dict[str, Any]) -> None:
    """The same transfer with ordinary steps: each commits its update on its own connection,
    then (slowly) returns, so a crash in between applies it twice."""
    def move(account: str, amount: int) -> None:
        with psycopg.connect(os.environ["FLOWLY_DSN"], autocommit=True) as conn:
            _move(conn, account, amount)
        time.sleep(inp.get("pause", 0))

    await ctx.step("debit", move, inp["from"], -inp["amount"])
    await ctx.step("credit", move, inp["to"], inp["amount"])


@flowly.workflow("transaction_cases")
async def transaction_cases(ctx: flowly.Context, inp: dict[str, Any]) -> Any:
    """One transactional step per case: 'conflicts' (the SQL loses a serialization race
    ``conflicts`` times), 'fails' (updates, then raises), 'saga' (a compensable transactional
    step, then a failing step), 'slow' (updates, records that it started, then sleeps)."""
    case = inp["case"]
    tries = CALLS[ctx.run_id]

    def conflicting(conn: psycopg.Connection[Any]) -> int:
        tries.append("try")
        _move(conn, "a", 1)
        if len(tries) <= inp.get("conflicts", 0):
            conn.execute("do $$ begin raise exception 'lost a race' using errcode = '40001';"
                         " end $$")
        return len(tries)

    def failing(conn: psycopg.Connection[Any]) -> None:
        _move(conn, "a", 1)
        raise ValueError("changed my mind")

    def slow(conn: psycopg.Connection[Any]) -> int:
        record_effect(ctx.run_id, "slow")
        balance = _move(conn, "a", 1)
        time.sleep(inp["seconds"])
        return balance

    retry = flowly.Retry(max_attempts=1)
    if case == "conflicts":
        return await ctx.transaction("move", conflicting, isolation="serializable", retry=retry)
    if case == "fails":
        return await ctx.transaction("move", failing, retry=retry)
    if case == "slow":
        return await ctx.transaction("move", slow)
    assert case == "saga"
    await ctx.transaction("move", _move, "a", 5,
                          compensate=lambda conn, out: _move(conn, "a", -5))
    def fail() -> None:
        raise ValueError("the next step fails")

    return await ctx.step("fails", fail, retry=retry)


@flowly.workflow("awaits_events")
async def awaits_events(ctx: flowly.Context, inp: Any) -> list[Any]:
    """Two waits for the same event name: each consumes one event, in the order sent."""
    first = await ctx.wait_for_event("go")
    second = await ctx.wait_for_event("go")
    return [first, second]


@flowly.workflow("event_or_timeout")
async def event_or_timeout(ctx: flowly.Context, inp: dict[str, Any]) -> str:
    """Waits for an event with a timeout; either way a slow recorded step follows."""
    try:
        await ctx.wait_for_event("approval", timeout=inp["timeout"])
        branch = "approved"
    except flowly.EventTimeout:
        branch = "timed out"
    await ctx.step("after", slow_effect, ctx.run_id, branch, inp.get("after_seconds", 0))
    return branch


@flowly.workflow("child_work")
async def child_work(ctx: flowly.Context, inp: dict[str, Any]) -> int:
    def work() -> int:
        if inp.get("gate"):  # a file the test creates when the children may go on
            deadline = time.monotonic() + 60
            while not os.path.exists(inp["gate"]):
                if time.monotonic() > deadline:
                    raise TimeoutError("the test never created the gate file")
                time.sleep(0.02)
        if inp.get("fail"):
            raise ValueError(f"child {inp['i']} fails")
        time.sleep(inp.get("seconds", 0))
        return int(inp["i"]) ** 2

    return int(await ctx.step("work", work, retry=flowly.Retry(max_attempts=1)))


@flowly.workflow("fan_out")
async def fan_out(ctx: flowly.Context, inp: dict[str, Any]) -> list[Any]:
    """Starts ``n`` children (child ``fail`` fails) and gathers their outcomes."""
    children = [await ctx.start("child_work", {"i": i, "fail": i == inp.get("fail"),
                                               "seconds": inp.get("seconds", 0),
                                               "gate": inp.get("gate")})
                for i in range(inp["n"])]

    async def outcome(child: str) -> Any:
        try:
            return await ctx.wait_for_run(child)
        except flowly.ChildFailed as exc:
            return {"failed": exc.status}

    return list(await asyncio.gather(*(outcome(c) for c in children)))


@flowly.workflow("runs_a_child")
async def runs_a_child(ctx: flowly.Context, inp: dict[str, Any]) -> Any:
    return await ctx.run("slow", {"seconds": inp["seconds"]})


def _collector_settings() -> list[Any]:
    return [gc.isenabled(), *gc.get_threshold()]


@flowly.workflow("collector_settings")
async def collector_settings(ctx: flowly.Context, inp: Any) -> Any:
    """The garbage collector's settings as a step running in the worker sees them."""
    return await ctx.step("settings", _collector_settings)
