"""Cache policies over a block access stream, registered in one place.

Each policy module implements the small `Policy` interface of `base` (a `replay(workload,
capacity_blocks) -> PolicyResult`) plus, for the simulators, a fast kernel over the `AccessStream` and a
plain reference implementation that tests compare it against. `POLICIES` is the registry every
analysis and the CLI read; `replay_point` replays one of them at one capacity, on a hybrid engine's
workload as docs/DESIGN.md ("Hybrid models") defines it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.hybrid_pool import position_capacity
from kmesh_trace.oracle.policies.base import Policy, PolicyResult, Workload, result_of

#: name -> (module under kmesh_trace.oracle.policies, class), in the order analyses list them.
_CLASSES = {"infinite": ("infinite", "Infinite"), "lru": ("lru", "LRU"), "vllm": ("vllm", "VLLM"),
            "belady": ("belady", "Belady"), "belady-prefix": ("belady_prefix", "BeladyPrefix")}


class _Registry(Mapping):
    """The policies by name. A policy's module, and the compiled kernels it binds (C), is imported
    when the policy is first looked up, so that naming or checking policies costs no compiler."""

    def __init__(self):
        self._made: dict[str, Policy] = {}

    def __getitem__(self, name: str) -> Policy:
        policy = self._made.get(name)
        if policy is None:
            module, cls = _CLASSES[name]
            policy = getattr(importlib.import_module(f"{__name__}.{module}"), cls)()
            self._made[name] = policy
        return policy

    def __iter__(self) -> Iterator[str]:
        return iter(_CLASSES)

    def __len__(self) -> int:
        return len(_CLASSES)

    def __contains__(self, name: object) -> bool:
        return name in _CLASSES


POLICIES: Mapping[str, Policy] = _Registry()

__all__ = ["POLICIES", "Policy", "PolicyResult", "Workload", "get_policy", "replay_point"]


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise KmeshTraceError(f"unknown policy {name!r}; the policies are {', '.join(POLICIES)}.") from None

def replay_point(workload: Workload, policy: str, capacity: int) -> PolicyResult:
    """`policy` at `capacity` blocks. On a hybrid engine's workload, the `vllm` policy replays the hybrid
    pool; every other policy replays the prefix positions at `hybrid_pool.position_capacity` (a position
    needs a block in every full-attention group; windowed groups are counted free, so a bound stays a
    bound), reported at the pool's `capacity`."""
    if not workload.hybrid or policy == "vllm":
        return get_policy(policy).simulate(workload, capacity)
    positions = position_capacity(workload.groups, capacity)
    if positions == 0:  # not one position's blocks in every full-attention group: no hit
        stream = workload.stream
        return result_of(policy, capacity, stream, np.zeros(stream.num_requests, np.int64), 0)
    res = get_policy(policy).simulate(workload, positions)
    res.capacity_blocks = capacity
    return res
