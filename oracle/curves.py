"""Whole hit-ratio curves: `lru` and `belady` at every capacity from one pass over the access stream.

Both are stack algorithms (Mattson et al., 1970): the cache of capacity c is always contained in
the cache of capacity c + 1, so one pass can give every access the smallest capacity at which it
hits (its *level*), and the hits at capacity c are the accesses of level <= c.

- `lru`: the recency stack. A request's reads are looked up before its blocks are touched, so a
  read's level is its object's stack distance when the request starts (counted with a Fenwick tree
  over touch times), and the request's j-th leading read hits at capacity c when the largest level
  among reads 0..j is <= c (the prefix lookup stops at the first miss).
- `belady`: a priority stack with holes. Level i holds at most one object; the cache of capacity c
  is the objects on levels 1..c. An access removes its object from its level (a hole), then, if the
  object has a counted next use, carries it down from level 1: at each level the object with the
  nearer next use stays and the farther one is carried on, until the carried object fills the
  first hole (or a new bottom level). At capacity c that is exactly the kernel of
  `policies.belady`: a resident object stays; a missing one is admitted into a free slot, or
  displaces the resident object with the farthest next use when its own is nearer; an object with
  no counted next use leaves.

  The levels are computed without that stack, in O(log n) per access, by the Critical Stack
  Algorithm of G. Bilardi, K. Ekanadham and P. Pattnaik, "Optimal on-line computation of stack
  distances for MIN and OPT" (ACM Computing Frontiers 2017, doi:10.1145/3075564.3075571), which
  gives OPT's stack distance of every access from the LRU order of the objects and, per capacity c,
  its *critical time* (when an access last had distance c). That algorithm is for demand paging
  (the accessed object always enters the cache); this cache may refuse an incoming block, which is
  demand paging with one more slot on the trace with a fresh, never reused access after each access
  (it takes the slot the refused block would hold): at time 2t the access, at 2t + 1 its dummy. An
  access without a counted previous use (a first access, a write, a read after a write) is a fresh
  object too. Every fresh object creates a capacity critical at its time. A counted reuse of an
  object last touched at time tau has level d = the smallest capacity c >= 1 critical at or before
  s, where s is the earliest last touch of an object after tau with balance 0 (as many capacities
  critical after s as objects touched after s; the balance is never negative there); d becomes
  critical now. The balance is a segment tree over time slots (sum, and the smallest suffix sum after
  a last touch), the critical times a min tree over capacities. `tests/belady_stack.py` keeps the
  stack itself as the reference the tests compare against.

  Both trees are kept as small as the stream allows, which is what keeps the time per access flat as
  the stream grows (their height, and the memory their paths touch, would otherwise grow with the
  stream and with the objects): the time tree holds a window of slots from the earliest last touch that
  a counted reuse will still read (the stream's next uses say which); nothing before it is read again,
  so when the window is full it moves on to there, or doubles when that frees less than half of it.
  The capacity tree tracks the capacities up to a power of two above the deepest level reached;
  capacities are created in time order and a capacity not yet tracked has never been critical since its
  creation, so when a level needs the first untracked one the tree doubles, its new capacities' times
  recovered from one bit per access (whether it created a capacity at 2t).

Each curve also carries, per capacity, the position sum of its hits so that prefill seconds follow
from a `PrefillCost` (hits are charged as a cached prefix: a request with h hit blocks computes
positions [h * block_size, prompt tokens)). Requests before `measure_from` warm the cache but are
not counted (the `--window last-half` of the CLI). Tests check both curves against the per-capacity
replays at every capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.interruptible import run_interruptible
from kmesh_trace.oracle.stream import NEVER, AccessStream


@dataclass
class HitCurve:
    """Hit blocks of one policy at every capacity, as a histogram over levels.

    `count[l]` reads first hit at capacity l; `position_sum[l]` the sum of their block positions in
    their requests' hit prefix (block k of a prefix of h hits has position k). Capacity 0 hits nothing."""

    policy: str
    block_size: int
    count: np.ndarray  # int64, index = level (capacity), count[0] == 0
    position_sum: np.ndarray  # int64
    num_reads: int  # hit-ratio denominator over the measured requests
    num_prompt_tokens: int  # over the measured requests

    @property
    def max_level(self) -> int:
        """The smallest capacity from which the curve is flat."""
        nz = np.flatnonzero(self.count)
        return int(nz[-1]) if len(nz) else 0

    def hit_blocks(self, capacities) -> np.ndarray:
        """Hit blocks at each capacity (int64 array)."""
        c = np.minimum(np.asarray(capacities, np.int64), len(self.count) - 1)
        return np.cumsum(self.count)[np.maximum(c, 0)] * (np.asarray(capacities) > 0)

    def hit_ratio(self, capacities) -> np.ndarray:
        return self.hit_blocks(capacities) / self.num_reads if self.num_reads else np.zeros(len(np.atleast_1d(capacities)))

    def prefill_tokens(self, capacities) -> np.ndarray:
        return self.num_prompt_tokens - self.hit_blocks(capacities) * self.block_size

    def saved_seconds(self, capacities, cost) -> np.ndarray:
        """Prefill seconds the hits save under `cost` (a PrefillCost): block k of a hit prefix covers
        positions [k * bs, (k + 1) * bs)."""
        bs = self.block_size
        caps = np.asarray(capacities, np.int64)
        c = np.minimum(np.maximum(caps, 0), len(self.count) - 1)
        n = np.cumsum(self.count)[c].astype(np.float64)
        k = np.cumsum(self.position_sum)[c].astype(np.float64)
        saved = cost.seconds_per_token * bs * n + cost.seconds_per_token_position * bs * bs * (2 * k + n) / 2
        return np.where(caps > 0, saved, 0.0)

    def steps(self) -> tuple[np.ndarray, np.ndarray]:
        """(capacities where the curve rises, hit blocks from each): the whole curve as a step function."""
        lv = np.flatnonzero(self.count)
        return lv, np.cumsum(self.count)[lv]

    def capacity_for(self, hit_blocks: float) -> int | None:
        """The smallest capacity with at least `hit_blocks` hits (None if the curve never gets there)."""
        cum = np.cumsum(self.count)
        i = int(np.searchsorted(cum, hit_blocks, side="left"))
        return max(i, 1) if i < len(cum) else None


