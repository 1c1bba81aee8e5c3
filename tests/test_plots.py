"""Plots of analysis results: the format checks and the atomic write (a failed plot leaves no half file)."""

from __future__ import annotations

import pytest

from kmesh_trace.datasets.workloads.fork_tree import fork_tree_requests
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.headroom import headroom_of_requests
from kmesh_trace.oracle.pressure import SweepPoint
from kmesh_trace.apps.plots import check_plot_path, plot_headroom, plot_pressure_sweep

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_both_plots_write_the_format_their_suffix_names(tmp_path):
    res = headroom_of_requests(fork_tree_requests(), 16, [256, 512], ["lru", "belady"])
    assert plot_headroom(res, tmp_path / "h.PNG") == tmp_path / "h.PNG"
    pts = [SweepPoint(64, 512, 0, 512, 100, 612), SweepPoint(128, 464, 1856, -1392, 2000, 608)]
    plot_pressure_sweep(pts, tmp_path / "p.svg", 16)
    assert (tmp_path / "h.PNG").read_bytes()[:8] == PNG_MAGIC
    assert (tmp_path / "p.svg").read_text().lstrip().startswith("<?xml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.PNG", "p.svg"]  # no temporary file left


def test_a_failed_plot_leaves_the_existing_file_whole(tmp_path):
    # Matplotlib opens an SVG before drawing it; a label it cannot parse fails mid-draw, which without
    # the temporary file truncates the target to half an SVG.
    res = headroom_of_requests(fork_tree_requests(), 16, [512], ["lru"])
    res.results[0].policy = r"$\nocommand$"
    target = tmp_path / "h.svg"
    target.write_text("the previous plot")
    with pytest.raises(ValueError, match="nocommand"):
        plot_headroom(res, target)
    assert target.read_text() == "the previous plot"
    assert [p.name for p in tmp_path.iterdir()] == ["h.svg"]


@pytest.mark.parametrize("name", ["x.pdf", "x", "x.png.txt"])
def test_only_png_and_svg_are_drawn(tmp_path, name):
    with pytest.raises(KmeshTraceError, match=rf"^cannot plot to {name}: give a \.png or \.svg file\.$"):
        check_plot_path(tmp_path / name)
    with pytest.raises(KmeshTraceError, match="give a .png or .svg file"):
        plot_pressure_sweep([], tmp_path / name, 16)
    assert list(tmp_path.iterdir()) == []
