"""The tier model compiled: `TierReplay` (`kmesh_trace.oracle.tiers.replay`) as one numba kernel.

The GPU pool is the compiled pool replay's own steps (`kmesh_trace.oracle.blockpool_compiled`: `arrive`,
`allocate_request` with a buffer for the evicted hashes, `end_admission`, `drain`), so the pool evolves
exactly as `simulate_pool`'s; between `arrive` and the allocation the kernel runs the lookup below the GPU
in `TierReplay._looked_up`'s steps (restores in flight, the lower-tier walk, settling, the restore wait, the
write-through stores), and after it the offloading of what the allocation evicted (`_allocated`). The
rules are the package docstring's (`kmesh_trace.oracle.tiers`); here is only how they are kept in arrays:

- every hash (prompt, output, preloaded chunk key) has a dense id; a tier's LRU is a doubly linked list
  over ids (`lnk`: each id's previous and next side by side, sentinel `num_ids`, least recent first;
  -1 off the list), as `TierStore`'s OrderedDict;
- the chunks one request reads (it reads each once) in a small open-addressing table, cleared after it;
  per tier and id, with singleflight, the read in flight; per id, a restored block's completion while it
  is not yet usable (`gpu_ready`, timed), with a heap of completions to expire them;
- reads are kept as (request, tier, chunks, bytes, prepare) rows merged as `TierRead`s are;

- early preparation's schedule (`EarlyPrep`'s heap) as arrays sorted in its pop order, the staged blocks
  per id, and what each parent staged as a segment of one buffer.

It covers every configuration, early preparation included, but the simple-cpu connector, which keeps its
Python replay (`simulate_tiers` chooses). `TierReplay` stays the reference: tests/test_tiers_compiled.py replays
random workloads and configurations through both and compares every `TierResult` field.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numba
import numpy as np

from kmesh_trace.oracle.blockpool_compiled import (
    REFUSED,
    STALLS,
    allocate_request,
    arrive,
    drain,
    end_admission,
    free_queue,
    heap_pop,
    heap_push,
    pool_state,
    replay_state,
)
from kmesh_trace.oracle.interruptible import run_interruptible

__all__ = ["TierStream", "tier_stream", "replay_tiers_compiled"]

_jit = numba.njit(cache=True, nogil=True, inline="always")


# A tier's LRU: lnk[ti, k] = (previous, next) of id k (-1, -1 off the list); row num_ids is its sentinel,
# (the most recent, the least recent). A node's two links share a cache line.


@_jit
def _held(lnk, ti, k):  # pragma: no cover (compiled); k is in tier ti's LRU
    return lnk[ti, k, 0] >= 0


@_jit
def _lru_unlink(lnk, ti, k):  # pragma: no cover (compiled)
    p, q = lnk[ti, k, 0], lnk[ti, k, 1]
    lnk[ti, p, 1] = q
    lnk[ti, q, 0] = p
    lnk[ti, k, 0] = -1


@_jit
def _lru_append(lnk, ti, k):  # pragma: no cover (compiled); k becomes the most recent
    s = lnk.shape[1] - 1
    last = lnk[ti, s, 0]
    lnk[ti, k, 0] = last
    lnk[ti, k, 1] = s
    lnk[ti, last, 1] = k
    lnk[ti, s, 0] = k


@_jit
def _lru_refresh(lnk, ti, k):  # pragma: no cover (compiled)
    _lru_unlink(lnk, ti, k)
    _lru_append(lnk, ti, k)


@numba.njit(cache=True, nogil=True)
def _lru_state(nt, num_ids, like):  # pragma: no cover (compiled)
    """The tiers' empty LRUs."""
    lnk = np.full((nt, num_ids + 1, 2), -1, like.dtype)
    for ti in range(nt):
        lnk[ti, num_ids, 0] = num_ids
        lnk[ti, num_ids, 1] = num_ids
    return lnk


