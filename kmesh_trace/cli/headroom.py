"""`headroom`: stock prefix-cache hits against LRU, the vLLM pool model and the Belady bound."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table as RichTable

from kmesh_trace.cli.common import (
    CapacityOption,
    Output,
    ScenarioOption,
    approximate_tokens_note,
    build_scenario,
    check_out_file,
    emit,
    err,
    handles_errors,
    out,
    output_options,
    parse_ints,
)
from kmesh_trace.errors import KmeshTraceError


def register(app: typer.Typer) -> None:
    app.command("headroom")(headroom_cmd)


@handles_errors
@output_options(csv=True)
def headroom_cmd(
    trace: Optional[Path] = typer.Argument(None, help="Trace directory (or use --scenario)."),
    capacity_blocks: CapacityOption = None,
    policies: Optional[str] = typer.Option(
        None, "--policies", help="Policies, comma-separated, from: infinite, lru, vllm, belady (default: all)."),
    scenario: ScenarioOption = None,
    engine: Optional[str] = typer.Option(None, "--engine", help="Engine partition, for traces with several."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also write hit ratio against capacity to FILE.png or FILE.svg."),
    output: Output = None,
) -> None:
    """Prefill tokens the stock cache failed to reuse that an ideal cache of the same capacity would have."""
    from kmesh_trace.oracle.headroom import headroom, headroom_of_requests
    from kmesh_trace.plots import check_plot_path, plot_headroom

    caps = parse_ints(capacity_blocks, "--capacity-blocks") if capacity_blocks is not None else None
    names = [p.strip() for p in policies.split(",") if p.strip()] if policies else None
    if (trace is None) == (scenario is None):
        raise KmeshTraceError("give either a TRACE directory or --scenario, not both and not neither.")
    if plot is not None:  # a bad --plot must fail before the replays, not after them
        check_out_file(check_plot_path(plot), "--plot")
    if scenario is not None:
        w = build_scenario(scenario)
        result = headroom_of_requests(w.requests, w.block_size, caps, names, num_usable_blocks=w.num_usable_blocks)
        approximate = None
    else:
        from kmesh_trace.trace import open_trace

        with open_trace(trace) as t:
            result = headroom(t, caps, names, engine=engine)
            approximate = approximate_tokens_note(t)
        if approximate:
            result.notes.append(approximate)
    if plot is not None:
        plot_headroom(result, plot)
        err.print(f"wrote {plot}")
    for note in result.notes:
        if note != approximate:  # already said
            err.print(f"note: {note}")
    d = result.to_dict()
    if approximate:
        d["note"] = approximate
    emit(output, d, rows=d["results"], render=lambda: render(d))


def render(d: dict) -> None:
    rt = RichTable(title=f"headroom ({d['block_size']}-token blocks)", title_justify="left")
    for h in ("policy", "capacity", "hit_blocks", "hit_tokens", "prefill", "hit_ratio"):
        rt.add_column(h, justify="left" if h == "policy" else "right")
    for r in d["results"]:
        rt.add_row(r["policy"], f"{r['capacity_blocks']:,}", f"{r['hit_blocks']:,}", f"{r['hit_tokens']:,}",
                   f"{r['prefill_tokens']:,}", f"{r['hit_ratio']:.4f}")
    out.print(rt)
    if d["headroom_tokens"] is not None:
        out.print(f"headroom: {d['headroom_tokens']:,} prefill tokens at {d['headroom_capacity_blocks']:,} blocks "
                  f"(stock from {d['stock_source']} minus belady)")
