"""The engine hooks: instance-level wrappers on one scheduler, its KV cache manager and block pool.

`install(scheduler, out_dir)` replaces bound methods on those three objects (never the classes'
code), so only the engine being captured is affected. Each wrapper calls vLLM's own method
unchanged and then appends rows to the recorder's buffers; the request the engine acts for is
tracked in `Recorder.ctx_req` by the manager-level wrappers (allocation, free). Block events are
emitted in the order a sequential reading of the pool implies: an eviction right before the
allocation that reused the block, and `num_free_blocks` as it stands after each single event.
"""

from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Callable
from typing import Any

from kmesh_trace.capture.recorder import Recorder, config_from_env

from kmesh_trace.errors import KmeshTraceError

log = logging.getLogger("kmesh_trace.capture")

# vLLM RequestStatus names -> the contract's terminal statuses.
_STATUS = {
    "FINISHED_STOPPED": "finished",
    "FINISHED_REPETITION": "finished",
    "FINISHED_LENGTH_CAPPED": "length_capped",
    "FINISHED_IGNORED": "length_capped",  # vLLM reports it as finish reason "length"
    "FINISHED_ABORTED": "aborted",
    "FINISHED_ERROR": "error",
}

#: The recorders of this process still open, in order (a closed one is removed).
RECORDERS: list[Recorder] = []
#: Called with each new recorder (the in-process session collects its own).
INSTALL_LISTENERS: list[Callable[[Recorder], None]] = []


def hash64(key: bytes) -> int:
    """Low 64 bits of a block hash (a BlockHashWithGroupId: hash bytes + 4-byte group id), as vLLM's KV events publish it."""
    return int.from_bytes(key[-12:-4], "big")


def plain_hash64(block_hash: bytes) -> int:
    """Low 64 bits of a plain BlockHash (no group id)."""
    return int.from_bytes(block_hash[-8:], "big")


def caller_id_of(request) -> str | None:
    caller = getattr(request, "_kmesh_caller_id", None)
    if caller is not None:
        return caller
    rid = request.request_id
    head, sep, tail = rid.rpartition("-")
    return head if sep and len(tail) == 8 else None


def engine_metadata(scheduler) -> dict[str, Any]:
    import vllm

    cfg = scheduler.vllm_config
    pool = scheduler.kv_cache_manager.block_pool
    return {
        "engine": f"vllm {vllm.__version__}",
        "model": str(cfg.model_config.model),
        "block_size": int(scheduler.block_size) if hasattr(scheduler, "block_size") else int(cfg.cache_config.block_size),
        "num_usable_blocks": int(pool.num_gpu_blocks) - 1,
        "null_block_id": int(pool.null_block.block_id),
        **model_geometry(scheduler.kv_cache_config, cfg.cache_config),
    }


def model_geometry(kv_cache_config, cache_config=None) -> dict[str, Any]:
    """KV bytes per token and its inputs, read from the KV cache spec the engine allocated with.

    `kv_bytes_per_token` = sum over KV cache groups of page bytes (one block of one layer) x layers
    / tokens per block; for plain attention that is layers x 2 x KV heads x head size x dtype bytes.
    Fields a spec does not have (e.g. heads of a Mamba layer) are null; never raises.
    """
    out: dict[str, Any] = {"kv_bytes_per_token": None, "num_layers": None, "num_kv_heads": None,
                           "head_size": None, "kv_cache_dtype": None}
    try:
        groups = kv_cache_config.kv_cache_groups
        total = 0.0
        for g in groups:
            spec = g.kv_cache_spec
            total += spec.page_size_bytes * len(g.layer_names) / spec.block_size
        first = groups[0].kv_cache_spec
        out["kv_bytes_per_token"] = int(total) if total == int(total) else total
        out["num_layers"] = sum(len(g.layer_names) for g in groups)
        out["num_kv_heads"] = getattr(first, "num_kv_heads", None)
        out["head_size"] = getattr(first, "head_size", None)
        dtype = getattr(first, "dtype", None)
        configured = getattr(cache_config, "cache_dtype", None)
        out["kv_cache_dtype"] = (str(configured) if configured not in (None, "auto")
                                 else str(dtype).removeprefix("torch.") if dtype is not None else None)
    except Exception:  # noqa: BLE001 (another spec layout: the geometry is left unknown, the capture runs)
        log.warning("kmesh-trace: could not read the model's KV geometry; kv_bytes_per_token is left null")
    return out


