"""The twin: vLLM's own `Scheduler` and `KVCacheManager` run on a trace's requests in simulated time.

No model and no forward pass: the scheduler is vLLM's real one (the version installed), built from the
flags `vllm serve` takes (`EngineFlags`) over a KV cache of `num_gpu_blocks` usable blocks of one
full-attention group. Requests enter at their arrival times on a simulated clock (`TwinRequest`); each
step's scheduled output is fed back as the model runner would: one sampled token for every scheduled
request whose known tokens are all computed after the step (a prefill that ends, a decode), taken from the
request's output until its output length (vLLM then finishes it, `max_tokens` with `ignore_eos`). The
clock advances by the step's modelled cost (`StepCost`, `kmesh_trace.oracle.step_cost`); when nothing is
running it jumps to the next arrival.

A request is recorded as vLLM saw it (`RequestRecord`): arrival, first scheduled (the start of the step
that first gave it blocks), first token and finish (the end of the step that sampled them), the prompt
tokens its first scheduling found in the prefix cache (`num_cached_tokens`), and its preemptions. A request
longer than `max_model_len` is refused (vLLM's front end refuses it too); one the pool can never hold is
aborted when the scheduler can do nothing else (status `error`).

Token ids: a trace's exact ids when it has them; otherwise each prompt block's ids are derived from its
chained block hash (`hash_tokens`), so two requests share a token prefix exactly when they share block
hashes, and the tokens no hash covers (a partial tail, outputs without ids) are made unique to the request.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

from kmesh_trace.errors import KmeshTraceError, MissingDependencyError
from kmesh_trace.oracle.step_cost import StepCost
from kmesh_trace.oracle.stream import RequestBlocks

__all__ = ["EngineFlags", "TwinRequest", "RequestRecord", "StepRecord", "TwinResult", "Twin", "run_twin",
           "twin_requests", "hash_tokens", "vllm_version"]

_M30 = (1 << 30) - 1
#: Token ids at and above this are the request-unique fill (`hash_tokens`); derived ids stay below it.
UNIQUE_BASE = 1 << 30

#: The model config the scheduler is built with (the scheduler reads only its length limits and kind).
_TWIN_MODEL = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 1 << 31,
    "max_position_embeddings": 1 << 24, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "torch_dtype": "float16", "num_hidden_layers": 1, "rope_theta": 10000.0,
}


@dataclass(frozen=True)
class EngineFlags:
    """The `vllm serve` flags the twin's scheduler is built from (None: vLLM's default)."""

    block_size: int
    num_gpu_blocks: int  # usable blocks (vLLM's --num-gpu-blocks-override counts one more: the null block)
    max_model_len: int
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    chunked_prefill: bool = True


@dataclass
class TwinRequest:
    """One request for the twin: its prompt and the tokens the model runner samples, in order (at least one),
    given, or derived from a trace request's block hashes when the twin asks (`tokens`), so that only the
    requests in flight hold their ids."""

    request_id: str
    prompt: list[int] | None
    output: list[int] | None
    arrival_s: float | None  # None: enters when the concurrency allows (`run_twin(concurrency=...)`)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    derived_from: tuple[RequestBlocks, int] | None = field(default=None, repr=False)  # (request, block size)

    def __post_init__(self):
        if self.prompt is not None:
            self.num_prompt_tokens, self.num_output_tokens = len(self.prompt), len(self.output)

    def tokens(self) -> tuple[list[int], list[int]]:
        if self.derived_from is None:
            return self.prompt, self.output
        r, block_size = self.derived_from
        seq = hash_tokens(list(r.prompt_hashes) + list(r.output_hashes), block_size,
                          self.num_prompt_tokens + self.num_output_tokens, r.index)
        return seq[:self.num_prompt_tokens], seq[self.num_prompt_tokens:]


@dataclass
class RequestRecord:
    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    arrival_s: float | None = None
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    status: str | None = None  # finished (its output length), error (never fit the pool), refused (too long)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def queue_wait_s(self) -> float | None:
        return None if self.first_scheduled_s is None else self.first_scheduled_s - self.arrival_s


@dataclass(frozen=True)
class StepRecord:
    """One scheduler step: when it started, its modelled duration and what it computed."""

    start_s: float
    duration_s: float
    num_prefill_tokens: int  # prompt (or recomputed) tokens computed
    num_decode_seqs: int  # requests that computed one generated token
    batch_size: int  # requests scheduled
    num_context_tokens: int  # tokens the scheduled requests attend over (computed, after the step)
    num_preempted: int = 0


@dataclass
class TwinResult:
    requests: list[RequestRecord]
    steps: list[StepRecord]
    flags: EngineFlags
    cost: StepCost
    engine: str  # "vllm <version>"

    @property
    def end_s(self) -> float:
        return max((r.finish_s for r in self.requests if r.finish_s is not None), default=0.0)


def vllm_version() -> str:
    try:
        from vllm import __version__
    except ImportError as e:
        raise MissingDependencyError("the twin runs vLLM's own scheduler: install vLLM (pip install -e "
                                     "'.[capture]', or vllm itself) to simulate.") from e
    return __version__


def _engine_env() -> None:
    """The environment vLLM is imported with here: in-process, quiet, no usage report, the CPU build content."""
    for k, v in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_NO_USAGE_STATS", "1"), ("DO_NOT_TRACK", "1"),
                 ("VLLM_CPU_OMP_THREADS_BIND", "nobind"), ("VLLM_CPU_KVCACHE_SPACE", "1"),
                 ("VLLM_LOGGING_LEVEL", "ERROR")):
        os.environ.setdefault(k, v)


def _vllm_config(flags: EngineFlags, model_dir: str):
    """vLLM's engine config of `flags` (its own checks; a refusal becomes one sentence naming vLLM's message)."""
    from vllm.engine.arg_utils import EngineArgs

    kw = {k: v for k, v in (("max_num_seqs", flags.max_num_seqs),
                            ("max_num_batched_tokens", flags.max_num_batched_tokens)) if v is not None}
    try:
        cfg = EngineArgs(model=model_dir, load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=True,
                         block_size=flags.block_size, max_model_len=flags.max_model_len,
                         enable_chunked_prefill=flags.chunked_prefill, enforce_eager=True, async_scheduling=False,
                         num_gpu_blocks_override=flags.num_gpu_blocks + 1, disable_log_stats=True,
                         **kw).create_engine_config()
    except Exception as e:  # vLLM's checks raise ValueError, pydantic's ValidationError, AssertionError...
        raise KmeshTraceError(f"vLLM refuses these engine flags: {_one_line(e)}.") from e
    cfg.cache_config.num_gpu_blocks = flags.num_gpu_blocks + 1
    return cfg


def _one_line(e: Exception) -> str:
    """An exception's message on one line: pydantic's messages without its boilerplate (input, docs link)."""
    try:
        found = [str(x.get("msg", "")).removeprefix("Value error, ") for x in e.errors()]  # pydantic's
    except Exception:
        found = []
    if any(found):
        return "; ".join(m for m in found if m).rstrip(".")[:400]
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and "errors.pydantic.dev" not in ln]
    text = " ".join(lines) or type(e).__name__
    return text.rstrip(".")[:400]


def build_scheduler(flags: EngineFlags):
    """vLLM's real `Scheduler` for `flags`, over one full-attention KV cache group of `num_gpu_blocks` usable blocks."""
    if flags.block_size < 1 or flags.num_gpu_blocks < 1 or flags.max_model_len < 1:
        raise KmeshTraceError("--block-size, --num-gpu-blocks-override and --max-model-len must be positive.")
    vllm_version()
    _engine_env()
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.structured_output import StructuredOutputManager

    with tempfile.TemporaryDirectory(prefix="kmesh-twin-") as d:
        (Path(d) / "config.json").write_text(json.dumps(_TWIN_MODEL))
        cfg = _vllm_config(flags, d)
    n, bs = flags.num_gpu_blocks + 1, flags.block_size
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=32, dtype=torch.float16)
    page = spec.page_size_bytes
    kv = KVCacheConfig(num_blocks=n, kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
                       kv_cache_tensors=[KVCacheTensor(size=n * page, layers=["layer.0"], layer_stride=0,
                                                       block_stride=page)])
    try:
        return Scheduler(cfg, kv, StructuredOutputManager(cfg), block_size=bs)
    except Exception as e:
        raise KmeshTraceError(f"vLLM's scheduler refuses this configuration: {_one_line(e)}.") from e


