"""The `kmesh-trace` command as typer runs it: the root group, whose commands are loaded when one runs (their
modules listed in COMMANDS, each exposing `register(app)`), and where a failure becomes one line on stderr."""

from __future__ import annotations

import errno
import importlib
import inspect
import os
import re
import sys

import typer
import typer.main
from typer.core import TyperGroup

from kmesh_trace.cli.help_text import install as tidy_help

#: Set to 1 to see the traceback of an unexpected error instead of its one-line summary.
DEBUG_ENV = "KMESH_TRACE_DEBUG"
EXIT_INTERRUPTED = 130  # the shell's code for a process ended by SIGINT

_APP_SETTINGS = dict(name="kmesh-trace", no_args_is_help=True,
                     help="Capture, analyse and replay the KV-cache life of LLM agent request families.")

#: Every command in --help order: its name, the module that registers it (`register(app)`), and the one-line
#: summary `kmesh-trace --help` lists (the first sentence of its help; tests/test_cli_startup.py checks that
#: each summary is the command's own). the root's help lists them from this table; a command imports its module
#: and builds its parameters only when it runs (or shows its own --help).
COMMANDS = (
    ("advise", "kmesh_trace.cli.advise", "The answer in one place: the hit-ratio ladder from the infinite cache to "
                                         "what the engine reached, with holds, host/SSD tiers and N engines, and "
                                         "the smallest configuration within --within percent of the bound"),
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
    ("simulate", "kmesh_trace.cli.simulate", "Run the source's requests through vLLM's own scheduler and KV cache "
                                             "manager in simulated time (no model, no GPU) and write the run as a "
                                             "trace: hits, TTFT, throughput and preemptions under the engine flags "
                                             "you give"),
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



class _Interrupted(Exception):
    """Ctrl-C inside a command; typer would turn a bare KeyboardInterrupt into a silent exit 130."""


def silence_stdout() -> None:
    """The reader of our output went away (`| head`): point stdout at /dev/null so the final flush at
    exit does not print a second error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


class _HelpGroup(TyperGroup):
    """A group whose unset --help is False rather than None: typer converts no bool a flag already holds, so a
    command's --help does not build (and import pydantic for) a converter of the group's own --help."""

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None and option.default is None:
            option.default = False
        return option


class _Group(_HelpGroup):
    """The root group: a command's module is imported, and its click command built, when the command is looked
    up (to run it or show its help); the listing in --help reads the summaries of COMMANDS instead.

    The one place where a failure becomes one line on stderr and an exit code. Usage mistakes (missing
    argument, unknown option, bad choice) and aborts: `Error: ...`, exit 1. Ctrl-C: `Error: interrupted.`,
    exit 130. A closed output pipe (`... | head`): quiet. Any other exception is a bug: one line naming it
    and where to report it, exit 1 (the traceback with KMESH_TRACE_DEBUG=1). Help and the commands' own exit
    codes pass through unchanged."""

    def list_commands(self, ctx) -> list[str]:
        return [name for name, _, _ in COMMANDS]

    def get_command(self, ctx, name: str):
        if name not in self.commands:
            module = next((m for n, m, _ in COMMANDS if n == name), None)
            if module is None:
                return None
            self.commands.update(typer.main.get_group(_typer_app([module])).commands)
        return self.commands.get(name)

    def format_commands(self, ctx, formatter) -> None:
        from gettext import gettext

        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names))
        summaries = {n: s for n, _, s in COMMANDS}
        rows = [(n, self.commands[n].get_short_help_str(limit) if n in self.commands else summaries[n]) for n in names]
        with formatter.section(gettext("Commands")):  # as TyperGroup.format_commands writes them
            formatter.write_dl(rows)

    def resolve_command(self, ctx, args):
        name, command, rest = super().resolve_command(ctx, args)
        if command is not None:
            tidy_help(command)
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
        except Exception as e:
            _exit_on(e)
        except BaseException as e:  # Ctrl-C, SystemExit, the BaseException a Rust panic in a dependency raises
            if isinstance(e, (SystemExit, GeneratorExit)):
                raise
            _exit_on(e)
        sys.exit(rv if isinstance(rv, int) else 0)


def _exit_on(e: BaseException) -> None:
    """Exit as the group's help says for the failure `e`."""
    from typer import _click

    if isinstance(e, _click.exceptions.ClickException):
        if isinstance(e, getattr(_click.exceptions, "NoArgsIsHelpError", ())):  # a bare group: its help
            sys.stdout.write(e.format_message() + "\n")
            sys.exit(0)
        if not e.format_message():  # a bare group: its help was shown, nothing failed
            sys.exit(0)
        ctx = getattr(e, "ctx", None)
        _error(e.format_message() + (f" (see '{ctx.command_path} --help')" if ctx is not None else ""))
        sys.exit(1)
    if isinstance(e, typer.Abort):
        _error("aborted.")
        sys.exit(1)
    if isinstance(e, (_Interrupted, KeyboardInterrupt)):
        _error("interrupted.")
        sys.exit(EXIT_INTERRUPTED)
    if isinstance(e, BrokenPipeError) or (isinstance(e, OSError) and e.errno == errno.EPIPE):
        silence_stdout()
        sys.exit(1)
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        raise e
    _error(f"unexpected {type(e).__name__}: {_first_line(e)}. This is a bug in kmesh-trace: please report it "
           f"with the command you ran and the traceback that {DEBUG_ENV}=1 prints.")
    sys.exit(1)


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


def version_line() -> str:
    """`kmesh-trace --version`: the installed distribution's version (the source tree's when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("kmesh-trace")
    except PackageNotFoundError:
        from kmesh_trace import __version__ as v
    return f"kmesh-trace {v}\n"


def _print_version(value: bool) -> None:
    if value:
        sys.stdout.write(version_line())
        raise typer.Exit(0)


def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Show the version and exit.")) -> None:
    """The root's own options (--version); each command runs after it."""


def _help_fits_the_terminal(group: typer.Typer) -> None:
    """--help as click writes it (wrapped whole words at the terminal's width), not typer's rich panels,
    whose option column cuts long option names (`--kv-bytes-per-t…`) at 80 columns; every sub-app too."""
    group.rich_markup_mode = None
    for c in group.registered_commands:  # click cuts a long first line with "..." in the command list
        c.short_help = c.short_help or _first_sentence(c.help or (c.callback.__doc__ if c.callback else "") or "")
    for g in group.registered_groups:
        g.cls = _HelpGroup
        info = g.typer_instance.info
        g.short_help = g.short_help or _first_sentence(g.help or getattr(info, "help", None) or "")
        _help_fits_the_terminal(g.typer_instance)


def _first_sentence(text: str) -> str | None:
    text = " ".join(str(text).split())
    return text.split(". ")[0].rstrip(".") if text else None


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _refusing_plainly(parser):
    """`parser` whose refusal (kmesh_trace.values.FlagRefusal) reads as its own sentence, control characters
    shown as escapes: typer reports it as `Invalid value for '--flag': <sentence>`, where a validator's
    ValueError would read `Value error, <sentence>`."""
    from kmesh_trace.values import FlagRefusal

    def parse(value):
        try:
            return parser(value)
        except FlagRefusal as e:
            raise typer.BadParameter(_CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", str(e))) from None

    parse.refuses_plainly = True
    parse.__wrapped__ = parser
    return parse


def _plain_refusals(app: typer.Typer) -> None:
    """Give every parser of the commands of `app` (and of its sub-apps) its plain refusal, once."""
    from typer.models import ParameterInfo

    for c in app.registered_commands:
        for p in inspect.signature(c.callback, eval_str=True).parameters.values():
            for info in (p.default, *getattr(p.annotation, "__metadata__", ())):
                if isinstance(info, ParameterInfo) and info.parser is not None and \
                        not getattr(info.parser, "refuses_plainly", False):
                    info.parser = _refusing_plainly(info.parser)
    for g in app.registered_groups:
        _plain_refusals(g.typer_instance)


def _typer_app(modules) -> typer.Typer:
    """The root typer app with the commands of `modules` registered (each module's `register(app)`)."""
    app = typer.Typer(cls=_Group, pretty_exceptions_enable=False, add_completion=False, rich_markup_mode=None,
                      **_APP_SETTINGS)
    app.callback(invoke_without_command=False)(_root)
    for name in modules:
        importlib.import_module(name).register(app)
    _help_fits_the_terminal(app)
    _plain_refusals(app)
    return app


def lazy_group() -> _Group:
    """The root command as `main` runs it: no command module imported until a command is looked up."""
    return typer.main.get_group(_typer_app(()))


def whole_app() -> typer.Typer:
    """Every command module imported, in one typer app (tests walk it, CliRunner runs it)."""
    return _typer_app(dict.fromkeys(m for _, m, _ in COMMANDS))


def run() -> None:
    """The command line as the lazy group parses and runs it."""
    lazy_group().main()
