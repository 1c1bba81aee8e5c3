"""Capture fitness: does a trace directory hold what the analyses need, and is it self-consistent?

`audit_capture(trace)` checks, per engine partition:
- contract fields: every metadata field a capture must fill (schema.REQUIRED_CAPTURE_METADATA), every contract
  column in every Parquet part, the nullable columns a row's state requires (FILLED_WHEN), and
  enumerated columns holding only their vocabulary (schema.VOCABULARIES);
- block events, walked in `seq` order: reference counts never negative; frees only of blocks that
  were allocated and are still referenced; touches only of blocks once allocated and still cached;
  evictions only of cached blocks; no allocation of a block whose hash was never evicted; every
  cached hash held by one block while resident (a warning: vLLM's BlockHashToBlockMap admits
  several blocks per hash when two requests computed the same block);
- invocations: `num_cached_tokens` equals the request's touch events times the block size
  (requests never preempted; KV group 0 or unknown);
- clocks: block events' `ts_ns` non-decreasing in `seq`, `seq` without gaps, invocations' arrival
  non-decreasing in `seq` and arrival <= first scheduled <= first token <= finish, transfers'
  start <= finish; steps once each, in start order, finishing after they start, their counts adding up;
- lineage: every edge's child (and parent, when given) is an invocation of the trace; an
  exact_prefix edge's child prompt starts with the parent's prompt + output, and
  `num_shared_tokens` is that length (these stop only the retention analysis);
- block hashes are plain prefix hashes (`hash_lookahead_tokens` 0 or absent; vLLM's lookahead hashes
  cover tokens the analyses do not replay);
- recorded drops are zero and the writer closed cleanly (`complete`), with counts from the loss
  record when the metadata file could not be rewritten; the trace holds every row the writer wrote
  (`num_rows_written`); every request the block events act for has an invocation row;
- the contract as opening the trace checks it (footers: table, columns, types, nulls in required
  columns, parts that repeat another byte for byte; metadata field types) and invocation keys
  (request_id, seq) unique within an engine partition.
Each finding is a `Problem` naming the analyses it stops from qualifying.

A KV-events recording (`source` kv-events:ENGINE, written by `kmesh-trace listen`) is checked by
`audit/kv_events.py` instead of the pool walk (it has no requests and no block ids).

An imported partition (`source` import:FORMAT) is no capture: it has no engine and no block events,
so it never qualifies (the verdict is blocked by `import`), and its `seq` is the import order (a warning,
not a clock fault). For each one `imports` says what it does support (what-if analyses at a capacity
the user gives), what in it stays approximate or modelled (token ids, edges guessed from text, arrival
across conversations) and, once, its inherent `gaps`: what an import can never hold (engine metadata,
block events, engine timings and hit counts). Those are not listed again as blocking problems.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
from kmesh_trace.audit.findings import BLOCKING, WARNING, Problem, exit_code
from kmesh_trace.audit.kv_events import check_kv_events, kv_event_engines

from kmesh_trace import schema
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.kv_groups import groups_from_metadata, is_hybrid, touched_blocks_of_hit
from kmesh_trace.trace import Trace, open_trace

HEADROOM = "headroom"
RETENTION = "retention_pressure"
ANALYSES = (HEADROOM, RETENTION)
#: Locations listed per problem (all are counted).
MAX_LOCATIONS = 5

#: table -> column -> the rows that must have it (beyond the contract's non-nullable columns).
FILLED_WHEN: dict[str, dict[str, schema.When]] = {}
for (_table, _col), _when in schema.FILLED_WHEN.items():
    FILLED_WHEN.setdefault(_table, {})[_col] = _when
#: The verdict's blocker for an imported partition (its gaps are inherent, not problems to fix).
IMPORT = "import"
#: Fields whose absence only stops the retention analysis (timing after arrival, outputs).
_RETENTION_ONLY_FIELDS = {"finish_ns", "first_scheduled_ns", "first_token_ns", "output_token_ids", "num_output_tokens"}


@dataclass
class CaptureAudit:
    path: str
    engines: list[str]
    rows: dict[str, int]
    problems: list[Problem] = field(default_factory=list)
    #: engine id -> {source, supports, approximate} for imported partitions.
    imports: dict[str, dict] = field(default_factory=dict)
    #: engine id -> block events per KV cache group, for captures of hybrid models (`kv_group_counts`).
    kv_groups: dict[str, list[dict]] = field(default_factory=dict)

    @property
    def verdict(self) -> dict[str, dict]:
        out = {}
        for a in ANALYSES:
            blockers = sorted({p.code for p in self.problems if p.severity == BLOCKING and a in p.blocks}
                              | ({IMPORT} if self.imports else set()))
            out[a] = {"qualified": not blockers, "blocked_by": blockers}
        return out

    @property
    def exit_code(self) -> int:
        """3 on a blocking problem; an import's inherent gaps are none (the verdict still says `import`)."""
        return exit_code(self.problems)

    def to_dict(self) -> dict:
        d = {"path": self.path, "engines": self.engines, "rows": self.rows, "verdict": self.verdict,
             "problems": [p.to_dict() for p in self.problems]}
        if self.imports:
            d["imports"] = self.imports
        if self.kv_groups:
            d["kv_groups"] = self.kv_groups
        return d


