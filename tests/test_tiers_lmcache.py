"""The LMCache model (`kmesh_trace.oracle.tiers.lmcache`) and `tiers --lmcache`: what one LMCache server shared
by vLLM engines stores, what each engine loads, and its external hits, rule by rule; and the command on two
captures written as a capture writes them (tests/test_lmcache_mp.py holds it to a real two-server run).
"""

from __future__ import annotations

import json
import random

import pytest

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.stream import requests_from_rows
from kmesh_trace.oracle.tiers.lmcache import EngineStream, LMCacheSpec, parse_lmcache_spec, simulate_lmcache
from kmesh_trace.writer import TraceWriter

BS = 32
KV = 256  # bytes per token: a chunk of 32 tokens is 8 KiB
rng = random.Random(5)


def tokens(n: int) -> list[int]:
    return [rng.randrange(1, 1000) for _ in range(n)]


P300, P200, P110, P96 = tokens(300), tokens(200), tokens(110), tokens(96)


def stream(name: str, prompts: list[list[int]], start_ns: int = 0, usable: int = 63) -> EngineStream:
    rows = [{"request_id": f"{name}{i}", "num_prompt_tokens": len(p), "num_output_tokens": 8, "prompt_token_ids": p,
             "arrival_ns": start_ns + i * 1000, "finish_ns": start_ns + i * 1000 + 500} for i, p in enumerate(prompts)]
    return EngineStream(name, requests_from_rows(rows, BS), BS, usable)


def run(*engines, **spec):
    return simulate_lmcache(list(engines), LMCacheSpec(**{"chunk_size": 32, "l1_size_gb": 0.25, **spec}), KV)


def test_a_fresh_engine_loads_what_another_stored():
    """The two-server run: A stores its prompts' whole chunks; B loads them and stores only its new prompt's."""
    out = run(stream("A", [P300, P200], 0), stream("B", [P300, P200, P110], 10_000), fs="/fs")
    a, b = out.engines
    assert (a.num_stores, a.stored_tokens, a.num_loads, a.external_hit_tokens) == (2, 480, 0, 0)
    assert (b.num_stores, b.stored_tokens, b.num_loads, b.loaded_tokens, b.external_hit_tokens) == (1, 96, 2, 480, 480)
    assert [n for _, n in out.stores] == [288, 192, 96] and [n for _, n in out.retrieves] == [288, 192]
    assert out.fs_chunks == 18 and out.l1_evictions == 0 and out.l1_capacity_chunks == (1 << 28) // 8192


def test_the_engines_interleave_by_arrival():
    """B's P200 arrives between A's P300 and A's P200: B stores P200, which A's P200 then loads."""
    out = run(stream("A", [P300, P200], 0), stream("B", [P200, P300], 500))
    a, b = out.engines
    assert (a.stored_tokens, a.external_hit_tokens) == (288, 192)
    assert (b.stored_tokens, b.external_hit_tokens) == (192, 288)
    assert [e for e, _ in out.stores] == ["A", "B"] and [e for e, _ in out.retrieves] == ["A", "B"]


def test_what_the_local_prefix_cache_serves_is_not_loaded():
    """A repeat on the same engine hits its own pool (the vllm model): LMCache holds it too, nothing to load."""
    (a,) = run(stream("A", [P300, P300])).engines
    assert (a.num_stores, a.num_loads, a.external_hit_tokens, a.local_hit_tokens) == (1, 0, 0, 288)


def test_a_whole_prompt_hit_loads_one_token_fewer():
    """vLLM computes the last prompt token: a 96-token prompt LMCache holds whole gives 95 external hits,
    and LMCache still retrieves its 3 chunks."""
    out = run(stream("A", [P96], 0), stream("B", [P96], 10_000))
    b = out.engines[1]
    assert (b.external_hit_tokens, b.loaded_tokens, b.num_stores) == (95, 96, 0)


def test_a_retrieve_starts_at_the_chunk_of_the_first_token_vllm_lacks():
    """Chunks of 64 tokens: B's pool already serves 32 tokens (one block of its earlier P110), LMCache 256 of
    P300's shared head; the retrieve starts at chunk 0 (token 32 lies in it) and covers 256 tokens."""
    head = P300[:32]
    other = head + tokens(90)
    out = run(stream("A", [P300], 0), stream("B", [other, P300], 10_000), chunk_size=64)
    b = out.engines[1]
    assert b.local_hit_tokens == 32 and b.external_hit_tokens == 256 - 32 and b.loaded_tokens == 256


def test_l1_evicts_least_recently_used_chunks_and_the_fs_tier_keeps_them():
    """An L1 of 10 chunks: P300's 9 then P200's 6 push P300's first 5 chunks out, so B finds none of P300 (its
    first chunk is gone) and stores all 9 again (9 more evictions), unless the fs tier holds every chunk."""
    small = 10 * 32 * KV / (1 << 30)
    without = run(stream("A", [P300, P200], 0), stream("B", [P300], 10_000), l1_size_gb=small)
    assert without.l1_capacity_chunks == 10 and without.l1_evictions == 5 + 9
    assert without.engines[1].external_hit_tokens == 0 and without.engines[1].stored_tokens == 288
    with_fs = run(stream("A", [P300, P200], 0), stream("B", [P300], 10_000), l1_size_gb=small, fs="/fs")
    assert with_fs.engines[1].external_hit_tokens == 288 and with_fs.fs_chunks == 15