# ---- token ids of a trace's requests ---------------------------------------------------------------


def hash_tokens(hashes: Sequence[int], block_size: int, num_tokens: int, index: int) -> list[int]:
    """`num_tokens` token ids whose `block_size` blocks stand for the chained block `hashes`: block i holds
    hash i's 64 bits in its first three ids (30 bits each), zeros after; the ids past the hashed blocks are
    `UNIQUE_BASE + index`, unique to request `index`. Equal hash prefixes give equal token prefixes."""
    out: list[int] = []
    pad = [0] * max(block_size - 3, 0)
    for h in hashes:
        if len(out) >= num_tokens:
            break
        h &= (1 << 64) - 1
        out.extend(([h & _M30, (h >> 30) & _M30, h >> 60] + pad)[:block_size])
    del out[num_tokens:]
    out.extend([UNIQUE_BASE + (index & _M30)] * (num_tokens - len(out)))
    return out


def twin_requests(requests: Sequence[RequestBlocks], block_size: int, arrivals_s: Sequence[float] | None = None
                  ) -> list[TwinRequest]:
    """The twin's requests of a workload's (arrival order): exact ids when the trace has them, else ids
    derived from the prompt and output block hashes (`hash_tokens`). `arrivals_s`: the arrival times to
    use (None: the trace's own, relative to its first; a request without one then enters by concurrency)."""
    t0 = min((r.arrival_ns for r in requests if r.arrival_ns is not None), default=0)
    out = []
    for k, r in enumerate(requests):
        n_out = max(r.num_output_tokens or 0, 1)  # vLLM samples at least one token
        if arrivals_s is not None:
            at = float(arrivals_s[k])
        else:
            at = None if r.arrival_ns is None else (r.arrival_ns - t0) / 1e9
        if r.prompt_token_ids is not None:
            tail = list(r.output_token_ids or [])[:n_out]
            output = tail + [UNIQUE_BASE + (r.index & _M30)] * (n_out - len(tail))
            out.append(TwinRequest(r.request_id, r.prompt_token_ids, output, at))
        else:
            out.append(TwinRequest(r.request_id, None, None, at, r.num_prompt_tokens, n_out, (r, block_size)))
    return out


