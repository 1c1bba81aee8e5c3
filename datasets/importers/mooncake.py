"""Importer for the Mooncake FAST'25 trace format (JSONL, one request per line).

Each line: `timestamp` (ms since the trace start), `input_length` and `output_length` (tokens),
`hash_ids` (chained prefix hashes of 512-token blocks; the last block may be partial, so
len(hash_ids) == ceil(input_length / 512)). One invocation per line, in file order; the hashes
are kept as given (they are already prefix hashes). Output blocks are not listed in the format.

One reader, `read_mooncake`, fills one container, `MooncakeColumns`: a compiled parse
(native/kernels/mooncake_lines.c) reads every line in the plain shape (four fields, plain decimal integers)
straight into the columns, and each line it refuses is judged by the plain reader (the project's line
classifier, then `_record_values`), which stores it when it is valid after all (a count written 16.0, an
extra field) and otherwise says exactly why it is malformed. An import is that read, then the rows written as
Parquet parts (`import_mooncake`); an analysis may read the file as it is (`read_mooncake`). `fast=False`
judges every line the plain way: the reference the tests compare the compiled parse with.
"""

from __future__ import annotations

import mmap
from array import array
from pathlib import Path
from typing import Callable

import numpy as np

from kmesh_trace.datasets.importers.common import (
    MAX_TOKENS,
    ROWS_PER_PART,
    ImportReport,
    RecordError,
    hashes_are_u64,
    iter_lines,
    require_int,
    require_time_ns,
)
from kmesh_trace.jsonl_lines import BLANK, BOM, MALFORMED, MALFORMED_REASONS, classify
from kmesh_trace.native.kernels import I32, I64, P, declare, ptr

BLOCK_SIZE = 512
FORMAT = "mooncake"
#: Bytes per read of the compiled parse: the buffer grows (doubling) only for a line longer than it.
CHUNK_BYTES = 4 << 20
#: Why a row whose hashes are not all 64-bit unsigned integers is malformed.
HASH_FAULT = "field hash_ids holds a value that is not a 64-bit unsigned integer"

REFUSED, _ROOM = -1, -2  # native/kernels/mooncake_lines.c's MC_REFUSED, MC_ROOM
_ROWS, _HASHES, _LINES, _BLANK, _AT, _END, _NEXT = range(7)  # its counts' slots
_BRACES, _NUMBERS, _NEWLINES = range(3)  # its bounds' slots

_bounds = declare("ks_mooncake_bounds", [P, I64, P])
_parse = declare("ks_mooncake_parse", [P, I64, I32, I64, P, P, P, P, P, P, I64, I64, P], I64)


class MooncakeColumns:
    """The rows of a Mooncake file (row i: the i-th valid line): int64 arrays per row, the hashes flattened into
    one array('Q') (8 bytes each, not a Python int each) with offsets; `part_ends`: the row each Parquet part of an
    import ends before."""

    def __init__(self, num_rows: int = 0, num_hashes: int = 0) -> None:
        self.lineno = np.zeros(num_rows, np.int64)  # input line of each row, to name it
        self.arrival_ns = np.zeros(num_rows, np.int64)
        self.num_prompt_tokens = np.zeros(num_rows, np.int64)
        self.num_output_tokens = np.zeros(num_rows, np.int64)
        self.offsets = np.zeros(num_rows + 1, np.int64)
        self.hashes = array("Q", [0]) * num_hashes
        self.part_ends: list[int] = []

    def __len__(self) -> int:
        return len(self.lineno)

    def table(self, lo: int, hi: int, block_size: int = BLOCK_SIZE) -> dict:
        """Rows lo..hi as the invocations table's columns (seq = row)."""
        import pyarrow as pa

        off = self.offsets[lo:hi + 1]
        values = np.frombuffer(self.hashes, np.uint64)[off[0]:off[-1]]
        seq = pa.array(np.arange(lo, hi, dtype=np.int64))
        return {
            "request_id": seq.cast(pa.string()),
            "seq": seq,
            "num_prompt_tokens": self.num_prompt_tokens[lo:hi],
            "num_output_tokens": self.num_output_tokens[lo:hi],
            "prompt_block_hashes": pa.ListArray.from_arrays(pa.array(off - off[0], pa.int32()), pa.array(values)),
            "arrival_ns": self.arrival_ns[lo:hi],
        }


