"""Importer for the LMCache agent-trace corpus: JSONL text records of agent LLM calls, made analysable honestly.

The corpus holds prompts and answers as text, with no token ids, no parent links and no finish
times. The import uses the corpus audit's own definitions (kmesh_trace.audit), so `audit corpus` and
the import never disagree about a line:
- the directory walk (sources, JSONL files), the line classifier (blank, record, malformed with its
  kind), exact duplicates (equal canonical JSON; imported once, every extra copy counted and listed);
- sessions (the first session key that is not null; without one, the file) and the content tests on
  consecutive calls of a session (the next input extends the previous one; the previous output
  reappears in the next input). A pair passing either test becomes a lineage edge of kind `content`,
  never `declared`; `num_shared_tokens` is the common prefix of the child's prompt and the parent's
  prompt + output, in the import's tokens;
- families are sessions (`SOURCE/SESSION`, or the file path for records without a session).

Tokens: text is turned into token ids by a deterministic tokenizer that needs nothing downloaded,
UTF-8 bytes (one token per byte) by default, or a user's `tokenizer.json` through the optional
`tokenizers` package. Those ids are not the serving model's: the metadata says
`token_ids_approximate: true` and names the tokenizer, and every report on the trace says so. Each
record's first numeric timestamp (its unit read from its magnitude, as the audit does) becomes
`arrival_ns` in Unix-epoch nanoseconds; records without one have no arrival.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np
import pyarrow as pa

from kmesh_trace.audit.corpus import KeyPlan, first_timestamp, session_record
from kmesh_trace.audit.edges import SessionRecord, pair_edges, sessions
from kmesh_trace.audit.fields import UNIT_SECONDS, unit_of
from kmesh_trace.audit.identity import RecordIndex, canonical
from kmesh_trace.audit.inventory import walk
from kmesh_trace.jsonl_lines import BOM, RECORD, FileRead, classify, iter_physical_lines
from kmesh_trace.datasets.importers.common import MAX_LISTED_MALFORMED, MAX_NS, ImportReport, record_of
from kmesh_trace.errors import InputFormatError, MissingDependencyError
from kmesh_trace.writer import TraceWriter, to_contract
from kmesh_trace import schema

FORMAT = "lmcache-agent"
BYTES_TOKENIZER = "utf-8-bytes"
#: Default block sizes: 64 bytes, or 16 tokens of a real tokenizer (about the same text either way).
BYTES_BLOCK_SIZE = 64
TOKENIZER_BLOCK_SIZE = 16
ROWS_PER_PART = 20_000
TOKENS_PER_PART = 1 << 30


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255): deterministic, lossless, needs nothing downloaded."""

    name = BYTES_TOKENIZER

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8).astype(np.int32)


class FileTokenizer:
    """A Hugging Face `tokenizer.json`, through the optional `tokenizers` package."""

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise MissingDependencyError(
                "--tokenizer needs the tokenizers package: pip install 'kmesh-trace[tokenizers]'") from None
        path = Path(path)
        if not path.is_file():
            raise InputFormatError(f"tokenizer file {path} does not exist.")
        data = path.read_bytes()
        try:
            self._tok = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # the package raises its own exception types
            raise InputFormatError(f"{path} is not a tokenizer.json the tokenizers package can load ({e}).") from None
        self.name = f"tokenizers:{path.name} sha256:{hashlib.sha256(data).hexdigest()[:16]}"

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def added_tokens(self) -> set[str]:
        """The tokenizer's added (special and control) tokens."""
        return {t.content for t in self._tok.get_added_tokens_decoder().values()}


def text_of(value: Any) -> str:
    """The text a value stands for: a string as it is, nothing for null, anything else as canonical JSON."""
    if type(value) is str:
        return value
    if value is None:
        return ""
    return canonical(value)


@dataclass
class LmcacheReport(ImportReport):
    tokenizer: str = BYTES_TOKENIZER
    block_size: int = BYTES_BLOCK_SIZE
    num_files: int = 0
    num_empty_files: int = 0
    num_unreadable_files: int = 0
    num_records: int = 0
    num_duplicate_records: int = 0
    duplicate_records: list[str] | None = None
    num_sessions: int = 0
    num_records_without_session: int = 0
    num_records_without_timestamp: int = 0
    num_prompt_tokens: int = 0

    SUMMARY_KEYS: ClassVar[tuple[str, ...]] = (
        "num_files", "num_lines", "num_blank_lines", "num_records", "num_duplicate_records", "num_malformed_lines",
        "num_invocations", "num_sessions", "num_lineage_edges", "num_prompt_tokens")

    def duplicate(self, where: str, first: str) -> None:
        self.num_duplicate_records += 1
        if self.duplicate_records is None:
            self.duplicate_records = []
        if len(self.duplicate_records) < MAX_LISTED_MALFORMED:
            self.duplicate_records.append(f"{where}: repeats {first}")


