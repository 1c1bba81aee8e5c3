"""Retention pressure: what holding a family's ancestor in the engine saves, and what it displaces.

It owns the family-hold what-if (docs/DESIGN.md, "Family hold" and "Tradeoff"): the same access stream replayed
twice through the vLLM block-pool model (`kmesh_trace.oracle.blockpool`), `stock` and `held` (family
holds per `HoldPolicy`), and the tradeoff between them. A *child* is a request with a parent edge;
every other request (parents included) is *other*. Per request, held hits minus stock hits:
`saved_child_tokens` sums it over children, `displaced_hit_tokens` sums its negation over the others,
and `net_cached_tokens` = saved - displaced = all held hits - all stock hits.

Words as `lineage` uses them: a hold is taken per *parent* (`holds`, one row each); a *family* is a
declared family id, else the tree of edges under one root (`num_families`; `oracle/families.py` names them).

Edges: `declared` uses each request's `parent_index` (and `num_expected_children` when declared: a
hold is released after that many child admissions, else after all the children the edges list);
`inferred` uses exact-prefix edges given as `lineage` (child index -> parent index, e.g. the trace's
lineage rows with edge_kind 'exact_prefix') or, when none are given, infers them from block hashes
(`infer_exact_prefix_edges`); `content` uses the trace's content edges given as `lineage` (an importer's
guess from text, e.g. `import lmcache-agent`; `Workload.lineage("content")` holds them).

To predict a captured run: `res = what_if_trace("TRACE_DIR")` (the trace's block size, usable blocks,
times and declared lineage); `res.stock.hit_tokens` / `res.held.hit_tokens` are the per-request hit
tokens of each arm, in arrival order (`res.request_ids`), `res.to_dict()` the JSON of `kmesh-trace pressure`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kmesh_trace.errors import KmeshTraceError, NeedsParameterError
from kmesh_trace.oracle.blockpool import HoldPolicy, PoolResult, simulate_pool
from kmesh_trace.oracle.executor import Executor, InProcess, Task
from kmesh_trace.oracle.families import family_keys, infer_exact_prefix_edges
from kmesh_trace.oracle.options import option
from kmesh_trace.oracle.stream import RequestBlocks, pool_capacity
from kmesh_trace.oracle.tasks import task_source, workload_at
from kmesh_trace.oracle.workload import Workload
from kmesh_trace.resources import check_fits, pool_bytes
from kmesh_trace.schema import EdgeKind, EdgeSource, PressureEdges, vocabulary

__all__ = ["FamilyRow", "PressureOptions", "PressureResult", "PressureSweep", "SweepPoint", "what_if", "what_if_trace",
           "sweep", "hold_policy", "infer_exact_prefix_edges", "lineage_for", "run", "sweep_point"]

EDGE_MODES = vocabulary(PressureEdges)


@dataclass
class FamilyRow:
    """One parent's hold and the children it was meant for."""

    parent_index: int
    parent_request_id: str
    family: str  # as `lineage` names it: the parent's declared family id, else "root:" + its edge tree's root
    child_indices: list[int]
    hold_status: str  # taken, refused_blocks, refused_families, empty, not_needed, never_finished
    num_held_blocks: int
    release_reason: str | None
    num_children_served: int
    child_hit_tokens_stock: int
    child_hit_tokens_held: int

    @property
    def saved_child_tokens(self) -> int:
        return self.child_hit_tokens_held - self.child_hit_tokens_stock

    def to_dict(self) -> dict:
        return {
            "parent_index": self.parent_index, "parent_request_id": self.parent_request_id,
            "family": self.family, "num_children": len(self.child_indices), "hold_status": self.hold_status,
            "num_held_blocks": self.num_held_blocks, "release_reason": self.release_reason,
            "num_children_served": self.num_children_served,
            "child_hit_tokens_stock": self.child_hit_tokens_stock,
            "child_hit_tokens_held": self.child_hit_tokens_held,
            "saved_child_tokens": self.saved_child_tokens,
        }