@_jit
def _slot(tkey, k):  # pragma: no cover (compiled); k's slot in an open-addressing table (-1: empty)
    mask = len(tkey) - 1
    q = (k * 40503) & mask
    while tkey[q] != k and tkey[q] != -1:
        q = (q + 1) & mask
    return q


@_jit
def _put(lnk, count, cap, num_stores, ti, keys, n, refresh, pass_through,
         left):  # pragma: no cover (compiled)
    """`TierStore.put` of keys[:n] into tier ti; the keys that leave go to `left` (which may be `keys`:
    the q-th key is read before left[q] can be written); returns how many."""
    c = cap[ti]
    if c <= 0:
        if not pass_through:
            return 0
        for q in range(n):
            left[q] = keys[q]
        return n
    s = lnk.shape[1] - 1
    nl = 0
    stored = 0
    for q in range(n):
        k = keys[q]
        if _held(lnk, ti, k):
            if refresh:
                _lru_refresh(lnk, ti, k)
            continue
        stored += 1
        _lru_append(lnk, ti, k)
        if count[ti] < c:
            count[ti] += 1
        else:
            first = lnk[ti, s, 1]
            _lru_unlink(lnk, ti, first)
            left[nl] = first
            nl += 1
    num_stores[ti] += stored
    return nl


@_jit
def _offload(lnk, count, cap, num_stores, on_evict, start, keys, n):  # pragma: no cover
    """`TierReplay._offload` of keys[:n] down the on-evict tiers from position `start`, in place (a put
    writes what leaves over the keys it has read)."""
    for o in range(start, len(on_evict)):
        if n == 0:
            return
        n = _put(lnk, count, cap, num_stores, on_evict[o], keys, n, True, True, keys)


