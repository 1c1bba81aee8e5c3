"""A small hybrid engine's trace (a sliding-window and a full-attention KV cache group) written in code."""

from __future__ import annotations

import random

from kmesh_trace.kv_groups import KVCacheGroup
from kmesh_trace.writer import TraceWriter

BS = 16
GROUPS = (KVCacheGroup("sliding_window", BS, 2, 2048, sliding_window=48), KVCacheGroup("full_attention", BS, 2, 2048))


def _rows(seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 1000) for _ in range(5 * BS + 3)]
    rows = []
    for i in range(24):
        prompt = (system if i % 3 else []) + [rng.randrange(1, 1000) for _ in range(rng.randrange(BS, 6 * BS))]
        if i >= 4 and i % 4 == 0:  # a repeat of an earlier prompt
            prompt = list(rows[i - 4]["prompt_token_ids"])
        out = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 2 * BS))]
        rows.append({"request_id": f"r{i}", "seq": i, "num_prompt_tokens": len(prompt), "num_output_tokens": len(out),
                     "prompt_token_ids": prompt, "output_token_ids": out, "status": "finished"})
    return rows


def write_hybrid(path, groups=GROUPS, usable: int = 40, **extra):
    rows = _rows()
    meta = {"block_size": BS, "num_usable_blocks": usable, "engine": "kmesh-trace test",
            "kv_cache_groups": [g.to_json() for g in groups], **extra}
    with TraceWriter(path, "e0", meta, source="generated:hybrid-test") as w:
        w.write("invocations", {k: [r[k] for r in rows] for k in rows[0]})
    return path