@dataclass
class PressureResult:
    """Both arms of one what-if and the tradeoff between them (`to_dict` is the JSON of the CLI)."""

    block_size: int
    capacity_blocks: int
    edges: str
    stock: PoolResult
    held: PoolResult
    child_indices: list[int]
    families: list[FamilyRow]  # one per parent: its hold (the JSON's `holds`)
    request_ids: list[str] = field(default_factory=list)
    num_families: int = 0  # as `lineage` counts them (module docstring)
    edge_source: str = "declared"  # an EdgeSource: declared (parent_index), lineage (given rows), block_hashes
    note: str | None = None  # what a reader must know about the trace (approximate token ids)

    def _arm(self, res: PoolResult) -> dict:
        children = set(self.child_indices)
        child = sum(res.hit_tokens[i] for i in children)
        return {
            "child_hit_tokens": child,
            "other_hit_tokens": res.total_hit_tokens - child,
            "hit_tokens": res.total_hit_tokens,
            "prefill_tokens": res.prefill_tokens,
            "evictions": res.total_evictions,
            "num_not_admitted": res.admitted.count(False),
            "num_stalled": res.stalled.count(True),
            "num_deferred": res.num_deferred,
        }

    @property
    def saved_child_tokens(self) -> int:
        return sum(self.held.hit_tokens[i] - self.stock.hit_tokens[i] for i in self.child_indices)

    @property
    def net_cached_tokens(self) -> int:
        return self.held.total_hit_tokens - self.stock.total_hit_tokens

    @property
    def displaced_hit_tokens(self) -> int:
        return self.saved_child_tokens - self.net_cached_tokens

    @property
    def num_holds(self) -> int:
        return sum(1 for h in self.held.holds if h.status == "taken")

    @property
    def num_unused_holds(self) -> int:
        return sum(1 for h in self.held.holds if h.unused)

    @property
    def num_refused_holds(self) -> int:
        return sum(1 for h in self.held.holds if h.status.startswith("refused"))

    def per_request(self) -> list[dict]:
        children = set(self.child_indices)
        return [
            {"index": i, "request_id": self.request_ids[i] if self.request_ids else str(i),
             "role": "child" if i in children else "other",
             "hit_tokens_stock": self.stock.hit_tokens[i], "hit_tokens_held": self.held.hit_tokens[i],
             "evictions_stock": self.stock.num_evictions[i], "evictions_held": self.held.num_evictions[i]}
            for i in range(len(self.stock.hit_tokens))
        ]

    def to_dict(self, *, per_request: bool = False) -> dict:
        d = {
            "block_size": self.block_size,
            "capacity_blocks": self.capacity_blocks,
            "edges": self.edges,
            "edge_source": self.edge_source,
            "timed": self.stock.timed,
            "num_requests": len(self.stock.hit_tokens),
            "num_children": len(self.child_indices),
            "arms": {"stock": self._arm(self.stock), "held": self._arm(self.held)},
            "saved_child_tokens": self.saved_child_tokens,
            "displaced_hit_tokens": self.displaced_hit_tokens,
            "net_cached_tokens": self.net_cached_tokens,
            "num_holds": self.num_holds,
            "unused_holds": self.num_unused_holds,
            "refused_holds": self.num_refused_holds,
            "held_block_steps": self.held.held_block_steps,
            "held_block_seconds": self.held.held_block_seconds,
            "num_families": self.num_families,
            "num_parents": len(self.families),
            "holds": [f.to_dict() for f in self.families],
        }
        if per_request:
            d["requests"] = self.per_request()
        if self.note:
            d["note"] = self.note
        return d


