"""The shape of a trace's lineage: families, fan-out, depth, reuse gaps and shared prefixes.

Reads edges from the trace's `lineage` table only (the one record of lineage), one `edge_kind` at a
time (default: the first of declared, exact_prefix, content that the trace has), and the invocations
they join (per engine: request ids are unique within an engine partition). Per edge:
- gap: the child's arrival minus the parent's finish, in seconds (negative when the child arrived
  while the parent was still running); unknown when either time is;
- shared-prefix blocks: the full blocks the child's prompt shares, from its start, with the parent's
  prompt + output (token ids when the trace has them: the common token prefix // block size; else
  the listed block hashes, which are chained, over both requests' full prompt blocks).
A request's family is its `family_id`, or when it has none the root of its edge tree; a request with
neither a family nor an edge is a singleton, not a family. Depth counts edges from the root (a root
is depth 0); fan-out counts children per parent (parents with at least one child).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.lineage import lineage_cycles
from kmesh_trace.oracle.options import option
from kmesh_trace.schema import EDGE_KINDS, EdgeKind

EDGE_ORDER = EDGE_KINDS  # the default edge kind: the first of these the trace has
QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class Distribution:
    """Summary of one distribution (count, min, quantiles, max, mean); empty when count is 0."""

    count: int
    min: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None
    mean: float | None = None

    @classmethod
    def of(cls, values: np.ndarray) -> "Distribution":
        values = np.asarray(values, dtype=np.float64)
        if values.size == 0:
            return cls(0)
        q = np.quantile(values, QUANTILES)
        return cls(int(values.size), float(values.min()), float(q[0]), float(q[1]), float(q[2]), float(values.max()),
                   float(values.mean()))

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class FamilyLineage:
    family: str
    engine: str
    num_requests: int
    num_edges: int
    num_roots: int
    max_fan_out: int
    depth: int
    gap_s_p50: float | None
    shared_blocks_p50: float | None
    num_agents: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class LineageReport:
    edge_kind: str | None
    edge_kinds: dict[str, int]
    block_size: int | None
    num_requests: int
    num_families: int
    num_singletons: int
    num_edges: int
    num_dangling_edges: int
    num_self_parent_edges: int
    num_parents: int
    fan_out: Distribution
    depth: Distribution
    family_size: Distribution
    gap_s: Distribution
    num_negative_gaps: int
    shared_blocks: Distribution
    shared_fraction: Distribution
    families: list[FamilyLineage]
    notes: list[str] = field(default_factory=list)
    # Raw per-parent / per-edge / per-family values, for plots (not in the JSON).
    fan_out_values: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    gap_values: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    shared_values: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    depth_values: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)

    def to_dict(self, max_families: int | None = None) -> dict[str, Any]:
        fams = self.families if max_families is None else self.families[:max_families]
        return {
            "edge_kind": self.edge_kind, "edge_kinds": self.edge_kinds, "block_size": self.block_size,
            "num_requests": self.num_requests, "num_families": self.num_families, "num_singletons": self.num_singletons,
            "num_edges": self.num_edges, "num_dangling_edges": self.num_dangling_edges,
            "num_self_parent_edges": self.num_self_parent_edges, "num_parents": self.num_parents,
            "fan_out": self.fan_out.to_dict(), "depth": self.depth.to_dict(), "family_size": self.family_size.to_dict(),
            "gap_s": self.gap_s.to_dict(), "num_negative_gaps": self.num_negative_gaps,
            "shared_blocks": self.shared_blocks.to_dict(), "shared_fraction": self.shared_fraction.to_dict(),
            "families": [f.to_dict() for f in fams], "notes": self.notes,
        }


def _flat(col) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(starts, ends, values) of an Arrow list column (a null row is empty), or None when every row is null."""
    import pyarrow as pa

    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if arr.null_count == len(arr):
        return None
    offsets = arr.offsets.to_numpy().astype(np.int64)  # absolute positions in arr.values, slices included
    starts, ends = offsets[:-1], offsets[1:].copy()
    if arr.null_count:
        nulls = arr.is_null().to_numpy(zero_copy_only=False)
        ends[nulls] = starts[nulls]
    return starts, ends, arr.values.to_numpy(zero_copy_only=False)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass
