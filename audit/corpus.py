"""The corpus audit: one pass over every JSONL line of a directory, and the verdict it supports.

`audit_corpus(DIR)` walks DIR (see `inventory`), reads each JSONL file once (hashing it as it
goes), classifies every physical line (see `lines`), and for each record: finds exact duplicates
across the whole corpus (equal canonical JSON: sorted keys, no whitespace) and near-duplicates
(records that differ only in the values of timestamp keys; see `identity`); counts keys, value
types and timestamp magnitudes per source; and notes which lineage evidence it carries (see
`fields`). After each source it derives content-only edges (see `edges`).

Memory: a small entry per record, plus the inputs and outputs of the source being read (content
edges need them), released after each source. The result holds counts, key names, hashes and
`file:line` locations only, never a prompt or an answer. Duplicates, malformed lines and
unreadable files are blocking problems; so is an analysis the evidence cannot qualify. Empty
files, near-duplicates, README labels (synthetic, hand-crafted), tooling-only directories,
symlinks that leave DIR and byte-order marks are warnings.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kmesh_trace.audit import fields as F
from kmesh_trace.audit.edges import ContentEdges, SessionRecord, content_edges
from kmesh_trace.audit.findings import BLOCKING, WARNING, Problem, exit_code
from kmesh_trace.audit.identity import Place, RecordIndex, canonical
from kmesh_trace.audit.identity import is_timestamp_key_cached as is_ts
from kmesh_trace.audit.inventory import ROOT_SOURCE, CorpusUnreadableError, Inventory, walk
from kmesh_trace.jsonl_lines import BLANK, BOM, MALFORMED, RECORD, FileRead, Malformed, classify, iter_physical_lines

#: At most this many locations are listed per kind (all are counted).
MAX_LISTED = 1000

#: What each analysis needs; a tuple is satisfied by any one of its members.
REQUIREMENTS: dict[str, tuple] = {
    "headroom": (F.TOKEN_IDS, F.START_COMPLETION, F.ENGINE_IDENTITY, (F.CACHE_EVENTS, F.CACHED_TOKENS)),
    "retention_pressure": (F.PARENT_LINKS, F.START_COMPLETION, F.ENGINE_IDENTITY, F.TOKEN_IDS, F.CACHE_EVENTS),
}

#: Distinct key sets whose plans are cached (records of one source usually share a handful).
MAX_PLANS = 10_000
_TYPE_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null",
               dict: "object", list: "array"}


class KeyPlan:
    """What the audit needs to know about one key set, worked out once: which keys are timestamps,
    which may carry evidence, which name the session, the input and the output, their sorted order."""

    __slots__ = ("items", "ts_keys", "sorted_keys", "session_keys", "input_key", "output_key")

    def __init__(self, keys: tuple[str, ...]):
        self.items = [(k, is_ts(k), F.EVIDENCE_KEYS.get(k.lower())) for k in keys]
        self.ts_keys = [k for k, ts, _ in self.items if ts]
        self.sorted_keys = sorted(keys)
        present = set(keys)
        self.session_keys = [k for k in F.SESSION_KEYS if k in present]
        self.input_key = next((k for k in F.INPUT_KEYS if k in present), None)
        self.output_key = next((k for k in F.OUTPUT_KEYS if k in present), None)


def session_record(obj: dict, ts: float | None, where: int, plan: KeyPlan | None = None) -> SessionRecord:
    """The session, input and output of one record (the session is the first session key not null)."""
    plan = plan or KeyPlan(tuple(obj))
    session = None
    for k in plan.session_keys:
        v = obj[k]
        if v is not None:
            session = (k, v if isinstance(v, (str, int, float)) else canonical(v))
            break
    inp = obj[plan.input_key] if plan.input_key is not None else None
    out = obj[plan.output_key] if plan.output_key is not None else None
    return SessionRecord(session, ts, where, inp, out)


def first_timestamp(obj: dict, plan: KeyPlan | None = None) -> float | None:
    """The record's first numeric timestamp value, as the audit orders records by."""
    plan = plan or KeyPlan(tuple(obj))
    for k in plan.ts_keys:
        v = obj[k]
        if type(v) is int or type(v) is float:
            return v
    return None


