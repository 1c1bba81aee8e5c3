"""The headroom bound: how many prefill tokens the stock prefix cache left on the table.

Replays a trace's block access stream through each requested policy at each capacity and compares
the stock cache with the Belady bound (DESIGN.md "Definitions the analyses share"). Stock is read
from the capture when every invocation has an engine hit count (`num_cached_tokens`), else it is
the `vllm` block-pool model. headroom_tokens = stock prefill - belady prefill, at the capacity the
stock cache had: the trace's usable blocks when the trace records them (and, for a modelled stock,
they are among the capacities asked for), else the first capacity asked for.

What each policy counts as a hit (all share the token rules in `policies.base`):
- infinite: any eligible prompt read of a block written before;
- lru, vllm: a prefix lookup, stopping at the request's first miss;
- belady: any eligible prompt read of a resident block, the cache chosen with the future known.
A read is eligible when it is one of the first (num_prompt_tokens - 1) // block_size blocks; every
prompt block hash the trace lists (an import's partial last block included) is one read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.policies import POLICIES, Replay, Workload, get_policy
from kmesh_trace.oracle.policies.base import replay_of
from kmesh_trace.oracle.stream import RequestBlocks, request_blocks

DEFAULT_POLICIES = ("infinite", "lru", "vllm", "belady")


@dataclass
class HeadroomResult:
    block_size: int
    results: list[Replay]
    headroom_tokens: int | None
    headroom_capacity_blocks: int | None
    stock_source: str | None  # "capture", "vllm", or None when no stock could be had
    stock: Replay | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        rows = [r.to_dict() for r in self.results]
        if self.stock is not None and self.stock_source == "capture":
            rows.append(self.stock.to_dict())
        return {
            "block_size": self.block_size,
            "results": rows,
            "headroom_tokens": self.headroom_tokens,
            "headroom_capacity_blocks": self.headroom_capacity_blocks,
            "stock_source": self.stock_source,
        }


def headroom(trace, capacities: Sequence[int] | None = None, policies: Sequence[str] | None = None, *,
             engine: str | None = None) -> HeadroomResult:
    """Headroom of an opened trace (`kmesh_trace.trace.open_trace`)."""
    meta = trace.engines.get(engine, {}) if engine is not None else trace.metadata
    return headroom_of_requests(request_blocks(trace, engine), meta.get("block_size"), capacities, policies,
                                num_usable_blocks=meta.get("num_usable_blocks"))


def headroom_of_requests(requests: Sequence[RequestBlocks], block_size: int | None,
                         capacities: Sequence[int] | None = None, policies: Sequence[str] | None = None, *,
                         num_usable_blocks: int | None = None) -> HeadroomResult:
    if not block_size:
        raise KmeshTraceError("the trace has no block size in its engine metadata; it cannot be analysed.")
    names = list(policies or DEFAULT_POLICIES)
    for name in names:
        get_policy(name)
    if capacities:
        caps = [int(c) for c in capacities]
    elif num_usable_blocks:
        caps = [int(num_usable_blocks)]
    else:
        raise KmeshTraceError("the trace does not record the engine's usable blocks (imported traces cannot); "
                              "pass --capacity-blocks N.")
    if any(c <= 0 for c in caps):
        raise KmeshTraceError("capacities must be positive block counts.")
    workload = Workload(block_size, requests)
    results = []
    for name in names:
        pol = POLICIES[name]
        for c in caps:
            results.append(pol.replay(workload, c))

    notes: list[str] = []
    captured = bool(requests) and all(r.stock_cached_tokens is not None for r in requests)
    if captured and num_usable_blocks:
        cap = int(num_usable_blocks)
        tokens = np.fromiter((r.stock_cached_tokens for r in requests), np.int64, len(requests))
        stock, source = replay_of("stock", cap, workload.stream, tokens // block_size), "capture"
        stock.measured_hit_tokens = tokens
    else:
        cap = int(num_usable_blocks) if num_usable_blocks in caps else caps[0]
        if captured:
            notes.append("the capture has engine hit counts but no usable-block count; stock is the vllm model.")
        stock = _find(results, "vllm", cap) or POLICIES["vllm"].replay(workload, cap)
        source = "vllm"
    bound = _find(results, "belady", cap) or POLICIES["belady"].replay(workload, cap)
    return HeadroomResult(block_size, results, stock.prefill_tokens - bound.prefill_tokens, cap, source, stock, notes)


def _find(results: list[Replay], policy: str, capacity: int) -> Replay | None:
    return next((r for r in results if r.policy == policy and r.capacity_blocks == capacity), None)


def plot_headroom(result: HeadroomResult, path: str | Path) -> Path:
    """Hit ratio against capacity, one line per policy (stock from a capture as one point)."""
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise KmeshTraceError(f"cannot plot to {path.name}: give a .png or .svg file.")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.policy for r in result.results):
        rows = sorted((r for r in result.results if r.policy == name), key=lambda r: r.capacity_blocks)
        ax.plot([r.capacity_blocks for r in rows], [r.hit_ratio for r in rows], marker="o", label=name,
                linestyle="--" if name == "infinite" else "-")
    if result.stock is not None and result.stock_source == "capture":
        ax.scatter([result.stock.capacity_blocks], [result.stock.hit_ratio], marker="*", s=160, color="black",
                   zorder=5, label="stock (capture)")
    caps = [r.capacity_blocks for r in result.results]
    if caps and max(caps) >= 8 * min(caps):  # capacities usually double: equal steps on a log axis
        ax.set_xscale("log", base=2)
    ax.set_xlabel(f"capacity (blocks of {result.block_size} tokens)")
    ax.set_ylabel("hit ratio (hit block reads / block reads)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    title = "Prefix-cache hit ratio by policy"
    if result.headroom_tokens is not None:
        title += f" (headroom {result.headroom_tokens:,} tokens at {result.headroom_capacity_blocks:,} blocks)"
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
