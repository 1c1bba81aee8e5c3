"""What every CLI command shares: consoles (data to stdout, decoration to stderr) and error handling."""

from __future__ import annotations

import functools
import json
import sys
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


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def progress(transient: bool = True):
    """A rich progress bar on stderr."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=err, transient=transient)
