"""`pressure`: what holding each family's ancestor saves its children, and what it displaces."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import typer
from kmesh_trace.cli.display import Table, prose

from kmesh_trace.cli.common import (
    AllowIncompleteOption,
    CapacityBytesFlags,
    CapacityOption,
    EngineOption,
    Output,
    RayOption,
    ScenarioOption,
    TraceOrScenarioArgument,
    approximate_tokens_note,
    check_plot_option,
    emit,
    err,
    handles_errors,
    open_input,
    out,
    output_options,
    parse_ints,
    plot_option,
    progress_of,
)
from kmesh_trace.cli.flags import flags, takes_flags
from kmesh_trace.distributed import check_ray_option
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.executor import InProcess, OnRay
from kmesh_trace.schema import PressureEdges
from kmesh_trace.values import MAX_BLOCKS, MAX_SECONDS, bounded_int, finite_float

MAX_FAMILY_ROWS = 20


def register(app: typer.Typer) -> None:
    app.command("pressure")(pressure_cmd)


@flags
class PressureFlags:
    """`pressure`'s flags."""

    trace: TraceOrScenarioArgument = None
    scenario: ScenarioOption = None
    edges: PressureEdges = typer.Option(PressureEdges.declared, "--edges", help="Families from declared lineage, inferred exact-prefix edges, or an import's content edges (guessed from text).")
    expiry_s: Optional[float] = typer.Option(None, "--expiry-s", parser=finite_float(0, MAX_SECONDS), help="Release a hold this many seconds after it was taken (needs trace times).")
    max_held_blocks: Optional[int] = typer.Option(None, "--max-held-blocks", parser=bounded_int(0, MAX_BLOCKS), help="Refuse a hold that would put more blocks under hold.")
    max_families: Optional[int] = typer.Option(None, "--max-families", parser=bounded_int(0, MAX_BLOCKS), help="Refuse a hold that would make more families hold at once.")
    capacity_blocks: CapacityOption = None
    sizes: CapacityBytesFlags = CapacityBytesFlags()
    sweep_capacity: Optional[str] = typer.Option(None, "--sweep-capacity", hidden=True, help="Same as --capacity-blocks with a sweep table (kept for old scripts).")
    plot: plot_option("With several capacities: write net tokens against capacity to FILE.png or FILE.svg.") = None
    engine: EngineOption = None
    allow_incomplete: AllowIncompleteOption = False
    per_request: bool = typer.Option(False, "--per-request", help="Also list every request's hits and evictions in each arm.")
    ray: RayOption = None

    def options(self):
        """(the analysis' options, the flag its capacities came from), checked before any input is read."""
        from kmesh_trace.oracle.pressure import PressureOptions

        if (self.trace is None) == (self.scenario is None):
            raise KmeshTraceError("give either a TRACE directory or --scenario, not both and not neither.")
        if self.capacity_blocks is not None and self.sweep_capacity is not None:
            raise KmeshTraceError("give the capacities once, with --capacity-blocks.")
        option = "--capacity-blocks" if self.sweep_capacity is None else "--sweep-capacity"
        text = self.capacity_blocks if self.sweep_capacity is None else self.sweep_capacity
        caps = parse_ints(text, option) if text is not None else None
        self.sizes.check_once(text)
        if self.plot is not None and caps is None and self.sizes.capacity is None:
            raise KmeshTraceError("--plot draws a capacity sweep; add --capacity-blocks a,b,c.")
        check_plot_option(self.plot, [self.trace, self.sizes.model_config])
        check_ray_option(self.ray)
        options = PressureOptions(self.edges, None if caps is None else tuple(caps), self.expiry_s, self.max_held_blocks,
                                  self.max_families, sweep=self.sweep_capacity is not None or self.plot is not None)
        options.check(option)
        return options


@handles_errors
@output_options(csv=True)
@takes_flags
def pressure_cmd(f: PressureFlags, output: Output = None) -> None:
    """Replay the trace stock and with family holds through the vLLM block-pool model; report the tradeoff.

    One capacity gives the detailed report; several (--capacity-blocks 64,96,128) a sweep table."""
    w, options, note = _workload(f, f.options())
    res = _pressure(w, options, f.ray)
    res.note = note
    if options.is_sweep:
        if f.plot is not None:
            from kmesh_trace.apps.plots import plot_pressure_sweep

            plot_pressure_sweep(res.points, f.plot, w.block_size)
            err.print(f"wrote {f.plot}", markup=False, highlight=False, soft_wrap=True)
        return emit(output, res.to_dict(), rows=res.rows(), render=lambda: render(res))
    d = res.to_dict(per_request=f.per_request)
    emit(output, d, rows=d["holds"], render=lambda: render(res, per_request=f.per_request))


