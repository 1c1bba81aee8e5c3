"""`headroom`: stock prefix-cache hits against LRU, the vLLM pool model and the Belady bracket, at given
capacities or (`--curve`, the default without --capacity-blocks) along the whole capacity axis."""

from __future__ import annotations

import textwrap
from dataclasses import replace
from enum import Enum
from pathlib import Path
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
    RequestDatasetFlags,
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
from kmesh_trace.oracle.executor import executor_for
from kmesh_trace.values import MAX_FACTOR, MAX_TOKENS_PER_S, bounded_int, finite_float


class Window(str, Enum):
    all = "all"
    last_half = "last-half"


class SampleCorrection(str, Enum):
    ratio = "ratio"
    adj = "adj"
    none = "none"


def register(app: typer.Typer) -> None:
    app.command("headroom")(headroom_cmd)


@flags
class HeadroomFlags:
    """`headroom`'s flags."""

    trace: TraceOrScenarioArgument = None
    capacity_blocks: CapacityOption = None
    sizes: CapacityBytesFlags = CapacityBytesFlags()
    policies: Optional[str] = typer.Option(
        None, "--policies", help="Policies, comma-separated, from: infinite, lru, vllm, belady, belady-prefix (default: all).")
    curve: bool = typer.Option(
        False, "--curve", help="Every capacity: lru and belady exact from one pass each, vllm and belady-prefix on a grid "
                               "(the default when no --capacity-blocks is given).")
    window: Window = typer.Option(Window.all, "--window", help="Requests counted in a curve: all, or the last half "
                                  "(the first half warms the cache); with --capacity-blocks, the curve at those "
                                  "capacities.")
    tokens_per_s: Optional[float] = typer.Option(
        None, "--prefill-tokens-per-s", parser=finite_float(0, MAX_TOKENS_PER_S, lo_open=True), help="Prefill throughput at position 0, for seconds (default: fitted to a "
                                             "capture's measured prefills).")
    attention_factor: float = typer.Option(
        0.0, "--attention-factor", parser=finite_float(0, MAX_FACTOR), help="With --prefill-tokens-per-s: extra cost of a token per earlier position, as a "
                                        "fraction of its position-0 cost.")
    processes: Optional[int] = typer.Option(None, "--processes", parser=bounded_int(1, 4096), help="Worker processes for grid replays "
                                            "(threads for a policy whose kernel is C; default: the cores).")
    scenario: ScenarioOption = None
    engine: EngineOption = None
    allow_incomplete: AllowIncompleteOption = False
    plot: plot_option("Also write hit ratio against capacity to FILE.png or FILE.svg.") = None
    sample: Optional[float] = typer.Option(
        None, "--sample", parser=finite_float(0, 1, lo_open=True), help="Curve from a spatial sample of the block "
        "ids at RATE (SHARDS; e.g. 0.01), labelled with its measured error; 1: exact (also above the memory budget).")
    partitions: Optional[int] = typer.Option(
        None, "--partitions", parser=bounded_int(1, 4096), help="Curve from K partitions of the block ids, each a "
        "cache of C / K, merged (Ray tasks with --ray): exact for the infinite cache, error-bounded below.")
    memory_budget: Optional[float] = typer.Option(
        None, "--memory-budget", parser=finite_float(0, 2**20, lo_open=True), help="GiB the exact curves may take beyond "
        "the stream; above it the curve is sampled, and says so (default: half the memory available).")
    sample_memory: Optional[str] = typer.Option(
        None, "--sample-memory", help="Curve from a fixed-size sample within SIZE (512MiB, 2GB; a plain number: MiB): "
        "the sampling rate (--sample, default 1) falls as the sample fills.")
    sample_correction: SampleCorrection = typer.Option(
        SampleCorrection.ratio, "--sample-correction", help="How a sample's hits scale to the stream's: ratio (the stream's counted "
        "reads over the sample's), adj (SHARDS-adj) or none (1 / rate).")
    ray: RayOption = None
    dataset: RequestDatasetFlags = RequestDatasetFlags()

    def options(self):
        """The analysis' options (capacities in bytes are converted once the input is open), checked with the
        flags' own rules first: one input, capacities given once, a writable --plot, a usable --ray."""
        from kmesh_trace.oracle.headroom import HeadroomOptions

        caps = parse_ints(self.capacity_blocks, "--capacity-blocks") if self.capacity_blocks is not None else None
        names = tuple(p.strip() for p in self.policies.split(",") if p.strip()) if self.policies else None
        if (self.trace is None) == (self.scenario is None):
            raise KmeshTraceError("give either a TRACE directory or --scenario, not both and not neither.")
        self.sizes.check_once(self.capacity_blocks)
        self.dataset.import_options(self.trace)  # --tokenizer on any other input: refused before anything is read
        if self.curve and self.sizes.capacity is not None:  # capacities in bytes: known once the trace is open
            raise KmeshTraceError("--curve covers every capacity; drop --capacity (or --curve).")
        options = HeadroomOptions(None if caps is None else tuple(caps), names, self.curve, self.window.value,
                                  self.tokens_per_s, self.attention_factor, self.sample, self.partitions, self.memory_budget,
                                  _mib(self.sample_memory), self.sample_correction.value)
        check_plot_option(self.plot, [self.trace, self.sizes.model_config])  # before the replays, not after them
        check_ray_option(self.ray)
        options.check()
        return options