def engine_metadata(src: Path, block_size: int = BLOCK_SIZE) -> dict:
    """The engine metadata of an import of `src` (the writer adds its own bookkeeping)."""
    return {"block_size": block_size, "engine": "mooncake trace",
            "capture_config": {"format": FORMAT, "source_file": src.name}}


def import_mooncake(src: str | Path, out: str | Path, *, engine_id: str = "import-mooncake",
                    on_bytes: Callable[[int], None] | None = None, fast: bool = True,
                    block_size: int = BLOCK_SIZE) -> ImportReport:
    """Import one Mooncake JSONL file: `read_mooncake`, then its rows written. `block_size`: tokens per hash id
    (512 in the published traces; a file exported at another `--block-tokens` says its own)."""
    from kmesh_trace.writer import TraceWriter

    src = Path(src)
    writer = TraceWriter(out, engine_id, engine_metadata(src, block_size), source=f"import:{FORMAT}")
    cols, report = read_mooncake(src, engine_id=engine_id, on_bytes=on_bytes, fast=fast, block_size=block_size)
    report.out = str(out)
    lo = 0
    for hi in cols.part_ends:
        if hi > lo:
            writer.write("invocations", cols.table(lo, hi))
        lo = hi
    writer.update_metadata(num_malformed_lines=report.num_malformed_lines, malformed_lines=report.malformed_lines)
    writer.close()
    return report


