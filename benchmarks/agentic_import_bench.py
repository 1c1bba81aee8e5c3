"""Agentic import benchmark: `import weka` at corpus scale, and `headroom` over the result.

Input: the kv-cache-tester sample conversations (../shared/datasets/weka-claude-code), repeated with
fresh file ids (`local` scope, so each copy gets its own id namespace) until the directory holds at
least --block-ids block ids; built under /tmp and removed afterwards. Two sizes (--small-block-ids
and --block-ids) show whether peak memory depends on the corpus size.

Per size, in child processes (so each peak RSS is its own), alternating baseline and import:
- baseline: read every file and `json.loads` it (the least any importer must do);
- import: `import_weka` of the same directory.
Reports the import/baseline time ratio (goal <= 1.5), Parquet bytes per block id (goal <= 4) and the
peak RSS of each (goal: bounded, independent of the corpus size).

Then `headroom` over the large import: per policy (infinite, lru, vllm, belady), a child process
loads the trace, builds the access stream and runs the policy; reports the policy's time and the
child's peak RSS, each per block read; and one `kmesh-trace headroom` run with all four.

    .venv/bin/python benchmarks/agentic_import_bench.py [--block-ids 10000000] [--small-block-ids 1000000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

HERE = Path(__file__).resolve()
POLICIES = ("infinite", "lru", "vllm", "belady")


def default_src() -> Path:
    base = Path(os.environ.get("KMESH_DATASETS", HERE.parents[2] / "shared" / "datasets"))
    return base / "weka-claude-code"


def build_corpus(src: Path, out: Path, min_block_ids: int) -> tuple[int, int]:
    """Copies of the sample conversations with fresh ids until >= min_block_ids; (files, block ids)."""
    samples = []
    for p in sorted(src.glob("*.json")):
        conv = json.loads(p.read_bytes())
        n = 0
        stack = list(conv["requests"])
        while stack:
            r = stack.pop()
            if r.get("type") == "subagent":
                stack.extend(r["requests"])
            else:
                n += len(r["hash_ids"])
        samples.append((conv, n))
    out.mkdir(parents=True)
    files = ids = copy = 0
    while ids < min_block_ids:
        for conv, n in samples:
            conv = dict(conv, id=f"{conv['id']}-c{copy:05d}")
            (out / f"{conv['id']}.json").write_text(json.dumps(conv, separators=(",", ":")))
            files += 1
            ids += n
        copy += 1
    return files, ids


CHILD_BASELINE = """
import json, sys, time, resource
from pathlib import Path
t0 = time.perf_counter()
for p in sorted(Path(sys.argv[1]).glob("*.json")):
    json.loads(p.read_bytes())
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

CHILD_IMPORT = """
import json, sys, time, resource
from kmesh_trace.datasets.importers.weka import import_weka
t0 = time.perf_counter()
rep = import_weka(sys.argv[1], sys.argv[2])
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "block_ids": rep.num_block_hashes, "requests": rep.num_invocations, "malformed": rep.num_malformed_lines}))
"""

