"""Opening an input: what an analysis reads as its TRACE, a trace directory or a public trace read as it is,
as a `TraceSource`.

`TraceSource` is the reading side of a trace every analysis needs: `kmesh_trace.trace.Trace` (a local
directory, `open_as_trace`), `kmesh_trace.parts.TraceParts` (a pyarrow filesystem, what a Ray task reads)
and `PublicInput` (a public trace read into memory, `read_directly`), whose invocations are in memory
(`invocations_in_memory`, `InvocationColumns`; None for a trace on disk).

A Mooncake or Bailian JSONL file, a directory (or one file) of kv-cache-tester conversations
(weka) and a directory of LMCache agent traces are imported on the way in, with the importer's own
fast path, into a temporary trace directory that is removed when the command ends. `kmesh-trace
import` stays for users who want the Parquet to query (`kmesh-trace sql`) or to analyse many times.

The format is recognised from the input itself (`sniff`): a trace directory holds the writer's
marker file; a JSONL file's first record names its format by its fields; a directory of `.json`
files is weka, one of `.jsonl` files (one level down) lmcache-agent.

An analysis run in this process (headroom, pressure, tiers, fleet, lineage; not on Ray, whose tasks read a
trace directory) takes a Mooncake or Bailian JSONL file or a weka directory without the temporary trace:
`read_directly` reads it into memory (`PublicInput`, the importer's own reader and checks, every bad line
counted as the import counts it), and the workload is built from it as from the imported trace
(`InvocationColumns`; lineage: `kmesh_trace.oracle.lineage_report`) -- the same
numbers, without polars, pyarrow or duckdb. LMCache agent traces carry token ids and content edges
the import derives with the corpus audit; they still go through the import.
"""

from __future__ import annotations

import atexit
import json
import re
from array import array
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

from kmesh_trace.audit.fields import INPUT_KEYS, OUTPUT_KEYS
from kmesh_trace.datasets.importers.request_shapes import is_request_record, is_sharegpt
from kmesh_trace.errors import InputFormatError, KmeshTraceError
from kmesh_trace.paths import TRACE_MARKER, check_trace_directory


class TraceSource(Protocol):
    """The reading side of a trace that the analyses need (`Trace`, `TraceParts` and `PublicInput` have it):
    the engine partitions' metadata, the invocations held in memory (None: read them with `scan`), and
    `scan(table)`, a polars LazyFrame of one of the trace's tables."""

    engines: dict[str, dict[str, Any]]
    invocations_in_memory: "InvocationColumns | None"

    @property
    def metadata(self) -> dict[str, Any]: ...

    @property
    def block_size(self) -> int | None: ...

    def scan(self, name: str): ...


@dataclass
class InvocationColumns:
    """The invocations of one engine partition held in memory, as an importer would write them (row i is seq
    i): what `Workload.from_trace` (oracle/workload.py) reads from a source that has them (`invocations_in_memory`)
    instead of its invocations table. Hash-only rows (no token ids, no captured hits, no caller names), as the public
    formats give them; `declared_parents`: child request id -> parent request id (None: dangling), the
    declared lineage edges as `kmesh_trace.lineage.declared_parents` reads them back from a trace."""

    request_id: list[str]
    num_prompt_tokens: list[int]
    num_output_tokens: list[int]
    arrival_ns: list[int]
    hash_offsets: list[int]  # row i lists hashes[hash_offsets[i]:hash_offsets[i + 1]]
    hashes: Sequence[int]  # a list, or an array('Q') (8 bytes a hash)
    family_id: list[str | None] | None = None
    parent_id: list[str | None] | None = None
    declared_parents: dict[str, str | None] = field(default_factory=dict)
    finish_ns: list[int | None] | None = None  # None: no row has a finish time (Mooncake, Bailian)

    def __len__(self) -> int:
        return len(self.request_id)

    def order(self) -> list[int]:
        """Rows by arrival, then seq: the order `Workload.from_trace` sorts a trace's invocations in."""
        return sorted(range(len(self)), key=self.arrival_ns.__getitem__)  # stable: ties stay in seq order

    def rows(self, order: Sequence[int], engine: str):
        """The rows in `order` as the dicts `requests_from_rows` (oracle/stream.py) reads (a trace's invocation
        columns)."""
        off, hashes, family, parent, finish = self.hash_offsets, self.hashes, self.family_id, self.parent_id, self.finish_ns
        for i in order:
            yield {"request_id": self.request_id[i], "caller_request_id": None, "seq": i,
                   "family_id": None if family is None else family[i],
                   "parent_id": None if parent is None else parent[i], "num_expected_children": None,
                   "num_prompt_tokens": self.num_prompt_tokens[i], "num_output_tokens": self.num_output_tokens[i],
                   "prompt_token_ids": None, "output_token_ids": None, "prompt_block_hashes": hashes[off[i]:off[i + 1]],
                   "arrival_ns": self.arrival_ns[i], "finish_ns": None if finish is None else finish[i],
                   "num_cached_tokens": None, "engine": engine}


