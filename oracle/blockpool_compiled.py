"""The `vllm` block-pool model compiled: `simulate_pool`'s replay, family holds included, in C.

The replay is native/kernels/pool.c over the steps of native/kernels/pool_steps.h, the same rules as
`kmesh_trace.oracle.blockpool` (its docstring lists them, rule by rule) applied in the same order over
arrays: the free queue a doubly linked list over block ids (vLLM's null block its sentinel), the hash map
the blocks cached under each dense hash id oldest first, the running requests a binary heap ordered by
(finish, index) as `heapq` orders the Python model's tuples, the active holds a list over parents oldest
first with one record per hold in the order they were asked for (`PoolReplay.records`). The steps
(`kp_lookup`, `kp_touch`, `kp_allocate` with an optional buffer for the evicted hashes, `kp_free_blocks`,
`kp_finish`, `kp_take_hold` / `kp_release_hold`, a request's `kp_arrive`, `kp_allocate_request`,
`kp_end_admission`, the stream's `kp_drain`) are static inline functions in one header, so the tier kernel
(native/kernels/tiers.c, `kmesh_trace.oracle.tiers.compiled`) runs the very same pool, observing a request
between `kp_arrive` and `kp_allocate_request` and after it.

This module builds the kernel's arrays and calls it through ctypes (`kmesh_trace.native.kernels`): no
compiler or JIT at run time. The Python model stays the reference: tests replay random workloads (timed
and sequential, duplicates, stalls, deferrals, holds with every cap and expiry) through both and compare
every per-request result, every hold record and the final free queue.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np

from kmesh_trace.native.kernels import I64, Ptr, Struct, check, declare
from kmesh_trace.oracle.interruptible import run_interruptible
from kmesh_trace.oracle.stream import AccessStream, RequestColumns, kept_and_eligible

# hold statuses and release reasons, as codes (`STATUSES[code]`, `REASONS[code]`; pool_steps.h's KP_TAKEN, ...)
STATUSES = ("taken", "refused_blocks", "refused_families", "empty", "not_needed")
REASONS = ("children", "expiry", "pressure", "close")
TAKEN = STATUSES.index("taken")

#: The hold records' rows (KP_NUM_RECORD_ROWS in native/kernels/pool_steps.h).
NUM_RECORD_ROWS = 8


def pool_inputs(requests, block_size: int, stream=None, columns=None):
    """The kernel's per-request arrays for `requests` (their AccessStream `stream` when built already), or,
    without requests, for `stream` and its `columns` (`kmesh_trace.oracle.stream.RequestColumns`)."""
    if stream is None:
        stream = AccessStream.from_requests(requests, block_size)
    if columns is None:
        columns = RequestColumns.of_requests(requests)
    listed, _ = kept_and_eligible(stream.num_reads, stream.num_prompt_tokens, block_size)
    return stream, listed, columns.num_output_tokens, columns.arrival_ns, columns.finish_ns


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


def replay_compiled(requests, block_size: int, num_usable_blocks: int, timed: bool, stream=None, holds=None,
                    inputs=None, free_queue: bool = True):
    """`PoolReplay(requests, ..., holds, timed).run()`'s results, compiled: (hit_blocks, num_evictions,
    admitted, stalled, free_queue) as numpy arrays, num_deferred, and the hold records as
    (parent, status, num_blocks, served, reason, held_block_steps, taken_ns, released_ns) arrays, with the
    family names their parents' ids index (`family_names[family_ids[parent]]`). `inputs`: `pool_inputs`'
    answer for these requests, when the caller replays them at several capacities; `free_queue=False`: the
    free queue is not wanted (it comes back empty, and no array of the pool's size is made for it)."""
    stream, listed, output_tokens, arrival, finish = inputs or pool_inputs(requests, block_size, stream)
    n = stream.num_requests
    if holds is None:
        is_parent, release_after, parent_of, fam, names, caps = (np.zeros(0, np.bool_), *(np.zeros(0, np.int64),) * 3,
                                                                 [], (-1, -1, -1))
    else:
        is_parent, release_after, parent_of, fam, names, caps = hold_inputs(holds, n)
    IN = (stream.req_start, listed, stream.num_prompt_tokens, output_tokens, finish, arrival)
    out = run_interruptible(_replay, stream.obj, IN, bool(timed), int(block_size), int(num_usable_blocks),
                            int(stream.num_objects), holds is not None, is_parent, release_after, parent_of, fam,
                            max(len(names), 1), caps, free_queue)
    return out, fam, names


class PoolArrays(NamedTuple):
    """A pool replay's per-request results and final free queue, as a kernel left them."""

    hit_blocks: np.ndarray
    num_evictions: np.ndarray
    admitted: np.ndarray
    stalled: np.ndarray
    free_queue: np.ndarray
    num_deferred: int


class PoolStreamStruct(Struct):
    """struct ks_pool_stream (native/kernels/boundary.h): a stream as the pool replays it."""

    c_type = "ks_pool_stream"
    _fields_ = [("obj32", Ptr(np.int32)), ("obj64", Ptr(np.int64)), ("req_start", Ptr(np.int64)),
                ("listed", Ptr(np.int64)), ("prompt_tokens", Ptr(np.int64)), ("output_tokens", Ptr(np.int64)),
                ("finish_ns", Ptr(np.int64)), ("arrival", Ptr(np.int64)), ("n_req", I64), ("timed", I64),
                ("block_size", I64), ("num_usable", I64), ("num_objects", I64)]

    @classmethod
    def over(cls, obj: np.ndarray, IN: tuple, timed: bool, block_size: int, num_usable: int,
             num_objects: int) -> PoolStreamStruct:
        """The stream of ids `obj` (int32 or int64) and the per-request arrays `IN` (req_start, listed,
        prompt_tokens, output_tokens, finish_ns, arrival)."""
        obj = obj if obj.dtype == np.int32 else np.ascontiguousarray(obj, np.int64)
        IN = [np.ascontiguousarray(a, np.int64) for a in IN]
        return cls.of(obj32=obj if obj.dtype == np.int32 else None, obj64=None if obj.dtype == np.int32 else obj,
                      **dict(zip(("req_start", "listed", "prompt_tokens", "output_tokens", "finish_ns", "arrival"),
                                 IN)),
                      n_req=len(IN[2]), timed=bool(timed), block_size=block_size, num_usable=num_usable,
                      num_objects=num_objects)


class PoolResultStruct(Struct):
    """struct ks_pool_result: per request hits, evictions, admitted, stalled; the final free queue."""

    c_type = "ks_pool_result"
    _fields_ = [("hit_blocks", Ptr(np.int64)), ("num_evictions", Ptr(np.int64)), ("admitted", Ptr(np.bool_)),
                ("stalled", Ptr(np.bool_)), ("free_queue", Ptr(np.int64)), ("free_queue_len", I64),
                ("num_deferred", I64)]

    @classmethod
    def fresh(cls, n_req: int, queue_size: int | None) -> PoolResultStruct:
        """Zeroed arrays for n_req requests and a free queue of `queue_size` blocks (None: not wanted)."""
        return cls.of(hit_blocks=np.zeros(n_req, np.int64), num_evictions=np.zeros(n_req, np.int64),
                      admitted=np.zeros(n_req, np.bool_), stalled=np.zeros(n_req, np.bool_),
                      free_queue=None if queue_size is None else np.zeros(queue_size, np.int64), free_queue_len=0,
                      num_deferred=0)

    def read(self, written: PoolResultStruct) -> PoolArrays:
        """This structure's arrays as the kernel filled them, cut and counted as `written` says (the copy of
        it the kernel was given, a field of its output structure)."""
        hit_blocks, num_evictions, admitted, stalled, queue = self._keep[:5]
        queue = np.zeros(0, np.int64) if queue is None else queue[:written.free_queue_len]
        return PoolArrays(hit_blocks, num_evictions, admitted, stalled, queue, int(written.num_deferred))


class _PoolIn(Struct):
    c_type = "ks_pool_in"
    _fields_ = [("stream", PoolStreamStruct), ("has_holds", I64), ("is_parent", Ptr(np.bool_)),
                ("release_after", Ptr(np.int64)), ("parent_of", Ptr(np.int64)), ("fam", Ptr(np.int64)),
                ("num_families", I64), ("expiry_ns", I64), ("max_held", I64), ("max_families", I64)]


class _PoolOut(Struct):
    c_type = "ks_pool_out"
    _fields_ = [("pool", PoolResultStruct), ("records", Ptr(np.int64)), ("num_records", I64)]


_pool_replay = declare("ks_pool_replay", [ctypes.POINTER(_PoolIn), ctypes.POINTER(_PoolOut)], I64)


def _replay(obj, IN, timed, block_size, num_usable, num_objects, has_holds, is_parent, release_after, parent_of,
            fam, num_families, caps, free_queue):
    """The C replay (native/kernels/pool.c); the results as `replay_compiled` documents them."""
    n_req = len(IN[2])
    holds = dict(is_parent=None, release_after=None, parent_of=None, fam=None)
    if has_holds:
        holds = dict(is_parent=np.ascontiguousarray(is_parent, np.bool_),
                     **{k: np.ascontiguousarray(a, np.int64) for k, a in (("release_after", release_after),
                                                                         ("parent_of", parent_of), ("fam", fam))})
    args = _PoolIn.of(stream=PoolStreamStruct.over(obj, IN, timed, block_size, num_usable, num_objects),
                      has_holds=bool(has_holds), **holds, num_families=num_families, expiry_ns=caps[0],
                      max_held=caps[1], max_families=caps[2])
    pool = PoolResultStruct.fresh(n_req, num_usable if free_queue else None)
    records = np.zeros((NUM_RECORD_ROWS, n_req if has_holds else 0), np.int64)
    out = _PoolOut.of(pool=pool, records=records, num_records=0)
    check(_pool_replay(ctypes.byref(args), ctypes.byref(out)), "the block-pool replay")
    return (*pool.read(out.pool), tuple(records[:, :int(out.num_records)]))


