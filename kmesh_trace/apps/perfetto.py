"""Perfetto / chrome://tracing export: a trace directory as Chrome trace-event JSON, plus its validator.

Owns the mapping from the contract's tables to trace events. Each engine partition becomes one
"KV pool" process (counters for free and held blocks, instant events for evictions and prefix-cache
clears, transfer slices on non-overlapping lanes) and one process per request family ("unrelated"
for requests without one), holding one thread per request with up to three sequential slices:
queued (arrival..first scheduled), prefill (first scheduled..first token) and decode (first
token..finish). Each lineage edge whose two requests were drawn is a flow arrow from the end of the
parent's last slice to the start of the child's first (parent's finish -> child's arrival, when both
are known). Timestamps are microseconds (floats, nanosecond precision kept) relative to the
earliest time in the trace. A slice whose ends are unknown or out of order is skipped and counted,
never invented. `validate_trace_events` checks a file against the trace-event format, so tests and
users can tell a broken export from a strange trace.
"""

from __future__ import annotations

import gzip
import heapq
import json
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import polars as pl

from kmesh_trace import schema
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.trace import Trace

#: Request phases in the order they happen: (slice name, start column, end column).
PHASES: tuple[tuple[str, str, str], ...] = (
    ("queued", "arrival_ns", "first_scheduled_ns"),
    ("prefill", "first_scheduled_ns", "first_token_ns"),
    ("decode", "first_token_ns", "finish_ns"),
)
UNRELATED = "unrelated"
# Perfetto names a counter track "<event name> <args key>" ("free blocks"); chrome://tracing shows
# the event name with one series per args key.
FREE_COUNTER = "free"
HELD_COUNTER = "held"
CATEGORY = "kmesh"
_CHUNK_EVENTS = 8192  # events encoded per write: bounded memory, few system calls

_INVOCATION_COLUMNS = ["engine", *schema.INVOCATIONS.select(
    "request_id", "seq", "family_id", "parent_id", "num_prompt_tokens", "num_output_tokens", "num_cached_tokens",
    "num_external_tokens", "num_preemptions", "status", *sorted({c for _, s, e in PHASES for c in (s, e)}))]
_REQUEST_ARGS = schema.INVOCATIONS.select("request_id", "family_id", "parent_id", "status", "num_prompt_tokens", "num_cached_tokens",
                 "num_external_tokens", "num_output_tokens", "num_preemptions")
_TRANSFER_ARGS = schema.TRANSFERS.select("request_id", "num_tokens", "num_blocks", "num_bytes", "status", "connector")
_TIME_COLUMNS = {t.name: t.time_columns for t in schema.TABLES.values() if t.time_columns}
_HOLD_EVENTS = schema.values("block_events", "event", "held", "released")
_MARK_EVENTS = schema.values("block_events", "event", "evicted", "cleared")


class _Clock:
    """Maps each engine's monotonic nanoseconds onto one relative microsecond axis.

    Several live engines may run on different hosts, whose monotonic clocks do not agree; their
    wall-clock anchors do, so captured partitions are shifted by (wall - mono) when there are
    several. Imported partitions keep their times as given: their anchors are the import's clock,
    not the source's.
    """

    def __init__(self, trace: Trace, engines: list[str]):
        self.offset: dict[str, int] = {e: 0 for e in engines}
        self.aligned = False
        if len(engines) > 1:
            metas = [trace.engines.get(e, {}) for e in engines]
            if all(m.get("source") == "capture" and m.get("wall_anchor_ns") is not None
                   and m.get("mono_anchor_ns") is not None for m in metas):
                self.offset = {e: int(m["wall_anchor_ns"]) - int(m["mono_anchor_ns"]) for e, m in zip(engines, metas)}
                self.aligned = True
        self.t0 = 0

    def us(self, engine: str, ns: int) -> float:
        # Integer nanoseconds first, one division last: keeps ns precision and makes equal
        # instants map to identical floats, so back-to-back slices never overlap by rounding.
        return (ns + self.offset[engine] - self.t0) / 1000


def _engine_col(lf: pl.LazyFrame) -> pl.LazyFrame:
    # Hive partitioning may read an engine id like "0" as an integer.
    return lf.with_columns(pl.col("engine").cast(pl.Utf8))


def _engines(trace: Trace) -> list[str]:
    seen = set(trace.engines)
    for name in _TIME_COLUMNS:
        seen |= set(_engine_col(trace.scan(name)).select("engine").unique().collect()["engine"].to_list())
    return sorted(seen)


