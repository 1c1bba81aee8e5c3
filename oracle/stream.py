"""The block access stream every simulator reads: one `RequestBlocks` per invocation, in arrival order.

Contract shared by the policies (lru, belady, infinite) and the vLLM block-pool model:
- `prompt_hashes` lists one chained prefix hash per prompt block the trace knows, in order. For
  token-id traces these are computed here from exact token ids (full blocks only, since a
  partial block has no identity in vLLM); imported traces list their own hashes, whose last
  block may be partial (`num_prompt_tokens % block_size != 0`).
- `num_full_prompt_blocks` = num_prompt_tokens // block_size; only these can ever be reused.
- The engine always computes the last prompt token, so a lookup considers at most
  `max_hit_blocks` = (num_prompt_tokens - 1) // block_size blocks.
- `output_hashes` continue the chain over the full blocks that generation completes (writes).
  vLLM holds KV for prompt + output - 1 tokens when a request finishes (the last sampled token is
  never fed back), so only the full blocks of those tokens are ever cached.

This module also owns `AccessStream`: the same workload flattened into numpy arrays (one row per
simulated block access) with each access's next use precomputed, as libCacheSim's oracle traces
do, so that no policy ever scans ahead.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from typing import Any, Iterable, Sequence

import numpy as np

from kmesh_trace.errors import KmeshTraceError, NeedsParameterError
from kmesh_trace.lineage import ParentResolver
from kmesh_trace.oracle.stream_index import NEVER, build_stream
from kmesh_trace.resources import check_fits, pool_bytes


@dataclass(slots=True)
class RequestBlocks:
    index: int  # arrival order, from 0
    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    prompt_hashes: list[int]
    output_hashes: list[int] = field(default_factory=list)
    arrival_ns: int | None = None
    finish_ns: int | None = None
    family_id: str | None = None
    parent_index: int | None = None  # index of the parent request (declared edge), when known
    num_expected_children: int | None = None
    stock_cached_tokens: int | None = None  # engine-measured local hit tokens (captures)
    # Exact token ids, when the trace has them (captures, built-in workloads); the vLLM pool
    # model's validation drives the real KVCacheManager with them. None for hash-only imports.
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None

    def num_full_prompt_blocks(self, block_size: int) -> int:
        return self.num_prompt_tokens // block_size

    def max_hit_blocks(self, block_size: int) -> int:
        return max(self.num_prompt_tokens - 1, 0) // block_size


# ---- hashing token ids ---------------------------------------------------------------------------

_ROOT_PARENT = b"\0" * 8


def chain_block_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int) -> list[int]:
    """Chained 64-bit hashes of the first `num_blocks` full blocks of `token_ids`.

    Each hash covers the parent's hash and the block's exact token ids, so equal hashes mean an
    equal whole prefix (as vLLM's prefix cache requires). Stable across processes (blake2b).
    """
    toks = np.asarray(token_ids, dtype="<i8")
    parent = _ROOT_PARENT
    out = []
    for b in range(num_blocks):
        digest = hashlib.blake2b(parent + toks[b * block_size:(b + 1) * block_size].tobytes(), digest_size=8).digest()
        out.append(int.from_bytes(digest, "little"))
        parent = digest
    return out


def num_computed_tokens(num_prompt_tokens: int, num_output_tokens: int) -> int:
    """Tokens whose KV vLLM holds when a request finishes: the prompt and every generated token but
    the last, which is sampled and never fed back."""
    return num_prompt_tokens + max(num_output_tokens - 1, 0)


def num_cached_blocks(num_prompt_tokens: int, num_output_tokens: int, block_size: int) -> int:
    """Full blocks vLLM has cached when the request finishes."""
    return num_computed_tokens(num_prompt_tokens, num_output_tokens) // block_size


def token_block_hashes(prompt: Sequence[int], output: Sequence[int] | None, block_size: int) -> tuple[list[int], list[int]]:
    """(prompt full-block hashes, hashes of the full blocks generation completes)."""
    output = list(output or [])
    n_prompt = len(prompt) // block_size
    n_total = num_cached_blocks(len(prompt), len(output), block_size)
    hashes = chain_block_hashes(list(prompt) + output, block_size, max(n_total, n_prompt))
    return hashes[:n_prompt], hashes[n_prompt:n_total]


# ---- building RequestBlocks ----------------------------------------------------------------------

def requests_from_rows(rows: Iterable[dict[str, Any]], block_size: int) -> list[RequestBlocks]:
    """RequestBlocks from invocation rows (dicts with contract column names), in the order given."""
    block_size = check_block_size(block_size)
    reqs: list[RequestBlocks] = []
    seen: set[str] = set()
    callers: list[str | None] = []
    parents: list[str | None] = []
    for i, row in enumerate(rows):
        n_prompt = int(row["num_prompt_tokens"])
        n_out = int(row.get("num_output_tokens") or 0)
        prompt_ids = row.get("prompt_token_ids")
        output_ids = row.get("output_token_ids")
        listed = row.get("prompt_block_hashes")
        # Exact tokens win: prompt and output blocks are then hashed one way, so a child whose prompt
        # repeats its parent's output finds the parent's generated blocks.
        if prompt_ids is not None:
            prompt_hashes, output_hashes = token_block_hashes(prompt_ids, output_ids, block_size)
        elif listed is not None:
            prompt_hashes, output_hashes = list(map(int, listed)), []
        else:
            raise KmeshTraceError(
                f"invocation {row.get('request_id')!r} has neither prompt_token_ids nor prompt_block_hashes; "
                "the oracle needs one of them to know which blocks repeat.")
        rid = str(row["request_id"])
        if rid in seen:
            raise duplicated_request(rid)
        seen.add(rid)
        reqs.append(RequestBlocks(
            index=i, request_id=rid, num_prompt_tokens=n_prompt, num_output_tokens=n_out,
            prompt_hashes=prompt_hashes, output_hashes=output_hashes,
            arrival_ns=row.get("arrival_ns"), finish_ns=row.get("finish_ns"), family_id=row.get("family_id"),
            num_expected_children=row.get("num_expected_children"),
            stock_cached_tokens=row.get("num_cached_tokens"),
            prompt_token_ids=None if prompt_ids is None else list(prompt_ids),
            output_token_ids=None if output_ids is None else list(output_ids),
        ))
        caller = row.get("caller_request_id")
        callers.append(None if caller is None else str(caller))
        parents.append(row.get("parent_id"))
    if any(p is not None for p in parents):  # names are resolved over every request, once all are seen
        _resolve_parents(reqs, callers, parents)
    return reqs


def duplicated_request(request_id: str) -> KmeshTraceError:
    """The refusal of a trace that lists request `request_id` twice (its blocks would count twice)."""
    return KmeshTraceError(f"invocation {request_id!r} appears twice; the trace holds duplicated rows, which would "
                           "count its blocks twice (`kmesh-trace audit capture` lists them).")


def _resolve_parents(reqs: list[RequestBlocks], callers: list[str | None], parents: list) -> None:
    """Each request's `parent_index` from the parent its caller named, by the rule the capture uses."""
    names = ParentResolver()
    for r, caller in zip(reqs, callers):
        names.add(r.request_id, caller)
    index = {r.request_id: r.index for r in reqs}
    for r, parent in zip(reqs, parents):
        p = names.resolve(parent)
        if p is not None and p != r.request_id:
            r.parent_index = index[p]


def set_declared_parents(requests: list[RequestBlocks], parents: dict[str, str | None]) -> None:
    """Set each request's `parent_index` from declared edges (child request id -> parent request id)."""
    index = {r.request_id: r.index for r in requests}
    for r in requests:
        if r.request_id in parents:
            p = parents[r.request_id]
            r.parent_index = index.get(p) if p is not None and p != r.request_id else None


def check_block_size(block_size: int | None) -> int:
    """`block_size` as a positive int, or the one error every analysis gives for a trace without one."""
    if not block_size or block_size <= 0:
        raise KmeshTraceError("the trace has no block size; its engine metadata must give `block_size`.")
    return int(block_size)


def pool_capacity(capacity_blocks: int | None, num_usable_blocks: int | None) -> int:
    """The pool capacity to replay: `capacity_blocks` (the caller's choice) when given, else
    the usable blocks the trace records; the one error every analysis gives when there is neither."""
    if capacity_blocks is not None:
        if capacity_blocks <= 0:
            raise KmeshTraceError(f"a pool capacity must be a positive block count, not {capacity_blocks}.")
        return int(capacity_blocks)
    if not num_usable_blocks:
        raise NeedsParameterError("the trace does not record the engine's usable blocks (imported traces cannot)",
                                  "capacity_blocks", "N")
    # A size from the trace's metadata is input too: checked as a flag's would be, before any pool is sized.
    check_fits(pool_bytes(int(num_usable_blocks)), "--capacity-blocks", "a vLLM pool model",
               asked_by=f"the trace's num_usable_blocks ({int(num_usable_blocks):,})")
    return int(num_usable_blocks)


def engine_geometry(trace, engine: str | None = None) -> tuple[int, int | None]:
    """(block_size, num_usable_blocks or None) of the trace's engine partition `engine` (None: the only one).

    Each engine has its own cache, so a trace with several needs `engine`; a missing block size is an
    error here, a missing usable-block count is left to `pool_capacity` (a sweep does not need it)."""
    if engine is None and len(trace.engines) > 1:
        raise NeedsParameterError(
            f"the trace has {len(trace.engines)} engine partitions ({', '.join(trace.engines)}), each with its own "
            "cache", "engine", "ENGINE_ID")
    if engine is not None and engine not in trace.engines:
        raise KmeshTraceError(f"the trace has no engine {engine!r}; its engines are {', '.join(trace.engines)}.")
    meta = trace.engines[engine] if engine is not None else trace.metadata
    return check_block_size(meta.get("block_size")), meta.get("num_usable_blocks")


# ---- the flat access stream ----------------------------------------------------------------------

@dataclass
class AccessStream:
    """One row per simulated block access, requests back to back, each request's accesses in order:
    its hit-eligible prompt reads (the first `max_hit_blocks` blocks), then its writes (the
    remaining full prompt blocks, then the full output blocks). Partial prompt blocks are never
    cached, so they are not accesses; they count only in `num_reads` (the hit-ratio denominator).

    `next_use[t]` is the position of the next access of the same object if that access is a
    hit-eligible read, else NEVER: a block whose next access is a write is recomputed there for
    free, so keeping it until then can earn nothing.
    """

    block_size: int
    obj: np.ndarray  # dense object id per access (int32 while the ids fit)
    eligible: np.ndarray  # bool: a prompt read whose hit would count
    next_use: np.ndarray  # int64 position of the next eligible read of obj, or NEVER
    req_start: np.ndarray  # int64 offsets, len = num_requests + 1
    num_prompt_tokens: np.ndarray  # int64 per request
    num_reads: np.ndarray  # int64 per request: every listed prompt block hash (partial included)
    num_objects: int

    @property
    def num_requests(self) -> int:
        return len(self.num_prompt_tokens)

    def __len__(self) -> int:
        return len(self.obj)

    @classmethod
    def from_requests(cls, requests: Sequence[RequestBlocks], block_size: int) -> "AccessStream":
        n_req = len(requests)
        prompt_tokens = np.fromiter((r.num_prompt_tokens for r in requests), np.int64, n_req)
        num_reads = np.fromiter((len(r.prompt_hashes) for r in requests), np.int64, n_req)
        n_full, n_elig = kept_and_eligible(num_reads, prompt_tokens, block_size)
        n_out = np.fromiter((len(r.output_hashes) for r in requests), np.int64, n_req)
        req_start = np.zeros(n_req + 1, np.int64)
        np.cumsum(n_full + n_out, out=req_start[1:])
        lists = (x for r, nf in zip(requests, n_full.tolist()) for x in (r.prompt_hashes[:nf], r.output_hashes))
        hashes = np.fromiter(chain.from_iterable(lists), np.uint64, int(req_start[-1]))
        # Each request's accesses are its kept prompt blocks then its output blocks; the first n_elig are eligible.
        obj, eligible, nxt, num_objects = build_stream(hashes, req_start[:-1], np.diff(req_start), n_elig)
        return cls(block_size, obj, eligible, nxt, req_start, prompt_tokens, num_reads, num_objects)

    @classmethod
    def from_flat(cls, block_size: int, flat: np.ndarray, num_reads: np.ndarray, num_prompt_tokens: np.ndarray,
                  starts: np.ndarray | None = None) -> "AccessStream":
        """The stream of hash-only requests: request r lists `num_reads[r]` hashes, back to back in `flat` (or
        from `flat[starts[r]]` when given: rows in any order, nothing gathered); its accesses are the full
        blocks among them (the first num_prompt_tokens[r] // block_size), the first `max_hit_blocks` of them
        eligible. One pass over the hashes (oracle/stream_index.py), no stream-long temporaries."""
        num_reads = np.asarray(num_reads, np.int64)
        prompt_tokens = np.asarray(num_prompt_tokens, np.int64)
        n_full, n_elig = kept_and_eligible(num_reads, prompt_tokens, block_size)
        if starts is None:
            starts = np.cumsum(num_reads) - num_reads
        req_start = np.zeros(len(num_reads) + 1, np.int64)
        np.cumsum(n_full, out=req_start[1:])
        obj, eligible, nxt, num_objects = build_stream(flat, starts, n_full, n_elig)
        return cls(block_size, obj, eligible, nxt, req_start, prompt_tokens, num_reads, num_objects)

    @classmethod
    def from_arrays(cls, block_size: int, hashes: np.ndarray, eligible: np.ndarray, req_start: np.ndarray,
                    num_prompt_tokens: np.ndarray, num_reads: np.ndarray) -> "AccessStream":
        """The stream of these accesses: dense object ids numbered as `np.unique` numbers the hashes, and
        next uses as `next_uses` gives them, in linear time (oracle/stream_index.py)."""
        hashes = np.asarray(hashes)
        n = len(hashes)
        obj, eligible, nxt, num_objects = build_stream(hashes, np.zeros(1, np.int64), np.array([n], np.int64), None,
                                                       eligible.astype(bool, copy=False))
        return cls(block_size, obj, eligible, nxt, req_start.astype(np.int64), num_prompt_tokens.astype(np.int64),
                   num_reads.astype(np.int64), num_objects)

    def tile(self, times: int) -> "AccessStream":
        """The stream repeated `times` times with fresh object ids per copy (a longer, equally shaped
        workload). Built copy by copy in place, so the peak memory is the result's."""
        n, m = len(self), self.num_objects
        dtype = np.int32 if m * times < 2**31 else np.int64
        obj = np.empty(n * times, dtype)
        nu = np.empty(n * times, np.int64)
        finite = self.next_use != NEVER
        for i in range(times):
            seg = slice(i * n, (i + 1) * n)
            np.add(self.obj, i * m, out=obj[seg], casting="unsafe")
            nu[seg] = self.next_use
            nu[seg][finite] += i * n
        starts = (self.req_start[:-1][None, :] + (np.arange(times, dtype=np.int64) * n)[:, None]).ravel()
        return AccessStream(self.block_size, obj, np.tile(self.eligible, times), nu,
                            np.append(starts, times * n), np.tile(self.num_prompt_tokens, times),
                            np.tile(self.num_reads, times), m * times)


def kept_and_eligible(num_reads: np.ndarray, prompt_tokens: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per request: the listed prompt blocks that are accesses (the full ones, `num_full_prompt_blocks`)
    and those of them that are hit-eligible (`max_hit_blocks`). The one statement of the rule: the stream,
    the pool kernel's inputs and the tier stream all take it from here."""
    n_full = np.maximum(np.minimum(num_reads, prompt_tokens // block_size), 0)
    n_elig = np.minimum(num_reads, np.maximum(prompt_tokens - 1, 0) // block_size)
    return n_full, n_elig


def next_uses(obj: np.ndarray, eligible: np.ndarray) -> np.ndarray:
    """Vectorised next-use: for each access, the position of the next access of the same object
    when that access is eligible, else NEVER."""
    n = len(obj)
    order = np.argsort(obj, kind="stable")
    nxt = np.full(n, NEVER, np.int64)
    same = obj[order[1:]] == obj[order[:-1]]
    src, dst = order[:-1][same], order[1:][same]
    keep = eligible[dst]
    nxt[src[keep]] = dst[keep]
    return nxt


# ---- the per-request columns the pool model reads ------------------------------------------------

@dataclass(frozen=True)
class RequestColumns:
    """What the `vllm` pool model reads of each request beside its blocks, in arrival order, as arrays: its
    output tokens, arrival and finish times (0 where a request has none; `timed`: every request has both, so
    the pool replays them concurrently). A workload without RequestBlocks carries them (`Workload.columns`)."""

    num_output_tokens: np.ndarray  # int64
    arrival_ns: np.ndarray  # int64, 0 where missing
    finish_ns: np.ndarray  # int64, 0 where missing
    timed: bool

    @classmethod
    def of_requests(cls, requests: Sequence[RequestBlocks]) -> "RequestColumns":
        return cls.of_values(list(map(attrgetter("num_output_tokens"), requests)),
                             list(map(attrgetter("arrival_ns"), requests)), list(map(attrgetter("finish_ns"), requests)))

    @classmethod
    def of_values(cls, num_output_tokens, arrival_ns, finish_ns) -> "RequestColumns":
        """From per-request values (lists or arrays; None or a null entry: missing), as `of_requests` reads them."""
        n = len(num_output_tokens)
        arrival, a_ok = _filled(arrival_ns, n)
        finish, f_ok = _filled(finish_ns, n)
        out, _ = _filled(num_output_tokens, n)
        return cls(out, arrival, finish, n > 0 and a_ok and f_ok)


def _filled(values, n: int) -> tuple[np.ndarray, bool]:
    """`values` as int64 with 0 for a missing entry, and whether none was missing (None: all missing)."""
    if values is None:
        return np.zeros(n, np.int64), n == 0
    if isinstance(values, np.ndarray) and values.dtype != object:
        return values.astype(np.int64, copy=False), True
    missing = values.count(None) if isinstance(values, list) else sum(v is None for v in values)
    if missing == n:  # none has one (a sequential stream)
        return np.zeros(n, np.int64), n == 0
    if missing == 0:
        return np.fromiter(values, np.int64, n), True
    return np.fromiter((v or 0 for v in values), np.int64, n), False
