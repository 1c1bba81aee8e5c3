"""`kmesh-trace report`: one self-contained page, checked in a real headless Chromium.

With no options, on a capture, a Mooncake import and a weka import (small synthetic inputs built here):
the page loads with no console message (its Content-Security-Policy turns any fetch into one, and the
negative control shows such messages are seen), the screenshot is not blank, every section the trace
supports is present and drawn, and every number in its tables equals what the reproducing command
prints with --json. Every hint and every reproducing command names options the CLI has; a trace
string holding `</script>` or `<!--<script` cannot break the embedded data.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from browser import chromium, load
from report_page import ReportPage  # tests/ is on sys.path

from kmesh_trace.apps import report as report_mod
from kmesh_trace.datasets.workloads.fork_tree import BLOCK_SIZE, fork_tree_rows
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.writer import TraceWriter

CAPS = "64,256,512"
NASTY = '</script><!--<script>alert(1)</script>&amp;'


@pytest.fixture
def browser():
    if chromium() is None:
        pytest.skip("no Chromium installed: `apt-get install -y chromium` (the Makefile's install-browser target) "
                    "to run the browser checks of the report page")


def _fork_tree(path: Path, family: str = "fork-tree") -> Path:
    """The fork tree with its declared lineage edges: a capture every section has something to say about."""
    rows = fork_tree_rows()
    for r in rows:
        r["family_id"] = family
    edges = [{"child_request_id": r["request_id"], "parent_request_id": "parent", "declared_parent_id": "parent",
              "family_id": family, "edge_kind": "declared", "num_shared_tokens": 4096}
             for r in rows if r["parent_id"]]
    with TraceWriter(path, "fork-tree", {"block_size": BLOCK_SIZE, "num_usable_blocks": 512,
                                         "kv_bytes_per_token": 2048}, source="generated:fork-tree") as w:
        w.write("invocations", {k: [r[k] for r in rows] for k in rows[0]})
        w.write("lineage", edges)
    return path


@pytest.fixture
def trace(tmp_path):
    return _fork_tree(tmp_path / "t")


def _mooncake(tmp_path: Path, cli) -> Path:
    """40 requests over 4 shared documents (chained prefix hashes), no lineage, no times but arrival."""
    lines = []
    for i in range(40):
        doc, n = i % 4, 3 + i % 5
        hashes = [1000 * doc + k for k in range(n)]
        lines.append(json.dumps({"timestamp": 100 * i, "input_length": 512 * n - 7, "output_length": 20,
                                 "hash_ids": hashes}))
    src = tmp_path / "mooncake.jsonl"
    src.write_text("\n".join(lines) + "\n")
    r = cli(["import", "mooncake", src, "--out", tmp_path / "mc"])
    assert r.exit_code == 0, r.stderr
    return tmp_path / "mc"


def _weka(tmp_path: Path, cli) -> Path:
    """Two conversations whose prompts grow turn by turn, one with a sub-agent: declared lineage, timed."""
    d = tmp_path / "weka-src"
    d.mkdir()
    for c in range(2):
        reqs, ids = [], []
        for turn in range(6):
            ids = ids + [100 * c + len(ids) + k + 1 for k in range(3)]
            reqs.append({"t": 10.0 * turn, "type": "n", "in": 4 * len(ids), "out": 3, "hash_ids": list(ids),
                         "api_time": 1.0})
        reqs.insert(3, {"t": 25.0, "type": "subagent", "agent_id": f"a{c}", "subagent_type": "Explore",
                        "requests": [{"t": 26.0, "type": "n", "in": 4 * len(ids) + 8, "out": 3,
                                      "hash_ids": list(ids) + [900 + c, 950 + c], "api_time": 1.0}]})
        (d / f"trace_{c}.json").write_text(json.dumps({"id": f"trace_{c}", "block_size": 4, "hash_id_scope": "local",
                                                       "requests": reqs}))
    r = cli(["import", "weka", d, "--out", tmp_path / "wk"])
    assert r.exit_code == 0, r.stderr
    return tmp_path / "wk"


def _json(cli, *args):
    r = cli([str(a) for a in args])
    assert r.exit_code in (0, 3), r.stderr
    return json.loads(r.stdout)


def _run(cli, command: str):
    """The JSON of a reproducing command as the page prints it (`kmesh-trace ...`)."""
    words = shlex.split(command)
    assert words[0] == "kmesh-trace"
    return _json(cli, *words[1:])


def _report(cli, trace: Path, tmp_path: Path, *extra) -> tuple[dict, ReportPage, object]:
    page = tmp_path / f"{trace.name}.html"
    r = cli(["report", trace, "--out", page, "--json", *extra])
    assert r.exit_code == 0, r.stderr
    loaded = load(page, tmp_path / f"{trace.name}.png", height=8000)
    assert loaded.console == []
    import matplotlib.image

    px = matplotlib.image.imread(str(loaded.screenshot))[..., :3]
    drawn = (px.min(axis=2) < 0.9).mean()
    assert 0.02 < drawn < 0.9 and px.std() > 0.05, drawn  # not blank, not one flat colour
    dom = ReportPage()
    dom.feed(loaded.dom)
    assert json.loads(dom.data) == json.loads(r.stdout)  # the browser reads the embedded data back whole
    return json.loads(r.stdout), dom, loaded


def _check_sections(cli, embedded: dict, dom: ReportPage, expected: set[str], plotted: set[str]) -> None:
    """Every expected section is there, with text, a how-to box and its plot; its data is its command's."""
    assert set(embedded) == expected and set(dom.sections) == expected, (set(embedded), expected)
    for sid, s in dom.sections.items():
        assert "unavailable" not in embedded[sid], (sid, embedded[sid])
        assert "How to read this" in s["text"] and len(s["text"]) > 200, sid
        assert s["svgs"] == (1 if sid in plotted else 0), (sid, s["svgs"])
    for sid in expected:
        commands = dom.sections[sid]["commands"]
        if sid == "pressure":
            assert _run(cli, commands[0]) == embedded[sid]["at_capacity"]
            if "sweep" in embedded[sid]:
                assert _run(cli, commands[1]) == embedded[sid]["sweep"]
        elif sid == "tiers":
            assert _run(cli, commands[0])["sweep"] == embedded[sid]
        else:
            assert _run(cli, commands[0]) == embedded[sid], sid


