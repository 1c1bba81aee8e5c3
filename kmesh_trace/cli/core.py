"""`schema`, `info` and `sql`: the contract and read-only views of a trace."""

from __future__ import annotations

import csv
import json
import sys
from enum import Enum
from pathlib import Path

import typer
from kmesh_trace.cli.display import Table

from kmesh_trace import schema
from kmesh_trace.cli.common import Output, TraceArgument, emit, err, handles_errors, out, output_options, print_json
from kmesh_trace.cli.flags import flags, takes_flags
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.paths import check_trace_directory
from kmesh_trace.values import MAX_SECONDS, bounded_int, finite_float


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
        rt = Table(title=f"{t.name}: {t.doc}", title_justify="left", expand=False)
        for h in ("column", "type", "unit", "null"):
            rt.add_column(h, no_wrap=True)
        rt.add_column("meaning", overflow="fold")
        for c in t.columns:
            rt.add_row(c.name, schema.type_name(c.type), c.unit or "", "yes" if c.nullable else "no", c.doc)
        out.print(rt)


def _trace_info(path: Path) -> dict:
    check_trace_directory(path)  # before the columnar libraries load
    from kmesh_trace.trace import open_trace, trace_info

    with open_trace(path) as t:
        return trace_info(t)


@handles_errors
@output_options()
def info_cmd(
    trace: TraceArgument,
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
    rt = Table(title=f"trace {info['path']}", title_justify="left")
    rt.add_column("table")
    rt.add_column("rows", justify="right")
    rt.add_column("parts", justify="right")
    for name, t in info["tables"].items():
        rt.add_row(name, f"{t['rows']:,}", str(t["parts"]))
    out.print(rt)
    for eid, meta in info["engines"].items():
        mt = Table(title=f"engine {eid}", title_justify="left", show_header=False)
        mt.add_column("field")
        mt.add_column("value", overflow="fold")
        for k, v in meta.items():
            if k == "malformed_lines":
                v = f"{len(v)} listed" + (f" (first: {v[0]})" if v else "")
            elif isinstance(v, (dict, list)):
                v = json.dumps(v)
            mt.add_row(k, str(v))
        out.print(mt)


#: Rows a table on the terminal shows unless --limit says otherwise (csv and json stream every row).
TABLE_ROWS = 1000
#: Seconds a query may run unless --timeout says otherwise.
DEFAULT_SQL_TIMEOUT_S = 600.0
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


#: DuckDB keeps its memory limit as a 63-bit byte count; nothing larger means anything.
MAX_MEMORY_BYTES = 1 << 62


def parse_bytes(text: str, option: str) -> int:
    """`4GB`, `512MiB` or a plain byte count, above zero."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 1 << 20:
        raise KmeshTraceError(f"{option} must be a size of at least 1MiB such as 2GB or 512MiB (got {text!r}).")
    n = int(float(m.group(1)) * _UNITS[unit])  # float() of digits is finite up to ~1e308; the bound below decides
    if n > MAX_MEMORY_BYTES:
        raise KmeshTraceError(f"{option} must be at most {MAX_MEMORY_BYTES >> 50:,}PiB, more memory than any machine has "
                              f"(got {text!r}).")
    return n


_INT64 = 1 << 63


def _cell(v):
    """One result value as JSON data: integers beyond 64 bits and decimals as exact text, bytes as DuckDB
    writes them, times as ISO text, NaN and infinities as null (JSON has none), anything else as text."""
    import datetime
    import decimal

    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return v if -_INT64 <= v < _INT64 else str(v)
    if isinstance(v, float):
        return v if v == v and v not in (float("inf"), float("-inf")) else None
    if isinstance(v, decimal.Decimal):
        return _cell(int(v)) if v == v.to_integral_value() and v.as_tuple().exponent >= 0 else str(v)
    if isinstance(v, (bytes, bytearray)):
        return "".join(chr(b) if 32 <= b < 127 and b != 92 else f"\\x{b:02X}" for b in v)
    if isinstance(v, dict):
        return {str(k): _cell(x) for k, x in v.items()}
    if type(v).__name__ == "MonthDayNano":  # an interval, as Arrow returns it
        return {"months": v.months, "days": v.days, "nanoseconds": v.nanoseconds}
    if isinstance(v, (list, tuple)):
        return [_cell(x) for x in v]
    if isinstance(v, (datetime.date, datetime.time)):
        return v.isoformat()
    return str(v)


def _csv_field(v) -> str:
    """One CSV cell: nested values as JSON text (CSV has no nesting), null as an empty field."""
    v = _cell(v)
    if v is None:
        return ""
    if isinstance(v, (dict, list)):
        return json.dumps(v, separators=(", ", ": "))
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


#: Items of a list a table cell shows; the rest is counted (json and csv print every item).
TABLE_LIST_ITEMS = 16
_SHORTENED = " more]"


def _table_cell(v) -> str:
    """One result value in the human table: a long list (token ids) as its first items and a count."""
    if v is None:
        return ""
    if isinstance(v, (list, tuple)) and len(v) > TABLE_LIST_ITEMS:
        head = ", ".join(str(_cell(x)) for x in v[:TABLE_LIST_ITEMS])
        return f"[{head}, +{len(v) - TABLE_LIST_ITEMS:,}{_SHORTENED}"
    return str(v)


@flags
class SqlFlags:
    """`sql`'s flags."""

    trace: TraceArgument
    query: str = typer.Argument(..., help="A read-only SQL query over the tables invocations, lineage, block_events, transfers, engines.")
    fmt: SqlFormat = typer.Option(SqlFormat.table, "--format", "-f", help="Output format (csv writes lists and structs as JSON text).")
    limit: int = typer.Option(None, "--limit", parser=bounded_int(0), help=f"Print at most this many rows (default: {TABLE_ROWS} for a table, every row for csv and json, streamed).")
    timeout_s: float = typer.Option(DEFAULT_SQL_TIMEOUT_S, "--timeout", parser=finite_float(0, MAX_SECONDS), help="Stop the query after this many seconds (0: no limit).")
    memory_limit: str = typer.Option(None, "--memory-limit", help="Memory DuckDB may use, e.g. 2GB (default: a quarter of this machine's memory); beyond it DuckDB spills to a private temporary directory, removed at exit.")


@handles_errors
@takes_flags
def sql_cmd(f: SqlFlags) -> None:
    """Query a trace with DuckDB SQL (read-only, confined to the trace directory, bounded in memory and time).

    Exit codes: 0 ok; 1 could not run (usage, input or I/O error, or the query ran past --timeout)."""
    from kmesh_trace.trace import check_read_only

    check_read_only(f.query)  # before opening anything
    mem = parse_bytes(f.memory_limit, "--memory-limit") if f.memory_limit is not None else None
    cap = f.limit if f.limit is not None else (TABLE_ROWS if f.fmt is SqlFormat.table else None)
    rows = _SQL_ROWS[f.fmt]()
    shown, more = _sql(f.trace, f.query, mem, f.timeout_s, cap, rows)
    if f.fmt is SqlFormat.table and rows.shortened():
        err.print(f"note: lists longer than {TABLE_LIST_ITEMS} items are shortened in the table; --format json or "
                  "csv prints them whole", soft_wrap=True)
    if more:
        err.print(f"showing the first {shown:,} rows; the query returned more (raise --limit"
                  + (", or use --format csv or json to stream every row)" if f.limit is None else ")"),
                  markup=False, highlight=False, soft_wrap=True)
    elif f.fmt is SqlFormat.table:
        err.print(f"{shown} row(s)", style="dim")


def _sql(trace: Path, query: str, memory: int | None, timeout_s: float, cap: int | None, rows) -> tuple[int, bool]:
    """Run the query, giving at most `cap` rows to `rows` (a renderer of one --format) as they stream:
    (rows given, whether the query returned more)."""
    from itertools import chain

    from kmesh_trace.trace import open_trace

    with open_trace(trace, memory_limit=memory) as t:
        batches = t.sql_batches(query, timeout_s=timeout_s or None)
        first = next(batches)
        rows.start(first.schema.names)
        shown, more = 0, False
        for batch in chain([first], batches):
            part = batch.to_pylist()
            if cap is not None and shown + len(part) > cap:
                part, more = part[:cap - shown], True
            for row in part:
                rows.add(row, shown)
                shown += 1
            if more:
                batches.close()
                break
        rows.end()
    return shown, more


class _JsonRows:
    """`--format json`: one JSON array, streamed."""

    def start(self, names: list[str]) -> None:
        sys.stdout.write("[")

    def add(self, row: dict, index: int) -> None:
        sys.stdout.write(("," if index else "") + json.dumps({k: _cell(v) for k, v in row.items()}, separators=(",", ":")))

    def end(self) -> None:
        sys.stdout.write("]\n")


class _CsvRows:
    """`--format csv`: a header line, then the rows, streamed."""

    def start(self, names: list[str]) -> None:
        self.names, self.writer = names, csv.writer(sys.stdout, lineterminator="\n")
        self.writer.writerow(names)

    def add(self, row: dict, index: int) -> None:
        self.writer.writerow([_csv_field(row[k]) for k in self.names])

    def end(self) -> None:
        pass


class _TableRows:
    """`--format table`: the rows collected, then one table (a record per row when the columns do not fit)."""

    def start(self, names: list[str]) -> None:
        self.names, self.rows = names, []

    def add(self, row: dict, index: int) -> None:
        self.rows.append([_table_cell(row[k]) for k in self.names])

    def end(self) -> None:
        rt = Table()
        for name in self.names:
            rt.add_column(name, overflow="fold")
        for row in self.rows:
            rt.add_row(*row)
        out.print(rt)

    def shortened(self) -> bool:
        return any(isinstance(v, str) and v.endswith(_SHORTENED) for r in self.rows for v in r)


_SQL_ROWS = {SqlFormat.json: _JsonRows, SqlFormat.csv: _CsvRows, SqlFormat.table: _TableRows}
