"""One-pass hit-ratio curves against the per-capacity replays, at every capacity."""

from __future__ import annotations

import numpy as np
import pytest

from kmesh_trace.oracle.curves import belady_curve, lru_curve
from kmesh_trace.oracle.policies import POLICIES, Workload
from kmesh_trace.oracle.prefill_cost import PrefillCost
from kmesh_trace.oracle.stream import requests_from_rows


def _random_requests(rng, bs, vocab, n_max=8, p_max=12):
    rows = []
    for i in range(int(rng.integers(1, n_max))):
        p, o = int(rng.integers(1, p_max)), int(rng.integers(0, 5))
        rows.append({"request_id": str(i), "num_prompt_tokens": p, "num_output_tokens": o,
                     "prompt_token_ids": rng.integers(0, vocab, p).tolist(),
                     "output_token_ids": rng.integers(0, vocab, o).tolist()})
    return requests_from_rows(rows, bs)


@pytest.mark.parametrize("policy,curve", [("lru", lru_curve), ("belady", belady_curve)])
def test_curve_equals_the_replay_at_every_capacity(policy, curve):
    rng = np.random.default_rng(17)
    cost = PrefillCost(1e-3, 1e-5, 2e-3)
    checked = 0
    for _ in range(400):
        w = Workload(2, _random_requests(rng, 2, int(rng.integers(2, 4))))
        s = w.stream
        start = int(rng.integers(0, s.num_requests))
        full, window = curve(s, 0), curve(s, start)
        caps = np.arange(0, s.num_objects + 3)
        for c, got, got_w, saved in zip(caps, full.hit_blocks(caps), window.hit_blocks(caps),
                                        window.saved_seconds(caps, cost)):
            res = POLICIES[policy].simulate(w, int(c))
            per_req = res.hit_blocks_per_request
            assert got == res.hit_blocks, (policy, c)
            assert got_w == per_req[start:].sum(), (policy, c, start)
            want = sum(cost.seconds(0, p) - cost.seconds(h * 2, p)
                       for h, p in zip(per_req[start:].tolist(), res.num_prompt_tokens[start:].tolist()))
            assert saved == pytest.approx(want, abs=1e-12)
            checked += got > 0
        assert full.num_reads == int(s.num_reads.sum())
    assert checked > 1000