@dataclass(slots=True)
class _Record:
    rec: SessionRecord
    request_id: str
    family_id: str
    arrival_ns: int | None
    prompt: np.ndarray
    output: np.ndarray


class _Import:
    def __init__(self, src: Path, writer: TraceWriter, tokenizer, report: LmcacheReport,
                 on_bytes: Callable[[int], None] | None):
        self.inv = walk(src)
        self.writer, self.tok, self.report, self.on_bytes = writer, tokenizer, report, on_bytes
        self.files: list[str] = []
        self.index = RecordIndex(self._reread)
        self.plans: dict[tuple, KeyPlan] = {}
        self.rows: list[_Record] = []
        self.seq = 0

    def _reread(self, place) -> dict:
        where, offset, length = place
        with open(self.inv.root / self.files[where >> 32], "rb") as f:
            f.seek(offset)
            kind, value = classify(f.read(length))
        if kind != RECORD:
            raise InputFormatError(f"{self.files[where >> 32]} changed while it was being imported; import it again once it is stable.")
        return value

    def loc(self, packed: int) -> str:
        return f"{self.files[packed >> 32]}:{packed & 0xFFFFFFFF}"

    def run(self) -> None:
        for name, files in self.inv.sources.items():
            records: list[_Record] = []
            for rel in files.jsonl:
                self._read_file(name, rel, records)
            self._write_source(records)

    def _plan(self, keys: tuple) -> KeyPlan:
        p = self.plans.get(keys)
        if p is None:
            p = KeyPlan(keys)
            if len(self.plans) < 10_000:
                self.plans[keys] = p
        return p

    def _read_file(self, source: str, rel: str, records: list[_Record]) -> None:
        rep = self.report
        file_idx = len(self.files)
        self.files.append(rel)
        rep.num_files += 1
        info = FileRead()
        offset = 0
        try:
            with open(self.inv.root / rel, "rb") as f:
                for lineno, raw in enumerate(iter_physical_lines(f, info, self.on_bytes), 1):
                    if lineno == 1 and info.bom:
                        offset = len(BOM)
                    start, offset = offset, offset + len(raw) + 1
                    rep.num_lines += 1
                    value = record_of(raw, rep, rel, lineno)
                    if value is None:
                        continue
                    rep.num_records += 1
                    where = file_idx << 32 | lineno
                    plan = self._plan(tuple(value))
                    if not self.index.add(value, plan.ts_keys, (where, start, len(raw)), plan.sorted_keys):
                        first = next(locs[0] for locs in self.index.repeats.values() if locs[-1] == where)
                        rep.duplicate(f"{rel}:{lineno}", self.loc(first))
                        continue
                    records.append(self._record(source, rel, lineno, where, value, plan))
        except OSError as e:
            rep.num_unreadable_files += 1
            rep.malformed(rel, f"unreadable ({e.strerror or type(e).__name__}); lines before the failure were imported")
        if info.num_bytes == 0:
            rep.num_empty_files += 1

    def _record(self, source: str, rel: str, lineno: int, where: int, obj: dict, plan: KeyPlan) -> _Record:
        ts = first_timestamp(obj, plan)
        sr = session_record(obj, ts, where, plan)
        arrival = None
        if ts is not None:
            ns = ts * UNIT_SECONDS.get(unit_of(ts), 1.0) * 1e9  # a huge finite ts overflows to inf here
            arrival = round(ns) if math.isfinite(ns) and abs(ns) <= MAX_NS else None
        if arrival is None:
            self.report.num_records_without_timestamp += 1
        family = rel if sr.session is None else f"{source}/{sr.session[1]}"
        return _Record(sr, f"{rel}:{lineno}", family, arrival, self.tok.encode(text_of(sr.input)),
                       self.tok.encode(text_of(sr.output)))

    def _write_source(self, records: list[_Record]) -> None:
        if not records:
            return
        by_where = {r.rec.where: r for r in records}
        edges = []
        groups = sessions([r.rec for r in records])
        self.report.num_sessions += len(groups)
        self.report.num_records_without_session += sum(r.rec.session is None for r in records)
        for group in groups.values():
            for prev, cur in zip(group, group[1:]):
                if any(pair_edges(prev, cur)):
                    p, c = by_where[prev.where], by_where[cur.where]
                    edges.append({"child_request_id": c.request_id, "parent_request_id": p.request_id,
                                  "family_id": c.family_id, "edge_kind": schema.EdgeKind.content.value,
                                  "num_shared_tokens": _common_prefix(c.prompt, p.prompt, p.output)})
        part: list[_Record] = []
        tokens = 0
        for r in records:  # parts bounded in rows and in tokens (list offsets are 32-bit)
            n = len(r.prompt) + len(r.output)
            if part and (len(part) >= ROWS_PER_PART or tokens + n > TOKENS_PER_PART):
                self._write_rows(part)
                part, tokens = [], 0
            part.append(r)
            tokens += n
        if part:
            self._write_rows(part)
        if edges:
            self.writer.write("lineage", edges)
            self.report.num_lineage_edges += len(edges)

    def _write_rows(self, rows: list[_Record]) -> None:
        def tokens(arrays: list[np.ndarray]) -> pa.ListArray:
            offsets = np.zeros(len(arrays) + 1, np.int64)
            np.cumsum([len(a) for a in arrays], out=offsets[1:])
            values = np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
            return pa.ListArray.from_arrays(offsets.astype(np.int32), values)

        n = len(rows)
        table = to_contract("invocations", {
            "request_id": [r.request_id for r in rows],
            "seq": pa.array(range(self.seq, self.seq + n), pa.int64()),
            "family_id": [r.family_id for r in rows],
            "num_prompt_tokens": [len(r.prompt) for r in rows],
            "num_output_tokens": [len(r.output) for r in rows],
            "prompt_token_ids": tokens([r.prompt for r in rows]),
            "output_token_ids": tokens([r.output for r in rows]),
            "arrival_ns": pa.array([r.arrival_ns for r in rows], pa.int64()),
        })
        self.writer.write("invocations", table)
        self.seq += n
        self.report.num_invocations += n
        self.report.num_prompt_tokens += sum(len(r.prompt) for r in rows)


