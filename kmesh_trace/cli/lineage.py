"""`lineage`: families, fan-out, depth, parent-finish to child-arrival gaps and shared prefixes of a trace."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from kmesh_trace.cli.display import Table, prose

from kmesh_trace.cli.common import Output, PartitionOption, approximate_tokens_note, check_plot_option, emit, err, handles_errors, out, output_options

MAX_FAMILY_ROWS = 20


def register(app: typer.Typer) -> None:
    app.command("lineage")(lineage_cmd)


def _fmt(v: float | None, digits: int = 2) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:,.{digits}f}"


@handles_errors
@output_options(csv=True)
def lineage_cmd(
    trace: Path = typer.Argument(..., help="Trace directory, or a Mooncake/Bailian JSONL file or weka directory, read as it is, or an lmcache-agent directory, imported on the way in."),
    edges: Optional[str] = typer.Option(None, "--edges", help="Edge kind to read from the lineage table: declared, "
                                        "exact_prefix or content (default: the first of these the trace has)."),
    engine: PartitionOption = None,
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw fan-out, reuse gaps and shared blocks to FILE.png or FILE.svg."),
    output: Output = None,
) -> None:
    """The shape of a trace's lineage: families, children per parent, depth, reuse gaps, shared-prefix blocks."""
    from kmesh_trace.oracle import lineage_report as lr
    from kmesh_trace.apps.plots import plot_lineage
    check_plot_option(plot, [trace])
    with _input(trace) as t:
        rep = lr.run(t, lr.LineageOptions(edges), engine)
        note = approximate_tokens_note(t)
    if note:
        rep.notes.append(note)
    d = rep.to_dict()
    if plot is not None:
        plot_lineage(rep, plot)
        err.print(f"wrote {plot}", markup=False, highlight=False, soft_wrap=True)
    for n in rep.notes:
        if n != note:
            err.print(f"note: {n}", markup=False, highlight=False)
    emit(output, d, rows=d["families"], render=lambda: render(rep))


@contextmanager
def _input(trace: Path):
    """The opened trace with requests, or a public trace read into memory as its import would read
    (`kmesh_trace.sources.read_directly`); other public traces are imported on the way in."""
    from kmesh_trace.sources import open_as_trace, read_directly

    public = read_directly(trace, on_import=err.print)
    if public is not None:
        yield public
        return
    from kmesh_trace.trace import check_has_requests

    with open_as_trace(trace, on_import=err.print) as t:
        check_has_requests(t)
        yield t


def render(rep) -> None:
    """A `LineageReport` on the console: its counts, the distributions, the largest families."""
    d = rep.to_dict()
    edges_text = (f"{d['num_edges']:,} {d['edge_kind']} edges ({d['num_dangling_edges']:,} dangling)"
                  if d["edge_kind"] else "no lineage edges")
    prose(f"{d['num_requests']:,} requests, {d['num_families']:,} families, {d['num_singletons']:,} singletons; "
          f"{edges_text}, {d['num_parents']:,} parents; block size {d['block_size']}")
    dt = Table(title="distributions", title_justify="left")
    for h in ("what", "count", "min", "p50", "p90", "p99", "max", "mean"):
        dt.add_column(h, justify="left" if h == "what" else "right")
    for label, key in (("children per parent", "fan_out"), ("family depth (edges)", "depth"),
                       ("family size (requests)", "family_size"), ("parent finish -> child arrival (s)", "gap_s"),
                       ("shared-prefix blocks", "shared_blocks"), ("shared / child's full blocks", "shared_fraction")):
        x = d[key]
        dt.add_row(label, f"{x['count']:,}", *(_fmt(x[q]) for q in ("min", "p50", "p90", "p99", "max", "mean")))
    out.print(dt)
    if d["num_negative_gaps"]:
        prose(f"{d['num_negative_gaps']:,} children arrived before their parent finished (negative gaps)")
    ft = Table(title="families (largest first)", title_justify="left")
    short = {"requests": "reqs", "max fan-out": "fan-out", "shared p50": "shared"}  # at 80 columns, with a legend
    for h in ("family", "requests", "edges", "roots", "max fan-out", "depth", "gap p50 (s)", "shared p50", "agents"):
        ft.add_column(h, justify="left" if h == "family" else "right", short=short.get(h))
    for f in d["families"][:MAX_FAMILY_ROWS]:
        ft.add_row(f["family"], f"{f['num_requests']:,}", f"{f['num_edges']:,}", f"{f['num_roots']:,}",
                   f"{f['max_fan_out']:,}", f"{f['depth']:,}", _fmt(f["gap_s_p50"]), _fmt(f["shared_blocks_p50"]),
                   f"{f['num_agents']:,}")
    out.print(ft)
    if len(d["families"]) > MAX_FAMILY_ROWS:
        err.print(f"({len(d['families']) - MAX_FAMILY_ROWS:,} more families; --json lists them all)")
