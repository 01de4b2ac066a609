"""Latency on an idle worker: enqueue to first step, and how late Client.wait returns.

An idle flowly worker process (poll interval 5 s, so NOTIFY is what wakes it); this process
starts one run at a time with ``flowly.Client.start`` and waits for it with
``Client.wait``. The run's only step returns the wall-clock time it ran, so:

- enqueue -> first step: the step's time minus the time just before ``start`` was called;
- wait return delay: the time ``wait`` returned minus the run's ``finished_at``;
- how late a durable sleep of 0.1 s ends: from the step before it to the step after it,
  less the 0.1 s; and how late a run started with a delay of 0.1 s begins: from just before
  ``start`` to its step, less the 0.1 s.

Also the per-step cost of one workflow of many sequential no-op steps, and pgqueuer's
enqueue -> job start on the same server (bench/peer/pgqueuer_latency.py), when installed.

    python bench/latency.py --runs 200 --steps 1000
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flowly
from bench import workloads  # noqa: F401  (registers the workflows)
from bench.common import Child, dsn_to_url, fresh_database
from flowly.config import resolve_dsn


def quantiles(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(sorted(values), n=100, method="inclusive")
    return {"p50": cuts[49], "p95": cuts[94], "p99": cuts[98], "max": max(values)}


# the step function is async, as pgqueuer's job is; SYNC_STEP's is a plain function, which
# runs on a step thread
ASYNC_STEP, SYNC_STEP = "bench.first_async_step_time", "bench.first_step_time"


@contextmanager
def idle_worker(dsn: str, workflow: str) -> Iterator[flowly.Client]:
    """A client, once a worker process serving ``workflow`` is up, listening and idle (poll
    interval 5 s, so NOTIFY is what wakes it); the worker is told to finish afterwards."""
    child = Child(["-m", "bench.flowly_child", "--dsn", dsn, "--workflow",
                   workflow, "--concurrency", "8", "--poll-interval", "5"])
    try:
        child.wait_ready()
        child.send("go")
        with flowly.Client(dsn) as client:
            time.sleep(1.0)
            yield client
        child.finish()
    finally:
        child.kill()


def flowly_latency(dsn: str, runs: int, workflow: str = ASYNC_STEP
                   ) -> tuple[list[float], list[float], list[float]]:
    """(enqueue -> first step ms, wait return delay ms, the ``start`` call alone ms) of
    ``runs`` runs of ``workflow`` one at a time."""
    first, delay, enqueue = [], [], []
    with idle_worker(dsn, workflow) as client:
        for _ in range(runs):
            before = time.time()
            run_id = client.start(workflow)
            enqueue.append((time.time() - before) * 1000)
            run = client.wait(run_id, timeout=30)
            returned = time.time()
            assert run.status == "completed", run
            assert run.finished_at is not None
            first.append((float(run.output) - before) * 1000)
            delay.append((returned - run.finished_at.timestamp()) * 1000)
            time.sleep(0.01)
    return first, delay, enqueue


def sleep_overshoot(dsn: str, runs: int, seconds: float = 0.1) -> list[float]:
    """ms past a durable sleep of ``seconds`` until the step after it ran, for ``runs`` runs
    one at a time on an idle worker: the release, the worker's timer, the claim and the
    replay up to the sleep."""
    late = []
    with idle_worker(dsn, "bench.nap") as client:
        for _ in range(runs):
            run = client.wait(client.start("bench.nap", seconds), timeout=30)
            assert run.status == "completed", run
            late.append(float(run.output) * 1000)
    return late


def delayed_start_lateness(dsn: str, runs: int, seconds: float = 0.1) -> list[float]:
    """ms past ``seconds`` from just before ``start(..., delay=seconds)`` to the run's first
    step, for ``runs`` runs one at a time on an idle worker: the start's call, the worker's
    timer, the claim."""
    late = []
    with idle_worker(dsn, ASYNC_STEP) as client:
        for _ in range(runs):
            before = time.time()
            run = client.wait(client.start(ASYNC_STEP, delay=seconds), timeout=30)
            assert run.status == "completed", run
            late.append((float(run.output) - before - seconds) * 1000)
    return late


def step_cost(dsn: str, steps: int) -> float:
    """Per-step ms of one workflow of ``steps`` sequential no-op steps (its own run time
    from started_at to finished_at, divided by the steps)."""
    child = Child(["-m", "bench.flowly_child", "--dsn", dsn, "--workflow",
                   "bench.many_steps", "--concurrency", "1", "--poll-interval", "0.05"])
    try:
        child.wait_ready()
        child.send("go")
        time.sleep(1.0)  # the worker is up
        with flowly.Client(dsn) as client:
            run = client.wait(client.start("bench.many_steps", steps), timeout=600)
        child.finish()
    finally:
        child.kill()
    assert run.status == "completed" and run.started_at and run.finished_at, run
    return (run.finished_at - run.started_at).total_seconds() * 1000 / steps


def bare_checkpoint_ms(dsn: str, steps: int) -> float:
    """Median ms of one autocommitted ``flowly.checkpoint_steps`` call writing one step of a
    claimed run: the database's share of a sequential step, for step_cost to be read against."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("delete from flowly.runs where id = 'bench.bare'")
        conn.execute("select flowly.start('bench.bare', run_id => 'bench.bare')")
        row = conn.execute("select lease_epoch from flowly.claim('bench', array['bench.bare'],"
                           " array['default'], 1, '1 hour')").fetchone()
        assert row is not None
        millis = []
        for i in range(steps):
            started = time.perf_counter()
            conn.execute("select * from flowly.checkpoint_steps(array['bench.bare'],"
                         " array[%s::bigint], array[%s], array['1'::jsonb], array[now()],"
                         " array[false], array[%s])", (row[0], f"s{i}", i))
            millis.append((time.perf_counter() - started) * 1000)
        conn.execute("delete from flowly.runs where id = 'bench.bare'")
    return statistics.median(millis)


