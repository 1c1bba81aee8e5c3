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
replay no longer holds is counted (`kv_events.num_unrecovered_batches`, with the ranges). Every
message received ends in exactly one place (the sequence state machine, `PublisherRecorder.classify`):
recorded (in order, after its gap is filled, or late: a batch counted lost that arrives after all,
taken off the lost count); counted as a duplicate (a seq recorded before with the same payload); the
first batch of a new epoch (a seq that goes back with another payload: the publisher restarted,
whatever its clock says); or counted as malformed. A listener restarted on the same `--out` resumes
each partition (new parts, its seq and residency continue) and catches up from the replay buffer:
batches after the last one written when the buffer still holds that one unchanged, else the
restarted publisher's batches as a new epoch.

Everything that comes in is bounded: a message over `MAX_MESSAGE_BYTES` is refused by ZeroMQ (its
seq becomes a gap, filled or counted), the receive queue holds `RECEIVE_QUEUE` messages (beyond it
the publisher drops them: a gap again), a gap costs the batches the replay returns (at most
`MAX_REPLAY_BATCHES`, never a walk over the missing seqs), and one replay request has one deadline
for its whole answer. Stopping (SIGINT, SIGTERM, `--duration`) takes at most `STOP_BUDGET_S` to
record what was already received, then counts whatever is still queued as lost at stop.
"""

from __future__ import annotations

import hashlib
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

import pyarrow.compute as pc
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
#: One replay request's whole answer must arrive within this (it does not restart per message).
REPLAY_TIMEOUT_S = 5.0
#: ZMQ_MAXMSGSIZE of every socket: larger messages are refused (no engine step publishes 8 MiB).
MAX_MESSAGE_BYTES = 8 << 20
#: ZMQ_RCVHWM of the subscriptions: messages queued before the listener reads them.
RECEIVE_QUEUE = 1000
#: Batches one replay request may return (vLLM buffers 10,000 steps by default).
MAX_REPLAY_BATCHES = 100_000
#: Stopping: time to record what was received, then to count what is still queued.
STOP_BUDGET_S = 0.15
COUNT_BUDGET_S = 0.1
#: Stopping: the subscription is drained once nothing has arrived for this long.
QUIET_S = 0.02
#: The longest a poll waits, so that a stop request is seen promptly.
POLL_SLICE_S = 0.05
#: Unrecovered seq ranges and malformed-frame reasons kept in the metadata (all are counted).
MAX_LISTED = 100
#: Payload digests of the latest batches (duplicates vs restarts) and lost ranges a late batch may fill.
RECENT_WINDOW = 16384
MAX_OPEN_GAPS = 4096
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


def _partition_metadata(root: Path, engine_id: str) -> dict | None:
    """An existing partition's metadata (None: there is none); one sentence when it cannot be read."""
    path = root / ENGINES_DIR / f"{engine_id}.json"
    if not path.exists():
        return None
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise KmeshTraceError(f"cannot resume {engine_id}: {path} is not readable JSON ({e}); move the trace aside "
                              "or give another --out.") from None
    if not isinstance(meta, dict):
        raise KmeshTraceError(f"cannot resume {engine_id}: {path} is not a JSON object; move the trace aside or "
                              "give another --out.")
    return meta


