"""The wrappers: what the capture attaches to one engine's block pool, KV cache manager and scheduler.

Each wrapper calls vLLM's own method unchanged and then appends rows (rows.BLOCK_EVENT_LAYOUT,
rows.INVOCATION_LAYOUT) to the recorder's buffers. The request the engine acts for is tracked in
`Recorder.ctx_req` through `Recorder.act_for` by the manager-level wrappers (allocation, free).
Block events are emitted in the order a sequential reading of the pool implies: an eviction right
before the allocation that reused the block, and `num_free_blocks` as it stands after each single
event. The engine thread keeps block hashes as vLLM's bytes; the writer thread converts them.
"""

from __future__ import annotations

import logging
import time

from kmesh_trace.capture.recorder import Recorder
from kmesh_trace.capture.rows import (
    ALLOCATED,
    REF_CHANGE,
    STATUS,
    BlockEventExpander,
    RequestState,
    bad_declaration,
    caller_id_of,
    group_of,
    invocation_row,
    step_counts,
)

log = logging.getLogger("kmesh_trace.capture")
#: Requests with a bad declaration logged one by one (all are counted).
MAX_WARNED = 10


# ---- block pool ----------------------------------------------------------------------------------

def install_pool(rec: Recorder, pool, single_group: int | None) -> None:
    """Allocations, touches and frees are buffered as one batch record per call (`rows.ALLOCATED`,
    `rows.REF_CHANGE`: the blocks vLLM handed over, by reference, plus what must be read at the
    event), expanded into rows by the writer thread; the rarer events (cached, evicted outside an
    allocation, cleared) are rows at once."""
    buf = rec.block_events
    rows = buf.rows
    cap = buf.capacity
    mono = time.monotonic_ns
    fq = pool.free_block_queue
    head = fq.fake_free_list_head
    caching = bool(getattr(pool, "enable_caching", True))
    pool_attrs = pool.__dict__
    orig_get_new = pool.get_new_blocks
    orig_evict = pool._maybe_evict_cached_block
    orig_touch = pool.touch
    orig_free = pool.free_blocks
    orig_cache_full = pool.cache_full_blocks
    orig_reset = pool.reset_prefix_cache
    multi = single_group is None
    rec.block_expander = BlockEventExpander(pool, multi)
    cached_map = getattr(getattr(pool, "cached_block_hash_to_block", None), "_cache", None)

    def emit(row):
        """One row at once (seq = rec.seq); counted as dropped when the buffer is full."""
        rec.seq = row[0] + 1
        if buf.num_events_in - buf.num_events_out < cap:
            rows.append(row)
            buf.num_events_in += 1
        else:
            buf.num_dropped += 1

    def maybe_evict(block):  # evictions outside an allocation (vLLM's evict_blocks, hybrid managers)
        key = block._block_hash
        evicted = orig_evict(block)
        if evicted and key is not None:
            emit((rec.seq, mono(), rec.step, "evicted", block.block_id, block.ref_cnt, key, None,
                  rec.ctx_req, fq.num_free_blocks, group_of(key) if multi else single_group))
        return evicted

    def get_new_blocks(num_blocks):
        free = fq.num_free_blocks
        keys = None
        # Only a block that holds a hash can be evicted; with none cached (or caching off) none is.
        if caching and 0 < num_blocks <= free and (cached_map is None or cached_map):
            # The hashes the allocation is about to evict: the first num_blocks of the free queue.
            keys = []
            add = keys.append
            b = head.next_free_block
            for _ in range(num_blocks):
                add(b._block_hash)
                b = b.next_free_block
        del pool_attrs["_maybe_evict_cached_block"]  # vLLM's own, once per block, without our wrapper
        try:
            ret = orig_get_new(num_blocks)
        finally:
            pool_attrs["_maybe_evict_cached_block"] = maybe_evict
        n = len(ret)
        s = rec.seq
        rec.seq = s + n
        if buf.num_events_in - buf.num_events_out + n <= cap:
            rows.append((ALLOCATED, s, n, mono(), rec.step, rec.ctx_req, free, ret, keys,
                         rec.ctx_group if multi else single_group))
            buf.num_events_in += n
        else:
            lost = n + (sum(k is not None for k in keys) if keys is not None else 0)
            buf.num_dropped += lost
            rec.seq = s + lost
        return ret

    def record_ref_changes(blocks, event, free, edge, delta):
        n = len(blocks)
        s = rec.seq
        rec.seq = s + n
        if buf.num_events_in - buf.num_events_out + n <= cap:
            rows.append((REF_CHANGE, s, n, mono(), rec.step, rec.ctx_req, free, event, blocks,
                         [b.ref_cnt for b in blocks], [b._block_hash for b in blocks], edge, delta,
                         rec.ctx_group if multi else single_group))
            buf.num_events_in += n
        else:
            lost = sum(1 for b in blocks if not (b.is_null or (b.pool is not None and b.pool is not pool)))
            buf.num_dropped += lost
            rec.seq = s + lost

    def touch(blocks):
        free = fq.num_free_blocks
        orig_touch(blocks)
        # edge 1, delta -1: a block reaching ref 1 left the free queue
        record_ref_changes(blocks, rec.touch_event, free, 1, -1)

    def free_blocks(ordered_blocks):
        blocks = list(ordered_blocks)  # iterated twice (often a reversed() iterator); kept by the record
        free = fq.num_free_blocks
        orig_free(blocks)
        # edge 0, delta +1: a block reaching ref 0 joined the free queue
        record_ref_changes(blocks, rec.free_event, free, 0, 1)

    def cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
                          block_mask=None):
        ret = orig_cache_full(request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
                              block_mask)
        if num_cached_blocks >= num_full_blocks:
            return ret
        ts = mono()
        step = rec.step
        rid = request.request_id
        free = fq.num_free_blocks
        chain = request.block_hashes
        if pool.hash_block_size != block_size:
            from vllm.v1.core.kv_cache_utils import resolve_block_hashes

            chain = resolve_block_hashes(chain, pool.hash_block_size, block_size)
        for i in range(num_full_blocks - num_cached_blocks):
            j = num_cached_blocks + i
            b = blocks[j]
            # vLLM hashes every new full block but null and masked-out ones (it skips those).
            if b.is_null or (block_mask is not None and not block_mask[i]) or b._block_hash is None:
                continue
            emit((rec.seq, ts, step, "cached", b.block_id, b.ref_cnt, b._block_hash, chain[j - 1] if j > 0 else None,
                  rid, free, kv_cache_group_id))
        return ret

    def reset_prefix_cache():
        ok = orig_reset()
        if ok:
            emit((rec.seq, mono(), rec.step, "cleared", None, None, None, None, rec.ctx_req, fq.num_free_blocks, None))
        return ok

    rec.attachments.attach(pool, {"_maybe_evict_cached_block": maybe_evict, "get_new_blocks": get_new_blocks,
                                  "touch": touch, "free_blocks": free_blocks, "cache_full_blocks": cache_full_blocks,
                                  "reset_prefix_cache": reset_prefix_cache})
    pool._kmesh_recorder = rec


