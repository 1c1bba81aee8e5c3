"""The structures at the kernels' boundary (native/kernels/boundary.h): each is mirrored once in Python (a
`Struct` beside the module that calls the kernel), every mirror agrees with the library's layout table
(`ks_layout`, native/kernels/layout.c) field by field, and a mirror that does not is refused when its entry
point is declared, before any call could misread it.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kmesh_trace.native import kernels
from kmesh_trace.native.binding import LayoutMismatchError, Ptr, Struct, layout_problems, structs_in
from kmesh_trace.oracle import blockpool_compiled, curves, hybrid_pool_compiled, kernel_ids, shards, stream_index
from kmesh_trace.oracle.tiers import compiled as tiers_compiled

CALLERS = (blockpool_compiled, curves, hybrid_pool_compiled, kernel_ids, shards, stream_index, tiers_compiled)


def project_mirrors() -> dict[str, type[Struct]]:
    """c_type -> the project's mirror of it (the tests' deliberately wrong ones left out)."""
    found: dict[str, list] = {}
    stack = list(Struct.__subclasses__())
    while stack:
        cls = stack.pop()
        stack += cls.__subclasses__()
        if cls.__module__.startswith("kmesh_trace."):
            found.setdefault(cls.c_type, []).append(cls)
    assert all(len(v) == 1 for v in found.values()), f"a structure mirrored twice: {found}"
    return {k: v[0] for k, v in found.items()}


def test_every_structure_at_the_boundary_has_one_mirror_that_agrees():
    c = kernels.layouts()
    mirrors = project_mirrors()
    assert set(mirrors) == set(c), "every C structure of the table has a mirror, and every mirror a C structure"
    for c_type, mirror in mirrors.items():
        assert layout_problems(c_type, c[c_type], mirror) == [], c_type
    assert c["ks_pool_in"]["fields"]["stream"] == (0, c["ks_pool_stream"]["size"])  # nested by value


def test_a_wrong_mirror_is_refused_when_its_entry_is_declared():
    good = blockpool_compiled.PoolResultStruct

    class Narrow(Struct):  # num_deferred as 4 bytes: the C has 8
        c_type = "ks_pool_result"
        _fields_ = good._fields_[:-1] + [("num_deferred", ctypes.c_int32)]

    class Out(Struct):
        c_type = "ks_pool_out"
        _fields_ = [("pool", Narrow), ("records", Ptr(np.int64)), ("num_records", ctypes.c_int64)]

    assert structs_in([ctypes.POINTER(Out)]) == [Out, Narrow]
    with pytest.raises(LayoutMismatchError) as e:
        kernels.declare("ks_pool_replay", [ctypes.c_void_p, ctypes.POINTER(Out)], ctypes.c_int64)
    message = str(e.value)  # ctypes pads the narrow field to the same size: the field's offset and size tell
    assert "ks_pool_result.num_deferred is 8 bytes at offset 48 in C, 4 at offset 48 in the binding" in message
    assert "rebuild it (`pip install -e .`)" in message
    # nothing was declared: the real entry still takes the real structures
    assert kernels.lib().ks_pool_replay.argtypes[1]._type_ is blockpool_compiled._PoolOut


def test_a_structure_is_filled_only_with_the_arrays_its_fields_name():
    fresh = blockpool_compiled.PoolResultStruct.fresh(3, None)
    assert fresh.free_queue.value is None and fresh.hit_blocks.value == fresh._keep[0].ctypes.data
    arrays = dict(hit_blocks=np.zeros(3, np.int64), num_evictions=np.zeros(3, np.int64),
                  admitted=np.zeros(3, np.bool_), stalled=np.zeros(3, np.bool_), free_queue=None,
                  free_queue_len=0, num_deferred=0)
    blockpool_compiled.PoolResultStruct.of(**arrays)
    with pytest.raises(TypeError, match="a kernel needs a C-contiguous bool array, not int64"):
        blockpool_compiled.PoolResultStruct.of(**{**arrays, "admitted": np.zeros(3, np.int64)})
    with pytest.raises(TypeError, match="strided"):
        blockpool_compiled.PoolResultStruct.of(**{**arrays, "hit_blocks": np.zeros(6, np.int64)[::2]})
    with pytest.raises(TypeError, match="struct ks_pool_result needs its field num_deferred"):
        blockpool_compiled.PoolResultStruct.of(**{k: v for k, v in arrays.items() if k != "num_deferred"})
    with pytest.raises(TypeError, match="struct ks_pool_result has no field hits"):
        blockpool_compiled.PoolResultStruct.of(**arrays, hits=None)