class _Findings:
    """Counts findings by (code, severity, blocks) keeping the first few locations; an imported
    partition's inherent gaps go to `gaps` (engine -> what it cannot hold), once each."""

    def __init__(self, imported: set[str] = frozenset()):
        self._by_key: dict[tuple, Problem] = {}
        self.imported = set(imported)
        self.gaps: dict[str, list[str]] = {e: [] for e in sorted(self.imported)}

    def gap(self, engine: str, what: str) -> None:
        if what not in self.gaps[engine]:
            self.gaps[engine].append(what)

    def add(self, code: str, message: str, location: str | list[str], *, severity: str = BLOCKING,
            blocks: tuple[str, ...] = ANALYSES, count: int = 1) -> None:
        key = (code, message)
        p = self._by_key.get(key)
        if p is None:
            p = self._by_key[key] = Problem(code, severity, 0, message, [], list(blocks) if severity == BLOCKING else [])
        p.count += count
        for loc in [location] if isinstance(location, str) else location:
            if len(p.locations) < MAX_LOCATIONS:
                p.locations.append(loc)

    def problems(self) -> list[Problem]:
        return list(self._by_key.values())


def audit_capture(trace: Trace | str | os.PathLike) -> CaptureAudit:
    """Audit a trace directory (or an opened Trace) for capture fitness."""
    t = trace if isinstance(trace, Trace) else open_trace(trace, strict=False)
    f = _Findings({e for e in t.engines if _is_import(t, e)})
    _check_contract(t, f)
    _check_metadata(t, f)
    _check_columns(t, f)
    rows = t.row_counts()
    kv = kv_event_engines(t)  # KV-events recordings: no requests, no block ids (audit/kv_events.py)
    if not rows["invocations"] and (not kv or len(kv) < len(t.engines)):
        f.add("empty_table", "the capture holds no invocations", "invocations")
    if not rows["block_events"]:
        if f.imported and f.imported == set(t.engines):  # no engine ran: no import has block events
            for eng in f.imported:
                f.gap(eng, "block events (no engine served the trace)")
        else:
            f.add("empty_table", "the capture holds no block events", "block_events", blocks=(RETENTION,))
    inv = _without_required_nulls(t.frame("invocations"), "invocations", f)
    ev = _without_required_nulls(t.frame("block_events"), "block_events", f)
    if kv:
        import polars as pl

        check_kv_events(t, kv, ev.filter(pl.col("engine").is_in(kv)), f, headroom=HEADROOM, retention=RETENTION,
                        warning=WARNING)
        ev = ev.filter(~pl.col("engine").is_in(kv))
    _check_unique(inv, f)
    _check_filled(inv, "invocations", f)
    _check_filled(ev, "block_events", f)
    frames = {"invocations": inv, "block_events": ev, "lineage": t.frame("lineage"), "transfers": t.frame("transfers"),
              "steps": t.frame("steps")}
    _check_values(frames, f)
    _check_domains(frames, f)
    touches = _walk_block_events(ev, f)
    _check_kv_groups(t, ev, f)
    _check_cached_tokens(t, inv, touches, f)
    _check_clocks(t, inv, f)
    _check_steps(frames["steps"], f)
    lineage = t.frame("lineage")
    _check_lineage(lineage, inv, f)
    _check_requests_known(ev, inv, f)
    imports = _imports(t, inv, lineage)
    for eng, gaps in f.gaps.items():
        imports[eng]["gaps"] = gaps
    return CaptureAudit(path=str(t.path), engines=sorted(t.engines), rows=rows, problems=f.problems(),
                        imports=imports, kv_groups=kv_group_counts(t, ev))


# ---- metadata and columns --------------------------------------------------------------------


#: What each contract violation found on open is called in the audit, and its message.
_CONTRACT_FINDINGS = {
    "damaged_part": "a part cannot be read or breaks the contract (schema, table, columns, types); it was left out",
    "duplicate_part": "a part repeats another byte for byte (its rows would count twice); it was left out",
    "null_in_required_column": "a part holds nulls in a column the contract requires; it was left out",
    "invalid_metadata": "an engine metadata field has the wrong type (it was ignored)",
    "part_outside_trace": "a part is a symbolic link to a file outside the trace; it was left out",
}