def _mib(text: str | None) -> float | None:
    """--sample-memory in MiB: a plain number is MiB, else a size with a unit."""
    if text is None:
        return None
    try:
        mib = float(text)
    except ValueError:
        from kmesh_trace.cli.core import parse_bytes

        return parse_bytes(text, "--sample-memory") / 2**20
    if not (1 <= mib <= 2**40):
        raise KmeshTraceError(f"--sample-memory must be at least 1 MiB such as 512MiB or 2GB (got {text!r}).")
    return mib


@handles_errors
@output_options(csv=True)
@takes_flags
def headroom_cmd(f: HeadroomFlags, output: Output = None) -> None:
    """Prefill tokens (and seconds) the stock cache failed to reuse that an ideal cache of the same capacity
    would have: at the given capacities, or along the whole capacity axis."""
    options = f.options()
    executor = executor_for(f.processes, f.ray)
    res = _at_read(f, options) or _on_disk(f, options, executor) or _in_memory(f, options, executor)
    if f.plot is not None:
        from kmesh_trace.apps.plots import plot_headroom, plot_headroom_curve
        from kmesh_trace.oracle.headroom_curve import CurveResult

        (plot_headroom_curve if isinstance(res, CurveResult) else plot_headroom)(res, f.plot)
        err.print(f"wrote {f.plot}", markup=False, highlight=False, soft_wrap=True)
    for line in res.notes:
        err.print(f"note: {line}")
    emit(output, res.to_dict(), rows=res.rows(), render=lambda: render(res))


def _on_disk(f: HeadroomFlags, options, executor):
    """The curve of a Mooncake file or an imported trace too long to hold in memory, or long enough for the disk
    path to cost about the same time and less memory, its stream built on disk (a status line on stderr); None
    when the input is not one (`oracle.streamed_curve.choose_path`), or when that path cannot read it (the
    in-memory path reads it then, and a note says why) unless the exact curve was asked for and memory cannot
    hold it."""
    from kmesh_trace.oracle.streamed_curve import TOO_LARGE, Unstreamable, choose_path

    if f.scenario is not None or f.sizes.capacity is not None or f.engine is not None:
        return None
    why = choose_path(f.trace, options, remote=f.ray is not None)
    if why is None:
        return None
    try:
        if Path(f.trace).is_dir():
            with open_input(f.trace, None, None, f.allow_incomplete) as (t, _):
                fitted = None if options.tokens_per_s is not None else _fitted(t, None)
                return _streamed(t, options, executor, why, fitted, approximate_tokens_note(t))
        return _streamed(f.trace, options, executor, why, None, None)
    except Unstreamable as e:
        if why is TOO_LARGE and options.sample == 1:
            raise
        err.print(f"note: the bounded-memory path stopped ({e}); the in-memory path reads the input instead.",
                  markup=False, highlight=False)
        return None


def _at_read(f: HeadroomFlags, options):
    """The curve of a Mooncake file or an imported trace from a sample taken while it is read
    (`oracle.shards.at_read_plan` says when); None otherwise, or when that path cannot read the input (the
    in-memory path reads it then and samples after, and a note says why)."""
    from kmesh_trace.oracle.shards import at_read_plan, run_at_read
    from kmesh_trace.oracle.stream_pieces import Unstreamable

    if f.scenario is not None or f.sizes.capacity is not None or f.engine is not None:
        return None
    plan = at_read_plan(f.trace, options, remote=f.ray is not None)
    if plan is None:
        return None
    try:
        with err.status("replaying: sampling while reading"):
            if Path(f.trace).is_dir():
                from kmesh_trace.oracle.stream import engine_geometry

                with open_input(f.trace, None, None, f.allow_incomplete) as (t, _):
                    return run_at_read(t, engine_geometry(t)[0], options, plan, approximate_tokens_note(t))
            from kmesh_trace.datasets.importers.mooncake import engine_metadata

            return run_at_read(f.trace, engine_metadata(Path(f.trace))["block_size"], options, plan)
    except Unstreamable as e:
        err.print(f"note: the sample at read time stopped ({e}); the in-memory path reads the input and samples it "
                  "instead.", markup=False, highlight=False)
        return None