def partition_id(root: Path, endpoint: str, taken: set[str] = frozenset()) -> str:
    """The partition of `endpoint` under `root`: its readable name (`PublisherSpec.engine_id`) unless another
    endpoint has it (here, or `taken` in this run; `ipc:///W/a/b.sock` and `ipc:///W/a-b.sock` read
    alike), then that name with a digest of the endpoint, so that two publishers never merge."""
    base = PublisherSpec(endpoint).engine_id
    meta = _partition_metadata(root, base)
    owner = ((meta or {}).get("kv_events") or {}).get("endpoint") if isinstance(meta, dict) else None
    if base not in taken and (meta is None or owner in (None, endpoint)):
        return base
    return f"{base}-{hashlib.sha256(endpoint.encode()).hexdigest()[:10]}"


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
        n += t.num_rows
        if not t.num_rows:
            continue
        # Column by column (a dict per row costs ~300 B each on a recording of millions of rows).
        events = t.column("event").to_pylist()
        for ev, medium, group, h in zip(events, t.column("medium").to_pylist(), t.column("kv_group").to_pylist(),
                                        t.column("block_hash").to_pylist()):
            _apply_residency(resident, ev, medium, group, h)
        touched += events.count("touched")
        i = pc.index(t.column("seq"), pc.max(t.column("seq"))).as_py()
        row = {c: t.column(c)[i].as_py() for c in cols}
        if last is None or row["seq"] > last["seq"]:
            last = row
    if last is not None and (last["publisher_seq"] is None or last["wall_publish_ns"] is None):
        raise KmeshTraceError(f"cannot resume {engine_id}: its last row has no publisher_seq or wall_publish_ns; "
                              "move the trace aside or give another --out.")
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
                 max_buffered_events: int = DEFAULT_MAX_BUFFERED_EVENTS, engine_id: str | None = None):
        self.spec = spec
        self.flush_interval_s = flush_interval_s
        self.capacity = max_buffered_events
        root = Path(out_dir)
        engine_id = partition_id(root, spec.endpoint) if engine_id is None else engine_id
        old = _partition_metadata(root, engine_id)
        if old is not None and not schema.is_kv_events(old):
            raise KmeshTraceError(f"{root / ENGINES_DIR / engine_id}.json is a partition of another source "
                                  f"({old.get('source')}); give the listener another --out.")
        n_rows, last, self.resident, n_touched = _read_last_rows(root, engine_id) if old else (0, None, Counter(), 0)
        fmt = spec.format or (old or {}).get("kv_events", {}).get("format")
        self.stats: dict[str, Any] = {
            "endpoint": spec.endpoint, "replay_endpoint": spec.replay_endpoint, "topic": spec.topic, "format": fmt,
            "hash_kind": HASH_KINDS.get(fmt), "num_batches": 0, "num_replayed_batches": 0, "num_gaps": 0,
            "num_missing_batches": 0, "num_recovered_batches": 0, "num_unrecovered_batches": 0, "unrecovered": [],
            "num_malformed_frames": 0, "num_malformed_events": 0, "malformed": [], "epochs": [],
            "num_removed_unseen": 0, "num_touched_blocks": 0, "first_publisher_seq": None, "num_resumes": 0,
            "num_duplicate_batches": 0, "num_late_batches": 0, "num_unread_at_stop": 0,
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
        self.writer = TraceWriter(root, engine_id=engine_id, metadata=metadata,
                                  source=old.get("source", source) if old else source)
        self.writer.num_rows["block_events"] = n_rows
        self.next_row_seq = 0 if last is None else last["seq"] + 1
        # Sequence state: the next batch seq expected, and the last batch's wall time (epochs, duplicates).
        self.expected: int | None = None if last is None else last["publisher_seq"] + 1
        self.last_wall_ns: int | None = None if last is None else last["wall_publish_ns"]
        # A resumed partition's last batch, (seq, wall ns): the replay buffer tells whether it is the same run.
        self.resumed_at: tuple[int, int] | None = None if last is None else (last["publisher_seq"], self.last_wall_ns)
        self.recent: dict[int, int] = {}  # seq -> payload digest of the latest batches of this epoch
        self.lost: list[list[int]] = [list(r) for r in self.stats["unrecovered"][:MAX_OPEN_GAPS]]
        self.rows: dict[str, list] = {c: [] for c in _COLUMNS}
        self.num_dropped = 0
        self.live = LiveStats(spec.num_usable_blocks or self.writer.metadata.get("num_usable_blocks"))
        self.closed = False

    @property
    def engine_id(self) -> str:
        return self.writer.engine_id

    # ---- frames: the sequence state machine ---------------------------------------------------

    def count_malformed(self, frame: Frame) -> None:
        if frame.ts is not None:  # the batch was read; some of its events were not
            self.stats["num_malformed_events"] += max(frame.num_bad_events, 1)
        else:
            self.stats["num_malformed_frames"] += 1
        if len(self.stats["malformed"]) < MAX_LISTED:
            self.stats["malformed"].append(f"seq {frame.seq}: {frame.error}")

    def classify(self, frame: Frame) -> str:
        """Where a message with a readable seq goes: `next` (record it, first filling any gap before it),
        `duplicate` (recorded before: the same seq and payload), `late` (a seq counted lost, arriving
        after all), `epoch` (the seq went back with another payload: the publisher restarted) or
        `stale` (an unreadable payload at a seq already passed: counted malformed)."""
        if self.expected is None or frame.seq >= self.expected:
            return "next"
        if self.recent.get(frame.seq) == frame.digest:
            return "duplicate"
        if frame.ts is None:  # unreadable: it cannot open an epoch
            return "stale"
        if frame.seq not in self.recent and self._lost_range(frame.seq) is not None:
            return "late"
        return "epoch"

    def _lost_range(self, seq: int) -> int | None:
        for i, (epoch, first, last) in enumerate(self.lost):
            if epoch == self.epoch_index and first <= seq <= last:
                return i
        return None

    def open_epoch(self, frame: Frame, *, restart: bool = True) -> None:
        """The publisher (re)started: its seq counts from 0 again (`restart` False: the first batch seen)."""
        self.stats["epochs"].append({"epoch": len(self.stats["epochs"]), "first_publisher_seq": frame.seq,
                                     "wall_ns": int(frame.ts * 1e9) if frame.ts is not None else None,
                                     "first_row_seq": self.next_row_seq})
        if restart:
            self.recent.clear()
            self.expected = 0

    def record(self, frame: Frame, *, replayed: bool = False, late: bool = False) -> None:
        """Rows for one batch: in order (the caller filled any gap before it), or `late` (it fills a
        seq counted lost; the sequence does not move)."""
        if frame.error:
            self.count_malformed(frame)
        if frame.ts is not None and not self.stats["epochs"]:
            self.open_epoch(frame, restart=False)
        self._remember(frame)
        if late:
            self._unlose(frame.seq)
        else:
            self.expected = frame.seq + 1
        if frame.ts is None:  # nothing readable beyond its seq: it only advanced the sequence
            return
        if self.stats["first_publisher_seq"] is None:
            self.stats["first_publisher_seq"] = frame.seq
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
        if not late:
            self.last_wall_ns = wall

    def _remember(self, frame: Frame) -> None:
        self.recent[frame.seq] = frame.digest
        if len(self.recent) > RECENT_WINDOW:
            del self.recent[next(iter(self.recent))]

    def _unlose(self, seq: int) -> None:
        """A batch counted lost arrived: it is lost no more."""
        i = self._lost_range(seq)
        epoch, first, last = self.lost.pop(i)
        self.lost[i:i] = [[epoch, a, b] for a, b in ((first, seq - 1), (seq + 1, last)) if a <= b]
        del self.lost[MAX_OPEN_GAPS:]
        self.stats["num_unrecovered_batches"] -= 1
        self.stats["num_late_batches"] += 1
        self.stats["unrecovered"] = [list(r) for r in self.lost[:MAX_LISTED]]

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
        if len(self.lost) < MAX_OPEN_GAPS:
            self.lost.append([self.epoch_index, first, last])
            self.stats["unrecovered"] = [list(r) for r in self.lost[:MAX_LISTED]]

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
        endpoints = [s.endpoint for s in specs]
        if len(set(endpoints)) != len(endpoints):
            raise KmeshTraceError("the same publisher endpoint is given twice.")
        ids: list[str] = []
        for s in specs:
            ids.append(partition_id(Path(out_dir), s.endpoint, set(ids)))
        self.zmq = zmq
        self.ctx = zmq.Context()
        self.flush_interval_s = flush_interval_s
        self.replay_timeout_s = replay_timeout_s
        self.recorders = [PublisherRecorder(out_dir, s, flush_interval_s=flush_interval_s,
                                            max_buffered_events=max_buffered_events, engine_id=eid)
                          for s, eid in zip(specs, ids)]
        self.subs = [self._subscribe(rec) for rec in self.recorders]
        self._ipc_ids = [_ipc_identity(rec.spec.endpoint) for rec in self.recorders]
        self.stop = threading.Event()

    def _socket(self, kind):
        zmq = self.zmq
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)  # beyond it the publisher drops: a gap, filled or counted
        sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:P and IPv6 host names connect, IPv4 ones as before
        return sock

    def _subscribe(self, rec: PublisherRecorder):
        zmq = self.zmq
        sub = self._socket(zmq.SUB)
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

    def replay(self, rec: PublisherRecorder, first: int, last: int | None, on_frame: Callable[[Frame], None], *,
               deadline: float | None = None, at_stop: bool = False) -> bool:
        """Hand `on_frame` the batches from seq `first` (to `last`) the publisher still buffers, in seq
        order, at most `MAX_REPLAY_BATCHES`; the whole answer within `replay_timeout_s` (or `deadline`).
        A stop request ends it, unless `at_stop` (the stop's own budget is `deadline`). True if the
        replay socket ended its answer (or gave everything asked for)."""
        zmq = self.zmq
        if not rec.spec.replay_endpoint:
            return False
        limit = MAX_REPLAY_BATCHES if last is None else min(last - first + 1, MAX_REPLAY_BATCHES)
        end = time.monotonic() + self.replay_timeout_s
        end = end if deadline is None else min(end, deadline)
        sock = self._socket(zmq.DEALER)
        try:
            sock.connect(rec.spec.replay_endpoint)
            sock.send_multipart([b"", first.to_bytes(8, "big")])
            n, after = 0, first
            while n < limit:
                left = end - time.monotonic()
                if (self.stop.is_set() and not at_stop) or left <= 0:
                    if left <= 0:
                        log.warning("kmesh-trace listen: the replay socket of %s did not answer in time",
                                    rec.engine_id)
                    return False
                if not sock.poll(int(min(left, POLL_SLICE_S) * 1000) + 1):
                    continue
                frames = sock.recv_multipart()
                frame = decode_frames(frames[1:] if frames and frames[0] == b"" else frames)
                if frame.is_end:
                    return True
                if frame.seq is None:
                    rec.count_malformed(frame)
                    continue
                if frame.seq < after:  # before what was asked, or out of order: a copy of no use here
                    rec.stats["num_duplicate_batches"] += 1
                    continue
                if last is not None and frame.seq > last:  # a copy of what is received live
                    return True
                n, after = n + 1, frame.seq + 1
                on_frame(frame)
            return True
        finally:
            sock.close()

    def catch_up(self, rec: PublisherRecorder, *, deadline: float | None = None) -> None:
        """At start: what the publisher buffered before we subscribed. A fresh trace: from 0. A resumed one:
        after its last batch when the buffer still holds that batch unchanged (the same run), else the
        restarted publisher's batches from 0, as a new epoch."""
        if not rec.spec.replay_endpoint:
            return
        if rec.resumed_at is None:
            self.replay(rec, 0, None, lambda f: self._in_order(rec, f, replayed=True), deadline=deadline)
            return
        seq, wall = rec.resumed_at
        rec.resumed_at = None
        verdict: list[str] = []

        def resumed(f: Frame) -> None:
            if not verdict:  # the first batch of the answer says whose buffer this is
                same = f.seq > seq or (f.seq == seq and f.ts is not None and int(f.ts * 1e9) == wall)
                verdict.append("same" if same else "restarted")
                if f.seq == seq and same:
                    return  # the batch already written last
            if verdict[0] == "same":
                self._in_order(rec, f, replayed=True)

        self.replay(rec, seq, None, resumed, deadline=deadline)
        if verdict != ["same"]:  # nothing at or after our last batch, or another batch there: it restarted
            started: list[bool] = []

            def restarted(f: Frame) -> None:
                if not started:
                    rec.open_epoch(f)
                    started.append(True)
                self._in_order(rec, f, replayed=True)

            self.replay(rec, 0, None, restarted, deadline=deadline)

    def _in_order(self, rec: PublisherRecorder, frame: Frame, *, replayed: bool = False) -> None:
        """Put one message with a readable seq where it belongs (`PublisherRecorder.classify`)."""
        kind = rec.classify(frame)
        if kind == "duplicate":
            rec.stats["num_duplicate_batches"] += 1
        elif kind == "stale":
            rec.count_malformed(frame)
        elif kind == "late":
            rec.record(frame, replayed=replayed, late=True)
        else:
            if kind == "epoch":
                rec.open_epoch(frame)
            if rec.expected is not None and frame.seq > rec.expected:
                self._fill_gap(rec, rec.expected, frame.seq - 1)
            rec.record(frame, replayed=replayed)

    def _fill_gap(self, rec: PublisherRecorder, first: int, last: int) -> None:
        """Seqs `first`..`last` were missed: record what the replay socket still holds, count the rest. The
        cost is the batches returned, never the size of the gap."""
        rec.stats["num_gaps"] += 1
        rec.stats["num_missing_batches"] += last - first + 1
        nxt = [first]

        def got(f: Frame) -> None:
            if f.seq > nxt[0]:
                rec.count_unrecovered(nxt[0], f.seq - 1)
            rec.stats["num_recovered_batches"] += 1
            rec.record(f, replayed=True)
            nxt[0] = f.seq + 1

        self.replay(rec, first, last, got)
        if nxt[0] <= last:
            rec.count_unrecovered(nxt[0], last)
        rec.expected = last + 1

    # ---- the loop -----------------------------------------------------------------------------

    def run(self, *, on_tick: Callable[[], None] | None = None, tick_s: float | None = None,
            duration_s: float | None = None) -> None:
        """Record until `stop` is set (or `duration_s` passed), then drain and close every partition."""
        zmq = self.zmq
        start = time.monotonic()
        end = None if duration_s is None else start + duration_s
        try:
            for rec in self.recorders:
                self.catch_up(rec, deadline=end)
            poller, by_sock = self._poller()
            next_flush = time.monotonic() + self.flush_interval_s
            next_tick = start + tick_s if tick_s else None
            while not self.stop.is_set():
                now = time.monotonic()
                if end is not None and now >= end:
                    break
                wake = min(t for t in (next_flush, next_tick, end) if t is not None)
                for sock, _ in poller.poll(int(max(min(wake - now, POLL_SLICE_S), 0) * 1000)):
                    rec = by_sock[sock]
                    while not self.stop.is_set():  # drain what is queued, within the flush deadline
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
                self.drain()
            finally:
                self.close()


    def drain(self) -> None:
        """At the stop: what the subscriptions had queued or still had in flight is recorded
        within `STOP_BUDGET_S` (then what the replay buffer holds beyond it), and what arrives after
        that is counted lost at stop (its seqs as unrecovered) for `COUNT_BUDGET_S` more."""
        deadline = time.monotonic() + STOP_BUDGET_S  # (no unsubscribing: a SUB drops queued messages then)
        for sub, rec in zip(self.subs, self.recorders):
            unread: list[bytes] = []
            while time.monotonic() < deadline + COUNT_BUDGET_S and sub.poll(int(QUIET_S * 1000)):
                frames = sub.recv_multipart()
                if time.monotonic() < deadline and not unread:
                    self._on_live(rec, frames)
                else:
                    unread.append(frames[1] if len(frames) == 3 else b"")
            if unread:
                self._count_unread(rec, unread)
            elif rec.spec.replay_endpoint and rec.expected is not None and time.monotonic() < deadline:
                self.replay(rec, rec.expected, None, lambda f: self._in_order(rec, f, replayed=True),
                            deadline=deadline, at_stop=True)

    def _count_unread(self, rec: PublisherRecorder, seqs: list[bytes]) -> None:
        """Messages received at the stop with no time left to record them: counted, their seqs lost."""
        rec.stats["num_unread_at_stop"] += len(seqs)
        valid = [int.from_bytes(b, "big", signed=True) for b in seqs if len(b) == 8]
        top = max((s for s in valid if s >= 0), default=None)
        if rec.expected is not None and top is not None and top >= rec.expected:
            rec.count_unrecovered(rec.expected, top)
            rec.expected = top + 1

    def _poller(self):
        zmq = self.zmq
        poller = zmq.Poller()
        for sub in self.subs:
            poller.register(sub, zmq.POLLIN)
        return poller, dict(zip(self.subs, self.recorders))

    def _on_live(self, rec: PublisherRecorder, frames: list[bytes]) -> None:
        frame = decode_frames(frames)
        if frame.seq is None or frame.is_end:  # the end marker belongs to replay answers only
            if frame.is_end:
                frame = Frame(None, error="a live message carries the replay end marker (seq -1)")
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
