"""One-pass hit-ratio curves against the per-capacity replays, at every capacity."""

from __future__ import annotations

import numpy as np
import pytest

from kmesh_trace.oracle.curves import HitCurve, belady_curve, lru_curve
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


# ---- the one-pass `belady` curve against the priority stack itself (tests/belady_stack.py) --------------

from belady_stack import stack_belady_curve  # noqa: E402

from kmesh_trace.oracle.stream import NEVER, AccessStream  # noqa: E402

SHAPES = {  # (distinct objects per access, share of writes, longest request)
    "small-vocabulary": (0.02, 0.1, 6),
    "deep": (0.3, 0.0, 40),
    "never-heavy": (0.8, 0.05, 12),  # most objects are never reused
    "write-heavy": (0.2, 0.7, 12),  # most next accesses are writes: NEVER next uses
    "mixed": (0.1, 0.3, 25),
}


def _random_stream(rng, n, shape):
    distinct, writes, longest = SHAPES[shape]
    ids = rng.integers(0, max(1, int(n * distinct)), n).astype(np.uint64)
    if shape == "deep":  # cyclic sweeps over a large working set, with noise
        ids = (np.arange(n) % max(1, int(n * distinct))).astype(np.uint64) ^ (rng.random(n) < 0.1)
    eligible = rng.random(n) >= writes
    cuts = np.cumsum(rng.integers(1, longest + 1, n))
    req_start = np.concatenate([[0], cuts[cuts < n], [n]]).astype(np.int64)
    per = np.diff(req_start)
    return AccessStream.from_arrays(16, ids, eligible, req_start, per * 16 + 1, per)


def _same_curve(got, want):
    top = max(got.max_level, want.max_level) + 1
    pad = lambda a: np.pad(a, (0, max(0, top - len(a))))[:top]  # noqa: E731
    assert np.array_equal(pad(got.count), pad(want.count))
    assert np.array_equal(pad(got.position_sum), pad(want.position_sum))
    assert (got.num_reads, got.num_prompt_tokens) == (want.num_reads, want.num_prompt_tokens)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_belady_curve_equals_the_priority_stack_on_random_streams(shape):
    rng = np.random.default_rng(sum(map(ord, shape)))
    deepest = 0
    for seed in range(300):
        n = int(rng.integers(1, 400 if seed % 10 else 5000))
        s = _random_stream(rng, n, shape)
        start = int(rng.integers(0, s.num_requests))
        for measure_from in (0, start):
            want = stack_belady_curve(s, measure_from)
            _same_curve(belady_curve(s, measure_from), want)
            # The kernel's trees (time window, tracked capacities) started as small as they go: they move and
            # grow all the time, which changes nothing.
            _same_curve(belady_curve(s, measure_from, first_blocks=1, first_capacities=1), want)
        deepest = max(deepest, want.max_level)
    assert deepest > 10  # the streams reach deep levels


