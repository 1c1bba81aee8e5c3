"""`audit corpus` and `audit capture`: fitness reports as tables or JSON, and linter-like exit codes.

Exit codes: 0 the audit ran and found nothing blocking; 3 it ran and found blocking problems; 1 it
could not run. The last line on stderr gives the reason in one line.
"""

from __future__ import annotations

from pathlib import Path

import typer
from kmesh_trace.cli.display import Table, prose

from kmesh_trace.audit.findings import EXIT_CLEAN, Problem, summary
from kmesh_trace.cli.common import (
    Output,
    emit,
    err,
    fail,
    handles_errors,
    out,
    output_options,
    progress,
)

audit_app = typer.Typer(
    help="Audit agent-trace corpora and captured traces for fitness. "
         "Exit codes: 0 nothing blocking, 3 blocking problems found, 1 the audit could not run.",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    app.add_typer(audit_app, name="audit")


def _finish(problems: list[Problem], code: int) -> None:
    if code == EXIT_CLEAN:
        err.print(f"OK: {summary(problems)}", markup=False, highlight=False, soft_wrap=True)
        return
    fail(f"audit found {summary(problems)}", code)


def _problems_table(problems: list[Problem]) -> Table:
    t = Table(title="problems", title_justify="left")
    # The first locations go under the table: a location (a file path and line) is one long word, and in a
    # column beside the message it would not fit 80 columns as a table.
    for h, short in (("severity", None), ("code", None), ("count", None), ("what", None)):
        t.add_column(h, justify="right" if h == "count" else "left", short=short)
    for p in problems:
        t.add_row(p.severity, p.code, f"{p.count:,}", p.message)
    located = [f"{p.code} at {', '.join(p.locations[:3])}" for p in problems if p.locations]
    if located:
        t.caption = "first locations:\n" + "\n".join(located)
    return t


_BLOCKING = "found a blocking problem (listed in the report)"


@audit_app.command("corpus")
@handles_errors
@output_options(blocking=_BLOCKING)
def corpus_cmd(
    directory: Path = typer.Argument(..., help="Corpus directory: one sub-directory per source, JSONL files inside."),
    output: Output = None,
) -> None:
    """Inventory, line health, duplicates, field coverage, lineage evidence and a verdict for a JSONL corpus."""
    from kmesh_trace.audit.corpus import audit_corpus

    with progress() as bar:
        task = bar.add_task("auditing", total=None)
        result = audit_corpus(directory, on_bytes=lambda n: bar.advance(task, n),
                              on_total=lambda n: bar.update(task, total=n))
    report = result.to_dict()
    emit(output, report, render=lambda: _render_corpus(report, result.problems))
    _finish(result.problems, result.exit_code)


def _render_corpus(r: dict, problems: list[Problem]) -> None:
    out.print(f"corpus {r['root']}: {r['jsonl_files']} JSONL files, {r['bytes']:,} bytes, "
              f"{r['nonempty_lines']:,} non-empty lines, {r['parsed_records']:,} records "
              f"({r['unique_records']:,} unique, {r['duplicate_records']:,} duplicate copies, "
              f"{r['near_duplicate_records']:,} near-duplicates), {r['malformed_lines']:,} malformed lines",
              markup=False, highlight=False)
    # Two tables, so that each fits 80 columns: the counts per source, then the keys and labels (long lists).
    t = Table(title="sources", title_justify="left")
    short = {"records": "recs", "malformed": "bad", "edges (pairs)": "edges"}  # at 80 columns, with a legend
    for h in ("source", "files", "empty", "bytes", "records", "malformed", "time unit", "edges (pairs)"):
        t.add_column(h, justify="right" if h in ("files", "empty", "bytes", "records", "malformed") else "left",
                     short=short.get(h))
    kt = Table(title="source keys and labels", title_justify="left")
    for h in ("source", "keys", "labels"):
        kt.add_column(h)
    for name, s in r["sources"].items():
        e = s["content_edges"]
        t.add_row(name, str(s["jsonl_files"]), str(len(s["empty_files"])), f"{s['bytes']:,}", f"{s['parsed_records']:,}",
                  f"{s['malformed_lines']:,}", s["timestamp_unit"] or "",
                  f"{e['pairs_with_edge']} ({e['pairs']})" if e else "")
        kt.add_row(name, ", ".join(s["fields"]), ", ".join(sorted(s["labels"])))
    out.print(t)
    out.print(kt)
    ev = Table(title="lineage evidence (records carrying it)", title_justify="left")
    for h in ("evidence", "records", "of", "fields recognised"):
        ev.add_column(h, overflow="fold")
    for cat, v in r["lineage"]["evidence"].items():
        ev.add_row(cat, f"{v['records']:,}", f"{v['of']:,}", ", ".join(v["fields"]))
    ce = r["lineage"]["content_edges"]
    ev.caption = (f"content-only edges (not lineage): {ce['input_extends_previous']} input extends previous, "
                  f"{ce['previous_output_in_next_input']} previous output in next input, over {ce['pairs']} pairs "
                  f"in {ce['sessions']} sessions")
    out.print(ev)
    vt = Table(title="verdict", title_justify="left")
    for h in ("analysis", "qualified", "missing evidence", "sources that qualify alone"):
        vt.add_column(h, overflow="fold")
    for analysis, v in r["verdict"].items():
        missing = [f"{m['evidence']} ({m['records_with']}/{m['of']})" for m in v["missing"]]
        if v["labelled_sources"]:
            missing.append("labelled: " + ", ".join(v["labelled_sources"]))
        vt.add_row(analysis, "yes" if v["qualified"] else "no", "; ".join(missing), ", ".join(v["qualified_sources"]) or "none")
    out.print(vt)
    if problems:
        out.print(_problems_table(problems))


@audit_app.command("capture")
@handles_errors
@output_options(blocking=_BLOCKING)
def capture_cmd(
    trace: Path = typer.Argument(..., help="Trace directory written by a capture."),
    output: Output = None,
) -> None:
    """Capture fitness: contract fields filled, block events consistent, cached tokens, clocks, drops."""
    from kmesh_trace.audit.capture import audit_capture

    result = audit_capture(trace)
    emit(output, result.to_dict(), render=lambda: _render_capture(result))
    _finish(result.problems, result.exit_code)


def _render_capture(result) -> None:
    rows = ", ".join(f"{k} {v:,}" for k, v in result.rows.items())
    prose(f"trace {result.path}: engines {', '.join(result.engines) or 'none'}; rows: {rows}")
    vt = Table(title="verdict", title_justify="left")
    for h in ("analysis", "qualified", "blocked by"):
        vt.add_column(h)
    for analysis, v in result.verdict.items():
        vt.add_row(analysis, "yes" if v["qualified"] else "no", ", ".join(v["blocked_by"]))
    out.print(vt)
    for eng, imp in result.imports.items():
        it = Table(title=f"imported partition {eng} ({imp['source']}): not a capture", title_justify="left")
        it.add_column("supports", overflow="fold")
        it.add_column("stays approximate or modelled", overflow="fold")
        for i in range(max(len(imp["supports"]), len(imp["approximate"]))):
            it.add_row(*(col[i] if i < len(col) else "" for col in (imp["supports"], imp["approximate"])))
        out.print(it)
        if imp.get("gaps"):
            out.print(f"what an import never holds (inherent, not problems): {'; '.join(imp['gaps'])}",
                      markup=False, highlight=False)
    for eng, groups in result.kv_groups.items():
        gt = Table(title=f"KV cache groups of {eng}: block events", title_justify="left")
        for h in ("group", "kind", "alloc", "touched", "cached", "freed", "early", "evicted"):
            gt.add_column(h, justify="left" if h == "kind" else "right")
        for g in groups:
            kind = f"window {g['sliding_window']}" if g["sliding_window"] else g["kind"]
            gt.add_row(str(g["group"]), kind, *(f"{g[k]:,}" for k in ("num_allocated", "num_touched", "num_cached",
                                                                        "num_freed", "num_freed_while_running",
                                                                        "num_evicted")))
        out.print(gt)
        out.print("early: freed before the request's last free of that group (a sliding window moved past "
                  "the blocks, or a preemption)", markup=False, highlight=False)
    if result.problems:
        out.print(_problems_table(result.problems))

