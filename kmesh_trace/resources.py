"""Memory from the flags, checked before it is allocated.

Some flags size what a command allocates whatever the trace holds: `--capacity-blocks` the vLLM pool
model (a slot per block), `fleet --engines` one pool per engine and a global pool of engines x
blocks. A command estimates those bytes first (`pool_bytes`, `fleet_bytes`) and `check_fits` refuses,
in one sentence naming the flag, an estimate above `MEMORY_FRACTION` of the memory this process can
still get (the machine's available memory, a cgroup limit, an address-space limit), instead of
swapping or being killed minutes later. The per-block and per-engine figures were measured on the
pool model (tracemalloc: 139 bytes a block; RSS: about 2.5 KB an engine); an estimate that is a little
high only refuses a pool that would have taken most of the machine.
"""

from __future__ import annotations

import os
import resource

from kmesh_trace.errors import KmeshTraceError

__all__ = ["MEMORY_FRACTION", "available_memory", "check_fits", "fleet_bytes", "pool_bytes"]

#: The vLLM block-pool model (oracle.blockpool.PoolModel): ref count, hash slot and free-queue entry.
POOL_BYTES_PER_BLOCK = 140
#: The Belady kernels' heap (two int64 arrays of the capacity).
KERNEL_BYTES_PER_BLOCK = 16
#: One engine of a fleet replay, pool excluded (its replay state and routing bookkeeping).
ENGINE_BYTES = 3000
#: The share of the available memory one command may ask for; the rest is the trace, Python and the
#: other processes of the machine.
MEMORY_FRACTION = 0.5


def _cgroup_room() -> int | None:
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current").read())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(int(limit) - used, 0)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _address_space_room() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        used = 0
    return max(soft - used, 0)


def available_memory() -> int | None:
    """Bytes this process can still allocate: the least of the machine's available memory, its
    cgroup's room and its address-space limit (None when none is known)."""
    known = [v for v in (_meminfo_available(), _cgroup_room(), _address_space_room()) if v is not None]
    return min(known) if known else None


def pool_bytes(capacity_blocks: int, *, vllm: bool = True, pools: int = 1) -> int:
    """Bytes of `pools` simultaneous pools of `capacity_blocks` (the vLLM pool model, else the kernels)."""
    return pools * capacity_blocks * (POOL_BYTES_PER_BLOCK if vllm else KERNEL_BYTES_PER_BLOCK)


def fleet_bytes(num_engines: int, capacity_blocks: int) -> int:
    """Bytes of one fleet replay: `num_engines` engines of `capacity_blocks`, or the global pool of both."""
    return num_engines * ENGINE_BYTES + pool_bytes(num_engines * capacity_blocks)


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_fits(num_bytes: int, flag: str, what: str, *, asked_by: str | None = None) -> None:
    """Refuse `num_bytes` (what `flag` asks for, described by `what`) when it exceeds MEMORY_FRACTION of
    the available memory: one sentence naming the flag (and `asked_by`, when the size came from elsewhere,
    e.g. the trace's metadata, and `flag` is how to ask for less)."""
    room = available_memory()
    if room is None or num_bytes <= room * MEMORY_FRACTION:
        return
    raise KmeshTraceError(f"{asked_by or flag} asks for {what} of about {_gib(num_bytes)}, more than half of the "
                          f"{_gib(room)} of memory available here; give a smaller {flag} or run on a larger machine.")