#: The fields that name a JSONL record's format, checked in this order.
_RECORD_FIELDS = (("bailian", {"chat_id", "parent_chat_id", "hash_ids"}),
                  ("mooncake", {"input_length", "hash_ids"}))
#: Bytes read from the head of a file to recognise it.
_SNIFF_BYTES = 1 << 20


def importer(fmt: str) -> Callable:
    """The import function of format `fmt` (mooncake, bailian, weka, lmcache-agent, requests). Each importer is
    imported when its format is asked for: lmcache-agent and requests load pyarrow, bailian and weka the
    compiled readers, none of which a command's start-up needs."""
    if fmt == "weka":
        from kmesh_trace.datasets.importers.weka import import_weka

        return import_weka
    if fmt == "lmcache-agent":
        from kmesh_trace.datasets.importers.lmcache_agent import import_lmcache_agent

        return import_lmcache_agent
    if fmt == "mooncake":
        from kmesh_trace.datasets.importers.mooncake import import_mooncake

        return import_mooncake
    if fmt == "bailian":
        from kmesh_trace.datasets.importers.bailian import import_bailian

        return import_bailian
    if fmt == "requests":
        from kmesh_trace.datasets.importers.requests import import_requests

        return import_requests
    raise InputFormatError(f"unknown input format {fmt!r}.")


def sniff(path: Path) -> str | None:
    """The public format `path` holds, or None for a trace directory; one sentence when it is neither."""
    if path.is_dir():
        if (path / TRACE_MARKER).is_file() or (path / "engines").is_dir():  # kmesh_trace.writer's MARKER, ENGINES_DIR
            return None
        inner = sorted(p for p in path.iterdir() if p.is_dir() and (p / TRACE_MARKER).is_file())
        if inner:
            raise InputFormatError(f"{path} is not a trace directory, but {inner[0]} is: give that.")
        return _directory_format(path)
    if not path.is_file():
        raise InputFormatError(f"{path} does not exist." if not path.exists() else f"{path} is not a readable file.")
    record, keys = _first_record(path)
    if isinstance(record, dict):
        keys = set(record)
    if keys is not None:
        if {"requests", "block_size"} <= keys:
            return "weka"
        for fmt, fields in _RECORD_FIELDS:
            if fields <= keys:
                return fmt
    if is_request_record(record) or is_sharegpt(record):
        return "requests"
    if record is _LONG:
        if keys & _REQUEST_KEYS:
            return "requests"
        raise InputFormatError(f"{path} is not a trace directory, and the first {_SNIFF_BYTES >> 20} MiB of its first "
                               "record name no Mooncake, Bailian, weka or request-dataset field; `kmesh-trace import "
                               "FORMAT` names the format of other inputs.")
    raise InputFormatError(f"{path} is not a trace directory, and its first record is not Mooncake, Bailian, weka "
                           "or request-dataset input; `kmesh-trace import FORMAT` names the format of other inputs.")


#: A record's keys as a JSON object's head shows them (the first line may be longer than what is read).
_KEY = re.compile(rb'"([A-Za-z_][A-Za-z0-9_]{0,63})"\s*:')
#: Bytes of each file's head a directory's format is judged by.
_HEAD_BYTES = 1 << 16


def _head_keys(path: Path) -> set[str] | None:
    """The keys the first record of a JSON or JSONL file shows in its first `_HEAD_BYTES` (empty when the
    file does not start with a JSON object; None when it is blank: no format either way)."""
    try:
        with path.open("rb") as f:
            head = f.read(_HEAD_BYTES).lstrip(b"\xef\xbb\xbf").lstrip()
    except OSError:
        return set()
    if not head:
        return None
    return _record_keys(head, b"{")


