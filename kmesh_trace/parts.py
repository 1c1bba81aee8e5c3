"""Reading a trace's Parquet parts where they lie: a local directory or any pyarrow filesystem URL.

A distributed task must read its own share of a trace (one engine partition, or every partition)
straight from storage, not receive rows from the driver. `open_parts(location, engines)` gives an
object with the reading side of `kmesh_trace.trace.Trace` that the analyses use (`engines`,
`metadata`, `block_size`, `scan`), limited to the engine partitions asked for, over
`pyarrow.fs` (`s3://bucket/trace`, `gs://...`, `file:///...`, or a plain path). Like `Trace`, it reads
only completed parts (`engine=<id>/part-*.parquet`) and checks each part's schema version; SQL stays
with `Trace`, which needs a local directory.

`parts_signature` names the exact parts a read covers (path, size, modification time), so a worker
that keeps a workload in memory between tasks can tell when the trace under a location changed.
"""

from __future__ import annotations

import fnmatch
import json
import os
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

import kmesh_trace.schema as schema
from kmesh_trace.errors import CorruptTraceError, KmeshTraceError, TraceNotFoundError
from kmesh_trace.paths import inside
from kmesh_trace.writer import ENGINES_DIR, MARKER

__all__ = ["TraceParts", "open_parts", "parts_signature"]


def _filesystem(location: str) -> tuple[pafs.FileSystem, str]:
    try:
        if "://" in location:
            return pafs.FileSystem.from_uri(location)
        return pafs.LocalFileSystem(), pafs.LocalFileSystem().normalize_path(_absolute(location))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as e:
        raise KmeshTraceError(f"cannot open {location}: {str(e).splitlines()[0]}; give a trace directory or a "
                              "pyarrow filesystem URL (s3://bucket/trace, file:///path).") from None


def _absolute(path: str) -> str:
    from pathlib import Path

    return str(Path(path).resolve())


class EngineMetadata:
    """What a trace's engine metadata says about its pool, shared by `Trace` and `TraceParts`
    (both hold `engines`: engine id -> metadata)."""

    engines: dict[str, dict[str, Any]]
    #: A trace on disk holds no invocations in memory (`kmesh_trace.sources.TraceSource`): read them with `scan`.
    invocations_in_memory = None

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


class TraceParts(EngineMetadata):
    """Some engine partitions of a trace, read through a pyarrow filesystem. `open_parts` opens one."""

    def __init__(self, location: str, engines: Iterable[str] | None = None):
        self.location = str(location)
        self.fs, self.root = _filesystem(self.location)
        info = self.fs.get_file_info(f"{self.root}/{MARKER}")
        if info.type != pafs.FileType.File:
            raise TraceNotFoundError(f"{self.location} is not a kmesh-trace trace (no {MARKER}).")
        schema.check_version(self._read_json(f"{self.root}/{MARKER}").get("schema_version"), f"{self.location}/{MARKER}")
        every: dict[str, dict[str, Any]] = {}
        for f in self._list(f"{self.root}/{ENGINES_DIR}", "*.json"):
            meta = self._read_json(f)
            schema.check_version(meta.get("schema_version"), f)
            if not isinstance(meta.get("engine_id"), str):
                raise CorruptTraceError(f"{f} is damaged: it has no engine_id.")
            every[meta["engine_id"]] = meta
        wanted = list(every) if engines is None else list(engines)
        missing = [e for e in wanted if e not in every]
        if missing:
            raise KmeshTraceError(f"the trace at {self.location} has no engine {missing[0]!r}; "
                                  f"its engines are {', '.join(every) or 'none'}.")
        self.engines: dict[str, dict[str, Any]] = {e: every[e] for e in wanted}

    # ---- the reading side of Trace ----------------------------------------------------------

    def parts(self, name: str) -> list[str]:
        """The completed parts of table `name` in the chosen partitions, sorted."""
        schema.table(name)
        out: list[str] = []
        for engine in self.engines:
            out += self._list(f"{self.root}/{name}/engine={engine}", "part-*.parquet")
        return sorted(out)

    def scan(self, name: str) -> pl.LazyFrame:
        """A polars LazyFrame over one table, with the partition column `engine` (a string)."""
        import polars as pl
        import pyarrow.dataset as ds

        parts = self.parts(name)
        if not parts:
            empty = schema.table(name).arrow_schema().empty_table().append_column("engine", pa.array([], pa.string()))
            return pl.from_arrow(empty).lazy()
        for p in parts:
            try:
                md = pq.read_schema(p, filesystem=self.fs).metadata or {}
            except (pa.ArrowInvalid, OSError) as e:
                raise CorruptTraceError(f"{p} is damaged ({str(e).splitlines()[0]}).") from None
            schema.check_version(md.get(schema.VERSION_KEY), p)
        partitioning = ds.partitioning(pa.schema([("engine", pa.string())]), flavor="hive")
        dataset = ds.dataset(parts, filesystem=self.fs, format="parquet", partitioning=partitioning,
                             partition_base_dir=f"{self.root}/{name}")
        return pl.scan_pyarrow_dataset(dataset)

    # ---- helpers -----------------------------------------------------------------------------

    def _list(self, directory: str, pattern: str) -> list[str]:
        infos = self.fs.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
        found = sorted(i.path for i in infos
                       if i.type == pafs.FileType.File and fnmatch.fnmatchcase(i.base_name, pattern))
        if isinstance(self.fs, pafs.LocalFileSystem):  # only a local filesystem has symbolic links
            for f in found:
                if not inside(self.root, f):
                    raise CorruptTraceError(f"{f} lies outside the trace (a symbolic link to {os.path.realpath(f)}); "
                                            "a trace reads only its own files: move the link out of it.")
        return found

    def _read_json(self, path: str) -> dict[str, Any]:
        with self.fs.open_input_stream(path) as f:
            data = f.read()
        try:
            obj = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CorruptTraceError(f"{path} is damaged: it is not valid JSON ({e}).") from None
        if not isinstance(obj, dict):
            raise CorruptTraceError(f"{path} is damaged: it holds JSON but not an object.")
        return obj


def open_parts(location: str, engines: Iterable[str] | None = None) -> TraceParts:
    """The engine partitions `engines` (None: all) of the trace at `location`, read where they lie."""
    return TraceParts(location, engines)


def parts_signature(parts: TraceParts, names: Iterable[str] = ("invocations",)) -> tuple:
    """(path, size, modification time) of every part of tables `names` in the chosen partitions."""
    paths = [p for name in names for p in parts.parts(name)]
    return tuple((i.path, i.size, i.mtime_ns) for i in parts.fs.get_file_info(paths))
