"""`import lmcache-agent`: the audit's definitions, content edges, approximate tokens, and every report saying so."""

import json
import random
import sys

import pytest

from kmesh_trace import open_trace
from kmesh_trace.audit.corpus import audit_corpus
from kmesh_trace.datasets.importers.lmcache_agent import import_lmcache_agent
from kmesh_trace.errors import MissingDependencyError


def jl(*objs):
    return "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs)


def make_corpus(d, files: dict[str, str | bytes]):
    for rel, text in files.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return d


def rec(ts, session, inp, out):
    return {"timestamp": ts, "session_id": session, "input": inp, "output": out}


# ---- content edges and tokens ------------------------------------------------------------------

def test_content_edges_tokens_and_families(tmp_path):
    a_in, a_out = "system: be brief. user: héllo " * 2, "an answer that is long enough"
    corpus = make_corpus(tmp_path / "c", {"src/a.jsonl": jl(
        rec(1_700_000_000.0, "s1", a_in, a_out),
        rec(1_700_000_002.5, "s1", a_in + a_out + " user: more", "ok"),  # extends, and repeats the output
        rec(1_700_000_004.0, "s1", "unrelated", "x"),  # no edge
        rec(1_700_000_001.0, "s2", a_in, a_out),  # another session: never an edge across sessions
    )})
    rep = import_lmcache_agent(corpus, tmp_path / "t")
    assert (rep.num_records, rep.num_invocations, rep.num_sessions, rep.num_lineage_edges) == (4, 4, 2, 1)
    t = open_trace(tmp_path / "t")
    inv = {r["request_id"]: r for r in t.frame("invocations").iter_rows(named=True)}
    assert inv["src/a.jsonl:1"]["prompt_token_ids"] == list(a_in.encode())
    assert inv["src/a.jsonl:1"]["output_token_ids"] == list(a_out.encode())
    assert inv["src/a.jsonl:1"]["num_prompt_tokens"] == len(a_in.encode())
    assert inv["src/a.jsonl:2"]["arrival_ns"] == 1_700_000_002_500_000_000
    assert inv["src/a.jsonl:1"]["family_id"] == "src/s1" and inv["src/a.jsonl:4"]["family_id"] == "src/s2"
    assert all(r["parent_id"] is None for r in inv.values())  # nothing declared
    (edge,) = t.frame("lineage").drop("engine").iter_rows(named=True)
    assert edge == {"child_request_id": "src/a.jsonl:2", "parent_request_id": "src/a.jsonl:1", "declared_parent_id": None,
                    "family_id": "src/s1", "edge_kind": "content", "num_shared_tokens": len((a_in + a_out).encode())}
    meta = t.metadata
    assert meta["token_ids_approximate"] is True and meta["tokenizer"] == "utf-8-bytes" and meta["block_size"] == 64


# ---- one definition of record, duplicate and malformed ----------------------------------------

_GOOD = lambda rng, i: rec(1_760_000_000 + i, f"s{rng.randrange(3)}", "x" * rng.randrange(0, 200) + str(i), f"out {i}")
_BAD = ['{"timestamp": 1, "input": ', b"\xff\xfe\n", "[1, 2]", '{"timestamp": NaN}', "null", '"text"']


@pytest.mark.parametrize("seed", range(6))
def test_fuzzed_lines_are_all_accounted_for_as_the_audit_counts_them(tmp_path, seed):
    rng = random.Random(seed)
    files, expected = {}, {"records": 0, "dups": 0, "malformed": 0, "blank": 0, "lines": 0}
    n = 0
    for f in range(rng.randint(1, 5)):
        lines: list[bytes] = []
        seen: list[bytes] = []
        for _ in range(rng.randint(0, 25)):
            x = rng.random()
            if x < 0.15 and seen:
                lines.append(rng.choice(seen))
                expected["dups"] += 1
                expected["records"] += 1
            elif x < 0.35:
                b = rng.choice(_BAD)
                lines.append(b if isinstance(b, bytes) else b.encode() + b"\n")
                expected["malformed"] += 1
            elif x < 0.42:
                lines.append(b"  \n")
                expected["blank"] += 1
            else:
                line = json.dumps(_GOOD(rng, n)).encode() + b"\n"
                n += 1
                seen.append(line)
                lines.append(line)
                expected["records"] += 1
        expected["lines"] += len(lines)
        files[f"src{f % 2}/f{f}.jsonl"] = b"".join(lines)
    corpus = make_corpus(tmp_path / "c", files)
    rep = import_lmcache_agent(corpus, tmp_path / "t")
    assert (rep.num_lines, rep.num_blank_lines, rep.num_records, rep.num_duplicate_records, rep.num_malformed_lines) == (
        expected["lines"], expected["blank"], expected["records"], expected["dups"], expected["malformed"])
    assert rep.num_invocations == expected["records"] - expected["dups"]
    assert rep.num_lines == rep.num_blank_lines + rep.num_records + rep.num_malformed_lines
    audit = audit_corpus(corpus).to_dict()
    assert (audit["parsed_records"], audit["duplicate_records"], audit["malformed_lines"]) == (
        rep.num_records, rep.num_duplicate_records, rep.num_malformed_lines)
    t = open_trace(tmp_path / "t")
    assert t.row_counts()["invocations"] == rep.num_invocations
    assert t.metadata["import_counts"]["num_duplicate_records"] == expected["dups"]
    assert len(t.metadata["duplicate_records"]) == expected["dups"]
    assert set(t.frame("lineage")["edge_kind"].to_list()) <= {"content"}


