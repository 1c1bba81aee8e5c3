"""The compiled tier replay (`kmesh_trace.oracle.tiers.compiled`) against the Python one (`TierReplay`, the
reference): random workloads (duplicate hashes, partial and short hash lists, generated blocks, stalls,
deferrals, families) through random configurations (no, one or two lower tiers, on-evict and write-through,
retain and read-once, chunks, lookup any and gpu-prefix, restore costs on some, all or no tiers, kv bytes or
none, singleflight, early preparation with and without a lead, preloads), timed and sequential; every TierResult field must be equal. (`simulate_tiers`
runs the compiled replay for these configurations, so tests/test_tiers*.py run it too.)"""

from __future__ import annotations

import numpy as np
import pytest

from kmesh_trace.oracle.stream import RequestBlocks
from kmesh_trace.oracle.tiers import RestoreCost, TierConfig, TierSpec, simple_cpu, simulate_tiers
from kmesh_trace.oracle.tiers import simulate
from kmesh_trace.oracle.tiers.replay import TierReplay

POOL_FIELDS = ("hit_blocks", "hit_tokens", "num_evictions", "admitted", "stalled", "free_queue", "num_deferred")
FIELDS = ("num_chunk_reads", "read_bytes", "distinct_blocks_needed", "num_shared_reads", "num_stores", "notes",
          "block_size", "kv_bytes_per_token", "config")


def _workload(rng, timed):
    bs, vocab = int(rng.integers(1, 5)), int(rng.integers(2, 12))
    reqs, t = [], 0
    for i in range(int(rng.integers(1, 16))):
        p, g = int(rng.integers(0, 24)), int(rng.integers(0, 6))
        n_hashes = p // bs + (1 if p % bs and rng.random() < 0.5 else 0)  # a partial last hash, sometimes
        n_hashes = max(0, n_hashes - (1 if rng.random() < 0.1 else 0))  # a list shorter than the prompt
        prompt = [int(x) for x in rng.integers(0, vocab, n_hashes)]
        if i and rng.random() < 0.5:  # share a prefix with an earlier request
            prev = reqs[int(rng.integers(0, i))].prompt_hashes
            k = min(len(prev), len(prompt))
            prompt[:k] = prev[:k]
        output = [int(x) for x in rng.integers(0, vocab, int(rng.integers(0, 3)))] if rng.random() < 0.5 else []
        t += int(rng.integers(0, 4)) * 1_000_000
        parent = int(rng.integers(0, i)) if i and rng.random() < 0.3 else None
        reqs.append(RequestBlocks(i, f"r{i}", p, g, prompt, output, t if timed else None,
                                  t + int(rng.integers(0, 8)) * 1_000_000 if timed else None, parent_index=parent))
    return reqs, bs, vocab


def _config(rng, vocab):
    tiers = []
    for name in ("host", "ssd"):
        if rng.random() < 0.6:
            write = "on-evict" if rng.random() < 0.5 else "write-through"
            chunk = 1 if write == "on-evict" else int(rng.integers(1, 4))
            tiers.append(TierSpec(name, int(rng.integers(0, 10)) * chunk, chunk, write, bool(rng.random() < 0.7)))
    config = TierConfig(int(rng.integers(1, 15)), tuple(tiers), singleflight=bool(rng.random() < 0.5),
                        early_prep=bool(rng.random() < 0.3), prep_lead_s=rng.choice([None, 0.0, 0.002]),
                        lookup="any" if rng.random() < 0.5 else "gpu-prefix")
    costs = {t.name: RestoreCost(float(rng.choice([0.001, 0.004, 0.5])), float(rng.choice([0.0, 1e-3, 3.3e-4])),
                                 float(rng.choice([0.0005, 0.002])) if rng.random() < 0.5 else None)
             for t in tiers if rng.random() < 0.8}
    preload = {t.name: [int(x) for x in rng.integers(0, vocab + 3, int(rng.integers(0, 6)))]
               for t in tiers if rng.random() < 0.3}
    kvbpt = int(rng.choice([1000, 250])) if rng.random() < 0.8 else None
    return config, costs, preload, kvbpt