def _check_headroom_table(embedded: dict, dom: ReportPage) -> None:
    grid = embedded["headroom"]["grid"]
    recs = dom.records("headroom-grid")
    assert [r["capacity_blocks"] for r in recs] == [g["capacity_blocks"] for g in grid]
    for r, g in zip(recs, grid):
        for p in embedded["headroom"]["curves"]:
            assert r[f"{p}.hit_ratio"] == g[p]["hit_ratio"]
        assert r["headroom_tokens"] == g.get("headroom_tokens")


def test_the_console_check_sees_fetches_and_scripts(browser, tmp_path):
    """Negative control: a page that tries a fetch and runs a script under the report's policy."""
    page = tmp_path / "bad.html"
    page.write_text(f'<!DOCTYPE html><html><head><meta http-equiv="Content-Security-Policy" content="{report_mod.CSP}">'
                    '</head><body><p>x</p><img src="http://example.invalid/x.png"><script>console.error("boom")</script>'
                    "</body></html>")
    loaded = load(page, tmp_path / "bad.png")
    assert any("example.invalid" in m for m in loaded.console)
    assert any("inline script" in m for m in loaded.console)


def test_capture_report_with_no_options_is_every_commands_default(browser, trace, tmp_path, cli):
    embedded, dom, _ = _report(cli, trace, tmp_path)
    sections = {"advise", "capture", "audit", "headroom", "pressure", "lineage", "tiers", "fleet"}
    _check_sections(cli, embedded, dom, sections, plotted={"advise", "headroom", "pressure", "lineage", "tiers", "fleet"})
    _check_headroom_table(embedded, dom)
    info = embedded["capture"]
    assert {r["table"]: r["rows"] for r in dom.records("capture-tables")} == {k: v["rows"] for k, v in info["tables"].items()}
    assert {r["analysis"]: r["qualified"] for r in dom.records("audit-verdict")} == {
        k: v["qualified"] for k, v in embedded["audit"]["verdict"].items()}
    # The headroom curve marks stock at the usable blocks (the vllm model: the fixture records no hit counts).
    assert embedded["headroom"]["stock"]["source"] == "vllm"
    assert embedded["headroom"]["stock"]["capacity_blocks"] == 512
    pr = embedded["pressure"]
    assert {r["arm"]: r["child_hit_tokens"] for r in dom.records("pressure-arms")} == {
        arm: pr["at_capacity"]["arms"][arm]["child_hit_tokens"] for arm in ("stock", "held")}
    assert len(pr["sweep"]["sweep"]) >= 3  # along the capacity axis, with no option given
    assert [r["net_cached_tokens"] for r in dom.records("pressure-sweep")] == [
        p["net_cached_tokens"] for p in pr["sweep"]["sweep"]]
    # pressure counts families as lineage does: one family here, one parent.
    assert pr["at_capacity"]["num_families"] == embedded["lineage"]["num_families"] == 1
    assert dom.records("lineage-summary")[0]["num_edges"] == embedded["lineage"]["num_edges"] == 5
    assert [r["hit_tokens"] for r in dom.records("tiers-sweep")] == [
        c["hit_tokens"] for c in embedded["tiers"]["configurations"]]
    fleet = [(p["num_engines"], r["policy"], r["hit_ratio"]) for p in embedded["fleet"]["points"] for r in p["runs"]]
    assert [(r["num_engines"], r["policy"], r["hit_ratio"]) for r in dom.records("fleet-runs")] == fleet