def _check_contract(t: Trace, f: _Findings) -> None:
    """What opening the trace found (footers and metadata checked against the contract), each blocking."""
    for pr in t.problems:
        if pr.code == "out_of_domain":
            continue  # _check_domains names the rows themselves
        where = str(Path(pr.path).relative_to(t.path)) if Path(pr.path).is_relative_to(t.path) else pr.path
        f.add(pr.code, _CONTRACT_FINDINGS[pr.code], f"{where}: {pr.message}")


def _without_required_nulls(df, table: str, f: _Findings):
    """Rows with a null in a required column (parts without footer statistics get here), reported and
    left out so that the checks below compare only values."""
    import polars as pl

    required = [c.name for c in schema.table(table).columns if not c.nullable and c.name in df.columns]
    if df.height == 0 or not required:
        return df
    bad = pl.any_horizontal(pl.col(c).is_null() for c in required)
    n = df.filter(bad).height
    if n:
        f.add("null_in_required_column", f"rows of {table} hold nulls in columns the contract requires; they were left out",
              table, count=n)
        df = df.filter(~bad)
    return df


def _check_unique(inv, f: _Findings) -> None:
    """Invocation keys repeat only when rows were duplicated (a part copied with other bytes, a writer
    that ran twice): request_id and seq are unique within an engine partition."""
    import polars as pl

    if inv.height == 0:
        return
    for key in ("request_id", "seq"):
        dup = inv.group_by("engine", key).agg(pl.len().alias("n")).filter(pl.col("n") > 1).sort("engine", key)
        if dup.height:
            f.add("duplicate_rows", f"invocations repeat a {key} within an engine partition",
                  [f"invocations:{e}:{k} x{n}" for e, k, n in dup.head(MAX_LOCATIONS).iter_rows()],
                  count=int(dup.get_column("n").sum() - dup.height))


def incomplete_note(meta: dict) -> str:
    """What an engine partition that never closed (complete: false) may be missing, from its metadata."""
    import datetime

    head = ("the engine never closed its capture (complete is false: killed, e.g. SIGKILL or out of memory, "
            "or still running)")
    last = meta.get("last_flush")
    interval = (meta.get("capture_config") or {}).get("flush_interval_s")
    within = f" (at most {interval:g} s of activity before the process ended)" if isinstance(interval, (int, float)) else ""
    if not isinstance(last, dict) or not isinstance(last.get("rows"), dict):
        return (f"{head}; what it recorded after its last flush{within} may be missing, and requests still "
                "running then have no invocation row")
    rows = last["rows"]
    when = datetime.datetime.fromtimestamp(last.get("wall_ns", 0) / 1e9, datetime.timezone.utc).isoformat(timespec="seconds")
    arrived, written = last.get("num_arrivals"), rows.get("invocations", 0)
    running = (f"; {arrived - written:,} of the {arrived:,} requests that had arrived by then had no invocation row yet "
               "(still running, or finished after it)") if isinstance(arrived, int) and arrived >= written else ""
    return (f"{head}; the last flush, at {when}, had written {written:,} invocations and "
            f"{rows.get('block_events', 0):,} block events (seq 0 to {rows.get('block_events', 0) - 1:,}); "
            f"what the engine recorded after it{within} may be missing{running}")


def check_complete(trace: Trace, engine: str | None, allow_incomplete: bool, warn) -> None:
    """Refuse to analyse an engine partition whose capture never closed, unless the user allows it.

    `warn(line)` is told what may be missing when `allow_incomplete`; otherwise KmeshTraceError says it
    and how to go on. Imported partitions (source import:...) are complete by construction of the importer.
    """
    from kmesh_trace.errors import KmeshTraceError

    for eid, meta in sorted(trace.engines.items()):
        if engine is not None and eid != engine:
            continue
        if meta.get("complete") is not False:
            continue
        note = incomplete_note(meta)
        if not allow_incomplete:
            source = str(meta.get("source") or "capture")
            if source.startswith("import:"):  # an import that was interrupted (or failed) before it closed
                raise KmeshTraceError(f"engine {eid}: the {source[len('import:'):]} import never finished (complete is "
                                      "false: it was interrupted or failed); run `kmesh-trace import` again into a new "
                                      "--out, or pass --allow-incomplete to analyse what was written.")
            raise KmeshTraceError(f"engine {eid}: {note}. Rerun the capture and stop it normally (Ctrl-C or SIGTERM), "
                                  "or pass --allow-incomplete to analyse what was written.")
        warn(f"warning: engine {eid}: {note}; analysing what was written (--allow-incomplete)")


