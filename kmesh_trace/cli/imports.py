"""`import FORMAT SRC --out TRACE`: convert a public trace file into a trace directory."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from kmesh_trace.cli.display import Table
from kmesh_trace.sources import importer

from kmesh_trace.cli.common import SummaryJsonOption, check_out_dir, check_out_not_in_input, err, handles_errors, out, print_json, progress
from kmesh_trace.cli.flags import flags, takes_flags
from kmesh_trace.errors import InputFormatError, KmeshTraceError
from kmesh_trace.values import MAX_BLOCKS, bounded_int, identifier


class ImportFormat(str, Enum):
    mooncake = "mooncake"
    bailian = "bailian"
    weka = "weka"
    lmcache_agent = "lmcache-agent"
    requests = "requests"


#: Formats whose SRC is a directory (of conversation files, or of sources of JSONL files).
_DIRECTORY_FORMATS = (ImportFormat.weka, ImportFormat.lmcache_agent)
_SUMMARY_KEYS = ("num_lines", "num_blank_lines", "num_invocations", "num_block_hashes", "num_lineage_edges", "num_malformed_lines")


def register(app: typer.Typer) -> None:
    app.command("import")(import_cmd)


@flags
class ImportFlags:
    """`import`'s flags."""

    fmt: ImportFormat = typer.Argument(..., metavar="FORMAT", help="Input format: mooncake, bailian, weka, lmcache-agent "
                                       "or requests (OpenAI-compatible JSONL, ShareGPT, vllm bench custom).")
    src: Path = typer.Argument(..., help="The JSONL file to import (weka, lmcache-agent: the directory).")
    out_dir: Path = typer.Option(..., "--out", help="Trace directory to write (created if missing).")
    engine_id: str = typer.Option(None, "--engine-id", parser=identifier, help="Engine partition name (default: import-FORMAT).")
    arrival: str = typer.Option(None, "--arrival", help="weka: when each conversation starts: as-recorded, "
                                "stagger:SECONDS or users:N (default users:8; see docs/IMPORT.md).")
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="lmcache-agent, requests: a tokenizer.json, or "
                                             "(requests) its directory with tokenizer_config.json and the chat "
                                             "template (needs the tokenizers package); default: UTF-8 bytes.")
    block_size: Optional[int] = typer.Option(None, "--block-size", parser=bounded_int(1, MAX_BLOCKS), help="lmcache-agent, requests: tokens per "
                                             "block (default 64 for UTF-8 bytes, 16 with --tokenizer); mooncake: "
                                             "tokens per hash id (default 512).")
    as_json: SummaryJsonOption = False

    def check(self) -> None:
        """Refuse, before any work, a source of the wrong kind, an unwritable --out and flags of other formats."""
        fmt, src = self.fmt, self.src
        directory = fmt in _DIRECTORY_FORMATS
        if directory and not src.is_dir() and not (fmt is ImportFormat.weka and src.is_file()):
            raise InputFormatError(f"{src} is not a directory; {fmt.value} imports a directory.")
        if not directory and not src.is_file():
            raise InputFormatError(f"{src} is not a readable file.")
        check_out_dir(self.out_dir, "--out")
        check_out_not_in_input(self.out_dir, [src])
        if self.arrival is not None and fmt is not ImportFormat.weka:
            raise KmeshTraceError("--arrival applies to weka imports only.")
        if self.tokenizer is not None and fmt not in (ImportFormat.lmcache_agent, ImportFormat.requests):
            raise KmeshTraceError("--tokenizer applies to lmcache-agent and requests imports only.")
        if self.block_size is not None and fmt not in (ImportFormat.lmcache_agent, ImportFormat.requests, ImportFormat.mooncake):
            raise KmeshTraceError("--block-size applies to lmcache-agent, requests and mooncake imports only.")

    def importer_options(self) -> tuple[dict, int]:
        """(the importer's keyword options, the bytes it will read, for the progress bar)."""
        fmt, src = self.fmt, self.src
        if fmt is ImportFormat.weka:
            from kmesh_trace.datasets.importers.weka import DEFAULT_ARRIVAL, Arrival, conversation_files

            arrival = Arrival.parse(self.arrival or DEFAULT_ARRIVAL)  # a bad value fails before any work
            return {"arrival": arrival}, sum(p.stat().st_size for p in conversation_files(src))
        if fmt is ImportFormat.lmcache_agent:
            from kmesh_trace.audit.corpus import jsonl_bytes
            from kmesh_trace.audit.inventory import walk

            return {"tokenizer": self.tokenizer, "block_size": self.block_size}, jsonl_bytes(walk(src))
        if fmt is ImportFormat.requests:
            return {"tokenizer": self.tokenizer, "block_size": self.block_size}, src.stat().st_size
        return ({} if self.block_size is None else {"block_size": self.block_size}), src.stat().st_size


