"""Stopping `kmesh-trace listen` (a real subprocess, SIGINT) under a flooding publisher and a mute replay
socket: it ends within a second, and every batch it received is in the trace or counted lost.

The publisher is an XPUB socket speaking vLLM's wire format, so the test starts publishing only once the
listener's subscription has reached it (every batch sent is then one the listener was offered).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("zmq")

KMESH = str(Path(sys.executable).with_name("kmesh-trace"))


# The publisher runs in its own process: a flood from a thread of the test's process would hold its GIL
# and delay the test's own view of when the listener ended.
PUBLISHER = """
import sys, msgspec, zmq
sock_dir, count, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ctx = zmq.Context()
pub = ctx.socket(zmq.XPUB)
pub.setsockopt(zmq.SNDHWM, 0)  # the listener's own queue bound is what is under test
pub.bind(f"ipc://{sock_dir}/ev.sock")
replay = ctx.socket(zmq.ROUTER)  # takes requests, never answers
replay.bind(f"ipc://{sock_dir}/rp.sock")
assert pub.recv()[:1] == b"\\x01"  # the listener's subscription reached us
print("subscribed", flush=True)
enc, seq = msgspec.msgpack.Encoder(), 0
while count < 0 or seq < count:
    events = [{"type": "BlockStored", "block_hashes": list(range(seq * width, (seq + 1) * width)),
               "parent_block_hash": None, "token_ids": [], "block_size": 32, "lora_id": None, "medium": "GPU",
               "lora_name": None, "group_idx": 0}]
    pub.send_multipart([b"kv", seq.to_bytes(8, "big"), enc.encode([1000.0 + seq * 1e-3, events, 0])])
    seq += 1
print("sent", seq, flush=True)
sys.stdin.read()  # until the test is done
"""


def _publisher(sock_dir: Path, count: int, width: int) -> subprocess.Popen:
    """Publishes `count` batches (-1: until killed) of `width` hashes once the listener subscribed."""
    return subprocess.Popen([sys.executable, "-c", PUBLISHER, str(sock_dir), str(count), str(width)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


@pytest.fixture
def sock_dir():
    d = Path(tempfile.mkdtemp(prefix="kvs", dir="/tmp"))  # private, and short enough for ipc paths
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _start(sock_dir: Path, out: Path) -> subprocess.Popen:
    """The listener, once it has said where it listens (its signal handlers are in place by then)."""
    proc = subprocess.Popen([KMESH, "listen", f"ipc://{sock_dir}/ev.sock", "--replay-endpoint",
                             f"ipc://{sock_dir}/rp.sock", "--topic", "kv", "--out", str(out), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()
    assert line.startswith("listening to"), line + proc.stderr.read()
    return proc


def _stop(proc: subprocess.Popen) -> tuple[float, dict]:
    """SIGINT; the seconds until the process ended, and its summary."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, errs = proc.communicate(timeout=30)
    took = time.monotonic() - t0
    assert proc.returncode == 0, errs
    return took, json.loads(out)


def _accounted(out: Path) -> tuple[int, int, int]:
    """(batches in the trace, batches counted lost, the span of seqs from the first to the last seen)."""
    (meta_file,) = (out / "engines").glob("*.json")
    st = json.loads(meta_file.read_text())["kv_events"]
    from kmesh_trace.trace import open_trace

    with open_trace(out) as t:
        (top,) = t.sql("SELECT max(publisher_seq) FROM block_events").row(0)
    top = max([top] + [b for _e, _a, b in st["unrecovered"]])
    assert top is not None and st["first_publisher_seq"] is not None, st
    return st["num_batches"], st["num_unrecovered_batches"], top - st["first_publisher_seq"] + 1


@contextlib.contextmanager
def _recording(sock_dir: Path, out: Path, count: int, width: int):
    """(publisher, listener) processes, both ended afterwards."""
    pub = _publisher(sock_dir, count, width)
    try:
        proc = _start(sock_dir, out)
        try:
            assert pub.stdout.readline() == "subscribed\n"
            yield pub, proc
        finally:
            proc.kill()
    finally:
        pub.kill()
        pub.wait()


def test_sigint_ends_within_a_second_under_a_flood_with_a_mute_replay_socket(sock_dir, tmp_path):
    out = tmp_path / "trace"
    with _recording(sock_dir, out, -1, 8) as (_pub, proc):
        deadline = time.monotonic() + 60
        while not list((out / "block_events").glob("*/part-*.parquet")):  # it is recording
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        took, summary = _stop(proc)
    assert took < 1.0
    (p,) = summary["publishers"].values()
    assert p["complete"] is True
    recorded, lost, span = _accounted(out)
    assert recorded + lost == span  # no batch in the recorded window missing uncounted


def test_batches_received_before_the_stop_are_recorded_or_counted(sock_dir, tmp_path):
    out = tmp_path / "trace"
    with _recording(sock_dir, out, 1500, 40) as (pub, proc):
        assert pub.stdout.readline() == "sent 1500\n"  # the listener is still asking the mute replay socket
        took, _summary = _stop(proc)
    assert took < 1.0
    recorded, lost, span = _accounted(out)
    assert (recorded + lost, span) == (1500, 1500)
    assert recorded > 0
