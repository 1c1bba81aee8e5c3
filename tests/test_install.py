"""The install (the Makefile's `install` target): PyTorch's CPU build chosen portably by .ci/install-torch,
and the project's own packaging free of setuptools warnings."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "install-torch"

#: A stand-in for the venv's python: answers the installed-version probe from $FAKE_TORCH_INSTALLED, the
#: local-wheel probe (`pip install --dry-run --no-index ...`) from $FAKE_TORCH_LOCAL, and logs every pip call.
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-c" ]; then
  [ -n "$FAKE_TORCH_INSTALLED" ] || exit 1
  echo "$FAKE_TORCH_INSTALLED"; exit 0
fi
shift 2  # -m pip
case " $* " in
  *" --dry-run "*) [ "$FAKE_TORCH_LOCAL" = 1 ]; exit $? ;;
esac
echo "$*" >> "$FAKE_PIP_LOG"
"""


def _install_torch(tmp_path: Path, *, local: bool, installed: str = "") -> tuple[str, list[str]]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "pip.log"
    env = {**os.environ, "FAKE_TORCH_LOCAL": "1" if local else "0", "FAKE_TORCH_INSTALLED": installed,
           "FAKE_PIP_LOG": str(log)}
    env.pop("KMESH_TORCH_CPU_INDEX", None)
    r = subprocess.run([str(SCRIPT), str(fake), "2.13.0"], capture_output=True, text=True, env=env, check=True)
    assert r.stdout == ""
    return r.stderr, log.read_text().splitlines() if log.exists() else []


def test_a_local_wheel_is_installed_from_where_pip_finds_it(tmp_path):
    said, calls = _install_torch(tmp_path, local=True)
    assert said == "torch 2.13.0: installing the wheel pip finds locally (find-links)\n"
    assert calls == ["install --progress-bar off torch==2.13.0"]


def test_without_a_local_wheel_the_cpu_build_comes_from_pytorchs_cpu_index(tmp_path):
    said, calls = _install_torch(tmp_path, local=False)
    assert said == "torch 2.13.0: no local wheel; installing the CPU build from https://download.pytorch.org/whl/cpu\n"
    assert calls == ["install --progress-bar off --index-url https://download.pytorch.org/whl/cpu torch==2.13.0"]


def test_an_installed_torch_of_that_version_is_kept(tmp_path):
    said, calls = _install_torch(tmp_path, local=False, installed="2.13.0+cpu")
    assert said == "torch 2.13.0: already installed (2.13.0+cpu)\n"
    assert calls == []


def test_another_installed_version_is_replaced(tmp_path):
    said, calls = _install_torch(tmp_path, local=True, installed="2.12.1")
    assert calls == ["install --progress-bar off torch==2.13.0"]


def test_the_makefile_installs_torch_through_the_script():
    assert "\t.ci/install-torch $(PY) 2.13.0\n" in (ROOT / "Makefile").read_text()


def test_building_the_package_gives_no_setuptools_package_warning(tmp_path):
    """Templates are a declared package with their data; the C sources under native/kernels/ are not package
    data. (setuptools prints a 'Package would be ignored' box for a data directory it was not told about.)"""
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler: the wheel's native libraries cannot be built here")
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", str(src),
                        "-w", str(tmp_path / "dist")], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "would be ignored" not in r.stdout + r.stderr
    import zipfile

    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"kmesh_trace/apps/templates/report_page.html.j2",
            "kmesh_trace/apps/templates/report_pieces.html.j2"} <= set(names)
    assert not [n for n in names if n.endswith((".c", ".h"))]
