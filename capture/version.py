"""The version guard: which vLLM releases the capture hooks were verified against.

The hooks wrap internal methods of vLLM's scheduler, KV cache manager and block pool (not a public
interface), so they are installed only on a release listed here and only when every method they
wrap still exists; otherwise the plugin logs one line and leaves the engine untouched.
"""

from __future__ import annotations

#: vLLM releases whose internals the hooks were read against and tested on.
SUPPORTED_VLLM_VERSIONS = ("0.32.0", "0.33.0")

#: (module, class, methods) the hooks wrap; all must exist for capture to install.
HOOKED = (
    ("vllm.v1.core.sched.scheduler", "Scheduler",
     ("__init__", "add_request", "schedule", "update_from_output", "_free_request", "shutdown")),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager", ("allocate_slots", "free", "remove_skipped_blocks")),
    ("vllm.v1.core.block_pool", "BlockPool",
     ("get_new_blocks", "touch", "free_blocks", "cache_full_blocks", "_maybe_evict_cached_block",
      "reset_prefix_cache", "get_num_free_blocks")),
    ("vllm.v1.request", "Request", ("from_engine_core_request",)),
)


def vllm_version() -> str | None:
    try:
        import vllm
    except ImportError:
        return None
    return getattr(vllm, "__version__", None)


def unsupported_reason(version: str | None = None) -> str | None:
    """None when the hooks can be installed; otherwise one sentence saying why not."""
    import importlib

    version = vllm_version() if version is None else version
    if version is None:
        return "vLLM is not installed in this environment; capture needs it (pip install 'kmesh-trace[capture]')."
    base = version.split("+")[0]
    if base not in SUPPORTED_VLLM_VERSIONS:
        return (f"vLLM {version} is not a version the capture hooks support "
                f"({', '.join(SUPPORTED_VLLM_VERSIONS)}); the engine runs uncaptured.")
    for module, cls_name, methods in HOOKED:
        cls = getattr(importlib.import_module(module), cls_name, None)
        missing = [m for m in methods if cls is None or not hasattr(cls, m)]
        if missing:
            return (f"vLLM {version} lacks {cls_name}.{', '.join(missing)} that the capture hooks wrap; "
                    "the engine runs uncaptured.")
    return None
