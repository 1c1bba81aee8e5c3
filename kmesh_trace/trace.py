"""Reading trace directories: the `Trace` object (polars LazyFrames, a DuckDB connection, SQL).

Only completed parts are read (temporary files are never matched), so a trace being written or
left behind by a killed writer is readable. Opening checks every part against the contract from its
Parquet footer alone (schema version, table, columns and types, null counts of required columns, a
part that repeats another byte for byte) and every engine metadata file's field types; a damaged
trace is refused in one sentence naming the file (`strict=False` lists the damage in `problems`
instead, for the audit). SQL runs bounded: a memory limit, a private spill directory removed on
close, a capped spill size and an optional timeout.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

import kmesh_trace.schema as schema
from kmesh_trace.errors import CorruptTraceError, KmeshTraceError, QueryRefusedError
from kmesh_trace.parts import EngineMetadata
from kmesh_trace.paths import check_trace_directory, inside
from kmesh_trace.writer import ENGINES_DIR, LOSS_SUFFIX, MARKER

# The one statement type `Trace.sql(..., read_only=True)` accepts; everything else (COPY, ATTACH,
# LOAD, INSTALL, CREATE, INSERT, SET, PRAGMA, and EXPLAIN, whose ANALYZE form runs its statement)
# is refused before it reaches DuckDB.
_READ_ONLY_STATEMENTS = {"SELECT"}


#: DuckDB's defaults (80% of RAM, spill into ./.tmp up to 90% of the free disk, no timeout) suit a
#: database server, not a command on a shared machine: every connection gets these bounds instead.
SQL_MEMORY_FRACTION = 0.25
SQL_MAX_TEMP_BYTES = 8 << 30
#: Traces opened in this process, so a read error deep inside an analysis can be traced to its file.
_OPEN_TRACES: "weakref.WeakSet[Trace]" = weakref.WeakSet()


def default_memory_limit() -> int:
    """Bytes DuckDB may use: a quarter of this machine's physical memory."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * SQL_MEMORY_FRACTION)
    except (ValueError, OSError):
        return 4 << 30


@dataclass(frozen=True)
class PartProblem:
    """A contract violation found when the trace was opened: `code`, the file, and one sentence."""

    code: str  # damaged_part, duplicate_part, null_in_required_column, invalid_metadata, part_outside_trace
    path: str
    message: str


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptTraceError(f"{path} is damaged: it is not valid JSON ({e}).") from None
    if not isinstance(obj, dict):
        raise CorruptTraceError(f"{path} is damaged: it holds JSON but not an object.")
    return obj