class CorpusChangedError(CorpusUnreadableError):
    """A file changed between two reads of one audit."""


@dataclass
class SourceReport:
    name: str
    jsonl_files: int = 0
    bytes: int = 0
    empty_files: list[str] = field(default_factory=list)
    physical_lines: int = 0
    blank_lines: int = 0
    nonempty_lines: int = 0
    parsed_records: int = 0
    malformed_lines: int = 0
    readmes: list[str] = field(default_factory=list)
    labels: dict[str, list[str]] = field(default_factory=dict)
    tooling_files: list[str] = field(default_factory=list)
    other_files: int = 0
    keys: dict[str, dict[str, int]] = field(default_factory=dict)
    timestamps: dict[str, F.TimestampStats] = field(default_factory=dict)
    out_of_order: int = 0
    evidence: dict[str, int] = field(default_factory=dict)
    evidence_fields: dict[str, set[str]] = field(default_factory=dict)
    edges: ContentEdges | None = None

    def to_dict(self) -> dict:
        n = self.parsed_records
        return {
            "jsonl_files": self.jsonl_files,
            "bytes": self.bytes,
            "empty_files": self.empty_files,
            "physical_lines": self.physical_lines,
            "blank_lines": self.blank_lines,
            "nonempty_lines": self.nonempty_lines,
            "parsed_records": n,
            "malformed_lines": self.malformed_lines,
            "readmes": self.readmes,
            "labels": self.labels,
            "tooling_files": self.tooling_files,
            "other_files": self.other_files,
            "fields": {
                k: {"records": sum(t.values()), "share": round(sum(t.values()) / n, 6) if n else 0.0, "types": dict(sorted(t.items()))}
                for k, t in sorted(self.keys.items())
            },
            "timestamps": {k: s.to_dict() for k, s in sorted(self.timestamps.items())},
            "timestamp_unit": self.timestamp_unit,
            "out_of_order_records": self.out_of_order,
            "evidence": {c: self.evidence.get(c, 0) for c in F.CATEGORIES},
            "evidence_fields": {c: sorted(self.evidence_fields.get(c, ())) for c in F.CATEGORIES},
            "content_edges": self.edges.to_dict() if self.edges else None,
        }

    @property
    def timestamp_unit(self) -> str | None:
        """The unit of the source's most common numeric timestamp key."""
        if not self.timestamps:
            return None
        return max(self.timestamps.values(), key=lambda s: s.num_values).unit


@dataclass
class CorpusAudit:
    root: str
    sources: dict[str, SourceReport]
    inventory: Inventory
    input_sha256: dict[str, str]
    malformed_by_file: dict[str, int]
    malformed_locations: list[dict]
    malformed_by_kind: dict[str, int]
    duplicate_groups: list[dict]
    duplicate_records: int
    near_duplicate_groups: list[dict]
    near_duplicate_records: int
    tooling_only_dirs: list[str]
    readmes: list[dict]
    unreadable_files: list[str]
    bom_files: list[str]
    verdict: dict
    problems: list[Problem]

    def total(self, attr: str) -> int:
        return sum(getattr(s, attr) for s in self.sources.values())

    @property
    def exit_code(self) -> int:
        return exit_code(self.problems)

    def to_dict(self) -> dict:
        parsed = self.total("parsed_records")
        return {
            "root": self.root,
            "jsonl_files": self.total("jsonl_files"),
            "bytes": self.total("bytes"),
            "empty_files": sorted(f for s in self.sources.values() for f in s.empty_files),
            "physical_lines": self.total("physical_lines"),
            "blank_lines": self.total("blank_lines"),
            "nonempty_lines": self.total("nonempty_lines"),
            "parsed_records": parsed,
            "unique_records": parsed - self.duplicate_records,
            "duplicate_records": self.duplicate_records,
            "duplicates": self.duplicate_groups,
            "near_duplicate_records": self.near_duplicate_records,
            "near_duplicates": self.near_duplicate_groups,
            "malformed_lines": self.total("malformed_lines"),
            "malformed_by_kind": self.malformed_by_kind,
            "malformed_by_file": self.malformed_by_file,
            "malformed_locations": self.malformed_locations,
            "unreadable_files": self.unreadable_files,
            "bom_files": self.bom_files,
            "sources": {name: s.to_dict() for name, s in self.sources.items()},
            "readmes": self.readmes,
            "tooling_only_dirs": self.tooling_only_dirs,
            "skipped_symlinks": self.inventory.skipped_symlinks,
            "symlink_aliases": self.inventory.symlink_aliases,
            "unreadable_dirs": self.inventory.unreadable_dirs,
            "hidden_entries_skipped": self.inventory.num_hidden_skipped,
            "lineage": self.lineage(),
            "verdict": self.verdict,
            "problems": [p.to_dict() for p in self.problems],
            "input_sha256": self.input_sha256,
        }

    def lineage(self) -> dict:
        parsed = self.total("parsed_records")
        evidence = {}
        for c in F.CATEGORIES:
            names: set[str] = set()
            for s in self.sources.values():
                names |= s.evidence_fields.get(c, set())
            evidence[c] = {"records": sum(s.evidence.get(c, 0) for s in self.sources.values()), "of": parsed,
                           "fields": sorted(names)}
        edges = ContentEdges.combine([s.edges for s in self.sources.values() if s.edges])
        return {
            "evidence": evidence,
            "content_edges": edges.to_dict(),
            "note": "content edges are derived from text only (input extends the previous input; the previous "
                    "output reappears in the next input) and are never explicit lineage",
        }


