"""Corpus audit: golden corpora built in code with known counts, the CLI's exit codes, the shared corpus.

The golden corpus has: a root file, a source with every kind of malformed line plus a blank line,
a CRLF line, an exact duplicate (other key order and spacing), a near-duplicate and an empty file;
a source labelled synthetic by the root README; a tooling-only `claudecode/` directory (a LiteLLM
callback config and parsers, as upstream has) and a source with a tooling-only sub-directory;
a symlink inside DIR (an alias), symlinks leaving DIR (not followed) and a hidden `.git`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kmesh_trace.audit.corpus import audit_corpus
from kmesh_trace.audit.fields import is_timestamp_key
from kmesh_trace.audit.inventory import CorpusUnreadableError

PROMPT = "You are a helper. Q1"
ANSWER = "The answer is forty-two, surely."


def _line(obj: dict, **kw) -> bytes:
    return json.dumps(obj, **kw).encode()


def build_golden(tmp: Path) -> Path:
    root = tmp / "corpus"
    (root / "src_a").mkdir(parents=True)
    (root / "src_b").mkdir()
    (root / "src_c" / "scripts").mkdir(parents=True)
    (root / "claudecode" / "parsers").mkdir(parents=True)
    (root / ".git" / "hooks").mkdir(parents=True)
    (root / ".git" / "hooks" / "pre-commit.py").write_text("print()\n")
    (root / "README.md").write_text("Corpus of agent traces.\nThe src_b traces are synthetic.\n")
    (root / "top.jsonl").write_bytes(_line({"timestamp": 1700000000, "session_id": "r", "input": "x", "output": "y"}) + b"\n")
    (root / "src_a" / "README.md").write_text("Real captures.\n")
    first = {"timestamp": 1700000000000, "session_id": "s1", "input": PROMPT, "output": ANSWER}
    lines = [
        _line(first),
        b"",
        _line({"session_id": "s1", "timestamp": 1700000060000, "input": PROMPT + ANSWER + " Q2", "output": "ok"}) + b"\r",
        b'{"a": ',
        b"[1, 2]",
        _line(dict(reversed(list(first.items()))), indent=None, separators=(" , ", " :  ")),
        _line({**first, "timestamp": 1700000120000}),
        b"\xff\xfe{}",
        b'{"timestamp": NaN}',
    ]
    (root / "src_a" / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (root / "src_a" / "b.jsonl").write_bytes(b"")
    (root / "src_b" / "b1.jsonl").write_bytes(
        _line({"ts": 1700000000.5, "conversation_id": 7, "prompt": "p", "response": "r", "model": "m"}) + b"\n"
        + _line({"ts": 1700000001.5, "conversation_id": 7, "prompt": "pp", "response": "r2", "model": None}))
    (root / "src_c" / "c.jsonl").write_bytes(_line({"timestamp": 1700000000000000, "session_id": "c", "input": "i", "output": "o"}) + b"\n")
    (root / "src_c" / "scripts" / "gen.py").write_text("print()\n")
    (root / "claudecode" / "litellm_config.yaml").write_text("callbacks: [parsers.log]\n")
    (root / "claudecode" / "parsers" / "__init__.py").write_text("")
    (root / "claudecode" / "parsers" / "parse_logs.py").write_text("print()\n")
    outside = tmp / "outside"
    outside.mkdir()
    (outside / "secret.jsonl").write_bytes(_line({"timestamp": 1, "input": "never read"}) + b"\n")
    os.symlink(outside, root / "outside")
    os.symlink(outside / "secret.jsonl", root / "outside_file.jsonl")
    os.symlink(root / "src_a" / "a.jsonl", root / "zz_alias.jsonl")
    return root


@pytest.fixture
def golden(tmp_path):
    return build_golden(tmp_path)


def test_golden_counts(golden):
    r = audit_corpus(golden)
    d = r.to_dict()
    assert list(d["sources"]) == [".", "claudecode", "src_a", "src_b", "src_c"]
    assert (d["jsonl_files"], d["physical_lines"], d["blank_lines"], d["nonempty_lines"]) == (5, 13, 1, 12)
    assert (d["parsed_records"], d["unique_records"], d["duplicate_records"], d["near_duplicate_records"]) == (8, 7, 1, 1)
    assert d["malformed_lines"] == 4
    assert d["malformed_by_file"] == {"src_a/a.jsonl": 4}
    assert d["malformed_by_kind"] == {"broken_json": 1, "invalid_utf8": 1, "nonstandard_literal": 1, "not_object": 1}
    assert [m["location"] for m in d["malformed_locations"]] == [f"src_a/a.jsonl:{n}" for n in (4, 5, 8, 9)]
    assert d["duplicates"][0]["locations"] == ["src_a/a.jsonl:1", "src_a/a.jsonl:6"]
    assert d["near_duplicates"] == [{"records": 2, "timestamp_keys": ["timestamp"], "locations": ["src_a/a.jsonl:1", "src_a/a.jsonl:7"]}]
    assert d["empty_files"] == ["src_a/b.jsonl"]
    assert d["tooling_only_dirs"] == ["claudecode", "src_c/scripts"]
    assert d["sources"]["claudecode"]["tooling_files"] == [
        "claudecode/litellm_config.yaml", "claudecode/parsers/__init__.py", "claudecode/parsers/parse_logs.py"]
    assert d["sources"]["claudecode"]["parsed_records"] == 0
    assert d["skipped_symlinks"] == ["outside", "outside_file.jsonl"]
    assert d["symlink_aliases"] == ["zz_alias.jsonl"]
    assert d["hidden_entries_skipped"] == 1
    assert d["bytes"] == sum((golden / f).stat().st_size for f in d["input_sha256"] if f.endswith(".jsonl"))


def test_golden_hashes_fields_and_units(golden):
    d = audit_corpus(golden).to_dict()
    assert d["input_sha256"] == {
        rel: hashlib.sha256((golden / rel).read_bytes()).hexdigest()
        for rel in ("README.md", "src_a/README.md", "src_a/a.jsonl", "src_a/b.jsonl", "src_b/b1.jsonl", "src_c/c.jsonl", "top.jsonl")
    }
    a = d["sources"]["src_a"]
    assert a["fields"]["timestamp"] == {"records": 4, "share": 1.0, "types": {"integer": 4}}
    assert a["timestamps"]["timestamp"]["unit"] == "ms"
    assert a["timestamps"]["timestamp"]["granularity_s"] == 20.0  # gcd of the four values, 20000 ms
    b = d["sources"]["src_b"]
    assert b["fields"]["model"] == {"records": 2, "share": 1.0, "types": {"null": 1, "string": 1}}
    assert b["timestamp_unit"] == "s" and b["timestamps"]["ts"]["granularity_s"] is None
    assert d["sources"]["src_c"]["timestamp_unit"] == "us"
    assert d["sources"]["."]["timestamp_unit"] == "s"


def test_golden_labels_edges_and_verdict(golden):
    r = audit_corpus(golden)
    d = r.to_dict()
    assert d["sources"]["src_b"]["labels"] == {"synthetic": ["README.md:2"]}
    assert d["readmes"] == [
        {"path": "README.md", "source": ".", "labels": [{"label": "synthetic", "line": 2, "sources": ["src_b"]}]},
        {"path": "src_a/README.md", "source": "src_a", "labels": []},
    ]
    # src_a, in time order: lines 1 and 6 tie; 6 -> 3 extends and repeats the answer; 3 -> 7 neither.
    assert d["sources"]["src_a"]["content_edges"] == {
        "sessions": 1, "records_without_session": 0, "pairs": 3, "input_extends_previous": 1,
        "previous_output_in_next_input": 1, "pairs_with_edge": 1, "timestamp_ties": 1}
    assert d["lineage"]["content_edges"] == {
        "sessions": 4, "records_without_session": 0, "pairs": 4, "input_extends_previous": 2,
        "previous_output_in_next_input": 1, "pairs_with_edge": 2, "timestamp_ties": 1}
    assert all(v["records"] == 0 for v in d["lineage"]["evidence"].values())
    assert d["verdict"]["headroom"]["qualified"] is False
    assert d["verdict"]["retention_pressure"]["labelled_sources"] == ["src_b"]
    assert [(p.code, p.severity, p.count) for p in r.problems] == [
        ("malformed_lines", "blocking", 4), ("duplicate_records", "blocking", 1),
        ("not_qualified_headroom", "blocking", 5), ("not_qualified_retention_pressure", "blocking", 6),
        ("empty_files", "warning", 1), ("near_duplicates", "warning", 1), ("labelled_not_observed", "warning", 1),
        ("tooling_only_dirs", "warning", 2), ("symlinks_outside", "warning", 2),
    ]
    assert r.exit_code == 3
    text = json.dumps(d)
    for secret in (PROMPT, ANSWER, "never read", "forty-two"):
        assert secret not in text


def _evidence_record(rid: str, parent: str | None, cached: int) -> dict:
    return {"request_id": rid, "parent_id": parent, "start_time": 1700000000.0, "end_time": 1700000001.0,
            "engine_id": "e0", "prompt_token_ids": [1, 2, 3], "num_cached_tokens": cached,
            "block_events": [{"event": "allocated", "block_id": 1}]}


def test_full_evidence_corpus_qualifies(tmp_path, cli):
    root = tmp_path / "good"
    (root / "calls").mkdir(parents=True)
    (root / "calls" / "c.jsonl").write_bytes(b"\n".join(_line(_evidence_record(r, p, c)) for r, p, c in
                                                        (("a", None, 0), ("b", "a", 16), ("c", "a", 16))))
    r = audit_corpus(root)
    ev = r.to_dict()["lineage"]["evidence"]
    assert ev["explicit_parent_links"] == {"records": 2, "of": 3, "fields": ["parent_id"]}
    assert ev["parent_link_fields"]["records"] == 3
    assert ev["start_completion_times"]["fields"] == ["end_time", "start_time"]
    assert [p.code for p in r.problems] == []
    assert r.to_dict()["verdict"]["retention_pressure"]["qualified_sources"] == ["calls"]
    res = cli(["audit", "corpus", root])
    assert res.exit_code == 0, res.stderr
    assert res.stderr.strip().splitlines()[-1] == "OK: nothing blocking"


def test_headroom_without_parent_links(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    recs = [{k: v for k, v in _evidence_record(str(i), None, 0).items() if k != "parent_id"} for i in range(2)]
    recs[1]["prompt_token_ids"] = [9]
    (root / "x.jsonl").write_bytes(b"\n".join(_line(x) for x in recs))
    v = audit_corpus(root).verdict
    assert v["headroom"]["qualified"] is True
    assert v["retention_pressure"]["missing"] == [{"evidence": "explicit_parent_links", "records_with": 0, "of": 2}]


def test_cli_json_and_out(golden, tmp_path, cli):
    out = tmp_path / "report.json"
    res = cli(["audit", "corpus", golden, "--json", "--out", out])
    assert res.exit_code == 3 and res.stdout == ""  # --out: the file, nothing on stdout
    d = json.loads(out.read_text())
    for key in ("jsonl_files", "nonempty_lines", "parsed_records", "unique_records", "duplicate_records",
                "malformed_lines", "malformed_by_file", "sources", "lineage", "verdict", "input_sha256"):
        assert key in d
    assert json.loads(out.read_text()) == d
    assert res.stderr.strip().splitlines()[-1] == (
        "Error: audit found 4 blocking problems: malformed_lines, duplicate_records, not_qualified_headroom, "
        "not_qualified_retention_pressure")


def test_cli_human_output(golden, cli):
    res = cli(["audit", "corpus", golden])
    assert res.exit_code == 3
    assert res.stdout.startswith(f"corpus {golden}: 5 JSONL files")
    assert "tooling_only_dirs" in res.stdout


def test_cli_cannot_run(tmp_path, cli):
    res = cli(["audit", "corpus", tmp_path / "missing"])
    assert res.exit_code == 1
    assert res.stderr.strip() == f"Error: {tmp_path / 'missing'} does not exist; give the directory that holds the corpus."
    f = tmp_path / "file.jsonl"
    f.write_text("{}\n")
    res = cli(["audit", "corpus", f])
    assert res.exit_code == 1 and "is not a directory" in res.stderr
    with pytest.raises(CorpusUnreadableError):
        audit_corpus(tmp_path / "missing")


def test_unreadable_subdirectory_is_a_problem(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads directories whatever their mode")
    root = tmp_path / "c"
    (root / "locked").mkdir(parents=True)
    (root / "ok.jsonl").write_text('{"a": 1}\n')
    (root / "locked").chmod(0)
    try:
        r = audit_corpus(root)
    finally:
        (root / "locked").chmod(0o755)
    assert [(p.code, p.locations) for p in r.problems if p.code == "unreadable"] == [("unreadable", ["locked"])]


def test_capture_cli_exit_codes(tmp_path, cli):
    from capture_traces import write_trace  # the same in-code traces (tests/ is on sys.path)

    clean = write_trace(tmp_path / "clean")
    res = cli(["audit", "capture", clean, "--json"])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["verdict"]["headroom"] == {"qualified": True, "blocked_by": []}
    bad = write_trace(tmp_path / "bad", dropped=3)
    res = cli(["audit", "capture", bad])
    assert res.exit_code == 3
    assert res.stderr.strip().splitlines()[-1] == "Error: audit found 1 blocking problem: dropped_events"
    res = cli(["audit", "capture", tmp_path / "nope"])
    assert res.exit_code == 1 and res.stderr.startswith("Error: ")


# ---- the shared corpus, checked against a plain independent count -------------------------------


@pytest.mark.shared_data
def test_shared_lmcache_corpus(shared_datasets):
    root = shared_datasets / "lmcache-agent-trace"
    if not root.is_dir():
        pytest.skip(f"{root} is absent")
    files = sorted(p for p in root.rglob("*.jsonl"))
    nonempty = parsed = malformed = 0
    canon: dict[str, int] = {}
    for p in files:
        for raw in p.read_bytes().split(b"\n"):
            if not raw.strip():
                continue
            nonempty += 1
            try:
                obj = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                malformed += 1
                continue
            if not isinstance(obj, dict):
                malformed += 1
                continue
            parsed += 1
            c = json.dumps(obj, sort_keys=True, separators=(",", ":"))
            canon[c] = canon.get(c, 0) + 1
    r = audit_corpus(root)
    d = r.to_dict()
    assert d["jsonl_files"] == len(files)
    assert (d["nonempty_lines"], d["parsed_records"], d["malformed_lines"]) == (nonempty, parsed, malformed)
    assert d["duplicate_records"] == sum(n - 1 for n in canon.values())
    assert d["unique_records"] == len(canon)
    assert d["empty_files"] == sorted(str(p.relative_to(root)) for p in files if p.stat().st_size == 0)
    for p in files:
        assert d["input_sha256"][str(p.relative_to(root))] == hashlib.sha256(p.read_bytes()).hexdigest()
    assert "hand-crafted" in d["sources"]["pyCodeAGI"]["labels"]
    assert d["verdict"]["headroom"]["qualified"] is False and d["verdict"]["retention_pressure"]["qualified"] is False
    assert r.exit_code == 3


# ---- record identity against a plain reference ---------------------------------------------------

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0.5, 1.0, -0.0, 1e300]),
                     st.text(alphabet="ab\u00e9\u2603\"\\", max_size=4), st.sampled_from(["x" * 70, "x" * 34 + "y" + "x" * 35]))  # same pre-key, different records
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.sampled_from("pq"), inner, max_size=2),
                       max_leaves=4)
_records = st.dictionaries(st.sampled_from(["timestamp", "ts", "a", "b"]), _values, max_size=3)


def _serialise(obj: dict, style: int) -> bytes:
    if style == 0:
        return json.dumps(obj).encode()
    if style == 1:
        return json.dumps(dict(reversed(list(obj.items()))), ensure_ascii=False, separators=(" ,", ": ")).encode()
    return b"  " + json.dumps(obj, sort_keys=True, indent=None).encode() + b"\r"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(records=st.lists(st.tuples(_records, st.integers(0, 2)), min_size=1, max_size=12))
def test_fuzz_duplicates_match_plain_canonical_json(tmp_path_factory, records):
    root = tmp_path_factory.mktemp("ident")
    (root / "s").mkdir()
    half = len(records) // 2
    (root / "s" / "one.jsonl").write_bytes(b"\n".join(_serialise(o, s) for o, s in records[:half]))
    (root / "s" / "two.jsonl").write_bytes(b"\n".join(_serialise(o, s) for o, s in records[half:]))
    canon = [json.dumps(o, sort_keys=True, separators=(",", ":")) for o, _ in records]
    unique = list(dict.fromkeys(canon))
    near: dict[str, int] = {}
    for c in unique:
        o = json.loads(c)
        ts = sorted(k for k in o if is_timestamp_key(k))
        if ts:
            key = json.dumps({k: v for k, v in o.items() if k not in ts}, sort_keys=True) + repr(ts)
            near[key] = near.get(key, 0) + 1
    d = audit_corpus(root).to_dict()
    assert d["parsed_records"] == len(records)
    assert d["duplicate_records"] == len(canon) - len(unique)
    assert d["near_duplicate_records"] == sum(n - 1 for n in near.values())
