"""`headroom`: stock prefix-cache hits against LRU, the vLLM pool model and the Belady bound."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table as RichTable

from kmesh_trace.cli.common import check_out_file, err, handles_errors, out, parse_ints, print_json
from kmesh_trace.errors import KmeshTraceError


class Scenario(str, Enum):
    fork_tree = "fork-tree"
    fork_tree_unaligned = "fork-tree-unaligned"


def register(app: typer.Typer) -> None:
    app.command("headroom")(headroom_cmd)


@handles_errors
def headroom_cmd(
    trace: Optional[Path] = typer.Argument(None, help="Trace directory (or use --scenario)."),
    capacity_blocks: Optional[str] = typer.Option(
        None, "--capacity-blocks", help="Cache capacities in blocks, comma-separated (default: the trace's usable blocks)."),
    policies: Optional[str] = typer.Option(
        None, "--policies", help="Policies, comma-separated, from: infinite, lru, vllm, belady (default: all)."),
    scenario: Optional[Scenario] = typer.Option(
        None, "--scenario", help="Analyse a built-in workload instead of a trace (512 usable blocks)."),
    engine: Optional[str] = typer.Option(None, "--engine", help="Engine partition, for traces with several."),
    allow_incomplete: bool = typer.Option(False, "--allow-incomplete", help="Analyse a capture that never closed "
                                          "(complete: false) with a warning, instead of refusing."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also write hit ratio against capacity to FILE.png or FILE.svg."),
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
        from kmesh_trace.datasets.fork_tree import BLOCK_SIZE, NUM_USABLE_BLOCKS, fork_tree_requests

        reqs = fork_tree_requests(aligned=scenario is Scenario.fork_tree)
        result = headroom_of_requests(reqs, BLOCK_SIZE, caps, names, num_usable_blocks=NUM_USABLE_BLOCKS)
    else:
        from kmesh_trace.audit.capture import check_complete
        from kmesh_trace.trace import open_trace

        with open_trace(trace) as t:
            check_complete(t, engine, allow_incomplete, lambda line: err.print(line, markup=False, highlight=False))
            result = headroom(t, caps, names, engine=engine)
    if plot is not None:
        plot_headroom(result, plot)
        err.print(f"wrote {plot}")
    for note in result.notes:
        err.print(f"note: {note}")
    if as_json:
        print_json(result.to_dict())
        return
    d = result.to_dict()
    rt = RichTable(title=f"headroom ({d['block_size']}-token blocks)", title_justify="left")
    for h in ("policy", "capacity_blocks", "hit_blocks", "hit_tokens", "prefill_tokens", "hit_ratio"):
        rt.add_column(h, justify="left" if h == "policy" else "right")
    for r in d["results"]:
        rt.add_row(r["policy"], f"{r['capacity_blocks']:,}", f"{r['hit_blocks']:,}", f"{r['hit_tokens']:,}",
                   f"{r['prefill_tokens']:,}", f"{r['hit_ratio']:.4f}")
    out.print(rt)
    if d["headroom_tokens"] is not None:
        out.print(f"headroom: {d['headroom_tokens']:,} prefill tokens at {d['headroom_capacity_blocks']:,} blocks "
                  f"(stock from {d['stock_source']} minus belady)")
