"""What a step costs in the worker's Python alone: ``Context.step`` driven with a store that
answers every checkpoint at once, so no database, no group commit and no wait on the event
loop take part; beside it, a bare loop that awaits the same function and writes and reads its
output's JSON. The difference is the step path's own cost (checks, tracking, replay lookup,
serialisation, the write's handling), the part a profile of a whole drain spreads thin.

    python bench/step_python.py --runs 20000

Not a test: the store is a stand-in, and the figure is CPU time, for comparing the step path
with itself (run it on two checkouts in turns) or with the bare loop.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flowly import deep_json
from flowly.context import Context
from flowly.db import dumps
from flowly.replay import ReplayLog
from flowly.retry import Retry

STEPS = ("one", "two", "three")


async def _add(value: int) -> int:
    return value + 1


class _AnsweringStore:
    """Stores nothing: a checkpoint comes back at once with its output read back as the
    database would send it (UTF-8 JSON bytes)."""

    def check_lease(self) -> None:
        pass

    async def checkpoint(self, name: str, payload: str, started_at: datetime,
                         compensable: bool, position: int) -> tuple[Any, int]:
        return deep_json.loads(payload.encode()), position


async def _steps(runs: int) -> float:
    store, retry = _AnsweringStore(), Retry()
    began = time.process_time()
    for number in range(runs):
        ctx = Context(run_id=str(number), workflow="bench", attempt=1, generation=1,
                      store=store, history=ReplayLog(None),  # type: ignore[arg-type]
                      compensating=False, default_retry=retry, max_output_bytes=1 << 20)
        total = 0
        for name in STEPS:
            total = await ctx.step(name, _add, total)
    return time.process_time() - began


async def _bare(runs: int) -> float:
    began = time.process_time()
    for _ in range(runs):
        total = 0
        for _name in STEPS:
            total = deep_json.loads(dumps(await _add(total)).encode())
    return time.process_time() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20000, help="runs of three steps each")
    parser.add_argument("--repeat", type=int, default=3, help="best of this many")
    args = parser.parse_args()
    steps = args.runs * len(STEPS)
    for label, measure in (("ctx.step", _steps), ("bare await + JSON", _bare)):
        best = min(asyncio.run(measure(args.runs)) for _ in range(args.repeat))
        print(f"{label:20} {best / steps * 1e6:6.2f} µs of CPU a step")


if __name__ == "__main__":
    main()
