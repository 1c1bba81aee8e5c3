"""The fleet what-if: N engines, each with its own vLLM block pool, behind a router, against one global pool.

It owns routing (docs/DESIGN.md "Fleet"). Every request of a trace, in arrival order, goes to one of N
engines, each a `PoolReplay` (the vLLM block-pool model of `kmesh_trace.oracle.blockpool`; on a hybrid
engine's trace a `HybridPoolReplay` of its KV cache groups, `kmesh_trace.oracle.hybrid_pool`) of C usable
blocks, fed one request at a time so the router sees each engine's cache and load as they are when
the request arrives. Routing is sequential within a run; runs (policy x N x C) are independent.

Routing policies:
- `round-robin`: request k goes to engine k mod N.
- `least-loaded`: the engine with the least load (ties: the lowest index).
- `family`: a request goes where its family's root went; a new family goes to the least-loaded
  engine. The family is the declared `family_id`, else the root of the declared parent chain, else
  (`edges="inferred"`, or `auto` on a trace that declares no lineage) the root of the inferred
  exact-prefix edges (`kmesh_trace.oracle.families.infer_exact_prefix_edges`).
- `prefix-aware`: the engine whose cache holds the longest prefix of the request's prompt blocks (what a
  lookup would hit now), among engines not overloaded (load <= overload x mean load + 1); ties go to
  the least-loaded, then the lowest index. It scores engines the way llm-d's precise prefix scorer
  and Dynamo's KV router do, by cached blocks, with load as the tie-break and the guard.
*Load* is an engine's running requests when every request has arrival and finish times (a timed
replay holds a request's blocks until it finishes), else the requests routed to it so far (a
sequential replay frees each request before the next, so nothing is ever running).

`global` is the reference: one pool of N x C usable blocks that serves every request (Mooncake's
global cache). Per run: hit blocks and tokens, hit ratio (hit blocks / listed prompt block reads, as
in `headroom`), prefill tokens, evictions, load imbalance (max / mean requests per engine) and the
gap to the global pool in prefill tokens; `gap_closed` is the share of round-robin's gap a policy
closes.

The global pool is not always ahead: it holds at least what every routing holds when it never evicts
(its hits are then every repeated prefix, the most any prefix cache can have) and equals the single
engine when N = 1; beyond that, splitting one LRU-like pool can happen to keep blocks a bigger shared
one drops.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.blockpool import PoolReplay, PoolResult, simulate_pool
from kmesh_trace.oracle.executor import Executor, InProcess, Task
from kmesh_trace.oracle.families import EDGE_MODES, families
from kmesh_trace.oracle.hybrid_mamba import hybrid_replay, simulate_hybrid
from kmesh_trace.oracle.options import option
from kmesh_trace.oracle.stream import RequestBlocks, pool_capacity
from kmesh_trace.oracle.tasks import workload_at
from kmesh_trace.oracle.workload import Workload, location_of
from kmesh_trace.resources import check_fits, fleet_bytes
from kmesh_trace.schema import FleetEdges

__all__ = ["DEFAULT_OVERLOAD", "EDGE_MODES", "GLOBAL", "ROUTINGS", "FleetPoint", "FleetResult", "FleetRun",
           "FleetOptions", "Routed", "families", "route", "run", "simulate_run", "sweep", "assemble", "check_options"]

ROUTINGS = ("round-robin", "least-loaded", "family", "prefix-aware")
GLOBAL = "global"
DEFAULT_OVERLOAD = 1.25


# ---------------------------------------------------------------------------------------------------
# One routed run
# ---------------------------------------------------------------------------------------------------


@dataclass
class Routed:
    """Which engine each request went to, and each engine's replay."""

    engine_of: list[int]
    pools: list[PoolResult]


# A router: (request position, request) -> engine.
_Choose = Callable[[int, RequestBlocks], int]


class _Fleet:
    def __init__(self, workload: Workload, num_engines: int, capacity_blocks: int):
        self.timed = workload.timed
        self.replays = [_replay(workload, capacity_blocks) for _ in range(num_engines)]
        self.routed = [0] * num_engines

    def loads(self) -> list[int]:
        return [r.num_running for r in self.replays] if self.timed else self.routed

    def least_loaded(self) -> int:
        loads = self.loads()
        return min(range(len(loads)), key=loads.__getitem__)


def _replay(workload: Workload, capacity_blocks: int):
    """One engine's step-by-step replay: the hybrid pool for a hybrid engine's workload (the groups are the
    trace's), else the single-group pool."""
    if workload.hybrid:
        return hybrid_replay([], workload.groups, capacity_blocks, workload.timed, workload.retention_interval)
    return PoolReplay([], workload.block_size, capacity_blocks, None, workload.timed)


