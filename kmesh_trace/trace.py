"""Reading trace directories: the `Trace` object (polars LazyFrames, a DuckDB connection, SQL).

Only completed parts are read (temporary files are never matched), so a trace being written or
left behind by a killed writer is readable. Every part's schema version is checked on open.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from kmesh_trace import schema
from kmesh_trace.errors import CorruptTraceError, KmeshTraceError, QueryRefusedError, TraceNotFoundError
from kmesh_trace.writer import ENGINES_DIR, MARKER

# The one statement type `Trace.sql(..., read_only=True)` accepts; everything else (COPY, ATTACH,
# LOAD, INSTALL, CREATE, INSERT, SET, PRAGMA, and EXPLAIN, whose ANALYZE form runs its statement)
# is refused before it reaches DuckDB.
_READ_ONLY_STATEMENTS = {"SELECT"}


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptTraceError(f"{path} is damaged: it is not valid JSON ({e}).") from None
    if not isinstance(obj, dict):
        raise CorruptTraceError(f"{path} is damaged: it holds JSON but not an object.")
    return obj


class Trace:
    """An opened trace directory. `open_trace(path)` is the way in."""

    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()
        if not self.path.is_dir():
            raise TraceNotFoundError(f"{path} is not a directory; give the path of a kmesh-trace trace directory.")
        marker = self.path / MARKER
        if not marker.is_file():
            raise TraceNotFoundError(f"{path} is not a kmesh-trace trace (no {MARKER}); create one with `kmesh-trace import` or `kmesh-trace capture`.")
        schema.check_version(_read_json_object(marker).get("schema_version"), str(marker))
        self.engines: dict[str, dict[str, Any]] = {}
        for meta_path in sorted((self.path / ENGINES_DIR).glob("*.json")):
            meta = _read_json_object(meta_path)
            schema.check_version(meta.get("schema_version"), str(meta_path))
            if not isinstance(meta.get("engine_id"), str):
                raise CorruptTraceError(f"{meta_path} is damaged: it has no engine_id.")
            self.engines[meta["engine_id"]] = meta
        self.parts: dict[str, list[Path]] = {name: self._find_parts(name) for name in schema.TABLES}

    def _find_parts(self, name: str) -> list[Path]:
        parts = sorted((self.path / name).glob("engine=*/part-*.parquet"))
        for p in parts:
            try:
                md = pq.read_schema(p).metadata or {}
            except (pa.ArrowInvalid, OSError) as e:
                raise CorruptTraceError(f"{p} is damaged ({_first_line(e)}); move it out of the trace to read the rest.") from None
            schema.check_version(md.get(schema.VERSION_KEY), str(p))
        return parts

    # ---- metadata ----------------------------------------------------------------------------

    @property
    def metadata(self) -> dict[str, Any]:
        """The single engine's metadata; for several engines, the first (see `engines`)."""
        return next(iter(self.engines.values()), {})

    @property
    def block_size(self) -> int | None:
        sizes = {m.get("block_size") for m in self.engines.values()} - {None}
        if len(sizes) > 1:
            raise KmeshTraceError(f"the trace's engines use different block sizes {sorted(sizes)}; analyse one engine at a time.")
        return sizes.pop() if sizes else None

    @property
    def num_usable_blocks(self) -> int | None:
        """The engine's KV pool capacity; each engine has its own pool, so several engines refuse."""
        vals = [m.get("num_usable_blocks") for m in self.engines.values() if m.get("num_usable_blocks") is not None]
        if len(vals) > 1:
            raise KmeshTraceError(f"the trace has {len(vals)} engines, each with its own KV pool; analyse one engine at a time.")
        return vals[0] if vals else None

    # ---- tables ------------------------------------------------------------------------------

    def _empty(self, name: str) -> pa.Table:
        return schema.table(name).arrow_schema().empty_table().append_column("engine", pa.array([], pa.string()))

    def engines_table(self) -> pa.Table:
        """The `engines` view: one row per engine partition, the metadata fields as columns (the
        contract's fields first, in its order, then any others), nested values as JSON text."""
        keys = list(schema.METADATA_FIELDS)
        keys += sorted({k for m in self.engines.values() for k in m} - set(keys))
        columns = {k: [m.get(k) for m in self.engines.values()] for k in keys}
        columns = {k: [json.dumps(v) if isinstance(v, (dict, list)) else v for v in vs] for k, vs in columns.items()}
        return pa.table({k: _column(vs) for k, vs in columns.items()})

    def scan(self, name: str) -> pl.LazyFrame:
        """A polars LazyFrame over one table, with the Hive partition column `engine`; `engines` is the
        engine-metadata view (see `engines_table`)."""
        if name == schema.ENGINES_VIEW:
            return pl.from_arrow(self.engines_table()).lazy()
        schema.table(name)
        parts = self.parts[name]
        if not parts:
            return pl.from_arrow(self._empty(name)).lazy()
        # The partition column is an id, never a number: "007" must stay "007".
        return pl.scan_parquet([str(p) for p in parts], hive_partitioning=True, hive_schema={"engine": pl.String})

    def frame(self, name: str) -> pl.DataFrame:
        return self.scan(name).collect()

    @property
    def tables(self) -> dict[str, pl.LazyFrame]:
        return {name: self.scan(name) for name in schema.TABLES}

    def row_counts(self) -> dict[str, int]:
        return {name: sum(pq.ParquetFile(p).metadata.num_rows for p in parts) for name, parts in self.parts.items()}

    # ---- DuckDB ------------------------------------------------------------------------------

    @cached_property
    def duckdb(self) -> duckdb.DuckDBPyConnection:
        """A DuckDB connection with one view per table, confined to this trace directory."""
        con = duckdb.connect(":memory:")
        con.execute("SET autoinstall_known_extensions = false")
        con.execute("SET autoload_known_extensions = false")
        for name, parts in self.parts.items():
            if parts:
                files = ", ".join("'" + str(p).replace("'", "''") + "'" for p in parts)
                con.execute(f"CREATE VIEW {name} AS SELECT * FROM read_parquet([{files}], hive_partitioning = true, hive_types = {{'engine': VARCHAR}})")
            else:
                self._create_table(con, name, self._empty(name))
        self._create_table(con, schema.ENGINES_VIEW, self.engines_table())
        # From here on only files under the trace are reachable, and the settings are locked.
        root = str(self.path).replace("'", "''")
        con.execute(f"SET allowed_directories = ['{root}/']")
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
        return con

    @staticmethod
    def _create_table(con: duckdb.DuckDBPyConnection, name: str, table: pa.Table) -> None:
        con.register("_arrow_source", table)
        con.execute(f"CREATE TABLE {name} AS SELECT * FROM _arrow_source")
        con.unregister("_arrow_source")

    def sql(self, query: str, *, read_only: bool = True) -> pl.DataFrame:
        """Run SQL against the trace's views (tables: invocations, lineage, block_events, transfers, engines)."""
        if read_only:
            check_read_only(query)
        try:
            rel = self.duckdb.sql(query)
        except duckdb.PermissionException as e:
            raise QueryRefusedError(f"query refused: it reaches outside the trace ({_first_line(e)}).") from None
        except duckdb.Error as e:
            raise KmeshTraceError(f"query failed: {_first_line(e)}") from None
        if rel is None:
            return pl.DataFrame()
        try:
            return _narrow_wide_ints(rel.pl())
        except duckdb.PermissionException as e:
            raise QueryRefusedError(f"query refused: it reaches outside the trace ({_first_line(e)}).") from None
        except duckdb.Error as e:
            raise KmeshTraceError(f"query failed: {_first_line(e)}") from None

    def close(self) -> None:
        if "duckdb" in self.__dict__:
            self.__dict__.pop("duckdb").close()

    def __enter__(self) -> "Trace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _column(values: list) -> pa.Array:
    """One metadata field over all engines: its own type when the engines agree, else text."""
    if all(v is None for v in values):
        return pa.array(values, pa.string())
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        return pa.array([None if v is None else str(v) for v in values], pa.string())


