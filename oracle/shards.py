"""The spatial sample (SHARDS, oracle/sampling.py) taken while the input is read, so that the time and memory
of a sampled curve are the sample's: a Mooncake JSONL file or a hash-only trace is read piece by piece
(oracle/stream_pieces.py, the readers the bounded-memory exact path shares), and in each piece the compiled
pass (native/kernels/shards.c) keeps or drops every access by the hash of its block hash alone, before
anything about it is stored. Only the kept accesses (hash, eligible flag, bucket: 13 bytes each) and four
numbers a request are held; the sample's stream is built from them once the input is read.

- Fixed rate R: the blocks whose bucket (`sampling.hash_buckets`: the top 24 bits of splitmix64's finaliser
  of the block hash, with `seed`) is below R * SPACE. The same block is in or out on every run and machine.
- Fixed size (`max_accesses`, from a memory budget in bytes: `accesses_for_bytes`): the rate starts at the
  one given (1 by default) and is lowered whenever the held accesses pass the bound, to the largest
  threshold that keeps at most the bound, and the held accesses above it are dropped; later pieces are read
  at the lowered rate. The accesses are held (not only counted, as SHARDS's fixed-size reuse-distance
  variant does), so the sample kept is exactly the fixed-rate sample at the final rate: one curve, one
  scale, and the equality with the sample taken after the stream is built holds at any bound.
- The sample taken after the stream is built (`sample_after_build`: the whole stream's objects bucketed by
  their hashes) keeps the same accesses with the same dense ids (both number the kept hashes in hash order),
  so the two give the same curve (tests/test_shards.py). The curve is `sampled_curve.curve_of_sample`'s,
  for either; what is not held here is the whole stream's infinite-cache hits, so the result's infinite
  cache is the sample's estimate and its check against the exact one is absent.

Rows must come in arrival order (timestamps not decreasing), as for the bounded-memory exact path; what
the readers refuse raises `Unstreamable` (the CLI reads the input into memory then and samples after).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.native.kernels import I64, U64, Ptr, Struct, check, declare
from kmesh_trace.oracle.headroom_curve import CurveResult
from kmesh_trace.oracle.sampled_curve import curve_of_sample
from kmesh_trace.oracle.sampling import SPACE, hash_buckets, rate_share, sub_stream
from kmesh_trace.oracle.stream import AccessStream, kept_and_eligible
from kmesh_trace.oracle.stream_pieces import Unstreamable, jsonl_pieces, trace_pieces

__all__ = ["ReadSample", "read_sample", "sample_after_build", "sample_at_read"]

#: Bytes of the input read at a time.
CHUNK_BYTES = 16 << 20
class _SampleIn(Struct):
    """struct ks_shards_in (native/kernels/boundary.h)."""

    c_type = "ks_shards_in"
    _fields_ = [("hashes", Ptr(np.uint64)), ("offsets", Ptr(np.int64)), ("n_keep", Ptr(np.int64)),
                ("n_elig", Ptr(np.int64)), ("num_rows", I64), ("seed", U64), ("threshold", I64)]


class _SampleOut(Struct):
    """struct ks_shards_out."""

    c_type = "ks_shards_out"
    _fields_ = [("kept", Ptr(np.uint64)), ("eligible", Ptr(np.bool_)), ("bucket", Ptr(np.uint32)),
                ("row_kept", Ptr(np.int64)), ("num_kept", I64)]


_sample = declare("ks_shards_sample", [ctypes.POINTER(_SampleIn), ctypes.POINTER(_SampleOut)], I64)


@dataclass
class ReadSample:
    """The sample taken while reading: its stream (the kept accesses; every request, with the whole stream's
    prompt tokens and listed reads), the bucket threshold it ended at (its rate: threshold / SPACE), the whole
    stream's accesses and eligible reads per request, the largest number of accesses held after a piece."""

    stream: AccessStream
    threshold: int
    num_accesses: int
    eligible_per_request: np.ndarray
    max_held: int
    seed: int

    @property
    def fraction(self) -> float:
        return self.threshold / SPACE


