"""The `kmesh-trace` command. Each command module owns its verbs and exposes `register(app)`; the root group
that runs them is `kmesh_trace.cli.group` (typer), which imports a command's module only when it runs."""

from __future__ import annotations

import sys


def __getattr__(name: str):
    """`kmesh_trace.cli.app`: the whole typer app, every command module imported (tests walk it, CliRunner runs
    it), made on first use, once; `_lazy_group`: the root group as `main` runs it."""
    if name == "app":
        from kmesh_trace.cli.group import whole_app

        globals()["app"] = built = whole_app()
        return built
    if name == "_lazy_group":
        from kmesh_trace.cli.group import lazy_group

        return lazy_group
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    from kmesh_trace.cli.group import run, silence_stdout

    try:
        run()
    finally:
        try:
            sys.stdout.flush()
        except BrokenPipeError:  # the reader left after our last write
            silence_stdout()