def assert_same(got, want, context):
    for f in POOL_FIELDS:
        assert getattr(got.pool, f) == getattr(want.pool, f), (f, context)
    for f in FIELDS:
        assert getattr(got, f) == getattr(want, f), (f, context)
    assert list(got.hit_blocks_by_tier) == list(want.hit_blocks_by_tier), context
    for k, v in want.hit_blocks_by_tier.items():
        assert got.hit_blocks_by_tier[k].tolist() == v.tolist(), (k, context)
    for f in ("restore_wait_s", "restore_wait_p95_s", "stores_per_request", "is_child"):
        a, b = getattr(got, f), getattr(want, f)
        assert (a is None) == (b is None) and (a is None or a.tolist() == b.tolist()), (f, context)
    assert [(r.request_index, r.tier, r.num_chunks, r.num_bytes, r.prepare) for r in got.reads] == \
        [(r.request_index, r.tier, r.num_chunks, r.num_bytes, r.prepare) for r in want.reads], context
    assert got.to_dict() == want.to_dict(), context


@pytest.mark.parametrize("timed", [False, True])
def test_compiled_tiers_equal_the_python_replay(timed, monkeypatch):
    monkeypatch.setattr(simulate, "TierReplay", None)  # simulate_tiers must not fall back to the Python replay
    rng = np.random.default_rng(2627 + timed)
    seen: dict[str, int] = {}
    for _ in range(1500):
        reqs, bs, vocab = _workload(rng, timed)
        config, costs, preload, kvbpt = _config(rng, vocab)
        sim = TierReplay(reqs, bs, config, kvbpt, costs, timed, preload)
        want = sim.result(sim.run(), None)
        got = simulate_tiers(reqs, config, block_size=bs, kv_bytes_per_token=kvbpt, costs=costs, timed=timed,
                             preload=preload)
        assert_same(got, want, (bs, config, costs, preload, kvbpt, reqs))
        for t in config.tiers:
            seen[t.name] = seen.get(t.name, 0) + int(want.hit_blocks_by_tier[t.name].sum() > 0)
            seen[t.write] = seen.get(t.write, 0) + int(want.hit_blocks_by_tier[t.name].sum() > 0)
        for k, v in (("prepared", any(r.prepare for r in want.reads)), ("shared", want.num_shared_reads), ("stalled", any(want.pool.stalled)),
                     ("deferred", want.pool.num_deferred), ("waits", want.restore_wait_s is not None
                                                            and want.restore_wait_s.sum() > 0)):
            seen[k] = seen.get(k, 0) + bool(v)
    wanted = ["host", "ssd", "on-evict", "write-through", "stalled", "waits", "prepared"] + (["shared", "deferred"] if timed else [])
    assert min(seen.get(k, 0) for k in wanted) > 10, seen


def test_the_connector_keeps_the_python_replay(monkeypatch):
    """The simple-cpu connector keeps its Python replay (`simulate_tiers` chooses); so do hashes that are not
    64-bit unsigned integers."""
    from kmesh_trace.oracle.tiers import compiled

    calls = []
    monkeypatch.setattr(compiled, "replay_tiers_compiled", lambda *a: calls.append(a))
    rng = np.random.default_rng(5)
    reqs, bs, _ = _workload(rng, False)
    simulate_tiers(reqs, simple_cpu(6, 4), block_size=bs)
    assert calls == []
    monkeypatch.undo()
    odd = [RequestBlocks(0, "a", 8, 1, [-1, -2]), RequestBlocks(1, "b", 8, 1, [-1, -2])]
    assert compiled.tier_stream(odd, 4) is None
    config = TierConfig(1, (TierSpec("host", 4),))
    sim = TierReplay(odd, 4, config, None, {}, False, {})
    assert_same(simulate_tiers(odd, config, block_size=4), sim.result(sim.run(), None), "negative hashes")


