"""Option checks every command shares: integer lists, and output paths refused before any work is done.

"Before any work" is shown without spies: each case also gives an input that would fail on its own
(a missing trace or corpus), so the error that comes out says which check ran first.
"""

from __future__ import annotations

import json
import os

import pytest

from kmesh_trace.cli.common import check_out_dir, check_out_file, parse_ints
from kmesh_trace.datasets.workloads.fork_tree import write_fork_tree
from kmesh_trace.errors import KmeshTraceError


def test_parse_ints_accepts_positive_lists_only():
    assert parse_ints("256, 512,1024", "--x") == [256, 512, 1024]
    for text in (",", "", "256,", "256,,512", "12x", "0", "64,-1", "1.5"):
        with pytest.raises(KmeshTraceError) as e:
            parse_ints(text, "--x")
        assert str(e.value) == f"--x must be comma-separated integers above zero, e.g. 256,512,1024 (got {text!r})."


@pytest.mark.parametrize("command", [
    ["headroom", "--scenario", "fork-tree", "--capacity-blocks"],
    ["pressure", "--scenario", "hold-stress", "--capacity-blocks"],
])
def test_headroom_and_pressure_refuse_an_empty_list_alike(cli, command):
    # headroom used to read "," as no list at all and replay at its default capacity.
    r = cli([*command, ","])
    assert r.exit_code == 1 and r.stdout == ""
    assert r.stderr == f"Error: {command[-1]} must be comma-separated integers above zero, e.g. 256,512,1024 (got ',').\n"


def test_check_out_file(tmp_path):
    assert check_out_file(tmp_path / "r.json", "--out") == tmp_path / "r.json"
    with pytest.raises(KmeshTraceError, match=rf"^--out {tmp_path} is a directory; give a file name\.$"):
        check_out_file(tmp_path, "--out")
    with pytest.raises(KmeshTraceError, match=rf"^cannot write {tmp_path}/no/r.json: the directory {tmp_path}/no "
                                              r"does not exist; create it first\.$"):
        check_out_file(tmp_path / "no" / "r.json", "--out")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to any directory")
def test_check_out_file_refuses_a_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    with pytest.raises(KmeshTraceError, match="is not writable; choose another --out"):
        check_out_file(ro / "r.json", "--out")


def test_check_out_dir(tmp_path):
    assert check_out_dir(tmp_path / "a" / "b", "--out") == tmp_path / "a" / "b"  # parents are created later
    (tmp_path / "f").write_text("")
    with pytest.raises(KmeshTraceError, match=rf"^--out {tmp_path}/f is a file; give a directory\.$"):
        check_out_dir(tmp_path / "f", "--out")
    with pytest.raises(KmeshTraceError, match=rf"^cannot create {tmp_path}/f/x: {tmp_path}/f is a file; choose another --out\.$"):
        check_out_dir(tmp_path / "f" / "x", "--out")


@pytest.mark.parametrize("command", [["headroom"], ["pressure", "--capacity-blocks", "64"]])
def test_a_bad_plot_is_refused_before_the_trace_is_read(cli, tmp_path, command):
    missing = tmp_path / "missing-trace"
    r = cli([*command, missing, "--plot", tmp_path / "x.pdf"])
    assert (r.exit_code, r.stderr) == (1, "Error: cannot plot to x.pdf: give a .png or .svg file.\n")
    r = cli([*command, missing, "--plot", tmp_path / "no" / "x.png"])
    assert (r.exit_code, r.stderr) == (
        1, f"Error: cannot write {tmp_path}/no/x.png: the directory {tmp_path}/no does not exist; create it first.\n")
    (tmp_path / "d.png").mkdir()
    r = cli([*command, missing, "--plot", tmp_path / "d.png"])
    assert (r.exit_code, r.stderr) == (1, f"Error: --plot {tmp_path}/d.png is a directory; give a file name.\n")


def test_pressure_plot_is_written_whole_from_a_trace(cli, tmp_path):
    trace = write_fork_tree(tmp_path / "t")
    r = cli(["pressure", trace, "--capacity-blocks", "300", "--plot", tmp_path / "s.svg", "--json"])
    assert r.exit_code == 0, r.stderr
    assert [p["capacity_blocks"] for p in json.loads(r.stdout)["sweep"]] == [300]
    assert (tmp_path / "s.svg").read_text().lstrip().startswith("<?xml")


def test_export_out_directory_is_named(cli, tmp_path):
    trace = write_fork_tree(tmp_path / "t")
    (tmp_path / "d1").mkdir()
    r = cli(["export", "perfetto", trace, "--out", tmp_path / "d1"])
    assert (r.exit_code, r.stderr) == (1, f"Error: --out {tmp_path}/d1 is a directory; give a file name.\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d1", "t"]  # no temporary file left behind


def test_audit_out_is_checked_before_the_audit(cli, tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "src").mkdir(parents=True)
    (corpus / "src" / "a.jsonl").write_text('{"session_id": "s", "input": "x", "output": "y"}\n')
    r = cli(["audit", "corpus", corpus, "--out", tmp_path / "no" / "x.json"])
    assert (r.exit_code, r.stdout) == (1, "")  # no report rendered: the audit never ran
    assert r.stderr == (f"Error: cannot write {tmp_path}/no/x.json: the directory {tmp_path}/no does not exist; "
                        "create it first.\n")
    r = cli(["audit", "corpus", corpus, "--out", corpus])
    assert (r.exit_code, r.stdout, r.stderr) == (1, "", f"Error: --out {corpus} is a directory; give a file name.\n")
