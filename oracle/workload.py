"""The one input every simulator, analysis, task and report section reads: a `Workload`, and the one
way to get it from a trace, `Workload.from_trace`.

A workload is the requests of one engine partition (or of every partition, merged, for the fleet) in
arrival order as `RequestBlocks`, and/or their flat `AccessStream`, with what the analyses need
around them: the block size, the engine's usable blocks, the engine's measured hit tokens (the
captured stock), and the lineage table's edges by kind (child index -> parent index). Declared
parents are applied to the requests, the same way for every analysis.

The source is anything with the reading side of a trace (`kmesh_trace.sources.TraceSource`):
`kmesh_trace.trace.Trace` (a local directory), `kmesh_trace.parts.TraceParts` (a pyarrow filesystem, what a
Ray task reads), or a public trace read as it is (`kmesh_trace.sources.PublicInput`), which holds its
invocations in memory (`InvocationColumns`): its workload is built from them the same way, without polars
or pyarrow. A KV-events recording's invocations are rebuilt from its events (`kmesh_trace.oracle.kv_stream`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kmesh_trace import schema
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.kv_groups import groups_from_metadata, is_hybrid, refuse_hybrid, retention_of_metadata
from kmesh_trace.lineage import declared_parents
from kmesh_trace.oracle.families import families
from kmesh_trace.oracle.stream import (AccessStream, RequestBlocks, RequestColumns, check_block_size,
                                      duplicated_request, engine_geometry, requests_from_rows, set_declared_parents)
from kmesh_trace.sources import InvocationColumns, TraceSource

__all__ = ["Workload", "location_of", "request_blocks"]

#: The invocation columns the loader reads (checked against the contract), plus the partition.
COLUMNS = schema.INVOCATIONS.select(
    "request_id", "caller_request_id", "seq", "family_id", "parent_id", "num_expected_children", "num_prompt_tokens",
    "num_output_tokens", "prompt_token_ids", "output_token_ids", "prompt_block_hashes", "arrival_ns", "finish_ns",
    "num_cached_tokens")


@dataclass
class Workload:
    """What a policy replays and an analysis reads: the requests (needed by the block-pool model) and
    their access stream, with the pool geometry, the captured stock and the lineage edges."""

    block_size: int
    requests: Sequence[RequestBlocks] | None = None
    _stream: AccessStream | None = field(default=None, repr=False)
    num_usable_blocks: int | None = None  # the engine's pool (merged: when every engine records the same)
    _stock_tokens: np.ndarray | None = field(default=None, repr=False)  # measured hit tokens (stream only)
    edges: dict[str, dict[int, int]] = field(default_factory=dict)  # lineage edge kind -> child index -> parent index
    num_partitions: int = 1
    engine: str | None = None  # the partition it is of (None: the only one, or every one merged)
    location: str | None = None  # where it was read from, for tasks that read it themselves (`kmesh_trace.oracle.tasks`)
    notes: list[str] = field(default_factory=list)  # what a reader must know about how it was built (scenarios)
    # What an analysis derives once and reuses, under its own key: fleet routing's family keys per edge mode
    # (`("families", edges)`), the vllm replay's per-request inputs (`"pool_inputs"`).
    derived: dict = field(default_factory=dict, repr=False)
    _columns: RequestColumns | None = field(default=None, repr=False)  # without requests: the pool model's columns
    #: The engine's KV cache groups (`kmesh_trace.kv_groups`, from the engine metadata); empty: one
    #: full-attention group of `block_size` (a trace that states none, a scenario).
    groups: tuple = ()
    #: vLLM's prefix_cache_retention_interval (`kv_groups.retention_of_metadata`): what a sliding window caches.
    retention_interval: int | None = 0

    @property
    def hybrid(self) -> bool:
        """The engine has several KV cache groups, or one that is not full attention (`kv_groups.is_hybrid`)."""
        return is_hybrid(tuple(self.groups)) if self.groups else False

    def refuse_hybrid(self, analysis: str) -> None:
        """Refuse, in one sentence, an analysis that models one full-attention group on a hybrid engine's trace."""
        refuse_hybrid(self.groups, analysis)

    @property
    def columns(self) -> RequestColumns | None:
        """The requests' columns the `vllm` pool model reads (of the RequestBlocks when there are any);
        None for a bare access stream."""
        if self.requests is None:
            return self._columns
        if "columns" not in self.derived:
            self.derived["columns"] = RequestColumns.of_requests(self.requests)
        return self.derived["columns"]

    @property
    def stream(self) -> AccessStream:
        if self._stream is None:
            assert self.requests is not None
            self._stream = AccessStream.from_requests(self.requests, self.block_size)
        return self._stream

    @classmethod
    def of_stream(cls, stream: AccessStream) -> "Workload":
        return cls(stream.block_size, None, stream)

    @property
    def stock_tokens(self) -> np.ndarray | None:
        """The engine's measured hit tokens per request when every request has them (captures), else None."""
        if self.requests is None:
            return self._stock_tokens
        if self.requests and all(r.stock_cached_tokens is not None for r in self.requests):
            return np.fromiter((r.stock_cached_tokens for r in self.requests), np.int64, len(self.requests))
        return None

    @property
    def timed(self) -> bool:
        """Every request has an arrival and a finish time (the pool replays concurrently)."""
        cols = self.columns
        return cols is not None and cols.timed

    def families(self, edges: str = "auto") -> tuple[list[str], str]:
        """(family key per request, declared or inferred): `kmesh_trace.oracle.families.families`."""
        return families(self, edges)

    def lineage(self, kind: str) -> dict[int, int] | None:
        """The trace's `kind` lineage edges (child index -> nearest parent index); None when it has none."""
        return dict(self.edges[kind]) if self.edges.get(kind) else None

    @classmethod
    def from_trace(cls, source: TraceSource, engine: str | None = None, *, merged: bool = False,
                   requests: bool = True) -> "Workload":
        """The workload of engine partition `engine` of `source` (None: the only one), or with `merged`
        of every partition (simultaneous arrivals ordered by partition, then seq).

        Ordered by arrival_ns then seq. With `requests=False`, a trace whose invocations list block hashes
        without token ids (imports) is flattened column-wise, without a RequestBlocks per invocation
        (`requests` stays None, `columns` holds what the `vllm` pool model reads); one with token ids still
        builds them (its blocks must be hashed)."""
        in_memory = source.invocations_in_memory
        if in_memory is not None and (not merged or len(source.engines) == 1):  # one partition: merged is it
            return cls._from_columns(source, in_memory, None if merged else engine, requests)
        import polars as pl

        from kmesh_trace.oracle.kv_stream import scan_invocations  # deferred: it loads polars and pyarrow

        if merged:
            block_size = check_block_size(source.block_size)
            pools = {m.get("num_usable_blocks") for m in source.engines.values()}
            usable, order = (pools.pop() if len(pools) == 1 else None), ["arrival_ns", "engine", "seq"]
            engine = None
        else:
            block_size, usable = engine_geometry(source, engine)
            order = ["arrival_ns", "seq"]
        groups, retention = _groups_of(source, engine, merged)
        lf = scan_invocations(source, engine)  # a KV-events recording's are rebuilt from its events
        if engine is not None:
            lf = lf.filter(pl.col("engine") == engine)
        lf = lf.sort(order, nulls_last=True)
        n, where = len(source.engines), location_of(source)
        if not requests and not is_hybrid(groups):  # the hybrid pool model replays RequestBlocks
            flat = _column_stream(lf, block_size)
            if flat is not None:
                stream, stock, columns = flat
                return cls(block_size, None, stream, usable, stock, num_partitions=n, engine=engine, location=where,
                           _columns=columns, groups=groups,
                           retention_interval=retention)
        df = lf.select(*COLUMNS, "engine").collect()
        reqs = requests_from_rows(df.iter_rows(named=True), block_size)
        set_declared_parents(reqs, {child: parent for (_, child), parent in declared_parents(source, engine).items()})
        return cls(block_size, reqs, None, usable, edges=_lineage_edges(source, engine, reqs),
                   num_partitions=n, engine=engine, location=where, groups=groups, retention_interval=retention)


    @classmethod
    def _from_columns(cls, source, columns: InvocationColumns, engine: str | None, requests: bool) -> "Workload":
        """`from_trace` of a source whose one partition's invocations are in memory: the same workload."""
        block_size, usable = engine_geometry(source, engine)
        order = columns.order()
        where = location_of(source)
        if not requests:  # hash-only rows: flattened column-wise, as `_column_stream` flattens a trace's
            off = np.asarray(columns.hash_offsets, np.int64)
            flat = np.asarray(columns.hashes, np.uint64)
            num_reads = np.diff(off)
            idx = np.asarray(order, np.int64)
            if not np.array_equal(idx, np.arange(len(idx))):  # rows out of arrival order: gather them
                num_reads = num_reads[idx]
                flat = flat[_gather(off[idx], num_reads)]
            tokens = np.asarray(columns.num_prompt_tokens, np.int64)[idx]
            _check_unique(columns.request_id)
            per_request = RequestColumns.of_values(*(_take(v, idx) for v in (
                columns.num_output_tokens, columns.arrival_ns, columns.finish_ns)))
            return cls(block_size, None, _flat_stream(tokens, num_reads, flat, block_size), usable, None,
                       num_partitions=len(source.engines), engine=engine, location=where, _columns=per_request)
        (engine_id,) = source.engines
        reqs = requests_from_rows(columns.rows(order, engine_id), block_size)
        set_declared_parents(reqs, columns.declared_parents)
        return cls(block_size, reqs, None, usable, edges={}, num_partitions=len(source.engines), engine=engine,
                   location=where)


