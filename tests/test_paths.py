"""One path policy (kmesh_trace.paths): every reader keeps to the trace's own files
(a part that is a symbolic link outside the trace is refused), no output lands on or inside an input,
and a replay store is sized against the free space before anything is written."""

from __future__ import annotations

import json
import os

import pytest

from kmesh_trace.datasets.workloads.fork_tree import BLOCK_SIZE, fork_tree_rows
from kmesh_trace.writer import TraceWriter


def _fork_tree(path):
    rows = fork_tree_rows()
    with TraceWriter(path, "e0", {"block_size": BLOCK_SIZE, "num_usable_blocks": 512, "kv_bytes_per_token": 64}) as w:
        w.write("invocations", {k: [r[k] for r in rows] for k in rows[0]})
    return path


@pytest.fixture
def linked_trace(tmp_path):
    """A trace one of whose parts is a symbolic link to a Parquet file of another directory."""
    trace = _fork_tree(tmp_path / "t")
    elsewhere = _fork_tree(tmp_path / "elsewhere")
    (outside,) = (elsewhere / "invocations" / "engine=e0").glob("part-*.parquet")
    link = trace / "invocations" / "engine=e0" / "part-99999999.parquet"
    link.symlink_to(outside)
    return trace, link


@pytest.mark.parametrize("command", [
    ["info", "{t}"],
    ["lineage", "{t}"],
    ["headroom", "{t}", "--capacity-blocks", "64", "--prefill-tokens-per-s", "1000"],
    ["pressure", "{t}"],
    ["sql", "{t}", "SELECT count(*) FROM invocations"],
    ["export", "perfetto", "{t}", "--out", "{out}/timeline.json"],
    ["fleet", "{t}"],
])
def test_a_part_linked_from_outside_the_trace_is_refused(cli, linked_trace, tmp_path, command):
    trace, link = linked_trace
    r = cli([a.format(t=trace, out=tmp_path) for a in command])
    assert r.exit_code == 1, r.stdout
    errors = r.stderr.strip().splitlines()  # (a progress bar stopped by the error leaves a blank line)
    assert len(errors) == 1 and errors[0].startswith(f"Error: {link} lies outside the trace (a symbolic link to ")


def test_the_audit_lists_a_linked_part_and_reads_the_rest(cli, linked_trace):
    trace, _ = linked_trace
    r = cli(["audit", "capture", trace, "--json"])
    assert r.exit_code == 3
    codes = {p["code"] for p in json.loads(r.stdout)["problems"]}
    assert "part_outside_trace" in codes


def test_a_linked_directory_of_parts_is_refused_too(cli, tmp_path):
    trace = _fork_tree(tmp_path / "t")
    elsewhere = _fork_tree(tmp_path / "elsewhere")
    (trace / "invocations" / "engine=x").symlink_to(elsewhere / "invocations" / "engine=e0")
    r = cli(["info", trace])
    assert r.exit_code == 1 and "lies outside the trace" in r.stderr


def test_report_out_onto_a_part_is_refused_and_the_part_kept(cli, tmp_path):
    trace = _fork_tree(tmp_path / "t")
    (part,) = (trace / "invocations" / "engine=e0").glob("part-*.parquet")
    before = part.read_bytes()
    r = cli(["report", trace, "--out", part])
    assert r.exit_code == 1
    assert r.stderr == f"Error: --out {part} is inside the input {trace}; write the output somewhere else.\n"
    assert part.read_bytes() == before
    assert cli(["info", trace]).exit_code == 0


def test_report_out_through_a_link_into_the_trace_is_refused(cli, tmp_path):
    trace = _fork_tree(tmp_path / "t")
    (tmp_path / "door").symlink_to(trace / "invocations")
    r = cli(["report", trace, "--out", tmp_path / "door" / "page.html"])
    assert r.exit_code == 1 and "is inside the input" in r.stderr
    assert not (trace / "invocations" / "page.html").exists()


def test_tiers_journal_inside_the_input_is_refused(cli, tmp_path):
    trace = _fork_tree(tmp_path / "t")
    r = cli(["tiers", trace, "--host", "64", "--journal", trace / "store"])
    assert r.exit_code == 1
    assert r.stderr == f"Error: --journal {trace / 'store'} is inside the input {trace}; write the output somewhere else.\n"
    assert not (trace / "store").exists()


def _transfers_trace(path, num_bytes):
    with TraceWriter(path, "e0", {"block_size": 16, "num_usable_blocks": 8}) as w:
        w.write("transfers", {"request_id": ["a", "b"], "direction": ["load", "load"], "num_bytes": [8192, num_bytes],
                              "status": ["ok", "ok"], "connector": ["X", "X"]})
    return path


def test_replay_prepare_refuses_a_row_larger_than_the_free_space(cli, tmp_path):
    trace = _transfers_trace(tmp_path / "t", 1 << 60)  # an exbibyte: no disk has it
    t0 = os.times().elapsed
    r = cli(["replay", "prepare", "--out", tmp_path / "s", "--from", trace])
    assert r.exit_code == 1
    assert r.stderr.startswith(f"Error: the 2 restores sized from {trace} need "), r.stderr
    assert "transfer row 1 alone asks 1,073,741,824.00 GiB" in r.stderr and "GiB free" in r.stderr
    assert not (tmp_path / "s" / "payload").exists()
    assert os.times().elapsed - t0 < 60


def test_replay_prepare_refuses_an_impossible_size(cli, tmp_path):
    trace = _transfers_trace(tmp_path / "t", -4096)
    r = cli(["replay", "prepare", "--out", tmp_path / "s", "--from", trace])
    assert r.exit_code == 1
    assert r.stderr == f"Error: transfer row 1 of {trace} has an impossible size of -4,096 bytes; the trace is damaged\n"


def test_a_store_that_does_not_fit_the_disk_is_refused_before_writing(tmpfs):
    from kmesh_trace.errors import KmeshTraceError
    from kmesh_trace.native import store as st

    small = tmpfs("size=1m")
    with pytest.raises(KmeshTraceError, match="needs 0.12 GiB but .* GiB free"):
        st.prepare(small / "s", st.plan_uniform(1, 32, 4 << 20))
    assert not (small / "s" / "payload").exists()
