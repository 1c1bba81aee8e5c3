"""Tiered capacity planning: what host-memory and SSD tiers below the GPU pool buy, and what restoring costs.

It owns the tier simulation (docs/DESIGN.md "Tiers"). The GPU tier is the vLLM block-pool model of
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
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence

import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.blockpool import PoolReplay, PoolResult
from kmesh_trace.oracle.stream import RequestBlocks, check_block_size, num_cached_blocks

__all__ = ["simple_cpu", "TierSpec", "RestoreCost", "TierConfig", "TierResult", "TierRead", "PrefillSeconds",
           "simulate_tiers", "sweep_tiers", "SweepResult", "family_burst_arms", "TIER_NAMES", "WRITE_POLICIES",
           "LOOKUP_MODES"]

TIER_NAMES = ("host", "ssd")
WRITE_POLICIES = ("on-evict", "write-through")
LOOKUP_MODES = ("any", "gpu-prefix")


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
        if self.connector not in (None, "simple-cpu"):
            raise KmeshTraceError(f"unknown connector model {self.connector!r}; the one modelled is simple-cpu.")
        if self.connector == "simple-cpu" and (
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
    connector's `disk` backend runs the same scheduler logic: model it as `tier="ssd"`."""
    return TierConfig(gpu_blocks, (TierSpec(tier, cpu_blocks, write="write-through"),), lookup="gpu-prefix",
                      connector="simple-cpu")


@dataclass(slots=True)
class TierRead:
    """One read issued to a lower tier: a request's (or an early preparation's) chunks from one tier."""

    request_index: int
    tier: str
    num_chunks: int
    num_bytes: int
    prepare: bool = False  # issued by early preparation, ahead of the children


