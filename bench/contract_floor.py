"""The floor under any engine that keeps flowly's contract, beside flowly and pgqueuer.

A run that checkpoints its steps writes, at the least: its claim (a new version of its row,
with the lease's epoch), one row per step (fenced by that epoch, its stored output read
back, so the body goes on with the value a replay will see), and its completion. This
drives exactly those statements and nothing else: plain SQL on two tables with a primary
key each and the one partial index a claim needs, no PL/pgSQL, no step bodies, no worker,
batches of ``--batch`` runs on ``--connections`` connections, each connection claiming,
checkpointing and completing its own batches in turn. Then, in the same sitting, each layer
of flowly above that floor: the same statements on flowly's own tables (its indexes,
constraints and triggers), flowly's functions called from the same bare driver, and
flowly's worker; beside them pgqueuer's one-step jobs and the 16-client commit ceiling. The
ratios say how far any engine with this contract could get on this machine, and the CPU a
run costs at each layer says where flowly spends what it spends beyond that:

    python bench/contract_floor.py --runs 20000 --repeat 3

Not a test and not part of ``make bench``: it prices a target, it does not track flowly.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import ceiling, peers, throughput
from bench.common import CpuMeter, Sample, fresh_database, ratio
from flowly.config import resolve_dsn

FLOOR_SCHEMA = """
drop table if exists floor_steps, floor_runs;
create table floor_runs (
    id bigint primary key,
    status text not null default 'pending',
    epoch integer not null default 0,
    locked_until timestamptz,
    input jsonb,
    output jsonb,
    finished_at timestamptz
);
create index floor_runs_pending on floor_runs (id) where status = 'pending';
create table floor_steps (
    run_id bigint not null,
    name text not null,
    output jsonb not null,
    primary key (run_id, name)
);
insert into floor_runs (id, input) select g, to_jsonb(g) from generate_series(1, %(runs)s) g;
vacuum analyze floor_runs;
"""


@dataclass
class Layout:
    """How a run is enqueued, claimed, checkpointed and completed, in SQL.

    Parameters by name: ``batch`` (claim), ``ids``, ``epochs`` and ``outputs`` (checkpoint
    and complete), the step's ``name`` and its arrays ``names``, ``started``,
    ``compensable`` and ``positions`` (checkpoint). ``checkpoint`` returns a row per step
    written, its output read back."""

    setup: str
    claim: str
    checkpoint: str
    complete: str


# the contract's bare statements on two tables of their own: the floor
FLOOR = Layout(
    FLOOR_SCHEMA,
    """
    with picked as (
        select id from floor_runs where status = 'pending' order by id limit %(batch)s
        for update skip locked
    )
    update floor_runs r set status = 'running', epoch = r.epoch + 1,
                            locked_until = now() + interval '1 minute'
    from picked where r.id = picked.id
    returning r.id, r.epoch, r.input
    """,
    # the fence: a step is written only while the run's epoch is the claimer's
    """
    insert into floor_steps (run_id, name, output)
    select i.id, %(name)s, i.output
    from unnest(%(ids)s::bigint[], %(epochs)s::integer[], %(outputs)s::jsonb[])
        as i (id, epoch, output)
    join floor_runs r on r.id = i.id and r.epoch = i.epoch and r.status = 'running'
    on conflict do nothing
    returning run_id, output
    """,
    """
    update floor_runs r set status = 'completed', output = i.output, finished_at = now(),
                            locked_until = null
    from unnest(%(ids)s::bigint[], %(epochs)s::integer[], %(outputs)s::jsonb[])
        as i (id, epoch, output)
    where r.id = i.id and r.epoch = i.epoch and r.status = 'running'
    """)

FLOWLY_ENQUEUE = """
truncate flowly.runs cascade;
select flowly.register_worker('floor', array['floor'], array['default'], '1 hour');
select count(flowly.start('floor', to_jsonb(g))) from generate_series(1, %(runs)s) g;
vacuum analyze flowly.runs;
"""

# the same statements on flowly's tables (their indexes, constraints and triggers)
FLOWLY_TABLES = Layout(
    FLOWLY_ENQUEUE,
    """
    with picked as (
        select id from flowly.runs
        where queue = 'default' and workflow = 'floor' and status = 'pending'
          and available_at <= now()
        order by priority desc, available_at limit %(batch)s
        for update skip locked
    )
    update flowly.runs r set status = 'running', lease_epoch = r.lease_epoch + 1,
                             locked_by = 'floor', locked_until = now() + interval '1 minute',
                             started_at = now()
    from picked where r.id = picked.id
    returning r.id, r.lease_epoch, r.input
    """,
    """
    insert into flowly.steps (run_id, name, seq, status, output, started_at)
    select i.id, %(name)s, nextval('flowly.step_seq'), 'completed', i.output, now()
    from unnest(%(ids)s::text[], %(epochs)s::bigint[], %(outputs)s::jsonb[])
        as i (id, epoch, output)
    join flowly.runs r on r.id = i.id and r.lease_epoch = i.epoch and r.status = 'running'
    on conflict do nothing
    returning run_id, output
    """,
    """
    update flowly.runs r set status = 'completed', output = i.output, finished_at = now(),
                             locked_by = null, locked_until = null
    from unnest(%(ids)s::text[], %(epochs)s::bigint[], %(outputs)s::jsonb[])
        as i (id, epoch, output)
    where r.id = i.id and r.lease_epoch = i.epoch and r.status = 'running'
    """)

# flowly's own functions, which the worker calls, from the same driver: no worker
FLOWLY_FUNCTIONS = Layout(
    FLOWLY_ENQUEUE,
    """
    select run_id, lease_epoch, input
    from flowly.claim('floor', array['floor'], array['default'], %(batch)s, '1 minute')
    """,
    """
    select c.run_id, c.output
    from flowly.checkpoint_steps(%(ids)s, %(epochs)s, %(names)s, %(outputs)s::jsonb[],
                                 %(started)s, %(compensable)s, %(positions)s) c
    """,
    "select * from flowly.complete_runs(%(ids)s, %(epochs)s, %(outputs)s::jsonb[])")


async def _drain_on(dsn: str, layout: Layout, steps: int, batch: int) -> int:
    """Claim, checkpoint and complete batches on one connection until none is left."""
    done = 0
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        while True:
            claimed = await (await conn.execute(layout.claim, {"batch": batch})).fetchall()
            if not claimed:
                return done
            n = len(claimed)
            batch_args: dict[str, Any] = {
                "ids": [row[0] for row in claimed], "epochs": [row[1] for row in claimed],
                "outputs": ["1"] * n, "compensable": [False] * n}
            for step in range(steps):
                batch_args.update(name=f"s{step}", names=[f"s{step}"] * n,
                                  started=[datetime.now(UTC)] * n, positions=[step + 1] * n)
                await (await conn.execute(layout.checkpoint, batch_args)).fetchall()
            await conn.execute(layout.complete, batch_args)
            done += n


def drain_layout(dsn: str, layout: Layout, runs: int, steps: int, batch: int,
                 connections: int) -> throughput.Drain:
    with psycopg.connect(dsn, autocommit=True) as conn:
        # one statement at a time: psycopg binds parameters into single statements only
        for statement in filter(str.strip, layout.setup.split(";")):
            conn.execute(statement, {"runs": runs})

    async def drain_all() -> int:
        counts = await asyncio.gather(*(_drain_on(dsn, layout, steps, batch)
                                        for _ in range(connections)))
        return sum(counts)

    cpu = CpuMeter([os.getpid()])
    started = time.perf_counter()
    finished = asyncio.run(drain_all())
    result = throughput.Drain(finished, time.perf_counter() - started, finished == runs)
    result.worker_cores, result.machine_busy = cpu.read(result.seconds)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default=os.environ.get("FLOWLY_DSN"))
    parser.add_argument("--runs", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=256,
                        help="flowly's concurrency in its drains")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    server = resolve_dsn(args.dsn)
    floor_dsn = fresh_database(server, "flowly_floor")
    flowly_dsn = fresh_database(server, "flowly_bench")
    throughput.prepare(flowly_dsn)
    ceiling_dsn = fresh_database(server, "flowly_bench_ceiling")
    layouts = {"floor": (floor_dsn, FLOOR), "flowly's tables": (flowly_dsn, FLOWLY_TABLES),
               "flowly's functions": (flowly_dsn, FLOWLY_FUNCTIONS)}
    rows = [f"{layout} {steps}-step" for steps in (1, 3) for layout in
            [*layouts, "flowly's worker"]] + ["pgqueuer 1-step"]
    samples = {name: Sample() for name in ["ceiling", *rows]}
    # CPU per run: the engine's own process (flowly's worker, pgqueuer's, this driver), and
    # the whole machine (the server's backends too)
    engine_cpu = {name: Sample() for name in rows}
    machine_cpu = {name: Sample() for name in rows}

    def record(name: str, drain: throughput.Drain) -> None:
        samples[name].add(drain.rate)
        engine_cpu[name].add(drain.worker_us_per_run)
        machine_cpu[name].add(drain.machine_us_per_run)

    for _ in range(args.repeat):
        samples["ceiling"].add(ceiling.measure(ceiling_dsn, 16, 10)[0])
        for steps, workflow in ((1, "bench.one_async"), (3, "bench.three_async")):
            for name, (dsn, layout) in layouts.items():
                record(f"{name} {steps}-step", drain_layout(dsn, layout, args.runs, steps,
                                                            args.batch, args.connections))
            record(f"flowly's worker {steps}-step", throughput.drain(
                flowly_dsn, workflow, args.runs, args.concurrency))
            if steps == 1 and peers.available("pgqueuer") is None:
                record("pgqueuer 1-step", peers.drain_peer(server, "pgqueuer", args.runs, 0,
                                                           120))
    print(f"{'':>24} {'runs/s':>24} {'CPU µs/run: engine':>20} {'machine':>18}")
    for name, sample in samples.items():
        engine = engine_cpu[name].fmt() if name in engine_cpu else ""
        machine = machine_cpu[name].fmt() if name in machine_cpu else ""
        print(f"{name:>24} {sample.fmt():>24} {engine:>20} {machine:>18}")
    for name in rows[:4]:
        print(f"{name} / pgqueuer 1-step: {ratio(samples[name], samples[rows[-1]]):.2f}"
              " (flowly's target 1.5)")
    for name in rows[4:8]:
        print(f"{name} / 16-client ceiling: {ratio(samples[name], samples['ceiling']):.2f}"
              " (flowly's target 0.4)")

if __name__ == "__main__":
    main()
