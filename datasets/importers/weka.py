"""Importer for agentic coding conversations in the kv-cache-tester trace format (Claude Code, with sub-agents).

A directory holds one JSON file per conversation: `id`, `block_size`, `hash_id_scope` (`local` or
`global`) and `requests`; each request has `t` (seconds from the conversation's start), `in`, `out`,
`hash_ids` (one id per FULL input block: `len(hash_ids) == in // block_size`), `api_time`, `ttft`;
a `subagent` entry has `agent_id`, `subagent_type` and its own `requests`, timed from its own start.

How the import reads it (docs/IMPORT.md says why):
- one file = one conversation = one family (`family_id` = the file's `id`); files are read one at a
  time in name order, so memory is bounded by the largest file and one Parquet batch, never by the
  corpus;
- a request's time is its `t` plus the start of every sub-agent it is nested in; within a file,
  requests are ordered by that time, ties in file order;
- declared lineage: a request's parent is the previous request of its thread (the main conversation
  or one sub-agent); a sub-agent's first request has as parent the latest request of the enclosing
  thread at or before the sub-agent's start (none when the sub-agent starts first);
- `local` ids are namespaced per file: id -> 2^63 | file_ordinal << 40 | id (ids must be below 2^40),
  so equal ids of two files are different blocks and delta encoding still packs them; `global` ids
  are kept as they are (below 2^63, so the two spaces never meet);
- conversations are placed on one time axis by an `Arrival` model, written into the metadata;
- `seq` is the import order (file by file, then time); analyses order by (arrival_ns, seq);
- a malformed file or entry is counted and listed (`file: requests[3].requests[1]: why`) and skipped;
  a skipped request's thread continues from the previous good request.

Speed: the ids are most of a file. The fast path cuts each `"hash_ids":[...]` list of digits and
commas out of the text and parses them all in one compiled pass (native/kernels/parse_ids.c; the plain
Python `_parse_ids_plain` is its reference in the tests), so `json.loads` reads only the small rest and
no Python int is made per id; Parquet parts are written on a background thread. `read_weka` gives the
same rows in memory, without pyarrow, for an analysis that reads a weka directory as it is. Any doubt
(a list the cut did not take, a placeholder out of place, a leading zero, an id out of range) sends
the file down the plain path: `json.loads` of the whole text and a check of every id, which is the
reference the tests compare the fast path with (`fast=False`).
"""

from __future__ import annotations

import heapq
import re
import secrets
from array import array
from bisect import bisect_left, bisect_right
from concurrent.futures import Future, ThreadPoolExecutor
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator

import numpy as np

from kmesh_trace.datasets.importers.common import (MAX_TOKENS, ImportReport, RecordError, require_hash_list, require_int,
                                                  require_number)
from kmesh_trace.errors import InputFormatError, KmeshTraceError
from kmesh_trace import schema
from kmesh_trace.native.kernels import I64, I32, P, declare, ptr
from kmesh_trace.values import MAX_SECONDS

if TYPE_CHECKING:  # pyarrow and the writer load for an import only, not for a direct read
    import pyarrow as pa

    from kmesh_trace.writer import TraceWriter

FORMAT = "weka"
DEFAULT_ARRIVAL = "users:8"
#: Local ids are namespaced as LOCAL_BIT | file_ordinal << LOCAL_ID_BITS | id.
LOCAL_BIT = 1 << 63
LOCAL_ID_BITS = 40
MAX_FILES = 1 << (63 - LOCAL_ID_BITS)
#: A Parquet part is written once this many rows or block ids are pending.
ROWS_PER_PART = 200_000
IDS_PER_PART = 1_000_000
_TYPES = ("n", "s", "subagent")


@dataclass(frozen=True)
class Arrival:
    """Where conversation k (in file order) starts on the trace's time axis.

    as-recorded: every conversation at 0; stagger:S: at k x S seconds; users:N: N users replay the
    conversations back to back, each taking the next conversation when their previous one ends (the
    earliest-free user first, the lowest user number on ties)."""

    mode: str
    seconds: float | None = None
    users: int | None = None

    @classmethod
    def parse(cls, text: str) -> "Arrival":
        text = text.strip()
        name, _, arg = text.partition(":")
        try:
            if name == "as-recorded" and not arg:
                return cls("as-recorded")
            if name == "stagger" and arg:
                s = float(arg)
                if math.isfinite(s) and 0 <= s <= MAX_SECONDS:
                    return cls("stagger", seconds=s)
            if name == "users" and arg:
                n = int(arg)
                if n >= 1:
                    return cls("users", users=n)
        except ValueError:
            pass
        raise KmeshTraceError(f"--arrival {text!r} is not one of as-recorded, stagger:SECONDS (0 to {MAX_SECONDS:,.0f}) or users:N (N >= 1).")

    def __str__(self) -> str:
        if self.mode == "stagger":
            return f"stagger:{self.seconds:g}"
        if self.mode == "users":
            return f"users:{self.users}"
        return self.mode


