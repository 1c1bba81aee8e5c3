"""Payload stores and their journals: what `replay prepare` writes and `replay run` reads.

A store is a directory holding `journal.parquet` and `payload/restore-NNNNNN.bin`. Each payload file
holds one restore's chunks back to back at O_DIRECT-aligned offsets; every chunk's bytes are a
deterministic pseudo-random function of (seed, restore id, chunk index), so a run can compare every
byte against an independent reference as well as against the SHA-256 the journal recorded. This module
owns that layout, the generator, journal validation (alignment, missing or short files) and sizing
restores from a trace's `transfers` table. It imports only pyarrow, numpy and the standard library.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kmesh_trace.errors import InputFormatError, KmeshTraceError

ALIGNMENT = 4096  # O_DIRECT offsets, sizes and buffers; statx DIOALIGN often says 512, 4096 is safe everywhere
DEFAULT_CHUNK_BYTES = 3 << 20
MAX_CHUNK_BYTES = 1 << 30  # one io_uring read (and the engine's per-chunk limit); larger chunks cannot be restored
DEFAULT_NUM_CHUNKS = 16  # one 48 MiB ancestor
JOURNAL = "journal.parquet"
STORE_FORMAT = "kmesh-replay-store/1"

JOURNAL_SCHEMA = pa.schema([
    pa.field("restore_id", pa.int64(), False),
    pa.field("chunk_index", pa.int32(), False),
    pa.field("chunk_key", pa.string(), False),
    pa.field("file", pa.string(), False),  # relative to the store
    pa.field("offset_bytes", pa.int64(), False),
    pa.field("size_bytes", pa.int64(), False),
    pa.field("sha256", pa.string(), False),  # hex
])


class StoreError(KmeshTraceError):
    """A payload store or journal is missing, misaligned or inconsistent."""


@dataclass(frozen=True)
class Chunk:
    restore_id: int
    chunk_index: int
    chunk_key: str
    file: str
    offset_bytes: int
    size_bytes: int
    sha256: str


@dataclass
class Store:
    """A validated store: its chunks grouped by restore, in journal order."""

    path: Path
    seed: int
    restores: dict[int, list[Chunk]]
    meta: dict

    @property
    def num_bytes(self) -> int:
        return sum(c.size_bytes for cs in self.restores.values() for c in cs)

    def restore_bytes(self, restore_id: int) -> int:
        return sum(c.size_bytes for c in self.restores[restore_id])

    def file_path(self, chunk: Chunk) -> Path:
        return self.path / chunk.file


def payload(seed: int, restore_id: int, chunk_index: int, size: int) -> bytes:
    """The reference content of one chunk (independent of any file)."""
    return np.random.Generator(np.random.PCG64([seed, restore_id, chunk_index])).bytes(size)


def check_aligned(what: str, value: int, alignment: int = ALIGNMENT) -> None:
    if value <= 0 or value % alignment:
        raise StoreError(f"{what} is {value} bytes, not a positive multiple of {alignment} (O_DIRECT alignment); "
                         f"use a multiple of {alignment}")


def check_chunk_bytes(what: str, value: int) -> None:
    """A chunk size the engine can read: O_DIRECT-aligned and at most MAX_CHUNK_BYTES."""
    check_aligned(what, value)
    if value > MAX_CHUNK_BYTES:
        raise StoreError(f"{what} is {value} bytes, more than the {MAX_CHUNK_BYTES} (1 GiB) one io_uring read can "
                         f"move; use a smaller chunk size")


MAX_SEED = (1 << 64) - 1


def check_seed(seed: object, where: str = "--seed") -> int:
    """A payload seed: an integer in 0..2**64-1 (the generator's seed words are unsigned)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise StoreError(f"{where} must be an integer in 0..{MAX_SEED} (got {seed!r})")
    return seed


def plan_uniform(num_restores: int, num_chunks: int, chunk_bytes: int) -> list[list[int]]:
    """Chunk sizes of `num_restores` restores of `num_chunks` chunks of `chunk_bytes` each."""
    check_chunk_bytes("--chunk-bytes", chunk_bytes)
    if num_restores <= 0 or num_chunks <= 0:
        raise StoreError("a store needs at least one restore of at least one chunk; raise --num-restores/--chunks")
    return [[chunk_bytes] * num_chunks for _ in range(num_restores)]


def plan_from_trace(trace: Path, chunk_bytes: int, max_restores: int, room: int | None = None) -> list[list[int]]:
    """One restore per completed `load` transfer of a trace, cut into chunks (the last one rounded up).
    A byte count below zero is refused; so is a plan larger than `room` bytes (the free space where the
    store goes), before any chunk list is built."""
    import pyarrow.dataset as ds

    from kmesh_trace.paths import inside

    check_chunk_bytes("--chunk-bytes", chunk_bytes)
    tdir = Path(trace) / "transfers"
    if not tdir.is_dir():
        raise StoreError(f"{trace} has no transfers table; pass a kmesh-trace capture directory to --from")
    parts = sorted(tdir.glob("engine=*/part-*.parquet"))
    if not parts:
        raise StoreError(f"{trace} recorded no transfers; capture with a KV connector to size restores from it")
    for p in parts:
        if not inside(trace, p):
            raise StoreError(f"{p} lies outside the trace (a symbolic link to {os.path.realpath(p)}); a trace reads "
                             "only its own files: move the link out of it")
    t = ds.dataset([str(p) for p in parts], format="parquet").to_table(columns=["direction", "status", "num_bytes"])
    rows = [(i, b) for i, (d, s, b) in enumerate(zip(t["direction"].to_pylist(), t["status"].to_pylist(),
                                                      t["num_bytes"].to_pylist())) if d == "load" and s == "ok" and b]
    bad = next(((i, b) for i, b in rows if b < 0), None)
    if bad is not None:
        raise StoreError(f"transfer row {bad[0]} of {trace} has an impossible size of {bad[1]:,} bytes; the trace is "
                         "damaged")
    if not rows:
        raise StoreError(f"{trace} has no completed load transfers with a byte count; nothing to replay")
    sizes = [-(-b // ALIGNMENT) * ALIGNMENT for _, b in rows[:max_restores]]
    if room is not None and sum(sizes) > room:
        big = max(rows[:max_restores], key=lambda r: r[1])
        raise StoreError(f"the {len(sizes)} restores sized from {trace} need {sum(sizes) / 2**30:,.2f} GiB (transfer "
                         f"row {big[0]} alone asks {big[1] / 2**30:,.2f} GiB) but --out has {room / 2**30:,.2f} GiB "
                         "free; lower --max-restores or write the store elsewhere")
    plan = []
    for b in sizes:
        full, rest = divmod(b, chunk_bytes)
        plan.append([chunk_bytes] * full + ([rest] if rest else []))
    return plan


def prepare(out: Path, plan: list[list[int]], seed: int = 0, source: str = "uniform", progress=None) -> Store:
    """Write payload files and the journal for `plan` (chunk sizes per restore) into `out`."""
    out = Path(out)
    check_seed(seed)
    if (out / JOURNAL).exists():
        raise StoreError(f"{out} already holds a store; choose another --out or delete it first")
    from kmesh_trace.paths import check_free_space

    check_free_space(out, sum(map(sum, plan)), f"the store at {out}")
    (out / "payload").mkdir(parents=True, exist_ok=True)
    rows: dict[str, list] = {f.name: [] for f in JOURNAL_SCHEMA}
    for rid, sizes in enumerate(plan):
        rel = f"payload/restore-{rid:06d}.bin"
        offset = 0
        with open(out / rel, "wb") as f:
            for ci, size in enumerate(sizes):
                check_chunk_bytes(f"chunk {ci} of restore {rid}", size)
                data = payload(seed, rid, ci, size)
                f.write(data)
                for k, v in (("restore_id", rid), ("chunk_index", ci), ("chunk_key", f"r{rid:06d}/c{ci:04d}"),
                             ("file", rel), ("offset_bytes", offset), ("size_bytes", size),
                             ("sha256", hashlib.sha256(data).hexdigest())):
                    rows[k].append(v)
                offset += size
            f.flush()
            os.fsync(f.fileno())  # O_DIRECT reads must see the data on disk, not dirty page-cache pages
        if progress:
            progress(rid + 1, len(plan))
    meta = {"format": STORE_FORMAT, "seed": seed, "alignment": ALIGNMENT, "source": source}
    table = pa.Table.from_pydict(rows, schema=JOURNAL_SCHEMA).replace_schema_metadata(
        {"kmesh_replay_store": json.dumps(meta)})
    tmp = out / (JOURNAL + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, out / JOURNAL)
    return open_store(out)


def open_store(path: Path) -> Store:
    """Read and validate a store: journal columns, O_DIRECT alignment, files present and long enough."""
    path = Path(path)
    jpath = path / JOURNAL
    if not jpath.exists():
        raise StoreError(f"{path} is not a replay store (no {JOURNAL}); create one with `kmesh-trace replay prepare`")
    try:
        table = pq.read_table(jpath)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise InputFormatError(f"cannot read {jpath}: {e}; re-create the store with `replay prepare`") from e
    missing = [f.name for f in JOURNAL_SCHEMA if f.name not in table.column_names]
    if missing:
        raise StoreError(f"{jpath} lacks columns {', '.join(missing)}; re-create the store with `replay prepare`")
    raw = (table.schema.metadata or {}).get(b"kmesh_replay_store")
    try:
        meta = json.loads(raw) if raw else {}
    except (ValueError, UnicodeDecodeError):
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != STORE_FORMAT:
        raise StoreError(f"{jpath} was not written by `replay prepare` ({STORE_FORMAT}); re-create the store")
    seed = check_seed(meta.get("seed", 0), f"the seed in {jpath}")
    try:
        table = table.select(JOURNAL_SCHEMA.names).cast(JOURNAL_SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, ValueError) as e:
        raise StoreError(f"{jpath} has columns of the wrong type ({str(e).splitlines()[0]}); re-create the store "
                         f"with `replay prepare`") from None
    nulls = [c for c in JOURNAL_SCHEMA.names if table[c].null_count]
    if nulls:
        raise StoreError(f"{jpath} has empty (null) entries in {', '.join(nulls)}; re-create the store with "
                         f"`replay prepare`")
    cols = {f.name: table[f.name].to_pylist() for f in JOURNAL_SCHEMA}
    restores: dict[int, list[Chunk]] = {}
    sizes: dict[str, int] = {}
    seen: set[tuple[int, int]] = set()
    root = path.resolve()
    for row in zip(*cols.values()):
        c = Chunk(*row)
        if c.restore_id < 0 or c.chunk_index < 0:
            raise StoreError(f"chunk {c.chunk_key}: restore_id {c.restore_id} and chunk_index {c.chunk_index} must be "
                             f"integers >= 0; re-create the store with `replay prepare`")
        check_chunk_bytes(f"chunk {c.chunk_key}: size", c.size_bytes)
        if c.offset_bytes < 0 or c.offset_bytes % ALIGNMENT:
            raise StoreError(f"chunk {c.chunk_key}: offset {c.offset_bytes} is not a non-negative multiple of "
                             f"{ALIGNMENT} (O_DIRECT alignment); re-create the store with `replay prepare`")
        if (c.restore_id, c.chunk_index) in seen:
            raise StoreError(f"chunk {c.chunk_key}: restore {c.restore_id} lists chunk {c.chunk_index} twice; "
                             f"re-create the store with `replay prepare`")
        seen.add((c.restore_id, c.chunk_index))
        if len(c.sha256) != 64 or any(ch not in "0123456789abcdef" for ch in c.sha256):
            raise StoreError(f"chunk {c.chunk_key}: sha256 {c.sha256[:80]!r} is not a SHA-256 in hex; re-create the "
                             f"store with `replay prepare`")
        if c.file not in sizes:
            fp = path / c.file
            # The journal names files relative to the store; one that leads outside it (an absolute path,
            # `..`, a symbolic link) is refused here, not read and reported later as a failed verification.
            if not fp.resolve().is_relative_to(root):
                raise StoreError(f"chunk {c.chunk_key}: payload file {c.file!r} lies outside the store {path}; "
                                 f"a journal only names files inside its store")
            if not fp.is_file():
                raise StoreError(f"payload file {fp} listed in the journal is missing; re-create the store "
                                 f"with `replay prepare`")
            sizes[c.file] = fp.stat().st_size
        if c.offset_bytes + c.size_bytes > sizes[c.file]:
            raise StoreError(f"payload file {path / c.file} ends at {sizes[c.file]} bytes, before chunk "
                             f"{c.chunk_key} ends ({c.offset_bytes + c.size_bytes}); re-create the store")
        restores.setdefault(c.restore_id, []).append(c)
    if not restores:
        raise StoreError(f"{jpath} lists no chunks; re-create the store with `replay prepare`")
    return Store(path, seed, restores, meta)
