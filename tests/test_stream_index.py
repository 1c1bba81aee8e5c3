"""The compiled stream flattening (oracle/stream_index.py, native/kernels/stream_index.c) against numpy."""

import numpy as np
import pytest

from kmesh_trace.native import kernels
from kmesh_trace.oracle.stream import NEVER, AccessStream, next_uses
from kmesh_trace.oracle.stream_index import dense_ids_and_next_uses, leading_flags


@pytest.mark.parametrize("seed", range(40))
def test_dense_ids_and_next_uses_equal_numpy(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3000))
    hashes = rng.choice(rng.integers(0, 2**64, int(rng.integers(1, 400)), dtype=np.uint64), n)
    eligible = rng.random(n) < 0.7
    order = np.argsort(hashes, kind="stable")
    for dtype in (np.int32, np.int64):
        obj, nxt = np.empty(n, dtype), np.empty(n, np.int64)
        m = dense_ids_and_next_uses(hashes, order, eligible, obj, nxt, NEVER)
        uniq, inverse = np.unique(hashes, return_inverse=True)
        assert m == len(uniq)
        assert np.array_equal(obj, inverse)
        assert np.array_equal(nxt, next_uses(inverse, eligible))


def test_leading_flags():
    req_start = np.array([0, 3, 3, 7, 8], np.int64)
    n_first = np.array([2, 5, 9, 0], np.int64)
    assert leading_flags(req_start, n_first).tolist() == [True, True, False, True, True, True, True, False]


def test_from_arrays_on_signed_hashes():
    hashes = np.array([5, -1, 5, 7, -1], np.int64)
    s = AccessStream.from_arrays(16, hashes, np.ones(5, bool), np.array([0, 2, 5]), np.array([32, 48]),
                                 np.array([2, 3]))
    assert s.num_objects == 3 and s.next_use.tolist() == [2, 4, NEVER, NEVER, NEVER]


def test_ptr_refuses_a_wrong_array():
    with pytest.raises(TypeError, match="C-contiguous int64"):
        kernels.ptr(np.zeros(4, np.int32), np.int64)
    with pytest.raises(TypeError, match="strided"):
        kernels.ptr(np.zeros(8, np.int64)[::2], np.int64)
