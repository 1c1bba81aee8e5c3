"""Declared lineage: the one rule that turns the parent a caller named into an engine request id.

A caller declares a child's parent (`kmesh_parent`) by whatever id it saw. Behind vLLM's OpenAI
server one request has several names, and any of them may be the one a client kept:

- the engine id, e.g. `cmpl-5f3a-0-8920dc1e` (what the trace's `request_id` holds);
- the caller id vLLM keeps as the request's external id, e.g. `cmpl-5f3a-0` (`caller_request_id`:
  the response id plus the prompt's index);
- the response `id` an HTTP client saw, e.g. `cmpl-5f3a` or `chatcmpl-5f3a`;
- the client-set id (`X-Request-Id: job-7` with `--enable-request-id-headers`), which the server
  prefixes: the response id is then `cmpl-job-7`.

`names_of` lists those names for one request, `ParentResolver` maps a declared name back to the
engine id (exact ids before derived ones; among derived names the earliest request wins, so a
response's first prompt is its parent), and `declared_edge` builds the lineage row. A declared
parent that no request answers to is kept as an edge with a null `parent_request_id` (dangling)
and counted, never dropped.

The capture writes the `lineage` table with these rules (in the engine process: this module
imports only the standard library); `declared_parents` reads a trace's declared edges back from
that table (resolving, with the same rules, any invocation that declares a parent but has no
declared lineage row, as some imported traces do), so the analyses, the audit, the Perfetto export
and the hold controller all see the same edges.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

#: The lineage table's `edge_kind` of a declared edge (`kmesh_trace.schema.EdgeKind.declared`; written here,
#: not imported, so the engine process's import of this module stays standard-library only).
DECLARED = "declared"

#: Prefixes vLLM's OpenAI server puts before the base request id (completions, chat completions).
RESPONSE_PREFIXES = ("cmpl-", "chatcmpl-")
_INDEX_SUFFIX = re.compile(r"^(.+)-(\d+)$")


def names_of(request_id: str, caller_id: str | None = None) -> tuple[list[str], list[str]]:
    """(exact names, derived names) a client may use for the request, most specific first."""
    exact = [request_id] + ([caller_id] if caller_id is not None and caller_id != request_id else [])
    derived: list[str] = []
    base = caller_id if caller_id is not None else None
    if base is not None:
        m = _INDEX_SUFFIX.match(base)
        response = m.group(1) if m else None
        for name in (response, base):
            if name is None:
                continue
            if name not in exact and name not in derived:
                derived.append(name)
            for prefix in RESPONSE_PREFIXES:
                if name.startswith(prefix) and len(name) > len(prefix):
                    client = name[len(prefix):]
                    if client not in exact and client not in derived:
                        derived.append(client)
    return exact, derived


class ParentResolver:
    """Name -> engine request id for requests seen so far (bounded to the latest `max_requests`)."""

    def __init__(self, max_requests: int | None = None):
        self.max_requests = max_requests
        self._exact: dict[str, str] = {}
        self._derived: dict[str, str] = {}
        self._names: OrderedDict[str, tuple[list[str], list[str]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._names)

    def add(self, request_id: str, caller_id: str | None = None) -> None:
        if request_id in self._names:
            return
        exact, derived = names_of(request_id, caller_id)
        self._names[request_id] = (exact, derived)
        for n in exact:
            self._exact[n] = request_id
        for n in derived:
            self._derived.setdefault(n, request_id)
        if self.max_requests is not None and len(self._names) > self.max_requests:
            self.remove(next(iter(self._names)))

    def remove(self, request_id: str) -> None:
        names = self._names.pop(request_id, None)
        if names is None:
            return
        for table, ns in zip((self._exact, self._derived), names):
            for n in ns:
                if table.get(n) == request_id:
                    del table[n]

    def names(self, request_id: str) -> list[str]:
        exact, derived = self._names.get(request_id, ([], []))
        return exact + derived

    def resolve(self, declared: Any) -> str | None:
        """The engine id of the request the caller named, or None (a parent not seen: dangling)."""
        if declared is None:
            return None
        d = str(declared)
        return self._exact.get(d) or self._derived.get(d)

    def clear(self) -> None:
        self._exact.clear()
        self._derived.clear()
        self._names.clear()


def declared_edge(child_request_id: str, declared_parent: Any, family_id: str | None,
                  resolver: ParentResolver) -> dict[str, Any]:
    """The `lineage` row of a declared edge (`num_shared_tokens` left for the caller to fill)."""
    return {"child_request_id": child_request_id, "parent_request_id": resolver.resolve(declared_parent),
            "declared_parent_id": str(declared_parent), "family_id": family_id, "edge_kind": DECLARED,
            "num_shared_tokens": None}


def declared_parents(trace, engine: str | None = None) -> dict[tuple[str, str], str | None]:
    """(engine, child request id) -> parent request id (None: dangling) for every declared edge.

    From the trace's `lineage` table; an invocation that declares a parent (`parent_id`) but has no
    declared lineage row is resolved here by `ParentResolver` over its engine's invocations.
    """
    import polars as pl

    # Hive partitioning may read an engine id like "0" as an integer.
    lin = trace.scan("lineage").with_columns(pl.col("engine").cast(pl.Utf8)).filter(pl.col("edge_kind") == DECLARED)
    inv = trace.scan("invocations").with_columns(pl.col("engine").cast(pl.Utf8))
    if engine is not None:
        lin = lin.filter(pl.col("engine") == engine)
        inv = inv.filter(pl.col("engine") == engine)
    edges: dict[tuple[str, str], str | None] = {}
    for eng, child, parent in lin.select("engine", "child_request_id", "parent_request_id").collect().iter_rows():
        key = (eng, child)
        if edges.get(key) is None:  # a resolved row wins over a dangling one
            edges[key] = parent
    rows = (inv.select("engine", "request_id", "caller_request_id", "parent_id", "seq")
            .sort(["engine", "seq"]).collect())
    if rows.filter(pl.col("parent_id").is_not_null()).height == 0:
        return edges
    resolvers: dict[str, ParentResolver] = {}
    for eng, rid, caller, _, _ in rows.iter_rows():
        resolvers.setdefault(eng, ParentResolver()).add(rid, caller)
    for eng, rid, _, declared, _ in rows.iter_rows():
        if declared is not None and (eng, rid) not in edges:
            edges[(eng, rid)] = resolvers[eng].resolve(declared)
    return edges


def lineage_cycles(parent_of: dict) -> tuple[list, list[list]]:
    """(the children that name themselves as parent, each cycle of parent links as a list of its keys).

    `parent_of` maps a child key to its parent key (None or a missing key: a root). A valid trace has
    neither: a request cannot be its own ancestor. Linear in the edges (each key is walked once)."""
    self_parents = [c for c, p in parent_of.items() if p is not None and p == c]
    cycles: list[list] = []
    state: dict = {}  # key -> 1 while on the current walk, 2 once finished
    for start in parent_of:
        if start in state:
            continue
        path, k = [], start
        while k is not None and k not in state and k in parent_of:
            state[k] = 1
            path.append(k)
            nxt = parent_of[k]
            k = None if nxt == k else nxt  # a self-parent is reported above, not as a cycle
        if k is not None and state.get(k) == 1:
            cycles.append(path[path.index(k):])
        for x in path:
            state[x] = 2
    return self_parents, cycles


class PrefixIndex:
    """Exact-prefix inference, the one implementation: sequences (token ids, or chained block hashes) by
    key, and for a query the longest indexed sequence it starts with.

    The capture (`kmesh_trace.capture.lineage`) indexes each finished request's prompt + output token
    ids; the analyses (`kmesh_trace.oracle.pressure.infer_exact_prefix_edges`) each request's cached
    chain of block hashes. Sequences are filed under (length, last element), so a query looks at only
    the lengths present and compares in full only the sequences that end as its own prefix does."""

    def __init__(self) -> None:
        self._seq: dict[Any, list] = {}
        self._by_end: dict[tuple[int, Any], list] = {}  # (length, last element) -> keys, oldest first
        self._lengths: dict[int, int] = {}  # length -> how many sequences have it

    def __contains__(self, key: Any) -> bool:
        return key in self._seq

    def get(self, key: Any) -> list | None:
        return self._seq.get(key)

    def add(self, key: Any, seq: list) -> None:
        """Index `seq` under `key` (an empty sequence is kept but never matches)."""
        self._seq[key] = seq
        if seq:
            self._by_end.setdefault((len(seq), seq[-1]), []).append(key)
            self._lengths[len(seq)] = self._lengths.get(len(seq), 0) + 1

    def remove(self, key: Any) -> None:
        seq = self._seq.pop(key)
        if not seq:
            return
        end = (len(seq), seq[-1])
        keys = self._by_end[end]
        keys.remove(key)
        if not keys:
            del self._by_end[end]
        self._lengths[len(seq)] -= 1
        if not self._lengths[len(seq)]:
            del self._lengths[len(seq)]

    def longest_prefix(self, query: list, *, max_len: int | None = None, accept=None,
                       latest: bool = False) -> tuple[Any, int] | None:
        """(key, length) of the longest indexed sequence of at most `max_len` elements (default: the
        query's) that `query` starts with and `accept(key)` allows; of equal ones, the oldest indexed
        (`latest`: the newest)."""
        limit = len(query) if max_len is None else min(max_len, len(query))
        for n in sorted((n for n in self._lengths if n <= limit), reverse=True):
            keys = self._by_end.get((n, query[n - 1]))
            if not keys:
                continue
            for key in (reversed(keys) if latest else keys):
                if (accept is None or accept(key)) and self._seq[key] == query[:n]:
                    return key, n
        return None