@dataclass
class TierResult:
    """Per-request outcome of one tier configuration, in arrival order, and the totals derived from it."""

    config: TierConfig
    block_size: int
    kv_bytes_per_token: int | None
    pool: PoolResult  # the GPU tier's own replay (identical to the single-tier `vllm` model)
    hit_blocks_by_tier: dict[str, np.ndarray]  # "gpu", "host", "ssd" -> int64 per request
    restore_wait_s: np.ndarray | None  # per request; None without restore costs
    restore_wait_p95_s: np.ndarray | None
    reads: list[TierRead]
    num_chunk_reads: dict[str, int]
    read_bytes: dict[str, int]
    distinct_blocks_needed: int  # distinct blocks ever served from a lower tier
    num_shared_reads: int  # chunk needs served by another request's in-flight read (singleflight)
    num_stores: dict[str, int]
    is_child: np.ndarray  # bool per request: has a declared parent
    stores_per_request: np.ndarray | None = None  # lower-tier stores made while each request ran (sequential)
    prefill: PrefillSeconds | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return len(self.pool.num_prompt_tokens)

    @property
    def hit_blocks(self) -> np.ndarray:
        return sum(self.hit_blocks_by_tier.values())

    @property
    def hit_tokens_per_request(self) -> np.ndarray:
        p = self._prompt_tokens()
        return np.minimum(self.hit_blocks * self.block_size, np.maximum(p - 1, 0))

    def hit_tokens_by_tier(self) -> dict[str, int]:
        return {k: int(v.sum()) * self.block_size for k, v in self.hit_blocks_by_tier.items()}

    @property
    def hit_tokens(self) -> int:
        return int(self.hit_tokens_per_request.sum())

    @property
    def recomputed_tokens(self) -> int:
        return int(sum(self.pool.num_prompt_tokens)) - self.hit_tokens

    @property
    def block_bytes(self) -> int | None:
        return None if self.kv_bytes_per_token is None else self.block_size * self.kv_bytes_per_token

    @property
    def read_amplification(self) -> float | None:
        need = self.distinct_blocks_needed * (self.block_bytes or 0)
        return sum(self.read_bytes.values()) / need if need else None

    def ttft_s(self, *, p95_restore: bool = False) -> np.ndarray | None:
        """Estimated time to first token per request: restore wait + prefill of the recomputed tokens."""
        wait = self.restore_wait_p95_s if p95_restore else self.restore_wait_s
        if self.prefill is None or wait is None:
            return None
        return wait + self.prefill.seconds_array(self.hit_tokens_per_request, self._prompt_tokens())

    def prefill_seconds_saved(self) -> float | None:
        """Prefill seconds this configuration saves against the GPU tier alone, net of restore waits."""
        if self.prefill is None or self.restore_wait_s is None:
            return None
        p = self._prompt_tokens()
        base = np.minimum(np.asarray(self.pool.hit_blocks, np.int64) * self.block_size, np.maximum(p - 1, 0))
        pre = self.prefill.seconds_array
        saved = pre(base, p) - pre(self.hit_tokens_per_request, p)
        return float(saved.sum() - self.restore_wait_s.sum())

    def _prompt_tokens(self) -> np.ndarray:
        return np.asarray(self.pool.num_prompt_tokens, np.int64)

    def to_dict(self) -> dict:
        ttft = self.ttft_s()
        groups = {}
        if ttft is not None:
            for name, mask in (("children", self.is_child), ("others", ~self.is_child)):
                v = ttft[mask]
                groups[name] = ({"num_requests": int(mask.sum()), "p50_s": float(np.percentile(v, 50)),
                                 "p95_s": float(np.percentile(v, 95))} if len(v) else
                                {"num_requests": 0, "p50_s": None, "p95_s": None})
        by = {t.name: t for t in self.config.tiers}
        return {
            "label": self.config.label,
            "gpu_blocks": self.config.gpu_blocks,
            "tiers": [{"name": t.name, "capacity_blocks": t.capacity_blocks, "chunk_blocks": t.chunk_blocks,
                       "write": t.write, "retain": t.retain} for t in self.config.tiers],
            "host_blocks": by["host"].capacity_blocks if "host" in by else None,
            "ssd_blocks": by["ssd"].capacity_blocks if "ssd" in by else None,
            "singleflight": self.config.singleflight, "early_prep": self.config.early_prep,
            "prep_lead_s": self.config.prep_lead_s, "lookup": self.config.lookup, "connector": self.config.connector,
            "num_requests": self.num_requests,
            "hit_tokens": self.hit_tokens,
            "hit_tokens_by_tier": self.hit_tokens_by_tier(),
            "recomputed_tokens": self.recomputed_tokens,
            "num_lower_tier_reads": sum(self.num_chunk_reads.values()),
            "lower_tier_read_bytes": sum(self.read_bytes.values()) if self.block_bytes else None,
            "num_reads_by_tier": dict(self.num_chunk_reads),
            "read_bytes_by_tier": dict(self.read_bytes) if self.block_bytes else None,
            "num_shared_reads": self.num_shared_reads,
            "num_stores_by_tier": dict(self.num_stores),
            "read_amplification": self.read_amplification,
            "restore_seconds": None if self.restore_wait_s is None else float(self.restore_wait_s.sum()),
            "prefill_seconds_saved": self.prefill_seconds_saved(),
            "ttft": groups or None,
            "gpu_evictions": self.pool.total_evictions,
        }


def simulate_tiers(requests: Sequence[RequestBlocks], config: TierConfig, *, block_size: int,
                   kv_bytes_per_token: int | None = None, costs: dict[str, RestoreCost] | None = None,
                   prefill: PrefillSeconds | None = None, timed: bool | None = None,
                   preload: dict[str, Sequence[int]] | None = None) -> TierResult:
    """Replay `requests` (arrival order) through the GPU pool and `config`'s lower tiers (module docstring).

    `costs` maps tier names to restore costs (needed for waits, singleflight and TTFT); `preload` puts
    chunk keys (block hashes for one-block chunks) into a tier before the first request, oldest first.
    """
    block_size = check_block_size(block_size)
    config.check()
    if timed is None:
        timed = bool(requests) and all(r.arrival_ns is not None and r.finish_ns is not None for r in requests)
    sim = _TierSimulation(list(requests), block_size, config, kv_bytes_per_token, costs or {}, timed, preload or {})
    return sim.result(sim.run(), prefill)


# ---------------------------------------------------------------------------------------------------
# The lower tiers
# ---------------------------------------------------------------------------------------------------


