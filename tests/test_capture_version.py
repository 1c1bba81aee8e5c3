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



def test_the_version_is_read_without_importing_vllm():
    """`kmesh-trace capture` checks the version in its own process before the server starts: from vllm/_version.py,
    not `import vllm` (seconds, and torch)."""
    import subprocess
    import sys

    pytest.importorskip("vllm")
    from kmesh_trace.capture.version import SUPPORTED_VLLM_VERSIONS

    code = ("import sys\nfrom kmesh_trace.capture.version import unsupported_reason, vllm_version\n"
            "print(vllm_version(), unsupported_reason(check_hooks=False), 'vllm' in sys.modules, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    found, reason, *imported = r.stdout.split()
    assert found.split("+")[0] in SUPPORTED_VLLM_VERSIONS and (reason, imported) == ("None", ["False", "False"])