def request_blocks(trace, engine: str | None = None) -> list[RequestBlocks]:
    """`Workload.from_trace(trace, engine).requests`, for callers that want only the requests."""
    return list(Workload.from_trace(trace, engine).requests)


def _groups_of(source, engine: str | None, merged: bool) -> tuple:
    """(KV cache groups, retention interval) of the partition (`kv_groups.groups_from_metadata`,
    `kv_groups.retention_of_metadata`); merged, those every engine shares (engines of different hybrid
    layouts do not make one fleet)."""
    if not merged:
        metas = [source.engines[engine] if engine is not None else source.metadata]
    else:
        metas = list(source.engines.values()) or [source.metadata]
    layouts = {(groups_from_metadata(m), retention_of_metadata(m)) for m in metas}
    if len(layouts) > 1 and any(is_hybrid(g) for g, _ in layouts):
        raise KmeshTraceError("the trace's engines have different KV cache groups; analyse each engine with --engine.")
    return layouts.pop()


def _take(values, idx: np.ndarray):
    """`values` (a list, an array or None) in the order `idx`."""
    if values is None:
        return None
    if isinstance(values, np.ndarray):
        return values[idx]
    return [values[i] for i in idx.tolist()]


def _check_unique(request_ids) -> None:
    """`requests_from_rows`' refusal of a request listed twice, without building the requests."""
    seen: set = set()
    for rid in request_ids:
        if rid in seen:
            raise duplicated_request(str(rid))
        seen.add(rid)


