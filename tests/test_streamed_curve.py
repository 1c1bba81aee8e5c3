"""The exact curve of a Mooncake JSONL file with its stream built on disk (oracle/streamed_curve.py): the
stream built in pieces is the in-memory stream up to the numbering of the objects, the `headroom` JSON is
the in-memory one byte for byte with pieces small enough that every boundary is crossed many times, the
path is chosen by the stream's length and the memory budget, says so in a note (never in the JSON), and refuses what it cannot read
in one pass."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle import stream_pieces, streamed_curve
from kmesh_trace.oracle.headroom import HeadroomOptions
from kmesh_trace.oracle.stream import next_uses
from kmesh_trace.oracle.streamed_curve import DiskStream, choose_path, estimated_reads
from kmesh_trace.native.kernels import I64, P, declare, ptr

BLOCK = 512


def conversations(seed=11, num_conversations=300, turns=14, prompts=25):
    """Mooncake records: conversations whose every turn re-reads its growing prefix after one of `prompts`
    system prompts, a partial last block of its own, interleaved in time (about 10^5 block reads)."""
    rng = np.random.default_rng(seed)
    events, next_id = [], 1 << 40
    for c in range(num_conversations):
        prefix = list(range(c % prompts * 1000, c % prompts * 1000 + int(rng.integers(2, 12))))
        t = rng.uniform(0, 5000)
        for _ in range(turns):
            grow = int(rng.integers(1, 10))
            prefix = prefix + list(range(next_id, next_id + grow))
            next_id += grow
            tail = int(rng.integers(0, BLOCK))  # a partial last block: its own id, never reused
            ids = prefix + ([next_id] if tail else [])
            next_id += 1
            events.append((int(t * 1000), BLOCK * len(prefix) + tail, int(rng.integers(0, 400)), ids))
            t += rng.exponential(30)
    events.sort(key=lambda e: e[0])
    return events


def write_jsonl(path, events):
    with open(path, "w") as f:
        for ts, n_in, n_out, ids in events:
            f.write(json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}) + "\n")
    return path


@pytest.fixture(scope="module")
def events():
    return conversations()


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory, events):
    return write_jsonl(tmp_path_factory.mktemp("streamed") / "agentic.jsonl", events)


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 4 KiB of text, 37 rows of a trace and 777 accesses: thousands of boundaries on the test stream."""
    monkeypatch.setattr(streamed_curve, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(streamed_curve, "NEXT_USE_PIECE", 777)
    monkeypatch.setattr(stream_pieces, "TRACE_BATCH_ROWS", 37)


def in_memory_stream(path):
    from kmesh_trace.sources import read_directly
    from kmesh_trace.oracle.workload import Workload

    w = Workload.from_trace(read_directly(path), None, requests=False)
    return w.stream, w.columns


def test_stream_on_disk_is_the_in_memory_stream(jsonl):
    stream, columns = in_memory_stream(jsonl)
    assert len(stream) > 100_000
    with DiskStream(jsonl, BLOCK, chunk_bytes=4096, piece=1001) as disk:
        d = disk.stream
        assert (len(d), d.num_objects) == (len(stream), stream.num_objects)
        # The same objects, numbered by first sighting: one id here for each there, and back.
        pairs = np.unique(np.stack([np.asarray(stream.obj), np.asarray(d.obj)]), axis=1)
        assert pairs.shape[1] == stream.num_objects == len(np.unique(pairs[1]))
        first_seen = np.unique(np.asarray(d.obj), return_index=True)[1]
        assert np.array_equal(first_seen, np.sort(first_seen))  # id k is the k-th object seen
        for name in ("eligible", "next_use", "req_start", "num_prompt_tokens", "num_reads"):
            assert np.array_equal(np.asarray(getattr(stream, name)), np.asarray(getattr(d, name))), name
        for name in ("num_output_tokens", "arrival_ns", "finish_ns"):
            assert np.array_equal(getattr(columns, name), getattr(disk.columns, name)), name
        assert disk.columns.timed == columns.timed
        where = disk.dir
    assert not where.exists()  # the files go with it


def test_id_table_numbers_hashes_at_their_first_sighting():
    new, free = declare("ks_idtable_new", [I64], P), declare("ks_idtable_free", [P])
    assign = declare("ks_idtable_assign", [P, P, I64, P], I64)
    rng = np.random.default_rng(3)
    hashes = rng.choice(np.array([0, 2**64 - 1, *rng.integers(0, 2**63, 5000)], np.uint64), 60_000)
    table, seen, ids = new(1), {}, []
    try:
        for part in np.array_split(hashes, 17):  # across pieces, through many doublings of the table
            out = np.empty(len(part), np.int32)
            got = assign(table, ptr(np.ascontiguousarray(part), np.uint64), len(part), ptr(out, np.int32))
            ids.extend(out.tolist())
            for h in part.tolist():
                seen.setdefault(h, len(seen))
            assert got == len(seen)
    finally:
        free(table)
    assert ids == [seen[h] for h in hashes.tolist()]


def test_next_uses_backward_in_pieces_are_next_uses():
    kernel = declare("ks_streamed_next_uses", [P, P, I64, I64, P, I64, P])
    rng = np.random.default_rng(5)
    obj = rng.integers(0, 300, 20_000).astype(np.int32)
    eligible = rng.random(20_000) < 0.7
    nxt = np.full(300, -1, np.int32)
    out = np.empty(len(obj), np.int64)
    for end in range(len(obj), 0, -613):
        start = max(end - 613, 0)
        o, e, piece = obj[start:end], eligible[start:end], np.empty(end - start, np.int64)
        kernel(ptr(o, np.int32), ptr(e, np.bool_), end - start, start, ptr(nxt, np.int32),
               int(np.iinfo(np.int64).max), ptr(piece, np.int64))
        out[start:end] = piece
    assert np.array_equal(out, next_uses(obj, eligible))


@pytest.mark.parametrize("extra", [[], ["--policies", "lru,belady"], ["--prefill-tokens-per-s", "5000"]])
def test_cli_json_is_the_in_memory_json_byte_for_byte(cli, jsonl, small_pieces, extra):
    _same_json_from_disk(cli, ["headroom", jsonl, "--window", "last-half", "--json", *extra])


def _same_json_from_disk(cli, args) -> str:
    """`args` give the same JSON in memory and, with --sample 1 under the in-memory curve's need, from disk
    (a note says so); returns it."""
    mem = cli(args)
    assert mem.exit_code == 0, mem.output
    assert "bounded memory" not in mem.stderr
    disk = cli([*args, "--sample", "1", "--memory-budget", "0.0001"])
    assert disk.exit_code == 0, disk.output
    assert disk.stdout == mem.stdout
    assert "note: bounded memory: the stream of" in disk.stderr and "built on disk" in disk.stderr
    return mem.stdout


def test_cli_human_output_names_the_path(cli, jsonl, small_pieces):
    r = cli(["headroom", jsonl, "--window", "last-half", "--sample", "1", "--memory-budget", "0.0001"])
    assert r.exit_code == 0, r.output
    assert "bounded memory" in r.stderr and "lru" in r.stdout


def test_path_is_chosen_by_the_memory_budget(jsonl, monkeypatch):
    reads = estimated_reads(jsonl)
    stream, _ = in_memory_stream(jsonl)
    assert 0.8 < reads / int(stream.num_reads.sum()) < 1.25
    curve = HeadroomOptions(window="last-half")
    assert not choose_path(jsonl, curve)  # fits: in memory
    assert not choose_path(jsonl, HeadroomOptions(window="last-half", memory_budget_gib=1.0))
    # Between this path's need per read and the in-memory curve's (16 B an access beyond the stream)
    tight = HeadroomOptions(window="last-half", memory_budget_gib=reads * 10 / 2**30)
    assert not choose_path(jsonl, tight)  # neither fits (this path's fixed part): the in-memory path samples
    monkeypatch.setattr(streamed_curve, "STREAMED_FIXED_BYTES", 0)
    assert choose_path(jsonl, tight)  # the in-memory curve does not fit, this one does
    assert not choose_path(jsonl, tight, remote=True)
    for other in (HeadroomOptions((8,), window="last-half", memory_budget_gib=0.001),  # given capacities
                  HeadroomOptions(window="last-half", sample=0.1, memory_budget_gib=0.001),
                  HeadroomOptions(window="last-half", partitions=2, memory_budget_gib=0.001)):
        assert not choose_path(jsonl, other)
    forced = HeadroomOptions(window="last-half", sample=1, memory_budget_gib=1e-6)
    assert choose_path(jsonl, forced)


def test_a_long_stream_takes_this_path_even_where_memory_would_hold_it(jsonl, monkeypatch):
    curve = HeadroomOptions(window="last-half")
    assert choose_path(jsonl, curve) is None  # short: in memory
    monkeypatch.setattr(streamed_curve, "STREAMED_FROM_READS", estimated_reads(jsonl))
    assert choose_path(jsonl, curve) is streamed_curve.LARGE
    assert choose_path(jsonl, HeadroomOptions(window="last-half", sample=1)) is streamed_curve.LARGE
    # a budget too small for the in-memory curve: chosen for the memory, whatever the length
    assert choose_path(jsonl, HeadroomOptions(window="last-half", sample=1, memory_budget_gib=1e-6)) is \
        streamed_curve.TOO_LARGE
    # a budget this path's own needs do not fit either: the in-memory path samples, and says why
    assert choose_path(jsonl, HeadroomOptions(window="last-half", memory_budget_gib=1e-6)) is None


def test_a_long_file_this_path_cannot_read_is_read_into_memory_with_a_note(cli, tmp_path, events, monkeypatch):
    """Rows out of arrival order: the in-memory path sorts them; where the disk path was chosen for the length
    alone, the run goes on in memory (the same JSON) and says so; forced by the budget, it stops."""
    late = write_jsonl(tmp_path / "late.jsonl", [events[1], events[0], *events[2:3000]])
    args = ["headroom", late, "--window", "last-half", "--json"]
    _read_into_memory_when_long(cli, args, monkeypatch, "not in arrival order")
    forced = cli([*args, "--sample", "1", "--memory-budget", "0.0001"])
    assert forced.exit_code != 0 and "not in arrival order" in forced.output


@pytest.fixture(scope="module")
def imported(tmp_path_factory, jsonl):
    """The Mooncake file imported into a trace directory (Parquet), as `kmesh-trace import` writes it."""
    from kmesh_trace.datasets.importers.mooncake import import_mooncake

    out = tmp_path_factory.mktemp("imported") / "trace"
    import_mooncake(jsonl, out)
    return out


def test_an_imported_trace_streams_from_its_parquet_parts_to_the_same_json(cli, jsonl, imported, small_pieces):
    got = _same_json_from_disk(cli, ["headroom", imported, "--window", "last-half", "--json"])
    assert got == cli(["headroom", jsonl, "--window", "last-half", "--json"]).stdout  # the file read as it is
    assert choose_path(imported, HeadroomOptions(window="last-half")) is None
    assert choose_path(imported, HeadroomOptions(window="last-half", sample=1, memory_budget_gib=1e-6)) is \
        streamed_curve.TOO_LARGE


def test_a_trace_with_the_engines_measured_hits_is_read_into_memory_with_a_note(cli, tmp_path, imported, monkeypatch):
    """A capture's measured hits (the stock) are what the in-memory path reads: the disk path stops and says so."""
    import shutil

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    trace = tmp_path / "with-stock"
    shutil.copytree(imported, trace)
    (part,) = trace.glob("invocations/engine=*/part-*.parquet")
    t = pq.read_table(part)
    i = t.schema.get_field_index("num_cached_tokens")
    hits = pc.divide(t["num_prompt_tokens"], 2).cast(t.schema.field(i).type)
    pq.write_table(t.set_column(i, t.schema.field(i), hits), part)
    _read_into_memory_when_long(cli, ["headroom", trace, "--window", "last-half", "--json"], monkeypatch,
                                "measured hits")


def _read_into_memory_when_long(cli, args, monkeypatch, why: str) -> None:
    """`args` give the in-memory JSON whether the disk path is chosen for the length or not, and, where it is, a
    note that it stopped, saying `why`."""
    mem = cli(args)
    assert mem.exit_code == 0, mem.output
    monkeypatch.setattr(streamed_curve, "STREAMED_FROM_READS", 1)
    long = cli(args)
    assert long.exit_code == 0, long.output
    assert long.stdout == mem.stdout
    assert "the bounded-memory path stopped" in long.stderr and why in long.stderr


def test_refuses_rows_out_of_time_order_and_lines_it_cannot_read(tmp_path, events):
    late = write_jsonl(tmp_path / "late.jsonl", [events[1], events[0], *events[2:50]])
    with pytest.raises(KmeshTraceError, match="not in arrival order"):
        DiskStream(late, BLOCK, tmp_dir=str(tmp_path))
    odd = tmp_path / "odd.jsonl"
    write_jsonl(odd, events[:20])
    with open(odd, "a") as f:
        f.write('{"timestamp": 9000000000000, "input_length": "5", "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(KmeshTraceError, match="not in the plain Mooncake shape"):
        DiskStream(odd, BLOCK, tmp_dir=str(tmp_path))
    assert not list(tmp_path.glob("kmesh-stream-*"))


def test_a_memory_budget_beyond_any_machine_is_refused_in_one_sentence(cli, tmp_path):
    """--memory-budget 1e300 (GiB) is finite but no machine has it: refused at parse time, not an OverflowError."""
    r = cli(["headroom", tmp_path, "--memory-budget", "1e300"])
    assert r.exit_code == 1 and "'1e300' is not a finite number above 0 and at most 1,048,576." in r.output


# ---- what the disk path estimates and what it does when the disk runs out -----------------------------------

def _prepend(path, text: str, events):
    with open(path, "w") as f:
        f.write(text)
    with open(path, "a") as f:
        for ts, n_in, n_out, ids in events:
            f.write(json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}) + "\n")
    return path


