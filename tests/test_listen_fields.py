"""Every field of the engines' KV events, decoded and recorded: KV cache group, the group's spec
kind and window, medium, locality, ownership, session, cache salt, origin; the groups a recording
learns from its stores; which removal semantics the publisher uses.

vLLM's frames come from the installed vLLM's own structs (`vllm/distributed/kv_events.py`); SGLang's
from the 0.5.23 structs `test_listen.py` copies from `sglang/srt/disaggregation/kv_events.py`. A
store's `origin` (NEW / REUSED) is not in vLLM 0.32 or 0.33: it is encoded the way msgspec encodes
an added optional field of the tagged map (one more key).
"""

from __future__ import annotations

import msgspec
import pytest

from kmesh_trace.capture.kv_events import decode_frames, removal_semantics, signed_hash
from kv_event_frames import (BlockRemoved, BlockStored, SgKVEventBatch, _frames, _listener, _meta,  # noqa: F401
                         _rows, sock_dir, vllm_events)

NEW_COLUMNS = ("kv_group", "medium", "locality", "ownership", "session_id", "cache_salt", "origin")


def _cpu_store(v, hashes, group, kind, window, parent=None):
    """A store as vLLM 0.32's CPU offloading manager publishes it (vllm/v1/simple_kv_offload/manager.py)."""
    return v.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[], block_size=32, lora_id=None,
                         medium="CPU", lora_name=None, group_idx=group, kv_cache_spec_kind=kind,
                         kv_cache_spec_sliding_window=window, locality="LOCAL")


def test_vllm_offload_fields_decode_exactly(vllm_events):
    v = vllm_events
    batch = v.KVEventBatch(ts=3.0, events=[
        _cpu_store(v, [11], 0, "sliding_window", 128),
        v.BlockStored(block_hashes=[12], parent_block_hash=None, token_ids=[1] * 32, block_size=32, lora_id=None,
                      medium="STORAGE", lora_name=None, group_idx=1, kv_cache_spec_kind="full_attention",
                      locality="REMOTE", ownership="kvcr", session_id="conv-7"),
        v.BlockRemoved(block_hashes=[11], medium="CPU", group_idx=0, locality="LOCAL", ownership="kvcr")])
    f = decode_frames(_frames(0, batch))
    assert (f.format, f.error) == ("vllm-map", None)
    s0, s1, r = f.events
    assert (s0.group, s0.spec_kind, s0.sliding_window, s0.medium, s0.locality, s0.ownership, s0.origin) == \
        (0, "sliding_window", 128, "CPU", "LOCAL", None, None)
    assert (s1.group, s1.spec_kind, s1.sliding_window, s1.medium, s1.locality, s1.ownership, s1.session_id) == \
        (1, "full_attention", None, "STORAGE", "REMOTE", "kvcr", "conv-7")
    assert (r.kind, r.hashes, r.group, r.medium, r.locality, r.ownership) == ("BlockRemoved", [11], 0, "CPU", "LOCAL", "kvcr")


def test_an_added_origin_key_is_read_and_decides_hits(vllm_events, sock_dir, tmp_path):
    v = vllm_events
    new = msgspec.to_builtins(v.BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[0] * 64,
                                            block_size=32, lora_id=None, medium="GPU", lora_name=None, group_idx=0))
    reused = {**new, "origin": "REUSED", "block_hashes": [1]}
    # A NEW store of a resident hash is a second copy, not a hit; a REUSED one is a hit even of a
    # block stored before the recording.
    batch = [3.0, [{**new, "origin": "NEW"}, {**new, "origin": "NEW", "block_hashes": [1]}, reused,
                   {**reused, "block_hashes": [99]}], 0]
    f = decode_frames([b"kv", (0).to_bytes(8, "big"), msgspec.msgpack.encode(batch)])
    assert [e.origin for e in f.events] == ["NEW", "NEW", "REUSED", "REUSED"] and f.error is None
    out = tmp_path / "trace"
    listener = _listener(out, sock_dir)
    listener._on_live(listener.recorders[0], [b"kv", (0).to_bytes(8, "big"), msgspec.msgpack.encode(batch)])
    listener.close()
    assert _rows(out).select("event", "block_hash", "origin").rows() == [
        ("cached", 1, "NEW"), ("cached", 2, "NEW"), ("cached", 1, "NEW"), ("touched", 1, "REUSED"),
        ("touched", 99, "REUSED")]
    assert _meta(out)["kv_events"]["num_touched_blocks"] == 2


