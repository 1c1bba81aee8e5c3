"""The exact headroom curve of a Mooncake JSONL file, or of a trace imported from one, too long for its stream
to be held (or long enough for this path to cost about the same time and less memory): the stream is built
piece by piece onto disk, and the curve kernels read it from there, so the memory the analysis holds is the
kernels' own (per object and per capacity), not the stream's 13 bytes an access.

- Input: the file is read in pieces of `CHUNK_BYTES` by the compiled line reader
  (datasets/importers/mooncake.py, through oracle/stream_pieces.py, which the sample at read time shares), never whole; a line it does not take (anything but the plain shape)
  stops the path with an error that names `--sample`, the way that reads any file. A trace is read record
  batch by record batch (`stream_pieces.TRACE_BATCH_ROWS` rows of its Parquet parts, each part's row group read whole by
  pyarrow); only a hash-only one (an import: no token ids, measured hits, finish times, usable blocks or KV
  cache groups), its rows stored in seq order, is taken.
- Ids: each hash gets a dense int32 id at its first sighting, from a hash table that lives across pieces
  (native/kernels/streamed_stream.c); only the distinct hashes are held (about 16 bytes each). The ids number the objects in
  another order than the in-memory stream's ranks; no policy's result depends on the numbering (the
  curves and the replays index state by id and never compare ids), and the tests compare the two paths'
  JSON byte for byte.
- Next uses: a backward pass over the pieces written (4 bytes a distinct object held), written to disk.
- The curves: the stream's three columns (ids, eligible flags, next uses) are mapped from their files, and
  `headroom_curve` runs on them as on any stream, its kernels unchanged (so its result is the in-memory
  one by construction). While they run, a thread drops the mapped pages behind them every
  `DROP_INTERVAL_S` (madvise MADV_DONTNEED: the pages stay in the page cache, a kernel that reads one again
  maps it again), so the resident part of the stream stays what the kernels read in that interval.

`choose_path` picks the path before anything is read, from the file's size and the block reads per byte of
`SNIFF_BYTES` read in windows from its head to its end (a trace: the block hashes its Parquet footers count): this path from
`STREAMED_FROM_READS` block reads on (there it takes about the in-memory path's time and about half its
memory), and below that when the in-memory curves do not fit the memory budget (`--memory-budget`,
default half the memory available) but this path's own needs do; else the in-memory path, whose sampled
curve says why. `--sample 1` (the exact curve, whatever the budget) takes this path when the in-memory one
does not fit. The disk it takes is checked against the free space of the temporary directory before the
first pass (from the estimate) and after it (from the exact count); a disk that fills meanwhile stops the
path as the other refusals do. Rows must come in arrival order (timestamps not decreasing), as a recorded trace does; what
this path cannot read raises `Unstreamable`, which the CLI turns into the in-memory path (with a note), or,
where the exact curve was asked for and memory cannot hold it, into the error with the way round it
(`--sample`).
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.native.kernels import I64, P, check, declare, ptr
from kmesh_trace.oracle.stream import AccessStream, kept_and_eligible
from kmesh_trace.oracle.stream_index import NEVER
from kmesh_trace.oracle.stream_pieces import Unstreamable, jsonl_pieces, trace_pieces
from kmesh_trace.oracle.workload import RequestColumns, Workload

#: Bytes of the file read at a time (and the largest piece of the stream held in memory, about).
CHUNK_BYTES = 16 << 20
#: Accesses per piece of the backward next-use pass.
NEXT_USE_PIECE = 1 << 23
#: Seconds between two drops of the mapped stream pages the kernels have read.
DROP_INTERVAL_S = 0.2
#: Bytes of the file read to estimate its block reads per byte, in `SNIFF_WINDOWS` windows from head to end.
SNIFF_BYTES = 4 << 20
SNIFF_WINDOWS = 16
#: The fewest bytes a block read takes in a Mooncake line (a one-digit id and its comma).
MIN_BYTES_PER_READ = 2
#: What this path holds, per block read (the kernels' per-object and per-capacity state, the grid's hits per
#: request: 7.9 B a read in all at 10^8 reads of the agentic stream of benchmarks/billion_reads_bench.py) and
#: beside them (the interpreter, libraries and the pieces in flight).
STREAMED_BYTES_PER_READ = 8
STREAMED_FIXED_BYTES = 256 << 20
#: Disk the stream takes: int32 ids, a bool and an int64 next use an access.
DISK_BYTES_PER_ACCESS = 13

_new = declare("ks_idtable_new", [I64], P)
_free = declare("ks_idtable_free", [P])
_assign = declare("ks_idtable_assign", [P, P, I64, P], I64)
_next_uses = declare("ks_streamed_next_uses", [P, P, I64, I64, P, I64, P])
_ETOOMANY = -75


# ---- which path ------------------------------------------------------------------------------------------

def estimated_reads(path: Path) -> int:
    """Block reads of Mooncake JSONL `path`: counted in the whole file when it is at most `SNIFF_BYTES` long,
    else estimated from the hash ids per byte of `SNIFF_WINDOWS` windows spread from its head to its end (whole
    record lines only; blank lines list none). Where no window holds a record, the most the file's bytes can
    list (`MIN_BYTES_PER_READ` each): an estimate that errs high sends a long file to the bounded paths, never
    into memory."""
    size = path.stat().st_size
    if size <= SNIFF_BYTES:
        with open(path, "rb") as f:
            return _ids_in(f.read())[0]
    width = SNIFF_BYTES // SNIFF_WINDOWS
    ids = seen = records = 0
    with open(path, "rb") as f:
        for k in range(SNIFF_WINDOWS):
            at = (size - width) * k // (SNIFF_WINDOWS - 1)
            f.seek(at)
            window = f.read(width)
            if at > 0:  # from the first line that starts in the window
                window = window[window.find(b"\n") + 1:] if b"\n" in window else b""
            window = window[:window.rfind(b"\n") + 1]
            got, lines = _ids_in(window)
            ids, seen, records = ids + got, seen + len(window), records + lines
    if not records:
        return size // MIN_BYTES_PER_READ
    return int(ids * size / max(seen, 1))


def _ids_in(text: bytes) -> tuple[int, int]:
    """(hash ids listed, record lines) in whole lines `text`: per record line, 3 commas separate the 4 fields
    and k - 1 the k ids."""
    lines = [line for line in text.split(b"\n") if line.strip()]
    return sum(max(line.count(b",") - 2, 0) for line in lines), len(lines)


#: Why a curve's stream is built on disk (`choose_path`), as its note says it.
TOO_LARGE = "the in-memory stream would not fit the memory budget"
LARGE = "at this length the disk path takes about the in-memory path's time and about half its memory"
#: Block reads from which the exact curve of a Mooncake file (or an imported trace) builds its stream on disk
#: even where the in-memory one fits. On benchmarks/billion_reads_bench.py's agentic stream (benchmarks/README.md),
#: whole process, this path against the in-memory one: at 10^8 reads 0.88x and 1.02x the time in two runs, and
#: 0.57x-0.59x the peak memory; at 5 x 10^7 1.04x and 0.7x; at 10^7 1.1x and 0.77x.
STREAMED_FROM_READS = 1 << 26


def choose_path(path, options, *, remote: bool = False) -> str | None:
    """Why `headroom` should build the stream of `path` on disk (this module: `TOO_LARGE` or `LARGE`), or None
    for the in-memory path: see the module docstring. Only a default-shaped curve of one Mooncake JSONL file
    or one trace directory of one engine partition is taken here."""
    from kmesh_trace.oracle.headroom import EXACT_CURVE_BYTES_PER_ACCESS

    if path is None or remote or not options.wants_curve or options.capacities is not None:
        return None
    if options.partitions is not None or options.sample not in (None, 1) or options.sample_memory_mib is not None:
        return None
    path = Path(path)
    if "://" in str(path):
        return None
    if path.is_dir():
        reads = trace_reads(path)
    elif path.is_file() and _is_mooncake(path):
        reads = estimated_reads(path)
    else:
        return None
    budget = _budget(options.memory_budget_gib)
    if reads is None or budget is None:
        return None
    fits = streamed_bytes(reads) <= budget
    if reads * EXACT_CURVE_BYTES_PER_ACCESS <= budget:  # the in-memory curve fits
        return LARGE if reads >= STREAMED_FROM_READS and fits else None
    return TOO_LARGE if options.sample == 1 or fits else None


def trace_reads(path: Path) -> int | None:
    """Block hashes the invocations of trace directory `path` list, from its Parquet footers; None when it is
    not a trace of one engine partition."""
    parts = sorted(path.glob("invocations/engine=*/part-*.parquet"))
    if not (path / "kmesh_trace.json").is_file() or not parts or len({p.parent for p in parts}) != 1:
        return None
    if not all(p.is_file() and not p.is_symlink() for p in parts):  # a FIFO would block the read: the trace reader
        return None  # says what such a part is
    import pyarrow.parquet as pq

    reads = 0
    try:
        for p in parts:
            meta = pq.read_metadata(p)
            for g in range(meta.num_row_groups):
                rg = meta.row_group(g)
                reads += next((rg.column(i).num_values for i in range(rg.num_columns)
                               if rg.column(i).path_in_schema.startswith("prompt_block_hashes.")), 0)
    except Exception:  # a damaged part: the trace reader says what it is
        return None
    return reads


def _is_mooncake(path: Path) -> bool:
    """The file's first non-blank line is a Mooncake record (its four fields), as the format's sniffer finds."""
    import json

    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                try:
                    rec = json.loads(line)
                except ValueError:
                    return False
                return isinstance(rec, dict) and {"timestamp", "input_length", "output_length", "hash_ids"} <= rec.keys()
    return False


def streamed_bytes(reads: int) -> int:
    """What this path is expected to hold for a stream of `reads` block reads."""
    return STREAMED_FIXED_BYTES + reads * STREAMED_BYTES_PER_READ


def _budget(gib: float | None) -> int | None:
    if gib is not None:
        return int(gib * 2**30)
    from kmesh_trace.resources import MEMORY_FRACTION, available_memory

    room = available_memory()
    return None if room is None else int(room * MEMORY_FRACTION)


# ---- the stream on disk ------------------------------------------------------------------------------------

class DiskStream:
    """The access stream of a Mooncake JSONL file, or of a hash-only trace's one engine partition (an import: a
    `kmesh_trace.trace.Trace` opened by the caller), written under a temporary directory: `stream` (its columns
    mapped from there) and the per-request columns the vllm pool model reads. Use as a context manager: the
    files go when it closes."""

    def __init__(self, source, block_size: int, *, chunk_bytes: int = CHUNK_BYTES,
                 piece: int = NEXT_USE_PIECE, tmp_dir: str | None = None) -> None:
        self.trace = None if isinstance(source, (str, Path)) else source
        self.path = Path(source) if self.trace is None else Path(self.trace.path)
        self.block_size = int(block_size)
        self.dir = Path(tempfile.mkdtemp(prefix="kmesh-stream-", dir=tmp_dir))
        self.stream: AccessStream | None = None
        self.columns: RequestColumns | None = None
        self._maps: list = []
        try:
            estimate = estimated_reads(self.path) if self.trace is None else trace_reads(self.path)
            self._check_disk((estimate or 0) * DISK_BYTES_PER_ACCESS)
            self._build(chunk_bytes, piece)
        except BaseException:
            self.close()
            raise

    def _check_disk(self, need: int) -> None:
        """Refuse (`Unstreamable`) `need` bytes more of the stream's files where the temporary directory has
        less free."""
        free = shutil.disk_usage(self.dir).free
        if need > free:
            raise Unstreamable(f"the stream of {self.path.name} takes about {need / 2**30:,.1f} GiB more on disk "
                               f"and {self.dir.parent} has {free / 2**30:,.1f} GiB free; point TMPDIR elsewhere, "
                               "or give --sample RATE.")

    @contextmanager
    def _disk_full_is_a_refusal(self):
        """A write that finds the temporary directory full stops this path in one sentence (`Unstreamable`)."""
        try:
            yield
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise Unstreamable(f"{self.dir.parent} filled up while the stream of {self.path.name} was written "
                               "there; point TMPDIR elsewhere, or give --sample RATE.") from None

    def _build(self, chunk_bytes: int, piece: int) -> None:
        with self._disk_full_is_a_refusal():
            tokens, num_reads, n_full, n_out, arrival = self._ids_and_flags(chunk_bytes)
            n = int(n_full.sum())
            if n >= 2**30:  # the belady curve's times are int32 (oracle/curves.py)
                raise Unstreamable(f"the exact curves handle up to 2^30 block accesses, not {n:,}; give --sample RATE.")
            self._check_disk(8 * n)  # the int64 next uses still to come: the estimate may have been low
            self._next_uses(n, piece)
        req_start = np.zeros(len(tokens) + 1, np.int64)
        np.cumsum(n_full, out=req_start[1:])
        obj, eligible, next_use = (self._map(name, dtype, n) for name, dtype in
                                   (("obj", np.int32), ("eligible", np.bool_), ("next_use", np.int64)))
        self.stream = AccessStream(self.block_size, obj, eligible, next_use, req_start, tokens, num_reads,
                                   self.num_objects)
        self.columns = RequestColumns.of_values(n_out, arrival, None)

    def _ids_and_flags(self, chunk_bytes: int) -> tuple[np.ndarray, ...]:
        """Pass 1: the input's rows in pieces; each piece's kept blocks get their ids and eligible flags, written
        to `obj` and `eligible`. Returns the per-request columns (prompt tokens, listed reads, kept blocks,
        output tokens, arrival)."""
        from kmesh_trace.oracle.stream_index import leading_flags

        table = _new(1 << 20)
        if not table:
            raise MemoryError("the stream's id table")
        cols: dict[str, list[np.ndarray]] = {k: [] for k in ("tokens", "reads", "full", "out", "arrival")}
        last_arrival = None
        self.num_objects = 0
        pieces = (jsonl_pieces(self.path, self.block_size, chunk_bytes) if self.trace is None
                  else trace_pieces(self.trace))
        try:
            with open(self.dir / "obj", "wb") as fo, open(self.dir / "eligible", "wb") as fe:
                for offsets, hashes, tokens, n_out, arrival in pieces:
                    if (last_arrival is not None and arrival[0] < last_arrival) or (np.diff(arrival) < 0).any():
                        raise Unstreamable(
                            f"{self.path.name}: rows are not in arrival order (a timestamp goes back), which the "
                            "bounded-memory curve reads in one pass; sort the file by timestamp, or give --sample RATE.")
                    last_arrival = int(arrival[-1])
                    self._piece(offsets, hashes, tokens, n_out, arrival, table, cols, fo, fe, leading_flags)
        finally:
            pieces.close()
            _free(table)
        if not cols["tokens"]:
            raise KmeshTraceError(f"{self.path.name} holds no request.")
        return tuple(np.concatenate(cols[k]) for k in ("tokens", "reads", "full", "out", "arrival"))

    def _piece(self, off, hashes, tokens, n_out, arrival, table, cols, fo, fe, leading_flags) -> None:
        rows = len(tokens)
        tokens = np.array(tokens, np.int64)
        num_reads = np.diff(off)
        n_full, n_elig = kept_and_eligible(num_reads, tokens, self.block_size)
        total = int(n_full.sum())
        starts = np.zeros(rows + 1, np.int64)
        np.cumsum(n_full, out=starts[1:])
        # The first n_full[r] hashes of each row, rows back to back.
        idx = np.arange(total, dtype=np.int64) + np.repeat(off[:-1] - starts[:-1], n_full)
        kept = np.ascontiguousarray(hashes[idx], np.uint64)
        ids = np.empty(total, np.int32)
        got = _assign(table, ptr(kept, np.uint64), total, ptr(ids, np.int32))
        if got == _ETOOMANY:
            raise Unstreamable(f"{self.path.name} has more than 2^31 - 1 distinct blocks; give --sample RATE.")
        self.num_objects = check(got, "the stream's ids")
        fo.write(ids.data)  # file writes, not ndarray.tofile: a full disk is an OSError with its errno
        fe.write(leading_flags(starts, n_elig).data)
        for k, v in (("tokens", tokens), ("reads", num_reads), ("full", n_full),
                     ("out", np.array(n_out, np.int64)), ("arrival", np.array(arrival, np.int64))):
            cols[k].append(v)

    def _next_uses(self, n: int, piece: int) -> None:
        """Pass 2: next uses, piece by piece from the stream's end, into `next_use`."""
        nxt = np.full(max(self.num_objects, 1), -1, np.int32)  # positions < 2^30
        with open(self.dir / "obj", "rb") as fo, open(self.dir / "eligible", "rb") as fe, \
                open(self.dir / "next_use", "wb") as fn:
            fn.truncate(8 * n)
            out = np.empty(min(piece, max(n, 1)), np.int64)
            end = n
            while end > 0:
                start = max(end - piece, 0)
                m = end - start
                fo.seek(4 * start)
                obj = np.fromfile(fo, np.int32, m)
                fe.seek(start)
                elig = np.fromfile(fe, np.bool_, m)
                _next_uses(ptr(obj, np.int32), ptr(elig, np.bool_), m, start, ptr(nxt, np.int32), int(NEVER),
                           ptr(out, np.int64))
                os.pwrite(fn.fileno(), out[:m].data, 8 * start)
                end = start

    def _map(self, name: str, dtype, n: int) -> np.ndarray:
        if n == 0:
            return np.zeros(0, dtype)
        a = np.memmap(self.dir / name, dtype=dtype, mode="r", shape=(n,))
        self._maps.append(a._mmap)
        return a

    @contextmanager
    def dropping(self, interval: float = DROP_INTERVAL_S):
        """While inside: the mapped pages of the stream dropped every `interval` seconds (see the module)."""
        stop = threading.Event()

        def drop() -> None:
            while not stop.wait(interval):
                for m in self._maps:
                    try:
                        m.madvise(mmap.MADV_DONTNEED)
                    except (ValueError, OSError):  # closed meanwhile
                        pass

        t = threading.Thread(target=drop, name="drop-stream-pages", daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()

    def close(self) -> None:
        self.stream = None
        self._maps.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "DiskStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- the curve -------------------------------------------------------------------------------------------

def streamed_run(source, options, executor=None, *, fitted=None, note: str | None = None, progress=None,
                 chunk_bytes: int = CHUNK_BYTES, piece: int = NEXT_USE_PIECE, why: str = TOO_LARGE):
    """`oracle.headroom.run` of the Mooncake JSONL file `source`, or of the hash-only trace `source` (opened and
    checked by the caller, with its fitted prefill cost and approximate-token note, as the in-memory path
    takes them), on its stream built on disk: the same CurveResult (the input has no usable-block count), with
    a note that says which path ran and `why` (`choose_path`'s answer)."""
    from kmesh_trace.oracle.headroom import run

    if isinstance(source, (str, Path)):
        from kmesh_trace.datasets.importers.mooncake import engine_metadata

        block_size = engine_metadata(Path(source))["block_size"]
    else:
        from kmesh_trace.oracle.stream import engine_geometry

        block_size, _ = engine_geometry(source)

    step = progress or (lambda what: None)
    step("building the stream on disk")
    with DiskStream(source, block_size, chunk_bytes=chunk_bytes, piece=piece) as disk:
        stream = disk.stream
        workload = Workload(block_size, None, stream, None, None, _columns=disk.columns)
        with disk.dropping():
            res = run(workload, replace(options, sample=1), executor, fitted=fitted, note=note, progress=progress)
        res.notes.append(f"bounded memory: the stream of {len(stream):,} block accesses was built on disk and read "
                         f"from there (the exact curves; {why}).")
    return res
