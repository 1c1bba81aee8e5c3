"""`fleet`: route a trace's requests over N engines under each routing policy, against one global pool."""

from __future__ import annotations

from typing import Optional

import typer
from kmesh_trace.cli.display import Table

from kmesh_trace.cli.common import (
    CapacityBytesFlags,
    Output,
    RayOption,
    capacities_in_blocks,
    check_plot_option,
    emit,
    err,
    handles_errors,
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
from kmesh_trace.schema import FleetEdges
from kmesh_trace.values import finite_float


def register(app: typer.Typer) -> None:
    app.command("fleet")(fleet_cmd)


@flags
class FleetFlags:
    """`fleet`'s flags."""

    trace: str = typer.Argument(..., help="Trace directory, pyarrow filesystem URL (s3://bucket/trace) or a Mooncake/Bailian JSONL file or weka directory, read as it is, or an lmcache-agent directory, imported on the way in; "
                                          "every engine partition's requests are routed.")
    engines: Optional[str] = typer.Option(
        None, "--engines", help="Fleet sizes, comma-separated (default: the trace's engine partitions).")
    capacity_blocks: Optional[str] = typer.Option(
        None, "--capacity-blocks", help="Usable blocks per engine, comma-separated (default: the trace's).")
    sizes: CapacityBytesFlags = CapacityBytesFlags()
    routing: str = typer.Option(
        "round-robin,least-loaded,family,prefix-aware", "--routing",
        help="Routing policies, comma-separated, from: round-robin, least-loaded, family, prefix-aware.")
    edges: FleetEdges = typer.Option(
        FleetEdges.auto, "--edges", help="Families for `family` routing: declared lineage, inferred exact-prefix "
                                    "edges, or auto (declared when the trace declares any).")
    overload: float = typer.Option(
        1.25, "--overload", parser=finite_float(0, 1e6, lo_open=True), help="prefix-aware skips an engine whose load exceeds this multiple of the mean load (+1).")
    ray: RayOption = None
    plot: plot_option("Also write hit ratio by policy to FILE.png or FILE.svg.") = None

    def check(self) -> tuple[str, ...]:
        """The routing policies, once the flags are checked before any input is read."""
        from kmesh_trace.oracle.fleet import ROUTINGS

        routings = tuple(r.strip() for r in self.routing.split(",") if r.strip())
        if not routings:
            raise KmeshTraceError(f"--routing needs at least one policy from: {', '.join(ROUTINGS)}.")
        self.sizes.check_once(self.capacity_blocks)
        check_plot_option(self.plot, [self.trace, self.sizes.model_config])
        check_ray_option(self.ray)
        return routings

    def options(self, routings: tuple[str, ...], parts):
        """The analysis' options, capacities in bytes converted with the trace's KV geometry."""
        from kmesh_trace.oracle.fleet import FleetOptions

        ns = parse_ints(self.engines, "--engines") if self.engines is not None else None
        caps = parse_ints(self.capacity_blocks, "--capacity-blocks") if self.capacity_blocks is not None else None
        if self.sizes.capacity is not None:  # per engine, in bytes: converted with the trace's KV geometry
            from kmesh_trace.oracle.stream import check_block_size

            caps = capacities_in_blocks(self.sizes.capacity, check_block_size(parts.block_size), parts.metadata,
                                        self.sizes.kv_bytes, self.sizes.model_config)
        options = FleetOptions(ns and tuple(ns), caps and tuple(caps), routings, self.edges, self.overload)
        options.check(parts)
        return options


@handles_errors
@output_options(csv=True)
@takes_flags
def fleet_cmd(f: FleetFlags, output: Output = None) -> None:
    """Hit ratio, prefill tokens and load imbalance of each routing policy, and its gap to a global pool."""
    routings = f.check()
    from kmesh_trace.sources import read_directly

    parts = read_directly(f.trace, on_import=err.print) if f.ray is None else None  # in memory (never empty), not for Ray's tasks
    if parts is None:
        parts = _trace_parts(f.trace)
    result = _fleet(parts, f.options(routings, parts), f.ray)
    if result.num_requests == 0:
        raise KmeshTraceError(f"{f.trace} has no invocations; there are no requests to route.")
    if f.plot is not None:
        from kmesh_trace.apps.plots import plot_fleet

        plot_fleet(result, f.plot)
        err.print(f"wrote {f.plot}", markup=False, highlight=False, soft_wrap=True)
    emit(output, result.to_dict(), rows=result.rows(), render=lambda: render(result))


def _fleet(parts, options, ray: str | None):
    """The analysis, with a progress bar on its pieces (in this process or as Ray tasks)."""
    from kmesh_trace.oracle import fleet

    executor = InProcess() if ray is None else OnRay(ray)
    with progress_of(executor, "fleet", always=True):
        return fleet.run(parts, options, executor)


def _trace_parts(trace: str):
    """The trace's parts (metadata only: the tasks read them), a public trace imported first; refused when
    there is nothing to route."""
    from kmesh_trace.sources import trace_location
    from kmesh_trace.parts import open_parts

    parts = open_parts(trace_location(trace, on_import=err.print))
    if not parts.engines:
        raise KmeshTraceError(f"{trace} has no engine partitions; there are no requests to route.")
    if not parts.parts("invocations") and not parts.parts("block_events"):  # a KV-events recording has only events
        raise KmeshTraceError(f"{trace} has no requests (its invocations table is empty and it holds no block events); "
                              "there are no requests to route.")
    return parts


def render(result) -> None:
    """A `FleetResult` on the console: one table per (fleet size, capacity), its notes, the legend."""
    d = result.to_dict()
    out.print(f"fleet: {d['num_requests']:,} requests, {d['block_size']}-token blocks, load = {d['load']}"
              + (f", families {d['family_source']}" if d["family_source"] else ""))
    for p in d["points"]:
        rt = Table(title=f"{p['num_engines']:,} engines x {p['capacity_blocks']:,} blocks", title_justify="left")
        for h in ("policy", "hit_ratio", "prefill", "max/mean", "gap", "closed"):
            rt.add_column(h, justify="left" if h == "policy" else "right")
        for r in p["runs"]:
            imb, closed = r["load_imbalance"], r["gap_closed"]
            rt.add_row(r["policy"], f"{r['hit_ratio']:.4f}", f"{r['prefill_tokens']:,}",
                       "-" if imb is None else f"{imb:.2f}", f"{r['gap_tokens']:,}",
                       "-" if closed is None else f"{closed:.1%}")
        out.print(rt)
    for note in d["notes"]:
        err.print(f"note: {note}", markup=False, highlight=False)
    err.print("prefill: prompt tokens computed; max/mean: requests per engine; gap: prefill tokens beyond the global pool of engines x blocks; "
              "closed: the share of round-robin's gap a policy closes")
