"""The built-in `hold-stress` scenario: one family whose hold competes with unrelated reuse.

Sequential requests, each run to completion and freed before the next, on a pool of 129 physical
blocks (vLLM's null block + 128 usable) of 16 tokens, 8 generated tokens per request:
request 0 is the parent (512-token prompt); requests 1-4 are four unrelated 497-token prompts and
requests 5-8 repeat them (the second pass); request 9 is the child, whose prompt is the parent's 512
prompt tokens + its 8 generated tokens + a distinct 64-token tail. `scale=2` doubles every token size
(block size 32, prompts 1024/994, tail 128, 16 generated tokens) with the same 129 blocks: the
variant a CPU engine can run (its attention needs block sizes that are multiples of 32); the replay is
block-for-block the same.

What it yields under the vLLM block-pool model (`kmesh_trace.oracle.pressure.what_if`), pinned by
tests/test_blockpool_vllm.py against vLLM's real `KVCacheManager` (both arms) and, for the stock arm
at scale 2, by tests/test_pressure_vllm.py against a real CPU engine; tokens at scale 1 (double
them all at scale 2; blocks and evictions are the same):
- stock: the parent's 32 full blocks are freed tail first to the LRU end; the first pass fills the
  whole pool, so its fourth request evicts 29 of them (the chain's tail) and 3 survive. Per request
  hits 0 x 5, then 496 x 4 (second pass: 31 blocks each, the most a 497-token prompt can hit), child 48;
  evictions 29 (request 4) + 33 (child) = 62; 2,032 hit tokens.
- held: the parent's 32 full blocks are held from its finish to the child's admission, leaving 96
  blocks to four 32-block requests per pass: each second-pass request hits only 32 tokens, the child
  hits all 512; evictions 29 x 5 + 4 = 149; 640 hit tokens.
- tradeoff: saved_child_tokens 464, displaced_hit_tokens 1,856, net_cached_tokens -1,392 (the hold
  loses); held_block_steps 288 (32 blocks x 9 request boundaries).

Token ids stay below 1000 so the prompts fit the tiny test model's 1024-token vocabulary. The
parent's generated tokens are placeholders: a live run puts the parent's real output in the child's
prompt (`parent_output`); no other request shares that block, so the replay does not depend on it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kmesh_trace.oracle.stream import RequestBlocks, token_block_hashes
from kmesh_trace.oracle.workload import Workload

NAME = "hold-stress"
NUM_PHYSICAL_BLOCKS = 129  # including vLLM's null block
FAMILY_ID = "hold-stress"


@dataclass(frozen=True)
class ScenarioRequest:
    request_id: str
    prompt_token_ids: list[int]
    num_output_tokens: int
    output_token_ids: list[int] | None = None
    family_id: str | None = None
    parent_index: int | None = None
    num_expected_children: int | None = None
    arrival_ns: int | None = None
    finish_ns: int | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    block_size: int
    num_physical_blocks: int
    requests: list[ScenarioRequest]

    @property
    def num_usable_blocks(self) -> int:
        return self.num_physical_blocks - 1

    def request_blocks(self) -> list[RequestBlocks]:
        """The access stream (without times, each request is freed before the next one starts)."""
        out = []
        for i, q in enumerate(self.requests):
            prompt_hashes, output_hashes = token_block_hashes(q.prompt_token_ids, q.output_token_ids, self.block_size)
            out.append(RequestBlocks(
                index=i, request_id=q.request_id, num_prompt_tokens=len(q.prompt_token_ids),
                num_output_tokens=q.num_output_tokens, prompt_hashes=prompt_hashes,
                # Unknown generated tokens: the pool model gives those blocks keys no lookup matches.
                output_hashes=output_hashes if q.output_token_ids else [],
                family_id=q.family_id, parent_index=q.parent_index, num_expected_children=q.num_expected_children,
                arrival_ns=q.arrival_ns, finish_ns=q.finish_ns,
                prompt_token_ids=list(q.prompt_token_ids),
                output_token_ids=None if q.output_token_ids is None else list(q.output_token_ids),
            ))
        return out


def hold_stress(scale: int = 1, parent_output: list[int] | None = None, seed: int = 0) -> Scenario:
    """The scenario at `scale` (1: 16-token blocks; 2: every token size doubled, 32-token blocks)."""
    if scale not in (1, 2):
        raise ValueError("hold-stress exists at scale 1 (16-token blocks) and 2 (32-token blocks)")
    rng = random.Random(seed)
    block_size, num_out = 16 * scale, 8 * scale

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, 1000) for _ in range(n)]

    parent = prompt(512 * scale)
    gen = list(parent_output) if parent_output is not None else [1000 - 1 - k for k in range(num_out)]
    if len(gen) != num_out:
        raise ValueError(f"parent_output must hold {num_out} tokens")
    others = [prompt(497 * scale) for _ in range(4)]
    tail = prompt(64 * scale)
    reqs = [ScenarioRequest("parent", parent, num_out, gen, FAMILY_ID, None, 1)]
    for p in (1, 2):
        reqs += [ScenarioRequest(f"other{k}-pass{p}", o, num_out) for k, o in enumerate(others)]
    reqs.append(ScenarioRequest("child", parent + gen + tail, num_out, None, FAMILY_ID, 0, None))
    return Scenario(NAME, block_size, NUM_PHYSICAL_BLOCKS, reqs)


def _built(scale: int):
    sc = hold_stress(scale)
    return Workload(sc.block_size, sc.request_blocks(), num_usable_blocks=sc.num_usable_blocks)


def scale_1():
    """Registry builder: `hold-stress`."""
    return _built(1)


def scale_2():
    """Registry builder: `hold-stress-x2`."""
    return _built(2)
