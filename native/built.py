"""Where setup.py left a shared object of this package (the replay library, the analysis kernels)."""

from __future__ import annotations

import importlib.machinery
import os
from pathlib import Path

from kmesh_trace.errors import MissingDependencyError

_HERE = Path(__file__).resolve().parent


def find_built(stem: str, override_env: str) -> Path | None:
    """The built `stem` (e.g. `_kmesh_replay`) next to this module, or the path in `override_env`."""
    override = os.environ.get(override_env)
    if override:
        return Path(override)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = _HERE / f"{stem}{suffix}"
        if p.exists():
            return p
    found = sorted(_HERE.glob(f"{stem}*.so"))
    return found[0] if found else None


def built_path(stem: str, override_env: str, what: str) -> Path:
    """`find_built`'s path; MissingDependencyError with the build command when `what` was not built."""
    path = find_built(stem, override_env)
    if path is None:
        raise MissingDependencyError(
            f"{what} is not built; run `pip install -e .` (or `pip install .`) in the kmesh-trace checkout "
            "with a C compiler available")
    return path
