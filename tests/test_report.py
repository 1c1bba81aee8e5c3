"""`kmesh-trace report`: one self-contained page, checked in a real headless Chromium.

The page loads with no console message (its Content-Security-Policy turns any fetch into one, and the
negative control shows such messages are seen), the screenshot is not blank, and every number in its
tables equals what the reproducing command prints with --json.
"""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
from browser import chromium, load

from kmesh_trace import report as report_mod
from kmesh_trace.datasets.workloads.fork_tree import BLOCK_SIZE, fork_tree_rows
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.writer import TraceWriter

CAPS = "64,256,512"


@pytest.fixture
def browser():
    if chromium() is None:
        pytest.skip("no Chromium installed: `apt-get install -y chromium` (the Makefile's install-browser target) "
                    "to run the browser checks of the report page")


@pytest.fixture
def trace(tmp_path):
    """The fork tree with its declared lineage edges: a trace every section has something to say about."""
    rows = fork_tree_rows()
    edges = [{"child_request_id": r["request_id"], "parent_request_id": "parent", "declared_parent_id": "parent",
              "family_id": "fork-tree", "edge_kind": "declared", "num_shared_tokens": 4096}
             for r in rows if r["parent_id"]]
    with TraceWriter(tmp_path / "t", "fork-tree", {"block_size": BLOCK_SIZE, "num_usable_blocks": 512,
                                                        "kv_bytes_per_token": 2048},
                     source="generated:fork-tree") as w:
        w.write("invocations", {k: [r[k] for r in rows] for k in rows[0]})
        w.write("lineage", edges)
    return tmp_path / "t"


class _Tables(HTMLParser):
    """Every table of a page by id: its data-key headers and its rows of (data-value, text) cells."""

    def __init__(self):
        super().__init__()
        self.tables: dict[str, dict] = {}
        self._t = self._cell = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self._t = self.tables.setdefault(a.get("id") or f"table{len(self.tables)}", {"keys": [], "rows": []})
        elif tag == "th" and self._t is not None:
            self._t["keys"].append(a["data-key"])
        elif tag == "tr" and self._t is not None:
            self._t["rows"].append([])
        elif tag == "td" and self._t is not None:
            self._cell = [json.loads(a["data-value"]), ""]

    def handle_data(self, data):
        if self._cell is not None:
            self._cell[1] += data

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self._t["rows"][-1].append(tuple(self._cell))
            self._cell = None
        elif tag == "table":
            self._t = None

    def records(self, table_id: str) -> list[dict]:
        t = self.tables[table_id]
        out = []
        for row in (r for r in t["rows"] if r):
            for value, text in row:
                assert text == report_mod.fmt(value), (table_id, value, text)  # what people read is the value
            out.append({k: v for k, (v, _) in zip(t["keys"], row)})
        return out


def _json(cli, *args):
    r = cli([str(a) for a in args])
    assert r.exit_code in (0, 3), r.stderr
    return json.loads(r.stdout)


def test_the_console_check_sees_fetches_and_scripts(browser, tmp_path):
    """Negative control: a page that tries a fetch and runs a script under the report's policy."""
    page = tmp_path / "bad.html"
    page.write_text(f'<!DOCTYPE html><html><head><meta http-equiv="Content-Security-Policy" content="{report_mod.CSP}">'
                    '</head><body><p>x</p><img src="http://example.invalid/x.png"><script>console.error("boom")</script>'
                    "</body></html>")
    loaded = load(page, tmp_path / "bad.png")
    assert any("example.invalid" in m for m in loaded.console)
    assert any("inline script" in m for m in loaded.console)


def test_report_page_in_chromium_shows_the_commands_numbers(browser, trace, tmp_path, cli):
    page = tmp_path / "report.html"
    r = cli(["report", trace, "--out", page, "--capacity-blocks", CAPS, "--json"])
    assert r.exit_code == 0, r.stderr
    embedded = json.loads(r.stdout)
    loaded = load(page, tmp_path / "report.png")
    assert loaded.console == []

    # Not blank: a good share of the pixels are drawn, and not one flat colour.
    import matplotlib.image

    px = matplotlib.image.imread(str(loaded.screenshot))[..., :3]
    drawn = (px.min(axis=2) < 0.9).mean()
    assert 0.02 < drawn < 0.9 and px.std() > 0.05, drawn

    dom = _Tables()
    dom.feed(loaded.dom)
    info = _json(cli, "info", trace, "--json")
    assert embedded["capture"] == info
    assert {r["table"]: r["rows"] for r in dom.records("capture-tables")} == {k: v["rows"] for k, v in info["tables"].items()}

    audit = _json(cli, "audit", "capture", trace, "--json")
    assert embedded["audit"] == audit
    assert {r["analysis"]: r["qualified"] for r in dom.records("audit-verdict")} == {
        k: v["qualified"] for k, v in audit["verdict"].items()}
    assert [(p["code"], p["count"]) for p in dom.records("audit-problems")] == [
        (p["code"], p["count"]) for p in audit["problems"]]

    hr = _json(cli, "headroom", trace, "--capacity-blocks", CAPS, "--json")
    assert embedded["headroom"] == hr
    keys = dom.tables["headroom-results"]["keys"]
    assert dom.records("headroom-results") == [{k: r[k] for k in keys} for r in hr["results"]]

    pr = _json(cli, "pressure", trace, "--json")
    assert embedded["pressure"]["at_capacity"] == pr
    assert {r["arm"]: r["child_hit_tokens"] for r in dom.records("pressure-arms")} == {
        arm: pr["arms"][arm]["child_hit_tokens"] for arm in ("stock", "held")}
    sweep = _json(cli, "pressure", trace, "--capacity-blocks", CAPS, "--json")["sweep"]
    keys = dom.tables["pressure-sweep"]["keys"]
    assert dom.records("pressure-sweep") == [{k: p[k] for k in keys} for p in sweep]

    lineage = _json(cli, "lineage", trace, "--json")
    assert embedded["lineage"] == lineage
    assert lineage["num_edges"] == 5 == dom.records("lineage-summary")[0]["num_edges"]
    fan_out = next(r for r in dom.records("lineage-distributions") if r["what"] == "children per parent")
    assert fan_out["count"] == lineage["fan_out"]["count"] and fan_out["max"] == lineage["fan_out"]["max"]

    # Each section says which command reproduces it, and those commands are the ones checked above.
    html = page.read_text()
    for command in (f"kmesh-trace info {trace} --json", f"kmesh-trace headroom {trace} --capacity-blocks {CAPS} --json",
                    f"kmesh-trace audit capture {trace} --json"):
        assert f"Reproduce: <code>{command}</code>" in html
    # The trace records its KV geometry, so the page has the tiers sweep: the command's own numbers.
    tiers = embedded["tiers"]
    sizes = ",".join(map(str, tiers["host_blocks"]))
    sweep = _json(cli, "tiers", trace, "--sweep-host", sizes, "--sweep-ssd", sizes, "--json")["sweep"]
    assert tiers["grid"] == sweep["grid"] and tiers["best"] == sweep["best"]
    assert [r["hit_tokens"] for r in dom.records("tiers-sweep")] == [c["hit_tokens"] for c in sweep["configurations"]]
    # the headroom curve, the pressure sweep, the lineage plot and the tiers heatmap, inline
    assert html.count("<svg") == 4


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
    assert "lineage" not in data  # no edges: no section
    assert "usable blocks" in data["headroom"]["unavailable"]
    r = cli(["report", tmp_path / "t", "--out", tmp_path / "no" / "r.html"])
    assert r.exit_code == 1 and "does not exist" in r.stderr
