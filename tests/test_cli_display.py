"""One output layer for people (kmesh_trace.cli.display).

Every string column of a trace (and a corpus's keys, a metadata value) holding markup, control
characters and `</script>` goes through every command's human output and comes out as visible text:
nothing styled, no hyperlink, no MarkupError, no control byte reaching the terminal. And every command's
human output at 80 and 120 columns cuts nothing ("…"), nor does any command's --help.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import typer

from kmesh_trace.cli import app
from kmesh_trace.cli import display
from kmesh_trace.datasets.workloads.fork_tree import BLOCK_SIZE, fork_tree_rows
from kmesh_trace.writer import TraceWriter

#: Markup (styles, a hidden hyperlink, an unbalanced closing tag), an emoji code, ESC sequences (a colour,
#: an OSC 8 hyperlink, a screen clear), BEL, a bidirectional override and the end of a script element.
HOSTILE = ("[bold red]x[/bold red][link=file:///etc/passwd]y[/link] [/oops] :smile: \x1b[31mred\x1b[0m "
           "\x1b]8;;file:///etc/passwd\x07z\x1b]8;;\x07 \x1b[2J \u202eevil </script><!--<script>")
RAW = ("\x1b", "\x07", "\u202e")


def _rows(tag: str = "") -> list[dict]:
    rows = fork_tree_rows()
    for i, r in enumerate(rows):
        if tag:
            r["request_id"] = f"{tag}{i}" if r["request_id"] != "parent" else f"{tag}parent"
            r["parent_id"] = f"{tag}parent" if r["parent_id"] else None
            r["family_id"] = tag
            r["caller_request_id"] = tag
            r["agent_id"] = tag
            r["agent_type"] = tag
    return rows


def _trace(path: Path, tag: str = "") -> Path:
    rows = _rows(tag)
    parent = next(r["request_id"] for r in rows if not r["parent_id"])
    edges = [{"child_request_id": r["request_id"], "parent_request_id": parent, "declared_parent_id": parent,
              "family_id": tag or "fork-tree", "edge_kind": "declared", "num_shared_tokens": 4096}
             for r in rows if r["parent_id"]]
    meta = {"block_size": BLOCK_SIZE, "num_usable_blocks": 512, "kv_bytes_per_token": 2048}
    if tag:
        meta.update({"model": tag, tag: tag, "tokenizer": tag})
    with TraceWriter(path, "e0", meta, source="generated:fork-tree") as w:
        w.write("invocations", {k: [r[k] for r in rows] for k in rows[0]})
        w.write("lineage", edges)
    return path


def _corpus(path: Path, tag: str = "") -> Path:
    src = path / (tag.replace("/", "_") if tag else "source")
    src.mkdir(parents=True)
    key = tag or "session_id"
    (src / "a.jsonl").write_text("\n".join(json.dumps({key: tag or "s", "messages": [{"role": "user", "content": "hi"}],
                                                       "timestamp": i}) for i in range(3)) + "\n")
    return path


#: (arguments, whether the output must show the hostile text): every command with a human output.
COMMANDS = [
    (["info", "{t}"], True),
    (["sql", "{t}", "SELECT * FROM invocations"], True),
    (["sql", "{t}", "SELECT * FROM lineage"], True),
    (["sql", "{t}", "SELECT * FROM engines"], True),
    (["lineage", "{t}"], True),
    (["headroom", "{t}", "--capacity-blocks", "64,512", "--prefill-tokens-per-s", "5000"], False),
    (["headroom", "{t}", "--prefill-tokens-per-s", "5000"], False),
    (["pressure", "{t}", "--per-request"], True),
    (["pressure", "{t}", "--capacity-blocks", "64,128,512"], False),
    (["tiers", "{t}", "--host", "256", "--ssd", "1024", "--host-gbps", "10", "--ssd-gbps", "2",
      "--prefill-tokens-per-s", "5000"], False),
    (["tiers", "{t}", "--sweep-host", "0,256", "--sweep-ssd", "0,1024", "--ssd-gbps", "2",
      "--prefill-tokens-per-s", "5000"], False),
    (["fleet", "{t}", "--engines", "1,2"], False),
    (["advise", "{t}", "--engines", "2"], False),
    (["audit", "capture", "{t}"], True),
    (["audit", "corpus", "{c}"], True),
    (["export", "perfetto", "{t}", "--out", "{o}/timeline.json"], False),
    (["schema"], False),
    (["replay", "probe", "--routes", "host"], False),
]


def _run(cli, args, tmp_path, tag=""):
    t = _trace(tmp_path / "t", tag)
    c = _corpus(tmp_path / "corpus", tag)
    r = cli([a.format(t=t, c=c, o=tmp_path) for a in args])
    assert r.exit_code in (0, 3), (args, r.stdout[-2000:], r.stderr[-2000:])
    return r.stdout + r.stderr


@pytest.mark.parametrize("args, shows", COMMANDS, ids=[" ".join(a[:2]) for a, _ in COMMANDS])
def test_data_prints_as_visible_text_never_interpreted(cli, tmp_path, width, args, shows):
    width(120)
    text = _run(cli, args, tmp_path, HOSTILE)
    assert "MarkupError" not in text and "unexpected" not in text
    assert not any(c in text for c in RAW), [c for c in RAW if c in text]
    if shows:
        for word in display.visible(HOSTILE).split():  # a cell may wrap between words, never inside one
            assert word in text, (word, text[:3000])


@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("args, _", COMMANDS, ids=[" ".join(a[:2]) for a, _ in COMMANDS])
def test_every_human_output_fits_the_terminal(cli, tmp_path, width, columns, args, _):
    width(columns)
    text = _run(cli, args, tmp_path)
    assert "…" not in text, text


def _commands(group: typer.Typer, prefix=()):
    for c in group.registered_commands:
        yield (*prefix, c.name)
    for g in group.registered_groups:
        yield from _commands(g.typer_instance, (*prefix, g.name))


@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("command", [(), *sorted(_commands(app))], ids=lambda c: " ".join(c) or "kmesh-trace")
def test_help_keeps_option_names_whole(cli, width, columns, command):
    import click

    width(columns)
    r = cli([*command, "--help"])
    assert r.exit_code == 0
    assert "…" not in r.stdout, r.stdout
    listed = r.stdout.partition("\nCommands:\n")[2]  # click cuts a long summary line with "..."
    assert not any(line.endswith("...") for line in listed.splitlines()), listed
    cmd = typer.main.get_command(app)
    for name in command:
        cmd = cmd.commands[name]
    for p in cmd.params:
        if isinstance(p, click.Option):
            for opt in p.opts:
                assert opt in r.stdout.split() or any(w.startswith(opt) for w in r.stdout.split()), (opt, r.stdout)


# ---- the layer itself ---------------------------------------------------------------------------------


def test_visible_shows_every_control_character():
    assert display.visible("a\x1b[31mb\x07\n\t\u202e\x9b") == "a\\x1b[31mb\\x07\\n\\t\\u202e\\x9b"
    assert display.visible_line("one\ntwo\x1b") == "one\ntwo\\x1b"


def test_the_consoles_never_interpret_markup(capsys):
    display.out.print("[/oops] [bold]b[/bold] :smile:")
    display.err.print(HOSTILE)
    captured = capsys.readouterr()
    assert captured.out == "[/oops] [bold]b[/bold] :smile:\n"
    assert "\x1b" not in captured.err and "[link=file:///etc/passwd]" in captured.err


def test_short_headers_come_with_a_legend_and_a_wide_table_becomes_records():
    import io

    def render(columns: int, short: bool) -> list[str]:
        t = display.Table("t")
        t.add_column("a_rather_long_header", short="a" if short else None)
        t.add_column("another_long_header", justify="right", short="b" if short else None)
        t.add_row("value", "12,345")
        buf = io.StringIO()
        display.SafeConsole(file=buf, width=columns).print(t)
        return [line.rstrip() for line in buf.getvalue().splitlines()]

    assert render(60, True)[2] == "┃ a_rather_long_header ┃ another_long_header ┃"
    narrow = render(30, True)
    assert narrow[2] == "┃ a     ┃      b ┃"
    assert " ".join(narrow[6:]) == "(a = a_rather_long_header, b = another_long_header)"
    narrow = render(40, False)
    assert narrow[:4] == ["t", "-[ record 1 ]-", "a_rather_long_header  value", "another_long_header   12,345"]
    assert " ".join(narrow[4:]) == ("(one record per row: the table needs 41 columns, the terminal has 40; a wider "
                                    "terminal, COLUMNS=41, or --json shows it whole)")
    # Without the box's rules the table fits where the boxed one did not.
    assert render(41, False) == ["t", "a_rather_long_header  another_long_header", "value                              12,345"]


def _families_table() -> display.Table:
    """The shape of `lineage`'s families table on an agentic import (weka): nine columns."""
    t = display.Table("families (largest first)")
    short = {"requests": "reqs", "max fan-out": "fan-out", "shared p50": "shared"}
    for h in ("family", "requests", "edges", "roots", "max fan-out", "depth", "gap p50 (s)", "shared p50", "agents"):
        t.add_column(h, justify="left" if h == "family" else "right", short=short.get(h))
    t.add_row("trace_0277", "53", "52", "1", "4", "17", "4.64", "709", "4")
    t.add_row("trace_0504", "3", "2", "1", "1", "2", "1,531.56", "1,827.50", "0")
    return t


