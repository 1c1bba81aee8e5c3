"""The listener's sequence state machine on the cases a broken or hostile publisher produced: a seq that
jumps to 2^62, a replay socket that never ends its answer, a restart with the clock behind, a repeated
seq, a batch out of order, a resumed recording whose publisher restarted (or did not), and values a
trace cannot hold. Exact counts; the replay socket is a real ZeroMQ ROUTER (tests/kv_wire.py)."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from kmesh_trace.capture.listen import Listener, PublisherSpec
from kv_wire import ReplayBuffer, frames, payload, stored  # tests/ is on sys.path

zmq = pytest.importorskip("zmq")


@pytest.fixture
def sock_dir():
    d = Path(tempfile.mkdtemp(prefix="kvq", dir="/tmp"))  # ipc paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def _listener(out: Path, sock_dir: Path, replay: bool = True, timeout: float = 2.0) -> Listener:
    return Listener(out, [PublisherSpec(f"ipc://{sock_dir}/ev.sock", f"ipc://{sock_dir}/rp.sock" if replay else None,
                                        "kv")], replay_timeout_s=timeout)


def _rows(out: Path) -> list[tuple]:
    from kmesh_trace.trace import open_trace

    with open_trace(out) as t:
        return t.sql("SELECT publisher_seq, block_hash FROM block_events ORDER BY seq").rows()


def _meta(out: Path) -> dict:
    (f,) = (out / "engines").glob("*.json")
    return json.loads(f.read_text())


def _send(listener: Listener, seq: int, ts: float, h: int, **kw) -> None:
    listener._on_live(listener.recorders[0], frames(seq, payload(ts, [stored(h)], **kw)))


def test_a_seq_jump_to_2_62_costs_what_the_replay_returns_not_the_gap(sock_dir, tmp_path, ctx):
    buf = ReplayBuffer(ctx, f"ipc://{sock_dir}/rp.sock", {1: payload(101.0, [stored(1)])})
    out = tmp_path / "trace"
    listener = _listener(out, sock_dir)
    try:
        t0 = time.monotonic()
        _send(listener, 0, 100.0, 0)
        _send(listener, 1 << 62, 102.0, 2)
        assert time.monotonic() - t0 < 10  # the old walk over 2^62 seqs never ended
        listener.close()
    finally:
        buf.close()
    st = _meta(out)["kv_events"]
    assert (st["num_gaps"], st["num_missing_batches"], st["num_recovered_batches"], st["num_unrecovered_batches"]) == \
        (1, (1 << 62) - 1, 1, (1 << 62) - 2)
    assert st["unrecovered"] == [[0, 2, (1 << 62) - 1]]
    assert _rows(out) == [(0, 0), (1, 1), (1 << 62, 2)]


@pytest.mark.parametrize("mode, lost, rows", [("endless", [[0, 7, 7]], [(5, 5), (6, 6), (8, 8)]),
                                              ("mute", [[0, 6, 7]], [(5, 5), (8, 8)])])
def test_a_replay_answer_has_one_deadline_however_it_drips(mode, lost, rows, sock_dir, tmp_path, ctx):
    # endless: seq 6 again and again, never the end marker (the old deadline restarted at each message)
    buf = ReplayBuffer(ctx, f"ipc://{sock_dir}/rp.sock", {6: payload(100.5, [stored(6)])}, mode=mode)
    out = tmp_path / "trace"
    listener = _listener(out, sock_dir, timeout=1.0)
    try:
        t0 = time.monotonic()
        _send(listener, 5, 100.0, 5)  # fresh: no gap before the first batch
        _send(listener, 8, 101.0, 8)  # gap 6-7: the replay gives 6 (endless) or nothing (mute)
        took = time.monotonic() - t0
        listener.close()
    finally:
        buf.close()
    assert took < 5  # one deadline (1 s) for the whole answer
    st = _meta(out)["kv_events"]
    assert (st["num_missing_batches"], st["unrecovered"]) == (2, lost)
    assert st["num_recovered_batches"] + st["num_unrecovered_batches"] == 2
    assert _rows(out) == rows


def test_a_restart_with_the_clock_behind_is_a_new_epoch_and_every_batch_is_recorded(sock_dir, tmp_path):
    out = tmp_path / "trace"
    listener = _listener(out, sock_dir, replay=False)
    for s in range(5):
        _send(listener, s, 100.0 + s, s)
    for s in range(10):  # restarted, its clock 2 s behind the last batch: not a repeat
        _send(listener, s, 102.0 + s * 0.1, 100 + s)
    listener.close()
    st = _meta(out)["kv_events"]
    assert [e["first_publisher_seq"] for e in st["epochs"]] == [0, 0]
    assert (st["num_batches"], st["num_duplicate_batches"], st["num_unrecovered_batches"]) == (15, 0, 0)
    assert [h for _s, h in _rows(out)] == [0, 1, 2, 3, 4] + list(range(100, 110))


def test_a_repeated_batch_is_a_counted_duplicate_not_an_epoch(sock_dir, tmp_path):
    out = tmp_path / "trace"
    listener = _listener(out, sock_dir, replay=False)
    _send(listener, 0, 100.0, 0)
    _send(listener, 1, 99.0, 1)  # the clock went back: the old rule took the repeat below as a restart
    _send(listener, 0, 100.0, 0)
    _send(listener, 2, 101.0, 2)
    listener.close()
    st = _meta(out)["kv_events"]
    assert (len(st["epochs"]), st["num_batches"], st["num_duplicate_batches"], st["num_missing_batches"]) == (1, 3, 1, 0)
    assert _rows(out) == [(0, 0), (1, 1), (2, 2)]


def test_a_batch_out_of_order_is_recorded_and_taken_off_the_lost_count(sock_dir, tmp_path):
    out = tmp_path / "trace"
    listener = _listener(out, sock_dir, replay=False)
    for s in (0, 1, 4, 2, 5):
        _send(listener, s, 100.0 + s, s)
    listener.close()
    st = _meta(out)["kv_events"]
    assert (st["num_missing_batches"], st["num_unrecovered_batches"], st["num_late_batches"]) == (2, 1, 1)
    assert st["unrecovered"] == [[0, 3, 3]] and len(st["epochs"]) == 1
    assert _rows(out) == [(0, 0), (1, 1), (4, 4), (2, 2), (5, 5)]


def _resume_with(sock_dir: Path, out: Path, ctx, buffer: dict[int, bytes]) -> dict:
    buf = ReplayBuffer(ctx, f"ipc://{sock_dir}/rp.sock", buffer)
    try:
        listener = _listener(out, sock_dir)
        listener.catch_up(listener.recorders[0])
        listener.close()
    finally:
        buf.close()
    return _meta(out)["kv_events"]


def test_a_resumed_recording_takes_a_restarted_publishers_batches_even_with_its_clock_behind(sock_dir, tmp_path, ctx):
    out = tmp_path / "trace"
    old = {s: payload(100.0 + s, [stored(s)]) for s in range(5)}
    st = _resume_with(sock_dir, out, ctx, old)  # a fresh recording: all five from the replay buffer
    assert st["num_batches"] == 5
    new = {s: payload(98.0 + s * 0.1, [stored(100 + s)]) for s in range(10)}  # restarted, clock behind
    st = _resume_with(sock_dir, out, ctx, new)
    assert [e["first_publisher_seq"] for e in st["epochs"]] == [0, 0]
    assert (st["num_batches"], st["num_duplicate_batches"], st["num_resumes"]) == (15, 0, 1)
    assert [h for _s, h in _rows(out)] == [0, 1, 2, 3, 4] + list(range(100, 110))


def test_a_resumed_recording_of_the_same_run_takes_only_what_follows(sock_dir, tmp_path, ctx):
    out = tmp_path / "trace"
    run = {s: payload(100.0 + s, [stored(s)]) for s in range(8)}
    _resume_with(sock_dir, out, ctx, {s: p for s, p in run.items() if s < 5})
    st = _resume_with(sock_dir, out, ctx, run)
    assert len(st["epochs"]) == 1 and st["num_batches"] == 8 and st["num_missing_batches"] == 0
    assert [h for _s, h in _rows(out)] == list(range(8))


@pytest.mark.parametrize("batch, why", [
    ([math.nan, [stored(1)], 0], "batch time"), ([math.inf, [stored(1)], 0], "batch time"),
    ([float(1 << 63), [stored(1)], 0], "batch time"), ([1 << 63, [stored(1)], 0], "batch time"),
    ([-1.0, [stored(1)], 0], "batch time"), ([1.0, [stored(1)], -5], "rank"), ([1.0, [stored(1)], 1 << 40], "rank"),
])
def test_a_batch_the_trace_cannot_hold_is_a_malformed_frame(batch, why, sock_dir, tmp_path):
    import msgspec

    out = tmp_path / "trace"
    listener = _listener(out, sock_dir, replay=False)
    _send(listener, 0, 100.0, 0)
    listener._on_live(listener.recorders[0], frames(1, msgspec.msgpack.encode(batch)))
    _send(listener, 2, 102.0, 2)
    listener.close()
    meta = _meta(out)
    st = meta["kv_events"]
    assert (st["num_malformed_frames"], st["num_batches"], st["num_unrecovered_batches"]) == (1, 2, 0)
    assert why in st["malformed"][0] and meta["engine_index"] == 0 and meta["complete"] is True
    assert _rows(out) == [(0, 0), (2, 2)]


@pytest.mark.parametrize("field, value", [("block_size", 0), ("block_size", -4), ("block_size", (1 << 63) - 1),
                                          ("block_size", 1 << 62), ("group_idx", 1 << 40), ("group_idx", -1)])
def test_an_event_the_trace_cannot_hold_is_a_malformed_event(field, value, sock_dir, tmp_path, cli):
    out = tmp_path / "trace"
    listener = _listener(out, sock_dir, replay=False)
    listener._on_live(listener.recorders[0], frames(0, payload(100.0, [stored(1), stored(2, **{field: value})])))
    listener.close()
    meta = _meta(out)
    assert (meta["kv_events"]["num_malformed_events"], meta["block_size"]) == (1, 32)
    assert _rows(out) == [(0, 1)]
    r = cli(["residency", out, "--json"])  # the trace stays readable by the analyses
    assert r.exit_code == 0, r.stdout


def test_endpoints_that_read_alike_keep_their_own_partitions_also_resumed(sock_dir, tmp_path):
    (sock_dir / "a").mkdir()
    eps = [f"ipc://{sock_dir}/a/b.sock", f"ipc://{sock_dir}/a-b.sock"]  # one readable name
    out = tmp_path / "trace"
    for order in (eps, eps[::-1], eps):
        listener = Listener(out, [PublisherSpec(ep, None, "kv") for ep in order])
        for rec in listener.recorders:
            n = rec.stats["num_batches"]
            listener._on_live(rec, frames(n, payload(100.0 + n, [stored(len(rec.spec.endpoint) * 10 + n)])))
        listener.close()
    metas = [json.loads(f.read_text()) for f in sorted((out / "engines").glob("*.json"))]
    assert sorted(m["kv_events"]["endpoint"] for m in metas) == sorted(eps)
    assert [m["kv_events"]["num_batches"] for m in metas] == [3, 3]
    assert [m["kv_events"]["num_resumes"] for m in metas] == [2, 2]


@pytest.mark.parametrize("bucket, says", [("1e-320", "at least 0.001, at most 1,000,000,000, not 9.99989e-321"),
                                          ("1e300", "at most 1,000,000,000, not 1e+300"), ("inf", "not inf"),
                                          ("nan", "not nan"), ("0.001", "more than 1,000,000 buckets")])
def test_residency_refuses_a_bucket_it_cannot_use_in_one_sentence(bucket, says, sock_dir, tmp_path, cli):
    out = tmp_path / "trace"
    listener = _listener(out, sock_dir, replay=False)
    _send(listener, 0, 100.0, 1)
    _send(listener, 1, 2_000.0, 2)  # 1,900 s: 1.9 million buckets of 1 ms
    listener.close()
    r = cli(["residency", out, "--bucket-s", bucket])
    assert r.exit_code == 1 and r.stderr.startswith("Error: --bucket-s ") and says in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2


def test_parents_that_loop_back_end_the_prefix_walk():
    """Stores whose recorded parents form a cycle: each unreported prefix stops at the loop (no block twice),
    so 600 such stores rebuild a few blocks each, not 2^16 (the walk's cap) each."""
    import polars as pl

    from kmesh_trace.oracle.kv_stream import rebuilt_rows

    events = [("cached", 1, 2), ("cached", 2, 1)] + [("cached", 1000 + i, 1) for i in range(600)]
    df = pl.DataFrame({"event": [e for e, _, _ in events], "block_hash": [h for _, h, _ in events],
                       "parent_block_hash": [p for _, _, p in events], "ts_ns": list(range(len(events))),
                       "seq": list(range(len(events)))}, schema={"event": pl.String, "block_hash": pl.UInt64,
                       "parent_block_hash": pl.UInt64, "ts_ns": pl.Int64, "seq": pl.Int64})
    rows, counts = rebuilt_rows(df, 16, "e0")
    assert counts["num_parent_cycles"] == 600 and counts["num_unreported_prefixes"] == 601
    assert all(len(r["prompt_block_hashes"]) == len(set(r["prompt_block_hashes"])) for r in rows[1:])
    assert rows[1]["prompt_block_hashes"] == [2, 1, 1000]
    assert sum(len(r["prompt_block_hashes"]) for r in rows) == 3 + 600 * 3


def _rebuild(events):
    from kv_wire import rebuild_rows  # tests/ is on sys.path

    return rebuild_rows(events)


def test_admission_retries_are_one_request_with_the_admitting_hit():
    """vLLM re-announces a waiting request's hit (parent None) on every admission attempt: three failed
    attempts in batches 1-3, then the admitted one in batch 4 (its stores follow): one request, 2 hit blocks;
    a second request with the same prefix after it is a request of its own."""
    report = [("touched", 1, None), ("touched", 2, 1)]
    events = [("cached", 1, None, 0), ("cached", 2, 1, 0), ("cached", 3, 2, 0)]
    for b in (1, 2, 3, 4):
        events += [(e, h, p, b) for e, h, p in report]
    events += [("cached", 10, 2, 4), ("touched", 1, None, 5), ("touched", 2, 1, 5), ("cached", 20, 2, 5)]
    rows, counts = _rebuild(events)
    assert len(rows) == 3 and counts["num_retried_reports"] == 3 and counts["num_ambiguous_reports"] == 0
    assert [r["num_cached_tokens"] for r in rows] == [0, 64, 64]
    assert rows[1]["prompt_block_hashes"] == [1, 2, 10]
