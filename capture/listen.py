"""Recording the KV events an unmodified engine publishes: one trace partition per publisher.

`Listener` subscribes (ZeroMQ SUB) to each publisher, decodes its batches (`kv_events.py`) and hands
them to that publisher's `PublisherRecorder`, which turns each event into `block_events` rows
(BlockStored -> `cached`, or `touched` when it re-announces blocks that are all resident and start
a prefix: vLLM's report of a request's hits under kv_cache_report_mode full; BlockRemoved ->
`evicted`; AllBlocksCleared -> `cleared`) with the publisher's medium, KV group, session, wall time
and batch seq, buffers them (bounded; an overflow is counted as dropped) and writes one Parquet part
at least every `flush_interval_s` through the same `TraceWriter` as the plugin capture, so the loss
record, `last_flush` and `complete` mean the same. Closing (SIGINT, SIGTERM) writes everything and
marks each partition complete; after SIGKILL every part written stays readable.

Nothing is lost silently. Each publisher numbers its batches; a gap is filled from its replay
socket (ROUTER: send a start seq, receive the buffered batches and an end marker), and what the
replay no longer holds is counted (`kv_events.num_unrecovered_batches`, with the ranges). A
publisher whose seq goes back (it restarted) starts a new epoch, not a gap. A listener restarted on
the same `--out` resumes each partition (new parts, its seq and residency continue) and catches up
from the replay buffer: batches after the last one written, or stamped later (a new epoch).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pyarrow.parquet as pq

from kmesh_trace import schema
from kmesh_trace.capture.kv_events import (CLEARED, HASH_KINDS, REMOVED, SPEC_KINDS, Event, Frame, decode_frames,
                                           removal_semantics)
from kmesh_trace.capture.live_stats import LiveStats
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.writer import ENGINES_DIR, TraceWriter

log = logging.getLogger("kmesh_trace.listen")

DEFAULT_FLUSH_S = 1.0
DEFAULT_MAX_BUFFERED_EVENTS = 524288
REPLAY_TIMEOUT_S = 5.0
#: Unrecovered seq ranges and malformed-frame reasons kept in the metadata (all are counted).
MAX_LISTED = 100
_COLUMNS = ("seq", "ts_ns", "event", "block_hash", "parent_block_hash", "kv_group", "medium", "session_id",
            "wall_publish_ns", "publisher_seq", "locality", "ownership", "cache_salt", "origin")
schema.BLOCK_EVENTS.select(*_COLUMNS)


@dataclass
class PublisherSpec:
    """One publisher to record: where it publishes and what is known about its engine."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    rank: int | None = None
    engine: str | None = None  # e.g. "vllm 0.32.0"
    model: str | None = None
    block_size: int | None = None
    num_usable_blocks: int | None = None
    host: str | None = None
    format: str | None = None  # forced (--format); None: detected
    bind: bool = False  # bind the SUB socket (the engine connects: it was given a concrete tcp address)

    @property
    def engine_id(self) -> str:
        """Stable across listener restarts (resuming needs it): the endpoint, made a partition name."""
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", self.endpoint).strip("-.")
        return f"kv-{slug}"


