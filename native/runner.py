"""The replay protocol: alternate routes in pairs, time restores, verify every byte, keep every sample.

For each restore: poison the destination, submit every chunk, wait for completion (timer 1), run the
GPU consumer (timer 2, GPU routes), then, outside timing, compare every byte against the reference
generator and the SHA-256 the journal recorded. Routes alternate in pairs (A B, then B A, ...), each
arm starting with warm-ups that are recorded but excluded from statistics. `corrupt` payloads are
flipped copies of journal chunks, restored after the measured pairs: each must be rejected, exactly.
This module owns the schedule, verification, statistics and the results directory (two Parquet tables
and summary.json); rendering lives in kmesh_trace.cli.replay.
"""

from __future__ import annotations

import errno
import hashlib
import os
import platform
import shutil
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.native.gpu import RouteUnavailable
from kmesh_trace.native.routes import ROUTES, Route, make_route, probe_route
from kmesh_trace.native.store import Chunk, Store, open_store, payload
from kmesh_trace.writer import atomic_output, write_json_atomic

_REFERENCE_CACHE_BYTES = 1 << 30
#: Every timed restore and every read keeps a sample row in memory until the results are written, so
#: one run is bounded; more samples than this are several runs.
MAX_TIMED_RESTORES = 100_000
MAX_READ_SAMPLES = 2_000_000
MAX_SEED = (1 << 64) - 1


@dataclass
class RunConfig:
    routes: list[str] = field(default_factory=lambda: ["host"])
    pairs: int = 4
    restores: int = 100  # measured restores per route, spread over the pairs
    warmup: int = 5  # per route, at the start of each of its arms
    corrupt: int = 0
    depth: int = 8
    workers: int = 1
    seed: int = 0  # picks the corrupted chunks

    def check(self) -> None:
        bad = [r for r in self.routes if r not in ROUTES]
        if bad or not self.routes:
            raise KmeshTraceError(f"unknown route(s) {', '.join(bad) or '(none)'}; choose from {', '.join(ROUTES)}")
        if len(set(self.routes)) != len(self.routes):
            raise KmeshTraceError("a route is listed twice in --routes; list each once")
        if self.pairs < 1 or self.restores < self.pairs or self.warmup < 0 or self.corrupt < 0:
            raise KmeshTraceError("--pairs must be >= 1, --restores >= --pairs, --warmup and --corrupt >= 0")
        if not 1 <= self.depth <= 4096 or not 1 <= self.workers <= 64:
            raise KmeshTraceError("--depth must be in 1..4096 and --workers in 1..64")
        if not 0 <= self.seed <= MAX_SEED:
            raise KmeshTraceError(f"--seed must be in 0..{MAX_SEED} (got {self.seed})")
        if self.num_timed_restores() > MAX_TIMED_RESTORES:
            raise KmeshTraceError(
                f"--restores, --warmup and --corrupt ask for {self.num_timed_restores():,} timed restores; one run keeps "
                f"at most {MAX_TIMED_RESTORES:,} samples in memory: split the work into several runs")

    def num_timed_restores(self, num_corrupt: int | None = None) -> int:
        """Restores the run will time: measured, warm-ups (each arm) and corruption checks, over all routes."""
        corrupt = self.corrupt if num_corrupt is None else num_corrupt
        return len(self.routes) * (self.restores + self.pairs * self.warmup + corrupt)


def _percentiles(v: list[int]) -> dict:
    if not v:
        return {"p50_ms": None, "p95_ms": None}
    a = np.asarray(v, dtype=np.float64) / 1e6
    return {"p50_ms": float(np.percentile(a, 50)), "p95_ms": float(np.percentile(a, 95))}


class _Reference:
    """Expected bytes of each chunk, from the generator (cached while the store is small)."""

    def __init__(self, store: Store):
        self.store = store
        self.cache: dict[tuple[int, int], np.ndarray] | None = {} if store.num_bytes <= _REFERENCE_CACHE_BYTES else None

    def get(self, c: Chunk) -> np.ndarray:
        key = (c.restore_id, c.chunk_index)
        if self.cache is not None and key in self.cache:
            return self.cache[key]
        a = np.frombuffer(payload(self.store.seed, c.restore_id, c.chunk_index, c.size_bytes), dtype=np.uint8)
        if self.cache is not None:
            self.cache[key] = a
        return a


