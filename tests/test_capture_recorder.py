"""The capture's recorder (capture/recorder.py), without an engine: rows written and drops counted in the
metadata, one partition per engine, failed table writes, a failed lineage inference, unfinished requests."""

from __future__ import annotations

import json
from types import SimpleNamespace

from kmesh_trace.capture.buffers import RowBuffer
from kmesh_trace.capture.recorder import Recorder


def _block_row(seq):
    return (seq, 1000 + seq, 1, "allocated", seq + 1, 1, None, None, "r", 10 - seq, 0)


def test_recorder_writes_rows_and_reports_drops_in_metadata(tmp_path):
    from kmesh_trace.trace import open_trace

    rec = Recorder(tmp_path / "t", metadata={"block_size": 16}, config={"max_buffered_events": 2, "flush_interval_s": 60})
    for s in range(5):
        rec.block_events.append(_block_row(s))
    rec.flush()
    meta = json.loads(rec.writer.metadata_path.read_text())
    assert meta["num_dropped_events"]["block_events"] == 3 and meta["complete"] is False
    rec.block_events.append(_block_row(5))
    rec.close()
    trace = open_trace(tmp_path / "t")
    assert trace.frame("block_events")["seq"].to_list() == [0, 1, 5]
    (meta,) = trace.engines.values()
    assert meta["complete"] is True and meta["num_dropped_events"]["block_events"] == 3
    assert meta["capture_config"]["max_buffered_events"] == 2 and meta["block_size"] == 16


def test_a_second_engine_in_one_process_gets_its_own_partition(tmp_path):
    a = Recorder(tmp_path, config={"flush_interval_s": 60})
    b = Recorder(tmp_path, config={"flush_interval_s": 60})
    a.close()
    b.close()
    assert b.engine_id == a.engine_id + "-2"


def _invocation(rid: str, seq: int, prompt: list[int], output: list[int]) -> tuple:
    row = {"request_id": rid, "seq": seq, "num_prompt_tokens": len(prompt), "num_output_tokens": len(output),
           "prompt_token_ids": prompt, "output_token_ids": output, "arrival_ns": 10 * seq, "finish_ns": 10 * seq + 5,
           "status": "finished"}
    return tuple(row.get(c) for c in RowBuffer("invocations", 1).columns)


def _transfer(rid: str) -> tuple:
    return (rid, "load", 16, 1, None, 1, 2, "ok", "X")


def _break_table(rec: Recorder, table: str) -> None:
    """A real write failure: the table's partition path is a plain file, so no part can be made there."""
    d = rec.writer.partition_dir(table)
    d.parent.mkdir(parents=True, exist_ok=True)
    d.write_text("not a directory")


def test_a_failed_table_write_counts_its_rows_and_the_other_tables_are_written(tmp_path):
    import pyarrow.parquet as pq

    rec = Recorder(tmp_path / "t", config={"flush_interval_s": 60})
    _break_table(rec, "invocations")
    _break_table(rec, "block_events")
    rec.invocations.append(_invocation("a", 0, [1, 2, 3], [4, 5]))
    rec.invocations.append(_invocation("b", 1, [1, 2, 3, 4, 5, 6], [7]))  # exact-prefix child of a
    for s in range(3):
        rec.block_events.append(_block_row(s))
    rec.transfers.append(_transfer("a"))
    rec.flush()
    meta = json.loads(rec.writer.metadata_path.read_text())
    assert meta["num_dropped_events"] == {"invocations": 2, "lineage": 0, "block_events": 3, "transfers": 0, "steps": 0}
    rec.invocations.append(_invocation("c", 2, [1, 2, 3, 4, 5, 6, 7, 8], [9]))  # child of b
    rec.block_events.append(_block_row(3))
    rec.block_events.append(_block_row(4))
    rec.transfers.append(_transfer("c"))
    rec.close()  # the final flush: invocations and block_events fail, the rest is written, the partition completes
    meta = json.loads(rec.writer.metadata_path.read_text())
    assert meta["complete"] is True
    assert meta["num_dropped_events"] == {"invocations": 3, "lineage": 0, "block_events": 5, "transfers": 0, "steps": 0}

    def rows(table):
        return pq.read_table(rec.writer.partition_dir(table)).to_pylist()

    assert [(r["child_request_id"], r["parent_request_id"], r["edge_kind"], r["num_shared_tokens"])
            for r in rows("lineage")] == [("b", "a", "exact_prefix", 5), ("c", "b", "exact_prefix", 7)]
    assert [r["request_id"] for r in rows("transfers")] == ["a", "c"]


