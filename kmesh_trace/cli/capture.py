"""`capture`: run a command (e.g. `vllm serve ...` or a Python script) with the capture hook enabled.

The hook itself is the vLLM plugin in `kmesh_trace.capture`; this command only sets
`KMESH_TRACE_DIR` (and the optional knobs) for the child, forwards SIGINT/SIGTERM to it so the
engine shuts down cleanly and flushes, and then reports what was captured (on stderr; the
command's own output passes through untouched).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import typer

from kmesh_trace.cli.common import check_out_dir, err, fail, handles_errors, print_json


def register(app: typer.Typer) -> None:
    app.command("capture", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(capture_cmd)


@handles_errors
def capture_cmd(
    command: list[str] = typer.Argument(..., help="The command to run, after `--`: e.g. -- vllm serve MODEL ..."),
    out_dir: Path = typer.Option(..., "--out", "-o", help="Trace directory to write (created if missing)."),
    flush_s: float = typer.Option(None, "--flush-s", help="Write buffered events at least this often (seconds; "
                                  "default: $KMESH_TRACE_FLUSH_S, else 1.0)."),
    max_buffered_events: int = typer.Option(None, "--max-buffered-events",
                                            help="Block events / transfers held between writes; beyond it events are "
                                                 "counted as dropped (default: $KMESH_TRACE_MAX_BUFFERED_EVENTS, else 524288)."),
    as_json: bool = typer.Option(False, "--json", help="Print the capture summary as JSON on stdout."),
) -> None:
    """Run COMMAND with the vLLM capture hook enabled, writing a trace to --out.

    Exit codes: COMMAND's own exit status when it ran (1 if it died of a signal); 1 when it could not be started."""
    from kmesh_trace.capture.env import ENV_DIR, ENV_FLUSH_S, ENV_MAX_EVENTS
    from kmesh_trace.capture.recorder import check_knob, config_from_env
    from kmesh_trace.capture.version import unsupported_reason

    if not command:
        fail("give the command to capture after `--`, e.g. kmesh-trace capture --out trace -- vllm serve MODEL.")
    # Checked here, before the command runs: inside the engine a bad knob only disables the capture.
    out_dir = check_out_dir(out_dir, "--out").resolve()
    env = {**os.environ, ENV_DIR: str(out_dir)}
    # An option given on the command line wins; otherwise what the user exported passes through.
    for value, knob, option, var in ((flush_s, "flush_interval_s", "--flush-s", ENV_FLUSH_S),
                                     (max_buffered_events, "max_buffered_events", "--max-buffered-events", ENV_MAX_EVENTS)):
        if value is not None:
            check_knob(knob, value, option)
            env[var] = str(value)
    config_from_env(env)  # every knob the command inherits is checked too
    reason = unsupported_reason()
    if reason is not None:
        err.print(f"warning: {reason}", markup=False, highlight=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.Popen(command, env=env)
    except FileNotFoundError:
        fail(f"command not found: {command[0]}; check the command after `--`.")
    forwarded = {s: signal.signal(s, lambda signum, _f: proc.send_signal(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait()
    finally:
        for s, h in forwarded.items():
            signal.signal(s, h)
    summary = _summary(out_dir, command, rc)
    if as_json:
        print_json(summary)
    else:
        for eid, e in summary["engines"].items():
            err.print(f"captured engine {eid}: {e['rows']} rows, dropped {e['num_dropped_events']}, "
                      f"{'complete' if e['complete'] else 'INCOMPLETE'}", markup=False, highlight=False)
        if not summary["engines"]:
            err.print("no engine was captured (was the kmesh-trace plugin loaded? is VLLM_PLUGINS filtering it out?)",
                      markup=False, highlight=False)
        err.print(f"trace: {out_dir}", markup=False, highlight=False)
    if rc != 0:
        raise typer.Exit(rc if rc > 0 else 1)


def _summary(out_dir: Path, command: list[str], rc: int) -> dict:
    from kmesh_trace import schema
    from kmesh_trace.trace import open_trace
    from kmesh_trace.writer import MARKER

    engines: dict = {}
    if (out_dir / MARKER).exists():
        trace = open_trace(out_dir)
        counts = trace.sql(" UNION ALL ".join(f"SELECT engine, '{name}' AS t, count(*) AS n FROM {name} GROUP BY 1"
                                              for name in schema.TABLES))
        for eid, meta in trace.engines.items():
            rows = {t: int(n) for e, t, n in counts.iter_rows() if e == eid}
            engines[eid] = {"rows": rows, "num_dropped_events": sum(meta.get("num_dropped_events", {}).values()),
                            "complete": bool(meta.get("complete"))}
    return {"trace": str(out_dir), "command": command, "exit_code": rc, "engines": engines}
