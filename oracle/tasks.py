"""The analyses cut into independent pieces, as task functions for `kmesh_trace.distributed.run_tasks`.

Each function takes a *source*: a trace's location (a directory or a pyarrow filesystem URL), which a
Ray task reads itself (`kmesh_trace.parts`), or the already-loaded input, which the in-process path
passes so the trace is read once. A worker keeps the last input it read in memory, keyed by the exact
parts it came from (path, size, modification time), so the pieces of one sweep that land on one
worker read the trace once, and a rewritten trace is read again.

- `fleet_run`: one routing policy (or the global pool) at one fleet size and capacity;
- `headroom_points`: one engine's headroom policies at some capacities (a sweep point each);
- `pressure_point`: one engine's retention what-if at one capacity;
- `tiers_point`: one engine's requests through one tier configuration.
"""

from __future__ import annotations

from typing import Any, Callable

from kmesh_trace.oracle.fleet import FleetRun, FleetWorkload, fleet_workload, simulate_run

__all__ = ["fleet_run", "fleet_sweep", "headroom_point", "pressure_point", "tiers_point", "load_at"]

_LOADED: dict[tuple, tuple[tuple, Any]] = {}


def load_at(location: str, engines: tuple[str, ...] | None, what: str, build: Callable[[Any], Any]) -> Any:
    """`build(parts)` over the engine partitions `engines` (None: all) of the trace at `location`,
    reused while the parts are unchanged. One input stays cached per worker."""
    from kmesh_trace.parts import open_parts, parts_signature

    parts = open_parts(location, engines)
    key = (location, engines, what)
    signature = parts_signature(parts, ("invocations", "lineage"))
    hit = _LOADED.get(key)
    if hit is not None and hit[0] == signature:
        return hit[1]
    value = build(parts)
    _LOADED.clear()
    _LOADED[key] = (signature, value)
    return value


# ---- fleet ---------------------------------------------------------------------------------------


def _fleet_workload(source) -> FleetWorkload:
    return source if isinstance(source, FleetWorkload) else load_at(str(source), None, "fleet", fleet_workload)


def fleet_run(source, policy: str, num_engines: int, capacity_blocks: int, overload: float, edges: str) -> FleetRun:
    return simulate_run(_fleet_workload(source), policy, num_engines, capacity_blocks, overload=overload, edges=edges)


def fleet_sweep(source, engines: list[int], capacities: list[int], routings: list[str], *, overload: float,
                edges: str, ray: str | None = None, on_done=None, on_start=None):
    """Every routing at every (N, C), plus the global pools, as one task each; merged into a FleetResult.
    `source`: a location (Ray tasks read it) or a FleetWorkload (in process). `on_start(num_tasks)` is
    called once the tasks are known, `on_done(task)` as each completes."""
    from kmesh_trace.distributed import Task, run_tasks
    from kmesh_trace.oracle.fleet import GLOBAL, assemble, check_options, plan

    check_options(routings, engines, capacities, overload)
    runs = plan(engines, capacities, routings)
    if not isinstance(source, FleetWorkload):  # in process: read once here; on Ray: each task reads
        source = _fleet_workload(source) if ray is None else str(source)
    tasks = [Task(f"{p} with {n * c if p == GLOBAL else n} {'blocks' if p == GLOBAL else 'engines'}"
                  + ("" if p == GLOBAL else f" of {c} blocks"), (source, p, n, c, overload, edges)) for p, n, c in runs]
    if on_start is not None:
        on_start(len(tasks))
    return assemble(run_tasks(fleet_run, tasks, ray=ray, on_done=on_done), engines, capacities, routings, overload)


# ---- headroom and pressure, one engine partition ---------------------------------------------------


def headroom_point(source, engine: str | None, policy: str, capacity: int):
    """One policy at one capacity over one engine's requests (`source`: a location, or a Workload)."""
    from kmesh_trace.oracle.policies import POLICIES, Workload

    if not isinstance(source, Workload):
        source = load_at(str(source), None if engine is None else (engine,), "headroom",
                         lambda parts: _headroom_workload(parts, engine))
    return POLICIES[policy].simulate(source, capacity)


def _headroom_workload(parts, engine):
    from kmesh_trace.oracle.policies import Workload
    from kmesh_trace.oracle.stream import engine_geometry, request_blocks

    block_size, _ = engine_geometry(parts, engine)
    return Workload(block_size, request_blocks(parts, engine))


def pressure_point(source, engine: str | None, capacity: int, options: dict, whole: bool):
    """The retention what-if at one capacity over one engine's stream (`source`: a location, or a
    TraceStream, whose exact-prefix lineage serves `edges="inferred"`): the whole PressureResult when
    `whole`, else its SweepPoint. `options`: what_if's other keywords."""
    from kmesh_trace.oracle.pressure import TraceStream, sweep_point, trace_stream, what_if

    if not isinstance(source, TraceStream):
        source = load_at(str(source), None if engine is None else (engine,), "pressure",
                         lambda parts: trace_stream(parts, engine))
    r = what_if(source.requests, block_size=source.block_size, num_usable_blocks=capacity, lineage=source.lineage,
                **options)
    return r if whole else sweep_point(r)


def tiers_point(source, engine: str | None, config, options: dict):
    """One tier configuration over one engine's requests (`source`: a location, or the requests);
    `options`: simulate_tiers's other keywords (block size, KV bytes per token, costs, prefill)."""
    from kmesh_trace.oracle.stream import request_blocks
    from kmesh_trace.oracle.tiers import simulate_tiers

    if isinstance(source, str):
        source = load_at(source, None if engine is None else (engine,), "tiers",
                         lambda parts: request_blocks(parts, engine))
    return simulate_tiers(source, config, **options)
