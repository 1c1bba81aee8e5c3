"""The `kmesh-trace` command. Each command module owns its verbs and exposes `register(app)`."""

from __future__ import annotations

import errno
import importlib
import os
import sys

import typer
from typer import _click
from typer.core import TyperGroup

#: Set to 1 to see the traceback of an unexpected error instead of its one-line summary.
DEBUG_ENV = "KMESH_TRACE_DEBUG"
EXIT_INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


class _Interrupted(Exception):
    """Ctrl-C inside a command; typer would turn a bare KeyboardInterrupt into a silent exit 130."""


class _Group(TyperGroup):
    """The one place where a failure becomes one line on stderr and an exit code.

    Usage mistakes (missing argument, unknown option, bad choice) and aborts: `Error: ...`, exit 1.
    Ctrl-C: `Error: interrupted.`, exit 130. A closed output pipe (`... | head`): quiet. Any other
    exception is a bug: one line naming it and where to report it, exit 1 (the traceback with
    KMESH_TRACE_DEBUG=1). Help and the commands' own exit codes pass through unchanged."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise _Interrupted() from None

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _click.exceptions.ClickException as e:
            if isinstance(e, getattr(_click.exceptions, "NoArgsIsHelpError", ())):  # a bare group: its help
                sys.stdout.write(e.format_message() + "\n")
                sys.exit(0)
            if not e.format_message():  # a bare group: its help was shown, nothing failed
                sys.exit(0)
            hint = ""
            ctx = getattr(e, "ctx", None)
            if ctx is not None:
                hint = f" (see '{ctx.command_path} --help')"
            _error(f"{e.format_message()}{hint}")
            sys.exit(1)
        except typer.Abort:
            _error("aborted.")
            sys.exit(1)
        except (_Interrupted, KeyboardInterrupt):
            _error("interrupted.")
            sys.exit(EXIT_INTERRUPTED)
        except SystemExit:
            raise
        except BrokenPipeError:
            _silence_stdout()
            sys.exit(1)
        except BaseException as e:  # Exception, and the BaseException a Rust panic in a dependency raises
            if isinstance(e, GeneratorExit):
                raise
            if isinstance(e, OSError) and e.errno == errno.EPIPE:
                _silence_stdout()
                sys.exit(1)
            if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
                raise
            _error(f"unexpected {type(e).__name__}: {_first_line(e)}. This is a bug in kmesh-trace: please report it "
                   f"with the command you ran and the traceback that {DEBUG_ENV}=1 prints.")
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"


def _error(message: str) -> None:
    from kmesh_trace.cli.display import error_line  # control characters in a message (a flag's value) shown

    try:
        sys.stderr.write(error_line(message))
        sys.stderr.flush()
    except OSError:
        pass  # stderr is gone too: the exit code is all that is left


def _silence_stdout() -> None:
    """The reader of our output went away (`| head`): point stdout at /dev/null so the final flush at
    exit does not print a second error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


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
    "kmesh_trace.cli.listen",  # listen (KV events of unmodified engines)
    "kmesh_trace.cli.residency",  # residency (of a KV-events recording)
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


def _help_fits_the_terminal(group: typer.Typer) -> None:
    """--help as click writes it (wrapped whole words at the terminal's width), not typer's rich panels,
    whose option column cuts long option names (`--kv-bytes-per-t…`) at 80 columns; every sub-app too."""
    group.rich_markup_mode = None
    for c in group.registered_commands:  # click cuts a long first line with "..." in the command list
        c.short_help = c.short_help or _first_sentence(c.help or (c.callback.__doc__ if c.callback else "") or "")
    for g in group.registered_groups:
        info = g.typer_instance.info
        g.short_help = g.short_help or _first_sentence(g.help or getattr(info, "help", None) or "")
        _help_fits_the_terminal(g.typer_instance)


def _first_sentence(text: str) -> str | None:
    text = " ".join(str(text).split())
    return text.split(". ")[0].rstrip(".") if text else None


_help_fits_the_terminal(app)


def main() -> None:
    try:
        app()
    finally:
        try:
            sys.stdout.flush()
        except BrokenPipeError:  # the reader left after our last write
            _silence_stdout()
