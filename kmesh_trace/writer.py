"""Writing trace directories: atomic Parquet parts and per-engine metadata.

Layout: `TRACE/<table>/engine=<engine_id>/part-NNNNN.parquet` (Hive-partitioned, so DuckDB,
polars, Spark and Trino read it as is), `TRACE/engines/<engine_id>.json` (the engine partition's
metadata) and `TRACE/kmesh_trace.json` (marks the directory as a trace). Every file is written
under a temporary name and renamed into place, so a reader never sees a half-written part, and a
writer killed at any instant leaves every completed part readable.

A full disk must not hide loss: each partition also has a *loss record*,
`TRACE/engines/<engine_id>.loss`, a small file allocated when the writer starts and afterwards only
overwritten in place (no new blocks), so that it can still be written when nothing else can. It
holds the counts that say what is missing (rows written and dropped per table, failed writes, the
first error); readers take the larger of its counts and the metadata file's.

Imports only pyarrow and the schema: the capture hook uses it inside the engine process.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

import kmesh_trace.schema as schema
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.paths import TRACE_MARKER

MARKER = TRACE_MARKER
ENGINES_DIR = "engines"
#: Suffix of each partition's loss record, beside its metadata file.
LOSS_SUFFIX = ".loss"
#: Bytes reserved for a loss record: allocated at start, only overwritten in place.
LOSS_RECORD_BYTES = 4096
#: Metadata fields the loss record repeats (the counts; `write_error` is cut to fit).
LOSS_FIELDS = ("engine_id", "num_dropped_events", "num_rows_written", "num_failed_writes", "write_error",
               "metadata_write_failed", "complete")
_PART_RE = re.compile(r"^part-(\d+)\.parquet$")
_ENGINE_ID_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


@contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary name beside `path`; on success it is renamed to `path`, on failure removed.

    Readers see the old file or the whole new one, never half of it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_output(path) as tmp:
        tmp.write_bytes(data)


def write_json_atomic(path: Path, obj: Any) -> None:
    _atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def default_engine_id(engine_index: int = 0) -> str:
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}-{engine_index}"


def to_contract(table_name: str, data: pa.Table | pa.RecordBatch | Mapping[str, Any] | list[Mapping[str, Any]]) -> pa.Table:
    """Cast data (a table, columns, or a list of row dicts) to the contract's schema for `table_name`.

    Unknown columns, or nulls in required ones, fail."""
    t = schema.table(table_name)
    target = t.arrow_schema()
    if isinstance(data, list):
        keys = {k for row in data for k in row}
        data = {k: [row.get(k) for row in data] for k in t.column_names if k in keys} | {k: [] for k in keys - set(t.column_names)}
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    if isinstance(data, pa.Table):
        cols = {name: data.column(name) for name in data.column_names}
    else:
        cols = dict(data)
    unknown = set(cols) - set(t.column_names)
    if unknown:
        raise KmeshTraceError(f"table {table_name} has no column(s) {', '.join(sorted(unknown))}.")
    n = None
    for v in cols.values():
        n = len(v)
        break
    n = n or 0
    arrays = []
    for c in t.columns:
        if c.name in cols:
            v = cols[c.name]
            arr = v if isinstance(v, (pa.Array, pa.ChunkedArray)) else pa.array(v, type=c.type)
            if arr.type != c.type:
                arr = arr.cast(c.type)
        else:
            if not c.nullable:
                raise KmeshTraceError(f"table {table_name}: required column {c.name} is missing.")
            arr = pa.nulls(n, type=c.type)
        if not c.nullable and arr.null_count:
            raise KmeshTraceError(f"table {table_name}: required column {c.name} has {arr.null_count} null value(s).")
        arrays.append(arr)
    return pa.Table.from_arrays(arrays, schema=target)


def _encodings(t: schema.Table) -> dict[str, Any]:
    """Parquet encodings per column: dictionaries for strings, delta packing for integers.

    Integer columns (sequence numbers, clocks, prefix hashes, token ids) are mostly runs and small
    steps; delta packing + zstd stores Mooncake's block hashes in under one byte each."""
    dictionary, encoding = [], {}
    for c in t.columns:
        typ, path = c.type, c.name
        if pa.types.is_list(typ):
            typ, path = typ.value_type, f"{c.name}.list.element"
        if pa.types.is_string(typ):
            dictionary.append(path)
        elif pa.types.is_integer(typ) and typ.bit_width >= 32:
            encoding[path] = "DELTA_BINARY_PACKED"
    return {"use_dictionary": dictionary, "column_encoding": encoding}


_ENCODINGS = {name: _encodings(t) for name, t in schema.TABLES.items()}


