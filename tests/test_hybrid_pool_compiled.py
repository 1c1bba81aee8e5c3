"""The compiled hybrid pool replay (native/kernels/hybrid_pool.c) against its Python reference
(`HybridPoolReplay`): random workloads over random layouts of full-attention, sliding-window and
chunked-local groups, sequential and timed, roomy and tight pools; every per-request result, the
deferrals and the final free queue compared."""

from __future__ import annotations

import random

import pytest

from kmesh_trace.datasets.workloads.hold_stress import Scenario, ScenarioRequest
from kmesh_trace.kv_groups import KVCacheGroup
from kmesh_trace.oracle.hybrid_pool import HybridPoolReplay, simulate_hybrid_pool
from random_scenarios import random_family_workload  # tests/ is on sys.path


def random_groups(rng: random.Random, bs: int) -> tuple[KVCacheGroup, ...]:
    def full(page=4096):
        return KVCacheGroup("full_attention", bs, 1, page)

    def window():
        w = rng.choice([2, bs - 1, bs, bs + 1, 2 * bs, 3 * bs + 5, 6 * bs])
        return KVCacheGroup("sliding_window", bs, 1, 4096, sliding_window=max(w, 2))

    def chunked():
        return KVCacheGroup("chunked_local", bs, 1, 4096, attention_chunk_size=rng.choice([bs, 2 * bs, 3 * bs + 3]))

    make = [full, window, chunked, lambda: full(8192), window]
    groups = [rng.choice(make)() for _ in range(rng.randrange(1, 5))]
    if rng.random() < 0.3:
        groups.append(groups[0])  # an equal spec: looked up together
    return tuple(groups)


def long_outputs(sc: Scenario, rng: random.Random, num_groups: int) -> Scenario:
    reqs = []
    for q in sc.requests:
        out = [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 8 * sc.block_size))]
        reqs.append(ScenarioRequest(q.request_id, q.prompt_token_ids, len(out), out, q.family_id, q.parent_index,
                                    q.num_expected_children, q.arrival_ns, q.finish_ns))
    longest = max(-(-len(q.prompt_token_ids) // sc.block_size) for q in reqs)
    return Scenario(sc.name, sc.block_size, max(longest * num_groups + rng.randrange(-2, 3), 1) + 1, reqs)


@pytest.mark.parametrize("timed", [False, True])
@pytest.mark.parametrize("tight", [False, True])
def test_compiled_equals_reference(timed, tight):
    rng = random.Random(1000 + 2 * timed + tight)
    for _ in range(250):
        sc = random_family_workload(rng, timed=timed)
        groups = random_groups(rng, sc.block_size)
        if tight:
            sc = long_outputs(sc, rng, len(groups))
        else:
            sc = Scenario(sc.name, sc.block_size, (sc.num_physical_blocks - 1) * len(groups) + 1, sc.requests)
        reqs = sc.request_blocks()
        retention = rng.choice([0, None, sc.block_size, 3 * sc.block_size])
        ref = HybridPoolReplay(reqs, groups, sc.num_usable_blocks, timed, retention).run()
        got = simulate_hybrid_pool(reqs, groups, num_usable_blocks=sc.num_usable_blocks, timed=timed,
                                   retention_interval=retention)
        for f in ("hit_tokens", "hit_blocks", "num_evictions", "admitted", "stalled", "free_queue", "num_deferred"):
            assert getattr(got, f) == getattr(ref, f), f


def test_a_bad_retention_interval_is_one_sentence():
    from kmesh_trace.errors import KmeshTraceError

    with pytest.raises(KmeshTraceError, match="prefix_cache_retention_interval"):
        simulate_hybrid_pool([], (KVCacheGroup("full_attention", 16),), num_usable_blocks=8, retention_interval=24)


def test_unknown_outputs_and_short_hash_lists():
    """Requests whose generated blocks the stream does not identify, and prompts listing fewer hashes than
    their full blocks (a hash-only trace): private keys, and lookups that stop at the listed blocks."""
    rng = random.Random(9)
    for _ in range(100):
        sc = random_family_workload(rng)
        groups = random_groups(rng, sc.block_size)
        reqs = sc.request_blocks()
        for r in reqs:
            if rng.random() < 0.5:
                r.output_hashes = []
            if rng.random() < 0.3:
                r.prompt_hashes = r.prompt_hashes[:rng.randrange(len(r.prompt_hashes) + 1)]
        n = (sc.num_physical_blocks - 1) * len(groups)
        retention = rng.choice([0, None])
        ref = HybridPoolReplay(reqs, groups, n, retention_interval=retention).run()
        got = simulate_hybrid_pool(reqs, groups, num_usable_blocks=n, timed=False, retention_interval=retention)
        assert (got.hit_tokens, got.num_evictions, got.free_queue) == (ref.hit_tokens, ref.num_evictions,
                                                                       ref.free_queue)


@pytest.mark.parametrize("timed", [False, True])
def test_one_full_attention_group_is_the_single_group_model(timed):
    """With one full-attention group the hybrid replay is `simulate_pool`'s (the single-group model)."""
    from kmesh_trace.oracle.blockpool import simulate_pool

    rng = random.Random(77 + timed)
    for _ in range(150):
        sc = random_family_workload(rng, timed=timed)
        if rng.random() < 0.5:
            sc = long_outputs(sc, rng, 1)
        reqs = sc.request_blocks()
        one = simulate_pool(reqs, block_size=sc.block_size, num_usable_blocks=sc.num_usable_blocks, timed=timed)
        got = simulate_hybrid_pool(reqs, (KVCacheGroup("full_attention", sc.block_size),),
                                   num_usable_blocks=sc.num_usable_blocks, timed=timed)
        for f in ("hit_tokens", "num_evictions", "admitted", "stalled", "free_queue", "num_deferred"):
            assert getattr(got, f) == getattr(one, f), f
