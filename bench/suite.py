"""`make bench`: every figure of issue 11 in one sitting, printed as one table of ratios.

Each repetition measures, back to back on the same server: the commit ceiling (pgbench, 1 and
16 clients), flowly's throughput (three-step workflows with async and with sync steps at
several concurrencies, two worker processes, one-step workflows), and each peer next to
flowly on the same workload (DBOS Transact, Absurd, pgqueuer). Medians over the repetitions,
ranges in brackets. Then, once: idle latency against pgqueuer's (the two taking turns), the
per-step cost of a 1,000-step workflow, claim cost with a large history against empty
tables, and a worker's memory over many runs.

    python bench/suite.py                 # the full size (8 to 25 minutes on 2 cores)
    python bench/suite.py --size ci       # a small size for CI (CI=true picks it too)
    python bench/suite.py --runs 5000 --repeat 2 --skip peers claim

Every engine gets a database of its own on the server of --dsn (FLOWLY_DSN, else the
embedded PostgreSQL).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import ceiling, claim_cost, latency, peers, throughput
from bench.common import Sample, fresh_database, ratio, server_version
from flowly.config import resolve_dsn

SIZES = {
    "full": dict(runs=10_000, repeat=3, concurrency=[16, 64, 256], peer_runs=3_000,
                 peer_timeout=40.0, latency_runs=400, latency_rounds=4, naps=100, steps=1000,
                 finished=1_000_000, sleeping=300_000, foreign=300_000, claim_rounds=200,
                 memory_runs=100_000, ceiling_seconds=10.0),
    "ci": dict(runs=600, repeat=1, concurrency=[16, 256], peer_runs=300, peer_timeout=20.0,
               latency_runs=30, latency_rounds=1, naps=10, steps=200, finished=20_000,
               sleeping=5_000, foreign=5_000, claim_rounds=30, memory_runs=3_000,
               ceiling_seconds=2.0),
}
SECTIONS = ("ceiling", "throughput", "peers", "latency", "steps", "claim", "memory")


@dataclass
class Row:
    what: str
    value: str
    vs: str = ""
    ratio: float | None = None
    target: str = ""
    met: bool | None = None


def fmt_ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def print_table(rows: list[Row]) -> None:
    headers = ("measure", "flowly", "against", "ratio", "target", "")
    cells = [(r.what, r.value, r.vs, fmt_ratio(r.ratio), r.target,
              "" if r.met is None else ("met" if r.met else "MISSED")) for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    print(line)
    print("-" * len(line))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip())


def machine(dsn: str) -> str:
    load = os.getloadavg()
    return (f"{os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB,"
            f" PostgreSQL {server_version(dsn)}, Python {platform.python_version()},"
            f" load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default=os.environ.get("FLOWLY_DSN"))
    parser.add_argument("--size", choices=list(SIZES),
                        default=os.environ.get("FLOWLY_BENCH_SIZE")
                        or ("ci" if os.environ.get("CI") else "full"))
    parser.add_argument("--skip", nargs="*", choices=SECTIONS, default=[])
    for key, value in SIZES["full"].items():
        kind = type(value[0]) if isinstance(value, list) else type(value)
        parser.add_argument(f"--{key.replace('_', '-')}", type=kind,
                            nargs="+" if isinstance(value, list) else None, default=None)
    args = parser.parse_args()
    size = {k: (getattr(args, k) if getattr(args, k) is not None else v)
            for k, v in SIZES[args.size].items()}
    skip = set(args.skip)
    logging.basicConfig(level=logging.WARNING)
    started = time.monotonic()
    server = resolve_dsn(args.dsn)
    dsn = fresh_database(server, "flowly_bench")
    throughput.prepare(dsn)
    print(f"flowly bench, size {args.size} ({size['runs']:,} runs, {size['repeat']} repetitions)"
          f" on {machine(server)}", flush=True)

    def note(text: str) -> None:
        print(f"  [{time.monotonic() - started:6.0f}s] {text}", file=sys.stderr, flush=True)

    commits = {1: Sample(), 16: Sample()}
    rates: dict[tuple[str, int, int], Sample] = {}
    max_conns: dict[int, int] = {}
    busy: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    peer_rates: dict[str, tuple[Sample, Sample]] = {}
    # CPU per run, in µs: (flowly's worker, the machine), the same for the peer
    peer_cpu: dict[str, tuple[list[tuple[float, float]], list[tuple[float, float]]]] = {}
    peer_skipped: dict[str, str] = {}
    pairs = {"dbos": "bench.three_async", "absurd": "bench.three_sync",
             "pgqueuer": "bench.one_async"}
    top = max(size["concurrency"])
    two_proc_c = 64 if 64 in size["concurrency"] else top
    ceiling_dsn = fresh_database(server, "flowly_bench_ceiling")

    for rep in range(size["repeat"]):
        note(f"repetition {rep + 1} of {size['repeat']}")
        if "ceiling" not in skip:
            for clients in commits:
                tps, tool = ceiling.measure(ceiling_dsn, clients, size["ceiling_seconds"])
                commits[clients].add(tps)
                note(f"ceiling {clients} clients: {tps:.0f} commits/s ({tool})")
        if "throughput" not in skip:
            plan = [(wf, c, 1) for c in size["concurrency"]
                    for wf in ("bench.three_async", "bench.three_sync")]
            plan += [("bench.three_async", two_proc_c, 2), ("bench.one_async", two_proc_c, 1)]
            for wf, c, procs in plan:
                d = throughput.drain(dsn, wf, size["runs"], c, procs)
                rates.setdefault((wf, c, procs), Sample()).add(d.rate)
                if procs == 1 and wf == "bench.three_async":
                    max_conns[c] = max(max_conns.get(c, 0), d.max_connections)
                busy.setdefault((wf, c, procs), []).append((d.worker_cores, d.machine_busy))
                note(f"{wf} c={c} x{procs}: {d.rate:.0f} runs/s, {d.max_connections} conns,"
                     f" worker CPU {d.worker_cores:.2f} cores, machine {d.machine_busy:.0%}")
        if "peers" not in skip:
            for name, wf in pairs.items():
                why = peers.available(name)
                if why:
                    peer_skipped[name] = why
                    continue
                ours, theirs = peer_rates.setdefault(name, (Sample(), Sample()))
                # flowly at its top concurrency against pgqueuer's unbounded batches
                c = top if name == "pgqueuer" else two_proc_c
                d = throughput.drain(dsn, wf, size["peer_runs"], c)
                ours.add(d.rate)
                p = peers.drain_peer(server, name, size["peer_runs"], two_proc_c,
                                     size["peer_timeout"])
                theirs.add(p.rate)
                ours_cpu, theirs_cpu = peer_cpu.setdefault(name, ([], []))
                ours_cpu.append((d.worker_us_per_run, d.machine_us_per_run))
                theirs_cpu.append((p.worker_us_per_run, p.machine_us_per_run))
                note(f"{name}: flowly {d.rate:.0f} runs/s, {name} {p.rate:.0f} runs/s"
                     f"{'' if p.done else f' ({p.runs} finished in {p.seconds:.0f}s)'}")

    rows: list[Row] = []
    c16 = commits[16]
    if "ceiling" not in skip:
        rows.append(Row("commit ceiling, 1 client (commits/s)", commits[1].fmt()))
        rows.append(Row("commit ceiling, 16 clients (commits/s)", c16.fmt()))
    if rates:
        for c in size["concurrency"]:
            a, s = rates[("bench.three_async", c, 1)], rates[("bench.three_sync", c, 1)]
            r = ratio(a, c16) if c16.values else None
            rows.append(Row(f"3-step async, c={c} (runs/s)", a.fmt(),
                            "16-client ceiling" if r else "", r, ">= 0.40",
                            None if r is None else r >= 0.4))
            rows.append(Row(f"3-step sync, c={c} (runs/s)", s.fmt(), f"3-step async, c={c}",
                            ratio(s, a), ">= 0.70", ratio(s, a) >= 0.7))
        best = max(size["concurrency"],
                   key=lambda c: rates[("bench.three_async", c, 1)].median)
        r = ratio(rates[("bench.three_async", best, 1)], c16) if c16.values else None
        rows.append(Row(f"3-step async, best (c={best}), steps/s",
                        Sample([3 * v for v in rates[("bench.three_async", best, 1)].values]
                               ).fmt(),
                        "16-client ceiling", None if r is None else 3 * r))
        two = rates[("bench.three_async", two_proc_c, 2)]
        one = rates[("bench.three_async", two_proc_c, 1)]
        rows.append(Row(f"3-step async, 2 worker processes, c={two_proc_c} each", two.fmt(),
                        "1 process", ratio(two, one), ">= 1.5 with DB headroom",
                        ratio(two, one) >= 1.5))
        for procs in (1, 2):
            cores = statistics.median(b[0] for b in busy[("bench.three_async", two_proc_c, procs)])
            machine_busy = statistics.median(
                b[1] for b in busy[("bench.three_async", two_proc_c, procs)])
            rows.append(Row(f"  CPU during the {procs}-process drain",
                            f"workers {cores:.2f} cores",
                            f"machine {machine_busy:.0%} busy of {os.cpu_count()} cores"))
        rows.append(Row(f"1-step async, c={two_proc_c} (runs/s)",
                        rates[("bench.one_async", two_proc_c, 1)].fmt()))
        rows.append(Row(f"connections held by one worker, c={top}", str(max_conns.get(top, 0)),
                        target="bounded (pool max 4 + 1 listener)",
                        met=max_conns.get(top, 0) <= 5))
    names = {"dbos": "DBOS Transact 3-step async", "absurd": "Absurd 3-step sync",
             "pgqueuer": "pgqueuer 1-step"}
    targets = {"dbos": (None, ""), "absurd": (10.0, ">= 10"), "pgqueuer": (1.5, ">= 1.5")}
    for name, (ours, theirs) in peer_rates.items():
        want, label = targets[name]
        r = ratio(ours, theirs)
        c = top if name == "pgqueuer" else two_proc_c
        rows.append(Row(f"flowly {pairs[name].split('.')[1]} vs peer, c={c},"
                        f" {size['peer_runs']:,} runs (runs/s)", ours.fmt(),
                        f"{names[name]} {theirs.fmt()}", r, label,
                        None if want is None else r >= want))
        ours_cpu, theirs_cpu = (
            [statistics.median(x[i] for x in side) for i in (0, 1)] for side in peer_cpu[name])
        rows.append(Row("  CPU per run, µs: its worker / the whole machine",
                        f"{ours_cpu[0]:.0f} / {ours_cpu[1]:.0f}",
                        f"{names[name].split()[0]} {theirs_cpu[0]:.0f} / {theirs_cpu[1]:.0f}",
                        ours_cpu[1] / theirs_cpu[1]))
    for name, why in peer_skipped.items():
        rows.append(Row(f"peer {name}", "skipped", why))

    if "latency" not in skip:
        note("latency")
        first, delay, enqueue, theirs = latency.side_by_side(
            dsn, server, size["latency_runs"], size["latency_rounds"])
        q1, q2 = latency.quantiles(first), latency.quantiles(delay)
        q3 = latency.quantiles(theirs[0]) if theirs else None
        for p in ("p50", "p95", "p99"):
            r = q1[p] / q3[p] if q3 else None
            rows.append(Row(f"enqueue -> first step {p} (ms)", f"{q1[p]:.1f}",
                            f"pgqueuer enqueue -> start {q3[p]:.1f}" if q3 else "", r,
                            "<= 0.50" if p == "p50" and q3 else "",
                            (r <= 0.5) if p == "p50" and r is not None else None))
        sync_first = latency.quantiles(
            latency.flowly_latency(dsn, size["latency_runs"], latency.SYNC_STEP)[0])
        rows.append(Row("the same, a sync step function p50 (ms)", f"{sync_first['p50']:.1f}",
                        "the async one above", sync_first["p50"] / q1["p50"]))
        # the floor under both: the enqueue call's own round trip is part of each figure
        ours_enqueue = latency.quantiles(enqueue)["p50"]
        theirs_enqueue = latency.quantiles(theirs[1])["p50"] if theirs else None
        rows.append(Row("the enqueue call alone p50 (ms)", f"{ours_enqueue:.1f}",
                        f"pgqueuer enqueue() {theirs_enqueue:.1f}" if theirs_enqueue else "",
                        ours_enqueue / theirs_enqueue if theirs_enqueue else None))
        rows.append(Row("Client.wait return delay p50/p95/p99 (ms)",
                        f"{q2['p50']:.1f} / {q2['p95']:.1f} / {q2['p99']:.1f}",
                        target="a few ms", met=q2["p50"] <= 10))
        naps = latency.quantiles(latency.sleep_overshoot(dsn, size["naps"]))
        rows.append(Row("a durable sleep of 0.1 s ends late by, p50/p95 (ms)",
                        f"{naps['p50']:.1f} / {naps['p95']:.1f}",
                        "the worker's poll interval 5 s"))
        delayed = latency.quantiles(latency.delayed_start_lateness(dsn, size["naps"]))
        rows.append(Row("a run started 0.1 s ahead begins late by, p50/p95 (ms)",
                        f"{delayed['p50']:.1f} / {delayed['p95']:.1f}",
                        "the worker's poll interval 5 s"))
    if "steps" not in skip:
        note("sequential steps")
        per_step = [latency.step_cost(dsn, size["steps"]) for _ in range(3)]
        cost = Sample(per_step)
        r = (1000 / commits[1].median) if commits[1].values else None
        rows.append(Row(f"{size['steps']:,} sequential no-op steps: ms per step",
                        cost.fmt(2), f"1-client commit {r:.2f} ms" if r else "",
                        cost.median / r if r else None))
        bare = latency.bare_checkpoint_ms(dsn, size["steps"])
        rows.append(Row("  the same steps' checkpoint_steps calls alone (ms each)",
                        f"{bare:.2f}", "per step in the workflow", bare / cost.median))
    if "claim" not in skip:
        note(f"claim cost with {size['finished']:,} finished runs")
        m = claim_cost.measure(server, size["finished"], size["sleeping"], size["foreign"],
                               size["steps"] * 10, size["claim_rounds"])
        rows.append(Row(f"claim of 10 runs, {size['finished']:,} finished runs (ms)",
                        f"{m['loaded']:.2f}", f"empty tables {m['empty']:.2f}",
                        m["loaded"] / m["empty"], "<= 1.5", m["loaded"] / m["empty"] <= 1.5))
        rows.append(Row(f"start handed to an idle worker, {size['finished']:,} finished runs (ms)",
                        f"{m['start_loaded']:.2f}", f"empty tables {m['start_empty']:.2f}",
                        m["start_loaded"] / m["start_empty"]))
        rows.append(Row(f"claim of a run with {size['steps'] * 10:,} checkpoints (ms)",
                        f"{m['long']:.2f}", f"fresh run {m['fresh']:.2f}",
                        m["long"] / m["fresh"]))
    if "memory" not in skip:
        note(f"worker memory over {size['memory_runs']:,} runs")
        d = throughput.drain(dsn, "bench.three_async", size["memory_runs"], two_proc_c,
                             sample_rss=True, timeout=3600)
        samples = [(n, rss) for n, rss in d.rss if n > 0]
        tenth = [rss for n, rss in samples if n <= size["memory_runs"] // 10] or \
            [samples[0][1]]
        early = statistics.median(tenth)
        late = statistics.median([rss for n, rss in samples
                                  if n >= size["memory_runs"] * 9 // 10] or [samples[-1][1]])
        peak = max(rss for _, rss in samples)
        short = rates.get(("bench.three_async", two_proc_c, 1))
        rows.append(Row(f"3-step async, c={two_proc_c}, over those {size['memory_runs']:,} runs"
                        " (runs/s)",
                        f"{d.rate:,.0f}", f"{size['runs']:,} runs {short.fmt()}" if short else "",
                        ratio(d.rate, short) if short else None,
                        "about 1 (cost per run independent of backlog)"))
        rows.append(Row(f"worker RSS over {size['memory_runs']:,} runs, last tenth (MiB)",
                        f"{late / 2**20:.1f} (peak {peak / 2**20:.1f})",
                        f"first tenth {early / 2**20:.1f}", late / early, "flat (<= 1.10)",
                        late / early <= 1.10))

    print()
    print_table(rows)
    print(f"\n({time.monotonic() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