def test_every_field_is_recorded_and_groups_are_learned(vllm_events, sock_dir, tmp_path):
    v = vllm_events
    out = tmp_path / "trace"
    listener = _listener(out, sock_dir, engine="vllm 0.32.0")
    rec = listener.recorders[0]
    gpu = v.BlockStored(block_hashes=[5], parent_block_hash=None, token_ids=[3] * 32, block_size=32, lora_id=None,
                        medium="GPU", lora_name=None, group_idx=1, session_id="conv-1")
    listener._on_live(rec, _frames(0, v.KVEventBatch(ts=1.0, events=[gpu, _cpu_store(v, [5], 1, "full_attention", None)])))
    assert "kv_cache_groups" not in rec.writer.metadata  # group 0 is not known yet
    listener._on_live(rec, _frames(1, v.KVEventBatch(ts=2.0, events=[
        _cpu_store(v, [6], 0, "sliding_window", 128),
        v.BlockRemoved(block_hashes=[6], medium="CPU", group_idx=0, locality="LOCAL")])))
    listener.close()
    rows = _rows(out).select("event", "block_hash", *NEW_COLUMNS).rows()
    assert rows == [
        ("cached", 5, 1, "GPU", None, None, "conv-1", None, None),
        ("cached", 5, 1, "CPU", "LOCAL", None, None, None, None),
        ("cached", 6, 0, "CPU", "LOCAL", None, None, None, None),
        ("evicted", 6, 0, "CPU", "LOCAL", None, None, None, None)]
    meta = _meta(out)
    assert meta["kv_cache_groups"] == [
        {"kind": "sliding_window", "block_size": 32, "sliding_window": 128},
        {"kind": "full_attention", "block_size": 32, "sliding_window": None}]
    from kmesh_trace.kv_groups import groups_from_metadata

    assert [g.kind for g in groups_from_metadata(meta)] == ["sliding_window", "full_attention"]
    kv = meta["kv_events"]
    assert (kv["removal_semantics"], kv["removal_semantics_basis"]) == ("each_copy", "the source of vllm 0.32.0")
    assert kv["group_specs"] == {"1": {"kind": "full_attention", "sliding_window": None, "block_size": 32},
                                 "0": {"kind": "sliding_window", "sliding_window": 128, "block_size": 32}}


def test_sglang_fields_are_recorded(sock_dir, tmp_path):
    out = tmp_path / "trace"
    listener = _listener(out, sock_dir)
    listener._on_live(listener.recorders[0], _frames(0, SgKVEventBatch(ts=5.0, events=[
        BlockStored(block_hashes=[-3], parent_block_hash=None, token_ids=list(range(16)), block_size=16, lora_id=None,
                    medium="CPU_PINNED", cache_salt="tenant-a", session_id="s9"),
        BlockRemoved(block_hashes=[-3], medium="CPU_PINNED")], attn_dp_rank=0)))
    listener.close()
    rows = _rows(out).select("event", "block_hash", *NEW_COLUMNS).rows()
    assert [(e, signed_hash(h), *rest) for e, h, *rest in rows] == [
        ("cached", -3, None, "CPU_PINNED", None, None, "s9", "tenant-a", None),
        ("evicted", -3, None, "CPU_PINNED", None, None, None, None, None)]
    kv = _meta(out)["kv_events"]
    assert kv["format"] == "sglang" and kv["removal_semantics"] == "unknown"  # not read off SGLang's source