CHILD_POLICY = """
import json, sys, time, resource
from kmesh_trace.trace import open_trace
from kmesh_trace.oracle.policies import POLICIES, Workload
from kmesh_trace.oracle.workload import request_blocks
t0 = time.perf_counter()
with open_trace(sys.argv[1]) as t:
    reqs = request_blocks(t)
    bs = t.block_size
w = Workload(bs, reqs)
reads = int(w.stream.num_reads.sum())
t1 = time.perf_counter()
res = POLICIES[sys.argv[2]].simulate(w, int(sys.argv[3]))
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "policy_s": t2 - t1, "reads": reads, "hit_ratio": res.hit_ratio,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def child(code: str, *args) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"child failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def parquet_bytes(trace: Path, num_ids: int) -> tuple[float, float]:
    parts = sorted((trace / "invocations").rglob("part-*.parquet"))
    total = sum(p.stat().st_size for p in parts)
    col = 0
    for p in parts:
        md = pq.ParquetFile(p).metadata
        for rg in range(md.num_row_groups):
            for c in range(md.num_columns):
                cc = md.row_group(rg).column(c)
                if cc.path_in_schema.startswith("prompt_block_hashes"):
                    col += cc.total_compressed_size
    return total / num_ids, col / num_ids


def bench_size(src: Path, work: Path, min_ids: int, pairs: int) -> dict:
    corpus = work / f"corpus-{min_ids}"
    files, ids = build_corpus(src, corpus, min_ids)
    base, imp = [], []
    for i in range(pairs):  # A B B A: drift hits both arms alike
        order = ("base", "import") if i % 2 == 0 else ("import", "base")
        for arm in order:
            if arm == "base":
                base.append(child(CHILD_BASELINE, corpus))
            else:
                out = work / f"trace-{min_ids}-{i}"
                imp.append(child(CHILD_IMPORT, corpus, out))
                if i < pairs - 1:
                    shutil.rmtree(out)
    trace = work / f"trace-{min_ids}-{pairs - 1}"
    per_id, per_id_col = parquet_bytes(trace, imp[-1]["block_ids"])
    b = statistics.median(x["seconds"] for x in base)
    m = statistics.median(x["seconds"] for x in imp)
    best = min(x["seconds"] for x in imp) / min(x["seconds"] for x in base)
    shutil.rmtree(corpus)
    return {"files": files, "block_ids": imp[-1]["block_ids"], "requests": imp[-1]["requests"],
            "malformed": imp[-1]["malformed"], "baseline_s": b, "import_s": m, "ratio": m / b, "ratio_min": best,
            "bytes_per_id": per_id, "bytes_per_id_hash_column": per_id_col,
            "baseline_peak_rss": max(x["peak_rss"] for x in base), "import_peak_rss": max(x["peak_rss"] for x in imp),
            "trace": str(trace)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=default_src())
    ap.add_argument("--block-ids", type=int, default=10_000_000)
    ap.add_argument("--small-block-ids", type=int, default=1_000_000)
    ap.add_argument("--pairs", type=int, default=3, help="baseline/import pairs per size (A B B A)")
    ap.add_argument("--capacity-blocks", type=int, default=4096)
    ap.add_argument("--skip-headroom", action="store_true")
    args = ap.parse_args()
    if not args.src.is_dir():
        print(f"Error: {args.src} not found (set KMESH_DATASETS or pass --src).", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="kmesh-agentic-bench-", dir="/tmp"))
    mib = 1 << 20
    print("load average at start: {:.2f} {:.2f} {:.2f} on {} CPUs".format(*os.getloadavg(), os.cpu_count()))
    try:
        sizes = {}
        for n in (args.small_block_ids, args.block_ids):
            r = sizes[n] = bench_size(args.src, work, n, args.pairs)
            print(f"corpus >= {n:,} ids: {r['files']:,} files, {r['requests']:,} requests, {r['block_ids']:,} block ids, "
                  f"{r['malformed']} malformed")
            print(f"  baseline read + json.loads: median {r['baseline_s']:.2f} s, peak RSS {r['baseline_peak_rss'] / mib:.0f} MiB")
            print(f"  import weka:                median {r['import_s']:.2f} s, peak RSS {r['import_peak_rss'] / mib:.0f} MiB")
            print(f"  ratio import/baseline:      {r['ratio']:.2f} (medians), {r['ratio_min']:.2f} (min/min)  (goal <= 1.5)")
            print(f"  Parquet bytes per block id: {r['bytes_per_id']:.3f} (whole invocations table), "
                  f"{r['bytes_per_id_hash_column']:.3f} (hash column)  (goal <= 4)")
        small, large = sizes[args.small_block_ids], sizes[args.block_ids]
        print(f"peak RSS large/small import: {large['import_peak_rss'] / small['import_peak_rss']:.2f} for "
              f"{large['block_ids'] / small['block_ids']:.1f}x the block ids (goal: bounded, ~1)")
        if args.skip_headroom:
            return 0
        trace = large["trace"]
        print(f"headroom over the large import, capacity {args.capacity_blocks:,} blocks, one child per policy:")
        for name in POLICIES:
            r = child(CHILD_POLICY, trace, name, args.capacity_blocks)
            print(f"  {name:<8} policy {r['policy_s']:.2f} s = {r['policy_s'] / r['reads'] * 1e9:.0f} ns/read; "
                  f"load + stream {r['load_s']:.2f} s; peak RSS {r['peak_rss'] / mib:.0f} MiB = "
                  f"{r['peak_rss'] / r['reads']:.0f} B/read; hit ratio {r['hit_ratio']:.4f} ({r['reads']:,} reads)")
        t0 = time.perf_counter()
        p = subprocess.run(["bash", "-c", f'command time -f "%M" {Path(sys.executable).parent}/kmesh-trace headroom '
                            f'{trace} --capacity-blocks {args.capacity_blocks} --json > /dev/null'],
                           capture_output=True, text=True)
        dt = time.perf_counter() - t0
        if p.returncode:
            raise SystemExit(p.stderr[-2000:])
        rss_kib = int(p.stderr.strip().splitlines()[-1])
        print(f"  kmesh-trace headroom (all four): {dt:.2f} s, peak RSS {rss_kib / 1024:.0f} MiB")
        print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