class _Held:
    """The kept accesses so far, piece by piece, and their count per request; with a bound, lowered (the
    threshold and what is above it) whenever they pass it."""

    def __init__(self, threshold: int, bound: int | None) -> None:
        self.threshold, self.bound = threshold, bound
        self.hashes: list[np.ndarray] = []
        self.eligible: list[np.ndarray] = []
        self.buckets: list[np.ndarray] = []
        self.row_kept: list[np.ndarray] = []
        self.size = self.max_size = 0

    def add(self, hashes, eligible, buckets, row_kept) -> None:
        self.hashes.append(hashes)
        self.eligible.append(eligible)
        if buckets is not None:
            self.buckets.append(buckets)
        self.row_kept.append(row_kept)
        self.size += len(hashes)
        if self.bound is not None and self.size > self.bound:
            self._lower()
        self.max_size = max(self.max_size, self.size)

    def _lower(self) -> None:
        """The threshold lowered to the bound-th smallest held bucket (at most `bound` held stay below it)."""
        b = np.concatenate(self.buckets)
        self.threshold = int(np.partition(b, self.bound)[self.bound])
        keep = b < self.threshold
        rows = np.concatenate(self.row_kept)
        at = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(rows, out=at[1:])
        kept_before = np.zeros(len(keep) + 1, np.int64)
        np.cumsum(keep, out=kept_before[1:])
        self.row_kept = [np.diff(kept_before[at])]
        self.hashes = [np.concatenate(self.hashes)[keep]]
        self.eligible = [np.concatenate(self.eligible)[keep]]
        self.buckets = [b[keep]]
        self.size = int(keep.sum())

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(hashes, eligible flags, kept per request), the pieces joined and let go."""
        out = tuple(np.concatenate(x) for x in (self.hashes, self.eligible, self.row_kept))
        self.hashes, self.eligible, self.buckets, self.row_kept = [], [], [], []
        return out


def _sample_piece(off, hashes, n_full, n_elig, seed: int, held: _Held):
    """One piece's kept accesses (copies: the piece's buffers are reused) into `held`."""
    flat = np.ascontiguousarray(hashes).view(np.uint64)
    rows = len(n_full)
    room = int(n_full.sum())
    kept, elig = np.empty(room, np.uint64), np.empty(room, np.bool_)
    buckets = np.empty(room, np.uint32) if held.bound is not None else None
    row_kept = np.empty(rows, np.int64)
    args = _SampleIn.of(hashes=flat, offsets=np.ascontiguousarray(off, np.int64), n_keep=n_full, n_elig=n_elig,
                        num_rows=rows, seed=int(seed) & (2**64 - 1), threshold=held.threshold)
    out = _SampleOut.of(kept=kept, eligible=elig, bucket=buckets, row_kept=row_kept, num_kept=0)
    k = check(_sample(ctypes.byref(args), ctypes.byref(out)), "the sample")
    held.add(kept[:k].copy(), elig[:k].copy(), None if buckets is None else buckets[:k].copy(), row_kept)


def read_sample(source, block_size: int, *, rate: float = 1.0, max_accesses: int | None = None, seed: int = 0,
                chunk_bytes: int = CHUNK_BYTES) -> ReadSample:
    """The sample of `source` (a Mooncake JSONL path, or an opened hash-only `Trace` of one engine) taken while
    it is read: at `rate`, or at most `max_accesses` kept accesses (the rate lowered as the sample fills)."""
    held = _Held(rate_share(rate).hi, max_accesses)
    trace = None if isinstance(source, (str, Path)) else source
    name = Path(source if trace is None else trace.path).name
    pieces = jsonl_pieces(Path(source), block_size, chunk_bytes) if trace is None else trace_pieces(trace)
    cols: dict[str, list[np.ndarray]] = {"tokens": [], "reads": [], "elig": []}
    dtype, total, last_arrival = None, 0, None
    try:
        for off, hashes, tokens, _n_out, arrival in pieces:
            if (last_arrival is not None and arrival[0] < last_arrival) or (np.diff(arrival) < 0).any():
                raise Unstreamable(f"{name}: rows are not in arrival order (a timestamp goes back), which the sample "
                                   "at read time takes in one pass; sort the file by timestamp.")
            last_arrival = int(arrival[-1])
            dtype = dtype or hashes.dtype
            tokens = np.array(tokens, np.int64)
            num_reads = np.diff(off)
            n_full, n_elig = kept_and_eligible(num_reads, tokens, block_size)
            n_full, n_elig = np.ascontiguousarray(n_full, np.int64), np.ascontiguousarray(n_elig, np.int64)
            total += int(n_full.sum())
            _sample_piece(off, hashes, n_full, n_elig, seed, held)
            for k, v in (("tokens", tokens), ("reads", num_reads.astype(np.int64)), ("elig", n_elig)):
                cols[k].append(v)
    finally:
        pieces.close()
    if not cols["tokens"]:
        raise KmeshTraceError(f"{name} holds no request.")
    return _built(held, cols, block_size, dtype, total, seed)


def _built(held: _Held, cols, block_size: int, dtype, total: int, seed: int) -> ReadSample:
    hashes, eligible, row_kept = held.arrays()
    req_start = np.zeros(len(row_kept) + 1, np.int64)
    np.cumsum(row_kept, out=req_start[1:])
    tokens, reads, elig = (np.concatenate(cols[k]) for k in ("tokens", "reads", "elig"))
    stream = AccessStream.from_arrays(block_size, hashes.view(dtype), eligible, req_start, tokens, reads)
    return ReadSample(stream, held.threshold, total, elig, held.max_size, seed)


def sample_after_build(stream: AccessStream, object_hashes: np.ndarray, rate: float, seed: int = 0) -> AccessStream:
    """The sample the read-time pass takes, from the whole built `stream` whose object i has block hash
    `object_hashes[i]` (the stream's ids rank the hashes, so these are its distinct hashes sorted)."""
    return sub_stream(stream, rate_share(rate), hash_buckets(object_hashes, seed))


def sample_at_read(source, block_size: int, *, rate: float = 1.0, max_accesses: int | None = None, seed: int = 0,
                   policies: Sequence[str] | None = None, window: str = "all", grid: Sequence[int] | None = None,
                   workers: int | None = None, correction: str = "ratio",
                   chunk_bytes: int = CHUNK_BYTES) -> CurveResult:
    """The sampled curve of `source` (see `read_sample`), labelled as `sampled_curve` labels it: the method,
    the rate it ended at, its measured error bound; a fixed-size sample also its bound and the rate asked."""
    s = read_sample(source, block_size, rate=rate, max_accesses=max_accesses, seed=seed, chunk_bytes=chunk_bytes)
    start = s.stream.num_requests // 2 if window == "last-half" else 0
    extra = {"taken": "at read", "seed": seed}
    if max_accesses is not None:
        extra.update(max_sampled_accesses=max_accesses, held_at_most=s.max_held, rate_asked=rate)
    return curve_of_sample(s.stream, s.fraction, int(s.eligible_per_request[start:].sum()), window=window,
                           policies=policies, grid=grid, workers=workers, correction=correction,
                           num_accesses=s.num_accesses, nominal_rate=rate if max_accesses is None else None,
                           extra=extra)


# ---- when `headroom` samples at read time ----------------------------------------------------------------

@dataclass(frozen=True)
class AtRead:
    """How `headroom` samples an input while reading it: at `rate`, or within `max_accesses` (fixed size,
    from `rate` down); `why` says why the curve is sampled when nobody asked (the memory budget)."""

    rate: float
    max_accesses: int | None = None
    why: str | None = None


def at_read_plan(path, options, *, remote: bool = False) -> AtRead | None:
    """The sample `headroom` takes while reading `path` (one Mooncake JSONL file or one trace directory), or
    None for the other paths: asked for (`--sample RATE` below 1, `--sample-memory`), or chosen because neither
    the in-memory exact curve nor the bounded-memory one fits the memory budget (the rate `auto_sample_rate`
    picks, as the in-memory path would after building the whole stream)."""
    from kmesh_trace.oracle.headroom import EXACT_CURVE_BYTES_PER_ACCESS, auto_sample_rate
    from kmesh_trace.oracle.sampling import accesses_for_bytes
    from kmesh_trace.oracle.streamed_curve import _budget, _is_mooncake, estimated_reads, streamed_bytes, trace_reads

    if path is None or remote or not options.wants_curve or options.partitions is not None or options.sample == 1:
        return None
    path = Path(path)
    if "://" in str(path) or not (path.is_dir() or (path.is_file() and _is_mooncake(path))):
        return None
    if options.sample_memory_mib is not None:
        return AtRead(options.sample or 1.0, accesses_for_bytes(int(options.sample_memory_mib * 2**20)))
    if options.sample is not None:
        return AtRead(options.sample)
    reads = trace_reads(path) if path.is_dir() else estimated_reads(path)
    budget = _budget(options.memory_budget_gib)
    if reads is None or budget is None or reads * EXACT_CURVE_BYTES_PER_ACCESS <= budget or streamed_bytes(reads) <= budget:
        return None
    rate = auto_sample_rate(reads, budget)
    return AtRead(rate, why=f"the exact curves of about {reads:,} accesses would take about "
                            f"{reads * EXACT_CURVE_BYTES_PER_ACCESS / 2**30:,.1f} GiB in memory and "
                            f"{streamed_bytes(reads) / 2**30:,.1f} GiB with the stream on disk, over the memory "
                            "budget; --sample 1 forces them")


def run_at_read(source, block_size: int, options, plan: AtRead, note: str | None = None) -> CurveResult:
    """`headroom`'s curve of `source` (a path or an opened trace) from its sample taken at read time."""
    from kmesh_trace.oracle.sampled_curve import SAMPLED_POLICIES

    names = list(options.policies) if options.policies is not None else None
    if plan.why is not None:  # policies the sample cannot replay are left out, as the in-memory path does
        names = [n for n in names or SAMPLED_POLICIES if n in SAMPLED_POLICIES]
    res = sample_at_read(source, block_size, rate=plan.rate, max_accesses=plan.max_accesses, policies=names,
                         window=options.window, grid=options.capacities, correction=options.sample_correction)
    if plan.why is not None:
        res.sampling["why"] = plan.why
    res.note = note
    return res