class _Pass:
    """The state of one audit pass; `run` returns the finished CorpusAudit."""

    def __init__(self, inv: Inventory, on_bytes: Callable[[int], None] | None):
        self.inv = inv
        self.on_bytes = on_bytes
        self.sources: dict[str, SourceReport] = {}
        self.input_sha256: dict[str, str] = {}
        self.malformed_by_file: dict[str, int] = {}
        self.malformed_locations: list[dict] = []
        self.malformed_by_kind: dict[str, int] = {}
        self.unreadable_files: list[str] = []
        self.bom_files: list[str] = []
        self.files: list[str] = []
        self.records_by_file: dict[str, int] = {}
        self.index = RecordIndex(self.reread)
        self.plans: dict[tuple[str, ...], KeyPlan] = {}

    # ---- locations are packed ints: file index * 2**32 + line ----
    def loc(self, packed: int) -> str:
        return f"{self.files[packed >> 32]}:{packed & 0xFFFFFFFF}"

    def run(self) -> None:
        for name, files in self.inv.sources.items():
            if name == ROOT_SOURCE and not files.jsonl:
                continue  # DIR's own README or tooling: not a source of records
            self.sources[name] = self.audit_source(name, files)

    def reread(self, place: Place) -> dict:
        """The record at `place`, read again from disk (pre-key repeats only; see `identity`)."""
        where, offset, length = place
        rel = self.files[where >> 32]
        with open(self.inv.root / rel, "rb") as f:
            f.seek(offset)
            kind, value = classify(f.read(length))
        if kind != RECORD:
            raise CorpusChangedError(f"{rel} changed while it was being audited; audit it again once it is stable.")
        return value

    def audit_source(self, name: str, files) -> SourceReport:
        src = SourceReport(name=name, readmes=list(files.readmes), tooling_files=list(files.tooling),
                           other_files=len(files.other))
        session_records: list[SessionRecord] = []
        for rel in files.jsonl:
            self.read_jsonl(src, rel, session_records)
        src.edges = content_edges(session_records) if session_records else None
        return src

    def read_jsonl(self, src: SourceReport, rel: str, session_records: list[SessionRecord]) -> None:
        file_idx = len(self.files)
        self.files.append(rel)
        info = FileRead()
        src.jsonl_files += 1
        base = file_idx << 32
        records = 0
        prev_ts = None
        offset = 0
        try:
            with open(self.inv.root / rel, "rb") as f:
                for lineno, raw in enumerate(iter_physical_lines(f, info, self.on_bytes), 1):
                    if lineno == 1 and info.bom:
                        offset = len(BOM)
                    start = offset
                    offset += len(raw) + 1
                    src.physical_lines += 1
                    kind, value = classify(raw)
                    if kind == BLANK:
                        src.blank_lines += 1
                        continue
                    src.nonempty_lines += 1
                    if kind == MALFORMED:
                        self.malformed(src, rel, lineno, value)
                        continue
                    records += 1
                    src.parsed_records += 1
                    ts = self.record(src, value, (base | lineno, start, len(raw)))
                    if ts is not None:
                        if prev_ts is not None and ts < prev_ts:
                            src.out_of_order += 1
                        prev_ts = ts
                    session_records.append(self.session_record(value, ts, base | lineno))
        except OSError:
            # Lines read before the failure stay counted, so the line totals still add up.
            self.unreadable_files.append(rel)
            self.records_by_file[rel] = records
            return
        self.records_by_file[rel] = records
        src.bytes += info.num_bytes
        self.input_sha256[rel] = info.sha256
        if info.num_bytes == 0:
            src.empty_files.append(rel)
        if info.bom:
            self.bom_files.append(rel)

    def malformed(self, src: SourceReport, rel: str, lineno: int, why: Malformed) -> None:
        src.malformed_lines += 1
        self.malformed_by_file[rel] = self.malformed_by_file.get(rel, 0) + 1
        self.malformed_by_kind[why.kind] = self.malformed_by_kind.get(why.kind, 0) + 1
        if len(self.malformed_locations) < MAX_LISTED:
            self.malformed_locations.append({"location": f"{rel}:{lineno}", "kind": why.kind, "column": why.column})

    def plan(self, keys: tuple[str, ...]) -> KeyPlan:
        p = self.plans.get(keys)
        if p is None:
            p = KeyPlan(keys)
            if len(self.plans) < MAX_PLANS:
                self.plans[keys] = p
        return p

    def record(self, src: SourceReport, obj: dict, place: Place) -> float | None:
        """Account for one record; returns its first numeric timestamp (None when it has none)."""
        plan = self.plan(tuple(obj))
        keys = src.keys
        first_ts = None
        found: dict[str, set[str]] | None = None
        for k, ts, cat in plan.items:
            v = obj[k]
            tv = type(v)
            t = _TYPE_NAMES.get(tv) or F.json_type(v)
            kt = keys.get(k)
            if kt is None:
                kt = keys[k] = {}
            kt[t] = kt.get(t, 0) + 1
            if ts and (tv is int or tv is float):
                st = src.timestamps.get(k)
                if st is None:
                    st = src.timestamps[k] = F.TimestampStats()
                st.add(v)
                if first_ts is None:
                    first_ts = v
            if cat is not None or (tv is dict and v):
                if found is None:
                    found = {}
                F.evidence_of({k: v}, found)
        if found:
            for cat, names in F.categories_of(found).items():
                src.evidence[cat] = src.evidence.get(cat, 0) + 1
                src.evidence_fields.setdefault(cat, set()).update(names)
        self.index.add(obj, plan.ts_keys, place, plan.sorted_keys)
        return first_ts

    def session_record(self, obj: dict, ts: float | None, where: int) -> SessionRecord:
        return session_record(obj, ts, where, self.plan(tuple(obj)))

    # ---- after the pass ----

    def duplicates(self) -> tuple[list[dict], int]:
        groups, extra = [], 0
        for digest, locs in self.index.repeats.items():
            extra += len(locs) - 1
            if len(groups) < MAX_LISTED:
                groups.append({"digest": digest.hex()[:16], "copies": len(locs), "locations": [self.loc(x) for x in locs]})
        groups.sort(key=lambda g: g["locations"][0])
        return groups, extra

    def near_duplicates(self) -> tuple[list[dict], int]:
        groups, extra = [], 0
        for nd, members in self.index.near_groups.items():
            if len(members) < 2:
                continue
            extra += len(members) - 1
            if len(groups) < MAX_LISTED:
                locs = sorted(members.values())
                groups.append({"records": len(members), "timestamp_keys": list(self.index.near_ts_keys[nd]),
                               "locations": [self.loc(x) for x in locs]})
        groups.sort(key=lambda g: g["locations"][0])
        return groups, extra

    def tooling_only_dirs(self) -> list[str]:
        """Directories (not DIR) whose subtree holds tooling files and no parsed records; outermost only."""
        tooling: dict[str, int] = {}
        records: dict[str, int] = {}
        for files in self.inv.sources.values():
            for rel in files.tooling:
                for d in _ancestors(rel):
                    tooling[d] = tooling.get(d, 0) + 1
            for rel in files.jsonl:
                for d in _ancestors(rel):
                    records[d] = records.get(d, 0) + self.records_by_file.get(rel, 0)
        hits = [d for d in self.inv.directories if tooling.get(d, 0) and not records.get(d, 0)]
        hit_set = set(hits)
        return [d for d in hits if not any(a in hit_set for a in _ancestors(d + "/x") if a != d)]

    def readme_report(self) -> list[dict]:
        names = [n for n in self.sources if n != ROOT_SOURCE]
        out = []
        for name, files in self.inv.sources.items():
            for rel in files.readmes:
                try:
                    data = (self.inv.root / rel).read_bytes()
                except OSError:
                    self.unreadable_files.append(rel)
                    continue
                self.input_sha256[rel] = hashlib.sha256(data).hexdigest()
                labels = []
                for lineno, label, line in F.readme_labels(data.decode("utf-8", "replace")):
                    if name == ROOT_SOURCE:
                        low = line.lower()
                        targets = [n for n in names if n.lower() in low] or [ROOT_SOURCE]
                    else:
                        targets = [name]
                    labels.append({"label": label, "line": lineno, "sources": targets})
                    for t in targets:
                        if t in self.sources:
                            self.sources[t].labels.setdefault(label, []).append(f"{rel}:{lineno}")
                out.append({"path": rel, "source": name, "labels": labels})
        return out