def _round_robin(fleet: _Fleet, workload, overload, edges) -> _Choose:
    n = len(fleet.replays)
    return lambda i, r: i % n


def _least_loaded(fleet: _Fleet, workload, overload, edges) -> _Choose:
    return lambda i, r: fleet.least_loaded()


def _family(fleet: _Fleet, workload, overload, edges) -> _Choose:
    keys, _ = families(workload, edges)
    home: dict[str, int] = {}

    def choose(i: int, r: RequestBlocks) -> int:
        k = keys[i]
        e = home.get(k)
        if e is None:
            e = home[k] = fleet.least_loaded()
        return e

    return choose


def _prefix_aware(fleet: _Fleet, workload, overload, edges) -> _Choose:
    replays = fleet.replays

    def choose(i: int, r: RequestBlocks) -> int:
        loads = fleet.loads()
        bound = overload * sum(loads) / len(loads) + 1
        return min((e for e in range(len(replays)) if loads[e] <= bound),
                   key=lambda e: (-replays[e].cached_prefix_blocks(r), loads[e], e))

    return choose


_ROUTERS = {"round-robin": _round_robin, "least-loaded": _least_loaded, "family": _family,
            "prefix-aware": _prefix_aware}


def route(workload: Workload, routing: str, num_engines: int, capacity_blocks: int, *,
          overload: float = DEFAULT_OVERLOAD, edges: str = "auto") -> Routed:
    """Route every request of `workload` to one of `num_engines` pools of `capacity_blocks`."""
    check_options([routing], [num_engines], [capacity_blocks], overload)
    fleet = _Fleet(workload, num_engines, capacity_blocks)
    choose = _ROUTERS[routing](fleet, workload, overload, edges)
    stateful = fleet.timed and routing != "round-robin"
    engine_of = []
    for i, r in enumerate(workload.requests):
        if stateful:  # loads and caches as they are at this arrival (feeding one engine advances only it)
            for rep in fleet.replays:
                rep.advance(r.arrival_ns)
        e = choose(i, r)
        fleet.replays[e].feed(r)
        fleet.routed[e] += 1
        engine_of.append(e)
    return Routed(engine_of, [rep.close() for rep in fleet.replays])


# ---------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------


@dataclass
class FleetRun:
    """One policy (a routing, or `global`) at one fleet size and per-engine capacity."""

    policy: str
    num_engines: int
    capacity_blocks: int  # per engine; the global pool has num_engines x capacity_blocks
    block_size: int
    num_requests_per_engine: list[int]  # global: one pool
    hit_blocks: int
    hit_tokens: int
    prefill_tokens: int
    num_reads: int
    num_evictions: int
    num_not_admitted: int
    num_deferred: int
    timed: bool
    family_source: str | None = None  # family routing: declared or inferred

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.num_reads if self.num_reads else 0.0

    @property
    def load_imbalance(self) -> float | None:
        """max / mean requests per engine (None for the global pool)."""
        counts = self.num_requests_per_engine
        if self.policy == GLOBAL or not sum(counts):
            return None
        return max(counts) / (sum(counts) / self.num_engines)

    def to_dict(self) -> dict:
        return {"policy": self.policy, "num_engines": self.num_engines, "capacity_blocks": self.capacity_blocks,
                "hit_blocks": self.hit_blocks, "hit_tokens": self.hit_tokens, "prefill_tokens": self.prefill_tokens,
                "hit_ratio": self.hit_ratio, "load_imbalance": self.load_imbalance,
                "num_requests_per_engine": self.num_requests_per_engine, "num_evictions": self.num_evictions,
                "num_not_admitted": self.num_not_admitted, "num_deferred": self.num_deferred}