class _Clock:
    """Start times (seconds) of conversations in file order under an `Arrival`."""

    def __init__(self, arrival: Arrival):
        self.arrival = arrival
        self.k = 0
        # (free at, user), a heap of the users met so far; the others are free at 0 and are taken in
        # number order, so memory follows the conversations, not N (users:100000000 holds none idle).
        self.free: list[tuple[float, int]] = []
        self.num_users_met = 0

    def start(self, duration_s: float) -> float:
        a = self.arrival
        if a.mode == "as-recorded":
            start = 0.0
        elif a.mode == "stagger":
            start = self.k * a.seconds
        else:
            if self.num_users_met < a.users and not (self.free and self.free[0][0] <= 0.0):
                start, user = 0.0, self.num_users_met  # an unmet user: free at 0, numbered after the met
                self.num_users_met += 1
            else:
                start, user = heapq.heappop(self.free)
            heapq.heappush(self.free, (start + max(duration_s, 0.0), user))
        self.k += 1
        return start


@dataclass(slots=True)
class _Req:
    t: float  # seconds from the conversation's start
    pos: int  # file order
    thread: int  # 0 = main conversation, else the sub-agent's thread number
    where: str
    n_in: int
    n_out: int | None
    hashes: list | None  # the parsed ids (plain path only)
    start: int  # first position of the request's ids in the file's id array
    end: int
    api_time: float | None
    ttft: float | None
    stop: Any


@dataclass(slots=True)
class _Thread:
    number: int
    parent: int | None  # enclosing thread
    start: float  # seconds from the conversation's start
    agent_id: str | None
    agent_type: str | None
    label: str  # request id segment


@dataclass
class WekaReport(ImportReport):
    arrival: str = DEFAULT_ARRIVAL
    block_size: int | None = None
    num_files: int = 0
    num_families: int = 0
    num_subagents: int = 0
    num_malformed_files: int = 0
    num_unreadable_files: int = 0
    num_malformed_entries: int = 0

    SUMMARY_KEYS: ClassVar[tuple[str, ...]] = (
        "num_files", "num_families", "num_invocations", "num_subagents", "num_block_hashes", "num_lineage_edges",
        "num_malformed_files", "num_unreadable_files", "num_malformed_entries")

    def entry(self, where: str, reason: str) -> None:
        self.num_malformed_entries += 1
        self.malformed(where, reason)

    def bad_file(self, where: str, reason: str) -> None:
        self.num_malformed_files += 1
        self.malformed(where, reason)


def _opt_number(obj: dict, key: str) -> float | None:
    if obj.get(key) is None:
        return None
    v = require_number(obj, key)
    if v < 0:
        raise RecordError(f"field {key} is negative")
    return float(v)


def _opt_str(obj: dict, key: str) -> str | None:
    v = obj.get(key)
    return v if isinstance(v, str) and v else None


class _NotFast(Exception):
    """The fast path cannot vouch for a file; it is read again the plain way."""


_IDS_KEY = b'"hash_ids":['