def read_mooncake(src: str | Path, *, engine_id: str = "import-mooncake", on_bytes: Callable[[int], None] | None = None,
                  fast: bool = True, block_size: int = BLOCK_SIZE) -> tuple[MooncakeColumns, ImportReport]:
    """The rows of Mooncake JSONL file `src` (in file order) and the report of reading it, every bad line named.
    The compiled parse reads the file in chunks, the plain reader judges the lines it refuses; `fast=False` (or a
    file that changes or fails while read) has the plain reader judge every line."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, not {block_size}")
    src = Path(src)
    report = ImportReport(FORMAT, str(src), "", engine_id)
    judge = _Judge(block_size)
    cols = _read_compiled(src, judge, report, on_bytes) if fast and src.is_file() else None
    if cols is None:
        report, judge = ImportReport(FORMAT, str(src), "", engine_id), _Judge(block_size)
        cols = _read_plain(src, judge, report, on_bytes)
    report.num_blank_lines += judge.num_blank
    _report_faults(cols, judge, report, src.name)
    report.num_invocations, report.num_block_hashes = len(cols), len(cols.hashes)
    return cols, report


def read_mooncake_as_written(src: str | Path, *, engine_id: str = "import-mooncake"
                             ) -> tuple[MooncakeColumns, ImportReport, int]:
    """`read_mooncake` at the tokens per hash id the file was written with: 512 (the published traces) unless
    its lines' hash_ids counts fit only another size (an export at `--block-tokens 32`), which is then
    inferred from them. (columns, report, block size)."""
    cols, report = read_mooncake(src, engine_id=engine_id)
    if not any("hash_ids has" in line for line in report.malformed_lines):
        return cols, report, BLOCK_SIZE
    block_size = fitting_block_size(Path(src))
    if block_size is None or block_size == BLOCK_SIZE:
        return cols, report, BLOCK_SIZE
    cols2, report2 = read_mooncake(src, engine_id=engine_id, block_size=block_size)
    if report2.num_malformed_lines >= report.num_malformed_lines:
        return cols, report, BLOCK_SIZE
    return cols2, report2, block_size


def fitting_block_size(src: Path) -> int | None:
    """The tokens per hash id that every line's counts fit (len(hash_ids) == ceil(input_length / size)): the
    largest power of two among them, else the smallest; None when no size fits them all."""
    lo, hi = 1, MAX_TOKENS
    for _, raw in iter_lines(src, ImportReport(FORMAT, str(src), "", "")):
        kind, obj = classify(raw)
        if kind in (BLANK, MALFORMED) or not isinstance(obj, dict):
            continue
        n, hashes = obj.get("input_length"), obj.get("hash_ids")
        if type(n) is not int or type(hashes) is not list or n < 1 or not hashes:
            continue
        k = len(hashes)
        lo = max(lo, -(-n // k))
        if k > 1:
            hi = min(hi, (n - 1) // (k - 1))
    if lo > hi:
        return None
    power = 1 << (hi.bit_length() - 1)
    return power if power >= lo else lo


def _record_values(rec: dict, block_size: int = BLOCK_SIZE) -> tuple[int, int, int, list]:
    """(arrival_ns, input tokens, output tokens, hash_ids) of a valid record; RecordError says what is wrong."""
    arrival_ns = require_time_ns(rec, "timestamp", 1_000_000)
    n_in = require_int(rec, "input_length", minimum=1, maximum=MAX_TOKENS)
    n_out = require_int(rec, "output_length", maximum=MAX_TOKENS)
    hashes = rec.get("hash_ids")
    if type(hashes) is not list:
        raise RecordError("field hash_ids missing or not a list")
    if len(hashes) != -(-n_in // block_size):
        raise RecordError(f"hash_ids has {len(hashes)} entries but input_length {n_in} needs {-(-n_in // block_size)}")
    return arrival_ns, n_in, n_out, hashes


class _Judge:
    """The plain reader's verdict on a line: its values when it is a row to store; else the line is counted as
    blank or its fault kept (in line order; a row whose hashes are not all 64-bit unsigned integers apart)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.num_blank = 0
        self.faults: list[tuple[int, str]] = []
        self.hash_faults: list[int] = []

    def __call__(self, lineno: int, raw: bytes) -> tuple[int, int, int, list] | None:
        kind, obj = classify(raw)
        if kind == BLANK:
            self.num_blank += 1
            return None
        if kind == MALFORMED:
            self.faults.append((lineno, MALFORMED_REASONS[obj.kind]))
            return None
        try:
            values = _record_values(obj, self.block_size)
        except RecordError as e:
            self.faults.append((lineno, str(e)))
            return None
        if not hashes_are_u64(values[3]):
            self.hash_faults.append(lineno)
            return None
        return values


def _report_faults(cols: MooncakeColumns, judge: _Judge, report: ImportReport, name: str) -> None:
    """The faults into `report` in the order the import has always listed them, and the import's parts.

    The import takes the rows in batches of ROWS_PER_PART lines that are rows or hold a hash fault (a batch's
    hashes checked at once), so a hash fault is listed once its batch is complete, after the faults of every
    line up to the line that completes it; each batch without its hash faults is one part."""
    taken = cols.lineno
    if judge.hash_faults:
        taken = np.sort(np.concatenate([taken, np.array(judge.hash_faults, np.int64)]))
    closing = taken[ROWS_PER_PART - 1::ROWS_PER_PART]  # the line that completes each full batch
    cols.part_ends = np.searchsorted(cols.lineno, closing, side="right").tolist() + [len(cols)]
    faults: list[tuple] = judge.faults
    if judge.hash_faults:
        batch = np.searchsorted(taken, judge.hash_faults) // ROWS_PER_PART
        closes = [int(closing[b]) if b < len(closing) else float("inf") for b in batch.tolist()]
        faults = sorted([(lineno, 0, lineno, why) for lineno, why in judge.faults]
                        + [(c, 1, lineno, HASH_FAULT) for c, lineno in zip(closes, judge.hash_faults)])
        faults = [(lineno, why) for _, _, lineno, why in faults]
    for lineno, why in faults:
        report.malformed(f"{name}:{lineno}", why)


