"""`headroom`: stock prefix-cache hits against LRU, the vLLM pool model and the Belady bracket, at given
capacities or (`--curve`, the default without --capacity-blocks) along the whole capacity axis."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from kmesh_trace.cli.display import Table

from kmesh_trace.cli.common import (
    CapacityOption,
    Output,
    ScenarioOption,
    approximate_tokens_note,
    build_scenario,
    check_plot_option,
    emit,
    err,
    handles_errors,
    out,
    output_options,
    parse_ints,
    run_tasks_with_progress,
)
from kmesh_trace.distributed import RAY_HELP, check_ray_option
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.values import bounded_int, finite_float


class Window(str, Enum):
    all = "all"
    last_half = "last-half"


def register(app: typer.Typer) -> None:
    app.command("headroom")(headroom_cmd)


@handles_errors
@output_options(csv=True)
def headroom_cmd(
    trace: Optional[Path] = typer.Argument(None, help="Trace directory (or use --scenario)."),
    capacity_blocks: CapacityOption = None,
    capacity: Optional[str] = typer.Option(
        None, "--capacity", help="Pool capacities, comma-separated: blocks, or bytes with a unit (40GiB) converted "
                                 "with the KV bytes per token."),
    kv_bytes: Optional[int] = typer.Option(None, "--kv-bytes-per-token", help="KV bytes per token, for --capacity "
                                           "in bytes (default: the capture's engine metadata)."),
    model_config: Optional[Path] = typer.Option(None, "--model-config", help="Hugging Face config.json giving the KV "
                                                "bytes per token, for --capacity in bytes."),
    policies: Optional[str] = typer.Option(
        None, "--policies", help="Policies, comma-separated, from: infinite, lru, vllm, belady, belady-prefix (default: all)."),
    curve: bool = typer.Option(
        False, "--curve", help="Every capacity: lru and belady exact from one pass each, vllm and belady-prefix on a grid "
                               "(the default when no --capacity-blocks is given)."),
    window: Window = typer.Option(Window.all, "--window", help="Requests counted in a curve: all, or the last half "
                                  "(the first half warms the cache); with --capacity-blocks, the curve at those "
                                  "capacities."),
    tokens_per_s: Optional[float] = typer.Option(
        None, "--prefill-tokens-per-s", parser=finite_float(0, lo_open=True), help="Prefill throughput at position 0, for seconds (default: fitted to a "
                                             "capture's measured prefills)."),
    attention_factor: float = typer.Option(
        0.0, "--attention-factor", parser=finite_float(0), help="With --prefill-tokens-per-s: extra cost of a token per earlier position, as a "
                                        "fraction of its position-0 cost."),
    processes: Optional[int] = typer.Option(None, "--processes", parser=bounded_int(1, 4096), help="Worker processes for grid replays "
                                            "(default: the cores)."),
    scenario: ScenarioOption = None,
    engine: Optional[str] = typer.Option(None, "--engine", help="Engine partition, for traces with several."),
    allow_incomplete: bool = typer.Option(False, "--allow-incomplete", help="Analyse a capture that never closed "
                                          "(complete: false) with a warning, instead of refusing."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also write hit ratio against capacity to FILE.png or FILE.svg."),
    ray: Optional[str] = typer.Option(None, "--ray", help=RAY_HELP),
    output: Output = None,
) -> None:
    """Prefill tokens (and seconds) the stock cache failed to reuse that an ideal cache of the same capacity
    would have: at the given capacities, or along the whole capacity axis."""
    from kmesh_trace.oracle.headroom import headroom_of_requests
    from kmesh_trace.apps.plots import plot_headroom

    caps = parse_ints(capacity_blocks, "--capacity-blocks") if capacity_blocks is not None else None
    names = [p.strip() for p in policies.split(",") if p.strip()] if policies else None
    if (trace is None) == (scenario is None):
        raise KmeshTraceError("give either a TRACE directory or --scenario, not both and not neither.")
    if capacity is not None and caps is not None:
        raise KmeshTraceError("give the capacities once: --capacity or --capacity-blocks.")
    fixed = caps is not None or capacity is not None  # capacities given (in bytes: known once the trace is open)
    if curve and fixed:
        raise KmeshTraceError("--curve covers every capacity; drop --capacity-blocks (or --curve).")
    check_plot_option(plot, [trace, model_config])  # a bad --plot must fail before the replays, not after them
    check_ray_option(ray)
    if caps is not None:
        _check_pool_memory(caps, names)
    cost = fit = stream = stock = None
    if tokens_per_s is not None:
        from kmesh_trace.oracle.prefill_cost import PrefillCost

        cost = PrefillCost.from_throughput(tokens_per_s, attention_factor=attention_factor)
    approximate = None
    if scenario is not None:
        w = build_scenario(scenario)
        reqs, block_size, usable = w.requests, w.block_size, w.num_usable_blocks
        meta: dict = {}
    else:
        from kmesh_trace.audit.capture import check_complete
        from kmesh_trace.oracle.stream import engine_geometry, request_blocks
        from kmesh_trace.trace import check_has_requests, open_trace

        with open_trace(trace) as t:
            check_has_requests(t)
            check_complete(t, engine, allow_incomplete, lambda line: err.print(line, markup=False, highlight=False))
            block_size, usable = engine_geometry(t, engine)
            meta = t.engines[engine] if engine is not None else t.metadata
            if (not fixed or window is not Window.all) and names is not None and "vllm" not in names:
                # a curve without vllm needs no RequestBlocks
                from kmesh_trace.oracle.stream import stream_of_trace

                reqs, (stream, stock) = None, stream_of_trace(t, engine)
            else:
                reqs = request_blocks(t, engine)
            if cost is None:
                cost, fit = _fitted_cost(t, engine)
            approximate = approximate_tokens_note(t)
    if capacity is not None:
        caps = _capacities_in_blocks(capacity, block_size, meta, kv_bytes, model_config)
    if caps is None or window is not Window.all:  # a window: the curve's result, at the given capacities if any
        if ray is not None:
            raise KmeshTraceError("--ray distributes the replays at given capacities; add --capacity-blocks "
                                  "(without --window).")
        return _curve(reqs, block_size, usable, names, window.value, cost, fit, processes, plot, output, approximate,
                      stream, stock, caps)
    simulate = None
    if ray is not None:  # one task per (policy, capacity) point, each reading its own input
        from kmesh_trace.oracle.policies import Workload

        simulate = _tasks(Workload(block_size, reqs) if scenario is not None else str(trace), engine, ray)
    result = headroom_of_requests(reqs, block_size, caps, names, num_usable_blocks=usable, simulate=simulate)
    result.cost = cost
    d = _plot_and_notes(result, plot, plot_headroom, approximate)
    emit(output, d, rows=d["results"], render=lambda: render(d))


def _check_pool_memory(caps: list[int], names: list[str] | None) -> None:
    """The pools the replays allocate at the largest capacity, refused before any work when too large."""
    from kmesh_trace.resources import check_fits, pool_bytes

    if names is None or "vllm" in names:
        check_fits(pool_bytes(max(caps)), "--capacity-blocks", "a vLLM pool model")
    elif {"belady", "belady-prefix"} & set(names):
        check_fits(pool_bytes(max(caps), vllm=False), "--capacity-blocks", "a Belady heap")


def render(d: dict) -> None:
    rt = Table(title=f"headroom ({d['block_size']}-token blocks)", title_justify="left")
    for h in ("policy", "capacity", "hit_blocks", "hit_tokens", "prefill", "hit_ratio"):
        rt.add_column(h, justify="left" if h == "policy" else "right")
    for r in d["results"]:
        rt.add_row(r["policy"], f"{r['capacity_blocks']:,}", f"{r['hit_blocks']:,}", f"{r['hit_tokens']:,}",
                   f"{r['prefill_tokens']:,}", f"{r['hit_ratio']:.4f}")
    out.print(rt)
    if d["headroom_tokens"] is not None:
        secs = f" = {d['headroom_seconds']:,.3f} prefill seconds" if "headroom_seconds" in d else ""
        out.print(f"headroom: {d['headroom_tokens']:,} prefill tokens{secs} at {d['headroom_capacity_blocks']:,} blocks "
                  f"(stock from {d['stock_source']} minus belady)")
    if "bracket" in d:
        b = d["bracket"]
        out.print(f"bracket: belady-prefix {b['belady_prefix_prefill_tokens']:,} .. belady {b['belady_prefill_tokens']:,} "
                  f"prefill tokens (width {b['width_tokens']:,}{', wide' if b['wide'] else ''})")


def _capacities_in_blocks(text: str, block_size: int, meta: dict, kv_bytes, model_config) -> list[int]:
    """`--capacity` as block counts: plain numbers are blocks, sizes with a unit are bytes over the block's bytes."""
    from kmesh_trace.oracle.tier_costs import kv_bytes_per_token, parse_capacity

    kvbpt, _ = kv_bytes_per_token(meta, kv_bytes, model_config)
    block_bytes = block_size * kvbpt if kvbpt else None
    caps = [parse_capacity(c, block_bytes, "--capacity") for c in text.split(",") if c.strip()]
    if not caps or min(caps) <= 0:
        raise KmeshTraceError(f"--capacity must give capacities of at least one block ({block_size} tokens"
                              f"{f', {block_bytes:,} bytes' if block_bytes else ''}); got {text!r}.")
    return caps