def split_ids(data: bytes) -> tuple[bytes, list[int], np.ndarray, int]:
    """Cut every `"hash_ids":[digits and commas]` out of a file's JSON text, parsing the ids with numpy.

    Returns (the text with list k replaced by the placeholder -(base + k), the number of ids of each
    list, all ids in list order, base). `base` is drawn at random per call, so a literal number in the
    file cannot pass for a placeholder (a request whose `hash_ids` is `-1` must stay malformed, not
    borrow a list that lies elsewhere in the file). A list holding anything but digits and commas is
    left in the text. Raises _NotFast when the numbers are not what JSON would read (empty items,
    leading zeros, values beyond int64); the caller checks that every placeholder lands in a request."""
    base = secrets.randbelow(1 << 52) + (1 << 52)  # placeholders stay exact in a float, and negative
    parts, counts, bodies = [], [], []
    pos, n_key = 0, len(_IDS_KEY)
    find = data.find
    while (i := find(_IDS_KEY, pos)) >= 0:
        j = find(b"]", i + n_key)
        if j < 0:
            break
        body = data[i + n_key:j]
        if body.translate(None, b"0123456789,"):
            parts.append(data[pos:j + 1])
        else:
            parts.append(data[pos:i + n_key - 1])
            parts.append(b"%d" % -(base + len(counts)))
            counts.append(body.count(b",") + 1 if body else 0)
            if body:
                bodies.append(body)
        pos = j + 1
    parts.append(data[pos:])
    values = parse_id_lists(b",".join(bodies))
    if len(values) != sum(counts):
        raise _NotFast("an empty item")
    return b"".join(parts), counts, values, base


#: What `_parse_ids` reports besides the ids: all read, an empty item, a leading zero, beyond int64, a byte
#: that is neither a digit nor a comma (native/kernels/parse_ids.c has the same codes).
_IDS_OK, _IDS_EMPTY, _IDS_ZERO, _IDS_RANGE, _IDS_CHAR = 0, 1, 2, 3, 4
_IDS_WHY = ("", "an empty item", "a leading zero", "a value beyond int64", "a byte that is neither a digit nor a comma")
_parse_ids_c = declare("ks_weka_parse_ids", [P, I64, P, P], I32)


def _parse_ids(text: bytes) -> tuple[int, np.ndarray]:
    """(status, the ids read before it) of comma-separated decimal ids, in one compiled pass."""
    buf = np.frombuffer(text, np.uint8)
    out = np.empty(text.count(b",") + 1, np.int64)
    num_read = np.zeros(1, np.int64)
    status = _parse_ids_c(ptr(buf, np.uint8) if len(buf) else None, len(buf), ptr(out, np.int64), ptr(num_read, np.int64))
    return status, out[:int(num_read[0])]


def _parse_ids_plain(text: bytes) -> tuple[int, list[int]]:
    """`_parse_ids` in plain Python, byte by byte: the reference the tests compare the kernel with."""
    limit = (1 << 63) - 1
    values: list[int] = []
    v = digits = 0
    for c in [*text, 0x2C]:
        if c == 0x2C:
            if digits == 0:
                return _IDS_EMPTY, values
            values.append(v)
            v = digits = 0
            continue
        if not 0x30 <= c <= 0x39:
            return _IDS_CHAR, values
        if digits == 1 and v == 0:
            return _IDS_ZERO, values
        v = v * 10 + (c - 0x30)
        if v > limit:
            return _IDS_RANGE, values
        digits += 1
    return _IDS_OK, values


def parse_id_lists(text: bytes) -> np.ndarray:
    """Comma-separated decimal integers (ASCII digits and commas only) as int64, in one compiled pass
    (no Python int per id). Raises _NotFast on an empty item, a leading zero, a value of 2^63 or
    more or any other byte, which the plain path judges one by one."""
    if not text:
        return np.zeros(0, np.int64)
    status, out = _parse_ids(text)
    if status != _IDS_OK:
        raise _NotFast(_IDS_WHY[status])
    return out


