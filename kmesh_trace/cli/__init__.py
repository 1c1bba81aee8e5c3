"""The `kmesh-trace` command. Each command module owns its verbs and exposes `register(app)`."""

from __future__ import annotations

import importlib
import sys

import typer
from typer import _click
from typer.core import TyperGroup


class _Group(TyperGroup):
    """Usage mistakes (missing argument, unknown option, bad choice) become one `Error: ...` line and
    exit 1, like every other error of the command; help and exit codes pass through unchanged."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _click.exceptions.ClickException as e:
            if not e.format_message():  # a bare group: its help was shown, nothing failed
                sys.exit(0)
            hint = ""
            ctx = getattr(e, "ctx", None)
            if ctx is not None:
                hint = f" (see '{ctx.command_path} --help')"
            sys.stderr.write(f"Error: {e.format_message()}{hint}\n")
            sys.exit(1)
        except _click.exceptions.Abort:
            sys.stderr.write("Error: aborted.\n")
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    cls=_Group,
    name="kmesh-trace",
    help="Capture, analyse and replay the KV-cache life of LLM agent request families.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# One line per command module; a module registers its own commands (and sub-apps) on `app`.
_COMMAND_MODULES = [
    "kmesh_trace.cli.core",  # schema, info, sql
    "kmesh_trace.cli.imports",  # import
    "kmesh_trace.cli.capture",  # capture
    "kmesh_trace.cli.headroom",  # headroom
    "kmesh_trace.cli.pressure",  # pressure
    "kmesh_trace.cli.tiers",  # tiers
    "kmesh_trace.cli.fleet",  # fleet
    "kmesh_trace.cli.export",  # export perfetto
    "kmesh_trace.cli.replay",  # replay probe|prepare|run
    "kmesh_trace.cli.demo",  # demo
    "kmesh_trace.cli.audit",  # audit corpus|capture
    "kmesh_trace.cli.report",  # report
    "kmesh_trace.cli.lineage",  # lineage
]

for _name in _COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main() -> None:
    app()