def _earliest_ns(trace: Trace, clock: _Clock) -> int | None:
    best = None
    for name, cols in _TIME_COLUMNS.items():
        mins = (_engine_col(trace.scan(name)).group_by("engine")
                .agg(pl.min_horizontal([pl.col(c).min() for c in cols]).alias("t")).collect())
        for engine, t in mins.iter_rows():
            if t is not None:
                t = int(t) + clock.offset[engine]
                best = t if best is None else min(best, t)
    return best


def _meta(ph_name: str, pid: int, tid: int | None, args: dict) -> dict:
    ev = {"name": ph_name, "ph": "M", "pid": pid, "args": args}
    if tid is not None:
        ev["tid"] = tid
    return ev


def _lanes(intervals: list[tuple[int, int]]) -> list[int]:
    """The lane of each (start, end), input sorted by start: no two intervals of a lane overlap, and
    each takes the lowest free lane, so the fewest lanes are used (greedy interval partitioning)."""
    busy: list[tuple[int, int]] = []  # (end, lane)
    free: list[int] = []
    out = []
    for start, end in intervals:
        while busy and busy[0][0] <= start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        lane = heapq.heappop(free) if free else len(busy) + len(free)
        heapq.heappush(busy, (end, lane))
        out.append(lane)
    return out


