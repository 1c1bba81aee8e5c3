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

from kmesh_trace.native.kernels import I32, I64, P, check, declare, ptr
from kmesh_trace.oracle.blockpool_compiled import pool_inputs, stream_pointers
from kmesh_trace.oracle.interruptible import run_interruptible
from kmesh_trace.oracle.stream import AccessStream, kept_and_eligible
from kmesh_trace.oracle.stream_index import leading_flags, obj_pointers

__all__ = ["TierStream", "tier_stream", "replay_tiers_compiled"]

_replay = declare("ks_tiers_replay", [*[P] * 8, I64, P, P, P, I32, I64, I64, I64, I64, *[P] * 7, I64, *[P] * 5,
                                      I32, I32, I32, P, P, I32, P, P, I64, *[P] * 16], I64)
_free_reads = declare("ks_tiers_free", [P])
_gather_into = declare("ks_tiers_gather", [P, I64, P, P, I64, P])
_find_into = declare("ks_tiers_find", [P, I64, P, P, P, I64, P], I64)


def _tier_kernel(obj, IN, tail, tstart, timed, block_size, num_usable, num_ids, cap, chunk, retain,
                 refresh_on_hit, write_through, below, on_evict, chunk_bytes, has_cost, lat_ns, dur0, dur1,
                 singleflight, any_gpu, with_costs, preload, pstart, early_prep, prep_at, prep_p, children_left,
                 parent_of):
    """The C replay (native/kernels/tiers.c): (pool arrays, hits per tier, waits, reads, per-tier counts,
    store marks, distinct blocks needed, shared reads)."""
    n_req, nt = len(IN[2]), len(cap)
    IN = tuple(np.ascontiguousarray(a, np.int64) for a in IN)
    i64 = [np.ascontiguousarray(a, np.int64) for a in (tstart, cap, chunk, below, on_evict, chunk_bytes, lat_ns,
                                                          dur0, dur1, preload, pstart, prep_at, prep_p, children_left,
                                                          parent_of)]
    tstart, cap, chunk, below, on_evict, chunk_bytes, lat_ns, dur0, dur1, preload, pstart, prep_at, prep_p, \
        children_left, parent_of = i64
    flags = [np.ascontiguousarray(a, np.bool_) for a in (retain, refresh_on_hit, write_through, has_cost)]
    hit_blocks, num_evictions, hit_marks = np.zeros(n_req, np.int64), np.zeros(n_req, np.int64), np.zeros(n_req, np.int64)
    admitted, stalled = np.zeros(n_req, np.bool_), np.zeros(n_req, np.bool_)
    queue = np.zeros(num_usable, np.int64)
    hit = np.zeros((nt + 1, n_req), np.int64)
    wait0, wait1 = np.zeros(n_req, np.float64), np.zeros(n_req, np.float64)
    num_reads, read_bytes, num_stores = (np.zeros(nt, np.int64) for _ in range(3))
    rows = ctypes.c_void_p()
    out = np.zeros(5, np.int64)
    p64 = lambda a: ptr(a, np.int64)  # noqa: E731
    check(_replay(*obj_pointers(obj), *stream_pointers(IN), n_req, *obj_pointers(tail), p64(tstart), timed,
                  block_size, num_usable, num_ids, nt, p64(cap), p64(chunk),
                  *(ptr(f, np.bool_) for f in flags[:3]), p64(below), p64(on_evict), len(on_evict), p64(chunk_bytes),
                  ptr(flags[3], np.bool_), p64(lat_ns), p64(dur0), p64(dur1), singleflight, any_gpu, with_costs,
                  p64(preload), p64(pstart), early_prep, p64(prep_at), p64(prep_p), len(prep_at), p64(children_left),
                  p64(parent_of), p64(hit_blocks), p64(num_evictions), ptr(admitted, np.bool_), ptr(stalled, np.bool_),
                  p64(queue), p64(hit), ptr(wait0, np.float64), ptr(wait1, np.float64), p64(hit_marks),
                  p64(num_reads), p64(read_bytes), p64(num_stores), ctypes.addressof(rows), p64(out)),
          "the tier replay")
    n_rd = int(out[2])
    rd = np.zeros((n_rd, 5), np.int64)
    if rows.value:
        ctypes.memmove(rd.ctypes.data, rows.value, rd.nbytes)
        _free_reads(rows.value)
    pool = (hit_blocks, num_evictions, admitted, stalled, queue[:int(out[0])], int(out[1]))
    reads = tuple(rd[:, k] for k in range(5))
    return pool, hit, wait0, wait1, reads, num_reads, read_bytes, num_stores, hit_marks, int(out[3]), int(out[4])


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
        _tier_kernel, stream.obj, stream.IN, stream.tail, stream.tail_start, bool(timed),
        int(block_size), int(config.gpu_blocks),
        num_ids, arr([t.num_chunks for t in tiers]), arr([t.chunk_blocks for t in tiers]),
        arr([t.retain for t in tiers], np.bool_), arr([t.retain and t.write == "on-evict" for t in tiers], np.bool_),
        arr([t.write == "write-through" for t in tiers], np.bool_), below, on_evict, arr(nbytes),
        arr([c is not None for c in cs], np.bool_), arr(lat), arr(dur0), arr(dur1),
        bool(config.singleflight and timed), config.lookup == "any", all(c is not None for c in cs), pid, pstart,
        early_prep, *schedule)


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
