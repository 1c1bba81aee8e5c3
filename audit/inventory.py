"""Walking a corpus directory: which files exist, which source each belongs to, what kind each is.

A source is a top-level directory of DIR; files directly under DIR form the root source `.`.
Files are JSONL (`.jsonl`, `.ndjson`), READMEs, tooling (code and configuration) or other.
Symbolic links are followed only while their target stays inside DIR, and a target already
walked is not walked twice (listed as an alias); links that leave DIR are listed, never followed.
Hidden entries (names starting with `.`, such as `.git`) are counted and skipped. A directory
that cannot be listed is recorded, not fatal, except DIR itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from kmesh_trace.errors import KmeshTraceError

ROOT_SOURCE = "."
JSONL_SUFFIXES = (".jsonl", ".ndjson")
TOOLING_SUFFIXES = frozenset({
    ".py", ".sh", ".bash", ".js", ".mjs", ".cjs", ".ts", ".rb", ".go", ".rs", ".java", ".c", ".cc", ".cpp",
    ".h", ".hpp", ".ipynb", ".yaml", ".yml", ".toml", ".json", ".cfg", ".ini", ".conf", ".lock", ".ps1",
})
TOOLING_NAMES = frozenset({"dockerfile", "makefile", "requirements.txt", "procfile", "justfile"})


class CorpusUnreadableError(KmeshTraceError):
    """DIR itself cannot be audited (missing, not a directory, or not readable)."""


@dataclass
class SourceFiles:
    """Files of one source, as paths relative to DIR (POSIX separators), in walk order."""

    jsonl: list[str] = field(default_factory=list)
    readmes: list[str] = field(default_factory=list)
    tooling: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)


@dataclass
class Inventory:
    root: Path
    sources: dict[str, SourceFiles] = field(default_factory=dict)
    #: Every directory walked (relative, without DIR itself) -> its source.
    directories: list[str] = field(default_factory=list)
    skipped_symlinks: list[str] = field(default_factory=list)
    symlink_aliases: list[str] = field(default_factory=list)
    unreadable_dirs: list[str] = field(default_factory=list)
    num_hidden_skipped: int = 0

    def source(self, name: str) -> SourceFiles:
        return self.sources.setdefault(name, SourceFiles())


def file_kind(name: str) -> str:
    low = name.lower()
    if low.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if low.startswith("readme"):
        return "readme"
    if low in TOOLING_NAMES or os.path.splitext(low)[1] in TOOLING_SUFFIXES:
        return "tooling"
    return "other"


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def walk(directory: str | os.PathLike) -> Inventory:
    """Inventory `directory`; raises CorpusUnreadableError when it cannot be listed at all."""
    root = Path(directory)
    if not root.exists():
        raise CorpusUnreadableError(f"{directory} does not exist; give the directory that holds the corpus.")
    if not root.is_dir():
        raise CorpusUnreadableError(f"{directory} is not a directory; give the directory that holds the corpus.")
    real_root = os.path.realpath(root)
    inv = Inventory(root=Path(real_root))
    try:
        top = sorted(os.scandir(real_root), key=lambda e: e.name)
    except OSError as e:
        raise CorpusUnreadableError(f"cannot list {directory} ({e.strerror}); check its permissions.") from None
    seen: set[str] = {real_root}
    _walk_entries(inv, top, "", None, real_root, seen)
    return inv


def _walk_entries(inv: Inventory, entries: list[os.DirEntry], rel_dir: str, source: str | None,
                  real_root: str, seen: set[str]) -> None:
    # Depth first, in name order, with an explicit stack: a directory nested thousands deep is walked,
    # not a RecursionError.
    stack = [(iter(entries), rel_dir, source)]
    while stack:
        it, rel_dir, source = stack[-1]
        entry = next(it, None)
        if entry is None:
            stack.pop()
            continue
        rel = f"{rel_dir}{entry.name}"
        if entry.name.startswith("."):
            inv.num_hidden_skipped += 1
            continue
        path = entry.path
        try:
            if entry.is_symlink():
                target = os.path.realpath(path)
                if not _inside(target, real_root):
                    inv.skipped_symlinks.append(rel)
                    continue
                path = target
            real = os.path.realpath(path)
            is_dir = os.path.isdir(path)
            is_file = not is_dir and os.path.isfile(path)
        except OSError:
            inv.unreadable_dirs.append(rel)
            continue
        if not (is_dir or is_file):
            continue  # a dangling link, a socket, a fifo: nothing to read
        if real in seen:
            inv.symlink_aliases.append(rel)
            continue
        seen.add(real)
        if is_dir:
            src = source if source is not None else entry.name
            inv.source(src)
            inv.directories.append(rel)
            try:
                children = sorted(os.scandir(path), key=lambda e: e.name)
            except OSError:
                inv.unreadable_dirs.append(rel)
                continue
            stack.append((iter(children), rel + "/", src))
        else:
            files = inv.source(source if source is not None else ROOT_SOURCE)
            getattr(files, {"jsonl": "jsonl", "readme": "readmes", "tooling": "tooling", "other": "other"}[file_kind(entry.name)]).append(rel)
