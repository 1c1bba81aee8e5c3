"""The GPU side of the replay routes: a device arena, its stream, the consumer and read-back.

PyTorch is imported lazily (only GPU routes need it) and used for what it does well: allocating the
arena, poisoning it, the consumer (a reduction that reads every byte, fenced by a stream
synchronisation) and copying the arena back for verification outside timing. The copies the routes
time are issued by the native engine through the driver API, not by PyTorch.
"""

from __future__ import annotations

from kmesh_trace.errors import KmeshTraceError, MissingDependencyError
from kmesh_trace.native._lib import now_ns

ARENA_ALIGNMENT = 2 << 20  # DMA-BUF export wants page-aligned ranges; 2 MiB also matches VMM granularity


class RouteUnavailable(KmeshTraceError):
    """A route's precondition does not hold on this host; the message names the first that failed."""


def torch_cuda():
    """PyTorch with a visible CUDA device, or RouteUnavailable/MissingDependencyError saying why not."""
    try:
        import torch
    except ImportError as e:
        raise MissingDependencyError("GPU routes need PyTorch with CUDA: pip install torch") from e
    if not torch.cuda.is_available():
        raise RouteUnavailable(f"PyTorch {torch.__version__} sees no CUDA device")
    return torch


def ensure_context():
    """Make PyTorch's (the primary) CUDA context current on this thread; driver API calls need one."""
    torch = torch_cuda()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    return torch


class GpuArena:
    """`num_bytes` of device memory, aligned to ARENA_ALIGNMENT, with a private stream."""

    def __init__(self, num_bytes: int):
        torch = self.torch = torch_cuda()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_bytes = num_bytes
        self._raw = torch.empty(num_bytes + ARENA_ALIGNMENT, dtype=torch.uint8, device=self.device)
        skip = (-self._raw.data_ptr()) % ARENA_ALIGNMENT
        self.tensor = self._raw[skip: skip + num_bytes]
        self.address = self.tensor.data_ptr()
        self.stream = torch.cuda.Stream(self.device)
        self.stream_handle = self.stream.cuda_stream
        torch.cuda.synchronize(self.device)  # the primary context is now current on this thread

    def poison(self, n: int, value: int) -> None:
        with self.torch.cuda.stream(self.stream):
            self.tensor[:n].fill_(value)
        self.stream.synchronize()

    def consume(self, n: int):
        """Run the consumer on the arena's stream and fence it; returns (done_ns, device sum tensor)."""
        with self.torch.cuda.stream(self.stream):
            total = self.tensor[:n].sum(dtype=self.torch.int64)
        self.stream.synchronize()
        return now_ns(), total

    def fetch(self, n: int):
        return self.tensor[:n].cpu().numpy()

    def close(self) -> None:
        self.stream.synchronize()
        self.tensor = self._raw = None
