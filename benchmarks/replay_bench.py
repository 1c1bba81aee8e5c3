"""Benchmark: the native `host` route against fio reading the same files the same way.

In one run, each round A B C D D C B A: fio (`--ioengine=io_uring --direct=1 --fixedbufs`: sequential
reads of every payload file into registered buffers, as the route reads; block size = the route's chunk
size, `--iodepth` = the route's depth, one job per route worker; fio's own run time, so process start-up
is not charged to it) against the `host` route restoring the same restores (timer 1: first submission
to last completion). The headline is host/fio (goal >= 0.9). Beside it, two readers that each lack one
thing the route has: fio without `--fixedbufs` (the kernel pins every buffer per read) and
`dd iflag=direct` (one read in flight). fio is timed in its steady state (after a ramp, over a fixed
run time, reading the files in order again and again), as the route is (its buffers registered once,
before timing). With --gpu, also the `host_fixed` restore (timer 2: to the
fenced GPU consumer) against the same bytes read by fio plus a pinned host-to-device copy and the
consumer, each measured alone. Needs fio (`apt-get install -y fio`, or --fio PATH). Timing lives
here, never in tests.

    python benchmarks/replay_bench.py --dir /var/tmp/kmesh-bench [--restores 8] [--rounds 3] [--gpu]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
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


FIO_RAMP_S = 0.3  # excluded: fio's start (allocating and registering its buffers, opening files)
FIO_RUN_S = 1.0  # measured: fio reads the files over and over, in order, for this long


def fio_seconds(fio: str, paths: list[Path], bs: int, depth: int, jobs: int, fixedbufs: bool = True) -> float:
    """Seconds fio needs, in its steady state, to read every file in `paths` once: `depth` reads of `bs`
    in flight per job, O_DIRECT through io_uring (the route's engine, block size and depth), into
    registered buffers unless `fixedbufs` is false. fio reads the files in order, again and again, for
    FIO_RUN_S after a FIO_RAMP_S ramp (its start-up is not charged, as the route's set-up is not)."""
    size = sum(p.stat().st_size for p in paths)
    cmd = [fio, "--name=baseline", "--rw=read", "--ioengine=io_uring", "--direct=1", f"--bs={bs}",
           f"--iodepth={depth}", f"--numjobs={jobs}", "--group_reporting", "--file_service_type=sequential",
           f"--size={size // jobs}", "--thread", "--time_based", f"--ramp_time={FIO_RAMP_S}s",
           f"--runtime={FIO_RUN_S}s", "--output-format=json", *(["--fixedbufs"] if fixedbufs else []),
           "--filename=" + ":".join(str(p).replace(":", "\\:") for p in paths)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"fio failed ({p.returncode}): {p.stderr.strip()[-500:]}")
    read = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]["read"]
    if read["io_bytes"] < size:
        raise RuntimeError(f"fio read only {read['io_bytes']} bytes in {FIO_RUN_S} s, less than the files' {size}")
    return size / read["bw_bytes"]


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
    ap.add_argument("--gpu", action="store_true", help="Also host_fixed against fio + pinned copy + consumer.")
    ap.add_argument("--fio", default="fio", help="The fio binary (default: fio on PATH).")
    ap.add_argument("--json", type=Path, help="Also write the figures to this file.")
    a = ap.parse_args()
    if shutil.which(a.fio) is None:
        print(f"Error: fio not found ({a.fio}); install it (apt-get install -y fio) or pass --fio PATH.", file=sys.stderr)
        return 1

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

    def fio_arm(fixedbufs: bool = True) -> float:
        return fio_seconds(a.fio, [sdir / f for f in files], a.chunk_bytes, a.depth, a.workers, fixedbufs)

    arms = {"fio": fio_arm, "fio_plain": lambda: fio_arm(False), "dd": dd_arm}

    host = HostRoute(max_bytes, a.depth, a.workers)
    arrays = [host.chunk_array(s.restores[r], fds, paths) for r in rids]
    route_seconds(host, arrays[:1], sizes[:1], False)  # warm-up
    fio_arm()
    dd_arm()
    res: dict[str, list[float]] = {"fio": [], "fio_plain": [], "dd": [], "host": []}
    for _ in range(a.rounds):
        for arm in ("fio", "host", "fio_plain", "dd", "dd", "fio_plain", "host", "fio"):
            res[arm].append(arms[arm]() if arm in arms else route_seconds(host, arrays, sizes, False))
    verify_last(host, s, rids[-1])
    own = host.close()
    assert own.drained, own
    gb = total / 1e9
    out = {"bytes": total, "files": len(files), "chunk_bytes": a.chunk_bytes, "depth": a.depth, "workers": a.workers,
           "rounds": a.rounds, "fio_GBps": gb / statistics.median(res["fio"]),
           "fio_plain_GBps": gb / statistics.median(res["fio_plain"]), "dd_GBps": gb / statistics.median(res["dd"]),
           "host_GBps": gb / statistics.median(res["host"]),
           "samples_s": res}
    out["ratio_host_to_fio"] = out["host_GBps"] / out["fio_GBps"]
    out["ratio_host_to_fio_plain"] = out["host_GBps"] / out["fio_plain_GBps"]
    out["ratio_host_to_dd"] = out["host_GBps"] / out["dd_GBps"]
    print(f"{total / 2**20:.0f} MiB in {len(files)} files, chunk {a.chunk_bytes} B, depth {a.depth}, "
          f"workers {a.workers}, {a.rounds} rounds of A B C D D C B A (medians)")
    print(f"  fio io_uring direct fixedbufs, iodepth {a.depth}, {a.workers} job(s): {out['fio_GBps']:.3f} GB/s")
    print(f"  host route (timer 1):                    {out['host_GBps']:.3f} GB/s")
    print(f"  fio without fixedbufs:                   {out['fio_plain_GBps']:.3f} GB/s")
    print(f"  dd iflag=direct (1 read in flight):      {out['dd_GBps']:.3f} GB/s")
    print(f"  ratio host/fio: {out['ratio_host_to_fio']:.3f} (goal >= 0.9); beside it host/fio-plain "
          f"{out['ratio_host_to_fio_plain']:.3f}, host/dd {out['ratio_host_to_dd']:.3f}")

    if a.gpu:
        fixed = HostFixedRoute(max_bytes, a.depth, a.workers)
        route_seconds(fixed, arrays[:1], sizes[:1], True)
        t_fixed, t_fio = [], []
        for _ in range(a.rounds):
            for arm in ("fio", "fixed", "fixed", "fio"):
                if arm == "fio":
                    t_fio.append(fio_arm())
                else:
                    t_fixed.append(route_seconds(fixed, arrays, sizes, True))
        verify_last(fixed, s, rids[-1])
        own = fixed.close()
        assert own.drained, own
        copy_s, cons_s = h2d_and_consumer_seconds(max_bytes, 20)
        n = len(rids)
        base = statistics.median(t_fio) + n * (copy_s + cons_s)
        out.update({"host_fixed_s": statistics.median(t_fixed), "fio_s": statistics.median(t_fio),
                    "h2d_copy_ms_per_restore": copy_s * 1e3, "consumer_ms_per_restore": cons_s * 1e3,
                    "baseline_s": base, "ratio_baseline_to_host_fixed": base / statistics.median(t_fixed)})
        print(f"  host_fixed (timer 2, {n} restores): {out['host_fixed_s'] * 1e3:.1f} ms")
        print(f"  alone: fio {out['fio_s'] * 1e3:.1f} ms + pinned H2D {copy_s * 1e3:.3f} ms/restore "
              f"+ consumer {cons_s * 1e3:.3f} ms/restore = {base * 1e3:.1f} ms")
        print(f"  ratio (alone sum)/host_fixed: {out['ratio_baseline_to_host_fixed']:.3f} (>1: the overlap pays)")
    for fd in fds.values():
        os.close(fd)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
