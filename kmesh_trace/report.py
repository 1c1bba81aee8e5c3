"""`kmesh-trace report`: one self-contained HTML page about a trace, for people to open and pass around.

The page is built from sections; each section runs the same public functions as one CLI command,
shows its numbers as tables (and inline SVG plots drawn by kmesh_trace.plots), and names the
command that reproduces it. The page fetches nothing (a Content-Security-Policy forbids it) and runs
no script; the data of every section is embedded as JSON (`<script type="application/json">`).

Sections are a registry. Adding one is one line in `SECTIONS` plus its builder:

    def my_section(ctx: ReportContext) -> Section | None:   # None: nothing to show for this trace
        result = my_analysis(ctx.trace)
        return Section("My analysis", f"kmesh-trace my-command {ctx.trace_arg} --json", result.to_dict(),
                       [table(["a", "b"], [[1, 2]])])

A builder that raises a KmeshTraceError (the trace lacks what the analysis needs) gives a section
that says why, instead of failing the page.
"""

from __future__ import annotations

import html
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from kmesh_trace.errors import KmeshTraceError

#: No fetch of any kind; inline styles and data: images only. A stray external reference is refused
#: by the browser and shows as a console error (the report test looks for those).
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


@dataclass
class ReportContext:
    trace: Any  # kmesh_trace.trace.Trace
    trace_arg: str  # the trace as the user named it, for the reproducing commands
    capacities: list[int] | None  # capacities to sweep (None: the analyses' defaults)
    engine: str | None = None

    def engine_flag(self) -> str:
        return f" --engine {self.engine}" if self.engine else ""


@dataclass
class Section:
    title: str
    command: str  # the command that reproduces the section's numbers
    data: Any  # what that command prints with --json (the page embeds it)
    body: list[str] = field(default_factory=list)  # HTML fragments: tables, plots, sentences
    id: str = ""  # filled from the registry key


# ---- HTML pieces ---------------------------------------------------------------------------------


def fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return {True: "yes", False: "no", None: "-"}[v]
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, id: str = "", keys: Sequence[str] | None = None) -> str:
    """An HTML table; every cell carries its raw value in `data-value`, and the columns their JSON keys
    (`keys`, default the headers) in `data-key`, so the page's numbers can be checked against --json."""
    keys = list(keys or headers)
    head = "".join(f'<th data-key="{html.escape(k)}">{html.escape(h)}</th>' for h, k in zip(headers, keys))
    body = []
    for r in rows:
        cells = "".join(
            f'<td data-value="{html.escape(json.dumps(v))}" class="{"num" if isinstance(v, (int, float)) and not isinstance(v, bool) else ""}">'
            f"{html.escape(fmt(v))}</td>" for v in r)
        body.append(f"<tr>{cells}</tr>")
    ident = f' id="{html.escape(id)}"' if id else ""
    return f"<table{ident}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def paragraph(text: str) -> str:
    return f"<p>{html.escape(text)}</p>"


def svg(draw: Callable[[Path], Path]) -> str:
    """Inline SVG of a figure drawn by kmesh_trace.plots (`draw(path)` writes FILE.svg)."""
    with tempfile.TemporaryDirectory() as d:
        text = draw(Path(d) / "figure.svg").read_text()
    start = text.find("<svg")
    return f'<figure>{text[start:]}</figure>'


# ---- sections ------------------------------------------------------------------------------------


def capture_section(ctx: ReportContext) -> Section:
    from kmesh_trace.trace import trace_info

    info = trace_info(ctx.trace)
    rows = [[name, t["rows"], t["parts"]] for name, t in info["tables"].items()]
    body = [table(["table", "rows", "parts"], rows, id="capture-tables")]
    for eid, meta in info["engines"].items():
        dropped = meta.get("num_dropped_events") or {}
        fields = [["engine_id", eid], ["source", meta.get("source")], ["engine", meta.get("engine")],
                  ["model", meta.get("model")], ["block_size", meta.get("block_size")],
                  ["num_usable_blocks", meta.get("num_usable_blocks")],
                  ["num_dropped_events", sum(v for v in dropped.values() if isinstance(v, int))],
                  ["complete", meta.get("complete")]]
        body.append(table(["field", "value"], fields, id=f"engine-{eid}"))
    return Section("Capture", f"kmesh-trace info {ctx.trace_arg} --json", info, body)


def audit_section(ctx: ReportContext) -> Section:
    from kmesh_trace.audit.capture import audit_capture

    result = audit_capture(ctx.trace)
    d = result.to_dict()
    verdict = [[name, v["qualified"], ", ".join(v["blocked_by"])] for name, v in d["verdict"].items()]
    body = [table(["analysis", "qualified", "blocked by"], verdict, id="audit-verdict", keys=["analysis", "qualified", "blocked_by"])]
    if d["problems"]:
        body.append(table(["severity", "code", "count", "what"],
                          [[p["severity"], p["code"], p["count"], p["message"]] for p in d["problems"]],
                          id="audit-problems", keys=["severity", "code", "count", "message"]))
    else:
        body.append(paragraph("No problems found."))
    return Section("Audit verdicts", f"kmesh-trace audit capture {ctx.trace_arg} --json", d, body)


