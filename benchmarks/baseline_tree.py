"""`kmesh-trace` as of an earlier commit, for before / after figures taken in one run (the benchmarks'
`--baseline COMMIT`): the commit's tree from `git archive` in a directory of the caller's, laid out as the
package installs (kmesh_trace/oracle, kmesh_trace/audit, ...), its native libraries built from its own
sources (copied from this checkout when they do not build), run with `python -P` and PYTHONPATH ahead of
this checkout's editable install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Where each subpackage lives in the repository (pyproject.toml's package-dir).
PACKAGE_DIRS = ("capture", "audit", "oracle", "native", "datasets")


def baseline_python(commit: str, tmp: Path) -> list[str]:
    """The command line of a Python that imports `kmesh_trace` as of `commit` (its tree made under `tmp` once)."""
    root = tmp / f"baseline-{commit}"
    if not root.exists():
        root.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
        for d in PACKAGE_DIRS:
            (root / "kmesh_trace" / d).symlink_to(root / d)
        # The commit's own native sources, built there: this checkout's library may lack entry points it calls.
        built = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=root,
                               capture_output=True).returncode == 0
        for so in () if built else (REPO / "native").glob("*.so"):
            (root / "native" / so.name).write_bytes(so.read_bytes())
    return ["env", f"PYTHONPATH={root}", sys.executable, "-P"]


def baseline_command(commit: str, tmp: Path) -> list[str]:
    """The command line that runs `kmesh-trace` as of `commit` (its tree made under `tmp` once)."""
    code = "import sys; from kmesh_trace.cli import main; sys.argv[0] = 'kmesh-trace'; main()"
    return baseline_python(commit, tmp) + ["-c", code]
