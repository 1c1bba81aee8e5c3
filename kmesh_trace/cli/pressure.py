"""`pressure`: what holding each family's ancestor saves its children, and what it displaces."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table as RichTable

from kmesh_trace.cli.common import check_out_file, err, handles_errors, out, parse_ints, print_json
from kmesh_trace.errors import KmeshTraceError

MAX_FAMILY_ROWS = 20


class Scenario(str, Enum):
    hold_stress = "hold-stress"
    hold_stress_x2 = "hold-stress-x2"


class Edges(str, Enum):
    declared = "declared"
    inferred = "inferred"


def register(app: typer.Typer) -> None:
    app.command("pressure")(pressure_cmd)


@handles_errors
def pressure_cmd(
    trace: Optional[Path] = typer.Argument(None, help="Trace directory (or use --scenario)."),
    scenario: Optional[Scenario] = typer.Option(None, "--scenario", help="Analyse a built-in scenario instead of a trace."),
    edges: Edges = typer.Option(Edges.declared, "--edges", help="Families from declared lineage or inferred exact-prefix edges."),
    expiry_s: Optional[float] = typer.Option(None, "--expiry-s", help="Release a hold this many seconds after it was taken (needs trace times)."),
    max_held_blocks: Optional[int] = typer.Option(None, "--max-held-blocks", help="Refuse a hold that would put more blocks under hold."),
    max_families: Optional[int] = typer.Option(None, "--max-families", help="Refuse a hold that would make more families hold at once."),
    capacity_blocks: Optional[int] = typer.Option(None, "--capacity-blocks", help="Usable pool blocks (default: the trace's)."),
    sweep_capacity: Optional[str] = typer.Option(None, "--sweep-capacity", help="Capacities to sweep, comma-separated (a table of net tokens)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="With --sweep-capacity: write net tokens against capacity to FILE.png or FILE.svg."),
    engine: Optional[str] = typer.Option(None, "--engine", help="Engine partition, for traces with several."),
    allow_incomplete: bool = typer.Option(False, "--allow-incomplete", help="Analyse a capture that never closed "
                                          "(complete: false) with a warning, instead of refusing."),
    per_request: bool = typer.Option(False, "--per-request", help="Also list every request's hits and evictions in each arm."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Replay the trace stock and with family holds through the vLLM block-pool model; report the tradeoff."""
    from kmesh_trace.oracle.pressure import sweep, trace_stream, what_if
    from kmesh_trace.oracle.stream import pool_capacity
    from kmesh_trace.plots import check_plot_path, plot_pressure_sweep

    if (trace is None) == (scenario is None):
        raise KmeshTraceError("give either a TRACE directory or --scenario, not both and not neither.")
    if plot is not None and sweep_capacity is None:
        raise KmeshTraceError("--plot draws a capacity sweep; add --sweep-capacity a,b,c.")
    if plot is not None:
        check_out_file(check_plot_path(plot), "--plot")
    caps = parse_ints(sweep_capacity, "--sweep-capacity") if sweep_capacity is not None else None
    if scenario is not None:
        from kmesh_trace.datasets.hold_stress import hold_stress

        sc = hold_stress(2 if scenario is Scenario.hold_stress_x2 else 1)
        reqs, block_size, usable, lineage = sc.request_blocks(), sc.block_size, sc.num_usable_blocks, None
    else:
        from kmesh_trace.audit.capture import check_complete
        from kmesh_trace.trace import open_trace

        with open_trace(trace) as t:
            check_complete(t, engine, allow_incomplete, lambda line: err.print(line, markup=False, highlight=False))
            ts = trace_stream(t, engine)
        reqs, block_size, usable, lineage = ts.requests, ts.block_size, ts.num_usable_blocks, ts.lineage
    num_timed = sum(r.arrival_ns is not None and r.finish_ns is not None for r in reqs)
    if 0 < num_timed < len(reqs):
        err.print(f"note: {len(reqs) - num_timed:,} of {len(reqs):,} requests lack arrival or finish times, so "
                  "the replay is sequential (each request freed before the next)")
    if capacity_blocks is not None or caps is None:  # a sweep needs no usable-block count of its own
        usable = pool_capacity(capacity_blocks, usable)
    opts = dict(edges=edges.value, lineage=lineage, expiry_s=expiry_s, max_held_blocks=max_held_blocks,
                max_families=max_families)
    if caps is not None:
        points = sweep(reqs, block_size=block_size, capacities=caps, **opts)
        if plot is not None:
            plot_pressure_sweep(points, plot, block_size)
            err.print(f"wrote {plot}")
        if as_json:
            print_json({"block_size": block_size, "edges": edges.value, "sweep": [p.to_dict() for p in points]})
            return
        rt = RichTable(title=f"retention pressure by capacity ({block_size}-token blocks, {edges.value} edges)",
                       title_justify="left")
        for h in ("capacity_blocks", "stock_hits", "held_hits", "saved", "displaced", "net"):
            rt.add_column(h, justify="right")
        for p in points:
            rt.add_row(*(f"{v:,}" for v in (p.capacity_blocks, p.stock_hit_tokens, p.held_hit_tokens,
                                              p.saved_child_tokens, p.displaced_hit_tokens, p.net_cached_tokens)))
        out.print(rt)
        return
    res = what_if(reqs, block_size=block_size, num_usable_blocks=usable, **opts)
    d = res.to_dict(per_request=per_request)
    if as_json:
        print_json(d)
        return
    _render(d)