def _unlike(files: list[Path], *wanted: set[str], keyless_ok: bool = False) -> list[Path]:
    """The files whose first record shows none of the keys of one of the `wanted` sets (`keyless_ok`: a
    file that shows no key at all, e.g. truncated, is left to the importer, which counts it)."""
    out = []
    for p in files:
        keys = _head_keys(p)
        if keys is not None and not (keyless_ok and not keys) and not all(keys & w for w in wanted):
            out.append(p)
    return out


def _directory_format(path: Path) -> str:
    """weka (.json conversations) or lmcache-agent (.jsonl agent traces, here or one level down), when every
    such file looks like one; else one sentence naming a file that does not."""
    weka = sorted(p for p in path.iterdir() if p.suffix.lower() == ".json" and p.is_file())
    if weka:
        others = _unlike(weka, {"requests", "block_size", "hash_id_scope"}, keyless_ok=True)
        if others:
            raise InputFormatError(f"{path} holds .json files that are not weka conversations ({len(others)} of "
                                   f"{len(weka)}, e.g. {others[0].name}); give a directory of one format.")
        return "weka"
    agent = sorted(p for p in (*path.glob("*.jsonl"), *path.glob("*/*.jsonl")) if p.is_file())
    if agent:
        others = _unlike(agent, set(INPUT_KEYS), {*OUTPUT_KEYS, "timestamp"})
        if others:
            raise InputFormatError(f"{path} holds .jsonl files that are not LMCache agent traces ({len(others)} of "
                                   f"{len(agent)}, e.g. {others[0].relative_to(path)}: no input and timestamp or "
                                   "output in its first record); give a directory of one format.")
        return "lmcache-agent"
    raise InputFormatError(f"{path} is neither a trace directory nor a directory of conversations (weka: .json "
                           "files) or agent traces (lmcache-agent: .jsonl files).")


#: `_first_record`'s record when the first record is longer than the bytes read (its keys come from the head).
_LONG = object()
#: Keys that name a request-dataset record (`request_shapes`) when only its head can be read.
_REQUEST_KEYS = {"messages", "prompt", "conversations"}


def _first_record(path: Path) -> tuple[object, set[str] | None]:
    """(the first JSON value of the file, None): its first non-blank line, or (a .json conversation) the whole
    file; or (`_LONG`, the keys its head shows) when that value does not end in the first `_SNIFF_BYTES`,
    so no more than those bytes are ever read."""
    with path.open("rb") as f:
        head = f.read(_SNIFF_BYTES + 1)
    whole = len(head) <= _SNIFF_BYTES
    head = head[:_SNIFF_BYTES]
    if path.suffix.lower() == ".json":
        if not whole:
            return _LONG, _record_keys(head)
        try:
            return json.loads(head), None
        except RecursionError:  # nested too deep to read whole: what its head shows (the import reads it by parts)
            return _LONG, _record_keys(head)
        except ValueError:
            return None, None
    start = len(head) - len(head.lstrip(b" \t\r\n"))
    end = head.find(b"\n", start)
    while end >= 0 and not head[start:end].strip():  # blank lines before the first record
        start = end + 1
        end = head.find(b"\n", start)
    if end < 0 and not whole:
        return _LONG, _record_keys(head[start:])
    line = head[start:end if end >= 0 else len(head)]
    if not line.strip():
        return None, None
    try:
        return json.loads(line.lstrip(b"\xef\xbb\xbf")), None
    except RecursionError:
        return _LONG, _record_keys(line)
    except ValueError:
        return None, None


def _record_keys(head: bytes, opens: bytes = b"{[") -> set[str]:
    """The keys the head of a JSON value shows (empty when it does not start with one of `opens`: an object, a list)."""
    head = head.lstrip(b"\xef\xbb\xbf").lstrip()
    return {m.decode() for m in _KEY.findall(head)} if head[:1] and head[:1] in opens else set()


