"""vLLM's SimpleCPUOffloadConnector (eager mode), as a replay strategy over the tier model.

`kmesh_trace.oracle.tiers.config.simple_cpu` builds its configuration (one retained write-through tier
of one-block chunks, gpu-prefix lookup); `SimpleCPUReplay` changes the two things the connector does
differently from the generic write-through tier: which blocks a request's stores reach, batch by batch
as the scheduler builds each step, and the order in which the request's GPU blocks are freed (tests/
test_tiers_vllm.py drives vLLM's real scheduler and connector against it).
"""

from __future__ import annotations

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.stream import RequestBlocks, num_cached_blocks
from kmesh_trace.oracle.tiers.replay import TierReplay, held_chain

__all__ = ["SimpleCPUReplay"]


class SimpleCPUReplay(TierReplay):
    def __init__(self, requests, block_size, config, kv_bytes_per_token, costs, timed, preload):
        super().__init__(requests, block_size, config, kv_bytes_per_token, costs, timed, preload)
        if timed:
            raise KmeshTraceError("the simple-cpu connector model replays sequentially; pass timed=False.")
        self.tiers[0].refresh_on_hit = True  # a load refreshes the blocks it reads
        self.stored_now: list[int] = []  # chain positions the current request newly stored

    def _hits(self, i: int) -> int:
        return int(self.hit["gpu"][i] + self.hit[self.tiers[0].name][i])

    def _write_through(self, i: int, r: RequestBlocks) -> None:
        """The connector's eager stores, one batch per build: each step's build stores the blocks the
        earlier steps confirmed (the prefill step's build: the hit tokens; decode step k's: P + k - 1; the
        finish: P + G - 1), checking the whole batch against the store before any of its stores evicts;
        a block already stored is not refreshed."""
        chain, bs = held_chain(r, self.bs), self.bs
        store = self.tiers[0].store
        p, g = r.num_prompt_tokens, r.num_output_tokens
        self.stored_now = stored = []
        start = 0
        for confirmed in (self._hits(i) * bs, *range(p, p + g - 1), p + g - 1):
            end = min(confirmed // bs, len(chain))
            if end <= start:
                continue
            batch = [j for j in range(start, end) if chain[j] not in store.lru]
            store.put([chain[j] for j in batch], refresh=False)
            stored.extend(batch)
            start = end

    def _finish(self, i: int) -> None:
        # A store holds its GPU block until the worker reports it done, which the scheduler learns after it
        # has freed the requests that finished in that step. So the stores issued for a request's last step
        # (the blocks its earlier steps confirmed) and at its finish (`_queue_finished_eager_store`) still
        # hold their blocks when vLLM frees the request's blocks (tail first); they are freed afterwards, in
        # block order. Builds store what earlier steps confirmed: the prefill step's build sees the hit
        # tokens, decode step k's sees P + k - 1; so the late stores are the blocks that were not full when
        # the build before the last step ran (none: G = 1; the hits: G = 2; P + G - 3 tokens: G >= 3).
        r, bs = self.requests[i], self.bs
        blocks = self.req_blocks.pop(i)
        p, g = r.num_prompt_tokens, r.num_output_tokens
        hits = self._hits(i)
        confirmed = 0 if g <= 1 else (hits * bs if g == 2 else p + g - 3)
        last = set(range(confirmed // bs, num_cached_blocks(p, g, bs)))
        flushed = [blocks[j] for j in self.stored_now if j in last]
        pool = self.pool
        pool.touch(flushed)
        blocks.reverse()
        pool.free_blocks(blocks)
        pool.free_blocks(flushed)
