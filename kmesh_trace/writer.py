"""Writing trace directories: atomic Parquet parts and per-engine metadata.

Layout: `TRACE/<table>/engine=<engine_id>/part-NNNNN.parquet` (Hive-partitioned, so DuckDB,
polars, Spark and Trino read it as is), `TRACE/engines/<engine_id>.json` (the engine partition's
metadata) and `TRACE/kmesh_trace.json` (marks the directory as a trace). Every file is written
under a temporary name and renamed into place, so a reader never sees a half-written part, and a
writer killed at any instant leaves every completed part readable.

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

from kmesh_trace import schema
from kmesh_trace.errors import KmeshTraceError

MARKER = "kmesh_trace.json"
ENGINES_DIR = "engines"
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
            "complete": False,
        }
        self.metadata.update(metadata or {})
        self._write_metadata()

    @property
    def metadata_path(self) -> Path:
        return self.root / ENGINES_DIR / f"{self.engine_id}.json"

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
        directory = self.partition_dir(table_name)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"part-{self._part_number(table_name, directory):05d}.parquet"
        with atomic_output(path) as tmp:
            pq.write_table(tbl, tmp, compression=self.compression, **_ENCODINGS[table_name])
        self.num_rows[table_name] += tbl.num_rows
        return path

    def update_metadata(self, **fields: Any) -> None:
        self.metadata.update(fields)
        self._write_metadata()

    def count_dropped(self, table_name: str, n: int) -> None:
        self.metadata["num_dropped_events"][table_name] = self.metadata["num_dropped_events"].get(table_name, 0) + n

    def _write_metadata(self) -> None:
        write_json_atomic(self.metadata_path, self.metadata)

    def close(self) -> None:
        self.update_metadata(complete=True)

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._write_metadata()
