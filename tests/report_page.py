"""Test support: the report page (`kmesh-trace report`) parsed back into its tables, sections, hints,
reproducing commands and embedded data, each table cell checked to read as its value formats.
"""

from __future__ import annotations

import json
from html.parser import HTMLParser

from kmesh_trace.apps import report as report_mod


class ReportPage(HTMLParser):
    """Every table of a page by id (its data-key headers and rows of (data-value, text) cells), each
    section's text, its hints, its reproducing commands, and the embedded data."""

    def __init__(self):
        super().__init__()
        self.tables: dict[str, dict] = {}
        self.sections: dict[str, dict] = {}
        self.hints: list[tuple[str, str, str]] = []  # (command, option, example)
        self.data = ""
        self._t = self._cell = self._section = self._hint = None
        self._in_data = self._in_code = False
        self._code = ""

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self._section = self.sections.setdefault(a["id"], {"text": "", "svgs": 0, "commands": []})
        elif tag == "svg" and self._section is not None:
            self._section["svgs"] += 1
        elif tag == "table":
            self._t = self.tables.setdefault(a.get("id") or f"table{len(self.tables)}", {"keys": [], "rows": []})
        elif tag == "th" and self._t is not None:
            self._t["keys"].append(a["data-key"])
        elif tag == "tr" and self._t is not None:
            self._t["rows"].append([])
        elif tag == "td" and self._t is not None:
            self._cell = [json.loads(a["data-value"]), ""]
        elif tag == "p" and a.get("class") == "hint":
            self._hint = [a["data-command"], a["data-option"], ""]
        elif tag == "script" and a.get("id") == "report-data":
            self._in_data = True
        elif tag == "code":
            self._in_code, self._code = True, ""

    def handle_data(self, data):
        if self._in_data:
            self.data += data
        if self._cell is not None:
            self._cell[1] += data
        if self._in_code:
            self._code += data
        if self._section is not None:
            self._section["text"] += data

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self._t["rows"][-1].append(tuple(self._cell))
            self._cell = None
        elif tag == "table":
            self._t = None
        elif tag == "section":
            self._section = None
        elif tag == "script":
            self._in_data = False
        elif tag == "code":
            self._in_code = False
            if self._hint is not None:
                self._hint[2] = self._code
                self.hints.append(tuple(self._hint))
                self._hint = None
            elif self._section is not None:
                self._section["commands"] += [c.strip() for c in self._code.split(";")]

    def records(self, table_id: str) -> list[dict]:
        t = self.tables[table_id]
        out = []
        for row in (r for r in t["rows"] if r):
            for value, text in row:
                assert text == report_mod.fmt(value), (table_id, value, text)  # what people read is the value
            out.append({k: v for k, (v, _) in zip(t["keys"], row)})
        return out
