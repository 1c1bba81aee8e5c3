"""The capture's lineage inference (capture/lineage.py): exact-prefix parents, the window, declared edges."""

from __future__ import annotations

from kmesh_trace.capture.lineage import LineageIndex, edges_for
from kmesh_trace.lineage import ParentResolver


def test_exact_prefix_parent_is_the_longest_earlier_finished_prefix():
    idx = LineageIndex(window=10)
    base = list(range(1, 40))
    idx.add("a", base[:20], finish_ns=10)
    idx.add("b", base[:30], finish_ns=20)
    idx.add("short", [1, 2, 3], finish_ns=5)  # a short prefix is a parent too
    idx.add("late", base[:35], finish_ns=1000)  # finished after the child arrived: not a parent
    assert idx.exact_prefix_parent("c", base + [99], arrival_ns=100) == ("b", 30)
    assert idx.exact_prefix_parent("c", [1, 2, 3, 4], arrival_ns=100) == ("short", 3)
    assert idx.exact_prefix_parent("c", [1, 2, 4], arrival_ns=100) is None
    assert idx.exact_prefix_parent("b", base[:30], arrival_ns=100) == ("a", 20)  # never itself


def test_lineage_window_forgets_the_oldest():
    idx = LineageIndex(window=2)
    idx.add("a", [5] * 20, None)
    idx.add("b", [6] * 20, None)
    idx.add("c", [7] * 20, None)
    assert idx.sequence("a") is None and idx.exact_prefix_parent("x", [5] * 25, None) is None
    assert idx.exact_prefix_parent("x", [7] * 25, None) == ("c", 20)


def test_declared_edge_resolves_the_caller_id_and_counts_shared_tokens():
    idx = LineageIndex(window=10)
    idx.add("p-1234abcd", [1, 2, 3, 4, 5], None)
    row = {"request_id": "c-00000000", "prompt_token_ids": [1, 2, 3, 9], "parent_id": "p", "family_id": "f",
           "arrival_ns": None}
    parents = ParentResolver()
    parents.add("p-1234abcd", "p")
    assert edges_for(idx, row, parents) == [{
        "child_request_id": "c-00000000", "parent_request_id": "p-1234abcd", "declared_parent_id": "p",
        "family_id": "f", "edge_kind": "declared", "num_shared_tokens": 3}]
    row["parent_id"] = "unknown"
    assert edges_for(idx, row, ParentResolver())[0]["parent_request_id"] is None

