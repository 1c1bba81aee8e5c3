"""`import FORMAT SRC --out TRACE`: convert a public trace file into a trace directory."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer
from rich.table import Table as RichTable

from kmesh_trace.cli.common import check_out_dir, check_out_not_in_input, err, handles_errors, out, print_json, progress
from kmesh_trace.errors import InputFormatError, KmeshTraceError


class ImportFormat(str, Enum):
    mooncake = "mooncake"
    bailian = "bailian"


def register(app: typer.Typer) -> None:
    app.command("import")(import_cmd)


def _importer(fmt: ImportFormat):
    if fmt is ImportFormat.mooncake:
        from kmesh_trace.datasets.mooncake import import_mooncake

        return import_mooncake
    from kmesh_trace.datasets.bailian import import_bailian

    return import_bailian


@handles_errors
def import_cmd(
    fmt: ImportFormat = typer.Argument(..., metavar="FORMAT", help="Input format: mooncake or bailian."),
    src: Path = typer.Argument(..., help="The JSONL file to import."),
    out_dir: Path = typer.Option(..., "--out", help="Trace directory to write (created if missing)."),
    engine_id: str = typer.Option(None, "--engine-id", help="Engine partition name (default: import-FORMAT)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable summary."),
) -> None:
    """Import a public trace (Mooncake FAST'25 or Bailian JSONL) into a trace directory."""
    if not src.is_file():
        raise InputFormatError(f"{src} is not a readable file.")
    check_out_dir(out_dir, "--out")
    check_out_not_in_input(out_dir, [src])
    engine_id = engine_id or f"import-{fmt.value}"
    if (out_dir / "invocations" / f"engine={engine_id}").exists():
        raise KmeshTraceError(f"{out_dir} already holds an import as engine {engine_id}; choose another --out or --engine-id.")
    with progress() as bar:
        task = bar.add_task(f"importing {src.name}", total=src.stat().st_size)
        report = _importer(fmt)(src, out_dir, engine_id=engine_id, on_bytes=lambda n: bar.advance(task, n))
    summary = report.to_dict()
    if as_json:
        print_json(summary)
        return
    rt = RichTable(title=f"{fmt.value} import into {out_dir}", title_justify="left", show_header=False)
    rt.add_column("what")
    rt.add_column("count", justify="right")
    for key in ("num_lines", "num_blank_lines", "num_invocations", "num_block_hashes", "num_lineage_edges", "num_malformed_lines"):
        rt.add_row(key, f"{summary[key]:,}")
    out.print(rt)
    if report.num_malformed_lines:
        err.print(f"{report.num_malformed_lines} malformed line(s) skipped and recorded in the trace metadata; first:")
        for loc in report.malformed_lines[:10]:
            err.print(f"  {loc}", markup=False, highlight=False)
