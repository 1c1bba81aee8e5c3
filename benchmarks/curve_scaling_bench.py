"""How the oracle's curve and grid kernels scale with the stream: time and peak memory per block read.

Streams: the Mooncake conversation trace (../shared/datasets/mooncake, or --src) flattened into its
AccessStream, then
- `fresh`: tiled with fresh block ids per copy (`AccessStream.tile`: copy k reuses nothing of copy k - 1,
  so the cache depth stays that of one copy) and cut at a request boundary after N block reads;
- `repeat`: the same copies with the same ids (each copy's reads reuse the previous copy's blocks, so the
  Belady stack grows to the whole working set, 170,899 blocks, from the second copy on).
For each N (doubling from --min-reads), one child process per kernel builds the stream and runs it once
(numba's compiled code loaded on a small stream first), reporting the kernel's seconds, its ratio to the
previous N in CPU seconds of the process (`CPU x previous`: 2.0 is linear; wall seconds move more with
the load), the load average when it ran, and the memory per block read
that the stream adds to the resident set and the kernel's own peak above that (the high-water mark is
reset before the kernel, /proc/self/clear_refs; the vllm arm's RequestBlocks count as stream):
`belady-curve` (every capacity; `belady-stack`, not in the defaults: the same curve by the priority
stack of tests/belady_stack.py, O(depth) per read), `vllm` and `belady-prefix` at one capacity (4,096
blocks; the grid runs 19 of these), `lru-curve`. It ends with the table as Markdown. The defaults (up to
1.6 M reads) take a few minutes; the series of benchmarks/README.md went to --max-reads 102400000.
`--runs R` times each row below `--runs-below` reads R times and keeps the fastest (small rows take
milliseconds, where the load shows most). `--from-logs LOG...` prints the table (and --plot draws CPU
seconds) from the lines of earlier runs. `--baseline COMMIT` also runs every kernel as of that commit
(rows `KERNEL@COMMIT`, `benchmarks/baseline_tree.py`), interleaved with this tree's: before / after kernel
time on the same streams, in one run, on one load.

    KMESH_DATASETS=../shared/datasets .venv/bin/python benchmarks/curve_scaling_bench.py \\
        [--kernels belady-curve,lru-curve] [--max-reads 1600000] [--repeat-max-reads 1600000] \\
        [--json OUT.json] [--plot OUT.png] [--baseline COMMIT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
DATASETS = Path(os.environ.get("KMESH_DATASETS") or HERE.parents[2] / "shared" / "datasets")
KERNELS = ("belady-curve", "lru-curve", "vllm", "belady-prefix")
CAPACITY = 4096


def mooncake_stream(src: Path):
    from kmesh_trace.oracle.stream import AccessStream

    hashes, reads, tokens = [], [], []
    with open(src) as f:
        for line in f:
            r = json.loads(line)
            hashes.extend(r["hash_ids"])
            reads.append(len(r["hash_ids"]))
            tokens.append(r["input_length"])
    flat, num_reads, prompt = np.array(hashes, np.uint64), np.array(reads, np.int64), np.array(tokens, np.int64)
    n_full = np.minimum(num_reads, prompt // 512)
    n_elig = np.minimum(num_reads, np.maximum(prompt - 1, 0) // 512)
    pos = np.arange(len(flat)) - np.repeat(np.cumsum(num_reads) - num_reads, num_reads)
    keep = pos < np.repeat(n_full, num_reads)
    starts = np.zeros(len(num_reads) + 1, np.int64)
    np.cumsum(n_full, out=starts[1:])
    return AccessStream.from_arrays(512, flat[keep], (pos < np.repeat(n_elig, num_reads))[keep], starts, prompt,
                                    num_reads)


def stream_of(base, mode: str, n_reads: int):
    """The first requests of the tiled stream holding at least n_reads block reads."""
    from kmesh_trace.oracle.stream import NEVER, AccessStream, next_uses

    copies = -(-n_reads // len(base))
    n = len(base)
    r = int(np.searchsorted(base.req_start, n_reads - (copies - 1) * n))  # requests of the last copy kept
    m = (copies - 1) * n + int(base.req_start[r])
    if mode == "fresh":
        tiled = base.tile(copies)
        obj, elig, nu = tiled.obj[:m].copy(), tiled.eligible[:m].copy(), tiled.next_use[:m].copy()
        nu[nu >= m] = NEVER  # a next use in the part cut off
        del tiled
    else:
        obj, elig = np.tile(base.obj, copies)[:m].copy(), np.tile(base.eligible, copies)[:m].copy()
        nu = next_uses(obj, elig)
    kept = (copies - 1) * base.num_requests + r
    starts = np.append((base.req_start[:-1][None, :] + (np.arange(copies) * n)[:, None]).ravel()[:kept], m)
    k = np.tile(base.num_prompt_tokens, copies)[:kept]
    nr = np.tile(base.num_reads, copies)[:kept]
    return AccessStream(512, obj, elig, nu, starts, k, nr, int(obj.max()) + 1 if m else 0)


def requests_of(stream):
    """RequestBlocks for the vllm model (its hashes are the stream's dense ids; no output)."""
    from kmesh_trace.oracle.stream import RequestBlocks

    s, k, nr = stream.req_start, stream.num_prompt_tokens.tolist(), stream.num_reads.tolist()
    obj = stream.obj.tolist()
    return [RequestBlocks(i, str(i), k[i], 0, obj[s[i]:s[i + 1]]) for i in range(stream.num_requests)]


def child(src: Path, mode: str, n_reads: int, kernel: str, runs: int = 1) -> dict:
    from kmesh_trace.oracle.blockpool import simulate_pool
    from kmesh_trace.oracle.curves import belady_curve, lru_curve
    from kmesh_trace.oracle.policies import POLICIES, Workload

    def run(stream, reqs):
        if kernel == "belady-curve":
            return belady_curve(stream).max_level
        if kernel == "belady-stack":  # the O(depth) priority stack the tests keep as the reference
            sys.path.insert(0, str(HERE.parents[1] / "tests"))
            from belady_stack import stack_belady_curve

            return stack_belady_curve(stream).max_level
        if kernel == "lru-curve":
            return lru_curve(stream).max_level
        if kernel == "vllm":
            return simulate_pool(reqs, block_size=512, num_usable_blocks=CAPACITY, timed=False,
                                 stream=stream).total_hit_blocks
        return POLICIES[kernel].simulate(Workload.of_stream(stream), CAPACITY).hit_blocks

    base = mooncake_stream(src)
    small = stream_of(base, "fresh", 1000)
    run(small, requests_of(small))  # numba's compiled code loaded from its cache, outside the timing
    del small
    stream = stream_of(base, mode, n_reads)
    before = _rss()
    reqs = requests_of(stream) if kernel == "vllm" else None
    arrays = ("obj", "eligible", "next_use", "req_start", "num_prompt_tokens", "num_reads")
    stream_bytes = sum(getattr(stream, a).nbytes for a in arrays) + _rss() - before
    with_stream = _rss()
    _reset_peak()
    best = None
    for i in range(runs):  # the fastest of `runs` (small streams take milliseconds: the load shows more)
        t0, c0 = time.perf_counter(), time.process_time()
        result = run(stream, reqs)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        best = (seconds, cpu) if best is None or cpu < best[1] else best
        if i == 0:
            peak = _peak()  # of the first run (the allocator keeps some of what later runs free)
    seconds, cpu = best
    return {"mode": mode, "kernel": kernel, "block_reads": len(stream), "seconds": seconds, "cpu_seconds": cpu,
            "result": int(result),
            "peak_bytes": peak, "stream_bytes": stream_bytes, "kernel_peak_bytes": peak - with_stream,
            "load": os.getloadavg()[0]}


_LINE = re.compile(r"(\w+)\s+([\w@-]+)\s+([\d,]+) reads\s+([\d.]+) s, CPU\s+([\d.]+) s \((?:x([\d.]+)|\s+)\)"
                   r"\s+[\d.]+ CPU ns/read; stream\s+([\d.]+) \+ kernel\s+([\d.]+) B/read; load ([\d.]+)")


def _rows_of_log(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        m = _LINE.match(line)
        if m:
            n = int(m[3].replace(",", ""))
            rows.append({"mode": m[1], "kernel": m[2], "block_reads": n, "seconds": float(m[4]),
                         "cpu_seconds": float(m[5]), "x_previous": float(m[6]) if m[6] else None,
                         "stream_bytes": float(m[7]) * n, "kernel_peak_bytes": float(m[8]) * n, "load": float(m[9])})
    return rows


def _reset_peak() -> None:
    """Start the resident-set high-water mark (VmHWM) afresh (Linux: /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, default=DATASETS / "mooncake" / "conversation_trace.jsonl")
    ap.add_argument("--min-reads", type=int, default=100_000)
    ap.add_argument("--max-reads", type=int, default=1_600_000)
    ap.add_argument("--repeat-max-reads", type=int, default=1_600_000)
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--runs", type=int, default=1, help="runs per row below --runs-below reads, the fastest kept")
    ap.add_argument("--runs-below", type=int, default=3_200_000)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--from-logs", nargs="+", type=Path, metavar="LOG",
                    help="no runs: the table and --plot from the printed lines of earlier runs")
    ap.add_argument("--baseline", metavar="COMMIT", help="also run each kernel as of this commit (before / after)")
    ap.add_argument("--child", nargs=4, metavar=("MODE", "READS", "KERNEL", "RUNS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.src, args.child[0], int(args.child[1]), args.child[2], int(args.child[3]))))
        return
    kernels = args.kernels.split(",")
    python = {k: [sys.executable] for k in kernels}
    if args.baseline and not args.from_logs:
        import tempfile

        sys.path.insert(0, str(HERE.parent))
        from baseline_tree import baseline_python

        before = baseline_python(args.baseline, Path(tempfile.mkdtemp(prefix="curve-bench-")))
        kernels = [k for kernel in kernels for k in (kernel, f"{kernel}@{args.baseline}")]
        python.update({f"{k}@{args.baseline}": before for k in python})
    if args.from_logs:
        rows = [r for path in args.from_logs for r in _rows_of_log(path)]
        kernels = list(dict.fromkeys(r["kernel"] for r in rows))
        args.max_reads = args.repeat_max_reads = 0  # nothing to run
    elif not args.src.is_file():
        sys.exit(f"{args.src} not found; pass --src with the Mooncake conversation_trace.jsonl")
    else:
        rows = []
    for mode, top in (("fresh", args.max_reads), ("repeat", args.repeat_max_reads)):
        n = args.min_reads
        while n <= top:
            for kernel in kernels:
                runs = args.runs if n < args.runs_below else 1
                cmd = [*python[kernel], str(HERE), "--src", str(args.src), "--child", mode, str(n),
                       kernel.split("@")[0], str(runs)]
                subprocess.run(cmd[:-5] + ["--child", mode, str(args.min_reads), kernel.split("@")[0], "1"], check=True,
                               capture_output=True)  # numba's cache, outside the timing
                row = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
                row["kernel"] = kernel
                row["bytes_per_read"] = (row["stream_bytes"] + row["kernel_peak_bytes"]) / row["block_reads"]
                prev = [r for r in rows if r["mode"] == mode and r["kernel"] == kernel]
                row["x_previous"] = row["cpu_seconds"] / prev[-1]["cpu_seconds"] if prev else None
                rows.append(row)
                print(f"{mode:6} {kernel:13} {row['block_reads']:>11,} reads  {row['seconds']:8.3f} s,"
                      f" CPU {row['cpu_seconds']:8.3f} s"
                      f" ({'x%.2f' % row['x_previous'] if prev else '     '})"
                      f"  {row['cpu_seconds'] / row['block_reads'] * 1e9:7.1f} CPU ns/read;"
                      f" stream {row['stream_bytes'] / row['block_reads']:5.1f} + kernel"
                      f" {row['kernel_peak_bytes'] / row['block_reads']:5.1f} B/read; load {row['load']:.1f}",
                      flush=True)
            n *= 2
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2))
    print("\n| stream | kernel | block reads | seconds | CPU seconds | CPU x previous | CPU ns/read | stream B/read |"
          " kernel B/read | load |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['kernel']} | {r['block_reads']:,} | {r['seconds']:.3f} | {r['cpu_seconds']:.3f} |"
              f" {'%.2f' % r['x_previous'] if r['x_previous'] else ''} |"
              f" {r['cpu_seconds'] / r['block_reads'] * 1e9:.0f} |"
              f" {r['stream_bytes'] / r['block_reads']:.1f} | {r['kernel_peak_bytes'] / r['block_reads']:.1f} |"
              f" {r['load']:.1f} |")
    print("\nFitted over each series (least squares on log CPU seconds against log block reads):")
    for mode in ("fresh", "repeat"):
        for kernel in kernels:
            pts = [(r["block_reads"], r["cpu_seconds"]) for r in rows if r["mode"] == mode and r["kernel"] == kernel
                   and r["cpu_seconds"] > 0]
            if len(pts) >= 3:
                k = float(np.polyfit(np.log(np.array(pts)[:, 0]), np.log(np.array(pts)[:, 1]), 1)[0])
                print(f"  {mode} {kernel}: CPU ~ n^{k:.3f}, x{2 ** k:.2f} per doubling, {pts[0][0]:,} to {pts[-1][0]:,} reads")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for mode in ("fresh", "repeat"):
            for kernel in kernels:
                pts = [(r["block_reads"], r["cpu_seconds"]) for r in rows
                       if r["mode"] == mode and r["kernel"] == kernel]
                if pts:
                    x, y = zip(*pts)
                    ax.loglog(x, y, "o-" if mode == "fresh" else "s--", label=f"{kernel} ({mode} ids)")
        ax.set_xlabel("block reads")
        ax.set_ylabel("kernel CPU seconds")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
