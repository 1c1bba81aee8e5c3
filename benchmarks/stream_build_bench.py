"""The access stream's build alone: seconds, CPU seconds and the peak it adds, on Mooncake-format JSONL files.

Each child process reads a file's columns as `headroom FILE` does (datasets/importers/mooncake.py
`read_mooncake`), resets its high-water mark (/proc/self/clear_refs), then builds the `AccessStream` of the
hash-only rows (`flat`: `oracle/workload.py` `_flat_stream`, what `headroom --policies lru,belady` runs) or
of one `RequestBlocks` per row (`requests`: `AccessStream.from_requests`, what a workload with requests
builds, the default curve's), and reports the build's wall and CPU seconds, the resident memory it added at
its peak (`peak_lift_MiB`; freed memory the process reuses hides part of it) and the stream's own arrays.
`--baseline COMMIT` runs the same children as of that commit (`benchmarks/baseline_tree.py`), interleaved
round by round with this tree's, so before / after share one load.

    .venv/bin/python benchmarks/stream_build_bench.py FILE.jsonl [FILE...] [--rounds 3] [--baseline COMMIT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, sys, time
import numpy as np
from kmesh_trace.datasets.importers.mooncake import read_mooncake
from kmesh_trace.oracle import workload
from kmesh_trace.oracle.stream import AccessStream, RequestBlocks
import kmesh_trace.oracle.stream_index  # the kernels loaded before the clock

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key))

src, variant = sys.argv[1], sys.argv[2]
cols, _ = read_mooncake(src)
flat = np.frombuffer(cols.hashes, np.uint64)
num_reads = np.diff(np.asarray(cols.offsets, np.int64))
tokens = np.asarray(cols.num_prompt_tokens, np.int64)
if variant == "requests":
    off = cols.offsets
    reqs = [RequestBlocks(i, str(i), int(tokens[i]), 0, flat[off[i]:off[i + 1]].tolist()) for i in range(len(tokens))]
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
rss = status("VmRSS")
t0, c0 = time.perf_counter(), time.process_time()
if variant == "flat":
    s = workload._flat_stream(tokens, num_reads, flat, 512)
else:
    s = AccessStream.from_requests(reqs, 512)
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
lift = status("VmHWM") - rss
own = (s.obj.nbytes + s.eligible.nbytes + s.next_use.nbytes + s.req_start.nbytes) / 2**20
print(json.dumps({"accesses": len(s), "objects": s.num_objects, "s": round(wall, 3), "cpu_s": round(cpu, 3),
                  "peak_lift_MiB": round(lift, 1), "stream_MiB": round(own, 1)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="flat,requests")
    ap.add_argument("--baseline", help="Also build as of this commit (before / after, interleaved).")
    args = ap.parse_args()
    trees = {"this tree": [sys.executable, "-P"]}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            sys.path.insert(0, str(HERE))
            from baseline_tree import baseline_python

            trees[f"@{args.baseline}"] = baseline_python(args.baseline, Path(tmp))
        for rnd in range(args.rounds):
            for src in args.files:
                for variant in args.variants.split(","):
                    for tree, python in trees.items():
                        out = subprocess.run([*python, "-c", CHILD, str(src), variant], capture_output=True, text=True,
                                             cwd=tmp, check=True).stdout
                        row = {"round": rnd + 1, "file": src.name, "variant": variant, "tree": tree,
                               **json.loads(out), "load": os.getloadavg()[0]}
                        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
