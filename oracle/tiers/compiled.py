"""The tier model compiled: `TierReplay` (`kmesh_trace.oracle.tiers.replay`) in C (native/kernels/tiers.c).

The GPU pool is the pool replay's own steps (native/kernels/pool_steps.h, as `kmesh_trace.oracle.
blockpool_compiled` runs them: `kp_arrive`, `kp_allocate_request` with a buffer for the evicted hashes,
`kp_end_admission`, `kp_drain`), so the pool evolves exactly as `simulate_pool`'s; between the arrival and
the allocation the kernel runs the lookup below the GPU in `TierReplay._looked_up`'s steps (restores in
flight, the lower-tier walk, settling, the restore wait, the write-through stores), and after it the
offloading of what the allocation evicted (`_allocated`). The rules are the package docstring's
(`kmesh_trace.oracle.tiers`); how they are kept in arrays is tiers.c's header: every hash (prompt, output,
preloaded chunk key) has a dense id (the pool's `AccessStream` ids, then the ids of the prompt hashes past
the listed ones), a tier's LRU is a ring of ids (`TierStore`'s OrderedDict order), the chunks one request
reads a small open-addressing table, reads rows merged as `TierRead`s are (`TierReads`), early
preparation's schedule arrays sorted in `EarlyPrep`'s pop order.

It covers every configuration, early preparation included, but the simple-cpu connector, which keeps its
Python replay (`simulate_tiers` chooses). This module builds the stream's arrays (`TierStream`) and calls
the kernel through ctypes. `TierReplay` stays the reference: tests/test_tiers_compiled.py replays random
workloads and configurations through both and compares every `TierResult` field.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from kmesh_trace.native.kernels import I64, P, Ptr, Struct, check, declare, ptr
from kmesh_trace.oracle.blockpool_compiled import PoolArrays, PoolResultStruct, PoolStreamStruct, pool_inputs
from kmesh_trace.oracle.interruptible import run_interruptible
from kmesh_trace.oracle.stream import AccessStream, kept_and_eligible
from kmesh_trace.oracle.stream_index import leading_flags, obj_pointers

__all__ = ["TierArrays", "TierStream", "tier_stream", "replay_tiers_compiled"]

_I64, _BOOL = Ptr(np.int64), Ptr(np.bool_)


class _TiersIn(Struct):
    """struct ks_tiers_in (native/kernels/boundary.h)."""

    c_type = "ks_tiers_in"
    _fields_ = [("stream", PoolStreamStruct), ("tail32", Ptr(np.int32)), ("tail64", _I64), ("tstart", _I64),
                ("nt", I64), ("cap", _I64), ("chunk", _I64), ("retain", _BOOL), ("refresh_on_hit", _BOOL),
                ("write_through", _BOOL), ("below", _I64), ("on_evict", _I64), ("n_on_evict", I64),
                ("chunk_bytes", _I64), ("has_cost", _BOOL), ("lat_ns", _I64), ("dur0", _I64), ("dur1", _I64),
                ("singleflight", I64), ("any_gpu", I64), ("with_costs", I64), ("preload", _I64), ("pstart", _I64),
                ("early_prep", I64), ("prep_at", _I64), ("prep_p", _I64), ("n_prep", I64), ("children_of", _I64),
                ("parent_of", _I64)]


class _TiersOut(Struct):
    """struct ks_tiers_out: the pool's results, then the tiers'."""

    c_type = "ks_tiers_out"
    _fields_ = [("pool", PoolResultStruct), ("hit", _I64), ("wait0", Ptr(np.float64)), ("wait1", Ptr(np.float64)),
                ("marks", _I64), ("num_reads", _I64), ("read_bytes", _I64), ("num_stores", _I64),
                ("reads", P), ("num_read_rows", I64), ("num_needed", I64), ("num_shared", I64)]


_replay = declare("ks_tiers_replay", [ctypes.POINTER(_TiersIn), ctypes.POINTER(_TiersOut)], I64)
_free_reads = declare("ks_tiers_free", [P])
_gather_into = declare("ks_tiers_gather", [P, I64, P, P, I64, P])
_find_into = declare("ks_tiers_find", [P, I64, P, P, P, I64, P], I64)

#: The per-tier arrays of the configuration (`_TiersIn`'s fields), as `replay_tiers_compiled` passes them.
_TIER_ARRAYS = ("cap", "chunk", "retain", "refresh_on_hit", "write_through", "below", "on_evict", "chunk_bytes",
                "has_cost", "lat_ns", "dur0", "dur1")


@dataclass
class TierArrays:
    """What the tier kernel leaves: the pool's `PoolArrays`; hits per tier (`hit[0]` the GPU's, `hit[1 + k]`
    tier k's, per request); the restore waits (typical and p95 throughput, s); the read rows (request, tier,
    chunks, bytes, prepare); per tier the reads, their bytes and the stores; per request the stores made
    before its lookup (-1: no lookup below the GPU); the distinct blocks needed and the shared reads."""

    pool: PoolArrays
    hit: np.ndarray
    wait0: np.ndarray
    wait1: np.ndarray
    reads: tuple
    num_reads: np.ndarray
    read_bytes: np.ndarray
    num_stores: np.ndarray
    marks: np.ndarray
    num_needed: int
    num_shared: int


def _tier_kernel(stream: PoolStreamStruct, tail, tstart, tiers: dict, singleflight, any_gpu, with_costs, preload,
                 pstart, early_prep, prep_at, prep_p, children_left, parent_of) -> TierArrays:
    """The C replay (native/kernels/tiers.c) of `stream` with the tiers' arrays `tiers` (`_TIER_ARRAYS`)."""
    n_req, nt = stream.n_req, len(tiers["cap"])
    i64 = lambda a: np.ascontiguousarray(a, np.int64)  # noqa: E731
    tiers = {k: np.ascontiguousarray(a, a.dtype if a.dtype == np.bool_ else np.int64) for k, a in tiers.items()}
    on_evict = tiers["on_evict"]
    args = _TiersIn.of(stream=stream, tail32=tail if tail.dtype == np.int32 else None,
                       tail64=None if tail.dtype == np.int32 else i64(tail), tstart=i64(tstart), nt=nt, **tiers,
                       n_on_evict=len(on_evict), singleflight=bool(singleflight), any_gpu=bool(any_gpu),
                       with_costs=bool(with_costs), preload=i64(preload), pstart=i64(pstart),
                       early_prep=bool(early_prep), prep_at=i64(prep_at), prep_p=i64(prep_p), n_prep=len(prep_at),
                       children_of=i64(children_left), parent_of=i64(parent_of))
    pool = PoolResultStruct.fresh(n_req, stream.num_usable)
    hit, wait0, wait1 = np.zeros((nt + 1, n_req), np.int64), np.zeros(n_req, np.float64), np.zeros(n_req, np.float64)
    marks = np.zeros(n_req, np.int64)
    num_reads, read_bytes, num_stores = (np.zeros(nt, np.int64) for _ in range(3))
    out = _TiersOut.of(pool=pool, hit=hit, wait0=wait0, wait1=wait1, marks=marks, num_reads=num_reads,
                       read_bytes=read_bytes, num_stores=num_stores, reads=None, num_read_rows=0, num_needed=0,
                       num_shared=0)
    check(_replay(ctypes.byref(args), ctypes.byref(out)), "the tier replay")
    rd = np.zeros((int(out.num_read_rows), 5), np.int64)
    if out.reads:
        ctypes.memmove(rd.ctypes.data, out.reads, rd.nbytes)
        _free_reads(out.reads)
    reads = tuple(rd[:, k] for k in range(5))
    return TierArrays(pool.read(out.pool), hit, wait0, wait1, reads, num_reads, read_bytes, num_stores, marks,
                      int(out.num_needed), int(out.num_shared))


