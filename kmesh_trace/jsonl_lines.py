"""Reading JSONL without losing a line: the physical-line splitter and the one-line classifier.

A physical line is what `data.split(b"\\n")` yields, less the empty piece after a final newline, so
a file's physical lines are its newlines plus one for an unterminated last line. Every physical
line is classified exactly once, and nothing here raises on any input:

- blank: only JSON whitespace (space, tab, CR); other control bytes are not blank;
- record: strict JSON (RFC 8259) whose top-level value is an object;
- malformed, with a kind: `invalid_utf8`, `broken_json`, `nonstandard_literal` (NaN, Infinity,
  -Infinity: accepted by Python's json, not JSON), `too_deep` (nesting beyond the parser's
  recursion limit) or `not_object` (valid JSON, but not an object).

A UTF-8 byte-order mark is tolerated at the start of a file only (the reader strips it and says so);
anywhere else it is broken JSON. Duplicate keys keep the last value, as every JSON parser here does.
The reader hashes the file (SHA-256) as it goes, so the audit reads each byte once.

A leaf of the base (it imports only the standard library): the corpus audit (`kmesh_trace.audit.corpus`)
and the importers (`kmesh_trace.datasets.importers`) classify lines with it alike.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

BOM = b"\xef\xbb\xbf"
CHUNK_BYTES = 1 << 22

RECORD = 0
BLANK = 1
MALFORMED = 2

MALFORMED_KINDS = ("invalid_utf8", "broken_json", "nonstandard_literal", "too_deep", "not_object")
#: Each malformed kind in words, for reports that list bad lines.
MALFORMED_REASONS = {
    "invalid_utf8": "invalid UTF-8",
    "broken_json": "broken JSON",
    "nonstandard_literal": "NaN or Infinity, which JSON does not allow",
    "too_deep": "JSON nested too deep",
    "not_object": "JSON value is not an object",
}


class _NonStandard(ValueError):
    pass


def _refuse_constant(name: str):
    raise _NonStandard(name)


# One decoder for every line: json.loads(**kw) would build a new decoder per call.
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)
_JSON_WS = b" \t\r"


@dataclass(frozen=True)
class Malformed:
    """Why a non-blank line is not a record; `column` is 1-based (bytes for UTF-8, characters for JSON)."""

    kind: str
    column: int | None = None


def is_blank(raw: bytes) -> bool:
    """A physical line (no newline) holding only JSON whitespace."""
    return not raw.strip(_JSON_WS)


def classify(raw: bytes) -> tuple[int, object]:
    """(RECORD, dict) | (BLANK, None) | (MALFORMED, Malformed) for one physical line (no newline)."""
    if is_blank(raw):
        return BLANK, None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return MALFORMED, Malformed("invalid_utf8", e.start + 1)
    try:
        obj = _DECODER.decode(text)
    except _NonStandard:
        return MALFORMED, Malformed("nonstandard_literal")
    except json.JSONDecodeError as e:
        return MALFORMED, Malformed("broken_json", e.colno)
    except RecursionError:
        return MALFORMED, Malformed("too_deep")
    except ValueError:  # e.g. an integer literal longer than Python's int-string limit
        return MALFORMED, Malformed("broken_json")
    if type(obj) is not dict:
        return MALFORMED, Malformed("not_object")
    return RECORD, obj


@dataclass
class FileRead:
    """What reading one file established besides its lines; complete once the iterator is drained."""

    sha256: str = ""
    num_bytes: int = 0
    bom: bool = False


def iter_physical_lines(f: BinaryIO, info: FileRead, on_bytes: Callable[[int], None] | None = None,
                        chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Yield each physical line of `f` (without its newline), hashing every byte into `info`.

    Lines longer than a chunk are joined from pieces once, so a huge line costs linear time.
    """
    h = hashlib.sha256()
    pending: list[bytes] = []
    first = True
    while True:
        chunk = f.read(chunk_bytes)
        if not chunk:
            break
        h.update(chunk)
        info.num_bytes += len(chunk)
        if on_bytes is not None:
            on_bytes(len(chunk))
        if first:
            first = False
            if chunk.startswith(BOM):
                info.bom = True
                chunk = chunk[len(BOM):]
            elif len(chunk) < len(BOM) and BOM.startswith(chunk):
                # A short first read that may be the start of a BOM: decide with more bytes.
                more = f.read(len(BOM) - len(chunk))
                h.update(more)
                info.num_bytes += len(more)
                chunk += more
                if chunk.startswith(BOM):
                    info.bom = True
                    chunk = chunk[len(BOM):]
        start = 0
        find = chunk.find
        while True:
            i = find(b"\n", start)
            if i < 0:
                if start < len(chunk):
                    pending.append(chunk[start:])
                break
            if pending:
                pending.append(chunk[start:i])
                line = b"".join(pending)
                pending = []
            else:
                line = chunk[start:i]
            yield line
            start = i + 1
    if pending:
        yield b"".join(pending)
    info.sha256 = h.hexdigest()


def count_physical_lines(data: bytes) -> int:
    """The reference count the reader must match: newlines plus an unterminated last line."""
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