def _caps_flag(ctx: ReportContext) -> str:
    return f" --capacity-blocks {','.join(map(str, ctx.capacities))}" if ctx.capacities else ""


def headroom_section(ctx: ReportContext) -> Section:
    from kmesh_trace.oracle.headroom import headroom
    from kmesh_trace.plots import plot_headroom

    result = headroom(ctx.trace, ctx.capacities, engine=ctx.engine)
    d = result.to_dict()
    keys = ["policy", "capacity_blocks", "hit_blocks", "hit_tokens", "prefill_tokens", "hit_ratio"]
    body = [svg(lambda p: plot_headroom(result, p)),
            table(["policy", "capacity", "hit_blocks", "hit_tokens", "prefill", "hit_ratio"],
                  [[r[k] for k in keys] for r in d["results"]], id="headroom-results", keys=keys)]
    if d["headroom_tokens"] is not None:
        body.append(paragraph(f"Headroom: {d['headroom_tokens']:,} prefill tokens at {d['headroom_capacity_blocks']:,} "
                              f"blocks (stock from {d['stock_source']} minus belady)."))
    body += [paragraph(f"Note: {n}") for n in result.notes]
    return Section("Headroom", f"kmesh-trace headroom {ctx.trace_arg}{_caps_flag(ctx)}{ctx.engine_flag()} --json", d, body)


def pressure_section(ctx: ReportContext) -> Section:
    from kmesh_trace.oracle.pressure import sweep, trace_stream, what_if
    from kmesh_trace.oracle.stream import pool_capacity
    from kmesh_trace.plots import plot_pressure_sweep

    ts = trace_stream(ctx.trace, ctx.engine)
    usable = pool_capacity(None, ts.num_usable_blocks)
    res = what_if(ts.requests, block_size=ts.block_size, num_usable_blocks=usable, lineage=ts.lineage)
    d = res.to_dict()
    arm_keys = ["child_hit_tokens", "other_hit_tokens", "hit_tokens", "prefill_tokens", "evictions"]
    body = [table(["arm", "child_hits", "other_hits", "hits", "prefill", "evictions"],
                  [[arm] + [d["arms"][arm][k] for k in arm_keys] for arm in ("stock", "held")],
                  id="pressure-arms", keys=["arm", *arm_keys]),
            paragraph(f"Holding each family's ancestor saves {d['saved_child_tokens']:,} child tokens and displaces "
                      f"{d['displaced_hit_tokens']:,} hit tokens of other requests: net {d['net_cached_tokens']:,} "
                      f"cached tokens at {d['capacity_blocks']:,} blocks.")]
    data: dict[str, Any] = {"at_capacity": d}
    command = f"kmesh-trace pressure {ctx.trace_arg}{ctx.engine_flag()} --json"
    if ctx.capacities and len(ctx.capacities) > 1:
        points = sweep(ts.requests, block_size=ts.block_size, capacities=ctx.capacities, lineage=ts.lineage)
        data["sweep"] = [p.to_dict() for p in points]
        keys = ["capacity_blocks", "stock_hit_tokens", "held_hit_tokens", "saved_child_tokens", "displaced_hit_tokens",
                "net_cached_tokens"]
        body += [svg(lambda p: plot_pressure_sweep(points, p, ts.block_size)),
                 table(["capacity", "stock_hits", "held_hits", "saved", "displaced", "net"],
                       [[s[k] for k in keys] for s in data["sweep"]], id="pressure-sweep", keys=keys)]
        command += f"; kmesh-trace pressure {ctx.trace_arg}{_caps_flag(ctx)}{ctx.engine_flag()} --json"
    return Section("Retention pressure", command, data, body)


def lineage_section(ctx: ReportContext) -> Section | None:
    from kmesh_trace.oracle.lineage_report import lineage_report
    from kmesh_trace.plots import plot_lineage

    if not ctx.trace.row_counts().get("lineage"):
        return None
    rep = lineage_report(ctx.trace, engine=ctx.engine)
    d = rep.to_dict()
    keys = ["what", "count", "min", "p50", "p90", "max", "mean"]
    rows = [[label, *(d[key][k] for k in keys[1:])] for label, key in (
        ("children per parent", "fan_out"), ("family depth (edges)", "depth"), ("family size (requests)", "family_size"),
        ("parent finish -> child arrival (s)", "gap_s"), ("shared-prefix blocks", "shared_blocks"))]
    summary_keys = ["num_requests", "num_families", "edge_kind", "num_edges", "num_dangling_edges", "num_parents"]
    body = [table(["requests", "families", "edge kind", "edges", "dangling", "parents"], [[d[k] for k in summary_keys]],
                  id="lineage-summary", keys=summary_keys),
            svg(lambda p: plot_lineage(rep, p)),
            table(keys, rows, id="lineage-distributions")]
    body += [paragraph(f"Note: {n}") for n in rep.notes]
    return Section("Lineage", f"kmesh-trace lineage {ctx.trace_arg}{ctx.engine_flag()} --json", d, body)