def imported(path: Path, fmt: str, *, on_import: Callable[[str], None] | None = None,
             until_exit: bool = False, import_options: dict | None = None) -> tuple[str, Path]:
    """(the temporary directory, the trace in it) of public trace `path` imported as `fmt` (with the importer's
    `import_options`, e.g. a request dataset's tokenizer); the directory is removed at the process's exit when
    `until_exit`, else it is the caller's to remove."""
    d = tempfile.mkdtemp(prefix="kmesh-trace-input-")
    if until_exit:
        atexit.register(shutil.rmtree, d, ignore_errors=True)
    out = Path(d) / "trace"
    try:
        report = importer(fmt)(path, out, engine_id=f"import-{fmt}", **(import_options or {}))
        _check_read(report, path, fmt)
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise
    if on_import is not None:
        on_import(_read_line(report, path, fmt))
    return d, out


def _check_read(report, path: Path, fmt: str) -> None:
    if report.num_invocations == 0:
        raise InputFormatError(f"{path} holds no request readable as {fmt} input "
                               f"({report.num_malformed_lines:,} malformed); `kmesh-trace import {fmt}` says why.")


def _read_line(report, path: Path, fmt: str) -> str:
    """What an analysis says on stderr about the public trace it read."""
    bad = f", {report.num_malformed_lines:,} malformed lines skipped" if report.num_malformed_lines else ""
    return (f"read {path} as {fmt} input: {report.num_invocations:,} requests{bad} (`kmesh-trace import "
            f"{fmt}` keeps the trace for SQL)")


@dataclass
class PublicInput:
    """A public trace read into memory, with the reading side of an imported trace that the analyses need:
    one engine partition (`engines`, its metadata as the import writes it), its invocations
    (`invocations_in_memory`) and its declared lineage edges (`edges`: (child, parent or None when it names
    no request read), as the import's lineage rows). Complete by construction, with no prefill timings (as
    an import)."""

    path: Path
    format: str
    engines: dict[str, dict[str, Any]]
    invocations_in_memory: InvocationColumns
    edges: list[tuple[str, str | None]] = field(default_factory=list)
    agent_id: list[str | None] | None = None  # per row, for lineage (weka's sub-agents)
    location: str | None = field(default=None)  # no trace directory: tasks get the workload itself

    @property
    def metadata(self) -> dict[str, Any]:
        (meta,) = self.engines.values()
        return meta

    @property
    def block_size(self) -> int | None:
        return self.metadata.get("block_size")

    def row_counts(self) -> dict[str, int]:
        """Rows per table, as `Trace.row_counts` counts an imported trace's."""
        return {"invocations": len(self.invocations_in_memory), "lineage": len(self.edges)}

    def scan(self, name: str):
        """No table to scan: the analyses read `invocations_in_memory` and `edges` instead."""
        raise KmeshTraceError(f"{self.path} was read into memory; it has no {name} table to scan "
                              f"(`kmesh-trace import {self.format}` writes one).")


#: The formats `read_directly` reads into memory.
DIRECT_FORMATS = ("mooncake", "bailian", "weka")


def read_directly(path: str | Path, *, on_import: Callable[[str], None] | None = None) -> PublicInput | None:
    """`path` read into memory when it is a public trace of a DIRECT_FORMATS format, else None (a trace
    directory, or a format that goes through the import). `on_import(line)` hears what was read, as from
    `imported`; an input with no readable request is the same error."""
    path = Path(path)
    if "://" in str(path) or not path.exists():
        return None
    fmt = sniff(path)
    if fmt not in DIRECT_FORMATS:
        return None
    engine_id = f"import-{fmt}"
    reader = {"mooncake": _mooncake_in_memory, "bailian": _bailian_in_memory, "weka": _weka_in_memory}[fmt]
    public, report = reader(path, engine_id)
    _check_read(report, path, fmt)
    meta = public.metadata
    meta.update(engine_id=engine_id, source=f"import:{fmt}", complete=True)
    meta.setdefault("num_malformed_lines", report.num_malformed_lines)
    meta.setdefault("malformed_lines", report.malformed_lines)
    if on_import is not None:
        on_import(_read_line(report, path, fmt))
    return public


