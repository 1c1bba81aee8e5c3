"""The inputs read piece by piece, for the paths that never hold the whole stream: the bounded-memory exact
curve (oracle/streamed_curve.py: the stream built on disk) and the sample taken at read time
(oracle/shards.py). Each yields, piece after piece, (hash offsets, hashes, prompt tokens, output tokens,
arrival ns) of the piece's rows: request r's listed prompt hashes are hashes[offsets[r]:offsets[r + 1]].
The arrays are views, valid until the next piece.

- `jsonl_pieces`: a Mooncake JSONL file read `chunk_bytes` at a time by the importer's compiled parse
  (datasets/importers/mooncake.py); a line it does not take (anything but the plain shape) raises
  `Unstreamable`, which names `--sample`.
- `trace_pieces`: a hash-only trace (an import: no token ids, measured hits, finish times, usable blocks or
  KV cache groups) of one engine partition, its rows stored in seq order, record batch by record batch
  (`TRACE_BATCH_ROWS` rows of its Parquet parts); anything else raises `Unstreamable`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.kv_groups import groups_from_metadata, is_hybrid

__all__ = ["TRACE_BATCH_ROWS", "TRACE_COLUMNS", "Unstreamable", "jsonl_pieces", "trace_pieces"]

#: Rows per record batch read from a trace's invocations, and the columns read.
TRACE_BATCH_ROWS = 1 << 16
TRACE_COLUMNS = ["request_id", "seq", "num_prompt_tokens", "num_output_tokens", "prompt_block_hashes", "arrival_ns",
                 "prompt_token_ids", "finish_ns", "num_cached_tokens"]


class Unstreamable(KmeshTraceError):
    """The file cannot be read by this path (lines out of time order or of another shape, too many accesses
    or blocks, too little disk); the in-memory path may read it."""


def jsonl_pieces(path: Path, block_size: int, chunk_bytes: int):
    """(hash offsets, hashes, prompt tokens, output tokens, arrival) of each piece of the JSONL file, read
    `chunk_bytes` at a time by the importer's compiled parse (views, valid until the next piece)."""
    from kmesh_trace.datasets.importers.mooncake import REFUSED, PlainPieces, ReadBuffer

    path = Path(path)
    with open(path, "rb") as f, ReadBuffer(chunk_bytes) as buf:
        lines = PlainPieces(buf.size, block_size)
        have = 0
        while True:
            if have == buf.size:  # one line longer than the buffer
                buf.grow()
                lines = PlainPieces(buf.size, block_size, lines)
            got = f.readinto(buf.view[have:])
            length, at_end = have + got, got == 0
            used = lines.parse(buf.array, length, at_end)
            if used < 0:
                raise Unstreamable(
                    f"{path.name}: a line is not in the plain Mooncake shape (four integer fields and a flat "
                    "list), which the bounded-memory curve reads; give --sample RATE for a sampled curve."
                    if used == REFUSED else f"{path.name} changed while it was read.")
            rows = int(lines.counts[0])
            if rows:
                yield (lines.offsets[:rows + 1], lines._hash_view, lines.num_prompt_tokens[:rows],
                       lines.num_output_tokens[:rows], lines.arrival_ns[:rows])
                lines.counts[0] = lines.counts[1] = 0  # the next piece's rows and hashes from 0
            if at_end:
                return
            buf.array[:length - used] = buf.array[used:length]
            have = length - used


def _check_engine(trace) -> None:
    name = Path(trace.path).name
    if len(trace.engines) != 1:
        raise Unstreamable(f"{name} has {len(trace.engines)} engine partitions.")
    (meta,) = trace.engines.values()
    if meta.get("num_usable_blocks") or is_hybrid(groups_from_metadata(meta)):
        raise Unstreamable(f"{name} is a capture (its pool's usable blocks, or its KV cache groups), "
                           "which the in-memory path reads.")


def _check_batch(name: str, c: dict, num_rows: int, last_seq: int) -> int:
    """The batch's columns checked (hash-only rows in seq order); returns its last seq."""
    if c["prompt_token_ids"].null_count < num_rows or c["finish_ns"].null_count < num_rows:
        raise Unstreamable(f"{name} holds token ids or finish times (a capture's), which the "
                           "in-memory path reads.")
    if c["prompt_block_hashes"].null_count or c["arrival_ns"].null_count:
        raise Unstreamable(f"{name} has rows without block hashes or arrival times.")
    seq = c["seq"].to_numpy()
    if seq[0] <= last_seq or (np.diff(seq) <= 0).any():
        raise Unstreamable(f"{name}: its rows are not stored in seq order.")
    return int(seq[-1])


def trace_pieces(trace):
    """The same of each record batch of the trace's invocations, its parts in order: rows that `headroom`
    would read in another order (seq not rising), or as more than hashes (token ids, the engine's measured
    hits, finish times: a capture's), stop this path (`Unstreamable`)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    import polars as pl

    name = Path(trace.path).name
    _check_engine(trace)
    last_seq, ids, all_cached = -1, [], True
    for part in trace.parts["invocations"]:
        f = pq.ParquetFile(part)
        if not set(TRACE_COLUMNS) <= set(f.schema_arrow.names):
            raise Unstreamable(f"{part.name} predates columns of the contract, which the in-memory path fills in.")
        for b in f.iter_batches(batch_size=TRACE_BATCH_ROWS, columns=TRACE_COLUMNS):
            if b.num_rows == 0:
                continue
            c = dict(zip(b.schema.names, b.columns))
            last_seq = _check_batch(name, c, b.num_rows, last_seq)
            all_cached = all_cached and c["num_cached_tokens"].null_count == 0
            ids.append(pl.from_arrow(c["request_id"]).hash(seed=0).to_numpy())
            lists = c["prompt_block_hashes"]
            offsets = lists.offsets.to_numpy()
            yield (offsets - offsets[0], lists.values.to_numpy()[offsets[0]:offsets[-1]],
                   c["num_prompt_tokens"].to_numpy(), pc.fill_null(c["num_output_tokens"], 0).to_numpy(),
                   c["arrival_ns"].to_numpy())
    if all_cached and ids:
        raise Unstreamable(f"{name} has the engine's measured hits of every request (a capture's), "
                           "which the in-memory path reads.")
    hashed = np.sort(np.concatenate(ids)) if ids else np.zeros(0, np.uint64)
    if (hashed[1:] == hashed[:-1]).any():  # a repeat, or (rarely) two ids of one hash: the in-memory path judges
        raise Unstreamable(f"{name}: a request id may appear twice, which the in-memory path checks.")
