"""Fleet benchmark: a routing sweep on a local Ray cluster against the same sweep in one process.

One run: the Mooncake conversation trace (../shared/datasets or $KMESH_DATASETS, or --src) imported into a temporary
trace directory; a sweep of --routings x --engines x --capacities (plus the global pools) run by
`kmesh_trace.oracle.fleet.sweep`, in this process (`InProcess`: the trace read once, then every
run in turn) and as Ray tasks (`OnRay`) on a local cluster of --workers CPUs (each task reads the trace's parts
itself; a worker keeps what it read while the parts are unchanged). The arms alternate A B B A for
--rounds pairs; the first Ray sweep on the fresh cluster (workers starting, importing, reading) is
timed apart as `cold`. Every sweep's result must equal the in-process one, run for run.

Also printed, for docs/SCALING.md: each policy's single-run time at one point (block reads replayed
per second by one task) and the memory the in-process workload takes (peak RSS growth per request).
The machine is shared: the load average before and after, and the machine's idle CPU share during
each sweep (from /proc/stat), are printed with the figures. Because a loaded machine leaves a second
worker no free core, the CPU seconds of every run are also measured, in this process and inside each
Ray task, and the Ray tasks' CPU times are dealt in order to --workers free workers: the projected
speedup on idle cores, labelled as a projection.

    .venv/bin/python benchmarks/fleet_bench.py [--src conversation_trace.jsonl] [--rounds 2]
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

DATASETS = Path(os.environ.get("KMESH_DATASETS") or Path(__file__).resolve().parents[2] / "shared" / "datasets")
DEFAULT_SRC = DATASETS / "mooncake" / "conversation_trace.jsonl"


def _cpu_jiffies() -> tuple[int, int]:
    """(idle, total) CPU time of the whole machine so far, from /proc/stat (idle + iowait count as idle)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields)


def _cpu_fleet_run(*args):
    """A fleet run as a Ray task that also reports the CPU seconds it took in its worker."""
    from kmesh_trace.oracle.fleet import fleet_run

    t = time.process_time()
    run = fleet_run(*args)
    return run, time.process_time() - t


