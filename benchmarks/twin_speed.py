"""Speed of the twin (`kmesh-trace simulate`'s engine) on the Mooncake conversation trace.

Reads the first --requests lines of conversation_trace.jsonl (KMESH_DATASETS or ../shared/datasets), runs
them through vLLM's own scheduler in simulated time at --blocks usable 512-token blocks with the trace's own
arrivals and the default step-cost model, and prints scheduler steps per wall second, simulated requests per
wall minute, and where the wall time goes (vLLM's schedule() and update_from_output() against the rest).

    KMESH_DATASETS=/work/shared/datasets .venv/bin/python benchmarks/twin_speed.py --requests 2000 --json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def _dataset() -> Path:
    root = Path(os.environ.get("KMESH_DATASETS", Path(__file__).resolve().parents[2] / "shared" / "datasets"))
    return root / "mooncake" / "conversation_trace.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--blocks", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    src = _dataset()
    if not src.is_file():
        raise SystemExit(f"{src} is missing: set KMESH_DATASETS to the shared datasets directory.")
    from kmesh_trace.oracle.step_cost import StepCost
    from kmesh_trace.oracle.twin import EngineFlags, build_scheduler, run_twin, twin_requests
    from kmesh_trace.oracle.workload import Workload
    from kmesh_trace.sources import read_directly

    with tempfile.TemporaryDirectory() as d:
        head = Path(d) / "head.jsonl"
        with src.open() as f, head.open("w") as g:
            for _, line in zip(range(a.requests), f):
                g.write(line)
        w = Workload.from_trace(read_directly(head))
    reqs = twin_requests(list(w.requests), w.block_size)
    flags = EngineFlags(w.block_size, a.blocks, -(-max(q.num_prompt_tokens + q.num_output_tokens for q in reqs) // 512) * 512)
    t0 = time.perf_counter()
    sched = build_scheduler(flags)
    built = time.perf_counter() - t0
    spent = {"schedule": 0.0, "update_from_output": 0.0}
    for name in spent:
        inner = getattr(sched, name)

        def timed(*args, _inner=inner, _name=name):
            s = time.perf_counter()
            try:
                return _inner(*args)
            finally:
                spent[_name] += time.perf_counter() - s
        setattr(sched, name, timed)
    t1 = time.perf_counter()
    res = run_twin(reqs, flags, StepCost(), scheduler=sched)
    wall = time.perf_counter() - t1
    out = {"requests": len(reqs), "blocks": a.blocks, "build_s": built, "wall_s": wall, "steps": len(res.steps),
           "steps_per_s": len(res.steps) / wall, "requests_per_min": 60 * len(reqs) / wall,
           "simulated_s": res.end_s, "share_schedule": spent["schedule"] / wall,
           "share_update_from_output": spent["update_from_output"] / wall,
           "hit_tokens": sum(r.num_cached_tokens or 0 for r in res.requests),
           "preemptions": sum(r.num_preemptions for r in res.requests)}
    print(json.dumps(out, indent=2) if a.json else " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                             for k, v in out.items()))


if __name__ == "__main__":
    main()
