"""The `vllm` block-pool model compiled: `simulate_pool`'s replay without holds, as one numba kernel.

The same rules as `kmesh_trace.oracle.blockpool` (its docstring lists them, rule by rule), applied in the
same order, over arrays instead of Python objects:

- the free queue is a doubly linked list over block ids (node 0, vLLM's null block, is its sentinel:
  `nxt[0]` is the head, the next block to be reused);
- the hash map keeps, per dense block-hash id, the blocks cached under it oldest first (a linked list
  through `bnext`/`bprev`), so a lookup returns the oldest surviving one and a duplicate is appended;
- a block's key is -1 (no hash: a partial tail), -2 (a private key no lookup matches: a generated block
  the stream does not identify) or the dense id of its hash;
- timed replays keep the running requests in a binary heap ordered by (finish, index), as `heapq` orders
  the Python model's tuples.

The Python model stays the reference: tests replay random workloads (timed and sequential, duplicates,
stalls, deferrals) through both and compare every per-request result and the final free queue.
"""

from __future__ import annotations

import numba
import numpy as np

from kmesh_trace.oracle.interruptible import run_interruptible

NO_KEY = -1
PRIVATE_KEY = -2


@numba.njit(cache=True, nogil=True, inline="always")
def _before(k1, i1, k2, i2):  # pragma: no cover (compiled); heapq's order of (finish, index) tuples
    return k1 < k2 or (k1 == k2 and i1 < i2)


@numba.njit(cache=True, nogil=True, inline="always")
def _heap_push(hk, hi, size, k, i):  # pragma: no cover (compiled)
    j = size
    p = (j - 1) >> 1
    while j > 0 and not _before(hk[p], hi[p], k, i):
        hk[j], hi[j] = hk[p], hi[p]
        j = p
        p = (j - 1) >> 1
    hk[j], hi[j] = k, i
    return size + 1


@numba.njit(cache=True, nogil=True, inline="always")
def _heap_pop(hk, hi, size):  # pragma: no cover (compiled); returns the new size, the popped index in hi[size]
    top = hi[0]
    size -= 1
    k, i = hk[size], hi[size]
    j = 0
    while 2 * j + 1 < size:
        c = 2 * j + 1
        if c + 1 < size and _before(hk[c + 1], hi[c + 1], hk[c], hi[c]):
            c += 1
        if _before(k, i, hk[c], hi[c]):
            break
        hk[j], hi[j] = hk[c], hi[c]
        j = c
    hk[j], hi[j] = k, i
    hi[size] = top
    return size


@numba.njit(cache=True, nogil=True, inline="always")
def _link_after(prv, nxt, left, blk):  # pragma: no cover (compiled); the free queue: blk right after left
    right = nxt[left]
    prv[blk], nxt[blk] = left, right
    nxt[left] = blk
    prv[right] = blk


@numba.njit(cache=True, nogil=True)
def _free_blocks(blocks, a, b, step, ref, key, prv, nxt, scratch):  # pragma: no cover (compiled)
    """`PoolModel.free_blocks` over blocks[a], blocks[a + step], ... (b excluded): unhashed blocks whose
    count reaches 0 go to the head (keeping their order), hashed ones to the tail, each in the order their
    count reached 0. Returns how many blocks joined the free queue."""
    nf = 0
    nl = len(scratch)  # hashed ones fill scratch from the end
    j = a
    while j != b:
        blk = blocks[j]
        ref[blk] -= 1
        if ref[blk] == 0:
            if key[blk] == NO_KEY:
                scratch[nf] = blk
                nf += 1
            else:
                nl -= 1
                scratch[nl] = blk
        j += step
    for q in range(nf - 1, -1, -1):  # prepend in reverse: the first of them ends at the head
        _link_after(prv, nxt, 0, scratch[q])
    for q in range(len(scratch) - 1, nl - 1, -1):
        _link_after(prv, nxt, prv[0], scratch[q])
    return nf + len(scratch) - nl


