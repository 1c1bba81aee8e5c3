"""`report TRACE --out report.html`: one self-contained HTML page with every analysis of a trace."""

from __future__ import annotations

from pathlib import Path

import typer

from kmesh_trace.cli.common import (
    CapacityOption,
    EngineOption,
    JsonOption,
    TraceArgument,
    check_out_file,
    check_out_not_in_input,
    err,
    exit_codes_help,
    handles_errors,
    parse_ints,
    print_json,
)


def register(app: typer.Typer) -> None:
    app.command("report", help=_HELP)(report_cmd)


_HELP = ("Write one self-contained HTML page (no network, inline SVG plots) with the capture summary, audit "
         "verdicts, the headroom curve, retention pressure along the capacity axis, lineage, the tiers sweep and "
         "(with several engines or families) the fleet what-if of a trace, capture or import; each section "
         f"defines its terms and names the command that reproduces it.\n\n{exit_codes_help()}")


@handles_errors
def report_cmd(
    trace: TraceArgument,
    out_file: Path = typer.Option(..., "--out", "-o", help="HTML file to write (atomically)."),
    capacity_blocks: CapacityOption = None,
    engine: EngineOption = None,
    as_json: JsonOption = False,
) -> None:
    from kmesh_trace.apps.report import write_report

    caps = parse_ints(capacity_blocks, "--capacity-blocks") if capacity_blocks is not None else None
    _refuse_a_public_trace(trace)
    check_out_file(out_file, "--out")
    check_out_not_in_input(out_file, [trace])  # a page written over a part would destroy the trace
    data = write_report(trace, out_file, capacities=caps, engine=engine, trace_arg=str(trace))
    err.print(f"wrote {out_file}", markup=False, highlight=False, soft_wrap=True)
    if as_json:
        print_json(data)


def _refuse_a_public_trace(path: Path) -> None:
    """A public trace (a Mooncake or Bailian JSONL file, a weka or LMCache agent directory) that the analyses
    read as it is: the page reads a trace directory, so say how to make one."""
    from kmesh_trace.sources import sniff
    from kmesh_trace.errors import InputFormatError, KmeshTraceError

    try:
        fmt = sniff(path)
    except InputFormatError:
        return  # neither: opening it as a trace says why
    if fmt is not None:
        raise KmeshTraceError(f"{path} is {fmt} input, not a trace directory: `report` reads a trace; import it first "
                              f"with `kmesh-trace import {fmt} {path} --out TRACE`, then `kmesh-trace report TRACE`.")
