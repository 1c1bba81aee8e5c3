"""Whole hit-ratio curves: `lru` and `belady` at every capacity from one pass over the access stream.

Both are stack algorithms (Mattson et al., 1970): the cache of capacity c is always contained in
the cache of capacity c + 1, so one pass can give every access the smallest capacity at which it
hits (its *level*), and the hits at capacity c are the accesses of level <= c.

- `lru`: the recency stack. A request's reads are looked up before its blocks are touched, so a
  read's level is its object's stack distance when the request starts (counted with a Fenwick tree
  over touch times), and the request's j-th leading read hits at capacity c when the largest level
  among reads 0..j is <= c (the prefix lookup stops at the first miss). The tree holds a window of
  touch times, windowed as the Belady time tree below: a level is counted from a last touch on, and a
  last touch is read again only when its object's next access after its request is a counted read, so
  when the window is full it moves on to the earliest such live touch (or doubles when that frees less
  than half of it).
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

Both kernels are C (native/kernels/curves.c and lru_curve_body.h, through kmesh_trace.native.kernels);
they release the GIL, so the two curves of one analysis run side by side.

Each curve also carries, per capacity, the position sum of its hits so that prefill seconds follow
from a `PrefillCost` (hits are charged as a cached prefix: a request with h hit blocks computes
positions [h * block_size, prompt tokens)). Requests before `measure_from` warm the cache but are
not counted (the `--window last-half` of the CLI). Tests check both curves against the per-capacity
replays at every capacity.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.native.kernels import I64, P, Struct, check, declare
from kmesh_trace.oracle.interruptible import run_interruptible
from kmesh_trace.oracle.kernel_ids import AccessStreamStruct, declare_widths, kernel_stream
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


#: First sizes of the Belady kernel's two trees (each doubles when it must): blocks of the time window,
#: and capacities tracked (levels reached + 1; it never exceeds the objects + 2).
FIRST_BLOCKS = 1 << 10
FIRST_CAPACITIES = 1 << 12
#: First size of the LRU kernel's window of touch times (it doubles when it must).
FIRST_LRU_WINDOW = 1 << 13

_BAD_STREAM = -22  # KS_EBADSTREAM of native/kernels/curves.c
_free = declare("ks_curves_free", [P])


class _CurveOut(Struct):
    """struct ks_curve_out (native/kernels/boundary.h): the histograms the kernel allocated, its trees' sizes."""

    c_type = "ks_curve_out"
    _fields_ = [("count", P), ("possum", P), ("window", I64), ("tracked", I64)]


_OUT = ctypes.POINTER(_CurveOut)
_belady = declare("ks_curves_belady_levels", [ctypes.POINTER(AccessStreamStruct), I64, I64, I64, _OUT], I64)
_lru = declare_widths("ks_curves_lru_levels", [I64, I64, _OUT], I64)


def _histograms(call) -> tuple[np.ndarray, np.ndarray, _CurveOut]:
    """The (count, position sum) histograms a curve kernel allocated (`call(&out)` returns their length),
    copied into numpy and freed, and the kernel's output structure."""
    out = _CurveOut()
    try:
        n = call(ctypes.byref(out))
        if n == _BAD_STREAM:
            raise ValueError("next_use does not match obj and eligible")
        check(n, "hit-ratio curve")
        return _copy(out.count, n), _copy(out.possum, n), out
    finally:
        _free(out.count)
        _free(out.possum)


def _copy(address: int, n: int) -> np.ndarray:
    """The n int64 values at `address`, copied into numpy."""
    return np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctypes.c_int64)), (n,)).copy()


def _lru_levels(stream: AccessStream, measure_from: int, first_window: int = FIRST_LRU_WINDOW):
    """(count, position sum, the final window of touch times) of the lru curve (native/kernels/curves.c)."""
    width, args = kernel_stream(stream)
    count, possum, out = _histograms(lambda o: _lru[width](ctypes.byref(args), int(measure_from), int(first_window),
                                                           o))
    return count, possum, out.window


def _belady_levels(obj, eligible, next_use, req_start, num_objects, measure_from, never, first_blocks, first_caps):
    """(count, position sum, the final sizes of the time window and of the capacity tree) of the belady
    curve (native/kernels/curves.c; fewer than 2^30 accesses)."""
    args = AccessStreamStruct.over(np.ascontiguousarray(obj, np.int32), np.ascontiguousarray(eligible, np.bool_),
                           np.ascontiguousarray(next_use, np.int64), np.ascontiguousarray(req_start, np.int64),
                           num_objects, never)
    count, possum, out = _histograms(lambda o: _belady(ctypes.byref(args), int(measure_from), int(first_blocks),
                                                       int(first_caps), o))
    return count, possum, out.window, out.tracked


def _measured(stream: AccessStream, measure_from: int) -> tuple[int, int]:
    return int(stream.num_reads[measure_from:].sum()), int(stream.num_prompt_tokens[measure_from:].sum())


def lru_curve(stream: AccessStream, measure_from: int = 0, *, first_window: int = FIRST_LRU_WINDOW) -> HitCurve:
    """`lru` at every capacity, counting requests from `measure_from` on (the first size of the kernel's
    window changes its speed only)."""
    count, possum, _ = run_interruptible(_lru_levels, stream, int(measure_from), int(first_window))
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