class _Builder:
    def __init__(self, trace: Trace):
        self.trace = trace
        self.engines = _engines(trace)
        self.clock = _Clock(trace, self.engines)
        t0 = _earliest_ns(trace, self.clock)
        self.clock.t0 = t0 or 0
        self.multi = len(self.engines) > 1
        self.next_pid = 1
        self.next_tid = 1
        self.sort_index = 0
        self.counts: dict[str, Any] = {
            "num_requests": 0, "num_request_slices": 0, "num_skipped_slices": 0, "num_families": 0,
            "num_free_block_samples": 0, "num_held_block_samples": 0, "num_evictions": 0, "num_clears": 0,
            "num_transfers": 0, "num_skipped_transfers": 0, "num_lineage_flows": 0,
        }
        self.next_flow = 1

    def _label(self, engine: str, name: str) -> str:
        return f"engine {engine}: {name}" if self.multi else name

    def _process(self, engine: str, name: str) -> tuple[int, list[dict]]:
        pid = self.next_pid
        self.next_pid += 1
        self.sort_index += 1
        return pid, [_meta("process_name", pid, None, {"name": self._label(engine, name)}),
                     _meta("process_sort_index", pid, None, {"sort_index": self.sort_index})]

    def _thread(self, pid: int, name: str, sort_index: int) -> tuple[int, list[dict]]:
        tid = self.next_tid
        self.next_tid += 1
        return tid, [_meta("thread_name", pid, tid, {"name": name}),
                     _meta("thread_sort_index", pid, tid, {"sort_index": sort_index})]

    def events(self) -> Iterator[dict]:
        from kmesh_trace.lineage import declared_parents

        self.parents = declared_parents(self.trace)  # the lineage table's resolution, as every analysis reads it
        inv = (_engine_col(self.trace.scan("invocations")).select(_INVOCATION_COLUMNS)
               .sort(["engine", "seq"]).collect())
        for engine in self.engines:
            yield from self._pool(engine)
            yield from self._requests(engine, inv.filter(pl.col("engine") == engine))

    # ---- the engine's KV pool -----------------------------------------------------------------

    def _pool(self, engine: str) -> Iterator[dict]:
        pid, meta = self._process(engine, "KV pool")
        yield from meta
        us = self.clock.us
        blocks = _engine_col(self.trace.scan("block_events")).filter(pl.col("engine") == engine)

        # Free blocks: one sample per change (the last value at each timestamp), not per event.
        free = (blocks.filter(pl.col("num_free_blocks").is_not_null()).sort("ts_ns", "seq")
                .group_by("ts_ns", maintain_order=True).agg(pl.col("num_free_blocks").last())
                .filter(pl.col("num_free_blocks") != pl.col("num_free_blocks").shift(1).fill_null(-1))
                .collect())
        for ts, n in free.iter_rows():
            yield {"name": FREE_COUNTER, "ph": "C", "ts": us(engine, ts), "pid": pid, "tid": 0, "args": {"blocks": n}}
        self.counts["num_free_block_samples"] += free.height

        # Held blocks: a running count of family holds (+1 held, -1 released), from 0.
        held = (blocks.filter(pl.col("event").is_in(list(_HOLD_EVENTS))).sort("seq")
                .with_columns(pl.when(pl.col("event") == "held").then(1).otherwise(-1).cum_sum().alias("n"))
                .sort("ts_ns", "seq").group_by("ts_ns", maintain_order=True).agg(pl.col("n").last()).collect())
        for ts, n in held.iter_rows():
            yield {"name": HELD_COUNTER, "ph": "C", "ts": us(engine, ts), "pid": pid, "tid": 0, "args": {"blocks": n}}
        self.counts["num_held_block_samples"] += held.height

        marks = (blocks.filter(pl.col("event").is_in(list(_MARK_EVENTS))).sort("ts_ns", "seq")
                 .select("ts_ns", "event", "block_id", "block_hash", "request_id", "step").collect())
        if marks.height:
            tid, meta = self._thread(pid, "evictions", 1)
            yield from meta
            for ts, event, block_id, block_hash, request_id, step in marks.iter_rows():
                args = {k: v for k, v in (("block_id", block_id), ("request_id", request_id), ("step", step)) if v is not None}
                if block_hash is not None:
                    args["block_hash"] = f"{block_hash:016x}"  # uint64 exceeds JSON's exact integers: hex text
                yield {"name": "evicted" if event == "evicted" else "prefix cache cleared", "ph": "i", "s": "t",
                       "ts": us(engine, ts), "pid": pid, "tid": tid, "cat": CATEGORY, "args": args}
                self.counts["num_evictions" if event == "evicted" else "num_clears"] += 1

        yield from self._transfers(engine, pid)

    def _transfers(self, engine: str, pid: int) -> Iterator[dict]:
        tr = (_engine_col(self.trace.scan("transfers")).filter(pl.col("engine") == engine)
              .sort(["direction", "start_ns", "finish_ns"], nulls_last=True).collect())
        ok = tr.filter(pl.col("start_ns").is_not_null() & pl.col("finish_ns").is_not_null()
                       & (pl.col("finish_ns") >= pl.col("start_ns")))
        self.counts["num_skipped_transfers"] += tr.height - ok.height
        self.counts["num_transfers"] += ok.height
        us = self.clock.us
        for direction in sorted(set(ok["direction"].to_list())):
            rows = ok.filter(pl.col("direction") == direction).to_dicts()
            lanes = _lanes([(r["start_ns"], r["finish_ns"]) for r in rows])
            tids: dict[int, int] = {}
            for lane in sorted(set(lanes)):
                tid, meta = self._thread(pid, f"{direction} transfers" + (f" ({lane + 1})" if lane else ""),
                                         2 + len(tids) + (0 if direction == "load" else 1000))
                tids[lane] = tid
                yield from meta
            for r, lane in zip(rows, lanes):
                yield {"name": f"{direction} {r['request_id']}", "ph": "X", "ts": us(engine, r["start_ns"]),
                       "dur": (r["finish_ns"] - r["start_ns"]) / 1000, "pid": pid, "tid": tids[lane], "cat": CATEGORY,
                       "args": {k: r[k] for k in _TRANSFER_ARGS if r[k] is not None}}

    # ---- requests, grouped by family ----------------------------------------------------------

    def _requests(self, engine: str, inv: pl.DataFrame) -> Iterator[dict]:
        families: dict[str, list[dict]] = defaultdict(list)
        for r in inv.iter_rows(named=True):  # arrival order: families appear in order of their first request
            families[r["family_id"] if r["family_id"] is not None else UNRELATED].append(r)
        order = [f for f in families if f != UNRELATED] + ([UNRELATED] if UNRELATED in families else [])
        self.counts["num_families"] += len(order) - (UNRELATED in families)
        us = self.clock.us
        drawn: dict[str, tuple[int, int, float, float]] = {}  # request id -> pid, tid, first start, last end (us)
        edges: list[tuple[str, str]] = []  # (parent, child) request ids
        for family in order:
            pid, meta = self._process(engine, family if family == UNRELATED else f"family {family}")
            yield from meta
            for r in families[family]:
                self.counts["num_requests"] += 1
                parent = self.parents.get((engine, r["request_id"]))
                name = r["request_id"]
                if parent is not None:
                    name += f" (parent {parent})"
                elif r["parent_id"] is not None:
                    name += f" (parent {r['parent_id']}, not in the trace)"
                tid, meta = self._thread(pid, name, r["seq"])
                yield from meta
                # Unknown values are left out (viewers drop nulls anyway; large exports shrink).
                args = {k: r[k] for k in _REQUEST_ARGS if r[k] is not None}
                if parent is not None:
                    args["parent_request_id"] = parent
                    edges.append((parent, r["request_id"]))
                last_end = first_start = None
                for phase, start_col, end_col in PHASES:
                    start, end = r[start_col], r[end_col]
                    if start is None or end is None:
                        continue  # unknown end: nothing to draw (not counted: the request may simply not have got there)
                    if end < start or (last_end is not None and start < last_end):
                        self.counts["num_skipped_slices"] += 1
                        continue
                    last_end = end
                    first_start = start if first_start is None else first_start
                    self.counts["num_request_slices"] += 1
                    yield {"name": phase, "ph": "X", "ts": us(engine, start), "dur": (end - start) / 1000,
                           "pid": pid, "tid": tid, "cat": CATEGORY, "args": args}
                if last_end is not None:
                    drawn[r["request_id"]] = (pid, tid, us(engine, first_start), us(engine, last_end))
        yield from self._flows(drawn, edges)

    def _flows(self, drawn: dict[str, tuple[int, int, float, float]], edges: list[tuple[str, str]]) -> Iterator[dict]:
        """One flow arrow per drawn edge: it starts (ph "s") just inside the parent's last slice, so it binds
        to it, and ends (ph "f", bp "e") at the child's first slice, which encloses its start."""
        for parent, child in edges:
            if parent not in drawn or child not in drawn:
                continue
            ppid, ptid, pstart, pend = drawn[parent]
            cpid, ctid, cstart, _ = drawn[child]
            fid = self.next_flow
            self.next_flow += 1
            self.counts["num_lineage_flows"] += 1
            common = {"name": "lineage", "cat": "lineage", "id": fid}
            yield {**common, "ph": "s", "ts": max(pstart, pend - 0.001), "pid": ppid, "tid": ptid,
                   "args": {"parent_request_id": parent, "child_request_id": child}}
            yield {**common, "ph": "f", "bp": "e", "ts": cstart, "pid": cpid, "tid": ctid}