@pytest.mark.parametrize("text, message", [
    ("chunk_size=32,color=red", "--lmcache takes chunk_size=, l1_size_gb=, eviction_policy= and fs= items"),
    ("chunk_size=big", "chunk_size must be a whole number"),
    ("l1_size_gb=0", "must be positive"),
    ("eviction_policy=LFU", "the model has LMCache's LRU eviction only"),
])
def test_a_bad_configuration_is_one_sentence(text, message):
    with pytest.raises(KmeshTraceError, match=message):
        parse_lmcache_spec(text)


def test_a_chunk_that_is_not_whole_blocks_is_refused():
    with pytest.raises(KmeshTraceError, match=r"chunk_size \(48\) must be a multiple of the block size \(32\)"):
        run(stream("A", [P300]), chunk_size=48)


def test_the_configuration_reads_as_lmcache_server_takes_it():
    assert parse_lmcache_spec("chunk_size=32, l1_size_gb=0.25,eviction_policy=LRU,fs=/tmp/x") == \
        LMCacheSpec(32, 0.25, "LRU", "/tmp/x")
    assert parse_lmcache_spec("") == LMCacheSpec()


# ---- the command, on captures ------------------------------------------------------------------------------

def write_capture(path, name: str, prompts: list[list[int]], start_ns: int, transfers: list[tuple]) -> str:
    """A capture of one engine: its invocations (external hits as recorded) and the proxy's transfers."""
    meta = {"engine_index": 0, "engine": "vllm 0.32.0", "model": "tiny", "block_size": BS, "num_usable_blocks": 63,
            "null_block_id": 0, "kv_bytes_per_token": KV, "wall_anchor_ns": 10**18, "mono_anchor_ns": 0}
    ext = {rid: n for rid, d, n in transfers if d == "load"}
    rows = [{"request_id": f"{name}{i}", "seq": i, "num_prompt_tokens": len(p), "num_output_tokens": 8,
             "prompt_token_ids": p, "arrival_ns": start_ns + i * 1000, "finish_ns": start_ns + i * 1000 + 500,
             "status": "finished", "num_cached_tokens": 0, "num_external_tokens": ext.get(f"{name}{i}", 0)}
            for i, p in enumerate(prompts)]
    with TraceWriter(path, engine_id=name, metadata=meta) as w:
        w.write("invocations", {k: [r[k] for r in rows] for k in rows[0]})
        if transfers:
            w.write("transfers", {
                "request_id": [t[0] for t in transfers], "direction": [t[1] for t in transfers],
                "num_tokens": [t[2] for t in transfers], "num_blocks": [t[2] // BS for t in transfers],
                "num_bytes": [t[2] * KV for t in transfers], "start_ns": [1] * len(transfers),
                "finish_ns": [2] * len(transfers), "status": ["ok"] * len(transfers),
                "connector": ["LMCacheMPConnector"] * len(transfers)})
    return str(path)


def test_the_command_shows_predicted_beside_measured(cli, tmp_path, width):
    a = write_capture(tmp_path / "A", "A", [P300, P200], 0, [("A0", "store", 288), ("A1", "store", 192)])
    b = write_capture(tmp_path / "B", "B", [P300, P200, P110], 10_000,
                      [("B0", "load", 288), ("B1", "load", 192), ("B2", "store", 96)])
    r = cli(["tiers", a, "--lmcache-peer", b, "--lmcache", "chunk_size=32,l1_size_gb=0.25,fs=/fs", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    for e in d["engines"]:
        m = e["measured"]
        assert {k: v for k, v in e["predicted"].items() if k != "local_hit_tokens"} == \
            {k: m[k] for k in ("num_stores", "stored_tokens", "num_loads", "loaded_tokens", "external_hit_tokens")}
    assert d["server"] == {"l1_capacity_chunks": 32768, "l1_evictions": 0, "fs_chunks": 18,
                           "stored_tokens": [288, 192, 96], "retrieved_tokens": [288, 192]}
    width(160)
    shown = cli(["tiers", a, "--lmcache-peer", b, "--lmcache", "chunk_size=32"])
    assert shown.exit_code == 0 and "480 / 480" in shown.stdout and "LMCache predicted: 3 stores" in shown.stdout


@pytest.mark.parametrize("args, message", [
    (["--lmcache-peer", "{a}"], "--lmcache-peer names another engine sharing LMCache; give --lmcache too."),
    (["--lmcache", "chunk_size=32", "--host", "8"], "--lmcache models LMCache's own tiers (L1 and fs); drop --host."),
])
def test_the_command_refuses_what_the_model_cannot_take(cli, tmp_path, args, message):
    a = write_capture(tmp_path / "A", "A", [P300], 0, [])
    r = cli(["tiers", a, *[x.format(a=a) for x in args]])
    assert r.exit_code == 1 and r.stderr == f"Error: {message}\n"