class _Rows:
    """The invocation columns the report reads, one entry per request (a null time is NaN), and how to
    count the full blocks each child shares with its parent (`shared(child_idx, par_idx, block_size)`)."""

    engine: list
    request_id: list
    family_id: list
    arrival_ns: np.ndarray  # float64
    finish_ns: np.ndarray  # float64
    num_prompt_tokens: np.ndarray  # int64
    agent_id: list
    shared: Any

    @classmethod
    def of_frame(cls, inv) -> "_Rows":
        """From a polars frame of a trace's invocations."""
        n = inv.height
        agents = inv.get_column("agent_id").to_list() if "agent_id" in inv.columns else [None] * n
        return cls(inv.get_column("engine").to_list(), inv.get_column("request_id").to_list(),
                   inv.get_column("family_id").to_list(),
                   inv.get_column("arrival_ns").to_numpy().astype(np.float64) if n else np.zeros(0),
                   inv.get_column("finish_ns").to_numpy().astype(np.float64) if n else np.zeros(0),
                   inv.get_column("num_prompt_tokens").to_numpy() if n else np.zeros(0, np.int64), agents,
                   lambda child_idx, par_idx, block_size: _shared_blocks(inv, child_idx, par_idx, block_size))

    @classmethod
    def in_memory(cls, public) -> "_Rows":
        """From a public trace read into memory (`kmesh_trace.sources.PublicInput`): hash-only rows."""
        inv, (engine,) = public.invocations_in_memory, public.engines
        n = len(inv)

        def times(values) -> np.ndarray:
            return np.array([np.nan if v is None else v for v in values], np.float64) if values else np.full(n, np.nan)

        off = np.asarray(inv.hash_offsets, np.int64)
        hv = np.asarray(inv.hashes, np.uint64)
        n_prompt = np.asarray(inv.num_prompt_tokens, np.int64)

        def shared(child_idx, par_idx, block_size):
            if not block_size or len(child_idx) == 0:
                return np.zeros(len(child_idx), np.int64) if block_size else None
            return _shared_hash_blocks(off[:-1], off[1:], hv, n_prompt // block_size, child_idx, par_idx)

        return cls([engine] * n, list(inv.request_id), list(inv.family_id or [None] * n), times(inv.arrival_ns),
                   times(inv.finish_ns), n_prompt, list(public.agent_id or [None] * n), shared)


def lineage_report(trace, *, edge_kind: str | None = None, engine: str | None = None) -> LineageReport:
    """The lineage shape of an opened trace (`kmesh_trace.trace.open_trace`), or of a public trace read into
    memory (`kmesh_trace.sources.PublicInput`, without polars); see the module docstring."""
    if engine is not None and engine not in trace.engines:
        raise KmeshTraceError(f"the trace has no engine {engine!r}; its engines are {', '.join(trace.engines)}.")
    in_memory = trace.invocations_in_memory is not None
    if in_memory:  # one engine partition, its declared edges only
        kinds = {EdgeKind.declared.value: len(trace.edges)} if trace.edges else {}
    else:
        import polars as pl

        lin, inv = trace.scan("lineage"), trace.scan("invocations")
        if engine is not None:
            lin, inv = lin.filter(pl.col("engine") == engine), inv.filter(pl.col("engine") == engine)
        kinds = dict(lin.group_by("edge_kind").len().collect().iter_rows())
    if edge_kind is None:
        edge_kind = next((k for k in EDGE_ORDER if kinds.get(k)), next(iter(sorted(kinds)), None))
    elif edge_kind not in kinds:
        have = ", ".join(sorted(kinds)) or "none"
        raise KmeshTraceError(f"the trace has no {edge_kind} edges (it has: {have}).")
    notes = []
    if edge_kind is None:
        notes.append("the trace has no lineage edges (its lineage table is empty)")
    if len(kinds) > 1:
        notes.append(f"the trace has edges of kinds {', '.join(sorted(kinds))}; this report reads {edge_kind} (--edges)")
    if in_memory:
        (eng,) = trace.engines
        rows = _Rows.in_memory(trace)
        edges = [(eng, child, parent) for child, parent in trace.edges] if edge_kind else None
    else:
        cols = ["engine", "request_id", "family_id", "arrival_ns", "finish_ns", "num_prompt_tokens",
                "prompt_block_hashes", "prompt_token_ids", "output_token_ids"]
        have = inv.collect_schema().names()
        rows = _Rows.of_frame(inv.select(cols + [c for c in ("agent_id",) if c in have]).collect())  # older traces lack agent_id
        edges = list(lin.filter(pl.col("edge_kind") == edge_kind).select(
            "engine", "child_request_id", "parent_request_id").collect().iter_rows()) if edge_kind else None
    block_sizes = {m.get("block_size") for e, m in trace.engines.items() if engine is None or e == engine} - {None}
    if len(block_sizes) > 1:
        raise KmeshTraceError(f"the trace's engines use different block sizes {sorted(block_sizes)}; pick one with --engine.")
    block_size = block_sizes.pop() if block_sizes else None
    return _report(rows, edges, edge_kind, kinds, block_size, notes)


def _refuse_cycles(parent: np.ndarray, keys: list, edge_kind: str | None) -> None:
    """A cycle of parent links has no root: no family, depth or fan-out describes it. Refused, naming it."""
    _, cycles = lineage_cycles({i: int(p) for i, p in enumerate(parent) if p >= 0})
    if cycles:
        names = " <- ".join(keys[i][1] for i in [*cycles[0], cycles[0][0]][:12])
        raise KmeshTraceError(f"the trace's {edge_kind} lineage has {len(cycles)} cycle(s), e.g. {names}: a request "
                              "cannot be its own ancestor; run `kmesh-trace audit capture` to list them.")


def _report(inv: _Rows, edges: list[tuple] | None, edge_kind, kinds, block_size, notes) -> LineageReport:
    n = len(inv.request_id)
    keys = list(zip(inv.engine, inv.request_id))
    index = {k: i for i, k in enumerate(keys)}
    parent = np.full(n, -1, np.int64)
    dangling = self_parents = 0
    if edges is not None:
        for eng, child, par in edges:
            c, p = index.get((eng, child)), index.get((eng, par)) if par is not None else None
            if c is not None and c == p:
                self_parents += 1  # no request is its own parent: counted and said, not a family
                continue
            if c is None or p is None:
                dangling += 1
                continue
            parent[c] = p  # several edges into one child: the last one read wins
    if self_parents:
        notes.append(f"{self_parents} {edge_kind} edge(s) name the child as its own parent; they were left out "
                     "(`kmesh-trace audit capture` lists them)")
    _refuse_cycles(parent, keys, edge_kind)
    has_edge = parent >= 0
    num_edges = int(has_edge.sum())
    children = np.bincount(parent[has_edge], minlength=n) if n else np.zeros(0, np.int64)
    # Depth and tree root, following parents (cycles were refused above).
    depth = np.full(n, -1, np.int64)
    root = np.arange(n)
    for i in range(n):
        if depth[i] >= 0:
            continue
        chain, j, seen = [], i, set()
        while j >= 0 and depth[j] < 0 and j not in seen:
            seen.add(j)
            chain.append(j)
            j = int(parent[j])
        base, r = (int(depth[j]), int(root[j])) if j >= 0 and depth[j] >= 0 else (-1, chain[-1])
        for k in reversed(chain):
            base += 1
            depth[k], root[k] = base, r
    fam_col = inv.family_id
    engines = inv.engine
    family = [fam_col[i] if fam_col[i] is not None else (f"root:{keys[root[i]][1]}" if has_edge[i] or children[i] else None)
              for i in range(n)]
    # Gaps and shared blocks per edge.
    arrival, finish = inv.arrival_ns, inv.finish_ns
    child_idx = np.flatnonzero(has_edge)
    par_idx = parent[child_idx]
    gaps = (arrival[child_idx] - finish[par_idx]) / 1e9
    gap_known = ~np.isnan(gaps)
    shared = inv.shared(child_idx, par_idx, block_size)
    n_prompt = inv.num_prompt_tokens
    child_full = n_prompt[child_idx] // block_size if block_size else np.zeros(len(child_idx))
    with np.errstate(divide="ignore", invalid="ignore"):
        fraction = np.where(child_full > 0, shared / np.maximum(child_full, 1), np.nan) if shared is not None else None
    # Per family.
    agents = inv.agent_id
    members: dict[tuple, list[int]] = {}
    for i in range(n):
        if family[i] is not None:
            members.setdefault((engines[i], family[i]), []).append(i)
    edge_pos = {int(c): k for k, c in enumerate(child_idx)}
    fams = []
    for (eng, fam), idx in members.items():
        e_rows = [edge_pos[i] for i in idx if i in edge_pos]
        g = gaps[e_rows][gap_known[e_rows]] if e_rows else np.zeros(0)
        s = shared[e_rows] if shared is not None and e_rows else np.zeros(0)
        fams.append(FamilyLineage(
            family=fam, engine=eng, num_requests=len(idx), num_edges=len(e_rows),
            num_roots=sum(1 for i in idx if not has_edge[i]), max_fan_out=int(max((children[i] for i in idx), default=0)),
            depth=int(max(depth[i] for i in idx)), gap_s_p50=float(np.median(g)) if g.size else None,
            shared_blocks_p50=float(np.median(s)) if s.size else None,
            num_agents=len({agents[i] for i in idx} - {None})))
    fams.sort(key=lambda f: (-f.num_requests, f.engine, f.family))
    fam_depths = np.array([f.depth for f in fams], np.int64)
    fan = children[children > 0]
    if shared is None and num_edges:
        notes.append("shared-prefix blocks are unknown: the invocations have neither token ids nor block hashes")
    if num_edges and not gap_known.any():
        notes.append("reuse gaps are unknown: the trace has no finish times (or no arrival times)")
    return LineageReport(
        edge_kind=edge_kind, edge_kinds=kinds, block_size=block_size, num_requests=n, num_families=len(fams),
        num_singletons=sum(f is None for f in family), num_edges=num_edges, num_dangling_edges=dangling,
        num_self_parent_edges=self_parents,
        num_parents=int(fan.size), fan_out=Distribution.of(fan), depth=Distribution.of(fam_depths),
        family_size=Distribution.of(np.array([f.num_requests for f in fams])), gap_s=Distribution.of(gaps[gap_known]),
        num_negative_gaps=int((gaps[gap_known] < 0).sum()),
        shared_blocks=Distribution.of(shared if shared is not None else np.zeros(0)),
        shared_fraction=Distribution.of(fraction[~np.isnan(fraction)] if fraction is not None else np.zeros(0)),
        families=fams, notes=notes, fan_out_values=fan, gap_values=gaps[gap_known],
        shared_values=shared if shared is not None else np.zeros(0), depth_values=fam_depths,
    )


def _shared_blocks(inv, child_idx: np.ndarray, par_idx: np.ndarray, block_size: int | None) -> np.ndarray | None:
    """Full blocks each child shares from its start with its parent (see the module docstring)."""
    if not block_size or len(child_idx) == 0:
        return np.zeros(len(child_idx), np.int64) if block_size else None
    arrow = inv.select("prompt_token_ids", "output_token_ids", "prompt_block_hashes", "num_prompt_tokens").to_arrow()
    prompt = _flat(arrow.column("prompt_token_ids"))
    out = np.zeros(len(child_idx), np.int64)
    if prompt is not None:
        ps, pe, pv = prompt
        output = _flat(arrow.column("output_token_ids"))
        for k, (c, p) in enumerate(zip(child_idx.tolist(), par_idx.tolist())):
            child, par = pv[ps[c]:pe[c]], pv[ps[p]:pe[p]]
            n = _common_prefix(child, par)
            if n == len(par) and output is not None:
                os_, oe, ov = output
                n += _common_prefix(child[n:], ov[os_[p]:oe[p]])
            out[k] = n // block_size
        return out
    hashes = _flat(arrow.column("prompt_block_hashes"))
    if hashes is None:
        return None
    hs, he, hv = hashes
    return _shared_hash_blocks(hs, he, hv, arrow.column("num_prompt_tokens").to_numpy() // block_size, child_idx, par_idx)


def _shared_hash_blocks(hs, he, hv, full, child_idx: np.ndarray, par_idx: np.ndarray) -> np.ndarray:
    """The common prefix of each child's and its parent's full prompt blocks' hashes (row i's hashes are
    hv[hs[i]:he[i]], its full blocks `full[i]`)."""
    out = np.zeros(len(child_idx), np.int64)
    for k, (c, p) in enumerate(zip(child_idx.tolist(), par_idx.tolist())):
        child = hv[hs[c]:hs[c] + min(full[c], he[c] - hs[c])]
        par = hv[hs[p]:hs[p] + min(full[p], he[p] - hs[p])]
        out[k] = _common_prefix(child, par)
    return out


@dataclass(frozen=True)
class LineageOptions:
    """What `kmesh-trace lineage` is asked (its flags name the fields; `kmesh_trace.oracle.options`)."""

    edges: str | None = option("--edges")  # an EdgeKind; None: the first kind the trace has (EDGE_ORDER)


def run(trace, options: LineageOptions, engine: str | None = None, *, note: str | None = None) -> LineageReport:
    """The lineage report `options` ask for, over engine `engine` (None: every one) of an opened trace;
    `note`: what a reader must know about the trace (approximate token ids), kept among its notes."""
    rep = lineage_report(trace, edge_kind=options.edges, engine=engine)
    if note:
        rep.notes.append(note)
    return rep
