"""Spatially sampled and partitioned access streams, and the curves scaled back from them.

Spatial sampling (SHARDS: C. Waldspurger, N. Park, A. Garthwaite and I. Ahmad, "Efficient MRC
Construction with SHARDS", FAST'15): an object is kept when a hash of its id falls below a threshold,
so a kept object keeps *every* one of its accesses and its reuses stay reuses. An object's hash is
`SPACE` buckets wide (the top 24 bits of splitmix64's output number id + 1, which `build_stream` numbers by
the rank of its block hash: the same hashes give the same ids, so the same sample, on every run and
on every machine); a `Share` is a range [lo, hi) of those buckets.

- Sampling at rate R keeps the share [0, R * SPACE). A stack curve over the kept accesses at capacity c
  stands for the whole stream at capacity c / R (`scaled_curve`: a level l moves to l / R, its hits spread
  over the capacities between (l - 1) / R and l / R, which the sample cannot tell apart), and its hits
  are scaled by E / E_s, the eligible reads of the whole stream over those of the sample in the measured
  window (the ratio estimator: the sample's own share of the reads, not the nominal R, which is what
  SHARDS-adj corrects). A policy replayed at one capacity (not a stack algorithm: `belady-prefix`) is
  replayed on the sample at capacity C * R, the mini-simulation of the same authors' "Cache Modeling
  and Optimization using Miniature Simulations" (USENIX ATC'17), and scaled the same way.
- Partitioning into k shares (share p = buckets [p * SPACE / k, (p + 1) * SPACE / k)) splits the stream
  into k disjoint sub-streams, each simulated as a cache of C / k; the merged curve (`merged_curve`)
  adds their hits at level l of share p to capacity l * k (spread as a sample's are). Every eligible reuse is a reuse in its own
  share, so the merge is exact for the infinite cache; at finite capacities it is share 0's sampling
  error, averaged over the k shares.

Two things make a sampled curve differ from the exact one, and the error is measured, not promised
(`MEASURED_ERROR`, benchmarks/README.md): which objects were kept, and, for `lru`, the prefix lookup:
a request's read hits only when every read before it hit, and the sample sees only its own reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.curves import HitCurve
from kmesh_trace.oracle.stream import NEVER, AccessStream

__all__ = ["MEASURED_ERROR", "SPACE", "Share", "adjusted_curve", "error_bound", "hash_buckets", "merged_curve",
           "object_buckets", "rate_share", "scaled_curve", "sub_stream", "accesses_for_bytes", "bounded_rate",
           "SAMPLE_BYTES_PER_ACCESS"]

#: Buckets of the object hash: a rate is kept to 1 / 2^24.
SPACE = 1 << 24
_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)
_CHUNK = 1 << 22

#: The largest |sampled - exact| hit ratio over the whole curve (every capacity of the exact curves, the grid
#: of belady-prefix), measured (benchmarks/sampled_curve_bench.py, benchmarks/README.md) per sampling rate and
#: per number of partitions, the larger of the two streams', rounded up: printed with every sampled result.
_STREAM = "agentic streams of 10 M and 94 M block reads, window last-half: the larger"
MEASURED_ERROR: dict[str, dict[float, dict[str, float | str]]] = {
    "shards": {0.1: {"lru": 0.0175, "belady-prefix": 0.0018, "belady": 0.0029, "stream": _STREAM},
               0.01: {"lru": 0.0423, "belady-prefix": 0.0121, "belady": 0.0126, "stream": _STREAM},
               0.001: {"lru": 0.0740, "belady-prefix": 0.0854, "belady": 0.0866, "stream": _STREAM}},
    "partitions": {2: {"lru": 0.0068, "belady-prefix": 0.0004, "belady": 0.0010, "stream": _STREAM},
                   4: {"lru": 0.0112, "belady-prefix": 0.0009, "belady": 0.0018, "stream": _STREAM}},
}


#: What one kept access costs through the curve, for a fixed-size sample's bound: held while reading (its
#: hash, flag and bucket: 13 B), the sample's stream (ids, flags, next uses: 13 B, with the build's hash
#: table) and the curve kernels' state (16 B at most, the in-memory path's `EXACT_CURVE_BYTES_PER_ACCESS`), rounded up.
SAMPLE_BYTES_PER_ACCESS = 48
#: What a sampled run holds besides (the interpreter, the libraries, the piece being read).
SAMPLE_FIXED_BYTES = 160 << 20


@dataclass(frozen=True)
class Share:
    """The objects whose hash bucket is in [lo, hi) of SPACE."""

    lo: int
    hi: int

    @property
    def fraction(self) -> float:
        return (self.hi - self.lo) / SPACE


def rate_share(rate: float) -> Share:
    """The share that sampling at `rate` keeps (0 < rate <= 1)."""
    if not (0 < rate <= 1):
        raise KmeshTraceError(f"a sampling rate is a fraction in (0, 1], not {rate}.")
    hi = int(round(rate * SPACE))
    if hi < 1:
        raise KmeshTraceError(f"a sampling rate below 1/{SPACE:,} keeps nothing; use a larger one than {rate}.")
    return Share(0, hi)


def partition_shares(k: int) -> list[Share]:
    """The k shares of a k-way partition (bucket ranges of equal width, up to rounding)."""
    if k < 1:
        raise KmeshTraceError(f"a stream splits into at least 1 partition, not {k}.")
    edges = [p * SPACE // k for p in range(k + 1)]
    return [Share(edges[p], edges[p + 1]) for p in range(k)]


def object_buckets(num_objects: int) -> np.ndarray:
    """Each dense object id's hash bucket (uint32 in [0, SPACE)): the top 24 bits of output id + 1 of
    splitmix64 seeded with 0 (the finaliser of (id + 1) * 0x9E3779B97F4A7C15)."""
    out = np.empty(num_objects, np.uint32)
    for lo in range(0, num_objects, _CHUNK):
        out[lo:min(lo + _CHUNK, num_objects)] = _buckets(np.arange(lo, min(lo + _CHUNK, num_objects), dtype=np.uint64))
    return out


def hash_buckets(hashes: np.ndarray, seed: int = 0) -> np.ndarray:
    """Each block hash's bucket as the sample taken at read time draws it (native/kernels/shards.c): the bucket
    `object_buckets` gives the id `hash ^ seed` (hashes as their 64-bit patterns)."""
    h = np.ascontiguousarray(hashes)
    h = h.view(np.uint64) if h.dtype.itemsize == 8 else h.astype(np.uint64)
    out = np.empty(len(h), np.uint32)
    for lo in range(0, len(h), _CHUNK):
        out[lo:lo + _CHUNK] = _buckets(h[lo:lo + _CHUNK] ^ np.uint64(seed))
    return out


def _buckets(ids: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = (ids + np.uint64(1)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(40)).astype(np.uint32)


def sub_stream(stream: AccessStream, share: Share, buckets: np.ndarray | None = None) -> AccessStream:
    """The accesses of the objects in `share`, in stream order: ids renumbered densely, next uses pointing
    to the same accesses' new positions, every request kept (an empty one stays, with its reads and
    prompt tokens: the denominators stay the whole stream's)."""
    b = object_buckets(stream.num_objects) if buckets is None else buckets
    keep_obj = (b >= share.lo) & (b < share.hi)
    new_id = np.cumsum(keep_obj, dtype=np.int64) - 1
    keep = keep_obj[stream.obj]
    pos = np.flatnonzero(keep)  # old position of each kept access
    obj = new_id[stream.obj[pos]].astype(np.int32 if len(pos) < 2**31 else np.int64)
    nu = stream.next_use[pos]
    finite = nu != NEVER
    nu[finite] = np.searchsorted(pos, nu[finite])  # a kept access's next use is a kept access
    req_start = np.searchsorted(pos, stream.req_start).astype(np.int64)
    return AccessStream(stream.block_size, obj, stream.eligible[pos], nu, req_start, stream.num_prompt_tokens,
                        stream.num_reads, int(keep_obj.sum()))


