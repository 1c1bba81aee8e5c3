"""`kmesh-trace report`: one self-contained HTML page about a trace, for people to open and pass around.

The page is the analyses' front page. It leads with the answer (`kmesh-trace advise`: the ladder, its
verdict and the recommendation); then each section runs the same public functions as one CLI command
does by default (the headroom curve, the pressure tradeoff along the capacity axis, the lineage
statistics, the tiers sweep, the fleet what-if), shows its numbers as tables and inline SVG plots
drawn by kmesh_trace.apps.plots, defines its terms in a "how to read this" box, and names the command
that reproduces it. Where the trace lacks a value a command needs (an import records no pool size),
the section chooses one, says which and why, and the reproducing command carries it as an option.
The page fetches nothing (a Content-Security-Policy forbids it) and runs no script; the data of every
section is embedded as JSON (`<script type="application/json">`, with `<`, `>` and `&` escaped so no
string in a trace can close the element or open a comment). The HTML comes from Jinja2 templates
(kmesh_trace/apps/templates/report_*.html.j2) with autoescaping on: every value is escaped as
`html.escape` escapes it, and only the pieces built here (tables, plots, the embedded data) pass as
markup.

Sections are a registry. Adding one is one line in `SECTIONS` plus its builder:

    def my_section(ctx: ReportContext) -> Section | None:   # None: nothing to show for this trace
        result = my_analysis(ctx.trace)
        return Section("My analysis", ctx.command("my-command"), result.to_dict(),
                       [table(["a", "b"], [[1, 2]])])

A builder that raises a KmeshTraceError (the trace lacks what the analysis needs) gives a section
that says why, instead of failing the page; a hint (`hint`) names the command and option that would
supply what is missing, and the tests check every hint's option against the CLI.
"""

from __future__ import annotations

import html
import json
import tempfile
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Sequence

import jinja2
from markupsafe import Markup

from kmesh_trace.errors import KmeshTraceError, NeedsParameterError
from kmesh_trace.oracle.model_error import MODEL_ERROR, UNMEASURED
from kmesh_trace.schema import EdgeKind, PressureEdges

#: No fetch of any kind; inline styles and data: images only. A stray external reference is refused
#: by the browser and shows as a console error (the report test looks for those).
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"

#: Python parameter names (NeedsParameterError) -> the CLI option that gives them.
OPTION_OF_PARAMETER = {"capacity_blocks": "--capacity-blocks", "engine": "--engine", "edges": "--edges"}
#: At most this many capacities in the pressure sweep (each is two pool replays).
MAX_PRESSURE_POINTS = 7


@dataclass
class ReportContext:
    trace: Any  # kmesh_trace.trace.Trace
    trace_arg: str  # the trace as the user named it, for the reproducing commands
    capacities: list[int] | None  # capacities to sweep (None: the analyses' defaults)
    engine: str | None = None
    curve: Any = None  # the headroom section's CurveResult, which later sections choose capacities from

    def engine_flag(self) -> str:
        return f" --engine {self.engine}" if self.engine else ""

    def command(self, name: str, options: Any = "") -> str:
        """The command line that reproduces a section: `options` is an analysis' options object (its flags
        derived by `kmesh_trace.oracle.options.flags`) or the flags as text."""
        from kmesh_trace.oracle.options import flags

        text = options if isinstance(options, str) else flags(options)
        return f"kmesh-trace {name} {self.trace_arg}{text}{self.engine_flag()} --json"

    @cached_property
    def geometry(self) -> tuple[int, int | None]:
        from kmesh_trace.oracle.stream import engine_geometry

        return engine_geometry(self.trace, self.engine)

    @cached_property
    def workload(self):
        """The engine's Workload (`kmesh_trace.oracle.workload`), read once for every section."""
        from kmesh_trace.oracle.workload import Workload

        return Workload.from_trace(self.trace, self.engine)

    @property
    def requests(self):
        return self.workload.requests

    @cached_property
    def fitted(self):
        """The prefill cost fitted to the capture, as headroom and tiers fit it (`oracle.headroom.FittedPrefill`)."""
        from kmesh_trace.oracle.headroom import fitted_prefill

        return fitted_prefill(self.trace, self.engine)

    @property
    def prefill(self):
        """(cost or None, fit report or None, why there are no seconds or None)."""
        f = self.fitted
        return f.cost, f.fit, f.why

    @property
    def meta(self) -> dict:
        return self.trace.engines[self.engine] if self.engine else self.trace.metadata

    @property
    def is_import(self) -> bool:
        return str(self.meta.get("source", "")).startswith("import")

    def pool_blocks(self) -> tuple[int, str]:
        """A GPU pool capacity for the what-ifs that need one, and where it comes from: the engine's
        usable blocks, else (an import) the smallest capacity at which LRU reaches half of the infinite
        cache's hits (from the headroom curve), else the curve's middle grid point."""
        _, usable = self.geometry
        if usable:
            return int(usable), "the engine's usable blocks"
        if self.curve is not None:
            half = self.curve.capacity_for_fraction().get("lru", {}).get("0.5")
            if half:
                return int(half), "no pool size recorded: the capacity at which LRU reaches half the infinite cache's hits"
            return int(self.curve.grid[len(self.curve.grid) // 2]), "no pool size recorded: the headroom grid's middle"
        raise NeedsParameterError("the trace does not record the engine's usable blocks (imported traces cannot)",
                                  "capacity_blocks", "N")


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


def _escaped(value: Any) -> Markup:
    """Every `{{ }}` of the templates: markup as it is, anything else escaped as html.escape does (quotes
    too), so the page is the one the f-strings it replaced wrote."""
    return value if isinstance(value, Markup) else Markup(html.escape(str(value)))


_TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).resolve().parent / "templates"),
    autoescape=True, finalize=_escaped, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
