"""The workflows the benchmarks run: no-op steps, so what is measured is the engine."""

from __future__ import annotations

import time
from typing import Any

import flowly


async def _add_async(value: int) -> int:
    return value + 1


def _add_sync(value: int) -> int:
    return value + 1


def _now() -> float:
    return time.time()


@flowly.workflow("bench.three_async")
async def three_async(ctx: flowly.Context, inp: Any) -> int:
    total = 0
    for name in ("one", "two", "three"):
        total = await ctx.step(name, _add_async, total)
    return int(total)


@flowly.workflow("bench.three_sync")
async def three_sync(ctx: flowly.Context, inp: Any) -> int:
    total = 0
    for name in ("one", "two", "three"):
        total = await ctx.step(name, _add_sync, total)
    return int(total)


@flowly.workflow("bench.one_async")
async def one_async(ctx: flowly.Context, inp: Any) -> int:
    return int(await ctx.step("one", _add_async, 0))


@flowly.workflow("bench.many_steps")
async def many_steps(ctx: flowly.Context, inp: Any) -> int:
    total = 0
    for i in range(int(inp)):
        total = await ctx.step(f"s{i}", _add_async, total)
    return total


@flowly.workflow("bench.first_step_time")
async def first_step_time(ctx: flowly.Context, inp: Any) -> float:
    """The first step's output is the wall-clock time it ran (latency.py reads it)."""
    return float(await ctx.step("t", _now))


async def _now_async() -> float:
    return time.time()


@flowly.workflow("bench.first_async_step_time")
async def first_async_step_time(ctx: flowly.Context, inp: Any) -> float:
    """The same with an async step function, as pgqueuer's job in latency.py is."""
    return float(await ctx.step("t", _now_async))


@flowly.workflow("bench.nap")
async def nap(ctx: flowly.Context, inp: Any) -> float:
    """A durable sleep of ``inp`` seconds between two steps; returns how many seconds more
    than that passed from the first step to the second (latency.py reads it). The first
    step's time is replayed, not taken again, when the run resumes."""
    before = float(await ctx.step("before", _now_async))
    await ctx.sleep("nap", float(inp))
    after = float(await ctx.step("after", _now_async))
    return after - before - float(inp)
