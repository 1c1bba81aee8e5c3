"""The hybrid `vllm` pool model compiled: `HybridPoolReplay`'s replay (`kmesh_trace.oracle.hybrid_pool`) in C,
native/kernels/hybrid_pool.c, the same rules in the same order over arrays.

This module turns the requests into the kernel's arrays (each distinct block hash a dense id; a group's
key is group x ids + id) and calls it through ctypes (`kmesh_trace.native.kernels`). `HybridPoolReplay`
stays the reference: tests replay random workloads (sequential and timed, windows, chunks, equal specs,
stalls, refusals, deferrals) through both and compare every per-request result and the final free queue.
"""

from __future__ import annotations

import numpy as np

from kmesh_trace.kv_groups import CHUNKED_LOCAL, SLIDING_WINDOW
from kmesh_trace.native.kernels import I32, I64, P, check, declare, ptr
from kmesh_trace.oracle.interruptible import run_interruptible

_KINDS = {SLIDING_WINDOW: 1, CHUNKED_LOCAL: 2}  # else 0: full attention (MLA included)


def replay_hybrid_compiled(requests, groups, spec_groups, block_size: int, num_usable_blocks: int, timed: bool,
                           retention_interval: int | None):
    """(hit_tokens, num_evictions, admitted, stalled, free_queue) as numpy arrays, and num_deferred."""
    n, G, bs = len(requests), len(groups), block_size
    ids: dict = {}
    ph, ph_off, n_ph, oh, oh_off, n_oh = [], [0], [], [], [0], []
    for r in requests:
        listed = r.prompt_hashes[:r.num_prompt_tokens // bs]
        ph.extend(ids.setdefault(h, len(ids)) for h in listed)
        n_ph.append(len(listed))
        ph_off.append(len(ph))
        oh.extend(ids.setdefault(h, len(ids)) for h in r.output_hashes)
        n_oh.append(len(r.output_hashes))
        oh_off.append(len(oh))
    prompt = np.fromiter((r.num_prompt_tokens for r in requests), np.int64, n)
    output = np.fromiter((r.num_output_tokens for r in requests), np.int64, n)
    arrival = np.fromiter((r.arrival_ns or 0 for r in requests), np.int64, n)
    finish = np.fromiter((r.finish_ns or 0 for r in requests), np.int64, n)
    tab_cap = -(-(prompt + np.maximum(output - 1, 0)) // bs)  # a table's most blocks
    kind = np.array([_KINDS.get(g.kind, 0) for g in groups], np.int64)
    span = np.array([g.sliding_window or g.attention_chunk_size or 0 for g in groups], np.int64)
    sg_kind = np.array([_KINDS.get(s.kind, 0) for s in spec_groups], np.int64)
    sg_span = np.array([s.span or 0 for s in spec_groups], np.int64)
    sg_start = np.concatenate([[0], np.cumsum([len(s.group_ids) for s in spec_groups])]).astype(np.int64)
    sg_gid = np.array([g for s in spec_groups for g in s.group_ids], np.int64)
    arrays = [np.asarray(a, np.int64) for a in (ph_off[:-1], n_ph, ph, oh_off[:-1], n_oh, oh)]
    maxb = int((prompt // bs).max()) + 1 if n else 1
    return run_interruptible(_replay, G, kind, span, sg_kind, sg_span, sg_start, sg_gid, prompt, output, arrays,
                             max(len(ids), 1), arrival, finish, timed, tab_cap, maxb, bs, num_usable_blocks,
                             -1 if retention_interval is None else int(retention_interval))


_hybrid_replay = declare("ks_hybrid_pool_replay", [I64, P, P, I64, P, P, P, P, I64, P, P, P, P, P, P, P, P, I64, P, P,
                                                   I32, P, I64, I64, I64, I64, P, P, P, P, P, P], I64)


def _replay(G, kind, span, sg_kind, sg_span, sg_start, sg_gid, prompt, output, arrays, K, arrival, finish, timed,
            tab_cap, maxb, bs, num_usable, retention):
    n = len(prompt)
    hit_tokens, num_evictions = np.zeros(n, np.int64), np.zeros(n, np.int64)
    admitted, stalled = np.zeros(n, np.bool_), np.zeros(n, np.bool_)
    queue, out = np.zeros(num_usable, np.int64), np.zeros(2, np.int64)
    i64 = [ptr(a, np.int64) for a in arrays]
    check(_hybrid_replay(G, ptr(kind, np.int64), ptr(span, np.int64), len(sg_kind), ptr(sg_kind, np.int64),
                         ptr(sg_span, np.int64), ptr(sg_start, np.int64), ptr(sg_gid, np.int64), n,
                         ptr(prompt, np.int64), ptr(output, np.int64), *i64, K, ptr(arrival, np.int64),
                         ptr(finish, np.int64), int(bool(timed)), ptr(tab_cap, np.int64), maxb, bs,
                         num_usable, retention, ptr(hit_tokens, np.int64), ptr(num_evictions, np.int64),
                         ptr(admitted, np.bool_),
                         ptr(stalled, np.bool_), ptr(queue, np.int64), ptr(out, np.int64)), "the hybrid pool replay")
    return hit_tokens, num_evictions, admitted, stalled, queue[:int(out[0])], int(out[1])