@numba.njit(cache=True, nogil=True)
def _pool_kernel(obj, req_start, n_prompt_listed, prompt_tokens, output_tokens, finish, arrival, timed,
                 block_size, num_usable, num_objects):  # pragma: no cover (compiled)
    n_req = len(prompt_tokens)
    n = num_usable + 1
    ref = np.zeros(n, np.int64)
    key = np.full(n, NO_KEY, np.int64)
    prv = np.full(n, -1, np.int64)  # -1: not in the free queue
    nxt = np.full(n, -1, np.int64)
    bprev = np.full(n, -1, np.int64)  # the blocks cached under one hash, oldest first
    bnext = np.full(n, -1, np.int64)
    head = np.full(num_objects, -1, np.int64)
    tail = np.full(num_objects, -1, np.int64)
    # the free queue starts in block-id order
    prv[0] = num_usable
    nxt[0] = 1 if num_usable > 0 else 0
    for blk in range(1, n):
        prv[blk] = blk - 1
        nxt[blk] = blk + 1 if blk + 1 < n else 0
    num_free = num_usable
    hit_blocks = np.zeros(n_req, np.int64)
    num_evictions = np.zeros(n_req, np.int64)
    admitted = np.zeros(n_req, np.bool_)
    stalled = np.zeros(n_req, np.bool_)
    # each request's blocks (hits, then new ones), while it runs
    off = np.zeros(n_req + 1, np.int64)
    for i in range(n_req):
        computed = prompt_tokens[i] + max(output_tokens[i] - 1, 0)
        nb = -(-computed // block_size)
        off[i + 1] = off[i] + (nb if timed else 0)
    longest = 0
    for i in range(n_req):
        computed = prompt_tokens[i] + max(output_tokens[i] - 1, 0)
        longest = max(longest, -(-computed // block_size))
    store = np.zeros(off[n_req] if timed else 0, np.int64)
    seq = np.zeros(max(longest, 1), np.int64)
    cnt = np.zeros(n_req, np.int64)
    scratch = np.zeros(max(longest, 1), np.int64)  # a freed request's blocks
    hk = np.zeros(n_req if timed else 1, np.int64)
    hi = np.zeros(n_req if timed else 1, np.int64)
    hsize = 0
    num_deferred = 0
    for i in range(n_req):
        if timed:
            while hsize > 0 and hk[0] <= arrival[i]:
                hsize = _heap_pop(hk, hi, hsize)
                f = hi[hsize]
                num_free += _free_blocks(store, off[f] + cnt[f] - 1, off[f] - 1, -1, ref, key, prv, nxt, scratch)
        P = prompt_tokens[i]
        computed = P + max(output_tokens[i] - 1, 0)
        num_blocks = -(-computed // block_size)
        num_full = computed // block_size
        n_prompt_full = P // block_size
        a = req_start[i]
        n_listed = n_prompt_listed[i]  # prompt hashes in the stream (<= n_prompt_full)
        n_out = req_start[i + 1] - a - n_listed
        max_hit = min(max(P - 1, 0) // block_size, n_prompt_full, n_listed)
        prompt_blocks = -(-P // block_size)
        deferred = False
        is_stalled = False
        ok = True
        while True:
            nh = 0
            ev = 0
            for j in range(max_hit):
                blk = head[obj[a + j]]
                if blk < 0:
                    break
                seq[nh] = blk
                nh += 1
                if ref[blk] == 0:
                    ev += 1
            need = num_blocks - nh + ev
            if need <= num_free:
                break
            if timed and hsize > 0:
                deferred = True
                hsize = _heap_pop(hk, hi, hsize)
                f = hi[hsize]
                num_free += _free_blocks(store, off[f] + cnt[f] - 1, off[f] - 1, -1, ref, key, prv, nxt, scratch)
                continue
            if prompt_blocks - nh + ev <= num_free:
                is_stalled = True
                num_blocks = nh + num_free - ev
                num_full = num_blocks
                break
            ok = False
            break
        if not ok:
            continue
        num_deferred += deferred
        for j in range(nh):  # touch
            blk = seq[j]
            if ref[blk] == 0:
                nxt[prv[blk]] = nxt[blk]
                prv[nxt[blk]] = prv[blk]
                prv[blk] = -1
                nxt[blk] = -1
                num_free -= 1
            ref[blk] += 1
        ne = 0
        m = nh
        for j in range(nh, num_blocks):  # allocate: pop the head, drop its old hash, cache the new one
            if j < num_full:
                if j < min(num_full, n_prompt_full) and j < n_listed:
                    k = obj[a + j]
                else:
                    o = j - n_prompt_full
                    k = obj[a + n_listed + o] if 0 <= o < n_out else PRIVATE_KEY
            else:
                k = NO_KEY
            blk = nxt[0]
            num_free -= 1
            nxt[0] = nxt[blk]
            prv[nxt[blk]] = 0
            prv[blk] = -1
            nxt[blk] = -1
            old = key[blk]
            if old != NO_KEY:
                ne += 1
                if old >= 0:
                    p, q = bprev[blk], bnext[blk]
                    if p >= 0:
                        bnext[p] = q
                    else:
                        head[old] = q
                    if q >= 0:
                        bprev[q] = p
                    else:
                        tail[old] = p
                    bprev[blk] = -1
                    bnext[blk] = -1
            ref[blk] = 1
            key[blk] = k
            if k >= 0:
                t = tail[k]
                bprev[blk] = t
                bnext[blk] = -1
                if t >= 0:
                    bnext[t] = blk
                else:
                    head[k] = blk
                tail[k] = blk
            seq[m] = blk
            m += 1
        hit_blocks[i] = nh
        num_evictions[i] = ne
        admitted[i] = True
        if is_stalled:
            stalled[i] = True
            num_free += _free_blocks(seq, m - 1, -1, -1, ref, key, prv, nxt, scratch)
        elif timed:
            for j in range(m):
                store[off[i] + j] = seq[j]
            cnt[i] = m
            hsize = _heap_push(hk, hi, hsize, max(finish[i], arrival[i]), i)
        else:
            num_free += _free_blocks(seq, m - 1, -1, -1, ref, key, prv, nxt, scratch)
    while hsize > 0:
        hsize = _heap_pop(hk, hi, hsize)
        f = hi[hsize]
        _free_blocks(store, off[f] + cnt[f] - 1, off[f] - 1, -1, ref, key, prv, nxt, scratch)
    queue = np.empty(num_usable, np.int64)
    nq = 0
    blk = nxt[0]
    while blk != 0:
        queue[nq] = blk
        nq += 1
        blk = nxt[blk]
    return hit_blocks, num_evictions, admitted, stalled, queue[:nq], num_deferred


def pool_inputs(requests, block_size: int, stream=None):
    """The kernel's per-request arrays for `requests` (their AccessStream `stream` when built already)."""
    from kmesh_trace.oracle.stream import AccessStream

    if stream is None:
        stream = AccessStream.from_requests(requests, block_size)
    n = len(requests)
    listed = np.minimum(stream.num_reads, stream.num_prompt_tokens // block_size)
    output_tokens = np.fromiter((r.num_output_tokens for r in requests), np.int64, n)
    arrival = np.fromiter((r.arrival_ns or 0 for r in requests), np.int64, n)
    finish = np.fromiter((r.finish_ns or 0 for r in requests), np.int64, n)
    return stream, listed, output_tokens, arrival, finish


def replay_compiled(requests, block_size: int, num_usable_blocks: int, timed: bool, stream=None):
    """`PoolReplay(requests, ..., holds=None, timed).run()`'s per-request results, compiled:
    (hit_blocks, num_evictions, admitted, stalled, free_queue, num_deferred) as numpy arrays and an int."""
    stream, listed, output_tokens, arrival, finish = pool_inputs(requests, block_size, stream)
    return run_interruptible(_pool_kernel, stream.obj, stream.req_start, listed, stream.num_prompt_tokens,
                             output_tokens, finish, arrival, bool(timed), int(block_size), int(num_usable_blocks),
                             int(stream.num_objects))
