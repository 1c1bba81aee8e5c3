"""How the oracle's curve and grid kernels scale with the stream: time and peak memory per block read.

Streams: the Mooncake conversation trace (../shared/datasets/mooncake, or --src) flattened into its
AccessStream, then
- `fresh`: tiled with fresh block ids per copy (`AccessStream.tile`: copy k reuses nothing of copy k - 1,
  so the cache depth stays that of one copy) and cut at a request boundary after N block reads;
- `repeat`: the same copies with the same ids (each copy's reads reuse the previous copy's blocks, so the
  Belady stack grows to the whole working set, 170,899 blocks, from the second copy on).
For each N (doubling from --min-reads), one child process per kernel builds the stream and runs it once
(numba's compiled code loaded on a small stream first), reporting the kernel's seconds, the child's peak
RSS (`ru_maxrss`) and the memory per block read that the stream and the kernel add to it (resident set
before the stream, after it, and the peak after the kernel; the vllm arm's RequestBlocks included):
`belady-curve` (every capacity), `vllm` and `belady-prefix` at one capacity (4,096 blocks; the grid runs
19 of these), `lru-curve`.

    KMESH_DATASETS=../shared/datasets .venv/bin/python benchmarks/curve_scaling_bench.py \\
        [--max-reads 16000000] [--repeat-max-reads 600000] [--json OUT.json] [--plot OUT.png]
"""

from __future__ import annotations

import argparse
import json
import os
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


def stream_of(src: Path, mode: str, n_reads: int):
    """The first requests of the tiled stream holding at least n_reads block reads."""
    from kmesh_trace.oracle.stream import AccessStream, next_uses

    base = mooncake_stream(src)
    copies = -(-n_reads // len(base))
    if mode == "fresh":
        tiled = base.tile(copies)
        obj, elig, starts = tiled.obj, tiled.eligible, tiled.req_start
    else:
        n = len(base)
        obj, elig = np.tile(base.obj, copies), np.tile(base.eligible, copies)
        starts = np.append((base.req_start[:-1][None, :] + (np.arange(copies) * n)[:, None]).ravel(), copies * n)
    r = int(np.searchsorted(starts, n_reads))  # requests kept
    m = int(starts[r])
    obj, elig = obj[:m], elig[:m]
    k = np.tile(base.num_prompt_tokens, copies)[:r]
    nr = np.tile(base.num_reads, copies)[:r]
    return AccessStream(512, obj, elig, next_uses(obj, elig), starts[:r + 1], k, nr,
                        int(obj.max()) + 1 if m else 0)


def requests_of(stream):
    """RequestBlocks for the vllm model (its hashes are the stream's dense ids; no output)."""
    from kmesh_trace.oracle.stream import RequestBlocks

    s, k, nr = stream.req_start, stream.num_prompt_tokens.tolist(), stream.num_reads.tolist()
    obj = stream.obj.tolist()
    return [RequestBlocks(i, str(i), k[i], 0, obj[s[i]:s[i + 1]]) for i in range(stream.num_requests)]


def child(src: Path, mode: str, n_reads: int, kernel: str) -> dict:
    from kmesh_trace.oracle.blockpool import simulate_pool
    from kmesh_trace.oracle.curves import belady_curve, lru_curve
    from kmesh_trace.oracle.policies import POLICIES, Workload

    def run(stream, reqs):
        if kernel == "belady-curve":
            return belady_curve(stream).max_level
        if kernel == "lru-curve":
            return lru_curve(stream).max_level
        if kernel == "vllm":
            return simulate_pool(reqs, block_size=512, num_usable_blocks=CAPACITY, timed=False,
                                 stream=stream).total_hit_blocks
        return POLICIES[kernel].simulate(Workload.of_stream(stream), CAPACITY).hit_blocks

    small = stream_of(src, "fresh", 1000)
    run(small, requests_of(small))  # numba's compiled code loaded from its cache, outside the timing
    before = _rss()
    stream = stream_of(src, mode, n_reads)
    reqs = requests_of(stream) if kernel == "vllm" else None
    with_stream = _rss()
    t0 = time.perf_counter()
    result = run(stream, reqs)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"mode": mode, "kernel": kernel, "block_reads": len(stream), "seconds": seconds, "result": int(result),
            "peak_bytes": peak, "stream_bytes": with_stream - before, "kernel_peak_bytes": peak - with_stream}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, default=DATASETS / "mooncake" / "conversation_trace.jsonl")
    ap.add_argument("--min-reads", type=int, default=100_000)
    ap.add_argument("--max-reads", type=int, default=16_000_000)
    ap.add_argument("--repeat-max-reads", type=int, default=600_000)
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--child", nargs=3, metavar=("MODE", "READS", "KERNEL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.src, args.child[0], int(args.child[1]), args.child[2])))
        return
    if not args.src.is_file():
        sys.exit(f"{args.src} not found; pass --src with the Mooncake conversation_trace.jsonl")
    rows = []
    kernels = args.kernels.split(",")
    for mode, top in (("fresh", args.max_reads), ("repeat", args.repeat_max_reads)):
        n = args.min_reads
        while n <= top:
            for kernel in kernels:
                cmd = [sys.executable, str(HERE), "--src", str(args.src), "--child", mode, str(n), kernel]
                subprocess.run(cmd[:-4] + ["--child", mode, str(args.min_reads), kernel], check=True,
                               capture_output=True)  # numba's cache, outside the timing
                row = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
                row["bytes_per_read"] = (row["stream_bytes"] + row["kernel_peak_bytes"]) / row["block_reads"]
                rows.append(row)
                print(f"{mode:6} {kernel:13} {row['block_reads']:>11,} reads  {row['seconds']:8.3f} s  "
                      f"{row['seconds'] / row['block_reads'] * 1e9:7.1f} ns/read  peak {row['peak_bytes'] / 2**20:6.0f} MiB;"
                      f" stream + kernel {row['bytes_per_read']:.1f} B/read", flush=True)
            n *= 2
    if args.json:
        args.json.write_text(json.dumps({"uptime": os.getloadavg(), "rows": rows}, indent=2))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for mode in ("fresh", "repeat"):
            for kernel in kernels:
                pts = [(r["block_reads"], r["seconds"]) for r in rows if r["mode"] == mode and r["kernel"] == kernel]
                if pts:
                    x, y = zip(*pts)
                    ax.loglog(x, y, "o-" if mode == "fresh" else "s--", label=f"{kernel} ({mode} ids)")
        ax.set_xlabel("block reads")
        ax.set_ylabel("kernel seconds")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