@dataclass
class SweepPoint:
    capacity_blocks: int
    saved_child_tokens: int
    displaced_hit_tokens: int
    net_cached_tokens: int
    stock_hit_tokens: int
    held_hit_tokens: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def hold_policy(requests: list[RequestBlocks], edges: dict[int, int], *, expiry_s: float | None = None,
                max_held_blocks: int | None = None, max_families: int | None = None,
                use_declared_counts: bool = True) -> HoldPolicy:
    """The holds a controller would apply for `edges` (child index -> parent index)."""
    counts: dict[int, int] = {}
    for c, p in edges.items():
        counts[p] = counts.get(p, 0) + 1
    release_after = {}
    for p, n in counts.items():
        declared = requests[p].num_expected_children if use_declared_counts else None
        release_after[p] = declared if declared is not None and declared > 0 else n
    family_of = {p: requests[p].family_id or f"parent-{requests[p].request_id}" for p in counts}
    return HoldPolicy(
        release_after=release_after, parent_of=dict(edges), family_of=family_of,
        expiry_ns=None if expiry_s is None else int(expiry_s * 1e9),
        max_held_blocks=max_held_blocks, max_families=max_families,
    )


def _edges(requests: list[RequestBlocks], mode: str, block_size: int,
           lineage: dict[int, int] | None) -> tuple[dict[int, int], str]:
    """The edges of `mode` (a `PressureEdges`) and their `EdgeSource`: declared parents; for `content`,
    the given lineage rows; for `inferred` (exact-prefix), the given lineage rows when there are any, else
    the edges inferred from block hashes."""
    if mode not in EDGE_MODES:
        raise KmeshTraceError(f"Unknown edge mode {mode!r}; use one of {', '.join(EDGE_MODES)}.")
    if mode == PressureEdges.declared.value:
        edges = {r.index: r.parent_index for r in requests if r.parent_index is not None}
        source = EdgeSource.declared
    elif mode == PressureEdges.content.value or lineage is not None:
        edges, source = dict(lineage or {}), EdgeSource.lineage
    else:
        edges, source = infer_exact_prefix_edges(requests, block_size), EdgeSource.block_hashes
    for c, p in edges.items():
        if not 0 <= p < c < len(requests):
            raise KmeshTraceError(f"Edge {p} -> {c} does not point from an earlier request to a later one; "
                                  "check the trace's lineage.")
    return edges, source.value


def what_if(requests: list[RequestBlocks], *, block_size: int, num_usable_blocks: int,
            edges: str = "declared", lineage: dict[int, int] | None = None, expiry_s: float | None = None,
            max_held_blocks: int | None = None, max_families: int | None = None,
            timed: bool | None = None) -> PressureResult:
    """Simulate `requests` stock and with family holds; see the module docstring."""
    for i, r in enumerate(requests):
        if r.index != i:
            raise KmeshTraceError("Requests must be in arrival order with index 0, 1, 2, ...; rebuild the stream.")
    e, source = _edges(requests, edges, block_size, lineage)
    if not e:
        raise NeedsParameterError(f"the stream has no {edges} parent-child edges, so there is nothing to hold "
                                  "(or use a trace with declared lineage)", "edges", "inferred")
    policy = hold_policy(requests, e, expiry_s=expiry_s, max_held_blocks=max_held_blocks, max_families=max_families)
    stock = simulate_pool(requests, block_size=block_size, num_usable_blocks=num_usable_blocks, timed=timed)
    held = simulate_pool(requests, block_size=block_size, num_usable_blocks=num_usable_blocks, holds=policy, timed=timed)
    family = family_keys(requests, e, naming="lineage")
    return PressureResult(
        block_size=block_size, capacity_blocks=num_usable_blocks, edges=edges, stock=stock, held=held,
        child_indices=sorted(e), families=_families(requests, e, family, stock, held),
        request_ids=[r.request_id for r in requests], edge_source=source, num_families=len(set(family.values())),
    )


