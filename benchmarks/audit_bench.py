"""Corpus audit time against the bare minimum: reading every line and parsing it as JSON.

Baseline (measured in the same run): open every JSONL file the audit reads, iterate its lines and
parse each with the fastest JSON parser installed (orjson when present, else the standard json
module; malformed lines are caught and skipped). The audit is `audit_corpus(DIR)` in full: walk,
SHA-256 of every file, line classification, duplicates, field coverage, evidence, content edges.
Runs alternate (baseline, audit, audit, baseline, ...) after one warm-up of each, so both see the
same page cache; each adjacent (baseline, audit) pair gives one ratio, so a load spike on a shared
machine skews one pair, not the figure. Reported: the median of the pair ratios (the figure the
goal applies to) and min(audit)/min(baseline). Goal: ratio <= 2.0.

    .venv/bin/python benchmarks/audit_bench.py [DIR] [--repeats N] [--json]

DIR defaults to ../shared/datasets/lmcache-agent-trace (or $KMESH_DATASETS/lmcache-agent-trace).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from kmesh_trace.audit.corpus import audit_corpus
from kmesh_trace.audit.inventory import walk

GOAL = 2.0


def default_dir() -> Path:
    env = os.environ.get("KMESH_DATASETS")
    base = Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared" / "datasets"
    return base / "lmcache-agent-trace"


def fastest_parser():
    try:
        import orjson

        return "orjson " + orjson.__version__, orjson.loads, orjson.JSONDecodeError
    except ImportError:
        return "json (stdlib)", json.loads, ValueError


def baseline(paths: list[Path], loads, error) -> int:
    n = 0
    for p in paths:
        with open(p, "rb") as f:
            for line in f:
                try:
                    loads(line)
                    n += 1
                except error:
                    pass
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", nargs="?", type=Path, default=default_dir())
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.dir.is_dir():
        print(f"Error: corpus {args.dir} not found; give its directory or set KMESH_DATASETS.", file=sys.stderr)
        return 1
    inv = walk(args.dir)
    paths = [inv.root / rel for files in inv.sources.values() for rel in files.jsonl]
    name, loads, error = fastest_parser()

    def time_it(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    run_base = lambda: baseline(paths, loads, error)
    run_audit = lambda: audit_corpus(args.dir)
    run_base(), run_audit()  # warm-up: page cache, imports
    base_s, audit_s = [], []
    for i in range(args.repeats):
        order = (run_base, run_audit) if i % 2 == 0 else (run_audit, run_base)
        for fn in order:
            (base_s if fn is run_base else audit_s).append(time_it(fn))
    a = audit_corpus(args.dir).to_dict()
    result = {
        "corpus": str(args.dir), "jsonl_files": len(paths), "bytes": a["bytes"], "nonempty_lines": a["nonempty_lines"],
        "parser": name, "repeats": args.repeats,
        "baseline_s": {"median": statistics.median(base_s), "min": min(base_s), "samples": base_s},
        "audit_s": {"median": statistics.median(audit_s), "min": min(audit_s), "samples": audit_s},
        "ratio_median": statistics.median(a / b for a, b in zip(audit_s, base_s)),
        "ratio_min": min(audit_s) / min(base_s),
        "goal": GOAL,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"corpus {result['corpus']}: {len(paths)} JSONL files, {a['bytes']:,} bytes, {a['nonempty_lines']:,} lines")
        print(f"baseline (read + {name} parse): median {result['baseline_s']['median'] * 1e3:.1f} ms, "
              f"min {result['baseline_s']['min'] * 1e3:.1f} ms")
        print(f"audit corpus:                  median {result['audit_s']['median'] * 1e3:.1f} ms, "
              f"min {result['audit_s']['min'] * 1e3:.1f} ms")
        print(f"ratio audit/baseline: median of pairs {result['ratio_median']:.2f}, min/min {result['ratio_min']:.2f} "
              f"(goal <= {GOAL})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