class _FileReader:
    """Walks one conversation's entries into requests and threads, keeping every bad entry.

    With `spans` (from `split_ids`), each request's `hash_ids` must be a placeholder of one id list,
    used once; anything else raises _NotFast. Without, `hash_ids` is the parsed list (plain path)."""

    def __init__(self, name: str, block_size: int, spans: list[int] | None = None, base: int = 0):
        self.name, self.block_size, self.base = name, block_size, base
        self.reqs: list[_Req] = []
        self.threads: list[_Thread] = [_Thread(0, None, 0.0, None, None, "m")]
        self.labels: set[str] = {"m"}  # the labels of self.threads
        self.end = 0.0  # latest known finish, seconds from the conversation's start
        self.latest = 0.0  # latest time of any request (arrival, first token, finish)
        self.bad: list[tuple[str, str]] = []
        self.spans = spans
        if spans is not None:
            self.span_start = np.zeros(len(spans) + 1, np.int64)
            np.cumsum(spans, out=self.span_start[1:])
            self.span_used = [False] * len(spans)

    def walk(self, entries: Any, thread: _Thread, path: str) -> None:
        if not isinstance(entries, list):
            self.bad.append((path, "field requests missing or not a list"))
            return
        for i, e in enumerate(entries):
            where = f"{path}[{i}]"
            try:
                if not isinstance(e, dict):
                    raise RecordError("entry is not an object")
                typ = e.get("type")
                if typ not in _TYPES:
                    raise RecordError(f"field type is {typ!r}, not one of {', '.join(_TYPES)}")
                t = require_number(e, "t")
                if t < 0:
                    raise RecordError("field t is negative")
                if typ == "subagent":
                    self._subagent(e, thread, where, float(t))
                    continue
                n_in = require_int(e, "in", minimum=1, maximum=MAX_TOKENS)
                n_out = require_int(e, "out", maximum=MAX_TOKENS) if e.get("out") is not None else None
                hashes, start, n_ids = self._ids(e.get("hash_ids"))
                if n_ids != n_in // self.block_size:
                    raise RecordError(f"hash_ids has {n_ids} entries but in {n_in} // block_size "
                                      f"{self.block_size} is {n_in // self.block_size}")
                api, ttft = _opt_number(e, "api_time"), _opt_number(e, "ttft")
            except RecordError as err:
                self.bad.append((where, str(err)))
                continue
            t_abs = thread.start + t
            latest = t_abs + max(api or 0.0, ttft or 0.0)
            if latest > MAX_SECONDS:
                self.bad.append((where, f"the request's time ({t_abs:.3g} s and after) is beyond the trace's clock "
                                        f"(at most {MAX_SECONDS:,} s)"))
                continue
            self.reqs.append(_Req(t_abs, len(self.reqs), thread.number, where, n_in, n_out, hashes, start,
                                  start + n_ids, api, ttft, e.get("stop")))
            self.end = max(self.end, t_abs + (api or 0.0))
            self.latest = max(self.latest, latest)

    def _ids(self, h: Any) -> tuple[list | None, int, int]:
        """(the id list on the plain path, first position in the file's ids on the fast path, count)."""
        if self.spans is None:
            if type(h) is not list:
                raise RecordError("field hash_ids missing or not a list")
            return h, 0, len(h)
        k = -h - self.base if type(h) is int else -1
        if not 0 <= k < len(self.spans) or self.span_used[k]:
            raise _NotFast("hash_ids is not one of the lists cut out of the text")
        self.span_used[k] = True
        return None, int(self.span_start[k]), self.spans[k]

    def _label(self, agent_id: str | None, number: int) -> str:
        """The request-id segment of a sub-agent: its own id when that is free and has no `/`, else
        `subN`, else `subN.k` with the first free k: unique within the file whatever order ids come in
        (an anonymous sub-agent after one that calls itself `sub2` must not become `sub2` too)."""
        label = agent_id if agent_id and "/" not in agent_id and agent_id not in self.labels else f"sub{number}"
        k = 0
        while label in self.labels:
            k += 1
            label = f"sub{number}.{k}"
        self.labels.add(label)
        return label

    def _subagent(self, e: dict, thread: _Thread, where: str, t: float) -> None:
        agent_id = _opt_str(e, "agent_id")
        number = len(self.threads)
        start = thread.start + t
        if start > MAX_SECONDS:
            raise RecordError(f"the sub-agent starts {start:.3g} s into its conversation, beyond the trace's clock "
                              f"(at most {MAX_SECONDS:,} s)")
        sub = _Thread(number, thread.number, start, agent_id, _opt_str(e, "subagent_type"), self._label(agent_id, number))
        self.threads.append(sub)
        dur = e.get("duration_ms")
        if isinstance(dur, (int, float)) and not isinstance(dur, bool) and math.isfinite(dur) and dur >= 0:
            self.end = max(self.end, sub.start + dur / 1000)
        self.walk(e.get("requests"), sub, f"{where}.requests")

    def finish_fast(self, values: np.ndarray, scope: str) -> np.ndarray:
        """The fast path's ids, once every list was used by a request and every id is in range."""
        if not all(self.span_used):
            raise _NotFast("an id list outside a request")
        if len(values) and (values.min() < 0 or (scope == "local" and values.max() >= 1 << LOCAL_ID_BITS)):
            raise _NotFast("ids out of range")
        return values

    def finish_plain(self, scope: str) -> np.ndarray:
        """Check every id of every request one by one; drop (and keep as bad) the requests that fail."""
        good, flat = [], []
        for r in self.reqs:
            try:
                require_hash_list({"hash_ids": r.hashes}, "hash_ids")
                if r.hashes and scope == "global" and max(r.hashes) >= LOCAL_BIT:
                    raise RecordError("a global hash id is 2^63 or more (that range holds namespaced local ids)")
                if r.hashes and scope == "local" and max(r.hashes) >= 1 << LOCAL_ID_BITS:
                    raise RecordError(f"a local hash id is 2^{LOCAL_ID_BITS} or more and cannot be namespaced")
            except RecordError as err:
                self.bad.append((r.where, str(err)))
                continue
            r.start, r.end = len(flat), len(flat) + len(r.hashes)
            flat.extend(r.hashes)
            good.append(r)
        self.reqs = good
        self.bad.sort(key=lambda b: _path_key(b[0]))
        return np.array(flat, dtype=np.uint64).view(np.int64) if flat else np.zeros(0, np.int64)


