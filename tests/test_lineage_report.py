"""`lineage`: exact figures on a small import, a Bailian import against a plain count, a real engine capture, the CLI."""

import json

import numpy as np
import pytest

from kmesh_trace import open_trace
from bailian_data import generate_bailian
from kmesh_trace.datasets.importers.bailian import import_bailian
from kmesh_trace.datasets.importers.weka import import_weka
from kmesh_trace.oracle.lineage_report import lineage_report


def _weka_trace(tmp_path):
    def req(t, ids, api=1.0):
        return {"t": t, "type": "n", "in": len(ids) * 4, "out": 2, "hash_ids": ids, "api_time": api}

    d = tmp_path / "in"
    d.mkdir()
    (d / "a.json").write_text(json.dumps({"id": "a", "block_size": 4, "hash_id_scope": "local", "requests": [
        req(0, [1, 2]),
        {"t": 5, "type": "subagent", "agent_id": "ag1", "subagent_type": "Explore",
         "requests": [req(0, [100]), req(2, [100, 101])]},
        req(5, [1, 2, 3]),
        {"t": 1, "type": "subagent", "agent_id": "ag0", "requests": [req(0, [200])]},
        req(20, [1, 2, 3, 4]),
    ]}))
    (d / "b.json").write_text(json.dumps({"id": "b", "block_size": 4, "requests": [req(0, [1])]}))
    import_weka(d, tmp_path / "t", arrival="as-recorded")
    return tmp_path / "t"


def test_exact_figures_on_a_small_import(tmp_path):
    rep = lineage_report(open_trace(_weka_trace(tmp_path)))
    assert (rep.edge_kind, rep.num_requests, rep.num_families, rep.num_singletons, rep.num_edges, rep.num_parents) == (
        "declared", 7, 2, 0, 5, 3)
    assert sorted(rep.fan_out_values.tolist()) == [1, 1, 3]
    # m0 finishes at 1 s: ag0/0 (1 s) gap 0, ag1/0 and m1 (5 s) gap 4; ag1/0 ends 6, ag1/1 at 7: 1; m1 ends 6, m2 at 20: 14.
    assert sorted(rep.gap_values.tolist()) == [0.0, 1.0, 4.0, 4.0, 14.0]
    # Shared full blocks with the parent: m1 2 of m0's, m2 3 of m1's, ag1/1 1 of ag1/0's, sub-agents' first requests none.
    assert sorted(rep.shared_values.tolist()) == [0, 0, 1, 2, 3]
    fams = {f.family: f for f in rep.families}
    a = fams["a"]
    assert (a.num_requests, a.num_edges, a.num_roots, a.max_fan_out, a.depth, a.num_agents) == (6, 5, 1, 3, 2, 2)
    assert a.gap_s_p50 == 4.0 and a.shared_blocks_p50 == 1.0
    assert (fams["b"].num_requests, fams["b"].num_edges, fams["b"].depth) == (1, 0, 0)
    d = rep.to_dict()
    assert d["depth"]["max"] == 2 and d["fan_out"]["max"] == 3 and d["num_negative_gaps"] == 0
    assert d["shared_fraction"]["max"] == 0.75  # m2 repeats 3 of its 4 blocks
    json.dumps(d)  # plain data only


def test_bailian_import_against_a_plain_count(tmp_path):
    generate_bailian(tmp_path / "g.jsonl", num_sessions=30, max_turns=5, seed=3)
    import_bailian(tmp_path / "g.jsonl", tmp_path / "t")
    rep = lineage_report(open_trace(tmp_path / "t"))
    recs = [json.loads(line) for line in (tmp_path / "g.jsonl").read_text().splitlines()]
    by_id = {r["chat_id"]: r for r in recs}
    children = [r for r in recs if r["parent_chat_id"] != -1]
    assert rep.num_edges == len(children)
    assert rep.num_families == sum(r["parent_chat_id"] == -1 for r in recs)
    plain = []
    for c in children:
        p = by_id[c["parent_chat_id"]]
        n = 0  # chained hashes: equal prefixes of block ids, over full blocks only
        full_c, full_p = c["input_length"] // 16, p["input_length"] // 16
        while n < min(full_c, full_p) and c["hash_ids"][n] == p["hash_ids"][n]:
            n += 1
        plain.append(n)
    assert sorted(rep.shared_values.tolist()) == sorted(plain)
    turns = {}
    for r in recs:
        turns[r["chat_id"]] = 0 if r["parent_chat_id"] == -1 else turns[r["parent_chat_id"]] + 1
    assert int(rep.depth_values.max()) == max(turns.values())
    assert rep.gap_s.count == 0 and any("no finish times" in n for n in rep.notes)


def test_cli(tmp_path, cli):
    trace = _weka_trace(tmp_path)
    r = cli(["lineage", trace, "--json", "--out", tmp_path / "l.json", "--plot", tmp_path / "l.png"])
    assert r.exit_code == 0 and r.stdout == "", r.stderr  # --out: the file, nothing on stdout
    d = json.loads((tmp_path / "l.json").read_text())
    assert (d["num_families"], d["num_edges"], d["edge_kinds"]) == (2, 5, {"declared": 5})
    assert (tmp_path / "l.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = cli(["lineage", trace])
    assert r.exit_code == 0 and "children per parent" in r.stdout and "families (largest first)" in r.stdout
    r = cli(["lineage", trace, "--edges", "content"])
    assert r.exit_code == 1 and r.stderr == "Error: the trace has no content edges (it has: declared).\n"
    r = cli(["lineage", trace, "--plot", tmp_path / "l.gif"])
    assert r.exit_code == 1 and r.stderr.startswith("Error: cannot plot to l.gif")


# ---- a real engine capture ---------------------------------------------------------------------

@pytest.mark.engine
def test_capture_of_a_real_engine(family_capture):
    from tiny_llm import BLOCK

    trace, outs = family_capture
    t = open_trace(trace)
    rep = lineage_report(t)
    anc = outs[0]
    shared = (len(anc.prompt_token_ids) + len(anc.outputs[0].token_ids)) // BLOCK
    assert rep.edge_kind == "declared" and rep.num_edges == 4
    assert rep.fan_out_values.tolist() == [4] and int(rep.depth_values.max()) == 1
    assert rep.shared_values.tolist() == [shared] * 4
    assert (rep.gap_values >= 0).all() and rep.gap_s.count == 4
    fam = next(f for f in rep.families if f.family == "fam")
    assert (fam.num_requests, fam.num_edges, fam.num_roots, fam.max_fan_out) == (5, 4, 1, 4)
    assert rep.num_singletons == len(outs) - 5
    # The same children through the inferred exact-prefix edges.
    inferred = lineage_report(t, edge_kind="exact_prefix")
    assert inferred.num_edges == 4 and inferred.shared_values.tolist() == [shared] * 4
    assert np.array_equal(np.sort(inferred.gap_values), np.sort(rep.gap_values))
