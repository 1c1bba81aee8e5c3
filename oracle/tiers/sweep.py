"""A host x SSD capacity sweep at one GPU capacity, and which configuration it recommends."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.stream import RequestBlocks
from kmesh_trace.oracle.tiers.config import TierConfig, TierSpec
from kmesh_trace.oracle.tiers.result import TierResult
from kmesh_trace.oracle.tiers.simulate import simulate_tiers, with_stream

__all__ = ["SweepResult", "sweep_configs", "sweep_tiers"]


@dataclass
class SweepResult:
    """Every (host, ssd) capacity pair at one GPU capacity; `metric` ranks them (higher is better)."""

    host_blocks: list[int]
    ssd_blocks: list[int]
    results: list[list[TierResult]]  # [host index][ssd index]
    metric: str  # prefill_seconds_saved or hit_tokens
    within_pct: float

    def value(self, r: TierResult) -> float:
        if self.metric == "prefill_seconds_saved":
            return r.prefill_seconds_saved()
        return float(r.hit_tokens)

    def grid(self) -> np.ndarray:
        return np.array([[self.value(r) for r in row] for row in self.results], dtype=float)

    def best(self) -> tuple[int, int]:
        g = self.grid()
        return tuple(int(x) for x in np.unravel_index(int(np.argmax(g)), g.shape))

    def smallest_within(self) -> tuple[int, int]:
        """The configuration with the fewest lower-tier blocks (host first on ties) whose metric is within
        `within_pct` percent of the best (of the best's distance from the GPU-only value, when the metric
        can be negative)."""
        g = self.grid()
        bi, bj = self.best()
        best = g[bi, bj]
        floor = best - abs(best) * self.within_pct / 100.0
        cands = [(self.host_blocks[a] + self.ssd_blocks[b], self.host_blocks[a], a, b)
                 for a in range(len(self.host_blocks)) for b in range(len(self.ssd_blocks)) if g[a, b] >= floor]
        _, _, a, b = min(cands)
        return a, b

    def to_dict(self) -> dict:
        bi, bj = self.best()
        si, sj = self.smallest_within()
        return {"metric": self.metric, "within_pct": self.within_pct, "host_blocks": self.host_blocks,
                "ssd_blocks": self.ssd_blocks, "grid": self.grid().tolist(),
                "best": self.results[bi][bj].config.label,
                "smallest_within": self.results[si][sj].config.label,
                "configurations": [r.to_dict() for row in self.results for r in row]}


def sweep_configs(base: TierConfig, host_blocks: Sequence[int], ssd_blocks: Sequence[int]) -> list[TierConfig]:
    """The configurations of a sweep, host-major: `base` at every (host, SSD) capacity pair (0: the tier is
    absent; a tier missing from `base` uses one-block on-evict chunks)."""
    by = {t.name: t for t in base.tiers}
    return [replace(base, tiers=tuple(replace(by.get(n, TierSpec(n, c)), capacity_blocks=c)
                                      for n, c in (("host", hb), ("ssd", sb)) if c > 0))
            for hb in host_blocks for sb in ssd_blocks]


def sweep_tiers(requests: Sequence[RequestBlocks], base: TierConfig, host_blocks: Sequence[int],
                ssd_blocks: Sequence[int], *, within_pct: float = 5.0, progress=None,
                simulate: Callable[[list[TierConfig]], list[TierResult]] | None = None, **kwargs) -> SweepResult:
    """`simulate_tiers` over host x SSD capacities (0: the tier is absent) at `base`'s GPU capacity; the
    other tier settings come from `base` (a tier missing there uses one-block on-evict chunks).
    `simulate(configs)`, when given, runs the configurations (e.g. as distributed tasks,
    `kmesh_trace.oracle.tiers.run.tiers_point`) and returns their results in order."""
    if within_pct < 0:
        raise KmeshTraceError("--within must be a percentage >= 0.")
    configs = sweep_configs(base, host_blocks, ssd_blocks)
    if simulate is not None:
        flat = simulate(configs)
    else:
        flat = []
        if "stream" not in kwargs and "block_size" in kwargs:
            kwargs = with_stream(kwargs, requests)
        for cfg in configs:
            flat.append(simulate_tiers(requests, cfg, **kwargs))
            if progress:
                progress(len(flat), len(configs))
    rows = [flat[i * len(ssd_blocks):(i + 1) * len(ssd_blocks)] for i in range(len(host_blocks))]
    with_seconds = all(r.prefill_seconds_saved() is not None for row in rows for r in row)
    return SweepResult(list(host_blocks), list(ssd_blocks), rows,
                       "prefill_seconds_saved" if with_seconds else "hit_tokens", within_pct)