def _path_key(where: str) -> list[int]:
    """Document order of an entry path such as requests[3].requests[1]."""
    return [int(x) for x in re.findall(r"\[(\d+)\]", where)]


def read_conversation(data: bytes, name: str, ordinal: int, block_size: int | None, families: set[str],
                      fast: bool = True) -> tuple[dict, _FileReader, np.ndarray] | str:
    """(the file's top-level fields, its requests, its namespaced ids in file order), or why the file is
    malformed. The fast path cuts the id lists out of the text before `json.loads`; the plain path
    (the reference, and where the fast one has any doubt) parses the whole text and checks every id."""
    if fast:
        try:
            text, spans, values, base = split_ids(data)
            conv = json.loads(text)
            problem = _check_file(conv, block_size, families)
            if problem:
                raise _NotFast(problem)
            scope = conv.get("hash_id_scope") or "local"
            reader = _FileReader(name, conv["block_size"], spans, base)
            reader.walk(conv["requests"], reader.threads[0], "requests")
            values = reader.finish_fast(values, scope)
            return _top(conv), reader, _namespace(values, scope, ordinal)
        except (_NotFast, UnicodeDecodeError, ValueError, RecursionError):
            pass
    try:
        conv = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        return f"not JSON ({type(e).__name__})"
    problem = _check_file(conv, block_size, families)
    if problem:
        return problem
    scope = conv.get("hash_id_scope") or "local"
    reader = _FileReader(name, conv["block_size"])
    reader.walk(conv["requests"], reader.threads[0], "requests")
    values = reader.finish_plain(scope)
    return _top(conv), reader, _namespace(values, scope, ordinal)


def _top(conv: dict) -> dict:
    return {"id": conv["id"], "block_size": conv["block_size"]}


def _namespace(values: np.ndarray, scope: str, ordinal: int) -> np.ndarray:
    values = values.view(np.uint64)
    if scope == "local":
        values = values | np.uint64(LOCAL_BIT | ordinal << LOCAL_ID_BITS)
    return values


def _lineage(reqs: list[_Req], threads: list[_Thread]) -> list[int | None]:
    """Parent position (in `reqs`, sorted by time) of each request, by the declared rules. Linear in the
    requests and sub-agents but for one binary search per sub-agent (`_latest_at_or_before`)."""
    parents: list[int | None] = []
    last: dict[int, int] = {}  # thread -> its latest request so far
    by_thread: dict[int, tuple[list[float], list[int]]] = {}  # thread -> its requests' times and positions
    for i, r in enumerate(reqs):
        times, positions = by_thread.setdefault(r.thread, ([], []))
        times.append(r.t)
        positions.append(i)
    for i, r in enumerate(reqs):
        p = last.get(r.thread)
        if p is None and r.thread != 0:
            th = threads[r.thread]
            p = _latest_at_or_before(by_thread.get(th.parent, ([], [])), th.start, i)
        parents.append(p)
        last[r.thread] = i
    return parents


def _latest_at_or_before(thread: tuple[list[float], list[int]], t: float, before: int) -> int | None:
    """The latest position of a thread's requests (`thread`: their times and positions, both ascending, as
    `reqs` is sorted by time then position) with time <= t and position < `before`."""
    times, positions = thread
    k = min(bisect_right(times, t), bisect_left(positions, before))
    return positions[k - 1] if k else None


