"""Tiered capacity planning: what host-memory and SSD tiers below the GPU pool buy, and what restoring costs.

This package owns the tier simulation (docs/DESIGN.md "Tiers"); this docstring holds its rules. The GPU tier is the vLLM block-pool model of
`kmesh_trace.oracle.blockpool`, unchanged (but for the `simple-cpu` connector model, below): a block
restored from a lower tier is allocated and cached in the pool exactly as if it had been recomputed, so
the pool evolves as in the single-tier `vllm` model and, with every lower tier absent, the results equal
that model's row of `headroom` exactly. The lower tiers observe the replay:

- **Tiers**: `host` then `ssd`, each optional, each an LRU over *chunks* of `chunk_blocks` consecutive
  blocks (1 by default; LMCache's 256-token chunks are 256 // block_size). A chunk is keyed by the chained
  hash of its last block, so equal keys mean an equal whole prefix; a chunk exists only once all its blocks
  are full. Capacities are in blocks (a tier holds capacity // chunk_blocks chunks).
- **Writes**: `on-evict` (one-block chunks only): a block the GPU pool evicts is stored in the highest
  on-evict tier, and a chunk an on-evict tier's LRU evicts moves down to the next on-evict tier, as vLLM's
  CPU offloading offloads what the pool lets go. `write-through`: at admission, every full block the
  request will hold (its prompt, hits included, and its generated blocks) is stored in the tier, or
  refreshed when already there, as LMCache stores a request's chunks.
- **Reads**: `retain` keeps a chunk after a load (refreshed in its LRU: on-evict tiers only, since a
  write-through tier is refreshed by the store pass that follows); read-once removes it.
- **Lookup**: block by block from the first block the GPU prefix lookup missed: the GPU pool (`any` mode;
  `gpu-prefix` skips it, as vLLM's connectors only extend the local prefix), then a block staged by early
  preparation, then each lower tier in order. The walk stops at the first block found nowhere: a prefix
  cache cannot use a block whose ancestor it must recompute. At most (prompt tokens - 1) // block_size
  blocks are looked up, as vLLM always computes the last prompt token. A request reads each chunk it
  needs once; bytes read count whole chunks, so a partly needed chunk amplifies reads.
- **Timing** (with arrival and finish times on every request): a request issues its reads when it is
  admitted (its arrival, unless the pool made it wait for finishes); a tier serves reads one after
  another, across requests (latency, then bytes / throughput, cumulatively). A block
  restored into the GPU is usable from its read's completion: a later request that finds it in the pool
  before then either waits for it (`singleflight`: concurrent needs of one chunk share one read) or, as
  vLLM does (it caches restored blocks only once the load finishes), looks it up below and reads it again.
- **Early preparation** (`early_prep`): for each declared family, when the parent finishes (or `lead`
  seconds before its first child arrives, not before the parent finishes) the ancestor's blocks that the
  GPU pool no longer holds are read from the lower tiers into a staging area outside the pool's
  accounting; the children use them, waiting only for what is still in flight. Staged blocks are dropped
  once every declared child of that parent has been admitted.
- **vLLM's own offloading**: `simple_cpu(gpu_blocks, cpu_blocks)` configures the model to reproduce vLLM's
  SimpleCPUOffloadConnector in eager mode (sequential replays), request by request, GPU free-queue order
  included (tests/test_tiers_vllm.py drives vLLM's real scheduler and connector against it).
- **Monotonicity**: in a sequential replay, more capacity in an LRU tier never lowers the hit tokens
  (tests/test_tiers.py checks it). A timed replay can lose a few: a larger tier restores a block that a
  concurrent request would otherwise have found recomputed in the pool, and a restore is not usable
  until it completes (singleflight removes the effect).
- **Costs**: bytes = blocks x block_size x kv bytes per token; a request's restore wait is the latest
  completion among the chunks it needs, minus its arrival (or the sum of its read durations, untimed);
  its estimated time to first token = restore wait + the prefill cost of the tokens it recomputes; the
  prefill seconds saved net of restores compare with the GPU-only replay of the same pool.

The modules, one job each: `config` (specs, costs, configurations and their checks), `store` (the one
LRU store), `timing` (when reads complete), `prep` (early preparation's schedule and staging),
`replay` (the pool replay's hooks: lookup steps, offloading, write-through stores: the reference),
`compiled` (the same replay in C, native/kernels/tiers.c, what `simulate_tiers` runs but for the connector), `connector` (the simple-cpu connector as a replay strategy), `simulate` (`simulate_tiers`), `result`, `sweep`,
`family_burst` (the scenario's arms), `run` (`run(input, options)`: what `kmesh-trace tiers` calls) and
`render` (its human output, from the JSON).
"""

from kmesh_trace.oracle.tiers.config import (
    LOOKUP_MODES,
    TIER_NAMES,
    WRITE_POLICIES,
    PrefillSeconds,
    RestoreCost,
    TierConfig,
    TierSpec,
    simple_cpu,
)
from kmesh_trace.oracle.tiers.family_burst import family_burst_arms
from kmesh_trace.oracle.tiers.result import TierRead, TierResult
from kmesh_trace.oracle.tiers.run import ArmsReport, TiersOptions, TiersReport, run, run_family_burst, workload_of
from kmesh_trace.oracle.tiers.simulate import simulate_tiers
from kmesh_trace.oracle.tiers.sweep import SweepResult, sweep_tiers

__all__ = ["simple_cpu", "TierSpec", "RestoreCost", "TierConfig", "TierResult", "TierRead", "PrefillSeconds",
           "simulate_tiers", "sweep_tiers", "SweepResult", "family_burst_arms", "TIER_NAMES", "WRITE_POLICIES",
           "LOOKUP_MODES", "run", "run_family_burst", "TiersOptions", "TiersReport", "ArmsReport",
           "workload_of"]
