"""Test support: random family workloads (hold_stress Scenarios) for the model-against-vLLM tests."""

from __future__ import annotations

import random

from kmesh_trace.datasets.workloads.hold_stress import Scenario, ScenarioRequest


def random_family_workload(rng: random.Random, timed: bool = False) -> Scenario:
    """Families (parent; children = parent prompt + output + tail), exact repeats, shared system prompts,
    block-aligned and unaligned lengths, at a capacity between one request and a few."""
    bs = rng.choice([4, 8, 16])

    def toks(n):
        return [rng.randrange(1, 30000) for _ in range(n)]

    def length(lo, hi):
        n = rng.randrange(lo, hi) * bs
        return n if rng.random() < 0.3 else n + rng.randrange(1, bs)

    systems = [toks(length(1, 4)) for _ in range(2)]
    reqs: list[ScenarioRequest] = []
    for _ in range(rng.randrange(4, 16)):
        kind = rng.random()
        G = rng.randrange(1, 3 * bs)
        parents = [i for i, q in enumerate(reqs) if q.family_id is not None and q.parent_index is None]
        if kind < 0.3 or not parents:
            prefix = rng.choice(systems) if rng.random() < 0.5 else []
            reqs.append(ScenarioRequest(f"p{len(reqs)}", prefix + toks(length(1, 8)), G, toks(G),
                                        f"f{len(reqs)}", None, rng.choice([None, 1, 2, 3])))
        elif kind < 0.65:
            p = rng.choice(parents)
            q = reqs[p]
            reqs.append(ScenarioRequest(f"c{len(reqs)}", q.prompt_token_ids + q.output_token_ids + toks(length(0, 4) + 1),
                                        G, toks(G), q.family_id, p, None))
        elif kind < 0.8 and reqs:
            q = rng.choice(reqs)
            reqs.append(ScenarioRequest(f"r{len(reqs)}", list(q.prompt_token_ids), G, toks(G)))
        else:
            prefix = rng.choice(systems) if rng.random() < 0.5 else []
            reqs.append(ScenarioRequest(f"u{len(reqs)}", prefix + toks(length(1, 8)), G, toks(G)))
    if timed:
        t = 0
        timed_reqs = []
        for q in reqs:
            t += rng.randrange(0, 50)
            timed_reqs.append(ScenarioRequest(q.request_id, q.prompt_token_ids, q.num_output_tokens, q.output_token_ids,
                                              q.family_id, q.parent_index, q.num_expected_children,
                                              t, t + rng.randrange(0, 120)))
        reqs = timed_reqs
    biggest = max(-(-(len(q.prompt_token_ids) + q.num_output_tokens - 1) // bs) for q in reqs)
    capacity = rng.randrange(max(biggest - 3, 1), 3 * biggest)  # sometimes too small for the biggest
    return Scenario("random", bs, capacity + 1, reqs)