def test_the_estimate_reads_record_lines_from_head_to_end(tmp_path, events, monkeypatch):
    """The reads of a long file are estimated from windows spread over it, record lines only: a head of blank
    lines (the head-only estimate: 0 reads) or of one-block requests before long ones (about a tenth) is
    estimated within a small factor; a file whose windows hold no record errs high, never at 0."""
    monkeypatch.setattr(streamed_curve, "SNIFF_BYTES", 64 << 10)
    reads = sum(len(e[3]) for e in events)
    blank = _prepend(tmp_path / "blank.jsonl", "\n" * (1 << 20), events)
    assert 0.7 < estimated_reads(blank) / reads < 1.4
    thin = [(0, 100, 1, [7 + i]) for i in range(20_000)]
    thin_head = tmp_path / "thin.jsonl"
    write_jsonl(thin_head, thin + [(e[0] + 1, *e[1:]) for e in events])
    assert 0.6 < estimated_reads(thin_head) / (reads + len(thin)) < 1.6
    only_blank = tmp_path / "nothing.jsonl"
    only_blank.write_text("\n" * (1 << 20))
    assert estimated_reads(only_blank) == (1 << 20) // streamed_curve.MIN_BYTES_PER_READ


def test_a_blank_head_under_a_tiny_budget_is_sampled_while_read(cli, tmp_path, events, monkeypatch):
    """The head-only estimate said 0 reads, and a long file went whole into memory under any budget."""
    monkeypatch.setattr(streamed_curve, "SNIFF_BYTES", 64 << 10)
    blank = _prepend(tmp_path / "blank.jsonl", "\n" * (1 << 20), events)
    r = cli(["headroom", blank, "--window", "last-half", "--memory-budget", "0.001", "--json"])
    assert r.exit_code == 0, r.output
    sampled = json.loads(r.stdout)["sampled"]
    assert sampled["taken"] == "at read" and "over the memory budget" in sampled["why"]


