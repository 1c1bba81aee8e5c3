"""The compiled stream build (oracle/stream_index.py, native/kernels/stream_index.c) against numpy's answers.

The reference is the numpy flattening the kernel replaced: positions within each request pick the kept and
the eligible accesses, `np.unique(..., return_inverse=True)` numbers the objects, `next_uses` (a stable sort)
gives the next uses. Every array is compared, on random streams and on the real traces."""

import os
import sys
from itertools import chain
from pathlib import Path

import numpy as np
import pytest

from kmesh_trace.native import kernels
from kmesh_trace.oracle.stream import NEVER, AccessStream, RequestBlocks, next_uses
from kmesh_trace.oracle.policies.infinite import infinite_hits
from kmesh_trace.oracle.stream_index import build_stream, leading_flags

REPO = Path(__file__).resolve().parents[1]
DATASETS = Path(os.environ.get("KMESH_DATASETS") or REPO.parent / "shared" / "datasets")


def numpy_flat_stream(block_size, flat, num_reads, prompt_tokens):
    """(obj, eligible, next_use, req_start, num_objects): the stream of hash-only requests, in numpy."""
    num_reads, prompt_tokens = np.asarray(num_reads, np.int64), np.asarray(prompt_tokens, np.int64)
    n_full = np.minimum(num_reads, prompt_tokens // block_size)
    n_elig = np.minimum(num_reads, np.maximum(prompt_tokens - 1, 0) // block_size)
    pos = np.arange(len(flat), dtype=np.int64) - np.repeat(np.cumsum(num_reads) - num_reads, num_reads)
    keep = pos < np.repeat(n_full, num_reads)
    eligible = (pos < np.repeat(n_elig, num_reads))[keep]
    req_start = np.zeros(len(num_reads) + 1, np.int64)
    np.cumsum(n_full, out=req_start[1:])
    uniq, inverse = np.unique(np.asarray(flat)[keep], return_inverse=True)
    return inverse.ravel(), eligible, next_uses(inverse.ravel(), eligible), req_start, len(uniq)


def numpy_infinite_hits(stream: AccessStream) -> np.ndarray:
    """Per request: eligible reads that are not their object's first access, in numpy."""
    seen_before = np.ones(len(stream), bool)
    _, first = np.unique(stream.obj, return_index=True)
    seen_before[first] = False
    c = np.zeros(len(stream) + 1, np.int64)
    np.cumsum(seen_before & stream.eligible, out=c[1:])
    return c[stream.req_start[1:]] - c[stream.req_start[:-1]]


def assert_stream_is(s: AccessStream, obj, eligible, nxt, req_start, num_objects):
    assert s.obj.dtype == np.int32
    assert np.array_equal(s.obj, obj)
    assert s.eligible.dtype == np.bool_ and np.array_equal(s.eligible, eligible)
    assert s.next_use.dtype == np.int64 and np.array_equal(s.next_use, nxt)
    assert s.req_start.dtype == np.int64 and np.array_equal(s.req_start, req_start)
    assert s.num_objects == num_objects


def random_requests(rng):
    """(flat hashes, reads per request, prompt tokens, block size): repeats, partial tails, requests that
    list no hash, prompts shorter than a block, hashes near 2**64."""
    bs = int(rng.choice([1, 2, 16, 512]))
    n_req = int(rng.integers(0, 60))
    pool = rng.integers(0, 2**64, int(rng.integers(1, 300)), dtype=np.uint64, endpoint=False)
    pool[: len(pool) // 4] = np.uint64(2**64 - 1) - pool[: len(pool) // 4] % np.uint64(50)  # near 2**64
    num_reads = rng.integers(0, 40, n_req) * (rng.random(n_req) < 0.9)  # some list nothing
    full = num_reads * bs
    prompt_tokens = np.where(rng.random(n_req) < 0.5, full, full - rng.integers(0, bs + 1, n_req))  # partial tails
    prompt_tokens = np.where(rng.random(n_req) < 0.1, rng.integers(0, bs + 1, n_req), prompt_tokens)  # < a block
    prompt_tokens = np.maximum(prompt_tokens, 0)
    flat = rng.choice(pool, int(num_reads.sum()))
    return flat, num_reads.astype(np.int64), prompt_tokens.astype(np.int64), bs


@pytest.mark.parametrize("seed", range(60))
def test_from_flat_equals_numpy_on_random_streams(seed):
    flat, num_reads, prompt_tokens, bs = random_requests(np.random.default_rng(seed))
    s = AccessStream.from_flat(bs, flat, num_reads, prompt_tokens)
    assert_stream_is(s, *numpy_flat_stream(bs, flat, num_reads, prompt_tokens))
    assert s.num_reads.tolist() == num_reads.tolist() and s.num_prompt_tokens.tolist() == prompt_tokens.tolist()
    assert np.array_equal(infinite_hits(s), numpy_infinite_hits(s))
    wide = AccessStream(bs, s.obj.astype(np.int64), s.eligible, s.next_use, s.req_start, s.num_prompt_tokens,
                        s.num_reads, s.num_objects)
    assert np.array_equal(infinite_hits(wide), numpy_infinite_hits(s))


@pytest.mark.parametrize("seed", range(20))
def test_from_flat_with_starts_reads_rows_in_place(seed):
    """Rows given out of order by their start offsets: the stream of the rows gathered in that order."""
    rng = np.random.default_rng(100 + seed)
    flat, num_reads, prompt_tokens, bs = random_requests(rng)
    off = np.concatenate([[0], np.cumsum(num_reads)])
    order = rng.permutation(len(num_reads))
    gathered = np.concatenate([flat[off[i]:off[i + 1]] for i in order]) if len(order) else flat[:0]
    s = AccessStream.from_flat(bs, flat, num_reads[order], prompt_tokens[order], starts=off[:-1][order])
    assert_stream_is(s, *numpy_flat_stream(bs, gathered, num_reads[order], prompt_tokens[order]))


def test_empty_stream():
    s = AccessStream.from_flat(16, np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert len(s) == 0 and s.num_objects == 0 and s.req_start.tolist() == [0]
    s = AccessStream.from_flat(16, np.zeros(0, np.uint64), np.zeros(3, np.int64), np.array([0, 5, 15]))
    assert len(s) == 0 and s.num_requests == 3 and s.req_start.tolist() == [0, 0, 0, 0]
    assert infinite_hits(s).tolist() == [0, 0, 0]
    s = AccessStream.from_requests([], 16)
    assert len(s) == 0 and s.num_objects == 0


@pytest.mark.parametrize("seed", range(40))
def test_from_arrays_equals_unique_and_next_uses(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3000))
    hashes = rng.choice(rng.integers(0, 2**64, int(rng.integers(1, 400)), dtype=np.uint64), n)
    eligible = rng.random(n) < 0.7
    s = AccessStream.from_arrays(16, hashes, eligible, np.array([0, n]), np.array([16 * n]), np.array([n]))
    uniq, inverse = np.unique(hashes, return_inverse=True)
    assert_stream_is(s, inverse, eligible, next_uses(inverse, eligible), [0, n], len(uniq))


def test_from_arrays_ranks_signed_hashes_as_signed():
    """int64 hashes number as np.unique sorts them (signed): -1 first."""
    hashes = np.array([5, -1, 5, 7, -1, -2**63], np.int64)
    s = AccessStream.from_arrays(16, hashes, np.ones(6, bool), np.array([0, 2, 6]), np.array([32, 64]),
                                 np.array([2, 4]))
    assert s.obj.tolist() == np.unique(hashes, return_inverse=True)[1].tolist() == [2, 1, 2, 3, 1, 0]
    assert s.num_objects == 4 and s.next_use.tolist() == [2, 4, NEVER, NEVER, NEVER, NEVER]
    small = AccessStream.from_arrays(16, hashes[:5].astype(np.int32), np.ones(5, bool), np.array([0, 5]),
                                     np.array([80]), np.array([5]))
    assert small.obj.tolist() == [1, 0, 1, 2, 0]


@pytest.mark.parametrize("seed", range(20))
def test_from_requests_equals_numpy(seed):
    """Prompt blocks kept up to the full ones, then the output blocks (never eligible)."""
    rng = np.random.default_rng(seed)
    flat, num_reads, prompt_tokens, bs = random_requests(rng)
    off = np.concatenate([[0], np.cumsum(num_reads)])
    pool = flat[:50] if len(flat) else np.array([3], np.uint64)
    reqs = [RequestBlocks(i, str(i), int(prompt_tokens[i]), 0, list(map(int, flat[off[i]:off[i + 1]])),
                          list(map(int, rng.choice(pool, int(rng.integers(0, 4))))))
            for i in range(len(num_reads))]
    s = AccessStream.from_requests(reqs, bs)
    n_full = np.minimum(num_reads, prompt_tokens // bs)
    n_elig = np.minimum(num_reads, np.maximum(prompt_tokens - 1, 0) // bs)
    req_start = np.concatenate([[0], np.cumsum(n_full + [len(r.output_hashes) for r in reqs])]).astype(np.int64)
    hashes = np.fromiter(chain.from_iterable(r.prompt_hashes[:nf] + r.output_hashes for r, nf in zip(reqs, n_full)),
                         np.uint64, int(req_start[-1]))
    eligible = leading_flags(req_start, n_elig)
    uniq, inverse = np.unique(hashes, return_inverse=True)
    assert_stream_is(s, inverse, eligible, next_uses(inverse, eligible), req_start, len(uniq))


def test_build_stream_refuses_accesses_past_the_hashes():
    with pytest.raises(ValueError, match="run past"):
        build_stream(np.zeros(3, np.uint64), np.array([0, 2]), np.array([2, 2]), np.array([1, 1]))
    with pytest.raises(ValueError, match="eligibility flags"):
        build_stream(np.zeros(3, np.uint64), np.array([0]), np.array([3]), None, np.ones(2, bool))


def test_many_distinct_hashes_grow_the_table():
    """More distinct hashes than the table's first size, every one a few times."""
    rng = np.random.default_rng(5)
    hashes = np.repeat(rng.integers(0, 2**64, 50_000, dtype=np.uint64), 3)
    rng.shuffle(hashes)
    eligible = rng.random(len(hashes)) < 0.5
    s = AccessStream.from_arrays(16, hashes, eligible, np.array([0, len(hashes)]), np.array([1]), np.array([1]))
    uniq, inverse = np.unique(hashes, return_inverse=True)
    assert_stream_is(s, inverse, eligible, next_uses(inverse, eligible), [0, len(hashes)], len(uniq))
    for wide in (False, True):  # 32-bit table slots, and the 64-bit ones of streams past 2**32 - 1 accesses
        obj, elig, nxt, m = build_stream(hashes, np.zeros(1), np.array([len(hashes)]), None, eligible,
                                         wide_table=wide)
        assert np.array_equal(obj, inverse) and np.array_equal(nxt, s.next_use) and m == len(uniq)
    ids = np.arange(70_000, dtype=np.int64)[::-1].copy()  # small integers, as ids: not pre-mixed
    s = AccessStream.from_arrays(16, ids, np.ones(len(ids), bool), np.array([0, len(ids)]), np.array([1]),
                                 np.array([1]))
    assert np.array_equal(s.obj, ids) and (s.next_use == NEVER).all()


def test_leading_flags():
    req_start = np.array([0, 3, 3, 7, 8], np.int64)
    n_first = np.array([2, 5, 9, 0], np.int64)
    assert leading_flags(req_start, n_first).tolist() == [True, True, False, True, True, True, True, False]


def test_ptr_refuses_a_wrong_array():
    with pytest.raises(TypeError, match="C-contiguous int64"):
        kernels.ptr(np.zeros(4, np.int32), np.int64)
    with pytest.raises(TypeError, match="strided"):
        kernels.ptr(np.zeros(8, np.int64)[::2], np.int64)


def _real_columns(src: Path):
    from kmesh_trace.datasets.importers.mooncake import read_mooncake

    cols, _ = read_mooncake(src)
    return (np.frombuffer(cols.hashes, np.uint64), np.diff(np.asarray(cols.offsets, np.int64)),
            np.asarray(cols.num_prompt_tokens, np.int64))


@pytest.mark.shared_data
def test_from_flat_equals_numpy_on_the_mooncake_traces():
    srcs = [DATASETS / "mooncake" / f for f in ("conversation_trace.jsonl", "synthetic_trace.jsonl")]
    if not any(p.is_file() for p in srcs):
        pytest.skip(f"Mooncake traces not found under {DATASETS / 'mooncake'} (set KMESH_DATASETS)")
    for src in filter(Path.is_file, srcs):
        flat, num_reads, prompt_tokens = _real_columns(src)
        s = AccessStream.from_flat(512, flat, num_reads, prompt_tokens)
        assert_stream_is(s, *numpy_flat_stream(512, flat, num_reads, prompt_tokens))
        assert np.array_equal(infinite_hits(s), numpy_infinite_hits(s))


@pytest.mark.shared_data
def test_from_flat_equals_numpy_on_an_agentic_stream(tmp_path):
    """The benches' agentic stream (weka-claude-code samples tiled with fresh ids), 2 M block reads."""
    if not (DATASETS / "weka-claude-code").is_dir():
        pytest.skip(f"weka-claude-code samples not found under {DATASETS} (set KMESH_DATASETS)")
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from oracle_peer_bench import build_agentic
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    build_agentic(tmp_path / "agentic.jsonl", 2_000_000, 60.0)
    flat, num_reads, prompt_tokens = _real_columns(tmp_path / "agentic.jsonl")
    s = AccessStream.from_flat(512, flat, num_reads, prompt_tokens)
    assert len(s) > 1_000_000
    assert_stream_is(s, *numpy_flat_stream(512, flat, num_reads, prompt_tokens))
    assert np.array_equal(infinite_hits(s), numpy_infinite_hits(s))
