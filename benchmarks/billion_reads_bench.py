"""The exact default curve on 10^7 .. 10^9 block reads in bounded memory: time, peak memory, bytes per read.

The agentic stream is built as benchmarks/oracle_peer_bench.py builds it (the Claude Code samples in
$KMESH_DATASETS/weka-claude-code, sub-agents' requests flattened in time, repeated with fresh ids, copy k
starting k * 30 s after copy k - 1, merged in time order, 512-token blocks), written once under /tmp for the
largest size asked; each smaller point of the series is a prefix of it (whole lines, cut at the first line
that reaches the size: the same time-ordered merge, shorter). Fresh ids here start at 2^62 (the peer bench's
2^40 meets the copies' own ids past 65,536 conversation copies).

Each point runs `kmesh-trace headroom FILE --window last-half --json` in a fresh process under GNU time
(whole process: wall seconds, peak RSS), with the bounded-memory path forced (`--streamed`) or left to choose.

    KMESH_DATASETS=/work/shared/datasets .venv/bin/python benchmarks/billion_reads_bench.py build --reads 1e9
    .venv/bin/python benchmarks/billion_reads_bench.py run --reads 1e7,1e8 [--as-limit-gib 9] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
DATASETS = Path(os.environ.get("KMESH_DATASETS") or HERE.parents[2] / "shared" / "datasets")
BIN = Path(sys.executable).parent
BLOCK = 512
WORK = Path("/tmp/billion")
FRESH = 1 << 62


def _flatten(requests, t0=0.0):
    for r in requests:
        if r.get("type") == "subagent":
            yield from _flatten(r.get("requests", []), t0 + float(r.get("t", 0.0)))
        else:
            yield t0 + float(r["t"]), int(r["in"]), int(r.get("out", 0)), r["hash_ids"]


def conversations() -> list[list[tuple]]:
    files = sorted((DATASETS / "weka-claude-code").glob("trace_*.json"))
    if not files:
        sys.exit(f"no weka-claude-code samples under {DATASETS} (set KMESH_DATASETS)")
    convs = []
    for f in files:
        d = json.loads(f.read_text())
        per = BLOCK // int(d["block_size"])
        reqs = []
        for t, n_in, n_out, hashes in _flatten(d["requests"]):
            n_blocks = -(-n_in // BLOCK)
            ids = [int(hashes[per * (g + 1) - 1]) if per * (g + 1) <= len(hashes) else -1 for g in range(n_blocks)]
            reqs.append((t, n_in, n_out, ids))
        convs.append(reqs)
    return convs


def build(out: Path, min_reads: int, stagger_s: float = 30.0) -> dict:
    """The agentic stream of at least `min_reads` block reads (oracle_peer_bench.build_agentic's, fresh ids
    from 2^62), and where it reaches each size of the series (`out`.index.json: reads -> bytes of whole lines)."""
    convs = conversations()
    reads_per_round = sum(len(r[3]) for c in convs for r in c)
    copies = math.ceil(min_reads / reads_per_round)
    events = [(k * stagger_s + t, k, ci, j) for k in range(copies) for ci, conv in enumerate(convs)
              for j, (t, _, _, _) in enumerate(conv)]
    events.sort()
    import numpy as np

    # Per request: its ids as an array and where its fresh ids (-1: a partial last block) are.
    arrays = [[(np.array(ids, np.int64), [g for g, h in enumerate(ids) if h < 0]) for _, _, _, ids in conv]
              for conv in convs]
    fresh = FRESH
    marks, reads, written = {}, 0, 0
    wanted = sorted({int(x) for x in (1e7, 2e7, 5e7, 1e8, 2e8, 5e8, 1e9, 2e9)})
    with open(out, "w", buffering=16 << 20) as f:
        for t, k, ci, j in events:
            _, n_in, n_out, ids = convs[ci][j]
            arr, holes = arrays[ci][j]
            out_ids = (arr + ((k * len(convs) + ci) << 24)).tolist()
            for g in holes:
                fresh += 1
                out_ids[g] = fresh
            line = json.dumps({"timestamp": int(t * 1000), "input_length": n_in, "output_length": n_out,
                               "hash_ids": out_ids}) + "\n"
            f.write(line)
            written += len(line)  # ASCII: characters are bytes
            reads += len(ids)
            while wanted and reads >= wanted[0]:
                marks[wanted.pop(0)] = {"bytes": written, "reads": reads}
    meta = {"copies": copies, "requests": len(events), "block_reads": reads, "bytes": written, "prefixes": marks}
    Path(str(out) + ".index.json").write_text(json.dumps(meta, indent=1))
    return meta
