"""The `kmesh-trace` command. Each command module owns its verbs and exposes `register(app)`."""

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

from kmesh_trace.cli import coercion

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


def _silence_stdout() -> None:
    """The reader of our output went away (`| head`): point stdout at /dev/null so the final flush at
    exit does not print a second error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


_APP_SETTINGS = dict(name="kmesh-trace", no_args_is_help=True,
                     help="Capture, analyse and replay the KV-cache life of LLM agent request families.")

#: Every command in --help order: its name, the module that registers it (`register(app)`), and the one-line
#: summary `kmesh-trace --help` lists (the first sentence of its help; tests/test_cli_startup.py checks that
#: each summary is the command's own). `kmesh-trace --help` reads only this table; a command imports its
#: module and builds its parameters only when it runs (or shows its own --help).
COMMANDS = (
    ("schema", "kmesh_trace.cli.core", "Show the trace schema: every table and column with type, unit and meaning"),
    ("info", "kmesh_trace.cli.core", "Tables, row counts and engine metadata of a trace"),
    ("sql", "kmesh_trace.cli.core", "Query a trace with DuckDB SQL (read-only, confined to the trace directory, "
                                    "bounded in memory and time)"),
    ("import", "kmesh_trace.cli.imports", "Import a public trace (Mooncake, Bailian, kv-cache-tester agentic "
                                          "conversations, LMCache agent traces) into a trace directory"),
    ("capture", "kmesh_trace.cli.capture", "Run COMMAND with the vLLM capture hook enabled, writing a trace to --out"),
    ("listen", "kmesh_trace.cli.listen", "Record the KV events of unmodified vLLM or SGLang engines into a trace at "
                                         "--out, until Ctrl-C"),
    ("residency", "kmesh_trace.cli.residency", "How long blocks stay resident, how soon dropped blocks come back, "
                                               "evictions over time, GPU <-> CPU movement"),
    ("headroom", "kmesh_trace.cli.headroom", "Prefill tokens (and seconds) the stock cache failed to reuse that an "
                                             "ideal cache of the same capacity would have: at the given capacities, "
                                             "or along the whole capacity axis"),
    ("pressure", "kmesh_trace.cli.pressure", "Replay the trace stock and with family holds through the vLLM "
                                             "block-pool model; report the tradeoff"),
    ("tiers", "kmesh_trace.cli.tiers", "Simulate the trace through the GPU pool and host/SSD tiers; hits by tier, "
                                       "bytes read, seconds saved, TTFT"),
    ("fleet", "kmesh_trace.cli.fleet", "Hit ratio, prefill tokens and load imbalance of each routing policy, and its "
                                       "gap to a global pool"),
    ("demo", "kmesh_trace.cli.demo", "Capture a real (tiny, CPU) vLLM engine running an agent workload, then analyse "
                                     "the capture"),
    ("report", "kmesh_trace.cli.report", "Write one self-contained HTML page (no network, inline SVG plots) with the "
                                         "capture summary, audit verdicts, the headroom curve, retention pressure "
                                         "along the capacity axis, lineage, the tiers sweep and (with several engines "
                                         "or families) the fleet what-if of a trace, capture or import; each section "
                                         "defines its terms and names the command that reproduces it"),
    ("lineage", "kmesh_trace.cli.lineage", "The shape of a trace's lineage: families, children per parent, depth, "
                                           "reuse gaps, shared-prefix blocks"),
    ("export", "kmesh_trace.cli.export", "Export a trace in other tools' formats"),
    ("replay", "kmesh_trace.cli.replay", "Replay KV restorations natively (io_uring, O_DIRECT, GPU routes) and "
                                         "verify them"),
    ("audit", "kmesh_trace.cli.audit", "Audit agent-trace corpora and captured traces for fitness"),
)


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


def __getattr__(name: str):
    """`kmesh_trace.cli.app`: the whole typer app, every command module imported (tests walk it, CliRunner runs
    it); made on first use, once."""
    if name == "app":
        globals()["app"] = built = _typer_app(dict.fromkeys(m for _, m, _ in COMMANDS))
        return built
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    try:
        _lazy_group().main()
    finally:
        try:
            sys.stdout.flush()
        except BrokenPipeError:  # the reader left after our last write
            _silence_stdout()