def test_mooncake_import_report_has_every_section_without_options(browser, tmp_path, cli):
    trace = _mooncake(tmp_path, cli)
    embedded, dom, _ = _report(cli, trace, tmp_path)
    # No lineage table (no section), no families (no fleet): the rest is there, with capacities chosen.
    _check_sections(cli, embedded, dom, {"advise", "capture", "audit", "headroom", "pressure", "tiers"},
                    plotted={"advise", "headroom", "pressure", "tiers"})
    _check_headroom_table(embedded, dom)
    assert embedded["headroom"]["stock"] is None and "No stock" in dom.sections["headroom"]["text"]
    assert embedded["pressure"]["at_capacity"]["edges"] == "inferred"  # no declared parents: exact-prefix edges
    assert "--capacity-blocks" in dom.sections["tiers"]["commands"][0]  # an import records no pool size: the page chose one
    assert embedded["audit"]["verdict"]["headroom"]["blocked_by"] == ["import"]
    assert "block events (no engine served the trace)" in embedded["audit"]["imports"]["import-mooncake"]["gaps"]
    assert not [p for p in embedded["audit"]["problems"] if p["severity"] == "blocking"]


def test_weka_import_report_has_every_section_without_options(browser, tmp_path, cli):
    trace = _weka(tmp_path, cli)
    embedded, dom, _ = _report(cli, trace, tmp_path)
    _check_sections(cli, embedded, dom, {"advise", "capture", "audit", "headroom", "pressure", "lineage", "tiers",
                                         "fleet"}, plotted={"advise", "headroom", "pressure", "lineage", "tiers", "fleet"})
    _check_headroom_table(embedded, dom)
    assert embedded["pressure"]["at_capacity"]["edges"] == "declared"
    assert embedded["pressure"]["at_capacity"]["num_families"] == embedded["lineage"]["num_families"] == 2
    assert embedded["fleet"]["timed"] and embedded["fleet"]["notes"] == []


