"""The version guard (capture/version.py): an unsupported vLLM is left untouched."""

from __future__ import annotations

import pytest


def test_version_guard_leaves_an_unsupported_vllm_untouched(monkeypatch):
    pytest.importorskip("vllm")
    import vllm
    from kmesh_trace.capture import plugin
    from kmesh_trace.capture.version import unsupported_reason
    from vllm.v1.core.sched.scheduler import Scheduler

    assert unsupported_reason("0.32.0") is None
    assert unsupported_reason("0.1.0") == ("vLLM 0.1.0 is not a version the capture hooks support "
                                           "(0.32.0, 0.33.0); the engine runs uncaptured.")
    lines = []
    monkeypatch.setattr(plugin, "_installed", False)
    monkeypatch.setattr(plugin, "_warn", lines.append)
    monkeypatch.setattr(vllm, "__version__", "0.1.0")
    monkeypatch.delenv("KMESH_TRACE_DIR", raising=False)
    init = Scheduler.__init__
    assert plugin.register() is False and lines == []  # disabled: silent
    monkeypatch.setenv("KMESH_TRACE_DIR", "/nonexistent")
    assert plugin.register() is False
    assert lines == ["kmesh-trace: vLLM 0.1.0 is not a version the capture hooks support (0.32.0, 0.33.0); "
                     "the engine runs uncaptured."]
    assert Scheduler.__init__ is init

