"""Import benchmark: the Mooncake conversation trace.

Baseline, measured in the same run: read every line and `json.loads` it (the least any importer
must do). Reports the import/baseline time ratio (goal <= 1.5) and Parquet bytes per block hash
(goal <= 4), both for the whole invocations table and for the hash column alone.

    .venv/bin/python benchmarks/import_bench.py [--src PATH] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from kmesh_trace.datasets.importers.mooncake import import_mooncake


def default_src() -> Path:
    base = Path(os.environ.get("KMESH_DATASETS", Path(__file__).resolve().parents[2] / "shared" / "datasets"))
    return base / "mooncake" / "conversation_trace.jsonl"


def baseline(src: Path) -> None:
    with open(src, "rb") as f:
        for line in f:
            if line.strip():
                json.loads(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=default_src())
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if not args.src.is_file():
        print(f"Error: {args.src} not found (set KMESH_DATASETS or pass --src).", file=sys.stderr)
        return 1
    base_t, imp_t = [], []
    work = Path(tempfile.mkdtemp(prefix="kmesh-import-bench-"))
    try:
        for i in range(args.repeat):  # alternate, so drift hits both arms alike
            t0 = time.perf_counter()
            baseline(args.src)
            base_t.append(time.perf_counter() - t0)
            out = work / f"t{i}"
            t0 = time.perf_counter()
            rep = import_mooncake(args.src, out)
            imp_t.append(time.perf_counter() - t0)
        parts = sorted((out / "invocations").rglob("part-*.parquet"))
        total_bytes = sum(p.stat().st_size for p in parts)
        col_bytes = 0
        for p in parts:
            md = pq.ParquetFile(p).metadata
            for rg in range(md.num_row_groups):
                for c in range(md.num_columns):
                    col = md.row_group(rg).column(c)
                    if col.path_in_schema.startswith("prompt_block_hashes"):
                        col_bytes += col.total_compressed_size
    finally:
        shutil.rmtree(work, ignore_errors=True)
    b, m = statistics.median(base_t), statistics.median(imp_t)
    print(f"source: {args.src} ({rep.num_invocations:,} requests, {rep.num_block_hashes:,} block hashes)")
    print(f"baseline read + json.loads: median {b * 1e3:.1f} ms over {args.repeat}")
    print(f"kmesh-trace import:         median {m * 1e3:.1f} ms over {args.repeat}")
    print(f"ratio import/baseline:      {m / b:.2f}  (goal <= 1.5)")
    print(f"Parquet bytes per block hash: {total_bytes / rep.num_block_hashes:.2f} (whole table), "
          f"{col_bytes / rep.num_block_hashes:.2f} (hash column)  (goal <= 4)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