def install(scheduler, out_dir: str, config: dict[str, Any] | None = None) -> Recorder:
    """Start recording `scheduler`'s engine into `out_dir`; returns the recorder."""
    global _atexit_registered
    config = config or config_from_env()  # first: a bad knob leaves the engine untouched
    engine_index = int(getattr(scheduler.parallel_config, "data_parallel_index", 0) or 0)
    rec = Recorder(out_dir, engine_index=engine_index, metadata=engine_metadata(scheduler), config=config)
    try:  # a partial install would leave wrappers recording into a recorder nobody flushes or closes
        mgr = scheduler.kv_cache_manager
        pool = mgr.block_pool
        groups = scheduler.kv_cache_config.kv_cache_groups
        single_group = 0 if len(groups) == 1 else None
        _install_pool(rec, pool, single_group)
        _install_manager(rec, mgr)
        _install_scheduler(rec, scheduler)
        scheduler._kmesh_recorder = rec
        RECORDERS.append(rec)
        for cb in INSTALL_LISTENERS:
            cb(rec)
    except BaseException:
        close_recorder(rec)  # detaches what was attached, stops the writer thread
        raise
    if not _atexit_registered:  # one hook for all recorders, so a closed one is referenced by nothing
        atexit.register(_close_all)
        _atexit_registered = True
    log.info("kmesh-trace: capturing engine %s into %s", rec.engine_id, rec.path)
    return rec


def try_install(scheduler, out_dir: str, warn: Callable[[str], None] = log.warning) -> Recorder | None:
    """`install`, for the plugin: a capture that cannot start never stops the engine, and says why.

    A bad knob is the user's to fix: one line naming it (through `warn`). Anything else is a bug:
    logged with its traceback.
    """
    try:
        return install(scheduler, out_dir)
    except KmeshTraceError as e:
        warn(f"kmesh-trace: {e} The engine runs uncaptured.")
    except Exception:
        log.exception("kmesh-trace: could not start the capture; the engine runs uncaptured")
    return None


_atexit_registered = False


def _close_all() -> None:
    for rec in RECORDERS[:]:  # each close removes its recorder
        close_recorder(rec)


def close_recorder(rec: Recorder) -> None:
    """Flush and complete `rec`'s partition, then let go of the engine (idempotent); never raises."""
    try:
        rec.close(unfinished_row)
    except Exception:
        log.exception("kmesh-trace: closing the capture failed")
    finally:
        _release(rec)


def _release(rec: Recorder) -> None:
    """Stop recording and drop every reference between the engine and `rec`.

    A wrapper still on top is removed (the engine calls vLLM's own method again). One that another
    wrapper was installed over (the hold controller wraps the scheduler's and manager's) stays in
    the chain but records nothing: every scheduler/manager wrapper checks `rec.closed` first and
    then only calls vLLM's own method.
    """
    for obj, wrappers in rec.wrappers:
        for name, fn in wrappers.items():
            if obj.__dict__.get(name) is fn:
                del obj.__dict__[name]
        if obj.__dict__.get("_kmesh_recorder") is rec:
            del obj.__dict__["_kmesh_recorder"]
    rec.wrappers.clear()
    rec.after_step.clear()
    rec.before_close.clear()
    rec.live.clear()
    rec.awaiting_first_token.clear()
    if rec in RECORDERS:
        RECORDERS.remove(rec)


def _attach(rec: Recorder, obj, wrappers: dict) -> None:
    for name, fn in wrappers.items():
        setattr(obj, name, fn)
    rec.wrappers.append((obj, wrappers))


def set_recording(rec: Recorder, on: bool) -> None:
    """Detach (or re-attach) every wrapper, so the engine runs vLLM's own methods only.

    For A/B measurements (benchmarks/capture_overhead.py). Requests that arrive or finish while
    detached are not recorded; detach only between workloads, with no request in flight.
    """
    for obj, wrappers in rec.wrappers:
        for name, fn in wrappers.items():
            if on:
                setattr(obj, name, fn)
            else:
                obj.__dict__.pop(name, None)


# ---- block pool ----------------------------------------------------------------------------------