def test_a_removal_that_leaves_a_copy_shows_each_copy_semantics(vllm_events, sock_dir, tmp_path):
    v = vllm_events
    out = tmp_path / "trace"
    listener = _listener(out, sock_dir)  # no engine version: unknown until the stream shows it
    store = v.BlockStored(block_hashes=[8], parent_block_hash=4, token_ids=[1] * 32, block_size=32, lora_id=None,
                          medium="GPU", lora_name=None, group_idx=0)
    rec = listener.recorders[0]
    listener._on_live(rec, _frames(0, v.KVEventBatch(ts=1.0, events=[store])))
    assert rec.stats["removal_semantics"] == "unknown"
    listener._on_live(rec, _frames(1, v.KVEventBatch(ts=2.0, events=[
        store, v.BlockRemoved(block_hashes=[8], medium="GPU", group_idx=0)])))
    listener.close()
    kv = _meta(out)["kv_events"]
    assert (kv["removal_semantics"], kv["removal_semantics_basis"]) == (
        "each_copy", "observed: a removal left another copy of its hash resident")


@pytest.mark.parametrize("fmt, engine, want", [
    ("vllm-map", "vllm 0.32.0", "each_copy"), ("vllm-map", "vllm 0.33.0", "each_copy"),
    ("vllm-map", "vllm 0.34.0", "unknown"), ("vllm-map", None, "unknown"), ("sglang", "sglang 0.5.23", "unknown"),
    ("vllm-map", "vllm dev", "unknown")])
def test_removal_semantics_by_engine_version(fmt, engine, want):
    assert removal_semantics(fmt, engine) == want


def test_a_bad_window_is_a_malformed_event(vllm_events):
    v = vllm_events
    f = decode_frames(_frames(0, v.KVEventBatch(ts=1.0, events=[_cpu_store(v, [1], 0, "sliding_window", 0)])))
    assert f.num_bad_events == 1 and "kv_cache_spec_sliding_window" in f.error


def test_a_033_store_with_lookahead_tokens_decodes(vllm_events):
    """vLLM 0.33 adds `lookahead_token_ids` to BlockStored (EAGLE lookahead hashing): read past it."""
    v = vllm_events
    store = msgspec.to_builtins(v.BlockStored(block_hashes=[4], parent_block_hash=None, token_ids=[0] * 32,
                                              block_size=32, lora_id=None, medium="GPU", lora_name=None, group_idx=0))
    store["lookahead_token_ids"] = [[1, 2, 3]]
    f = decode_frames([b"kv", (0).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [store], 0])])
    assert f.error is None and [(e.kind, e.hashes, e.group) for e in f.events] == [("BlockStored", [4], 0)]


@pytest.mark.parametrize("field, value, says", [
    ("origin", "MAYBE", "origin is 'MAYBE', not one of NEW, REUSED"),
    ("origin", "\x1b[2J", "origin is not a printable name"),
    ("locality", "x" * 300_000, "locality is not a printable name of at most 256 characters"),
    ("locality", "LOCAL\x1b]0;owned\x07", "locality is not a printable name"),
    ("ownership", "\n", "ownership is not a printable name"),
    ("medium", "G" * 257, "medium is not a printable name"),
])
def test_enumerated_fields_keep_to_their_values_and_lengths(vllm_events, field, value, says):
    v = vllm_events
    good = msgspec.to_builtins(v.BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[0] * 32,
                                             block_size=32, lora_id=None, medium="GPU", lora_name=None, group_idx=0))
    batch = [3.0, [{**good, field: value}, {**good, "origin": "reused", "locality": "LOCAL"}], 0]
    f = decode_frames([b"kv", (0).to_bytes(8, "big"), msgspec.msgpack.encode(batch)])
    assert f.num_bad_events == 1 and says in f.error and len(f.error) < 400
    assert [(e.origin, e.locality) for e in f.events] == [("REUSED", "LOCAL")]
