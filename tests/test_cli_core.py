"""CLI: exact output and exit codes of schema, info, sql and import."""

import json

from kmesh_trace import schema
from kmesh_trace.writer import TraceWriter


def tiny(path):
    with TraceWriter(path, "e0", {"block_size": 16, "num_usable_blocks": 8}) as w:
        w.write("invocations", {"request_id": ["a", "b"], "seq": [0, 1], "num_prompt_tokens": [3, 40]})
    return path


def test_schema_json_is_the_contract(cli):
    r = cli(["schema", "--json"])
    assert r.exit_code == 0
    assert json.loads(r.stdout) == schema.as_dict()


def test_schema_markdown_matches_the_committed_page(cli):
    from pathlib import Path

    r = cli(["schema", "--markdown"])
    assert r.exit_code == 0
    assert r.stdout == (Path(__file__).resolve().parents[1] / "docs" / "SCHEMA.md").read_text()


def test_schema_human_lists_every_column(cli):
    r = cli(["schema"])
    assert r.exit_code == 0
    for t in schema.TABLES.values():
        for c in t.columns:
            assert c.name in r.stdout


def test_info_json(tmp_path, cli):
    root = tiny(tmp_path / "t")
    r = cli(["info", root, "--json"])
    assert r.exit_code == 0
    info = json.loads(r.stdout)
    assert info["tables"] == {"invocations": {"rows": 2, "parts": 1}, "lineage": {"rows": 0, "parts": 0},
                              "block_events": {"rows": 0, "parts": 0}, "transfers": {"rows": 0, "parts": 0},
                              "steps": {"rows": 0, "parts": 0}}
    assert info["engines"]["e0"]["block_size"] == 16
    assert info["engines"]["e0"]["complete"] is True


def test_info_of_a_missing_trace_is_one_error_line(tmp_path, cli):
    r = cli(["info", tmp_path / "nope"])
    assert r.exit_code == 1
    assert r.stdout == ""
    assert r.stderr == f"Error: {tmp_path / 'nope'} is not a directory; give the path of a kmesh-trace trace directory.\n"


def test_sql_formats(tmp_path, cli):
    root = tiny(tmp_path / "t")
    q = "SELECT request_id, num_prompt_tokens FROM invocations ORDER BY seq"
    r = cli(["sql", root, q, "--format", "json"])
    assert r.exit_code == 0
    assert json.loads(r.stdout) == [{"request_id": "a", "num_prompt_tokens": 3}, {"request_id": "b", "num_prompt_tokens": 40}]
    r = cli(["sql", root, q, "--format", "csv"])
    assert r.stdout == "request_id,num_prompt_tokens\na,3\nb,40\n"
    r = cli(["sql", root, q])
    assert r.exit_code == 0 and "40" in r.stdout and "2 row(s)" in r.stderr


def test_sql_error_is_one_line(tmp_path, cli):
    root = tiny(tmp_path / "t")
    r = cli(["sql", root, "SELECT nope FROM invocations"])
    assert r.exit_code == 1
    assert r.stderr.startswith("Error: query failed: Binder Error") and r.stderr.count("\n") == 1


def test_usage_mistakes_are_one_error_line_and_exit_1(cli):
    r = cli(["info"])
    assert (r.exit_code, r.stdout, r.stderr) == (1, "", "Error: Missing argument 'trace'. (see 'kmesh-trace info --help')\n")
    r = cli(["headroom", "--bogus"])
    assert r.exit_code == 1 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("Error: No such option: --bogus") and r.stderr.endswith("(see 'kmesh-trace headroom --help')\n")
    r = cli(["nosuch"])
    assert (r.exit_code, r.stderr) == (1, "Error: No such command 'nosuch'. (see 'kmesh-trace --help')\n")


def test_help_still_exits_0(cli):
    r = cli(["--help"])
    assert r.exit_code == 0 and "schema" in r.stdout
    r = cli(["audit"])
    assert r.exit_code == 0 and "corpus" in r.stdout


def test_sql_sums_come_back_as_plain_integers(tmp_path, cli):
    root = tiny(tmp_path / "t")
    r = cli(["sql", root, "SELECT sum(num_prompt_tokens) AS s, 170141183460469231731687303715884105727::HUGEINT AS big FROM invocations", "--format", "json"])
    assert r.exit_code == 0
    assert r.stdout.strip() == '[{"s":43,"big":"170141183460469231731687303715884105727"}]'
