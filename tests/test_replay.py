"""Native replay on a CPU host: the `host` route end to end on real files with real io_uring.

Every payload is verified against the generator and the journal's SHA-256, corruptions are rejected
exactly, misaligned sizes and missing files give one clear error, and the native engine's reads are
compared with plain pread (the reference implementation).
"""

from __future__ import annotations

import ctypes.util
import errno
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kmesh_trace.native import store as st
from kmesh_trace.native._lib import CHUNK_DTYPE, HostArena, Ring
from kmesh_trace.native.runner import RunConfig, run, schedule
from replay_support import KIB, ddir, small_store  # noqa: F401  (the fixture, a helper; importing it skips without io_uring)


def test_prepare_writes_generator_content_and_journal(ddir):
    s = small_store(ddir)
    j = pq.read_table(ddir / "s" / st.JOURNAL)
    assert j.schema.equals(st.JOURNAL_SCHEMA.with_metadata(j.schema.metadata))
    assert j.num_rows == 6
    assert j["chunk_key"].to_pylist()[:3] == ["r000000/c0000", "r000000/c0001", "r000000/c0002"]
    assert j["offset_bytes"].to_pylist()[:3] == [0, 64 * KIB, 128 * KIB]
    raw = (ddir / "s" / "payload" / "restore-000001.bin").read_bytes()
    assert len(raw) == 3 * 64 * KIB
    c = s.restores[1][2]
    assert raw[c.offset_bytes: c.offset_bytes + c.size_bytes] == st.payload(7, 1, 2, 64 * KIB)
    # the content depends on (seed, restore, chunk): distinct chunks differ
    assert st.payload(7, 1, 2, 4096) != st.payload(7, 1, 1, 4096) != st.payload(8, 1, 2, 4096)


def test_native_reads_match_pread_with_several_workers_and_short_queue(ddir):
    s = small_store(ddir, restores=1, chunks=6, chunk_bytes=8 * KIB)
    path = ddir / "s" / s.restores[0][0].file
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    plain = os.open(path, os.O_RDONLY)
    buf = HostArena(64 * KIB)
    try:
        # out of order, into scattered destinations: chunk i of the file lands at dest[i]
        order = [5, 0, 3, 1, 4, 2]
        dest = [0, 48, 8, 32, 16, 24]
        chunks = np.array([(fd, 0, k * 8 * KIB, 8 * KIB, d * KIB) for k, d in zip(order, dest)], dtype=CHUNK_DTYPE)
        with Ring(depth=2, num_workers=3) as ring:
            ring.register_buffers([buf.address], [64 * KIB])
            samples, done = ring.restore(chunks)
            own = ring.ownership()
            ring.unregister_buffers()
        assert samples["result"].tolist() == [8 * KIB] * 6
        assert sorted(set(samples["worker"].tolist())) == [0, 1, 2]
        assert (samples["complete_ns"] >= samples["submit_ns"]).all() and done >= samples["complete_ns"].max()
        for k, d in zip(order, dest):
            assert buf.array[d * KIB: d * KIB + 8 * KIB].tobytes() == os.pread(plain, 8 * KIB, k * 8 * KIB)
        assert (own.num_acquired, own.num_released, own.num_inflight, own.num_cq_pending) == (6, 6, 0, 0)
        assert own.drained
    finally:
        os.close(fd)
        os.close(plain)


def test_huge_page_arena_is_aligned_and_reads_match_pread(ddir):
    """An arena of 2 MiB or more starts on a huge-page boundary (asked MADV_HUGEPAGE); reads into it at
    offsets that straddle the boundary land exactly, as into plain pages."""
    s = small_store(ddir, restores=1, chunks=4, chunk_bytes=64 * KIB)
    path = ddir / "s" / s.restores[0][0].file
    fd, plain = os.open(path, os.O_RDONLY | os.O_DIRECT), os.open(path, os.O_RDONLY)
    big, small = HostArena(4 << 20), HostArena(4 << 20, huge=False)
    try:
        assert big.address % (2 << 20) == 0 and small.address % 4096 == 0 and not small.huge
        assert not HostArena(64 * KIB).huge  # under a huge page: plain pages, no padding
        for arena in (big, small):
            arena.array[:] = 0xA5
            dest = [(2 << 20) - 96 * KIB, 0, (4 << 20) - 64 * KIB, (2 << 20) - 32 * KIB]
            chunks = np.array([(fd, 0, k * 64 * KIB, 64 * KIB, d) for k, d in enumerate(dest)], dtype=CHUNK_DTYPE)
            with Ring(depth=4) as ring:
                ring.register_buffers([arena.address], [4 << 20])
                samples, _ = ring.restore(chunks)
                assert ring.ownership().drained
            assert samples["result"].tolist() == [64 * KIB] * 4
            for k, d in enumerate(dest):
                assert arena.array[d: d + 64 * KIB].tobytes() == os.pread(plain, 64 * KIB, k * 64 * KIB)
    finally:
        big.close(), small.close(), os.close(fd), os.close(plain)