def _ancestors(rel: str) -> list[str]:
    parts = rel.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def _coverage(counts: dict[str, int], category: str) -> int:
    """Records that satisfy `category`: for parent links, records declaring the field, once any link exists."""
    if category == F.PARENT_LINKS:
        return counts.get(F.PARENT_FIELDS, 0) if counts.get(F.PARENT_LINKS, 0) else 0
    return counts.get(category, 0)


def _covered(counts: dict[str, int], n: int, need) -> bool:
    options = need if isinstance(need, tuple) else (need,)
    return n > 0 and any(_coverage(counts, c) == n for c in options)


def _missing(counts: dict[str, int], n: int, need) -> dict:
    options = need if isinstance(need, tuple) else (need,)
    best = max(options, key=lambda c: _coverage(counts, c))
    return {"evidence": " or ".join(options), "records_with": _coverage(counts, best), "of": n}


def verdict(sources: dict[str, SourceReport]) -> dict:
    """Per analysis: qualified or not, the evidence missing corpus-wide, and which sources qualify alone."""
    total = {c: sum(s.evidence.get(c, 0) for s in sources.values()) for c in F.CATEGORIES}
    n = sum(s.parsed_records for s in sources.values())
    labelled = sorted(name for name, s in sources.items() if s.labels and s.parsed_records)
    out = {}
    for analysis, needs in REQUIREMENTS.items():
        missing = [_missing(total, n, need) for need in needs if not _covered(total, n, need)]
        by_source = {}
        for name, s in sources.items():
            if not s.parsed_records:
                continue
            blockers = [_missing(s.evidence, s.parsed_records, need)["evidence"]
                        for need in needs if not _covered(s.evidence, s.parsed_records, need)]
            if s.labels:
                blockers.append("labelled " + "/".join(sorted(s.labels)))
            by_source[name] = blockers
        out[analysis] = {
            "qualified": n > 0 and not missing and not labelled,
            "missing": missing if n else [{"evidence": "parsed records", "records_with": 0, "of": 0}],
            "labelled_sources": labelled,
            "qualified_sources": sorted(k for k, v in by_source.items() if not v),
            "blocked_sources": {k: v for k, v in sorted(by_source.items()) if v},
        }
    return out


