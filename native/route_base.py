"""What every replay route shares: the `Route` interface, the timing a restore reports (`Restored`), the
probe of a route's preconditions (`Probe`, `run_steps`) and the GPU steps two routes' probes take.

The routes themselves live above this module: `host` and `host_fixed` in native/routes.py (with the
registry and `probe_route`), `cufile` and `dmabuf_fixed` in their own modules; each of them imports this
one, and none of them imports another route's module but the registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from kmesh_trace.native import _lib
from kmesh_trace.native._lib import NOT_MEASURED, CHUNK_DTYPE, Ownership, Ring
from kmesh_trace.native.codes import cuda_code, failure
from kmesh_trace.native.store import Chunk

HOST_POISON = 0xA5
GPU_POISON = 0x5A


@dataclass
class Step:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class Probe:
    route: str
    steps: list[Step] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps)

    @property
    def reason(self) -> str | None:
        """The first failed precondition, as `step: detail`."""
        bad = next((s for s in self.steps if not s.ok), None)
        return None if bad is None else f"{bad.name}: {bad.detail}" if bad.detail else bad.name

    def as_dict(self) -> dict:
        return {"route": self.route, "status": "ok" if self.ok else "unavailable", "reason": self.reason,
                "steps": [{"step": s.name, "ok": s.ok, "detail": s.detail} for s in self.steps]}


def run_steps(probe: Probe, steps: list[tuple], keep_going: bool = False) -> Probe:
    """Run (name, fn[, needs]) steps; fn returns a detail or raises. Stops at the first failure unless
    keep_going; then a step whose `needs` (names of earlier steps) failed is recorded as not tried."""
    failed: set[str] = set()
    for name, fn, *rest in steps:
        blocked = [n for n in (rest[0] if rest else ()) if n in failed]
        if blocked:
            probe.steps.append(Step(name, False, f"not tried: needs {', '.join(blocked)}"))
            failed.add(name)
            continue
        try:
            probe.steps.append(Step(name, True, fn() or ""))
        except Exception as e:  # a probe reports every failure as data, whatever raised it
            probe.steps.append(Step(name, False, str(e) or type(e).__name__))
            failed.add(name)
            if not keep_going:
                break
    return probe


@dataclass
class Restored:
    """Timing of one restore: samples per chunk (native records), timer 1 and, for GPU routes, timer 2."""

    samples: np.ndarray
    start_ns: int
    io_done_ns: int
    consumer_done_ns: int | None = None
    consumer_sum: int | None = None


class Route:
    """One way to restore a journal restore into a destination; subclasses fill in the destination.

    A constructor that fails part-way calls close() before raising, so close() must tolerate parts that
    were never built (they stay None) and being called twice."""

    name: ClassVar[str]
    gpu: ClassVar[bool] = False
    ring: Ring | None = None

    def __init__(self, max_bytes: int, depth: int, num_workers: int):
        self.max_bytes = max_bytes
        self.ring = Ring(depth, num_workers)

    def chunk_array(self, chunks: list[Chunk], fds: dict[str, int], paths: dict[str, Path]) -> np.ndarray:
        """The native chunk records for one restore: chunks land back to back in the destination."""
        a = np.zeros(len(chunks), dtype=CHUNK_DTYPE)
        off = 0
        for i, c in enumerate(chunks):
            a[i] = (fds[c.file], 0, c.offset_bytes, c.size_bytes, off)
            off += c.size_bytes
        return a

    def poison(self, n: int) -> None:
        raise NotImplementedError

    def restore(self, chunks: np.ndarray) -> Restored:
        raise NotImplementedError

    def fetch(self, n: int) -> np.ndarray:
        raise NotImplementedError

    def forget(self, fd: int) -> None:
        """`fd` is about to be closed: drop anything registered for it (its number will be reused)."""

    def ownership(self) -> Ownership:
        return self.ring.ownership() if self.ring is not None else NOT_MEASURED

    def close(self) -> Ownership:
        """Release everything; returns the ownership state read just before the ring was torn down."""
        own = self.ownership()
        if self.ring is not None:
            self.ring.close()  # unregisters the buffers too, and cannot fail part-way
            self.ring = None
        return own



def cuda_driver_step() -> str:
    code = cuda_code(_lib.lib().kr_cuda_load())
    if not code.ok:
        raise OSError(str(code) if code.is_engine_code else failure("cuInit", code))
    return "libcuda.so.1 loaded, cuInit ok"


def torch_cuda_step() -> str:
    from kmesh_trace.native.gpu import torch_cuda

    torch = torch_cuda()
    return f"torch {torch.__version__}, {torch.cuda.get_device_name()}"