def _gather(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Positions starts[0]..starts[0]+lengths[0]-1, then those of the next run, ...: runs gathered in order."""
    firsts = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return firsts + np.arange(int(lengths.sum()), dtype=np.int64)


def location_of(source: TraceSource) -> str | None:
    """The trace's directory or URL (`Trace.path`, `TraceParts.location`)."""
    where = getattr(source, "location", None) or getattr(source, "path", None)
    return None if where is None else str(where)


def _column_stream(lf, block_size: int) -> tuple[AccessStream, np.ndarray | None, RequestColumns] | None:
    """The stream of a hash-only trace flattened column-wise, the measured hit tokens when every
    invocation has them, and the columns the pool model reads; None when some invocation has token ids
    or lacks hashes."""
    import polars as pl
    import pyarrow.compute as pc

    cols = lf.select(pl.col("prompt_token_ids").is_not_null().any().alias("tokens"),
                     pl.col("num_cached_tokens").is_not_null().all().alias("stock"),
                     pl.col("prompt_block_hashes").is_null().any().alias("missing"),
                     pl.col("request_id").is_duplicated().any().alias("twice")).collect().row(0, named=True)
    if cols["tokens"] or cols["missing"]:
        return None
    if cols["twice"]:
        _check_unique(lf.select("request_id").collect().to_series().to_list())
    stock = None
    if cols["stock"]:
        stock = lf.select("num_cached_tokens").collect().to_series().to_numpy().astype(np.int64)
    df = lf.select("num_prompt_tokens", "prompt_block_hashes", "num_output_tokens", "arrival_ns", "finish_ns").collect()
    lists = df.to_arrow().column("prompt_block_hashes").combine_chunks()
    num_reads = pc.list_value_length(lists).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(lists).to_numpy(zero_copy_only=False).astype(np.uint64, copy=False)
    prompt_tokens = df["num_prompt_tokens"].to_numpy().astype(np.int64)
    columns = RequestColumns.of_values(*(_nullable(df[c]) for c in ("num_output_tokens", "arrival_ns", "finish_ns")))
    return _flat_stream(prompt_tokens, num_reads, flat, block_size), stock, columns


def _nullable(series):
    """A polars column as int64 values when it has no null, else as a list (None: missing), for `of_values`."""
    return series.to_numpy().astype(np.int64) if series.null_count() == 0 else series.to_list()


def _flat_stream(prompt_tokens: np.ndarray, num_reads: np.ndarray, flat: np.ndarray, block_size: int) -> AccessStream:
    """The access stream of hash-only requests: `num_reads[i]` listed hashes each, back to back in `flat`."""
    return AccessStream.from_flat(block_size, flat, num_reads, prompt_tokens)


def _lineage_edges(source: TraceSource, engine: str | None, reqs: Sequence[RequestBlocks]) -> dict[str, dict[int, int]]:
    """The lineage table's exact_prefix and content edges as request indices (several ancestors of a
    child: the nearest one is its parent); declared edges are the requests' `parent_index`."""
    import polars as pl

    kinds = (schema.EdgeKind.exact_prefix.value, schema.EdgeKind.content.value)
    lf = source.scan("lineage").filter(pl.col("edge_kind").is_in(kinds))
    if engine is not None:
        lf = lf.filter(pl.col("engine") == engine)
    rows = lf.select("edge_kind", "child_request_id", "parent_request_id").collect()
    if rows.height == 0:
        return {}
    index = {r.request_id: r.index for r in reqs}
    out: dict[str, dict[int, int]] = {}
    for kind, child, parent in rows.iter_rows():
        c, p = index.get(child), index.get(parent)
        edges = out.setdefault(kind, {})
        if c is not None and p is not None and p < c and p > edges.get(c, -1):
            edges[c] = p
    return out

