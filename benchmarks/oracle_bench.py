"""Oracle benchmark: our `belady` and `lru` kernels against libCacheSim's C `Belady` and `LRU`.

One run, one block stream: the Mooncake conversation trace (../shared/datasets, or --src),
imported, turned into the oracle's AccessStream (one row per simulated block access, next uses
precomputed), and written as a libCacheSim oracleGeneral trace holding the same accesses in the
same order (object size 1, so a capacity in bytes is a capacity in blocks). Timed: only the
simulation, best of --repeat, each side reading its precomputed next uses (ours from memory,
libCacheSim from its mmap'd binary trace, its hash table sized to the stream). Ratio = ours / libCacheSim (<= 1.0: at least as fast).

The policies differ in semantics, so their hit ratios differ: ours count hits the engine's way
(prefix lookup for lru, reads only, Belady with optional admission), libCacheSim's count every
access. The point is the cost of the same stream through each simulator.

Scaling: the stream tiled (fresh block ids per copy) to --scale-to accesses, each size in a fresh
subprocess that reports its simulation time and peak resident memory (ru_maxrss).

    .venv/bin/python benchmarks/oracle_bench.py [--src conversation_trace.jsonl] [--scale-to 50000000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kmesh_trace.oracle.policies.belady import belady_hits
from kmesh_trace.oracle.policies.lru import lru_hits
from kmesh_trace.oracle.stream import NEVER, AccessStream
from kmesh_trace.oracle.workload import request_blocks
from kmesh_trace.trace import open_trace

DEFAULT_SRC = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mooncake" / "conversation_trace.jsonl"
_ORACLE_GENERAL = np.dtype([("clock_time", "<u4"), ("obj_id", "<u8"), ("obj_size", "<u4"), ("next_access_vtime", "<i8")])


def load_stream(src: Path, timings: dict | None = None) -> AccessStream:
    from kmesh_trace.datasets.importers.mooncake import import_mooncake

    timings = {} if timings is None else timings
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        import_mooncake(src, Path(d) / "trace")
        trace = open_trace(Path(d) / "trace")
        reqs = request_blocks(trace)
        timings["import_s"] = time.perf_counter() - t
        t = time.perf_counter()
        stream = AccessStream.from_requests(reqs, trace.block_size)
        timings["stream_s"] = time.perf_counter() - t
        return stream


def write_oracle_general(stream: AccessStream, path: Path, times: int = 1) -> None:
    """The stream (tiled `times`, fresh ids per copy) as libCacheSim's oracleGeneral binary trace;
    next_access_vtime is the next access of the object of any kind (-1: none), as libCacheSim defines it."""
    n = len(stream)
    order = np.argsort(stream.obj, kind="stable")
    nxt = np.full(n, -1, np.int64)
    same = stream.obj[order[1:]] == stream.obj[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    rec = np.zeros(n, _ORACLE_GENERAL)
    rec["obj_size"] = 1
    with open(path, "wb") as f:
        for i in range(times):
            rec["clock_time"] = 0
            rec["obj_id"] = stream.obj.astype(np.uint64) + np.uint64(i * stream.num_objects + 1)
            rec["next_access_vtime"] = np.where(nxt >= 0, nxt + i * n, -1)
            rec.tofile(f)


def best_of(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def hashpower(num_objects: int) -> int:
    """libCacheSim's hash table size (log2 buckets) sized to the stream: its default (24) costs a
    fixed ~0.3 s on this stream, which would flatter us."""
    return max(16, int(np.ceil(np.log2(max(num_objects, 2)))))


def libcachesim_run(cls_name: str, path: Path, capacity: int, num_objects: int) -> float:
    import libcachesim as lcs

    reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
    cache = getattr(lcs, cls_name)(cache_size=capacity, hashpower=hashpower(num_objects))
    miss_ratio, _ = cache.process_trace(reader)
    return 1.0 - miss_ratio


def compare(stream: AccessStream, capacities: list[int], repeat: int) -> list[dict]:
    try:
        import libcachesim  # noqa: F401
    except ImportError:
        sys.exit("libCacheSim is not installed: pip install libcachesim (or pip install -e '.[dev]')")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "stream.oracleGeneral.bin"
        write_oracle_general(stream, path)
        for cap in capacities:
            belady_hits(stream, cap), lru_hits(stream, cap)  # compile outside the timing
            for ours_name, ours, theirs in (("belady", belady_hits, "Belady"), ("lru", lru_hits, "LRU")):
                t_ours, (hits, _) = best_of(lambda: ours(stream, cap), repeat)
                t_lcs, lcs_hit_ratio = best_of(lambda: libcachesim_run(theirs, path, cap, stream.num_objects), repeat)
                rows.append({"policy": ours_name, "capacity_blocks": cap, "accesses": len(stream),
                             "ours_s": t_ours, "libcachesim_s": t_lcs, "ratio": t_ours / t_lcs,
                             "ours_hit_ratio": int(hits.sum()) / int(stream.num_reads.sum()),
                             "libcachesim_hit_ratio": lcs_hit_ratio})
    return rows


def scale_child(src: Path, times: int, capacity: int, with_lcs: bool) -> dict:
    """Runs in a fresh process: tile, simulate, report times and peak memory."""
    base = load_stream(src)
    t = time.perf_counter()
    stream = base.tile(times)
    t_tile = time.perf_counter() - t
    del base
    head = _head(stream)
    belady_hits(head, capacity), lru_hits(head, capacity)  # compile outside the timing
    out = {"accesses": len(stream), "tile_s": t_tile}
    t = time.perf_counter()
    hits, _ = belady_hits(stream, capacity)
    out["belady_s"], out["belady_hits"] = time.perf_counter() - t, int(hits.sum())
    t = time.perf_counter()
    hits, _ = lru_hits(stream, capacity)
    out["lru_s"], out["lru_hits"] = time.perf_counter() - t, int(hits.sum())
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if with_lcs:
        base = load_stream(src)
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "tiled.oracleGeneral.bin"
            write_oracle_general(base, path, times)
            del stream
            for name in ("Belady", "LRU"):
                t = time.perf_counter()
                libcachesim_run(name, path, capacity, base.num_objects * times)
                out[f"libcachesim_{name}_s"] = time.perf_counter() - t
    return out


def _head(stream: AccessStream) -> AccessStream:
    """The first request only: enough to trigger JIT compilation for these array types."""
    e = int(stream.req_start[1])
    return AccessStream(stream.block_size, stream.obj[:e], stream.eligible[:e],
                        np.where(stream.next_use[:e] < e, stream.next_use[:e], NEVER), stream.req_start[:2],
                        stream.num_prompt_tokens[:1], stream.num_reads[:1], stream.num_objects)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, default=DEFAULT_SRC, help="Mooncake JSONL trace")
    ap.add_argument("--capacities", default="256,1024,8192", help="cache capacities in blocks")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--scale-to", type=int, default=50_000_000, help="largest tiled stream, in accesses (0: skip)")
    ap.add_argument("--scale-capacity", type=int, default=8192)
    ap.add_argument("--scale-libcachesim", action="store_true", help="also time libCacheSim on the tiled streams")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--_child", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.src.is_file():
        sys.exit(f"{args.src} not found; pass --src with the Mooncake conversation_trace.jsonl")
    if args._child:
        print(json.dumps(scale_child(args.src, args._child, args.scale_capacity, args.scale_libcachesim)))
        return

    timings: dict = {}
    stream = load_stream(args.src, timings)
    caps = [int(c) for c in args.capacities.split(",")]
    rows = compare(stream, caps, args.repeat)
    scale = []
    if args.scale_to:
        n = len(stream)
        for times in sorted({max(1, round(args.scale_to / d / n)) for d in (8, 4, 2, 1)}):
            cmd = [sys.executable, __file__, "--src", str(args.src), "--_child", str(times),
                   "--scale-capacity", str(args.scale_capacity)] + (["--scale-libcachesim"] if args.scale_libcachesim else [])
            res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ)
            scale.append(json.loads(res.stdout.strip().splitlines()[-1]))
    report = {"source": str(args.src), "accesses": len(stream), "block_reads": int(stream.num_reads.sum()),
              **timings, "compare": rows, "scale": scale}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"stream: {args.src.name}: {len(stream):,} accesses ({report['block_reads']:,} block reads); "
          f"import + RequestBlocks {timings['import_s']:.2f} s, AccessStream (ids, next uses) {timings['stream_s']:.3f} s "
          "(not in the timings below; libCacheSim's side reads a precomputed binary trace)")
    print(f"{'policy':8} {'capacity':>9} {'ours s':>9} {'libCacheSim s':>14} {'ratio':>7} {'ours hit':>9} {'lcs hit':>8}")
    for r in rows:
        print(f"{r['policy']:8} {r['capacity_blocks']:>9,} {r['ours_s']:>9.4f} {r['libcachesim_s']:>14.4f} "
              f"{r['ratio']:>7.3f} {r['ours_hit_ratio']:>9.4f} {r['libcachesim_hit_ratio']:>8.4f}")
    if scale:
        print(f"scaling (tiled, capacity {args.scale_capacity:,} blocks; ns per access; peak RSS of the process)")
        for s in scale:
            ns = {k: 1e9 * s[f"{k}_s"] / s["accesses"] for k in ("belady", "lru")}
            line = (f"  {s['accesses']:>12,} accesses: belady {s['belady_s']:7.2f} s ({ns['belady']:5.1f} ns)"
                    f"  lru {s['lru_s']:7.2f} s ({ns['lru']:5.1f} ns)"
                    f"  peak RSS {s['peak_rss_bytes'] / 2**30:5.2f} GiB")
            if "libcachesim_Belady_s" in s:
                line += (f"  libCacheSim Belady {s['libcachesim_Belady_s']:.2f} s, LRU {s['libcachesim_LRU_s']:.2f} s")
            print(line)


if __name__ == "__main__":
    main()
