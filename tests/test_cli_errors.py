"""Every failure is one clear line, resources are bounded, inputs are never outputs: the
CLI's catch-all, Ctrl-C and closed pipes through the real console script, nested CSV
cells, unwritable outputs, out-of-range numbers in importers, and `sql`'s memory, spill and time bounds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kmesh_trace.writer import TraceWriter

CLI = [sys.executable, "-m", "kmesh_trace.cli"]


def tiny(path):
    with TraceWriter(path, "e0", {"block_size": 16, "num_usable_blocks": 8}) as w:
        w.write("invocations", {"request_id": ["a", "b"], "seq": [0, 1], "num_prompt_tokens": [3, 40],
                                "prompt_token_ids": [[1, 2, 3], None]})
    return path


def _scratch_dirs() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("kmesh-trace-sql-")}


# ---- class 1: the catch-all -------------------------------------------------------------------


def test_an_unexpected_exception_is_one_line_naming_it(cli, monkeypatch):
    from kmesh_trace import schema

    monkeypatch.setattr(schema, "as_dict", lambda: (_ for _ in ()).throw(ValueError("boom\nsecond line")))
    r = cli(["schema", "--json"])
    assert r.exit_code == 1
    assert r.stderr == ("Error: unexpected ValueError: boom. This is a bug in kmesh-trace: please report it with the "
                        "command you ran and the traceback that KMESH_TRACE_DEBUG=1 prints.\n")


def test_debug_shows_the_traceback(cli, monkeypatch):
    from kmesh_trace import schema

    monkeypatch.setenv("KMESH_TRACE_DEBUG", "1")
    monkeypatch.setattr(schema, "as_dict", lambda: (_ for _ in ()).throw(ValueError("boom")))
    r = cli(["schema", "--json"])
    assert isinstance(r.exception, ValueError)


def test_keyboard_interrupt_inside_a_command(cli, monkeypatch):
    from kmesh_trace import schema

    monkeypatch.setattr(schema, "as_dict", lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
    r = cli(["schema", "--json"])
    assert (r.exit_code, r.stderr) == (130, "Error: interrupted.\n")


def test_ctrl_c_stops_a_long_query_in_one_line(tmp_path):
    """A real SIGINT to the console script while DuckDB runs: the query stops at once, one line, 130,
    and the private spill directory is removed."""
    root = tiny(tmp_path / "t")
    before = _scratch_dirs()
    p = subprocess.Popen(CLI + ["sql", str(root), "SELECT sum(hash(range)) FROM range(100000000000)"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(4)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert (p.returncode, out, err) == (130, "", "Error: interrupted.\n")
    assert time.monotonic() - t0 < 30
    assert _scratch_dirs() <= before


@pytest.mark.parametrize("args", [["--help"], ["schema"], ["schema", "--json"], ["schema", "--markdown"]])
def test_a_closed_pipe_is_quiet(args):
    """`kmesh-trace ... | head -1`: the reader has gone; no traceback, no second error."""
    r_fd, w_fd = os.pipe()
    os.close(r_fd)  # every write now fails with EPIPE
    try:
        p = subprocess.run(CLI + args, stdout=w_fd, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w_fd)
    assert p.stderr == ""
    assert p.returncode in (0, 1)


def test_sql_csv_writes_nested_values_as_json(tmp_path, cli):
    root = tiny(tmp_path / "t")
    r = cli(["sql", root, "SELECT request_id, prompt_token_ids, {'a': 1, 'b': [2]} AS s FROM invocations ORDER BY seq",
             "--format", "csv"])
    assert r.exit_code == 0, r.stderr
    assert r.stdout == 'request_id,prompt_token_ids,s\na,"[1, 2, 3]","{""a"": 1, ""b"": [2]}"\nb,,"{""a"": 1, ""b"": [2]}"\n'


@pytest.mark.parametrize("command", [
    ["import", "mooncake", "{src}", "--out", "{file}"],
    ["capture", "--out", "{file}", "--", "true"],
    ["replay", "prepare", "--out", "{file}"],
])
def test_out_that_is_an_existing_file_is_one_line(tmp_path, cli, command):
    src = tmp_path / "in.jsonl"
    src.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n')
    (tmp_path / "file").write_text("keep me")
    r = cli([a.format(src=src, file=tmp_path / "file") for a in command])
    assert r.exit_code == 1
    assert r.stderr == f"Error: --out {tmp_path / 'file'} is a file; give a directory.\n"
    assert (tmp_path / "file").read_text() == "keep me"


@pytest.fixture
def read_only_dir(tmpfs):
    """A read-only tmpfs (EROFS even for root)."""
    return tmpfs("ro,size=64k")


@pytest.mark.parametrize("command", [
    ["import", "mooncake", "{src}", "--out", "{ro}/trace"],
    ["capture", "--out", "{ro}/trace", "--", "true"],
    ["audit", "corpus", "{corpus}", "--out", "{ro}/report.json"],
    ["export", "perfetto", "{trace}", "--out", "{ro}/timeline.json"],
])
def test_out_on_a_read_only_filesystem_is_one_line(tmp_path, cli, read_only_dir, command):
    src = tmp_path / "in.jsonl"
    src.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n')
    (tmp_path / "corpus" / "s").mkdir(parents=True)
    (tmp_path / "corpus" / "s" / "a.jsonl").write_text('{"x": 1}\n')
    trace = tiny(tmp_path / "t")
    r = cli([a.format(src=src, ro=read_only_dir, corpus=tmp_path / "corpus", trace=trace) for a in command])
    assert r.exit_code == 1
    assert r.stderr.startswith("Error: cannot write ") and "is not writable" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1


OUT_OF_RANGE = [
    '{"timestamp": 1, "input_length": 100000000000000000000000, "output_length": 5, "hash_ids": [1]}',
    '{"timestamp": 1e300, "input_length": 10, "output_length": 5, "hash_ids": [1]}',
    '{"timestamp": NaN, "input_length": 10, "output_length": 5, "hash_ids": [1]}',
    '{"timestamp": 1, "input_length": 10, "output_length": 1e300, "hash_ids": [1]}',
    '{"timestamp": 1, "input_length": 10, "output_length": 5, "hash_ids": [18446744073709551616]}',
]


@pytest.mark.parametrize("fast", [True, False])
def test_out_of_range_numbers_are_counted_malformed_lines_mooncake(tmp_path, fast):
    from kmesh_trace.datasets.importers.mooncake import import_mooncake

    src = tmp_path / "m.jsonl"
    good = '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}'
    src.write_text("\n".join([good, *OUT_OF_RANGE, good]) + "\n")
    rep = import_mooncake(src, tmp_path / "t", fast=fast)
    assert (rep.num_invocations, rep.num_malformed_lines) == (2, len(OUT_OF_RANGE))


def test_out_of_range_numbers_are_counted_malformed_lines_bailian(tmp_path, cli):
    rows = [{"chat_id": 1, "parent_chat_id": -1, "timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}]
    bad = ['{"chat_id": 100000000000000000000000, "parent_chat_id": -1, "timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}',
           '{"chat_id": 3, "parent_chat_id": 100000000000000000000000, "timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}',
           '{"chat_id": 4, "parent_chat_id": -1, "timestamp": 1e300, "input_length": 10, "output_length": 5, "hash_ids": [1]}',
           '{"chat_id": 5, "parent_chat_id": -1, "timestamp": 0, "input_length": 1e20, "output_length": 5, "hash_ids": [1]}']
    src = tmp_path / "b.jsonl"
    src.write_text("\n".join([json.dumps(rows[0]), *bad]) + "\n")
    r = cli(["import", "bailian", src, "--out", tmp_path / "t", "--json"])
    assert r.exit_code == 0, r.stderr
    rep = json.loads(r.stdout)
    assert (rep["num_invocations"], rep["num_malformed_lines"]) == (1, 4)
    assert rep["malformed_lines"][0] == "b.jsonl:2: field chat_id is out of range (above 9223372036854775807)"


# ---- class 5: sql is bounded ----------------------------------------------------------------


def test_sql_timeout_stops_the_query(tmp_path, cli):
    root = tiny(tmp_path / "t")
    t0 = time.monotonic()
    r = cli(["sql", root, "SELECT sum(hash(range)) FROM range(100000000000)", "--timeout", "1"])
    assert r.exit_code == 1
    assert r.stderr == "Error: the query ran past its timeout of 1 s and was stopped; narrow it or raise --timeout.\n"
    assert time.monotonic() - t0 < 30


def test_sql_memory_limit_is_set_and_checked(tmp_path, cli):
    root = tiny(tmp_path / "t")
    r = cli(["sql", root, "SELECT current_setting('memory_limit') AS m", "--memory-limit", "512MiB", "-f", "json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout) == [{"m": "512.0 MiB"}]
    r = cli(["sql", root, "SELECT 1", "--memory-limit", "lots"])
    assert r.exit_code == 1 and r.stderr.startswith("Error: --memory-limit must be a size")


def test_sql_spills_into_a_private_directory_that_sql_cannot_read_and_that_goes(tmp_path, cli, monkeypatch):
    root = tiny(tmp_path / "t")
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".tmp").mkdir()
    (tmp_path / ".tmp" / "secret.csv").write_text("a\n1\n")
    before = _scratch_dirs()
    r = cli(["sql", root, "SELECT current_setting('temp_directory') AS d, current_setting('max_temp_directory_size') AS s",
             "-f", "json"])
    assert r.exit_code == 0, r.stderr
    row = json.loads(r.stdout)[0]
    assert Path(row["d"]).name.startswith("kmesh-trace-sql-") and Path(row["d"]).parent == Path(tempfile.gettempdir())
    assert not Path(row["d"]).exists() and _scratch_dirs() <= before  # removed when the command ended
    r = cli(["sql", root, "SELECT * FROM read_csv('.tmp/secret.csv')"])
    assert r.exit_code == 1 and r.stderr.startswith("Error: query refused")


def test_sql_streams_and_caps_rows(tmp_path, cli):
    root = tiny(tmp_path / "t")
    r = cli(["sql", root, "SELECT range AS n FROM range(200000)", "-f", "csv"])
    assert r.exit_code == 0 and r.stdout.count("\n") == 200_001 and r.stderr == ""
    r = cli(["sql", root, "SELECT range AS n FROM range(200000)", "-f", "json", "--limit", "2"])
    assert json.loads(r.stdout) == [{"n": 0}, {"n": 1}]
    assert r.stderr == "showing the first 2 rows; the query returned more (raise --limit)\n"
    r = cli(["sql", root, "SELECT range AS n FROM range(5000)"])
    assert r.stdout.count("│ 999 ") == 1 and "│ 1000 " not in r.stdout
    assert "showing the first 1,000 rows" in r.stderr
    r = cli(["sql", root, "SELECT range AS n FROM range(0)", "-f", "json"])
    assert json.loads(r.stdout) == []


# ---- class 6: inputs are never outputs ------------------------------------------------------


def test_audit_corpus_out_inside_the_corpus_is_refused(tmp_path, cli):
    corpus = tmp_path / "corpus"
    (corpus / "s").mkdir(parents=True)
    f = corpus / "s" / "a.jsonl"
    f.write_text('{"x": 1}\n')
    r = cli(["audit", "corpus", corpus, "--out", f])
    assert r.exit_code == 1
    assert r.stderr == f"Error: --out {f} is inside the input {corpus}; write the output somewhere else.\n"
    assert f.read_text() == '{"x": 1}\n'


@pytest.mark.parametrize("command", [
    ["export", "perfetto", "{t}", "--out", "{t}/engines/e0.json"],
    ["headroom", "{t}", "--plot", "{t}/plot.png"],
    ["pressure", "{t}", "--sweep-capacity", "4,8", "--plot", "{t}/plot.svg"],
    ["lineage", "{t}", "--plot", "{t}/plot.png"],
    ["tiers", "{t}", "--gpu-blocks", "8", "--sweep-host", "0,4", "--plot", "{t}/plot.png"],
    ["fleet", "{t}", "--capacity-blocks", "8", "--plot", "{t}/plot.png"],
    ["headroom", "{t}", "--out", "{t}/headroom.json"],
    ["import", "mooncake", "{src}", "--out", "{src}"],
])
def test_every_out_refuses_a_path_inside_its_input(tmp_path, cli, command):
    root = tiny(tmp_path / "t")
    src = tmp_path / "in.jsonl"
    src.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n')
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    r = cli([a.format(t=root, src=src) for a in command])
    assert r.exit_code == 1
    assert "write the output somewhere else" in r.stderr or "is a file; give a directory" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_a_symlink_does_not_slip_past(tmp_path, cli):
    root = tiny(tmp_path / "t")
    (tmp_path / "link").symlink_to(root / "engines")
    r = cli(["export", "perfetto", root, "--out", tmp_path / "link" / "e0.json"])
    assert r.exit_code == 1 and "inside the input" in r.stderr


@pytest.mark.parametrize("fmt", ["json", "csv", "table"])
def test_sql_prints_every_duckdb_type(tmp_path, cli, fmt):
    """Blobs, intervals (polars cannot import them, even nested), maps, 128-bit integers, NaN: no format fails."""
    root = tiny(tmp_path / "t")
    q = ("SELECT 'a\\x00'::BLOB AS b, INTERVAL 1 DAY AS i, [INTERVAL 2 HOUR] AS li, MAP {'k': 1} AS m, "
         "170141183460469231731687303715884105727::HUGEINT AS h, 1.50::DECIMAL(10, 2) AS d, 'nan'::DOUBLE AS n, "
         "{'x': 'y'::BLOB} AS s, TIMESTAMPTZ '2020-01-01 00:00+00' AS tz")
    r = cli(["sql", root, q, "-f", fmt])
    assert r.exit_code == 0, r.stderr
    if fmt == "json":
        assert json.loads(r.stdout) == [{"b": "a\\x00", "i": {"months": 0, "days": 1, "nanoseconds": 0},
                                         "li": [{"months": 0, "days": 0, "nanoseconds": 7_200_000_000_000}],
                                         "m": [["k", 1]], "h": "170141183460469231731687303715884105727",
                                         "d": "1.50", "n": None, "s": {"x": "y"}, "tz": "2020-01-01T00:00:00+00:00"}]
    elif fmt == "csv":
        assert r.stdout.splitlines()[0] == "b,i,li,m,h,d,n,s,tz"


@pytest.mark.parametrize("args,message", [
    # Flag values are refused by the shared typed parsers (kmesh_trace.values), naming the flag.
    (["--expiry-s", "nan"], "Invalid value for '--expiry-s': 'nan' is not a finite number at least 0 and at most "
                            "9,223,372,036. (see 'kmesh-trace pressure --help')"),
    (["--expiry-s", "inf"], "Invalid value for '--expiry-s': 'inf' is not a finite number at least 0 and at most "
                            "9,223,372,036. (see 'kmesh-trace pressure --help')"),
    (["--expiry-s", "1e300"], "Invalid value for '--expiry-s': '1e300' is not a finite number at least 0 and at most "
                              "9,223,372,036. (see 'kmesh-trace pressure --help')"),
    (["--max-held-blocks", "-5"], "Invalid value for '--max-held-blocks': '-5' is not an integer at least 0 and at "
                                  "most 2,147,483,647. (see 'kmesh-trace pressure --help')"),
    (["--capacity-blocks", "99999999999999999999"], "--capacity-blocks values must be at most 2,147,483,647 (got '99999999999999999999')."),
    (["--sweep-capacity", "4,99999999999999999999"], "--sweep-capacity values must be at most 2,147,483,647 (got '4,99999999999999999999')."),
])
def test_pressure_refuses_unusable_numbers_in_one_line(cli, args, message):
    r = cli(["pressure", "--scenario", "hold-stress", *args])
    assert (r.exit_code, r.stderr) == (1, f"Error: {message}\n")


def test_headroom_refuses_a_capacity_beyond_int32(cli):
    r = cli(["headroom", "--scenario", "fork-tree", "--capacity-blocks", "99999999999999999999999"])
    assert (r.exit_code, r.stderr) == (1, "Error: --capacity-blocks values must be at most 2,147,483,647 "
                                          "(got '99999999999999999999999').\n")


def test_report_given_a_public_trace_names_the_import_that_makes_one(cli, tmp_path):
    src = tmp_path / "conversation_trace.jsonl"
    src.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]}\n')
    r = cli(["report", src, "--out", tmp_path / "r.html"])
    assert (r.exit_code, r.stdout) == (1, "")
    assert r.stderr == (f"Error: {src} is mooncake input, not a trace directory: `report` reads a trace; import it "
                        f"first with `kmesh-trace import mooncake {src} --out TRACE`, then `kmesh-trace report TRACE`.\n")
    assert not (tmp_path / "r.html").exists()
