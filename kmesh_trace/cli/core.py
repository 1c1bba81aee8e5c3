"""`schema`, `info` and `sql`: the contract and read-only views of a trace."""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path

import typer
from rich.table import Table as RichTable

from kmesh_trace import schema
from kmesh_trace.cli.common import Output, emit, err, handles_errors, out, output_options, print_json


class SqlFormat(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"


def register(app: typer.Typer) -> None:
    app.command("schema")(schema_cmd)
    app.command("info")(info_cmd)
    app.command("sql")(sql_cmd)


@handles_errors
def schema_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print the contract as JSON."),
    as_markdown: bool = typer.Option(False, "--markdown", help="Print the contract as Markdown (docs/SCHEMA.md)."),
) -> None:
    """Show the trace schema: every table and column with type, unit and meaning.

    Exit codes: 0 ok; 1 could not run (usage, input or I/O error)."""
    if as_json:
        print_json(schema.as_dict())
        return
    if as_markdown:
        sys.stdout.write(schema.markdown())
        return
    out.print(f"kmesh-trace schema {schema.SCHEMA_VERSION}", style="bold")
    for t in schema.TABLES.values():
        rt = RichTable(title=f"{t.name}: {t.doc}", title_justify="left", expand=False)
        for h in ("column", "type", "unit", "null"):
            rt.add_column(h, no_wrap=True)
        rt.add_column("meaning", overflow="fold")
        for c in t.columns:
            rt.add_row(c.name, schema.type_name(c.type), c.unit or "", "yes" if c.nullable else "no", c.doc)
        out.print(rt)


def _trace_info(path: Path) -> dict:
    from kmesh_trace.trace import open_trace, trace_info

    with open_trace(path) as t:
        return trace_info(t)


@handles_errors
@output_options()
def info_cmd(
    trace: Path = typer.Argument(..., help="Trace directory."),
    output: Output = None,
) -> None:
    """Tables, row counts and engine metadata of a trace."""
    info = _trace_info(trace)
    notes = [m["tokenizer"] for m in info["engines"].values() if m.get("token_ids_approximate")]
    if notes:
        info["note"] = (f"token ids are approximate: the importer tokenized text with {', '.join(map(str, notes))}, "
                        "not the serving model's tokenizer")
        err.print(f"note: {info['note']}", markup=False, highlight=False)
    emit(output, info, render=lambda: _render_info(info))


def _render_info(info: dict) -> None:
    rt = RichTable(title=f"trace {info['path']}", title_justify="left")
    rt.add_column("table")
    rt.add_column("rows", justify="right")
    rt.add_column("parts", justify="right")
    for name, t in info["tables"].items():
        rt.add_row(name, f"{t['rows']:,}", str(t["parts"]))
    out.print(rt)
    for eid, meta in info["engines"].items():
        mt = RichTable(title=f"engine {eid}", title_justify="left", show_header=False)
        mt.add_column("field")
        mt.add_column("value", overflow="fold")
        for k, v in meta.items():
            if k == "malformed_lines":
                v = f"{len(v)} listed" + (f" (first: {v[0]})" if v else "")
            elif isinstance(v, (dict, list)):
                v = json.dumps(v)
            mt.add_row(k, str(v))
        out.print(mt)


@handles_errors
def sql_cmd(
    trace: Path = typer.Argument(..., help="Trace directory."),
    query: str = typer.Argument(..., help="A read-only SQL query over the tables invocations, lineage, block_events, transfers, engines."),
    fmt: SqlFormat = typer.Option(SqlFormat.table, "--format", "-f", help="Output format."),
) -> None:
    """Query a trace with DuckDB SQL (read-only, confined to the trace directory).

    Exit codes: 0 ok; 1 could not run (usage, input or I/O error)."""
    from kmesh_trace.trace import check_read_only, open_trace

    check_read_only(query)  # before opening anything
    df = open_trace(trace).sql(query)
    if fmt is SqlFormat.json:
        sys.stdout.write(df.write_json() + "\n")
    elif fmt is SqlFormat.csv:
        sys.stdout.write(df.write_csv())
    else:
        rt = RichTable()
        for name in df.columns:
            rt.add_column(name, overflow="fold")
        for row in df.iter_rows():
            rt.add_row(*("" if v is None else str(v) for v in row))
        out.print(rt)
        err.print(f"{df.height} row(s)", style="dim")