#: The invocation columns an import fills (the writer adds the rest).
_FILE_COLUMNS = ("request_id", "seq", "family_id", "parent_id", "num_prompt_tokens", "num_output_tokens",
                 "prompt_block_hashes", "arrival_ns", "first_token_ns", "finish_ns", "status", "agent_id", "agent_type")


def _file_schema() -> "pa.Schema":
    """`_FILE_COLUMNS` typed as the contract types them."""
    import pyarrow as pa

    return pa.schema([schema.INVOCATIONS.column(c).field() for c in _FILE_COLUMNS])


class _Batch:
    """Tables waiting to become one Parquet part each of invocations and lineage.

    Parts are encoded and written on one background thread (Arrow and zstd release the GIL), so the
    next files are parsed meanwhile; at most one batch is in flight, which bounds memory."""

    def __init__(self, writer: TraceWriter):
        self.writer = writer
        self.inv: list[pa.Table] = []
        self.edges: list[dict] = []
        self.rows = self.ids = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kmesh-import-writer")
        self._pending: Future | None = None

    def add(self, inv: pa.Table, edges: list[dict], num_ids: int) -> None:
        self.inv.append(inv)
        self.edges.extend(edges)
        self.rows += inv.num_rows
        self.ids += num_ids
        if self.rows >= ROWS_PER_PART or self.ids >= IDS_PER_PART:
            self.flush()

    def flush(self) -> None:
        self.wait()
        inv, edges = self.inv, self.edges
        self.inv, self.edges, self.rows, self.ids = [], [], 0, 0
        if inv or edges:
            self._pending = self._pool.submit(self._write, inv, edges)

    def _write(self, inv: list[pa.Table], edges: list[dict]) -> None:
        import pyarrow as pa

        if inv:
            self.writer.write("invocations", pa.concat_tables(inv))
        if edges:
            self.writer.write("lineage", edges)

    def wait(self) -> None:
        """Block until the batch in flight is written; re-raise its error."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        self.flush()
        self.wait()
        self._pool.shutdown()


@dataclass
class FileRows:
    """One conversation's invocation rows as the import writes them (`_FILE_COLUMNS`, in time order), with the
    block hashes as offsets into one uint64 array; `read_weka` keeps them in memory, the import writes them."""

    columns: dict[str, list]  # every column of _FILE_COLUMNS but prompt_block_hashes
    offsets: np.ndarray  # int64, one more than the rows: row i lists hashes[offsets[i]:offsets[i + 1]]
    hashes: np.ndarray  # uint64

    def __len__(self) -> int:
        return len(self.columns["request_id"])

    def edges(self) -> list[dict]:
        """The declared lineage edges of the rows (the import's `lineage` rows)."""
        c = self.columns
        return [{"child_request_id": child, "parent_request_id": parent, "declared_parent_id": parent,
                 "family_id": fid, "edge_kind": schema.EdgeKind.declared.value}
                for child, parent, fid in zip(c["request_id"], c["parent_id"], c["family_id"]) if parent is not None]

    def table(self) -> "pa.Table":
        import pyarrow as pa

        hashes = pa.ListArray.from_arrays(pa.array(self.offsets.astype(np.int32), pa.int32()),
                                          pa.array(self.hashes, pa.uint64()))
        c = self.columns
        return pa.Table.from_pydict({**{k: c[k] for k in _FILE_COLUMNS[:6]}, "prompt_block_hashes": hashes,
                                     **{k: c[k] for k in _FILE_COLUMNS[7:]}}, schema=_file_schema())


def file_rows(fid: str, reader: _FileReader, values: np.ndarray, first_seq: int, start_s: float) -> FileRows:
    """The rows of one read conversation (`read_conversation`) started at `start_s` on the trace's clock."""
    reqs = reader.reqs
    order = sorted(range(len(reqs)), key=lambda i: (reqs[i].t, i))
    reqs_sorted = [reqs[i] for i in order]
    lengths = np.fromiter((r.end - r.start for r in reqs_sorted), np.int64, len(reqs))
    starts = np.fromiter((r.start for r in reqs_sorted), np.int64, len(reqs))
    offsets = np.zeros(len(reqs) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if len(reqs) and not (starts == offsets[:-1]).all():  # not already in file order, back to back
        values = values[np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])]
    elif len(reqs):
        values = values[:offsets[-1]]
    else:
        values = values[:0]
    threads = reader.threads
    counters: dict[int, int] = {}
    ids = []
    for r in reqs_sorted:
        n = counters.get(r.thread, 0)
        counters[r.thread] = n + 1
        ids.append(f"{fid}/{threads[r.thread].label}/{n}")
    parents = _lineage(reqs_sorted, threads)
    arrival, first_token, finish = [], [], []
    for r in reqs_sorted:
        a = round((start_s + r.t) * 1e9)
        arrival.append(a)
        first_token.append(None if r.ttft is None else a + round(r.ttft * 1e9))
        finish.append(None if r.api_time is None else a + round(r.api_time * 1e9))
    columns = {
        "request_id": ids,
        "seq": list(range(first_seq, first_seq + len(reqs))),
        "family_id": [fid] * len(reqs),
        "parent_id": [None if p is None else ids[p] for p in parents],
        "num_prompt_tokens": [r.n_in for r in reqs_sorted],
        "num_output_tokens": [r.n_out for r in reqs_sorted],
        "arrival_ns": arrival,
        "first_token_ns": first_token,
        "finish_ns": finish,
        "status": ["length_capped" if r.stop == "max_tokens" else "finished" for r in reqs_sorted],
        "agent_id": [threads[r.thread].agent_id for r in reqs_sorted],
        "agent_type": [threads[r.thread].agent_type for r in reqs_sorted],
    }
    return FileRows(columns, offsets, values.view(np.uint64))