def measured_eligible(stream: AccessStream, measure_from: int) -> int:
    """Eligible accesses of the requests from `measure_from` on."""
    return int(np.count_nonzero(stream.eligible[int(stream.req_start[measure_from]):]))


def _spread(values: np.ndarray, rate: float, length: int) -> np.ndarray:
    """`values` per sampled level spread evenly over the whole stream's levels it stands for: sampled
    level l over (round((l - 1) / rate), round(l / rate)] (a float array of `length` levels)."""
    levels = np.arange(1, len(values))
    lo = np.rint((levels - 1) / rate).astype(np.int64) + 1
    hi = np.maximum(np.rint(levels / rate).astype(np.int64), lo)
    density = np.zeros(length + 1, np.float64)
    per = values[1:] / (hi - lo + 1)
    np.add.at(density, lo, per)
    np.add.at(density, hi + 1, -per)
    return np.cumsum(density)[:length]


def scaled_curve(sample: HitCurve, rate: float, factor: float) -> HitCurve:
    """The whole stream's curve from the curve of a sample at `rate`: the hits of sampled level l spread
    evenly over capacities (round((l - 1) / rate), round(l / rate)] (a sample resolves capacity only to
    1 / rate blocks; between its steps the curve is interpolated linearly), times `factor` (rounded on the
    cumulative curve, so the counts stay whole)."""
    length = int(np.rint((len(sample.count) - 1) / rate)) + 1 if len(sample.count) > 1 else 1

    def scale(values):
        cum = np.rint(np.cumsum(_spread(values.astype(np.float64), rate, length)) * factor).astype(np.int64)
        return np.diff(cum, prepend=0)

    count, possum = scale(sample.count), scale(sample.position_sum)
    count[0] = possum[0] = 0
    return HitCurve(sample.policy, sample.block_size, count, possum, sample.num_reads, sample.num_prompt_tokens)


