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
def _lru_levels(obj, eligible, req_start, num_objects, measure_from):  # pragma: no cover (compiled)
    n = len(obj)
    tree = np.zeros(n + 1, np.int32)  # Fenwick tree over touch times 1..n: 1 where an object was last touched
    last = np.zeros(num_objects, np.int64)  # last touch time, 0 = never
    count = np.zeros(num_objects + 1, np.int64)
    possum = np.zeros(num_objects + 1, np.int64)
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
def _belady_levels(obj, eligible, next_use, req_start, num_objects, never, measure_from):  # pragma: no cover
    # Levels are two sequential arrays (object, next use; object -1 = a hole); the inner loops touch
    # nothing else, so an object's level is found by scanning rather than kept up to date per move.
    size = 1024
    lvl_obj = np.full(size, -1, np.int64)
    lvl_key = np.zeros(size, np.int64)
    on_stack = np.zeros(num_objects, np.bool_)
    num_levels = 0
    count = np.zeros(size + 1, np.int64)
    possum = np.zeros(size + 1, np.int64)
    longest = 0
    for r in range(len(req_start) - 1):
        longest = max(longest, req_start[r + 1] - req_start[r])
    thr = np.empty(max(longest, 1), np.int64)
    for r in range(len(req_start) - 1):
        nh = 0
        for t in range(req_start[r], req_start[r + 1]):
            o = obj[t]
            if on_stack[o]:
                d = 0
                while lvl_obj[d] != o:
                    d += 1
                if eligible[t]:
                    thr[nh] = d + 1
                    nh += 1
                lvl_obj[d] = -1
                on_stack[o] = False
            ky = next_use[t]
            if ky == never:
                continue
            on_stack[o] = True
            y = o
            i = 0
            while True:
                if i == num_levels:
                    if i == size:
                        size *= 2
                        grown_obj = np.full(size, -1, np.int64)
                        grown_obj[:i] = lvl_obj
                        grown_key = np.zeros(size, np.int64)
                        grown_key[:i] = lvl_key
                        lvl_obj, lvl_key = grown_obj, grown_key
                    num_levels += 1
                    lvl_obj[i] = y
                    lvl_key[i] = ky
                    break
                z = lvl_obj[i]
                if z < 0:
                    lvl_obj[i] = y
                    lvl_key[i] = ky
                    break
                kz = lvl_key[i]
                if kz > ky:  # the nearer next use stays on this level
                    lvl_obj[i] = y
                    lvl_key[i] = ky
                    y = z
                    ky = kz
                i += 1
        while num_levels > 0 and lvl_obj[num_levels - 1] < 0:
            num_levels -= 1
        if r >= measure_from and nh > 0:
            th = np.sort(thr[:nh])  # charged as a prefix: the k-th cheapest hit is block k
            if th[nh - 1] >= len(count):
                grown = np.zeros(max(2 * len(count), th[nh - 1] + 1), np.int64)
                grown[:len(count)] = count
                count = grown
                grown = np.zeros(len(count), np.int64)
                grown[:len(possum)] = possum
                possum = grown
            for k in range(nh):
                count[th[k]] += 1
                possum[th[k]] += k
    return count, possum


def _measured(stream: AccessStream, measure_from: int) -> tuple[int, int]:
    return int(stream.num_reads[measure_from:].sum()), int(stream.num_prompt_tokens[measure_from:].sum())


def lru_curve(stream: AccessStream, measure_from: int = 0) -> HitCurve:
    """`lru` at every capacity, counting requests from `measure_from` on."""
    count, possum = run_interruptible(_lru_levels, stream.obj, stream.eligible, stream.req_start, stream.num_objects,
                                      int(measure_from))
    count[0] = possum[0] = 0
    return HitCurve("lru", stream.block_size, count, possum, *_measured(stream, measure_from))


def belady_curve(stream: AccessStream, measure_from: int = 0) -> HitCurve:
    """`belady` at every capacity, counting requests from `measure_from` on."""
    count, possum = run_interruptible(_belady_levels, stream.obj, stream.eligible, stream.next_use, stream.req_start,
                                   stream.num_objects, NEVER, int(measure_from))
    return HitCurve("belady", stream.block_size, count, possum, *_measured(stream, measure_from))


CURVES = {"lru": lru_curve, "belady": belady_curve}