def _problems(a: _Pass, dup_groups, dups, near_groups, near, tooling_only, v: dict) -> list[Problem]:
    ps: list[Problem] = []
    total = lambda attr: sum(getattr(s, attr) for s in a.sources.values())
    if not total("jsonl_files"):
        ps.append(Problem("no_jsonl_files", BLOCKING, 0, "no .jsonl or .ndjson file was found"))
    if a.unreadable_files or a.inv.unreadable_dirs:
        locs = a.unreadable_files + a.inv.unreadable_dirs
        ps.append(Problem("unreadable", BLOCKING, len(locs), "files or directories could not be read", locs[:10]))
    if total("malformed_lines"):
        ps.append(Problem("malformed_lines", BLOCKING, total("malformed_lines"),
                          "non-empty lines that are not JSON objects: " + ", ".join(f"{k} {n}" for k, n in sorted(a.malformed_by_kind.items())),
                          [m["location"] for m in a.malformed_locations[:10]]))
    if dups:
        ps.append(Problem("duplicate_records", BLOCKING, dups, "extra copies of records already seen (canonical JSON)",
                          [g["locations"][1] for g in dup_groups[:10]]))
    for analysis, res in v.items():
        if not res["qualified"]:
            why = [f"{m['evidence']} ({m['records_with']} of {m['of']} records)" for m in res["missing"]]
            why += [f"labelled sources {', '.join(res['labelled_sources'])}"] if res["labelled_sources"] else []
            ps.append(Problem(f"not_qualified_{analysis}", BLOCKING, len(why), f"{analysis} cannot be qualified: " + "; ".join(why)))
    empty = sorted(f for s in a.sources.values() for f in s.empty_files)
    if empty:
        ps.append(Problem("empty_files", WARNING, len(empty), "JSONL files with no bytes", empty[:10]))
    if near:
        ps.append(Problem("near_duplicates", WARNING, near, "records identical but for a timestamp key",
                          [g["locations"][1] for g in near_groups[:10]]))
    labelled = {n: s.labels for n, s in a.sources.items() if s.labels}
    if labelled:
        ps.append(Problem("labelled_not_observed", WARNING, len(labelled),
                          "README labels data as " + "; ".join(f"{n}: {'/'.join(sorted(lab))}" for n, lab in sorted(labelled.items())),
                          sorted({loc for lab in labelled.values() for locs in lab.values() for loc in locs})[:10]))
    if tooling_only:
        ps.append(Problem("tooling_only_dirs", WARNING, len(tooling_only), "directories with code or configuration and no records", tooling_only[:10]))
    if a.inv.skipped_symlinks:
        ps.append(Problem("symlinks_outside", WARNING, len(a.inv.skipped_symlinks), "symbolic links leaving the directory were not followed",
                          a.inv.skipped_symlinks[:10]))
    if a.bom_files:
        ps.append(Problem("byte_order_marks", WARNING, len(a.bom_files), "files starting with a UTF-8 byte-order mark (stripped)", a.bom_files[:10]))
    return ps


