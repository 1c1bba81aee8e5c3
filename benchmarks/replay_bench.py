"""Benchmark: the native `host` route against a plain O_DIRECT sequential read of the same files.

In one run, alternating A B B A per round: `dd if=FILE of=/dev/null bs=CHUNK iflag=direct` over every
payload file (dd's own elapsed time, so process start-up is not charged to it) against the `host` route
restoring the same restores (timer 1: first submission to last completion). Prints each arm's
bandwidth and the ratio host/dd (goal >= 0.9). With --gpu, also the `host_fixed` restore (timer 2: to
the fenced GPU consumer) against the same bytes read by dd plus a pinned host-to-device copy and the
consumer, each measured alone. Timing lives here, never in tests.

    python benchmarks/replay_bench.py --dir /var/tmp/kmesh-bench [--restores 8] [--rounds 3] [--gpu]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from kmesh_trace.native import store as st
from kmesh_trace.native.routes import HostFixedRoute, HostRoute, Route



def dd_seconds(path: Path, bs: int) -> float:
    """dd's own elapsed time for an O_DIRECT sequential read of `path`."""
    p = subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={bs}", "iflag=direct"], capture_output=True,
                       text=True, check=True)
    m = re.search(r"copied, ([0-9.e+-]+) s", p.stderr)
    if not m:
        raise RuntimeError(f"cannot read dd's time from: {p.stderr!r}")
    return float(m.group(1))


def route_seconds(route: Route, arrays: list[np.ndarray], sizes: list[int], use_timer2: bool) -> float:
    total = 0.0
    for arr, n in zip(arrays, sizes):
        route.poison(n)
        r = route.restore(arr)
        end = r.consumer_done_ns if use_timer2 else r.io_done_ns
        total += (end - r.start_ns) / 1e9
    return total


def verify_last(route: Route, s: st.Store, rid: int) -> None:
    data = route.fetch(s.restore_bytes(rid))
    off = 0
    for c in s.restores[rid]:
        assert data[off: off + c.size_bytes].tobytes() == st.payload(s.seed, rid, c.chunk_index, c.size_bytes), c
        off += c.size_bytes


def h2d_and_consumer_seconds(nbytes: int, reps: int) -> tuple[float, float]:
    """Median seconds of a pinned host->device copy of `nbytes`, and of the consumer over them, each alone."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    src.fill_(7)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    copy, cons = [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        torch.cuda.synchronize()
        copy.append(a.elapsed_time(b) / 1e3)
        a.record()
        dst.sum(dtype=torch.int64)
        b.record()
        torch.cuda.synchronize()
        cons.append(a.elapsed_time(b) / 1e3)
    return statistics.median(copy), statistics.median(cons)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="Where the store lives (O_DIRECT must work there).")
    ap.add_argument("--restores", type=int, default=8, help="48 MiB restores in the store (default 8: 384 MiB).")
    ap.add_argument("--chunk-bytes", type=int, default=st.DEFAULT_CHUNK_BYTES)
    ap.add_argument("--rounds", type=int, default=3, help="A B B A rounds.")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--gpu", action="store_true", help="Also host_fixed against dd + pinned copy + consumer.")
    ap.add_argument("--json", type=Path, help="Also write the figures to this file.")
    a = ap.parse_args()

    sdir = a.dir / f"store-{a.restores}x{st.DEFAULT_NUM_CHUNKS}x{a.chunk_bytes}"
    s = st.open_store(sdir) if (sdir / st.JOURNAL).exists() else st.prepare(
        sdir, st.plan_uniform(a.restores, st.DEFAULT_NUM_CHUNKS, a.chunk_bytes))
    rids = sorted(s.restores)
    files = sorted({c.file for r in rids for c in s.restores[r]})
    total = s.num_bytes
    fds = {f: os.open(sdir / f, os.O_RDONLY | os.O_DIRECT) for f in files}
    paths = {f: sdir / f for f in files}
    sizes = [s.restore_bytes(r) for r in rids]
    max_bytes = max(sizes)

    def dd_arm() -> float:
        return sum(dd_seconds(sdir / f, a.chunk_bytes) for f in files)

    host = HostRoute(max_bytes, a.depth, a.workers)
    arrays = [host.chunk_array(s.restores[r], fds, paths) for r in rids]
    route_seconds(host, arrays[:1], sizes[:1], False)  # warm-up
    dd_arm()
    res: dict[str, list[float]] = {"dd": [], "host": []}
    for _ in range(a.rounds):
        for arm in ("dd", "host", "host", "dd"):
            res[arm].append(dd_arm() if arm == "dd" else route_seconds(host, arrays, sizes, False))
    verify_last(host, s, rids[-1])
    own = host.close()
    assert own.drained, own
    gb = total / 1e9
    out = {"bytes": total, "files": len(files), "chunk_bytes": a.chunk_bytes, "depth": a.depth, "workers": a.workers,
           "rounds": a.rounds, "dd_GBps": gb / statistics.median(res["dd"]),
           "host_GBps": gb / statistics.median(res["host"])}
    out["ratio_host_to_dd"] = out["host_GBps"] / out["dd_GBps"]
    print(f"{total / 2**20:.0f} MiB in {len(files)} files, chunk {a.chunk_bytes} B, depth {a.depth}, "
          f"workers {a.workers}, {a.rounds} A B B A rounds (medians)")
    print(f"  dd iflag=direct bs={a.chunk_bytes}: {out['dd_GBps']:.3f} GB/s")
    print(f"  host route (timer 1):      {out['host_GBps']:.3f} GB/s")
    print(f"  ratio host/dd:             {out['ratio_host_to_dd']:.3f} (goal >= 0.9)")

    if a.gpu:
        fixed = HostFixedRoute(max_bytes, a.depth, a.workers)
        route_seconds(fixed, arrays[:1], sizes[:1], True)
        t_fixed, t_dd = [], []
        for _ in range(a.rounds):
            for arm in ("dd", "fixed", "fixed", "dd"):
                if arm == "dd":
                    t_dd.append(dd_arm())
                else:
                    t_fixed.append(route_seconds(fixed, arrays, sizes, True))
        verify_last(fixed, s, rids[-1])
        own = fixed.close()
        assert own.drained, own
        copy_s, cons_s = h2d_and_consumer_seconds(max_bytes, 20)
        n = len(rids)
        base = statistics.median(t_dd) + n * (copy_s + cons_s)
        out.update({"host_fixed_s": statistics.median(t_fixed), "dd_s": statistics.median(t_dd),
                    "h2d_copy_ms_per_restore": copy_s * 1e3, "consumer_ms_per_restore": cons_s * 1e3,
                    "baseline_s": base, "ratio_baseline_to_host_fixed": base / statistics.median(t_fixed)})
        print(f"  host_fixed (timer 2, {n} restores): {out['host_fixed_s'] * 1e3:.1f} ms")
        print(f"  alone: dd {out['dd_s'] * 1e3:.1f} ms + pinned H2D {copy_s * 1e3:.3f} ms/restore "
              f"+ consumer {cons_s * 1e3:.3f} ms/restore = {base * 1e3:.1f} ms")
        print(f"  ratio (alone sum)/host_fixed: {out['ratio_baseline_to_host_fixed']:.3f} (>1: the overlap pays)")
    for fd in fds.values():
        os.close(fd)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
