"""Replay is exact: a body observes the same values when a run first executes and when it is
replayed from its checkpoints, whatever jsonb normalises."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import psycopg

import flowly
from tests.support import running_worker, scalar

LOG: dict[str, list[str]] = defaultdict(list)


TRICKY = {"b": 1, "a": [2, 1], "": None, "long key first": True, "é": "\u2028\ud7ff\U0001f600",
          "neg_zero": -0.0, "big": 2 ** 70, "float_big": 1e16, "sum": 0.1 + 0.2,
          "tiny": 5e-324, "max": 1.7976931348623157e308, "nested": {"z": {"y": [{}, []]}}}


@flowly.workflow("rv_replay_exact")
async def rv_replay_exact(ctx: flowly.Context, inp: Any) -> Any:
    seen = []
    for i in range(3):
        seen.append(await ctx.step(f"s{i}", lambda: TRICKY))
        seen.append(await ctx.transaction(f"t{i}", lambda conn: TRICKY))
    await ctx.sleep("zero", 0)
    await ctx.sleep("negative", -5)
    LOG[ctx.run_id].append(repr(seen))
    if ctx.attempt == 1:
        raise RuntimeError("replay me")  # the whole body is retried, replaying every step
    return len(seen)


def test_the_body_observes_identical_values_on_first_run_and_on_replay(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """Design: 'whatever a workflow body observes ... is recorded once and replayed from the
    record, never recomputed', including what jsonb normalises (key order, -0.0, 1e16 as an
    integer); zero and negative sleeps do not release the run."""
    run_id = client.start("rv_replay_exact", None)
    with running_worker(dsn):
        run = client.wait(run_id, timeout=20)
    assert run.status == "completed" and run.attempt == 2
    first, replayed = LOG[run_id]
    assert first == replayed
    assert scalar(db, "select count(*) from flowly.timers where run_id = %s"
                      " and fired_at is not null", run_id) == 2
