"""Lineage of finished requests: declared edges resolved to engine ids, exact-prefix edges inferred.

Declared parents are resolved by `kmesh_trace.lineage.ParentResolver`, the rule every analysis shares.

Runs in the capture's writer thread, never on the engine's hot path. Requests are fed in the
order they finished. A request is the exact-prefix child of an earlier finished request whose
entire prompt + output its own prompt starts with; of several such requests the longest (the
nearest ancestor) is the parent. Only the last `window` finished requests are remembered, so
memory stays bounded; the window is part of the capture configuration.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from kmesh_trace.lineage import ParentResolver, PrefixIndex, declared_edge
from kmesh_trace.schema import EdgeKind

def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class LineageIndex:
    """The last `window` finished requests' prompt + output token ids, in a `PrefixIndex`."""

    def __init__(self, window: int):
        self.window = window
        self._index = PrefixIndex()  # request id -> prompt + output token ids
        self._finish: dict[str, int | None] = {}
        self._order: deque[str] = deque()

    def add(self, request_id: str, seq: list[int], finish_ns: int | None) -> None:
        if request_id in self._index:
            return
        self._index.add(request_id, seq)
        self._finish[request_id] = finish_ns
        self._order.append(request_id)
        while len(self._order) > self.window:
            forgotten = self._order.popleft()
            self._index.remove(forgotten)
            self._finish.pop(forgotten, None)

    def sequence(self, request_id: str) -> list[int] | None:
        return self._index.get(request_id)

    def exact_prefix_parent(self, request_id: str, prompt: list[int], arrival_ns: int | None) -> tuple[str, int] | None:
        """The longest earlier-finished request whose prompt + output the prompt starts with."""

        def finished_before(rid: str) -> bool:
            finish = self._finish.get(rid)
            return rid != request_id and (arrival_ns is None or finish is None or finish <= arrival_ns)

        return self._index.longest_prefix(prompt, accept=finished_before)


def edges_for(index: LineageIndex, row: dict[str, Any], parents: ParentResolver) -> list[dict[str, Any]]:
    """Lineage rows for one finished invocation row (declared first, then exact-prefix)."""
    out = []
    rid = row["request_id"]
    prompt = row["prompt_token_ids"] or []
    declared = row["parent_id"]
    if declared is not None:
        edge = declared_edge(rid, declared, row["family_id"], parents)
        parent_rid = edge["parent_request_id"]
        if parent_rid is None and index.sequence(str(declared)) is not None:
            parent_rid = edge["parent_request_id"] = str(declared)  # an engine id the resolver has forgotten
        parent_seq = index.sequence(parent_rid) if parent_rid is not None else None
        if parent_seq is not None:
            edge["num_shared_tokens"] = _common_prefix_len(prompt, parent_seq)
        out.append(edge)
    found = index.exact_prefix_parent(rid, prompt, row["arrival_ns"])
    if found is not None:
        out.append({
            "child_request_id": rid,
            "parent_request_id": found[0],
            "declared_parent_id": None,
            "family_id": row["family_id"],
            "edge_kind": EdgeKind.exact_prefix.value,
            "num_shared_tokens": found[1],
        })
    return out
