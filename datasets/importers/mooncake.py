"""Importer for the Mooncake FAST'25 trace format (JSONL, one request per line).

Each line: `timestamp` (ms since the trace start), `input_length` and `output_length` (tokens),
`hash_ids` (chained prefix hashes of 512-token blocks; the last block may be partial, so
len(hash_ids) == ceil(input_length / 512)). One invocation per line, in file order; the hashes
are kept as given (they are already prefix hashes). Output blocks are not listed in the format.

Two readers share one definition of a valid line (`_record_values`) and of a bad one: `import_mooncake`
writes a trace (Arrow's JSON reader first, the plain line-by-line path when any line is off), and
`read_mooncake` returns the same rows in memory without pyarrow (a compiled reader of plain-shaped lines first,
`mooncake_lines`, then msgspec, then the same plain path), for analyses that read the file as it is
(`kmesh_trace.sources`).
"""

from __future__ import annotations

import functools
from array import array
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Callable, Iterator

from kmesh_trace.jsonl_lines import BOM
from kmesh_trace.datasets.importers.common import (
    MAX_NS,
    MAX_TOKENS,
    ROWS_PER_PART,
    ImportReport,
    RecordError,
    hashes_are_u64,
    iter_records,
    require_hash_list,
    require_int,
    require_time_ns,
)

if TYPE_CHECKING:
    import pyarrow as pa

BLOCK_SIZE = 512
FORMAT = "mooncake"


class _Columns:
    """One batch of invocation columns in plain lists; hashes flattened with offsets (no list of lists)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.lineno: list[int] = []  # input line of each row, to name a bad row
        self.num_prompt_tokens: list[int] = []
        self.num_output_tokens: list[int] = []
        self.arrival_ns: list[int] = []
        self.offsets: list[int] = [0]
        self.hashes: list[int] = []

    def __len__(self) -> int:
        return len(self.lineno)

    def add(self, lineno: int, arrival_ns: int, n_in: int, n_out: int, hashes: list[int]) -> None:
        self.lineno.append(lineno)
        self.num_prompt_tokens.append(n_in)
        self.num_output_tokens.append(n_out)
        self.arrival_ns.append(arrival_ns)
        self.hashes.extend(hashes)
        self.offsets.append(len(self.hashes))

    def extend(self, other: "_Columns") -> None:
        base = len(self.hashes)
        for name in ("lineno", "num_prompt_tokens", "num_output_tokens", "arrival_ns", "hashes"):
            getattr(self, name).extend(getattr(other, name))
        self.offsets.extend(base + o for o in other.offsets[1:])

    def row_hashes(self, i: int) -> list[int]:
        return self.hashes[self.offsets[i]:self.offsets[i + 1]]

    def bad_rows(self) -> list[int]:
        """Rows whose hashes are not all 64-bit unsigned integers (the plain, per-value check)."""
        bad = []
        for i in range(len(self)):
            try:
                require_hash_list({"hash_ids": self.row_hashes(i)}, "hash_ids")
            except RecordError:
                bad.append(i)
        return bad

    def drop(self, rows: list[int]) -> None:
        drop = set(rows)
        keep = [i for i in range(len(self)) if i not in drop]
        hashes, offsets = [], [0]
        for i in keep:
            hashes.extend(self.row_hashes(i))
            offsets.append(len(hashes))
        for name in ("lineno", "num_prompt_tokens", "num_output_tokens", "arrival_ns"):
            col = getattr(self, name)
            setattr(self, name, [col[i] for i in keep])
        self.hashes, self.offsets = hashes, offsets

    def table(self, first_seq: int) -> dict:
        import pyarrow as pa

        hashes = pa.ListArray.from_arrays(pa.array(self.offsets, pa.int32()), pa.array(self.hashes, pa.uint64()))
        seq = list(range(first_seq, first_seq + len(self)))
        return {
            "request_id": [str(i) for i in seq],
            "seq": seq,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "prompt_block_hashes": hashes,
            "arrival_ns": self.arrival_ns,
        }


def _fast_schema() -> "pa.Schema":
    import pyarrow as pa

    return pa.schema([("timestamp", pa.float64()), ("input_length", pa.int64()),
                      ("output_length", pa.int64()), ("hash_ids", pa.list_(pa.uint64()))])


_FAST_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_EXACT_NS = 1 << 53
#: Files up to this size go through the fast path (read whole into memory).
FAST_PATH_MAX_BYTES = 1 << 30


def _fast_table(data: bytes, block_size: int = BLOCK_SIZE) -> pa.Table | None:
    """The whole file parsed by Arrow's JSON reader and checked column-wise; None if any line is off.

    None sends the file down the plain line-by-line path, which names every bad line: the fast path
    only ever handles files in which every non-blank line is a valid record."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj

    try:
        t = pj.read_json(pa.BufferReader(data), parse_options=pj.ParseOptions(
            explicit_schema=_fast_schema(), unexpected_field_behavior="ignore"))
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return None
    if any(t.column(c).null_count for c in _FAST_FIELDS):
        return None
    ts, n_in, n_out, hashes = (t.column(c) for c in _FAST_FIELDS)
    need = pc.divide(pc.add(n_in, block_size - 1), block_size)
    # Below 2**53 ns the float product is exact for every integer timestamp, as the plain path's integer
    # arithmetic is; beyond it (over 104 days) the plain path decides.
    in_range = pc.less(pc.abs(pc.multiply(ts, 1_000_000.0)), float(_EXACT_NS))
    ok = pc.and_(pc.and_(pc.and_(pc.is_finite(ts), in_range), pc.greater_equal(n_in, 1)),
                 pc.and_(pc.greater_equal(n_out, 0), pc.equal(pc.list_value_length(hashes), need)))
    if not pc.all(ok).as_py():
        return None
    seq = pa.array(range(t.num_rows), pa.int64())
    return pa.table({
        "request_id": pc.cast(seq, pa.string()),
        "seq": seq,
        "num_prompt_tokens": n_in,
        "num_output_tokens": n_out,
        "prompt_block_hashes": hashes,
        "arrival_ns": pc.cast(pc.round(pc.multiply(ts, 1_000_000.0), round_mode="half_to_even"), pa.int64()),
    })