def test_a_nine_column_table_stays_a_table_at_80_columns():
    import io

    buf = io.StringIO()
    display.SafeConsole(file=buf, width=80).print(_families_table())
    assert [line.rstrip() for line in buf.getvalue().splitlines()] == [
        "families (largest first)",
        "family      reqs  edges  roots  fan-out  depth  gap p50 (s)    shared  agents",
        "trace_0277    53     52      1        4     17         4.64       709       4",
        "trace_0504     3      2      1        1      2     1,531.56  1,827.50       0",
        "(reqs = requests, fan-out = max fan-out, shared = shared p50)",
    ]


@pytest.mark.parametrize("args", [["lineage", "{t}"], ["audit", "corpus", "{c}"], ["audit", "capture", "{t}"],
                                  ["tiers", "{t}", "--sweep-host", "0,256", "--sweep-ssd", "0,1024", "--ssd-gbps", "2",
                                   "--prefill-tokens-per-s", "5000"]])
def test_analysis_tables_stay_tables_at_80_columns(cli, tmp_path, width, args):
    width(80)
    text = _run(cli, args, tmp_path)
    assert "-[ record" not in text and "one record per row" not in text, text


def test_no_command_module_builds_rich_tables_or_markup_itself():
    """The next command goes through the layer too: no cli module but display imports rich.table or
    passes markup=True."""
    cli_dir = Path(display.__file__).parent
    for path in cli_dir.glob("*.py"):
        if path.name == "display.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "rich.table":
                pytest.fail(f"{path.name} imports rich.table; build tables with kmesh_trace.cli.display.Table")
            if isinstance(node, ast.keyword) and node.arg == "markup" and getattr(node.value, "value", None) is True:
                pytest.fail(f"{path.name} passes markup=True")


