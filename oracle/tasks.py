"""The analyses cut into independent pieces, as task functions an `Executor` (kmesh_trace.oracle.executor) runs.

Each function takes a *source*: a trace's location (a directory or a pyarrow filesystem URL), which a
Ray task reads itself (`kmesh_trace.parts`), or the loaded `Workload`, which the in-process path
passes so the trace is read once (`workload_at` tells them apart; `task_source` picks what to send).
A worker keeps the last input it read in memory, keyed by the exact parts it came from (path, size,
modification time), so the pieces of one sweep that land on one worker read the trace once, and a
rewritten trace is read again.

- `fleet_run`: one routing policy (or the global pool) at one fleet size and capacity;
- `headroom_point`: one policy at one capacity over one engine's requests;
- `pressure_point`: one engine's retention what-if at one capacity;
- `tiers_point`: one engine's requests through one tier configuration.
"""

from __future__ import annotations

from typing import Any, Callable

from kmesh_trace.oracle.fleet import FleetRun, simulate_run

__all__ = ["fleet_run", "headroom_point", "pressure_point", "tiers_point", "load_at", "stream_at", "task_source",
           "workload_at"]

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


def workload_at(source, engine: str | None = None, *, merged: bool = False):
    """`source` itself when it is a loaded Workload (in process), else the workload of the trace at the
    location `source` (a Ray task), read once per worker while its parts are unchanged."""
    from kmesh_trace.oracle.workload import Workload

    if isinstance(source, Workload):
        return source
    engines = None if engine is None else (engine,)
    return load_at(str(source), engines, "merged" if merged else "one",
                   lambda parts: Workload.from_trace(parts, None if merged else engine, merged=merged))


def stream_at(source, engine: str | None = None):
    """The access stream of `source` (a loaded Workload, or a trace location read once per worker as
    `workload_at` reads it, but without a RequestBlocks per invocation where the trace lets: the columns
    flattened, as the curves' own workload is built)."""
    from kmesh_trace.oracle.workload import Workload

    if isinstance(source, Workload):
        return source.stream
    engines = None if engine is None else (engine,)
    return load_at(str(source), engines, "stream",
                   lambda parts: Workload.from_trace(parts, engine, requests=False)).stream


def task_source(workload, executor):
    """What a task is given to read: the trace's location on a remote executor, else the workload."""
    return workload.location if executor.remote and workload.location is not None else workload


# ---- fleet ---------------------------------------------------------------------------------------


def fleet_run(source, policy: str, num_engines: int, capacity_blocks: int, overload: float, edges: str) -> FleetRun:
    return simulate_run(workload_at(source, merged=True), policy, num_engines, capacity_blocks, overload=overload,
                        edges=edges)


# ---- headroom and pressure, one engine partition ---------------------------------------------------


def headroom_point(source, engine: str | None, policy: str, capacity: int):
    """One policy at one capacity over one engine's requests (`source`: a location, or a Workload); on a
    hybrid engine's trace as `policies.replay_point` replays it."""
    from kmesh_trace.oracle.policies import replay_point

    return replay_point(workload_at(source, engine), policy, capacity)


def pressure_point(source, engine: str | None, capacity: int, options: dict, whole: bool):
    """The retention what-if at one capacity over one engine's requests (`source`: a location, or a
    Workload, whose lineage edges of the kind `options["edges"]` reads serve it): the whole PressureResult
    when `whole`, else its SweepPoint. `options`: what_if's other keywords."""
    from kmesh_trace.oracle.pressure import lineage_for, sweep_point, what_if

    w = workload_at(source, engine)
    r = what_if(w.requests, block_size=w.block_size, num_usable_blocks=capacity,
                lineage=lineage_for(w, options["edges"]), **options)
    return r if whole else sweep_point(r)


def tiers_point(source, engine: str | None, config, options: dict):
    """One tier configuration over one engine's requests (`source`: a location, or the requests);
    `options`: simulate_tiers's other keywords (block size, KV bytes per token, costs, prefill)."""
    from kmesh_trace.oracle.tiers import simulate_tiers

    if isinstance(source, str):
        source = workload_at(source, engine).requests
    return simulate_tiers(source, config, **options)