def build_trace_events(trace: Trace) -> list[dict]:
    """Every trace event of the export, in file order (for tests and small traces)."""
    return list(_Builder(trace).events())


def export_perfetto(trace: Trace, out_path: str | os.PathLike) -> dict[str, Any]:
    """Write `trace` as Chrome trace-event JSON (gzip when the name ends in .gz); returns a summary.

    Events are streamed to a temporary file and renamed into place, so a large trace never sits
    in memory as one JSON document and a reader never sees half a file.
    """
    out_path = Path(out_path)
    if not out_path.parent.is_dir():
        raise KmeshTraceError(f"cannot write {out_path}: the directory {out_path.parent} does not exist; create it first.")
    builder = _Builder(trace)
    # One encoder call per chunk of events (C speed), not one per event; the list's brackets are dropped.
    # Raw UTF-8, not \u escapes: Perfetto's JSON tokenizer shows \u sequences literally in names.
    encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    opener = gzip.open if out_path.name.endswith(".gz") else open
    num_events = 0
    try:
        with opener(tmp, "wt", encoding="utf-8") as f:
            f.write('{"traceEvents":[\n')
            chunk: list[dict] = []
            for ev in builder.events():
                chunk.append(ev)
                if len(chunk) == _CHUNK_EVENTS:
                    f.write(("," if num_events else "") + encode(chunk)[1:-1] + "\n")
                    num_events += len(chunk)
                    chunk.clear()
            if chunk:
                f.write(("," if num_events else "") + encode(chunk)[1:-1] + "\n")
                num_events += len(chunk)
            other = {"source": "kmesh-trace", "trace": str(trace.path), "t0_ns": builder.clock.t0,
                     "clock": "wall-aligned" if builder.clock.aligned else "monotonic"}
            f.write('],"displayTimeUnit":"ns","otherData":' + json.dumps(other) + "}\n")
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return {"path": str(out_path), "num_events": num_events, "num_bytes": out_path.stat().st_size,
            "engines": builder.engines, "clock": other["clock"], **builder.counts}


# ---- validation -------------------------------------------------------------------------------