def test_read_past_end_of_file_is_reported_not_hidden(ddir):
    s = small_store(ddir, restores=1, chunks=2, chunk_bytes=4 * KIB)
    fd = os.open(ddir / "s" / s.restores[0][0].file, os.O_RDONLY | os.O_DIRECT)
    buf = HostArena(16 * KIB)
    try:
        # the file has 8 KiB: this chunk gets a short read (4 KiB), is resubmitted, then hits end of file
        chunks = np.array([(fd, 0, 4 * KIB, 8 * KIB, 0)], dtype=CHUNK_DTYPE)
        with Ring() as ring:
            ring.register_buffers([buf.address], [16 * KIB])
            samples, _ = ring.restore(chunks)
            assert ring.ownership().drained
        assert samples["result"][0] == -errno.ENODATA
        assert samples["num_sqes"][0] == 2
    finally:
        os.close(fd)


def test_host_route_end_to_end_every_payload_verified_corruptions_rejected(ddir):
    small_store(ddir)
    cfg = RunConfig(routes=["host"], pairs=2, restores=5, warmup=1, corrupt=2, depth=4, seed=3)
    res = run(ddir / "s", cfg, out=ddir / "res")
    sm = res.summary
    h = sm["routes"]["host"]
    assert (h["num_measured"], h["num_warmup"], h["num_rejected"], h["num_rejected_measured"]) == (5, 2, 2, 0)
    assert h["bytes_moved"] == (5 + 2 + 2) * 3 * 64 * KIB
    assert h["ownership"] == {"num_acquired": 27, "num_released": 27, "num_inflight": 0, "num_cq_pending": 0,
                              "drained": True}
    picks = np.random.default_rng(3).choice(6, 2, replace=False)
    expected = sorted(f"r{i // 3:06d}/c{i % 3:04d}" for i in picks)
    assert sm["corrupted_chunks"] == expected
    assert (sm["corruptions_rejected"], sm["corruption_checks"], sm["missed_corruptions"]) == (2, 2, [])
    assert sm["unexpected_rejections"] == [] and sm["all_buffers_returned"] and sm["ok"]
    assert [p["num_measured"] for p in sm["pairs"]] == [3, 2]
    # every sample kept: restores (warm-ups and corruption checks flagged) and every read
    r = pq.read_table(ddir / "res" / "restores.parquet").to_pylist()
    assert [x["kind"] for x in r] == ["warmup"] + ["measured"] * 3 + ["warmup"] + ["measured"] * 2 + ["corrupt"] * 2
    assert [x["restore_id"] for x in r[:7]] == [0, 1, 0, 1, 0, 1, 0]
    assert all(x["accepted"] for x in r[:7]) and all(x["timer1_ns"] > 0 and x["timer2_ns"] is None for x in r)
    assert [x["bad_chunks"] for x in r[7:]] == [[k] for k in expected]
    reads = pq.read_table(ddir / "res" / "reads.parquet")
    assert reads.num_rows == 27
    assert set(reads["result"].to_pylist()) == {64 * KIB}
    assert json.loads((ddir / "res" / "summary.json").read_text())["ok"] is True
    assert not list((ddir / "s").glob(".corrupt-*"))  # flipped copies are cleaned up; the store is untouched
    assert st.open_store(ddir / "s").restores[0][0].sha256 == __import__("hashlib").sha256(
        st.payload(7, 0, 0, 64 * KIB)).hexdigest()


def test_schedule_alternates_pairs_with_warmups_per_arm():
    cfg = RunConfig(routes=["host", "host_fixed"], pairs=3, restores=4, warmup=1)
    got = [(p, pos, r[5] if "_" in r else "h", k[0]) for p, pos, r, k in schedule(cfg)]
    assert got == [(0, 0, "h", "w"), (0, 0, "h", "m"), (0, 0, "h", "m"), (0, 1, "f", "w"), (0, 1, "f", "m"),
                   (0, 1, "f", "m"),
                   (1, 0, "f", "w"), (1, 0, "f", "m"), (1, 1, "h", "w"), (1, 1, "h", "m"),
                   (2, 0, "h", "w"), (2, 0, "h", "m"), (2, 1, "f", "w"), (2, 1, "f", "m")]


