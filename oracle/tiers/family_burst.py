"""The `baseline`, `singleflight` and `retention` arms of the `family-burst` scenario
(`kmesh_trace.datasets.workloads.family_burst`): one ancestor in the SSD tier, its children at once."""

from __future__ import annotations

import numpy as np

from kmesh_trace.oracle.tiers.config import PrefillSeconds, RestoreCost, TierConfig, TierSpec
from kmesh_trace.oracle.tiers.simulate import simulate_tiers

__all__ = ["family_burst_arms"]


def family_burst_arms(burst, *, costs: dict[str, RestoreCost] | None = None,
                      prefill: PrefillSeconds | None = None) -> list[dict]:
    """The `baseline`, `singleflight` and `retention` arms of a `datasets.workloads.family_burst.FamilyBurst`."""
    n = len(burst.ancestor_hashes)
    ssd = TierSpec("ssd", n)
    arms = {
        "baseline": (TierConfig(burst.gpu_blocks, (ssd,)), {"ssd": burst.ancestor_hashes}),
        "singleflight": (TierConfig(burst.gpu_blocks, (ssd,), singleflight=True), {"ssd": burst.ancestor_hashes}),
        "retention": (TierConfig(burst.gpu_blocks, (TierSpec("host", n), ssd)),
                      {"host": burst.ancestor_hashes, "ssd": burst.ancestor_hashes}),
    }
    out = []
    for name, (config, preload) in arms.items():
        r = simulate_tiers(burst.requests, config, block_size=burst.block_size,
                           kv_bytes_per_token=burst.kv_bytes_per_token, costs=costs, prefill=prefill,
                           timed=True, preload=preload)
        d = r.to_dict()
        waits = r.restore_wait_s
        out.append({"arm": name, "num_lower_tier_reads": d["num_lower_tier_reads"],
                    "lower_tier_read_bytes": d["lower_tier_read_bytes"], "num_reads_by_tier": d["num_reads_by_tier"],
                    "read_bytes_by_tier": d["read_bytes_by_tier"], "num_shared_reads": d["num_shared_reads"],
                    "read_amplification": d["read_amplification"], "hit_tokens_by_tier": d["hit_tokens_by_tier"],
                    "restore_wait_p50_s": None if waits is None else float(np.percentile(waits, 50)),
                    "restore_wait_max_s": None if waits is None else float(waits.max()),
                    "ttft": d["ttft"]})
    return out