def pgqueuer_latency(server: str, runs: int) -> tuple[list[float], list[float]] | None:
    """(enqueue -> job start ms, the ``enqueue`` call alone ms), if pgqueuer is installed."""
    try:
        import pgqueuer  # noqa: F401
    except ImportError:
        return None
    dsn = fresh_database(server, "flowly_bench_pgqueuer")
    child = Child(["-m", "bench.peer.pgqueuer_latency", dsn_to_url(dsn), str(runs)])
    try:
        child.wait_ready()
        child.send("go")
        result = child.finish(timeout=runs * 30)
    finally:
        child.kill()
    return [float(v) for v in result["ms"]], [float(v) for v in result["enqueue_ms"]]


def side_by_side(dsn: str, server: str, runs: int, rounds: int
                 ) -> tuple[list[float], list[float], list[float],
                            tuple[list[float], list[float]] | None]:
    """flowly's latencies (as flowly_latency) and pgqueuer's (as pgqueuer_latency), ``runs``
    of each taken in ``rounds`` turns, so that a machine whose speed drifts during the
    sitting (it is shared) weighs on both alike."""
    first: list[float] = []
    delay: list[float] = []
    enqueue: list[float] = []
    theirs: tuple[list[float], list[float]] | None = ([], [])
    for turn in range(rounds):
        share = runs // rounds + (1 if turn < runs % rounds else 0)
        for samples, taken in zip((first, delay, enqueue), flowly_latency(dsn, share),
                                  strict=True):
            samples.extend(taken)
        if theirs is not None:
            round_theirs = pgqueuer_latency(server, share)
            if round_theirs is None:
                theirs = None
            else:
                theirs[0].extend(round_theirs[0])
                theirs[1].extend(round_theirs[1])
    return first, delay, enqueue, theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", default=os.environ.get("FLOWLY_DSN"))
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--steps", type=int, default=1000,
                        help="sequential no-op steps of the per-step cost's run (0: none)")
    parser.add_argument("--naps", type=int, default=50,
                        help="runs that sleep 0.1 s durably, and runs started 0.1 s"
                             " ahead, one at a time (50 each)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="turns flowly and pgqueuer take at the runs (4)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    server = resolve_dsn(args.dsn)
    dsn = fresh_database(server, "flowly_bench")
    flowly.install_dsn(dsn)
    first, delay, enqueue, theirs = side_by_side(dsn, server, args.runs, args.rounds)
    sync_first = flowly_latency(dsn, args.runs, SYNC_STEP)[0]
    rows = {"flowly enqueue -> first step": quantiles(first),
            "flowly the same, a sync step": quantiles(sync_first),
            "flowly start() call alone": quantiles(enqueue),
            "flowly Client.wait return delay": quantiles(delay),
            "flowly durable sleep 0.1 s, late by": quantiles(sleep_overshoot(dsn, args.naps)),
            "flowly start, delay 0.1 s, late by": quantiles(
                delayed_start_lateness(dsn, args.naps))}
    if theirs:
        rows["pgqueuer enqueue -> job start"] = quantiles(theirs[0])
        rows["pgqueuer enqueue() call alone"] = quantiles(theirs[1])
    print(f"{'ms':<34} {'p50':>7} {'p95':>7} {'p99':>7} {'max':>7}")
    for name, q in rows.items():
        print(f"{name:<34} {q['p50']:>7.2f} {q['p95']:>7.2f} {q['p99']:>7.2f} {q['max']:>7.2f}")
    if args.steps > 0:
        print(f"{args.steps} sequential no-op steps: {step_cost(dsn, args.steps):.3f} ms per"
              f" step; one checkpoint_steps call alone:"
              f" {bare_checkpoint_ms(dsn, args.steps):.3f} ms")


if __name__ == "__main__":
    main()
