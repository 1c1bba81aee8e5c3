"""`import weka` against sub-agents per file (linear in sub-agents).

One conversation file with N sub-agents (each one request of 4 blocks, after one main request; with
`--shape interleaved`, after a main request of its own, so that each sub-agent's parent is searched among
N main requests), for N doubling from --start to --stop; each size imported --rounds times in this process
(median). Linear: time(2N) / time(N) stays near 2. Baseline in the same run: `json.loads` of the same file.

    .venv/bin/python benchmarks/weka_subagents_bench.py [--start 4000] [--stop 64000] [--rounds 3] [--shape interleaved] [--compact]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kmesh_trace.datasets.importers.weka import import_weka


def conversation(n: int, shape: str = "after-main") -> dict:
    main = {"t": 0.0, "type": "n", "in": 16, "out": 3, "hash_ids": [1, 2, 3, 4], "api_time": 1.0}
    subs = [{"t": 1.0 + i * 1e-3, "type": "subagent", "agent_id": f"agent_{i:06d}", "subagent_type": "Explore",
             "requests": [{"t": 1.0 + i * 1e-3, "type": "n", "in": 16, "out": 3,
                           "hash_ids": [1, 2, 10 + 2 * i, 11 + 2 * i], "api_time": 0.5}]} for i in range(n)]
    if shape == "interleaved":  # a main request just before each sub-agent starts
        mains = [{**main, "t": 1.0 + i * 1e-3 - 1e-4, "hash_ids": [1, 2, 3, 5 + i]} for i in range(n)]
        return {"id": "c0", "block_size": 4, "hash_id_scope": "local",
                "requests": [e for pair in zip(mains, subs) for e in pair]}
    return {"id": "c0", "block_size": 4, "hash_id_scope": "local", "requests": [main, *subs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", type=int, default=4000)
    ap.add_argument("--stop", type=int, default=64000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shape", choices=("after-main", "interleaved"), default="after-main")
    ap.add_argument("--compact", action="store_true", help="Write the file without spaces, as kv-cache-tester does "
                    "(the import's fast path reads only that); default: json.dumps' spaces (the plain path).")
    args = ap.parse_args()
    rows, n, prev = [], args.start, None
    with tempfile.TemporaryDirectory() as d:
        while n <= args.stop:
            src = Path(d) / f"n{n}"
            src.mkdir()
            (src / "c0.json").write_text(json.dumps(conversation(n, args.shape), separators=(',', ':') if args.compact else None))
            base, imp = [], []
            for r in range(args.rounds):
                t0 = time.perf_counter()
                json.loads((src / "c0.json").read_bytes())
                base.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                import_weka(src, Path(d) / f"out{n}-{r}")
                imp.append(time.perf_counter() - t0)
            t = statistics.median(imp)
            row = {"subagents": n, "bytes": (src / "c0.json").stat().st_size, "import_s": round(t, 3),
                   "json_loads_s": round(statistics.median(base), 4),
                   "x_previous": None if prev is None else round(t / prev, 2)}
            print(f"{n:>8,} sub-agents  {row['bytes'] / 1e6:6.1f} MB  import {t:7.3f} s  json.loads "
                  f"{row['json_loads_s']:.4f} s  x previous {row['x_previous']}")
            rows.append(row)
            prev, n = t, n * 2
    print(json.dumps({"rounds": args.rounds, "shape": args.shape, "compact": args.compact, "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
