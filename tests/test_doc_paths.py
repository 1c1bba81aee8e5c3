"""Docs and docstrings cite only files that exist in the repository.

A path is a token starting with a top-level directory of the repository (`kmesh_trace/`, `capture/`,
`docs/`, ...) that names a file (it has a suffix) or a directory (it ends with `/`), or a bare Markdown
file name; every one named in README.md, docs/, benchmarks/README.md or a docstring of any Python file
must be in the tree. A bare Markdown name counts in the citing document's own directory (a relative
link) or at the root. Patterns (`*`, `<engine_id>`) and URLs are not paths.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = ("kmesh_trace", "capture", "audit", "oracle", "native", "datasets", "docs", "benchmarks", "tests", ".ci")
_PATH = re.compile(r"(?<![\w./:-])((?:%s)/[\w./-]*[\w/]|[\w-]+\.md)(?![\w*<{])" % "|".join(re.escape(t) for t in TOP))


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: cannot list the repository's files")
    return out.splitlines()


def paths_in(text: str) -> list[str]:
    out = []
    for m in _PATH.finditer(text):
        p = m.group(1).rstrip(".")
        if re.search(r"[*<>{}]", p) or not (p.endswith("/") or "." in p.rsplit("/", 1)[-1]):
            continue  # a pattern, or a word pair like "capture/off"
        out.append(p)
    return out


def missing(text: str, files: set[str], dirs: set[str], here: str = "") -> list[str]:
    bad = []
    for p in paths_in(text):
        p = p.rstrip("/")
        if "/" not in p:  # a bare Markdown name: beside the citing document, or at the root
            ok = p in files or (here and f"{here}/{p}" in files)
        else:
            ok = p in files or p in dirs
        if not ok:
            bad.append(p)
    return bad


def _docstrings(path: Path) -> str:
    tree = ast.parse(path.read_text(), str(path))
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    return "\n".join(d for n in nodes if (d := ast.get_docstring(n, clean=False)))


def test_the_checker_finds_a_missing_path():
    files, dirs = {"README.md", "capture/hold.py"}, {"capture"}
    text = "see `kmesh_trace/datasets/agent_workload.py`, capture/hold.py, DESIGN.md, README.md and part-*.parquet"
    assert missing(text, files, dirs) == ["kmesh_trace/datasets/agent_workload.py", "DESIGN.md"]


def test_every_cited_path_exists():
    tracked = _tracked()
    files = set(tracked)
    dirs = {str(Path(f).parents[i]) for f in tracked for i in range(len(Path(f).parents) - 1)}
    sources = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = {}
    for src in sources:
        here = str(src.parent.relative_to(ROOT)).replace(".", "")
        if m := missing(src.read_text(), files, dirs, here):
            bad[str(src.relative_to(ROOT))] = m
    for f in tracked:
        if f.endswith(".py") and (ROOT / f).is_file():
            if m := missing(_docstrings(ROOT / f), files, dirs):
                bad[f] = m
    assert not bad, f"paths that are not in the repository: {bad}"