@pytest.mark.shared_data
def test_public_samples_report(browser, tmp_path, cli, shared_datasets):
    """The weka public sample, imported as shipped (skipped without ../shared/datasets)."""
    r = cli(["import", "weka", shared_datasets / "weka-claude-code", "--out", tmp_path / "w"])
    assert r.exit_code == 0, r.stderr
    embedded, dom, _ = _report(cli, tmp_path / "w", tmp_path)
    assert {"headroom", "pressure", "lineage", "tiers", "fleet"} <= set(embedded)
    assert all("unavailable" not in v for v in embedded.values())


def _app_params():
    """command path ('headroom', 'audit capture') -> its option names, from the real CLI."""
    import typer.main

    from kmesh_trace.cli import app

    group = typer.main.get_command(app)
    out = {}

    def walk(cmd, prefix):
        for name, sub in getattr(cmd, "commands", {}).items():
            path = f"{prefix} {name}".strip()
            walk(sub, path)
            out[path] = {o for p in sub.params for o in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])}

    walk(group, "")
    return out


def _check_command_line(params: dict, line: str) -> None:
    words = shlex.split(line)
    assert words[0] == "kmesh-trace", line
    path = words[1] if f"{words[1]} {words[2]}" not in params else f"{words[1]} {words[2]}"
    assert path in params, line
    for w in words[2:]:
        if w.startswith("--"):
            assert w.split("=")[0] in params[path], (line, w)


def test_every_hint_and_command_names_a_real_option(browser, trace, tmp_path, cli, monkeypatch):
    """Hints (and the reproducing commands) of pages for a capture, an import, and sections that cannot run."""
    from kmesh_trace.errors import NeedsParameterError

    params = _app_params()
    pages = [_report(cli, trace, tmp_path)[1], _report(cli, _mooncake(tmp_path, cli), tmp_path)[1]]

    def needs(ctx):
        raise NeedsParameterError("the trace does not record the engine's usable blocks", "capacity_blocks", "N")

    monkeypatch.setitem(report_mod.SECTIONS, "pressure", needs)
    report_mod.write_report(trace, tmp_path / "needs.html")
    dom = ReportPage()
    dom.feed((tmp_path / "needs.html").read_text())
    pages.append(dom)
    hints = [h for p in pages for h in p.hints]
    assert ("pressure", "--capacity-blocks") in {(c, o) for c, o, _ in hints}
    assert ("headroom", "--prefill-tokens-per-s") in {(c, o) for c, o, _ in hints}  # the import has no timings
    for command, option, example in hints:
        assert option in params[command], (command, option)
        assert f"kmesh-trace {command} " in example and option in example
        _check_command_line(params, example)
    for p in pages:
        for s in p.sections.values():
            for line in s["commands"]:
                _check_command_line(params, line)


def test_trace_strings_cannot_break_the_embedded_data(browser, tmp_path, cli):
    """A family id holding `</script>`, `<!--<script` and `&`: the page's data still parses whole in Chromium."""
    trace = _fork_tree(tmp_path / "nasty", family=NASTY)
    embedded, dom, loaded = _report(cli, trace, tmp_path)
    assert embedded["lineage"]["families"][0]["family"] == NASTY
    html = (tmp_path / "nasty.html").read_text()
    data = html[html.index('id="report-data">'):]
    assert "</script>" not in data[:-len("</script></body></html>\n")] and "<!--" not in data
    assert loaded.dom.count('id="report-data"') == 1 and set(dom.sections) >= {"lineage", "fleet"}


def test_embedded_json_escapes_markup():
    text = report_mod.embedded_json({"a": NASTY})
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == {"a": NASTY}


def test_headroom_at_given_capacities_is_a_pivot(trace, tmp_path, cli):
    r = cli(["report", trace, "--out", tmp_path / "r.html", "--capacity-blocks", CAPS, "--json"])
    assert r.exit_code == 0, r.stderr
    hr = _json(cli, "headroom", trace, "--capacity-blocks", CAPS, "--json")
    assert json.loads(r.stdout)["headroom"] == hr
    dom = ReportPage()
    dom.feed((tmp_path / "r.html").read_text())
    recs = dom.records("headroom-pivot")
    assert [x["capacity_blocks"] for x in recs] == [64, 256, 512]  # one row per capacity, one column per policy
    by = {(x["policy"], x["capacity_blocks"]): x["hit_ratio"] for x in hr["results"]}
    for x in recs:
        for p in {p for p, _ in by}:
            assert x[p] == by.get((p, x["capacity_blocks"]))
    sweep = _json(cli, "pressure", trace, "--capacity-blocks", CAPS, "--json")
    assert json.loads(r.stdout)["pressure"]["sweep"] == sweep