def _plot_and_notes(result, plot, plotter, approximate: str | None) -> dict:
    """Write the plot, print the notes (the approximate-token note was said already); the result as a dict."""
    if plot is not None:
        plotter(result, plot)
        err.print(f"wrote {plot}")
    for note in result.notes:
        err.print(f"note: {note}")
    d = result.to_dict()
    if approximate:
        d["note"] = approximate
    return d


def _fitted_cost(trace, engine):
    """The prefill cost fitted to a capture's measured prefills when the fit is usable, else (None, fit or
    None) with a note saying why there are no seconds (`kmesh_trace.oracle.prefill_cost.usable_fit`)."""
    from kmesh_trace.oracle.prefill_cost import usable_fit

    cost, fit, why = usable_fit(trace, engine)
    if fit is not None:
        err.print(f"prefill cost fitted to {fit.n} measured prefills: r2 {fit.r2:.3f}, median relative error "
                  f"{fit.median_relative_error:.1%}", markup=False, highlight=False)
    if why and not str(trace.metadata.get("source", "")).startswith("import"):
        err.print(f"note: {why}", markup=False, highlight=False)
    if fit is None:
        return cost, None
    fit_d = fit.to_json()
    fit_d.pop("points")
    if why:
        fit_d["why_unusable"] = why
    return cost, fit_d


