"""Test support: synthetic files in the Bailian format (the importer lives in
datasets/importers/bailian.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from kmesh_trace.datasets.importers.bailian import _ROOT, BLOCK_SIZE


def generate_bailian(path: str | Path, *, num_sessions: int = 20, max_turns: int = 4, seed: int = 0,
                     malformed_every: int = 0) -> dict:
    """Write a synthetic file in the Bailian format: multi-turn sessions whose turns extend the last.

    Each turn's blocks are the previous turn's blocks plus new ones, so the re-chained prefix hashes
    of a child repeat its parent's. Block ids are drawn from a small pool so that equal ids at
    different prefixes occur (the importer must keep those distinct). With `malformed_every` = k,
    every k-th line is replaced by a broken one. Returns the expected counts.
    """
    rng = random.Random(seed)
    lines: list[str] = []
    chat_id = 0
    t = 0.0
    expected = {"invocations": 0, "edges": 0, "blocks": 0, "malformed": 0}
    for _ in range(num_sessions):
        parent = _ROOT
        ids: list[int] = []
        for turn in range(1, rng.randint(1, max_turns) + 1):
            ids = ids + [rng.randrange(64) for _ in range(rng.randint(1, 6))]
            n_in = (len(ids) - 1) * BLOCK_SIZE + rng.randint(1, BLOCK_SIZE)
            t += rng.random()
            rec = {"chat_id": chat_id, "parent_chat_id": parent, "timestamp": round(t, 3), "input_length": n_in,
                   "output_length": rng.randint(1, 64), "type": "text", "turn": turn, "hash_ids": ids}
            lines.append(json.dumps(rec))
            expected["invocations"] += 1
            expected["edges"] += parent != _ROOT
            expected["blocks"] += len(ids)
            parent = chat_id
            chat_id += 1
    if malformed_every:
        broken = ['{"chat_id": ', "[1, 2, 3]", '{"chat_id": "x"}']
        out: list[str] = []
        for i, line in enumerate(lines, 1):
            out.append(line)
            if i % malformed_every == 0:
                out.append(broken[(i // malformed_every) % len(broken)])
                expected["malformed"] += 1
        lines = out
    Path(path).write_text("\n".join(lines) + "\n")
    return expected
