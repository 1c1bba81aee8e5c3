"""The live family hold controller (capture/hold.py) on a real vLLM engine, against the what-if.

hold-stress with every size doubled (32-token blocks, 129 physical blocks, sequential requests, the
child's prompt carrying the parent's real output) runs twice in one process (this file is its script,
started in the background when the collection ends), each arm captured: stock, and held
(`KMESH_HOLD=1`). The what-if computed from the stock capture alone
(`kmesh_trace.oracle.pressure.what_if_trace`) must predict the hit tokens each request measured in
both arms; in the held arm the controller's references show up as held/released block events, and
at the end every block is back in the free queue with no reference left.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

import background  # tests/ is on sys.path
from requires import skip_module_without

pytestmark = pytest.mark.engine

BLOCK = 32


def _run_arm(tmp, *, hold: bool, monkeypatch) -> dict:
    from kmesh_trace.capture.session import capture_in_process
    from kmesh_trace.datasets.workloads.hold_stress import NUM_PHYSICAL_BLOCKS, hold_stress
    from vllm import SamplingParams, TokensPrompt

    from kmesh_trace.apps.tiny_engine import make_engine, write_tiny_model

    if hold:
        monkeypatch.setenv("KMESH_HOLD", "1")
    else:
        monkeypatch.delenv("KMESH_HOLD", raising=False)
    sc = hold_stress(scale=2)
    measured, out = [], {}
    with capture_in_process(tmp / "trace") as session:
        llm = make_engine(write_tiny_model(tmp / "model"), block_size=BLOCK, num_gpu_blocks=NUM_PHYSICAL_BLOCKS,
                          max_model_len=2048)
        engine = llm.llm_engine
        parent_output: list[int] = []
        for i, q in enumerate(sc.requests):
            prompt = q.prompt_token_ids
            extra = {}
            if q.num_expected_children:
                extra = {"kmesh_family": q.family_id, "kmesh_children": q.num_expected_children}
            if q.parent_index is not None:  # the child extends the parent's real output
                prompt = sc.requests[0].prompt_token_ids + parent_output + prompt[len(prompt) - 128:]
                extra = {"kmesh_family": q.family_id, "kmesh_parent": sc.requests[q.parent_index].request_id}
            engine.add_request(q.request_id, TokensPrompt(prompt_token_ids=prompt),
                               SamplingParams(max_tokens=q.num_output_tokens, temperature=0.0, ignore_eos=True,
                                              detokenize=False, extra_args=extra or None))
            done = None
            while done is None:
                done = next((o for o in engine.step() if o.finished), None)
            if i == 0:
                parent_output = list(done.outputs[0].token_ids)
            measured.append(done.num_cached_tokens or 0)
        scheduler = engine.engine_core.engine_core.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        out["free_blocks"] = pool.get_num_free_blocks()
        out["ref_cnts"] = {b.ref_cnt for b in pool.blocks[1:]}
        controller = getattr(scheduler, "_kmesh_hold", None)
        out["holds"] = list(controller.records) if controller else None
        out["active_holds"] = len(controller.active) if controller else 0
        engine.engine_core.shutdown()
    assert len(session.engine_ids) == 1
    out["measured"] = measured
    out["trace"] = tmp / "trace"
    return out


def _run_arms(out: Path) -> None:
    """Both arms, in a process of their own (this file is its script: `python THIS_FILE OUT`), pickled to
    OUT/arms.pkl."""
    mp = pytest.MonkeyPatch()
    try:
        (out / "stock").mkdir()
        stock = _run_arm(out / "stock", hold=False, monkeypatch=mp)
        (out / "held").mkdir()
        held = _run_arm(out / "held", hold=True, monkeypatch=mp)
    finally:
        mp.undo()
    (out / "arms.pkl").write_bytes(pickle.dumps((stock, held)))


# Started in the background when the collection ends (tests/background.py): it runs beside the tests before it.
ARMS = background.job(__name__, "arms", lambda out: [sys.executable, __file__, out])


@pytest.fixture(scope="module")
def arms():
    skip_module_without("vllm")
    out, proc = background.finished(ARMS)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return pickle.loads((out / "arms.pkl").read_bytes())


def test_measured_hits_equal_the_what_if_from_the_stock_capture(arms):
    from kmesh_trace.oracle.pressure import what_if_trace

    stock, held = arms
    pred = what_if_trace(stock["trace"])  # declared lineage from the capture
    assert stock["measured"] == pred.stock.hit_tokens == [0, 0, 0, 0, 0, 992, 992, 992, 992, 96]
    assert held["measured"] == pred.held.hit_tokens == [0, 0, 0, 0, 0, 64, 64, 64, 64, 1024]
    # The captures agree with what the engine returned, request by request, and so do evictions.
    for arm, res in ((stock, pred.stock), (held, pred.held)):
        from kmesh_trace.trace import open_trace

        t = open_trace(arm["trace"])
        inv = t.frame("invocations").sort("seq")
        assert inv["num_cached_tokens"].to_list() == arm["measured"]
        ev = t.sql("SELECT request_id, count(*) AS n FROM block_events WHERE event = 'evicted' GROUP BY 1")
        n = dict(zip(ev["request_id"], ev["n"]))
        assert [n.get(r, 0) for r in inv["request_id"]] == res.num_evictions


def test_the_controller_held_the_parent_until_the_child_was_admitted(arms):
    _, held = arms
    (rec,) = held["holds"]
    assert (rec.parent_request_id.split("-")[0], rec.caller_id, rec.family, rec.status, rec.num_blocks,
            rec.num_children_served, rec.release_reason) == ("parent", "parent", "hold-stress", "taken", 32, 1, "children")
    assert rec.taken_ns < rec.released_ns and held["active_holds"] == 0
    from kmesh_trace.trace import open_trace

    hold_cfg = {"max_held_blocks": None, "max_families": None, "expiry_s": None}
    assert open_trace(held["trace"]).metadata["capture_config"]["hold"] == hold_cfg
    assert "hold" not in open_trace(arms[0]["trace"]).metadata["capture_config"]


def test_all_blocks_return_and_all_references_drain(arms):
    from kmesh_trace.trace import open_trace

    for arm in arms:
        assert arm["free_blocks"] == 128 and arm["ref_cnts"] == {0}
    stock, held = arms
    t = open_trace(held["trace"])
    ev = t.frame("block_events").sort("seq")
    parent = t.frame("invocations").sort("seq")["request_id"][0]
    for kind in ("held", "released"):
        rows = ev.filter(ev["event"] == kind)
        assert rows.height == 32 and set(rows["request_id"]) == {parent}
    ref: dict[int, int] = {}
    for e in ev.iter_rows(named=True):
        b, kind = e["block_id"], e["event"]
        if kind in ("allocated",):
            ref[b] = 1
        elif kind in ("touched", "held"):
            ref[b] += 1
        elif kind in ("freed", "released"):
            ref[b] -= 1
        assert ref.get(b, 0) == e["ref_cnt"] >= 0
    assert set(ref.values()) == {0} and ev["num_free_blocks"][-1] == 128
    # Held blocks are the parent's 32 full blocks, released tail first.
    held_ids = ev.filter(ev["event"] == "held")["block_id"].to_list()
    assert ev.filter(ev["event"] == "released")["block_id"].to_list() == held_ids[::-1]
    stock_kinds = set(open_trace(stock["trace"]).frame("block_events")["event"])
    assert stock_kinds == {"allocated", "touched", "cached", "freed", "evicted"}  # no controller, no holds


if __name__ == "__main__":
    _run_arms(Path(sys.argv[1]))