#: Every analysis command with `--out` (from COMMANDS, the ones that take it).
OUT_COMMANDS = [a for a, _ in COMMANDS if a[0] in ("info", "lineage", "headroom", "pressure", "tiers", "fleet")
                or a[:2] in (["audit", "capture"], ["audit", "corpus"])]


@pytest.mark.parametrize("as_json", [False, True], ids=["human", "json"])
@pytest.mark.parametrize("args", OUT_COMMANDS, ids=[" ".join(a[:2]) for a in OUT_COMMANDS])
def test_out_writes_the_file_and_nothing_on_stdout(cli, tmp_path, args, as_json):
    t, c = _trace(tmp_path / "t"), _corpus(tmp_path / "corpus")
    target = tmp_path / "result.json"
    r = cli([a.format(t=t, c=c, o=tmp_path) for a in args] + ["--out", target] + (["--json"] if as_json else []))
    assert r.exit_code in (0, 3), r.stderr[-2000:]
    assert r.stdout == ""
    assert f"wrote {target}" in r.stderr
    assert isinstance(json.loads(target.read_text()), dict)


@pytest.mark.parametrize("command", sorted(_commands(app)), ids=lambda c: " ".join(c))
def test_help_has_no_list_type_labels_and_no_double_space_before_brackets(cli, width, command):
    width(100)
    r = cli([*command, "--help"])
    assert r.exit_code == 0
    assert "<list[" not in r.stdout
    assert not re.search(r"\S  \[(default|required)", r.stdout), r.stdout
    description = re.split(r"Exit codes|╭", r.stdout)[0]  # the docstring, wrapped: no runs of spaces inside
    assert not re.search(r"\S {2,}\S", description), description



@pytest.mark.parametrize("command", sorted(_commands(app)), ids=lambda c: " ".join(c))
def test_help_names_only_the_output_options_the_command_has(cli, width, command):
    """`advise --help` named a `--csv` it lacks (in --out's help): a flag named anywhere in a command's help is
    one of its options."""
    width(100)
    r = cli([*command, "--help"])
    assert r.exit_code == 0
    has = re.findall(r"^\s*(?:-\w, )?(--[a-z][\w-]*)", r.stdout, re.M)
    for flag in ("--csv", "--json", "--out"):
        if flag in r.stdout:
            assert flag in has, (flag, r.stdout)


#: The commands whose prose (a table's title, its notes, a summary line) ran past 80 columns on a real capture.
CAPTURE_COMMANDS = [["tiers", "--host", "256", "--ssd", "1024"], ["tiers", "--sweep-host", "0,256", "--sweep-ssd", "0,1024"],
                    ["lineage"], ["pressure"], ["audit", "capture"]]


@pytest.mark.engine
@pytest.mark.parametrize("args", CAPTURE_COMMANDS, ids=[" ".join(a) for a in CAPTURE_COMMANDS])
def test_a_real_capture_prints_no_line_over_80_columns(cli, width, family_capture, args):
    trace, _ = family_capture
    width(80)
    argv = args[:2] + [trace] + args[2:] if args[0] == "audit" else args[:1] + [trace] + args[1:]
    r = cli(argv)
    assert r.exit_code in (0, 3), r.stdout + r.stderr
    long = [line for line in (r.stdout + r.stderr).splitlines() if len(line) > 80]
    assert not long, long


def test_a_captions_lines_print_as_lines_not_as_escapes():
    """`audit`'s problems table lists first locations one per caption line; a newline there is the caption's
    own, not data to show as `\\n` (a newline inside a cell still is)."""
    import io

    t = display.Table(title="problems")
    t.add_column("what")
    t.add_row("a\nb")
    t.caption = "first locations:\nX at f.jsonl:3"
    buf = io.StringIO()
    display.SafeConsole(file=buf, width=80).print(t)
    lines = buf.getvalue().splitlines()
    assert lines[-2:] == ["first locations:", "X at f.jsonl:3"], lines
    assert "a\\nb" in buf.getvalue()  # data: made visible