_JSON_WS = b" \t\r"


def _line_counts(data: bytes) -> tuple[int, int] | None:
    """Physical lines and blank lines, counted as the plain path counts them; None when a line could
    hold other than exactly one record, so the plain path must decide.

    Arrow reads a stream of objects, blind to lines: two records on one line, or one record split
    over two, read the same to it. A line that starts with `{` and ends with `}` cannot be part of a
    record split across lines (the continuation of an object never starts with `{`, and a line it
    continues ends in `:`, `,`, `[` or a value, never in the `}` of a complete object), so when every
    non-blank line does and the row count equals the non-blank line count, each line is one record.
    Invalid UTF-8 anywhere (even in a field the importer ignores) makes the plain path call the line
    malformed, so it sends the file there too."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if lines and lines[0].startswith(BOM):
        lines[0] = lines[0][len(BOM):]
    num_blank = 0
    for line in lines:
        s = line.strip(_JSON_WS)
        if not s:
            num_blank += 1
        elif s[0] != 0x7B or s[-1] != 0x7D:  # "{" ... "}"
            return None
    return len(lines), num_blank


def engine_metadata(src: Path, block_size: int = BLOCK_SIZE) -> dict:
    """The engine metadata of an import of `src` (the writer adds its own bookkeeping)."""
    return {"block_size": block_size, "engine": "mooncake trace",
            "capture_config": {"format": FORMAT, "source_file": src.name}}


def import_mooncake(src: str | Path, out: str | Path, *, engine_id: str = "import-mooncake",
                    on_bytes: Callable[[int], None] | None = None, fast: bool = True,
                    block_size: int = BLOCK_SIZE) -> ImportReport:
    """Import one Mooncake JSONL file; `fast=False` forces the plain line-by-line reference path. `block_size`:
    tokens per hash id (512 in the published traces; a file exported at another `--block-tokens` says its own)."""
    from kmesh_trace.writer import TraceWriter

    src = Path(src)
    report = ImportReport(FORMAT, str(src), str(out), engine_id)
    writer = TraceWriter(out, engine_id, engine_metadata(src, block_size), source=f"import:{FORMAT}")
    if fast and src.is_file() and src.stat().st_size <= FAST_PATH_MAX_BYTES:
        data = src.read_bytes()
        counts = _line_counts(data)
        table = _fast_table(data, block_size) if counts is not None else None
        num_lines, num_blank = counts or (0, 0)
        # Arrow must have read one record per non-blank line, and the direct path (`read_mooncake`) must
        # take the file whole too (Arrow alone also reads NaN or a 5,000-digit number in a field it
        # ignores); anything else goes the plain way, where both paths keep and count the same lines.
        if table is not None and table.num_rows == num_lines - num_blank and _read_whole(src, data, counts):
            for start in range(0, table.num_rows, ROWS_PER_PART):
                writer.write("invocations", table.slice(start, ROWS_PER_PART))
            report.num_lines, report.num_blank_lines = num_lines, num_blank
            report.num_invocations = table.num_rows
            report.num_block_hashes = len(table.column("prompt_block_hashes").combine_chunks().values)
            if on_bytes is not None:
                on_bytes(len(data))
            writer.update_metadata(num_malformed_lines=0, malformed_lines=[])
            writer.close()
            return report
    for cols in _plain_batches(src, report, on_bytes, block_size):
        writer.write("invocations", cols.table(report.num_invocations))
        report.num_invocations += len(cols)
        report.num_block_hashes += len(cols.hashes)
    writer.update_metadata(num_malformed_lines=report.num_malformed_lines, malformed_lines=report.malformed_lines)
    writer.close()
    return report


def _read_whole(src: Path, data: bytes, counts: tuple[int, int]) -> bool:
    """Whether `read_mooncake`'s fast readers take every line of the file (the one decision both the direct
    path and the import make before trusting a fast reader)."""
    from kmesh_trace.datasets.importers.mooncake_lines import read_lines

    return read_lines(src) is not None or _decoded_columns(data, counts[0] - counts[1]) is not None


def read_mooncake(src: str | Path, *, engine_id: str = "import-mooncake", fast: bool = True) -> tuple[_Columns, ImportReport]:
    """The rows `import_mooncake` would write (in file order: row i is seq i) and its report, read into memory
    without pyarrow. A file whose every line is in the plain shape is parsed in chunks by a compiled reader
    straight into columns (`mooncake_lines.read_lines`: int64 arrays, no Python object per value); else msgspec
    decodes the lines when every one is plainly valid, else the plain path decides. The hashes come as one
    array('Q') (8 bytes each, not a Python int each)."""
    src = Path(src)
    report = ImportReport(FORMAT, str(src), "", engine_id)
    if fast and src.is_file():
        from kmesh_trace.datasets.importers.mooncake_lines import read_lines

        lines = read_lines(src)
        if lines is not None:
            cols = _Columns()
            for name in ("lineno", "num_prompt_tokens", "num_output_tokens", "arrival_ns", "offsets", "hashes"):
                setattr(cols, name, getattr(lines, name))
            report.num_lines, report.num_blank_lines = lines.num_lines, lines.num_blank_lines
            report.num_invocations, report.num_block_hashes = len(cols), len(cols.hashes)
            return cols, report
    if fast and src.is_file() and src.stat().st_size <= FAST_PATH_MAX_BYTES:
        data = src.read_bytes()
        counts = _line_counts(data)
        cols = _decoded_columns(data, counts[0] - counts[1]) if counts is not None else None
        if cols is not None:
            report.num_lines, report.num_blank_lines = counts
            report.num_invocations, report.num_block_hashes = len(cols), len(cols.hashes)
            return cols, report
    cols = _Columns()
    cols.hashes = array("Q")  # checked: every hash is a 64-bit unsigned integer
    for batch in _plain_batches(src, report, None):
        cols.extend(batch)
        report.num_invocations += len(batch)
        report.num_block_hashes += len(batch.hashes)
    return cols, report


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


def _plain_batches(src: Path, report: ImportReport, on_bytes, block_size: int = BLOCK_SIZE) -> Iterator[_Columns]:
    """The plain line-by-line path: the valid rows in batches of ROWS_PER_PART, every bad line reported (a
    line whose hashes are not all 64-bit unsigned integers after its batch's other faults: a batch's hashes
    are checked at once, then value by value only when that fails)."""
    cols = _Columns()

    def checked() -> _Columns:
        if not hashes_are_u64(cols.hashes):
            bad = cols.bad_rows()
            for i in bad:
                report.malformed(f"{src.name}:{cols.lineno[i]}", "field hash_ids holds a value that is not a 64-bit unsigned integer")
            cols.drop(bad)
        return cols

    for lineno, rec in iter_records(src, report, on_bytes):
        try:
            values = _record_values(rec, block_size)
        except RecordError as e:
            report.malformed(f"{src.name}:{lineno}", str(e))
            continue
        cols.add(lineno, *values)
        if len(cols) >= ROWS_PER_PART:
            yield checked()
            cols = _Columns()
    if len(cols):
        yield checked()


def _decoded_columns(data: bytes, num_records: int) -> _Columns | None:
    """Every record of `data` decoded by msgspec; None when any line is not plainly valid (the plain path then
    decides, and names the bad lines).

    Only lines that `_line_counts` found to be one `{...}` each come here, and only a file with exactly one
    `{` and one `[` per record (no nesting beyond the hash list, no braces in strings) is decoded: msgspec and
    Python's json then read every line to the same values (both keep a repeated key's last value). msgspec
    checks the types and ranges that `_record_values` asks for (`_record_type`); the arrival time and the
    hash count are checked here as `_record_values` checks them (tests/test_import_mooncake_paths.py compares
    the two readers)."""
    import msgspec

    if data.count(b"{") != num_records or data.count(b"[") != num_records:
        return None
    decode = msgspec.json.Decoder(_record_type()).decode
    cols = _Columns()
    cols.hashes = array("Q")  # 8 bytes a hash; one of 2**64 or more cannot be stored (OverflowError)
    lines = data.split(b"\n")
    if lines and lines[0].startswith(BOM):
        lines[0] = lines[0][len(BOM):]
    try:
        for lineno, line in enumerate(lines, 1):
            if not line.strip(_JSON_WS):
                continue
            r = decode(line)
            arrival_ns = round(r.timestamp * 1_000_000)  # as require_time_ns: an infinite product raises here
            if abs(arrival_ns) > MAX_NS or len(r.hash_ids) != -(-r.input_length // BLOCK_SIZE):
                return None
            cols.add(lineno, arrival_ns, r.input_length, r.output_length, r.hash_ids)
    except (msgspec.DecodeError, OverflowError, ValueError):
        return None
    return cols


@functools.lru_cache(maxsize=None)
def _record_type() -> type:
    """The fields `_record_values` reads, as msgspec decodes them (made on first use: msgspec loads only for
    the in-memory reader). Strict types: a float count or a bool is no int here, so such a file goes the
    plain way, which accepts 16.0 as 16 and refuses true. The bounds are `_record_values`'."""
    import msgspec

    return msgspec.defstruct("Record", [
        ("timestamp", int | float),  # no bool; a number beyond a float's range is refused
        ("input_length", Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]),
        ("output_length", Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]),
        ("hash_ids", list[Annotated[int, msgspec.Meta(ge=0)]])])  # below 2**64: the array('Q') they go to
