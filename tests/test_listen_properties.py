"""The listener's sequence state machine driven by random message sequences (Hypothesis): gaps of any
size, repeats, restarts with the clock behind, late batches, bad values and garbage. Whatever comes in,
every message ends in exactly one place (recorded, a duplicate, or malformed), every well-formed batch
seen once is recorded once, a bad value is a counted malformed event or frame, and the trace opens.

The messages go through the listener's own entry point for live messages (`Listener._on_live`); the
replay socket, where one is used, is a real ZeroMQ ROUTER answering vLLM's replay protocol from a
buffer the test controls.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kmesh_trace.capture.listen import Listener, PublisherSpec
from kv_wire import ReplayBuffer, stored  # tests/ is on sys.path

BIG = [1 << 62, (1 << 63) - 1, 1 << 40, -5, -4, (1 << 63), -(1 << 63)]  # no rank, group or block size
BAD_TS = [math.nan, math.inf, -math.inf, float(1 << 63), -1.0, 1 << 63, (1 << 64) - 1, 1e300]


# A bad event: one field out of what a trace can hold, or of the wrong type.
BAD_EVENTS = st.one_of(
    st.sampled_from(BIG + [0]).map(lambda v: stored(1, block_size=v)),
    st.sampled_from(BIG).map(lambda v: stored(1, group_idx=v)),
    st.sampled_from(["x", 1.5, True, b"", None]).map(lambda v: stored(v)),
    st.just({"type": "BlockStored"}), st.just({"type": "Nope"}), st.just([]), st.just(7),
    st.sampled_from(BIG).map(lambda v: {"type": "BlockRemoved", "block_hashes": [1], "group_idx": v}),
)


@st.composite
def messages(draw):
    """A list of (kind, seq, ts, payload-or-frames, num_good, num_bad) as a hostile publisher sends them."""
    out = []
    seq, ts, used = 0, 1_000.0, set()
    for i in range(draw(st.integers(1, 14))):
        op = draw(st.sampled_from(["next", "next", "next", "gap", "repeat", "restart", "behind", "late",
                                   "bad_ts", "bad_rank", "garbage", "frames", "neg_seq", "end"]))
        ts += 1.0
        if op == "repeat" and out:
            out.append(draw(st.sampled_from(out)))
            continue
        if op == "gap":
            seq += draw(st.sampled_from([2, 5, 1000, 1 << 40, 1 << 62]))
        elif op == "restart":
            seq = draw(st.integers(0, 3))
        elif op == "behind":  # restarted with its clock behind
            seq, ts = draw(st.integers(0, 3)), max(ts - draw(st.sampled_from([2.0, 500.0])), 1.0)
        while ts in used:  # one stamp per batch: the trace's rows name a batch by (seq, stamp)
            ts += 0.25
        used.add(ts)
        if op == "late" and 2 < seq < 1 << 63:
            seq_l = draw(st.integers(0, seq - 1))
            good = [stored(10_000 + i)]
            out.append(("ok", seq_l, ts, msgspec.msgpack.encode([ts, good, 0]), 1, 0))
            continue
        if op == "frames":
            out.append(("frames", None, None, draw(st.sampled_from([[b"kv"], [b"kv", b"\x00\x01", b""],
                                                                    [b"kv", b"", b"", b""]])), 0, 0))
            continue
        if op == "neg_seq":
            out.append(("frames", None, None, [b"kv", (-7).to_bytes(8, "big", signed=True), b"\x90"], 0, 0))
            continue
        if op == "end":
            out.append(("frames", None, None, [b"", (-1).to_bytes(8, "big", signed=True), b""], 0, 0))
            continue
        good = [stored(1000 * i + j, parent_block_hash=None) for j in range(draw(st.integers(1, 3)))]
        bad = draw(st.lists(BAD_EVENTS, max_size=2))
        events = good + bad
        if op == "bad_ts":
            payload = msgspec.msgpack.encode([draw(st.sampled_from(BAD_TS)), events, 0])
            out.append(("bad", seq, ts, payload, 0, 0))
        elif op == "bad_rank":
            out.append(("bad", seq, ts, msgspec.msgpack.encode([ts, events, draw(st.sampled_from(BIG[:5]))]), 0, 0))
        elif op == "garbage":
            out.append(("bad", seq, ts, draw(st.sampled_from([b"\xc1", b"\x92\xcb", b"\x91" * 4000, b""])), 0, 0))
        elif seq >= 1 << 63:  # eight bytes read as a signed seq: a negative one, malformed
            out.append(("bad", seq, ts, msgspec.msgpack.encode([ts, events, 0]), 0, 0))
        else:
            out.append(("ok", seq, ts, msgspec.msgpack.encode([ts, events, 0]), len(good), len(bad)))
        seq += 1
    return out


def _wire(m) -> list[bytes]:
    kind, seq, _ts, payload, _g, _b = m
    return payload if kind == "frames" else [b"kv", (seq % (1 << 64)).to_bytes(8, "big"), payload]


@pytest.fixture(scope="module")
def sock_dir():
    d = Path(tempfile.mkdtemp(prefix="kvp", dir="/tmp"))  # ipc paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _groups(out: Path) -> list[tuple]:
    from kmesh_trace.trace import open_trace

    with open_trace(out) as t:
        return t.sql("SELECT publisher_seq, wall_publish_ns, count(*) AS n FROM block_events GROUP BY ALL").rows()


def _recorded(out: Path) -> dict:
    return {(s, w): n for s, w, n in _groups(out)}


def _check(out: Path, msgs, st_: dict, num_received: int) -> None:
    """The accounting every run must satisfy (`msgs`: every message received), and the trace opens."""
    assert st_["num_batches"] + st_["num_malformed_frames"] + st_["num_duplicate_batches"] == num_received
    assert st_["num_missing_batches"] == st_["num_recovered_batches"] + st_["num_unrecovered_batches"] + \
        st_["num_late_batches"]
    rows = _groups(out)
    by_id = {(seq, int(ts * 1e9)): (g, b) for kind, seq, ts, _p, g, b in msgs if kind == "ok"}
    recorded = {}
    for seq, wall, n in rows:
        good, _bad = by_id[(seq, wall)]  # no row that no message carried
        assert n % good == 0  # whole batches only
        recorded[(seq, wall)] = n // good
    unique = [m for m in msgs if m[0] == "ok" and sum(x[3] == m[3] and x[1] == m[1] for x in msgs) == 1]
    for _k, seq, ts, _p, _g, _b in unique:  # a well-formed batch sent once is recorded once
        assert recorded.get((seq, int(ts * 1e9))) == 1, (seq, ts)
    assert st_["num_batches"] == sum(recorded.values())
    assert st_["num_malformed_events"] == sum(k * by_id[i][1] for i, k in recorded.items())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(msgs=messages())
def test_every_live_message_is_recorded_or_counted(msgs, sock_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trace")
    listener = Listener(out, [PublisherSpec(f"ipc://{sock_dir}/ev.sock", None, "kv")])
    rec = listener.recorders[0]
    for m in msgs:
        listener._on_live(rec, _wire(m))
    listener.close()
    _check(out, msgs, rec.stats, len(msgs))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(n=st.integers(1, 40), dropped=st.sets(st.integers(0, 39), max_size=20), kept_from=st.integers(0, 40),
       repeats=st.sets(st.integers(0, 39), max_size=5))
def test_gaps_are_filled_from_replay_or_counted_exactly(n, dropped, kept_from, repeats, sock_dir, tmp_path_factory):
    """A publisher sends seq 0..n-1; `dropped` never arrive live, `repeats` arrive twice; its replay buffer
    still holds seq >= kept_from. Recovered + lost = missing, exactly; every batch is recorded once."""
    import zmq

    payloads = {s: msgspec.msgpack.encode([100.0 + s, [stored(s)], 0]) for s in range(n)}
    ctx = zmq.Context()
    replay = ReplayBuffer(ctx, f"ipc://{sock_dir}/rp.sock", {s: p for s, p in payloads.items() if s >= kept_from})
    out = tmp_path_factory.mktemp("trace")
    listener = Listener(out, [PublisherSpec(f"ipc://{sock_dir}/ev.sock", f"ipc://{sock_dir}/rp.sock", "kv")],
                        replay_timeout_s=2)
    rec = listener.recorders[0]
    live = [s for s in range(n) if s not in dropped]
    try:
        for s in live:
            for _ in range(1 + (s in repeats)):
                listener._on_live(rec, [b"kv", s.to_bytes(8, "big"), payloads[s]])
        listener.close()
    finally:
        replay.close()
        ctx.term()
    st_ = rec.stats
    last = max(live, default=-1)
    missing = [s for s in range(last + 1) if s in dropped and s > live[0]] if live else []
    lost = [s for s in missing if s < kept_from]
    assert (st_["num_missing_batches"], st_["num_unrecovered_batches"]) == (len(missing), len(lost))
    assert st_["num_recovered_batches"] == len(missing) - len(lost)
    assert st_["num_duplicate_batches"] == len([s for s in live if s in repeats])
    received = [s for s in live for _ in range(1 + (s in repeats))] + [s for s in missing if s >= kept_from]
    _check(out, [("ok", s, 100.0 + s, payloads[s], 1, 0) for s in received], st_, len(received))
    assert _recorded(out) == {(s, int((100.0 + s) * 1e9)): 1 for s in received}