def _check_metadata(t: Trace, f: _Findings) -> None:
    if not t.engines:
        f.add("missing_field", "the trace has no engine metadata (engines/*.json)", "engines/")
    for eid, meta in sorted(t.engines.items()):
        where = f"engines/{eid}.json"
        for name in schema.REQUIRED_CAPTURE_METADATA:
            if meta.get(name) is None:
                if schema.is_kv_events(meta) and name in schema.KV_EVENTS_UNKNOWABLE_METADATA:
                    f.add("missing_field", f"metadata field {name} is unknown (the KV events do not carry it; give "
                          "`listen` a server URL or --num-blocks)", f"{where}:{name}", severity=WARNING)
                    continue
                if eid in f.imported:
                    f.gap(eid, f"engine metadata {name}")
                else:
                    f.add("missing_field", f"metadata field {name} is missing or null", f"{where}:{name}")
        dropped = meta.get("num_dropped_events") or {}
        total = sum(v for v in dropped.values() if isinstance(v, int)) if isinstance(dropped, dict) else 0
        if total:
            error = f" ({meta['write_error']})" if meta.get("write_error") else ""
            f.add("dropped_events", "the capture recorded dropped events", f"{where}:num_dropped_events{error}",
                  count=total)
        if meta.get("complete") is False:
            f.add("incomplete_capture", incomplete_note(meta), f"{where}:complete")
        if meta.get("engine_died"):  # what was recorded until then stands; the run itself did not end as planned
            f.add("engine_died", f"the engine died under the capture: {meta['engine_died']}; the trace holds what "
                  "was recorded until then", f"{where}:engine_died", severity=WARNING)
        lookahead = meta.get("hash_lookahead_tokens")
        if isinstance(lookahead, int) and lookahead > 0:
            f.add("lookahead_block_hashes", "each block hash also covers the tokens after its block (vLLM's lookahead "
                  "hashing with EAGLE speculative decoding); the analyses replay plain prefix hashes, so their hits "
                  "would not be the engine's", f"{where}:hash_lookahead_tokens={lookahead}")
        if meta.get("metadata_write_failed"):
            f.add("metadata_stale", "the metadata file could not be rewritten (its counts come from the loss record)",
                  f"{where}: {meta.get('write_error')}")
        written = meta.get("num_rows_written")
        if isinstance(written, dict):
            found = _rows_per_engine(t, eid)
            for table, n in sorted(written.items()):
                if isinstance(n, int) and found.get(table, 0) < n:
                    f.add("rows_missing", "the trace holds fewer rows than the writer wrote (parts lost or removed)",
                          f"{table}/engine={eid}: {found.get(table, 0)} of {n}", count=n - found.get(table, 0))


def _rows_per_engine(t: Trace, eid: str) -> dict[str, int]:
    """Rows of each table in engine `eid`'s partition, from the part footers."""
    return {name: sum(pq.read_metadata(p).num_rows for p in parts if p.parent.name == f"engine={eid}")
            for name, parts in t.parts.items()}


def _check_columns(t: Trace, f: _Findings) -> None:
    """Columns a capture must have: the required ones and those FILLED_WHEN names. A nullable column a
    capture never fills (invocations' agent_id, which only imports fill) may be absent from older parts."""
    for name, parts in t.parts.items():
        wanted = [c.name for c in schema.table(name).columns
                  if not c.nullable or (name, c.name) in schema.FILLED_WHEN]
        for p in parts:
            have = set(pq.read_schema(p).names)
            for col in wanted:
                if col not in have:
                    f.add("missing_field", f"column {name}.{col} is missing", str(Path(p).relative_to(t.path)))


def _check_filled(df, table: str, f: _Findings) -> None:
    import polars as pl

    if df.height == 0:
        return
    imported = pl.col("engine").is_in(sorted(f.imported))
    for col, when in FILLED_WHEN.get(table, {}).items():
        if col not in df.columns:
            continue
        cond = _rows_where(when)
        for eng, n in (df.filter(imported & cond & pl.col(col).is_null()).group_by("engine").len()
                          .sort("engine").iter_rows() if f.imported else ()):
            f.gap(eng, f"{table}.{col} (null in {n:,} rows: no engine timed or served them)")
        bad = df.filter(~imported & cond & pl.col(col).is_null())
        if bad.height:
            key = "request_id" if table == "invocations" else "seq"
            blocks = (RETENTION,) if col in _RETENTION_ONLY_FIELDS else ANALYSES
            locations = [f"{table}:{eng}:{k}" for eng, k in bad.select("engine", key).head(MAX_LOCATIONS).iter_rows()]
            f.add("missing_field", f"column {table}.{col} is null where it must be filled", locations,
                  blocks=blocks, count=bad.height)


