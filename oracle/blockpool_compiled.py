"""The `vllm` block-pool model compiled: `simulate_pool`'s replay, family holds included, as one numba kernel.

The same rules as `kmesh_trace.oracle.blockpool` (its docstring lists them, rule by rule), applied in the
same order, over arrays instead of Python objects:

- the free queue is a doubly linked list over block ids (node 0, vLLM's null block, is its sentinel:
  `nxt[0]` is the head, the next block to be reused);
- the hash map keeps, per dense block-hash id, the blocks cached under it oldest first (a linked list
  through `bnext`/`bprev`), so a lookup returns the oldest surviving one and a duplicate is appended;
- a block's key is -1 (no hash: a partial tail), -2 (a private key no lookup matches: a generated block
  the stream does not identify) or the dense id of its hash;
- timed replays keep the running requests in a binary heap ordered by (finish, index), as `heapq` orders
  the Python model's tuples;
- active holds form a linked list over parent indices, oldest first (the Python model's dict order), and
  each parent's held blocks are kept in a buffer sized by the parents' full blocks; a record per hold, in
  the order they were asked for, as `PoolReplay.records`.

The pool's state travels as one tuple of arrays (`pool_state`), the holds' as another (`HoldState`), so
the steps are small functions compiled inline into their callers: `lookup`, `touch`, `allocate` (with an
optional buffer that receives the evicted hashes), `free_blocks`, `finish`, `take_hold` / `release_hold`;
a request's replay is `arrive` (finishes due, expiry, and admission: releasing holds under pressure,
waiting for finishes, stalling or refusing), `allocate_request`, `end_admission`, and the stream's end
`drain`. The pool kernel here and the tier kernel (`kmesh_trace.oracle.tiers.compiled`) are built from
them, the tier kernel observing a request between `arrive` and `allocate_request` and after it.

The Python model stays the reference: tests replay random workloads (timed and sequential, duplicates,
stalls, deferrals, holds with every cap and expiry) through both and compare every per-request result,
every hold record and the final free queue.
"""

from __future__ import annotations

import numba
import numpy as np

from kmesh_trace.native.kernels import I32, I64, P, check, declare, ptr
from kmesh_trace.oracle.interruptible import run_interruptible

NO_KEY = -1
PRIVATE_KEY = -2

# hold statuses and release reasons, as codes (`STATUSES[code]`, `REASONS[code]`)
STATUSES = ("taken", "refused_blocks", "refused_families", "empty", "not_needed")
REASONS = ("children", "expiry", "pressure", "close")
TAKEN, REFUSED_BLOCKS, REFUSED_FAMILIES, EMPTY, NOT_NEEDED = range(5)
CHILDREN, EXPIRY, PRESSURE, CLOSE = range(4)

# fit's outcomes
FITS, STALLS, REFUSED = 0, 1, 2

#: The hold records' rows (KP_NUM_RECORD_ROWS in native/kernels/pool_steps.h).
NUM_RECORD_ROWS = 8

_jit = numba.njit(cache=True, nogil=True, inline="always")


# ---------------------------------------------------------------------------------------------------
# The running requests' heap
# ---------------------------------------------------------------------------------------------------


@_jit
def _before(k1, i1, k2, i2):  # pragma: no cover (compiled); heapq's order of (finish, index) tuples
    return k1 < k2 or (k1 == k2 and i1 < i2)


@_jit
def heap_push(hk, hi, size, k, i):  # pragma: no cover (compiled)
    j = size
    p = (j - 1) >> 1
    while j > 0 and not _before(hk[p], hi[p], k, i):
        hk[j], hi[j] = hk[p], hi[p]
        j = p
        p = (j - 1) >> 1
    hk[j], hi[j] = k, i
    return size + 1


@_jit
def heap_pop(hk, hi, size):  # pragma: no cover (compiled); returns the new size, the popped index in hi[size]
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


# ---------------------------------------------------------------------------------------------------
# The pool: (ref, key, prv, nxt, bprev, bnext, head, tail)
# ---------------------------------------------------------------------------------------------------


