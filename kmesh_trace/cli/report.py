"""`report TRACE --out report.html`: one self-contained HTML page with every analysis of a trace."""

from __future__ import annotations

from pathlib import Path

import typer

from kmesh_trace.cli.common import (
    CapacityOption,
    EngineOption,
    JsonOption,
    RequestDatasetFlags,
    TraceArgument,
    check_out_file,
    check_out_not_in_input,
    err,
    exit_codes_help,
    handles_errors,
    parse_ints,
    print_json,
)
from kmesh_trace.cli.flags import flags, takes_flags


def register(app: typer.Typer) -> None:
    app.command("report", help=_HELP)(report_cmd)


_HELP = ("Write one self-contained HTML page (no network, inline SVG plots) with the capture summary, audit "
         "verdicts, the headroom curve, retention pressure along the capacity axis, lineage, the tiers sweep and "
         "(with several engines or families) the fleet what-if of a trace, capture or import; each section "
         f"defines its terms and names the command that reproduces it.\n\n{exit_codes_help()}")


@flags
class ReportFlags:
    """`report`'s flags."""

    trace: TraceArgument
    out_file: Path = typer.Option(..., "--out", "-o", help="HTML file to write (atomically).")
    capacity_blocks: CapacityOption = None
    engine: EngineOption = None
    as_json: JsonOption = False
    dataset: RequestDatasetFlags = RequestDatasetFlags()


@handles_errors
@takes_flags
def report_cmd(f: ReportFlags) -> None:
    from kmesh_trace.apps.report import write_report

    caps = parse_ints(f.capacity_blocks, "--capacity-blocks") if f.capacity_blocks is not None else None
    import_options = f.dataset.import_options(f.trace)
    _refuse_a_public_trace(f.trace)
    check_out_file(f.out_file, "--out")
    check_out_not_in_input(f.out_file, [f.trace])  # a page written over a part would destroy the trace
    data = write_report(_trace_dir(f.trace, import_options), f.out_file, capacities=caps, engine=f.engine,
                        trace_arg=str(f.trace))
    err.print(f"wrote {f.out_file}", markup=False, highlight=False, soft_wrap=True)
    if f.as_json:
        print_json(data)


def _trace_dir(path: Path, import_options: dict | None) -> Path:
    """The trace directory the page reads: `path`, or a request dataset imported into a temporary one (removed at
    exit), with its tokenizer and block size."""
    from kmesh_trace.sources import imported, sniff

    if sniff(path) != "requests":
        return path
    _, out = imported(path, "requests", on_import=lambda line: err.print(line, markup=False, highlight=False),
                      until_exit=True, import_options=import_options)
    return out


def _refuse_a_public_trace(path: Path) -> None:
    """A public trace (a Mooncake or Bailian JSONL file, a weka or LMCache agent directory) that the analyses
    read as it is: the page reads a trace directory, so say how to make one."""
    from kmesh_trace.sources import sniff
    from kmesh_trace.errors import InputFormatError, KmeshTraceError

    try:
        fmt = sniff(path)
    except InputFormatError:
        return  # neither: opening it as a trace says why
    if fmt not in (None, "requests"):  # a request dataset is imported on the way in (`_trace_dir`)
        raise KmeshTraceError(f"{path} is {fmt} input, not a trace directory: `report` reads a trace; import it first "
                              f"with `kmesh-trace import {fmt} {path} --out TRACE`, then `kmesh-trace report TRACE`.")
