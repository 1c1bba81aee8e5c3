"""What a tier configuration is: the lower tiers' specs, their restore costs, the GPU pool and the options.

The vocabularies (`TIER_NAMES`, `WRITE_POLICIES`, `LOOKUP_MODES`) and the checks that refuse a
configuration the model does not define live here, so every other module of the tier model reads a
checked `TierConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.schema import TierConnector, TierLookup, TierWrite, vocabulary

if TYPE_CHECKING:
    import numpy as np

__all__ = ["TIER_NAMES", "WRITE_POLICIES", "LOOKUP_MODES", "SIMPLE_CPU", "PrefillSeconds", "TierSpec", "RestoreCost",
           "TierConfig", "simple_cpu"]

TIER_NAMES = ("host", "ssd")
WRITE_POLICIES = vocabulary(TierWrite)
LOOKUP_MODES = vocabulary(TierLookup)
#: The one connector model: vLLM's SimpleCPUOffloadConnector (`kmesh_trace.oracle.tiers.simple_cpu`).
SIMPLE_CPU = TierConnector.simple_cpu.value


class PrefillSeconds(Protocol):
    """The prefill cost model's interface (`kmesh_trace.oracle.prefill_cost.PrefillCost`): seconds to
    compute prompt positions [start, end), elementwise over arrays."""

    def seconds_array(self, start: np.ndarray, end: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class TierSpec:
    """One lower tier. `capacity_blocks` counts GPU-sized blocks; `retain` False is read-once."""

    name: str
    capacity_blocks: int
    chunk_blocks: int = 1
    write: str = "on-evict"
    retain: bool = True

    def check(self) -> None:
        if self.name not in TIER_NAMES:
            raise KmeshTraceError(f"unknown tier {self.name!r}; the lower tiers are {', '.join(TIER_NAMES)}.")
        if self.write not in WRITE_POLICIES:
            raise KmeshTraceError(f"unknown write policy {self.write!r}; choose from {', '.join(WRITE_POLICIES)}.")
        if self.capacity_blocks < 0 or self.chunk_blocks <= 0:
            raise KmeshTraceError(f"the {self.name} tier needs a capacity >= 0 and a chunk of at least one block.")
        if self.write == "on-evict" and self.chunk_blocks != 1:
            raise KmeshTraceError(f"the {self.name} tier is on-evict, which stores the single blocks the GPU pool "
                                  "evicts; use one-block chunks or the write-through policy.")

    @property
    def num_chunks(self) -> int:
        return self.capacity_blocks // self.chunk_blocks


@dataclass(frozen=True)
class RestoreCost:
    """How long a tier takes to restore bytes into GPU memory: latency + bytes / throughput. `gbps_p95`
    (the throughput of a p95 restore) gives the pessimistic estimate; `source` says where it came from."""

    gbps: float
    latency_s: float = 0.0
    gbps_p95: float | None = None
    source: str = "flag"

    def seconds(self, nbytes: int, *, p95: bool = False) -> float:
        g = self.gbps_p95 if p95 and self.gbps_p95 else self.gbps
        return self.latency_s + nbytes / (g * 1e9)

    def to_dict(self) -> dict:
        return {"gbps": self.gbps, "gbps_p95": self.gbps_p95, "latency_s": self.latency_s, "source": self.source}


@dataclass(frozen=True)
class TierConfig:
    gpu_blocks: int
    tiers: tuple[TierSpec, ...] = ()
    singleflight: bool = False
    early_prep: bool = False
    prep_lead_s: float | None = None
    lookup: str = "any"
    #: "simple-cpu": reproduce vLLM's SimpleCPUOffloadConnector (eager mode) exactly; see `simple_cpu`.
    connector: str | None = None

    def check(self) -> None:
        if self.gpu_blocks <= 0:
            raise KmeshTraceError("the GPU tier needs a positive block count.")
        if self.connector not in (None, SIMPLE_CPU):
            raise KmeshTraceError(f"unknown connector model {self.connector!r}; the one modelled is simple-cpu.")
        if self.connector == SIMPLE_CPU and (
                len(self.tiers) != 1 or self.tiers[0].write != "write-through" or self.tiers[0].chunk_blocks != 1
                or not self.tiers[0].retain or self.lookup != "gpu-prefix" or self.singleflight or self.early_prep):
            raise KmeshTraceError("the simple-cpu connector model is one retained write-through tier of one-block "
                                  "chunks with gpu-prefix lookup, no singleflight and no early preparation; "
                                  "use simple_cpu(gpu_blocks, cpu_blocks).")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names) or names != sorted(names, key=TIER_NAMES.index):
            raise KmeshTraceError("give each lower tier once, host before ssd.")
        for t in self.tiers:
            t.check()
        if self.lookup not in LOOKUP_MODES:
            raise KmeshTraceError(f"unknown lookup mode {self.lookup!r}; choose from {', '.join(LOOKUP_MODES)}.")
        if self.prep_lead_s is not None and self.prep_lead_s < 0:
            raise KmeshTraceError("the early-preparation lead time must be >= 0 seconds.")

    @property
    def label(self) -> str:
        by = {t.name: t for t in self.tiers}
        return " ".join([f"gpu={self.gpu_blocks}"] + [f"{n}={by[n].capacity_blocks if n in by else '-'}"
                                                        for n in TIER_NAMES])


def simple_cpu(gpu_blocks: int, cpu_blocks: int, tier: str = "host") -> TierConfig:
    """vLLM's SimpleCPUOffloadConnector in eager mode (`vllm/v1/simple_kv_offload/manager.py`), sequential
    replays: a CPU block pool of `cpu_blocks` usable blocks; every full block a request computes or reuses
    is stored unless the pool already holds it (a store that finds it refreshes nothing); a load refreshes
    the blocks it reads; lookups only extend the GPU prefix. The stores issued in a request's last step and
    at its finish still hold their GPU blocks when the request's blocks are freed, so those blocks are
    freed after the others, in block order (the GPU pool's free-queue order changes accordingly). The
    connector's `disk` backend runs the same scheduler logic: model it as `tier="ssd"`.
    `kmesh_trace.oracle.tiers.connector` is its replay."""
    return TierConfig(gpu_blocks, (TierSpec(tier, cpu_blocks, write="write-through"),), lookup="gpu-prefix",
                      connector=SIMPLE_CPU)
