"""Sampled curves against the exact ones: the error table of `headroom --sample` and `--partitions`.

Stream: the agentic stream of `oracle_peer_bench.py` (the Claude Code samples of
../shared/datasets/weka-claude-code, repeated with fresh ids, copy k starting k * --stagger-s seconds
after copy k - 1; at least --agentic-reads block reads), written under /tmp once and read as
`kmesh-trace headroom` reads it (the JSONL file as it is), or --src FILE (a Mooncake-format JSONL file).

For the window `last-half`, the exact curves (`lru` and `belady` at every capacity, `belady-prefix` on the
power-of-two grid), then at each --rates the sampled curves (`oracle.sampled_curve.sampled_curve`) and at
each --partitions k the merged curve of k partitions (in this process, one after another), each against
the exact: max |sampled - exact| hit ratio over every capacity where either step curve rises (the two are
step functions, so that is the largest difference anywhere) and over the grid for `belady-prefix`; and
the seconds of each (a ratio to the exact curves' seconds of the same run: the machine may be loaded).

    KMESH_DATASETS=../shared/datasets .venv/bin/python benchmarks/sampled_curve_bench.py \\
        [--agentic-reads 10000000] [--rates 0.1,0.01,0.001] [--partitions 2,4] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from oracle_peer_bench import DATASETS, build_agentic  # noqa: E402


def load_stream(src: Path):
    from kmesh_trace.sources import read_directly
    from kmesh_trace.oracle.workload import Workload

    public = read_directly(src, on_import=lambda *a, **k: None)
    return Workload.from_trace(public, requests=False)


def max_delta(exact, sampled, num_reads: int, grid) -> float:
    """max |sampled - exact| hit ratio: over the union of both step curves' rises, or over the grid."""
    caps = np.union1d(exact.capacities, sampled.capacities) if exact.exact else np.asarray(grid)
    return float(np.abs(exact.at(caps) - sampled.at(caps)).max()) / num_reads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path)
    ap.add_argument("--agentic-reads", type=int, default=10_000_000)
    ap.add_argument("--stagger-s", type=float, default=60.0)
    ap.add_argument("--rates", default="0.1,0.01,0.001")
    ap.add_argument("--partitions", default="")
    ap.add_argument("--policies", default="lru,belady-prefix,belady")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from kmesh_trace.oracle.headroom_curve import headroom_curve
    from kmesh_trace.oracle.workload import Workload
    from kmesh_trace.oracle.sampled_curve import partitioned_curve, sampled_curve

    src = args.src
    if src is None:
        if not (DATASETS / "weka-claude-code").is_dir():
            sys.exit(f"skipped: no weka-claude-code samples under {DATASETS} (set KMESH_DATASETS)")
        src = Path(f"/tmp/kmesh-agentic-{args.agentic_reads}-{int(args.stagger_s)}.jsonl")
        if not src.exists():
            print(f"building {src}", file=sys.stderr)
            print(build_agentic(src, args.agentic_reads, args.stagger_s), file=sys.stderr)
    t = time.perf_counter()
    w = load_stream(src)
    stream = w.stream
    print(f"{src}: {len(stream):,} accesses, {int(stream.num_reads.sum()):,} block reads, {stream.num_objects:,} "
          f"objects, read in {time.perf_counter() - t:.1f} s; load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    names = args.policies.split(",")
    t = time.perf_counter()
    exact = headroom_curve(Workload.of_stream(stream), policies=names, window="last-half", processes=1)
    exact_s = time.perf_counter() - t
    print(f"exact: {exact_s:.1f} s", file=sys.stderr)
    rows = []

    def row(label, res, seconds):
        d = {"arm": label, "seconds": seconds, "ratio_to_exact": seconds / exact_s,
             "load": os.getloadavg()[0], "infinite_delta": res.sampling["infinite_check"]["delta"],
             "sampled_accesses": res.sampling.get("num_sampled_accesses")}
        for n in names:
            d[n] = max_delta(exact.curves[n], res.curves[n], exact.num_reads, exact.grid)
        rows.append(d)
        print(json.dumps(d), file=sys.stderr)

    for rate in [float(r) for r in args.rates.split(",") if r]:
        t = time.perf_counter()
        res = sampled_curve(stream, rate, policies=names, window="last-half", grid=exact.grid)
        row(f"sample {rate:g}", res, time.perf_counter() - t)
    for k in [int(k) for k in args.partitions.split(",") if k]:
        t = time.perf_counter()
        res = partitioned_curve(w, k, policies=names, window="last-half", grid=exact.grid)
        row(f"partitions {k}", res, time.perf_counter() - t)

    print(f"| arm | {' | '.join(f'max abs delta {n}' for n in names)} | infinite delta | accesses simulated | "
          "seconds | / exact |")
    print("|---|" + "---:|" * (len(names) + 4))
    for d in rows:
        acc = f"{d['sampled_accesses']:,}" if d["sampled_accesses"] is not None else f"{len(stream):,}"
        print(f"| {d['arm']} | " + " | ".join(f"{d[n]:.4f}" for n in names) +
              f" | {d['infinite_delta']:+.5f} | {acc} | {d['seconds']:.1f} | {d['ratio_to_exact']:.3f} |")
    print(f"exact: {exact_s:.1f} s over {len(stream):,} accesses ({exact.num_reads:,} block reads measured)")
    if args.json:
        args.json.write_text(json.dumps({"src": str(src), "accesses": len(stream), "exact_seconds": exact_s,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
