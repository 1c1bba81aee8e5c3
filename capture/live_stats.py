"""What `kmesh-trace listen --live` shows per publisher, computed incrementally in bounded memory.

Counts since the last look (stored and evicted blocks, for per-second rates) and, when requests report
their hits (kv_cache_report_mode full: re-announced blocks are recorded as `touched`), the stock block
hit ratio (touched / (touched + newly cached), GPU blocks) next to an LRU cache model over the same
accesses at 1x, 2x and 4x the engine's blocks. Each model holds at most its capacity in hashes, so
memory is bounded by 4x the engine's pool whatever the stream's length. Rendering lives in the CLI.
"""

from __future__ import annotations

import time
from collections import OrderedDict

MULTIPLES = (1, 2, 4)


class LruModel:
    """An LRU cache of block hashes: an access hits when the hash is resident, then becomes most recent."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: OrderedDict[int, None] = OrderedDict()
        self.num_hits = 0
        self.num_accesses = 0

    def access(self, key: int) -> None:
        self.num_accesses += 1
        entries = self.entries
        if key in entries:
            self.num_hits += 1
            entries.move_to_end(key)
            return
        entries[key] = None
        if len(entries) > self.capacity:
            entries.popitem(last=False)

    @property
    def hit_ratio(self) -> float | None:
        return self.num_hits / self.num_accesses if self.num_accesses else None


class LiveStats:
    def __init__(self, num_blocks: int | None = None):
        self.num_stored = self.num_evicted = 0  # since the last `take_rates`
        self.num_touched_total = self.num_cached_total = 0  # GPU blocks, for the stock ratio
        self.models: dict[int, LruModel] = {}
        self.since = time.monotonic()
        self.set_capacity(num_blocks)

    def set_capacity(self, num_blocks: int | None) -> None:
        if num_blocks and not self.models:
            self.models = {m: LruModel(m * num_blocks) for m in MULTIPLES}

    def on_row(self, event: str, block_hash: int | None, medium: str | None) -> None:
        if event == "cached":
            self.num_stored += 1
        elif event == "evicted":
            self.num_evicted += 1
        if medium not in (None, "GPU") or event not in ("cached", "touched"):
            return
        if event == "touched":
            self.num_touched_total += 1
        else:
            self.num_cached_total += 1
        for model in self.models.values():
            model.access(block_hash)

    @property
    def stock_hit_ratio(self) -> float | None:
        n = self.num_touched_total + self.num_cached_total
        return self.num_touched_total / n if self.num_touched_total and n else None

    def take_rates(self) -> dict:
        """Stored and evicted blocks per second since the previous call, and the hit ratios so far."""
        now = time.monotonic()
        dt = max(now - self.since, 1e-9)
        out = {"stored_per_s": self.num_stored / dt, "evicted_per_s": self.num_evicted / dt,
               "stock_hit_ratio": self.stock_hit_ratio,
               "lru_hit_ratio": {f"{m}x": model.hit_ratio for m, model in self.models.items()}}
        self.num_stored = self.num_evicted = 0
        self.since = now
        return out
