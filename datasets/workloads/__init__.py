"""The registry of built-in workloads: every command taking `--scenario NAME` accepts these names.

A workload is a named builder returning a `BuiltWorkload` (the oracle's request stream plus the pool
geometry it is meant for). Adding one is one line in `WORKLOADS`:

    Workload("my-burst", "what it is, in one sentence", "kmesh_trace.some.module:build_function"),

The builder is named as "module:function" and imported only when the workload is used, so listing
the registry (e.g. for `--help`) costs nothing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from kmesh_trace.oracle.stream import RequestBlocks


@dataclass
class BuiltWorkload:
    requests: list[RequestBlocks]  # in arrival order
    block_size: int  # tokens per block
    num_usable_blocks: int  # the pool capacity the workload was designed for
    notes: list[str] = field(default_factory=list)  # what a reader must know about how it was built


@dataclass(frozen=True)
class Workload:
    name: str
    doc: str
    builder: str  # "module:function", the function taking no arguments and returning a BuiltWorkload

    def build(self) -> BuiltWorkload:
        module, _, fn = self.builder.partition(":")
        build: Callable[[], BuiltWorkload] = getattr(importlib.import_module(module), fn)
        return build()


_W = "kmesh_trace.datasets.workloads"

WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("fork-tree", "One 4,096-token ancestor and 5 children extending it by 512 tokens (16-token blocks).", f"{_W}.fork_tree:aligned"),
    Workload("fork-tree-unaligned", "The fork tree with a 4,101-token ancestor: each child recomputes 5 boundary tokens.", f"{_W}.fork_tree:unaligned"),
    Workload("hold-stress", "One family whose hold competes with unrelated reuse on 128 usable 16-token blocks.", f"{_W}.hold_stress:scale_1"),
    Workload("hold-stress-x2", "hold-stress with every token size doubled (32-token blocks), as a CPU engine runs it.", f"{_W}.hold_stress:scale_2"),
    Workload("agent", "The demo's agent workload (6 families, 24 competitors), parents' outputs as placeholders.", f"{_W}.agent:full"),
    Workload("family-burst", "Five children sent together, each extending one 48 MiB ancestor of 16 chunks (256-token blocks); `tiers` runs its lower-tier arms.", f"{_W}.family_burst:built"),
    Workload("agent-small", "The reduced agent workload the test suite runs (2 families, 6 competitors).", f"{_W}.agent:small"),
)}


def names() -> list[str]:
    return list(WORKLOADS)


def get(name: str) -> Workload:
    """The workload called `name`; an unknown name is one error listing the known ones."""
    from kmesh_trace.errors import KmeshTraceError

    try:
        return WORKLOADS[name]
    except KeyError:
        raise KmeshTraceError(f"unknown workload {name!r}; the built-in workloads are {', '.join(WORKLOADS)}.") from None
