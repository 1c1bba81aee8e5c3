"""The family-hold admission rule, shared by the what-if model (`kmesh_trace.oracle.blockpool`) and
the live controller in the engine (`kmesh_trace.capture.hold`), so the prediction and the engine
cannot drift apart. Standard library only: the engine process imports it.
"""

from __future__ import annotations

from collections.abc import Mapping


def hold_status(*, remaining_children: int, num_blocks: int, num_held_refs: int, max_held_blocks: int | None,
                family: str, family_refs: Mapping[str, int], max_families: int | None) -> str:
    """What happens to a parent's hold when it finishes: taken, or why not.

    not_needed (every expected child was admitted already), empty (no full block to hold),
    refused_blocks (the held-block cap would be exceeded), refused_families (a new family would
    exceed the family cap; `family_refs` maps families with an active hold to their references)."""
    if remaining_children <= 0:
        return "not_needed"
    if not num_blocks:
        return "empty"
    if max_held_blocks is not None and num_held_refs + num_blocks > max_held_blocks:
        return "refused_blocks"
    if max_families is not None and family not in family_refs and len(family_refs) + 1 > max_families:
        return "refused_families"
    return "taken"
