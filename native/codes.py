"""The one mapping from the native side's return codes to what a user reads.

Three domains meet in kmesh_trace.native, and a bare integer means nothing without its domain (-1 is
EPERM from an io_uring call but "no libcuda.so.1" from a CUDA one), so every code travels as a
`NativeCode` (domain, value) and becomes text only in `NativeCode.__str__`:

- `errno`: native/replay.c's io_uring entry points (`kr_probe_io_uring`, `kr_open`, `kr_register_*`,
  `kr_unregister_buffers`, `kr_restore`) and each sample's `result`: >= 0 on success, -errno (Linux)
  on failure; read as `EINVAL: Invalid argument`;
- `cuda`: replay.c's CUDA entry points (`kr_cuda_load`, `kr_cuda_host_register`, `kr_attach_cuda`) and
  each sample's `copy_result`: 0 on success, a positive CUresult from the driver (`CUresult 201`), or
  the engine's own codes, -1 (libcuda.so.1 not found) and -2 (a driver API symbol missing);
- `cufile`: libcufile's `CUfileError_t` (native/cufile.py): err 0 on success, else a cuFile error
  number (`cuFile error 5027`) with the CUresult when the error carries one.

The engine's own codes are defined in replay.c (`KR_ENOLIBCUDA`, `KR_ENOSYMBOL`) and mirrored here
(`ENGINE_CODES`); on a host without an NVIDIA driver tests/test_native_binding.py checks the first
against the library itself.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

ERRNO, CUDA, CUFILE = "errno", "cuda", "cufile"
DOMAINS = (ERRNO, CUDA, CUFILE)

# replay.c's own codes in the CUDA domain (KR_ENOLIBCUDA, KR_ENOSYMBOL): not errnos, not CUresults.
NO_LIBCUDA, NO_SYMBOL = -1, -2
ENGINE_CODES = {
    NO_LIBCUDA: "libcuda.so.1 not found (no NVIDIA driver on this host)",
    NO_SYMBOL: "libcuda.so.1 lacks driver API symbols this engine needs",
}


@dataclass(frozen=True)
class NativeCode:
    """One return code with its domain; `cuda_result` is the CUresult a cuFile error carries (or 0)."""

    domain: str
    value: int
    cuda_result: int = 0

    def __post_init__(self):
        if self.domain not in DOMAINS:
            raise ValueError(f"unknown native error domain {self.domain!r} (one of {', '.join(DOMAINS)})")

    @property
    def ok(self) -> bool:
        return self.value >= 0 if self.domain == ERRNO else self.value == 0

    @property
    def is_engine_code(self) -> bool:
        """One of replay.c's own codes (only the CUDA domain has them)."""
        return self.domain == CUDA and self.value in ENGINE_CODES

    def __str__(self) -> str:
        if self.domain == ERRNO:
            n = -self.value
            return f"{errno.errorcode.get(n, str(n))}: {os.strerror(n)}"
        if self.domain == CUDA:
            return ENGINE_CODES.get(self.value, f"CUresult {self.value}")
        cu = f", CUresult {self.cuda_result}" if self.cuda_result else ""
        return f"cuFile error {self.value}{cu}"


def errno_code(rc: int) -> NativeCode:
    return NativeCode(ERRNO, rc)


def cuda_code(rc: int) -> NativeCode:
    return NativeCode(CUDA, rc)


def cufile_code(err: int, cu_err: int = 0) -> NativeCode:
    return NativeCode(CUFILE, err, cu_err)


def failure(what: str, code: NativeCode) -> str:
    """The one sentence for a failed call: `what failed (code)`."""
    return f"{what} failed ({code})"