@numba.njit(cache=True, nogil=True)
def pool_state(num_usable, num_objects):  # pragma: no cover (compiled)
    """A fresh pool of `num_usable` blocks, the free queue in block-id order, over `num_objects` hashes."""
    n = num_usable + 1
    ref = np.zeros(n, np.int64)
    key = np.full(n, NO_KEY, np.int64)
    prv = np.full(n, -1, np.int64)  # -1: not in the free queue
    nxt = np.full(n, -1, np.int64)
    bprev = np.full(n, -1, np.int64)  # the blocks cached under one hash, oldest first
    bnext = np.full(n, -1, np.int64)
    head = np.full(num_objects, -1, np.int64)
    tail = np.full(num_objects, -1, np.int64)
    prv[0] = num_usable
    nxt[0] = 1 if num_usable > 0 else 0
    for blk in range(1, n):
        prv[blk] = blk - 1
        nxt[blk] = blk + 1 if blk + 1 < n else 0
    return (ref, key, prv, nxt, bprev, bnext, head, tail)


@_jit
def _link_after(prv, nxt, left, blk):  # pragma: no cover (compiled); the free queue: blk right after left
    right = nxt[left]
    prv[blk], nxt[blk] = left, right
    nxt[left] = blk
    prv[right] = blk


@_jit
def _unlink(prv, nxt, blk):  # pragma: no cover (compiled); blk leaves the free queue
    nxt[prv[blk]] = nxt[blk]
    prv[nxt[blk]] = prv[blk]
    prv[blk] = -1
    nxt[blk] = -1


@_jit
def lookup(P, obj, a, max_hit, seq):  # pragma: no cover (compiled)
    """The prefix lookup of hashes obj[a:a + max_hit]: hit blocks into seq[:nh]; returns (nh, how many of
    them sit in the free queue)."""
    ref, head = P[0], P[6]
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
    return nh, ev


@_jit
def cached_block(P, k):  # pragma: no cover (compiled); the oldest block cached under hash id k, or -1
    return P[6][k]


@_jit
def touch(P, blocks, a, b):  # pragma: no cover (compiled)
    """`PoolModel.touch` of blocks[a:b]; returns how many left the free queue."""
    ref, prv, nxt = P[0], P[2], P[3]
    n = 0
    for j in range(a, b):
        blk = blocks[j]
        if ref[blk] == 0:
            _unlink(prv, nxt, blk)
            n += 1
        ref[blk] += 1
    return n


@_jit
def new_block_key(obj, a, n_listed, n_out, n_prompt_full, num_full, j):  # pragma: no cover (compiled)
    """The key of a request's block j (its hashes are obj[a:], n_listed prompt ones then n_out output
    ones): a prompt hash, a generated one (private when unknown), or none for the partial tail."""
    if j >= num_full:
        return NO_KEY
    if j < n_prompt_full and j < n_listed:
        return obj[a + j]
    o = j - n_prompt_full
    return obj[a + n_listed + o] if 0 <= o < n_out else PRIVATE_KEY


@_jit
def allocate(P, obj, a, n_listed, n_out, n_prompt_full, num_full, start, num_blocks, seq,
             evicted):  # pragma: no cover (compiled)
    """`PoolModel.allocate` of the request's blocks start..num_blocks into seq[start:num_blocks]: pop the
    head, drop its old hash, cache the new key. `evicted` (length 0: not kept) receives the evicted hash
    ids, private keys excepted, in order. Returns (cached blocks evicted, hash ids written to evicted)."""
    ref, key, prv, nxt, bprev, bnext, head, tail = P
    keep = len(evicted) > 0
    ne = 0
    nk = 0
    for j in range(start, num_blocks):
        k = new_block_key(obj, a, n_listed, n_out, n_prompt_full, num_full, j)
        blk = nxt[0]
        nxt[0] = nxt[blk]
        prv[nxt[blk]] = 0
        prv[blk] = -1
        nxt[blk] = -1
        old = key[blk]
        if old != NO_KEY:
            ne += 1
            if old >= 0:
                if keep:
                    evicted[nk] = old
                    nk += 1
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
        seq[j] = blk
    return ne, nk