def test_a_section_is_one_line_and_a_failing_one_says_why(trace, tmp_path, monkeypatch):
    def extra(ctx):
        return report_mod.Section("Extra", f"kmesh-trace extra {ctx.trace_arg}", {"n": 7},
                                  [report_mod.table(["n"], [[7]], id="extra")])

    def failing(ctx):
        raise KmeshTraceError("the trace has no tiers")

    monkeypatch.setitem(report_mod.SECTIONS, "extra", extra)
    monkeypatch.setitem(report_mod.SECTIONS, "tiers", failing)
    data = report_mod.write_report(trace, tmp_path / "r.html")
    assert data["extra"] == {"n": 7} and data["tiers"] == {"unavailable": "the trace has no tiers"}
    html = (tmp_path / "r.html").read_text()
    assert '<section id="extra"><h2>Extra</h2>' in html
    assert "Not available for this trace: the trace has no tiers" in html


def test_a_trace_without_lineage_or_capacity_still_reports(tmp_path, cli):
    from kmesh_trace.datasets.importers.mooncake import import_mooncake

    src = tmp_path / "m.jsonl"
    src.write_text('{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n')
    import_mooncake(src, tmp_path / "t")
    r = cli(["report", tmp_path / "t", "--out", tmp_path / "r.html", "--json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert "lineage" not in data and "fleet" not in data  # no edges, no families: no sections
    assert data["headroom"]["num_requests"] == 1 and data["headroom"]["stock"] is None
    r = cli(["report", tmp_path / "t", "--out", tmp_path / "no" / "r.html"])
    assert r.exit_code == 1 and "does not exist" in r.stderr


def test_a_trace_of_several_engines_has_the_fleet_and_names_the_engine_option(tmp_path, cli):
    from fleet_workloads import write_fleet_trace

    trace = write_fleet_trace(tmp_path / "t", num_engines=3)
    r = cli(["report", trace, "--out", tmp_path / "r.html", "--json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert [p["num_engines"] for p in data["fleet"]["points"]] == [3] * 4  # the trace's engines, 4 capacities
    assert data["fleet"] == _json(cli, "fleet", trace, "--capacity-blocks", "6,12,24,48", "--json")
    html = (tmp_path / "r.html").read_text()
    assert data["headroom"]["unavailable"].startswith("the trace has 3 engine partitions")
    assert "engine=" not in html and 'data-option="--engine"' in html


def test_the_ladder_shows_the_models_measured_error_beside_each_modelled_rung(tmp_path, cli):
    from kmesh_trace.oracle.model_error import MODEL_ERROR, UNMEASURED

    trace = _mooncake(tmp_path, cli)
    r = cli(["report", trace, "--out", tmp_path / "r.html", "--json"])
    assert r.exit_code == 0, r.stderr
    dom = ReportPage()
    html = (tmp_path / "r.html").read_text()
    dom.feed(html)
    column = {x["rung"]: x["model_error"] for x in dom.records("advise-ladder")}
    assert column["modelled"] == "±0.0004 hit ratio (12 replays)"
    assert column["infinite"] is None and column["bound"] is None  # bounds, not predictions of an engine
    assert {column[k] for k in column if k.startswith("host-")} == {"not measured"}
    text = dom.sections["advise"]["text"]
    assert MODEL_ERROR.summary in text and "benchmarks/results/closed-loop-2026-12-02" in text
    assert UNMEASURED["tiers"] in text and UNMEASURED["tiers"] in dom.sections["tiers"]["text"]
    assert MODEL_ERROR.summary in dom.sections["headroom"]["text"]  # the vllm curve's term
