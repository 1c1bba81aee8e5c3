"""What one tier configuration gave: per-request hits by tier, restore waits, reads and stores, and the totals
(hit and recomputed tokens, bytes read, read amplification, prefill seconds saved, TTFT) derived from them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter, is_not

import numpy as np

from kmesh_trace.oracle.blockpool import PoolResult
from kmesh_trace.oracle.tiers.config import PrefillSeconds, TierConfig

__all__ = ["TierRead", "TierReads", "TierResult", "tier_result"]


@dataclass(slots=True)
class TierRead:
    """One read issued to a lower tier: a request's (or an early preparation's) chunks from one tier."""

    request_index: int
    tier: str
    num_chunks: int
    num_bytes: int
    prepare: bool = False  # issued by early preparation, ahead of the children


class TierReads(Sequence):
    """A replay's reads as columns (the compiled replay's rows: no object per read), a sequence of
    `TierRead`s made on demand: `tier` holds indices into `tier_names`."""

    __slots__ = ("tier_names", "request_index", "tier", "num_chunks", "num_bytes", "prepare")

    def __init__(self, tier_names, request_index: np.ndarray, tier: np.ndarray, num_chunks: np.ndarray,
                 num_bytes: np.ndarray, prepare: np.ndarray):
        self.tier_names = tuple(tier_names)
        self.request_index, self.tier, self.num_chunks, self.num_bytes = request_index, tier, num_chunks, num_bytes
        self.prepare = prepare.astype(bool, copy=False)

    def __len__(self) -> int:
        return len(self.request_index)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return TierReads(self.tier_names, *(a[k] for a in self._columns()))
        return TierRead(int(self.request_index[k]), self.tier_names[int(self.tier[k])], int(self.num_chunks[k]),
                        int(self.num_bytes[k]), bool(self.prepare[k]))

    def __iter__(self):
        names = self.tier_names
        for i, t, c, b, prep in zip(*(a.tolist() for a in self._columns())):
            yield TierRead(i, names[t], c, b, prep)

    def _columns(self) -> tuple:
        return self.request_index, self.tier, self.num_chunks, self.num_bytes, self.prepare


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
    reads: Sequence[TierRead]  # a list (the Python replay's) or TierReads (the compiled one's)
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



def tier_result(config: TierConfig, block_size: int, kv_bytes_per_token: int | None, timed: bool, pool: PoolResult,
                prefill: PrefillSeconds | None, requests, *, hit: dict[str, np.ndarray], wait: np.ndarray | None,
                wait95: np.ndarray | None, reads: Sequence[TierRead], num_reads: dict[str, int],
                read_bytes: dict[str, int], num_stores: dict[str, int], store_marks: dict[int, int] | tuple,
                num_needed: int, num_shared: int) -> TierResult:
    """A replay's TierResult (the Python and the compiled replay's): `wait` None without restore costs;
    `store_marks` maps each request looked up, in order, to the lower-tier stores made before it (a dict, or
    the arrays (requests, marks))."""
    notes = []
    if config.tiers and wait is None:
        notes.append("a lower tier has no restore cost: restore waits, singleflight timing and TTFT are not "
                     "estimated.")
    if config.tiers and not kv_bytes_per_token:
        notes.append("no kv bytes per token: bytes read are not estimated.")
    if config.singleflight and not timed:
        notes.append("singleflight needs arrival and finish times; the replay is sequential, so it changes "
                     "nothing.")
    stores = np.zeros(len(requests), np.int64)
    if isinstance(store_marks, dict):
        store_marks = (np.fromiter(store_marks.keys(), np.int64, len(store_marks)),
                       np.fromiter(store_marks.values(), np.int64, len(store_marks)))
    looked, marks = store_marks
    if len(looked):  # each request's stores: up to the next request's mark (the last: up to the total)
        stores[looked] = np.diff(marks, append=sum(num_stores.values()))
    return TierResult(
        stores_per_request=stores,
        config=config, block_size=block_size, kv_bytes_per_token=kv_bytes_per_token, pool=pool,
        hit_blocks_by_tier=hit, restore_wait_s=wait, restore_wait_p95_s=wait95, reads=reads,
        num_chunk_reads=num_reads, read_bytes=read_bytes, distinct_blocks_needed=num_needed,
        num_shared_reads=num_shared, num_stores=num_stores,
        is_child=_has_parent(requests),
        prefill=prefill if wait is not None else None, notes=notes)


def _has_parent(requests) -> np.ndarray:
    """bool per request: it has a declared parent."""
    return np.fromiter(map(is_not, map(attrgetter("parent_index"), requests), repeat(None)), bool, len(requests))