def test_cli_prepare_and_run_json(ddir, cli):
    r = cli(["replay", "prepare", "--out", ddir / "s", "--chunks", 2, "--chunk-bytes", 16384, "--num-restores", 2,
             "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"store": str(ddir / "s"), "journal": str(ddir / "s" / "journal.parquet"),
                                    "num_restores": 2, "num_chunks": 4, "num_bytes": 65536, "seed": 0,
                                    "source": "uniform"}
    r = cli(["replay", "run", ddir / "s", "--pairs", 1, "--restores", 2, "--warmup", 0, "--corrupt", 1,
             "--out", ddir / "res", "--json"])
    assert r.exit_code == 0, r.output
    sm = json.loads(r.stdout)
    assert (sm["ok"], sm["corruptions_rejected"], sm["routes"]["host"]["num_measured"]) == (True, 1, 2)
    assert sm["results"] == str(ddir / "res")


def test_cli_run_fails_when_an_intact_payload_no_longer_matches(ddir, cli):
    s = small_store(ddir, restores=1)
    with open(ddir / "s" / s.restores[0][1].file, "r+b") as f:  # damage the store itself: not a planned corruption
        f.seek(s.restores[0][1].offset_bytes + 10)
        f.write(b"\x00\x01\x02")
    r = cli(["replay", "run", ddir / "s", "--pairs", 1, "--restores", 1, "--warmup", 0, "--out", ddir / "res"])
    assert r.exit_code == 3  # ran and found a blocking problem
    assert r.stderr.strip().splitlines()[-1] == f"Error: 1 intact restore(s) failed verification; see {ddir / 'res'}"
    rows = pq.read_table(ddir / "res" / "restores.parquet").to_pylist()
    assert rows[0]["bad_chunks"] == ["r000000/c0001"] and rows[0]["accepted"] is False


def test_misaligned_chunk_size_is_a_clear_error(ddir, cli):
    r = cli(["replay", "prepare", "--out", ddir / "s", "--chunk-bytes", 3000])
    assert r.exit_code == 1
    assert r.stderr.strip() == ("Error: --chunk-bytes is 3000 bytes, not a positive multiple of 4096 "
                                "(O_DIRECT alignment); use a multiple of 4096")


def test_misaligned_journal_entry_is_a_clear_error(ddir, cli):
    small_store(ddir, restores=1)
    jp = ddir / "s" / st.JOURNAL
    t = pq.read_table(jp)
    sizes = t["size_bytes"].to_pylist()
    sizes[1] = 65000
    t = t.set_column(t.schema.get_field_index("size_bytes"), t.schema.field("size_bytes"), pa.array(sizes, pa.int64()))
    pq.write_table(t, jp)
    r = cli(["replay", "run", ddir / "s", "--restores", 1, "--pairs", 1])
    assert r.exit_code == 1
    assert r.stderr.strip() == ("Error: chunk r000000/c0001: size is 65000 bytes, not a positive multiple of 4096 "
                                "(O_DIRECT alignment); use a multiple of 4096")


def test_missing_payload_file_is_a_clear_error(ddir, cli):
    small_store(ddir, restores=2)
    (ddir / "s" / "payload" / "restore-000001.bin").unlink()
    r = cli(["replay", "run", ddir / "s", "--restores", 1, "--pairs", 1])
    assert r.exit_code == 1
    assert r.stderr.strip() == (f"Error: payload file {ddir / 's' / 'payload' / 'restore-000001.bin'} listed in the "
                                f"journal is missing; re-create the store with `replay prepare`")


def test_not_a_store_is_a_clear_error(ddir, cli):
    r = cli(["replay", "run", ddir, "--restores", 1, "--pairs", 1])
    assert r.exit_code == 1
    assert r.stderr.strip() == (f"Error: {ddir} is not a replay store (no journal.parquet); create one with "
                                f"`kmesh-trace replay prepare`")


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="this host has a CUDA driver")
def test_probe_on_a_cpu_host(ddir, cli):
    r = cli(["replay", "probe", "--dir", ddir])
    assert r.exit_code == 0
    no_driver = "unavailable: CUDA driver: libcuda.so.1 not found (no NVIDIA driver on this host)"
    assert r.stdout.splitlines() == ["host          ok", f"host_fixed    {no_driver}", f"cufile        {no_driver}",
                                     f"dmabuf_fixed  {no_driver}"]
    r = cli(["replay", "probe", "--dir", ddir, "--json", "--routes", "host,dmabuf_fixed"])
    host, dma = json.loads(r.stdout)
    assert [s["step"] for s in host["steps"]] == ["native engine built", "io_uring", "O_DIRECT", "registered buffers"]
    assert host["status"] == "ok" and all(s["ok"] for s in host["steps"])
    steps = {s["step"]: s for s in dma["steps"]}
    assert steps["DMA-BUF export"]["detail"] == "not tried: needs CUDA driver, cuda-python"
    # the kernel is still asked: a stock kernel refuses the extended buffer update
    assert "IORING_REGISTER_BUFFERS_UPDATE with a DMA-BUF descriptor" in steps["io_uring DMA-BUF registration"]["detail"]