def test_a_lineage_inference_failure_still_writes_the_invocations_and_counts_the_lineage(tmp_path, monkeypatch, caplog):
    import pyarrow.parquet as pq
    from kmesh_trace.capture import recorder

    real = recorder.edges_for

    def edges_for(index, row, parents):  # an inference bug that hits one request
        if row["request_id"] == "b":
            raise RuntimeError("lineage bug")
        return real(index, row, parents)

    monkeypatch.setattr(recorder, "edges_for", edges_for)
    rec = Recorder(tmp_path / "t", config={"flush_interval_s": 60})
    rec.invocations.append(_invocation("a", 0, [1, 2, 3], [4, 5]))
    rec.invocations.append(_invocation("b", 1, [1, 2, 3, 4, 5, 6], [7]))  # its edge to a is lost
    rec.invocations.append(_invocation("c", 2, [1, 2, 3, 4, 5, 6, 7, 8], [9]))  # b is not indexed: child of a
    with caplog.at_level("ERROR", logger="kmesh_trace.capture"):
        rec.flush()
    assert [r.getMessage() for r in caplog.records] == [
        "kmesh-trace: inferring lineage failed for 1 request(s) (RuntimeError: lineage bug); they are counted "
        "as dropped lineage and their invocations are still written"]
    rec.close()
    meta = json.loads(rec.writer.metadata_path.read_text())
    assert meta["complete"] is True
    assert meta["num_dropped_events"] == {"invocations": 0, "lineage": 1, "block_events": 0, "transfers": 0, "steps": 0}
    assert [r["request_id"] for r in pq.read_table(rec.writer.partition_dir("invocations")).to_pylist()] == ["a", "b", "c"]
    assert [(r["child_request_id"], r["parent_request_id"], r["num_shared_tokens"])
            for r in pq.read_table(rec.writer.partition_dir("lineage")).to_pylist()] == [("c", "a", 5)]


def test_close_counts_an_unfinished_request_it_cannot_record_and_still_completes(tmp_path, caplog):
    import pyarrow.parquet as pq

    rec = Recorder(tmp_path / "t", config={"flush_interval_s": 60})
    rec.block_events.append(_block_row(0))
    rec.live = {rid: SimpleNamespace(request_id=rid) for rid in ("bad", "ok")}

    def unfinished_row(request):
        if request.request_id == "bad":
            raise AttributeError("no _kmesh")
        return _invocation("ok", 0, [1, 2], [])

    with caplog.at_level("ERROR", logger="kmesh_trace.capture"):
        rec.close(unfinished_row)
    assert [r.getMessage() for r in caplog.records] == [
        "kmesh-trace: could not record unfinished request bad (AttributeError: no _kmesh); counted as dropped"]
    meta = json.loads(rec.writer.metadata_path.read_text())
    assert meta["complete"] is True and rec.live == {}
    assert meta["num_dropped_events"] == {"invocations": 1, "lineage": 0, "block_events": 0, "transfers": 0, "steps": 0}
    assert [r["request_id"] for r in pq.read_table(rec.writer.partition_dir("invocations")).to_pylist()] == ["ok"]
    assert [r["seq"] for r in pq.read_table(rec.writer.partition_dir("block_events")).to_pylist()] == [0]

