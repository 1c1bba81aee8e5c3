"""`simulate_tiers`: one tier configuration over a request stream, with the replay its configuration asks for."""

from __future__ import annotations

from typing import Sequence

from kmesh_trace.oracle.stream import RequestBlocks, check_block_size
from kmesh_trace.oracle.tiers.config import SIMPLE_CPU, PrefillSeconds, RestoreCost, TierConfig
from kmesh_trace.oracle.tiers.connector import SimpleCPUReplay
from kmesh_trace.oracle.tiers.replay import TierReplay
from kmesh_trace.oracle.tiers.result import TierResult

__all__ = ["simulate_tiers"]


def simulate_tiers(requests: Sequence[RequestBlocks], config: TierConfig, *, block_size: int,
                   kv_bytes_per_token: int | None = None, costs: dict[str, RestoreCost] | None = None,
                   prefill: PrefillSeconds | None = None, timed: bool | None = None,
                   preload: dict[str, Sequence[int]] | None = None) -> TierResult:
    """Replay `requests` (arrival order) through the GPU pool and `config`'s lower tiers (the rules:
    `kmesh_trace.oracle.tiers`).

    `costs` maps tier names to restore costs (needed for waits, singleflight and TTFT); `preload` puts
    chunk keys (block hashes for one-block chunks) into a tier before the first request, oldest first.
    """
    block_size = check_block_size(block_size)
    config.check()
    if timed is None:
        timed = bool(requests) and all(r.arrival_ns is not None and r.finish_ns is not None for r in requests)
    replay = SimpleCPUReplay if config.connector == SIMPLE_CPU else TierReplay
    sim = replay(list(requests), block_size, config, kv_bytes_per_token, costs or {}, timed, preload or {})
    return sim.result(sim.run(), prefill)