def tiers_section(ctx: ReportContext) -> Section | None:
    """A host x SSD sweep at the engine's own GPU capacity (multiples 0, 1, 2, 4 of it), ranked by hit
    tokens: what lower tiers would have bought. Shown for captures that record their KV geometry."""
    from kmesh_trace.oracle import tiers as tm
    from kmesh_trace.oracle.stream import engine_geometry, pool_capacity, request_blocks
    from kmesh_trace.plots import plot_tier_sweep

    meta = ctx.trace.engines[ctx.engine] if ctx.engine else ctx.trace.metadata
    if not meta.get("kv_bytes_per_token"):
        return None
    block_size, usable = engine_geometry(ctx.trace, ctx.engine)
    gpu = pool_capacity(None, usable)
    grid = [0, gpu, 2 * gpu, 4 * gpu]
    sw = tm.sweep_tiers(request_blocks(ctx.trace, ctx.engine), tm.TierConfig(gpu), grid, grid,
                        block_size=block_size, kv_bytes_per_token=int(meta["kv_bytes_per_token"]))
    d = sw.to_dict()
    keys = ["label", "hit_tokens", "recomputed_tokens", "num_lower_tier_reads", "lower_tier_read_bytes"]
    rows = [[c[k] for k in keys] for c in d["configurations"]]
    sizes = ",".join(map(str, grid))
    body = [paragraph(f"Host and SSD tiers below the GPU pool ({gpu:,} blocks), LRU, on-evict: best {d['best']}; "
                      f"the smallest within {d['within_pct']:g}% of it is {d['smallest_within']}. Restore costs "
                      "are not priced here: give a replay result to the command below for seconds."),
            svg(lambda p: plot_tier_sweep(sw, p, block_size)),
            table(["configuration", "hit tokens", "recomputed", "reads", "bytes read"], rows, id="tiers-sweep", keys=keys)]
    command = f"kmesh-trace tiers {ctx.trace_arg}{ctx.engine_flag()} --sweep-host {sizes} --sweep-ssd {sizes} --json"
    return Section("Tiers", command, d, body)


#: The page's sections, in order: id -> builder. One line per section.
SECTIONS: dict[str, Callable[[ReportContext], Section | None]] = {
    "capture": capture_section,
    "audit": audit_section,
    "headroom": headroom_section,
    "pressure": pressure_section,
    "lineage": lineage_section,
    "tiers": tiers_section,
}


# ---- the page ------------------------------------------------------------------------------------

_STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 64em; padding: 0 1em; color: #1b1b1b; background: #fff; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; margin: .8em 0; } th, td { border: 1px solid #ddd; padding: .25em .6em; text-align: left; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
code { background: #f3f3f3; padding: .1em .3em; word-break: break-all; } .reproduce { color: #555; }
.unavailable { color: #8a4b00; } figure { margin: 1em 0; } figure svg { max-width: 100%; height: auto; }
"""


def build(trace, *, trace_arg: str | None = None, capacities: Sequence[int] | None = None,
          engine: str | None = None) -> list[Section]:
    """Run every section's analysis over an opened trace."""
    ctx = ReportContext(trace, trace_arg or str(trace.path), list(capacities) if capacities else None, engine)
    sections = []
    for sid, builder in SECTIONS.items():
        try:
            s = builder(ctx)
        except KmeshTraceError as e:
            s = Section(sid.capitalize(), "", {"unavailable": str(e)},
                        [f'<p class="unavailable">Not available for this trace: {html.escape(str(e))}</p>'])
        if s is not None:
            s.id = sid
            sections.append(s)
    return sections


def render(sections: Sequence[Section], title: str) -> str:
    parts = [f"<section id=\"{s.id}\"><h2>{html.escape(s.title)}</h2>"
             + (f'<p class="reproduce">Reproduce: <code>{html.escape(s.command)}</code></p>' if s.command else "")
             + "".join(s.body) + "</section>" for s in sections]
    data = json.dumps({s.id: s.data for s in sections}, default=str).replace("</", "<\\/")
    toc = " · ".join(f'<a href="#{s.id}">{html.escape(s.title)}</a>' for s in sections)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><nav>{toc}</nav>{''.join(parts)}"
            f'<script type="application/json" id="report-data">{data}</script></body></html>\n')


def write_report(trace_path: str | Path, out: str | Path, *, capacities: Sequence[int] | None = None,
                 engine: str | None = None, trace_arg: str | None = None) -> dict[str, Any]:
    """Write the HTML report of the trace at `trace_path` to `out` (atomically); returns the sections'
    data by section id (what the page embeds)."""
    from kmesh_trace.trace import open_trace
    from kmesh_trace.writer import atomic_output

    with open_trace(trace_path) as t:
        sections = build(t, trace_arg=trace_arg or str(trace_path), capacities=capacities, engine=engine)
        page = render(sections, f"kmesh-trace report: {t.path.name}")
    with atomic_output(out) as tmp:
        tmp.write_text(page)
    return {s.id: s.data for s in sections}
