"""What every CLI command shares: consoles (data to stdout, decoration to stderr), error handling, and
the checks of option values (integer lists, output paths) that must fail before any work is done."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import typer
from rich.console import Console

from kmesh_trace.errors import KmeshTraceError

out = Console(soft_wrap=True)  # data
err = Console(stderr=True)  # progress, decoration, errors


def fail(message: str, code: int = 1) -> None:
    """Print one `Error: ...` line on stderr and exit with `code`."""
    err.print(f"Error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def handles_errors(fn: Callable) -> Callable:
    """Turn a KmeshTraceError (or an unreadable file) into one `Error:` line and exit 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KmeshTraceError as e:
            fail(str(e))
        except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as e:
            fail(f"{e.strerror}: {e.filename}")

    return wrapper


def parse_ints(text: str, what: str) -> list[int]:
    """Comma-separated integers above zero (`--capacity-blocks 256,512`); an empty item, a non-integer
    or a value below 1 is one error naming the option `what`."""
    try:
        values = [int(x) for x in text.split(",")]  # int("") fails: an empty item is refused too
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise KmeshTraceError(f"{what} must be comma-separated integers above zero, e.g. 256,512,1024 (got {text!r}).")
    return values


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


def check_out_dir(path: Path, option: str) -> Path:
    """Refuse, before any work, a directory the command could not create or fill: an existing file, or
    a nearest existing ancestor that is not a writable directory (missing parents are created)."""
    if path.exists() and not path.is_dir():
        raise KmeshTraceError(f"{option} {path} is a file; give a directory.")
    nearest = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not nearest.is_dir():
        raise KmeshTraceError(f"cannot create {path}: {nearest} is a file; choose another {option}.")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise KmeshTraceError(f"cannot write {path}: the directory {nearest} is not writable; choose another {option}.")
    return path


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def progress(transient: bool = True):
    """A rich progress bar on stderr."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=err, transient=transient)


def run_tasks_with_progress(fn: Callable, tasks: list, *, ray: str | None, label: str) -> list:
    """`kmesh_trace.distributed.run_tasks` with a progress bar that advances as each task completes."""
    from kmesh_trace.distributed import run_tasks

    with progress() as bar:
        tid = bar.add_task(label, total=len(tasks))
        return run_tasks(fn, tasks, ray=ray, on_done=lambda t: bar.advance(tid))