def test_a_low_estimate_is_checked_against_the_disk_when_the_first_pass_ends(jsonl, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    stream, _ = in_memory_stream(jsonl)
    n = int(stream.num_reads.sum())
    monkeypatch.setattr(streamed_curve, "estimated_reads", lambda path: 0)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, 0, 6 * n))  # the next uses, 8 B a read, do not fit
    with pytest.raises(stream_pieces.Unstreamable, match="more on disk"):
        DiskStream(jsonl, BLOCK, tmp_dir=str(tmp_path))
    assert not list(tmp_path.glob("kmesh-stream-*"))


@pytest.fixture
def full_disk(tmp_path, monkeypatch):
    """The stream's files are the kernel's full device (/dev/full: every write fails with ENOSPC)."""
    import tempfile

    def mkdtemp(prefix="", dir=None):
        d = tmp_path / "full"
        d.mkdir()
        for name in ("obj", "eligible"):  # pass 1's files (next_use is truncated to size first, which a device refuses)
            (d / name).symlink_to("/dev/full")
        return str(d)

    if not __import__("os").path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    return tmp_path


def test_a_full_temporary_directory_stops_the_path_in_one_sentence(jsonl, full_disk):
    with pytest.raises(stream_pieces.Unstreamable, match="filled up while the stream"):
        DiskStream(jsonl, BLOCK, chunk_bytes=4096, tmp_dir=str(full_disk))
    assert not (full_disk / "full").exists()


