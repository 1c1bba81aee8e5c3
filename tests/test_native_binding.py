"""The ctypes binding of native/replay.c: its record layouts are checked against the C at load, its
argument checks raise (under `python -O` too), and every return code reads through one mapping.

The library is the real one built from native/replay.c; a mismatch is shown with deliberately wrong
mirrors (a numpy dtype and a ctypes Structure), and an old library with a real shared object that lacks
the entry points (the C library).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.native import _lib
from kmesh_trace.native._lib import CHUNK_DTYPE, SAMPLE_DTYPE, LayoutMismatchError, NativeError
from kmesh_trace.native.codes import (CUDA, ENGINE_CODES, ERRNO, NO_LIBCUDA, NO_SYMBOL, NativeCode, cuda_code,
                                      cufile_code, errno_code, failure)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def c_layouts() -> dict:
    return _lib.c_layouts(_lib.lib())


def test_the_c_structures_are_what_the_binding_mirrors(c_layouts):
    assert c_layouts == {
        "kr_chunk": {"size": 32, "fields": {"fd": (0, 4), "buf_index": (4, 4), "file_offset": (8, 8),
                                            "size": (16, 8), "buf_offset": (24, 8)}},
        "kr_sample": {"size": 40, "fields": {"submit_ns": (0, 8), "complete_ns": (8, 8), "result": (16, 8),
                                             "worker": (24, 4), "num_sqes": (28, 4), "copy_result": (32, 4),
                                             "pad": (36, 4)}},
    }
    _lib.check_layouts(c_layouts)  # the mirrors agree: no error
    assert _lib.layout_problems("kr_chunk", c_layouts["kr_chunk"], CHUNK_DTYPE) == []
    assert _lib.layout_problems("kr_sample", c_layouts["kr_sample"], SAMPLE_DTYPE) == []


def test_a_wrong_dtype_is_refused_naming_the_field(c_layouts):
    narrow = np.dtype([("fd", "<i4"), ("buf_index", "<i4"), ("file_offset", "<i8"), ("size", "<i4"),
                       ("buf_offset", "<i8")])  # size as 4 bytes: the C has 8
    problems = _lib.layout_problems("kr_chunk", c_layouts["kr_chunk"], narrow)
    assert problems == ["sizeof(struct kr_chunk) is 32 bytes in C, 28 in the binding",
                        "kr_chunk.size is 8 bytes at offset 16 in C, 4 at offset 16 in the binding",
                        "kr_chunk.buf_offset is 8 bytes at offset 24 in C, 8 at offset 20 in the binding"]
    with pytest.raises(LayoutMismatchError, match=r"kr_chunk\.size is 8 bytes at offset 16 in C") as e:
        _lib.check_layouts(c_layouts, "lib.so", {"kr_chunk": narrow, "kr_sample": SAMPLE_DTYPE})
    assert isinstance(e.value, KmeshTraceError) and "rebuild it (`pip install -e .`)" in str(e.value)


def test_a_wrong_ctypes_structure_is_refused(c_layouts):
    class Sample(ctypes.Structure):  # struct kr_sample as the C has it
        _fields_ = [("submit_ns", ctypes.c_int64), ("complete_ns", ctypes.c_int64), ("result", ctypes.c_int64),
                    ("worker", ctypes.c_int32), ("num_sqes", ctypes.c_int32), ("copy_result", ctypes.c_int32),
                    ("pad", ctypes.c_int32)]

    class NoPad(ctypes.Structure):  # the padding field forgotten: ctypes pads to 40 anyway, the fields differ
        _fields_ = Sample._fields_[:-1]

    class Reordered(ctypes.Structure):  # two fields swapped
        _fields_ = [Sample._fields_[1], Sample._fields_[0]] + Sample._fields_[2:]

    assert _lib.layout_problems("kr_sample", c_layouts["kr_sample"], Sample) == []
    assert _lib.layout_problems("kr_sample", c_layouts["kr_sample"], NoPad) == [
        "struct kr_sample has fields ['submit_ns', 'complete_ns', 'result', 'worker', 'num_sqes', 'copy_result', "
        "'pad'] in C, ['submit_ns', 'complete_ns', 'result', 'worker', 'num_sqes', 'copy_result'] in the binding"]
    problems = _lib.layout_problems("kr_sample", c_layouts["kr_sample"], Reordered)
    assert "kr_sample.submit_ns is 8 bytes at offset 0 in C, 8 at offset 8 in the binding" in problems
    assert _lib.layout_problems("kr_nothing", None, Sample) == ["the library describes no struct kr_nothing"]


def test_a_library_built_from_another_replay_c_is_refused():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))  # a real shared object without the engine's entry points
    with pytest.raises(NativeError, match=r"libc.* has no entry point kr_cuda_load: it was built from another"):
        _lib._declare(libc, "libc.so.6")


def test_restore_refuses_bad_chunks_with_an_error_even_under_python_O():
    """The raw-pointer check raises (NativeError), so `python -O`, which drops asserts, keeps it."""
    if _lib.probe_io_uring():
        pytest.skip(f"io_uring is unavailable here ({_lib.strerror(_lib.probe_io_uring())})")
    script = (
        "import numpy as np\n"
        "from kmesh_trace.native._lib import CHUNK_DTYPE, SAMPLE_DTYPE, NativeError, Ring\n"
        "with Ring(depth=2) as ring:\n"
        "    for bad in (np.zeros(2, dtype=SAMPLE_DTYPE), np.zeros(4, dtype=CHUNK_DTYPE)[::2]):\n"
        "        try:\n"
        "            ring.restore(bad)\n"
        "        except NativeError as e:\n"
        "            print(e)\n"
        "        else:\n"
        "            print('accepted')\n"
    )
    out = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert len(lines) == 2 and "accepted" not in out, out
    assert lines[0].startswith("restore needs a C-contiguous array of CHUNK_DTYPE records (got dtype [(")
    assert lines[1].endswith("not contiguous)")


def test_the_three_code_domains_read_through_one_mapping():
    assert str(errno_code(-errno.EINVAL)) == "EINVAL: Invalid argument"
    assert errno_code(0).ok and errno_code(4096).ok and not errno_code(-errno.EIO).ok
    # -1 and -2 from a CUDA entry point are the engine's own codes, not EPERM/ENOENT.
    assert str(errno_code(-1)) == "EPERM: Operation not permitted"
    assert str(cuda_code(NO_LIBCUDA)) == ENGINE_CODES[NO_LIBCUDA] == "libcuda.so.1 not found (no NVIDIA driver on this host)"
    assert str(cuda_code(NO_SYMBOL)) == "libcuda.so.1 lacks driver API symbols this engine needs"
    assert cuda_code(NO_LIBCUDA).is_engine_code and not errno_code(NO_LIBCUDA).is_engine_code
    assert str(cuda_code(201)) == "CUresult 201" and not cuda_code(201).is_engine_code and cuda_code(0).ok
    assert str(cufile_code(5027)) == "cuFile error 5027"
    assert str(cufile_code(5011, 2)) == "cuFile error 5011, CUresult 2"
    assert failure("cuFileHandleRegister", cufile_code(5027)) == "cuFileHandleRegister failed (cuFile error 5027)"
    assert failure("cuInit", cuda_code(3)) == "cuInit failed (CUresult 3)"
    assert NativeCode(ERRNO, -5).domain == ERRNO and NativeCode(CUDA, 1).domain == CUDA
    with pytest.raises(ValueError, match="unknown native error domain"):
        NativeCode("nccl", 1)


def test_an_io_uring_failure_carries_its_code():
    with pytest.raises(NativeError, match=r"io_uring setup failed \(EINVAL: Invalid argument\)") as e:
        _lib.Ring(depth=0)
    assert e.value.code == errno_code(-errno.EINVAL)


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="this host has an NVIDIA driver")
def test_the_engine_code_for_no_driver_is_the_one_the_mapping_knows():
    from kmesh_trace.native.routes import cuda_driver_step

    assert _lib.lib().kr_cuda_load() == NO_LIBCUDA
    with pytest.raises(OSError, match=re.escape(ENGINE_CODES[NO_LIBCUDA])):
        cuda_driver_step()


def test_the_unmerged_dmabuf_abi_says_where_its_constants_came_from():
    """replay.c compiles in its own values for the proposed io_uring DMA-BUF registration unless the kernel
    header defines them; the library says which (a stock header defines neither)."""
    abi = _lib.dmabuf_abi_from_header()
    header = Path("/usr/include/linux/io_uring.h")
    text = header.read_text() if header.exists() else ""
    assert abi == {"IORING_RSRC_F_EXTENDED_UPDATE": "IORING_RSRC_F_EXTENDED_UPDATE" in text,
                   "IORING_BUF_TYPE_DMABUF": "IORING_BUF_TYPE_DMABUF" in text}
    assert "NOTE: UNMERGED KERNEL ABI COMPILED IN" in (ROOT / "native" / "replay.c").read_text()
