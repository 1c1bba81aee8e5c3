"""The vLLM plugin entry point (`vllm.general_plugins`: `kmesh_trace = kmesh_trace.capture.plugin:register`).

vLLM calls `register()` once in every process it starts (front end, engine core, workers). It does
nothing unless `KMESH_TRACE_DIR` (capture) or `KMESH_HOLD=1` (the family hold controller, `hold.py`) is set. Enabled on a supported vLLM, it wraps the scheduler's
constructor so that each engine core builds a recorder for its own scheduler (one trace partition
per engine process), and remembers each request's caller id (vLLM keeps only an id with a random
suffix). On any other vLLM it logs one line and leaves the engine untouched.
"""

from __future__ import annotations

import functools
import logging
import os

from kmesh_trace.capture.env import ENV_DIR, hold_enabled

log = logging.getLogger("kmesh_trace.capture")

_installed = False


def enabled() -> bool:
    return bool(os.environ.get(ENV_DIR)) or hold_enabled()


def register() -> bool:
    """Install the capture hooks if capture is enabled; True when they are (or already were) installed."""
    global _installed
    if _installed:
        return True
    if not enabled():
        return False
    from kmesh_trace.capture.version import unsupported_reason

    reason = unsupported_reason()
    if reason is not None:
        _warn(f"kmesh-trace: {reason}")
        return False
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    orig_init = Scheduler.__init__

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        out_dir = os.environ.get(ENV_DIR)
        if out_dir and getattr(self, "_kmesh_recorder", None) is None:
            from kmesh_trace.capture import hooks

            hooks.try_install(self, out_dir, _warn)  # a capture that cannot start must not stop the engine
        from kmesh_trace.capture import hold

        if hold.hold_enabled() and getattr(self, "_kmesh_hold", None) is None:
            from kmesh_trace.errors import KmeshTraceError

            try:  # after the capture, so its pool operations are recorded as held/released
                hold.install(self)
            except KmeshTraceError as e:  # a bad knob: the user's to fix, one line
                _warn(f"kmesh-trace: {e} The engine runs without holds.")
            except Exception:
                log.exception("kmesh-trace: could not start the hold controller; the engine runs without holds")

    orig_from_ecr = Request.from_engine_core_request.__func__

    @classmethod
    @functools.wraps(orig_from_ecr)
    def from_engine_core_request(cls, request, *args, **kwargs):
        req = orig_from_ecr(cls, request, *args, **kwargs)
        req._kmesh_caller_id = getattr(request, "external_req_id", None)
        return req

    Scheduler.__init__ = __init__
    Request.from_engine_core_request = from_engine_core_request
    if os.environ.get(ENV_DIR):
        _give_engine_cores_time_to_close()
    _installed = True
    return True


def _give_engine_cores_time_to_close() -> None:
    """In a front end (e.g. the OpenAI API server): let an engine core close its capture before it is killed.

    On SIGINT/SIGTERM the API server stops its engine-core processes through
    `vllm.v1.engine.utils.shutdown(procs, timeout)`: SIGTERM, wait `timeout` (0 unless the server was
    started with `--shutdown-timeout`), then SIGKILL. With a zero wait the engine core is killed while
    it tears down, before its recorder writes the last rows and marks the partition complete. With a
    capture running, the wait is at least `KMESH_TRACE_SHUTDOWN_GRACE_S` (default 30 s): an engine core
    that exits sooner ends the wait at once, one that hangs is still killed. Requests are not drained
    longer: the engine core's own `--shutdown-timeout` still decides that.
    """
    try:
        import vllm.v1.engine.utils as engine_utils
    except Exception:  # noqa: BLE001 (another vLLM layout: the guard above has already checked the hooks)
        return
    orig = getattr(engine_utils, "shutdown", None)
    if orig is None or getattr(orig, "_kmesh_grace", False):
        return
    from kmesh_trace.capture.env import shutdown_grace_s

    @functools.wraps(orig)
    def shutdown(procs, timeout=None):
        grace = shutdown_grace_s()
        return orig(procs, timeout=max(5.0 if timeout is None else timeout, grace))

    shutdown._kmesh_grace = True
    engine_utils.shutdown = shutdown


def _warn(line: str) -> None:
    # vLLM's logger is configured in every vLLM process; fall back to ours outside vLLM.
    try:
        from vllm.logger import init_logger

        init_logger("kmesh_trace.capture").warning(line)
    except Exception:
        log.warning(line)
