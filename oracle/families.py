"""Request families: which requests of a workload belong together, the one code fleet routing, the
retention what-if and the workload share.

A family is a request's declared `family_id`, else the tree of parent edges (child index -> parent
index) it is in. The edges are the declared parents, the trace's lineage rows, or those inferred from
block hashes (`infer_exact_prefix_edges`). Two namings of the same families, picked by `naming`:

- `"routing"` (fleet): every request has a key; `family:<id>` for a declared family (when the
  declared ids are used), else the key of its parent, else `root:<index>`;
- `"lineage"` (pressure, as `lineage` names them): only requests with a declared family or an edge
  have one; the declared family id, else `root:` + the request id of its edge tree's root.
"""

from __future__ import annotations

from typing import Literal, Sequence

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.lineage import PrefixIndex
from kmesh_trace.oracle.stream import RequestBlocks
from kmesh_trace.schema import FleetEdges, vocabulary

__all__ = ["EDGE_MODES", "families", "family_keys", "infer_exact_prefix_edges"]

#: The edge modes `families` accepts (`FleetEdges`).
EDGE_MODES = vocabulary(FleetEdges)


def infer_exact_prefix_edges(requests: Sequence[RequestBlocks], block_size: int) -> dict[int, int]:
    """child index -> parent index: the earlier request with the longest cached chain (its full prompt
    blocks, then the full generated blocks the stream identifies) that is a proper prefix of the
    child's full prompt blocks; the latest such request on ties. Block-granular: a parent's partial
    tail block is not compared. The inference is `kmesh_trace.lineage.PrefixIndex`, the capture's own,
    over chained block hashes (equal hashes at a position mean equal prefixes; checked anyway)."""
    index = PrefixIndex()
    edges: dict[int, int] = {}
    for r in requests:
        n_full = r.num_full_prompt_blocks(block_size)
        mine = r.prompt_hashes[:n_full]
        found = index.longest_prefix(mine, max_len=len(mine) - 1, latest=True)
        if found is not None:
            edges[r.index] = found[0]
        chain = list(mine)
        if len(chain) == n_full:
            chain += r.output_hashes
        index.add(r.index, chain)
    return edges


def family_keys(requests: Sequence[RequestBlocks], edges: dict[int, int], *,
                naming: Literal["routing", "lineage"], declared_ids: bool = True) -> dict[int, str]:
    """Request index -> family key over the parent `edges` (child index -> parent index), named as
    `naming` says (the module's docstring); `declared_ids`: a declared `family_id` names the family
    (the routing naming ignores them for inferred edges)."""
    out: dict[int, str] = {}
    if naming == "routing":
        for i, r in enumerate(requests):
            p = edges.get(i)
            if declared_ids and r.family_id is not None:
                out[i] = f"family:{r.family_id}"
            elif p is not None and p < i:
                out[i] = out[p]
            else:
                out[i] = f"root:{i}"
        return out
    has_children = set(edges.values())
    root: dict[int, int] = {}
    for r in requests:  # arrival order: a parent is always earlier than its child
        i = r.index
        root[i] = root.get(edges[i], edges[i]) if i in edges else i
        if declared_ids and r.family_id is not None:
            out[i] = r.family_id
        elif i in edges or i in has_children:
            out[i] = f"root:{requests[root[i]].request_id}"
    return out


def families(workload, edges: str = "auto") -> tuple[list[str], str]:
    """(family key per request in the routing naming, where the families came from: declared or
    inferred), kept on the workload (`Workload.derived`)."""
    if edges not in EDGE_MODES:
        raise KmeshTraceError(f"unknown edge mode {edges!r}; use one of {', '.join(EDGE_MODES)}.")
    if edges == "auto":
        declared = any(r.family_id is not None or r.parent_index is not None for r in workload.requests)
        edges = "declared" if declared else "inferred"
    key = ("families", edges)
    if key not in workload.derived:
        requests = workload.requests
        if edges == "declared":
            parent = {i: r.parent_index for i, r in enumerate(requests) if r.parent_index is not None}
        else:
            parent = infer_exact_prefix_edges(list(requests), workload.block_size)
        keys = family_keys(requests, parent, naming="routing", declared_ids=edges == "declared")
        workload.derived[key] = ([keys[i] for i in range(len(requests))], edges)
    return workload.derived[key]
