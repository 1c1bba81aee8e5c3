"""The recorder: one per engine process; owns the buffers, the writer thread and the trace partition.

The engine thread only appends tuples to bounded buffers (see `buffers.py`; block events as one
batch record per pool call, expanded by the writer thread: `rows.BlockEventExpander`) and keeps a
little per-request state; a daemon thread drains the buffers at least once per `flush_interval_s`, infers
lineage (see `lineage.py`), and writes one atomic Parquet part per table through `TraceWriter`.
`close()` (engine shutdown, or atexit) drains everything, writes rows for requests that never
finished (status null) and marks the partition complete. After a SIGKILL every part written so far
stays readable and the metadata says `complete: false`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from kmesh_trace.capture.attach import Attachments
from kmesh_trace.capture.buffers import RowBuffer
from kmesh_trace.capture.rows import BLOCK_EVENT_CONVERSIONS, INVOCATION_LAYOUT, LAYOUTS, BlockEventExpander
from kmesh_trace.capture.config import DEFAULTS, ENV_NAMES, check_knob, config_from_env  # noqa: F401 (re-exported)
from kmesh_trace.capture.lineage import LineageIndex, edges_for
from kmesh_trace.lineage import ParentResolver

from kmesh_trace.writer import ENGINES_DIR, TraceWriter, default_engine_id

log = logging.getLogger("kmesh_trace.capture")

def _free_engine_id(root: str, engine_index: int) -> str:
    """host-pid-index, with a suffix when this process already wrote an engine into `root`."""
    base = default_engine_id(engine_index)
    engine_id, k = base, 1
    while os.path.exists(os.path.join(root, ENGINES_DIR, f"{engine_id}.json")):
        k += 1
        engine_id = f"{base}-{k}"
    return engine_id


class Recorder:
    """Hot-path state the hooks write to, plus the background writer. Created by `hooks.install`."""

    def __init__(self, out_dir: str, *, engine_index: int = 0, metadata: dict[str, Any] | None = None,
                 config: dict[str, Any] | None = None):
        self.config = {**DEFAULTS, **(config or {})}
        for key in ENV_NAMES:
            check_knob(key, self.config[key], key)
        self.writer = TraceWriter(out_dir, engine_id=_free_engine_id(str(out_dir), engine_index),
                                  metadata={**(metadata or {}), "engine_index": engine_index,
                                            "capture_config": self.config})
        cap_events = int(self.config["max_buffered_events"])
        self.block_events = RowBuffer("block_events", cap_events, LAYOUTS["block_events"],
                                      conversions=BLOCK_EVENT_CONVERSIONS)
        self.invocations = RowBuffer("invocations", int(self.config["max_buffered_requests"]), LAYOUTS["invocations"])
        self.transfers = RowBuffer("transfers", cap_events, LAYOUTS["transfers"])
        self.steps = RowBuffer("steps", cap_events, LAYOUTS["steps"])
        self._buffers = (self.invocations, self.block_events, self.transfers, self.steps)
        self.block_expander = BlockEventExpander()  # the pool wrappers install one that knows their pool
        self.num_lineage_dropped = 0
        self.num_bad_declarations = 0  # requests whose kmesh_children is not a count (capture/rows.py)
        # Hot-path state, touched only by the engine thread.
        self.seq = 0  # next block event seq (advances for dropped events too, leaving a visible gap)
        self.step = 0  # scheduler iterations so far
        self.ctx_req: str | None = None  # request the engine is acting for
        self.ctx_group: int | None = None  # KV cache group whose manager is calling the pool (hybrid engines)
        # What a pool touch / free records as: the hold controller's references are held / released.
        self.touch_event = "touched"
        self.free_event = "freed"
        self.num_arrivals = 0
        self.live: dict[str, Any] = {}  # request id -> vllm Request, until it finishes
        self.awaiting_first_token: set = set()
        self.output_ns = 0  # while the scheduler handles a step's output: when that output arrived
        self.after_step: list[Callable[[], None]] = []  # called after each update_from_output
        self.before_close: list[Callable[[], None]] = []  # called once, before the final flush
        self.attachments = Attachments()  # every wrapper attached for this recorder (hooks, connector)
        # (request id, caller id) of each arrival: appended by the engine thread, named by the writer's.
        self.arrivals: list[tuple[str, str | None]] = []
        self.parents = ParentResolver(4 * int(self.config["lineage_window"]))  # writer thread only
        self._lineage = LineageIndex(int(self.config["lineage_window"]))
        self._num_written_dropped: dict[str, int] = {}
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self.closed = False
        self._thread = threading.Thread(target=self._run, name="kmesh-trace-writer", daemon=True)
        self._thread.start()

    @property
    def engine_id(self) -> str:
        return self.writer.engine_id

    @property
    def path(self) -> str:
        return str(self.writer.root)

    # ---- the public API (the hooks, the hold controller and the proxy connector use only this) --

    def act_for(self, request_id: str | None, fn: Callable, *args, **kwargs):
        """`fn(*args, **kwargs)` with every pool event it causes recorded for `request_id`."""
        prev = self.ctx_req
        self.ctx_req = request_id
        try:
            return fn(*args, **kwargs)
        finally:
            self.ctx_req = prev

    def in_group(self, group: int, fn: Callable) -> Callable:
        """`fn`, recording every pool event it causes for KV cache group `group` (a hybrid engine's
        per-group manager calls the one shared pool)."""
        def call(*args, **kwargs):
            prev = self.ctx_group
            self.ctx_group = group
            try:
                return fn(*args, **kwargs)
            finally:
                self.ctx_group = prev

        return call

    def act_as(self, event: str, request_id: str | None, fn: Callable, *args):
        """`act_for`, with the touches and frees `fn` makes recorded as `event` (the hold controller's
        `held` / `released`)."""
        prev = self.touch_event, self.free_event
        self.touch_event = self.free_event = event
        try:
            return self.act_for(request_id, fn, *args)
        finally:
            self.touch_event, self.free_event = prev

    def on_step(self, callback: Callable[[], None]) -> None:
        """Call `callback()` after each engine step (the scheduler's update_from_output), engine thread."""
        self.after_step.append(callback)

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call `callback()` once when the capture closes, before the final flush."""
        self.before_close.append(callback)

    def record_config(self, key: str, value: Any) -> None:
        """Add `key` to the partition's `capture_config` (e.g. the hold controller's caps)."""
        self.writer.update_metadata(capture_config={**self.writer.metadata.get("capture_config", {}), key: value})

    def record_transfer(self, row: tuple) -> None:
        """One transfers row (rows.TRANSFER_LAYOUT); counted as dropped when the buffer is full."""
        self.transfers.append(row)

    # ---- writer thread -----------------------------------------------------------------------

    def _run(self) -> None:
        interval = float(self.config["flush_interval_s"])
        while not self._stop.wait(interval):
            try:
                self.flush()
            except Exception:  # never let the capture take the engine down
                log.exception("kmesh-trace: a capture flush failed (lineage inference or the metadata file)")

    def flush(self) -> None:
        """Write everything buffered so far as new parts (one per non-empty table).

        Each table's part is written on its own: a table whose write fails has its rows counted as
        dropped and the others are still written; a request whose lineage cannot be inferred counts
        one dropped lineage row and its invocation is still written. The drop counts always reach
        the metadata.
        """
        with self._flush_lock:
            num_arrivals = self.num_arrivals  # before the drain: every one of them is named or written below
            wrote = False
            try:
                arrivals = self.arrivals
                n = len(arrivals)
                for rid, caller in arrivals[:n]:  # before the invocations: a parent is named before its child ends
                    self.parents.add(rid, caller)
                del arrivals[:n]
                inv = self.invocations.drain()
                wrote = bool(inv)
                lineage_rows = self._infer_lineage(inv) if inv else []
                if inv:
                    self._write(self.invocations.table, partial(self.invocations.to_columns, inv), len(inv))
                if lineage_rows:
                    self._write("lineage", lambda: {k: [r[k] for r in lineage_rows] for k in lineage_rows[0]},
                                len(lineage_rows))
                batch = self.block_events.drain()
                if batch:
                    wrote = True
                    expander = self.block_expander
                    self.block_events.num_events_out += sum(map(expander.events_in, batch)) - len(batch)
                    rows = expander.expand(batch)
                    self._write("block_events", partial(self.block_events.to_columns, rows), len(rows))
                for buf in (self.transfers, self.steps):
                    batch = buf.drain()
                    if batch:
                        wrote = True
                        self._write(buf.table, partial(buf.to_columns, batch), len(batch))
            finally:
                self._update_dropped(num_arrivals if wrote else None)

    def _infer_lineage(self, inv: list[tuple]) -> list[dict[str, Any]]:
        """Lineage edges of the drained invocations; indexes the finished ones as future parents.

        Never raises: the invocations are already drained, so an inference failure must not lose
        them. A request whose inference fails contributes no edge and counts one dropped lineage row.
        """
        cols = INVOCATION_LAYOUT
        edges: list[dict[str, Any]] = []
        failed, first = 0, None
        for raw in inv:
            try:
                row = dict(zip(cols, raw))
                mine = edges_for(self._lineage, row, self.parents)
                if row["status"] is not None:
                    self._lineage.add(row["request_id"], list(row["prompt_token_ids"] or []) +
                                      list(row["output_token_ids"] or []), row["finish_ns"])
            except Exception as e:  # noqa: BLE001 (a bad row or an inference bug: counted, one line)
                failed += 1
                first = first or e
            else:
                edges += mine
        if failed:
            self.num_lineage_dropped += failed
            log.error("kmesh-trace: inferring lineage failed for %d request(s) (%s: %s); they are counted as "
                      "dropped lineage and their invocations are still written", failed, type(first).__name__, first)
        return edges

    def _update_dropped(self, num_arrivals: int | None) -> None:
        """Drop counts into the metadata, and, when this flush wrote rows, what is on disk so far
        (`last_flush`: what a capture that dies before closing still holds; the audit reports it)."""
        dropped = {buf.table: buf.num_dropped + self._num_written_dropped.get(buf.table, 0) for buf in self._buffers}
        dropped["lineage"] = self.num_lineage_dropped + self._num_written_dropped.get("lineage", 0)
        fields: dict[str, Any] = {}
        if dropped != {k: v for k, v in self.writer.metadata["num_dropped_events"].items() if k in dropped}:
            fields["num_dropped_events"] = {**self.writer.metadata["num_dropped_events"], **dropped}
        if self.num_bad_declarations != self.writer.metadata.get("num_bad_declarations", 0):
            fields["num_bad_declarations"] = self.num_bad_declarations
        if num_arrivals is not None:
            fields["last_flush"] = {"wall_ns": time.time_ns(), "num_arrivals": num_arrivals,
                                    "rows": dict(self.writer.num_rows)}
        if fields:
            self.writer.update_metadata(**fields)

    def _write(self, table: str, columns: Callable[[], dict[str, Any]], n: int) -> None:
        """Write one part; on failure count its `n` rows as dropped and log one line (never raises)."""
        try:
            self.writer.write(table, columns())
        except Exception as e:  # noqa: BLE001 (any failure: a full disk, a bad row; counted, one line)
            self._num_written_dropped[table] = self._num_written_dropped.get(table, 0) + n
            log.error("kmesh-trace: writing %d %s row(s) failed (%s: %s); they are counted as dropped",
                      n, table, type(e).__name__, e)

    # ---- shutdown ----------------------------------------------------------------------------

    def close(self, unfinished_row: Callable[[Any], tuple] | None = None) -> None:
        """Drain everything, record requests still in flight (status null), mark the partition complete."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        try:  # whatever fails below, the buffers are still written and the partition completed
            if self._thread.is_alive() and self._thread is not threading.current_thread():
                self._thread.join(timeout=30)
            for cb in self.before_close:
                try:
                    cb()
                except Exception:
                    log.exception("kmesh-trace: a capture close hook failed")
            if unfinished_row is not None:
                for request in list(self.live.values()):
                    try:
                        row = unfinished_row(request)
                    except Exception as e:  # noqa: BLE001 (a malformed request: counted, one line)
                        self.invocations.num_dropped += 1
                        log.error("kmesh-trace: could not record unfinished request %s (%s: %s); counted as dropped",
                                  getattr(request, "request_id", "?"), type(e).__name__, e)
                    else:
                        self.invocations.append(row)
                self.live.clear()
        finally:
            try:
                self.flush()
            finally:
                # The engine may keep a wrapper that references this recorder (another wrapper sits
                # above it); let go of the requests remembered for lineage.
                self._lineage = LineageIndex(1)
                self.parents.clear()
                self.arrivals.clear()
                self.writer.close()