def _rows_where(when: schema.When):
    """The polars condition selecting the rows `when` describes."""
    import polars as pl

    if when.column is None:
        return pl.lit(True)
    col = pl.col(when.column)
    if when.any_of is not None:
        return col.is_in(list(when.any_of))
    if when.none_of is not None:
        return col.is_not_null() & ~col.is_in(list(when.none_of))
    return col.is_not_null()


def _check_values(frames: dict, f: _Findings) -> None:
    import polars as pl

    for (table, col), allowed in schema.VOCABULARIES.items():
        df = frames[table]
        if df.height == 0 or col not in df.columns:
            continue
        bad = df.filter(pl.col(col).is_not_null() & ~pl.col(col).is_in(list(allowed)))
        if bad.height:
            values = sorted(set(bad.get_column(col).to_list()))[:MAX_LOCATIONS]
            f.add("invalid_value", f"column {table}.{col} holds values outside {', '.join(allowed)}",
                  [f"{table}.{col}={v!r}" for v in values], count=bad.height)


#: Domain rules the block-event walk reports in its own words (negative_ref_cnt).
_DOMAINS_CHECKED_ELSEWHERE = {("block_events", "ref_cnt")}
#: The key that names a row of each table in a finding's location.
_ROW_KEY = {"invocations": "request_id", "block_events": "seq", "lineage": "child_request_id", "transfers": "request_id",
            "steps": "step"}


def _check_domains(frames: dict, f: _Findings) -> None:
    """Every row inside the contract's domains (schema.DOMAINS): no negative length or count, no more
    hit tokens than prompt tokens. A value outside is impossible, so it blocks every analysis."""
    import polars as pl

    for (table, col), dom in schema.DOMAINS.items():
        df = frames[table]
        if (table, col) in _DOMAINS_CHECKED_ELSEWHERE or df.height == 0 or col not in df.columns:
            continue
        bad = pl.lit(False)
        if dom.minimum is not None:
            bad = bad | (pl.col(col) < dom.minimum)
        if dom.at_most is not None and dom.at_most in df.columns:
            bad = bad | (pl.col(col) > pl.col(dom.at_most))
        rows = df.filter(bad.fill_null(False))
        if rows.height:
            key = _ROW_KEY[table]
            f.add("out_of_domain", f"column {table}.{col} breaks its domain ({dom.describe(col)})",
                  [f"{table}:{e}:{k} {col}={v}" for e, k, v in rows.select("engine", key, col).head(MAX_LOCATIONS).iter_rows()],
                  count=rows.height)


# ---- block events --------------------------------------------------------------------------


def _walk_block_events(ev, f: _Findings) -> dict[tuple[str, str, int], int]:
    """Replay each engine's block events in seq order; returns touches per (engine, request, KV group)."""
    touches: dict[tuple[str, str, int], int] = {}
    if ev.height == 0:
        return touches
    ev = ev.sort(["engine", "seq"])
    cols = ("engine", "seq", "ts_ns", "event", "block_id", "ref_cnt", "block_hash", "request_id", "kv_group")
    state = None
    for eng, seq, ts, event, block, ref, bhash, req, group in zip(*(ev.get_column(c).to_list() for c in cols)):
        if state is None or state.engine != eng:
            state = _PoolState(eng)
        where = f"block_events:{eng}:{seq}"
        if state.prev_seq is not None and seq != state.prev_seq + 1:
            f.add("seq_gap", "block event seq has gaps or repeats", where)
        if state.prev_ts is not None and ts < state.prev_ts:
            f.add("clock_not_monotonic", "block event ts_ns goes back in seq order", where)
        state.prev_seq, state.prev_ts = seq, ts
        if ref is not None and ref < 0:
            f.add("negative_ref_cnt", "a block's reference count is negative", where)
        if event == "cleared":
            state.resident.clear()
            state.holder.clear()
            continue
        if block is None:
            continue  # counted as a missing field
        key = (group, bhash)
        if event == "allocated":
            if block in state.resident:
                f.add("allocated_while_cached", "a block was allocated while its hash was still cached (no eviction)", where)
                _drop(state, block)
            state.allocated.add(block)
        elif event == "touched":
            if block not in state.allocated:
                f.add("touch_unallocated", "a touched block was never allocated", where)
            elif block not in state.resident:
                f.add("touch_uncached", "a touched block holds no cached hash", where)
            if req is not None:
                k = (eng, req, group or 0)
                touches[k] = touches.get(k, 0) + 1
        elif event == "freed":
            if block not in state.allocated or state.ref.get(block, 0) <= 0:
                f.add("free_unallocated", "a freed block was not allocated (never, or no reference left)", where)
        elif event == "cached":
            if bhash is not None:
                other = state.holder.get(key)
                if other is not None and other != block and state.resident.get(other) == key:
                    f.add("duplicate_resident_hash", "a cached hash is already resident in another block", where,
                          severity=WARNING)
                if block in state.resident and state.resident[block] != key:
                    _drop(state, block)
                state.resident[block] = key
                state.holder[key] = block
        elif event == "evicted":
            if block not in state.resident:
                f.add("evict_uncached", "an evicted block held no cached hash", where)
            else:
                _drop(state, block)
        if ref is not None:
            state.ref[block] = ref
    return touches


