"""Early preparation's schedule and staging area (the reads themselves are the replay's).

For each declared family, the parent is prepared when it finishes, or `prep_lead_s` seconds before its
first child arrives but not before the parent finishes (sequential replays: just before the first
child, entirely ahead of it). Blocks read ahead are staged outside the GPU pool's accounting and
dropped once every declared child of that parent has been admitted.
"""

from __future__ import annotations

import heapq

from kmesh_trace.oracle.tiers.config import TierConfig

__all__ = ["EarlyPrep"]


class EarlyPrep:
    """`staged`: block hash -> (done_ns, done_p95_ns, tier name), what the children may use."""

    __slots__ = ("timed", "children_left", "staged", "by_parent", "heap")

    def __init__(self, requests: list, config: TierConfig, timed: bool):
        self.timed = timed
        self.children_left: dict[int, int] = {}  # parent -> declared children not yet admitted
        self.staged: dict = {}
        self.by_parent: dict[int, list] = {}  # parent -> the hashes staged for its children
        self.heap: list = []  # (when: ns timed, request index sequential; parent)
        first_child: dict[int, int] = {}
        for i, r in enumerate(requests):
            if r.parent_index is not None:
                self.children_left[r.parent_index] = self.children_left.get(r.parent_index, 0) + 1
                first_child.setdefault(r.parent_index, i)
        lead = None if config.prep_lead_s is None else int(config.prep_lead_s * 1e9)
        for p, c in first_child.items():
            if timed:
                at = requests[p].finish_ns
                if lead is not None:
                    at = max(at, requests[c].arrival_ns - lead)
                heapq.heappush(self.heap, (at, p))
            else:
                heapq.heappush(self.heap, (c, p))

    def due(self, i: int, t: int) -> list[tuple[int, int | None]]:
        """(parent, when its reads are issued: ns, or None sequentially) of every preparation due before
        request `i` is looked up at `t`, in schedule order, skipping parents whose children are all in."""
        heap, out = self.heap, []
        while heap and heap[0][0] <= (t if self.timed else i):
            at, p = heapq.heappop(heap)
            if self.children_left.get(p, 0) > 0:
                out.append((p, at if self.timed else None))
        return out

    def is_parent(self, p: int | None) -> bool:
        return p in self.children_left

    def child_admitted(self, p: int) -> None:
        left = self.children_left[p] - 1
        self.children_left[p] = left
        if left <= 0:
            for h in self.by_parent.pop(p, ()):
                self.staged.pop(h, None)