def _read_plain(src: Path, judge: _Judge, report: ImportReport, on_bytes) -> MooncakeColumns:
    """Every line judged by the plain reader."""
    lineno, arrival, n_in, n_out, offsets, hashes = [], [], [], [], [0], array("Q")
    for at, raw in iter_lines(src, report, on_bytes):
        values = judge(at, raw)
        if values is not None:
            lineno.append(at)
            arrival.append(values[0])
            n_in.append(values[1])
            n_out.append(values[2])
            hashes.extend(values[3])
            offsets.append(len(hashes))
    cols = MooncakeColumns()
    cols.lineno, cols.arrival_ns = np.array(lineno, np.int64), np.array(arrival, np.int64)
    cols.num_prompt_tokens, cols.num_output_tokens = np.array(n_in, np.int64), np.array(n_out, np.int64)
    cols.offsets, cols.hashes = np.array(offsets, np.int64), hashes
    return cols


def _read_compiled(src: Path, judge: _Judge, report: ImportReport, on_bytes) -> MooncakeColumns | None:
    """The file read by the compiled parse, each line it refuses judged by `judge`; None when reading fails or
    the file changes between the passes (the plain reader then reads it all, and says how it fails)."""
    try:
        with open(src, "rb") as f, ReadBuffer(CHUNK_BYTES) as buf:
            reader = _Compiled(*_column_sizes(f, buf), judge)
            f.seek(0)
            have = 0
            while True:
                if have == buf.size:  # one line longer than the buffer
                    buf.grow()
                n = f.readinto(buf.view[have:])
                if on_bytes is not None and n:
                    on_bytes(n)
                length, at_end = have + n, n == 0
                used = reader.parse(buf.array, length, at_end)
                if used is None:
                    return None
                if at_end:
                    report.num_lines, report.num_blank_lines = reader.num_lines, reader.num_blank_lines
                    return reader.trimmed()
                buf.array[:length - used] = buf.array[used:length]
                have = length - used
    except OSError:
        return None


class _Compiled:
    """The columns the compiled parse fills (sized by the first pass), and the rows the judge adds."""

    def __init__(self, num_rows: int, num_hashes: int, judge: _Judge) -> None:
        self.cols = MooncakeColumns(num_rows, num_hashes)
        self.judge = judge
        # written through a numpy view (the bound is within three per row of the count, and a run split by a block)
        self._hash_view = np.frombuffer(self.cols.hashes, np.uint64) if num_hashes else np.zeros(1, np.uint64)
        self.counts = np.zeros(7, np.int64)

    @property
    def num_lines(self) -> int:
        return int(self.counts[_LINES])

    @property
    def num_blank_lines(self) -> int:
        return int(self.counts[_BLANK])

    def parse(self, buf: np.ndarray, length: int, at_end: bool) -> int | None:
        """Bytes of buf[:length] consumed (whole lines; each refused one judged), or None when the columns are full."""
        c, counts, pos = self.cols, self.counts, 0
        while True:
            used = _parse(ptr(buf[pos:length], np.uint8), length - pos, at_end, self.judge.block_size,
                          ptr(c.lineno, np.int64), ptr(c.arrival_ns, np.int64), ptr(c.num_prompt_tokens, np.int64),
                          ptr(c.num_output_tokens, np.int64), ptr(c.offsets, np.int64),
                          ptr(self._hash_view, np.uint64), len(c.lineno), len(c.hashes), ptr(counts, np.int64))
            if used >= 0:
                return pos + used
            if used != REFUSED or not self._judged(buf[pos + counts[_AT]:pos + counts[_END]].tobytes()):
                return None
            pos += int(counts[_NEXT])

    def _judged(self, raw: bytes) -> bool:
        """The refused line `raw` judged, and stored when it is a row; False when the columns have no room."""
        lineno = int(self.counts[_LINES])
        if lineno == 1 and raw.startswith(BOM):
            raw = raw[len(BOM):]
        values = self.judge(lineno, raw)
        if values is None:
            return True
        c, row, h = self.cols, int(self.counts[_ROWS]), int(self.counts[_HASHES])
        end = h + len(values[3])
        if row >= len(c.lineno) or end > len(c.hashes):
            return False
        c.lineno[row], c.arrival_ns[row], c.num_prompt_tokens[row], c.num_output_tokens[row] = lineno, *values[:3]
        self._hash_view[h:end] = values[3]
        c.offsets[row + 1] = end
        self.counts[_ROWS], self.counts[_HASHES] = row + 1, end
        return True

    def trimmed(self) -> MooncakeColumns:
        """The columns cut to what was stored (the sizes are upper bounds)."""
        c, rows = self.cols, int(self.counts[_ROWS])
        for name in ("lineno", "arrival_ns", "num_prompt_tokens", "num_output_tokens"):
            setattr(c, name, getattr(c, name)[:rows])
        c.offsets = c.offsets[:rows + 1]
        del self._hash_view  # the array may shrink (in place) once no view holds it
        del c.hashes[int(self.counts[_HASHES]):]
        return c


