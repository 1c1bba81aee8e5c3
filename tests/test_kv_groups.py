"""The KV cache group contract (kmesh_trace/kv_groups.py): metadata round trip, defaults, refusals, vLLM specs."""

import pytest

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.kv_groups import (FULL, SLIDING_WINDOW, KVCacheGroup, group_of_vllm, groups_from_metadata,
                                   is_hybrid)


def test_a_trace_without_groups_has_one_full_attention_group():
    assert groups_from_metadata({"block_size": 16}) == (KVCacheGroup(FULL, 16),)
    assert not is_hybrid(groups_from_metadata({"block_size": 16}))


def test_groups_round_trip_through_metadata():
    groups = (KVCacheGroup(SLIDING_WINDOW, 32, 2, 4096, sliding_window=128), KVCacheGroup(FULL, 32, 2, 4096))
    meta = {"block_size": 32, "kv_cache_groups": [g.to_json() for g in groups]}
    assert groups_from_metadata(meta) == groups
    assert is_hybrid(groups)
    assert groups[0].kv_bytes_per_token == 4096 * 2 / 32


@pytest.mark.parametrize("bad", [
    [{"kind": "sliding_window", "block_size": 32}],           # no window
    [{"kind": "full_attention", "block_size": 0}],            # no tokens
    [{"kind": "full_attention", "block_size": 16, "num_layers": -1}],
    [{"kind": "attention", "block_size": 16}],                # unknown kind
    [{"kind": "full_attention", "block_size": 16}, {"kind": "sliding_window", "block_size": 32,
                                                    "sliding_window": 64}],  # another block size than the partition's
    ["full_attention"],
])
def test_bad_groups_are_one_sentence(bad):
    with pytest.raises(KmeshTraceError, match="kv_cache_groups"):
        groups_from_metadata({"block_size": 16, "kv_cache_groups": bad})


def test_vllm_specs_map_to_groups():
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=32, dtype=torch.float16)
    swa = SlidingWindowSpec(block_size=32, num_kv_heads=1, head_size=32, dtype=torch.float16, sliding_window=128)
    g_full = group_of_vllm(KVCacheGroupSpec(["l1", "l3"], full))
    g_swa = group_of_vllm(KVCacheGroupSpec(["l0", "l2"], swa))
    assert g_full == KVCacheGroup(FULL, 32, 2, full.page_size_bytes)
    assert g_swa == KVCacheGroup(SLIDING_WINDOW, 32, 2, swa.page_size_bytes, sliding_window=128)


def test_touched_blocks_of_a_hit_per_kind():
    from kmesh_trace.kv_groups import CHUNKED_LOCAL, MAMBA, touched_blocks_of_hit

    assert touched_blocks_of_hit(KVCacheGroup(FULL, 32), 576) == 18
    # window 128, block 32: (576 - 127) // 32 = 14 blocks skipped, 4 touched; a short hit keeps all
    assert touched_blocks_of_hit(KVCacheGroup(SLIDING_WINDOW, 32, sliding_window=128), 576) == 4
    assert touched_blocks_of_hit(KVCacheGroup(SLIDING_WINDOW, 32, sliding_window=128), 96) == 3
    # chunks of 64 tokens: a 160-token hit keeps the current chunk's one full block (tokens 128..159)
    assert touched_blocks_of_hit(KVCacheGroup(CHUNKED_LOCAL, 32, attention_chunk_size=64), 160) == 1
    assert touched_blocks_of_hit(KVCacheGroup(MAMBA, 32), 160) is None
