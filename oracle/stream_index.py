"""The compiled pass that flattens a workload into its `AccessStream` (oracle/stream.py) in linear time.

Kept apart from oracle/stream.py so that the modules which only need `RequestBlocks` load no kernel. The
stream's dense object ids are the rank of each access's hash among the distinct hashes (as
`np.unique(..., return_inverse=True)` numbers them: the policies' tie-breaks see these ids), and each
access's next use is the position of the next access of the same hash when that access is eligible. The C
kernel (native/kernels/stream_index.c, `ks_stream_build`) finds both without sorting the stream: a hash
table gives each access the first-seen id of its hash, only the distinct hashes are sorted (to turn
first-seen ids into ranks), and one backward pass gives the next uses. It writes only the stream's own
arrays; `tests/test_stream_index.py` compares it with numpy's answers (`np.unique`, `next_uses`).
"""

from __future__ import annotations

import ctypes

import numpy as np

from kmesh_trace.native.kernels import I64, P, U64, Ptr, Struct, check, declare, ptr

#: next_use value of an access whose object is never read again as a counted (hit-eligible) read.
NEVER = np.iinfo(np.int64).max


class _BuildIn(Struct):
    """struct ks_stream_build_in (native/kernels/boundary.h)."""

    c_type = "ks_stream_build_in"
    _fields_ = [("flat", Ptr(np.uint64)), ("starts", Ptr(np.int64)), ("n_keep", Ptr(np.int64)),
                ("n_elig", Ptr(np.int64)), ("num_requests", I64), ("n", I64), ("key_xor", U64), ("wide_table", I64),
                ("never", I64)]


class _BuildOut(Struct):
    """struct ks_stream_build_out."""

    c_type = "ks_stream_build_out"
    _fields_ = [("eligible", Ptr(np.bool_)), ("obj32", Ptr(np.int32)), ("obj64", Ptr(np.int64)),
                ("next_use", Ptr(np.int64))]


_leading = declare("ks_stream_leading_flags", [P, I64, P, P])
_build = declare("ks_stream_build", [ctypes.POINTER(_BuildIn), ctypes.POINTER(_BuildOut)], I64)
_infinite = declare("ks_stream_infinite_hits", [P, P, P, P, I64, I64, P], I64)

#: The kernel's key_xor that orders hashes as signed 64-bit integers (what a sort of int64 hashes gives).
_SIGNED = 1 << 63


def obj_pointers(obj: np.ndarray) -> tuple:
    """A stream's dense ids (int32 or int64, contiguous: the caller keeps them) as the kernels take them:
    (int32 pointer, int64 pointer), one of them NULL."""
    if obj.dtype == np.int32:
        return ptr(obj, np.int32), None
    return None, ptr(obj, np.int64)


def leading_flags(req_start: np.ndarray, n_first: np.ndarray) -> np.ndarray:
    """One bool per access: it is among the first `n_first[r]` accesses of its request r."""
    req_start = np.ascontiguousarray(req_start, np.int64)
    n_first = np.ascontiguousarray(n_first, np.int64)
    out = np.empty(int(req_start[-1]), np.bool_)
    _leading(ptr(req_start, np.int64), len(req_start) - 1, ptr(n_first, np.int64), ptr(out, np.bool_))
    return out


def build_stream(flat: np.ndarray, starts: np.ndarray, n_keep: np.ndarray, n_elig: np.ndarray | None,
                 eligible: np.ndarray | None = None, *, wide_table: bool = False
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(obj, eligible, next_use, number of distinct hashes) of the stream whose request r accesses
    `flat[starts[r]:starts[r] + n_keep[r]]` (n_keep[r] <= 0: nothing), requests back to back.

    Eligible accesses are the first `n_elig[r]` of each request, or, with `n_elig` None, the `eligible` given
    (one bool per access). Hashes rank as their dtype orders them: a signed integer dtype as signed, any
    other as unsigned 64-bit. `obj` is int32 while the ids fit, else int64; `next_use` is int64, NEVER
    (oracle/stream.py) where there is no eligible next use. `wide_table`: the kernel's hash table with the
    64-bit slots it takes past 2**32 - 1 accesses (tests use it on small streams)."""
    flat = np.asarray(flat)
    key_xor = _SIGNED if flat.dtype.kind == "i" else 0
    flat = np.ascontiguousarray(flat, np.int64 if key_xor else np.uint64).view(np.uint64)
    starts = np.ascontiguousarray(starts, np.int64)
    n_keep = np.ascontiguousarray(n_keep, np.int64)
    n = int(np.maximum(n_keep, 0).sum())
    used = n_keep > 0
    if len(starts) != len(n_keep) or (used.any() and (int(starts[used].min()) < 0
                                                      or int((starts + n_keep)[used].max()) > len(flat))):
        raise ValueError("build_stream: a request's accesses run past the hashes given")
    if n_elig is not None:
        n_elig = np.ascontiguousarray(n_elig, np.int64)
        eligible = np.empty(n, np.bool_)
    else:
        eligible = np.ascontiguousarray(eligible, np.bool_)
        if len(eligible) != n:
            raise ValueError(f"build_stream: {len(eligible)} eligibility flags for {n} accesses")
    obj = np.empty(n, np.int32 if n < 2**31 else np.int64)  # ids < accesses
    next_use = np.empty(n, np.int64)
    args = _BuildIn.of(flat=flat, starts=starts, n_keep=n_keep, n_elig=n_elig, num_requests=len(n_keep), n=n,
                       key_xor=key_xor, wide_table=bool(wide_table), never=int(NEVER))
    out = _BuildOut.of(eligible=eligible, obj32=obj if obj.dtype == np.int32 else None,
                       obj64=None if obj.dtype == np.int32 else obj, next_use=next_use)
    num_objects = check(_build(ctypes.byref(args), ctypes.byref(out)), "stream build")
    if obj.dtype == np.int64 and num_objects < 2**31:
        obj = obj.astype(np.int32)
    return obj, eligible, next_use, int(num_objects)


def infinite_hits(stream) -> np.ndarray:
    """Per request of the `AccessStream`, its eligible reads whose object was accessed earlier in the stream
    (the `infinite` policy's hits), in one pass."""
    o32, o64 = obj_pointers(stream.obj)
    req_start = np.ascontiguousarray(stream.req_start, np.int64)
    hits = np.empty(len(req_start) - 1, np.int64)
    check(_infinite(o32, o64, ptr(np.ascontiguousarray(stream.eligible, np.bool_), np.bool_), ptr(req_start, np.int64),
                    len(hits), int(stream.num_objects), ptr(hits, np.int64)), "infinite hits")
    return hits