def _install_pool(rec: Recorder, pool, single_group: int | None) -> None:
    buf = rec.block_events
    rows = buf.rows
    cap = buf.capacity
    mono = time.monotonic_ns
    fq = pool.free_block_queue
    orig_get_new = pool.get_new_blocks
    orig_evict = pool._maybe_evict_cached_block
    orig_touch = pool.touch
    orig_free = pool.free_blocks
    orig_cache_full = pool.cache_full_blocks
    orig_reset = pool.reset_prefix_cache
    scratch: dict[int, bytes] = {}  # evictions inside get_new_blocks, emitted with their allocation
    in_alloc = [False]

    def group_of(key):
        return single_group if single_group is not None else int.from_bytes(key[-4:], "big")

    def emit(row):
        if len(rows) < cap:
            rows.append(row)
        else:
            buf.num_dropped += 1

    def emit_all(new):
        room = cap - len(rows)
        if room >= len(new):
            rows.extend(new)
        else:
            rows.extend(new[:max(room, 0)])
            buf.num_dropped += len(new) - max(room, 0)

    def maybe_evict(block):
        key = block._block_hash
        evicted = orig_evict(block)
        if evicted and key is not None:
            if in_alloc[0]:
                scratch[block.block_id] = key
            else:
                s = rec.seq
                rec.seq = s + 1
                emit((s, mono(), rec.step, "evicted", block.block_id, block.ref_cnt, hash64(key), None,
                      rec.ctx_req, fq.num_free_blocks, group_of(key)))
        return evicted

    def get_new_blocks(num_blocks):
        free = fq.num_free_blocks
        in_alloc[0] = True
        try:
            ret = orig_get_new(num_blocks)
        finally:
            in_alloc[0] = False
        ts = mono()
        step = rec.step
        req = rec.ctx_req
        s = rec.seq
        if not scratch:  # no eviction: the common case, one comprehension
            new = [(s + i, ts, step, "allocated", b.block_id, b.ref_cnt, None, None, req, free - i - 1, single_group)
                   for i, b in enumerate(ret)]
            rec.seq = s + len(new)
            emit_all(new)
            return ret
        new = []
        for b in ret:
            free -= 1
            key = scratch.pop(b.block_id, None)
            if key is not None:
                new.append((s, ts, step, "evicted", b.block_id, 0, hash64(key), None, req, free, group_of(key)))
                s += 1
            new.append((s, ts, step, "allocated", b.block_id, b.ref_cnt, None, None, req, free, single_group))
            s += 1
        rec.seq = s
        scratch.clear()
        emit_all(new)
        return ret

    def record_ref_changes(blocks, kind, free, edge, delta):
        """Rows for a touch (edge 1, delta -1: a block reaching ref 1 left the free queue) or a
        free (edge 0, delta +1: a block reaching ref 0 joined it), with the running free count."""
        ts = mono()
        step = rec.step
        req = rec.ctx_req
        s = rec.seq
        new = []
        for b in blocks:
            if b.is_null or (b.pool is not None and b.pool is not pool):
                continue
            rc = b.ref_cnt
            if rc == edge:
                free += delta
            key = b._block_hash
            new.append((s, ts, step, kind, b.block_id, rc, hash64(key) if key is not None else None, None, req,
                        free, group_of(key) if key is not None else single_group))
            s += 1
        rec.seq = s
        emit_all(new)

    def touch(blocks):
        free = fq.num_free_blocks
        orig_touch(blocks)
        record_ref_changes(blocks, rec.touch_event, free, 1, -1)

    def free_blocks(ordered_blocks):
        blocks = list(ordered_blocks)
        free = fq.num_free_blocks
        orig_free(blocks)
        record_ref_changes(blocks, rec.free_event, free, 0, 1)

    def cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
                          block_mask=None):
        if num_cached_blocks >= num_full_blocks:
            return orig_cache_full(request, blocks, num_cached_blocks, num_full_blocks, block_size,
                                   kv_cache_group_id, block_mask)
        new = blocks[num_cached_blocks:num_full_blocks]
        before = [b._block_hash for b in new]
        orig_cache_full(request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, block_mask)
        ts = mono()
        step = rec.step
        rid = request.request_id
        free = fq.num_free_blocks
        chain = request.block_hashes
        if pool.hash_block_size != block_size:
            from vllm.v1.core.kv_cache_utils import resolve_block_hashes

            chain = resolve_block_hashes(chain, pool.hash_block_size, block_size)
        s = rec.seq
        for i, b in enumerate(new):
            key = b._block_hash
            if key is None or key == before[i] or b.is_null:
                continue
            j = num_cached_blocks + i
            emit((s, ts, step, "cached", b.block_id, b.ref_cnt, hash64(key),
                  plain_hash64(chain[j - 1]) if j > 0 else None, rid, free, kv_cache_group_id))
            s += 1
        rec.seq = s

    def reset_prefix_cache():
        ok = orig_reset()
        if ok:
            s = rec.seq
            rec.seq = s + 1
            emit((s, mono(), rec.step, "cleared", None, None, None, None, rec.ctx_req, fq.num_free_blocks, None))
        return ok

    _attach(rec, pool, {"_maybe_evict_cached_block": maybe_evict, "get_new_blocks": get_new_blocks, "touch": touch,
                        "free_blocks": free_blocks, "cache_full_blocks": cache_full_blocks,
                        "reset_prefix_cache": reset_prefix_cache})
    pool._kmesh_recorder = rec


# ---- KV cache manager (request context, first scheduling) -----------------------------------------