class _Files:
    """O_DIRECT descriptors of the payload files, and flipped copies for the corruption checks."""

    def __init__(self, store: Store):
        self.store = store
        self.paths = {f: store.path / f for f in {c.file for cs in store.restores.values() for c in cs}}
        self.fds = {}
        self.tmp: Path | None = None
        try:
            for f, p in self.paths.items():
                self.fds[f] = os.open(p, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            self.close()
            raise _open_error(e) from e

    def corrupted(self, c: Chunk) -> tuple[dict[str, int], dict[str, Path], int]:
        """fds/paths where c's file is a copy with one byte flipped inside c; and the flipped file offset."""
        if self.tmp is None:
            self.tmp = self.store.path / f".corrupt-{os.getpid()}"
            self.tmp.mkdir(exist_ok=True)
        dst = self.tmp / f"{c.restore_id}-{c.chunk_index}.bin"
        shutil.copyfile(self.paths[c.file], dst)
        flip_at = c.offset_bytes + c.size_bytes // 2 + 7
        with open(dst, "r+b") as f:
            f.seek(flip_at)
            b = f.read(1)
            f.seek(flip_at)
            f.write(bytes([b[0] ^ 0xFF]))
            f.flush()
            os.fsync(f.fileno())
        fds, paths = dict(self.fds), dict(self.paths)
        fds[c.file] = os.open(dst, os.O_RDONLY | os.O_DIRECT)
        paths[c.file] = dst
        return fds, paths, flip_at

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _open_error(e: OSError) -> KmeshTraceError:
    """Name the actual cause: only EINVAL means the filesystem refuses O_DIRECT."""
    if e.errno == errno.EINVAL:
        return KmeshTraceError(f"cannot open {e.filename} with O_DIRECT ({e.strerror}); keep the store on ext4 "
                               f"or xfs, not a filesystem without O_DIRECT")
    if e.errno == errno.ENOENT:
        return KmeshTraceError(f"payload file {e.filename} is missing (it was there when the store was opened); "
                               f"re-create the store with `replay prepare`")
    return KmeshTraceError(f"cannot open payload file {e.filename} ({e.strerror}); check its permissions")


@dataclass
class RunResult:
    summary: dict
    restores: pa.Table
    reads: pa.Table
    out: Path | None = None


def host_description() -> dict:
    d = {"host": socket.gethostname(), "kernel": platform.release(), "machine": platform.machine(),
         "cpus": os.cpu_count(), "python": platform.python_version(),
         "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import torch

        if torch.cuda.is_available():
            d["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return d


def _verify(chunks: list[Chunk], data: np.ndarray, starts: np.ndarray, ref: _Reference) -> list[tuple[bool, bool]]:
    """(every byte equal to the reference, SHA-256 equal to the journal's) for each chunk of a restore."""
    out = []
    for i, c in enumerate(chunks):
        got = data[starts[i]: starts[i + 1]]
        out.append((bool(np.array_equal(got, ref.get(c))), hashlib.sha256(got).hexdigest() == c.sha256))
    return out


def schedule(cfg: RunConfig) -> Iterator[tuple[int, int, str, str]]:
    """(pair, position, route, kind) of every timed restore, planned as it is consumed: A B, then B A, ...;
    each arm opens with warm-ups."""
    for p in range(cfg.pairs):
        per_pair = cfg.restores // cfg.pairs + (1 if p < cfg.restores % cfg.pairs else 0)
        order = cfg.routes if p % 2 == 0 else cfg.routes[::-1]
        for pos, name in enumerate(order):
            for k in range(cfg.warmup + per_pair):
                yield p, pos, name, "warmup" if k < cfg.warmup else "measured"


def open_run(store_path: Path, cfg: RunConfig) -> Store:
    """The store of a run, after every check that needs no device: the options, the journal (read and
    validated), and the samples the run would keep in memory."""
    cfg.check()
    store = open_store(store_path)
    total = cfg.num_timed_restores()
    max_chunks = max(len(cs) for cs in store.restores.values())
    if total * max_chunks > MAX_READ_SAMPLES:
        raise KmeshTraceError(
            f"{total:,} timed restores of up to {max_chunks} chunks would keep {total * max_chunks:,} read samples in "
            f"memory; one run keeps at most {MAX_READ_SAMPLES:,}: lower --restores or split the work into several runs")
    return store


def run(store_path: Path, cfg: RunConfig, on_progress: Callable[[int, int], None] | None = None,
        out: Path | None = None) -> RunResult:
    store = open_run(store_path, cfg)
    for name in cfg.routes:
        p = probe_route(name, store.path)
        if not p.ok:
            raise RouteUnavailable(f"route {name} is unavailable here ({p.reason}); see `kmesh-trace replay probe`")
    chunks_all = [c for rid in sorted(store.restores) for c in store.restores[rid]]
    if cfg.corrupt > len(chunks_all):
        raise KmeshTraceError(f"--corrupt {cfg.corrupt} exceeds the store's {len(chunks_all)} chunks; lower it")
    picks = np.random.default_rng(cfg.seed).choice(len(chunks_all), cfg.corrupt, replace=False)
    corrupt = [chunks_all[i] for i in sorted(picks)]
    rids = sorted(store.restores)
    total = cfg.num_timed_restores()
    max_bytes = max(store.restore_bytes(r) for r in rids)

    ref = _Reference(store)
    files = _Files(store)
    routes: dict[str, Route] = {}
    rows: list[dict] = []
    reads: list[dict] = []
    arrays: dict[tuple[str, int], np.ndarray] = {}
    counters = {name: 0 for name in cfg.routes}
    ownership = {}
    modes: dict[str, str | None] = {}  # a route that runs in one of several modes (cufile: gds or compat)
    state = {"seq": 0}

    def one(route: Route, rid: int, kind: str, pair: int | None, position: int | None,
            fds=None, paths=None, flipped: Chunk | None = None) -> None:
        chunks = store.restores[rid]
        if fds is None:
            key = (route.name, rid)
            if key not in arrays:
                arrays[key] = route.chunk_array(chunks, files.fds, files.paths)
            arr = arrays[key]
        else:
            arr = route.chunk_array(chunks, fds, paths)
        n = int(sum(c.size_bytes for c in chunks))
        route.poison(n)
        r = route.restore(arr)
        # ---- outside timing: every byte, every digest
        data = route.fetch(n)
        starts = np.cumsum([0] + [c.size_bytes for c in chunks])
        chunk_ok = _verify(chunks, data, starts, ref)
        bad = [c.chunk_key for c, ok in zip(chunks, chunk_ok) if not all(ok)]
        owner = np.searchsorted(starts, arr["buf_offset"], side="right") - 1  # reads may split chunks
        io_errors = 0
        for j, s in enumerate(r.samples):
            ci = int(owner[j])
            expect = int(arr["size"][j])
            io_errors += int(s["result"] != expect) + int(s["copy_result"] != 0)
            reads.append({"seq": state["seq"], "route": route.name, "chunk_key": chunks[ci].chunk_key,
                          "read_index": j, "num_bytes": expect, "submit_ns": int(s["submit_ns"]),
                          "complete_ns": int(s["complete_ns"]), "result": int(s["result"]), "worker": int(s["worker"]),
                          "num_sqes": int(s["num_sqes"]), "copy_result": int(s["copy_result"]),
                          "bytes_ok": chunk_ok[ci][0], "sha256_ok": chunk_ok[ci][1]})
        consumer_ok = None
        if r.consumer_sum is not None:
            consumer_ok = r.consumer_sum == int(data.sum(dtype=np.uint64))
        rows.append({"seq": state["seq"], "route": route.name, "kind": kind, "pair": pair, "position": position,
                     "restore_id": rid, "num_chunks": len(chunks), "num_bytes": n, "start_ns": r.start_ns,
                     "io_done_ns": r.io_done_ns, "consumer_done_ns": r.consumer_done_ns,
                     "timer1_ns": r.io_done_ns - r.start_ns,
                     "timer2_ns": None if r.consumer_done_ns is None else r.consumer_done_ns - r.start_ns,
                     "accepted": not bad and io_errors == 0, "num_bad_chunks": len(bad), "bad_chunks": bad,
                     "io_errors": io_errors, "consumer_ok": consumer_ok,
                     "corrupted_chunk": flipped.chunk_key if flipped else None})
        state["seq"] += 1
        if on_progress:
            on_progress(state["seq"], total)

    try:
        for name in cfg.routes:
            routes[name] = make_route(name, max_bytes, cfg.depth, cfg.workers, store.path)
        for pair, pos, name, kind in schedule(cfg):
            rid = rids[counters[name] % len(rids)]  # every route sees the same sequence of restores
            counters[name] += 1
            one(routes[name], rid, kind, pair, pos)
        for name in cfg.routes:
            for c in corrupt:
                fds, paths, _ = files.corrupted(c)
                try:
                    one(routes[name], c.restore_id, "corrupt", None, None, fds, paths, c)
                finally:
                    routes[name].forget(fds[c.file])  # the next copy's descriptor may get the same number
                    os.close(fds[c.file])
    finally:
        for name, route in routes.items():
            own = route.close()
            ownership[name] = {**asdict(own), "drained": own.drained}
            modes[name] = getattr(route, "mode", None)
        files.close()

    result = RunResult(_summary(store, cfg, rows, ownership, corrupt, modes), _table(rows), _table(reads))
    if out is not None:
        write_results(result, out)
    return result


def _table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows) if rows else pa.table({})


def _summary(store: Store, cfg: RunConfig, rows: list[dict], ownership: dict, corrupt: list[Chunk],
             modes: dict[str, str | None] | None = None) -> dict:
    per_route, per_pair = {}, []
    for name in cfg.routes:
        mine = [r for r in rows if r["route"] == name]
        ok = [r for r in mine if r["kind"] == "measured" and r["accepted"]]
        t1 = [r["timer1_ns"] for r in ok]
        t2 = [r["timer2_ns"] for r in ok if r["timer2_ns"] is not None]
        s1, s2 = _percentiles(t1), _percentiles(t2)
        nbytes = [r["num_bytes"] for r in ok]
        gbps = float(np.median(np.asarray(nbytes) / np.asarray(t1))) if t1 else None
        per_route[name] = {
            "num_measured": len(ok), "num_warmup": sum(r["kind"] == "warmup" for r in mine),
            "timer1": s1, "timer2": s2 if t2 else None, "p50_gbps_timer1": gbps,
            "bytes_moved": int(sum(r["num_bytes"] for r in mine)),
            "num_rejected": sum(not r["accepted"] for r in mine),
            "num_rejected_measured": sum(not r["accepted"] for r in mine if r["kind"] != "corrupt"),
            "consumer_mismatches": sum(r["consumer_ok"] is False for r in mine),
            "ownership": ownership.get(name),
        }
        if (modes or {}).get(name):
            per_route[name]["mode"] = modes[name]
        for p in range(cfg.pairs):
            pr = [r for r in ok if r["pair"] == p]
            per_pair.append({"pair": p, "route": name, "position": pr[0]["position"] if pr else None,
                             "num_measured": len(pr), "timer1": _percentiles([r["timer1_ns"] for r in pr]),
                             "timer2": _percentiles([r["timer2_ns"] for r in pr if r["timer2_ns"] is not None])})
    checks = [r for r in rows if r["kind"] == "corrupt"]
    missed = [r["corrupted_chunk"] for r in checks if r["bad_chunks"] != [r["corrupted_chunk"]]]
    unexpected = [{"seq": r["seq"], "route": r["route"], "bad_chunks": r["bad_chunks"], "io_errors": r["io_errors"]}
                  for r in rows if r["kind"] != "corrupt" and not r["accepted"]]
    first = cfg.routes[0]
    base = per_route[first]["timer1"]["p50_ms"]
    for name in cfg.routes:
        p50 = per_route[name]["timer1"]["p50_ms"]
        per_route[name]["timer1_p50_ratio_to_" + first] = p50 / base if p50 and base else None
    # A route whose ownership is not measured (drained None) is listed as such, neither proof nor
    # failure; with no route measured at all there is no proof either way (None).
    measured = [o["drained"] for o in ownership.values() if o is not None and o["drained"] is not None]
    drained = all(measured) if measured else None
    not_measured = [n for n, o in ownership.items() if o is not None and o["drained"] is None]
    consumer_bad = sum(v["consumer_mismatches"] for v in per_route.values())
    return {
        "store": str(store.path), "host": host_description(), "config": asdict(cfg),
        "store_bytes": store.num_bytes, "num_store_restores": len(store.restores),
        "routes": per_route, "pairs": per_pair,
        "corrupted_chunks": [c.chunk_key for c in corrupt],
        "corruptions_rejected": len(checks) - len(missed), "corruption_checks": len(checks),
        "missed_corruptions": missed, "unexpected_rejections": unexpected,
        "all_buffers_returned": drained, "ownership_not_measured": not_measured,
        "ok": not missed and not unexpected and drained is not False and consumer_bad == 0,
    }


def write_results(result: RunResult, out: Path) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result.summary["results"] = str(out)
    for name, table in (("restores.parquet", result.restores), ("reads.parquet", result.reads)):
        with atomic_output(out / name) as tmp:
            pq.write_table(table, tmp)
    write_json_atomic(out / "summary.json", result.summary)
    result.out = out
