"""`vllm`: the stock engine's cache, by wrapping the vLLM V1 block-pool model of
`kmesh_trace.oracle.blockpool` (its docstring says what it copies from vLLM, rule by rule), or, for a
hybrid engine's workload (several KV cache groups), `kmesh_trace.oracle.hybrid_pool`.

Hits are vLLM's: a prefix lookup that stops at the first miss, over blocks that survived the free
queue's eviction order, with running requests' blocks pinned; capacity is the pool's usable blocks.
On a hybrid workload a hit is the prefix every group serves, and the capacity is the one pool all
groups share (native/kernels/hybrid_pool.c, tested equal to its reference and to vLLM's manager).
"""

from __future__ import annotations

import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.blockpool import pool_hits
from kmesh_trace.oracle.hybrid_mamba import simulate_hybrid
from kmesh_trace.oracle.policies.base import PolicyResult, Workload, result_of


class VLLM:
    name = "vllm"
    summary = "model of vLLM V1's block pool: free-queue order, prefix lookup, running requests pinned"
    needs_capacity = True
    releases_gil = True  # the replay is C (native/kernels/pool.c); only its inputs and result are Python

    def simulate(self, workload: Workload, capacity_blocks: int | None) -> PolicyResult:
        assert capacity_blocks is not None
        if workload.columns is None:
            raise KmeshTraceError("the vllm policy replays requests, not a bare access stream; build the workload from a trace.")
        if workload.hybrid:
            if workload.requests is None:
                raise KmeshTraceError("the hybrid vllm pool model replays requests; build the workload with them.")
            res = simulate_hybrid(list(workload.requests), workload.groups, num_usable_blocks=int(capacity_blocks),
                                  timed=workload.timed, retention_interval=workload.retention_interval)
            return result_of(self.name, capacity_blocks, workload.stream, np.asarray(res.hit_blocks, np.int64),
                             res.total_evictions)
        hits, evictions = pool_hits(workload.requests, block_size=workload.block_size,
                                    num_usable_blocks=int(capacity_blocks), stream=workload.stream,
                                    memo=workload.derived, columns=workload.columns)
        return result_of(self.name, capacity_blocks, workload.stream, hits, evictions)
