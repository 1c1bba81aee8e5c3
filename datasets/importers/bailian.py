"""Importer of the Alibaba Qwen/Bailian trace format (JSONL).

Each line: `chat_id`, `parent_chat_id` (-1 for a root), `timestamp` (seconds), `input_length`,
`output_length`, `type`, `turn`, `hash_ids` (one id per 16-token block, NOT chained: equal ids
at different positions of different prompts name equal block contents, not equal prefixes).
The importer re-chains them into prefix hashes (h_i = H(h_{i-1}, id_i)) so that two blocks share
a hash only when their whole prefixes are equal, which is what a prefix cache can reuse.
`parent_chat_id` becomes a declared lineage edge; a family is the root of the parent chain.
`bailian_rows` is the one reader: the import writes its rows, an analysis may read them in memory.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from kmesh_trace.datasets.importers.common import (
    MAX_TOKENS,
    ROWS_PER_PART,
    ImportReport,
    RecordError,
    iter_records,
    require_hash_list,
    require_int,
    require_time_ns,
)
from kmesh_trace import schema
from kmesh_trace.native.kernels import I64, P, declare, ptr

BLOCK_SIZE = 16
FORMAT = "bailian"
_ROOT = -1


def chain_hashes(block_ids: list[int]) -> list[int]:
    """Prefix hashes of a sequence of unchained block ids, each below 2**64 (64-bit BLAKE2b of parent hash + id),
    in one compiled pass (native/kernels/bailian_chain.c); `chain_hashes_plain` is the reference."""
    if not block_ids:
        return []
    ids = np.array(block_ids, np.uint64)
    out = np.empty(len(ids), np.uint64)
    _chain(ptr(ids, np.uint64), len(ids), ptr(out, np.uint64))
    return out.tolist()


_chain = declare("ks_bailian_chain", [P, I64, P])


def chain_hashes_plain(block_ids: list[int]) -> list[int]:
    """`chain_hashes` with hashlib, id by id: the reference the tests compare the kernel with."""
    out = []
    parent = b"\0" * 8
    for bid in block_ids:
        parent = hashlib.blake2b(parent + bid.to_bytes(8, "little"), digest_size=8).digest()
        out.append(int.from_bytes(parent, "little"))
    return out


def engine_metadata(src: Path) -> dict:
    """The engine metadata of an import of `src` (the writer adds its own bookkeeping)."""
    return {"block_size": BLOCK_SIZE, "engine": "bailian trace",
            "capture_config": {"format": FORMAT, "source_file": src.name}}


def import_bailian(src: str | Path, out: str | Path, *, engine_id: str = "import-bailian",
                   on_bytes: Callable[[int], None] | None = None) -> ImportReport:
    from kmesh_trace.writer import TraceWriter

    src = Path(src)
    report = ImportReport(FORMAT, str(src), str(out), engine_id)
    writer = TraceWriter(out, engine_id, engine_metadata(src), source=f"import:{FORMAT}")
    rows: list[dict] = []
    edges: list[dict] = []
    for row, edge in bailian_rows(src, report, on_bytes):
        rows.append(row)
        if edge is not None:
            edges.append(edge)
        if len(rows) >= ROWS_PER_PART:
            writer.write("invocations", rows)
            rows.clear()
    if rows:
        writer.write("invocations", rows)
    if edges:
        writer.write("lineage", edges)
    writer.update_metadata(num_malformed_lines=report.num_malformed_lines, malformed_lines=report.malformed_lines)
    writer.close()
    return report


def bailian_rows(src: Path, report: ImportReport, on_bytes=None) -> Iterator[tuple[dict, dict | None]]:
    """Each valid line's invocation row and its declared lineage edge (None for a root), in file order, every
    bad line counted in `report` (with the invocations, block hashes and lineage edges read)."""
    family_of: dict[str, str] = {}  # chat id -> root chat id, for parents already seen
    seen: set[str] = set()
    for lineno, rec in iter_records(src, report, on_bytes):
        try:
            chat_id = require_int(rec, "chat_id")
            parent = require_int(rec, "parent_chat_id", minimum=_ROOT)
            arrival_ns = require_time_ns(rec, "timestamp", 1_000_000_000)
            n_in = require_int(rec, "input_length", minimum=1, maximum=MAX_TOKENS)
            n_out = require_int(rec, "output_length", maximum=MAX_TOKENS)
            ids = require_hash_list(rec, "hash_ids")
            if len(ids) != -(-n_in // BLOCK_SIZE):
                raise RecordError(f"hash_ids has {len(ids)} entries but input_length {n_in} needs {-(-n_in // BLOCK_SIZE)}")
            if str(chat_id) in seen:
                raise RecordError(f"chat_id {chat_id} repeats an earlier line")
        except RecordError as e:
            report.malformed(f"{src.name}:{lineno}", str(e))
            continue
        cid = str(chat_id)
        seen.add(cid)
        pid = None if parent == _ROOT else str(parent)
        family = cid if pid is None else family_of.get(pid, pid)
        family_of[cid] = family
        row = {"request_id": cid, "seq": report.num_invocations, "family_id": family, "parent_id": pid,
               "num_prompt_tokens": n_in, "num_output_tokens": n_out,
               "prompt_block_hashes": chain_hashes(ids), "arrival_ns": arrival_ns}
        edge = None
        if pid is not None:
            edge = {"child_request_id": cid, "parent_request_id": pid if pid in seen else None,
                    "declared_parent_id": pid, "family_id": family, "edge_kind": schema.EdgeKind.declared.value}
            report.num_lineage_edges += 1
        report.num_invocations += 1
        report.num_block_hashes += len(ids)
        yield row, edge