@pytest.mark.parametrize("timed", [False, True])
def test_long_streams_through_large_tiers_equal_the_python_replay(timed):
    """Hundreds of requests through tiers of up to a few hundred blocks: each tier's LRU queue (native/kernels/
    tiers.c: a ring with blanked entries, rebuilt and doubled when full) goes through many rebuilds, growths,
    wrap-arounds and refreshes."""
    rng = np.random.default_rng(260 + timed)
    for _ in range(6):
        bs, vocab, reqs, t = 2, int(rng.integers(50, 400)), [], 0
        for i in range(400):
            prompt = [int(x) for x in rng.integers(0, vocab, int(rng.integers(0, 24)))]
            if i and rng.random() < 0.6:
                prev = reqs[int(rng.integers(0, i))].prompt_hashes
                k = min(len(prev), len(prompt))
                prompt[:k] = prev[:k]
            t += int(rng.integers(0, 3)) * 1_000_000
            reqs.append(RequestBlocks(i, f"r{i}", 2 * len(prompt) + 1, int(rng.integers(0, 4)), prompt, [],
                                      t if timed else None, t + 2_000_000 if timed else None))
        write = rng.choice(["on-evict", "write-through"])
        config = TierConfig(int(rng.integers(8, 40)), (TierSpec("host", int(rng.integers(16, 300))),
                                                      TierSpec("ssd", int(rng.integers(16, 600)), 1, write,
                                                               bool(rng.random() < 0.7))),
                            singleflight=bool(rng.random() < 0.5))
        costs = {"host": RestoreCost(0.004, 1e-3), "ssd": RestoreCost(0.5, 3.3e-4)}
        want = TierReplay(reqs, bs, config, 1000, costs, timed, {})
        want = want.result(want.run(), None)
        got = simulate_tiers(reqs, config, block_size=bs, kv_bytes_per_token=1000, costs=costs, timed=timed)
        assert_same(got, want, (config, timed))
        assert want.hit_blocks_by_tier["host"].sum() > 0


def test_the_tier_stream_numbers_every_hash_from_the_pools_stream():
    """`tier_stream` takes the pool's `AccessStream` ids (the stream `simulate_pool` replays) and numbers the
    prompt hashes past the listed ones (partial last blocks) after them where the stream lacks them: equal
    hashes get equal ids and only they, the ids are dense, and a preloaded key the stream has gets its id."""
    from kmesh_trace.oracle.stream import AccessStream
    from kmesh_trace.oracle.tiers import compiled

    rng = np.random.default_rng(26)
    for _ in range(300):
        reqs, bs, vocab = _workload(rng, bool(rng.random() < 0.5))
        for r in reqs:  # partial last hashes that repeat full ones, and some of their own
            if r.num_prompt_tokens % bs and rng.random() < 0.7:
                r.prompt_hashes = r.prompt_hashes[:r.num_prompt_tokens // bs] + [int(rng.integers(0, vocab + 4))]
        ts = compiled.tier_stream(reqs, bs)
        pool = AccessStream.from_requests(reqs, bs)
        assert ts.obj.tolist() == pool.obj.tolist() and ts.IN[0].tolist() == pool.req_start.tolist()
        hashes, ids = [], []
        for i, r in enumerate(reqs):
            a, nl = int(ts.IN[0][i]), int(ts.IN[1][i])
            hashes += r.prompt_hashes + r.output_hashes
            ids += ts.obj[a:a + nl].tolist() + ts.tail[ts.tail_start[i]:ts.tail_start[i + 1]].tolist()
            ids += ts.obj[a + nl:int(ts.IN[0][i + 1])].tolist()
        assert len(hashes) == len(ids)
        assert {h: k for h, k in zip(hashes, ids)} == {h: k for h, k in zip(reversed(hashes), reversed(ids))}
        assert len(set(hashes)) == len(set(ids)) and set(ids) == set(range(ts.num_ids))
        keys = [np.array([hashes[0], vocab + 100, hashes[-1], vocab + 100], np.uint64)] if hashes else []
        if keys:
            pid, n = ts.preload_ids(keys)
            assert pid.tolist() == [ids[0], ts.num_ids, ids[-1], ts.num_ids] and n == ts.num_ids + 1


def test_the_compiled_reads_are_a_sequence_of_tier_reads():
    """`TierReads` (the compiled replay's reads as columns) indexes, slices and iterates as the Python
    replay's list of `TierRead`s does."""
    from kmesh_trace.oracle.tiers.result import TierRead, TierReads

    reads = TierReads(("host", "ssd"), *(np.array(v, np.int64) for v in ([0, 2, 2], [1, 0, 1], [3, 1, 2],
                                                                         [30, 10, 20], [0, 1, 0])))
    want = [TierRead(0, "ssd", 3, 30, False), TierRead(2, "host", 1, 10, True), TierRead(2, "ssd", 2, 20, False)]
    assert list(reads) == want and len(reads) == 3 and reads[1] == want[1] and reads[-1] == want[-1]
    assert list(reads[1:]) == want[1:] and [r for r in reads if r.tier == "ssd"] == [want[0], want[2]]