# ---- the run ---------------------------------------------------------------------------------------


@dataclass
class _Live:
    request: object  # vLLM's Request
    output: list[int]
    record: RequestRecord


@dataclass
class Twin:
    """One run: the scheduler, the clock, the requests in it and what was recorded."""

    flags: EngineFlags
    cost: StepCost
    scheduler: object = None
    clock: float = 0.0
    live: dict[str, _Live] = field(default_factory=dict)
    records: list[RequestRecord] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)

    def __post_init__(self):
        if self.scheduler is None:
            self.scheduler = build_scheduler(self.flags)
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)  # vLLM's engine core does this once at start
        self._hasher = get_request_block_hasher(self.flags.block_size, sha256)
        self._request, self._params = Request, SamplingParams

    def add(self, q: TwinRequest, by_concurrency: bool = False) -> None:
        """Give vLLM request `q` now, or refuse it as vLLM's front end would; its arrival is its own, or now
        (`by_concurrency`: it enters when a place is free)."""
        at = self.clock if by_concurrency or q.arrival_s is None else q.arrival_s
        rec = RequestRecord(q.request_id, q.num_prompt_tokens, q.num_output_tokens, at)
        self.records.append(rec)
        if q.num_prompt_tokens + q.num_output_tokens > self.flags.max_model_len or not q.num_prompt_tokens:
            rec.status = "refused"
            return
        prompt, output = q.tokens()
        req = self._request(q.request_id, list(prompt), self._params(max_tokens=len(output), ignore_eos=True),
                            None, block_hasher=self._hasher)
        self.scheduler.add_request(req)
        self.live[q.request_id] = _Live(req, output, rec)

    def step(self) -> StepRecord | None:
        """One scheduler step and its model runner output; None when the scheduler gave out nothing."""
        from vllm.v1.outputs import ModelRunnerOutput

        s = self.scheduler
        so = s.schedule()
        if so.total_num_scheduled_tokens == 0:
            s.update_from_output(so, ModelRunnerOutput(req_ids=[], req_id_to_index={}))
            return None
        for nr in so.scheduled_new_reqs:
            rec = self.live[nr.req_id].record
            if rec.first_scheduled_s is None:
                rec.first_scheduled_s, rec.num_cached_tokens = self.clock, nr.num_computed_tokens
        rec_step, sampled = self._account(so)
        self.clock += rec_step.duration_s
        ids = list(so.num_scheduled_tokens)  # every scheduled request; a partial prefill samples nothing
        s.update_from_output(so, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)},
                                                   sampled_token_ids=[sampled.get(r, []) for r in ids]))
        self._after(list(sampled))
        self.steps.append(rec_step)
        return rec_step

    def _account(self, so) -> tuple[StepRecord, dict[str, list[int]]]:
        """The step's record (its cost modelled) and the token each request samples in it."""
        prefill = decode = context = 0
        sampled: dict[str, list[int]] = {}
        for rid, n in so.num_scheduled_tokens.items():
            live = self.live[rid]
            req = live.request
            done = req.num_computed_tokens  # vLLM advanced it when it scheduled the step
            if n == 1 and req.num_output_tokens > 0 and done == req.num_tokens:
                decode += 1
            else:
                prefill += n
            context += done
            if done >= req.num_tokens:
                sampled[rid] = [live.output[req.num_output_tokens]]
        preempted = len(getattr(so, "preempted_req_ids", None) or ())
        dur = self.cost.seconds(prefill, decode, context)
        return StepRecord(self.clock, dur, prefill, decode, len(so.num_scheduled_tokens), context, preempted), sampled

    def _after(self, sampled_ids: list[str]) -> None:
        for rid in sampled_ids:
            live = self.live[rid]
            rec = live.record
            if rec.first_token_s is None:
                rec.first_token_s = self.clock
            if rid not in self.scheduler.requests:  # vLLM finished it (its output length)
                rec.finish_s, rec.status = self.clock, "finished"
                rec.num_preemptions = live.request.num_preemptions
                del self.live[rid]

    def abort_stuck(self) -> None:
        """Nothing runs and nothing can be scheduled: the waiting head can never fit the pool; abort it."""
        from vllm.v1.request import RequestStatus

        head = self.scheduler.waiting.peek_request()
        live = self.live.pop(head.request_id)
        self.scheduler.finish_requests([head.request_id], RequestStatus.FINISHED_ABORTED)
        live.record.status, live.record.num_preemptions = "error", head.num_preemptions


