"""The built-in agent workload of `kmesh-trace demo`: request families interleaved with competitors.

A family is an ancestor request (a long document prompt) followed by 2 to 8 children whose
prompts are the ancestor's exact prompt + generated output + a private tail, so each child can
reuse the ancestor's KV only while it stays resident. Some families release their children right
after the parent finishes, others after a delay (in engine steps) during which unrelated
competing requests push on the KV pool. Children's prompts depend on the parent's output, which
is only known once it ran: the plan says what to send and when, and the driver
(`kmesh_trace.apps.tiny_engine.run_workload`) fills the prompts in as parents finish.

Token ids are drawn from a seeded generator, so a plan is reproducible; two random 32-token
blocks never coincide in practice, so prefixes are shared only where the plan says they are.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kmesh_trace.oracle.stream import requests_from_rows
from kmesh_trace.oracle.workload import Workload


@dataclass(frozen=True)
class PlannedRequest:
    name: str  # the caller's request id
    max_tokens: int
    prompt: tuple[int, ...] = ()  # whole prompt of a root or competitor; for a child, its private tail
    family: str | None = None
    parent: str | None = None  # caller id of the parent; the child's prompt = parent prompt + output + `prompt`
    num_children: int | None = None  # declared on parents
    release_step: int = 0  # roots and competitors: engine step at which the request is sent
    delay_steps: int = 0  # children: steps after the parent finished


@dataclass
class AgentWorkload:
    block_size: int
    num_gpu_blocks: int  # physical KV blocks of the engine (including vLLM's null block)
    max_model_len: int
    requests: list[PlannedRequest] = field(default_factory=list)

    @property
    def families(self) -> list[str]:
        return sorted({r.family for r in self.requests if r.family})


VOCAB_SIZE = 1024


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1, VOCAB_SIZE) for _ in range(n))


def agent_workload(*, size: str = "full", seed: int = 7) -> AgentWorkload:
    """The demo's workload. `size="small"` is the reduced version the test suite runs."""
    rng = random.Random(seed)
    small = size == "small"
    block_size = 32
    if small:
        fanouts, delays = [2, 4], [0, 6]
        ancestor_blocks, num_competitors = (6, 10), 6
    else:
        fanouts, delays = [2, 3, 4, 5, 6, 8], [0, 8, 0, 16, 4, 24]
        ancestor_blocks, num_competitors = (8, 20), 24
    w = AgentWorkload(block_size=block_size, num_gpu_blocks=49 if small else 97, max_model_len=1024)
    step = 0
    for f, (fanout, delay) in enumerate(zip(fanouts, delays)):
        fam = f"fam{f}"
        n_anc = rng.randint(*ancestor_blocks) * block_size + rng.randint(0, block_size - 1)
        w.requests.append(PlannedRequest(
            name=f"{fam}-parent", max_tokens=rng.randint(8, 16), prompt=_tokens(rng, n_anc),
            family=fam, num_children=fanout, release_step=step))
        for c in range(fanout):
            w.requests.append(PlannedRequest(
                name=f"{fam}-child{c}", max_tokens=rng.randint(4, 12), prompt=_tokens(rng, rng.randint(16, 96)),
                family=fam, parent=f"{fam}-parent", delay_steps=delay + c))
        step += rng.randint(6, 14)
    # Competitors: most start with one of a few shared system prompts (their own reuse, which a
    # family hold can displace), the rest are unique.
    system_prompts = [_tokens(rng, rng.randint(3, 8) * block_size) for _ in range(2 if small else 3)]
    for k in range(num_competitors):
        tail = _tokens(rng, rng.randint(2, 8) * block_size + rng.randint(0, block_size - 1))
        prefix = rng.choice(system_prompts) if rng.random() < 0.7 else ()
        w.requests.append(PlannedRequest(name=f"other{k}", max_tokens=rng.randint(4, 12),
                                         prompt=prefix + tail, release_step=rng.randint(0, step + 40)))
    w.requests.sort(key=lambda r: (r.parent is not None, r.release_step, r.name))
    return w


def request_rows(plan: AgentWorkload, seed: int = 0) -> list[dict]:
    """The plan as invocation rows (contract column names) without running an engine: each parent's
    output is a placeholder of `max_tokens` seeded tokens, and requests are ordered by the step the
    driver would send them at if every request ran alone (a parent finishes `max_tokens` steps after
    it was sent). Without times, an analysis replays them one after another."""
    rng = random.Random(seed)
    by_name = {r.name: r for r in plan.requests}
    sent: dict[str, int] = {}

    def send_step(r: PlannedRequest) -> int:
        if r.name not in sent:
            if r.parent is None:
                sent[r.name] = r.release_step
            else:
                p = by_name[r.parent]
                sent[r.name] = send_step(p) + p.max_tokens + 1 + r.delay_steps
        return sent[r.name]

    outputs = {r.name: list(_tokens(rng, r.max_tokens)) for r in plan.requests}
    rows = []
    for r in sorted(plan.requests, key=lambda r: (send_step(r), r.name)):
        prompt = list(r.prompt)
        if r.parent is not None:
            parent = by_name[r.parent]
            prompt = list(parent.prompt) + outputs[r.parent] + prompt
        rows.append({"request_id": r.name, "seq": len(rows), "family_id": r.family, "parent_id": r.parent,
                     "num_expected_children": r.num_children, "num_prompt_tokens": len(prompt),
                     "num_output_tokens": r.max_tokens, "prompt_token_ids": prompt,
                     "output_token_ids": outputs[r.name]})
    return rows


def _built(size: str):
    plan = agent_workload(size=size)
    return Workload(plan.block_size, requests_from_rows(request_rows(plan), plan.block_size),
                    num_usable_blocks=plan.num_gpu_blocks - 1,
                    notes=["the agent plan without an engine: parents' outputs are placeholders and requests run "
                           "one after another; `kmesh-trace demo` captures the real run"])


def full():
    """Registry builder: `agent`."""
    return _built("full")


def small():
    """Registry builder: `agent-small`."""
    return _built("small")
