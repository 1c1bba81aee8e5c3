"""Open benchmark: what validating every part on open costs, on a trace of many small parts.

A long capture writes one part per table per flush (about one a second), so a trace of hours holds
thousands of parts. Baseline, measured in the same run: read every part's Parquet footer
(`pyarrow.parquet.read_metadata`), the least any reader that checks the schema version must do.
Reports open_trace / baseline (median of rounds; goal <= 2).

    .venv/bin/python benchmarks/open_bench.py [--parts 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from kmesh_trace.trace import open_trace
from kmesh_trace.writer import TraceWriter


def build(root: Path, parts: int) -> None:
    with TraceWriter(root, "e0", {"block_size": 16, "num_usable_blocks": 64}) as w:
        for i in range(parts):
            w.write("block_events", {"seq": [2 * i, 2 * i + 1], "ts_ns": [i, i], "event": ["allocated", "freed"],
                                     "block_id": [i % 64, i % 64], "ref_cnt": [1, 0], "request_id": [f"r{i}"] * 2})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "t"
        build(root, args.parts)
        files = sorted(root.glob("*/engine=*/part-*.parquet"))
        ratios, base_s, open_s = [], [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for p in files:
                pq.read_metadata(p)
            t1 = time.perf_counter()
            t = open_trace(root)
            t2 = time.perf_counter()
            assert t.row_counts()["block_events"] == 2 * args.parts and not t.problems
            base_s.append(t1 - t0)
            open_s.append(t2 - t1)
            ratios.append((t2 - t1) / (t1 - t0))
    print(f"{args.parts} parts: open_trace {statistics.median(open_s) * 1e3:.1f} ms, footers only "
          f"{statistics.median(base_s) * 1e3:.1f} ms; open / footers = {statistics.median(ratios):.2f} "
          f"(median of {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
