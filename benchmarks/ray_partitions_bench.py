"""`headroom --partitions K --ray`: the curve of k partitions of the block ids as Ray tasks, against the exact
one-machine curve: time with 1, 2, 4 workers (k = workers) and the merged curve's error.

The stream (a Mooncake-format JSONL file, e.g. the agentic stream `sampled_curve_bench.py` writes under
/tmp) is imported once into a trace directory, which every Ray task reads itself (as `--ray` runs it: each
worker reads the whole trace, then keeps its partition). Per worker count n, a fresh local Ray cluster of n
CPUs (127.0.0.1 only, no dashboard) in a child process times `partitioned_curve(workload, n)` (Ray's start
not included; the tasks' reads are); the baseline, in the same run, is the exact curve in one process
(`--policies`, window last-half, grid replays on one thread).

    KMESH_DATASETS=../shared/datasets .venv/bin/python benchmarks/ray_partitions_bench.py \\
        --src /tmp/kmesh-agentic-10000000-60.jsonl [--workers 1,2,4] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHILD = r"""
import json, sys, time, logging
import ray
from kmesh_trace.distributed import local_cluster_options
from kmesh_trace.oracle.executor import OnRay
from kmesh_trace.oracle.sampled_curve import partitioned_curve
from kmesh_trace.oracle.workload import Workload
from kmesh_trace.trace import open_trace
trace, n, policies, out = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
ray.init(num_cpus=n, logging_level=logging.WARNING, log_to_driver=False, **local_cluster_options())
w = Workload.from_trace(open_trace(trace), requests=False)
t = time.perf_counter()
res = partitioned_curve(w, n, policies=policies, window="last-half", executor=OnRay("auto"))
seconds = time.perf_counter() - t
open(out, "w").write(json.dumps({"seconds": seconds, "result": res.to_dict()}))
ray.shutdown()
"""


def at(curve: dict, caps) -> np.ndarray:
    c = np.asarray(curve["capacities"])
    i = np.searchsorted(c, caps, side="right") - 1
    return np.where(i >= 0, np.asarray(curve["hit_blocks"])[np.maximum(i, 0)], 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, required=True)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--policies", default="lru,belady")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not args.src.exists():
        sys.exit(f"skipped: {args.src} is absent (benchmarks/sampled_curve_bench.py writes it)")
    py = sys.executable
    tmp = Path(tempfile.mkdtemp(prefix="kmesh-ray-bench-"))
    trace = tmp / "trace"
    subprocess.run([str(Path(py).parent / "kmesh-trace"), "import", "mooncake", str(args.src), "--out", str(trace)],
                   check=True, capture_output=True)
    from kmesh_trace.oracle.headroom_curve import headroom_curve
    from kmesh_trace.oracle.workload import Workload
    from kmesh_trace.trace import open_trace

    names = args.policies.split(",")
    w = Workload.from_trace(open_trace(trace), requests=False)
    t = time.perf_counter()
    exact = headroom_curve(Workload.of_stream(w.stream), policies=names, window="last-half", processes=1)
    exact_s = time.perf_counter() - t
    exact = exact.to_dict()
    print(f"exact, one process: {exact_s:.1f} s ({len(w.stream):,} accesses); load {os.getloadavg()[0]:.1f}",
          file=sys.stderr)
    rows = []
    for n in [int(x) for x in args.workers.split(",")]:
        out = tmp / f"ray-{n}.json"
        subprocess.run([py, "-c", CHILD, str(trace), str(n), args.policies, str(out)], check=True)
        d = json.loads(out.read_text())
        res = d["result"]
        row = {"workers": n, "seconds": d["seconds"], "ratio_to_exact": d["seconds"] / exact_s,
               "load": os.getloadavg()[0], "infinite_delta": res["sampled"]["infinite_check"]["delta"]}
        for name in names:
            caps = np.union1d(exact["curves"][name]["capacities"], res["curves"][name]["capacities"])
            row[name] = float(np.abs(at(exact["curves"][name], caps) - at(res["curves"][name], caps)).max()
                              / exact["num_reads"])
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    print(f"| Ray workers = partitions | seconds | / exact one process | {' | '.join(f'max abs delta {n}' for n in names)}"
          " | infinite delta | load |")
    print("|---:|---:|---:|" + "---:|" * (len(names) + 2))
    for r in rows:
        print(f"| {r['workers']} | {r['seconds']:.1f} | {r['ratio_to_exact']:.2f} | "
              + " | ".join(f"{r[n]:.4f}" for n in names) + f" | {r['infinite_delta']:+.5f} | {r['load']:.1f} |")
    print(f"exact, one process: {exact_s:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"src": str(args.src), "exact_seconds": exact_s, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