def _mooncake_in_memory(path: Path, engine_id: str):
    from kmesh_trace.datasets.importers.mooncake import engine_metadata, read_mooncake_as_written  # deferred

    cols, report, block_size = read_mooncake_as_written(path, engine_id=engine_id)
    # Per-row columns as lists (the reader gives int64 arrays): the workload reads them row by row; the hashes
    # and offsets stay as they are (array('Q'), read by slices or numpy).
    per_row = [c.tolist() for c in (cols.num_prompt_tokens, cols.num_output_tokens, cols.arrival_ns)]
    invocations = InvocationColumns([str(i) for i in range(len(cols))], *per_row, cols.offsets, cols.hashes)
    return PublicInput(path, "mooncake", {engine_id: engine_metadata(path, block_size)}, invocations), report


def _bailian_in_memory(path: Path, engine_id: str):
    from kmesh_trace.datasets.importers.bailian import FORMAT, bailian_rows, engine_metadata  # deferred: as `importer`
    from kmesh_trace.datasets.importers.common import ImportReport

    report = ImportReport(FORMAT, str(path), "", engine_id)
    inv = InvocationColumns([], [], [], [], [0], array("Q"), [], [])
    edges = []
    for row, edge in bailian_rows(path, report):
        inv.request_id.append(row["request_id"])
        inv.num_prompt_tokens.append(row["num_prompt_tokens"])
        inv.num_output_tokens.append(row["num_output_tokens"])
        inv.arrival_ns.append(row["arrival_ns"])
        inv.hashes.extend(row["prompt_block_hashes"])
        inv.hash_offsets.append(len(inv.hashes))
        inv.family_id.append(row["family_id"])
        inv.parent_id.append(row["parent_id"])
        if edge is not None:
            edges.append((edge["child_request_id"], edge["parent_request_id"]))
            if inv.declared_parents.get(edge["child_request_id"]) is None:
                inv.declared_parents[edge["child_request_id"]] = edge["parent_request_id"]  # a resolved edge wins
    return PublicInput(path, FORMAT, {engine_id: engine_metadata(path)}, inv, edges), report


def _weka_in_memory(path: Path, engine_id: str):
    """A weka directory (or one conversation file), with the import's default arrival model."""
    from kmesh_trace.datasets.importers.weka import FORMAT, read_weka  # deferred: as `importer`

    rows, report, meta = read_weka(path, engine_id=engine_id)
    c = rows.columns
    inv = InvocationColumns(c["request_id"], c["num_prompt_tokens"], c["num_output_tokens"], c["arrival_ns"],
                            rows.offsets, rows.hashes, c["family_id"], c["parent_id"], finish_ns=c["finish_ns"])
    edges = [(child, parent) for child, parent in zip(c["request_id"], c["parent_id"]) if parent is not None]
    inv.declared_parents = dict(edges)
    return PublicInput(path, FORMAT, {engine_id: meta}, inv, edges, c["agent_id"]), report


@contextmanager
def open_as_trace(path: str | Path, *, on_import: Callable[[str], None] | None = None, until_exit: bool = False,
                  import_options: dict | None = None, **open_options) -> Iterator:
    """An opened `Trace` of `path`: the trace directory itself, or a public trace imported into a temporary
    one, removed when the block ends (`until_exit`: when the process ends, so that tasks started after
    the block, on Ray, can still read it). `on_import(line)` hears what was imported; `open_options`
    go to `open_trace`."""
    path = Path(path)
    fmt = sniff(path)
    if fmt is None:
        check_trace_directory(path)  # before the columnar libraries load
    from kmesh_trace.trace import open_trace  # deferred: it loads polars, pyarrow and duckdb

    if fmt is None:
        with open_trace(path, **open_options) as t:
            yield t
        return
    d, out = imported(path, fmt, on_import=on_import, until_exit=until_exit, import_options=import_options)
    try:
        with open_trace(out, **open_options) as t:
            yield t
    finally:
        if not until_exit:
            shutil.rmtree(d, ignore_errors=True)


def trace_location(where: str, *, on_import: Callable[[str], None] | None = None) -> str:
    """`where` (a trace directory or a pyarrow filesystem URL) as given, or, for a local public trace, the
    temporary trace directory it is imported into (kept until the process ends: tasks read it)."""
    path = Path(where)
    if "://" in where or not path.exists() or (fmt := sniff(path)) is None:
        return where
    return str(imported(path, fmt, on_import=on_import, until_exit=True)[1])