def _ipc_identity(endpoint: str) -> tuple[int, int] | None:
    """(device, inode) of an ipc:// endpoint's socket file, None when it is not one or does not exist."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return None
    try:
        st = os.stat(endpoint[len("ipc://"):])
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _read_last_rows(writer_root: Path, engine_id: str) -> tuple[int, dict | None, Counter, int]:
    """(rows in the partition, the last row, the residency its events leave, touched rows) of an existing
    partition, from its parts: a resumed listener continues from what is on disk, not from metadata that
    a SIGKILL may have left one flush behind."""
    directory = writer_root / "block_events" / f"engine={engine_id}"
    parts = sorted(directory.glob("part-*.parquet")) if directory.is_dir() else []
    n, last, resident, touched = 0, None, Counter(), 0
    cols = ["seq", "event", "block_hash", "medium", "kv_group", "publisher_seq", "wall_publish_ns"]
    for p in parts:
        try:
            t = pq.read_table(p, columns=cols)
        except Exception as e:  # noqa: BLE001 (a damaged part: resuming would build on unknown rows)
            raise KmeshTraceError(f"cannot resume {engine_id}: its part {p} is unreadable ({e}); move the trace "
                                  "aside or give another --out.") from None
        rows = t.to_pylist()
        n += len(rows)
        for r in rows:
            _apply_residency(resident, r["event"], r["medium"], r["kv_group"], r["block_hash"])
            touched += r["event"] == "touched"
            if last is None or r["seq"] > last["seq"]:
                last = r
    return n, last, resident, touched


def _apply_residency(resident: Counter, event: str, medium, group, block_hash) -> bool:
    """Update the resident hashes; False when a removal names a hash never seen stored."""
    if event == "cleared":
        for key in [k for k in resident if k[0] in (medium, None, "GPU")]:
            del resident[key]
        return True
    key = (medium, group, block_hash)
    if event == "cached":
        resident[key] += 1
    elif event == "evicted":
        if resident[key] <= 0:
            resident.pop(key, None)
            return False
        resident[key] -= 1
        if not resident[key]:
            del resident[key]
    return True


class PublisherRecorder:
    """One publisher's partition: sequence tracking, rows, the writer."""

    def __init__(self, out_dir: str | os.PathLike, spec: PublisherSpec, *, flush_interval_s: float = DEFAULT_FLUSH_S,
                 max_buffered_events: int = DEFAULT_MAX_BUFFERED_EVENTS):
        self.spec = spec
        self.flush_interval_s = flush_interval_s
        self.capacity = max_buffered_events
        root = Path(out_dir)
        meta_path = root / ENGINES_DIR / f"{spec.engine_id}.json"
        old = json.loads(meta_path.read_text()) if meta_path.exists() else None
        if old is not None and not schema.is_kv_events(old):
            raise KmeshTraceError(f"{meta_path} is a partition of another source ({old.get('source')}); "
                                  "give the listener another --out.")
        n_rows, last, self.resident, n_touched = _read_last_rows(root, spec.engine_id) if old else (0, None, Counter(), 0)
        fmt = spec.format or (old or {}).get("kv_events", {}).get("format")
        self.stats: dict[str, Any] = {
            "endpoint": spec.endpoint, "replay_endpoint": spec.replay_endpoint, "topic": spec.topic, "format": fmt,
            "hash_kind": HASH_KINDS.get(fmt), "num_batches": 0, "num_replayed_batches": 0, "num_gaps": 0,
            "num_missing_batches": 0, "num_recovered_batches": 0, "num_unrecovered_batches": 0, "unrecovered": [],
            "num_malformed_frames": 0, "num_malformed_events": 0, "malformed": [], "epochs": [],
            "num_removed_unseen": 0, "num_touched_blocks": 0, "first_publisher_seq": None, "num_resumes": 0,
            "removal_semantics": removal_semantics(fmt, spec.engine), "removal_semantics_basis": None,
            "group_specs": {}, "num_reported_outside_window": 0,
        }
        if self.stats["removal_semantics"] != "unknown":
            self.stats["removal_semantics_basis"] = f"the source of {spec.engine}"
        if old is not None:
            self.stats.update({k: v for k, v in (old.get("kv_events") or {}).items()
                               if k in self.stats and k not in ("endpoint", "replay_endpoint", "topic")})
            self.stats["num_resumes"] += 1
            self.stats["num_touched_blocks"] = n_touched
            keep = {k: v for k, v in old.items() if k not in ("complete", "pid", "num_rows_written", "last_flush")}
            metadata = {**keep, "kv_events": self.stats}
        else:
            metadata = {"engine_index": spec.rank, "engine": spec.engine, "model": spec.model,
                        "block_size": spec.block_size, "num_usable_blocks": spec.num_usable_blocks,
                        "kv_events": self.stats,
                        "capture_config": {"flush_interval_s": flush_interval_s,
                                           "max_buffered_events": max_buffered_events}}
            if spec.host:
                metadata["host"] = spec.host
        source = schema.KV_EVENTS_SOURCE + (fmt.split("-")[0] if fmt else "unknown")
        self.writer = TraceWriter(root, engine_id=spec.engine_id, metadata=metadata,
                                  source=old.get("source", source) if old else source)
        self.writer.num_rows["block_events"] = n_rows
        self.next_row_seq = 0 if last is None else last["seq"] + 1
        # Sequence state: the next batch seq expected, and the last batch's wall time (epochs, duplicates).
        self.expected: int | None = None if last is None else last["publisher_seq"] + 1
        self.last_wall_ns: int | None = None if last is None else last["wall_publish_ns"]
        self.rows: dict[str, list] = {c: [] for c in _COLUMNS}
        self.num_dropped = 0
        self.live = LiveStats(spec.num_usable_blocks or self.writer.metadata.get("num_usable_blocks"))
        self.closed = False

    @property
    def engine_id(self) -> str:
        return self.writer.engine_id

    # ---- frames -------------------------------------------------------------------------------

    def count_malformed(self, frame: Frame) -> None:
        if frame.ts is not None:  # the batch was read; some of its events were not
            self.stats["num_malformed_events"] += max(frame.num_bad_events, 1)
        else:
            self.stats["num_malformed_frames"] += 1
        if len(self.stats["malformed"]) < MAX_LISTED:
            self.stats["malformed"].append(f"seq {frame.seq}: {frame.error}")

    def is_duplicate(self, frame: Frame) -> bool:
        """Already recorded: a seq before the expected one, stamped no later than the last batch."""
        if self.expected is None or frame.seq >= self.expected:
            return False
        if frame.ts is None:  # unreadable: it cannot open an epoch, so it is taken as a repeat (and counted)
            return True
        return self.last_wall_ns is not None and int(frame.ts * 1e9) <= self.last_wall_ns

    def starts_epoch(self, frame: Frame) -> bool:
        return self.expected is not None and frame.seq < self.expected and not self.is_duplicate(frame)

    def open_epoch(self, frame: Frame) -> None:
        """The publisher (re)started: its seq counts from 0 again."""
        self.stats["epochs"].append({"epoch": len(self.stats["epochs"]), "first_publisher_seq": frame.seq,
                                     "wall_ns": int(frame.ts * 1e9) if frame.ts is not None else None,
                                     "first_row_seq": self.next_row_seq})
        if self.expected is not None:
            self.expected = 0

    def record(self, frame: Frame, *, replayed: bool = False) -> None:
        """Rows for one in-order batch (the caller filled any gap before it)."""
        if frame.error:
            self.count_malformed(frame)
        if frame.ts is None:  # nothing readable beyond its seq: it still advances the sequence
            self.expected = frame.seq + 1
            return
        if self.stats["first_publisher_seq"] is None:
            self.stats["first_publisher_seq"] = frame.seq
        if self.expected is None and not self.stats["epochs"]:
            self.open_epoch(frame)
        if frame.format and not self.stats["format"]:
            self._set_format(frame.format)
        if frame.rank is not None and self.writer.metadata.get("engine_index") is None:
            self.writer.metadata["engine_index"] = frame.rank
        self.stats["num_batches"] += 1
        self.stats["num_replayed_batches"] += replayed
        wall = int(frame.ts * 1e9)
        ts = self.writer.metadata["mono_anchor_ns"] + (wall - self.writer.metadata["wall_anchor_ns"])
        for ev in frame.events:
            self._rows_of(ev, ts, wall, frame.seq)
        self.expected = frame.seq + 1
        self.last_wall_ns = wall

    def _set_format(self, fmt: str) -> None:
        self.stats["format"] = fmt
        self.stats["hash_kind"] = HASH_KINDS[fmt]
        if self.stats["removal_semantics"] == "unknown" and self.spec.engine:
            self.stats["removal_semantics"] = removal_semantics(fmt, self.spec.engine)
            if self.stats["removal_semantics"] != "unknown":
                self.stats["removal_semantics_basis"] = f"the source of {self.spec.engine}"
        engine = fmt.split("-")[0]
        self.writer.metadata["source"] = schema.KV_EVENTS_SOURCE + engine
        if not self.writer.metadata.get("engine"):
            self.writer.metadata["engine"] = engine

    def _rows_of(self, ev: Event, ts: int, wall: int, pseq: int) -> None:
        if ev.kind == CLEARED:
            _apply_residency(self.resident, "cleared", None, None, None)
            self._append("cleared", ts, None, None, ev, wall, pseq)
            return
        if ev.kind == REMOVED:
            for h in ev.hashes:
                if self.resident[(ev.medium, ev.group, h)] > 1 and self.stats["removal_semantics"] == "unknown":
                    self.stats["removal_semantics"] = "each_copy"
                    self.stats["removal_semantics_basis"] = "observed: a removal left another copy of its hash resident"
                if not _apply_residency(self.resident, "evicted", ev.medium, ev.group, h):
                    self.stats["num_removed_unseen"] += 1
                self._append("evicted", ts, h, None, ev, wall, pseq)
            return
        self._maybe_block_size(ev)
        self._maybe_group_spec(ev)
        resident = [self.resident[(ev.medium, ev.group, h)] > 0 for h in ev.hashes]
        skip = 0
        if ev.origin is not None:  # the publisher says whether the store is a hit
            hit = ev.origin.upper() == "REUSED"
        else:  # a re-announced prefix: from the first block on, resident up to its last block
            hit = ev.parent is None and bool(ev.hashes) and resident[-1]
            if hit and not all(resident):
                # A sliding-window (or chunked-local) group reports its whole hit, but holds only the
                # blocks at its end: those are the hit's touches; the ones before were never used.
                skip = len(resident) - next(i for i, r in enumerate(reversed(resident)) if not r)
                self.stats["num_reported_outside_window"] += skip
        parent = ev.parent
        for i, h in enumerate(ev.hashes):
            if i < skip:
                pass
            elif hit:
                self.stats["num_touched_blocks"] += 1
                self._append("touched", ts, h, parent, ev, wall, pseq)
            else:
                _apply_residency(self.resident, "cached", ev.medium, ev.group, h)
                self._append("cached", ts, h, parent, ev, wall, pseq)
            parent = h

    def _maybe_group_spec(self, ev: Event) -> None:
        """A store naming its group's spec (vLLM's offloading tiers): kept in `kv_events.group_specs`, and
        once every group 0..N is known, the partition's `kv_cache_groups`."""
        if ev.spec_kind is None or ev.group is None:
            return
        specs = self.stats["group_specs"]
        key = str(ev.group)
        if key in specs:
            return
        specs[key] = {"kind": ev.spec_kind, "sliding_window": ev.sliding_window, "block_size": ev.block_size}
        groups = []
        for i in range(len(specs)):
            g = specs.get(str(i))
            kind = SPEC_KINDS.get(g["kind"]) if g else None
            if kind is None or not g["block_size"] or (kind == "sliding_window" and not g["sliding_window"]):
                return  # a group not seen yet, or one not modelled
            groups.append({"kind": kind, "block_size": g["block_size"],
                           "sliding_window": g["sliding_window"] if kind == "sliding_window" else None})
        self.writer.metadata["kv_cache_groups"] = groups

    def _maybe_block_size(self, ev: Event) -> None:
        """The block size, when neither the user nor discovery gave it: the largest a store reports
        (SGLang's last page of a node, and vLLM's partial blocks, are shorter)."""
        size = ev.block_size
        if size and not self.spec.block_size and size > (self.writer.metadata.get("block_size") or 0):
            self.writer.metadata["block_size"] = size

    def _append(self, event, ts, h, parent, ev: Event, wall, pseq) -> None:
        self.live.on_row(event, h, ev.medium)
        rows = self.rows
        if len(rows["seq"]) >= self.capacity:
            self.num_dropped += 1
            self.next_row_seq += 1  # a visible gap, as the plugin leaves one
            return
        for col, v in zip(_COLUMNS, (self.next_row_seq, ts, event, h, parent, ev.group, ev.medium, ev.session_id, wall,
                                     pseq, ev.locality, ev.ownership, ev.cache_salt, ev.origin)):
            rows[col].append(v)
        self.next_row_seq += 1

    def count_unrecovered(self, first: int, last: int) -> None:
        self.stats["num_unrecovered_batches"] += last - first + 1
        if len(self.stats["unrecovered"]) < MAX_LISTED:
            self.stats["unrecovered"].append([self.epoch_index, first, last])

    @property
    def epoch_index(self) -> int:
        return max(len(self.stats["epochs"]) - 1, 0)

    # ---- writing ------------------------------------------------------------------------------

    def flush(self) -> None:
        rows, n = self.rows, len(self.rows["seq"])
        if n:
            self.rows = {c: [] for c in _COLUMNS}
            try:
                self.writer.write("block_events", rows)
            except Exception as e:  # noqa: BLE001 (a full disk: the rows are counted, the listener goes on)
                if not isinstance(e, OSError):  # the writer counts its own I/O failures
                    self.writer.count_dropped("block_events", n)
                log.error("kmesh-trace listen: writing %d block events of %s failed (%s: %s); they are counted as "
                          "dropped", n, self.engine_id, type(e).__name__, e)
        if self.num_dropped:
            self.writer.count_dropped("block_events", self.num_dropped)
            self.num_dropped = 0
        fields: dict[str, Any] = {"kv_events": self.stats}
        if n:
            fields["last_flush"] = {"wall_ns": time.time_ns(), "rows": dict(self.writer.num_rows)}
        self.writer.update_metadata(**fields)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.flush()
        finally:
            self.writer.close()