_TEMPLATES.filters.update(fmt=fmt, json=json.dumps)
_TEMPLATES.tests["numeric"] = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
_TEMPLATES.globals["zip"] = zip
_PIECES = _TEMPLATES.get_template("report_pieces.html.j2").module


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, id: str = "", keys: Sequence[str] | None = None) -> str:
    """An HTML table; every cell carries its raw value in `data-value`, and the columns their JSON keys
    (`keys`, default the headers) in `data-key`, so the page's numbers can be checked against --json."""
    return _PIECES.table(headers, list(keys or headers), rows, id)


def paragraph(text: str) -> str:
    return _PIECES.paragraph(text)


def hint(text: str, command: str, option: str, example: str) -> str:
    """A sentence naming a real option of a real command (`data-command`, `data-option`: the tests check
    both against the CLI) and the example command line that uses it."""
    return _PIECES.hint(text, command, option, example)


def howto(terms: Sequence[tuple[str, str]]) -> str:
    """The "how to read this" box: each term of the section and what it means."""
    return _PIECES.howto(terms)


def svg(draw: Callable[[Path], Path]) -> str:
    """Inline SVG of a figure drawn by kmesh_trace.apps.plots (`draw(path)` writes FILE.svg)."""
    with tempfile.TemporaryDirectory() as d:
        text = draw(Path(d) / "figure.svg").read_text()
    start = text.find("<svg")
    return _PIECES.figure(Markup(text[start:]))  # matplotlib's own SVG, inlined as it is


