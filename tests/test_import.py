"""Importers: Mooncake (shared data when present) and Bailian (generated), malformed lines kept count of."""

import json

import pytest

from kmesh_trace import open_trace
from bailian_data import generate_bailian

from kmesh_trace.datasets.importers.bailian import chain_hashes, import_bailian
from kmesh_trace.datasets.importers.mooncake import import_mooncake


def write_lines(path, lines):
    path.write_bytes(b"".join(l if isinstance(l, bytes) else l.encode() + b"\n" for l in lines))
    return path


def test_mooncake_golden(tmp_path):
    src = write_lines(tmp_path / "m.jsonl", [
        json.dumps({"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}),
        "",
        json.dumps({"timestamp": 3, "input_length": 512, "output_length": 1, "hash_ids": [0]}),
        "{broken",
        b"\xff\xfe not utf8\n",
        "[1, 2]",
        json.dumps({"timestamp": 4, "input_length": 513, "output_length": 1, "hash_ids": [0]}),
        json.dumps({"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [-1]}),
        json.dumps({"timestamp": 6, "input_length": 1025, "output_length": 2, "hash_ids": [0, 1, 7]}),
    ])
    rep = import_mooncake(src, tmp_path / "t")
    assert (rep.num_lines, rep.num_blank_lines, rep.num_invocations, rep.num_malformed_lines) == (9, 1, 3, 5)
    assert rep.malformed_lines == [
        "m.jsonl:4: broken JSON",
        "m.jsonl:5: invalid UTF-8",
        "m.jsonl:6: JSON value is not an object",
        "m.jsonl:7: hash_ids has 1 entries but input_length 513 needs 2",
        "m.jsonl:8: field hash_ids holds a value that is not a 64-bit unsigned integer",
    ]
    t = open_trace(tmp_path / "t")
    inv = t.frame("invocations").sort("seq")
    assert inv["prompt_block_hashes"].to_list() == [[0, 1], [0], [0, 1, 7]]
    assert inv["arrival_ns"].to_list() == [0, 3_000_000, 6_000_000]
    assert inv["num_prompt_tokens"].to_list() == [600, 512, 1025]
    assert t.block_size == 512
    assert t.metadata["num_malformed_lines"] == 5 and len(t.metadata["malformed_lines"]) == 5


@pytest.mark.shared_data
@pytest.mark.parametrize("name", ["conversation_trace.jsonl", "synthetic_trace.jsonl"])
def test_mooncake_shared_files_match_a_plain_count(tmp_path, shared_datasets, name):
    src = shared_datasets / "mooncake" / name
    if not src.is_file():
        pytest.skip(f"{src} is absent")
    requests = blocks = 0
    distinct = set()
    with open(src) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                requests += 1
                blocks += len(rec["hash_ids"])
                distinct.update(rec["hash_ids"])
    rep = import_mooncake(src, tmp_path / "t")
    assert rep.num_malformed_lines == 0
    assert (rep.num_invocations, rep.num_block_hashes) == (requests, blocks)
    t = open_trace(tmp_path / "t")
    got = t.sql("SELECT count(*) AS n, sum(len(prompt_block_hashes)) AS b, "
                "(SELECT count(DISTINCT h) FROM (SELECT unnest(prompt_block_hashes) AS h FROM invocations)) AS d FROM invocations")
    assert got.row(0) == (requests, blocks, len(distinct))


def test_bailian_rechains_and_declares_lineage(tmp_path):
    src = write_lines(tmp_path / "b.jsonl", [
        json.dumps({"chat_id": 1, "parent_chat_id": -1, "timestamp": 1.5, "input_length": 32, "output_length": 4, "type": "text", "turn": 1, "hash_ids": [7, 8]}),
        json.dumps({"chat_id": 2, "parent_chat_id": 1, "timestamp": 2.0, "input_length": 40, "output_length": 4, "type": "text", "turn": 2, "hash_ids": [7, 8, 9]}),
        json.dumps({"chat_id": 3, "parent_chat_id": -1, "timestamp": 2.5, "input_length": 16, "output_length": 4, "type": "text", "turn": 1, "hash_ids": [8]}),
        json.dumps({"chat_id": 4, "parent_chat_id": 99, "timestamp": 3.0, "input_length": 16, "output_length": 4, "type": "text", "turn": 2, "hash_ids": [8]}),
        json.dumps({"chat_id": 2, "parent_chat_id": 1, "timestamp": 4.0, "input_length": 16, "output_length": 4, "type": "text", "turn": 2, "hash_ids": [1]}),
    ])
    rep = import_bailian(src, tmp_path / "t")
    assert (rep.num_invocations, rep.num_lineage_edges, rep.num_malformed_lines) == (4, 2, 1)
    assert rep.malformed_lines == ["b.jsonl:5: chat_id 2 repeats an earlier line"]
    t = open_trace(tmp_path / "t")
    inv = {r["request_id"]: r for r in t.frame("invocations").to_dicts()}
    h1, h2, h3 = inv["1"]["prompt_block_hashes"], inv["2"]["prompt_block_hashes"], inv["3"]["prompt_block_hashes"]
    assert h2[:2] == h1  # the child's prefix hashes repeat the parent's
    assert h3[0] != h1[1]  # block id 8 at another prefix is another block
    assert h1 == chain_hashes([7, 8])
    assert inv["2"]["family_id"] == "1" and inv["2"]["parent_id"] == "1"
    assert inv["1"]["arrival_ns"] == 1_500_000_000
    edges = t.sql("SELECT child_request_id, parent_request_id, declared_parent_id, edge_kind FROM lineage ORDER BY child_request_id")
    assert edges.rows() == [("2", "1", "1", "declared"), ("4", None, "99", "declared")]
    assert t.block_size == 16


def test_bailian_generator_round_trip(tmp_path):
    expected = generate_bailian(tmp_path / "g.jsonl", num_sessions=30, seed=3, malformed_every=5)
    rep = import_bailian(tmp_path / "g.jsonl", tmp_path / "t")
    assert rep.num_invocations == expected["invocations"]
    assert rep.num_lineage_edges == expected["edges"]
    assert rep.num_block_hashes == expected["blocks"]
    assert rep.num_malformed_lines == expected["malformed"] > 0
    t = open_trace(tmp_path / "t")
    # Every child's hashes start with its parent's.
    inv = {r["request_id"]: r for r in t.frame("invocations").to_dicts()}
    for e in t.frame("lineage").to_dicts():
        parent = inv[e["parent_request_id"]]["prompt_block_hashes"]
        assert inv[e["child_request_id"]]["prompt_block_hashes"][: len(parent)] == parent


def test_import_cli(tmp_path, cli):
    generate_bailian(tmp_path / "g.jsonl", num_sessions=5, seed=1)
    r = cli(["import", "bailian", tmp_path / "g.jsonl", "--out", tmp_path / "t", "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["num_malformed_lines"] == 0
    r = cli(["import", "bailian", tmp_path / "g.jsonl", "--out", tmp_path / "t"])
    assert r.exit_code == 1
    assert r.stderr.startswith("Error: ") and "already holds an import" in r.stderr
    r = cli(["import", "mooncake", tmp_path / "missing.jsonl", "--out", tmp_path / "t2"])
    assert r.exit_code == 1 and r.stderr == f"Error: {tmp_path / 'missing.jsonl'} is not a readable file.\n"
    r = cli(["import", "nosuch", tmp_path / "g.jsonl", "--out", tmp_path / "t3"])
    assert r.exit_code == 1
    assert r.stderr == ("Error: Invalid value for 'FORMAT': Value error, 'nosuch' is not one of 'mooncake', 'bailian', 'weka', 'lmcache-agent', "
                        "'requests'. "
                        "(see 'kmesh-trace import --help')\n")


def mooncake_tables(tmp_path, src):
    out = {}
    for fast in (True, False):
        rep = import_mooncake(src, tmp_path / f"t{fast}", fast=fast)
        out[fast] = (rep.to_dict() | {"out": None}, open_trace(tmp_path / f"t{fast}").frame("invocations").drop("engine").sort("seq"))
    return out


def test_mooncake_fast_path_equals_the_plain_path(tmp_path):
    lines = [json.dumps({"timestamp": i * 0.5, "input_length": 100 + 300 * i, "output_length": i, "extra": "x",
                         "hash_ids": list(range(i, i + -(-(100 + 300 * i) // 512)))}) for i in range(50)]
    src = write_lines(tmp_path / "m.jsonl", ["\ufeff" + lines[0]] + lines[1:10] + ["", "   "] + lines[10:])
    got = mooncake_tables(tmp_path, src)
    assert got[True][0] == got[False][0]
    assert got[True][1].equals(got[False][1])
    assert got[True][0]["num_lines"] == 52 and got[True][0]["num_blank_lines"] == 2


@pytest.mark.parametrize("bad", ['{"timestamp": NaN, "input_length": 1, "output_length": 1, "hash_ids": [1]}',
                                 '{"timestamp": 1e300, "input_length": 1, "output_length": 1, "hash_ids": [1]}',
                                 '\x0c',
                                 '{"timestamp": 1, "input_length": 1, "input_length": 1, "output_length": 1, "hash_ids": [1]}',
                                 '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1.0]}',
                                 '{"timestamp": 1, "input_length": 1, "output_length": 1}'])
def test_mooncake_lines_the_compiled_parse_refuses_are_judged_as_the_plain_path_judges_them(tmp_path, bad):
    good = json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [5]})
    src = write_lines(tmp_path / "m.jsonl", [good, bad, good])
    got = mooncake_tables(tmp_path, src)
    assert got[True][0] == got[False][0]
    assert got[True][1].equals(got[False][1])


@pytest.mark.shared_data
def test_mooncake_fast_path_equals_plain_on_shared_data(tmp_path, shared_datasets):
    src = shared_datasets / "mooncake" / "synthetic_trace.jsonl"
    if not src.is_file():
        pytest.skip(f"{src} is absent")
    got = mooncake_tables(tmp_path, src)
    assert got[True][0] == got[False][0]
    assert got[True][1].equals(got[False][1])


def test_mooncake_sub_nanosecond_times_round_alike_on_both_paths(tmp_path):
    src = write_lines(tmp_path / "m.jsonl", [
        json.dumps({"timestamp": t, "input_length": 10, "output_length": 2, "hash_ids": [5]})
        for t in (1.0000005, 2.5e-7, 0.0000015, 7)])
    got = mooncake_tables(tmp_path, src)
    assert got[True][1]["arrival_ns"].to_list() == got[False][1]["arrival_ns"].to_list() == [round(1.0000005 * 1e6), 0, round(0.0000015 * 1e6), 7_000_000]


def test_out_of_range_timestamp_is_a_malformed_line(tmp_path):
    src = write_lines(tmp_path / "m.jsonl", [
        json.dumps({"timestamp": 1e300, "input_length": 10, "output_length": 2, "hash_ids": [5]}),
        json.dumps({"timestamp": 1, "input_length": 10, "output_length": 2, "hash_ids": [5]})])
    rep = import_mooncake(src, tmp_path / "t")
    assert rep.malformed_lines == ["m.jsonl:1: field timestamp is out of range"]
    assert rep.num_invocations == 1


def test_the_compiled_chain_hashes_equal_hashlib():
    """native/kernels/bailian_chain.c (BLAKE2b-64 of parent || id, one compression per id) against hashlib."""
    import random

    from kmesh_trace.datasets.importers.bailian import chain_hashes_plain

    rng = random.Random(5)
    for _ in range(500):
        ids = [rng.choice([0, 1, 2**64 - 1, 2**63, rng.randrange(2**64), rng.randrange(64)])
               for _ in range(rng.randint(0, 40))]
        assert chain_hashes(ids) == chain_hashes_plain(ids)
    assert chain_hashes([]) == []


@pytest.mark.parametrize("extra", ['"x": NaN', '"x": Infinity', '"x": 1' + "0" * 5000, '"x": [[[[[[[[1]]]]]]]]'])
def test_direct_reading_and_import_keep_and_count_the_same_lines(tmp_path, cli, extra):
    """One decision for both paths: a value in a field neither reads (NaN, a 5,000-digit number) makes
    the line malformed for `headroom FILE` and for `import` + `headroom` alike, or for neither."""
    good = [json.dumps({"timestamp": i, "input_length": 100, "output_length": 3, "hash_ids": [i]}) for i in range(3)]
    odd = '{"timestamp": 9, "input_length": 100, "output_length": 3, "hash_ids": [9], ' + extra + "}"
    src = write_lines(tmp_path / "m.jsonl", good[:2] + [odd] + good[2:])
    direct = cli(["headroom", src, "--json"])
    assert cli(["import", "mooncake", src, "--out", tmp_path / "t"]).exit_code == 0
    imported = cli(["headroom", tmp_path / "t", "--json"])
    assert direct.exit_code == imported.exit_code == 0, direct.stderr + imported.stderr
    d, i = json.loads(direct.stdout), json.loads(imported.stdout)
    assert (d["num_requests"], d["num_prompt_tokens"]) == (i["num_requests"], i["num_prompt_tokens"])
    assert open_trace(tmp_path / "t").metadata["num_malformed_lines"] == 4 - d["num_requests"]
