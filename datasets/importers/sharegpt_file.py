"""A ShareGPT file read one conversation at a time when it must be: a conversation nested deeper than JSON
readers allow (Python's recursion limit) is that conversation's error, not the file's."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

#: A JSON string, a bracket or a comma: what splitting the top-level list needs to see.
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{},]')


@dataclass
class Unparsed:
    """A conversation that could not be read, and why."""

    reason: str


def load_conversations(data: bytes) -> object:
    """The file's JSON value; for a top-level list too deep to read whole, its elements one by one (an element
    that still fails becomes `Unparsed`). ValueError when the file is not JSON."""
    try:
        return json.loads(data)
    except RecursionError:
        pass
    return [_element(piece) for piece in _top_level_elements(data)]


def _element(piece: bytes) -> object:
    try:
        return json.loads(piece)
    except RecursionError:
        return Unparsed("nested deeper than a JSON reader allows")
    except ValueError:
        return Unparsed("broken JSON")


def _top_level_elements(data: bytes) -> list[bytes]:
    """The raw text of each element of the top-level JSON list `data`; ValueError when it is not a list."""
    start = len(data) - len(data.lstrip())
    if not data[start:start + 1] == b"[":
        raise ValueError("not a JSON list")
    pieces, depth, begin = [], 0, start + 1
    for m in _TOKENS.finditer(data, start):
        tok = m.group()
        if tok in (b"[", b"{"):
            depth += 1
        elif tok in (b"]", b"}"):
            depth -= 1
            if depth == 0:
                pieces.append(data[begin:m.start()])
                break
        elif tok == b"," and depth == 1:
            pieces.append(data[begin:m.start()])
            begin = m.end()
    return [p for p in pieces if p.strip()]