def _file_table(fid: str, reader: _FileReader, values: np.ndarray, first_seq: int, start_s: float,
                block_size: int) -> "tuple[pa.Table, list[dict]]":
    """The invocations table and lineage rows the import writes for one conversation."""
    rows = file_rows(fid, reader, values, first_seq, start_s)
    return rows.table(), rows.edges()


def conversation_files(src: Path) -> list[Path]:
    """The `.json` files of `src` (a directory, searched one level deep, or one file), in name order."""
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise InputFormatError(f"{src} is neither a directory nor a file.")
    return sorted(p for p in src.iterdir() if p.suffix.lower() == ".json" and p.is_file())


def _checked_files(src: Path) -> list[Path]:
    """`conversation_files(src)`, refused when there are none or more than one import numbers."""
    files = conversation_files(src)
    if not files:
        raise InputFormatError(f"{src} holds no .json conversation files.")
    if len(files) > MAX_FILES:
        raise InputFormatError(f"{src} holds {len(files):,} files; one import takes at most {MAX_FILES:,}.")
    return files


def _conversations(files: list[Path], arrival: Arrival, report: WekaReport, on_bytes, fast: bool) -> Iterator[FileRows]:
    """The rows of every readable conversation of `files` in order, placed on the time axis by `arrival`;
    `report` counts every file, request, id, edge and bad entry as the import reports them."""
    clock = _Clock(arrival)
    families: set[str] = set()
    for ordinal, path in enumerate(files):
        report.num_files += 1
        try:
            data = path.read_bytes()
        except OSError as e:  # one unreadable file is counted and listed; the others are still imported
            report.num_unreadable_files += 1
            report.bad_file(path.name, f"unreadable ({e.strerror or type(e).__name__})")
            continue
        if on_bytes is not None:
            on_bytes(len(data))
        got = read_conversation(data, path.name, ordinal, report.block_size, families, fast)
        del data
        if isinstance(got, str):
            report.bad_file(path.name, got)
            continue
        top, reader, values = got
        fid = top["id"]
        report.block_size = top["block_size"]
        families.add(fid)
        for where, why in reader.bad:
            report.entry(f"{path.name}: {where}", why)
        report.num_subagents += len(reader.threads) - 1
        start_s = clock.start(reader.end)
        if start_s + reader.latest > MAX_SECONDS:
            raise InputFormatError(f"--arrival {arrival} starts {path.name} at {start_s:.3g} s, so its requests fall "
                                   f"beyond the trace's clock (at most {MAX_SECONDS:,.0f} s); choose a smaller stagger "
                                   "or more users.")
        rows = file_rows(fid, reader, values, report.num_invocations, start_s)
        report.num_families += 1
        report.num_invocations += len(rows)
        report.num_block_hashes += len(rows.hashes)
        report.num_lineage_edges += sum(p is not None for p in rows.columns["parent_id"])
        yield rows


