"""`capture`: run a command (e.g. `vllm serve ...` or a Python script) with the capture hook enabled.

The hook itself is the vLLM plugin in `kmesh_trace.capture`; this command only sets
`KMESH_TRACE_DIR` (and the optional knobs) for the child, runs it in its own process group and
forwards SIGINT/SIGTERM/SIGHUP to it (so Ctrl-C reaches the server exactly once and it shuts its
engines down cleanly), waits for it, and then reports per engine what was written (on stderr, or as
JSON into `--summary FILE`: the command's own output passes through untouched).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import typer

from kmesh_trace.cli.common import check_out_dir, check_out_file, err, fail, handles_errors, print_json
from kmesh_trace.cli.flags import flags, takes_flags


def register(app: typer.Typer) -> None:
    app.command("capture", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(capture_cmd)


@flags
class CaptureFlags:
    """`capture`'s flags."""

    command: list[str] = typer.Argument(..., help="The command to run, after `--`: e.g. -- vllm serve MODEL ...")
    out_dir: Path = typer.Option(..., "--out", "-o", help="Trace directory to write (created if missing).")
    flush_s: float = typer.Option(None, "--flush-s", help="Write buffered events at least this often (seconds; "
                                  "default: $KMESH_TRACE_FLUSH_S, else 1.0).")
    max_buffered_events: int = typer.Option(None, "--max-buffered-events",
                                            help="Block events / transfers held between writes; beyond it events are "
                                                 "counted as dropped (default: $KMESH_TRACE_MAX_BUFFERED_EVENTS, else 524288).")
    summary_path: Path = typer.Option(None, "--summary", help="Also write the capture summary as JSON to FILE "
                                      "(written atomically when the command ends).")
    as_json: bool = typer.Option(False, "--json", help="Print the capture summary as JSON on stdout (after the "
                                 "command's own output; --summary keeps it apart).")

    def environment(self) -> tuple[Path, dict[str, str]]:
        """(the trace directory, the command's environment), every capture knob checked here, before the command
        runs: inside the engine a bad knob only disables the capture."""
        from kmesh_trace.capture.config import check_knob, config_from_env, hold_config_from_env
        from kmesh_trace.capture.env import ENV_DIR, ENV_FLUSH_S, ENV_MAX_EVENTS

        if not self.command:
            fail("give the command to capture after `--`, e.g. kmesh-trace capture --out trace -- vllm serve MODEL.")
        out_dir = check_out_dir(self.out_dir, "--out").resolve()
        env = {**os.environ, ENV_DIR: str(out_dir)}
        # An option given on the command line wins; otherwise what the user exported passes through.
        for value, knob, option, var in ((self.flush_s, "flush_interval_s", "--flush-s", ENV_FLUSH_S),
                                         (self.max_buffered_events, "max_buffered_events", "--max-buffered-events",
                                          ENV_MAX_EVENTS)):
            if value is not None:
                check_knob(knob, value, option)
                env[var] = str(value)
        config_from_env(env)  # every knob the command inherits is checked too
        hold_config_from_env(env)
        if self.summary_path is not None:
            check_out_file(self.summary_path, "--summary")
        return out_dir, env


@handles_errors
@takes_flags
def capture_cmd(f: CaptureFlags) -> None:
    """Run COMMAND with the vLLM capture hook enabled, writing a trace to --out.

    Prints one line (stderr) when each engine's capture starts, and one when an engine dies under it.

    Exit codes: COMMAND's own exit status when it ran (128 + N when signal N killed it); 3 when it exited
    0 but an engine died under it (its worker or its own process killed, e.g. by the OOM killer); 1 when
    it could not be started."""
    from kmesh_trace.capture.version import unsupported_reason

    out_dir, env = f.environment()
    reason = unsupported_reason(check_hooks=False)  # vLLM not imported here: the server's own start is not delayed
    if reason is not None:
        err.print(f"warning: {reason}", markup=False, highlight=False)
    rc, summary, died = _capture(f.command, out_dir, env)
    if f.summary_path is not None:
        from kmesh_trace.writer import write_json_atomic

        write_json_atomic(f.summary_path, summary)
    if f.as_json:
        print_json(summary)
    else:
        _report(summary)
    if rc != 0:
        raise typer.Exit(rc if rc > 0 else 128 - rc)  # killed by signal N: the shell's 128 + N
    if died:
        raise typer.Exit(ENGINE_DIED_EXIT)