def test_a_full_temporary_directory_falls_back_to_memory_or_says_so(cli, jsonl, full_disk, monkeypatch):
    args = ["headroom", jsonl, "--window", "last-half", "--json"]
    monkeypatch.setattr(streamed_curve, "STREAMED_FROM_READS", 1)  # chosen for the length: memory holds it
    long = cli(args)
    assert long.exit_code == 0, long.output
    assert "the bounded-memory path stopped" in long.stderr and "filled up" in long.stderr
    forced = cli([*args, "--sample", "1", "--memory-budget", "0.0001"])  # memory cannot hold it: one sentence
    assert forced.exit_code == 1 and "filled up while the stream" in forced.stderr and "unexpected" not in forced.stderr


@pytest.mark.parametrize("when", ["first pass", "curves"])
def test_ctrl_c_on_the_disk_path_exits_130_and_leaves_nothing(tmp_path, when):
    """SIGINT while the stream is written (its directory exists) or while the curves read it (the next uses are
    written): exit 130, one line, the temporary directory gone."""
    import os
    import signal
    import subprocess
    import sys
    import time

    big = tmp_path / "big.jsonl"
    with open(big, "w") as f:
        for i in range(60_000):
            ids = ",".join(map(str, [*range(i % 40 * 100, i % 40 * 100 + 30), *range(10**6 + 30 * i, 10**6 + 30 * i + 30)]))
            f.write(f'{{"timestamp": {i}, "input_length": 30720, "output_length": 8, "hash_ids": [{ids}]}}\n')
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    exe = [sys.executable, "-m", "kmesh_trace.cli", "headroom", str(big), "--sample", "1", "--memory-budget", "0.01",
           "--json"]
    p = subprocess.Popen(exe, env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    mark = "kmesh-stream-*" if when == "first pass" else "kmesh-stream-*/next_use"
    deadline = time.monotonic() + 120
    while not list(tmp.glob(mark)) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert p.poll() is None, "the run ended before it could be interrupted: make the file longer"
    p.send_signal(signal.SIGINT)
    _, stderr = p.communicate(timeout=120)
    assert p.returncode == 130, stderr.decode()
    assert stderr.decode().strip().endswith("Error: interrupted.") and "Traceback" not in stderr.decode()
    assert not list(tmp.iterdir())
