"""`export`: a trace in other tools' formats. `export perfetto` writes a timeline for ui.perfetto.dev, `export
mooncake` the requests as Mooncake JSONL for replay clients (aiperf)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from kmesh_trace.cli.display import Table

from kmesh_trace.cli.common import EngineOption, SummaryJsonOption, TraceArgument, check_out_file, check_out_not_in_input, err, handles_errors, out, print_json
from kmesh_trace.cli.flags import flags, takes_flags
from kmesh_trace.values import MAX_BLOCKS, bounded_int

export_app = typer.Typer(help="Export a trace in other tools' formats.", no_args_is_help=True)

_SUMMARY_ROWS = (
    ("num_events", "trace events"),
    ("num_requests", "requests"),
    ("num_request_slices", "request slices (queued, prefill, decode)"),
    ("num_skipped_slices", "slices skipped (times out of order)"),
    ("num_families", "families"),
    ("num_free_block_samples", "free-block counter samples"),
    ("num_held_block_samples", "held-block counter samples"),
    ("num_evictions", "evictions"),
    ("num_clears", "prefix-cache clears"),
    ("num_transfers", "transfers"),
    ("num_skipped_transfers", "transfers skipped (no start or finish)"),
    ("num_bytes", "file bytes"),
)


def register(app: typer.Typer) -> None:
    app.add_typer(export_app, name="export")


@export_app.command("perfetto")
@handles_errors
def perfetto_cmd(
    trace: TraceArgument,
    out_path: Path = typer.Option(..., "--out", "-o", help="JSON file to write (FILE.json, or FILE.json.gz for gzip)."),
    as_json: SummaryJsonOption = False,
) -> None:
    """Write the trace as Chrome trace-event JSON: open it in ui.perfetto.dev or chrome://tracing.

    Exit codes: 0 ok; 1 could not run (usage, input or I/O error)."""
    from kmesh_trace.apps.perfetto import export_perfetto
    from kmesh_trace.trace import open_trace

    check_out_file(out_path, "--out")
    check_out_not_in_input(out_path, [trace])
    with open_trace(trace) as t:
        summary = export_perfetto(t, out_path)
    if as_json:
        print_json(summary)
        return
    rt = Table(title=f"perfetto timeline {summary['path']}", title_justify="left", show_header=False)
    rt.add_column("what")
    rt.add_column("count", justify="right")
    for key, label in _SUMMARY_ROWS:
        rt.add_row(label, f"{summary[key]:,}")
    rt.add_row("engines", ", ".join(summary["engines"]) or "none")
    rt.add_row("clock", summary["clock"])
    out.print(rt)
    err.print("Open it at https://ui.perfetto.dev (Open trace file) or in chrome://tracing.", style="dim")


@flags
class MooncakeFlags:
    """`export mooncake`'s flags; the export's own options are named as `export_mooncake` names them."""

    trace: TraceArgument
    out_path: Path = typer.Option(..., "--out", "-o", help="JSONL file to write.")
    block_tokens: int = typer.Option(512, "--block-tokens", parser=bounded_int(1, MAX_BLOCKS),
                                     help="Prompt tokens per hash id (aiperf: give the same --isl-block-size).")
    engine: EngineOption = None
    sessions: bool = typer.Option(False, "--sessions", help="Write each request's family as session_id (aiperf "
                                  "then replays a session's lines as turns of one conversation).")
    token_ids: bool = typer.Option(False, "--token-ids", help="Also write the prompt token ids as extra.prompt "
                                   "(aiperf sends them as the prompt): a capture's own, else synthesised from "
                                   "the hash ids (give --vocab-size).")
    vocab_size: Optional[int] = typer.Option(None, "--vocab-size", parser=bounded_int(3, 1 << 31),
                                             help="With --token-ids on a trace of hashes: ids in [2, N).")
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Write extra.ignore_eos = true (every request "
                                    "generates its output_length).")
    as_json: SummaryJsonOption = False


@export_app.command("mooncake")
@handles_errors
@takes_flags
def mooncake_cmd(f: MooncakeFlags) -> None:
    """Write the trace's requests as Mooncake JSONL (timestamp, input_length, output_length, hash_ids), the
    dataset aiperf replays with --custom-dataset-type mooncake_trace --fixed-schedule.

    Exit codes: 0 ok; 1 could not run (usage, input or I/O error)."""
    check_out_file(f.out_path, "--out")
    check_out_not_in_input(f.out_path, [f.trace])
    summary = _mooncake(f)
    if f.as_json:
        print_json(summary.as_dict())
        return
    _render_mooncake(summary)


def _mooncake(f: MooncakeFlags):
    """The export: the trace's requests written as Mooncake JSONL, and its summary."""
    from kmesh_trace.apps.mooncake_export import export_mooncake
    from kmesh_trace.trace import open_trace

    with open_trace(f.trace) as t:
        return export_mooncake(t, f.out_path, engine=f.engine, block_tokens=f.block_tokens, sessions=f.sessions,
                               token_ids=f.token_ids, vocab_size=f.vocab_size, ignore_eos=f.ignore_eos)


def _render_mooncake(summary) -> None:
    rt = Table(title=f"mooncake lines {summary.path}", title_justify="left", show_header=False)
    rt.add_column("what")
    rt.add_column("value", justify="right")
    rt.add_row("lines (requests)", f"{summary.num_lines:,}")
    rt.add_row("tokens per hash id", f"{summary.block_tokens:,}")
    rt.add_row("hash ids", f"{summary.num_hash_ids:,}")
    rt.add_row("distinct hash ids", f"{summary.num_distinct_hash_ids:,}")
    rt.add_row("hash ids from", summary.hash_source)
    rt.add_row("sessions", f"{summary.num_sessions:,}")
    rt.add_row("lines with token ids", f"{summary.num_token_id_lines:,}")
    out.print(rt)
    for note in summary.notes:
        err.print(note, style="dim")
