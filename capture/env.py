"""The environment variables that configure the capture and the hold controller.

Kept apart and free of imports so that the plugin, which vLLM loads in every process it starts,
can decide whether it is enabled without importing anything heavy.
"""

import os

ENV_DIR = "KMESH_TRACE_DIR"  # the trace directory; setting it enables capture
ENV_FLUSH_S = "KMESH_TRACE_FLUSH_S"
ENV_MAX_EVENTS = "KMESH_TRACE_MAX_BUFFERED_EVENTS"
ENV_MAX_REQUESTS = "KMESH_TRACE_MAX_BUFFERED_REQUESTS"
ENV_LINEAGE_WINDOW = "KMESH_TRACE_LINEAGE_WINDOW"
ENV_SHUTDOWN_GRACE_S = "KMESH_TRACE_SHUTDOWN_GRACE_S"  # how long a front end lets an engine core close
DEFAULT_SHUTDOWN_GRACE_S = 30.0

ENV_HOLD = "KMESH_HOLD"  # 1 enables the family hold controller
ENV_HOLD_MAX_BLOCKS = "KMESH_HOLD_MAX_BLOCKS"
ENV_HOLD_MAX_FAMILIES = "KMESH_HOLD_MAX_FAMILIES"
ENV_HOLD_EXPIRY_S = "KMESH_HOLD_EXPIRY_S"


def hold_enabled() -> bool:
    return os.environ.get(ENV_HOLD, "").strip().lower() in ("1", "true", "yes", "on")


def shutdown_grace_s() -> float:
    """Seconds a front end waits for an engine core to close its capture before killing it."""
    raw = os.environ.get(ENV_SHUTDOWN_GRACE_S, "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_SHUTDOWN_GRACE_S
    except ValueError:
        return DEFAULT_SHUTDOWN_GRACE_S
    return value if value >= 0 else DEFAULT_SHUTDOWN_GRACE_S