def _families(requests, edges, family: dict[int, str], stock: PoolResult, held: PoolResult) -> list[FamilyRow]:
    children: dict[int, list[int]] = {}
    for c, p in sorted(edges.items()):
        children.setdefault(p, []).append(c)
    rec = {h.parent_index: h for h in held.holds}
    rows = []
    for p in sorted(children):
        h = rec.get(p)
        cs = children[p]
        rows.append(FamilyRow(
            parent_index=p, parent_request_id=requests[p].request_id, family=family[p],
            child_indices=cs, hold_status=h.status if h else "never_finished",
            num_held_blocks=h.num_blocks if h and h.status == "taken" else 0,
            release_reason=h.release_reason if h else None,
            num_children_served=h.num_children_served if h else 0,
            child_hit_tokens_stock=sum(stock.hit_tokens[c] for c in cs),
            child_hit_tokens_held=sum(held.hit_tokens[c] for c in cs),
        ))
    return rows


def sweep(requests: list[RequestBlocks], *, block_size: int, capacities: list[int], **kwargs) -> list[SweepPoint]:
    """`what_if` at each capacity (usable blocks); same keyword options."""
    return [sweep_point(what_if(requests, block_size=block_size, num_usable_blocks=cap, **kwargs)) for cap in capacities]


def sweep_point(r: PressureResult) -> SweepPoint:
    """The sweep's row of one what-if."""
    return SweepPoint(r.capacity_blocks, r.saved_child_tokens, r.displaced_hit_tokens, r.net_cached_tokens,
                      r.stock.total_hit_tokens, r.held.total_hit_tokens)


def lineage_for(workload: Workload, edges: str) -> dict[int, int] | None:
    """The trace's lineage edges that serve `edges`: its content rows for `content`, else its exact_prefix
    rows (which `inferred` uses when the trace has them; `declared` ignores them)."""
    kind = EdgeKind.content if edges == PressureEdges.content.value else EdgeKind.exact_prefix
    return workload.lineage(kind.value)


def check_has_requests(source, engine: str | None) -> None:
    """One sentence for a KV-events recording: the what-if needs requests and lineage."""
    from kmesh_trace.oracle.kv_stream import refuse_without_requests  # deferred: it loads polars and pyarrow

    refuse_without_requests(source, engine, "the retention what-if")


def workload_of(trace, engine: str | None = None) -> Workload:
    """The workload `run` reads from an opened trace's engine partition (`engine`, None: the only one), refused
    in one sentence when it is a KV-events recording; a public trace read into memory always has requests."""
    if trace.invocations_in_memory is None:
        check_has_requests(trace, engine)
    return Workload.from_trace(trace, engine)


def what_if_trace(trace, *, engine: str | None = None, capacity_blocks: int | None = None, **kwargs) -> PressureResult:
    """`what_if` over a trace (a path or an opened `Trace`), at its own usable blocks unless
    `capacity_blocks` is given; other keywords as `what_if` (the trace's exact-prefix lineage rows
    serve `edges="inferred"`)."""
    from kmesh_trace.trace import open_trace  # deferred: it loads polars, pyarrow and duckdb

    if isinstance(trace, (str, Path)):
        with open_trace(trace) as t:
            check_has_requests(t, engine)
            w = Workload.from_trace(t, engine)
    else:
        check_has_requests(trace, engine)
        w = Workload.from_trace(trace, engine)
    w.refuse_hybrid("pressure")
    kwargs.setdefault("lineage", w.lineage(EdgeKind.exact_prefix.value))
    return what_if(w.requests, block_size=w.block_size,
                   num_usable_blocks=pool_capacity(capacity_blocks, w.num_usable_blocks), **kwargs)


# ---- one run of the analysis, as `kmesh-trace pressure` and the report's section run it ------------