class _Tier:
    __slots__ = ("spec", "lru", "capacity", "chunk", "cost", "num_reads", "read_bytes", "num_stores", "refresh_on_hit",
                 "busy")

    def __init__(self, spec: TierSpec, cost: RestoreCost | None):
        self.spec, self.cost = spec, cost
        self.lru: OrderedDict = OrderedDict()  # chunk key -> None, least recent first
        self.capacity = spec.num_chunks
        self.chunk = spec.chunk_blocks
        self.num_reads = self.read_bytes = self.num_stores = 0
        self.refresh_on_hit = spec.retain and spec.write == "on-evict"  # (simple-cpu: set by the simulation)
        self.busy = (0, 0)  # when the tier finishes the reads issued so far (p50, p95 clocks), timed replays

    def store(self, key, refresh: bool = True) -> object | None:
        """Store or refresh `key`; returns the chunk key the LRU evicted, if any."""
        lru = self.lru
        if key in lru:
            if refresh:
                lru.move_to_end(key)
            return None
        if self.capacity <= 0:
            return None
        self.num_stores += 1
        lru[key] = None
        if len(lru) > self.capacity:
            return lru.popitem(last=False)[0]
        return None

    def chunk_key(self, chain: list, j: int):
        """Key of the chunk holding block j of a hash chain, or None while that chunk is incomplete."""
        if self.chunk == 1:
            return chain[j]
        end = (j // self.chunk + 1) * self.chunk - 1
        return chain[end] if end < len(chain) else None


class _TierSimulation(PoolReplay):
    def __init__(self, requests, block_size, config: TierConfig, kv_bytes_per_token, costs, timed, preload):
        super().__init__(requests, block_size, config.gpu_blocks, None, timed)
        self.config = config
        self.kvbpt = kv_bytes_per_token
        self.block_bytes = block_size * kv_bytes_per_token if kv_bytes_per_token else 0
        self.tiers = [_Tier(s, costs.get(s.name)) for s in config.tiers]
        self.with_costs = all(t.cost is not None for t in self.tiers)
        self.on_evict = [t for t in self.tiers if t.spec.write == "on-evict"]
        self.write_through = [t for t in self.tiers if t.spec.write == "write-through"]
        # Where a tier's LRU evictions go: the first on-evict tier below it (an index into on_evict).
        self.below = {id(t): next((k for k, o in enumerate(self.on_evict) if self.tiers.index(o) > ti), None)
                      for ti, t in enumerate(self.tiers)}
        self.track_evictions = bool(self.on_evict)
        self.single_tier = self.tiers[0] if len(self.tiers) == 1 and self.tiers[0].chunk == 1 else None
        self.simple = config.connector == "simple-cpu"
        if self.simple:
            if timed:
                raise KmeshTraceError("the simple-cpu connector model replays sequentially; pass timed=False.")
            self.tiers[0].refresh_on_hit = True
            self.stored_now: list[int] = []  # chain positions the current request newly stored
        self.store_marks: dict[int, int] = {}  # request -> lower-tier stores before it, for per-request counts
        for t in self.tiers:
            for key in preload.get(t.spec.name, ()):
                t.store(key)
            t.num_stores = 0
        n = len(requests)
        self.hit = {"gpu": np.zeros(n, np.int64), **{t.spec.name: np.zeros(n, np.int64) for t in self.tiers}}
        self.wait = np.zeros(n) if self.with_costs else None
        self.wait95 = np.zeros(n) if self.with_costs else None
        self.reads: list[TierRead] = []
        self.needed: set = set()
        self.num_shared = 0
        self.inflight: dict = {}  # (tier index, chunk key) -> (done_ns, done_p95_ns), singleflight
        self.gpu_ready: dict = {}  # block hash -> (done_ns, done_p95_ns, tier name): restored, not yet usable
        self.ready_heap: list = []
        # Early preparation: parent -> children still to be admitted, staged blocks, pending events.
        self.children_left: dict[int, int] = {}
        self.staged: dict = {}  # block hash -> (done_ns, done_p95_ns, tier name), staged by early preparation
        self.staged_by_parent: dict[int, list] = {}
        self.prep_heap: list = []
        if config.early_prep and self.tiers:
            first_child: dict[int, int] = {}
            for i, r in enumerate(requests):
                if r.parent_index is not None:
                    self.children_left[r.parent_index] = self.children_left.get(r.parent_index, 0) + 1
                    first_child.setdefault(r.parent_index, i)
            lead = None if config.prep_lead_s is None else int(config.prep_lead_s * 1e9)
            for p, c in first_child.items():
                if timed:
                    at = requests[p].finish_ns
                    if lead is not None:
                        at = max(at, requests[c].arrival_ns - lead)
                    heapq.heappush(self.prep_heap, (at, p))
                else:  # sequential: prepared just before the first child, entirely ahead of it
                    heapq.heappush(self.prep_heap, (c, p))

    # -- observing the pool ---------------------------------------------------------------------------

    def _allocated(self, i: int, evicted: list) -> None:
        if not evicted:
            return
        gpu_ready = self.gpu_ready
        if gpu_ready:
            for h in evicted:
                gpu_ready.pop(h, None)
        # The on-evict tiers' stores, inlined (this runs once per GPU eviction; there are at most two tiers).
        first = self.on_evict[0]
        lru, cap = first.lru, first.capacity
        second = self.on_evict[1] if len(self.on_evict) > 1 else None
        lru2, cap2 = (second.lru, second.capacity) if second is not None else (None, 0)
        refresh, popitem = lru.move_to_end, lru.popitem
        n1 = n2 = 0
        for h in evicted:
            if h in lru:
                refresh(h)
                continue
            if cap <= 0:
                v = h
            else:
                n1 += 1
                lru[h] = None
                if len(lru) <= cap:
                    continue
                v = popitem(False)[0]
            if cap2 > 0:
                if v in lru2:
                    lru2.move_to_end(v)
                else:
                    n2 += 1
                    lru2[v] = None
                    if len(lru2) > cap2:
                        lru2.popitem(False)
        first.num_stores += n1
        if n2:
            second.num_stores += n2

    def _offload(self, key, start: int) -> None:
        """An evicted block or chunk goes to the next on-evict tier at or below position `start`."""
        tiers = self.on_evict
        k = start
        while key is not None and k < len(tiers):
            key = tiers[k].store(key)
            k += 1

    def _read(self, ti: int, key, t_ns: int, clock: list, i: int, prepare: bool) -> tuple[int, int]:
        """Issue one chunk read on tier `ti` at `t_ns` after the request's earlier reads there (`clock`)."""
        tier = self.tiers[ti]
        nbytes = tier.chunk * self.block_bytes
        tier.num_reads += 1
        tier.read_bytes += nbytes
        reads = self.reads
        if reads and reads[-1].request_index == i and reads[-1].tier == tier.spec.name and reads[-1].prepare == prepare:
            reads[-1].num_chunks += 1
            reads[-1].num_bytes += nbytes
        else:
            reads.append(TierRead(i, tier.spec.name, 1, nbytes, prepare))
        c = tier.cost
        if c is None:
            done = (t_ns, t_ns)
        else:
            if clock[ti] is None:  # a request's first read on this tier queues behind earlier requests' reads
                lat = int(c.latency_s * 1e9)
                clock[ti] = [max(t_ns, tier.busy[0]) + lat, max(t_ns, tier.busy[1]) + lat]
            clock[ti][0] += int(nbytes / (c.gbps * 1e9) * 1e9)
            clock[ti][1] += int(nbytes / ((c.gbps_p95 or c.gbps) * 1e9) * 1e9)
            done = (clock[ti][0], clock[ti][1])
            if self.timed:
                tier.busy = done
        if self.config.singleflight and self.timed:
            self.inflight[(ti, key)] = done
        return done

    def _find_below(self, chain: list, j: int):
        for ti, tier in enumerate(self.tiers):
            key = tier.chunk_key(chain, j)
            if key is not None and key in tier.lru:
                return ti, key
        return None

    def _looked_up(self, i: int, hits: list[int]) -> None:
        r = self.requests[i]
        bs = self.bs
        t = self.now if self.timed else 0
        if self.prep_heap:
            self._prepare_due(i, t)
        self._expire_ready(t)
        chain = r.prompt_hashes
        n_gpu = len(hits)
        max_hit = min(r.max_hit_blocks(bs), r.num_full_prompt_blocks(bs))
        hit = self.hit
        hit["gpu"][i] = n_gpu
        if not self.tiers:
            return
        self.store_marks[i] = sum(t.num_stores for t in self.tiers)
        wait = [t, t]  # latest completion this request needs (p50, p95)
        gpu_ready = self.gpu_ready
        singleflight = self.config.singleflight and self.timed
        if gpu_ready:  # blocks restored for an earlier request that are still in flight
            for j in range(n_gpu):
                got = gpu_ready.get(chain[j])
                if got is None:
                    continue
                if singleflight:
                    wait[0], wait[1] = max(wait[0], got[0]), max(wait[1], got[1])
                    hit["gpu"][i] -= 1
                    hit[got[2]][i] += 1
                    self.num_shared += 1
                    self.needed.add(chain[j])
                else:  # vLLM has not cached them yet: the lookup below starts here
                    hit["gpu"][i] = n_gpu = j
                    break
        any_gpu = self.config.lookup == "any"
        cached = self.pool.cached
        staged = self.staged
        clock: list = [None] * len(self.tiers)
        read_now: dict = {}  # (tier index, key) -> completion, chunks this request already reads or shares
        read_once: list = []
        loaded: list = []
        counts = [0] * len(self.tiers)
        needed = self.needed
        timed = self.timed
        single = self.single_tier  # one lower tier of one-block chunks: the lookup inlined
        j = n_gpu
        while j < max_hit:
            h = chain[j]
            if any_gpu and h in cached and h not in gpu_ready:
                hit["gpu"][i] += 1
                j += 1
                continue
            if staged:
                got = staged.get(h)
                if got is not None:
                    wait[0], wait[1] = max(wait[0], got[0]), max(wait[1], got[1])
                    hit[got[2]][i] += 1
                    needed.add(h)
                    j += 1
                    continue
            if single is not None:  # no tuples here: this loop runs once per lower-tier hit
                if h not in single.lru:
                    break
                ti, key, found = 0, h, h
            else:
                found = self._find_below(chain, j)
                if found is None:
                    break
                ti, key = found
            tier = self.tiers[ti]
            done = read_now.get(found)
            if done is None:
                shared = self.inflight.get((ti, key)) if singleflight else None
                if shared is not None and shared[0] >= t:
                    done = shared
                    self.num_shared += 1
                else:
                    done = self._read(ti, key, t, clock, i, False)
                    if not tier.spec.retain:
                        read_once.append((ti, key))
                    elif tier.refresh_on_hit:
                        tier.lru.move_to_end(key)
                read_now[found] = done
            if done[0] > wait[0]:
                wait[0] = done[0]
            if done[1] > wait[1]:
                wait[1] = done[1]
            counts[ti] += 1
            needed.add(h)
            if timed:
                loaded.append((h, done, tier.spec.name))
            j += 1
        for ti, n in enumerate(counts):
            if n:
                hit[self.tiers[ti].spec.name][i] += n
        for ti, key in read_once:
            self.tiers[ti].lru.pop(key, None)
        if loaded:
            for h, done, name in loaded:
                if done[0] >= t:
                    gpu_ready[h] = (done[0], done[1], name)
                    heapq.heappush(self.ready_heap, (done[0], h))
        if self.with_costs:
            if self.timed:
                self.wait[i], self.wait95[i] = (wait[0] - t) / 1e9, (wait[1] - t) / 1e9
            else:
                self.wait[i], self.wait95[i] = wait[0] / 1e9, wait[1] / 1e9
        if self.write_through:
            self._write_through(i, r)
        if self.children_left and r.parent_index in self.children_left:
            self._child_admitted(r.parent_index)

    def _write_through(self, i: int, r: RequestBlocks) -> None:
        n = num_cached_blocks(r.num_prompt_tokens, r.num_output_tokens, self.bs)
        nf = r.num_full_prompt_blocks(self.bs)
        chain = r.prompt_hashes[:min(n, nf)]
        if n > nf:
            chain = chain + r.output_hashes[:n - nf]
        if self.simple:
            self._simple_stores(i, r, chain)
            return
        for tier in self.write_through:
            k = tier.chunk
            below = self.below[id(tier)]
            for j in range(k - 1, len(chain), k):
                evicted = tier.store(chain[j])
                if evicted is not None and below is not None:
                    self._offload(evicted, below)

    def _simple_stores(self, i: int, r: RequestBlocks, chain: list) -> None:
        """SimpleCPUOffloadConnector's eager stores, one batch per build: each step's build stores the blocks
        the earlier steps confirmed (the prefill step's build: the hit tokens; decode step k's: P + k - 1;
        the finish: P + G - 1), checking the whole batch against the pool before any of its stores evicts."""
        tier, bs = self.tiers[0], self.bs
        lru = tier.lru
        p, g = r.num_prompt_tokens, r.num_output_tokens
        hits = int(self.hit["gpu"][i] + self.hit[tier.spec.name][i])
        self.stored_now = stored = []
        start = 0
        for confirmed in (hits * bs, *range(p, p + g - 1), p + g - 1):
            end = min(confirmed // bs, len(chain))
            if end <= start:
                continue
            batch = [j for j in range(start, end) if chain[j] not in lru]
            for j in batch:
                tier.store(chain[j], refresh=False)
            stored.extend(batch)
            start = end

    def _finish(self, i: int) -> None:
        if not self.simple:
            return super()._finish(i)
        # A store holds its GPU block until the worker reports it done, which the scheduler learns after it
        # has freed the requests that finished in that step. So the stores issued for a request's last step
        # (the blocks its earlier steps confirmed) and at its finish (`_queue_finished_eager_store`) still
        # hold their blocks when vLLM frees the request's blocks (tail first); they are freed afterwards, in
        # block order. Builds store what earlier steps confirmed: the prefill step's build sees the hit
        # tokens, decode step k's sees P + k - 1; so the late stores are the blocks that were not full when
        # the build before the last step ran (none: G = 1; the hits: G = 2; P + G - 3 tokens: G >= 3).
        r, bs = self.requests[i], self.bs
        blocks = self.req_blocks.pop(i)
        p, g = r.num_prompt_tokens, r.num_output_tokens
        hits = int(self.hit["gpu"][i] + self.hit[self.tiers[0].spec.name][i])
        confirmed = 0 if g <= 1 else (hits * bs if g == 2 else p + g - 3)
        last = set(range(confirmed // bs, num_cached_blocks(p, g, bs)))
        flushed = [blocks[j] for j in self.stored_now if j in last]
        pool = self.pool
        pool.touch(flushed)
        blocks.reverse()
        pool.free_blocks(blocks)
        pool.free_blocks(flushed)

    def _expire_ready(self, t: int) -> None:
        heap, ready = self.ready_heap, self.gpu_ready
        while heap and heap[0][0] < t:
            done, h = heapq.heappop(heap)
            got = ready.get(h)
            if got is not None and got[0] == done:
                del ready[h]

    # -- early preparation ----------------------------------------------------------------------------

    def _prepare_due(self, i: int, t: int) -> None:
        heap = self.prep_heap
        while heap and heap[0][0] <= (t if self.timed else i):
            at, p = heapq.heappop(heap)
            if self.children_left.get(p, 0) > 0:
                self._prepare(p, at if self.timed else None)

    def _prepare(self, p: int, at: int | None) -> None:
        r = self.requests[p]
        n = num_cached_blocks(r.num_prompt_tokens, r.num_output_tokens, self.bs)
        nf = r.num_full_prompt_blocks(self.bs)
        chain = r.prompt_hashes[:min(n, nf)] + (r.output_hashes[:n - nf] if n > nf else [])
        cached, staged = self.pool.cached, self.staged
        clock: list = [None] * len(self.tiers)
        t = at if at is not None else 0
        mine = self.staged_by_parent.setdefault(p, [])
        read_now: dict = {}
        for j, h in enumerate(chain):
            if h in cached or h in staged:
                continue
            found = self._find_below(chain, j)
            if found is None:
                break
            ti, key = found
            tier = self.tiers[ti]
            done = read_now.get(found)
            if done is None:
                done = read_now[found] = self._read(ti, key, t, clock, p, True)
                if not tier.spec.retain:
                    tier.lru.pop(key, None)
                elif tier.refresh_on_hit:
                    tier.lru.move_to_end(key)
            # Untimed, the preparation runs entirely before the child: nothing left to wait for.
            staged[h] = (done[0], done[1], tier.spec.name) if at is not None else (0, 0, tier.spec.name)
            mine.append(h)

    def _child_admitted(self, p: int) -> None:
        left = self.children_left[p] - 1
        self.children_left[p] = left
        if left <= 0:
            for h in self.staged_by_parent.pop(p, ()):
                self.staged.pop(h, None)

    # -- the result -----------------------------------------------------------------------------------

    def result(self, pool: PoolResult, prefill: PrefillSeconds | None) -> TierResult:
        notes = []
        if self.tiers and not self.with_costs:
            notes.append("a lower tier has no restore cost: restore waits, singleflight timing and TTFT are not "
                         "estimated.")
        if self.tiers and not self.kvbpt:
            notes.append("no kv bytes per token: bytes read are not estimated.")
        if self.config.singleflight and not self.timed:
            notes.append("singleflight needs arrival and finish times; the replay is sequential, so it changes "
                         "nothing.")
        stores = np.zeros(len(self.requests), np.int64)
        order = list(self.store_marks)
        ends = [self.store_marks[k] for k in order[1:]] + [sum(t.num_stores for t in self.tiers)]
        for k, end in zip(order, ends):
            stores[k] = end - self.store_marks[k]
        return TierResult(
            stores_per_request=stores,
            config=self.config, block_size=self.bs, kv_bytes_per_token=self.kvbpt, pool=pool,
            hit_blocks_by_tier=self.hit, restore_wait_s=self.wait, restore_wait_p95_s=self.wait95, reads=self.reads,
            num_chunk_reads={t.spec.name: t.num_reads for t in self.tiers},
            read_bytes={t.spec.name: t.read_bytes for t in self.tiers},
            distinct_blocks_needed=len(self.needed), num_shared_reads=self.num_shared,
            num_stores={t.spec.name: t.num_stores for t in self.tiers},
            is_child=np.fromiter((r.parent_index is not None for r in self.requests), bool, len(self.requests)),
            prefill=prefill if self.with_costs else None, notes=notes)


# ---------------------------------------------------------------------------------------------------
# A host x SSD sweep
# ---------------------------------------------------------------------------------------------------


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


def sweep_tiers(requests: Sequence[RequestBlocks], base: TierConfig, host_blocks: Sequence[int],
                ssd_blocks: Sequence[int], *, within_pct: float = 5.0, progress=None,
                simulate: Callable[[list[TierConfig]], list[TierResult]] | None = None, **kwargs) -> SweepResult:
    """`simulate_tiers` over host x SSD capacities (0: the tier is absent) at `base`'s GPU capacity; the
    other tier settings come from `base` (a tier missing there uses one-block on-evict chunks).
    `simulate(configs)`, when given, runs the configurations (e.g. as distributed tasks,
    `kmesh_trace.oracle.tasks.tiers_point`) and returns their results in order."""
    if within_pct < 0:
        raise KmeshTraceError("--within must be a percentage >= 0.")
    by = {t.name: t for t in base.tiers}
    configs = [replace(base, tiers=tuple(replace(by.get(n, TierSpec(n, c)), capacity_blocks=c)
                                         for n, c in (("host", hb), ("ssd", sb)) if c > 0))
               for hb in host_blocks for sb in ssd_blocks]
    if simulate is not None:
        flat = simulate(configs)
    else:
        flat = []
        for cfg in configs:
            flat.append(simulate_tiers(requests, cfg, **kwargs))
            if progress:
                progress(len(flat), len(configs))
    rows = [flat[i * len(ssd_blocks):(i + 1) * len(ssd_blocks)] for i in range(len(host_blocks))]
    with_seconds = all(r.prefill_seconds_saved() is not None for row in rows for r in row)
    return SweepResult(list(host_blocks), list(ssd_blocks), rows,
                       "prefill_seconds_saved" if with_seconds else "hit_tokens", within_pct)



# ---------------------------------------------------------------------------------------------------
# The family-burst scenario's arms
# ---------------------------------------------------------------------------------------------------


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