def _greedy_makespan(durations: list[float], workers: int) -> float:
    """When the last of `durations` ends if each goes, in order, to the worker that frees first (how
    Ray hands queued tasks to idle workers)."""
    import heapq

    free = [0.0] * workers
    for d in durations:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=DEFAULT_SRC)
    ap.add_argument("--engines", type=_ints, default=[8, 16])
    ap.add_argument("--capacities", type=_ints, default=[1000, 2000])
    ap.add_argument("--routings", default="round-robin,least-loaded,family,prefix-aware")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="A B B A pairs of (one process, Ray)")
    args = ap.parse_args()
    if not args.src.is_file():
        raise SystemExit(f"Mooncake trace not found at {args.src} (give --src, or set up ../shared/datasets)")

    import ray

    from kmesh_trace.datasets.importers.mooncake import import_mooncake
    from kmesh_trace.distributed import local_cluster_options
    from kmesh_trace.oracle.executor import InProcess, OnRay
    from kmesh_trace.oracle.fleet import plan, simulate_run, sweep as fleet_sweep
    from kmesh_trace.oracle.workload import Workload
    from kmesh_trace.parts import open_parts

    routings = args.routings.split(",")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        trace = str(Path(d) / "trace")
        import_mooncake(args.src, trace)
        opts = dict(overload=1.25, edges="auto")

        def sweep(ray_address):
            idle0, total0 = _cpu_jiffies()
            t = time.perf_counter()
            executor = InProcess() if ray_address is None else OnRay(ray_address)
            source = trace if executor.remote else Workload.from_trace(open_parts(trace), merged=True)
            res = fleet_sweep(source, args.engines, args.capacities, routings, executor=executor, **opts)
            s = time.perf_counter() - t
            idle1, total1 = _cpu_jiffies()
            idle[ray_address is not None].append((idle1 - idle0) / max(total1 - total0, 1))
            return s, res.to_dict()

        idle: dict[bool, list[float]] = {False: [], True: []}
        num_runs = len(plan(args.engines, args.capacities, routings))
        t = time.perf_counter()
        # every server on 127.0.0.1, no dashboard, workers at nice 0 (like the one-process arm)
        ray.init(num_cpus=args.workers, logging_level=logging.WARNING, log_to_driver=False, **local_cluster_options())
        start_s = time.perf_counter() - t
        address = ray.get_runtime_context().gcs_address
        cold_s, reference = sweep(address)
        times: dict[str, list[float]] = {"one process": [], "ray": []}
        pairs: list[float] = []  # one process / ray, per adjacent pair (A B, then B A)
        for _ in range(args.rounds):
            for arm in ("one process", "ray", "ray", "one process"):
                s, res = sweep(None if arm == "one process" else address)
                assert res == reference, f"the {arm} sweep differs from the first Ray sweep"
                times[arm].append(s)
            pairs += [times["one process"][-2] / times["ray"][-2], times["one process"][-1] / times["ray"][-1]]
        # CPU seconds per run: in this process, and inside each Ray task (measured by the task itself).
        from kmesh_trace.distributed import Task, run_tasks
        from kmesh_trace.oracle.fleet import assemble

        runs = plan(args.engines, args.capacities, routings)
        w = Workload.from_trace(open_parts(trace), merged=True)
        local_cpu = []
        for policy, n, c in runs:
            t = time.process_time()
            simulate_run(w, policy, n, c, **opts)
            local_cpu.append(time.process_time() - t)
        out = run_tasks(_cpu_fleet_run, [Task(f"{p} {n} {c}", (trace, p, n, c, 1.25, "auto")) for p, n, c in runs],
                        ray=address)
        assert assemble([r for r, _ in out], args.engines, args.capacities, routings, 1.25).to_dict() == reference
        ray_cpu = [s for _, s in out]
        ray.shutdown()
        load_after = os.getloadavg()

        # Per-task figures for SCALING.md: one run of each policy at one point, in this process.
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t = time.perf_counter()
        w = Workload.from_trace(open_parts(trace), merged=True)
        read_s = time.perf_counter() - t
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        num_reads = sum(len(r.prompt_hashes) for r in w.requests)
        n, c = args.engines[-1], args.capacities[0]
        per_policy = {}
        for policy in [*routings, "global"]:
            t = time.perf_counter()
            simulate_run(w, policy, n, c, **opts)
            per_policy[policy] = time.perf_counter() - t

    med = {arm: statistics.median(v) for arm, v in times.items()}
    print(f"trace: {args.src.name}, {len(w.requests):,} requests, {num_reads:,} block reads, block size {w.block_size}")
    print(f"sweep: routings {','.join(routings)} x engines {args.engines} x capacities {args.capacities} "
          f"= {num_runs} runs (global pools included), {args.rounds} A B B A rounds")
    print(f"ray cluster start: {start_s:.1f} s (not in the sweep times); cold first Ray sweep: {cold_s:.2f} s")
    for arm, v in times.items():
        print(f"  {arm:12s} median {med[arm]:.2f} s  ({', '.join(f'{x:.2f}' for x in v)})")
    print(f"speedup one process / ray ({args.workers} workers): median of pairs {statistics.median(pairs):.2f} "
          f"({', '.join(f'{x:.2f}' for x in pairs)}), ratio of medians {med['one process'] / med['ray']:.2f} "
          f"(goal >= 1.6); every sweep identical to the first: yes")
    print(f"idle CPU share of the machine during the sweeps: one process "
          f"{', '.join(f'{x:.0%}' for x in idle[False])}; ray {', '.join(f'{x:.0%}' for x in idle[True][1:])}")
    makespan = _greedy_makespan(ray_cpu, args.workers)
    print(f"CPU seconds of the runs: one process {sum(local_cpu):.2f}, inside the Ray tasks {sum(ray_cpu):.2f} "
          f"(ratio {sum(ray_cpu) / sum(local_cpu):.2f}); the Ray tasks' CPU times dealt in order to {args.workers} "
          f"free workers end after {makespan:.2f} s: a projected speedup of {sum(local_cpu) / makespan:.2f} on "
          f"{args.workers} idle cores (a projection from measured CPU times, not a wall-clock measurement)")
    print(f"load average (1, 5, 15 min) before {tuple(round(x, 2) for x in load_before)}, "
          f"after {tuple(round(x, 2) for x in load_after)}; {os.cpu_count()} CPUs")
    print(f"per task, {n} engines x {c} blocks: trace read {read_s:.2f} s; "
          f"workload peak RSS growth {(rss1 - rss0) / 1024:.0f} MiB ({(rss1 - rss0) * 1024 / len(w.requests):,.0f} B/request)")
    for policy, s in per_policy.items():
        print(f"  {policy:13s} {s:.2f} s  {num_reads / s:,.0f} block reads/s  {len(w.requests) / s:,.0f} requests/s")


if __name__ == "__main__":
    main()
