"""The report page's Jinja2 templates: autoescaping on, escaping exactly as html.escape does (so the page
is byte for byte the one the f-strings wrote), markup passed through only where the code says so."""

from __future__ import annotations

import html

from markupsafe import Markup

from kmesh_trace.apps import report as report_mod

NASTY = '</script><!--<script>alert(1)</script>&amp; "q" \'a\''


def test_autoescape_is_on_and_escapes_as_html_escape():
    assert report_mod._TEMPLATES.autoescape is True
    assert report_mod.paragraph(NASTY) == f"<p>{html.escape(NASTY)}</p>"
    assert "&#x27;" in report_mod.paragraph("engine's") and "&#39;" not in report_mod.paragraph("engine's")
    assert report_mod.hint(NASTY, "tiers", "--capacity-blocks", "kmesh-trace tiers T --capacity-blocks 8") == (
        f'<p class="hint" data-command="tiers" data-option="--capacity-blocks">{html.escape(NASTY)} '
        "<code>kmesh-trace tiers T --capacity-blocks 8</code></p>")
    assert report_mod.howto([("a<b", 'say "x"')]) == (
        '<aside class="howto"><h3>How to read this</h3><dl><dt>a&lt;b</dt><dd>say &quot;x&quot;</dd></dl></aside>')


def test_a_table_is_the_one_the_f_strings_wrote():
    got = report_mod.table(["n", "name's"], [[1, 0.5], [True, NASTY], [None, 12345]], id="t<1>", keys=["n", "k"])
    assert got == (
        '<table id="t&lt;1&gt;"><thead><tr><th data-key="n">n</th><th data-key="k">name&#x27;s</th></tr></thead><tbody>'
        '<tr><td data-value="1" class="num">1</td><td data-value="0.5" class="num">0.5000</td></tr>'
        '<tr><td data-value="true" class="">yes</td>'
        f'<td data-value="{html.escape(__import__("json").dumps(NASTY))}" class="">{html.escape(NASTY)}</td></tr>'
        '<tr><td data-value="null" class="">-</td><td data-value="12345" class="num">12,345</td></tr>'
        "</tbody></table>")
    assert isinstance(got, Markup)  # a fragment: the page inlines it as it is


def test_the_page_escapes_titles_and_commands_but_not_fragments():
    s = report_mod.Section("A <title>", "kmesh-trace x 'T' --json", {"k": NASTY}, [report_mod.paragraph("p"), "<hr>"])
    s.id = "a"
    page = report_mod.render([s], "report: <t>")
    assert page.startswith('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
                           f'<meta http-equiv="Content-Security-Policy" content="{report_mod.CSP}">')
    assert "<title>report: &lt;t&gt;</title>" in page and '<nav><a href="#a">A &lt;title&gt;</a></nav>' in page
    assert ('<section id="a"><h2>A &lt;title&gt;</h2><p class="reproduce">Reproduce: '
            "<code>kmesh-trace x &#x27;T&#x27; --json</code></p><p>p</p><hr></section>") in page
    assert page.endswith(f'<script type="application/json" id="report-data">{report_mod.embedded_json({"a": {"k": NASTY}})}'
                         "</script></body></html>\n")
    assert "</script><!--" not in page.split('id="report-data">')[1][:-len("</script></body></html>\n")]
