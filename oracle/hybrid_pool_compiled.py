"""The hybrid `vllm` pool model compiled: `HybridPoolReplay`'s replay (`kmesh_trace.oracle.hybrid_pool`) in C,
native/kernels/hybrid_pool.c, the same rules in the same order over arrays.

This module turns the requests into the kernel's arrays (each distinct block hash a dense id; a group's
key is group x ids + id) and calls it through ctypes (`kmesh_trace.native.kernels`). `HybridPoolReplay`
stays the reference: tests replay random workloads (sequential and timed, windows, chunks, equal specs,
stalls, refusals, deferrals) through both and compare every per-request result and the final free queue.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kmesh_trace.kv_groups import CHUNKED_LOCAL, SLIDING_WINDOW
from kmesh_trace.native.kernels import I64, Ptr, Struct, check, declare
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


_I64 = Ptr(np.int64)


class _HybridIn(Struct):
    """struct ks_hybrid_pool_in (native/kernels/boundary.h)."""

    c_type = "ks_hybrid_pool_in"
    _fields_ = [("G", I64), ("kind", _I64), ("span", _I64), ("n_sg", I64), ("sg_kind", _I64), ("sg_span", _I64),
                ("sg_start", _I64), ("sg_gid", _I64), ("n_req", I64), ("P", _I64), ("Gout", _I64), ("ph_off", _I64),
                ("n_ph", _I64), ("ph", _I64), ("oh_off", _I64), ("n_oh", _I64), ("oh", _I64), ("K", I64),
                ("arrival", _I64), ("finish", _I64), ("timed", I64), ("tab_cap", _I64), ("maxb", I64), ("bs", I64),
                ("N", I64), ("retention", I64)]


class _HybridOut(Struct):
    """struct ks_hybrid_pool_out."""

    c_type = "ks_hybrid_pool_out"
    _fields_ = [("hit_tokens", _I64), ("num_evictions", _I64), ("admitted", Ptr(np.bool_)),
                ("stalled", Ptr(np.bool_)), ("free_queue", _I64), ("free_queue_len", I64), ("num_deferred", I64)]


_hybrid_replay = declare("ks_hybrid_pool_replay", [ctypes.POINTER(_HybridIn), ctypes.POINTER(_HybridOut)], I64)


def _replay(G, kind, span, sg_kind, sg_span, sg_start, sg_gid, prompt, output, arrays, K, arrival, finish, timed,
            tab_cap, maxb, bs, num_usable, retention):
    n = len(prompt)
    hit_tokens, num_evictions = np.zeros(n, np.int64), np.zeros(n, np.int64)
    admitted, stalled = np.zeros(n, np.bool_), np.zeros(n, np.bool_)
    queue = np.zeros(num_usable, np.int64)
    args = _HybridIn.of(G=G, kind=kind, span=span, n_sg=len(sg_kind), sg_kind=sg_kind, sg_span=sg_span,
                        sg_start=sg_start, sg_gid=sg_gid, n_req=n, P=prompt, Gout=output,
                        **dict(zip(("ph_off", "n_ph", "ph", "oh_off", "n_oh", "oh"), arrays)), K=K, arrival=arrival,
                        finish=finish, timed=bool(timed), tab_cap=tab_cap, maxb=maxb, bs=bs, N=num_usable,
                        retention=retention)
    out = _HybridOut.of(hit_tokens=hit_tokens, num_evictions=num_evictions, admitted=admitted, stalled=stalled,
                        free_queue=queue, free_queue_len=0, num_deferred=0)
    check(_hybrid_replay(ctypes.byref(args), ctypes.byref(out)), "the hybrid pool replay")
    return hit_tokens, num_evictions, admitted, stalled, queue[:int(out.free_queue_len)], int(out.num_deferred)