class Trace(EngineMetadata):
    """An opened trace directory. `open_trace(path)` is the way in; `metadata`, `block_size` and
    `num_usable_blocks` come from `EngineMetadata`."""

    def __init__(self, path: str | Path, *, strict: bool = True, memory_limit: int | None = None):
        self._scratch: str | None = None
        self.path = Path(path).resolve()
        self.memory_limit = memory_limit or default_memory_limit()
        check_trace_directory(path)
        marker = self.path / MARKER
        schema.check_version(_read_json_object(marker).get("schema_version"), str(marker))
        #: Contract violations found on open; with strict=True (the default) the first one is raised.
        self.problems: list[PartProblem] = []
        self._footers: dict[Path, pq.FileMetaData] = {}
        self.engines: dict[str, dict[str, Any]] = {}
        for meta_path in sorted((self.path / ENGINES_DIR).glob("*.json")):
            if not inside(self.path, meta_path):
                raise CorruptTraceError(f"{meta_path} lies outside the trace (a symbolic link to "
                                        f"{os.path.realpath(meta_path)}); a trace reads only its own files.")
            if not meta_path.is_file():  # a FIFO or a device would block the read, deaf to Ctrl-C
                raise CorruptTraceError(f"{meta_path} is not a regular file; a trace holds only regular files: "
                                        "move it out of the trace.")
            meta = _read_json_object(meta_path)
            schema.check_version(meta.get("schema_version"), str(meta_path))
            if not isinstance(meta.get("engine_id"), str):
                raise CorruptTraceError(f"{meta_path} is damaged: it has no engine_id.")
            meta = self._with_loss_record(meta_path.with_suffix(LOSS_SUFFIX), meta)
            self.engines[meta["engine_id"]] = self._checked_metadata(meta_path, meta)
        self.parts: dict[str, list[Path]] = {name: self._find_parts(name) for name in schema.TABLES}
        self._check_duplicate_parts()
        if strict and self.problems:
            raise CorruptTraceError(self.problems[0].message)
        _OPEN_TRACES.add(self)

    def _problem(self, code: str, path: Path, message: str) -> None:
        self.problems.append(PartProblem(code, str(path), message))

    def _with_loss_record(self, loss_path: Path, meta: dict[str, Any]) -> dict[str, Any]:
        """The metadata with the partition's loss record folded in: each count is the larger of the two
        (the record can still be written when a full disk stops the metadata file)."""
        if not loss_path.is_file():
            return meta
        try:
            loss = json.loads(loss_path.read_bytes().decode("utf-8"))
            if not isinstance(loss, dict):
                raise ValueError("not an object")
        except (ValueError, UnicodeDecodeError) as e:
            self._problem("invalid_metadata", loss_path, f"{loss_path} is damaged: it is not a JSON object ({e}).")
            return meta
        meta = dict(meta)
        for key in ("num_dropped_events", "num_rows_written"):
            mine, theirs = meta.get(key), loss.get(key)
            if isinstance(mine, dict) and isinstance(theirs, dict):
                meta[key] = {t: max(mine.get(t, 0), theirs.get(t, 0), key=_count) for t in dict.fromkeys([*mine, *theirs])}
            elif mine is None and theirs is not None:
                meta[key] = theirs
        if _count(loss.get("num_failed_writes")) > _count(meta.get("num_failed_writes")):
            meta["num_failed_writes"] = loss["num_failed_writes"]
        if meta.get("write_error") is None and loss.get("write_error") is not None:
            meta["write_error"] = loss["write_error"]
        if loss.get("metadata_write_failed") and not meta.get("metadata_write_failed"):
            meta["metadata_write_failed"] = True  # the metadata file is older than the record
            meta["complete"] = loss.get("complete", meta.get("complete"))
        return meta

    def _checked_metadata(self, meta_path: Path, meta: dict[str, Any]) -> dict[str, Any]:
        """The metadata with every field of the wrong type recorded as a problem and dropped, so that no
        analysis computes with a block size of "16" or a count of true."""
        if meta_path.stem != meta["engine_id"]:
            self._problem("invalid_metadata", meta_path, f"{meta_path} is damaged: it names engine "
                          f"{meta['engine_id']!r}, not the {meta_path.stem!r} of its file name.")
        clean = dict(meta)
        for name, value in meta.items():
            why = schema.metadata_type_error(name, value)
            if why is not None:
                self._problem("invalid_metadata", meta_path, f"{meta_path} is damaged: {why}.")
                clean[name] = None
        return clean

    def _find_parts(self, name: str) -> list[Path]:
        """The table's parts that fit the contract; an unreadable part or one outside the contract is a
        problem, and is left out (so a non-strict reader, the audit, still reads the rest)."""
        readable = []
        for p in sorted((self.path / name).glob("engine=*/part-*.parquet")):
            if not inside(self.path, p):
                self._problem("part_outside_trace", p, f"{p} lies outside the trace (a symbolic link to "
                              f"{os.path.realpath(p)}); a trace reads only its own files: move the link out of it.")
                continue
            if not p.is_file():  # a FIFO or a device would block the read, deaf to Ctrl-C
                self._problem("damaged_part", p, f"{p} is not a regular file; move it out of the trace to read "
                              "the rest.")
                continue
            try:
                footer = pq.read_metadata(p)
                why = _part_damage(name, p, footer)
            except (pa.ArrowException, OSError) as e:
                footer, why = None, _first_line(e)
            if why is not None:
                self._problem("damaged_part", p, f"{p} is damaged ({why}); move it out of the trace to read the rest.")
                continue
            self._footers[p] = footer
            nulls = _required_nulls(name, footer)
            if nulls:
                self._problem("null_in_required_column", p, f"{p} breaks the contract: required column(s) "
                              f"{', '.join(f'{c} ({n} null)' for c, n in nulls)} hold nulls; move it out of the trace "
                              "or re-create it.")
                continue
            broken = _out_of_domain(name, p, footer)
            if broken:  # kept for a non-strict reader: the audit names the rows
                self._problem("out_of_domain", p, f"{p} breaks the contract: {'; '.join(broken)}; these values are "
                              "impossible, so no analysis reads the trace (`kmesh-trace audit capture` lists the rows).")
            readable.append(p)
        return readable

    def _check_duplicate_parts(self) -> None:
        """A part whose bytes repeat another part of the same partition (a copy under a new number) would
        count its rows twice; its footer fingerprint finds it without reading the data."""
        for name, parts in self.parts.items():
            seen: dict[tuple, list[Path]] = {}
            for p in parts:
                # A copy has the same size and the same footer bytes (row counts and every column's min/max
                # statistics); only parts alike in both are compared byte by byte.
                alike = seen.setdefault((p.parent, p.stat().st_size, _footer_digest(p, self._footers[p])), [])
                first = next((q for q in alike if _same_bytes(q, p)), None)
                if first is not None:
                    self._problem("duplicate_part", p, f"{p} repeats {first.name} byte for byte, so its rows would "
                                  "count twice; remove the copy.")
                else:
                    alike.append(p)
        if any(pr.code == "duplicate_part" for pr in self.problems):
            dups = {Path(pr.path) for pr in self.problems if pr.code == "duplicate_part"}
            self.parts = {name: [p for p in parts if p not in dups] for name, parts in self.parts.items()}

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
        import polars as pl

        if name == schema.ENGINES_VIEW:
            return pl.from_arrow(self.engines_table()).lazy()
        schema.table(name)
        parts = self.parts[name]
        if not parts:
            return pl.from_arrow(self._empty(name)).lazy()
        # The partition column is an id, never a number: "007" must stay "007". A nullable column that a
        # part predates is read as nulls.
        return pl.scan_parquet([str(p) for p in parts], hive_partitioning=True, hive_schema={"engine": pl.String},
                               schema=self._polars_schema(name), missing_columns="insert")

    @staticmethod
    def _polars_schema(name: str) -> pl.Schema:
        import polars as pl

        return pl.from_arrow(schema.table(name).arrow_schema().empty_table()).schema

    def _lacks_columns(self, name: str) -> bool:
        """Whether a part of `name` predates one of the contract's (nullable) columns."""
        want = set(schema.table(name).column_names)
        return any(not want <= set(self._footers[p].schema.to_arrow_schema().names) for p in self.parts[name])

    def frame(self, name: str) -> pl.DataFrame:
        return self.scan(name).collect()

    @property
    def tables(self) -> dict[str, pl.LazyFrame]:
        return {name: self.scan(name) for name in schema.TABLES}

    def row_counts(self) -> dict[str, int]:
        return {name: sum(self._footers[p].num_rows for p in parts) for name, parts in self.parts.items()}

    # ---- DuckDB ------------------------------------------------------------------------------

    @cached_property
    def duckdb(self) -> duckdb.DuckDBPyConnection:
        """A DuckDB connection with one view per table, confined to this trace directory, with bounded
        memory and a private spill directory (removed on close and at exit)."""
        con = duckdb.connect(":memory:")
        con.execute("SET autoinstall_known_extensions = false")
        con.execute("SET autoload_known_extensions = false")
        self._scratch = tempfile.mkdtemp(prefix="kmesh-trace-sql-")
        weakref.finalize(self, shutil.rmtree, self._scratch, ignore_errors=True)
        con.execute(f"SET temp_directory = '{_sql_str(self._scratch)}'")
        con.execute(f"SET memory_limit = '{int(self.memory_limit)}B'")
        con.execute(f"SET max_temp_directory_size = '{SQL_MAX_TEMP_BYTES}B'")
        for name, parts in self.parts.items():
            if parts:
                files = ", ".join("'" + _sql_str(str(p)) + "'" for p in parts)
                options = "hive_partitioning = true, hive_types = {'engine': VARCHAR}"
                source = f"read_parquet([{files}], {options})"
                if self._lacks_columns(name):  # parts that predate a nullable column: it reads as nulls
                    self._create_table(con, f"_{name}_contract", self._empty(name))
                    source = (f"(SELECT * FROM read_parquet([{files}], {options}, union_by_name = true) "
                              f"UNION ALL BY NAME SELECT * FROM _{name}_contract)")
                con.execute(f"CREATE VIEW {name} AS SELECT * FROM {source}")
            else:
                self._create_table(con, name, self._empty(name))
        self._create_table(con, schema.ENGINES_VIEW, self.engines_table())
        # From here on only files under the trace are reachable, and the settings are locked.
        con.execute(f"SET allowed_directories = ['{_sql_str(str(self.path))}/']")
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
        return con

    @staticmethod
    def _create_table(con: duckdb.DuckDBPyConnection, name: str, table: pa.Table) -> None:
        con.register("_arrow_source", table)
        con.execute(f"CREATE TABLE {name} AS SELECT * FROM _arrow_source")
        con.unregister("_arrow_source")

    def sql(self, query: str, *, read_only: bool = True, timeout_s: float | None = None) -> pl.DataFrame:
        """Run SQL against the trace's views (tables: invocations, lineage, block_events, transfers, engines)."""
        import polars as pl

        batches = list(self.sql_batches(query, read_only=read_only, timeout_s=timeout_s))
        if not batches:
            return pl.DataFrame()
        return _narrow_wide_ints(_to_polars(pa.Table.from_batches(batches)))

    def sql_batches(self, query: str, *, read_only: bool = True, timeout_s: float | None = None,
                    batch_rows: int = 65_536) -> Iterator[pa.RecordBatch]:
        """The query's result as Arrow batches of at most `batch_rows` rows, fetched as they are consumed,
        so a large result never sits in memory whole (an empty result is one empty batch). `timeout_s`
        bounds the whole run (interrupting DuckDB)."""
        if read_only:
            check_read_only(query)
        deadline = None if not timeout_s else time.monotonic() + timeout_s
        reader = self._interruptible(lambda: self.duckdb.sql(query), deadline, timeout_s)
        if reader is None:
            return
        reader = self._interruptible(lambda: reader.to_arrow_reader(batch_rows), deadline, timeout_s)
        try:
            empty = True
            while True:
                batch = self._interruptible(lambda: _next_batch(reader), deadline, timeout_s)
                if batch is None:
                    break
                empty = False
                yield batch
            if empty:
                yield pa.RecordBatch.from_pylist([], schema=reader.schema)
        finally:
            reader.close()  # a pending result keeps the connection busy: end it before anything else runs

    def _interruptible(self, work, deadline: float | None, timeout_s: float | None):
        """Run `work` (a DuckDB call) on a helper thread while this thread waits in Python, so Ctrl-C and
        the deadline are noticed at once and stop the query (`interrupt`) instead of waiting for it."""
        con = self.duckdb
        box: dict[str, Any] = {}
        done = threading.Event()  # not Thread.join: a join that Ctrl-C interrupted may return early later

        def run() -> None:
            try:
                box["value"] = work()
            except BaseException as e:  # handed to the waiting thread
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=run, name="kmesh-trace-sql", daemon=True).start()
        timed_out = False
        try:
            while not done.wait(0.05):
                if deadline is not None and time.monotonic() >= deadline:
                    timed_out = True
                    con.interrupt()
                    done.wait()
        except KeyboardInterrupt:
            con.interrupt()
            done.wait()
            raise
        error = box.get("error")
        if error is None:
            return box.get("value")
        if timed_out and isinstance(error, (duckdb.InterruptException, RuntimeError)):
            raise KmeshTraceError(f"the query ran past its timeout of {timeout_s:g} s and was stopped; "
                                  "narrow it or raise --timeout.") from None
        raise _sql_error(error) from None

    def close(self) -> None:
        if "duckdb" in self.__dict__:
            con = self.__dict__.pop("duckdb")
            try:
                con.close()
            except duckdb.Error:  # still busy with an interrupted call: stop it, then close
                con.interrupt()
                con.close()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

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