class _PoolState:
    def __init__(self, engine: str):
        self.engine = engine
        self.prev_seq = None
        self.prev_ts = None
        self.allocated: set[int] = set()
        self.ref: dict[int, int] = {}
        #: block -> (kv group, hash) while cached; (kv group, hash) -> the block that last cached it
        self.resident: dict[int, tuple] = {}
        self.holder: dict[tuple, int] = {}


def _drop(state: _PoolState, block: int) -> None:
    key = state.resident.pop(block)
    if state.holder.get(key) == block:
        del state.holder[key]


# ---- invocations ---------------------------------------------------------------------------


def _check_cached_tokens(t: Trace, inv, touches: dict[tuple[str, str, int], int], f: _Findings) -> None:
    """Each request's hit against its touch events, in every KV cache group: a full-attention group
    touches the hit's blocks; a sliding-window (chunked local) group only those inside the window
    (chunk) at the hit's end. Mamba groups are not checked (vLLM keeps their state blocks by its own rule)."""
    if inv.height == 0:
        return
    groups = {}
    for eng, meta in t.engines.items():
        try:
            groups[eng] = groups_from_metadata(meta)
        except KmeshTraceError:
            groups[eng] = ()  # reported by the metadata check
    for eng, rid, cached, preempt in inv.select("engine", "request_id", "num_cached_tokens", "num_preemptions").iter_rows():
        if cached is None or preempt:
            continue
        mine = groups.get(eng, ())
        if not mine:
            continue  # reported as a missing metadata field
        for i, group in enumerate(mine):
            want = touched_blocks_of_hit(group, cached)
            got = touches.get((eng, rid, i), 0)
            if want is None or got == want:
                continue
            if len(mine) == 1:  # the message of a one-group model: tokens against touches x block size
                where = f"invocations:{eng}:{rid} ({cached} != {got * group.block_size})"
            else:
                where = f"invocations:{eng}:{rid} group {i} ({group.kind}: {got} blocks touched, {want} expected)"
            f.add("cached_tokens_mismatch", "num_cached_tokens disagrees with the request's touch events x block size",
                  where)


def kv_group_counts(t: Trace, ev) -> dict[str, list[dict]]:
    """Per hybrid engine (more than one KV cache group, or one that is not full attention), each group's
    kind and its block events by kind; `freed_while_running`: frees of a request's blocks before its
    last free of that group (a sliding window moving past them, or a preemption)."""
    import polars as pl

    out: dict[str, list[dict]] = {}
    if ev.height == 0:
        return out
    for eng, meta in t.engines.items():
        try:
            groups = groups_from_metadata(meta)
        except KmeshTraceError:
            continue  # reported by the metadata check
        if not is_hybrid(groups):
            continue
        mine = ev.filter(pl.col("engine") == eng)
        counts = {(g, e): n for g, e, n in mine.group_by("kv_group", "event").len().iter_rows()}
        frees = mine.filter((pl.col("event") == "freed") & pl.col("request_id").is_not_null())
        early = dict(frees.with_columns(last=pl.col("ts_ns").max().over("request_id", "kv_group"))
                     .filter(pl.col("ts_ns") < pl.col("last")).group_by("kv_group").len().iter_rows())
        out[eng] = [{"group": i, "kind": g.kind, "sliding_window": g.sliding_window,
                     **{f"num_{e}": counts.get((i, e), 0) for e in ("allocated", "touched", "cached", "freed", "evicted")},
                     "num_freed_while_running": early.get(i, 0)} for i, g in enumerate(groups)]
    return out


def _check_kv_groups(t: Trace, ev, f: _Findings) -> None:
    """Every kv_group a block event names is one of its engine's KV cache groups."""
    if ev.height == 0 or "kv_group" not in ev.columns:
        return
    import polars as pl

    for eng, meta in t.engines.items():
        try:
            n = len(groups_from_metadata(meta)) or 1
        except KmeshTraceError:
            continue  # reported by the metadata check
        bad = ev.filter((pl.col("engine") == eng) & (pl.col("kv_group") >= n))
        if bad.height:
            f.add("unknown_kv_group", f"a block event names a KV cache group the engine metadata does not list "
                  f"({n} group{'s' if n != 1 else ''}: kv_cache_groups)",
                  [f"block_events:{eng}:{s} kv_group={g}" for s, g in bad.select("seq", "kv_group").head(MAX_LOCATIONS).iter_rows()],
                  count=bad.height)


