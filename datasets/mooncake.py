"""Importer for the Mooncake FAST'25 trace format (JSONL, one request per line).

Each line: `timestamp` (ms since the trace start), `input_length` and `output_length` (tokens),
`hash_ids` (chained prefix hashes of 512-token blocks; the last block may be partial, so
len(hash_ids) == ceil(input_length / 512)). One invocation per line, in file order; the hashes
are kept as given (they are already prefix hashes). Output blocks are not listed in the format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pyarrow as pa

from kmesh_trace.datasets.importer import (
    ROWS_PER_PART,
    ImportReport,
    RecordError,
    iter_records,
    require_hash_list,
    require_int,
    require_number,
)
from kmesh_trace.writer import TraceWriter

BLOCK_SIZE = 512
FORMAT = "mooncake"


class _Columns:
    """Invocation columns accumulated in plain lists; hashes flattened with offsets (no list of lists)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.request_id: list[str] = []
        self.seq: list[int] = []
        self.num_prompt_tokens: list[int] = []
        self.num_output_tokens: list[int] = []
        self.arrival_ns: list[int] = []
        self.offsets: list[int] = [0]
        self.hashes: list[int] = []

    def __len__(self) -> int:
        return len(self.seq)

    def table(self) -> dict:
        hashes = pa.ListArray.from_arrays(pa.array(self.offsets, pa.int32()), pa.array(self.hashes, pa.uint64()))
        return {
            "request_id": self.request_id,
            "seq": self.seq,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "prompt_block_hashes": hashes,
            "arrival_ns": self.arrival_ns,
        }


def import_mooncake(src: str | Path, out: str | Path, *, engine_id: str = "import-mooncake",
                    on_bytes: Callable[[int], None] | None = None) -> ImportReport:
    src = Path(src)
    report = ImportReport(FORMAT, str(src), str(out), engine_id)
    writer = TraceWriter(out, engine_id, {"block_size": BLOCK_SIZE, "engine": "mooncake trace",
                                          "capture_config": {"format": FORMAT, "source_file": src.name}},
                         source=f"import:{FORMAT}")
    cols = _Columns()
    seq = 0
    for where, rec in iter_records(src, report, on_bytes):
        try:
            ts = require_number(rec, "timestamp")
            n_in = require_int(rec, "input_length", minimum=1)
            n_out = require_int(rec, "output_length")
            hashes = require_hash_list(rec, "hash_ids")
            if len(hashes) != -(-n_in // BLOCK_SIZE):
                raise RecordError(f"hash_ids has {len(hashes)} entries but input_length {n_in} needs {-(-n_in // BLOCK_SIZE)}")
        except RecordError as e:
            report.malformed(where, str(e))
            continue
        cols.request_id.append(str(seq))
        cols.seq.append(seq)
        cols.num_prompt_tokens.append(n_in)
        cols.num_output_tokens.append(n_out)
        cols.arrival_ns.append(int(ts * 1_000_000))
        cols.hashes.extend(hashes)
        cols.offsets.append(len(cols.hashes))
        seq += 1
        report.num_block_hashes += len(hashes)
        if len(cols) >= ROWS_PER_PART:
            writer.write("invocations", cols.table())
            cols.clear()
    if len(cols):
        writer.write("invocations", cols.table())
    report.num_invocations = seq
    writer.update_metadata(num_malformed_lines=report.num_malformed_lines, malformed_lines=report.malformed_lines)
    writer.close()
    return report