@numba.njit(cache=True, nogil=True)
def free_blocks(P, blocks, a, b, step, scratch):  # pragma: no cover (compiled)
    """`PoolModel.free_blocks` over blocks[a], blocks[a + step], ... (b excluded): unhashed blocks whose
    count reaches 0 go to the head (keeping their order), hashed ones to the tail, each in the order their
    count reached 0. Returns how many blocks joined the free queue."""
    ref, key, prv, nxt = P[0], P[1], P[2], P[3]
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
def free_queue(P):  # pragma: no cover (compiled)
    """The free queue's block ids, head first."""
    nxt = P[3]
    queue = np.empty(len(nxt) - 1, np.int64)
    nq = 0
    blk = nxt[0]
    while blk != 0:
        queue[nq] = blk
        nq += 1
        blk = nxt[blk]
    return queue[:nq]


@_jit
def request_blocks(prompt_tokens, output_tokens, block_size, i):  # pragma: no cover (compiled)
    """(blocks, full blocks) request i holds when it finishes (`PoolReplay._needs`)."""
    computed = prompt_tokens[i] + max(output_tokens[i] - 1, 0)
    return -(-computed // block_size), computed // block_size


# ---------------------------------------------------------------------------------------------------
# Holds
# ---------------------------------------------------------------------------------------------------
# H = (aprev, anext, remaining, taken_step, hoff, hstore, fam, fam_refs, children, rec_of, is_parent,
#      release_after, parent_of, rec_parent, rec_status, rec_blocks, rec_served, rec_reason, rec_steps,
#      rec_taken, rec_released)
# S = [n_active, num_held_refs, num_families_active, num_boundaries, num_records, now,
#      expiry_ns (-1: none), max_held_blocks (-1: none), max_families (-1: none),
#      num_free, heap size, num_deferred (the replay's scalars, below)]
# aprev/anext: the active holds, oldest first, a list over parent indices with sentinel n_req.


@numba.njit(cache=True, nogil=True)
def hold_state(n_req, has_holds, is_parent, release_after, parent_of, fam, num_families, num_full, expiry_ns,
               max_held_blocks, max_families):  # pragma: no cover (compiled)
    """The holds' state for one replay (arrays of one element each when `has_holds` is False)."""
    m = n_req if has_holds else 0
    hoff = np.zeros(m + 1, np.int64)
    for p in range(m):
        hoff[p + 1] = hoff[p] + (num_full[p] if is_parent[p] else 0)
    aprev = np.full(m + 1, m, np.int64)
    anext = np.full(m + 1, m, np.int64)
    H = (aprev, anext, np.zeros(m, np.int64), np.zeros(m, np.int64), hoff, np.zeros(hoff[m], np.int64),
         fam[:m].astype(np.int64), np.zeros(num_families if has_holds else 0, np.int64), np.zeros(m, np.int64),
         np.full(m, -1, np.int64), is_parent[:m].astype(np.int64), release_after[:m].astype(np.int64),
         parent_of[:m].astype(np.int64), np.zeros(m, np.int64), np.zeros(m, np.int64), np.zeros(m, np.int64),
         np.zeros(m, np.int64), np.full(m, -1, np.int64), np.zeros(m, np.int64), np.zeros(m, np.int64),
         np.zeros(m, np.int64))
    S = np.zeros(12, np.int64)
    S[6], S[7], S[8] = expiry_ns, max_held_blocks, max_families
    return H, S


@_jit
def take_hold(P, H, S, p, blocks, a, nblk, timed):  # pragma: no cover (compiled)
    """`PoolReplay._take`: parent p finishing with full blocks blocks[a:a + nblk], before its own
    references are freed. Returns how many blocks left the free queue (none: p references them)."""
    aprev, anext, remaining, taken_step, hoff, hstore = H[0], H[1], H[2], H[3], H[4], H[5]
    fam, fam_refs, children, rec_of, release_after = H[6], H[7], H[8], H[9], H[11]
    rec_parent, rec_status, rec_blocks, rec_taken = H[13], H[14], H[15], H[19]
    f = fam[p]
    left = release_after[p] - children[p]
    r = S[4]
    S[4] += 1
    rec_of[p] = r
    rec_parent[r] = p
    rec_blocks[r] = nblk
    if left <= 0:
        rec_status[r] = NOT_NEEDED
    elif nblk == 0:
        rec_status[r] = EMPTY
    elif S[7] >= 0 and S[1] + nblk > S[7]:
        rec_status[r] = REFUSED_BLOCKS
    elif S[8] >= 0 and fam_refs[f] == 0 and S[2] + 1 > S[8]:
        rec_status[r] = REFUSED_FAMILIES
    else:
        rec_status[r] = TAKEN
    if rec_status[r] != TAKEN:
        return 0
    rec_taken[r] = S[5] if timed else 0
    o = hoff[p]
    for j in range(nblk):
        hstore[o + j] = blocks[a + j]
    out = touch(P, hstore, o, o + nblk)
    sentinel = len(aprev) - 1
    last = aprev[sentinel]
    aprev[p], anext[p] = last, sentinel
    anext[last] = p
    aprev[sentinel] = p
    S[0] += 1
    remaining[p] = left
    taken_step[p] = S[3]
    S[1] += nblk
    if fam_refs[f] == 0:
        S[2] += 1
    fam_refs[f] += 1
    return out


@_jit
def release_hold(P, H, S, p, reason, timed, scratch):  # pragma: no cover (compiled)
    """`PoolReplay._release` of p's active hold; returns how many blocks joined the free queue."""
    aprev, anext, taken_step, hoff, hstore, fam, fam_refs, rec_of = H[0], H[1], H[3], H[4], H[5], H[6], H[7], H[9]
    rec_blocks, rec_reason, rec_steps, rec_released = H[15], H[17], H[18], H[20]
    anext[aprev[p]] = anext[p]
    aprev[anext[p]] = aprev[p]
    S[0] -= 1
    r = rec_of[p]
    nblk = rec_blocks[r]
    rec_reason[r] = reason
    rec_released[r] = S[5] if timed else 0
    rec_steps[r] = nblk * (S[3] - taken_step[p])
    S[1] -= nblk
    f = fam[p]
    fam_refs[f] -= 1
    if fam_refs[f] == 0:
        S[2] -= 1
    o = hoff[p]
    return free_blocks(P, hstore, o + nblk - 1, o - 1, -1, scratch)


@_jit
def oldest_hold(H):  # pragma: no cover (compiled)
    return H[1][len(H[1]) - 1]


@_jit
def child_admitted(P, H, S, i, timed, scratch):  # pragma: no cover (compiled)
    """`PoolReplay._child_admitted`; returns how many blocks joined the free queue."""
    p = H[12][i]
    if p < 0:
        return 0
    H[8][p] += 1
    r = H[9][p]
    if r < 0 or H[14][r] != TAKEN or H[17][r] >= 0:  # no active hold
        return 0
    H[16][r] += 1
    H[2][p] -= 1
    if H[2][p] <= 0:
        return release_hold(P, H, S, p, CHILDREN, timed, scratch)
    return 0


@_jit
def boundary(P, H, S, timed, scratch):  # pragma: no cover (compiled)
    """`PoolReplay._boundary`: expire holds, oldest first, then count the boundary. Returns blocks freed."""
    out = 0
    if S[6] >= 0:
        while S[0] > 0:
            p = oldest_hold(H)
            if H[19][H[9][p]] + S[6] > S[5]:
                break
            out += release_hold(P, H, S, p, EXPIRY, timed, scratch)
    S[3] += 1
    return out


@_jit
def close_holds(P, H, S, timed, scratch):  # pragma: no cover (compiled)
    while S[0] > 0:
        release_hold(P, H, S, oldest_hold(H), CLOSE, timed, scratch)


# ---------------------------------------------------------------------------------------------------
# A request's admission and finish
# ---------------------------------------------------------------------------------------------------
# IN = (req_start, listed, prompt_tokens, output_tokens, finish_ns, arrival): the stream, per request
# R = (seq, store, off, cnt, scratch, hk, hi, num_full_of): the replay's buffers; seq holds the request
#     being admitted (hits, then new blocks), store[off[i]:off[i] + cnt[i]] a running request's blocks
#     (timed), hk/hi the running requests' heap; S[9:12] = num_free, heap size, num_deferred


@numba.njit(cache=True, nogil=True)
def replay_state(IN, timed, block_size, has_holds, is_parent, release_after, parent_of, fam, num_families,
                 expiry_ns, max_held_blocks, max_families):  # pragma: no cover (compiled)
    """The buffers (R) and the holds' state (H, S) of one replay over the stream IN."""
    prompt_tokens, output_tokens = IN[2], IN[3]
    n_req = len(prompt_tokens)
    off = np.zeros(n_req + 1, np.int64)
    num_full_of = np.zeros(n_req, np.int64)
    longest = 1
    for i in range(n_req):
        nb, nfull = request_blocks(prompt_tokens, output_tokens, block_size, i)
        off[i + 1] = off[i] + (nb if timed else 0)
        num_full_of[i] = nfull
        longest = max(longest, nb)
    H, S = hold_state(n_req, has_holds, is_parent, release_after, parent_of, fam, num_families, num_full_of,
                      expiry_ns, max_held_blocks, max_families)
    m = n_req if timed else 1
    R = (np.zeros(longest, np.int64), np.zeros(off[n_req], np.int64), off, np.zeros(n_req, np.int64),
         np.zeros(longest, np.int64), np.zeros(m, np.int64), np.zeros(m, np.int64), num_full_of)
    return R, H, S


@_jit
def finish(P, H, S, R, f, blocks, a, n, finish_ns, has_holds, timed):  # pragma: no cover (compiled)
    """`PoolReplay._finish` of request f, whose blocks are blocks[a:a + n]: the clock, its hold, then its
    blocks freed tail first."""
    if timed:
        S[5] = max(S[5], finish_ns)
    if has_holds and H[10][f]:
        S[9] -= take_hold(P, H, S, f, blocks, a, R[7][f], timed)
    S[9] += free_blocks(P, blocks, a + n - 1, a - 1, -1, R[4])


@_jit
def finish_earliest(P, H, S, R, IN, has_holds, timed):  # pragma: no cover (compiled)
    """Finish the running request that finishes first (timed)."""
    S[10] = heap_pop(R[5], R[6], S[10])
    f = R[6][S[10]]
    finish(P, H, S, R, f, R[1], R[2][f], R[3][f], IN[4][f], has_holds, timed)


@_jit
def geometry(IN, i, block_size):  # pragma: no cover (compiled)
    """Request i's (first hash, listed prompt hashes, output hashes, full prompt blocks, max hit blocks)."""
    req_start, listed, prompt_tokens = IN[0], IN[1], IN[2]
    p = prompt_tokens[i]
    a = req_start[i]
    n_listed = listed[i]  # prompt hashes in the stream (<= n_prompt_full)
    n_prompt_full = p // block_size
    return (a, n_listed, req_start[i + 1] - a - n_listed, n_prompt_full,
            min(max(p - 1, 0) // block_size, n_prompt_full, n_listed))


@_jit
def arrive(P, H, S, R, IN, obj, i, block_size, has_holds, timed):  # pragma: no cover (compiled)
    """`PoolReplay._arrive` up to the allocation: finishes due (timed), the boundary, then `admit`'s loop:
    look the prompt up until its blocks fit, releasing the oldest hold under pressure, else waiting for
    the earliest finish (timed), else stalling or refusing it. Returns (outcome, hits in R[0][:nh],
    blocks, full blocks)."""
    if timed:
        hk = R[5]
        while S[10] > 0 and hk[0] <= IN[5][i]:
            finish_earliest(P, H, S, R, IN, has_holds, timed)
        S[5] = max(S[5], IN[5][i])
    if has_holds:
        S[9] += boundary(P, H, S, timed, R[4])
    a, n_listed, n_out, n_prompt_full, max_hit = geometry(IN, i, block_size)
    num_blocks, num_full = request_blocks(IN[2], IN[3], block_size, i)
    prompt_blocks = -(-IN[2][i] // block_size)
    deferred = False
    while True:
        nh, ev = lookup(P, obj, a, max_hit, R[0])
        if num_blocks - nh + ev <= S[9]:
            outcome = FITS
            break
        if has_holds and S[0] > 0:  # a hold never blocks an admission
            S[9] += release_hold(P, H, S, oldest_hold(H), PRESSURE, timed, R[4])
        elif timed and S[10] > 0:
            deferred = True
            finish_earliest(P, H, S, R, IN, has_holds, timed)
        elif prompt_blocks - nh + ev <= S[9]:
            outcome = STALLS  # vLLM admits on the prompt alone; its output then outgrows the pool
            num_blocks = num_full = nh + S[9] - ev
            break
        else:
            return REFUSED, nh, num_blocks, num_full
    S[11] += deferred
    return outcome, nh, num_blocks, num_full


@_jit
def allocate_request(P, S, R, IN, obj, i, nh, num_blocks, num_full, block_size, evicted):  # pragma: no cover
    """Touch request i's hits R[0][:nh] and allocate its new blocks after them; returns (cached blocks
    evicted, evicted hash ids written to `evicted`)."""
    a, n_listed, n_out, n_prompt_full, _ = geometry(IN, i, block_size)
    S[9] -= touch(P, R[0], 0, nh) + num_blocks - nh
    return allocate(P, obj, a, n_listed, n_out, n_prompt_full, num_full, nh, num_blocks, R[0], evicted)


@_jit
def end_admission(P, H, S, R, IN, i, outcome, num_blocks, has_holds, timed):  # pragma: no cover (compiled)
    """After the allocation: a stalled request is freed at once; a timed one runs until its finish, a
    sequential one finishes now (a child's admission counts toward its parent's hold first)."""
    seq = R[0]
    if outcome == STALLS:  # it filled every block, all full and cached, then was preempted for good
        S[9] += free_blocks(P, seq, num_blocks - 1, -1, -1, R[4])
        return
    if timed:
        store, off = R[1], R[2]
        for j in range(num_blocks):
            store[off[i] + j] = seq[j]
        R[3][i] = num_blocks
    if has_holds:
        S[9] += child_admitted(P, H, S, i, timed, R[4])
    if timed:
        S[10] = heap_push(R[5], R[6], S[10], max(IN[4][i], IN[5][i]), i)
    else:
        finish(P, H, S, R, i, seq, 0, num_blocks, 0, has_holds, timed)


@_jit
def drain(P, H, S, R, IN, has_holds, timed):  # pragma: no cover (compiled)
    """`PoolReplay.close`: finish what is running, then release the holds."""
    while S[10] > 0:
        finish_earliest(P, H, S, R, IN, has_holds, timed)
    if has_holds:
        close_holds(P, H, S, timed, R[4])


# ---------------------------------------------------------------------------------------------------
# The pool's replay
# ---------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------
# Python side
# ---------------------------------------------------------------------------------------------------


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


def hold_inputs(holds, n: int):
    """A `HoldPolicy` as the kernel's arrays over n requests: (is_parent, release_after, parent_of, family
    ids, family names, expiry, caps), -1 for what the policy leaves out. Indices outside the stream are
    dropped: no request there can take or count toward a hold."""
    is_parent = np.zeros(n, np.bool_)
    release_after = np.zeros(n, np.int64)
    parent_of = np.full(n, -1, np.int64)
    fam = np.zeros(n, np.int64)
    names: dict[str, int] = {}
    for p, k in holds.release_after.items():
        if 0 <= p < n:
            is_parent[p] = True
            release_after[p] = k
            fam[p] = names.setdefault(holds.family_of.get(p, str(p)), len(names))
    for c, p in holds.parent_of.items():
        if 0 <= c < n and 0 <= p < n:
            parent_of[c] = p
    caps = tuple(-1 if v is None else int(v) for v in (holds.expiry_ns, holds.max_held_blocks, holds.max_families))
    return is_parent, release_after, parent_of, fam, list(names), caps


def replay_compiled(requests, block_size: int, num_usable_blocks: int, timed: bool, stream=None, holds=None):
    """`PoolReplay(requests, ..., holds, timed).run()`'s results, compiled: (hit_blocks, num_evictions,
    admitted, stalled, free_queue) as numpy arrays, num_deferred, and the hold records as
    (parent, status, num_blocks, served, reason, held_block_steps, taken_ns, released_ns) arrays, with the
    family names their parents' ids index (`family_names[family_ids[parent]]`)."""
    stream, listed, output_tokens, arrival, finish = pool_inputs(requests, block_size, stream)
    n = len(requests)
    if holds is None:
        is_parent, release_after, parent_of, fam, names, caps = (np.zeros(0, np.bool_), *(np.zeros(0, np.int64),) * 3,
                                                                 [], (-1, -1, -1))
    else:
        is_parent, release_after, parent_of, fam, names, caps = hold_inputs(holds, n)
    IN = (stream.req_start, listed, stream.num_prompt_tokens, output_tokens, finish, arrival)
    out = run_interruptible(_replay, stream.obj, IN, bool(timed), int(block_size), int(num_usable_blocks),
                            int(stream.num_objects), holds is not None, is_parent, release_after, parent_of, fam,
                            max(len(names), 1), caps)
    return out, fam, names


_pool_replay = declare("ks_pool_replay", [P, P, P, P, P, P, P, P, I64, I32, I64, I64, I64, I32, P, P, P, P, I64, I64,
                                          I64, I64, P, P, P, P, P, P, P], I64)


def obj_pointers(obj: np.ndarray) -> tuple:
    """A stream's dense ids (int32 or int64, contiguous: the caller keeps them) as the kernels take them:
    (int32 pointer, int64 pointer), one of them NULL."""
    if obj.dtype == np.int32:
        return ptr(obj, np.int32), None
    return None, ptr(obj, np.int64)


def stream_pointers(IN: tuple) -> list:
    """The per-request arrays of a stream (req_start, listed, prompt_tokens, output_tokens, finish_ns,
    arrival) as pointers to int64 arrays."""
    return [ptr(a, np.int64) for a in IN]


def _replay(obj, IN, timed, block_size, num_usable, num_objects, has_holds, is_parent, release_after, parent_of,
            fam, num_families, caps):
    """The C replay (native/kernels/pool.c); the results as `replay_compiled` documents them."""
    n_req = len(IN[2])
    IN = tuple(np.ascontiguousarray(a, np.int64) for a in IN)
    obj = obj if obj.dtype == np.int32 else np.ascontiguousarray(obj, np.int64)
    hit_blocks = np.zeros(n_req, np.int64)
    num_evictions = np.zeros(n_req, np.int64)
    admitted = np.zeros(n_req, np.bool_)
    stalled = np.zeros(n_req, np.bool_)
    queue = np.zeros(num_usable, np.int64)
    records = np.zeros((NUM_RECORD_ROWS, n_req if has_holds else 0), np.int64)
    out = np.zeros(3, np.int64)
    hold_ptrs = [None] * 4
    if has_holds:  # the arrays stay referenced (is_parent, ...) until the call returns
        is_parent = np.ascontiguousarray(is_parent, np.bool_)
        release_after, parent_of, fam = (np.ascontiguousarray(a, np.int64) for a in (release_after, parent_of, fam))
        hold_ptrs = [ptr(is_parent, np.bool_)] + [ptr(a, np.int64) for a in (release_after, parent_of, fam)]
    check(_pool_replay(*obj_pointers(obj), *stream_pointers(IN), n_req, timed, block_size, num_usable, num_objects,
                       has_holds, *hold_ptrs, num_families, *caps, ptr(hit_blocks, np.int64), ptr(num_evictions, np.int64),
                       ptr(admitted, np.bool_), ptr(stalled, np.bool_), ptr(queue, np.int64), ptr(records, np.int64),
                       ptr(out, np.int64)), "the block-pool replay")
    m = int(out[2])
    return hit_blocks, num_evictions, admitted, stalled, queue[:int(out[0])], int(out[1]), tuple(records[:, :m])
