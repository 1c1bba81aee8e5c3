"""The tier model's replay: the vLLM block-pool replay (`kmesh_trace.oracle.blockpool.PoolReplay`),
unchanged, observed through its two hooks.

- `_looked_up` (a request's GPU prefix hits, before its blocks are allocated) runs the lookup below the
  GPU in named steps: due early preparations, restores still in flight, the lower-tier walk, the
  settling of what was read (hits by tier, read-once removals, restored blocks not yet usable), the
  restore wait, then the write-through stores.
- `_allocated` (the hashes the allocation evicted) offloads them down the on-evict tiers.

The rules are in the package docstring (`kmesh_trace.oracle.tiers`); the store, the read timing and
early preparation's schedule are their own modules.
"""

from __future__ import annotations

import heapq

import numpy as np

from kmesh_trace.oracle.blockpool import PoolReplay, PoolResult
from kmesh_trace.oracle.stream import RequestBlocks, num_cached_blocks
from kmesh_trace.oracle.tiers.config import PrefillSeconds, RestoreCost, TierConfig, TierSpec
from kmesh_trace.oracle.tiers.prep import EarlyPrep
from kmesh_trace.oracle.tiers.result import TierRead, TierResult, tier_result
from kmesh_trace.oracle.tiers.store import TierStore
from kmesh_trace.oracle.tiers.timing import ReadQueue

__all__ = ["Tier", "TierReplay", "held_chain"]


def held_chain(r: RequestBlocks, block_size: int) -> list:
    """The hashes of the full blocks a request holds when it finishes: its prompt's, then its output's."""
    n = num_cached_blocks(r.num_prompt_tokens, r.num_output_tokens, block_size)
    nf = r.num_full_prompt_blocks(block_size)
    chain = r.prompt_hashes[:min(n, nf)]
    if n > nf:
        chain = chain + r.output_hashes[:n - nf]
    return chain


class Tier:
    """One lower tier in a replay: its store, its read queue and what it served."""

    __slots__ = ("spec", "name", "store", "queue", "chunk_bytes", "num_reads", "read_bytes", "refresh_on_hit")

    def __init__(self, spec: TierSpec, cost: RestoreCost | None, timed: bool, block_bytes: int):
        self.spec, self.name = spec, spec.name
        self.store = TierStore(spec.num_chunks, spec.chunk_blocks)
        self.queue = ReadQueue(cost, timed)
        self.chunk_bytes = spec.chunk_blocks * block_bytes
        self.num_reads = self.read_bytes = 0
        # A retained chunk is refreshed by a load; a write-through tier is refreshed by the store pass instead.
        self.refresh_on_hit = spec.retain and spec.write == "on-evict"

    def after_load(self, key) -> None:
        """Keep (refresh) or drop a chunk just loaded (early preparation; a request defers its drops)."""
        if not self.spec.retain:
            self.store.discard(key)
        elif self.refresh_on_hit:
            self.store.refresh(key)


class _Lookup:
    """One request's lookup below the GPU: what it waits for and what it read. One per replay, reset for
    each request (allocating one per request costs more than the lookup on a large stream)."""

    __slots__ = ("t", "wait", "clock", "read_now", "read_once", "loaded", "counts")

    def __init__(self, num_tiers: int):
        self.t = 0
        self.wait = [0, 0]  # latest completion this request needs (p50, p95)
        self.clock: list = [None] * num_tiers  # per tier: completion of this request's reads so far
        self.read_now: dict = {}  # chunk -> completion, chunks this request already reads or shares
        self.read_once: list = []  # (tier index, key): read-once chunks, dropped once the walk is done
        self.loaded: list = []  # (hash, completion, tier name): blocks restored into the GPU (timed)
        self.counts = [0] * num_tiers  # blocks found per tier

    def reset(self, t: int) -> _Lookup:
        self.t = t
        self.wait[0] = self.wait[1] = t
        clock, counts = self.clock, self.counts
        for k in range(len(clock)):
            clock[k] = None
            counts[k] = 0
        if self.read_now:
            self.read_now.clear()
        if self.read_once:
            self.read_once.clear()
        if self.loaded:
            self.loaded.clear()
        return self


