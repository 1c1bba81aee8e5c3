"""A trace's requests as Mooncake JSONL, the format replay clients read (aiperf's `mooncake_trace` dataset).

One line per request of one engine partition, in arrival order: `timestamp` (ms after the first request),
`input_length`, `output_length` and `hash_ids`, one id per `block_tokens` tokens of the prompt (the last block
may be partial), chained so that two requests share an id exactly when their prompts agree on every token up to
the end of that block. Where the ids come from:

- a trace whose rows list block hashes at `block_tokens` tokens (a Mooncake import) keeps them as listed, so a
  Mooncake file read back and exported gives its own lines again;
- a trace with prompt token ids (a capture) hashes each block's tokens chained with its parent's, at any
  `block_tokens`, and numbers the distinct hashes from 0 in order of first use;
- a trace with block hashes at another block size groups them when `block_tokens` is a multiple of that size
  (the id of a group is the chained hash of its last block), or splits each into sub-blocks when it is a
  divisor (one id per listed hash and position in it: the sub-blocks of a partial last block are taken to be
  the first sub-blocks of the full block with that hash, as a replay client's synthesised text makes them);
  a prompt tail the listed hashes do not cover gets an id of its own.

Optional fields, for aiperf 0.13's loader (`aiperf/dataset/loader/models.py`, `MooncakeTrace`):
`session_id` (the request's family, with `sessions`), and `extra`, which aiperf merges into the request body
at dispatch: `extra.prompt` carries the exact prompt token ids (`token_ids`; vLLM's `/v1/completions` takes
a list of ids as the prompt, so the engine sees the recorded tokens instead of text aiperf synthesises from
the hash ids; a trace with only hashes gets ids synthesised from them, `synthetic_tokens`), and `extra.ignore_eos` (`ignore_eos`; a model with dummy weights would otherwise stop early).
No field names a line's request: aiperf sends its own `X-Request-Id`, which vLLM takes as the request id
(`kmesh_trace.apps.closed_loop` matches a capture of the replay through aiperf's records instead).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.writer import atomic_output
from kmesh_trace.oracle.stream import RequestBlocks, chain_block_hashes

#: The block size of the Mooncake format (and aiperf's default `--isl-block-size`).
DEFAULT_BLOCK_TOKENS = 512


@dataclass
class ExportSummary:
    path: str
    block_tokens: int
    hash_source: str  # listed (kept as given), tokens (hashed from token ids), grouped or split (listed, regrouped)
    num_lines: int = 0
    num_hash_ids: int = 0
    num_distinct_hash_ids: int = 0
    num_sessions: int = 0
    num_token_id_lines: int = 0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class _Numbering:
    """Chained hashes (or keys of prompt tails no hash covers) -> ids, numbered from `first` in order of first use."""

    def __init__(self, first: int = 0) -> None:
        self.first = first
        self.ids: dict[Any, int] = {}

    def __call__(self, h: Any) -> int:
        return self.ids.setdefault(h, self.first + len(self.ids))


def _hash_source(reqs: Sequence[RequestBlocks], trace_block: int, block_tokens: int) -> str:
    if reqs and all(r.prompt_token_ids is not None for r in reqs):
        return "tokens"
    if trace_block == block_tokens:
        return "listed"
    if block_tokens % trace_block == 0:
        return "grouped"
    if trace_block % block_tokens == 0:
        return "split"
    raise KmeshTraceError(
        f"the trace lists block hashes of {trace_block} tokens, not token ids, so it can be exported only at a "
        f"divisor or a multiple of {trace_block} tokens per hash id; give --block-tokens {trace_block}, a divisor "
        "or a multiple of it.")


def request_hash_ids(r: RequestBlocks, source: str, trace_block: int, block_tokens: int,
                     number: _Numbering) -> list[int]:
    """The hash ids of one request's prompt: ceil(prompt tokens / block_tokens) of them."""
    n_ids = -(-r.num_prompt_tokens // block_tokens)
    if source == "listed":
        tail = [number(("tail", r.index, k)) for k in range(len(r.prompt_hashes), n_ids)]
        return [int(h) for h in r.prompt_hashes[:n_ids]] + tail
    if source == "tokens":
        return [number(h) for h in chain_block_hashes(r.prompt_token_ids, block_tokens, n_ids)]
    if source == "split":  # sub-block j of listed block k: one id per (chained hash, j)
        per = trace_block // block_tokens
        return [number((int(r.prompt_hashes[k // per]), k % per)) if k // per < len(r.prompt_hashes)
                else number(("tail", r.index, k)) for k in range(n_ids)]
    per = block_tokens // trace_block
    out = []
    for k in range(n_ids):
        last = min((k + 1) * per, -(-r.num_prompt_tokens // trace_block)) - 1
        out.append(number(int(r.prompt_hashes[last])) if last < len(r.prompt_hashes) else number(("tail", r.index, k)))
    return out


def _timestamp(ns: int) -> int | float:
    """Milliseconds, an integer when exact (the Mooncake files' own form), else to the microsecond."""
    return ns // 1_000_000 if ns % 1_000_000 == 0 else round(ns / 1_000_000, 3)


def synthetic_tokens(hash_ids: Sequence[int], n: int, block_tokens: int, vocab_size: int) -> list[int]:
    """Token ids for a prompt of `n` tokens given only its hash ids: each id one fixed pseudo-random run of
    `block_tokens` ids in [2, vocab_size) (0 and 1 left to bos and eos), the same wherever the id appears, so
    equal ids are equal tokens and equal prefixes stay equal."""
    import numpy as np

    out: list[int] = []
    for h in hash_ids:
        out += np.random.default_rng(int(h)).integers(2, vocab_size, block_tokens).tolist()
    return out[:n]


def mooncake_records(reqs: Sequence[RequestBlocks], trace_block: int, *, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                     sessions: bool = False, token_ids: bool = False, vocab_size: int | None = None,
                     ignore_eos: bool = False, summary: ExportSummary | None = None) -> Iterator[dict[str, Any]]:
    """The Mooncake records of `reqs` (in arrival order, as `Workload.from_trace` gives them). `token_ids` on a
    trace with only block hashes synthesises the ids from the hash ids (`synthetic_tokens`, needs `vocab_size`)."""
    source = _hash_source(reqs, trace_block, block_tokens)
    if token_ids and source != "tokens" and not vocab_size:
        raise KmeshTraceError("the trace has no prompt token ids (only block hashes); give --vocab-size to synthesise "
                              "them from the hash ids, or export without --token-ids.")
    if vocab_size is not None and vocab_size < 3:
        raise KmeshTraceError("--vocab-size must be at least 3 (ids 0 and 1 are left to bos and eos).")
    missing = [r.request_id for r in reqs if r.arrival_ns is None]
    if missing:
        raise KmeshTraceError(f"{len(missing)} requests have no arrival time (first: {missing[0]!r}); Mooncake lines "
                              "need one each.")
    # Listed hashes are kept; the ids of tails they do not cover start above the largest.
    first = 1 + max((int(h) for r in reqs for h in r.prompt_hashes), default=-1) if source == "listed" else 0
    number = _Numbering(first)
    t0 = min((r.arrival_ns for r in reqs), default=0)
    for i, r in enumerate(reqs):
        rec: dict[str, Any] = {"timestamp": _timestamp(r.arrival_ns - t0), "input_length": r.num_prompt_tokens,
                               "output_length": r.num_output_tokens,
                               "hash_ids": request_hash_ids(r, source, trace_block, block_tokens, number)}
        if sessions and r.family_id is not None:
            rec["session_id"] = r.family_id
        extra: dict[str, Any] = {}
        if token_ids and source == "tokens":
            extra["prompt"] = list(map(int, r.prompt_token_ids))
        elif token_ids:
            extra["prompt"] = synthetic_tokens(rec["hash_ids"], r.num_prompt_tokens, block_tokens, vocab_size)
        if ignore_eos:
            extra["ignore_eos"] = True
        if extra:
            rec["extra"] = extra
        if summary is not None:
            summary.num_lines += 1
            summary.num_hash_ids += len(rec["hash_ids"])
            summary.num_token_id_lines += token_ids
        yield rec
    if summary is not None:
        listed = {int(h) for r in reqs for h in r.prompt_hashes} if source == "listed" else set()
        summary.num_distinct_hash_ids = len(number.ids) + len(listed)
        summary.num_sessions = len({r.family_id for r in reqs if r.family_id is not None}) if sessions else 0


def export_mooncake(trace, out: str | Path, *, engine: str | None = None, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                    sessions: bool = False, token_ids: bool = False, vocab_size: int | None = None,
                    ignore_eos: bool = False) -> ExportSummary:
    """Write engine partition `engine` of `trace` (an open trace) as Mooncake JSONL to `out`."""
    from kmesh_trace.oracle.workload import Workload

    if block_tokens < 1:
        raise KmeshTraceError("--block-tokens must be at least 1.")
    w = Workload.from_trace(trace, engine)
    reqs = list(w.requests)
    summary = ExportSummary(str(out), block_tokens, _hash_source(reqs, w.block_size, block_tokens))
    if not token_ids and summary.hash_source == "tokens" and w.block_size != block_tokens:
        summary.notes.append(f"hash ids cover {block_tokens} tokens; the trace's engine used blocks of {w.block_size}: "
                             f"replay with aiperf's --isl-block-size {block_tokens}.")
    with atomic_output(out) as tmp, open(tmp, "w") as f:  # a failure part-way leaves neither OUT nor a temporary
        for rec in mooncake_records(reqs, w.block_size, block_tokens=block_tokens, sessions=sessions,
                                    token_ids=token_ids, vocab_size=vocab_size, ignore_eos=ignore_eos,
                                    summary=summary):
            f.write(json.dumps(rec) + "\n")
    return summary