def _column_sizes(f, buf: "ReadBuffer") -> tuple[int, int]:
    """(rows, hashes) that bound the columns of the file `f` reads (the first pass): a row is a line holding a
    '{', a hash a run of digits."""
    bounds = np.zeros(3, np.int64)
    while n := f.readinto(buf.view):
        _bounds(ptr(buf.array, np.uint8), n, ptr(bounds, np.int64))
    return int(min(bounds[_BRACES], bounds[_NEWLINES] + 1)), int(bounds[_NUMBERS])


class ReadBuffer:
    """The reused read buffer, an anonymous mapping of its own: a malloc'd one would raise the allocator's
    mmap threshold to its size when freed, and every later allocation below it would stay on the heap
    (~15 MB more resident over a whole analysis at 16 MB)."""

    def __init__(self, size: int) -> None:
        self.size = 0
        self._map(max(size, mmap.PAGESIZE))

    def _map(self, size: int, keep: int = 0) -> None:
        m = mmap.mmap(-1, size)
        if keep:
            m[:keep] = self.array[:keep]
        self.close()
        self.mm, self.size = m, size
        self.array = np.frombuffer(m, np.uint8)
        self.view = memoryview(m)

    def grow(self) -> None:
        """Twice the room, the bytes held kept."""
        self._map(2 * self.size, self.size)

    def close(self) -> None:
        if self.size:
            self.view.release()
            del self.array
            self.mm.close()
            self.size = 0

    def __enter__(self) -> "ReadBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PlainPieces:
    """Room for every row and hash a buffer of `buf_size` bytes can hold (a row takes more than 8 bytes, a hash
    at least 2), filled by the compiled parse, piece after piece (the bounded-memory curve's reader,
    oracle/streamed_curve.py); the line counts
    carried over from `old`. A line the parse refuses ends the read: this path takes the plain shape only."""

    def __init__(self, buf_size: int, block_size: int, old: "PlainPieces | None" = None) -> None:
        rows, hashes = buf_size // 8 + 1, buf_size // 2 + 1
        self.block_size = block_size
        self.lineno, self.arrival_ns, self.num_prompt_tokens, self.num_output_tokens = (
            np.empty(rows, np.int64) for _ in range(4))
        self.offsets = np.zeros(rows + 1, np.int64)
        self._hash_view = np.zeros(hashes, np.uint64)
        self.counts = np.zeros(7, np.int64) if old is None else old.counts.copy()

    def parse(self, buf: np.ndarray, length: int, at_end: bool) -> int:
        """Bytes of buf[:length] consumed (whole lines), or a negative code (the line refused, or no room)."""
        return _parse(ptr(buf, np.uint8), length, at_end, self.block_size, ptr(self.lineno, np.int64),
                      ptr(self.arrival_ns, np.int64), ptr(self.num_prompt_tokens, np.int64),
                      ptr(self.num_output_tokens, np.int64), ptr(self.offsets, np.int64),
                      ptr(self._hash_view, np.uint64), len(self.lineno), len(self._hash_view), ptr(self.counts, np.int64))