def _streamed(source, options, executor, why, fitted, note):
    from kmesh_trace.oracle.streamed_curve import streamed_run

    with err.status("replaying") as status:
        return streamed_run(source, options, executor, why=why, fitted=fitted, note=note,
                            progress=lambda what: status.update(f"replaying: {what}"))


def _in_memory(f: HeadroomFlags, options, executor):
    """The analysis of the input read into memory (or, with --ray, read by the tasks)."""
    w, options, fitted, note = _workload(f, options)
    options.check_executor(executor)
    return _headroom(w, options, executor, fitted, note)


def _workload(f: HeadroomFlags, options):
    """(the workload, the options with --capacity in blocks, the fitted prefill cost, the approximate-token note)
    of the input the flags name; the input is closed after: what the replays read is in the workload."""
    from kmesh_trace.oracle.workload import Workload

    with open_input(f.trace, f.scenario, f.engine, f.allow_incomplete, direct=f.ray is None,  # Ray tasks read a trace
                    import_options=f.dataset.import_options(f.trace)) as (t, w):
        if f.sizes.capacity is not None:
            options = replace(options, capacities=f.sizes.in_blocks(t, w, f.engine))
        w = w or Workload.from_trace(t, f.engine, requests=options.needs_requests)  # its refusals come first
        fitted = None if t is None or options.tokens_per_s is not None else _fitted(t, f.engine)
        note = approximate_tokens_note(t) if t is not None else None
    return w, options, fitted, note


def _headroom(w, options, executor, fitted, note):
    """The analysis: a curve along the capacity axis (a status line on stderr), or the given capacities."""
    from kmesh_trace.oracle import headroom as hr

    if options.wants_curve:
        with err.status("replaying") as status:
            return hr.run(w, options, executor, fitted=fitted, note=note,
                          progress=lambda what: status.update(f"replaying: {what}"))
    with progress_of(executor, "headroom"):
        return hr.run(w, options, executor, fitted=fitted, note=note)


def render(res) -> None:
    """A headroom result on the console: its curve (`CurveResult`), or its given capacities (`HeadroomResult`)."""
    from kmesh_trace.oracle.headroom_curve import CurveResult

    (render_curve if isinstance(res, CurveResult) else render_capacities)(res)


#: What a hit ratio in headroom's tables counts (`advise` and the stock line give token ratios).
BLOCK_RATIO = "(hit ratio: hit blocks / prompt blocks looked up, a block ratio)"


def render_capacities(res) -> None:
    """A `HeadroomResult`: each policy at each given capacity, the headroom, the bracket."""
    d = res.to_dict()
    rt = Table(title=f"headroom ({d['block_size']}-token blocks)", caption=BLOCK_RATIO, title_justify="left")
    for h in ("policy", "capacity", "hit_blocks", "hit_tokens", "prefill", "hit_ratio"):
        rt.add_column(h, justify="left" if h == "policy" else "right")
    for r in d["results"]:
        rt.add_row(r["policy"], f"{r['capacity_blocks']:,}", f"{r['hit_blocks']:,}", f"{r['hit_tokens']:,}",
                   f"{r['prefill_tokens']:,}", f"{r['hit_ratio']:.4f}")
    out.print(rt)
    for r in d["results"]:
        if r["policy"] == "stock" and r["hit_tokens"] + r["prefill_tokens"]:
            share = r["hit_tokens"] / (r["hit_tokens"] + r["prefill_tokens"])
            prose(f"stock reuses {share:.1%} of prompt tokens (hit_tokens / prompt tokens: the figure `advise` "
                  f"gives), against a block hit_ratio of {r['hit_ratio']:.4f}")
    if d["headroom_tokens"] is not None:
        secs = f" = {d['headroom_seconds']:,.3f} prefill seconds" if "headroom_seconds" in d else ""
        out.print(f"headroom: {d['headroom_tokens']:,} prefill tokens{secs} at {d['headroom_capacity_blocks']:,} blocks "
                  f"(stock from {d['stock_source']} minus belady)")
    if "bracket" in d:
        b = d["bracket"]
        out.print(f"bracket: belady-prefix {b['belady_prefix_prefill_tokens']:,} .. belady {b['belady_prefill_tokens']:,} "
                  f"prefill tokens (width {b['width_tokens']:,}{', wide' if b['wide'] else ''})")