# ---------------------------------------------------------------------------------------------------
# Python side
# ---------------------------------------------------------------------------------------------------


def _gather(values: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """values[starts[k]:starts[k] + lens[k]] for every k, concatenated."""
    values = np.ascontiguousarray(values)
    starts, lens = np.ascontiguousarray(starts, np.int64), np.ascontiguousarray(lens, np.int64)
    out = np.empty(int(lens.sum()), values.dtype)
    _gather_into(values.ctypes.data, values.dtype.itemsize, ptr(starts, np.int64), ptr(lens, np.int64), len(starts),
                 out.ctypes.data)
    return out


def _ids_of(keys: np.ndarray, known: list[tuple[np.ndarray, np.ndarray]], first_new: int) -> tuple[np.ndarray, int]:
    """The ids of `keys` (uint64): an equal hash's id in `known` (pairs of hashes and their ids), else ids
    from `first_new` on (in the keys' sorted order); and the number of ids with them."""
    distinct, inv = np.unique(keys, return_inverse=True)
    found = np.full(len(distinct), -1, np.int64)
    for hashes, ids in known:  # one pass over each, through a table of the keys (ks_tiers_find)
        check(_find_into(ptr(distinct, np.uint64), len(distinct), ptr(hashes, np.uint64), *obj_pointers(ids),
                         len(hashes), ptr(found, np.int64)), "the tier stream's ids")
    extra = found < 0
    found[extra] = first_new + np.arange(int(extra.sum()))
    return found[inv.ravel()], first_new + int(extra.sum())


def _interleave(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Two columns per request, interleaved (request 0's first, request 0's second, ...)."""
    return np.stack([first, second], axis=1).ravel()


@dataclass
class _Flat:
    """Every request's prompt hashes, then every request's output hashes, flattened (`hashes`), with where
    each request's lists start (`pstart`, `ostart`) and their lengths (`plen`, `olen`)."""

    hashes: np.ndarray
    pstart: np.ndarray
    plen: np.ndarray
    ostart: np.ndarray
    olen: np.ndarray

    @classmethod
    def of(cls, requests) -> _Flat:
        """Raises OverflowError, ValueError or TypeError when a hash is not a 64-bit unsigned integer."""
        n = len(requests)
        lists = list(map(attrgetter("prompt_hashes"), requests))
        lists += map(attrgetter("output_hashes"), requests)
        lens = np.fromiter(map(len, lists), np.int64, 2 * n)
        start = np.zeros(2 * n + 1, np.int64)
        np.cumsum(lens, out=start[1:])
        hashes = np.fromiter(itertools.chain.from_iterable(lists), np.uint64, int(start[-1]))
        return cls(hashes, start[:n], lens[:n], start[n:-1], lens[n:])

    def accesses(self, listed: np.ndarray) -> np.ndarray:
        """The pool's accesses: each request's first `listed` prompt hashes, then its output hashes."""
        return _gather(self.hashes, _interleave(self.pstart, self.ostart), _interleave(listed, self.olen))

    def tails(self, listed: np.ndarray) -> np.ndarray:
        """Each request's prompt hashes past its first `listed`."""
        return _gather(self.hashes, self.pstart + listed, self.plen - listed)


@dataclass
class TierStream:
    """A request stream as the tier kernel reads it, built once for every configuration replayed over it:
    the pool's `AccessStream` ids (`obj`, the requests' listed prompt hashes then output hashes; `IN`, the
    per-request arrays of the pool kernel) and the ids of the prompt hashes past the listed ones (`tail`,
    per request from `tail_start`: partial last blocks), numbered after the stream's objects where they
    are not among them; `num_ids` ids in all. Each request's prompt chain and held chain are runs of
    these (native/kernels/tiers.c, `kt_prompt_seq`, `kt_held_seq`)."""

    requests: list
    block_size: int
    obj: np.ndarray
    IN: tuple
    tail: np.ndarray
    tail_start: np.ndarray
    num_ids: int

    def preload_ids(self, keys: list[np.ndarray]) -> tuple[np.ndarray, int]:
        """Each tier's preloaded keys as ids (keys the stream lacks numbered after its own), concatenated,
        and the number of ids with them."""
        flat = np.concatenate(keys) if keys else np.zeros(0, np.uint64)
        if not len(flat):
            return np.zeros(0, np.int64), self.num_ids
        hashes = _Flat.of(self.requests)  # the stream's hashes again: preloads are rare, the stream keeps none
        listed = self.IN[1]
        return _ids_of(flat, [(hashes.accesses(listed), self.obj), (hashes.tails(listed), self.tail)], self.num_ids)


def tier_stream(requests, block_size: int) -> TierStream | None:
    """The requests' TierStream, or None when their hashes are not 64-bit unsigned integers (the Python
    replay takes those). Its pool part is `AccessStream.from_arrays` over the requests' accesses, the
    stream `simulate_pool` replays (`AccessStream.from_requests`'s); the tails are looked up among its hashes
    in one pass, so every hash is sorted once."""
    requests = list(requests)
    try:
        flat = _Flat.of(requests)
    except (OverflowError, ValueError, TypeError):
        return None
    n = len(requests)
    p_tokens = np.fromiter(map(attrgetter("num_prompt_tokens"), requests), np.int64, n)
    listed, n_elig = kept_and_eligible(flat.plen, p_tokens, block_size)
    access = flat.accesses(listed)
    req_start = np.zeros(n + 1, np.int64)
    np.cumsum(listed + flat.olen, out=req_start[1:])
    stream = AccessStream.from_arrays(block_size, access, leading_flags(req_start, n_elig), req_start, p_tokens,
                                      flat.plen)
    tails = flat.tails(listed)
    tail_start = np.zeros(n + 1, np.int64)
    np.cumsum(flat.plen - listed, out=tail_start[1:])
    num_ids = stream.num_objects
    tail = np.zeros(len(tails), stream.obj.dtype)
    if len(tails):
        tail, num_ids = _ids_of(tails, [(access, stream.obj)], num_ids)
        tail = tail.astype(np.int32 if num_ids < 2**31 else np.int64)
    _, listed, output_tokens, arrival, finish = pool_inputs(requests, block_size, stream)
    IN = (stream.req_start, listed, stream.num_prompt_tokens, output_tokens, finish, arrival)
    return TierStream(requests, block_size, stream.obj, IN, tail, tail_start, num_ids)


def replay_tiers_compiled(stream: TierStream, config, costs: dict, timed: bool, preload: dict,
                          block_bytes: int) -> TierArrays | None:
    """`TierReplay(...).run()` and its state, compiled: a `TierArrays`. None when a preloaded key is not a
    64-bit unsigned integer (the Python replay takes it)."""
    tiers = config.tiers
    try:
        keys = [np.fromiter(preload.get(t.name, ()), np.uint64) for t in tiers]
    except (OverflowError, ValueError, TypeError):
        return None
    pid, num_ids = stream.preload_ids(keys)
    pstart = np.zeros(len(tiers) + 1, np.int64)
    np.cumsum([len(k) for k in keys], out=pstart[1:])
    early_prep = bool(config.early_prep and tiers)
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
    arrays = dict(zip(_TIER_ARRAYS, (
        arr([t.num_chunks for t in tiers]), arr([t.chunk_blocks for t in tiers]),
        arr([t.retain for t in tiers], np.bool_), arr([t.retain and t.write == "on-evict" for t in tiers], np.bool_),
        arr([t.write == "write-through" for t in tiers], np.bool_), below, on_evict, arr(nbytes),
        arr([c is not None for c in cs], np.bool_), arr(lat), arr(dur0), arr(dur1))))
    pool = PoolStreamStruct.over(stream.obj, stream.IN, bool(timed), int(block_size), int(config.gpu_blocks),
                                 num_ids)
    return run_interruptible(
        _tier_kernel, pool, stream.tail, stream.tail_start, arrays, bool(config.singleflight and timed),
        config.lookup == "any", all(c is not None for c in cs), pid, pstart, early_prep, *schedule)


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