def audit_corpus(directory: str | os.PathLike, on_bytes: Callable[[int], None] | None = None,
                 on_total: Callable[[int], None] | None = None) -> CorpusAudit:
    """Audit every JSONL file under `directory`.

    For a progress bar: `on_total(n)` is called once with the JSONL bytes to read, then `on_bytes(n)`
    as they are read.
    """
    inv = walk(directory)
    if on_total is not None:
        on_total(jsonl_bytes(inv))
    a = _Pass(inv, on_bytes)
    a.run()
    readmes = a.readme_report()
    dup_groups, dups = a.duplicates()
    near_groups, near = a.near_duplicates()
    tooling_only = a.tooling_only_dirs()
    v = verdict(a.sources)
    problems = _problems(a, dup_groups, dups, near_groups, near, tooling_only, v)
    return CorpusAudit(
        root=str(Path(directory)), sources=a.sources, inventory=inv, input_sha256=dict(sorted(a.input_sha256.items())),
        malformed_by_file=dict(sorted(a.malformed_by_file.items())), malformed_locations=a.malformed_locations,
        malformed_by_kind=dict(sorted(a.malformed_by_kind.items())), duplicate_groups=dup_groups, duplicate_records=dups,
        near_duplicate_groups=near_groups, near_duplicate_records=near, tooling_only_dirs=tooling_only, readmes=readmes,
        unreadable_files=a.unreadable_files, bom_files=a.bom_files, verdict=v, problems=problems,
    )



def jsonl_bytes(inv: Inventory) -> int:
    total = 0
    for files in inv.sources.values():
        for rel in files.jsonl:
            try:
                total += (inv.root / rel).stat().st_size
            except OSError:
                pass
    return total
