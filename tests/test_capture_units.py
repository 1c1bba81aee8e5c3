"""Capture pieces that need no engine: bounded buffers, drop accounting, lineage inference, version guard, CLI errors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from kmesh_trace.capture.buffers import RowBuffer
from kmesh_trace.capture.lineage import HEAD, LineageIndex, edges_for
from kmesh_trace.lineage import ParentResolver
from kmesh_trace.capture.recorder import Recorder


def test_row_buffer_is_bounded_and_counts_drops():
    buf = RowBuffer("transfers", capacity=3)
    for i in range(5):
        buf.append((f"r{i}",))
    assert buf.num_dropped == 2
    assert buf.drain() == [("r0",), ("r1",), ("r2",)]
    assert buf.drain() == []
    buf.append(("r5",))
    assert buf.drain() == [("r5",)] and buf.num_dropped == 2


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


def test_exact_prefix_parent_is_the_longest_earlier_finished_prefix():
    idx = LineageIndex(window=10)
    base = list(range(1, 40))
    idx.add("a", base[:20], finish_ns=10)
    idx.add("b", base[:30], finish_ns=20)
    idx.add("short", [1, 2, 3], finish_ns=5)  # shorter than HEAD: indexed by all its tokens
    idx.add("late", base[:35], finish_ns=1000)  # finished after the child arrived: not a parent
    assert idx.exact_prefix_parent("c", base + [99], arrival_ns=100) == ("b", 30)
    assert idx.exact_prefix_parent("c", [1, 2, 3, 4], arrival_ns=100) == ("short", 3)
    assert idx.exact_prefix_parent("c", [1, 2, 4], arrival_ns=100) is None
    assert idx.exact_prefix_parent("b", base[:30], arrival_ns=100) == ("a", 20)  # never itself
    assert HEAD < 20


def test_lineage_window_forgets_the_oldest():
    idx = LineageIndex(window=2)
    idx.add("a", [5] * 20, None)
    idx.add("b", [6] * 20, None)
    idx.add("c", [7] * 20, None)
    assert idx.sequence("a") is None and idx.exact_prefix_parent("x", [5] * 25, None) is None
    assert idx.exact_prefix_parent("x", [7] * 25, None) == ("c", 20)


def test_declared_edge_resolves_the_caller_id_and_counts_shared_tokens():
    idx = LineageIndex(window=10)
    idx.add("p-1234abcd", [1, 2, 3, 4, 5], None)
    row = {"request_id": "c-00000000", "prompt_token_ids": [1, 2, 3, 9], "parent_id": "p", "family_id": "f",
           "arrival_ns": None}
    parents = ParentResolver()
    parents.add("p-1234abcd", "p")
    assert edges_for(idx, row, parents) == [{
        "child_request_id": "c-00000000", "parent_request_id": "p-1234abcd", "declared_parent_id": "p",
        "family_id": "f", "edge_kind": "declared", "num_shared_tokens": 3}]
    row["parent_id"] = "unknown"
    assert edges_for(idx, row, ParentResolver())[0]["parent_request_id"] is None


def test_version_guard_leaves_an_unsupported_vllm_untouched(monkeypatch):
    pytest.importorskip("vllm")
    import vllm
    from kmesh_trace.capture import plugin
    from kmesh_trace.capture.version import unsupported_reason
    from vllm.v1.core.sched.scheduler import Scheduler

    assert unsupported_reason("0.32.0") is None
    assert unsupported_reason("0.1.0") == ("vLLM 0.1.0 is not a version the capture hooks support "
                                           "(0.32.0, 0.33.0); the engine runs uncaptured.")
    lines = []
    monkeypatch.setattr(plugin, "_installed", False)
    monkeypatch.setattr(plugin, "_warn", lines.append)
    monkeypatch.setattr(vllm, "__version__", "0.1.0")
    monkeypatch.delenv("KMESH_TRACE_DIR", raising=False)
    init = Scheduler.__init__
    assert plugin.register() is False and lines == []  # disabled: silent
    monkeypatch.setenv("KMESH_TRACE_DIR", "/nonexistent")
    assert plugin.register() is False
    assert lines == ["kmesh-trace: vLLM 0.1.0 is not a version the capture hooks support (0.32.0, 0.33.0); "
                     "the engine runs uncaptured."]
    assert Scheduler.__init__ is init


def test_cli_capture_reports_a_missing_command(tmp_path, cli):
    result = cli(["capture", "--out", tmp_path / "t", "--", "no-such-command-kmesh"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == "Error: command not found: no-such-command-kmesh; check the command after `--`."


def test_cli_capture_names_the_servers_own_error_when_no_engine_started(tmp_path, cli):
    """A server that dies before its engine starts: the command's output passes through, and the
    capture names the root cause as the server logged it (vLLM's log lines, on stdout), not the
    wrapper exceptions after it."""
    import sys

    script = (
        "import sys\n"
        "print('(VllmWorker-0 pid=9) ERROR 12-01 11:11:52 [multiproc_executor.py:953] Traceback (most recent call last):')\n"
        "print('(VllmWorker-0 pid=9) ERROR 12-01 11:11:52 [multiproc_executor.py:953] ValueError: Available memory on "
        "node 0 (6.41/9.84 GiB) on startup is less than desired CPU memory utilization (0.92, 9.05 GiB).')\n"
        "print('(EngineCore pid=8) ERROR 12-01 11:11:57 [core.py:1510] EngineCore failed to start.')\n"
        "sys.stderr.write('Traceback (most recent call last):\\nRuntimeError: Engine core initialization failed. "
        "See root cause above. Failed core proc(s): {}\\n')\n"
        "sys.exit(1)\n")
    result = cli(["capture", "--out", tmp_path / "t", "--summary", tmp_path / "s.json", "--", sys.executable, "-c", script])
    assert result.exit_code == 1
    assert "EngineCore failed to start." in result.stdout  # passed through
    assert "RuntimeError: Engine core initialization failed." in result.stderr
    root = ("ValueError: Available memory on node 0 (6.41/9.84 GiB) on startup is less than desired CPU memory "
            "utilization (0.92, 9.05 GiB).")
    assert (f"no engine was captured: the command exited with 1 before an engine started; its error: {root}"
            in result.stderr.replace("\n", " "))
    assert json.loads((tmp_path / "s.json").read_text())["server_error"] == root
    ok = cli(["capture", "--out", tmp_path / "t2", "--", sys.executable, "-c", "pass"])
    assert ok.exit_code == 0 and "was the kmesh-trace plugin loaded?" in ok.stderr


# ---- a table whose part cannot be written -----------------------------------------------------------

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
    assert meta["num_dropped_events"] == {"invocations": 2, "lineage": 0, "block_events": 3, "transfers": 0}
    rec.invocations.append(_invocation("c", 2, [1, 2, 3, 4, 5, 6, 7, 8], [9]))  # child of b
    rec.block_events.append(_block_row(3))
    rec.block_events.append(_block_row(4))
    rec.transfers.append(_transfer("c"))
    rec.close()  # the final flush: invocations and block_events fail, the rest is written, the partition completes
    meta = json.loads(rec.writer.metadata_path.read_text())
    assert meta["complete"] is True
    assert meta["num_dropped_events"] == {"invocations": 3, "lineage": 0, "block_events": 5, "transfers": 0}

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
    assert meta["num_dropped_events"] == {"invocations": 0, "lineage": 1, "block_events": 0, "transfers": 0}
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
    assert meta["num_dropped_events"] == {"invocations": 1, "lineage": 0, "block_events": 0, "transfers": 0}
    assert [r["request_id"] for r in pq.read_table(rec.writer.partition_dir("invocations")).to_pylist()] == ["ok"]
    assert [r["seq"] for r in pq.read_table(rec.writer.partition_dir("block_events")).to_pylist()] == [0]


# ---- capture knobs --------------------------------------------------------------------------------

@pytest.mark.parametrize("args, line", [
    (["--flush-s", "0"], "Error: --flush-s must be a number of seconds > 0, not 0.0."),
    (["--flush-s", "-1"], "Error: --flush-s must be a number of seconds > 0, not -1.0."),
    (["--max-buffered-events", "0"], "Error: --max-buffered-events must be an integer >= 1, not 0."),
])
def test_cli_capture_refuses_a_bad_knob_before_running_the_command(tmp_path, cli, args, line):
    ran = tmp_path / "ran"
    result = cli(["capture", "--out", tmp_path / "t", *args, "--", "touch", ran])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [line]
    assert not ran.exists() and not (tmp_path / "t").exists()


@pytest.mark.parametrize("env, value, line", [
    ("KMESH_TRACE_MAX_BUFFERED_REQUESTS", "0", "Error: KMESH_TRACE_MAX_BUFFERED_REQUESTS must be an integer >= 1, not 0."),
    ("KMESH_TRACE_LINEAGE_WINDOW", "many", "Error: KMESH_TRACE_LINEAGE_WINDOW must be an integer >= 1, not 'many'."),
])
def test_cli_capture_refuses_a_bad_knob_in_its_environment_before_running_the_command(tmp_path, cli, monkeypatch,
                                                                                      env, value, line):
    monkeypatch.setenv(env, value)  # the command would inherit it, and its engine would run uncaptured
    ran = tmp_path / "ran"
    result = cli(["capture", "--out", tmp_path / "t", "--", "touch", ran])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [line]
    assert not ran.exists() and not (tmp_path / "t").exists()


def test_cli_capture_passes_exported_knobs_through_and_options_win(tmp_path, cli, monkeypatch):
    monkeypatch.setenv("KMESH_TRACE_FLUSH_S", "0.25")
    monkeypatch.setenv("KMESH_TRACE_MAX_BUFFERED_EVENTS", "4096")
    seen = tmp_path / "seen"
    show = f'echo "$KMESH_TRACE_FLUSH_S $KMESH_TRACE_MAX_BUFFERED_EVENTS" > {seen}'
    assert cli(["capture", "--out", tmp_path / "t", "--", "sh", "-c", show]).exit_code == 0
    assert seen.read_text().split() == ["0.25", "4096"]
    assert cli(["capture", "--out", tmp_path / "t2", "--flush-s", "2", "--", "sh", "-c", show]).exit_code == 0
    assert seen.read_text().split() == ["2.0", "4096"]
    monkeypatch.setenv("KMESH_TRACE_FLUSH_S", "0")
    r = cli(["capture", "--out", tmp_path / "t3", "--", "sh", "-c", show])
    assert (r.exit_code, r.stderr.strip()) == (1, "Error: KMESH_TRACE_FLUSH_S must be a number of seconds > 0, not 0.0.")


@pytest.mark.parametrize("env, value, line", [
    ("KMESH_TRACE_FLUSH_S", "0", "KMESH_TRACE_FLUSH_S must be a number of seconds > 0, not 0.0."),
    ("KMESH_TRACE_FLUSH_S", "soon", "KMESH_TRACE_FLUSH_S must be a number of seconds > 0, not 'soon'."),
    ("KMESH_TRACE_MAX_BUFFERED_EVENTS", "-5", "KMESH_TRACE_MAX_BUFFERED_EVENTS must be an integer >= 1, not -5."),
    ("KMESH_TRACE_MAX_BUFFERED_REQUESTS", "0", "KMESH_TRACE_MAX_BUFFERED_REQUESTS must be an integer >= 1, not 0."),
    ("KMESH_TRACE_LINEAGE_WINDOW", "0", "KMESH_TRACE_LINEAGE_WINDOW must be an integer >= 1, not 0."),
])
def test_a_bad_knob_in_the_engine_environment_is_one_line_and_no_capture(tmp_path, monkeypatch, env, value, line):
    from kmesh_trace.capture import hooks
    from kmesh_trace.capture.recorder import config_from_env

    from kmesh_trace.errors import KmeshTraceError

    monkeypatch.setenv(env, value)
    with pytest.raises(KmeshTraceError) as e:
        config_from_env()
    assert str(e.value) == line
    # What the plugin does in the engine's Scheduler.__init__: the knobs are read before the
    # scheduler is touched, so nothing is installed and no partition is started.
    lines = []
    assert hooks.try_install(None, str(tmp_path / "t"), lines.append) is None
    assert lines == [f"kmesh-trace: {line} The engine runs uncaptured."]
    assert not (tmp_path / "t").exists()


def test_knobs_are_checked_where_they_are_given(tmp_path):
    from kmesh_trace.capture.session import capture_in_process

    from kmesh_trace.errors import KmeshTraceError

    with pytest.raises(KmeshTraceError, match=r"^max_buffered_events must be an integer >= 1, not 0\.$"):
        Recorder(tmp_path / "r", config={"max_buffered_events": 0})
    with (pytest.raises(KmeshTraceError, match=r"^flush_interval_s must be a number of seconds > 0, not -0\.5\.$"),
          capture_in_process(tmp_path / "s", flush_interval_s=-0.5)):
        pass
    assert not (tmp_path / "r").exists() and not (tmp_path / "s").exists()