def embedded_json(obj: Any) -> str:
    """JSON safe inside `<script type="application/json">`: `<`, `>` and `&` as \\u escapes, so a trace
    string holding `</script>` or `<!--` cannot end the element or start a comment (JSON.parse reads
    the escapes back as the same characters)."""
    return (json.dumps(obj, default=str).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


# ---- terms -----------------------------------------------------------------------------------------

TERMS = {
    "stock": "what the engine actually reused, read from the capture (imports have no engine, hence no stock; "
             "the vllm model at the engine's usable blocks stands in when the capture has no hit counts).",
    "vllm": "a model of vLLM's block pool (running requests pin their blocks, freed blocks are evicted least "
            f"recently used first), replayed on the trace's requests; {MODEL_ERROR.summary}.",
    "lru": "a plain least-recently-used prefix cache of the same capacity.",
    "belady": "the headroom bound: knowing the whole future, it keeps the blocks needed soonest, any block "
              "independently of its prefix. No prefix cache can beat it.",
    "belady-prefix": "the same future knowledge applied only as a prefix cache can (it evicts leaves of the prefix "
                     "tree), so a real cache could reach it.",
    "bracket": "the shaded band from belady-prefix to belady: the best prefix cache lies inside it.",
    "headroom": "prefill tokens the stock cache (or vllm) computed that belady would have reused: stock prefill - "
                "belady prefill, at the same capacity. Small headroom means no policy can win much.",
    "hit ratio": "hit prompt blocks / prompt blocks read.",
    "infinite": "a cache that never evicts: every repeated prefix hits (the ceiling of every curve).",
}


def terms(*names: str) -> list[tuple[str, str]]:
    return [(n, TERMS[n]) for n in names]


# ---- sections ------------------------------------------------------------------------------------


def advise_section(ctx: ReportContext) -> Section:
    """The answer first: the `advise` ladder of the trace with its verdict, a plot, and the recommendation."""
    from kmesh_trace.apps.advise import AdviseOptions, advise, unanswered_sentence
    from kmesh_trace.apps.plots import plot_ladder

    options = AdviseOptions(capacity_blocks=ctx.capacities[0] if ctx.capacities else None)
    d = advise(ctx.trace, options, source_arg=ctx.trace_arg, engine=ctx.engine).to_dict()
    keys = ["rung", "label", "token_hit_ratio", "hit_ratio", "model_error", "prefill_tokens", "prefill_s",
            "capacity_blocks", "capacity_bytes"]
    rec = d["recommendation"]
    e = d["model_error"]
    body = [paragraph(d["verdict"]),
            howto([("rung", "one configuration: infinite (a cache that never evicts), bound (Belady at the pool), "
                            "stock (the engine as captured), modelled (the vllm pool model), holds (family holds), "
                            "host-50/90/99 (a host tier reaching that share of what lower tiers can add), ssd (the "
                            "90% host tier plus an SSD tier), fleet-best / fleet-global (N engines)."),
                   ("token hit ratio", "hit prompt tokens / prompt tokens, as vLLM counts prefix-cache hits."),
                   ("recommendation", f"the cheapest rung within {rec['within_pct']:g}% of the bound's hit tokens "
                                      "(hatched in the plot), as the settings that realise it."),
                   ("vs engine", "how far the rung's hit ratio may be from a real engine's: the largest error of "
                                 "the vllm pool model against vLLM replaying traces under capture (modelled), or "
                                 "not measured (the what-ifs no engine replayed; the note below says why)."),
                   ("reproduce", "each rung's numbers are in the --json output of the command in its row.")]),
            svg(lambda p: plot_ladder(d, p)),
            table(["rung", "what", "token hit", "block hit", "vs engine", "prefill tokens", "prefill s", "blocks",
                   "bytes"], [[r[k] for k in keys] for r in d["ladder"]], id="advise-ladder", keys=keys),
            paragraph(f"Modelled, {e['summary']}: the largest, {e['largest']}. Replays: {'; '.join(e['commands'])} "
                      f"(results in {e['results']}). Not measured: "
                      + "; ".join(f"{k}: {why}" for k, why in e["unmeasured"].items()) + "."),
            paragraph(f"Recommendation: {rec['label']}: {rec['how']}.")]
    body += [paragraph(f"Not answered here: {unanswered_sentence(u)}")
             for u in d["unanswered"]]
    flag = f" --capacity-blocks {options.capacity_blocks}" if options.capacity_blocks else ""
    return Section("Advice", f"kmesh-trace advise {ctx.trace_arg}{flag}{ctx.engine_flag()} --json", d, body)


def capture_section(ctx: ReportContext) -> Section:
    from kmesh_trace.trace import trace_info

    info = trace_info(ctx.trace)
    rows = [[name, t["rows"], t["parts"]] for name, t in info["tables"].items()]
    body = [howto([("source", "capture: recorded by the plugin inside vLLM; import:FORMAT: converted from a public "
                              "trace file (requests and block hashes only, no engine)."),
                   ("block_size", "tokens per KV block: only full blocks are reusable."),
                   ("num_usable_blocks", "the engine's KV pool, in blocks (imports do not record one)."),
                   ("complete", "the writer closed cleanly (no: the capture was cut short).")]),
            table(["table", "rows", "parts"], rows, id="capture-tables")]
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
    body = [howto([("qualified", "the trace holds what the analysis needs to be measured on a capture (stock from the "
                                 "engine, timings, block events)."),
                   ("blocked by", "the problem codes that stop it; import: the trace is an import, which can support "
                                  "what-ifs but never qualifies as a capture."),
                   ("inherent gaps", "what an import can never hold; listed once, not problems to fix.")]),
            table(["analysis", "qualified", "blocked by"], verdict, id="audit-verdict", keys=["analysis", "qualified", "blocked_by"])]
    for eng, imp in d.get("imports", {}).items():
        n = max(len(imp["supports"]), len(imp["approximate"]))
        body.append(table(["supports", "stays approximate or modelled"],
                          [[(imp["supports"] + [""] * n)[i], (imp["approximate"] + [""] * n)[i]] for i in range(n)],
                          id=f"audit-import-{eng}", keys=["supports", "approximate"]))
        if imp.get("gaps"):
            body.append(paragraph(f"Inherent gaps of the import {eng}: {'; '.join(imp['gaps'])}."))
    if d["problems"]:
        body.append(table(["severity", "code", "count", "what"],
                          [[p["severity"], p["code"], p["count"], p["message"]] for p in d["problems"]],
                          id="audit-problems", keys=["severity", "code", "count", "message"]))
    else:
        body.append(paragraph("No problems found."))
    return Section("Audit verdicts", f"kmesh-trace audit capture {ctx.trace_arg} --json", d, body)


def headroom_section(ctx: ReportContext) -> Section:
    if ctx.capacities:
        return _headroom_at(ctx)
    from kmesh_trace.oracle import headroom as hr
    from kmesh_trace.oracle.executor import executor_for
    from kmesh_trace.apps.plots import plot_headroom_curve

    options = hr.HeadroomOptions()
    res = ctx.curve = hr.run(ctx.workload, options, executor_for(), fitted=ctx.fitted, note=_approximate(ctx))
    d = res.to_dict()
    cost, why = res.cost, ctx.fitted.why
    rows = res.along_grid()
    pols = list(res.curves)
    keys = ["capacity_blocks", *(f"{p}.hit_ratio" for p in pols), "headroom_tokens", "bracket_width_tokens"]
    with_s = cost is not None
    if with_s:
        keys.append("headroom_seconds")
    cells = [[row["capacity_blocks"], *(row[p]["hit_ratio"] for p in pols), row.get("headroom_tokens"),
              row.get("bracket_width_tokens"), *([row.get("headroom_seconds")] if with_s else [])] for row in rows]
    body = [howto(terms("hit ratio", "stock", "vllm", "lru", "belady", "belady-prefix", "bracket", "headroom", "infinite")
                  + [("capacity", "pool size in blocks of the trace's block size; the grid doubles up to the working set.")]),
            svg(lambda p: plot_headroom_curve(res, p))]
    if res.stock is not None:
        s = res.stock
        at = next((r for r in rows if r["capacity_blocks"] == s["capacity_blocks"]), None)
        text = (f"Stock ({s['source']}) at {s['capacity_blocks']:,} blocks: {s['prefill_tokens']:,} prefill tokens "
                f"of {res.num_prompt_tokens:,} prompt tokens")
        if at is not None and "headroom_tokens" in at:
            text += f"; headroom there {at['headroom_tokens']:,} prefill tokens (vllm minus belady)"
        body.append(paragraph(text + "."))
    else:
        body.append(paragraph("No stock: no engine served this trace (an import), so every curve is a model; the "
                              "star is absent."))
    body.append(table(["capacity", *pols, "headroom tokens", "bracket width", *(["headroom s"] if with_s else [])],
                      cells, id="headroom-grid", keys=keys))
    frac = res.capacity_for_fraction()
    body.append(table(["policy", "50% of infinite", "90%", "99%"],
                      [[p, *frac[p].values()] for p in pols], id="headroom-fractions",
                      keys=["policy", "0.5", "0.9", "0.99"]))
    if res.ttft:
        qs = ("mean", "p50", "p90", "p99")
        body.append(table(["policy (prefill s per request at stock capacity)", *qs],
                          [[p, *(v.get(q) for q in qs)] for p, v in res.ttft.items()], id="headroom-ttft",
                          keys=["policy", *qs]))
    elif why:
        body.append(hint(f"No prefill seconds: {why}:", "headroom", "--prefill-tokens-per-s",
                         f"kmesh-trace headroom {ctx.trace_arg} --prefill-tokens-per-s 20000"))
    body += [paragraph(f"Note: {n}") for n in res.notes]
    return Section("Headroom", ctx.command("headroom", options), d, body)


def _approximate(ctx: ReportContext) -> str | None:
    from kmesh_trace.trace import approximate_tokens

    return approximate_tokens(ctx.trace)


def _headroom_at(ctx: ReportContext) -> Section:
    """Headroom at the capacities the user gave: one row per capacity, one column per policy (as the CLI)."""
    from kmesh_trace.oracle import headroom as hr
    from kmesh_trace.apps.plots import plot_headroom

    options = hr.HeadroomOptions(capacities=tuple(ctx.capacities))
    result = hr.run(ctx.workload, options)
    d = result.to_dict()
    pols = list(dict.fromkeys(r["policy"] for r in d["results"]))
    caps = sorted({r["capacity_blocks"] for r in d["results"]})
    by = {(r["policy"], r["capacity_blocks"]): r for r in d["results"]}
    cells = [[c, *((by[(p, c)]["hit_ratio"] if (p, c) in by else None) for p in pols)] for c in caps]
    body = [howto(terms("hit ratio", "stock", "vllm", "lru", "belady", "belady-prefix", "headroom", "infinite")),
            svg(lambda p: plot_headroom(result, p)),
            table(["capacity", *pols], cells, id="headroom-pivot", keys=["capacity_blocks", *pols])]
    if d["headroom_tokens"] is not None:
        body.append(paragraph(f"Headroom: {d['headroom_tokens']:,} prefill tokens at {d['headroom_capacity_blocks']:,} "
                              f"blocks (stock from {d['stock_source']} minus belady)."))
    body += [paragraph(f"Note: {n}") for n in result.notes]
    return Section("Headroom", ctx.command("headroom", options), d, body)


def _pressure_edges(ctx: ReportContext) -> str:
    """The edges `pressure` can use here: declared when the trace declares parents, else the import's
    content edges when those are all it has, else exact-prefix edges inferred from block hashes."""
    if any(r.parent_index is not None for r in ctx.requests):
        return PressureEdges.declared.value
    kinds = set()
    if ctx.trace.row_counts().get("lineage"):
        kinds = set(ctx.trace.scan("lineage").select("edge_kind").unique().collect().get_column("edge_kind").to_list())
    content, exact = EdgeKind.content.value, EdgeKind.exact_prefix.value
    return (PressureEdges.content if content in kinds and exact not in kinds else PressureEdges.inferred).value


def _sweep_capacities(ctx: ReportContext, at: int) -> list[int]:
    """The pressure sweep's capacities: the user's, else the headroom grid from 8 blocks up, thinned to at
    most MAX_PRESSURE_POINTS, with the pool capacity `at` among them."""
    if ctx.capacities and len(ctx.capacities) > 1:
        return list(ctx.capacities)
    grid = [c for c in (ctx.curve.grid if ctx.curve is not None else []) if c >= 8] or [at]
    step = max(1, -(-len(grid) // (MAX_PRESSURE_POINTS - 1)))
    return sorted(set(grid[::step]) | {at})


def pressure_section(ctx: ReportContext) -> Section:
    from kmesh_trace.oracle import pressure as pr
    from kmesh_trace.apps.plots import plot_pressure_sweep

    edges = _pressure_edges(ctx)
    pr.check_has_requests(ctx.trace, ctx.engine)
    w = ctx.workload
    usable, where = ctx.pool_blocks()
    options = pr.PressureOptions(pr.PressureEdges(edges), None if w.num_usable_blocks else (usable,))
    res = pr.run(w, options)
    res.note = note = _approximate(ctx)
    d = res.to_dict()
    arm_keys = ["child_hit_tokens", "other_hit_tokens", "hit_tokens", "prefill_tokens", "evictions"]
    body = [howto([("hold", "an extra reference on a family's ancestor blocks, taken when the parent finishes and "
                            "released when its children have been admitted (or on expiry)."),
                   ("stock / held", "the same requests replayed through the vllm pool model without and with holds."),
                   ("saved", "child prefill tokens the holds turned into hits."),
                   ("displaced", "hit tokens of other requests the held blocks pushed out."),
                   ("net", "saved - displaced: the cache's total gain (negative: holding loses)."),
                   ("the sweep", "holds pay only in a window of capacities: below it the held ancestor does not fit "
                                 "beside the running requests, above it the stock cache keeps the ancestor anyway "
                                 "(saved 0). A narrow peak is that window; flat zero means no window on this trace."),
                   ("family", "as the lineage section counts them: a declared family id, else one tree of edges; "
                              "holds are taken per parent."),
                   ("edges", f"{edges}: " + {"declared": "the parents the trace declares.",
                                             "inferred": "the trace declares no parents, so a child is a request "
                                                         "whose prompt extends an earlier request's whole prompt "
                                                         "and output (exact prefix).",
                                             "content": "the import's content edges, guessed from text."}[edges])]),
            table(["arm", "child_hits", "other_hits", "hits", "prefill", "evictions"],
                  [[arm] + [d["arms"][arm][k] for k in arm_keys] for arm in ("stock", "held")],
                  id="pressure-arms", keys=["arm", *arm_keys]),
            paragraph(f"At {usable:,} blocks ({where}): holding each parent's ancestor for its children saves "
                      f"{d['saved_child_tokens']:,} child tokens and displaces {d['displaced_hit_tokens']:,} hit tokens "
                      f"of other requests: net {d['net_cached_tokens']:,} cached tokens, over {d['num_families']:,} "
                      f"families and {d['num_parents']:,} parents.")]
    data: dict[str, Any] = {"at_capacity": d}
    command = ctx.command("pressure", options)
    caps = _sweep_capacities(ctx, usable)
    if len(caps) > 1:
        along = replace(options, capacities=tuple(caps))
        swept = pr.run(w, along)
        swept.note, points = note, swept.points
        data["sweep"] = swept.to_dict()
        keys = ["capacity_blocks", "stock_hit_tokens", "held_hit_tokens", "saved_child_tokens", "displaced_hit_tokens",
                "net_cached_tokens"]
        body += [svg(lambda p: plot_pressure_sweep(points, p, w.block_size)),
                 table(["capacity", "stock_hits", "held_hits", "saved", "displaced", "net"],
                       [[s[k] for k in keys] for s in data["sweep"]["sweep"]], id="pressure-sweep", keys=keys)]
        command += "; " + ctx.command("pressure", along)
    return Section("Retention pressure", command, data, body)


def lineage_section(ctx: ReportContext) -> Section | None:
    from kmesh_trace.oracle import lineage_report as lr
    from kmesh_trace.apps.plots import plot_lineage

    if not ctx.trace.row_counts().get("lineage"):
        return None
    options = lr.LineageOptions()
    rep = lr.run(ctx.trace, options, ctx.engine, note=_approximate(ctx))
    d = rep.to_dict()
    keys = ["what", "count", "min", "p50", "p90", "max", "mean"]
    rows = [[label, *(d[key][k] for k in keys[1:])] for label, key in (
        ("children per parent", "fan_out"), ("family depth (edges)", "depth"), ("family size (requests)", "family_size"),
        ("parent finish -> child arrival (s)", "gap_s"), ("shared-prefix blocks", "shared_blocks"))]
    summary_keys = ["num_requests", "num_families", "edge_kind", "num_edges", "num_dangling_edges", "num_parents"]
    body = [howto([("family", "a declared family id, else one tree of edges; a request in neither is a singleton."),
                   ("edge", "child -> parent: declared by the caller, exact_prefix (the child's prompt extends the "
                            "parent's prompt and output) or content (guessed by an importer)."),
                   ("parent", "a request with at least one child (pressure takes one hold per parent)."),
                   ("gap", "the child's arrival minus the parent's finish: how long a hold would be kept."),
                   ("shared-prefix blocks", "full blocks the child's prompt shares with the parent's prompt + output.")]),
            table(["requests", "families", "edge kind", "edges", "dangling", "parents"], [[d[k] for k in summary_keys]],
                  id="lineage-summary", keys=summary_keys),
            svg(lambda p: plot_lineage(rep, p)),
            table(keys, rows, id="lineage-distributions")]
    body += [paragraph(f"Note: {n}") for n in rep.notes]
    return Section("Lineage", ctx.command("lineage", options), d, body)


def tiers_section(ctx: ReportContext) -> Section:
    """A host x SSD sweep at the GPU pool (multiples 0, 1, 2, 4 of it), ranked by hit tokens (or seconds
    saved, with restore costs): what lower tiers would have bought."""
    from kmesh_trace.oracle import tier_costs as tc
    from kmesh_trace.oracle.options import flags
    from kmesh_trace.oracle import tiers as tm
    from kmesh_trace.apps.plots import plot_tier_sweep

    ctx.workload.refuse_hybrid("tiers")
    block_size, usable = ctx.geometry
    gpu, where = ctx.pool_blocks()
    kvbpt, _ = tc.kv_bytes_per_token(ctx.meta, None, None)
    cost, _, _ = ctx.prefill
    grid = [0, gpu, 2 * gpu, 4 * gpu]
    sw = tm.sweep_tiers(ctx.requests, tm.TierConfig(gpu, tuple(tm.TierSpec(n, 1) for n in tm.TIER_NAMES)), grid, grid,
                        block_size=block_size, kv_bytes_per_token=kvbpt, costs={}, prefill=cost)
    d = sw.to_dict()
    keys = ["label", "hit_tokens", "recomputed_tokens", "num_lower_tier_reads", "lower_tier_read_bytes"]
    rows = [[c[k] for k in keys] for c in d["configurations"]]
    sizes = ",".join(map(str, grid))
    options = tm.TiersOptions(capacity_blocks=None if usable else gpu, sweep_host=sizes, sweep_ssd=sizes)
    flat = [v for row in d["grid"] for v in row]
    spread = (max(flat) - min(flat)) / max(flat) if flat and max(flat) else 0.0
    body = [howto([("GPU / host / SSD", "the engine's pool, then host memory, then SSD; a prompt block is usable "
                                        "while every earlier block of the prompt is in some tier."),
                   ("configuration", "host x SSD capacity in blocks (none: the tier is absent), LRU, stored on eviction."),
                   ("hit tokens", "prompt tokens served by any tier instead of recomputed."),
                   ("best / smallest within", "the highest cell, and the one with the fewest lower-tier blocks within "
                                              f"{d['within_pct']:g}% of it."),
                   ("colour scale", "from 0 to the best cell, so a small spread looks small.")]),
            paragraph(f"Host and SSD tiers below a GPU pool of {gpu:,} blocks ({where}): best {d['best']}; the smallest "
                      f"within {d['within_pct']:g}% of it is {d['smallest_within']}; the cells differ by "
                      f"{spread:.1%} of the best. Every cell is a prediction no engine measured: "
                      f"{UNMEASURED['tiers']}."),
            hint("Restore costs are not priced here; for seconds saved, give the restores measured on the target host "
                 "(a `replay run --out` directory):", "tiers", "--restore-results",
                 f"kmesh-trace tiers {ctx.trace_arg}{flags(options)} --restore-results DIR"),
            svg(lambda p: plot_tier_sweep(sw, p, block_size)),
            table(["configuration", "hit tokens", "recomputed", "reads", "bytes read"], rows, id="tiers-sweep", keys=keys)]
    return Section("Tiers", ctx.command("tiers", options), d, body)


#: Engines in the fleet what-if of a one-engine trace with families.
FLEET_ENGINES = (2, 4, 8)


def fleet_section(ctx: ReportContext) -> Section | None:
    """Routing over N engines against one global pool: shown when the trace has several engines, or
    families a family-aware router could keep together."""
    from kmesh_trace.oracle import fleet
    from kmesh_trace.oracle.options import flags
    from kmesh_trace.apps.plots import plot_fleet

    several = len(ctx.trace.engines) > 1
    if not several and not any(r.family_id is not None or r.parent_index is not None for r in ctx.requests):
        return None
    if several:  # every engine's pool: one size, or the user's
        pools = {m.get("num_usable_blocks") for m in ctx.trace.engines.values()}
        if len(pools) != 1 or not next(iter(pools)):
            raise NeedsParameterError("the trace's engines record different pools, or none", "capacity_blocks", "N")
        cap, where = int(pools.pop()), "the engines' usable blocks"
    else:
        cap, where = ctx.pool_blocks()
    # A line, not a point: the trace's engines at a few capacities, or one engine's requests over 2..8 engines.
    ns = [len(ctx.trace.engines)] if several else list(FLEET_ENGINES)
    caps = sorted({max(cap // 4, 1), max(cap // 2, 1), cap, 2 * cap}) if several else [cap]
    options = fleet.FleetOptions(None if several else tuple(ns), tuple(caps))
    result = fleet.run(ctx.trace, options)
    d = result.to_dict()
    keys = ["num_engines", "capacity_blocks", "policy", "hit_ratio", "prefill_tokens", "load_imbalance", "gap_tokens",
            "gap_closed"]
    rows = [[p["num_engines"], p["capacity_blocks"], *(r[k] for k in keys[2:])] for p in d["points"] for r in p["runs"]]
    body = [howto([("round-robin", "request k goes to engine k mod N."),
                   ("least-loaded", f"the engine with the least load ({d['load']})."),
                   ("family", "a request goes where its family's root went."),
                   ("prefix-aware", "the engine whose cache holds the longest prefix of the prompt, unless overloaded."),
                   ("global", "one pool of N x capacity every engine can read: the reference."),
                   ("gap / closed", "prefill tokens beyond the global pool, and the share of round-robin's gap a "
                                    "policy closes.")]),
            paragraph(f"{', '.join(map(str, ns))} engines x {', '.join(f'{c:,}' for c in caps)} blocks per engine "
                      f"({where} is {cap:,}); the trace's requests in arrival order, routed by each policy."),
            svg(lambda p: plot_fleet(result, p)),
            table(["engines", "blocks each", "policy", "hit ratio", "prefill", "max/mean requests", "gap", "closed"],
                  rows, id="fleet-runs", keys=keys)]
    body += [paragraph(f"Note: {note}") for note in d["notes"]]
    command = f"kmesh-trace fleet {ctx.trace_arg}{flags(options)} --json"
    return Section("Fleet", command, d, body)


#: The page's sections, in order: id -> builder. One line per section.
SECTIONS: dict[str, Callable[[ReportContext], Section | None]] = {
    "advise": advise_section,
    "capture": capture_section,
    "audit": audit_section,
    "headroom": headroom_section,
    "pressure": pressure_section,
    "lineage": lineage_section,
    "tiers": tiers_section,
    "fleet": fleet_section,
}


#: For a section that cannot run: the command it reproduces (its hint names that command's option).
_SECTION_COMMAND = {"advise": "advise", "headroom": "headroom", "pressure": "pressure", "lineage": "lineage", "tiers": "tiers",
                    "fleet": "fleet", "audit": "audit capture", "capture": "info"}


# ---- the page ------------------------------------------------------------------------------------

_STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 64em; padding: 0 1em; color: #1b1b1b; background: #fff; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; margin: .8em 0; } th, td { border: 1px solid #ddd; padding: .25em .6em; text-align: left; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
code { background: #f3f3f3; padding: .1em .3em; word-break: break-all; } .reproduce { color: #555; }
.unavailable { color: #8a4b00; } figure { margin: 1em 0; } figure svg { max-width: 100%; height: auto; }
.howto { background: #f6f8fb; border-left: 3px solid #7a9cc6; padding: .3em 1em; margin: .8em 0; font-size: .9em; }
.howto h3 { font-size: 1em; margin: .3em 0; } .howto dt { font-weight: 600; float: left; clear: left; margin-right: .5em; }
.howto dd { margin: 0 0 .2em 0; } .hint { color: #30476b; }
"""


def _unavailable(sid: str, ctx: ReportContext, e: KmeshTraceError) -> Section:
    """A section that cannot run: why, and (when the analysis needs a value) the option that gives it,
    named as the CLI names it, never as the Python parameter."""
    needs = isinstance(e, NeedsParameterError) and e.parameter in OPTION_OF_PARAMETER
    why = f"{e.reason}." if needs else str(e)
    body = [_PIECES.unavailable(why)]
    if needs:
        command, option = _SECTION_COMMAND.get(sid, sid), OPTION_OF_PARAMETER[e.parameter]
        body.append(hint("Give it on the command line:", command, option,
                         f"kmesh-trace {command} {ctx.trace_arg} {option} {e.value or 'VALUE'}"))
    return Section(sid.capitalize(), "", {"unavailable": why}, body)


def build(trace, *, trace_arg: str | None = None, capacities: Sequence[int] | None = None,
          engine: str | None = None) -> list[Section]:
    """Run every section's analysis over an opened trace (one with requests: `check_has_requests`)."""
    from kmesh_trace.trace import check_has_requests

    check_has_requests(trace)
    ctx = ReportContext(trace, trace_arg or str(trace.path), list(capacities) if capacities else None, engine)
    sections = []
    for sid, builder in SECTIONS.items():
        try:
            s = builder(ctx)
        except KmeshTraceError as e:
            s = _unavailable(sid, ctx, e)
        if s is not None:
            s.id = sid
            sections.append(s)
    return sections


def render(sections: Sequence[Section], title: str) -> str:
    # A section's body is HTML fragments by contract (the pieces above, or a builder's own markup).
    shown = [{"id": s.id, "title": s.title, "command": s.command, "body": Markup("".join(s.body))} for s in sections]
    return _TEMPLATES.get_template("report_page.html.j2").render(
        sections=shown, title=title, csp=Markup(CSP), style=Markup(_STYLE),
        data=Markup(embedded_json({s.id: s.data for s in sections})))


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
