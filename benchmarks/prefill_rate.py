"""Prefill throughput of a Llama-3-8B-shaped decoder on this GPU, in plain PyTorch (not vLLM, not a benchmark of
any serving engine): random bf16 weights of the model's geometry, one prompt of L tokens computed from position 0
(causal scaled-dot-product attention with grouped KV heads, rotary positions, SwiGLU MLP, logits of the last
token only, as an engine's prefill computes them). Prints one JSON line per L: seconds (median of the timed
runs after warm-up) and tokens per second, then the two-term cost fit a + b * position per token that
`kmesh_trace.oracle.prefill_cost.PrefillCost.fit_points` makes of them.

    python benchmarks/prefill_rate.py [--lengths 512,2048,8192,16384] [--repeat 5]

Weights are random: the arithmetic (and so the time) of a forward pass does not depend on their values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

# Meta-Llama-3-8B's config.json: hidden 4096, 32 layers, 32 heads, 8 KV heads, MLP 14336, vocab 128256.
GEOMETRY = dict(hidden=4096, layers=32, heads=32, kv_heads=8, mlp=14336, vocab=128256, rope_theta=500000.0)


def _weights(g: dict, device: str) -> dict:
    def w(*shape):
        return torch.empty(*shape, device=device, dtype=torch.bfloat16).normal_(0, 0.02)

    hd = g["hidden"] // g["heads"]
    layers = [dict(qkv=w((g["heads"] + 2 * g["kv_heads"]) * hd, g["hidden"]), o=w(g["hidden"], g["hidden"]),
                   up=w(2 * g["mlp"], g["hidden"]), down=w(g["hidden"], g["mlp"]),
                   n1=torch.ones(g["hidden"], device=device, dtype=torch.bfloat16),
                   n2=torch.ones(g["hidden"], device=device, dtype=torch.bfloat16)) for _ in range(g["layers"])]
    return dict(embed=w(g["vocab"], g["hidden"]), head=w(g["vocab"], g["hidden"]), layers=layers,
                norm=torch.ones(g["hidden"], device=device, dtype=torch.bfloat16))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x[..., ::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


@torch.inference_mode()
def prefill(tokens: torch.Tensor, wts: dict, g: dict) -> torch.Tensor:
    hd = g["hidden"] // g["heads"]
    n = tokens.shape[0]
    pos = torch.arange(n, device=tokens.device, dtype=torch.float32)
    inv = g["rope_theta"] ** (-torch.arange(0, hd, 2, device=tokens.device, dtype=torch.float32) / hd)
    ang = torch.outer(pos, inv)
    cos, sin = ang.cos().to(torch.bfloat16)[:, None, :], ang.sin().to(torch.bfloat16)[:, None, :]
    x = wts["embed"][tokens]
    for L in wts["layers"]:
        h = F.rms_norm(x, (g["hidden"],), L["n1"])
        q, k, v = (h @ L["qkv"].T).split([g["heads"] * hd, g["kv_heads"] * hd, g["kv_heads"] * hd], dim=-1)
        q = _rope(q.view(n, g["heads"], hd), cos, sin).transpose(0, 1)
        k = _rope(k.view(n, g["kv_heads"], hd), cos, sin).transpose(0, 1)
        v = v.view(n, g["kv_heads"], hd).transpose(0, 1)
        a = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0]
        x = x + a.transpose(0, 1).reshape(n, g["hidden"]) @ L["o"].T
        h = F.rms_norm(x, (g["hidden"],), L["n2"])
        gate, up = (h @ L["up"].T).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ L["down"].T
    return F.rms_norm(x[-1:], (g["hidden"],), wts["norm"]) @ wts["head"].T  # the last token's logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="512,2048,8192,16384")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    g = GEOMETRY
    wts = _weights(g, "cuda")
    rows = []
    for n in map(int, args.lengths.split(",")):
        tokens = torch.randint(0, g["vocab"], (n,), device="cuda")
        for _ in range(2):
            prefill(tokens, wts, g)
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            prefill(tokens, wts, g)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        rows.append((n, s))
        print(json.dumps({"tokens": n, "seconds": s, "tokens_per_s": n / s, "runs_s": times}))
    import numpy as np

    # Per token at position p: a + b * p, so a prompt of n tokens costs c + a * n + b * n^2 / 2 (the model of
    # kmesh_trace.oracle.prefill_cost); least squares over the lengths measured.
    n = np.array([r[0] for r in rows], float)
    y = np.array([r[1] for r in rows], float)
    (a, b, c), *_ = np.linalg.lstsq(np.column_stack([n, n * n / 2, np.ones_like(n)]), y, rcond=None)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "geometry": g,
                      "seconds_per_token": a, "seconds_per_token_position": b, "seconds_per_request": c,
                      "tokens_per_s_at_0": 1 / a if a > 0 else None, "attention_factor": b / a if a > 0 else None}))


if __name__ == "__main__":
    main()
