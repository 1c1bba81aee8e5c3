"""`simulate_tiers`: one tier configuration over a request stream, with the replay its configuration asks for."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kmesh_trace.oracle.blockpool import compiled_pool_result
from kmesh_trace.oracle.stream import RequestBlocks, check_block_size
from kmesh_trace.oracle.tiers.compiled import replay_tiers_compiled, tier_stream
from kmesh_trace.oracle.tiers.config import SIMPLE_CPU, PrefillSeconds, RestoreCost, TierConfig
from kmesh_trace.oracle.tiers.connector import SimpleCPUReplay
from kmesh_trace.oracle.tiers.replay import TierReplay
from kmesh_trace.oracle.tiers.result import TierReads, TierResult, tier_result
from kmesh_trace.values import token_bytes

__all__ = ["simulate_tiers", "with_stream"]


def simulate_tiers(requests: Sequence[RequestBlocks], config: TierConfig, *, block_size: int,
                   kv_bytes_per_token: int | None = None, costs: dict[str, RestoreCost] | None = None,
                   prefill: PrefillSeconds | None = None, timed: bool | None = None,
                   preload: dict[str, Sequence[int]] | None = None, stream=None) -> TierResult:
    """Replay `requests` (arrival order) through the GPU pool and `config`'s lower tiers (the rules:
    `kmesh_trace.oracle.tiers`).

    `costs` maps tier names to restore costs (needed for waits, singleflight and TTFT); `preload` puts
    chunk keys (block hashes for one-block chunks) into a tier before the first request, oldest first.

    The replay runs compiled (`kmesh_trace.oracle.tiers.compiled`, tested equal to `TierReplay`, the
    reference) for every configuration, early preparation included, but the simple-cpu connector, which
    runs the Python `SimpleCPUReplay`; so do streams whose hashes are not 64-bit unsigned integers. `stream`, the requests' `TierStream` (`kmesh_trace.oracle.tiers.compiled.
    tier_stream`) when the caller replays several configurations over them, saves building it again.
    """
    block_size = check_block_size(block_size)
    config.check()
    if timed is None:
        timed = bool(requests) and all(r.arrival_ns is not None and r.finish_ns is not None for r in requests)
    requests, costs, preload = list(requests), costs or {}, preload or {}
    if kv_bytes_per_token:
        _check_read_bytes(requests, config, block_size, kv_bytes_per_token)
    if config.connector is None:
        done = _compiled(requests, config, block_size, kv_bytes_per_token, costs, prefill, timed, preload, stream)
        if done is not None:
            return done
    replay = SimpleCPUReplay if config.connector == SIMPLE_CPU else TierReplay
    sim = replay(requests, block_size, config, kv_bytes_per_token, costs, timed, preload)
    return sim.result(sim.run(), prefill)


def _compiled(requests, config, block_size, kv_bytes_per_token, costs, prefill, timed, preload,
              stream) -> TierResult | None:
    """The compiled replay's TierResult (`kmesh_trace.oracle.tiers.compiled`), or None when it cannot take
    the stream (hashes that are not 64-bit unsigned integers)."""
    if stream is None or stream.block_size != block_size or len(stream.requests) != len(requests):
        stream = tier_stream(requests, block_size)
    out = None if stream is None else replay_tiers_compiled(
        stream, config, costs, timed, preload, block_size * kv_bytes_per_token if kv_bytes_per_token else 0)
    if out is None:
        return None
    pool = compiled_pool_result(requests, block_size, config.gpu_blocks, timed, *out.pool, [])
    names = [t.name for t in config.tiers]
    with_costs = all(costs.get(n) is not None for n in names)
    looked = np.flatnonzero(out.marks >= 0)
    return tier_result(
        config, block_size, kv_bytes_per_token, timed, pool, prefill, requests,
        hit={"gpu": out.hit[0], **{n: out.hit[1 + k] for k, n in enumerate(names)}},
        wait=out.wait0 if with_costs else None, wait95=out.wait1 if with_costs else None,
        reads=TierReads(names, *out.reads),
        num_reads=dict(zip(names, out.num_reads.tolist())), read_bytes=dict(zip(names, out.read_bytes.tolist())),
        num_stores=dict(zip(names, out.num_stores.tolist())),
        store_marks=(looked, out.marks[looked]) if names else {},
        num_needed=out.num_needed, num_shared=out.num_shared)


def _check_read_bytes(requests: list[RequestBlocks], config: TierConfig, block_size: int,
                      kv_bytes_per_token: int) -> None:
    """Refuse, in one sentence, KV bytes per token at which the most the replay could read (every block of every
    request, plus a whole chunk per request) would not fit its int64 byte counters."""
    chunk = max((t.chunk_blocks for t in config.tiers), default=1)
    blocks = sum(len(r.prompt_hashes) + len(r.output_hashes) for r in requests) + chunk * len(requests)
    token_bytes(blocks * block_size, kv_bytes_per_token, "the blocks the tiers could read")


def with_stream(kw: dict, requests) -> dict:
    """`simulate_tiers`'s keywords with the requests' compiled stream (`TierStream`), built once for the
    configurations replayed over them in this process."""
    return {**kw, "stream": tier_stream(requests, kw["block_size"])}