@numba.njit(cache=True, nogil=True)
def _grown(hist, top):  # pragma: no cover (compiled)
    """`hist` (int64) with room for index `top`: at least twice as long, zeros added."""
    out = np.zeros(max(2 * len(hist), top + 1), np.int64)
    out[:len(hist)] = hist
    return out


@numba.njit(cache=True, nogil=True)
def _lru_levels(obj, eligible, req_start, last, measure_from):  # pragma: no cover (compiled)
    # last[o]: the object's last touch time, 0 = never (zeros, one per object, in integers that hold n).
    n = len(obj)
    tree = np.zeros(n + 1, np.int32)  # Fenwick tree over touch times 1..n: 1 where an object was last touched
    count = np.zeros(1025, np.int64)  # by level, grown as levels deepen (a level never exceeds the objects)
    possum = np.zeros(1025, np.int64)
    live = 0
    clock = 0
    for r in range(len(req_start) - 1):
        a, b = req_start[r], req_start[r + 1]
        m = 0
        for t in range(a, b):
            if not eligible[t]:
                break
            lt = last[obj[t]]
            if lt == 0:
                break
            s = 0
            i = lt - 1
            while i > 0:
                s += tree[i]
                i -= i & -i
            rank = live - s  # objects touched at or after lt
            if rank > m:
                m = rank
                if m >= len(count):
                    count, possum = _grown(count, m), _grown(possum, m)
            if r >= measure_from:
                count[m] += 1
                possum[m] += t - a
        for t in range(b - 1, a - 1, -1):
            o = obj[t]
            lt = last[o]
            if lt == 0:
                live += 1
            else:
                i = lt
                while i <= n:
                    tree[i] -= 1
                    i += i & -i
            clock += 1
            last[o] = clock
            i = clock
            while i <= n:
                tree[i] += 1
                i += i & -i
    return count, possum


@numba.njit(cache=True, nogil=True)
def level_buffers(req_start):  # pragma: no cover (compiled)
    """(count, position-sum histograms, a buffer for one request's hit levels)."""
    longest = 0
    for r in range(len(req_start) - 1):
        longest = max(longest, req_start[r + 1] - req_start[r])
    return np.zeros(1025, np.int64), np.zeros(1025, np.int64), np.empty(max(longest, 1), np.int64)


