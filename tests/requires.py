"""Skipping a test module when a package is missing, without importing it: `import vllm` alone takes about
10 s, which a module-level `pytest.importorskip("vllm")` spent at collection."""

from __future__ import annotations

import importlib.util

import pytest


def skip_module_without(package: str, reason: str | None = None) -> None:
    """Skip the calling module (at its top level) when the top-level `package` is not installed."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(reason or f"{package} is not installed", allow_module_level=True)
