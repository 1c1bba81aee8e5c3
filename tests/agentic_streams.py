"""A synthetic agentic stream in the Mooncake JSONL format, for the tests of the paths that read a file piece by
piece (tests/test_shards.py): sessions whose every turn re-reads its growing prefix after one of a few shared
system prompts, sub-agents that fork a session's prefix and run a few turns of their own, partial last blocks
that are never reused, interleaved in time. Hash ids are large and scattered (not 0, 1, 2...), so a sample
drawn by the hash of the block id and one drawn by the rank of the id differ."""

from __future__ import annotations

import json

import numpy as np

BLOCK = 512


def agentic_rows(seed: int = 3, sessions: int = 120, turns: int = 10, prompts: int = 8, subagent_every: int = 3):
    """(timestamp ms, input tokens, output tokens, hash ids) per request, in arrival order."""
    rng = np.random.default_rng(seed)
    rows, next_id = [], 0

    def fresh(n):
        nonlocal next_id
        ids = [int(x) for x in (np.arange(next_id, next_id + n, dtype=np.uint64) * np.uint64(0x9E3779B1) + np.uint64(12345))]
        next_id += n
        return ids

    system = [fresh(int(rng.integers(3, 9))) for _ in range(prompts)]
    for s in range(sessions):
        prefix, t = list(system[s % prompts]), float(rng.uniform(0, 20_000))
        for turn in range(turns):
            prefix += fresh(int(rng.integers(1, 12)))
            rows.append(_row(rng, t, prefix, fresh))
            if turn % subagent_every == 1:  # a sub-agent: the session's prefix, then its own turns
                sub, ts = list(prefix), t + float(rng.uniform(1, 50))
                for _ in range(int(rng.integers(1, 4))):
                    sub += fresh(int(rng.integers(1, 6)))
                    rows.append(_row(rng, ts, sub, fresh))
                    ts += float(rng.exponential(15))
            t += float(rng.exponential(60))
    rows.sort(key=lambda r: r[0])
    return rows


def _row(rng, t, prefix, fresh):
    tail = int(rng.integers(0, BLOCK))  # a partial last block: its own id
    ids = list(prefix) + (fresh(1) if tail else [])
    return int(t * 1000), BLOCK * len(prefix) + tail, int(rng.integers(1, 500)), ids


def write_mooncake(path, rows):
    with open(path, "w") as f:
        for ts, n_in, n_out, ids in rows:
            f.write(json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}) + "\n")
    return path


def object_hashes(rows, block_size: int = BLOCK) -> np.ndarray:
    """The distinct hashes of the stream's accesses (each request's full prompt blocks), sorted: object i of
    the built stream is hash i of these."""
    full = [ids[:min(len(ids), n_in // block_size)] for _, n_in, _, ids in rows]
    return np.unique(np.array([h for ids in full for h in ids], np.uint64))