@handles_errors
@takes_flags
def import_cmd(f: ImportFlags) -> None:
    """Import a public trace (Mooncake, Bailian, kv-cache-tester agentic conversations, LMCache agent traces) into a trace directory.

    Exit codes: 0 ok; 1 could not run (usage, input or I/O error)."""
    f.check()
    kwargs, total = f.importer_options()
    engine_id = f.engine_id or f"import-{f.fmt.value}"
    if (f.out_dir / "invocations" / f"engine={engine_id}").exists():
        raise KmeshTraceError(f"{f.out_dir} already holds an import as engine {engine_id}; choose another --out or --engine-id.")
    report = _import(f, engine_id, kwargs, total)
    summary = report.to_dict()
    if f.as_json:
        print_json(summary)
        return
    _render(report, summary, f"{f.fmt.value} import into {f.out_dir}")


def _import(f: ImportFlags, engine_id: str, kwargs: dict, total: int):
    """The import, with a progress bar on the bytes read; one that produced no request leaves nothing behind."""
    existed = f.out_dir.exists()
    with progress() as bar:
        task = bar.add_task(f"importing {f.src.name}", total=total)
        report = importer(f.fmt.value)(f.src, f.out_dir, engine_id=engine_id, on_bytes=lambda n: bar.advance(task, n),
                                       **kwargs)
    if report.num_invocations == 0:
        _discard_empty(f.out_dir, engine_id, existed)
        raise InputFormatError(_why_empty(f.fmt, f.src, report))
    return report


def _render(report, summary: dict, title: str) -> None:
    """An import's counts as a table, then its duplicates and malformed lines on stderr."""
    rt = Table(title=title, title_justify="left", show_header=False)
    rt.add_column("what")
    rt.add_column("count", justify="right")
    for key in getattr(report, "SUMMARY_KEYS", _SUMMARY_KEYS):
        rt.add_row(key, f"{summary[key]:,}")
    for key in ("arrival", "tokenizer"):
        if key in summary:
            rt.add_row(key, str(summary[key]))
    out.print(rt)
    if summary.get("num_duplicate_records"):
        err.print(f"{summary['num_duplicate_records']} exact duplicate record(s) imported once; listed in the trace metadata.")
    for note in summary.get("notes") or ():
        err.print(f"Note: {note}", markup=False, highlight=False)
    if report.num_malformed_lines:
        err.print(f"{report.num_malformed_lines} malformed line(s) or entries skipped and recorded in the trace metadata; first:")
        for loc in report.malformed_lines[:10]:
            err.print(f"  {loc}", markup=False, highlight=False)


def _why_empty(fmt: ImportFormat, src: Path, report) -> str:
    """One sentence: the import produced no request, and why (nothing to read, or all of it malformed)."""
    if hasattr(report, "num_files"):  # directory formats read conversation files
        n, unit = report.num_files, "file(s)"
    else:
        n, unit = report.num_lines - report.num_blank_lines, "non-blank line(s)"
    head = f"{src} imported no request as {fmt.value}"
    if report.num_malformed_lines:
        reasons = sorted(report.malformed_reasons.items(), key=lambda kv: -kv[1])
        first = f"; first: {report.malformed_lines[0]}" if report.malformed_lines else ""
        return (f"{head}: of its {n:,} {unit}, every record is malformed ({report.num_malformed_lines:,}; most often "
                f"{reasons[0][0]!r}){first}; is it a {fmt.value} input? Nothing was written.")
    what = "it holds no records" if n == 0 else f"its {n:,} {unit} hold no request"
    return f"{head}: {what}; nothing was written."


def _discard_empty(out_dir: Path, engine_id: str, existed: bool) -> None:
    """Remove what an import that produced no request wrote: its engine's metadata (the partition is new,
    checked before the import), and the trace directory itself when the import created it."""
    from kmesh_trace.writer import ENGINES_DIR, LOSS_SUFFIX, MARKER

    engines = out_dir / ENGINES_DIR
    for p in (engines / f"{engine_id}.json", engines / f"{engine_id}{LOSS_SUFFIX}"):
        p.unlink(missing_ok=True)
    if not existed:
        (out_dir / MARKER).unlink(missing_ok=True)
        for d in (engines, out_dir):
            try:
                d.rmdir()  # only when empty
            except OSError:
                pass