def engine_metadata(src: Path, arrival: Arrival) -> dict:
    """The engine metadata of an import of `src` (the writer adds its own bookkeeping; the block size and
    the counts come once the files are read: `final_metadata`)."""
    config = {"format": FORMAT, "source": str(src), "arrival": str(arrival)}
    return {"engine": "kv-cache-tester trace", "capture_config": config, "arrival": str(arrival)}


def final_metadata(report: WekaReport) -> dict:
    """What the import adds to the engine metadata once every file is read."""
    return {"block_size": report.block_size, "num_malformed_lines": report.num_malformed_lines,
            "malformed_lines": report.malformed_lines, "import_counts": _counts(report)}


def import_weka(src: str | Path, out: str | Path, *, engine_id: str = "import-weka", arrival: str | Arrival = DEFAULT_ARRIVAL,
                on_bytes: Callable[[int], None] | None = None, fast: bool = True) -> WekaReport:
    """Import a directory of kv-cache-tester conversation files (or one file); see the module docstring.
    `fast=False` reads every file the plain way (the reference the fast path is tested against)."""
    from kmesh_trace.writer import TraceWriter

    src = Path(src)
    arrival = arrival if isinstance(arrival, Arrival) else Arrival.parse(arrival)
    files = _checked_files(src)
    report = WekaReport(FORMAT, str(src), str(out), engine_id, arrival=str(arrival))
    writer = TraceWriter(out, engine_id, engine_metadata(src, arrival), source=f"import:{FORMAT}")
    batch = _Batch(writer)
    for rows in _conversations(files, arrival, report, on_bytes, fast):
        batch.add(rows.table(), rows.edges(), len(rows.hashes))
    batch.close()
    writer.update_metadata(**final_metadata(report))
    writer.close()
    return report


@dataclass
class WekaRows:
    """Every conversation's rows of a weka input, in import order (`seq`), held in memory."""

    columns: dict[str, list]
    offsets: list[int]
    hashes: array  # array('Q')


def read_weka(src: str | Path, *, engine_id: str = "import-weka", arrival: str | Arrival = DEFAULT_ARRIVAL,
              fast: bool = True) -> tuple[WekaRows, WekaReport, dict]:
    """The rows `import_weka` would write (row i is seq i), its report and engine metadata, read into memory
    without pyarrow (what an analysis reads when it is given a weka directory as it is)."""
    src = Path(src)
    arrival = arrival if isinstance(arrival, Arrival) else Arrival.parse(arrival)
    report = WekaReport(FORMAT, str(src), "", engine_id, arrival=str(arrival))
    columns: dict[str, list] = {k: [] for k in _FILE_COLUMNS if k != "prompt_block_hashes"}
    offsets, hashes = [0], array("Q")
    for rows in _conversations(_checked_files(src), arrival, report, None, fast):
        for k, v in rows.columns.items():
            columns[k].extend(v)
        base = offsets[-1]
        offsets.extend((rows.offsets[1:] + base).tolist())
        hashes.frombytes(rows.hashes.tobytes())
    return WekaRows(columns, offsets, hashes), report, {**engine_metadata(src, arrival), **final_metadata(report)}


def _check_file(conv: Any, block_size: int | None, families: set[str]) -> str | None:
    """Why a parsed file cannot be imported as a whole, or None."""
    if not isinstance(conv, dict):
        return "the file's JSON value is not an object"
    fid = conv.get("id")
    if not isinstance(fid, str) or not fid:
        return "field id missing or not a string"
    if fid in families:
        return f"id {fid!r} repeats an earlier file's"
    bs = conv.get("block_size")
    if type(bs) is not int or bs <= 0:
        return "field block_size missing or not a positive integer"
    if bs > schema.MAX_BLOCK_SIZE:
        return f"block_size {bs} is above {schema.MAX_BLOCK_SIZE}, larger than any engine's block"
    if block_size is not None and bs != block_size:
        return f"block_size {bs} differs from the {block_size} of the files before it (one trace, one block size)"
    if conv.get("hash_id_scope") not in (None, "local", "global"):
        return f"hash_id_scope {conv.get('hash_id_scope')!r} is neither local nor global"
    if not isinstance(conv.get("requests"), list):
        return "field requests missing or not a list"
    return None


def _counts(report: WekaReport) -> dict[str, int]:
    keys = ("num_files", "num_families", "num_invocations", "num_subagents", "num_block_hashes",
            "num_lineage_edges", "num_malformed_files", "num_unreadable_files", "num_malformed_entries")
    return {k: getattr(report, k) for k in keys}
