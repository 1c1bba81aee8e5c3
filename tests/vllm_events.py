"""vLLM's real in-process scheduler publishing its KV events (ZeroMQ, ipc://) to the project's real Listener.

`PressuredScheduler` drives `vllm.v1.core.sched.scheduler.Scheduler` (0.32, or 0.33 ahead on the path) over
a small pool without a model: each step it feeds back one sampled token per request whose prompt is
computed, as a model runner would. Requests arrive a few per step with prompts of hundreds of tokens
that share system prompts and set kv_cache_report_mode "full", so requests wait (every failed admission
attempt re-announces the head's hit), get preempted and re-admitted. The engine's own count of each
request's hit (`prefill_stats.num_cached_tokens`, what the OpenAI usage reports as cached_tokens) is
kept per request.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from vllm.config import CacheConfig, KVEventsConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kmesh_trace.capture.listen import Listener, PublisherSpec

init_none_hash(sha256)
BS = 32
MAX_LEN = 2048


@dataclass
class Workload:
    """Requests of one seed: (arrival step, prompt, output tokens), in arrival order."""

    requests: list[tuple[int, list[int], int]] = field(default_factory=list)


def pressured_workload(seed: int, n: int = 30) -> Workload:
    """`n` requests of 200-700 tokens: one of three system prompts (2-6 blocks), then a unique tail;
    a third of them repeat an earlier request's prompt with more turns (agentic), 4-40 output tokens."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 30000) for _ in range(BS * rng.randint(2, 6) + rng.randrange(BS))] for _ in range(3)]
    w, step, prompts = Workload(), 0, []
    for _ in range(n):
        if prompts and rng.random() < 0.33:
            base = rng.choice(prompts)
        else:
            base = list(rng.choice(systems))
        prompt = base + [rng.randrange(1, 30000) for _ in range(rng.randint(40, 300))]
        prompt = prompt[:MAX_LEN - 64]
        prompts.append(prompt)
        w.requests.append((step, prompt, rng.randint(4, 40)))
        step += rng.choice((0, 0, 1, 2, 4))
    return w


class PressuredScheduler:
    """A real scheduler over `num_blocks` blocks publishing on ipc:// endpoints in `sock_dir`."""

    def __init__(self, model_dir, sock_dir: Path, num_blocks: int, max_num_batched_tokens: int = 512):
        mc = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=MAX_LEN, dtype="float32", seed=0)
        sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens, max_model_len=MAX_LEN,
                             is_encoder_decoder=False, enable_chunked_prefill=True)
        cc = CacheConfig(block_size=BS, enable_prefix_caching=True)
        cc.num_gpu_blocks = num_blocks
        self.endpoint, self.replay = f"ipc://{sock_dir}/ev.sock", f"ipc://{sock_dir}/rp.sock"
        ev = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=self.endpoint,
                            replay_endpoint=self.replay, topic="kv")
        vc = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, kv_events_config=ev)
        kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=32,
                                                            dtype=torch.float32))])
        self.s = Scheduler(vllm_config=vc, kv_cache_config=kv, block_size=BS,
                           structured_output_manager=StructuredOutputManager(vc))
        self.hasher = get_request_block_hasher(BS, sha256)
        self.reqs: dict[str, Request] = {}
        self.cached_tokens: dict[str, int] = {}  # the engine's count, as its usage reports it
        self.num_preemptions = 0
        self.num_batches = 0  # batches published (the listener has them all when its next seq is this)
        publish = self.s.kv_event_publisher.publish

        def counted(batch) -> None:
            self.num_batches += 1
            publish(batch)

        self.s.kv_event_publisher.publish = counted

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args={"kv_cache_report_mode": "full"})
        req = Request(rid, list(prompt), sp, None, block_hasher=self.hasher)
        self.reqs[rid] = req
        self.s.add_request(req)

    def step(self) -> None:
        out = self.s.schedule()
        self.num_preemptions += len(out.preempted_req_ids or ())
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.reqs[rid]
            done = req.num_computed_tokens + out.num_scheduled_tokens[rid] >= req.num_tokens
            sampled.append([7 + len(req.output_token_ids)] if done else [])
        outs = self.s.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={k: i for i, k in enumerate(ids)}, sampled_token_ids=sampled))
        for eco in outs.values():
            for o in eco.outputs:
                if o.prefill_stats is not None:
                    self.cached_tokens[o.request_id] = o.prefill_stats.num_cached_tokens

    def run(self, w: Workload, max_steps: int = 20000) -> None:
        pending, step = list(w.requests), 0
        while (pending or self.s.get_num_unfinished_requests()) and step < max_steps:
            while pending and pending[0][0] <= step:
                _, prompt, n_out = pending.pop(0)
                self.add(f"r{len(self.reqs)}", prompt, n_out)
            self.step()
            step += 1
        assert not pending and not self.s.get_num_unfinished_requests(), "the workload did not finish"

    def close(self) -> None:
        self.s.shutdown()


def record(model_dir, sock_dir: Path, out: Path, w: Workload, num_blocks: int,
           capture: Path | None = None) -> PressuredScheduler:
    """Runs `w` on a real scheduler while a real Listener records its published events into `out` (and,
    with `capture`, the plugin's recorder, attached as the plugin attaches it, captures the same run)."""
    eng = PressuredScheduler(model_dir, sock_dir, num_blocks)
    if capture is not None:
        from kmesh_trace.capture import hooks

        hooks.install(eng.s, str(capture))
    spec = PublisherSpec(eng.endpoint, eng.replay, "kv", block_size=BS, num_usable_blocks=num_blocks - 1)
    listener = Listener(out, [spec], replay_timeout_s=3)
    t = threading.Thread(target=listener.run, daemon=True)
    t.start()
    time.sleep(0.3)  # the subscription joins; anything it missed comes back from the replay socket
    try:
        eng.run(w)
        deadline = time.monotonic() + 30
        rec = listener.recorders[0]
        while time.monotonic() < deadline and (rec.expected or 0) < eng.num_batches:
            time.sleep(0.05)
    finally:
        listener.stop.set()
        t.join(timeout=30)
        eng.close()
    return eng