class Listener:
    """Subscribes to every publisher and records each into its partition of `out_dir`."""

    def __init__(self, out_dir: str | os.PathLike, specs: list[PublisherSpec], *,
                 flush_interval_s: float = DEFAULT_FLUSH_S, max_buffered_events: int = DEFAULT_MAX_BUFFERED_EVENTS,
                 replay_timeout_s: float = REPLAY_TIMEOUT_S):
        import zmq

        if not specs:
            raise KmeshTraceError("no publisher to listen to.")
        ids = [s.engine_id for s in specs]
        if len(set(ids)) != len(ids):
            raise KmeshTraceError("the same publisher endpoint is given twice.")
        self.zmq = zmq
        self.ctx = zmq.Context()
        self.flush_interval_s = flush_interval_s
        self.replay_timeout_s = replay_timeout_s
        self.recorders = [PublisherRecorder(out_dir, s, flush_interval_s=flush_interval_s,
                                            max_buffered_events=max_buffered_events) for s in specs]
        self.subs = [self._subscribe(rec) for rec in self.recorders]
        self._ipc_ids = [_ipc_identity(rec.spec.endpoint) for rec in self.recorders]
        self.stop = threading.Event()

    def _subscribe(self, rec: PublisherRecorder):
        zmq = self.zmq
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 0)  # never drop on our side: the publisher's HWM and replay bound it
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt_string(zmq.SUBSCRIBE, rec.spec.topic)
        if rec.spec.bind:  # the engine was given a concrete tcp address, so it connects: we bind it
            sub.bind(rec.spec.endpoint)
        else:
            sub.connect(rec.spec.endpoint)
        return sub

    def check_endpoints(self) -> bool:
        """Subscribe again to an ipc:// publisher whose socket file was made anew (the engine restarted, or
        started after us): libzmq does not reconnect a SUB to a re-bound ipc path by itself; what it published
        before the new subscription took effect comes from its replay socket. True if any was."""
        changed = False
        for i, rec in enumerate(self.recorders):
            ident = _ipc_identity(rec.spec.endpoint)
            if ident is not None and ident != self._ipc_ids[i]:
                self.subs[i].close(linger=0)
                self.subs[i] = self._subscribe(rec)
                self._ipc_ids[i] = ident
                self.catch_up(rec)  # what it published before the new subscription took effect
                changed = True
        return changed

    # ---- replay -------------------------------------------------------------------------------

    def replay(self, rec: PublisherRecorder, start: int) -> list[Frame] | None:
        """Batches from `start` on that the publisher still buffers (None: no replay socket or no answer)."""
        zmq = self.zmq
        if not rec.spec.replay_endpoint:
            return None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(rec.spec.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[Frame] = []
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000)):
                    log.warning("kmesh-trace listen: the replay socket of %s did not answer in %.0f s",
                                rec.engine_id, self.replay_timeout_s)
                    return out or None
                frames = sock.recv_multipart()
                frame = decode_frames(frames[1:] if frames and frames[0] == b"" else frames)
                if frame.is_end:
                    return out
                if frame.seq is None:
                    rec.count_malformed(frame)
                    continue
                out.append(frame)
                deadline = time.monotonic() + self.replay_timeout_s
        finally:
            sock.close()

    def catch_up(self, rec: PublisherRecorder) -> None:
        """At start: what the publisher buffered before we subscribed (a fresh trace: from 0; a resumed
        one: every batch after the last written, or stamped after it, i.e. a restarted publisher's)."""
        if not rec.spec.replay_endpoint:
            return
        frames = self.replay(rec, 0)
        for f in frames or []:
            if rec.expected is not None and rec.is_duplicate(f):
                continue
            self._in_order(rec, f, replayed=True)

    def _in_order(self, rec: PublisherRecorder, frame: Frame, *, replayed: bool = False) -> None:
        """Record `frame`, first filling a gap before it from the replay socket."""
        if rec.expected is not None and frame.seq > rec.expected:
            first, last = rec.expected, frame.seq - 1
            rec.stats["num_gaps"] += 1
            rec.stats["num_missing_batches"] += last - first + 1
            got = {f.seq: f for f in (self.replay(rec, first) or []) if first <= f.seq <= last}
            rec.stats["num_recovered_batches"] += len(got)
            missing_from = None
            for s in range(first, last + 1):
                f = got.get(s)
                if f is None:
                    missing_from = s if missing_from is None else missing_from
                    continue
                if missing_from is not None:
                    rec.count_unrecovered(missing_from, s - 1)
                    missing_from = None
                rec.record(f, replayed=True)
            if missing_from is not None:
                rec.count_unrecovered(missing_from, last)
            rec.record(frame, replayed=replayed)
        elif rec.starts_epoch(frame):
            # A restarted publisher: a new epoch from seq 0; batches of it we missed are a gap.
            rec.open_epoch(frame)
            self._in_order(rec, frame, replayed=replayed)
        else:
            rec.record(frame, replayed=replayed)

    # ---- the loop -----------------------------------------------------------------------------

    def run(self, *, on_tick: Callable[[], None] | None = None, tick_s: float | None = None,
            duration_s: float | None = None) -> None:
        """Record until `stop` is set (or `duration_s` passed), then close every partition."""
        zmq = self.zmq
        try:
            for rec in self.recorders:
                self.catch_up(rec)
            poller, by_sock = self._poller()
            start = time.monotonic()
            next_flush = start + self.flush_interval_s
            next_tick = start + tick_s if tick_s else None
            while not self.stop.is_set():
                now = time.monotonic()
                if duration_s is not None and now - start >= duration_s:
                    break
                wait = next_flush - now if next_tick is None else min(next_flush, next_tick) - now
                for sock, _ in poller.poll(max(int(wait * 1000), 0) if wait > 0 else 0):
                    rec = by_sock[sock]
                    while True:  # drain what is queued, within the flush deadline
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_live(rec, frames)
                        if time.monotonic() >= next_flush:
                            break
                now = time.monotonic()
                if now >= next_flush:
                    for rec in self.recorders:
                        rec.flush()
                    if self.check_endpoints():
                        poller, by_sock = self._poller()
                    next_flush = now + self.flush_interval_s
                if next_tick is not None and now >= next_tick and on_tick is not None:
                    on_tick()
                    next_tick = now + tick_s
        finally:
            try:
                for rec in self.recorders:  # what the subscription had not delivered yet
                    self.catch_up_tail(rec)
            finally:
                self.close()

    def catch_up_tail(self, rec: PublisherRecorder) -> None:
        """At the end: batches published after the last one received (short wait: the engine may be gone)."""
        if not rec.spec.replay_endpoint or rec.expected is None:
            return
        saved, self.replay_timeout_s = self.replay_timeout_s, min(self.replay_timeout_s, 1.0)
        try:
            for f in self.replay(rec, rec.expected) or []:
                if f.seq >= rec.expected and not rec.is_duplicate(f):
                    self._in_order(rec, f, replayed=True)
        finally:
            self.replay_timeout_s = saved

    def _poller(self):
        zmq = self.zmq
        poller = zmq.Poller()
        for sub in self.subs:
            poller.register(sub, zmq.POLLIN)
        return poller, dict(zip(self.subs, self.recorders))

    def _on_live(self, rec: PublisherRecorder, frames: list[bytes]) -> None:
        frame = decode_frames(frames)
        if frame.seq is None:
            rec.count_malformed(frame)
            return
        if rec.is_duplicate(frame):
            if frame.error:
                rec.count_malformed(frame)
            return
        self._in_order(rec, frame)

    def close(self) -> None:
        errors = []
        for rec in self.recorders:
            try:
                rec.close()
            except Exception as e:  # noqa: BLE001 (close the others; report the first)
                errors.append(e)
        for sub in self.subs:
            sub.close(linger=0)
        self.ctx.term()
        if errors:
            raise errors[0]