@numba.njit(cache=True, nogil=True)
def charge_as_prefix(levels, count, possum):  # pragma: no cover (compiled)
    """Add one request's hit levels to the histograms (grown as needed), charged as a prefix: the k-th
    cheapest hit is block k of the request's hit prefix."""
    th = np.sort(levels)
    nh = len(th)
    if th[nh - 1] >= len(count):
        count, possum = _grown(count, th[nh - 1]), _grown(possum, th[nh - 1])
    for k in range(nh):
        count[th[k]] += 1
        possum[th[k]] += k
    return count, possum


_INF = np.int32(1 << 30)  # "no last touch in this node" (sums stay far below it)
_DONE, _CAP_READ, _TOUCH, _CAP_DUMMY = 8, 1, 2, 4  # slot state bits, see _slot
_BLOCK = 8  # slots per leaf of the time tree, scanned in place


@numba.njit(cache=True, nogil=True, inline="always")
def _slot(state):  # pragma: no cover (compiled)
    # Slot j of the time tree holds times 2j (access j) and 2j + 1 (its dummy). Returns the slot's sum of
    # (capacity marks - last touches) and the smallest such sum after one of its last touches.
    if not state & _DONE:
        return 0, _INF
    dummy = ((state >> 2) & 1) - 1  # the dummy is always a last touch
    total = (state & _CAP_READ) - ((state >> 1) & 1) + dummy
    return total, (min(0, dummy) if state & _TOUCH else 0)


@numba.njit(cache=True, nogil=True)
def _scan(slots, lo, hi, after):  # pragma: no cover (compiled)
    # Over slots [lo, hi) with `after` the sum of everything later: (their sum, the smallest suffix sum
    # after a last touch, the earliest last touch whose suffix sum is 0 or -1).
    total = 0
    low = _INF
    first = -1
    for j in range(hi - 1, lo - 1, -1):
        s, m = _slot(slots[j])
        if m != _INF:
            if after + total == 0:  # the dummy at 2j + 1
                first = 2 * j + 1
            if slots[j] & _TOUCH and after + total + ((slots[j] >> 2) & 1) - 1 == 0:
                first = 2 * j
            low = min(low, m + total)
        total += s
    return total, low, first


@numba.njit(cache=True, nogil=True)
def _pull(sm, ms, slots, nb, j):  # pragma: no cover (compiled)
    # Nodes 1..nb-1 are internal, nb + b summarises block b.
    b = j // _BLOCK
    s, m, _ = _scan(slots, b * _BLOCK, (b + 1) * _BLOCK, 0)
    i = nb + b
    sm[i] = s
    ms[i] = m
    i >>= 1
    while i >= 1:
        sr = sm[2 * i + 1]
        sm[i] = sm[2 * i] + sr
        ms[i] = min(ms[2 * i] + sr, ms[2 * i + 1])
        i >>= 1


@numba.njit(cache=True, nogil=True)
def _first_balanced(sm, ms, slots, nb, p, nodes, after):  # pragma: no cover (compiled)
    # The earliest last touch after time 2p with nothing after it on balance (imbalance 0). Time
    # 2(t - 1) + 1, the latest dummy, always qualifies.
    bp = p // _BLOCK
    k = 0
    lo, hi = bp + 1 + nb, 2 * nb
    while lo < hi:
        if lo & 1:
            nodes[k] = lo
            k += 1
            lo += 1
        lo >>= 1
        hi >>= 1
    a = 0
    for q in range(k - 1, -1, -1):
        after[q] = a
        a += sm[nodes[q]]
    total, _, first = _scan(slots, p + 1, (bp + 1) * _BLOCK, a)
    if a + total == 0:  # the dummy right after p
        return 2 * p + 1
    if first >= 0:
        return first
    for q in range(k):
        i, a = nodes[q], after[q]
        if ms[i] + a != 0:
            continue
        while i < nb:
            sr = sm[2 * i + 1]
            if ms[2 * i] + a + sr == 0:
                a += sr
                i = 2 * i
            else:
                i = 2 * i + 1
        b = i - nb
        return _scan(slots, b * _BLOCK, (b + 1) * _BLOCK, a)[2]
    return -1  # unreachable


@numba.njit(cache=True, nogil=True)
def _set_critical(tree, csize, c, when):  # pragma: no cover (compiled)
    i = c + csize
    tree[i] = when
    i >>= 1
    while i >= 1:
        tree[i] = min(tree[2 * i], tree[2 * i + 1])
        i >>= 1