class TierReplay(PoolReplay):
    def __init__(self, requests, block_size, config: TierConfig, kv_bytes_per_token, costs, timed, preload):
        super().__init__(requests, block_size, config.gpu_blocks, None, timed)
        self.config = config
        self.kvbpt = kv_bytes_per_token
        self.block_bytes = block_size * kv_bytes_per_token if kv_bytes_per_token else 0
        self.tiers = [Tier(s, costs.get(s.name), timed, self.block_bytes) for s in config.tiers]
        self.with_costs = all(t.queue.cost is not None for t in self.tiers)
        self.on_evict = [t for t in self.tiers if t.spec.write == "on-evict"]
        self.write_through = [t for t in self.tiers if t.spec.write == "write-through"]
        # Where a tier's LRU evictions go: the first on-evict tier below it (an index into on_evict).
        self.below = {id(t): next((k for k, o in enumerate(self.on_evict) if self.tiers.index(o) > ti), None)
                      for ti, t in enumerate(self.tiers)}
        self.track_evictions = bool(self.on_evict)
        self.single_tier = self.tiers[0] if len(self.tiers) == 1 and self.tiers[0].spec.chunk_blocks == 1 else None
        self.singleflight = config.singleflight and timed
        self.store_marks: dict[int, int] = {}  # request -> lower-tier stores before it, for per-request counts
        for t in self.tiers:
            t.store.put(preload.get(t.name, ()))
            t.store.num_stores = 0
        n = len(requests)
        self.hit = {"gpu": np.zeros(n, np.int64), **{t.name: np.zeros(n, np.int64) for t in self.tiers}}
        self.wait = np.zeros(n) if self.with_costs else None
        self.wait95 = np.zeros(n) if self.with_costs else None
        self.reads: list[TierRead] = []
        self.needed: set = set()
        self.num_shared = 0
        self.inflight: dict = {}  # (tier index, chunk key) -> (done_ns, done_p95_ns), singleflight
        self.gpu_ready: dict = {}  # block hash -> (done_ns, done_p95_ns, tier name): restored, not yet usable
        self.ready_heap: list = []
        self.prep = EarlyPrep(self.requests, config, timed) if config.early_prep and self.tiers else None
        self.look = _Lookup(len(self.tiers))

    # -- the pool's hooks -----------------------------------------------------------------------------

    def _allocated(self, i: int, evicted: list) -> None:
        if not evicted:
            return
        gpu_ready = self.gpu_ready
        if gpu_ready:
            for h in evicted:
                gpu_ready.pop(h, None)
        self._offload(evicted, 0)

    def _looked_up(self, i: int, hits: list[int]) -> None:
        r = self.requests[i]
        t = self.now if self.timed else 0
        if self.prep is not None and self.prep.heap:
            for p, at in self.prep.due(i, t):
                self._prepare(p, at)
        self._expire_ready(t)
        n_gpu = len(hits)
        self.hit["gpu"][i] = n_gpu
        if not self.tiers:
            return
        self.store_marks[i] = sum(x.store.num_stores for x in self.tiers)
        look = self.look.reset(t)
        if self.gpu_ready:
            n_gpu = self._restores_in_flight(i, r.prompt_hashes, n_gpu, look)
        self._walk_below(i, r, n_gpu, look)
        self._settle(i, look)
        self._restore_wait(i, look)
        if self.write_through:
            self._write_through(i, r)
        if self.prep is not None and self.prep.is_parent(r.parent_index):
            self.prep.child_admitted(r.parent_index)

    # -- the lookup's steps ---------------------------------------------------------------------------

    def _restores_in_flight(self, i: int, chain: list, n_gpu: int, look: _Lookup) -> int:
        """GPU prefix hits restored for an earlier request whose reads have not completed: with
        singleflight the request waits for them (hits of the tier they came from); without, as vLLM (it
        caches a restored block only once its load finishes), the lookup below starts at the first.
        Returns the GPU prefix hits that stand."""
        gpu_ready, hit, wait = self.gpu_ready, self.hit, look.wait
        for j in range(n_gpu):
            got = gpu_ready.get(chain[j])
            if got is None:
                continue
            if self.singleflight:
                wait[0], wait[1] = max(wait[0], got[0]), max(wait[1], got[1])
                hit["gpu"][i] -= 1
                hit[got[2]][i] += 1
                self.num_shared += 1
                self.needed.add(chain[j])
            else:
                hit["gpu"][i] = n_gpu = j
                break
        return n_gpu

    def _walk_below(self, i: int, r: RequestBlocks, j: int, look: _Lookup) -> None:
        """From block j, block by block: the GPU pool (`any` lookup), a block staged by early preparation,
        then each lower tier in order; stops at the first block found nowhere."""
        chain = r.prompt_hashes
        # a hash list shorter than the prompt ends the walk, as it ends the pool's lookup
        max_hit = min(r.max_hit_blocks(self.bs), r.num_full_prompt_blocks(self.bs), len(chain))
        hit_gpu = self.hit["gpu"]
        any_gpu = self.config.lookup == "any"
        cached, gpu_ready = self.pool.cached, self.gpu_ready
        staged = self.prep.staged if self.prep is not None else None
        wait, counts, needed = look.wait, look.counts, self.needed
        single = self.single_tier  # one lower tier of one-block chunks: the lookup inlined
        single_lru = single.store.lru if single is not None else None
        while j < max_hit:
            h = chain[j]
            if any_gpu and h in cached and h not in gpu_ready:
                hit_gpu[i] += 1
                j += 1
                continue
            if staged:
                got = staged.get(h)
                if got is not None:
                    wait[0], wait[1] = max(wait[0], got[0]), max(wait[1], got[1])
                    self.hit[got[2]][i] += 1
                    needed.add(h)
                    j += 1
                    continue
            if single_lru is not None:  # no tuples here: this loop runs once per lower-tier hit
                if h not in single_lru:
                    break
                ti, key, found = 0, h, h
            else:
                found = self._find_below(chain, j)
                if found is None:
                    break
                ti, key = found
            done = self._load(i, ti, key, found, look)
            if done[0] > wait[0]:
                wait[0] = done[0]
            if done[1] > wait[1]:
                wait[1] = done[1]
            counts[ti] += 1
            needed.add(h)
            if self.timed:
                look.loaded.append((h, done, self.tiers[ti].name))
            j += 1

    def _find_below(self, chain: list, j: int):
        for ti, tier in enumerate(self.tiers):
            key = tier.store.chunk_key(chain, j)
            if key is not None and key in tier.store.lru:
                return ti, key
        return None

    def _load(self, i: int, ti: int, key, found, look: _Lookup) -> tuple[int, int]:
        """The completion of the chunk holding a block found in tier `ti`: a chunk this request already
        reads, another request's read still in flight (singleflight), or a new read."""
        done = look.read_now.get(found)
        if done is not None:
            return done
        shared = self.inflight.get((ti, key)) if self.singleflight else None
        if shared is not None and shared[0] >= look.t:
            done = shared
            self.num_shared += 1
        else:
            tier = self.tiers[ti]
            done = self._read(ti, key, look.t, look.clock, i, False)
            if not tier.spec.retain:
                look.read_once.append((ti, key))
            elif tier.refresh_on_hit:
                tier.store.refresh(key)
        look.read_now[found] = done
        return done

    def _read(self, ti: int, key, t_ns: int, clock: list, i: int, prepare: bool) -> tuple[int, int]:
        """Issue one chunk read on tier `ti` at `t_ns` after the request's earlier reads there (`clock`)."""
        tier = self.tiers[ti]
        nbytes = tier.chunk_bytes
        tier.num_reads += 1
        tier.read_bytes += nbytes
        reads = self.reads
        if reads and reads[-1].request_index == i and reads[-1].tier == tier.name and reads[-1].prepare == prepare:
            reads[-1].num_chunks += 1
            reads[-1].num_bytes += nbytes
        else:
            reads.append(TierRead(i, tier.name, 1, nbytes, prepare))
        clock[ti], done = tier.queue.complete(clock[ti], t_ns, nbytes)
        if self.singleflight:
            self.inflight[(ti, key)] = done
        return done

    def _settle(self, i: int, look: _Lookup) -> None:
        """Count the request's lower-tier hits, drop the read-once chunks it read, and mark the blocks it
        restores as not usable by others before their reads complete."""
        for ti, n in enumerate(look.counts):
            if n:
                self.hit[self.tiers[ti].name][i] += n
        for ti, key in look.read_once:
            self.tiers[ti].store.discard(key)
        for h, done, name in look.loaded:
            if done[0] >= look.t:
                self.gpu_ready[h] = (done[0], done[1], name)
                heapq.heappush(self.ready_heap, (done[0], h))

    def _restore_wait(self, i: int, look: _Lookup) -> None:
        """The request's restore wait: its latest needed completion minus its admission (timed), or the
        sum of its read durations (sequential)."""
        if not self.with_costs:
            return
        w, t = look.wait, look.t
        if self.timed:
            self.wait[i], self.wait95[i] = (w[0] - t) / 1e9, (w[1] - t) / 1e9
        else:
            self.wait[i], self.wait95[i] = w[0] / 1e9, w[1] / 1e9

    def _expire_ready(self, t: int) -> None:
        heap, ready = self.ready_heap, self.gpu_ready
        while heap and heap[0][0] < t:
            done, h = heapq.heappop(heap)
            got = ready.get(h)
            if got is not None and got[0] == done:
                del ready[h]

    # -- stores ---------------------------------------------------------------------------------------

    def _write_through(self, i: int, r: RequestBlocks) -> None:
        """At admission, every full chunk the request will hold is stored (or refreshed) in each
        write-through tier; what a tier evicts moves to the next on-evict tier below it."""
        chain = held_chain(r, self.bs)
        for tier in self.write_through:
            k = tier.spec.chunk_blocks
            left = tier.store.put(chain[k - 1::k])
            below = self.below[id(tier)]
            if left and below is not None:
                self._offload(left, below)

    def _offload(self, keys: list, start: int) -> None:
        """Blocks (or chunks) let go above go to the on-evict tiers from position `start` down: each
        tier stores them and hands on what it evicts, or all of them when it has no capacity."""
        for tier in self.on_evict[start:]:
            if not keys:
                return
            keys = tier.store.put(keys, pass_through=True)

    # -- early preparation ----------------------------------------------------------------------------

    def _prepare(self, p: int, at: int | None) -> None:
        """Read the parent's blocks the GPU pool no longer holds from the lower tiers into the staging
        area, at `at` (None: sequentially, before the first child, so nothing is left to wait for)."""
        chain = held_chain(self.requests[p], self.bs)
        cached, staged = self.pool.cached, self.prep.staged
        clock: list = [None] * len(self.tiers)
        t = at if at is not None else 0
        mine = self.prep.by_parent.setdefault(p, [])
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
                tier.after_load(key)
            staged[h] = (done[0], done[1], tier.name) if at is not None else (0, 0, tier.name)
            mine.append(h)

    # -- the result -----------------------------------------------------------------------------------

    def result(self, pool: PoolResult, prefill: PrefillSeconds | None) -> TierResult:
        return tier_result(
            self.config, self.bs, self.kvbpt, self.timed, pool, prefill, self.requests, hit=self.hit, wait=self.wait,
            wait95=self.wait95, reads=self.reads, num_reads={t.name: t.num_reads for t in self.tiers},
            read_bytes={t.name: t.read_bytes for t in self.tiers},
            num_stores={t.name: t.store.num_stores for t in self.tiers}, store_marks=self.store_marks,
            num_needed=len(self.needed), num_shared=self.num_shared)
