"""Starting and ending captures: the recorders of this process, installing one on an engine, closing it.

`install(scheduler, out_dir)` builds a recorder for the engine's metadata (incl. its model's KV
geometry) and attaches the wrappers (`wrappers.py`) to that scheduler, its KV cache manager and
block pool: instance attributes, never the classes' code, so only the engine being captured is
affected. `close_recorder` flushes and completes the partition and detaches every wrapper; at exit
every recorder still open is closed. `recorder_of(obj)` finds the open recorder of a pool, manager
or scheduler for the modules that add to a capture (the hold controller, the proxy connector).
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable
from typing import Any

from kmesh_trace.capture import wrappers
from kmesh_trace.capture.config import config_from_env
from kmesh_trace.capture.recorder import Recorder
from kmesh_trace.capture.rows import unfinished_row

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.kv_groups import group_of_vllm

log = logging.getLogger("kmesh_trace.capture")

#: The recorders of this process still open, in order (a closed one is removed).
RECORDERS: list[Recorder] = []
#: Called with each new recorder (the in-process session collects its own).
INSTALL_LISTENERS: list[Callable[[Recorder], None]] = []


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
        # vLLM >= 0.33 with EAGLE: each block hash also covers the next N tokens (0: plain prefix hashes).
        "hash_lookahead_tokens": int(getattr(pool, "num_hash_lookahead_tokens", 0) or 0),
        **model_geometry(scheduler.kv_cache_config, cfg.cache_config),
        **kv_cache_groups(scheduler.kv_cache_config),
        "prefix_cache_retention_interval": retention_interval(scheduler.kv_cache_config),
        "scheduler_config": scheduler_config(scheduler),
    }


def scheduler_config(scheduler) -> dict[str, Any]:
    """The scheduler's configuration as the engine resolved it (METADATA["scheduler_config"]); a field this
    vLLM does not have is null."""
    cfg = scheduler.vllm_config
    sc, cc = getattr(cfg, "scheduler_config", None), getattr(cfg, "cache_config", None)

    def get(obj, name, kind=int):
        v = getattr(obj, name, None)
        return None if v is None else kind(v) if kind is not str else str(getattr(v, "value", v))

    return {"max_num_seqs": get(sc, "max_num_seqs"), "max_num_batched_tokens": get(sc, "max_num_batched_tokens"),
            "max_model_len": get(getattr(cfg, "model_config", None), "max_model_len"),
            "chunked_prefill": get(sc, "enable_chunked_prefill", bool),
            "long_prefill_token_threshold": get(sc, "long_prefill_token_threshold"),
            "async_scheduling": get(sc, "async_scheduling", bool), "policy": get(sc, "policy", str),
            "block_size": get(cc, "block_size"), "num_gpu_blocks": int(scheduler.kv_cache_manager.block_pool.num_gpu_blocks),
            "prefix_caching": get(cc, "enable_prefix_caching", bool)}


def retention_interval(kv_cache_config) -> int:
    """vLLM's prefix_cache_retention_interval as the engine runs with it (what a sliding-window group caches);
    -1 for vLLM's None (every block), 0 where this vLLM has no such setting."""
    v = getattr(kv_cache_config, "prefix_cache_retention_interval", 0)
    return -1 if v is None else int(v)


def kv_cache_groups(kv_cache_config) -> dict[str, Any]:
    """`{"kv_cache_groups": [...]}`: every KV cache group the engine allocated, in vLLM's order
    (`block_events.kv_group` indexes the list); empty when a group's spec is of a kind not modelled
    (its rows still name the group; the audit reports the trace's groups as unknown)."""
    groups = [group_of_vllm(g) for g in kv_cache_config.kv_cache_groups]
    unknown = [type(g.kv_cache_spec).__name__ for g, mine in zip(kv_cache_config.kv_cache_groups, groups) if mine is None]
    if unknown:
        log.warning("kmesh-trace: KV cache group spec(s) %s are not modelled; kv_cache_groups is left out",
                    ", ".join(unknown))
        return {}
    return {"kv_cache_groups": [g.to_json() for g in groups]}


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
        wrappers.install_pool(rec, pool, single_group)
        wrappers.install_manager(rec, mgr)
        if single_group is None:
            wrappers.install_group_managers(rec, mgr.coordinator.single_type_managers)
        wrappers.install_scheduler(rec, scheduler, close_recorder)
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


def record_death(error: BaseException | None, worker_died: bool = False) -> None:
    """Mark every open partition of this process `engine_died`: the engine's fatal error, in one line."""
    stated = "" if error is None else f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}".rstrip(": ")
    what = ("a worker process died (killed by the OOM killer, kill -9 or a crash) and the engine core stopped"
            if worker_died else "the engine core stopped on a fatal error")
    what += f": {stated}" if stated else ""
    for rec in RECORDERS[:]:
        if not rec.closed:
            rec.writer.update_metadata(engine_died=what)


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
    for obj, _ in rec.attachments:
        if obj.__dict__.get("_kmesh_recorder") is rec:
            del obj.__dict__["_kmesh_recorder"]
    rec.attachments.detach()
    rec.after_step.clear()
    rec.before_close.clear()
    rec.live.clear()
    rec.awaiting_first_token.clear()
    if rec in RECORDERS:
        RECORDERS.remove(rec)


def set_recording(rec: Recorder, on: bool) -> None:
    """Detach (or re-attach) every wrapper, so the engine runs vLLM's own methods only.

    For A/B measurements (benchmarks/capture_overhead.py). Requests that arrive or finish while
    detached are not recorded; detach only between workloads, with no request in flight.
    """
    rec.attachments.set_attached(on)


def recorder_of(obj) -> Recorder | None:
    """The open recorder capturing the engine that `obj` (its block pool, manager or scheduler) belongs to."""
    rec = getattr(obj, "_kmesh_recorder", None)
    return rec if rec is not None and not rec.closed else None
