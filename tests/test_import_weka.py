"""`import weka`: the sample conversations (golden), lineage rules, id scopes, arrival models, malformed input."""

import json
import random

import pytest

from kmesh_trace import open_trace
from kmesh_trace.datasets.importers.weka import LOCAL_BIT, LOCAL_ID_BITS, Arrival, import_weka
from kmesh_trace.errors import KmeshTraceError


def conv(cid, requests, block_size=4, scope="local"):
    return {"id": cid, "block_size": block_size, "hash_id_scope": scope, "requests": requests}


def req(t, n_blocks, *, first=1, api=1.0, extra=0, **kw):
    return {"t": t, "type": "n", "in": n_blocks * 4 + extra, "out": 3, "hash_ids": list(range(first, first + n_blocks)),
            "api_time": api, **kw}


def sub(t, agent_id, requests, subagent_type="Explore", duration_ms=None):
    d = {"t": t, "type": "subagent", "agent_id": agent_id, "subagent_type": subagent_type, "requests": requests}
    if duration_ms is not None:
        d["duration_ms"] = duration_ms
    return d


def write(d, name, obj):
    p = d / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return p


def rows(trace):
    return {r["request_id"]: r for r in open_trace(trace).frame("invocations").iter_rows(named=True)}


def parents(trace):
    lin = open_trace(trace).frame("lineage")
    assert set(lin["edge_kind"]) <= {"declared"}
    return dict(zip(lin["child_request_id"], lin["parent_request_id"]))


# ---- the public samples ------------------------------------------------------------------------

def _plain_counts(d):
    """Requests, sub-agents and block ids of the sample files, counted without the importer."""
    requests = subagents = ids = 0
    for p in sorted(d.glob("*.json")):
        stack = list(json.loads(p.read_text())["requests"])
        while stack:
            r = stack.pop()
            if r["type"] == "subagent":
                subagents += 1
                stack.extend(r["requests"])
            else:
                requests += 1
                ids += len(r["hash_ids"])
    return requests, subagents, ids


@pytest.mark.shared_data
def test_samples_golden(tmp_path, shared_datasets):
    src = shared_datasets / "weka-claude-code"
    if not src.is_dir():
        pytest.skip(f"{src} is absent")
    rep = import_weka(src, tmp_path / "t")
    assert (rep.num_files, rep.num_families, rep.num_invocations, rep.num_subagents, rep.num_block_hashes,
            rep.num_lineage_edges, rep.num_malformed_lines) == (4, 4, 129, 6, 152_091, 125, 0)
    assert (rep.num_invocations, rep.num_subagents, rep.num_block_hashes) == _plain_counts(src)
    t = open_trace(tmp_path / "t")
    assert t.block_size == 64 and t.metadata["arrival"] == "users:8"
    fams = t.sql("SELECT family_id, count(*) AS n, count(agent_id) AS a FROM invocations GROUP BY 1 ORDER BY 1")
    assert fams.rows() == [("trace_0001", 41, 0), ("trace_0277", 53, 44), ("trace_0291", 32, 12), ("trace_0504", 3, 0)]
    # Each sub-agent's first request hangs off the latest main request at or before the sub-agent's start.
    got = t.sql("SELECT l.child_request_id, l.parent_request_id, i.agent_type FROM lineage l JOIN invocations i "
                "ON i.request_id = l.child_request_id WHERE l.family_id = 'trace_0277' AND i.agent_id IS NOT NULL "
                "AND l.parent_request_id LIKE 'trace_0277/m/%' ORDER BY 1").rows()
    assert got == [("trace_0277/agent_001/0", "trace_0277/m/0", "Explore"),
                   ("trace_0277/agent_002/0", "trace_0277/m/0", "Explore"),
                   ("trace_0277/agent_003/0", "trace_0277/m/0", "Explore"),
                   ("trace_0277/agent_004/0", "trace_0277/m/6", "Plan")]
    # The main thread's requests at 347 s and 763 s bracket agent_004's start (723.533 s).
    r = rows(tmp_path / "t")
    start = r["trace_0277/m/0"]["arrival_ns"]
    assert r["trace_0277/m/6"]["arrival_ns"] - start == 347_000_000_000
    assert r["trace_0277/agent_004/0"]["arrival_ns"] - start == 723_533_000_000
    assert r["trace_0277/m/7"]["arrival_ns"] - start == 763_000_000_000
    # Sub-agent threads chain within themselves.
    assert parents(tmp_path / "t")["trace_0277/agent_004/1"] == "trace_0277/agent_004/0"
    # Full blocks only: every request lists in // 64 ids.
    bad = t.sql("SELECT count(*) AS n FROM invocations WHERE len(prompt_block_hashes) != num_prompt_tokens // 64")
    assert bad["n"][0] == 0


