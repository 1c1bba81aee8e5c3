"""The one path policy: where a command may read and where it may write.

Every reader of a trace takes its parts through `inside(root, path)` (a part whose real path, symbolic
links resolved, lies outside the trace directory is refused: a trace must not be a window onto the
rest of the filesystem), and every command checks its outputs with `check_out_file` / `check_out_dir`
(a place it can write) and `check_out_not_in_input` (an output is never an input, nor inside one, nor
a link to one), before any work. Raising `KmeshTraceError`, these are usable below the CLI
(`kmesh_trace.trace`, `kmesh_trace.parts`, `kmesh_trace.native.store`); the CLI re-exports them from
`kmesh_trace.cli.common`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterable

from kmesh_trace.errors import KmeshTraceError, TraceNotFoundError

#: The file that makes a directory a kmesh-trace trace (its schema version inside).
TRACE_MARKER = "kmesh_trace.json"

__all__ = ["TRACE_MARKER", "check_free_space", "check_trace_directory", "check_out_dir", "check_out_file", "check_out_not_in_input", "free_space", "inside",
           "nearest_existing"]


def inside(root: str | os.PathLike, path: str | os.PathLike) -> bool:
    """Whether `path`'s real location (every symbolic link resolved) is `root`'s real location or under it."""
    r = Path(os.path.realpath(root))
    p = Path(os.path.realpath(path))
    return p == r or r in p.parents


def check_out_not_in_input(out_path: Path, inputs: Iterable[Path | str | None], option: str = "--out") -> Path:
    """Refuse an output path that is, or lies inside, one of the inputs the command reads (a corpus
    directory, a trace directory, a source file): writing there would change what is being read, or
    destroy it. Symbolic links are resolved first, so a link cannot slip past."""
    target = Path(os.path.realpath(out_path))
    for src in inputs:
        if src is None or "://" in str(src):
            continue
        s = Path(os.path.realpath(src))
        if target == s or s in target.parents:
            raise KmeshTraceError(f"{option} {out_path} is {'the input' if target == s else 'inside the input'} {src}; "
                                  f"write the output somewhere else.")
    return out_path


def check_out_file(path: Path, option: str) -> Path:
    """Refuse, before any work, a file the command could only fail to write at the end: a directory,
    or a parent directory that is missing or not writable."""
    if path.is_dir():
        raise KmeshTraceError(f"{option} {path} is a directory; give a file name.")
    parent = path.parent
    if not parent.is_dir():
        raise KmeshTraceError(f"cannot write {path}: the directory {parent} does not exist; create it first.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise KmeshTraceError(f"cannot write {path}: the directory {parent} is not writable; choose another {option}.")
    return path


def nearest_existing(path: Path) -> Path:
    """`path` itself or its nearest ancestor that exists (where a directory to be created would live)."""
    return next(p for p in (path, *path.absolute().parents) if p.exists())


def check_out_dir(path: Path, option: str) -> Path:
    """Refuse, before any work, a directory the command could not create or fill: an existing file, or
    a nearest existing ancestor that is not a writable directory (missing parents are created)."""
    if path.exists() and not path.is_dir():
        raise KmeshTraceError(f"{option} {path} is a file; give a directory.")
    nearest = nearest_existing(path)
    if not nearest.is_dir():
        raise KmeshTraceError(f"cannot create {path}: {nearest} is a file; choose another {option}.")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise KmeshTraceError(f"cannot write {path}: the directory {nearest} is not writable; choose another {option}.")
    return path


#: Room left on the filesystem after a store is written, so a write that fits is not the one that fills it.
FREE_SPACE_MARGIN = 64 << 20


def free_space(path: Path) -> int:
    """Free bytes on the filesystem where `path` is (or would be created)."""
    return shutil.disk_usage(nearest_existing(Path(path))).free


def check_free_space(path: Path, num_bytes: int, what: str) -> None:
    """Refuse to write `num_bytes` under `path` (created if missing) when its filesystem has less free."""
    free = free_space(path)
    if num_bytes + FREE_SPACE_MARGIN > free:
        raise KmeshTraceError(f"{what} needs {num_bytes / 2**30:,.2f} GiB but {nearest_existing(Path(path))} has "
                              f"{free / 2**30:,.2f} GiB free; free some space or write elsewhere.")


def check_trace_directory(path: str | os.PathLike) -> None:
    """Refuse, in one sentence, a path that is not a trace directory (no directory, or no trace marker):
    the first checks of opening a trace, cheap enough to make before the columnar libraries load."""
    if not Path(path).is_dir():
        raise TraceNotFoundError(f"{path} is not a directory; give the path of a kmesh-trace trace directory.")
    if not (Path(path) / TRACE_MARKER).is_file():
        raise TraceNotFoundError(f"{path} is not a kmesh-trace trace (no {TRACE_MARKER}); create one with "
                                 "`kmesh-trace import` or `kmesh-trace capture`.")