class TraceWriter:
    """Writes one engine partition of a trace directory.

    `write(table, data)` writes one Parquet part per call (callers batch); `update_metadata`
    rewrites the partition's metadata file; `close()` marks the partition complete.
    """

    def __init__(self, root: str | os.PathLike, engine_id: str | None = None, metadata: Mapping[str, Any] | None = None,
                 *, source: str = "capture", compression: str = "zstd"):
        self.root = Path(root)
        self.engine_id = engine_id or default_engine_id()
        if not _ENGINE_ID_RE.match(self.engine_id):
            raise KmeshTraceError(f"engine id {self.engine_id!r} may only hold letters, digits, '_', '.' and '-'.")
        self.compression = compression
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / ENGINES_DIR).mkdir(exist_ok=True)
        marker = self.root / MARKER
        if marker.exists():
            schema.check_version(json.loads(marker.read_text()).get("schema_version"), str(marker))
        else:
            write_json_atomic(marker, {"format": "kmesh-trace", "schema_version": schema.SCHEMA_VERSION})
        self._next_part: dict[str, int] = {}
        self.num_rows: dict[str, int] = {name: 0 for name in schema.TABLES}
        self.metadata: dict[str, Any] = {
            "engine_id": self.engine_id,
            "source": source,
            "schema_version": schema.SCHEMA_VERSION,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "wall_anchor_ns": time.time_ns(),
            "mono_anchor_ns": time.monotonic_ns(),
            "num_dropped_events": {name: 0 for name in schema.TABLES},
            "num_rows_written": {name: 0 for name in schema.TABLES},
            "num_failed_writes": 0,
            "complete": False,
        }
        self.metadata.update(metadata or {})
        self._reserve_loss_record()
        self._write_metadata()

    @property
    def metadata_path(self) -> Path:
        return self.root / ENGINES_DIR / f"{self.engine_id}.json"

    @property
    def loss_path(self) -> Path:
        return self.root / ENGINES_DIR / f"{self.engine_id}{LOSS_SUFFIX}"

    def _reserve_loss_record(self) -> None:
        """Allocate the loss record's blocks now, while the disk has room (written whole and synced)."""
        with open(self.loss_path, "wb") as f:
            f.write(self._loss_bytes())
            f.flush()
            os.fsync(f.fileno())

    def _loss_bytes(self) -> bytes:
        record = {k: self.metadata.get(k) for k in LOSS_FIELDS}
        data = json.dumps(record, sort_keys=True, default=str).encode()
        if len(data) >= LOSS_RECORD_BYTES:  # only the error text can grow: cut it
            record["write_error"] = str(record["write_error"])[:200]
            data = json.dumps(record, sort_keys=True, default=str).encode()
        return data + b" " * (LOSS_RECORD_BYTES - 1 - len(data)) + b"\n"

    def _write_loss_record(self) -> None:
        """Overwrite the loss record in place: the same 4 KiB, no new blocks, so a full disk cannot stop it."""
        fd = os.open(self.loss_path, os.O_WRONLY)
        try:
            os.pwrite(fd, self._loss_bytes(), 0)
        finally:
            os.close(fd)

    def _lost(self, table_name: str, n: int, error: BaseException) -> None:
        """Count `n` rows of `table_name` that could not be written, wherever the count can still go."""
        self.metadata["num_dropped_events"][table_name] = self.metadata["num_dropped_events"].get(table_name, 0) + n
        self.metadata["num_failed_writes"] = self.metadata.get("num_failed_writes", 0) + 1
        self.metadata.setdefault("write_error", f"{type(error).__name__}: {error}")
        try:
            self._write_metadata()
        except OSError:
            pass  # the loss record holds the counts (see _write_metadata)

    def partition_dir(self, table_name: str) -> Path:
        return self.root / table_name / f"engine={self.engine_id}"

    def _part_number(self, table_name: str, directory: Path) -> int:
        if table_name not in self._next_part:
            existing = [int(m.group(1)) for p in directory.iterdir() if (m := _PART_RE.match(p.name))]
            self._next_part[table_name] = max(existing, default=-1) + 1
        n = self._next_part[table_name]
        self._next_part[table_name] = n + 1
        return n

    def write(self, table_name: str, data: pa.Table | pa.RecordBatch | Mapping[str, Any] | list[Mapping[str, Any]]) -> Path | None:
        """Write `data` as one new part of `table_name`; returns its path (None for no rows)."""
        tbl = to_contract(table_name, data)
        if tbl.num_rows == 0:
            return None
        if str(self.metadata["source"]).startswith("import:"):
            # An import states what its source said; a value outside the contract's domain (a negative
            # length, more hit tokens than prompt tokens) is the importer's fault, never a part. A
            # capture writes what the engine reported, and `audit capture` judges it.
            bad = schema.domain_violations(table_name, tbl)
            if bad:
                raise KmeshTraceError(f"the {self.metadata['source']} import produced {table_name} rows outside the "
                                      f"contract ({'; '.join(bad)}); this is a bug in the importer, please report it.")
        directory = self.partition_dir(table_name)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / f"part-{self._part_number(table_name, directory):05d}.parquet"
            with atomic_output(path) as tmp:
                pq.write_table(tbl, tmp, compression=self.compression, **_ENCODINGS[table_name])
        except OSError as e:  # a full disk, a vanished directory: the rows are lost, and counted
            self._lost(table_name, tbl.num_rows, e)
            raise
        self.num_rows[table_name] += tbl.num_rows
        return path

    def update_metadata(self, **fields: Any) -> None:
        self.metadata.update(fields)
        self._write_metadata()

    def count_dropped(self, table_name: str, n: int) -> None:
        self.metadata["num_dropped_events"][table_name] = self.metadata["num_dropped_events"].get(table_name, 0) + n

    def _write_metadata(self) -> None:
        """The loss record first (in place, it cannot fail for space), then the metadata file (a new file
        renamed into place, which needs free blocks); if that fails, the loss record says so."""
        self.metadata["num_rows_written"] = dict(self.num_rows)
        self._write_loss_record()
        try:
            write_json_atomic(self.metadata_path, self.metadata)
        except OSError as e:
            self.metadata["metadata_write_failed"] = True
            self.metadata.setdefault("write_error", f"{type(e).__name__}: {e}")
            self._write_loss_record()
            raise
        if self.metadata.pop("metadata_write_failed", None):  # the file is current again
            self._write_loss_record()

    def close(self) -> None:
        self.update_metadata(complete=True)

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._write_metadata()