def run_twin(requests: Sequence[TwinRequest], flags: EngineFlags, cost: StepCost, *, concurrency: int | None = None,
             on_progress: Callable[[int], None] | None = None, scheduler=None) -> TwinResult:
    """Run `requests` (arrival order) through vLLM's scheduler in simulated time (module docstring). With
    `concurrency`, a request enters whenever fewer than that many are in the engine (arrival times ignored);
    otherwise every request needs `arrival_s`. `on_progress(n)`: n more requests done. `scheduler`: one built
    by `build_scheduler(flags)` to use (a fresh one by default)."""
    if concurrency is None and any(q.arrival_s is None for q in requests):
        raise KmeshTraceError("the requests have no arrival times; give --arrivals poisson:RATE or --concurrency N.")
    twin = Twin(flags, cost, scheduler)
    i, n, done = 0, len(requests), 0
    while i < n or twin.live:
        while i < n and (len(twin.live) < concurrency if concurrency else requests[i].arrival_s <= twin.clock):
            twin.add(requests[i], bool(concurrency))
            i += 1
        if not twin.live:
            if i < n and not concurrency:
                twin.clock = max(twin.clock, requests[i].arrival_s)
            continue
        if twin.step() is None:  # with nothing running, the waiting head can never fit
            if twin.scheduler.running:
                raise KmeshTraceError("vLLM's scheduler scheduled nothing while requests were running; "
                                      "please report this trace and these flags.")
            twin.abort_stuck()
        if on_progress is not None and (now := i - len(twin.live)) > done:
            on_progress(now - done)
            done = now
    return TwinResult(twin.records, twin.steps, resolved_flags(twin.scheduler, flags), cost, f"vllm {vllm_version()}")


def resolved_flags(scheduler, flags: EngineFlags) -> EngineFlags:
    """`flags` with vLLM's defaults filled in as its scheduler resolved them (they depend on the platform)."""
    sc = scheduler.scheduler_config
    return replace(flags, max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
                   chunked_prefill=bool(sc.enable_chunked_prefill))


def result_dict(res: TwinResult) -> dict:
    """The flags and cost model a run used, as JSON-ready dicts (the trace metadata's `simulation`)."""
    return {"engine": res.engine, "flags": asdict(res.flags), "step_cost": asdict(res.cost)}
