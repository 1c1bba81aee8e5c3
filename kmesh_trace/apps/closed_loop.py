"""Predicted against measured, block by block: a Mooncake export replayed on a real engine under capture.

A replay client (aiperf) turns each hash id of an exported line into text, and the engine's capture records the
prompt it received and the vLLM block hashes it cached and hit. With the export at the engine's block size
(`kmesh-trace export mooncake --block-tokens B`), block k of line i is hash id `hash_ids[k]` on one side and the
k-th prompt block of the engine request that served line i on the other. `compare_blocks` maps the two ways
(hash id -> vLLM block hash, vLLM block hash -> hash id; a conflict is a hash id that became two different
blocks, or two hash ids that became one, e.g. when text synthesis or tokenisation moved a boundary) and sets
the pool model's predicted hits beside the engine's measured ones for every full prompt block (vLLM's hits are
a prefix of the prompt: the first `num_cached_tokens / B` blocks, then `num_external_tokens / B` loaded by a
connector).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from kmesh_trace.errors import KmeshTraceError

#: Disagreeing blocks listed in a comparison (the counts cover all of them).
MAX_LISTED = 20


@dataclass
class BlockComparison:
    block_size: int
    num_lines: int
    num_matched: int = 0  # lines served by an engine request of the capture
    num_misaligned: int = 0  # matched lines whose recorded prompt length differs from input_length (skipped)
    num_blocks: int = 0  # full prompt blocks compared
    both: int = 0  # predicted and measured hits
    predicted_only: int = 0
    measured_only: int = 0
    neither: int = 0
    id_to_block: dict[int, int] = field(default_factory=dict)  # hash id -> vLLM block hash (first seen)
    block_to_id: dict[int, int] = field(default_factory=dict)  # vLLM block hash -> hash id (first seen)
    num_id_conflicts: int = 0  # hash ids seen as another vLLM block hash too
    num_block_conflicts: int = 0  # vLLM block hashes seen for another hash id too
    num_unhashed: int = 0  # compared blocks whose vLLM hash the capture does not list
    disagreements: list[dict[str, Any]] = field(default_factory=list)  # first MAX_LISTED

    @property
    def agreement(self) -> float | None:
        return None if not self.num_blocks else (self.both + self.neither) / self.num_blocks

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("id_to_block", "block_to_id")}
        d["num_mapped_ids"] = len(self.id_to_block)
        d["agreement"] = self.agreement
        return d


def engine_prompt_blocks(trace, request_ids: set[str]) -> dict[str, list[int]]:
    """Each engine request's vLLM block hashes in prompt order: the blocks it hit (`touched`), then those it
    cached, each hash once (a preempted request touches and caches again)."""
    ev = trace.sql("SELECT request_id, block_hash FROM block_events WHERE event IN ('touched', 'cached') "
                   "AND block_hash IS NOT NULL ORDER BY seq")
    out: dict[str, list[int]] = {}
    seen: dict[str, set[int]] = {}
    for rid, h in ev.iter_rows():
        if rid in request_ids and h not in seen.setdefault(rid, set()):
            seen[rid].add(h)
            out.setdefault(rid, []).append(int(h))
    return out


def compare_blocks(lines: Sequence[dict], engine_request_ids: Sequence[str | None], trace,
                   predicted_hit_blocks: Sequence[int]) -> BlockComparison:
    """Line i of the export (`lines`, the Mooncake records at the engine's block size) against the engine request
    `engine_request_ids[i]` of the capture `trace` (None: the line was not served), with the model's predicted
    hit blocks of line i (`PoolResult.hit_blocks` of the export read back)."""
    if not (len(lines) == len(engine_request_ids) == len(predicted_hit_blocks)):
        raise KmeshTraceError(f"compare_blocks needs one engine request id and one prediction per line: {len(lines)} "
                              f"lines, {len(engine_request_ids)} request ids, {len(predicted_hit_blocks)} predictions.")
    bs = trace.block_size
    if bs is None:
        raise KmeshTraceError("the capture records no block size.")
    inv = {r["request_id"]: r for r in trace.frame("invocations").select(
        "request_id", "num_prompt_tokens", "num_cached_tokens", "num_external_tokens").iter_rows(named=True)}
    wanted = {rid for rid in engine_request_ids if rid is not None}
    unknown = wanted - inv.keys()
    if unknown:
        raise KmeshTraceError(f"{len(unknown)} engine request ids are not in the capture (first: "
                              f"{sorted(unknown)[0]!r}).")
    blocks = engine_prompt_blocks(trace, wanted)
    c = BlockComparison(bs, len(lines))
    for i, (line, rid, pred) in enumerate(zip(lines, engine_request_ids, predicted_hit_blocks)):
        if rid is None:
            continue
        c.num_matched += 1
        row = inv[rid]
        if row["num_prompt_tokens"] != line["input_length"]:
            c.num_misaligned += 1
            continue
        n_full = line["input_length"] // bs
        hit = ((row["num_cached_tokens"] or 0) + (row["num_external_tokens"] or 0)) // bs
        hashes = blocks.get(rid, [])
        for k in range(n_full):
            hid = int(line["hash_ids"][k])
            vh = hashes[k] if k < len(hashes) else None
            if vh is None:
                c.num_unhashed += 1
            else:
                known = c.id_to_block.setdefault(hid, vh)
                c.num_id_conflicts += known != vh
                known_id = c.block_to_id.setdefault(vh, hid)
                c.num_block_conflicts += known_id != hid
            p, m = k < pred, k < hit
            c.num_blocks += 1
            if p and m:
                c.both += 1
            elif p:
                c.predicted_only += 1
            elif m:
                c.measured_only += 1
            else:
                c.neither += 1
            if p != m and len(c.disagreements) < MAX_LISTED:
                c.disagreements.append({"line": i, "block": k, "hash_id": hid, "vllm_block_hash": vh,
                                        "predicted_hit": p, "measured_hit": m})
    return c


def aiperf_engine_ids(records: Sequence[dict], trace) -> list[str | None]:
    """Engine request id per exported line from aiperf 0.13's `profile_export.jsonl` records: line i is the
    conversation `session_<i>` (aiperf names one single-turn session per line, in file order; `session_num` is
    the order it issued them in, which differs where timestamps tie), and vLLM names the request
    `cmpl-<X-Request-Id>-<choice>-<suffix>` after aiperf's `x_request_id`."""
    by_x = {}
    for rid, caller in trace.frame("invocations").select("request_id", "caller_request_id").iter_rows():
        name = caller or rid
        if name.startswith("cmpl-"):
            by_x[name[len("cmpl-"):len("cmpl-") + 36]] = rid  # a uuid4 is 36 characters
    line = {}
    for r in records:
        md = r["metadata"]
        conv = md.get("conversation_id") or ""
        if not conv.startswith("session_") or not conv[len("session_"):].isdigit():
            raise KmeshTraceError(f"aiperf record of conversation {conv!r}: not a session_<N> of a Mooncake replay.")
        line[int(conv[len("session_"):])] = by_x.get(md.get("x_request_id"))
    out: list[str | None] = [None] * (1 + max(line, default=-1))
    for i, rid in line.items():
        out[i] = rid
    return out
