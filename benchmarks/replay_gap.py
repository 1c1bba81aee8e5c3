"""Benchmark: where the `host` route loses to fio (io_uring, O_DIRECT, registered buffers), in one run.

Each round A B C D D C B A over the same store and the same fio baseline as replay_bench.py:
  - fio: `--fixedbufs`, block size = the route's chunk, `--iodepth` = the route's depth, one job per worker;
  - host: the route as shipped (its arena advised MADV_HUGEPAGE, see HostArena);
  - host_4k: the same route on plain 4 KiB pages (what the route was before the advice);
  - host_stream: every restore's chunks in one call (one restore of all of them): the engine's steady
    state, as fio's is; the gap between it and `host` is what a restore's own start and drain cost.
From `host`'s per-chunk samples also: time to the first completion and from the last submission to the
last completion (the drain), medians over restores. Prints the host block device's queue limits and the
kernel's THP setting, which decide how many block requests one read becomes. Timing lives here.

    python benchmarks/replay_gap.py --dir /var/tmp/kmesh-bench [--depth 8] [--workers 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_bench import fio_seconds, route_seconds, verify_last  # noqa: E402

from kmesh_trace.native import store as st  # noqa: E402
from kmesh_trace.native.routes import HostRoute  # noqa: E402


class PlainPagesRoute(HostRoute):
    """`host` on plain 4 KiB pages."""

    huge_pages = False


def host_facts(path: Path) -> dict:
    """THP setting and the queue limits of the block device under `path` (best effort)."""
    facts = {"thp": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()}
    dev = os.stat(path).st_dev
    q = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    q = q / "queue" if (q / "queue").exists() else q.resolve().parent / "queue"
    for f in ("max_segments", "max_sectors_kb", "max_segment_size", "nr_requests", "scheduler", "rotational"):
        try:
            facts[f] = (q / f).read_text().strip()
        except OSError:
            facts[f] = "?"
    return facts


def timeline(route: HostRoute, arrays: list[np.ndarray]) -> dict:
    """Median ms to the first completion and of the drain (last submission to last completion)."""
    first, drain, total = [], [], []
    for arr in arrays:
        r = route.restore(arr)
        s = r.samples
        first.append((s["complete_ns"].min() - s["submit_ns"].min()) / 1e6)
        drain.append((s["complete_ns"].max() - s["submit_ns"].max()) / 1e6)
        total.append((r.io_done_ns - r.start_ns) / 1e6)
    return {"first_completion_ms": statistics.median(first), "drain_ms": statistics.median(drain),
            "restore_ms": statistics.median(total)}


def report(out: dict) -> None:
    print(f"depth {out['depth']}, workers {out['workers']}, {out['bytes'] / 2**20:.0f} MiB, "
          f"chunk {out['chunk_bytes']} B; {out['host_facts']}")
    for n, g in out["GBps"].items():
        print(f"  {n:12s} {g:6.3f} GB/s  {out['ratio_to_fio'][n]:.3f}x fio")
    for n, t in out["timeline"].items():
        print(f"  {n:12s} restore {t['restore_ms']:.2f} ms, first completion {t['first_completion_ms']:.2f} ms, "
              f"drain {t['drain_ms']:.2f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--restores", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--fio", default="fio")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    cb = st.DEFAULT_CHUNK_BYTES
    sdir = a.dir / f"store-{a.restores}x{st.DEFAULT_NUM_CHUNKS}x{cb}"
    s = st.open_store(sdir) if (sdir / st.JOURNAL).exists() else st.prepare(
        sdir, st.plan_uniform(a.restores, st.DEFAULT_NUM_CHUNKS, cb))
    rids = sorted(s.restores)
    files = sorted({c.file for r in rids for c in s.restores[r]})
    fds = {f: os.open(sdir / f, os.O_RDONLY | os.O_DIRECT) for f in files}
    paths = {f: sdir / f for f in files}
    sizes = [s.restore_bytes(r) for r in rids]
    routes = {"host": HostRoute(max(sizes), a.depth, a.workers),
              "host_4k": PlainPagesRoute(max(sizes), a.depth, a.workers),
              "host_stream": HostRoute(sum(sizes), a.depth, a.workers)}
    arrays = [routes["host"].chunk_array(s.restores[r], fds, paths) for r in rids]
    stream = [routes["host_stream"].chunk_array([c for r in rids for c in s.restores[r]], fds, paths)]
    work = {"host": (arrays, sizes), "host_4k": (arrays, sizes), "host_stream": (stream, [sum(sizes)])}

    def fio() -> float:
        return fio_seconds(a.fio, [sdir / f for f in files], cb, a.depth, a.workers)

    def arm(name: str) -> float:
        return fio() if name == "fio" else route_seconds(routes[name], *work[name], False)

    for name in ("fio", *routes):
        arm(name)  # warm-up
    res: dict[str, list[float]] = {n: [] for n in ("fio", *routes)}
    order = ["fio", "host", "host_4k", "host_stream"]
    for _ in range(a.rounds):
        for name in order + order[::-1]:
            res[name].append(arm(name))
    tl = {n: timeline(routes[n], arrays) for n in ("host", "host_4k")}
    verify_last(routes["host"], s, rids[-1])
    verify_last(routes["host_4k"], s, rids[-1])
    huge = {n: r.host.huge for n, r in routes.items()}
    for r in routes.values():
        assert r.close().drained
    for fd in fds.values():
        os.close(fd)
    gb = s.num_bytes / 1e9
    out = {"depth": a.depth, "workers": a.workers, "chunk_bytes": cb, "bytes": s.num_bytes, "rounds": a.rounds,
           "host_facts": host_facts(sdir / files[0]), "huge_advised": huge, "timeline": tl, "samples_s": res,
           "GBps": {n: gb / statistics.median(v) for n, v in res.items()}}
    out["ratio_to_fio"] = {n: g / out["GBps"]["fio"] for n, g in out["GBps"].items()}
    report(out)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