def test_run_refuses_an_unavailable_route_with_its_reason(ddir, cli):
    small_store(ddir, restores=1)
    if ctypes.util.find_library("cuda") is not None:
        pytest.skip("this host has a CUDA driver")
    r = cli(["replay", "run", ddir / "s", "--routes", "host,host_fixed", "--restores", 1, "--pairs", 1])
    assert r.exit_code == 1
    assert r.stderr.strip() == ("Error: route host_fixed is unavailable here (CUDA driver: libcuda.so.1 not found "
                                "(no NVIDIA driver on this host)); see `kmesh-trace replay probe`")


def test_prepare_from_trace_sizes_restores_from_load_transfers(ddir, cli):
    from kmesh_trace.writer import TraceWriter

    with TraceWriter(ddir / "t", "e0", {"block_size": 16, "num_usable_blocks": 8}) as w:
        w.write("transfers", {"request_id": ["a", "b", "c", "d"], "direction": ["load", "store", "load", "load"],
                              "num_bytes": [10 * KIB + 1, 99 * KIB, 8 * KIB, 20 * KIB],
                              "status": ["ok", "ok", "ok", "failed"], "connector": ["X"] * 4})
    plan = st.plan_from_trace(ddir / "t", chunk_bytes=4 * KIB, max_restores=10)
    assert plan == [[4096, 4096, 4096], [4096, 4096]]  # 10 KiB + 1 rounds up to 12 KiB
    r = cli(["replay", "prepare", "--out", ddir / "s", "--from", ddir / "t", "--chunk-bytes", 4096, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["num_chunks"] == 5 and json.loads(r.stdout)["source"] == f"trace:{ddir / 't'}"
    s = st.open_store(ddir / "s")
    assert [s.restore_bytes(r) for r in sorted(s.restores)] == [12 * KIB, 8 * KIB]
    r = cli(["replay", "prepare", "--out", ddir / "s2", "--from", ddir])
    assert r.exit_code == 1
    assert r.stderr.strip() == f"Error: {ddir} has no transfers table; pass a kmesh-trace capture directory to --from"


def test_fiemap_extents_read_back_from_the_raw_device(ddir):
    from kmesh_trace.native import blockdev

    s = small_store(ddir, restores=1, chunks=2, chunk_bytes=64 * KIB)
    dev = blockdev.device_of(ddir)
    if dev is None or not os.access(dev.path, os.R_OK):
        pytest.skip("the block device under the test directory is not readable here")
    c = s.restores[0][1]
    pieces = blockdev.extents(ddir / "s" / c.file, c.offset_bytes, c.size_bytes)
    assert sum(p[2] for p in pieces) == c.size_bytes and pieces[0][0] == c.offset_bytes
    try:
        fd = os.open(dev.path, os.O_RDONLY | os.O_DIRECT)  # O_DIRECT: never the device's own page cache
    except OSError as e:
        pytest.skip(f"cannot open {dev.path} here ({e.strerror})")
    buf = HostArena(c.size_bytes)
    try:
        got = b""
        for _, ph, ln in pieces:
            view = memoryview(buf.array)[:ln]
            assert os.preadv(fd, [view], ph) == ln
            got += view.tobytes()
    finally:
        os.close(fd)
    assert got == st.payload(7, 0, 1, 64 * KIB)


def test_cli_out_that_is_a_file_is_refused_before_any_work(ddir, cli):
    small_store(ddir, restores=1)
    (ddir / "f").write_text("")
    r = cli(["replay", "run", ddir / "s", "--pairs", 1, "--restores", 1, "--warmup", 0, "--out", ddir / "f"])
    assert (r.exit_code, r.stdout, r.stderr) == (1, "", f"Error: --out {ddir / 'f'} is a file; give a directory.\n")
    assert not (ddir / "s" / "runs").exists()
    r = cli(["replay", "prepare", "--out", ddir / "f" / "s2", "--chunk-bytes", 4096])
    assert (r.exit_code, r.stderr) == (1, (f"Error: cannot create {ddir / 'f' / 's2'}: {ddir / 'f'} is a file; "
                                           "choose another --out.\n"))