def _capture(command: list[str], out_dir: Path, env: dict[str, str]) -> tuple[int, dict, list]:
    """Run the command, a line on stderr as each engine's capture starts or dies: (its exit status, the
    capture's summary, the engines that died under it)."""
    from kmesh_trace.cli.capture_watch import EngineWatch
    from kmesh_trace.writer import ENGINES_DIR

    out_dir.mkdir(parents=True, exist_ok=True)
    say = lambda line: err.print(line, markup=False, highlight=False, soft_wrap=True)  # noqa: E731
    with EngineWatch(out_dir / ENGINES_DIR, say) as watch:
        rc, signals, outputs = _run(command, env)
    died = watch.finish()
    summary = _summary(out_dir, command, rc, signals, died)
    if not summary["engines"]:
        summary["server_error"] = server_error_line(outputs)
    return rc, summary, died


#: The exit status of a command that exited 0 while an engine died under it.
ENGINE_DIED_EXIT = 3


#: Bytes of the command's output kept per stream (it is passed through as it comes) to name its error.
OUTPUT_TAIL_BYTES = 256 << 10


def _run(command: list[str], env: dict[str, str]) -> tuple[int, list[str], list[bytes]]:
    """Run `command` in its own process group, forwarding each stop signal to it; its exit status,
    the signals forwarded and the last OUTPUT_TAIL_BYTES of its stdout and of its stderr.

    In its own group, a terminal's Ctrl-C reaches only this process, which passes it on once: a server
    that got SIGINT twice (from the terminal and from us) could take the second as "force quit".
    Its stdout and stderr go through this process unchanged (a thread per stream copies it as it
    comes), so that a server that never started its engine can be named by its own error line
    (vLLM logs to stdout, Python tracebacks go to stderr).
    """
    try:
        proc = subprocess.Popen(command, env=env, process_group=0, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except FileNotFoundError:
        fail(f"command not found: {command[0]}; check the command after `--`.")
    tails = [bytearray(), bytearray()]
    copiers = [threading.Thread(target=_copy, args=(pipe, stream, tail), name="capture-output", daemon=True)
               for pipe, stream, tail in ((proc.stdout, sys.stdout, tails[0]), (proc.stderr, sys.stderr, tails[1]))]
    for c in copiers:
        c.start()
    received: list[str] = []

    def forward(signum, _frame):
        received.append(signal.Signals(signum).name)
        if proc.poll() is None:
            proc.send_signal(signum)

    forwarded = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        rc = proc.wait()  # a forwarded signal interrupts nothing: the wait is retried (PEP 475)
    finally:
        for s, h in forwarded.items():
            signal.signal(s, h)
    for c in copiers:
        c.join(timeout=5)  # a grandchild that still holds a pipe open is not waited for
    return rc, received, [bytes(t) for t in tails]


def _copy(pipe, stream, tail: bytearray) -> None:
    """Copy `pipe` to `stream` as it comes, keeping its last OUTPUT_TAIL_BYTES in `tail`."""
    out = getattr(stream, "buffer", None)
    fd = pipe.fileno()
    while chunk := os.read(fd, 65536):
        if out is not None:
            out.write(chunk)
            out.flush()
        else:  # a text-only stream (e.g. under a test runner)
            stream.write(chunk.decode(errors="replace"))
            stream.flush()
        tail += chunk
        del tail[:-OUTPUT_TAIL_BYTES]
    pipe.close()


#: vLLM's log prefix: `(EngineCore pid=N) ERROR 12-01 11:11:57 [core.py:1510] `, each part optional.
_LOG_PREFIX = re.compile(r"^(?:\([\w.-]+ pid=\d+\)\s*)?(?:(?P<level>[A-Z]+) \d\d-\d\d [\d:]+ \[[^\]]*\]\s*)?")
#: What states an exception: `ValueError: ...`, `torch.OutOfMemoryError: ...`, `Exception: ...`.
_EXCEPTION = re.compile(r"^[\w.]*(?:Error|Exception|Exit)\b:\s*\S")
#: An exception that only wraps another one raised earlier.
_WRAPPER = re.compile(r"root cause|see (?:the )?(?:stack trace|above)", re.IGNORECASE)


def server_error_line(outputs: list[bytes]) -> str | None:
    """The command's own error, as it stated it: the first exception it reported that is not a
    wrapper of an earlier one (the root cause; vLLM's log stream first, where its workers report
    theirs), else the last exception, else its last ERROR log line; None when it stated none."""
    first, last, error = None, None, None
    for data in outputs:
        for raw in data.decode(errors="replace").splitlines():
            prefix = _LOG_PREFIX.match(raw.strip())
            message = raw.strip()[prefix.end():].strip()
            if not message:
                continue
            if _EXCEPTION.match(message):
                last = message
                if first is None and not _WRAPPER.search(message):
                    first = message
            elif prefix.group("level") in ("ERROR", "CRITICAL"):
                error = message
    return first or last or error


def _report(summary: dict) -> None:
    say = lambda line: err.print(line, markup=False, highlight=False, soft_wrap=True)  # noqa: E731
    if summary["signals"]:
        say(f"forwarded {', '.join(summary['signals'])} to the command; it exited with {summary['exit_code']}")
    for eid, e in summary["engines"].items():
        rows = e["rows"]
        say(f"engine {eid}: {rows.get('invocations', 0):,} invocations, {rows.get('block_events', 0):,} block events, "
            f"{rows.get('transfers', 0):,} transfers, {e['declared_edges']:,} declared edges "
            f"({e['dangling_declared_edges']:,} dangling), {e['exact_prefix_edges']:,} exact-prefix edges; "
            f"dropped {e['num_dropped_events']:,}; {_verdict(e)}")
    if not summary["engines"]:
        if summary["exit_code"] != 0 and summary.get("server_error"):
            say(f"no engine was captured: the command exited with {summary['exit_code']} before an engine started; "
                f"its error: {summary['server_error']}")
        elif summary["exit_code"] != 0:
            say(f"no engine was captured: the command exited with {summary['exit_code']} before an engine started "
                "(its output above says why)")
        else:
            say("no engine was captured (was the kmesh-trace plugin loaded? is VLLM_PLUGINS filtering it out?)")
    say(f"trace: {summary['trace']}")


def _verdict(e: dict) -> str:
    if e["died"]:
        return f"DIED under the capture: {e['died']}. The trace holds what was recorded until then"
    return "complete" if e["complete"] else "INCOMPLETE (see: kmesh-trace audit capture)"


def _summary(out_dir: Path, command: list[str], rc: int, signals: list[str], died: dict[str, str]) -> dict:
    from kmesh_trace.trace import open_trace
    from kmesh_trace.writer import MARKER

    engines: dict = {}
    if (out_dir / MARKER).exists():
        with open_trace(out_dir) as trace:
            counts = trace.sql(
                "SELECT engine, 'invocations' AS t, count(*) AS n FROM invocations GROUP BY 1 "
                "UNION ALL SELECT engine, 'block_events', count(*) FROM block_events GROUP BY 1 "
                "UNION ALL SELECT engine, 'transfers', count(*) FROM transfers GROUP BY 1 "
                "UNION ALL SELECT engine, 'lineage', count(*) FROM lineage GROUP BY 1 "
                "UNION ALL SELECT engine, 'declared_edges', count(*) FROM lineage WHERE edge_kind = 'declared' GROUP BY 1 "
                "UNION ALL SELECT engine, 'dangling_declared_edges', count(*) FROM lineage "
                "WHERE edge_kind = 'declared' AND parent_request_id IS NULL GROUP BY 1 "
                "UNION ALL SELECT engine, 'exact_prefix_edges', count(*) FROM lineage WHERE edge_kind = 'exact_prefix' GROUP BY 1")
            for eid, meta in trace.engines.items():
                n = {t: int(c) for e, t, c in counts.iter_rows() if e == eid}
                engines[eid] = {
                    "rows": {t: n.get(t, 0) for t in ("invocations", "block_events", "transfers", "lineage")},
                    "declared_edges": n.get("declared_edges", 0),
                    "dangling_declared_edges": n.get("dangling_declared_edges", 0),
                    "exact_prefix_edges": n.get("exact_prefix_edges", 0),
                    "num_dropped_events": sum(v for v in (meta.get("num_dropped_events") or {}).values() if isinstance(v, int)),
                    "complete": bool(meta.get("complete")),
                    "died": died.get(eid),
                    "pid": meta.get("pid"),
                    "engine_index": meta.get("engine_index"),
                }
    return {"trace": str(out_dir), "command": command, "exit_code": rc, "signals": signals, "engines": engines}