def _install_manager(rec: Recorder, mgr) -> None:
    orig_allocate = mgr.allocate_slots
    orig_free = mgr.free
    orig_remove_skipped = mgr.remove_skipped_blocks
    mono = time.monotonic_ns

    def allocate_slots(request, *args, **kwargs):
        if rec.closed:  # left in a chain under another wrapper: vLLM's own method, nothing kept
            return orig_allocate(request, *args, **kwargs)
        prev = rec.ctx_req
        rec.ctx_req = request.request_id
        try:
            ret = orig_allocate(request, *args, **kwargs)
        finally:
            rec.ctx_req = prev
        if ret is not None:
            st = getattr(request, "_kmesh", None)
            if st is not None and st[2] is None:
                st[2] = mono()
                st[4] = kwargs["num_new_computed_tokens"] if "num_new_computed_tokens" in kwargs else (
                    args[1] if len(args) > 1 else 0)
                st[5] = kwargs["num_external_computed_tokens"] if "num_external_computed_tokens" in kwargs else (
                    args[4] if len(args) > 4 else 0)
                rec.awaiting_first_token.add(request)
        return ret

    def free(request):
        if rec.closed:
            return orig_free(request)
        prev = rec.ctx_req
        rec.ctx_req = request.request_id
        try:
            return orig_free(request)
        finally:
            rec.ctx_req = prev

    def remove_skipped_blocks(request_id, *args, **kwargs):
        if rec.closed:
            return orig_remove_skipped(request_id, *args, **kwargs)
        prev = rec.ctx_req
        rec.ctx_req = request_id
        try:
            return orig_remove_skipped(request_id, *args, **kwargs)
        finally:
            rec.ctx_req = prev

    _attach(rec, mgr, {"allocate_slots": allocate_slots, "free": free, "remove_skipped_blocks": remove_skipped_blocks})


# ---- scheduler (invocations, steps, shutdown) -----------------------------------------------------

# Per-request state kept on the vLLM Request as `_kmesh`:
# [seq, arrival_ns, first_scheduled_ns, first_token_ns, num_cached_tokens, num_external_tokens]

def invocation_row(request, finish_ns: int | None, status: str | None) -> tuple:
    st = request._kmesh
    extra = getattr(request.sampling_params, "extra_args", None) or {}
    children = _as_int(extra.get("kmesh_children"))
    prompt = request.prompt_token_ids
    output = list(request.output_token_ids)
    return (
        request.request_id, caller_id_of(request), st[0],
        None if extra.get("kmesh_family") is None else str(extra["kmesh_family"]),
        None if extra.get("kmesh_parent") is None else str(extra["kmesh_parent"]),
        children,
        request.num_prompt_tokens, len(output),
        list(prompt) if prompt is not None else None, output, None,
        st[1], st[2], st[3], finish_ns, status, st[4], st[5], request.num_preemptions,
    )


def _as_int(value) -> int | None:
    # Callers declare through JSON (vllm_xargs); a value that is not a count is ignored, never raised.
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def unfinished_row(request) -> tuple:
    return invocation_row(request, None, None)


def _install_scheduler(rec: Recorder, scheduler) -> None:
    orig_add = scheduler.add_request
    orig_schedule = scheduler.schedule
    orig_update = scheduler.update_from_output
    orig_free_request = scheduler._free_request
    orig_shutdown = scheduler.shutdown
    mono = time.monotonic_ns
    inv = rec.invocations

    def add_request(request):
        if not rec.closed and request.request_id not in scheduler.requests:
            request._kmesh = [rec.num_arrivals, mono(), None, None, None, None]
            rec.num_arrivals += 1
            rec.live[request.request_id] = request
            rec.arrivals.append((request.request_id, caller_id_of(request)))
        return orig_add(request)

    def schedule(*args, **kwargs):
        if rec.closed:
            return orig_schedule(*args, **kwargs)
        rec.step += 1
        return orig_schedule(*args, **kwargs)

    def update_from_output(scheduler_output, model_runner_output):
        out = orig_update(scheduler_output, model_runner_output)
        if rec.closed:
            return out
        waiting = rec.awaiting_first_token
        if waiting:
            now = mono()
            for request in [r for r in waiting if r.num_output_tokens > 0]:
                request._kmesh[3] = now
                waiting.discard(request)
        for cb in rec.after_step:
            cb()
        return out

    def _free_request(request, *args, **kwargs):
        if rec.closed:
            return orig_free_request(request, *args, **kwargs)
        prev = rec.ctx_req
        rec.ctx_req = request.request_id
        try:
            ret = orig_free_request(request, *args, **kwargs)
        finally:
            rec.ctx_req = prev
        if rec.live.pop(request.request_id, None) is not None:
            rec.awaiting_first_token.discard(request)
            try:
                row = invocation_row(request, mono(), _STATUS.get(request.status.name, "error"))
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
            close_recorder(rec)

    _attach(rec, scheduler, {"add_request": add_request, "schedule": schedule, "update_from_output": update_from_output,
                             "_free_request": _free_request, "shutdown": shutdown})