def adjusted_curve(sample: HitCurve, delta: int) -> HitCurve:
    """SHARDS-adj (Waldspurger et al., FAST'15, section 4.2): the sample's curve with `delta` reads (the
    eligible reads a sample at its nominal rate would have, E * R, less those it has, E_s) added to its
    smallest capacity, so that scaled by 1 / R its denominator is the whole stream's. A negative `delta` takes
    hits off from the smallest capacities up (never below none); the position sums follow the counts."""
    count = sample.count.astype(np.int64)
    if len(count) < 2:
        count = np.zeros(2, np.int64)
    cum = np.maximum(np.cumsum(count) + int(delta), 0)
    cum[0] = 0
    new = np.diff(cum, prepend=0)
    possum = np.zeros(len(new), np.int64)
    old = sample.position_sum[:len(new)]
    had = count[:len(old)] > 0
    possum[:len(old)][had] = np.rint(old[had] * (new[:len(old)][had] / count[:len(old)][had])).astype(np.int64)
    return HitCurve(sample.policy, sample.block_size, new, possum, sample.num_reads, sample.num_prompt_tokens)


def merged_curve(parts: list[HitCurve]) -> HitCurve:
    """The whole stream's curve from its k partitions' exact curves (see the module docstring): share p's
    level l stands for capacity l * k, its hits spread over (l - 1) * k, l * k] as `scaled_curve` spreads a
    sample's (a partition resolves capacity to k blocks), and added. Every hit is some partition's, so the
    infinite cache's hits are exact."""
    k = len(parts)
    length = max((len(c.count) - 1) * k + 1 for c in parts)
    count, possum = np.zeros(length, np.float64), np.zeros(length, np.float64)
    for c in parts:
        count += _spread(c.count.astype(np.float64), 1 / k, length)
        possum += _spread(c.position_sum.astype(np.float64), 1 / k, length)
    count, possum = (np.diff(np.rint(np.cumsum(v)).astype(np.int64), prepend=0) for v in (count, possum))
    first = parts[0]
    return HitCurve(first.policy, first.block_size, count, possum, first.num_reads, first.num_prompt_tokens)


def error_bound(method: str, rate: float) -> dict | None:
    """The error measured for `method` ("shards" at a rate, "partitions" at a number of partitions) at the
    measured setting that errs at least as much as `rate` would (the largest rate at or below it; the
    smallest number of partitions at or above it), or None when none was measured there."""
    table = MEASURED_ERROR[method]
    if method == "shards":
        near = [r for r in table if r <= rate * (1 + 1e-9)]
        key = max(near) if near else None
    else:
        near = [k for k in table if k >= rate]
        key = min(near) if near else None
    return None if key is None else {"rate" if method == "shards" else "partitions": key, **table[key]}


def accesses_for_bytes(budget_bytes: int) -> int:
    """The kept accesses a fixed-size sample may hold within `budget_bytes` (the run's whole peak, about)."""
    room = int(budget_bytes) - SAMPLE_FIXED_BYTES
    if room < SAMPLE_BYTES_PER_ACCESS * 1024:
        raise KmeshTraceError(f"a sample's memory of {budget_bytes / 2**20:,.0f} MiB leaves no room for a sample "
                              f"beside the {SAMPLE_FIXED_BYTES >> 20} MiB a run takes anyway; give at least "
                              f"{(SAMPLE_FIXED_BYTES >> 20) + 64} MiB.")
    return room // SAMPLE_BYTES_PER_ACCESS


def bounded_rate(stream: AccessStream, max_accesses: int) -> float:
    """The rate of the largest sample of `stream` (by `object_buckets`) that keeps at most `max_accesses`
    accesses: the fixed-size sample of a stream already built (the read-time one: oracle/shards.py)."""
    if len(stream) <= max_accesses:
        return 1.0
    per_bucket = np.bincount(object_buckets(stream.num_objects)[stream.obj], minlength=SPACE)
    within = int(np.searchsorted(np.cumsum(per_bucket), max_accesses, side="right"))
    return max(within, 1) / SPACE