@numba.njit(cache=True, nogil=True)
def _build(sm, ms, slots, nb):  # pragma: no cover (compiled)
    # Every node of the time tree from its slots, bottom-up.
    for b in range(nb):
        s, m, _ = _scan(slots, b * _BLOCK, (b + 1) * _BLOCK, 0)
        sm[nb + b] = s
        ms[nb + b] = m
    for i in range(nb - 1, 0, -1):
        sr = sm[2 * i + 1]
        sm[i] = sm[2 * i] + sr
        ms[i] = min(ms[2 * i] + sr, ms[2 * i + 1])


@numba.njit(cache=True, nogil=True)
def _time_window(sm, ms, slots, nb, base, low, t, next_use, never):  # pragma: no cover (compiled)
    # The window [base, base + nb * _BLOCK) of slots is full at access t. Its new start is the block of the
    # earliest last touch that a counted reuse will still read (`low`, found by moving on from the last one:
    # a live last touch is only ever added at the present); earlier slots are never scanned again. The slots
    # kept move to the front, into a tree twice as large when they would fill more than half of it.
    while low < t and not (slots[low - base] & _TOUCH and next_use[low] != never):
        low += 1
    start = low - low % _BLOCK
    keep = t - start
    if 2 * keep > nb * _BLOCK:
        nb *= 2
        sm = np.zeros(2 * nb, np.int32)
        ms = np.full(2 * nb, _INF, np.int32)
        grown = np.zeros(nb * _BLOCK, np.uint8)
        grown[:keep] = slots[start - base:t - base]
        slots = grown
    else:
        for j in range(keep):  # forward: the destination is never after the source
            slots[j] = slots[start - base + j]
        slots[keep:] = 0
    _build(sm, ms, slots, nb)
    return sm, ms, slots, nb, start, low


@numba.njit(cache=True, nogil=True)
def _more_capacities(crit, csize, num_caps, fresh):  # pragma: no cover (compiled)
    # The capacity tree doubled. Capacities at or above the old size were created without being tracked
    # (each at its creation time, never critical since: none could be a level yet); their critical times
    # come back from the accesses that created them (a fresh access creates one at 2u, its dummy one at
    # 2u + 1, in that order), recorded as one bit per access in `fresh`.
    old = csize
    csize *= 2
    grown = np.full(csize, -1, np.int32)
    grown[:old] = crit
    c = 0
    u = 0
    while c < min(csize, num_caps):
        if fresh[u >> 3] >> (u & 7) & 1:
            if c >= old:
                grown[c] = 2 * u
            c += 1
        if old <= c < csize:
            grown[c] = 2 * u + 1
        c += 1
        u += 1
    tree = np.full(2 * csize, _INF, np.int32)
    for c in range(1, min(csize, num_caps)):
        tree[csize + c] = grown[c]
    for i in range(csize - 1, 0, -1):
        tree[i] = min(tree[2 * i], tree[2 * i + 1])
    return grown, tree, csize


#: First sizes of the Belady kernel's two trees (each doubles when it must): blocks of the time window,
#: and capacities tracked (levels reached + 1; it never exceeds the objects + 2).
FIRST_BLOCKS = 1 << 10
FIRST_CAPACITIES = 1 << 12


