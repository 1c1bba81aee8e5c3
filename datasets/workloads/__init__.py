"""The registry of built-in workloads: every command taking `--scenario NAME` accepts these names.

A *scenario* is a named builder returning a `Workload` (`kmesh_trace.oracle.workload`: the oracle's
request stream plus the pool geometry it is meant for, and notes on how it was built). Adding one is
one line in `SCENARIOS`:

    Scenario("my-burst", "what it is, in one sentence", "kmesh_trace.some.module:build_function"),

The builder is named as "module:function" and imported only when the workload is used, so listing
the registry (e.g. for `--help`) costs nothing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from kmesh_trace.errors import KmeshTraceError

if TYPE_CHECKING:
    from kmesh_trace.oracle.workload import Workload


@dataclass(frozen=True)
class Scenario:
    name: str
    doc: str
    builder: str  # "module:function", the function taking no arguments and returning a Workload

    def build(self) -> Workload:
        module, _, fn = self.builder.partition(":")
        build: Callable[[], Workload] = getattr(importlib.import_module(module), fn)
        return build()


_W = "kmesh_trace.datasets.workloads"

SCENARIOS: dict[str, Scenario] = {w.name: w for w in (
    Scenario("fork-tree", "One 4,096-token ancestor and 5 children extending it by 512 tokens (16-token blocks).", f"{_W}.fork_tree:aligned"),
    Scenario("fork-tree-unaligned", "The fork tree with a 4,101-token ancestor: each child recomputes 5 boundary tokens.", f"{_W}.fork_tree:unaligned"),
    Scenario("hold-stress", "One family whose hold competes with unrelated reuse on 128 usable 16-token blocks.", f"{_W}.hold_stress:scale_1"),
    Scenario("hold-stress-x2", "hold-stress with every token size doubled (32-token blocks), as a CPU engine runs it.", f"{_W}.hold_stress:scale_2"),
    Scenario("agent", "The demo's agent workload (6 families, 24 competitors), parents' outputs as placeholders.", f"{_W}.agent:full"),
    Scenario("family-burst", "Five children sent together, each extending one 48 MiB ancestor of 16 chunks (256-token blocks); `tiers` runs its lower-tier arms.", f"{_W}.family_burst:built"),
    Scenario("agent-small", "The reduced agent workload the test suite runs (2 families, 6 competitors).", f"{_W}.agent:small"),
)}


def names() -> list[str]:
    return list(SCENARIOS)


def get(name: str) -> Scenario:
    """The scenario called `name`; an unknown name is one error listing the known ones."""
    try:
        return SCENARIOS[name]
    except KeyError:
        raise KmeshTraceError(f"unknown workload {name!r}; the built-in workloads are {', '.join(SCENARIOS)}.") from None
