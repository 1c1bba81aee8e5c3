"""Plots of analysis results: the format checks and the atomic write (a failed plot leaves no half file)."""

from __future__ import annotations

import pytest

from kmesh_trace.datasets.workloads.fork_tree import fork_tree_requests
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.headroom import headroom_of_requests
from kmesh_trace.oracle.pressure import SweepPoint
from kmesh_trace.oracle.workload import Workload
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


@pytest.mark.parametrize("suffix", [".svg", ".png"])
def test_the_same_figure_gives_the_same_bytes(tmp_path, suffix):
    """A report or plot drawn twice is byte for byte the same (no date, SVG ids from a fixed salt)."""
    res = headroom_of_requests(fork_tree_requests(), 16, [256, 512], ["lru", "belady"])
    first, second = plot_headroom(res, tmp_path / f"a{suffix}"), plot_headroom(res, tmp_path / f"b{suffix}")
    assert first.read_bytes() == second.read_bytes()
    if suffix == ".svg":
        assert "<dc:date>" not in first.read_text()


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


def _drawn(monkeypatch, draw):
    """The figure `draw()` makes, kept (drawn) before the plot module closes it."""
    from kmesh_trace.apps import plots

    kept = []
    real = plots._save

    def keep(fig, path):
        fig.canvas.draw()
        kept.append((fig, [(a, a.get_window_extent(), a.get_legend()) for a in fig.axes]))
        return real(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    draw()
    return kept[0]


def test_headroom_plots_keep_legends_off_the_data_ticks_at_the_capacities_and_one_colour_per_policy(
        tmp_path, monkeypatch):
    from matplotlib.colors import to_hex

    from kmesh_trace.apps.plots import POLICY_COLORS, plot_headroom_curve
    from kmesh_trace.oracle.headroom_curve import headroom_curve

    res = headroom_of_requests(fork_tree_requests(), 16, [64, 128, 256, 512], ["lru", "belady"])
    fig, axes = _drawn(monkeypatch, lambda: plot_headroom(res, tmp_path / "h.png"))
    (ax, box, legend), = axes
    assert legend.get_window_extent().x0 >= box.x1  # right of the axes, over no line or point
    assert list(ax.get_xticks()) == [64, 128, 256, 512]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["64", "128", "256", "512"]
    colours = {line.get_label(): to_hex(line.get_color()) for line in ax.get_lines()}
    assert colours["lru"] == to_hex(POLICY_COLORS["lru"]) and colours["belady"] == to_hex(POLICY_COLORS["belady"])
    curve = headroom_curve(Workload(16, fork_tree_requests()), policies=["belady", "lru"])  # the other order
    fig, axes = _drawn(monkeypatch, lambda: plot_headroom_curve(curve, tmp_path / "c.png"))
    (ax, box, legend), = axes
    assert legend.get_window_extent().x0 >= box.x1
    assert {line.get_label(): to_hex(line.get_color()) for line in ax.get_lines()
            if line.get_label() in ("lru (exact)", "belady (exact)")} == {
        "lru (exact)": colours["lru"], "belady (exact)": colours["belady"]}