# ---- rules on small conversations --------------------------------------------------------------

def test_time_order_lineage_and_agents(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    write(d, "a.json", conv("a", [
        req(0, 2),
        sub(5, "ag1", [req(0, 1, first=100), req(2, 2, first=100)], duration_ms=4000),
        req(5, 3),  # same time as the sub-agent's start: file order decides (the sub-agent first)
        sub(1, "ag0", [req(0, 1, first=200)]),  # starts before the main thread's second request
        req(20, 4, stop="max_tokens"),
    ]))
    rep = import_weka(d, tmp_path / "t", arrival="as-recorded")
    assert (rep.num_invocations, rep.num_subagents, rep.num_lineage_edges) == (6, 2, 5)
    r = rows(tmp_path / "t")
    order = sorted(r.values(), key=lambda x: (x["arrival_ns"], x["seq"]))
    assert [x["request_id"] for x in order] == ["a/m/0", "a/ag0/0", "a/ag1/0", "a/m/1", "a/ag1/1", "a/m/2"]
    assert [x["seq"] for x in order] == list(range(6))
    assert parents(tmp_path / "t") == {"a/ag0/0": "a/m/0", "a/ag1/0": "a/m/0", "a/m/1": "a/m/0",
                                       "a/ag1/1": "a/ag1/0", "a/m/2": "a/m/1"}
    assert r["a/ag1/1"]["agent_id"] == "ag1" and r["a/ag1/1"]["agent_type"] == "Explore"
    assert r["a/m/1"]["agent_id"] is None and r["a/m/1"]["parent_id"] == "a/m/0"
    assert r["a/ag1/1"]["arrival_ns"] == 7_000_000_000 and r["a/ag1/1"]["finish_ns"] == 8_000_000_000
    assert r["a/m/2"]["status"] == "length_capped" and r["a/m/1"]["status"] == "finished"
    assert all(x["family_id"] == "a" for x in r.values())


def test_subagent_before_any_main_request_is_a_root(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    write(d, "a.json", conv("a", [sub(0, "s", [req(0, 1)]), req(0, 1)]))
    import_weka(d, tmp_path / "t")
    # The sub-agent starts at 0 and comes first in the file: no main request precedes it.
    assert parents(tmp_path / "t") == {}


def test_local_ids_are_namespaced_per_file_and_global_ids_shared(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    for name in ("a", "b"):
        write(d, f"{name}.json", conv(name, [req(0, 3)]))
    for name in ("g1", "g2"):
        write(d, f"{name}.json", conv(name, [req(0, 3)], scope="global"))
    import_weka(d, tmp_path / "t")
    r = rows(tmp_path / "t")
    a, b = r["a/m/0"]["prompt_block_hashes"], r["b/m/0"]["prompt_block_hashes"]
    assert a == [LOCAL_BIT | 0 << LOCAL_ID_BITS | i for i in (1, 2, 3)]
    assert b == [LOCAL_BIT | 1 << LOCAL_ID_BITS | i for i in (1, 2, 3)]
    assert r["g1/m/0"]["prompt_block_hashes"] == r["g2/m/0"]["prompt_block_hashes"] == [1, 2, 3]


def test_partial_tail_is_not_a_block_and_mismatch_is_malformed(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    write(d, "a.json", conv("a", [req(0, 2, extra=3), {**req(1, 2), "in": 13}]))
    rep = import_weka(d, tmp_path / "t")
    assert rep.num_invocations == 1 and rep.num_malformed_entries == 1
    assert rep.malformed_lines == ["a.json: requests[1]: hash_ids has 2 entries but in 13 // block_size 4 is 3"]
    (row,) = rows(tmp_path / "t").values()
    assert row["num_prompt_tokens"] == 11 and len(row["prompt_block_hashes"]) == 2


# ---- arrival models ----------------------------------------------------------------------------

@pytest.mark.parametrize("arrival,starts", [
    ("as-recorded", [0, 0, 0, 0]),
    ("stagger:10", [0, 10, 20, 30]),
    # durations 100, 30, 50, 5 s: user 0 takes a (ends 100), user 1 b (ends 30), then c at 30 (ends 80), d at 80.
    ("users:2", [0, 0, 30, 80]),
    ("users:8", [0, 0, 0, 0]),
])
def test_arrival_models(tmp_path, arrival, starts):
    d = tmp_path / "in"
    d.mkdir()
    for name, end in (("a", 100), ("b", 30), ("c", 50), ("d", 5)):
        write(d, f"{name}.json", conv(name, [req(0, 1), req(end - 1, 1, api=1.0)]))
    rep = import_weka(d, tmp_path / "t", arrival=arrival)
    assert rep.arrival == arrival
    t = open_trace(tmp_path / "t")
    assert t.metadata["arrival"] == arrival and t.metadata["capture_config"]["arrival"] == arrival
    first = t.sql("SELECT family_id, min(arrival_ns) AS a FROM invocations GROUP BY 1 ORDER BY 1")
    assert first["a"].to_list() == [s * 1_000_000_000 for s in starts]


@pytest.mark.parametrize("bad", ["users:0", "stagger:-1", "stagger:", "poisson:3", "as-recorded:1", "users:x"])
def test_arrival_refuses_bad_values(bad):
    with pytest.raises(KmeshTraceError, match="--arrival"):
        Arrival.parse(bad)


def test_arrival_cli(tmp_path, cli):
    d = tmp_path / "in"
    d.mkdir()
    write(d, "a.json", conv("a", [req(0, 1)]))
    r = cli(["import", "weka", d, "--out", tmp_path / "t", "--arrival", "stagger:5", "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["arrival"] == "stagger:5"
    r = cli(["import", "weka", d, "--out", tmp_path / "t2", "--arrival", "users:0"])
    assert r.exit_code == 1 and r.stderr.startswith("Error: --arrival 'users:0'")
    r = cli(["import", "mooncake", d / "a.json", "--out", tmp_path / "t3", "--arrival", "users:2"])
    assert r.exit_code == 1 and "applies to weka imports only" in r.stderr


# ---- malformed input, fuzzed -------------------------------------------------------------------

_BAD_REQUESTS = [
    lambda r: {**r, "t": -1},
    lambda r: {**r, "t": "soon"},
    lambda r: {**r, "type": "x"},
    lambda r: {**r, "in": 0},
    lambda r: {**r, "in": r["in"] + 4},  # one block short
    lambda r: {**r, "hash_ids": r["hash_ids"][:-1] + [1.5]},
    lambda r: {**r, "hash_ids": r["hash_ids"][:-1] + [True]},
    lambda r: {**r, "hash_ids": r["hash_ids"][:-1] + [None]},
    lambda r: {**r, "hash_ids": r["hash_ids"][:-1] + [-3]},
    lambda r: {**r, "hash_ids": r["hash_ids"][:-1] + [1 << 41]},  # cannot be namespaced (local scope)
    lambda r: {**r, "hash_ids": "1,2"},
    lambda r: {**r, "api_time": "slow"},
    lambda r: [r],
]
_BAD_FILES = ["{not json", "[1, 2]", json.dumps({"id": 5, "block_size": 4, "requests": []}),
              json.dumps({"id": "z", "block_size": 0, "requests": []}),
              json.dumps({"id": "z", "block_size": 4, "hash_id_scope": "shared", "requests": []}),
              json.dumps({"id": "z", "block_size": 4}), "\xff"]


@pytest.mark.parametrize("seed", range(8))
def test_fuzzed_malformed_entries_are_all_accounted_for(tmp_path, seed):
    rng = random.Random(seed)
    d = tmp_path / "in"
    d.mkdir()
    good = bad_entries = bad_files = 0
    for f in range(rng.randint(2, 6)):
        if rng.random() < 0.25:
            write(d, f"f{f:02d}.json", rng.choice(_BAD_FILES))
            bad_files += 1
            continue
        entries = []
        for i in range(rng.randint(1, 8)):
            if rng.random() < 0.3:
                inner = []
                for j in range(rng.randint(0, 4)):
                    r = req(j, rng.randint(1, 5))
                    if rng.random() < 0.3:
                        r, bad_entries = rng.choice(_BAD_REQUESTS)(r), bad_entries + 1
                    else:
                        good += 1
                    inner.append(r)
                entries.append(sub(i, f"s{i}", inner))
                continue
            r = req(i, rng.randint(1, 5))
            if rng.random() < 0.3:
                r, bad_entries = rng.choice(_BAD_REQUESTS)(r), bad_entries + 1
            else:
                good += 1
            entries.append(r)
        write(d, f"f{f:02d}.json", conv(f"c{f}", entries))
    rep = import_weka(d, tmp_path / "t")
    assert rep.num_invocations == good
    assert rep.num_malformed_entries == bad_entries and rep.num_malformed_files == bad_files
    assert rep.num_malformed_lines == bad_entries + bad_files == len(rep.malformed_lines)
    t = open_trace(tmp_path / "t")
    assert t.row_counts()["invocations"] == good
    assert t.metadata["num_malformed_lines"] == bad_entries + bad_files
    assert t.metadata["import_counts"]["num_malformed_entries"] == bad_entries
    assert t.metadata["complete"] is True
    # Every edge joins two imported requests of one family.
    dangling = t.sql("SELECT count(*) AS n FROM lineage l LEFT JOIN invocations c ON c.request_id = l.child_request_id "
                     "LEFT JOIN invocations p ON p.request_id = l.parent_request_id "
                     "WHERE c.request_id IS NULL OR p.request_id IS NULL OR c.family_id != p.family_id")
    assert dangling["n"][0] == 0


def test_duplicate_file_id_and_block_size_change_are_malformed_files(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    write(d, "a.json", conv("a", [req(0, 1)]))
    write(d, "b.json", conv("a", [req(0, 1)]))
    write(d, "c.json", conv("c", [req(0, 1)], block_size=8))
    rep = import_weka(d, tmp_path / "t")
    assert rep.num_invocations == 1 and rep.num_malformed_files == 2
    assert rep.malformed_lines == ["b.json: id 'a' repeats an earlier file's",
                                   "c.json: block_size 8 differs from the 4 of the files before it (one trace, one block size)"]


# ---- the fast path (ids cut out of the text) agrees with the plain path ------------------------

def _tables(path):
    t = open_trace(path)
    return (t.frame("invocations").drop("engine").sort("seq").to_dicts(),
            t.frame("lineage").drop("engine").sort("child_request_id").to_dicts(), t.metadata["malformed_lines"])


def assert_fast_equals_plain(tmp_path, src, **kw):
    fast = import_weka(src, tmp_path / "fast", **kw).to_dict()
    plain = import_weka(src, tmp_path / "plain", fast=False, **kw).to_dict()
    assert {k: v for k, v in fast.items() if k != "out"} == {k: v for k, v in plain.items() if k != "out"}
    assert _tables(tmp_path / "fast") == _tables(tmp_path / "plain")
    return fast


@pytest.mark.shared_data
def test_fast_equals_plain_on_the_samples(tmp_path, shared_datasets):
    src = shared_datasets / "weka-claude-code"
    if not src.is_dir():
        pytest.skip(f"{src} is absent")
    assert assert_fast_equals_plain(tmp_path, src)["num_block_hashes"] == 152_091


@pytest.mark.parametrize("seed", range(8))
def test_fast_equals_plain_on_fuzzed_input(tmp_path, seed):
    (tmp_path / "f").mkdir()
    test_fuzzed_malformed_entries_are_all_accounted_for(tmp_path / "f", seed)
    assert_fast_equals_plain(tmp_path, tmp_path / "f" / "in")


@pytest.mark.parametrize("text", [
    '{"id": "a", "block_size": 4, "requests": [{"t": 0, "type": "n", "in": 8, "hash_ids": [01, 2]}]}',
    '{"id": "a", "block_size": 4, "requests": [{"t": 0, "type": "n", "in": 8, "hash_ids": [1,,2]}]}',
    '{"id": "a", "block_size": 4, "requests": [{"t": 0, "type": "n", "in": 8, "hash_ids":[1,2,]}]}',
    '{"id": "a", "block_size": 4, "x\\"hash_ids":[1], "requests": [{"t": 0, "type": "n", "in": 4, "hash_ids":[1]}]}',
    '{"id": "a", "block_size": 4, "hash_ids":[5], "requests": [{"t": 0, "type": "n", "in": 4, "hash_ids":[1]}]}',
    '{"id": "a", "block_size": 4, "requests": [{"t": 0, "type": "n", "in": 4, "hash_ids": -1}, '
    '{"t": 1, "type": "n", "in": 4, "hash_ids":[3]}]}',
    '{"id": "a", "block_size": 4, "requests": [{"t": 0, "type": "n", "in": 8, "hash_ids":[1, 2]}, '
    '{"t": 1, "type": "n", "in": 8, "hash_ids":[1,2]}]}',
    '{"id": "a", "block_size": 4, "requests": [{"t": 0, "type": "n", "in": 4, "note": "\\"hash_ids\\":[7]", "hash_ids":[9]}]}',
    '{"id": "a", "block_size": 4, "hash_id_scope": "global", "requests": [{"t": 0, "type": "n", "in": 8, '
    '"hash_ids":[9223372036854775807,99999999999999999999]}]}',
    '{"id": "a", "block_size": 4, "hash_id_scope": "global", "requests": [{"t": 0, "type": "n", "in": 4, '
    '"hash_ids":[9223372036854775808]}]}',
    '{"id": "a", "block_size": 4, "requests": [{"t": 0, "type": "x", "in": 4, "hash_ids":[1]}, '
    '{"t": 1, "type": "n", "in": 4, "hash_ids":[2]}]}',
    '{\n  "id": "a",\n  "block_size": 4,\n  "requests": [\n    {"t": 0, "type": "n", "in": 8, "hash_ids": [\n 1,\n 2\n ]}\n  ]\n}',
])
def test_fast_path_doubts_go_the_plain_way(tmp_path, text):
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.json").write_text(text)
    assert_fast_equals_plain(tmp_path, d)


def test_sizes_beyond_what_int64_sums_hold_are_malformed_not_negative_tokens(tmp_path, cli):
    d = tmp_path / "in"
    d.mkdir()
    write(d, "a.json", conv("a", [req(0, 2)]))
    huge = 1 << 62  # 2 blocks of 2^62 tokens: 2^63 prefill tokens, -2^63 in int64
    write(d, "b.json", {**conv("b", [{**req(1, 2), "in": 2 * huge}]), "block_size": huge})
    write(d, "c.json", conv("c", [{**req(2, 1), "in": (1 << 40) + 1, "hash_ids": [9]}], block_size=4))
    rep = import_weka(d, tmp_path / "t")
    assert rep.num_invocations == 1 and rep.num_malformed_files == 1
    assert rep.malformed_lines[0] == f"b.json: block_size {huge} is above 1048576, larger than any engine's block"
    assert any("field in is out of range (above 4294967296)" in m for m in rep.malformed_lines)
    r = cli(["headroom", d, "--json"])
    assert r.exit_code == 0, r.stdout
    got = json.loads(r.stdout)
    assert (got["block_size"], got["num_requests"], got["num_prompt_tokens"]) == (4, 1, 8)