def _common_prefix(child: np.ndarray, prompt: np.ndarray, output: np.ndarray) -> int:
    """Tokens of `prompt + output` that `child` starts with."""
    parent = np.concatenate([prompt, output])
    n = min(len(child), len(parent))
    diff = np.flatnonzero(child[:n] != parent[:n])
    return int(diff[0]) if len(diff) else n


def import_lmcache_agent(src: str | Path, out: str | Path, *, engine_id: str = "import-lmcache-agent",
                         tokenizer: str | Path | None = None, block_size: int | None = None,
                         on_bytes: Callable[[int], None] | None = None) -> LmcacheReport:
    """Import an LMCache agent-trace directory; see the module docstring."""
    src = Path(src)
    if not src.is_dir():
        raise InputFormatError(f"{src} is not a directory; give the corpus directory (one subdirectory per source).")
    if not any(files.jsonl for files in walk(src).sources.values()):  # as weka refuses an empty directory
        raise InputFormatError(f"{src} holds no .jsonl or .ndjson files; give the corpus directory (one subdirectory "
                               "per source).")
    tok = FileTokenizer(tokenizer) if tokenizer is not None else ByteTokenizer()
    if block_size is None:
        block_size = BYTES_BLOCK_SIZE if tokenizer is None else TOKENIZER_BLOCK_SIZE
    if block_size <= 0:
        raise InputFormatError("--block-size must be a positive number of tokens.")
    report = LmcacheReport(FORMAT, str(src), str(out), engine_id, tokenizer=tok.name, block_size=block_size)
    writer = TraceWriter(out, engine_id, {
        "block_size": block_size, "engine": "lmcache agent trace", "tokenizer": tok.name,
        "token_ids_approximate": True,
        "capture_config": {"format": FORMAT, "source": str(src), "tokenizer": tok.name, "block_size": block_size},
    }, source=f"import:{FORMAT}")
    _Import(src, writer, tok, report, on_bytes).run()
    counts = {k: getattr(report, k) for k in (
        "num_files", "num_empty_files", "num_unreadable_files", "num_lines", "num_blank_lines", "num_records",
        "num_duplicate_records", "num_malformed_lines", "num_invocations", "num_sessions",
        "num_records_without_session", "num_records_without_timestamp", "num_lineage_edges", "num_prompt_tokens")}
    writer.update_metadata(num_malformed_lines=report.num_malformed_lines, malformed_lines=report.malformed_lines,
                           import_counts=counts, duplicate_records=report.duplicate_records or [])
    writer.close()
    return report
