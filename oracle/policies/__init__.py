"""Cache policies over a block access stream, registered in one place.

Each policy module implements the small `Policy` interface of `base` (a `replay(workload,
capacity_blocks) -> PolicyResult`) plus, for the simulators, a fast kernel over the `AccessStream` and a
plain reference implementation that tests compare it against. `POLICIES` is the registry every
analysis and the CLI read.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.policies.base import Policy, PolicyResult, Workload

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

__all__ = ["POLICIES", "Policy", "PolicyResult", "Workload", "get_policy"]


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise KmeshTraceError(f"unknown policy {name!r}; the policies are {', '.join(POLICIES)}.") from None
