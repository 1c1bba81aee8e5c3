"""Edges derivable from content only: never lineage, only a hint of how calls in a session relate.

Within a session (the records sharing a session key's value; without one, the records of one file)
ordered by timestamp, then file and line, each consecutive pair is tested two ways:
- `input_extends_previous`: the next input starts with the whole previous input and is longer
  (strings by prefix, message lists by leading elements);
- `previous_output_in_next_input`: the previous output (a string of at least MIN_OUTPUT_CHARS
  characters; shorter ones match by chance) reappears in the next input.
A pair may show both; `pairs_with_edge` counts pairs with either. Pairs whose timestamps are equal
are counted as `timestamp_ties`: their order is the file order, not a measured one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

MIN_OUTPUT_CHARS = 16


class SessionRecord(NamedTuple):
    session: tuple | None  # (key, value) or None
    ts: float | None
    where: int  # packed file index << 32 | line
    input: Any
    output: Any


@dataclass
class ContentEdges:
    sessions: int = 0
    records_without_session: int = 0
    pairs: int = 0
    input_extends_previous: int = 0
    previous_output_in_next_input: int = 0
    pairs_with_edge: int = 0
    timestamp_ties: int = 0

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def combine(cls, parts: list[ContentEdges]) -> ContentEdges:
        total = cls()
        for p in parts:
            for f in fields(cls):
                setattr(total, f.name, getattr(total, f.name) + getattr(p, f.name))
        return total


def extends(prev: Any, cur: Any) -> bool:
    if type(prev) is str and type(cur) is str:
        return len(cur) > len(prev) and cur.startswith(prev)
    if type(prev) is list and type(cur) is list:
        try:
            return len(cur) > len(prev) and cur[: len(prev)] == prev
        except RecursionError:  # messages nested beyond what == can compare: no claim
            return False
    return False


def reappears(output: Any, cur_input: Any, start: int = 0) -> bool:
    """Whether `output` occurs in `cur_input` (a string or a message list).

    For a string, the part from `start` on is searched first, where a new output usually lands;
    the rest only when that misses, so the answer is the same as a plain `in`.
    """
    if type(output) is not str or len(output.strip()) < MIN_OUTPUT_CHARS:
        return False
    if type(cur_input) is str:
        if cur_input.find(output, start) >= 0:
            return True
        return start > 0 and cur_input.find(output, 0, start + len(output) - 1) >= 0
    if type(cur_input) is list:
        for m in cur_input:
            if type(m) is str and output in m:
                return True
            if type(m) is dict and type(m.get("content")) is str and output in m["content"]:
                return True
    return False


def _order(r: SessionRecord) -> tuple:
    return (r.ts is None, r.ts if r.ts is not None else -math.inf, r.where)


def sessions(records: list[SessionRecord]) -> dict[tuple, list[SessionRecord]]:
    """Records grouped by session (without one: by file), each group in timestamp, file, line order."""
    groups: dict[tuple, list[SessionRecord]] = {}
    for r in records:
        key = ("file", r.where >> 32) if r.session is None else ("session",) + r.session
        groups.setdefault(key, []).append(r)
    for group in groups.values():
        group.sort(key=_order)
    return groups


def pair_edges(prev: SessionRecord, cur: SessionRecord) -> tuple[bool, bool]:
    """(input_extends_previous, previous_output_in_next_input) for one consecutive pair."""
    e1 = extends(prev.input, cur.input)
    # When the input extends the previous one, a new output lands after it: search there first.
    start = max(0, len(prev.input) - len(prev.output)) if e1 and type(prev.output) is str else 0
    return e1, reappears(prev.output, cur.input, start)


def content_edges(records: list[SessionRecord]) -> ContentEdges:
    out = ContentEdges()
    out.records_without_session = sum(r.session is None for r in records)
    groups = sessions(records)
    out.sessions = len(groups)
    for group in groups.values():
        for prev, cur in zip(group, group[1:]):
            out.pairs += 1
            if prev.ts is not None and prev.ts == cur.ts:
                out.timestamp_ties += 1
            e1, e2 = pair_edges(prev, cur)
            out.input_extends_previous += e1
            out.previous_output_in_next_input += e2
            out.pairs_with_edge += e1 or e2
    return out
