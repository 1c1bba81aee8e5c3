"""The version guard: which vLLM releases the capture hooks were verified against.

The hooks wrap internal methods of vLLM's scheduler, KV cache manager and block pool (not a public
interface), so they are installed only on a release listed here and only when every method they
wrap still exists; otherwise the plugin logs one line and leaves the engine untouched.
"""

from __future__ import annotations

import re
from pathlib import Path

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
    """The installed vLLM's version, None when vLLM is not installed.

    Read from the package's `vllm/_version.py` as text, without importing vLLM: `import vllm` takes
    seconds and loads torch, and `kmesh-trace capture` asks this in its own process before it starts the
    server. An imported vLLM (or one whose version file cannot be read) is asked directly."""
    import sys

    if "vllm" in sys.modules:
        return getattr(sys.modules["vllm"], "__version__", None)
    version = _version_from_file()
    if version is not None:
        return version
    try:
        import vllm
    except ImportError:
        return None
    return getattr(vllm, "__version__", None)


#: The assignment vcs-versioning writes into vllm/_version.py: `__version__ = version = '0.32.0'`.
_VERSION_LINE = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.MULTILINE)


def _version_from_file() -> str | None:
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")  # a top-level package: found, not imported
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        try:
            match = _VERSION_LINE.search((Path(folder) / "_version.py").read_text())
        except OSError:
            continue
        if match:
            return match.group(1)
    return None


def unsupported_reason(version: str | None = None, check_hooks: bool = True) -> str | None:
    """None when the hooks can be installed; otherwise one sentence saying why not. `check_hooks=False`
    checks the version only, importing nothing of vLLM (the engine's own plugin checks the methods)."""
    import importlib

    version = vllm_version() if version is None else version
    if version is None:
        return "vLLM is not installed in this environment; capture needs it (pip install 'kmesh-trace[capture]')."
    base = version.split("+")[0]
    if base not in SUPPORTED_VLLM_VERSIONS:
        return (f"vLLM {version} is not a version the capture hooks support "
                f"({', '.join(SUPPORTED_VLLM_VERSIONS)}); the engine runs uncaptured.")
    if not check_hooks:
        return None
    for module, cls_name, methods in HOOKED:
        cls = getattr(importlib.import_module(module), cls_name, None)
        missing = [m for m in methods if cls is None or not hasattr(cls, m)]
        if missing:
            return (f"vLLM {version} lacks {cls_name}.{', '.join(missing)} that the capture hooks wrap; "
                    "the engine runs uncaptured.")
    return None