def _fitted(trace, engine):
    """The prefill cost fitted to a capture's measured prefills (`oracle.headroom.fitted_prefill`), said on
    stderr: the fit's quality, and why there are no seconds when it is not usable."""
    from kmesh_trace.sources import PublicInput
    from kmesh_trace.oracle.headroom import FittedPrefill, fitted_prefill

    if isinstance(trace, PublicInput):  # read as it is: no prefill timings, as its import would have none
        return FittedPrefill(None, None, "an import has no prefill timings; give --prefill-tokens-per-s for seconds")
    fitted = fitted_prefill(trace, engine)
    fit, why = fitted.fit, fitted.why
    if fit is not None:
        err.print(f"prefill cost fitted to {fit.n} measured prefills: r2 {fit.r2:.3f}, median relative error "
                  f"{fit.median_relative_error:.1%}", markup=False, highlight=False)
    if why and not str(trace.metadata.get("source", "")).startswith("import"):
        err.print(f"note: {why}", markup=False, highlight=False)
    return fitted


def sampled_label(sampling: dict) -> list[str]:
    """The lines that say a curve is sampled, how, and its error: measured at its rate on the benchmark's
    stream, and on this stream at the infinite cache (the one capacity known exactly here)."""
    if sampling["method"] == "partitions":
        how = f"merged from {sampling['partitions']} partitions of the block ids, each a cache of C / {sampling['partitions']}"
    else:
        how = (f"sampled: {sampling['rate']:.3g} of the block ids (SHARDS; {sampling['num_sampled_accesses']:,} of "
               f"{sampling['num_accesses']:,} accesses)")
    bound = sampling.get("error_bound")
    if bound is None:
        err_line = "error: not measured at this setting (benchmarks/sampled_curve_bench.py measures it)"
    else:
        at = f"rate {bound['rate']:g}" if "rate" in bound else f"{bound['partitions']} partitions"
        err_line = (f"error: max |delta hit ratio| measured at {at}: lru {bound['lru']:.4f}, belady "
                    f"{bound['belady']:.4f}, belady-prefix {bound['belady-prefix']:.4f}, on {bound['stream']}")
    inf = sampling["infinite_check"]
    if sampling.get("taken") == "at read":
        how += ", taken while the input was read"
    if "max_sampled_accesses" in sampling:
        how += (f"; fixed size: at most {sampling['max_sampled_accesses']:,} accesses, the rate fallen from "
                f"{sampling['rate_asked']:.3g}")
    if inf["exact_hit_ratio"] is None:
        check = (f"infinite cache here: {inf['sampled_hit_ratio']:.4f} from the sample (taken while reading: the "
                 "exact one is not known)")
    else:
        check = (f"infinite cache here: {inf['sampled_hit_ratio']:.4f} against {inf['exact_hit_ratio']:.4f} exact "
                 f"(delta {inf['delta']:+.4f})")
    lines = [how, err_line, check]
    if "why" in sampling:
        lines.insert(0, sampling["why"])
    return [part for line in lines for part in textwrap.wrap(line, 80, subsequent_indent="  ")]  # 80 columns


def render_curve(res) -> None:
    """A `CurveResult`: hit ratio by capacity, the capacities reaching a share of the infinite cache, the stock,
    the estimated prefill seconds."""
    block_size, window, cost = res.block_size, res.window, res.cost
    rows = res.along_grid()
    pols = list(res.curves)
    if res.sampling is not None:
        for line in sampled_label(res.sampling):
            out.print(line, markup=False, highlight=False)
    kind = "" if res.sampling is None else ("SAMPLED " if res.sampling["method"] == "shards" else "MERGED ")
    rt = Table(title=f"{kind}block hit ratio by capacity ({block_size}-token blocks, window: {window}, "
                     f"{res.num_requests:,} requests)", caption=BLOCK_RATIO, title_justify="left")
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
        total = s["hit_tokens"] + s["prefill_tokens"]
        share = f" ({s['hit_tokens'] / total:.1%} of prompt tokens hit: the token ratio `advise` gives)" if total else ""
        prose(f"stock ({s['source']}) at {s['capacity_blocks']:,} blocks: {s['prefill_tokens']:,} prefill tokens{share}")
    if res.ttft:
        tt = Table(title="estimated prefill seconds per request at the stock capacity (time to first token, "
                             "queueing excluded)", title_justify="left")
        tt.add_column("policy")
        for q in ("mean", "p50", "p90", "p99"):
            tt.add_column(q, justify="right")
        for p, qs in res.ttft.items():
            tt.add_row(p, *[f"{qs[q]:.4f}" for q in ("mean", "p50", "p90", "p99")])
        out.print(tt)


