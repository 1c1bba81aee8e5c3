"""Figures of analysis results: the headroom hit-ratio curves, the retention-pressure capacity sweep, the
host x SSD tier sweep, the shape of a trace's lineage, the fleet routing sweep and the advise ladder.

Rendering, not analysis: the analyses in kmesh_trace.oracle return result objects
and this module draws them (matplotlib, Agg backend, imported only when a plot is drawn). Every figure
is written atomically: to a temporary file beside the target, then renamed over it, so a failed or
interrupted plot never leaves a half-written file under the name the caller asked for.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from kmesh_trace.errors import KmeshTraceError

if TYPE_CHECKING:
    from kmesh_trace.oracle.fleet import FleetResult
    from kmesh_trace.oracle.headroom import HeadroomResult
    from kmesh_trace.oracle.headroom_curve import CurveResult
    from kmesh_trace.oracle.lineage_report import LineageReport
    from kmesh_trace.oracle.pressure import SweepPoint
    from kmesh_trace.oracle.tiers import SweepResult

PLOT_SUFFIXES = (".png", ".svg")

#: One look per line, so lines that lie on top of each other stay distinguishable: a marker and a dash
#: pattern each (colour alone is lost where lines coincide, and in grey print).
_LOOKS = [dict(marker=m, linestyle=ls, markerfacecolor="none") for m, ls in
          (("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", (0, (5, 1))), ("x", (0, (3, 1, 1, 1))))]


def _look(k: int) -> dict:
    return dict(_LOOKS[k % len(_LOOKS)], markersize=6 - (k % len(_LOOKS)) * 0.6)


#: One colour and one look per policy, the same in every figure (headroom.png, the report page's curve):
#: a policy keeps its colour wherever it is drawn, whatever else is drawn beside it.
POLICY_COLORS = {"lru": "tab:blue", "vllm": "tab:orange", "belady-prefix": "tab:green", "belady": "tab:purple",
                 "stock": "black", "infinite": "grey", "fifo": "tab:brown", "lfu": "tab:pink", "arc": "tab:olive",
                 "s3fifo": "tab:cyan", "family-hold": "tab:red"}
_OTHER_COLORS = ("tab:red", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")


def policy_style(name: str, k: int) -> dict:
    """The look (marker, dashes) and colour of policy `name`, the `k`-th line of its figure: fixed for the
    named policies, by position for any other."""
    base = name.split(" ")[0]
    known = list(POLICY_COLORS)
    i = known.index(base) if base in known else len(known) + k
    return dict(_look(i), color=POLICY_COLORS.get(base, _OTHER_COLORS[k % len(_OTHER_COLORS)]))


def _legend_outside(ax) -> None:
    """The legend beside the axes, right of the plot: never over a line or a point."""
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)


#: At most this many capacity ticks; more measured capacities are labelled at powers of two.
MAX_CAPACITY_TICKS = 10


def _capacity_ticks(ax, capacities: Sequence[int], log: bool) -> None:
    """X ticks at the measured capacities (their own numbers, not 2^k), or, with more of them than fit,
    at the powers of two between the smallest and the largest."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    caps = sorted({int(c) for c in capacities if c and c > 0})
    if not caps:
        return
    if len(caps) > MAX_CAPACITY_TICKS and log:
        lo, hi = caps[0].bit_length() - 1, caps[-1].bit_length()
        step = max(1, -(-(hi - lo) // MAX_CAPACITY_TICKS))
        caps = [1 << k for k in range(lo, hi + 1, step) if caps[0] <= (1 << k) <= caps[-1] * 2]
    ax.xaxis.set_major_locator(FixedLocator(caps))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{int(round(x)):,}"))
    ax.tick_params(axis="x", labelrotation=45 if len(caps) > 5 else 0)


def same_lines(series: dict[str, Sequence[float]]) -> list[str]:
    """"b = a here" for each series equal at every point to an earlier one (the plot note that says why a
    line seems missing)."""
    notes, seen = [], []
    for name, ys in series.items():
        twin = next((other for other, o in seen if len(o) == len(ys) and all(abs(a - b) <= 1e-12 for a, b in zip(o, ys))), None)
        if twin is not None:
            notes.append(f"{name} = {twin} here")
        else:
            seen.append((name, list(ys)))
    return notes


def _note(ax, notes: list[str]) -> None:
    """The notes below the legend, right of the axes (off the data, as the legend)."""
    if notes:
        ax.text(1.01, 0.0, "\n".join(notes), transform=ax.transAxes, ha="left", va="bottom", fontsize=8,
                bbox=dict(boxstyle="round", facecolor="white", edgecolor="#999", alpha=0.9))


def check_plot_path(path: str | Path) -> Path:
    """`path` as a Path when it names a format we draw (checked before any work is done)."""
    path = Path(path)
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise KmeshTraceError(f"cannot plot to {path.name}: give a .png or .svg file.")
    return path


def plot_headroom(result: "HeadroomResult", path: str | Path) -> Path:
    """Hit ratio against capacity, one line per policy (stock from a capture as one point)."""
    path = check_plot_path(path)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    series = {}
    for k, name in enumerate(dict.fromkeys(r.policy for r in result.results)):
        rows = sorted((r for r in result.results if r.policy == name), key=lambda r: r.capacity_blocks)
        series[name] = [r.hit_ratio for r in rows]
        ax.plot([r.capacity_blocks for r in rows], series[name], label=name, **policy_style(name, k))
    _note(ax, same_lines(series))
    if result.stock is not None and result.stock_source == "capture":
        ax.scatter([result.stock.capacity_blocks], [result.stock.hit_ratio], marker="*", s=160, color="black",
                   zorder=5, label="stock (capture)")
    caps = [r.capacity_blocks for r in result.results]
    log = bool(caps) and max(caps) >= 8 * min(caps)  # capacities usually double: equal steps on a log axis
    if log:
        ax.set_xscale("log", base=2)
    _capacity_ticks(ax, caps, log)
    ax.set_xlabel(f"capacity (blocks of {result.block_size} tokens)")
    ax.set_ylabel("hit ratio (hit block reads / block reads)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    _legend_outside(ax)
    title = "Prefix-cache hit ratio by policy"
    if result.headroom_tokens is not None:
        title += f" (headroom {result.headroom_tokens:,} tokens at {result.headroom_capacity_blocks:,} blocks)"
    ax.set_title(title, fontsize=10)
    return _save(fig, path)


def plot_headroom_curve(result: "CurveResult", path: str | Path) -> Path:
    """Hit ratio at every capacity: exact curves as steps, grid policies as points, the infinite cache
    as a dashed line and stock as a star."""
    path = check_plot_path(path)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    n = max(result.num_reads, 1)
    top = max(result.grid[-1], 2)
    sampling = getattr(result, "sampling", None)  # a sampled or merged curve says so in its legend and title
    how = "exact" if sampling is None else ("sampled" if sampling["method"] == "shards" else "merged")
    for k, (name, cur) in enumerate(result.curves.items()):
        caps, hits = cur.capacities, cur.hit_blocks
        look = policy_style(name, k)
        if cur.exact:
            x = [max(int(c), 1) for c in caps] + [top]
            ax.step(x, [h / n for h in hits] + [hits[-1] / n], where="post", linestyle=look["linestyle"],
                    color=look["color"])
            ax.plot(result.grid, cur.at(result.grid) / n, label=f"{name} ({how})",
                    **dict(look, linestyle="none"))  # markers at the grid, so coinciding steps stay apart
        else:
            ax.plot(caps, hits / n, label=name, **look)
    if "belady" in result.curves and "belady-prefix" in result.curves:  # the bracket, where the optimum lies
        lo = result.curves["belady-prefix"].at(result.grid) / n
        hi = result.curves["belady"].at(result.grid) / n
        ax.fill_between(result.grid, lo, hi, color="tab:purple", alpha=0.15, label="bracket [belady-prefix, belady]")
    ax.axhline(result.infinite_hit_blocks / n, color="grey", linestyle="--", linewidth=1, label="infinite")
    _note(ax, same_lines({name: list(cur.at(result.grid) / n) for name, cur in result.curves.items()}))
    if result.stock is not None:
        ax.scatter([result.stock["capacity_blocks"]], [result.stock["hit_tokens"] / result.block_size / n], marker="*",
                   s=160, color="black", zorder=5, label=f"stock ({result.stock['source']})")
        ax.axvline(result.stock["capacity_blocks"], color="black", linewidth=0.6, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xlim(1, top)
    _capacity_ticks(ax, list(result.grid), True)
    ax.set_xlabel(f"capacity (blocks of {result.block_size} tokens)")
    ax.set_ylabel("hit ratio (hit block reads / block reads)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    _legend_outside(ax)
    what = "" if sampling is None else (f", sampled at {sampling['rate']:g}" if how == "sampled"
                                        else f", {sampling['partitions']} partitions merged")
    ax.set_title(f"Prefix-cache hit ratio at every capacity (window: {result.window}{what})", fontsize=10)
    return _save(fig, path)


def plot_pressure_sweep(points: Sequence["SweepPoint"], path: str | Path, block_size: int) -> Path:
    """Net cached tokens of family holds against pool capacity, with its saved and displaced parts."""
    path = check_plot_path(path)
    plt = _pyplot()
    caps = [p.capacity_blocks for p in points]
    fig, ax = plt.subplots(figsize=(8.5, 4))
    series = {"net cached tokens": [p.net_cached_tokens for p in points],
              "saved child tokens": [p.saved_child_tokens for p in points],
              "- displaced hit tokens": [-p.displaced_hit_tokens for p in points]}
    for k, (name, ys) in enumerate(series.items()):
        ax.plot(caps, ys, label=name, **_look(k))
    ax.axhline(0, color="grey", linewidth=0.8)
    log = bool(caps) and min(caps) > 0 and max(caps) >= 8 * min(caps)
    if log:
        ax.set_xscale("log", base=2)
    _capacity_ticks(ax, caps, log)
    _note(ax, same_lines(series))
    ax.set_xlabel(f"pool capacity (usable {block_size}-token blocks)")
    ax.set_ylabel("tokens (held - stock)")
    ax.set_title("Family holds: tokens gained (+) or lost (-) against stock, by capacity", fontsize=10)
    ax.grid(alpha=0.3)
    _legend_outside(ax)
    return _save(fig, path)


def plot_tier_sweep(sweep: "SweepResult", path: str | Path, block_size: int) -> Path:
    """The host x SSD sweep as a heatmap of its metric, the best and the smallest near-best cell marked."""
    path = check_plot_path(path)
    plt = _pyplot()
    grid = sweep.grid()
    fig, ax = plt.subplots(figsize=(1.2 * len(sweep.ssd_blocks) + 3, 0.8 * len(sweep.host_blocks) + 2.2))
    lo, hi = float(grid.min()), float(grid.max())
    # The scale starts at 0 (not at the smallest cell), so a 2% spread looks like 2%; the label says the range.
    vmin = min(lo, 0.0)
    im = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis", vmin=vmin, vmax=max(hi, vmin + 1e-9))
    fmt = "{:.3g}" if sweep.metric == "prefill_seconds_saved" else "{:,.0f}"
    spread = f" (spread {(hi - lo) / abs(hi):.1%} of the best)" if hi else ""
    fig.colorbar(im, ax=ax, label=f"{sweep.metric.replace('_', ' ')}, scale from {fmt.format(vmin)}")
    range_text = f"cells {fmt.format(lo)}..{fmt.format(hi)}{spread}"
    ax.set_xticks(range(len(sweep.ssd_blocks)), [f"{s:,}" if s else "none" for s in sweep.ssd_blocks])
    ax.set_yticks(range(len(sweep.host_blocks)), [f"{h:,}" if h else "none" for h in sweep.host_blocks])
    ax.set_xlabel(f"SSD tier ({block_size}-token blocks)")
    ax.set_ylabel(f"host tier ({block_size}-token blocks)")
    for a in range(grid.shape[0]):
        for b in range(grid.shape[1]):
            dark = hi > vmin and (grid[a, b] - vmin) / (hi - vmin) < 0.5
            ax.text(b, a, fmt.format(grid[a, b]), ha="center", va="center", fontsize=8,
                    color="white" if dark else "black")
    bi, bj = sweep.best()
    si, sj = sweep.smallest_within()
    ax.scatter([bj], [bi], marker="*", s=220, facecolor="none", edgecolor="red", linewidth=1.5, label="best")
    ax.scatter([sj], [si], marker="s", s=500, facecolor="none", edgecolor="orange", linewidth=2,
               label=f"smallest within {sweep.within_pct:g}%")
    ax.legend(loc="upper left", bbox_to_anchor=(0, -0.18), ncol=2, fontsize=8, frameon=False)
    gpu = sweep.results[0][0].config.gpu_blocks
    ax.set_title(f"Lower tiers at {gpu:,} GPU blocks: {sweep.metric.replace('_', ' ')}\n{range_text}", fontsize=10)
    return _save(fig, path)


def plot_lineage(report: "LineageReport", path: str | Path) -> Path:
    """Three panels: children per parent (histogram), parent finish -> child arrival (CDF, seconds),
    shared-prefix blocks per edge (CDF)."""
    import numpy as np

    path = check_plot_path(path)
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    ax = axes[0]
    fan = np.asarray(report.fan_out_values, dtype=np.int64)
    if fan.size:
        counts = np.bincount(fan)
        ax.bar(np.arange(len(counts))[1:], counts[1:])
    ax.set_xlabel("children per parent")
    ax.set_ylabel("parents")
    for ax, values, label, log in ((axes[1], report.gap_values, "parent finish -> child arrival (s)", True),
                                   (axes[2], report.shared_values, f"shared-prefix blocks ({report.block_size} tokens)", False)):
        v = np.sort(np.asarray(values, dtype=np.float64))
        if v.size:
            ax.step(v, np.arange(1, v.size + 1) / v.size, where="post")
            if log and v.min() > 0:
                ax.set_xscale("log")
        else:
            ax.text(0.5, 0.5, "unknown in this trace", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of edges")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Lineage ({report.edge_kind} edges): {report.num_families:,} families, {report.num_edges:,} edges",
                 fontsize=10)
    return _save(fig, path)


def plot_fleet(result: "FleetResult", path: str | Path) -> Path:
    """Hit ratio of each routing policy and of the global pool: against the per-engine capacity, one panel
    per fleet size (or against the fleet size, when the sweep has one capacity)."""
    path = check_plot_path(path)
    plt = _pyplot()
    engines = list(dict.fromkeys(p.num_engines for p in result.points))
    caps = list(dict.fromkeys(p.capacity_blocks for p in result.points))
    by_caps = len(caps) > 1
    panels = engines if by_caps else [None]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False, sharey=True)
    for ax, n in zip(axes[0], panels):
        points = [p for p in result.points if n is None or p.num_engines == n]
        xs = [p.capacity_blocks if by_caps else p.num_engines for p in points]
        series = {}
        for k, run in enumerate(points[0].runs):
            ys = series[run.policy] = [p.runs[k].hit_ratio for p in points]
            if run.policy == "global":
                ax.plot(xs, ys, marker="*", label=run.policy, linestyle="--", color="black")
            else:
                ax.plot(xs, ys, label=run.policy, **_look(k))
        _note(ax, same_lines(series))
        log = len(xs) > 1 and max(xs) >= 8 * min(xs)
        if log:
            ax.set_xscale("log", base=2)
        _capacity_ticks(ax, xs, log)
        ax.set_xlabel(f"capacity per engine (blocks of {result.block_size} tokens)" if by_caps else "engines")
        ax.set_title(f"{n} engines" if by_caps else f"{caps[0]:,} blocks per engine", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("hit ratio (hit block reads / block reads)")
    _legend_outside(axes[0][-1])
    fig.suptitle("Fleet routing against one global pool of engines x capacity", fontsize=11)
    return _save(fig, path)


def plot_ladder(advice: dict, path: str | Path) -> Path:
    """The advise ladder (`kmesh_trace.apps.advise.Advice.to_dict()`): each rung's token hit ratio as a bar, the
    bound and the recommendation's target as vertical lines, the recommended rung hatched."""
    path = check_plot_path(path)
    plt = _pyplot()
    rungs = advice["ladder"]
    rec = advice["recommendation"]
    fig, ax = plt.subplots(figsize=(7.5, 0.42 * len(rungs) + 2.2))
    ys = list(range(len(rungs)))[::-1]
    for y, r in zip(ys, rungs):
        chosen = r["rung"] == rec["rung"]
        ax.barh(y, r["token_hit_ratio"], color="#7a9cc6" if not chosen else "#e0a040", edgecolor="black",
                hatch="//" if chosen else None)
        ax.text(r["token_hit_ratio"], y, f" {r['token_hit_ratio']:.1%}", va="center", fontsize=8)
    bound = next(r for r in rungs if r["rung"] == "bound")["token_hit_ratio"]
    ax.axvline(bound, color="black", linestyle="--", label=f"bound {bound:.1%}")
    ax.axvline(rec["target_token_hit_ratio"], color="#b04030", linestyle=":",
               label=f"within {rec['within_pct']:g}% of the bound")
    ax.set_yticks(ys, [r["rung"] for r in rungs])
    ax.set_xlabel("token hit ratio (hit prompt tokens / prompt tokens)")
    ax.set_xlim(0, min(1.0, max(r["token_hit_ratio"] for r in rungs) * 1.18 + 0.02))
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)  # below: never over a bar
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"Ladder at {advice['capacity_blocks']:,} blocks; recommended: {rec['rung']} (hatched)", fontsize=10)
    return _save(fig, path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    """Write `fig` to `path` through a temporary file in the same directory (so the rename is atomic);
    the format is given explicitly, from `path`'s suffix."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        fig.tight_layout()
        fmt = path.suffix[1:].lower()
        # The same figure gives the same bytes: SVG ids come from a fixed salt, and no date is written.
        with plt.rc_context({"svg.hashsalt": "kmesh-trace"}):
            fig.savefig(tmp, format=fmt, metadata={"Date": None} if fmt == "svg" else None)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a plot is as readable as the HTML and JSON beside it
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        Path(tmp).unlink(missing_ok=True)
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