def _to_polars(data: pa.RecordBatch | pa.Table) -> pl.DataFrame:
    """A DuckDB result as polars; a column polars cannot import (an INTERVAL, for one) comes as text."""
    import polars as pl

    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    cols = {}
    for name, col in zip(data.column_names, data.columns):
        if _polars_can_import(col.type):
            cols[name] = pl.from_arrow(pa.table({name: col}))[name]
        else:
            cols[name] = pl.Series(name, [None if v is None else str(v) for v in col.to_pylist()], pl.String)
    return pl.DataFrame(cols)


def _polars_can_import(t: pa.DataType) -> bool:
    """Whether polars takes this Arrow type (it panics on intervals, even inside lists and structs)."""
    if pa.types.is_interval(t):
        return False
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _polars_can_import(t.value_type)
    if pa.types.is_struct(t):
        return all(_polars_can_import(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_map(t):
        return _polars_can_import(t.key_type) and _polars_can_import(t.item_type)
    return True


def _narrow_wide_ints(df: pl.DataFrame) -> pl.DataFrame:
    """DuckDB sums integers into 128 bits (HUGEINT, reaching polars as Int128 or Decimal(38, 0)); a
    column whose values fit 64 bits comes back as Int64 (JSON and CSV writers and most tools handle
    128-bit integers as text)."""
    import polars as pl

    for name, dtype in df.schema.items():
        if dtype == pl.Int128 or (isinstance(dtype, pl.Decimal) and dtype.scale == 0):
            try:
                df = df.with_columns(pl.col(name).cast(pl.Int64, strict=True))
            except pl.exceptions.InvalidOperationError:
                pass  # it does not fit: keep every digit
    return df


def _count(v: Any) -> int:
    """A count for comparison; anything that is not a count compares as 0 (its type is checked later)."""
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _sql_str(text: str) -> str:
    return text.replace("'", "''")


def _next_batch(reader: pa.RecordBatchReader) -> pa.RecordBatch | None:
    try:
        return reader.read_next_batch()
    except StopIteration:
        return None


def _sql_error(e: BaseException) -> BaseException:
    """DuckDB's errors as one sentence each (an interrupt without a timeout is Ctrl-C)."""
    if isinstance(e, duckdb.InterruptException) or (isinstance(e, RuntimeError) and "interrupted" in str(e).lower()):
        return KeyboardInterrupt()
    if isinstance(e, duckdb.PermissionException):
        return QueryRefusedError(f"query refused: it reaches outside the trace ({_first_line(e)}).")
    if isinstance(e, duckdb.OutOfMemoryException):
        return KmeshTraceError(f"the query needs more than its memory limit and spill space allow "
                               f"({_first_line(e)}); narrow it or raise --memory-limit.")
    if isinstance(e, duckdb.Error):
        return KmeshTraceError(f"query failed: {_first_line(e)}")
    return e


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _same_type(have: pa.DataType, want: pa.DataType) -> bool:
    """Arrow types equal up to the name of a list's item field (Parquet calls it `element`)."""
    if pa.types.is_list(want):
        return pa.types.is_list(have) and have.value_type == want.value_type
    return have == want


def _part_damage(name: str, path: Path, footer: pq.FileMetaData) -> str | None:
    """Why the part at `path` cannot be read as table `name` (None when its footer fits the contract)."""
    arrow_schema = footer.schema.to_arrow_schema()
    md = footer.metadata or {}
    try:
        version = md.get(schema.VERSION_KEY)
        version = version.decode("utf-8") if version is not None else None
        table = md.get(schema.TABLE_KEY)
        table = table.decode("utf-8") if table is not None else None
    except UnicodeDecodeError:
        return "its kmesh-trace metadata is not UTF-8"
    schema.check_version(version, str(path))
    if table is not None and table != name:
        return f"it holds table {table}, not {name}"
    contract = schema.table(name)
    have = {f.name: f.type for f in arrow_schema}
    # A nullable column may be absent: a part written before the contract added it (the readers fill
    # it with nulls); a required column never.
    missing = [c.name for c in contract.columns if c.name not in have and not c.nullable]
    if missing:
        return f"column(s) {', '.join(missing)} missing"
    wrong = [f"{c.name} is {schema.type_name(have[c.name])}, not {schema.type_name(c.type)}"
             for c in contract.columns if c.name in have and not _same_type(have[c.name], c.type)]
    if wrong:
        return "; ".join(wrong[:3])
    unknown = sorted(set(have) - set(contract.column_names))
    if unknown:
        return f"column(s) {', '.join(unknown)} are not in the contract"
    return None


def _required_nulls(name: str, md: pq.FileMetaData) -> list[tuple[str, int]]:
    """(column, nulls) of each required column whose footer statistics count nulls (no scan: a column
    without statistics is not checked here; `audit capture` reads the rows)."""
    required = {c.name for c in schema.table(name).columns if not c.nullable}
    leaves = [(i, md.schema.column(i).path) for i in range(md.num_columns)]
    wanted = [(i, path) for i, path in leaves if path in required]
    counts: dict[str, int] = {}
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        for i, path in wanted:
            stats = rg.column(i).statistics
            if stats is not None and stats.has_null_count and stats.null_count:
                counts[path] = counts.get(path, 0) + stats.null_count
    return list(counts.items())


def _out_of_domain(name: str, path: Path, md: pq.FileMetaData) -> list[str]:
    """The schema's domain rules (`schema.DOMAINS`) that the part breaks. Minimums are read from the
    footer's statistics (no scan); a cross-column rule (cached <= prompt) reads its two columns only
    when the statistics cannot prove it."""
    rules = {col: d for (t, col), d in schema.DOMAINS.items() if t == name}
    if not rules:
        return []
    index = {md.schema.column(i).path: i for i in range(md.num_columns)}
    lo: dict[str, Any] = {}
    hi: dict[str, Any] = {}
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        for col in {*rules, *(d.at_most for d in rules.values() if d.at_most)}:
            i = index.get(col)
            stats = rg.column(i).statistics if i is not None else None
            if stats is None or not stats.has_min_max:
                continue
            lo[col] = stats.min if col not in lo else min(lo[col], stats.min)
            hi[col] = stats.max if col not in hi else max(hi[col], stats.max)
    broken = [f"{d.describe(col)}, but its least value is {lo[col]}" for col, d in rules.items()
              if d.minimum is not None and col in lo and lo[col] < d.minimum]
    cross = [col for col, d in rules.items() if d.at_most and col in hi
             and not (d.at_most in lo and hi[col] <= lo[d.at_most])]
    if cross and not broken:
        cols = sorted({*cross, *(rules[c].at_most for c in cross)})
        broken = schema.domain_violations(name, pq.read_table(path, columns=cols))
    return broken


def _footer_digest(path: Path, footer: pq.FileMetaData) -> str:
    """SHA-256 of the part's serialized footer (its last bytes), read without the data pages."""
    n = footer.serialized_size + 8  # the footer, its length and the closing magic
    with open(path, "rb") as f:
        f.seek(-n, os.SEEK_END)
        return hashlib.sha256(f.read(n)).hexdigest()


def _same_bytes(a: Path, b: Path) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(1 << 20), fb.read(1 << 20)
            if x != y:
                return False
            if not x:
                return True


def locate_damage(exc: BaseException) -> CorruptTraceError | None:
    """After a read failed deep inside an analysis (polars, Arrow or DuckDB decoding a data page), find
    the part of an open trace that cannot be read, so the error can name it. Reads whole parts, but
    only on this failure path; None when every part reads (the failure was something else)."""
    for trace in list(_OPEN_TRACES):
        for parts in trace.parts.values():
            for p in parts:
                try:
                    pq.read_table(p)
                except (pa.ArrowException, OSError) as e:
                    return CorruptTraceError(f"{p} is damaged ({_first_line(e)}); move it out of the trace to read "
                                             "the rest.")
    return None


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


def open_trace(path: str | Path, *, strict: bool = True, memory_limit: int | None = None) -> Trace:
    """Open a trace directory for reading; a part or metadata file outside the contract is refused
    (`strict=False`: listed in `Trace.problems` and left out where it cannot be read)."""
    return Trace(path, strict=strict, memory_limit=memory_limit)


def trace_info(trace: Trace) -> dict[str, Any]:
    """What `kmesh-trace info --json` prints: tables with row and part counts, and each engine's metadata."""
    return {
        "path": str(trace.path),
        "schema_version": schema.SCHEMA_VERSION,
        "tables": {name: {"rows": n, "parts": len(trace.parts[name])} for name, n in trace.row_counts().items()},
        "engines": trace.engines,
    }


def check_has_requests(trace: Trace) -> None:
    """Refuse, in one sentence, a trace with nothing to analyse: no invocations and no block events (an
    import that produced no request, a capture that never served one). An analysis of it would print
    zeros as if they were results."""
    counts = trace.row_counts()
    if not counts.get("invocations") and not counts.get("block_events"):
        raise KmeshTraceError(f"{trace.path} has no requests (its invocations table is empty and it holds no block "
                              "events), so there is nothing to analyse; re-import or re-capture it.")


def approximate_tokens(trace: Trace) -> str | None:
    """The note every analysis of an import with approximated token ids carries (None when exact)."""
    names = sorted({str(m.get("tokenizer")) for m in trace.engines.values() if m.get("token_ids_approximate")})
    if not names:
        return None
    return (f"token ids are approximate: the importer tokenized text with {', '.join(names)}, not the serving "
            "model's tokenizer, so block and token counts are estimates")
