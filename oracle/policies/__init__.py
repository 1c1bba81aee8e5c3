"""Cache policies over a block access stream, registered in one place.

Each policy module implements the small `Policy` interface of `base` (a `replay(workload,
capacity_blocks) -> PolicyResult`) plus, for the simulators, a fast kernel over the `AccessStream` and a
plain reference implementation that tests compare it against. `POLICIES` is the registry every
analysis and the CLI read.
"""

from __future__ import annotations

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.policies.base import Policy, PolicyResult, Workload
from kmesh_trace.oracle.policies.belady import Belady
from kmesh_trace.oracle.policies.belady_prefix import BeladyPrefix
from kmesh_trace.oracle.policies.infinite import Infinite
from kmesh_trace.oracle.policies.lru import LRU
from kmesh_trace.oracle.policies.vllm import VLLM

POLICIES: dict[str, Policy] = {p.name: p for p in (Infinite(), LRU(), VLLM(), Belady(), BeladyPrefix())}

__all__ = ["POLICIES", "Policy", "PolicyResult", "Workload", "get_policy"]


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise KmeshTraceError(f"unknown policy {name!r}; the policies are {', '.join(POLICIES)}.") from None