def _narrow_wide_ints(df: pl.DataFrame) -> pl.DataFrame:
    """DuckDB sums integers into 128 bits (HUGEINT, reaching polars as Int128 or Decimal(38, 0)); a
    column whose values fit 64 bits comes back as Int64 (JSON and CSV writers and most tools handle
    128-bit integers as text)."""
    for name, dtype in df.schema.items():
        if dtype == pl.Int128 or (isinstance(dtype, pl.Decimal) and dtype.scale == 0):
            try:
                df = df.with_columns(pl.col(name).cast(pl.Int64, strict=True))
            except pl.exceptions.InvalidOperationError:
                pass  # it does not fit: keep every digit
    return df


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def check_read_only(query: str) -> None:
    """Refuse any statement that is not a plain query (writes, ATTACH, INSTALL/LOAD, SET, ...)."""
    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error as e:
        raise KmeshTraceError(f"query does not parse: {_first_line(e)}") from None
    if not statements:
        raise KmeshTraceError("the query is empty.")
    for st in statements:
        kind = st.type.name
        if kind not in _READ_ONLY_STATEMENTS:
            raise QueryRefusedError(f"query refused: {kind} statements are not allowed; `kmesh-trace sql` only reads the trace.")


def open_trace(path: str | Path) -> Trace:
    """Open a trace directory for reading."""
    return Trace(path)


def trace_info(trace: Trace) -> dict[str, Any]:
    """What `kmesh-trace info --json` prints: tables with row and part counts, and each engine's metadata."""
    return {
        "path": str(trace.path),
        "schema_version": schema.SCHEMA_VERSION,
        "tables": {name: {"rows": n, "parts": len(trace.parts[name])} for name, n in trace.row_counts().items()},
        "engines": trace.engines,
    }
