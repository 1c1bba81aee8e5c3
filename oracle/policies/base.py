"""The one small interface every cache policy implements, and the replay result they return.

A policy replays a `Workload` (`kmesh_trace.oracle.workload`: the requests and/or their flat `AccessStream`) at a capacity in
blocks and returns, per request, how many of its prompt blocks were served from the cache. Token
counts and ratios are derived here, once, from those per-request hits, so every policy follows
the same engine rules: a request's hit tokens are its hit blocks times the block size, capped so
the last prompt token is always computed; prefill tokens are the rest of its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

import numpy as np

from kmesh_trace.oracle.stream import AccessStream, RequestBlocks
from kmesh_trace.oracle.workload import Workload

__all__ = ["Policy", "PolicyResult", "StreamPolicy", "Workload", "reference_accesses", "result_of"]


@dataclass
class PolicyResult:
    """One policy at one capacity: per-request hit blocks, and the totals derived from them."""

    policy: str
    capacity_blocks: int | None
    block_size: int
    hit_blocks_per_request: np.ndarray  # int64
    num_prompt_tokens: np.ndarray  # int64 per request
    num_reads: int  # every prompt block hash the trace lists
    num_evictions: int | None = None
    #: Hit tokens the engine reported (stock from a capture); None: derived from the hit blocks.
    measured_hit_tokens: np.ndarray | None = None

    @property
    def hit_tokens_per_request(self) -> np.ndarray:
        if self.measured_hit_tokens is not None:
            return self.measured_hit_tokens
        return np.minimum(self.hit_blocks_per_request * self.block_size, np.maximum(self.num_prompt_tokens - 1, 0))

    @property
    def hit_blocks(self) -> int:
        return int(self.hit_blocks_per_request.sum())

    @property
    def hit_tokens(self) -> int:
        return int(self.hit_tokens_per_request.sum())

    @property
    def prefill_tokens(self) -> int:
        return int(self.num_prompt_tokens.sum()) - self.hit_tokens

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.num_reads if self.num_reads else 0.0

    @property
    def token_hit_ratio(self) -> float:
        """Hit prompt tokens / prompt tokens: vLLM's prefix_cache_hits / prefix_cache_queries."""
        total = int(self.num_prompt_tokens.sum())
        return self.hit_tokens / total if total else 0.0

    def to_dict(self) -> dict:
        return {"policy": self.policy, "capacity_blocks": self.capacity_blocks, "hit_blocks": self.hit_blocks,
                "hit_tokens": self.hit_tokens, "prefill_tokens": self.prefill_tokens, "hit_ratio": self.hit_ratio,
                "token_hit_ratio": self.token_hit_ratio}


def result_of(policy: str, capacity: int | None, stream: AccessStream, hits: np.ndarray,
              num_evictions: int | None = None) -> PolicyResult:
    return PolicyResult(policy, capacity, stream.block_size, hits.astype(np.int64, copy=False), stream.num_prompt_tokens,
                        int(stream.num_reads.sum()), num_evictions)


class StreamPolicy:
    """A policy simulated by a kernel over the access stream: `kernel(stream, capacity) ->
    (per-request hit blocks, evictions or None)`; replay adds the totals."""

    name: str
    summary: str
    needs_capacity = True
    #: The kernel runs outside the GIL (C through ctypes): replays at many capacities can share threads.
    releases_gil = False

    @staticmethod
    def kernel(stream: AccessStream, capacity: int) -> tuple[np.ndarray, int | None]:
        raise NotImplementedError

    def simulate(self, workload: Workload, capacity_blocks: int | None) -> PolicyResult:
        assert capacity_blocks is not None or not self.needs_capacity
        hits, evictions = self.kernel(workload.stream, capacity_blocks)
        return result_of(self.name, capacity_blocks, workload.stream, hits, evictions)


class Policy(Protocol):
    name: str
    #: One line on what the policy counts as a hit (shown by `kmesh-trace headroom --help`).
    summary: str
    #: False for policies whose result does not depend on capacity (infinite).
    needs_capacity: bool

    def simulate(self, workload: Workload, capacity_blocks: int | None) -> PolicyResult: ...


# ---- plain reference semantics, shared by the reference implementations ------------------------

def reference_accesses(requests: Sequence[RequestBlocks], block_size: int) -> Iterator[list[tuple[int, bool]]]:
    """Per request, its simulated accesses as (hash, hit-eligible), written plainly from the
    contract in stream.py: eligible prompt reads first, then the writes. Tests and reference
    implementations use it; the fast paths use AccessStream instead."""
    for r in requests:
        full = r.prompt_hashes[:r.num_full_prompt_blocks(block_size)]
        elig = r.max_hit_blocks(block_size)
        yield [(h, i < elig) for i, h in enumerate(full)] + [(h, False) for h in r.output_hashes]
