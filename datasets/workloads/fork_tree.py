"""The built-in fork-tree workload: one ancestor request and children that each extend it.

A parent prompt of `ancestor_tokens` tokens, then `num_children` children whose prompts are that
ancestor followed by a distinct tail of `tail_tokens` tokens, 16-token blocks. Aligned (4,096 +
5 x 512): with the ancestor cached the tree writes 256 + 5 x 32 = 416 blocks, as independent copies
256 + 5 x 288 = 1,696. Non-aligned (4,101 + 5 x 509): the ancestor's 5 trailing tokens share a
block with each child's tail, so each child recomputes those 5 boundary tokens. Outputs are short
(8 tokens) so that no generated block completes and the block counts above are exact.

The workload is defined once, as invocation rows of the contract; `fork_tree_requests` turns
them into RequestBlocks (the oracle's input) and `write_fork_tree` into a trace directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kmesh_trace.oracle.stream import RequestBlocks, requests_from_rows
from kmesh_trace.oracle.workload import Workload
from kmesh_trace.writer import TraceWriter

BLOCK_SIZE = 16
#: Pool capacity written into the trace's metadata (the scenario's default capacity).
NUM_USABLE_BLOCKS = 512
_MS = 1_000_000


def fork_tree_rows(*, aligned: bool = True, num_children: int = 5, ancestor_tokens: int | None = None,
                   tail_tokens: int | None = None, output_tokens: int = 8, concurrent_children: bool = False,
                   vocab_size: int = 1000, seed: int = 0) -> list[dict[str, Any]]:
    """Invocation rows (contract column names): the parent first, then its children in arrival order.

    Times: the parent runs 0-10 ms; children arrive after it finished, one after another (each
    finishing before the next arrives) or, with `concurrent_children`, all at once.
    """
    anc_n = ancestor_tokens if ancestor_tokens is not None else (4096 if aligned else 4101)
    tail_n = tail_tokens if tail_tokens is not None else (512 if aligned else 509)
    rng = np.random.default_rng(seed)
    ancestor = rng.integers(num_children, vocab_size, anc_n).tolist()
    rows = [_row(0, "parent", None, ancestor, rng, output_tokens, vocab_size, 0, 10 * _MS, num_children)]
    for c in range(num_children):
        tail = rng.integers(num_children, vocab_size, tail_n).tolist()
        tail[0] = c  # tails differ from their first token on, so no two children share a tail block
        arrival = 20 * _MS if concurrent_children else (20 + 10 * c) * _MS
        finish = 30 * _MS if concurrent_children else arrival + 5 * _MS
        rows.append(_row(c + 1, f"child-{c}", "parent", ancestor + tail, rng, output_tokens, vocab_size,
                         arrival, finish, None))
    return rows


def _row(seq, rid, parent, prompt, rng, num_output_tokens, vocab, arrival, finish, num_children) -> dict[str, Any]:
    return {
        "request_id": rid, "seq": seq, "family_id": "fork-tree", "parent_id": parent,
        "num_expected_children": num_children, "num_prompt_tokens": len(prompt), "num_output_tokens": num_output_tokens,
        "prompt_token_ids": prompt, "output_token_ids": rng.integers(0, vocab, num_output_tokens).tolist(),
        "arrival_ns": arrival, "first_scheduled_ns": arrival, "finish_ns": finish, "status": "finished",
    }


def fork_tree_requests(**kwargs) -> list[RequestBlocks]:
    """The workload as the oracle's RequestBlocks (16-token blocks); kwargs as `fork_tree_rows`."""
    return requests_from_rows(fork_tree_rows(**kwargs), BLOCK_SIZE)


def write_fork_tree(out: str | Path, *, num_usable_blocks: int = NUM_USABLE_BLOCKS, **kwargs) -> Path:
    """Write the workload as a trace directory (no stock hit counts: it was generated, not captured)."""
    rows = fork_tree_rows(**kwargs)
    with TraceWriter(out, "fork-tree", {"block_size": BLOCK_SIZE, "num_usable_blocks": num_usable_blocks,
                                        "engine": "kmesh-trace fork-tree generator",
                                        "capture_config": {"scenario": "fork-tree", **kwargs}},
                     source="generated:fork-tree") as w:
        w.write("invocations", {k: [r[k] for r in rows] for k in rows[0]})
    return Path(out)


def _built(aligned: bool):
    return Workload(BLOCK_SIZE, fork_tree_requests(aligned=aligned), num_usable_blocks=NUM_USABLE_BLOCKS)


def aligned():
    """Registry builder: `fork-tree`."""
    return _built(True)


def unaligned():
    """Registry builder: `fork-tree-unaligned`."""
    return _built(False)