@dataclass(frozen=True)
class PressureOptions:
    """What `kmesh-trace pressure` is asked (its flags name the fields; `kmesh_trace.oracle.options`)."""

    edges: PressureEdges = option("--edges", PressureEdges.declared)
    capacities: tuple[int, ...] | None = option("--capacity-blocks")  # None: the trace's usable blocks
    expiry_s: float | None = option("--expiry-s")
    max_held_blocks: int | None = option("--max-held-blocks")
    max_families: int | None = option("--max-families")
    sweep: bool = option(None, False)  # a sweep table even at one capacity (several capacities always are)

    def check(self, flag: str = "--capacity-blocks") -> None:
        """Refuse pools too large for memory before any work (`flag`: the option that gave the capacities)."""
        if self.capacities is not None:
            check_fits(pool_bytes(max(self.capacities)), flag, "a vLLM pool model")

    @property
    def is_sweep(self) -> bool:
        return self.capacities is not None and (len(self.capacities) > 1 or self.sweep)

    def what_if_options(self) -> dict:
        return dict(edges=PressureEdges(self.edges).value, expiry_s=self.expiry_s,
                    max_held_blocks=self.max_held_blocks, max_families=self.max_families)


@dataclass
class PressureSweep:
    """The what-if along the capacity axis (`to_dict` is the JSON of `kmesh-trace pressure` with several capacities)."""

    block_size: int
    edges: str
    points: list[SweepPoint]
    note: str | None = None  # what a reader must know about the trace (approximate token ids)

    def to_dict(self) -> dict:
        d = {"block_size": self.block_size, "edges": self.edges, "sweep": [p.to_dict() for p in self.points]}
        if self.note:
            d["note"] = self.note
        return d

    def rows(self) -> list[dict]:
        return self.to_dict()["sweep"]


def pressure_point(source, engine: str | None, capacity: int, options: dict, whole: bool):
    """The task of the retention what-if at one capacity over one engine's requests (`source`: a location,
    or a Workload, whose lineage edges of the kind `options["edges"]` reads serve it): the whole
    PressureResult when `whole`, else its SweepPoint. `options`: what_if's other keywords."""
    w = workload_at(source, engine)
    r = what_if(w.requests, block_size=w.block_size, num_usable_blocks=capacity,
                lineage=lineage_for(w, options["edges"]), **options)
    return r if whole else sweep_point(r)


def run(workload: Workload, options: PressureOptions, executor: Executor | None = None) -> PressureResult | PressureSweep:
    """The what-if of `options` over `workload`: one PressureResult at one capacity (the trace's usable
    blocks by default), or a PressureSweep; on a remote executor, one task per capacity reads the trace."""
    workload.refuse_hybrid("pressure")
    executor = executor or InProcess()
    opts = options.what_if_options()
    lineage = lineage_for(workload, opts["edges"])
    caps = list(options.capacities) if options.is_sweep else [
        pool_capacity(options.capacities[0] if options.capacities else None, workload.num_usable_blocks)]
    whole = not options.is_sweep
    if executor.remote:  # one task per capacity, each reading the engine's parts itself
        source, engine = task_source(workload, executor), workload.engine
        where = f"engine={engine}" if engine else "the trace"
        results = executor.map(pressure_point, [Task(f"{where}: what-if at {c} blocks", (source, engine, c, opts, whole))
                                                for c in caps])
    elif whole:
        results = [what_if(workload.requests, block_size=workload.block_size, num_usable_blocks=caps[0],
                           lineage=lineage, **opts)]
    else:
        results = sweep(workload.requests, block_size=workload.block_size, capacities=caps, lineage=lineage, **opts)
    return results[0] if whole else PressureSweep(workload.block_size, opts["edges"], results)


def untimed_note(workload: Workload) -> str | None:
    """Why the replay is sequential, when only some requests have arrival and finish times."""
    reqs = workload.requests
    num_timed = sum(r.arrival_ns is not None and r.finish_ns is not None for r in reqs)
    if 0 < num_timed < len(reqs):
        return (f"{len(reqs) - num_timed:,} of {len(reqs):,} requests lack arrival or finish times, so "
                "the replay is sequential (each request freed before the next)")
    return None