def _curve(reqs, block_size, usable, names, window, cost, fit, processes, plot, output, approximate, stream, stock,
           grid=None) -> None:
    from kmesh_trace.oracle.headroom_curve import headroom_curve
    from kmesh_trace.apps.plots import plot_headroom_curve

    with err.status("replaying") as status:
        res = headroom_curve(reqs, block_size, policies=names, window=window, num_usable_blocks=usable, cost=cost,
                             cost_fit=fit, processes=processes, progress=lambda what: status.update(f"replaying: {what}"),
                             stream=stream, stock_tokens=stock, grid=grid)
    d = _plot_and_notes(res, plot, plot_headroom_curve, approximate)
    if cost is None and fit is not None:  # fitted, but not usable: say so in the JSON too
        d["prefill_cost_fit"] = fit
    emit(output, d, rows=res.along_grid(), render=lambda: _render_curve(res, block_size, window, cost))


def _render_curve(res, block_size, window, cost) -> None:
    rows = res.along_grid()
    pols = list(res.curves)
    rt = Table(title=f"hit ratio by capacity ({block_size}-token blocks, window: {window}, "
                         f"{res.num_requests:,} requests)", title_justify="left")
    rt.add_column("capacity_blocks", justify="right", short="blocks")  # short: at 80 columns, with a legend
    for p in pols:
        rt.add_column(p, justify="right", short={"belady-prefix": "b-prefix"}.get(p))
    rt.add_column("headroom_tokens", justify="right", short="headroom")
    if cost is not None:
        rt.add_column("headroom_s", justify="right", short="hr_s")
    for row in rows:
        cells = [f"{row['capacity_blocks']:,}"] + [f"{row[p]['hit_ratio']:.4f}" for p in pols]
        cells.append(f"{row['headroom_tokens']:,}" if "headroom_tokens" in row else "")
        if cost is not None:
            cells.append(f"{row['headroom_seconds']:,.3f}" if "headroom_seconds" in row else "")
        rt.add_row(*cells)
    out.print(rt)
    inf_ratio = res.infinite_hit_blocks / res.num_reads if res.num_reads else 0.0
    ft = Table(title=f"capacity (blocks) reaching a share of the infinite cache's hit ratio ({inf_ratio:.4f})",
                   title_justify="left")
    ft.add_column("policy")
    for f in ("50%", "90%", "99%"):
        ft.add_column(f, justify="right")
    for p, row in res.capacity_for_fraction().items():
        exact = res.curves[p].exact
        ft.add_row(p + ("" if exact else " (grid, at most)"),
                   *[("-" if v is None else f"{v:,}") for v in row.values()])
    out.print(ft)
    if res.stock is not None:
        s = res.stock
        out.print(f"stock ({s['source']}) at {s['capacity_blocks']:,} blocks: {s['prefill_tokens']:,} prefill tokens")
    if res.ttft:
        tt = Table(title="estimated prefill seconds per request at the stock capacity (time to first token, "
                             "queueing excluded)", title_justify="left")
        tt.add_column("policy")
        for q in ("mean", "p50", "p90", "p99"):
            tt.add_column(q, justify="right")
        for p, qs in res.ttft.items():
            tt.add_row(p, *[f"{qs[q]:.4f}" for q in ("mean", "p50", "p90", "p99")])
        out.print(tt)


def _tasks(source, engine: str | None, ray: str):
    """headroom's `simulate`: one task per (policy, capacity) point, each reading `source` itself."""
    from kmesh_trace.distributed import Task
    from kmesh_trace.oracle.tasks import headroom_point

    where = f"engine={engine}" if engine else "the trace"
    return lambda points: run_tasks_with_progress(
        headroom_point, [Task(f"{where}: {p} at {c} blocks", (source, engine, p, c)) for p, c in points],
        ray=ray, label="headroom")
