"""The `kmesh-trace` command. Each command module owns its verbs and exposes `register(app)`; the root group
that runs them is `kmesh_trace.cli.group` (typer), loaded only when a command runs: the root's own help is
written without it (`kmesh_trace.cli.root_help`)."""

from __future__ import annotations

import os
import sys

#: Set to 1 to see the traceback of an unexpected error instead of its one-line summary.
DEBUG_ENV = "KMESH_TRACE_DEBUG"
EXIT_INTERRUPTED = 130  # the shell's code for a process ended by SIGINT

_APP_SETTINGS = dict(name="kmesh-trace", no_args_is_help=True,
                     help="Capture, analyse and replay the KV-cache life of LLM agent request families.")

#: Every command in --help order: its name, the module that registers it (`register(app)`), and the one-line
#: summary `kmesh-trace --help` lists (the first sentence of its help; tests/test_cli_startup.py checks that
#: each summary is the command's own). `kmesh-trace --help` reads only this table; a command imports its
#: module and builds its parameters only when it runs (or shows its own --help).
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


def _silence_stdout() -> None:
    """The reader of our output went away (`| head`): point stdout at /dev/null so the final flush at
    exit does not print a second error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass




def __getattr__(name: str):
    """`kmesh_trace.cli.app`: the whole typer app, every command module imported (tests walk it, CliRunner runs
    it), made on first use, once; `_lazy_group`: the root group as `main` runs it."""
    if name == "app":
        from kmesh_trace.cli.group import whole_app

        globals()["app"] = built = whole_app()
        return built
    if name == "_lazy_group":
        from kmesh_trace.cli.group import _lazy_group

        return _lazy_group
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    try:
        if sys.argv[1:] in ([], ["--help"]):  # the root's help (a bare command too), without typer
            from kmesh_trace.cli.root_help import root_help

            try:
                sys.stdout.write(root_help())
            except BrokenPipeError:  # `kmesh-trace --help | head`: quiet, as a command's output
                _silence_stdout()
                sys.exit(1)
            sys.exit(0)
        if sys.argv[1:] == ["--version"]:  # without typer, as the root's help
            from kmesh_trace.cli.root_help import version_line

            sys.stdout.write(version_line())
            sys.exit(0)
        from kmesh_trace.cli.group import run

        run()
    finally:
        try:
            sys.stdout.flush()
        except BrokenPipeError:  # the reader left after our last write
            _silence_stdout()