# ---- the per-group managers of a hybrid engine (which group a pool call is for) ------------------

#: Methods of vLLM's single-type managers that call into the block pool.
GROUP_MANAGER_METHODS = ("allocate_new_blocks", "allocate_external_computed_blocks", "add_local_computed_blocks",
                         "free", "remove_skipped_blocks", "cache_blocks")


def install_group_managers(rec: Recorder, managers) -> None:
    """Each KV cache group's manager (vLLM's `coordinator.single_type_managers`, one per group):
    the pool calls it makes are recorded for its group (`Recorder.ctx_group`): allocations and
    frees of blocks without a hash, which name no group themselves, and the sliding-window blocks
    it frees as the window moves (`remove_skipped_blocks`)."""
    for m in managers:
        group = int(m.kv_cache_group_id)
        rec.attachments.attach(m, {name: rec.in_group(group, getattr(m, name))
                                   for name in GROUP_MANAGER_METHODS if hasattr(m, name)})


# ---- KV cache manager (request context, first scheduling) -----------------------------------------

def install_manager(rec: Recorder, mgr) -> None:
    orig_allocate = mgr.allocate_slots
    orig_free = mgr.free
    orig_remove_skipped = mgr.remove_skipped_blocks
    mono = time.monotonic_ns
    act_for = rec.act_for

    def allocate_slots(request, *args, **kwargs):
        if rec.closed:  # left in a chain under another wrapper: vLLM's own method, nothing kept
            return orig_allocate(request, *args, **kwargs)
        ret = act_for(request.request_id, orig_allocate, request, *args, **kwargs)
        if ret is not None:
            st = getattr(request, "_kmesh", None)
            if st is not None and st.first_scheduled_ns is None:
                st.first_scheduled_ns = mono()
                st.num_cached_tokens = kwargs["num_new_computed_tokens"] if "num_new_computed_tokens" in kwargs else (
                    args[1] if len(args) > 1 else 0)
                st.num_external_tokens = (kwargs["num_external_computed_tokens"]
                                          if "num_external_computed_tokens" in kwargs else (args[4] if len(args) > 4 else 0))
                rec.awaiting_first_token.add(request)
        return ret

    def free(request):
        if rec.closed:
            return orig_free(request)
        return act_for(request.request_id, orig_free, request)

    def remove_skipped_blocks(request_id, *args, **kwargs):
        if rec.closed:
            return orig_remove_skipped(request_id, *args, **kwargs)
        return act_for(request_id, orig_remove_skipped, request_id, *args, **kwargs)

    rec.attachments.attach(mgr, {"allocate_slots": allocate_slots, "free": free,
                                 "remove_skipped_blocks": remove_skipped_blocks})


# ---- scheduler (invocations, steps, shutdown) -----------------------------------------------------

