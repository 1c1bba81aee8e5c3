"""The `kmesh-trace` command. Each command module owns its verbs and exposes `register(app)`."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
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
    "kmesh_trace.cli.export",  # export perfetto
    "kmesh_trace.cli.replay",  # replay probe|prepare|run
    "kmesh_trace.cli.demo",  # demo
    "kmesh_trace.cli.audit",  # audit corpus|capture
]

for _name in _COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main() -> None:
    app()
