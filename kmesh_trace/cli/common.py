"""What every CLI command shares: consoles (data to stdout, decoration to stderr), error handling, and
the checks of option values (integer lists, output paths) that must fail before any work is done."""

from __future__ import annotations

import errno
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
        except OSError as e:
            if e.errno == errno.EPIPE or e.strerror is None:
                raise  # a closed pipe is quiet; an OSError without an errno is not the environment's
            fail(os_error_message(e))
        except MemoryError:
            fail("this machine ran out of memory for the command; ask for less (a smaller --capacity-blocks, "
                 "fewer rows) or run it on a larger machine.")
        except Exception as e:
            damage = _read_damage(e)
            if damage is None:
                raise
            fail(str(damage))

    return wrapper


def os_error_message(e: OSError) -> str:
    """An operating-system refusal as one sentence: what failed, on which file, and what to do."""
    hint = {errno.ENOSPC: "free some space or write elsewhere", errno.EROFS: "write to a writable filesystem",
            errno.EDQUOT: "free some space or write elsewhere", errno.EACCES: "check its permissions",
            errno.EPERM: "check its permissions"}.get(e.errno)
    where = f": {e.filename}" if e.filename is not None else ""
    return f"{e.strerror}{where}" + (f"; {hint}." if hint else "")


def _read_damage(e: Exception):
    """A decoding error from polars, Arrow or DuckDB while a trace is open: the damaged part, if one is."""
    if type(e).__module__.split(".")[0] not in ("polars", "pyarrow", "duckdb", "_duckdb"):
        return None
    from kmesh_trace.trace import locate_damage

    return locate_damage(e)


def check_out_not_in_input(out_path: Path, inputs: "list[Path | None] | tuple[Path | None, ...]",
                           option: str = "--out") -> Path:
    """Refuse an output path that is, or lies inside, one of the inputs the command reads (a corpus
    directory, a trace directory, a source file): writing there would change what is being read, or
    destroy it. Symbolic links are resolved first, so a link cannot slip past."""
    target = out_path.resolve()
    for src in inputs:
        if src is None:
            continue
        s = Path(src).resolve()
        if target == s or s in target.parents:
            raise KmeshTraceError(f"{option} {out_path} is {'the input' if target == s else 'inside the input'} {src}; "
                                  f"write the output somewhere else.")
    return out_path


#: Block counts are int32 in the contract (block ids); a larger capacity names no pool.
MAX_BLOCKS = (1 << 31) - 1


def parse_ints(text: str, what: str, maximum: int = MAX_BLOCKS) -> list[int]:
    """Comma-separated integers above zero and at most `maximum` (`--capacity-blocks 256,512`); an empty
    item, a non-integer or a value out of range is one error naming the option `what`."""
    try:
        values = [int(x) for x in text.split(",")]  # int("") fails: an empty item is refused too
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise KmeshTraceError(f"{what} must be comma-separated integers above zero, e.g. 256,512,1024 (got {text!r}).")
    if any(v > maximum for v in values):
        raise KmeshTraceError(f"{what} values must be at most {maximum:,} (got {text!r}).")
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
