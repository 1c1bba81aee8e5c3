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

from kmesh_trace.lineage import ParentResolver, declared_edge

#: Finished sequences are indexed by their first HEAD tokens (or all of them, when shorter).
HEAD = 16


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
    def __init__(self, window: int):
        self.window = window
        self._seq: dict[str, list[int]] = {}  # request id -> prompt + output token ids
        self._finish: dict[str, int | None] = {}
        self._by_head: dict[tuple, list[str]] = {}
        self._short_lens: dict[int, int] = {}  # lengths < HEAD present in the index, with counts
        self._order: deque[str] = deque()

    def _head(self, seq: list[int]) -> tuple:
        return tuple(seq[:HEAD])

    def add(self, request_id: str, seq: list[int], finish_ns: int | None) -> None:
        if request_id in self._seq:
            return
        self._seq[request_id] = seq
        self._finish[request_id] = finish_ns
        self._by_head.setdefault(self._head(seq), []).append(request_id)
        if len(seq) < HEAD:
            self._short_lens[len(seq)] = self._short_lens.get(len(seq), 0) + 1
        self._order.append(request_id)
        while len(self._order) > self.window:
            self._forget(self._order.popleft())

    def _forget(self, request_id: str) -> None:
        seq = self._seq.pop(request_id)
        self._finish.pop(request_id, None)
        head = self._head(seq)
        ids = self._by_head[head]
        ids.remove(request_id)
        if not ids:
            del self._by_head[head]
        if len(seq) < HEAD:
            self._short_lens[len(seq)] -= 1
            if not self._short_lens[len(seq)]:
                del self._short_lens[len(seq)]

    def sequence(self, request_id: str) -> list[int] | None:
        return self._seq.get(request_id)

    def exact_prefix_parent(self, request_id: str, prompt: list[int], arrival_ns: int | None) -> tuple[str, int] | None:
        """The longest earlier-finished request whose prompt + output the prompt starts with."""
        heads = [tuple(prompt[:HEAD])] if len(prompt) >= HEAD else []
        heads += [tuple(prompt[:n]) for n in self._short_lens if n <= len(prompt)]
        best: tuple[str, int] | None = None
        for head in heads:
            for rid in self._by_head.get(head, ()):
                if rid == request_id:
                    continue
                seq = self._seq[rid]
                n = len(seq)
                if n == 0 or n > len(prompt) or (best is not None and n <= best[1]):
                    continue
                finish = self._finish.get(rid)
                if arrival_ns is not None and finish is not None and finish > arrival_ns:
                    continue
                if prompt[:n] == seq:
                    best = (rid, n)
        return best


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
            "edge_kind": "exact_prefix",
            "num_shared_tokens": found[1],
        })
    return out
