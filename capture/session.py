"""Capturing a workload from Python: `capture_in_process(out_dir)`.

    from kmesh_trace.capture.session import capture_in_process

    with capture_in_process("trace-out") as session:
        llm = LLM(model=..., enable_prefix_caching=True, ...)   # built inside the block
        llm.generate(prompts, SamplingParams(..., extra_args={"kmesh_family": "f", "kmesh_parent": "0"}))
    # every engine built inside the block is recorded; on exit its partition is flushed and
    # marked complete, and the hooks are removed (later engine activity is not recorded, and
    # nothing of the capture keeps the engine alive); session.engine_ids lists them.

It sets `KMESH_TRACE_DIR` for the block (so engine-core processes spawned inside it capture too,
through the plugin entry point) and installs the hooks in this process even if vLLM loaded its
plugins before the variable was set. With `VLLM_ENABLE_V1_MULTIPROCESSING=0` the engine core runs
in this process; otherwise each spawned engine core records its own partition and closes it when
the engine shuts down.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kmesh_trace.capture import plugin
from kmesh_trace.capture.env import ENV_DIR

from kmesh_trace.errors import KmeshTraceError


@dataclass
class CaptureSession:
    path: Path
    recorders: list = field(default_factory=list)

    @property
    def engine_ids(self) -> list[str]:
        return [r.engine_id for r in self.recorders]


@contextmanager
def capture_in_process(out_dir: str | os.PathLike, *, flush_interval_s: float | None = None,
                       max_buffered_events: int | None = None, max_buffered_requests: int | None = None,
                       lineage_window: int | None = None) -> Iterator[CaptureSession]:
    """Record every vLLM engine built inside the block into the trace directory `out_dir`."""
    from kmesh_trace.capture import hooks
    from kmesh_trace.capture.config import ENV_NAMES, check_knob

    knobs = {"flush_interval_s": flush_interval_s, "max_buffered_events": max_buffered_events,
             "max_buffered_requests": max_buffered_requests, "lineage_window": lineage_window}
    for key, value in knobs.items():  # here, not in the engine, which would run uncaptured
        if value is not None:
            check_knob(key, value, key)
    path = Path(out_dir).resolve()
    env = {ENV_DIR: str(path)}
    for key, value in knobs.items():
        if value is not None:
            env[ENV_NAMES[key]] = str(value)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    session = CaptureSession(path)

    def started(rec) -> None:  # also sees engines that shut down (and closed) inside the block
        if str(Path(rec.path).resolve()) == str(path):
            session.recorders.append(rec)

    hooks.INSTALL_LISTENERS.append(started)
    try:
        if not plugin.register():
            from kmesh_trace.capture.version import unsupported_reason

            raise KmeshTraceError(unsupported_reason() or "the capture hooks could not be installed.")
        yield session
    finally:
        hooks.INSTALL_LISTENERS.remove(started)
        for rec in session.recorders:
            hooks.close_recorder(rec)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