#: Every phase of the trace-event format (duration, complete, instant, counter, async, flow,
#: sample, object, metadata, memory dump, mark, clock sync, context).
KNOWN_PHASES = set("BEXiICbneSTpFstfPNODMVvRc()")
_TIMED_TRACK_PHASES = {"B", "E", "X", "i", "I"}
_METADATA_NAMES = {"process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _ns(us: float) -> int:
    # Viewers turn microseconds into integer nanoseconds before comparing (Perfetto: llround(us * 1000)),
    # so slices that touch in nanoseconds must not be reported as overlapping by float addition.
    return round(us * 1000)


def validate_trace_events(obj: Any) -> list[str]:
    """Problems that would make a viewer reject or misdraw `obj` (a parsed trace-event JSON); [] when valid.

    Checks the container (JSON Array or Object Format), per event the fields its phase requires
    (name, ph, ts, pid, tid; dur >= 0 for X; numeric args for C; args.name / args.sort_index for
    metadata), balanced B/E per track, non-decreasing timestamps per track in file order, and that
    complete slices on one track nest properly (no partial overlaps, which viewers draw wrongly).
    """
    problems: list[str] = []
    if isinstance(obj, dict):
        events = obj.get("traceEvents")
        if not isinstance(events, list):
            return ["the JSON object has no traceEvents list"]
        unit = obj.get("displayTimeUnit")
        if unit is not None and unit not in ("ms", "ns"):
            problems.append(f"displayTimeUnit is {unit!r}; it must be 'ms' or 'ns'")
    elif isinstance(obj, list):
        events = obj
    else:
        return ["a trace must be a JSON array of events or an object with traceEvents"]

    last_ts: dict[tuple, float] = {}
    open_b: dict[tuple, list[str]] = defaultdict(list)
    x_stack: dict[tuple, list[int]] = defaultdict(list)  # end times (ns) of enclosing X slices per track
    for i, ev in enumerate(events):
        where = f"event {i}"
        if not isinstance(ev, dict):
            problems.append(f"{where} is not an object")
            continue
        ph = ev.get("ph")
        if not isinstance(ph, str) or ph not in KNOWN_PHASES:
            problems.append(f"{where} has unknown phase {ph!r}")
            continue
        where = f"event {i} ({ph} {ev.get('name')!r})"
        if ph != "E" and not isinstance(ev.get("name"), str):
            problems.append(f"{where} has no name")
        if not isinstance(ev.get("pid"), int) or isinstance(ev.get("pid"), bool):
            problems.append(f"{where} has no integer pid")
            continue
        if ph == "M":
            name, args = ev.get("name"), ev.get("args")
            if isinstance(name, str) and name in _METADATA_NAMES:
                if name.startswith("thread") and not isinstance(ev.get("tid"), int):
                    problems.append(f"{where} has no integer tid")
                key = "sort_index" if name.endswith("sort_index") else ("labels" if name == "process_labels" else "name")
                if not isinstance(args, dict) or key not in args:
                    problems.append(f"{where} has no args.{key}")
                elif key == "sort_index" and not (isinstance(args[key], int) and not isinstance(args[key], bool)):
                    problems.append(f"{where} has a non-integer sort_index")
            continue
        if not _number(ev.get("ts")):
            problems.append(f"{where} has no finite numeric ts")
            continue
        ts = _ns(ev["ts"])
        if ph in _TIMED_TRACK_PHASES:
            if not isinstance(ev.get("tid"), int) or isinstance(ev.get("tid"), bool):
                problems.append(f"{where} has no integer tid")
                continue
        if ph == "C":
            args = ev.get("args")
            if not isinstance(args, dict) or not args or not all(_number(v) for v in args.values()):
                problems.append(f"{where} needs args with numeric values")
            track = ("C", ev["pid"], repr(ev.get("name")), repr(ev.get("id")))
        elif ph in _TIMED_TRACK_PHASES:
            track = ("T", ev["pid"], ev["tid"])
        else:
            continue
        if track in last_ts and ts < last_ts[track]:
            problems.append(f"{where} goes back in time on its track ({ev['ts']} us, after {last_ts[track] / 1000} us)")
        last_ts[track] = max(ts, last_ts.get(track, ts))
        if ph == "X":
            dur = ev.get("dur")
            if not _number(dur) or dur < 0:
                problems.append(f"{where} needs a non-negative numeric dur")
                continue
            stack = x_stack[track]
            while stack and stack[-1] <= ts:
                stack.pop()
            end = ts + _ns(dur)
            if stack and end > stack[-1]:
                problems.append(f"{where} overlaps the slice before it on its track without nesting inside it")
            stack.append(end)
        elif ph == "B":
            open_b[track].append(ev.get("name"))
        elif ph == "E":
            if not open_b[track]:
                problems.append(f"{where} ends a slice that never began on its track")
            else:
                open_b[track].pop()
        elif ph in ("i", "I") and ev.get("s", "t") not in ("g", "p", "t"):
            problems.append(f"{where} has instant scope {ev.get('s')!r}; it must be g, p or t")
    for track, names in open_b.items():
        for name in names:
            problems.append(f"slice {name!r} on pid {track[1]} tid {track[2]} begins (B) but never ends (E)")
    return problems