@pytest.mark.shared_data
def test_public_corpus_matches_the_audit(tmp_path, shared_datasets):
    src = shared_datasets / "lmcache-agent-trace"
    if not src.is_dir():
        pytest.skip(f"{src} is absent")
    rep = import_lmcache_agent(src, tmp_path / "t")
    audit = audit_corpus(src).to_dict()
    assert rep.num_records == audit["parsed_records"] == 1917
    assert rep.num_duplicate_records == audit["duplicate_records"] == 2
    assert rep.num_malformed_lines == audit["malformed_lines"] == 20
    assert rep.num_invocations == 1915 and rep.num_sessions == 111
    t = open_trace(tmp_path / "t")
    fam_edges = t.sql("SELECT count(*) AS n FROM lineage l JOIN invocations c ON c.request_id = l.child_request_id "
                      "JOIN invocations p ON p.request_id = l.parent_request_id WHERE c.family_id = p.family_id "
                      "AND l.edge_kind = 'content' AND c.arrival_ns >= p.arrival_ns")
    assert fam_edges["n"][0] == rep.num_lineage_edges > 0


# ---- tokenizers ---------------------------------------------------------------------------------

def _word_tokenizer(path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "again": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return tokenizers


def test_tokenizer_json(tmp_path):
    _word_tokenizer(tmp_path / "tok.json")
    corpus = make_corpus(tmp_path / "c", {"s/a.jsonl": jl(rec(1.0, "s", "hello world", "again"),
                                                          rec(2.0, "s", "hello world again zzz", "x"))})
    rep = import_lmcache_agent(corpus, tmp_path / "t", tokenizer=tmp_path / "tok.json")
    t = open_trace(tmp_path / "t")
    assert t.metadata["tokenizer"].startswith("tokenizers:tok.json sha256:") and rep.block_size == 16
    inv = t.frame("invocations").sort("seq")
    assert inv["prompt_token_ids"].to_list() == [[1, 2], [1, 2, 3, 0]]
    assert t.frame("lineage")["num_shared_tokens"].to_list() == [3]


def test_missing_tokenizers_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    corpus = make_corpus(tmp_path / "c", {"s/a.jsonl": jl(rec(1.0, "s", "a", "b"))})
    with pytest.raises(MissingDependencyError, match=r"pip install 'kmesh-trace\[tokenizers\]'"):
        import_lmcache_agent(corpus, tmp_path / "t", tokenizer=tmp_path / "tok.json")


# ---- every report says the tokens are approximate ---------------------------------------------

def test_reports_mark_approximate_tokens(tmp_path, cli):
    text = "the shared context of this session, long enough to fill blocks. " * 8
    corpus = make_corpus(tmp_path / "c", {"s/a.jsonl": jl(
        rec(1.0, "s", text, "first answer, long enough"),
        rec(2.0, "s", text + "first answer, long enough more", "second"),
        rec(3.0, "s", text + "first answer, long enough more second and more", "third"))})
    r = cli(["import", "lmcache-agent", corpus, "--out", tmp_path / "t", "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["tokenizer"] == "utf-8-bytes"
    trace = tmp_path / "t"
    for args in (["headroom", trace, "--capacity-blocks", "64", "--json"],
                 ["pressure", trace, "--edges", "content", "--capacity-blocks", "64", "--json"],
                 ["info", trace, "--json"], ["lineage", trace, "--json"]):
        r = cli(args)
        assert r.exit_code == 0, (args, r.stderr)
        d = json.loads(r.stdout)
        said = d.get("note") or " ".join(d.get("notes", []))
        assert "token ids are approximate" in said and "utf-8-bytes" in said, args
        assert "note: token ids are approximate" in r.stderr.replace("\n", " "), args
    r = cli(["pressure", trace, "--edges", "content", "--capacity-blocks", "64", "--json"])
    assert json.loads(r.stdout)["num_children"] == 2
    r = cli(["audit", "capture", trace, "--json"])
    d = json.loads(r.stdout)
    # An import is no capture: the verdict says so, and its inherent gaps are listed once, not as blocking problems.
    assert r.exit_code == 0 and all(v["blocked_by"] == ["import"] for v in d["verdict"].values())
    assert not [p for p in d["problems"] if p["severity"] == "blocking"]
    imp = d["imports"]["import-lmcache-agent"]
    assert "block events (no engine served the trace)" in imp["gaps"]
    assert any("utf-8-bytes" in a for a in imp["approximate"])
    assert any("--edges content" in s for s in imp["supports"])
    assert any("content edges are guessed" in a for a in imp["approximate"])
    r = cli(["headroom", trace, "--capacity-blocks", "64"])
    assert "token ids are approximate" in r.stderr.replace("\n", " ")
