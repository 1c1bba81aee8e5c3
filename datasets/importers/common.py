"""What every importer shares: reading JSONL without losing a line, and writing one engine partition.

A malformed line (invalid UTF-8, broken JSON, a value that is not an object, a record missing a
field or holding one of the wrong type) is counted with its `file:line` and skipped; the import
goes on and the counts land in the trace metadata (`num_malformed_lines`, `malformed_lines`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from kmesh_trace.jsonl_lines import BLANK, BOM, MALFORMED, MALFORMED_REASONS, classify
from kmesh_trace.errors import InputFormatError

#: At most this many malformed locations are listed (all are counted).
MAX_LISTED_MALFORMED = 1000
#: Invocations per Parquet part.
ROWS_PER_PART = 200_000


class RecordError(ValueError):
    """A JSON object that does not have the fields a format needs."""


@dataclass
class ImportReport:
    format: str
    source: str
    out: str
    engine_id: str
    num_lines: int = 0
    num_blank_lines: int = 0
    num_invocations: int = 0
    num_block_hashes: int = 0
    num_lineage_edges: int = 0
    num_malformed_lines: int = 0
    malformed_lines: list[str] = field(default_factory=list)
    malformed_reasons: dict[str, int] = field(default_factory=dict)

    def malformed(self, where: str, reason: str) -> None:
        self.num_malformed_lines += 1
        self.malformed_reasons[reason] = self.malformed_reasons.get(reason, 0) + 1
        if len(self.malformed_lines) < MAX_LISTED_MALFORMED:
            self.malformed_lines.append(f"{where}: {reason}")

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def iter_lines(path: Path, report: ImportReport, on_bytes: Callable[[int], None] | None = None) -> Iterator[tuple[int, bytes]]:
    """Yield (line number, physical line without its newline) for every line, counted in `report.num_lines`; a
    UTF-8 byte-order mark opening the file is not part of the first line."""
    if not path.is_file():
        raise InputFormatError(f"{path} is not a readable file.")
    try:
        yield from _lines(path, report, on_bytes)
    except OSError as e:  # a read error in the middle of the file carries no file name of its own
        raise InputFormatError(f"cannot read {path}: {e.strerror or type(e).__name__}; lines before the failure "
                               f"({report.num_lines:,}) were read, but the import stopped.") from None


def _lines(path: Path, report: ImportReport, on_bytes) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            report.num_lines += 1
            if on_bytes is not None:
                on_bytes(len(raw))
            if lineno == 1 and raw.startswith(BOM):
                raw = raw[len(BOM):]  # a UTF-8 byte-order mark opens the file, not the record
            yield lineno, raw[:-1] if raw.endswith(b"\n") else raw


def iter_records(path: Path, report: ImportReport, on_bytes: Callable[[int], None] | None = None) -> Iterator[tuple[int, dict]]:
    """Yield (line number, record) for every line that holds a JSON object; count every other line."""
    name = path.name
    for lineno, raw in iter_lines(path, report, on_bytes):
        rec = record_of(raw, report, name, lineno)
        if rec is not None:
            yield lineno, rec


def record_of(raw: bytes, report: ImportReport, name: str, lineno: int) -> dict | None:
    """The JSON object physical line `raw` (no newline) holds, or None: a blank line counted in `report`, a
    malformed one reported as `name:lineno`. The audit's classifier: one definition of blank, record and
    malformed for the project."""
    kind, obj = classify(raw)
    if kind == BLANK:
        report.num_blank_lines += 1
        return None
    if kind == MALFORMED:
        report.malformed(f"{name}:{lineno}", MALFORMED_REASONS[obj.kind])
        return None
    return obj


#: Largest value of an int64 column (counts, ids, times).
MAX_INT64 = (1 << 63) - 1
#: Largest |time| in nanoseconds an int64 column holds.
MAX_NS = MAX_INT64
#: The most tokens one request may declare (input or output): far beyond any context window, and small
#: enough that the token sums of 2^31 requests stay inside int64 (a larger value is the record's error).
MAX_TOKENS = 1 << 32


def require_int(rec: dict, key: str, *, minimum: int = 0, maximum: int = MAX_INT64) -> int:
    """An integer field in [minimum, maximum] (an int64 column by default); a float holding a whole number
    counts (JSON writers emit 16.0), infinities, NaN and out-of-range values are the record's error."""
    v = rec.get(key)
    if type(v) is int and minimum <= v <= maximum:  # the common case, first
        return v
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():  # False for inf and NaN
            v = int(v)
        else:
            raise RecordError(f"field {key} missing or not an integer")
    if v < minimum:
        raise RecordError(f"field {key} below {minimum}")
    if v > maximum:
        raise RecordError(f"field {key} is out of range (above {maximum})")
    return v


def require_number(rec: dict, key: str) -> float:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
        raise RecordError(f"field {key} missing or not a finite number")
    return v


def require_time_ns(rec: dict, key: str, ns_per_unit: int) -> int:
    """A timestamp field in `ns_per_unit` nanoseconds per unit, as whole nanoseconds (half to even)."""
    v = require_number(rec, key)
    try:
        ns = round(v * ns_per_unit)  # an int beyond a float's range, or a product that overflows, fails here
    except (OverflowError, ValueError):
        raise RecordError(f"field {key} is out of range") from None
    if abs(ns) > MAX_NS:
        raise RecordError(f"field {key} is out of range")
    return ns


def hashes_are_u64(hashes: list) -> bool:
    """Every value is a 64-bit unsigned integer (what `require_hash_list` asks of each), checked at once."""
    return not hashes or (set(map(type, hashes)) == {int} and min(hashes) >= 0 and max(hashes) < 1 << 64)


def require_hash_list(rec: dict, key: str) -> list[int]:
    v = rec.get(key)
    if not isinstance(v, list):
        raise RecordError(f"field {key} missing or not a list")
    for h in v:
        if isinstance(h, bool) or not isinstance(h, int) or h < 0 or h >= 1 << 64:
            raise RecordError(f"field {key} holds a value that is not a 64-bit unsigned integer")
    return v