def simulate_run(workload: Workload, policy: str, num_engines: int, capacity_blocks: int, *,
                 overload: float = DEFAULT_OVERLOAD, edges: str = "auto") -> FleetRun:
    """One run: `policy` is a routing from ROUTINGS or `global`."""
    if policy == GLOBAL:
        check_options([], [num_engines], [capacity_blocks], overload)
        reqs = workload.requests
        if workload.hybrid:
            pools = [simulate_hybrid(list(reqs), workload.groups, num_usable_blocks=num_engines * capacity_blocks,
                                     timed=workload.timed, retention_interval=workload.retention_interval)]
        else:
            pools = [simulate_pool(list(reqs), block_size=workload.block_size,
                                   num_usable_blocks=num_engines * capacity_blocks, timed=workload.timed)]  # compiled
        counts = [len(reqs)]
    else:
        routed = route(workload, policy, num_engines, capacity_blocks, overload=overload, edges=edges)
        pools = routed.pools
        counts = [len(p.hit_blocks) for p in pools]
    return FleetRun(
        policy=policy, num_engines=num_engines, capacity_blocks=capacity_blocks, block_size=workload.block_size,
        num_requests_per_engine=counts, hit_blocks=sum(p.total_hit_blocks for p in pools),
        hit_tokens=sum(p.total_hit_tokens for p in pools), prefill_tokens=sum(p.prefill_tokens for p in pools),
        num_reads=sum(len(r.prompt_hashes) for r in workload.requests),
        num_evictions=sum(p.total_evictions for p in pools),
        num_not_admitted=sum(p.admitted.count(False) for p in pools),
        num_deferred=sum(p.num_deferred for p in pools), timed=workload.timed,
        family_source=families(workload, edges)[1] if policy == "family" else None,
    )


@dataclass
class FleetPoint:
    """Every policy at one (engines, capacity) point; `runs` ends with the global pool."""

    num_engines: int
    capacity_blocks: int
    runs: list[FleetRun]

    @property
    def global_run(self) -> FleetRun:
        return next(r for r in self.runs if r.policy == GLOBAL)

    def gap_tokens(self, run: FleetRun) -> int:
        """Prefill tokens `run` computes beyond the global pool."""
        return run.prefill_tokens - self.global_run.prefill_tokens

    def gap_closed(self, run: FleetRun) -> float | None:
        """The share of round-robin's gap to the global pool that `run` closes (None without round-robin
        or when round-robin has no gap)."""
        rr = next((r for r in self.runs if r.policy == "round-robin"), None)
        if rr is None or self.gap_tokens(rr) <= 0:
            return None
        return (rr.prefill_tokens - run.prefill_tokens) / self.gap_tokens(rr)

    def to_dict(self) -> dict:
        return {"num_engines": self.num_engines, "capacity_blocks": self.capacity_blocks,
                "runs": [{**r.to_dict(), "gap_tokens": self.gap_tokens(r), "gap_closed": self.gap_closed(r)}
                         for r in self.runs]}


@dataclass
class FleetResult:
    block_size: int
    num_requests: int
    timed: bool
    overload: float
    family_source: str | None
    points: list[FleetPoint]

    @property
    def notes(self) -> list[str]:
        """What a reader must know to read the rows: untimed, least-loaded has no load signal."""
        policies = {r.policy for p in self.points for r in p.runs}
        if self.timed or "least-loaded" not in policies:
            return []
        return ["least-loaded has no load signal here: without arrival and finish times on every request nothing "
                "is ever running, so its load is the requests routed so far and it routes exactly as round-robin "
                "(identical rows)."]

    def to_dict(self) -> dict:
        return {"block_size": self.block_size, "num_requests": self.num_requests, "timed": self.timed,
                "load": "running requests" if self.timed else "requests routed so far",
                "overload": self.overload, "family_source": self.family_source,
                "points": [p.to_dict() for p in self.points], "notes": self.notes}

    def rows(self) -> list[dict]:
        """One row per run at each point: the table and the CSV."""
        return [{"num_engines": p["num_engines"], "capacity_blocks": p["capacity_blocks"], **run}
                for p in self.to_dict()["points"] for run in p["runs"]]


def check_options(routings: Sequence[str], engines: Sequence[int], capacities: Sequence[int],
                  overload: float) -> None:
    for name in routings:
        if name not in _ROUTERS:
            raise KmeshTraceError(f"unknown routing {name!r}; the routings are {', '.join(ROUTINGS)}.")
    if any(n <= 0 for n in engines):
        raise KmeshTraceError("--engines must be positive engine counts.")
    if any(c <= 0 for c in capacities):
        raise KmeshTraceError("--capacity-blocks must be positive block counts.")
    if not overload >= 1:
        raise KmeshTraceError(f"--overload must be at least 1 (a multiple of the mean load); got {overload}.")


def plan(engines: Sequence[int], capacities: Sequence[int], routings: Sequence[str]) -> list[tuple[str, int, int]]:
    """The runs of a sweep, (policy, N, C): every routing at every point, then one global pool per
    distinct total N x C (points with the same total share it)."""
    runs = [(p, n, c) for n in engines for c in capacities for p in routings]
    totals: dict[int, tuple[int, int]] = {}
    for n in engines:
        for c in capacities:
            totals.setdefault(n * c, (n, c))
    return runs + [(GLOBAL, n, c) for n, c in totals.values()]


