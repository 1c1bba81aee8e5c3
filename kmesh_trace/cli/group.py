"""The `kmesh-trace` command as typer runs it: the root group (`_Group`, one line per failure), built lazily
from `kmesh_trace.cli.COMMANDS`, and the whole app (`kmesh_trace.cli.app`)."""

from __future__ import annotations

import errno
import importlib
import os
import sys
from collections.abc import Mapping
from gettext import gettext

import typer
import typer.main
from typer import _click
from typer.core import TyperGroup

from kmesh_trace.cli import _APP_SETTINGS, COMMANDS, DEBUG_ENV, EXIT_INTERRUPTED, _silence_stdout, coercion, help_text
from kmesh_trace.cli.root_help import VERSION_HELP, version_line


class _Interrupted(Exception):
    """Ctrl-C inside a command; typer would turn a bare KeyboardInterrupt into a silent exit 130."""


def _print_version(ctx, _param, value) -> None:
    if value and not ctx.resilient_parsing:
        sys.stdout.write(version_line())
        ctx.exit(0)


class _Group(TyperGroup):
    """The one place where a failure becomes one line on stderr and an exit code.

    Usage mistakes (missing argument, unknown option, bad choice) and aborts: `Error: ...`, exit 1.
    Ctrl-C: `Error: interrupted.`, exit 130. A closed output pipe (`... | head`): quiet. Any other
    exception is a bug: one line naming it and where to report it, exit 1 (the traceback with
    KMESH_TRACE_DEBUG=1). Help and the commands' own exit codes pass through unchanged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from typer._click.decorators import option
        from typer._coercion import bool_flag_type_descriptor

        # As typer makes the --help option (typer._click.decorators.help_option): a flag that acts and exits.
        option(["--version"], is_flag=True, expose_value=False, is_eager=True, help=VERSION_HELP,
               callback=_print_version, required=False, type_descriptor=bool_flag_type_descriptor())(self)
        self.params.insert(0, self.params.pop())

    def list_commands(self, ctx) -> list[str]:
        return list(self.commands)  # names only: a lazy group builds nothing to list them

    def format_commands(self, ctx, formatter) -> None:
        summary = getattr(self.commands, "summary", None)
        if summary is None:
            return super().format_commands(ctx, formatter)
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names))
        with formatter.section(gettext("Commands")):  # as TyperGroup.format_commands writes them
            formatter.write_dl([(name, summary(name, limit)) for name in names])

    def parse_args(self, ctx, args):
        coercion.install(self, ctx)  # option values converted without pydantic where that is exact
        return super().parse_args(ctx, args)

    def resolve_command(self, ctx, args):
        name, command, rest = super().resolve_command(ctx, args)
        if command is not None:
            coercion.install(command, ctx)
            help_text.install(command)
        return name, command, rest

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


def _typer_app(modules) -> typer.Typer:
    """A typer app with the commands of `modules` registered (each module's `register(app)`)."""
    app = typer.Typer(cls=_Group, pretty_exceptions_enable=False, add_completion=False, **_APP_SETTINGS)
    for name in modules:
        importlib.import_module(name).register(app)
    _help_fits_the_terminal(app)
    return app


class _Commands(Mapping):
    """The commands of the lazy group (`_lazy_group`): every name is known up front (from COMMANDS, for the
    listing, "did you mean" and dispatch); a command's module is imported and its click command built on the
    first lookup of one of its names."""

    def __init__(self):
        self._built: dict = {}

    def __iter__(self):
        return iter(name for name, _, _ in COMMANDS)

    def __len__(self) -> int:
        return len(COMMANDS)

    def __getitem__(self, name: str):
        if name not in self._built:
            module = next((m for n, m, _ in COMMANDS if n == name), None)
            if module is None:
                raise KeyError(name)
            self._built.update(typer.main.get_group(_typer_app([module])).commands)
        return self._built[name]

    def summary(self, name: str, limit: int) -> str:
        """The command's line in `kmesh-trace --help`, without building it (no command is hidden)."""
        if name in self._built:
            return self._built[name].get_short_help_str(limit)
        return next(s for n, _, s in COMMANDS if n == name)


def _lazy_group() -> "_Group":
    """The root command as `main` runs it: built from COMMANDS alone; one command built when it is run."""
    return _Group(commands=_Commands(), rich_markup_mode=None, **_APP_SETTINGS)


def whole_app() -> typer.Typer:
    """Every command module imported, in one typer app (tests walk it, CliRunner runs it)."""
    return _typer_app(dict.fromkeys(m for _, m, _ in COMMANDS))


def run() -> None:
    """The command line as the lazy group parses and runs it."""
    _lazy_group().main()