def _workload(f: PressureFlags, options):
    """(the workload, the options with --capacity in blocks, the approximate-token note) of the input."""
    from kmesh_trace.oracle import pressure as pr

    with open_input(f.trace, f.scenario, f.engine, f.allow_incomplete, direct=f.ray is None) as (t, w):  # Ray tasks read a trace
        if t is not None:
            w = pr.workload_of(t, f.engine)
        if f.sizes.capacity is not None:  # in bytes: converted with the engine's KV geometry, known now
            options = replace(options, capacities=f.sizes.in_blocks(t, w, f.engine))
            options.check("--capacity")
        note = approximate_tokens_note(t) if t is not None else None
    if (untimed := pr.untimed_note(w)) is not None:
        err.print(f"note: {untimed}")
    return w, options, note


def _pressure(w, options, ray: str | None):
    """The analysis, in this process or its pieces as Ray tasks."""
    from kmesh_trace.oracle import pressure as pr

    executor = InProcess() if ray is None else OnRay(ray)
    with progress_of(executor, "pressure"):
        return pr.run(w, options, executor)


def render(res, *, per_request: bool = False) -> None:
    """A pressure result on the console: a sweep's table (`PressureSweep`), or one capacity's report
    (`PressureResult`, with every request's rows when `per_request`)."""
    from kmesh_trace.oracle.pressure import PressureSweep

    if isinstance(res, PressureSweep):
        render_sweep(res)
    else:
        render_result(res, per_request=per_request)


def render_sweep(res) -> None:
    """A `PressureSweep`: one row per capacity."""
    d = res.to_dict()
    rt = Table(title=f"retention pressure by capacity ({d['block_size']}-token blocks, {d['edges']} edges)",
                   title_justify="left")
    for h in ("capacity", "stock_hits", "held_hits", "saved", "displaced", "net"):
        rt.add_column(h, justify="right")
    keys = ("capacity_blocks", "stock_hit_tokens", "held_hit_tokens", "saved_child_tokens", "displaced_hit_tokens",
            "net_cached_tokens")
    for p in d["sweep"]:
        rt.add_row(*(f"{p[k]:,}" for k in keys))
    out.print(rt)


def render_result(res, *, per_request: bool = False) -> None:
    """A `PressureResult`: both arms, the holds per parent, the requests when `per_request`, the totals."""
    d = res.to_dict(per_request=per_request)
    at = Table(title=f"retention pressure: {d['capacity_blocks']:,} blocks of {d['block_size']} tokens, "
                         f"{d['num_requests']:,} requests, {d['num_children']:,} children ({d['edges']} edges)",
                   title_justify="left")
    cols = ("child_hit_tokens", "other_hit_tokens", "hit_tokens", "prefill_tokens", "evictions")
    at.add_column("arm")
    for c in ("child_hits", "other_hits", "hits", "prefill", "evictions"):
        at.add_column(c, justify="right")
    for arm in ("stock", "held"):
        at.add_row(arm, *(f"{d['arms'][arm][c]:,}" for c in cols))
    out.print(at)
    fams = sorted(d["holds"], key=lambda f: (-abs(f["saved_child_tokens"]), f["parent_index"]))
    prose(f"{d['num_families']:,} families (as `lineage` counts them), {d['num_parents']:,} parents: one hold "
          "per parent")
    ft = Table(title="holds per parent (kids: children; stock, held: child hit tokens in each arm)",
                   title_justify="left")
    # child hits in tokens, stock then held; saved = held - stock
    for h in ("family", "parent", "kids", "hold", "blocks", "release", "stock", "held", "saved"):
        ft.add_column(h, justify="left" if h in ("family", "parent", "hold", "release") else "right", overflow="fold")
    for f in fams[:MAX_FAMILY_ROWS]:
        ft.add_row(f["family"], f["parent_request_id"], f"{f['num_children']:,}", f["hold_status"],
                   f"{f['num_held_blocks']:,}", f["release_reason"] or "-", f"{f['child_hit_tokens_stock']:,}",
                   f"{f['child_hit_tokens_held']:,}", f"{f['saved_child_tokens']:,}")
    out.print(ft)
    if len(fams) > MAX_FAMILY_ROWS:
        err.print(f"({len(fams) - MAX_FAMILY_ROWS:,} more parents; --json lists them all)")
    if "requests" in d:
        rt = Table(title="requests (hit tokens and evictions, stock then held)", title_justify="left")
        for h in ("index", "request", "role", "hits_stock", "hits_held", "evict_stock", "evict_held"):
            rt.add_column(h, justify="left" if h in ("request", "role") else "right")
        for r in d["requests"]:
            rt.add_row(str(r["index"]), r["request_id"], r["role"], f"{r['hit_tokens_stock']:,}",
                       f"{r['hit_tokens_held']:,}", f"{r['evictions_stock']:,}", f"{r['evictions_held']:,}")
        out.print(rt)
    secs = d["held_block_seconds"]
    prose(f"saved_child_tokens {d['saved_child_tokens']:,}  displaced_hit_tokens {d['displaced_hit_tokens']:,}  "
              f"net_cached_tokens {d['net_cached_tokens']:,}")
    prose(f"holds {d['num_holds']:,}  unused {d['unused_holds']:,}  refused {d['refused_holds']:,}  "
              f"held_block_steps {d['held_block_steps']:,}"
              + (f"  held_block_seconds {secs:,.3f}" if secs is not None else ""))
