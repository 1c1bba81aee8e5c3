"""What a task function an `Executor` (kmesh_trace.oracle.executor) runs reads: its workload.

The analyses cut themselves into independent pieces, each a task function of their own module
(`fleet.fleet_run`, `headroom.headroom_point`, `pressure.pressure_point`, `tiers.run.tiers_point`). Each
takes a *source*: a trace's location (a directory or a pyarrow filesystem URL), which a
Ray task reads itself (`kmesh_trace.parts`), or the loaded `Workload`, which the in-process path
passes so the trace is read once (`workload_at` tells them apart; `task_source` picks what to send).
A worker keeps the last input it read in memory, keyed by the exact parts it came from (path, size,
modification time), so the pieces of one sweep that land on one worker read the trace once, and a
rewritten trace is read again.
"""

from __future__ import annotations

from typing import Any, Callable

from kmesh_trace.oracle.workload import Workload

__all__ = ["load_at", "stream_at", "task_source", "workload_at"]

_LOADED: dict[tuple, tuple[tuple, Any]] = {}


def load_at(location: str, engines: tuple[str, ...] | None, what: str, build: Callable[[Any], Any]) -> Any:
    """`build(parts)` over the engine partitions `engines` (None: all) of the trace at `location`,
    reused while the parts are unchanged. One input stays cached per worker."""
    from kmesh_trace.parts import open_parts, parts_signature  # deferred: it loads pyarrow and polars

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
    if isinstance(source, Workload):
        return source
    engines = None if engine is None else (engine,)
    return load_at(str(source), engines, "merged" if merged else "one",
                   lambda parts: Workload.from_trace(parts, None if merged else engine, merged=merged))


def stream_at(source, engine: str | None = None):
    """The access stream of `source` (a loaded Workload, or a trace location read once per worker as
    `workload_at` reads it, but without a RequestBlocks per invocation where the trace lets: the columns
    flattened, as the curves' own workload is built)."""
    if isinstance(source, Workload):
        return source.stream
    engines = None if engine is None else (engine,)
    return load_at(str(source), engines, "stream",
                   lambda parts: Workload.from_trace(parts, engine, requests=False)).stream


def task_source(workload, executor):
    """What a task is given to read: the trace's location on a remote executor, else the workload."""
    return workload.location if executor.remote and workload.location is not None else workload
