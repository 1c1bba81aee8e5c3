"""Loss is always counted: a writer on a real full filesystem (a small tmpfs mounted
for the test) counts every row it could not write in the loss record, which it can still overwrite
when the metadata file cannot be rewritten, and the audit blocks on it; rows that vanish without a
recorded reason are found too."""

from __future__ import annotations

import json
import os

import pytest

from kmesh_trace.audit.capture import audit_capture
from kmesh_trace.trace import open_trace
from kmesh_trace.writer import LOSS_RECORD_BYTES, TraceWriter

META = {"block_size": 16, "num_usable_blocks": 64, "engine_index": 0, "engine": "test", "model": "tiny"}


@pytest.fixture
def small_fs(tmpfs):
    """A 256 KiB tmpfs: it fills after a few parts."""
    return tmpfs("size=256k")


def _invocations(first: int, n: int) -> dict:
    rng = range(first, first + n)
    return {"request_id": [f"r{i}" for i in rng], "seq": list(rng), "num_prompt_tokens": [512] * n,
            "prompt_token_ids": [[(i * 7919 + j * 104729) % 50_000 for j in range(512)] for i in rng],
            "arrival_ns": [1000 * i for i in rng], "num_cached_tokens": [0] * n}


def _fill(writer: TraceWriter) -> tuple[int, int]:
    """Write 20-row parts until the disk is full and then some, as the capture's writer thread would
    (a failed write is logged and the capture goes on). Returns (rows written, rows refused)."""
    written = refused = 0
    for part in range(60):
        try:
            writer.write("invocations", _invocations(part * 20, 20))
            written += 20
        except OSError:
            refused += 20
    try:
        writer.close()
    except OSError:
        pass
    return written, refused


def test_a_full_disk_is_counted_in_the_loss_record(small_fs):
    root = small_fs / "trace"
    w = TraceWriter(root, "e0", META)
    written, refused = _fill(w)
    assert written and refused, "the filesystem never filled: raise the number of parts"
    loss = json.loads((root / "engines" / "e0.loss").read_bytes())
    assert (root / "engines" / "e0.loss").stat().st_size == LOSS_RECORD_BYTES
    assert loss["num_dropped_events"]["invocations"] == refused
    assert loss["num_rows_written"]["invocations"] == written
    assert loss["num_failed_writes"] == refused // 20
    assert "No space left on device" in loss["write_error"]

    t = open_trace(root)
    meta = t.engines["e0"]
    assert meta["num_dropped_events"]["invocations"] == refused  # the reader takes the record's counts
    assert t.row_counts()["invocations"] == written
    result = audit_capture(root)
    codes = {p.code: p for p in result.problems}
    assert codes["dropped_events"].count == refused and codes["dropped_events"].severity == "blocking"
    assert "No space left on device" in codes["dropped_events"].locations[0]
    assert not result.verdict["headroom"]["qualified"]


def test_when_even_the_metadata_cannot_be_rewritten_the_record_says_so(small_fs):
    root = small_fs / "trace"
    w = TraceWriter(root, "e0", META)
    _fill(w)
    fd = os.open(small_fs / "ballast", os.O_WRONLY | os.O_CREAT)  # take every block that is left
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    before = (root / "engines" / "e0.json").read_bytes()
    w.metadata["num_dropped_events"]["block_events"] = 5  # a count the capture adds late (buffer overflow)
    with pytest.raises(OSError):
        w.update_metadata(complete=True)
    assert (root / "engines" / "e0.json").read_bytes() == before  # the metadata file is stale ...
    meta = open_trace(root).engines["e0"]
    assert meta["metadata_write_failed"] is True and meta["num_dropped_events"]["block_events"] == 5  # ... not lost
    codes = {p.code for p in audit_capture(root).problems}
    assert {"metadata_stale", "dropped_events"} <= codes


def test_rows_that_vanish_without_a_recorded_reason_block_the_audit(tmp_path):
    root = tmp_path / "t"
    with TraceWriter(root, "e0", META) as w:
        w.write("invocations", _invocations(0, 3))
        w.write("invocations", _invocations(3, 3))
        w.write("block_events", {"seq": [0, 1], "ts_ns": [1, 2], "event": ["allocated", "allocated"],
                                 "block_id": [1, 2], "ref_cnt": [1, 1], "request_id": ["r0", "r4"], "kv_group": [0, 0]})
    assert audit_capture(root).exit_code in (0, 3)
    (root / "invocations" / "engine=e0" / "part-00001.parquet").unlink()  # a part lost after the writer closed
    codes = {p.code: p for p in audit_capture(root).problems}
    assert codes["rows_missing"].count == 3 and codes["rows_missing"].severity == "blocking"
    assert codes["requests_missing"].locations == ["block_events:e0:r4"]