def test_belady_kernel_window_moves_and_the_capacity_tree_grows():
    """On a stream whose reuses stay near (a cyclic sweep, fresh ids per pass), the time window moves on
    instead of growing with the stream; the tracked capacities double up to the deepest level; the curve
    is the stack's whatever the first sizes."""
    from kmesh_trace.oracle.curves import _belady_levels

    ring, passes = 600, 40
    ids = np.concatenate([np.tile(np.arange(ring), 3) + k * ring for k in range(passes)]).astype(np.uint64)
    n = len(ids)
    per = np.full(n // 6, 6)
    s = AccessStream.from_arrays(16, ids, np.ones(n, bool), np.concatenate([[0], np.cumsum(per)]), per * 16 + 1, per)
    want = stack_belady_curve(s)
    assert want.max_level >= ring
    for blocks, caps in ((1, 1), (16, 4), (1 << 10, 1 << 12), (1 << 15, 1 << 20)):
        count, possum, window, tracked = _belady_levels(s.obj, s.eligible, s.next_use, s.req_start, s.num_objects, 0,
                                                        NEVER, blocks, caps)
        got = HitCurve("belady", 16, count, possum, want.num_reads, want.num_prompt_tokens)
        _same_curve(got, want)
        assert want.max_level < tracked <= max(2 * want.max_level + 2, caps), (blocks, caps, tracked)
        # The live reuses span at most two passes (3,600 accesses): a window of 4 x that at most, not the stream.
        if blocks * 8 < n:
            assert window <= max(blocks * 8, 4 * 2 * 3 * ring) < n, (blocks, window)


@pytest.mark.parametrize("name", ["conversation_trace.jsonl", "synthetic_trace.jsonl"])
def test_belady_curve_equals_the_priority_stack_on_mooncake(shared_datasets, tmp_path, name):
    from kmesh_trace.datasets.importers.mooncake import import_mooncake
    from kmesh_trace.oracle.stream import next_uses
    from kmesh_trace.oracle.workload import Workload
    from kmesh_trace.trace import open_trace

    path = shared_datasets / "mooncake" / name
    if not path.is_file():
        pytest.skip(f"{path} not found (the Mooncake traces of the public datasets)")
    import_mooncake(path, tmp_path / "trace")
    s = Workload.from_trace(open_trace(tmp_path / "trace"), requests=False).stream
    for measure_from in (0, s.num_requests // 2):
        _same_curve(belady_curve(s, measure_from), stack_belady_curve(s, measure_from))
    # Then again with the same ids, as far as 150,000 more accesses: the second pass reuses the whole working
    # set (the deepest stack; the stack's own cost grows with its depth).
    r = min(int(np.searchsorted(s.req_start, 150_000)), s.num_requests)
    m = int(s.req_start[r])
    obj, eligible = np.concatenate([s.obj, s.obj[:m]]), np.concatenate([s.eligible, s.eligible[:m]])
    starts = np.concatenate([s.req_start, s.req_start[1:r + 1] + len(s)])
    again = AccessStream(512, obj, eligible, next_uses(obj, eligible), starts,
                         np.concatenate([s.num_prompt_tokens, s.num_prompt_tokens[:r]]),
                         np.concatenate([s.num_reads, s.num_reads[:r]]), s.num_objects)
    got = belady_curve(again, s.num_requests)
    _same_curve(got, stack_belady_curve(again, s.num_requests))
    assert got.max_level > s.num_objects // 2


# ---- the lru curve's window of touch times (native/kernels/lru_curve_body.h) ------------------------------


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_lru_curve_window_moves_and_changes_nothing(shape):
    """Started at one slot, the lru kernel's window moves on and doubles all the time; the curve stays the
    per-capacity replays' (on streams this short the default window never moves)."""
    from kmesh_trace.oracle.curves import _lru_levels
    from kmesh_trace.oracle.policies.lru import lru_hits

    rng = np.random.default_rng(7 + sum(map(ord, shape)))
    for seed in range(150):
        n = int(rng.integers(1, 400 if seed % 10 else 3000))
        s = _random_stream(rng, n, shape)
        start = int(rng.integers(0, s.num_requests))
        for measure_from in (0, start):
            want = lru_curve(s, measure_from)
            for first in (1, 2, 5, 64):
                _same_curve(lru_curve(s, measure_from, first_window=first), want)
        caps = sorted({1, 2, 3, 7, want.max_level, want.max_level + 1} - {0})
        got = lru_curve(s, start, first_window=1).hit_blocks(caps)
        assert got.tolist() == [int(lru_hits(s, c)[0][start:].sum()) for c in caps]
    # On a cyclic sweep with fresh ids per pass the reuses stay near: the window stays near their span.
    ring, passes = 600, 40
    ids = np.concatenate([np.tile(np.arange(ring), 3) + k * ring for k in range(passes)]).astype(np.uint64)
    per = np.full(len(ids) // 6, 6)
    s = AccessStream.from_arrays(16, ids, np.ones(len(ids), bool), np.concatenate([[0], np.cumsum(per)]), per * 16 + 1,
                                 per)
    count, possum, window = _lru_levels(s, 0, 1)
    _same_curve(HitCurve("lru", 16, count, possum, int(s.num_reads.sum()), int(s.num_prompt_tokens.sum())),
                lru_curve(s, 0, first_window=1 << 20))
    assert window <= 4 * 3 * ring < len(s), window


def test_the_64_bit_kernels_equal_the_32_bit_ones():
    """The C kernels are built per id width (native/kernels/by_width.h): a stream whose ids are int64 (the
    64-bit build, taken from 2^30 accesses on) gives what its int32 twin gives."""
    import dataclasses

    from kmesh_trace.oracle.policies.belady import belady_hits
    from kmesh_trace.oracle.policies.belady_prefix import belady_prefix_hits
    from kmesh_trace.oracle.policies.lru import lru_hits

    rng = np.random.default_rng(64)
    for shape in sorted(SHAPES):
        s = _random_stream(rng, 2000, shape)
        wide = dataclasses.replace(s, obj=s.obj.astype(np.int64))
        _same_curve(lru_curve(wide, 3, first_window=4), lru_curve(s, 3))
        for c in (1, 5, 40, s.num_objects):
            for replay in (lru_hits, belady_hits, belady_prefix_hits):
                h32, e32 = replay(s, c)
                h64, e64 = replay(wide, c)
                assert np.array_equal(h32, h64) and e32 == e64, (shape, c, replay.__name__)
