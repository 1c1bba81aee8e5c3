"""The compiled `vllm` block-pool replay (`blockpool_compiled`) against the Python model (`PoolReplay`, the
reference): random workloads, sequential and timed, with duplicate hashes inside a prompt, partial and
missing hash lists, generated blocks, stalls and deferrals; every per-request result and the final free
queue must be equal. (`simulate_pool` without holds runs the compiled replay, so every test of the model
against vLLM's real pool in test_blockpool_vllm.py and test_blockpool_admission_vllm.py runs it too.)"""

from __future__ import annotations

import numpy as np
import pytest

from kmesh_trace.oracle.blockpool import HoldPolicy, PoolReplay, pool_hits, simulate_pool
from kmesh_trace.oracle.stream import RequestBlocks

FIELDS = ("hit_blocks", "hit_tokens", "num_evictions", "admitted", "stalled", "free_queue", "num_deferred")


def _workload(rng):
    bs, vocab = int(rng.integers(1, 5)), int(rng.integers(1, 8))
    reqs, t = [], 0
    for i in range(int(rng.integers(1, 12))):
        p, g = int(rng.integers(0, 20)), int(rng.integers(0, 6))
        n_hashes = p // bs + (1 if p % bs and rng.random() < 0.5 else 0)  # a partial last hash, sometimes
        n_hashes = max(0, n_hashes - (1 if rng.random() < 0.2 else 0))  # a list shorter than the prompt
        prompt = [int(x) for x in rng.integers(0, vocab, n_hashes)]
        output = [int(x) for x in rng.integers(0, vocab, int(rng.integers(0, 3)))] if rng.random() < 0.5 else []
        t += int(rng.integers(0, 5))
        reqs.append(RequestBlocks(i, f"r{i}", p, g, prompt, output, t, t + int(rng.integers(0, 10))))
    return reqs, bs


@pytest.mark.parametrize("timed", [False, True])
def test_compiled_replay_equals_the_python_model(timed):
    rng = np.random.default_rng(26)
    seen = {"hits": 0, "evictions": 0, "stalled": 0, "refused": 0, "deferred": 0}
    for _ in range(1500):
        reqs, bs = _workload(rng)
        cap = int(rng.integers(1, 15))
        want = PoolReplay(reqs, bs, cap, None, timed).run()
        got = simulate_pool(reqs, block_size=bs, num_usable_blocks=cap, timed=timed)
        for f in FIELDS:
            assert getattr(got, f) == getattr(want, f), (f, bs, cap, reqs)
        seen["hits"] += want.total_hit_blocks > 0
        seen["evictions"] += want.total_evictions > 0
        seen["stalled"] += any(want.stalled)
        seen["refused"] += not all(want.admitted)
        seen["deferred"] += want.num_deferred > 0
    assert min(seen["hits"], seen["evictions"], seen["stalled"], seen["refused"]) > 20, seen
    assert (seen["deferred"] > 20) == timed, seen


def test_pool_hits_at_many_capacities_equal_the_python_model():
    """The grid's replay (one memo of the kernel's inputs across capacities) gives each capacity's hits and
    evictions as the reference does, timed or not (decided from the requests, as simulate_pool does)."""
    rng = np.random.default_rng(261)
    for _ in range(300):
        reqs, bs = _workload(rng)
        if rng.random() < 0.3:
            reqs[int(rng.integers(0, len(reqs)))].finish_ns = None  # not every request timed: sequential
        timed = all(r.arrival_ns is not None and r.finish_ns is not None for r in reqs)
        memo: dict = {}
        for cap in rng.integers(1, 15, 4):
            want = PoolReplay(reqs, bs, int(cap), None, timed).run()
            hits, evictions = pool_hits(reqs, block_size=bs, num_usable_blocks=int(cap), memo=memo)
            assert hits.tolist() == want.hit_blocks and evictions == want.total_evictions, (bs, cap, reqs)
        assert memo["pool_inputs"][0] == timed


HOLD_FIELDS = ("parent_index", "family", "status", "num_blocks", "num_children_served", "release_reason",
               "held_block_steps", "taken_ns", "released_ns")


def _policy(rng, reqs, timed):
    """Random holds over a workload: parents before (and, sometimes, after) their children, families
    shared or per parent, every cap and expiry drawn at random."""
    n = len(reqs)
    parent_of = {c: int(rng.integers(0, n)) for c in range(n) if rng.random() < 0.5}
    parents = set(parent_of.values()) | {int(x) for x in rng.integers(0, n, int(rng.integers(0, 3)))}
    release_after = {p: int(rng.integers(-1, 4)) for p in parents}
    family_of = {p: rng.choice(["a", "b", "c", str(p + 1)]) for p in parents if rng.random() < 0.5}
    return HoldPolicy(release_after, parent_of, family_of,
                      expiry_ns=int(rng.integers(0, 12)) if timed and rng.random() < 0.5 else None,
                      max_held_blocks=int(rng.integers(0, 12)) if rng.random() < 0.3 else None,
                      max_families=int(rng.integers(0, 3)) if rng.random() < 0.3 else None)


@pytest.mark.parametrize("timed", [False, True])
def test_compiled_replay_with_holds_equals_the_python_model(timed):
    rng = np.random.default_rng(2626 + timed)
    seen: dict[str, int] = {}
    for _ in range(1500):
        reqs, bs = _workload(rng)
        cap = int(rng.integers(1, 15))
        policy = _policy(rng, reqs, timed)
        want = PoolReplay(reqs, bs, cap, policy, timed).run()
        got = simulate_pool(reqs, block_size=bs, num_usable_blocks=cap, holds=policy, timed=timed)
        for f in FIELDS:
            assert getattr(got, f) == getattr(want, f), (f, bs, cap, policy, reqs)
        assert [[getattr(h, f) for f in HOLD_FIELDS] for h in got.holds] == \
            [[getattr(h, f) for f in HOLD_FIELDS] for h in want.holds], (bs, cap, policy, reqs)
        assert (got.held_block_steps, got.held_block_seconds) == (want.held_block_steps, want.held_block_seconds)
        for h in want.holds:
            seen[h.status] = seen.get(h.status, 0) + 1
            seen[h.release_reason] = seen.get(h.release_reason, 0) + 1
        seen["stalled"] = seen.get("stalled", 0) + any(want.stalled)
        seen["deferred"] = seen.get("deferred", 0) + (want.num_deferred > 0)
    # every status, every release reason (expiry only timed) and the pool's own cases were reached
    wanted = ["taken", "refused_blocks", "refused_families", "empty", "not_needed", "children", "pressure", "close",
              "stalled"] + (["expiry", "deferred"] if timed else [])
    assert min(seen.get(k, 0) for k in wanted) > 10, seen