def _check_clocks(t: Trace, inv, f: _Findings) -> None:
    if inv.height:
        inv = inv.sort(["engine", "seq"])
        prev = (None, None)
        for eng, seq, rid, arr, sched, first, fin in inv.select(
                "engine", "seq", "request_id", "arrival_ns", "first_scheduled_ns", "first_token_ns", "finish_ns").iter_rows():
            where = f"invocations:{eng}:{rid}"
            if prev[0] == eng and arr is not None and prev[1] is not None and arr < prev[1]:
                if _is_import(t, eng):
                    f.add("import_order", "an import's seq is its import order (file by file), not arrival order; "
                          "analyses order by arrival_ns", where, severity=WARNING)
                else:
                    f.add("clock_not_monotonic", "invocation arrival_ns goes back in seq order", where)
            if arr is not None:
                prev = (eng, arr)
            times = [x for x in (arr, sched, first, fin) if x is not None]
            if any(b < a for a, b in zip(times, times[1:])):
                f.add("clock_not_monotonic", "an invocation's times are out of order (arrival, scheduled, first token, finish)", where)
    tr = t.frame("transfers")
    if tr.height:
        for eng, rid, start, fin in tr.select("engine", "request_id", "start_ns", "finish_ns").iter_rows():
            if start is not None and fin is not None and fin < start:
                f.add("clock_not_monotonic", "a transfer finished before it started", f"transfers:{eng}:{rid}")


def _check_steps(steps, f: _Findings) -> None:
    """Scheduler steps (no analysis of the verdict reads them; the twin's calibration does): each step once, its
    start not before the previous step's, its finish not before its start, its token and request counts adding
    up (prefill + decode = scheduled, prefill + decode requests = batch size)."""
    import polars as pl

    if steps.height == 0:
        return
    s = steps.sort("engine", "step")
    where = lambda rows: [f"steps:{e}:{k}" for e, k in rows.select("engine", "step").head(MAX_LOCATIONS).iter_rows()]  # noqa: E731
    same_engine = pl.col("engine") == pl.col("engine").shift(1)
    repeated = s.filter(same_engine & (pl.col("step") == pl.col("step").shift(1)))
    if repeated.height:
        f.add("duplicate_step", "a scheduler step is recorded twice", where(repeated), severity=WARNING, count=repeated.height)
    back = s.filter((same_engine & (pl.col("start_ns") < pl.col("start_ns").shift(1))) |
                    (pl.col("finish_ns") < pl.col("start_ns")).fill_null(False))
    if back.height:
        f.add("clock_not_monotonic", "a step starts before the one before it, or finishes before it starts",
              where(back), severity=WARNING, count=back.height)
    off = s.filter((pl.col("num_prefill_tokens") + pl.col("num_decode_tokens") != pl.col("num_scheduled_tokens")) |
                   (pl.col("num_prefill_requests") + pl.col("num_decode_requests") != pl.col("batch_size")))
    if off.height:
        f.add("inconsistent_step", "a step's prefill and decode counts do not add up to what it scheduled",
              where(off), severity=WARNING, count=off.height)


def _check_requests_known(ev, inv, f: _Findings) -> None:
    """Every request the block events act for has an invocation row: a request the pool served but the
    invocations lack means rows stopped early (a write that failed uncounted, a part lost)."""
    import polars as pl

    if ev.height == 0:
        return
    acted = ev.filter(pl.col("request_id").is_not_null()).select("engine", "request_id").unique()
    missing = acted.join(inv.select("engine", "request_id"), on=["engine", "request_id"], how="anti").sort("engine", "request_id")
    if missing.height:
        f.add("requests_missing", "block events act for requests that have no invocation row (rows stopped early)",
              [f"block_events:{e}:{r}" for e, r in missing.head(MAX_LOCATIONS).iter_rows()], count=missing.height)


