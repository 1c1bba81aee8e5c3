"""The built-in `family-burst` scenario of `kmesh-trace tiers`: one ancestor on SSD, its children at once.

An ancestor of `ancestor_mib` MiB lies in the SSD tier as `num_chunks` chunks (one 256-token block per
chunk, so the KV bytes per token follow from the chunk size); the GPU pool does not hold it. Its
`num_children` children arrive together, each with the ancestor as its prompt prefix plus one private
block and a few tokens, and run for one second. Three arms:

- `baseline`: every child finds the ancestor missing from the GPU pool and reads it from SSD itself
  (a block restored for another child is not usable until that read completes);
- `singleflight`: concurrent needs of one chunk share one read;
- `retention`: the ancestor was kept in host memory after its first load, so the children read it there.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.stream import RequestBlocks, token_block_hashes
from kmesh_trace.oracle.workload import Workload

BLOCK_SIZE = 256
DEFAULT_CHILDREN = 5
DEFAULT_ANCESTOR_MIB = 48
DEFAULT_CHUNKS = 16
ARMS = ("baseline", "singleflight", "retention")


@dataclass
class FamilyBurst:
    requests: list[RequestBlocks]
    ancestor_hashes: list[int]  # the chunks stored in the SSD tier (and, for `retention`, in host memory)
    block_size: int
    kv_bytes_per_token: int
    gpu_blocks: int


def family_burst(num_children: int = DEFAULT_CHILDREN, ancestor_mib: float = DEFAULT_ANCESTOR_MIB,
                 num_chunks: int = DEFAULT_CHUNKS, seed: int = 0) -> FamilyBurst:
    if num_children < 1 or num_chunks < 1 or ancestor_mib <= 0:
        raise KmeshTraceError("family-burst needs at least one child, one chunk and a positive ancestor size.")
    chunk_bytes = int(ancestor_mib * 2**20) // num_chunks
    if chunk_bytes < BLOCK_SIZE or chunk_bytes % BLOCK_SIZE:
        raise KmeshTraceError(f"an ancestor of {ancestor_mib} MiB in {num_chunks} chunks gives {chunk_bytes}-byte "
                              f"chunks; a chunk must be a positive multiple of {BLOCK_SIZE} bytes (one block's tokens).")
    rng = random.Random(seed)
    ancestor = [rng.randrange(1 << 30) for _ in range(num_chunks * BLOCK_SIZE)]
    requests = []
    for c in range(num_children):
        prompt = ancestor + [rng.randrange(1 << 30) for _ in range(BLOCK_SIZE + 16)]
        ph, oh = token_block_hashes(prompt, [0], BLOCK_SIZE)
        requests.append(RequestBlocks(index=c, request_id=f"child-{c}", num_prompt_tokens=len(prompt),
                                      num_output_tokens=1, prompt_hashes=ph, output_hashes=oh,
                                      arrival_ns=0, finish_ns=1_000_000_000, family_id="burst"))
    ancestor_hashes = requests[0].prompt_hashes[:num_chunks]
    gpu_blocks = num_children * (num_chunks + 2)  # every child fits; nothing else competes
    return FamilyBurst(requests, ancestor_hashes, BLOCK_SIZE, chunk_bytes // BLOCK_SIZE, gpu_blocks)


def built():
    """The default family burst as a registry workload: the parent (its prompt is the ancestor) finishes,
    then its children arrive together; the GPU pool holds every child and nothing competes."""
    from dataclasses import replace

    b = family_burst()
    n = len(b.ancestor_hashes) * b.block_size
    parent = RequestBlocks(index=0, request_id="parent", num_prompt_tokens=n + 1, num_output_tokens=1,
                           prompt_hashes=list(b.ancestor_hashes), arrival_ns=0, finish_ns=500_000_000,
                           family_id="burst", num_expected_children=len(b.requests))
    children = [replace(r, index=r.index + 1, parent_index=0) for r in b.requests]
    return Workload(b.block_size, [parent, *children], num_usable_blocks=b.gpu_blocks + len(b.ancestor_hashes) + 1,
                    notes=[f"{b.kv_bytes_per_token:,} KV bytes per token; `tiers --scenario family-burst` stores the "
                           "ancestor in the SSD tier and compares its arms"])