@numba.njit(cache=True, nogil=True)
def _belady_levels(obj, eligible, next_use, req_start, num_objects, measure_from, never, first_blocks,
                   first_caps):  # pragma: no cover
    n = len(obj)
    nb = first_blocks  # blocks of _BLOCK slots, a power of two: the time window [base, base + nb * _BLOCK)
    sm = np.zeros(2 * nb, np.int32)  # the time tree's nodes: sum, smallest suffix sum after a last touch
    ms = np.full(2 * nb, _INF, np.int32)
    slots = np.zeros(nb * _BLOCK, np.uint8)
    base = 0
    low = 0
    csize = 1  # capacities tracked, a power of two (a level never exceeds the objects on the stack + 1)
    while csize < min(num_objects + 2, first_caps):
        csize *= 2
    ctree = np.full(2 * csize, _INF, np.int32)  # min tree over tracked capacities of their critical times
    crit = np.full(csize, -1, np.int32)
    fresh = np.zeros((n >> 3) + 1, np.uint8)  # one bit per access: it created a capacity at 2t
    last = np.full(num_objects, -1, np.int32)
    nodes = np.empty(64, np.int64)
    after = np.empty(64, np.int64)
    num_caps = 0  # capacities created so far (one per fresh access and one per dummy); index 0 is never a level
    count, possum, thr = level_buffers(req_start)
    for r in range(len(req_start) - 1):
        nh = 0
        for t in range(req_start[r], req_start[r + 1]):
            if t - base == nb * _BLOCK:
                sm, ms, slots, nb, base, low = _time_window(sm, ms, slots, nb, base, low, t, next_use, never)
            o = obj[t]
            p = last[o]
            if eligible[t] and p >= 0:  # a counted reuse (next_use[p] == t): its level; then d becomes critical
                if p < base:
                    raise ValueError("next_use does not match obj and eligible")
                s = _first_balanced(sm, ms, slots, nb, p - base, nodes, after) + 2 * base
                if ctree[1] > s:  # no tracked capacity is critical by s: the smallest untracked one is
                    d = csize  # (capacities are created in time order, and stay untouched until tracked)
                    crit, ctree, csize = _more_capacities(crit, csize, num_caps, fresh)
                else:
                    i = 1
                    while i < csize:
                        i = 2 * i if ctree[2 * i] <= s else 2 * i + 1
                    d = i - csize
                thr[nh] = d
                nh += 1
                old = crit[d]
                if old >> 1 >= base:  # an earlier mark lies before the window, where nothing is read again
                    slots[(old >> 1) - base] &= np.uint8(0xFF ^ (_CAP_DUMMY if old & 1 else _CAP_READ))
                    _pull(sm, ms, slots, nb, (old >> 1) - base)
                crit[d] = 2 * t
                _set_critical(ctree, csize, d, 2 * t)
                slots[p - base] &= np.uint8(0xFF ^ _TOUCH)  # the object's last touch moves to t
                _pull(sm, ms, slots, nb, p - base)
            else:  # a fresh object (first access, write, or a read after a write): a new capacity
                fresh[t >> 3] |= np.uint8(1 << (t & 7))
                if 0 < num_caps < csize:
                    crit[num_caps] = 2 * t
                    _set_critical(ctree, csize, num_caps, 2 * t)
                num_caps += 1
            if 0 < num_caps < csize:  # the dummy after t: a fresh object, a new capacity
                crit[num_caps] = 2 * t + 1
                _set_critical(ctree, csize, num_caps, 2 * t + 1)
            num_caps += 1
            slots[t - base] = np.uint8(_DONE | _CAP_READ | _TOUCH | _CAP_DUMMY)
            _pull(sm, ms, slots, nb, t - base)
            last[o] = t
        if r >= measure_from and nh > 0:
            count, possum = charge_as_prefix(thr[:nh], count, possum)
    return count, possum, nb * _BLOCK, csize  # (the curve; the final sizes of the two trees)


def _measured(stream: AccessStream, measure_from: int) -> tuple[int, int]:
    return int(stream.num_reads[measure_from:].sum()), int(stream.num_prompt_tokens[measure_from:].sum())


def lru_curve(stream: AccessStream, measure_from: int = 0) -> HitCurve:
    """`lru` at every capacity, counting requests from `measure_from` on."""
    last = np.zeros(stream.num_objects, np.int32 if len(stream) < 2**31 else np.int64)
    count, possum = run_interruptible(_lru_levels, stream.obj, stream.eligible, stream.req_start, last,
                                      int(measure_from))
    count[0] = possum[0] = 0
    return HitCurve("lru", stream.block_size, count, possum, *_measured(stream, measure_from))


def belady_curve(stream: AccessStream, measure_from: int = 0, *, first_blocks: int = FIRST_BLOCKS,
                 first_capacities: int = FIRST_CAPACITIES) -> HitCurve:
    """`belady` at every capacity, counting requests from `measure_from` on (the first sizes of the
    kernel's trees change its speed only: the tests start them small, so that they grow often)."""
    if len(stream) >= 2**30:  # times 2t + 1 are int32 in the kernel
        raise KmeshTraceError(f"the belady curve handles up to 2^30 block accesses, not {len(stream):,}.")
    count, possum, _, _ = run_interruptible(_belady_levels, stream.obj, stream.eligible, stream.next_use,
                                            stream.req_start, stream.num_objects, int(measure_from), NEVER,
                                            int(first_blocks), int(first_capacities))
    return HitCurve("belady", stream.block_size, count, possum, *_measured(stream, measure_from))


CURVES = {"lru": lru_curve, "belady": belady_curve}