def assemble(runs: Sequence[FleetRun], engines: Sequence[int], capacities: Sequence[int],
             routings: Sequence[str], overload: float) -> FleetResult:
    """The sweep's result from the runs of `plan` (in any order)."""
    by_key = {(r.policy, r.num_engines, r.capacity_blocks): r for r in runs}
    by_total = {r.num_engines * r.capacity_blocks: r for r in runs if r.policy == GLOBAL}
    points = []
    for n in engines:
        for c in capacities:
            point_runs = [by_key[(p, n, c)] for p in routings]
            point_runs.append(replace(by_total[n * c], num_engines=n, capacity_blocks=c))
            points.append(FleetPoint(n, c, point_runs))
    first = runs[0]
    family = next((r.family_source for r in runs if r.family_source is not None), None)
    return FleetResult(first.block_size, sum(first.num_requests_per_engine), first.timed, overload, family, points)


# ---------------------------------------------------------------------------------------------------
# One run of the analysis, as `kmesh-trace fleet` and the report's section run it
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FleetOptions:
    """What `kmesh-trace fleet` is asked (its flags name the fields; `kmesh_trace.oracle.options`)."""

    engines: tuple[int, ...] | None = option("--engines")  # None: the trace's engine partitions
    capacities: tuple[int, ...] | None = option("--capacity-blocks")  # None: the engines' usable blocks
    routings: tuple[str, ...] = option("--routing", ROUTINGS)
    edges: FleetEdges = option("--edges", FleetEdges.auto)
    overload: float = option("--overload", DEFAULT_OVERLOAD)

    def resolved(self, source) -> tuple[list[int], list[int]]:
        """(fleet sizes, capacities): the options', else the trace's engines and their one pool size."""
        ns = list(self.engines) if self.engines is not None else [len(source.engines)]
        if self.capacities is not None:
            return ns, list(self.capacities)
        usable = {m.get("num_usable_blocks") for m in source.engines.values()}
        if len(usable) > 1:
            raise KmeshTraceError(f"the trace's engines have different pools ({', '.join(map(str, sorted(usable, key=str)))} "
                                  "usable blocks); pass --capacity-blocks N.")
        return ns, [pool_capacity(None, usable.pop())]

    def check(self, source) -> tuple[list[int], list[int]]:
        """The resolved (fleet sizes, capacities), refused before any work when invalid or too large for memory."""
        ns, caps = self.resolved(source)
        check_options(self.routings, ns, caps, self.overload)
        given = (("--engines", self.engines), ("--capacity-blocks", self.capacities))
        flags = " x ".join(f for f, v in given if v is not None)
        check_fits(max(fleet_bytes(n, c) for n in ns for c in caps), flags or "--engines",
                   "engine pools (and a global pool of engines x blocks)")
        return ns, caps


def run(source, options: FleetOptions, executor: Executor | None = None) -> FleetResult:
    """Every routing of `options` at every (N, C), plus the global pools, over every engine partition of
    `source` (a `TraceSource`): read once here, or on a remote executor by each task from its location."""
    executor = executor or InProcess()
    ns, caps = options.check(source)
    workload = location_of(source) if executor.remote else Workload.from_trace(source, merged=True)
    return sweep(workload, ns, caps, list(options.routings), overload=options.overload,
                 edges=FleetEdges(options.edges).value, executor=executor)


def fleet_run(source, policy: str, num_engines: int, capacity_blocks: int, overload: float, edges: str) -> FleetRun:
    """The task of one routing policy (or the global pool) at one fleet size and capacity (`source`: a
    location, or a Workload: `oracle.tasks.workload_at`)."""
    return simulate_run(workload_at(source, merged=True), policy, num_engines, capacity_blocks, overload=overload,
                        edges=edges)


def sweep(source, engines: list[int], capacities: list[int], routings: list[str], *, overload: float,
          edges: str, executor: Executor | None = None) -> FleetResult:
    """Every routing at every (N, C), plus the global pools, as one task each on `executor` (default: here);
    merged into a FleetResult. `source`: a Workload, or a location that each task reads."""
    check_options(routings, engines, capacities, overload)
    runs = plan(engines, capacities, routings)
    tasks = [Task(f"{p} with {n * c if p == GLOBAL else n} {'blocks' if p == GLOBAL else 'engines'}"
                  + ("" if p == GLOBAL else f" of {c} blocks"), (source, p, n, c, overload, edges)) for p, n, c in runs]
    return assemble((executor or InProcess()).map(fleet_run, tasks), engines, capacities, routings, overload)