def _render(d: dict) -> None:
    at = RichTable(title=f"retention pressure: {d['capacity_blocks']:,} blocks of {d['block_size']} tokens, "
                         f"{d['num_requests']:,} requests, {d['num_children']:,} children ({d['edges']} edges)",
                   title_justify="left")
    cols = ("child_hit_tokens", "other_hit_tokens", "hit_tokens", "prefill_tokens", "evictions")
    at.add_column("arm")
    for c in ("child_hits", "other_hits", "hits", "prefill", "evictions"):
        at.add_column(c, justify="right")
    for arm in ("stock", "held"):
        at.add_row(arm, *(f"{d['arms'][arm][c]:,}" for c in cols))
    out.print(at)
    fams = sorted(d["families"], key=lambda f: (-abs(f["saved_child_tokens"]), f["parent_index"]))
    ft = RichTable(title="families", title_justify="left")
    # child hits in tokens, stock then held; saved = held - stock
    for h in ("family", "parent", "children", "hold", "blocks", "released", "stock", "held", "saved"):
        ft.add_column(h, justify="left" if h in ("family", "parent", "hold", "released") else "right")
    for f in fams[:MAX_FAMILY_ROWS]:
        ft.add_row(f["family"] or "-", f["parent_request_id"], f"{f['num_children']:,}", f["hold_status"],
                   f"{f['num_held_blocks']:,}", f["release_reason"] or "-", f"{f['child_hit_tokens_stock']:,}",
                   f"{f['child_hit_tokens_held']:,}", f"{f['saved_child_tokens']:,}")
    out.print(ft)
    if len(fams) > MAX_FAMILY_ROWS:
        err.print(f"({len(fams) - MAX_FAMILY_ROWS:,} more families; --json lists them all)")
    if "requests" in d:
        rt = RichTable(title="requests (hit tokens and evictions, stock then held)", title_justify="left")
        for h in ("index", "request", "role", "hits_stock", "hits_held", "evict_stock", "evict_held"):
            rt.add_column(h, justify="left" if h in ("request", "role") else "right")
        for r in d["requests"]:
            rt.add_row(str(r["index"]), r["request_id"], r["role"], f"{r['hit_tokens_stock']:,}",
                       f"{r['hit_tokens_held']:,}", f"{r['evictions_stock']:,}", f"{r['evictions_held']:,}")
        out.print(rt)
    secs = d["held_block_seconds"]
    out.print(f"saved_child_tokens {d['saved_child_tokens']:,}  displaced_hit_tokens {d['displaced_hit_tokens']:,}  "
              f"net_cached_tokens {d['net_cached_tokens']:,}")
    out.print(f"holds {d['num_holds']:,}  unused {d['unused_holds']:,}  refused {d['refused_holds']:,}  "
              f"held_block_steps {d['held_block_steps']:,}"
              + (f"  held_block_seconds {secs:,.3f}" if secs is not None else ""))