@_jit
def _find_below(lnk, chunk, chain, cs, ce, j):  # pragma: no cover (compiled)
    """`TierReplay._find_below` for block j of the hash chain chain[cs:ce]: (tier, chunk key) of the first
    tier holding the chunk, or (-1, -1)."""
    for ti in range(len(chunk)):
        c = chunk[ti]
        if c == 1:
            key = chain[cs + j]
        else:
            end = (j // c + 1) * c - 1
            key = chain[cs + end] if end < ce - cs else -1
        if key >= 0 and _held(lnk, ti, key):
            return ti, key
    return -1, -1


@_jit
def _read(ti, key, t, req, prepare, rd, n_rd, C, Q, clk_set, timed, singleflight, if_valid, IF):  # pragma: no cover
    """`TierReplay._read` (and `ReadQueue.complete`): one chunk read on tier ti issued at t for request
    `req`. C = (chunk bytes, reads, bytes read) and Q = (busy p50, busy p95, clock p50, clock p95, latency,
    duration p50, duration p95, has a restore cost) per tier; rd the read rows (request, tier, chunks, bytes, prepare). Returns
    (completion p50, p95, rd, its rows)."""
    nbytes = C[0][ti]
    C[1][ti] += 1
    C[2][ti] += nbytes
    if n_rd > 0 and rd[n_rd - 1, 0] == req and rd[n_rd - 1, 1] == ti and rd[n_rd - 1, 4] == prepare:
        rd[n_rd - 1, 2] += 1
        rd[n_rd - 1, 3] += nbytes
    else:
        if n_rd == len(rd):
            grown = np.zeros((2 * len(rd) + 16, 5), np.int64)
            grown[:n_rd] = rd
            rd = grown
        rd[n_rd, 0], rd[n_rd, 1], rd[n_rd, 2], rd[n_rd, 3], rd[n_rd, 4] = req, ti, 1, nbytes, prepare
        n_rd += 1
    busy0, busy1, clk0, clk1, lat_ns, dur0, dur1, has_cost = Q
    if has_cost[ti]:
        if not clk_set[ti]:
            clk_set[ti] = True
            clk0[ti] = max(t, busy0[ti]) + lat_ns[ti]
            clk1[ti] = max(t, busy1[ti]) + lat_ns[ti]
        clk0[ti] += dur0[ti]
        clk1[ti] += dur1[ti]
        d0, d1 = clk0[ti], clk1[ti]
        if timed:
            busy0[ti], busy1[ti] = d0, d1
    else:
        d0, d1 = t, t
    if singleflight:
        if_valid[ti, key] = True
        IF[0][ti, key], IF[1][ti, key] = d0, d1
    return d0, d1, rd, n_rd


@_jit
def _discard(lnk, count, ti, key):  # pragma: no cover (compiled); `TierStore.discard`
    if _held(lnk, ti, key):
        _lru_unlink(lnk, ti, key)
        count[ti] -= 1


@_jit
def _grow(a, n):  # pragma: no cover (compiled); a with room for index n
    if n < len(a):
        return a
    b = np.empty(2 * len(a) + 16, a.dtype)
    b[:len(a)] = a
    return b


@numba.njit(cache=True, nogil=True)
def _tier_kernel(obj, IN, chain, cstart, held, hstart, timed, block_size, num_usable, num_ids, cap, chunk,
                 retain, refresh_on_hit, write_through, below, on_evict, chunk_bytes, has_cost, lat_ns, dur0,
                 dur1, singleflight, any_gpu, with_costs, preload, pstart, like, early_prep, prep_at, prep_p,
                 children_left, parent_of):  # pragma: no cover (compiled)
    n_req = len(IN[2])
    nt = len(cap)
    P = pool_state(num_usable, num_ids)
    no = np.zeros(0, np.int64)
    R, H, S = replay_state(IN, timed, block_size, False, no.astype(np.bool_), no, no, no, 1, -1, -1, -1)
    S[9] = num_usable
    seq, scratch = R[0], R[4]
    longest = len(seq)
    hit_blocks = np.zeros(n_req, np.int64)
    num_evictions = np.zeros(n_req, np.int64)
    admitted = np.zeros(n_req, np.bool_)
    stalled = np.zeros(n_req, np.bool_)
    # the lower tiers
    lnk = _lru_state(nt, num_ids, like)
    count = np.zeros(nt, np.int64)
    num_stores = np.zeros(nt, np.int64)
    num_reads = np.zeros(nt, np.int64)
    read_bytes = np.zeros(nt, np.int64)
    C = (chunk_bytes, num_reads, read_bytes)
    # the chunks this request reads, (tier, id) -> completion: a table of twice the longest request's blocks
    size = 1
    while size < 2 * longest + 2:
        size *= 2
    tkey = np.full(size, -1, np.int64)
    t0 = np.zeros(size, np.int64)
    t1 = np.zeros(size, np.int64)
    used = np.zeros(longest, np.int64)
    m_if = num_ids if singleflight else 0
    if_valid = np.zeros((nt, m_if), np.bool_)
    if0 = np.zeros((nt, m_if), np.int64)
    if1 = np.zeros((nt, m_if), np.int64)
    m_gr = num_ids if timed else 0
    gr_valid = np.zeros(m_gr, np.bool_)
    gr0 = np.zeros(m_gr, np.int64)
    gr1 = np.zeros(m_gr, np.int64)
    gr_tier = np.zeros(m_gr, np.int64)
    rhk = np.zeros(16, np.int64)  # the ready heap: (completion, id)
    rhi = np.zeros(16, np.int64)
    rh_size = 0
    needed = np.zeros(num_ids, np.bool_)
    num_needed = 0
    num_shared = 0
    hit = np.zeros((nt + 1, n_req), np.int64)
    wait0 = np.zeros(n_req, np.float64)
    wait1 = np.zeros(n_req, np.float64)
    marks = np.full(n_req, -1, np.int64)
    rd = np.zeros((16, 5), np.int64)  # reads: (request, tier, chunks, bytes, prepare)
    n_rd = 0
    # one request's lookup (or one early preparation's)
    clk_set = np.zeros(nt, np.bool_)
    Q = (np.zeros(nt, np.int64), np.zeros(nt, np.int64), np.zeros(nt, np.int64), np.zeros(nt, np.int64),
         lat_ns, dur0, dur1, has_cost.astype(np.int64))
    IF = (if0, if1)
    # early preparation: the staged blocks (id -> completions, tier) and what each parent staged
    m_st = num_ids if early_prep else 0
    st_valid = np.zeros(m_st, np.bool_)
    st0 = np.zeros(m_st, np.int64)
    st1 = np.zeros(m_st, np.int64)
    st_tier = np.zeros(m_st, np.int64)
    bp = np.zeros(16, np.int64)
    n_bp = 0
    bp_start = np.zeros(n_req if early_prep else 0, np.int64)
    bp_len = np.zeros(n_req if early_prep else 0, np.int64)
    n_staged = 0
    next_prep = 0
    counts = np.zeros(nt, np.int64)
    ro_tier = np.zeros(longest, np.int64)
    ro_key = np.zeros(longest, np.int64)
    ld_h = np.zeros(longest, np.int64)
    ld0 = np.zeros(longest, np.int64)
    ld1 = np.zeros(longest, np.int64)
    ld_tier = np.zeros(longest, np.int64)
    evicted = np.zeros(longest if len(on_evict) else 0, np.int64)
    keys = np.zeros(longest, np.int64)
    for ti in range(nt):
        m = pstart[ti + 1] - pstart[ti]
        gone = np.zeros(m, np.int64)
        _put(lnk, count, cap, num_stores, ti, preload[pstart[ti]:], m, True, False, gone)
        num_stores[ti] = 0
    for i in range(n_req):
        outcome, nh, num_blocks, num_full = arrive(P, H, S, R, IN, obj, i, block_size, False, timed)
        if outcome == REFUSED:
            continue
        # -- TierReplay._looked_up
        t = S[5] if timed else 0
        while early_prep and next_prep < len(prep_at) and prep_at[next_prep] <= (t if timed else i):  # due
            p = prep_p[next_prep]
            at = prep_at[next_prep]
            next_prep += 1
            if children_left[p] <= 0:
                continue
            tp = at if timed else 0  # _prepare
            for ti in range(nt):
                clk_set[ti] = False
            n_used = 0
            hs, he = hstart[p], hstart[p + 1]
            bp_start[p] = n_bp
            for j in range(he - hs):
                h = held[hs + j]
                if P[6][h] >= 0 or st_valid[h]:
                    continue
                ti, key = _find_below(lnk, chunk, held, hs, he, j)
                if ti < 0:
                    break
                q = _slot(tkey, ti * (num_ids + 1) + key)
                if tkey[q] >= 0:
                    d0, d1 = t0[q], t1[q]
                else:
                    d0, d1, rd, n_rd = _read(ti, key, tp, p, 1, rd, n_rd, C, Q, clk_set, timed, singleflight,
                                             if_valid, IF)
                    if not retain[ti]:  # Tier.after_load
                        _discard(lnk, count, ti, key)
                    elif refresh_on_hit[ti]:
                        _lru_refresh(lnk, ti, key)
                    tkey[q] = ti * (num_ids + 1) + key
                    t0[q], t1[q] = d0, d1
                    used[n_used] = q
                    n_used += 1
                if not st_valid[h]:
                    n_staged += 1
                st_valid[h] = True
                st0[h], st1[h], st_tier[h] = (d0, d1, ti) if timed else (0, 0, ti)
                bp = _grow(bp, n_bp)
                bp[n_bp] = h
                n_bp += 1
            bp_len[p] = n_bp - bp_start[p]
            for q in range(n_used):
                tkey[used[q]] = -1
        if timed:  # _expire_ready
            while rh_size > 0 and rhk[0] < t:
                done = rhk[0]
                rh_size = heap_pop(rhk, rhi, rh_size)
                h = rhi[rh_size]
                if gr_valid[h] and gr0[h] == done:
                    gr_valid[h] = False
        n_gpu = nh
        hit[0, i] = nh
        cs = cstart[i]
        max_hit = min(max(IN[2][i] - 1, 0) // block_size, IN[2][i] // block_size, cstart[i + 1] - cs)
        if nt > 0:
            total = 0
            for ti in range(nt):
                total += num_stores[ti]
            marks[i] = total
            w0 = t
            w1 = t
            for ti in range(nt):
                clk_set[ti] = False
                counts[ti] = 0
            n_ro = 0
            n_ld = 0
            n_used = 0
            if timed:  # _restores_in_flight
                for j in range(n_gpu):
                    h = chain[cs + j]
                    if not gr_valid[h]:
                        continue
                    if singleflight:
                        w0 = max(w0, gr0[h])
                        w1 = max(w1, gr1[h])
                        hit[0, i] -= 1
                        hit[1 + gr_tier[h], i] += 1
                        num_shared += 1
                        if not needed[h]:
                            needed[h] = True
                            num_needed += 1
                    else:
                        hit[0, i] = n_gpu = j
                        break
            j = n_gpu
            while j < max_hit:  # _walk_below
                h = chain[cs + j]
                if any_gpu and P[6][h] >= 0 and not (timed and gr_valid[h]):
                    hit[0, i] += 1
                    j += 1
                    continue
                if n_staged > 0 and st_valid[h]:  # staged by early preparation
                    w0 = max(w0, st0[h])
                    w1 = max(w1, st1[h])
                    hit[1 + st_tier[h], i] += 1
                    if not needed[h]:
                        needed[h] = True
                        num_needed += 1
                    j += 1
                    continue
                ti, key = _find_below(lnk, chunk, chain, cs, cstart[i + 1], j)
                if ti < 0:
                    break
                q = _slot(tkey, ti * (num_ids + 1) + key)
                if tkey[q] >= 0:  # _load: a chunk this request already reads
                    d0, d1 = t0[q], t1[q]
                elif singleflight and if_valid[ti, key] and if0[ti, key] >= t:
                    d0, d1 = if0[ti, key], if1[ti, key]
                    num_shared += 1
                else:
                    d0, d1, rd, n_rd = _read(ti, key, t, i, 0, rd, n_rd, C, Q, clk_set, timed, singleflight,
                                             if_valid, IF)
                    if not retain[ti]:
                        ro_tier[n_ro], ro_key[n_ro] = ti, key
                        n_ro += 1
                    elif refresh_on_hit[ti]:
                        _lru_refresh(lnk, ti, key)
                if tkey[q] < 0:
                    tkey[q] = ti * (num_ids + 1) + key
                    t0[q], t1[q] = d0, d1
                    used[n_used] = q
                    n_used += 1
                w0 = max(w0, d0)
                w1 = max(w1, d1)
                counts[ti] += 1
                if not needed[h]:
                    needed[h] = True
                    num_needed += 1
                if timed:
                    ld_h[n_ld], ld0[n_ld], ld1[n_ld], ld_tier[n_ld] = h, d0, d1, ti
                    n_ld += 1
                j += 1
            for q in range(n_used):
                tkey[used[q]] = -1
            for ti in range(nt):  # _settle
                hit[1 + ti, i] += counts[ti]
            for q in range(n_ro):
                _discard(lnk, count, ro_tier[q], ro_key[q])
            for q in range(n_ld):
                if ld0[q] >= t:
                    h = ld_h[q]
                    gr_valid[h] = True
                    gr0[h], gr1[h], gr_tier[h] = ld0[q], ld1[q], ld_tier[q]
                    rhk = _grow(rhk, rh_size)
                    rhi = _grow(rhi, rh_size)
                    rh_size = heap_push(rhk, rhi, rh_size, ld0[q], h)
            if with_costs:  # _restore_wait
                if timed:
                    wait0[i], wait1[i] = (w0 - t) / 1e9, (w1 - t) / 1e9
                else:
                    wait0[i], wait1[i] = w0 / 1e9, w1 / 1e9
            for ti in range(nt):  # _write_through
                if not write_through[ti]:
                    continue
                c = chunk[ti]
                hs, he = hstart[i], hstart[i + 1]
                nk = 0
                for q in range(hs + c - 1, he, c):
                    keys[nk] = held[q]
                    nk += 1
                nl = _put(lnk, count, cap, num_stores, ti, keys, nk, True, False, keys)
                if nl > 0 and below[ti] >= 0:
                    _offload(lnk, count, cap, num_stores, on_evict, below[ti], keys, nl)
            p = parent_of[i]
            if early_prep and p >= 0:  # EarlyPrep.child_admitted (a child's parent has declared children)
                children_left[p] -= 1
                if children_left[p] <= 0:
                    for q in range(bp_start[p], bp_start[p] + bp_len[p]):
                        if st_valid[bp[q]]:
                            st_valid[bp[q]] = False
                            n_staged -= 1
                    bp_len[p] = 0
        ne, nk = allocate_request(P, S, R, IN, obj, i, nh, num_blocks, num_full, block_size, evicted)
        if nk > 0:  # TierReplay._allocated
            if timed:
                for q in range(nk):
                    gr_valid[evicted[q]] = False
            _offload(lnk, count, cap, num_stores, on_evict, 0, evicted, nk)
        num_evictions[i] = ne
        hit_blocks[i] = nh
        admitted[i] = True
        stalled[i] = outcome == STALLS
        end_admission(P, H, S, R, IN, i, outcome, num_blocks, False, timed)
    drain(P, H, S, R, IN, False, timed)
    pool = (hit_blocks, num_evictions, admitted, stalled, free_queue(P), S[11])
    reads = (rd[:n_rd, 0], rd[:n_rd, 1], rd[:n_rd, 2], rd[:n_rd, 3], rd[:n_rd, 4])
    return (pool, hit, wait0, wait1, reads, num_reads, read_bytes, num_stores, marks, num_needed, num_shared)


# ---------------------------------------------------------------------------------------------------
# Python side
# ---------------------------------------------------------------------------------------------------


@numba.njit(cache=True, nogil=True)
def _gather_into(values, starts, lens, out):  # pragma: no cover (compiled)
    o = 0
    for k in range(len(starts)):
        a = starts[k]
        for q in range(lens[k]):
            out[o] = values[a + q]
            o += 1


def _gather(values: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """values[starts[k]:starts[k] + lens[k]] for every k, concatenated."""
    out = np.empty(int(lens.sum()), values.dtype)
    _gather_into(values, starts, lens, out)
    return out


@numba.njit(cache=True, nogil=True)
def _rank(hashes, order, ids):  # pragma: no cover (compiled)
    """ids[t] = the rank of hashes[t] among the distinct hashes (`order` sorts them); returns those, sorted."""
    distinct = np.empty(len(hashes), np.uint64)
    r = -1
    for k in range(len(hashes)):
        t = order[k]
        if k == 0 or hashes[t] != hashes[order[k - 1]]:
            r += 1
            distinct[r] = hashes[t]
        ids[t] = r
    return distinct[:r + 1]


def _per_request(first: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two columns per request, interleaved (request 0's first, request 0's second, ...), and the
    per-request offsets of their sums."""
    start = np.zeros(len(first) + 1, np.int64)
    np.cumsum(first + second, out=start[1:])
    return np.stack([first, second], axis=1).ravel(), start


@dataclass
class TierStream:
    """A request stream as the tier kernel reads it, built once for every configuration replayed over it:
    dense ids of its hashes (`hashes`, sorted, gives id -> hash), the pool's layout (`obj`, `IN`: listed
    prompt hashes then output hashes per request), each request's whole prompt hash list (`chain`,
    `chain_start`) and, built on first use, the chains its write-through stores put (`held`)."""

    requests: list
    block_size: int
    hashes: np.ndarray
    ids: np.ndarray  # prompt hashes, then output hashes, as ids
    starts: np.ndarray  # per request: where its prompt and its output hashes start in ids (interleaved)
    obj: np.ndarray
    IN: tuple
    chain_start: np.ndarray
    plen: np.ndarray
    olen: np.ndarray
    _held: tuple | None = None

    @property
    def chain(self) -> np.ndarray:
        return self.ids[:int(self.chain_start[-1])]

    @property
    def num_ids(self) -> int:
        return len(self.hashes)

    def held(self) -> tuple[np.ndarray, np.ndarray]:
        """(held chains, offsets): per request prompt[:min(n, nf)], then output[:n - nf], n its cached blocks."""
        if self._held is None:
            p_tokens, o_tokens = self.IN[2], self.IN[3]
            nf = p_tokens // self.block_size
            cached = (p_tokens + np.maximum(o_tokens - 1, 0)) // self.block_size
            lens, hstart = _per_request(np.minimum(np.minimum(cached, nf), self.plen),
                                        np.minimum(np.maximum(cached - nf, 0), self.olen))
            self._held = _gather(self.ids, self.starts, lens), hstart
        return self._held

    def preload_ids(self, keys: list[np.ndarray]) -> tuple[np.ndarray, int]:
        """Each tier's preloaded keys as ids (keys the stream lacks numbered after its own), concatenated,
        and the number of ids with them."""
        flat = np.concatenate(keys) if keys else np.zeros(0, np.uint64)
        pos = np.minimum(np.searchsorted(self.hashes, flat), max(self.num_ids - 1, 0))
        known = (self.hashes[pos] == flat) if self.num_ids else np.zeros(len(flat), bool)
        extra, inv = np.unique(flat[~known], return_inverse=True)
        out = np.empty(len(flat), self.ids.dtype)
        out[known] = pos[known]
        out[~known] = self.num_ids + inv.ravel()
        return out, self.num_ids + len(extra)


def tier_stream(requests, block_size: int) -> TierStream | None:
    """The requests' TierStream, or None when their hashes are not 64-bit unsigned integers (the Python
    replay takes those)."""
    requests = list(requests)
    n = len(requests)
    try:
        prompt, pstart = _flat([r.prompt_hashes for r in requests], n)
        output, ostart = _flat([r.output_hashes for r in requests], n)
    except (OverflowError, ValueError, TypeError):
        return None
    every = np.concatenate([prompt, output])
    ids = np.empty(len(every), np.int32 if len(every) < 2**31 - 2**20 else np.int64)  # ids < hashes
    hashes = _rank(every, np.argsort(every), ids)  # np.unique's numbering, in one pass after the sort
    p_tokens = np.fromiter((r.num_prompt_tokens for r in requests), np.int64, n)
    o_tokens = np.fromiter((r.num_output_tokens for r in requests), np.int64, n)
    plen, olen = np.diff(pstart), np.diff(ostart)
    listed = np.minimum(plen, p_tokens // block_size)
    starts = np.stack([pstart[:-1], len(prompt) + ostart[:-1]], axis=1).ravel()
    lens, req_start = _per_request(listed, olen)
    arrival = np.fromiter((r.arrival_ns or 0 for r in requests), np.int64, n)
    finish = np.fromiter((r.finish_ns or 0 for r in requests), np.int64, n)
    return TierStream(requests, block_size, hashes, ids, starts, _gather(ids, starts, lens),
                      (req_start, listed, p_tokens, o_tokens, finish, arrival), pstart, plen, olen)


def replay_tiers_compiled(stream: TierStream, config, costs: dict, timed: bool, preload: dict, block_bytes: int):
    """`TierReplay(...).run()` and its state, compiled: (pool arrays, hits per tier, waits, reads, per-tier
    counts, store marks, distinct blocks needed, shared reads); see `_tier_kernel`. None when a preloaded
    key is not a 64-bit unsigned integer (the Python replay takes it)."""
    tiers = config.tiers
    try:
        keys = [np.fromiter(preload.get(t.name, ()), np.uint64) for t in tiers]
    except (OverflowError, ValueError, TypeError):
        return None
    pid, num_ids = stream.preload_ids(keys)
    pstart = np.zeros(len(tiers) + 1, np.int64)
    np.cumsum([len(k) for k in keys], out=pstart[1:])
    early_prep = bool(config.early_prep and tiers)
    if early_prep or any(t.write == "write-through" for t in tiers):
        held, hstart = stream.held()
    else:
        held, hstart = stream.ids[:0], np.zeros(len(stream.requests) + 1, np.int64)
    block_size = stream.block_size
    schedule = _prep_schedule(stream.requests, config, timed) if early_prep else _prep_schedule([], config, timed)
    if schedule is None:
        return None
    on_evict = np.array([k for k, t in enumerate(tiers) if t.write == "on-evict"], np.int64)
    below = np.array([next((o for o, k in enumerate(on_evict) if k > ti), -1) for ti in range(len(tiers))], np.int64)
    cs = [costs.get(t.name) for t in tiers]
    nbytes = [t.chunk_blocks * block_bytes for t in tiers]
    lat = [int(c.latency_s * 1e9) if c else 0 for c in cs]
    dur0 = [int(b / (c.gbps * 1e9) * 1e9) if c else 0 for c, b in zip(cs, nbytes)]
    dur1 = [int(b / ((c.gbps_p95 or c.gbps) * 1e9) * 1e9) if c else 0 for c, b in zip(cs, nbytes)]
    arr = lambda v, dt=np.int64: np.array(v, dt).reshape(len(tiers))  # noqa: E731
    return run_interruptible(
        _tier_kernel, stream.obj, stream.IN, stream.chain, stream.chain_start, held, hstart, bool(timed),
        int(block_size), int(config.gpu_blocks),
        num_ids, arr([t.num_chunks for t in tiers]), arr([t.chunk_blocks for t in tiers]),
        arr([t.retain for t in tiers], np.bool_), arr([t.retain and t.write == "on-evict" for t in tiers], np.bool_),
        arr([t.write == "write-through" for t in tiers], np.bool_), below, on_evict, arr(nbytes),
        arr([c is not None for c in cs], np.bool_), arr(lat), arr(dur0), arr(dur1),
        bool(config.singleflight and timed), config.lookup == "any", all(c is not None for c in cs), pid, pstart,
        np.zeros(0, np.int32 if num_ids < 2**31 - 1 else np.int64), early_prep, *schedule)


def _flat(lists, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Lists of hashes flattened (uint64) with their offsets."""
    lens = np.fromiter((len(x) for x in lists), np.int64, n)
    start = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=start[1:])
    return np.fromiter(itertools.chain.from_iterable(lists), np.uint64, int(start[-1])), start


def _prep_schedule(requests, config, timed: bool):
    """`EarlyPrep`'s schedule as arrays: (when, parent) in the order its heap pops them, each parent's
    declared children and each request's parent (-1: none); None when a parent is not in the stream."""
    n = len(requests)
    parent_of = np.fromiter((-1 if r.parent_index is None else r.parent_index for r in requests), np.int64, n)
    if n and (parent_of.max() >= n or parent_of.min() < -1):
        return None
    children = np.bincount(parent_of[parent_of >= 0], minlength=n).astype(np.int64)
    first_child: dict[int, int] = {}
    for c, p in enumerate(parent_of.tolist()):
        if p >= 0:
            first_child.setdefault(p, c)
    lead = None if config.prep_lead_s is None else int(config.prep_lead_s * 1e9)
    due = []
    for p, c in first_child.items():
        if timed:
            at = requests[p].finish_ns
            if lead is not None:
                at = max(at, requests[c].arrival_ns - lead)
            due.append((at, p))
        else:
            due.append((c, p))
    due.sort()
    return (np.array([a for a, _ in due], np.int64), np.array([p for _, p in due], np.int64), children, parent_of)
