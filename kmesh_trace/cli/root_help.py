"""`kmesh-trace --help` (and a bare `kmesh-trace`) written from `kmesh_trace.cli.COMMANDS` alone, without
loading typer (whose import is most of the command's start-up): the same text, wrapped at the same width,
as the root group prints (click's help formatter: tests/test_cli_startup.py compares the two at many widths)."""

from __future__ import annotations

import shutil
import textwrap

USAGE = "[OPTIONS] COMMAND [ARGS]..."
VERSION_HELP = "Show the version and exit."
OPTIONS = (("--version", VERSION_HELP), ("--help", "Show this message and exit."))


def version_line() -> str:
    """`kmesh-trace --version`: the installed distribution's version (the source tree's when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("kmesh-trace")
    except PackageNotFoundError:
        from kmesh_trace import __version__ as v
    return f"kmesh-trace {v}\n"


def _wrap(text: str, width: int, initial: str = "", subsequent: str = "") -> list[str]:
    return textwrap.TextWrapper(width, initial_indent=initial, subsequent_indent=subsequent,
                                replace_whitespace=False).wrap(" ".join(text.split()))


def _definitions(rows, width: int, indent: int = 2, spacing: int = 2) -> list[str]:
    """A definition list as click's `HelpFormatter.write_dl` writes it (names within its 30-column cap)."""
    first = min(max(len(name) for name, _ in rows), 30) + spacing
    lines = []
    for name, text in rows:
        wrapped = _wrap(text, max(width - first - 2, 10))
        lines.append(" " * indent + name.ljust(first) + wrapped[0])
        lines += [" " * (first + indent) + line for line in wrapped[1:]]
    return lines


def root_help(columns: int | None = None) -> str:
    """The root's help text, ending in a newline, for a terminal of `columns` (None: this one's, as click asks)."""
    from kmesh_trace.cli import _APP_SETTINGS, COMMANDS

    columns = shutil.get_terminal_size().columns if columns is None else columns
    width = max(min(columns, 80) - 2, 50)
    prefix = f"Usage: {_APP_SETTINGS['name']} "
    lines = _wrap(USAGE, width, prefix, " " * len(prefix))
    lines += [""] + _wrap(_APP_SETTINGS["help"], width, "  ", "  ")
    lines += ["", "Options:"] + _definitions(OPTIONS, width)
    lines += ["", "Commands:"] + _definitions([(name, summary) for name, _, summary in COMMANDS], width)
    return "\n".join(lines) + "\n"
