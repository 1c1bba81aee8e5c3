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
        _stop_output_handler_first()
        _close_before_teardown()
        _record_engine_death()
    _installed = True
    return True


def _give_engine_cores_time_to_close() -> None:
    """In a front end (e.g. the OpenAI API server): let an engine core close its capture before it is killed.

    On SIGINT/SIGTERM the API server stops its engine-core processes through
    `vllm.v1.engine.utils.shutdown(procs, timeout)`: SIGTERM, wait `timeout` (0 unless the server was
    started with `--shutdown-timeout`), then SIGKILL. With a zero wait the engine core is killed while
    it tears down, before its recorder writes the last rows and marks the partition complete. With a
    capture running, the SIGTERM goes out first and the front end waits until each engine core's
    partition is complete (or the process has exited), at most `KMESH_TRACE_SHUTDOWN_GRACE_S` (default
    30 s); then vLLM's own shutdown runs with the server's own timeout. The wait ends when the capture
    is closed, not when the process exits: vLLM's teardown after it (waiting for workers, freeing
    memory: seconds on a CPU) is not waited for, so a Ctrl-C stops a captured server about as fast as
    an uncaptured one. Requests are not drained longer: the engine core's own `--shutdown-timeout`
    still decides that.
    """
    try:
        import vllm.v1.engine.utils as engine_utils
    except Exception:  # noqa: BLE001 (another vLLM layout: the guard above has already checked the hooks)
        return
    orig = getattr(engine_utils, "shutdown", None)
    if orig is None or getattr(orig, "_kmesh_grace", False):
        return

    @functools.wraps(orig)
    def shutdown(procs, timeout=None):
        try:
            _stop_and_wait_for_captures(procs)
        except Exception:  # noqa: BLE001 (vLLM's own shutdown must run whatever happens here)
            log.exception("kmesh-trace: waiting for the engine cores' captures failed")
        return orig(procs, timeout=timeout)

    shutdown._kmesh_grace = True
    engine_utils.shutdown = shutdown


def _stop_output_handler_first() -> None:
    """In a front end (AsyncLLM): at shutdown, stop its output handler before the engine cores are stopped.

    vLLM's `AsyncLLM.shutdown` stops the engine cores first (with a capture: until each has closed its
    partition) and cancels the task that reads their outputs last. Meanwhile that task sees the engine
    core gone and logs `AsyncLLM output_handler failed` with an `EngineDeadError` traceback after a plain
    Ctrl-C. Here the task is cancelled first and each request still open is failed with the same
    `EngineDeadError` it would have got (none is left waiting for an output that cannot come); then vLLM's
    own shutdown runs as before."""
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.exceptions import EngineDeadError
    except Exception:  # noqa: BLE001 (another vLLM layout: its shutdown runs as it is)
        return
    orig = getattr(AsyncLLM, "shutdown", None)
    if orig is None or getattr(orig, "_kmesh_quiet", False):
        return

    @functools.wraps(orig)
    def shutdown(self, *args, **kwargs):
        try:
            _cancel_output_handler(self, EngineDeadError)
        except Exception:  # noqa: BLE001 (vLLM's own shutdown must run whatever happens here)
            log.exception("kmesh-trace: could not stop the output handler before the engine cores")
        return orig(self, *args, **kwargs)

    shutdown._kmesh_quiet = True
    AsyncLLM.shutdown = shutdown


def _cancel_output_handler(llm, dead_error: type[Exception]) -> None:
    from vllm.utils.async_utils import cancel_task_threadsafe

    handler = getattr(llm, "output_handler", None)
    if handler is None or handler.done():
        return
    cancel_task_threadsafe(handler)
    processor = getattr(llm, "output_processor", None)
    if processor is not None:
        processor.propagate_error(dead_error())


#: Seconds between two looks at the engine cores' partitions while a front end waits for them to close.
_CLOSE_POLL_S = 0.05


def _stop_and_wait_for_captures(procs) -> None:
    """SIGTERM each live engine-core process, then wait until each has exited or closed every partition
    it writes (at most the shutdown grace). A process that writes no partition is not waited for."""
    import json
    import time
    from pathlib import Path

    from kmesh_trace.capture.env import shutdown_grace_s

    engines = Path(os.environ[ENV_DIR]) / "engines"

    def open_partitions(pid: int) -> bool:
        for path in engines.glob("*.json"):
            try:
                meta = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(meta, dict) and meta.get("pid") == pid and not meta.get("complete"):
                return True
        return False

    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + shutdown_grace_s()
    while time.monotonic() < deadline:
        if not any(p.is_alive() and open_partitions(p.pid) for p in procs):
            return
        time.sleep(_CLOSE_POLL_S)


def _close_before_teardown() -> None:
    """In an engine core: close the capture when the engine core starts tearing down, before vLLM
    waits for its worker processes to exit (seconds), rather than when the scheduler is shut down
    last. Nothing is scheduled once the teardown starts; requests still in flight are recorded as
    unfinished, as at any close."""
    try:
        from vllm.v1.engine.core import EngineCore
    except Exception:  # noqa: BLE001 (another vLLM layout: the scheduler's shutdown still closes it)
        return
    orig = getattr(EngineCore, "shutdown", None)
    if orig is None or getattr(orig, "_kmesh_close", False):
        return

    @functools.wraps(orig)
    def shutdown(self, *args, **kwargs):
        rec = getattr(getattr(self, "scheduler", None), "_kmesh_recorder", None)
        if rec is not None:
            from kmesh_trace.capture import hooks

            hooks.close_recorder(rec)  # never raises
        return orig(self, *args, **kwargs)

    shutdown._kmesh_close = True
    EngineCore.shutdown = shutdown


def _record_engine_death() -> None:
    """In an engine core: when the engine dies of a fatal error, say so in each open partition's metadata.

    vLLM's engine core sends its front end `ENGINE_CORE_DEAD` (`EngineCoreProc._send_engine_dead`) from
    inside the `except` of its busy loop, e.g. when a worker process was killed (the OOM killer picks
    the worker that holds the KV cache) and the executor failed. The engine core then still shuts down
    cleanly, so its partition closes `complete`; `engine_died` keeps the capture from reading as a
    healthy run. (An engine core killed outright closes nothing: `kmesh-trace capture` says that one.)
    """
    try:
        from vllm.v1.engine.core import EngineCoreProc
    except Exception:  # noqa: BLE001 (another vLLM layout: the capture itself still runs)
        return
    orig = getattr(EngineCoreProc, "_send_engine_dead", None)
    if orig is None or getattr(orig, "_kmesh_death", False):
        return

    @functools.wraps(orig)
    def _send_engine_dead(self, *args, **kwargs):
        import sys

        try:
            from kmesh_trace.capture import hooks

            executor = getattr(self, "model_executor", None)
            hooks.record_death(sys.exc_info()[1], worker_died=bool(getattr(executor, "is_failed", False)))
        except Exception:  # noqa: BLE001 (the engine's own death notice must go out whatever happens here)
            log.exception("kmesh-trace: could not record the engine's death")
        return orig(self, *args, **kwargs)

    _send_engine_dead._kmesh_death = True
    EngineCoreProc._send_engine_dead = _send_engine_dead


def _warn(line: str) -> None:
    # vLLM's logger is configured in every vLLM process; fall back to ours outside vLLM.
    try:
        from vllm.logger import init_logger

        init_logger("kmesh_trace.capture").warning(line)
    except Exception:
        log.warning(line)