def _check_lineage(lin, inv, f: _Findings) -> None:
    if lin.height == 0:
        return
    _check_lineage_shape(lin, f)
    known = {(e, r) for e, r in inv.select("engine", "request_id").iter_rows()}
    wanted = {(e, r) for e, r, p in lin.select("engine", "child_request_id", "parent_request_id").iter_rows() for r in (r, p) if r}
    import polars as pl

    tokens = {}
    rows = inv.filter(pl.col("request_id").is_in(sorted({r for _, r in wanted})))
    for e, r, prompt, output in rows.select("engine", "request_id", "prompt_token_ids", "output_token_ids").iter_rows():
        if (e, r) in wanted:
            tokens[(e, r)] = (prompt, output)
    for eng, child, parent, kind, shared, declared in lin.select(
            "engine", "child_request_id", "parent_request_id", "edge_kind", "num_shared_tokens",
            "declared_parent_id").iter_rows():
        where = f"lineage:{eng}:{child}<-{parent}"
        if kind == schema.EdgeKind.declared and parent is None:
            f.add("lineage_dangling_parent", "a declared parent is not in the child's engine partition (never sent, "
                  "or served by another engine; the edge is kept without parent_request_id and that engine's "
                  "retention analysis cannot hold for it)",
                  f"lineage:{eng}:{child}<-{declared!r}", severity=WARNING)
        if (eng, child) not in known or (parent is not None and (eng, parent) not in known):
            f.add("lineage_dangling", "a lineage edge names a request that is not in the invocations", where, blocks=(RETENTION,))
            continue
        if kind != schema.EdgeKind.exact_prefix or parent is None:
            continue
        child_prompt, _ = tokens[(eng, child)]
        p_prompt, p_output = tokens[(eng, parent)]
        if child_prompt is None or p_prompt is None:
            continue  # hashes only: nothing to compare token by token
        prefix = list(p_prompt) + list(p_output or [])
        if list(child_prompt[: len(prefix)]) != prefix or shared != len(prefix):
            f.add("lineage_not_exact_prefix",
                  "an exact_prefix edge's child prompt does not start with the parent's prompt + output "
                  "(or num_shared_tokens is not that length)", where, blocks=(RETENTION,))



def _check_lineage_shape(lin, f: _Findings) -> None:
    """No request is its own parent or its own ancestor, in any edge kind: either makes a family without
    a root (an analysis would walk it forever or report one deep family)."""
    from kmesh_trace.lineage import lineage_cycles

    for kind in sorted(set(lin.get_column("edge_kind").drop_nulls().to_list())):
        parent_of = {}
        for eng, child, parent in lin.filter(lin["edge_kind"] == kind).select(
                "engine", "child_request_id", "parent_request_id").iter_rows():
            if parent is not None:
                parent_of[(eng, child)] = (eng, parent)
        self_parents, cycles = lineage_cycles(parent_of)
        if self_parents:
            f.add("lineage_self_parent", f"a {kind} lineage edge names the child as its own parent",
                  [f"lineage:{e}:{c}<-{c}" for e, c in self_parents[:MAX_LOCATIONS]], count=len(self_parents),
                  blocks=(RETENTION,))
        for cycle in cycles:
            f.add("lineage_cycle", f"{kind} lineage edges form a cycle (a request is its own ancestor)",
                  f"lineage:{cycle[0][0]}:" + "<-".join(c for _, c in [*cycle, cycle[0]][:20]), blocks=(RETENTION,))


# ---- imported partitions -------------------------------------------------------------------


def _is_import(t: Trace, engine: str) -> bool:
    return str(t.engines.get(engine, {}).get("source", "")).startswith("import:")


def _imports(t: Trace, inv, lineage) -> dict[str, dict]:
    """What each imported partition supports, and what in it is approximate or modelled."""
    import polars as pl

    out = {}
    for eng, meta in sorted(t.engines.items()):
        if not _is_import(t, eng):
            continue
        rows = inv.filter(pl.col("engine") == eng) if inv.height else inv
        kinds = sorted(set(lineage.filter(pl.col("engine") == eng).get_column("edge_kind").to_list())) if lineage.height else []
        has_tokens = rows.height > 0 and rows.get_column("prompt_token_ids").null_count() < rows.height
        has_finish = rows.height > 0 and rows.get_column("finish_ns").null_count() < rows.height
        supports = ["headroom what-if: the policies and the Belady bound at a capacity you give (--capacity-blocks); "
                    "no stock, since no engine served this trace"]
        approximate = []
        if meta.get("token_ids_approximate"):
            approximate.append(f"token ids come from the importer's tokenizer ({meta.get('tokenizer')}), not the "
                               "serving model's: block counts and hit tokens are approximate")
        elif not has_tokens:
            approximate.append("prompts are block ids from the source (no token ids): block-exact, output blocks unknown")
        for kind in kinds:
            edges = "--edges declared" if kind == schema.EdgeKind.declared else ("--edges inferred" if kind == schema.EdgeKind.exact_prefix else f"--edges {kind}")
            supports.append(f"pressure what-if over {kind} edges ({edges}) and the lineage report")
        if schema.EdgeKind.content.value in kinds:
            approximate.append("content edges are guessed from text (an input extends the previous one, or repeats its "
                               "output); they are not lineage")
        if meta.get("arrival"):
            approximate.append(f"arrival across conversations is modelled ({meta['arrival']}); times within one "
                               "conversation are as recorded")
        if not has_finish:
            approximate.append("no finish times: the replay is sequential and reuse gaps are unknown")
        out[eng] = {"source": meta.get("source"), "supports": supports, "approximate": approximate}
    return out
