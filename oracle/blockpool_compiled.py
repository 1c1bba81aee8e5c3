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

import numpy as np

from kmesh_trace.native.kernels import I32, I64, P, check, declare, ptr
from kmesh_trace.oracle.interruptible import run_interruptible
from kmesh_trace.oracle.stream import AccessStream, RequestColumns, kept_and_eligible
from kmesh_trace.oracle.stream_index import obj_pointers

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


_pool_replay = declare("ks_pool_replay", [P, P, P, P, P, P, P, P, I64, I32, I64, I64, I64, I32, P, P, P, P, I64, I64,
                                          I64, I64, P, P, P, P, P, P, P], I64)


def stream_pointers(IN: tuple) -> list:
    """The per-request arrays of a stream (req_start, listed, prompt_tokens, output_tokens, finish_ns,
    arrival) as pointers to int64 arrays."""
    return [ptr(a, np.int64) for a in IN]


def _replay(obj, IN, timed, block_size, num_usable, num_objects, has_holds, is_parent, release_after, parent_of,
            fam, num_families, caps, free_queue):
    """The C replay (native/kernels/pool.c); the results as `replay_compiled` documents them."""
    n_req = len(IN[2])
    IN = tuple(np.ascontiguousarray(a, np.int64) for a in IN)
    obj = obj if obj.dtype == np.int32 else np.ascontiguousarray(obj, np.int64)
    hit_blocks = np.zeros(n_req, np.int64)
    num_evictions = np.zeros(n_req, np.int64)
    admitted = np.zeros(n_req, np.bool_)
    stalled = np.zeros(n_req, np.bool_)
    queue = np.zeros(num_usable if free_queue else 0, np.int64)
    records = np.zeros((NUM_RECORD_ROWS, n_req if has_holds else 0), np.int64)
    out = np.zeros(3, np.int64)
    hold_ptrs = [None] * 4
    if has_holds:  # the arrays stay referenced (is_parent, ...) until the call returns
        is_parent = np.ascontiguousarray(is_parent, np.bool_)
        release_after, parent_of, fam = (np.ascontiguousarray(a, np.int64) for a in (release_after, parent_of, fam))
        hold_ptrs = [ptr(is_parent, np.bool_)] + [ptr(a, np.int64) for a in (release_after, parent_of, fam)]
    check(_pool_replay(*obj_pointers(obj), *stream_pointers(IN), n_req, timed, block_size, num_usable, num_objects,
                       has_holds, *hold_ptrs, num_families, *caps, ptr(hit_blocks, np.int64), ptr(num_evictions, np.int64),
                       ptr(admitted, np.bool_), ptr(stalled, np.bool_), ptr(queue, np.int64) if free_queue else None, ptr(records, np.int64),
                       ptr(out, np.int64)), "the block-pool replay")
    m = int(out[2])
    return hit_blocks, num_evictions, admitted, stalled, queue[:int(out[0])], int(out[1]), tuple(records[:, :m])