def install_scheduler(rec: Recorder, scheduler, close) -> None:
    """`close(rec)` is called when the scheduler shuts down (after vLLM's own shutdown)."""
    orig_add = scheduler.add_request
    orig_schedule = scheduler.schedule
    orig_update = scheduler.update_from_output
    orig_free_request = scheduler._free_request
    orig_shutdown = scheduler.shutdown
    mono = time.monotonic_ns
    inv = rec.invocations
    arrivals = rec.arrivals
    act_for = rec.act_for

    def add_request(request):
        if not rec.closed and request.request_id not in scheduler.requests:
            request._kmesh = RequestState(rec.num_arrivals, mono())
            rec.num_arrivals += 1
            rec.live[request.request_id] = request
            arrivals.append((request.request_id, caller_id_of(request)))
            problem = bad_declaration(request)
            if problem:
                rec.num_bad_declarations += 1
                if rec.num_bad_declarations <= MAX_WARNED:
                    log.warning("kmesh-trace: request %s: %s; recorded as null (counted in num_bad_declarations)",
                                request.request_id, problem)
        return orig_add(request)

    steps = StepRecorder(rec, scheduler)

    def schedule(*args, **kwargs):
        if rec.closed:
            return orig_schedule(*args, **kwargs)
        rec.step += 1
        start = mono()
        out = orig_schedule(*args, **kwargs)
        steps.scheduled(out, start)
        return out

    def update_from_output(scheduler_output, model_runner_output):
        if rec.closed:
            return orig_update(scheduler_output, model_runner_output)
        waiting = rec.awaiting_first_token
        # The step's output time, read before vLLM handles the output: a request that stops on its
        # first token (max_tokens=1) is freed inside this call, and its row must already carry it.
        now = rec.output_ns = mono() if waiting else 0
        steps.finished(scheduler_output, now or mono())
        try:
            out = orig_update(scheduler_output, model_runner_output)
        finally:
            rec.output_ns = 0
        if waiting:
            done = None
            for request in waiting:
                if request.num_output_tokens > 0:
                    request._kmesh.first_token_ns = now
                    if done is None:
                        done = [request]
                    else:
                        done.append(request)
            if done is not None:
                waiting.difference_update(done)
        for cb in rec.after_step:
            cb()
        return out

    def _free_request(request, *args, **kwargs):
        if rec.closed:
            return orig_free_request(request, *args, **kwargs)
        ret = act_for(request.request_id, orig_free_request, request, *args, **kwargs)
        if rec.live.pop(request.request_id, None) is not None:
            if request in rec.awaiting_first_token:
                rec.awaiting_first_token.discard(request)
                if request.num_output_tokens > 0:  # stopped on its first token, in the step's output
                    request._kmesh.first_token_ns = rec.output_ns or mono()
            try:
                row = invocation_row(request, mono(), STATUS.get(request.status.name, "error"))
            except Exception:  # never let a malformed request take the engine down; count it
                inv.num_dropped += 1
                log.exception("kmesh-trace: could not record request %s", request.request_id)
            else:
                inv.append(row)
        return ret

    def shutdown():
        try:
            orig_shutdown()
        finally:
            close(rec)

    rec.attachments.attach(scheduler, {"add_request": add_request, "schedule": schedule,
                                       "update_from_output": update_from_output, "_free_request": _free_request,
                                       "shutdown": shutdown})


class StepRecorder:
    """The steps rows of one scheduler: counted when `schedule()` returns (`rows.step_counts`), kept until the
    step's output reaches `update_from_output` (one step under sync scheduling, two under async), then
    buffered. A step that scheduled nothing is not recorded; a step whose output never came is buffered
    with no finish when more than `MAX_PENDING` are waiting, or when the capture closes."""

    MAX_PENDING = 16

    def __init__(self, rec: Recorder, scheduler):
        self.rec = rec
        self.scheduler = scheduler
        self.pending: list[tuple[object, tuple]] = []  # (scheduler output, row without its finish)
        rec.on_close(self.close)

    def scheduled(self, out, start_ns: int) -> None:
        if not getattr(out, "total_num_scheduled_tokens", 0):
            return
        try:
            counts = step_counts(out, self.scheduler.requests)
            preempted = getattr(out, "preempted_req_ids", None)
            row = (self.rec.step, start_ns, None, *counts, len(preempted) if preempted is not None else None,
                   len(self.scheduler.waiting))
        except Exception:  # another vLLM's output layout: counted, never raised into the engine
            self.rec.steps.num_dropped += 1
            return
        pending = self.pending
        pending.append((out, row))
        if len(pending) > self.MAX_PENDING:
            self.rec.steps.append(pending.pop(0)[1])

    def finished(self, out, now_ns: int) -> None:
        pending = self.pending
        for k, (o, _) in enumerate(pending):
            if o is out:
                for _, row in pending[:k]:  # outputs that never came (dropped by the engine)
                    self.rec.steps.append(row)
                row = pending[k][1]
                del pending[:k + 1]
                self.rec.steps.append(row[:2] + (now_ns,) + row[3:])
                return

    def close(self) -> None:
        for _, row in self.pending:
            self.rec.steps.append(row)
        self.pending.clear()
