"""The capture contract: every table, column, type, unit and sentence of documentation.

This module is the single source of truth. Writers, readers, DuckDB views, validation, the
`kmesh-trace schema` command and docs/SCHEMA.md are all derived from it; nothing restates it.
It imports only pyarrow, so the capture hook (inside the engine process) can use it.

Clock rules: `*_ns` columns are nanoseconds of one monotonic clock per engine partition; the
engine's metadata carries one wall-clock anchor (`wall_anchor_ns`, `mono_anchor_ns`) that maps
them to wall time. Block hashes are the low 64 bits that vLLM's own KV events publish, so a
capture joins against vLLM's event stream; imported traces carry their own (re-chained) hashes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import TYPE_CHECKING

from kmesh_trace.errors import SchemaVersionError

if TYPE_CHECKING:
    import pyarrow as pa

SCHEMA_VERSION = "1.0"
#: The largest block size (tokens) any source may give a trace: no engine's block is larger, and it keeps
#: every token count built from blocks (blocks x block size, summed over a trace) inside int64.
MAX_BLOCK_SIZE = 1 << 20
SCHEMA_MAJOR = int(SCHEMA_VERSION.split(".")[0])
#: Key under which every Parquet part records the schema version it was written with.
VERSION_KEY = b"kmesh_trace.schema_version"
#: Key under which every Parquet part records its table name.
TABLE_KEY = b"kmesh_trace.table"


@dataclass(frozen=True)
class Column:
    name: str
    type_name: str  # the Arrow type as `type_name` writes it: int64, string, list<int32>, ...
    unit: str | None
    nullable: bool
    doc: str

    @property
    def type(self) -> "pa.DataType":
        """The column's Arrow type (pyarrow is imported here, not with the module: `--help` needs none)."""
        return arrow_type(self.type_name)

    def field(self) -> "pa.Field":
        import pyarrow as pa

        return pa.field(self.name, self.type, nullable=self.nullable, metadata={b"doc": self.doc.encode()})


@dataclass(frozen=True)
class Table:
    name: str
    doc: str
    columns: tuple[Column, ...]

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    def column(self, name: str) -> Column:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(name)

    def select(self, *names: str) -> tuple[str, ...]:
        """`names`, each checked to be a column of this table: a reader states which columns it needs
        and a renamed column fails where it is named, not as a missing key later."""
        for n in names:
            if n not in self.column_names:
                raise KeyError(f"{self.name} has no column {n!r}")
        return names

    @property
    def time_columns(self) -> list[str]:
        """The columns holding monotonic nanoseconds (unit ns)."""
        return [c.name for c in self.columns if c.unit == "ns"]

    def arrow_schema(self) -> "pa.Schema":
        import pyarrow as pa

        return pa.schema(
            [c.field() for c in self.columns],
            metadata={VERSION_KEY: SCHEMA_VERSION.encode(), TABLE_KEY: self.name.encode()},
        )


def _c(name: str, type_: str, unit: str | None, nullable: bool, doc: str) -> Column:
    return Column(name, type_, unit, nullable, doc)


TOKENS = "list<int32>"
HASHES = "list<uint64>"


@lru_cache(maxsize=None)
def arrow_type(name: str) -> "pa.DataType":
    """The Arrow type a column's `type_name` names."""
    import pyarrow as pa

    if name.startswith("list<") and name.endswith(">"):
        return pa.list_(arrow_type(name[5:-1]))
    return {"string": pa.string, "int64": pa.int64, "int32": pa.int32, "uint64": pa.uint64}[name]()

INVOCATION_STATUSES = ("finished", "length_capped", "aborted", "error")

INVOCATIONS = Table(
    "invocations",
    "One row per request the engine saw (or per line of an imported trace); `seq` gives the arrival order.",
    (
        _c("request_id", "string", None, False, "Engine request id (unique within the engine partition)."),
        _c("caller_request_id", "string", None, True, "The id the caller gave the request, when it differs from the engine's."),
        _c("seq", "int64", None, False, "Arrival order of the request within its engine partition, from 0."),
        _c("family_id", "string", None, True, "Caller-declared family id (`kmesh_family`), or null."),
        _c("parent_id", "string", None, True, "Caller-declared id of the parent request (`kmesh_parent`), or null."),
        _c("num_expected_children", "int32", "requests", True, "Caller-declared number of children the request will have (`kmesh_children`), or null."),
        _c("num_prompt_tokens", "int64", "tokens", False, "Prompt length."),
        _c("num_output_tokens", "int64", "tokens", True, "Generated tokens; null when unknown."),
        _c("prompt_token_ids", TOKENS, "token ids", True, "Exact prompt token ids; null when the source has only block hashes."),
        _c("output_token_ids", TOKENS, "token ids", True, "Exact generated token ids; null when unknown."),
        _c("prompt_block_hashes", HASHES, "hashes", True, "Chained prefix hash of each prompt block (block size in the metadata; the last block may be partial in imported traces); null when token ids are given instead."),
        _c("arrival_ns", "int64", "ns", True, "When the request reached the engine (monotonic clock)."),
        _c("first_scheduled_ns", "int64", "ns", True, "When the scheduler first gave the request KV blocks."),
        _c("first_token_ns", "int64", "ns", True, "When the first output token was produced."),
        _c("finish_ns", "int64", "ns", True, "When the request finished and its blocks were freed."),
        _c("status", "string", None, True, "Terminal status: finished, length_capped, aborted or error; null if it never finished in the capture."),
        _c("num_cached_tokens", "int64", "tokens", True, "Prompt tokens served from the engine's local prefix cache (stock hits); null when unknown."),
        _c("num_external_tokens", "int64", "tokens", True, "Prompt tokens loaded through a KV connector; null when unknown."),
        _c("num_preemptions", "int32", "count", True, "Times the request was preempted; null when unknown."),
        _c("agent_id", "string", None, True, "Sub-agent the request was sent by (imported agentic traces, e.g. `agent_001`); null for the main conversation or when unknown."),
        _c("agent_type", "string", None, True, "Kind of that sub-agent as the source names it (e.g. Explore, Plan); null when `agent_id` is."),
    ),
)


def vocabulary(enum: type[Enum]) -> tuple[str, ...]:
    """The values of one of the vocabulary enums below (edges, tier policies), in order."""
    return tuple(m.value for m in enum)


class EdgeKind(str, Enum):
    """The lineage table's `edge_kind`: where a parent-child edge comes from."""

    declared = "declared"  # from the caller, or the source's own structure
    exact_prefix = "exact_prefix"  # the child's prompt starts with the parent's whole prompt + output
    content = "content"  # an importer's guess from text


EDGE_KINDS = vocabulary(EdgeKind)


class PressureEdges(str, Enum):
    """Which edges the retention what-if (`kmesh-trace pressure --edges`) holds parents for.

    `inferred` means exact-prefix edges, whatever their `EdgeSource`: the trace's exact_prefix
    lineage rows when it has them (recorded from exact token ids), else inferred here from block hashes."""

    declared = "declared"
    inferred = "inferred"
    content = "content"


class EdgeSource(str, Enum):
    """Where the edges of one what-if came from (the JSON's `edge_source`)."""

    declared = "declared"  # each request's declared parent
    lineage = "lineage"  # rows of the trace's lineage table (exact_prefix or content)
    block_hashes = "block_hashes"  # exact-prefix edges inferred from the requests' block hashes


class FleetEdges(str, Enum):
    """The families `family` routing keeps together (`kmesh-trace fleet --edges`): declared lineage,
    exact-prefix edges inferred from block hashes, or auto (declared when the trace declares any)."""

    auto = "auto"
    declared = "declared"
    inferred = "inferred"


class TierWrite(str, Enum):
    """When a lower tier stores a block (`kmesh-trace tiers --host-write/--ssd-write`)."""

    on_evict = "on-evict"  # the blocks the GPU pool evicts
    write_through = "write-through"  # every full block as it is computed, in chunks


class TierLookup(str, Enum):
    """How a prompt's blocks are looked up below the GPU (`kmesh-trace tiers --lookup`)."""

    any = "any"  # GPU then lower tiers, block by block
    gpu_prefix = "gpu-prefix"  # lower tiers only extend the GPU prefix (vLLM's connectors)


class TierConnector(str, Enum):
    """A vLLM connector the tier model reproduces exactly (`kmesh-trace tiers --vllm-connector`)."""

    simple_cpu = "simple-cpu"  # SimpleCPUOffloadConnector, eager mode


LINEAGE = Table(
    "lineage",
    "One row per parent-child edge between invocations, declared by the caller or inferred.",
    (
        _c("child_request_id", "string", None, False, "Engine request id of the child."),
        _c("parent_request_id", "string", None, True, "Engine request id of the parent; null when a declared parent is not in the trace."),
        _c("declared_parent_id", "string", None, True, "The parent id as the caller declared it; null for inferred edges."),
        _c("family_id", "string", None, True, "Family the edge belongs to, when declared."),
        _c("edge_kind", "string", None, False, "declared (from the caller or the source's own structure), exact_prefix (child prompt starts with the parent's whole prompt + output) or content (an importer's guess from text: the next call of a session extends the previous input or repeats its output; never lineage)."),
        _c("num_shared_tokens", "int64", "tokens", True, "Tokens of the parent's prompt + output that the child's prompt repeats exactly; null when unknown."),
    ),
)

BLOCK_EVENT_KINDS = ("allocated", "touched", "cached", "freed", "evicted", "cleared", "held", "released")

BLOCK_EVENTS = Table(
    "block_events",
    "One row per physical KV block event in the engine's block pool, in the order they happened.",
    (
        _c("seq", "int64", None, False, "Event order within the engine partition, from 0, without gaps unless events were dropped (counted in the metadata)."),
        _c("ts_ns", "int64", "ns", False, "When the event was recorded (monotonic clock)."),
        _c("step", "int64", "steps", True, "Engine step (scheduler iteration) during which the event happened."),
        _c("event", "string", None, False, "allocated, touched (prefix hit), cached (hash assigned), freed, evicted (hash dropped for reuse), cleared (prefix cache reset), held or released (family hold)."),
        _c("block_id", "int32", None, True, "Physical block id; null for pool-wide events (cleared)."),
        _c("ref_cnt", "int32", "references", True, "The block's reference count after the event."),
        _c("block_hash", "uint64", None, True, "Low 64 bits of the block hash, as vLLM's KV events publish it (cached, evicted, touched)."),
        _c("parent_block_hash", "uint64", None, True, "Hash of the previous block in the prefix chain (cached events); null for a first block."),
        _c("request_id", "string", None, True, "Engine request id the engine was acting for, when known."),
        _c("num_free_blocks", "int32", "blocks", True, "Free blocks in the pool after the event."),
        _c("kv_group", "int32", None, True, "KV cache group id of the block."),
        _c("medium", "string", None, True, "Where the block lives as the engine's KV events name it (GPU, CPU, STORAGE; SGLang: GPU, CPU_PINNED); KV-events recordings only."),
        _c("session_id", "string", None, True, "Session the engine's KV event names for the store or reuse report (attribution only); KV-events recordings only."),
        _c("wall_publish_ns", "int64", "ns", True, "Wall-clock time (Unix epoch) the publisher stamped on the event's batch; KV-events recordings only (`ts_ns` is this time on the listener's monotonic clock)."),
        _c("publisher_seq", "int64", None, True, "Sequence number of the publisher's batch that carried the event (restarts at 0 when the publisher restarts); KV-events recordings only."),
        _c("locality", "string", None, True, "LOCAL or REMOTE: where the copy is relative to the publisher (vLLM offloading tiers); KV-events recordings only."),
        _c("ownership", "string", None, True, "The secondary offloading tier that owns the copy, as the publisher names it; KV-events recordings only."),
        _c("cache_salt", "string", None, True, "The salt that namespaces the block's hash (SGLang); KV-events recordings only."),
        _c("origin", "string", None, True, "NEW (computed) or REUSED (a prefix hit re-announced), when the publisher says which; KV-events recordings only."),
    ),
)

TRANSFER_DIRECTIONS = ("load", "store")
TRANSFER_STATUSES = ("ok", "failed", "incomplete")

TRANSFERS = Table(
    "transfers",
    "One row per KV-connector load or store, recorded by the proxy connector.",
    (
        _c("request_id", "string", None, False, "Engine request id the transfer was for."),
        _c("direction", "string", None, False, "load (external cache into the engine) or store (engine out to the external cache)."),
        _c("num_tokens", "int64", "tokens", True, "Tokens whose KV moved."),
        _c("num_blocks", "int64", "blocks", True, "Engine blocks the transfer covered."),
        _c("num_bytes", "int64", "bytes", True, "Bytes of KV moved, computed from the KV cache layout."),
        _c("start_ns", "int64", "ns", True, "When the transfer was started (monotonic clock)."),
        _c("finish_ns", "int64", "ns", True, "When the transfer was reported complete."),
        _c("status", "string", None, False, "ok, failed or incomplete (still pending when the capture ended)."),
        _c("connector", "string", None, False, "Class name of the inner KV connector that did the work."),
    ),
)

STEPS = Table(
    "steps",
    "One row per scheduler step that scheduled tokens, recorded by the capture (and written by `kmesh-trace "
    "simulate`): what the step computed and how long it took, the input of the twin's step-cost model. Counts are "
    "read from vLLM's SchedulerOutput when `schedule()` returns; the step ends when its model output reaches "
    "`update_from_output`.",
    (
        _c("step", "int64", None, False, "Scheduler iteration number (the `step` of the block events it caused)."),
        _c("start_ns", "int64", "ns", False, "When `schedule()` was called (monotonic clock)."),
        _c("finish_ns", "int64", "ns", True, "When the step's model output reached the scheduler; null for a step "
           "still running when the capture ended."),
        _c("num_scheduled_tokens", "int64", "tokens", False, "Tokens the step computed (prefill plus decode)."),
        _c("num_prefill_tokens", "int64", "tokens", False, "Prompt tokens computed (or recomputed after a preemption)."),
        _c("num_decode_tokens", "int64", "tokens", False, "Tokens computed for requests that are generating "
           "(one each, plus speculative tokens)."),
        _c("batch_size", "int64", "requests", False, "Requests scheduled in the step."),
        _c("num_prefill_requests", "int64", "requests", False, "Scheduled requests computing prompt tokens."),
        _c("num_decode_requests", "int64", "requests", False, "Scheduled requests generating."),
        _c("num_context_tokens", "int64", "tokens", False, "Tokens the scheduled requests attend over: their "
           "computed tokens after the step, summed."),
        _c("num_preempted", "int64", "requests", True, "Requests the step preempted."),
        _c("num_waiting", "int64", "requests", True, "Requests left waiting when the step was scheduled."),
    ),
)

TABLES: dict[str, Table] = {t.name: t for t in (INVOCATIONS, LINEAGE, BLOCK_EVENTS, TRANSFERS, STEPS)}

@dataclass(frozen=True)
class MetadataField:
    """One metadata field: its JSON type, its unit, what it means, and the least value of an integer field."""

    type: type
    unit: str | None
    doc: str
    minimum: int | None = None


#: Every field of an engine partition's metadata file (`TRACE/engines/<engine_id>.json`), typed. Null is
#: always allowed (the audit says which fields a capture must fill); `int` fields refuse booleans.
METADATA: dict[str, MetadataField] = {
    "engine_id": MetadataField(str, None, "Engine partition id: the `engine=` directory name of its parts."),
    "source": MetadataField(str, None, "capture (a live engine), kv-events:<engine> (the KV events an unmodified vLLM or SGLang published, "
               "recorded by `kmesh-trace listen`), import:<format> (a converted public trace) or simulate:vllm (a run of "
               "`kmesh-trace simulate`: vLLM's own scheduler in simulated time, no model)."),
    "schema_version": MetadataField(str, None, "Schema version the partition was written with."),
    "host": MetadataField(str, None, "Host name of the engine process."),
    "pid": MetadataField(int, None, "Process id of the engine process (a KV-events recording: the listener's, which wrote the partition).", minimum=0),
    "engine_index": MetadataField(int, None, "Data-parallel engine index.", minimum=0),
    "engine": MetadataField(str, None, "Engine name and version, e.g. vllm 0.32.0."),
    "model": MetadataField(str, None, "Model the engine served."),
    "block_size": MetadataField(int, "tokens", "Tokens per KV block (for imports: tokens per hashed block).", minimum=1),
    "num_usable_blocks": MetadataField(int, "blocks", "Blocks the pool can hand out (capacity, without the null block).", minimum=0),
    "null_block_id": MetadataField(int, None, "Id of the pool's reserved null block, when it has one.", minimum=0),
    "wall_anchor_ns": MetadataField(int, "ns", "Wall-clock time (Unix epoch) at `mono_anchor_ns`: maps the monotonic clock to wall time."),
    "mono_anchor_ns": MetadataField(int, "ns", "Monotonic clock reading taken together with `wall_anchor_ns`."),
    "capture_config": MetadataField(dict, None, "Options the capture or import ran with."),
    "num_dropped_events": MetadataField(dict, "events", "Events per table that could not be recorded (must be zero for a complete trace)."),
    "num_malformed_lines": MetadataField(int, "lines", "Input lines an importer could not read.", minimum=0),
    "num_bad_declarations": MetadataField(int, "requests", "Requests whose declared `kmesh_children` was not a count "
                                          "(recorded as null; the capture logs the first few).", minimum=0),
    "malformed_lines": MetadataField(list, None, "file:line of each malformed input line (first 1000)."),
    "complete": MetadataField(bool, None, "True once the writer closed cleanly; false while writing or after a crash."),
    "engine_died": MetadataField(str, None, "Captures: how the engine died under the capture, when it did: a fatal error it reported "
                    "(e.g. a worker process killed by the OOM killer; the partition still closes complete), or, written "
                    "by `kmesh-trace capture`, an engine process that ended without closing its partition (SIGKILL, "
                    "the OOM killer, a native crash). Absent for an engine that was stopped."),
    "token_ids_approximate": MetadataField(bool, None, "True when the token ids are not the serving model's (an importer tokenized text itself); every report on the trace says so."),
    "tokenizer": MetadataField(str, None, "How an importer turned text into token ids (e.g. utf-8-bytes, or tokenizers:FILE sha256:...)."),
    "arrival": MetadataField(str, None, "How an importer placed conversations on one time axis (e.g. users:8, stagger:30, as-recorded)."),
    "duplicate_records": MetadataField(list, None, "file:line of each exact duplicate record an importer imported once (first 1000), with the line it repeats."),
    "import_counts": MetadataField(dict, None, "What an importer read, imported, skipped and merged (files, entries, duplicates), by name."),
    "num_rows_written": MetadataField(dict, "rows", "Rows per table the writer wrote as parts (fewer rows in the trace: parts were lost)."),
    "num_failed_writes": MetadataField(int, "writes", "Parts the writer failed to write (their rows are counted in num_dropped_events).", minimum=0),
    "write_error": MetadataField(str, None, "The first write error (e.g. a full disk), when there was one."),
    "metadata_write_failed": MetadataField(bool, None, "True when this file could not be rewritten at the end; the loss record "
                              "`engines/<engine_id>.loss` then holds the final counts."),
    "last_flush": MetadataField(dict, None, "Captures: what was on disk after the latest flush that wrote rows: `wall_ns` (when), `num_arrivals` "
                   "(requests that had arrived by then), `rows` (rows written per table). After a crash (complete "
                   "false) only what the engine recorded after it may be missing."),
    "kv_bytes_per_token": MetadataField(int, "bytes", "KV cache bytes one token occupies across all layers (from the engine's KV cache spec).", minimum=0),
    "num_layers": MetadataField(int, "layers", "Attention layers that hold KV cache.", minimum=0),
    "num_kv_heads": MetadataField(int, "heads", "KV heads per layer (of the first KV cache group).", minimum=0),
    "head_size": MetadataField(int, None, "Elements per head (of the first KV cache group).", minimum=0),
    "kv_cache_dtype": MetadataField(str, None, "Element type of the KV cache, e.g. float16, bfloat16, fp8."),
    "hash_lookahead_tokens": MetadataField(int, "tokens", "Captures: tokens after each block that its hash also covers (vLLM >= 0.33 "
                              "with EAGLE lookahead hashing); 0 for plain prefix hashes. Above 0 the audit blocks "
                              "the analyses, which replay plain prefix hashes."),
    "kv_cache_groups": MetadataField(list, None, "The model's KV cache groups in vLLM's order (`block_events.kv_group` indexes it): each "
                        "`kind` (full_attention, sliding_window, chunked_local, mamba, mla), `block_size` (tokens), `num_layers`, "
                        "`page_size_bytes` (one block of one layer), `sliding_window` and `attention_chunk_size` (tokens). "
                        "Absent: one full-attention group of `block_size` (kmesh_trace/kv_groups.py)."),
    "prefix_cache_retention_interval": MetadataField(int, "tokens", "vLLM's prefix_cache_retention_interval: the blocks a "
                                        "sliding-window group caches. 0 (also when absent: vLLM's default) the window's tail "
                                        "before each prompt's last token and before a shared-prefix junction; a positive "
                                        "interval also before each interval's end; -1 (vLLM's none) every block.",
                                        minimum=-1),
    "scheduler_config": MetadataField(dict, None, "Captures: the scheduler's configuration as the engine resolved it: "
                         "`max_num_seqs`, `max_num_batched_tokens`, `max_model_len`, `chunked_prefill`, "
                         "`long_prefill_token_threshold`, `async_scheduling`, `policy`, `block_size`, `num_gpu_blocks` "
                         "(with the null block) and `prefix_caching` (what the twin needs to run the same engine)."),
    "simulation": MetadataField(dict, None, "Simulated partitions (source simulate:vllm): what `kmesh-trace simulate` ran, "
                   "`engine` (the vLLM whose scheduler ran), `flags` (block_size, num_gpu_blocks, max_model_len, "
                   "max_num_seqs, max_num_batched_tokens, chunked_prefill), `step_cost` (the step-cost model's "
                   "coefficients, seconds, and where they came from), `arrivals` (the trace's own, poisson:RATE or "
                   "concurrency:N), `input` (the source simulated) and, with `--calibrate`, `calibration` (the capture the "
                   "step cost was fitted to and its error on held-out steps)."),
    "kv_events": MetadataField(dict, None, "KV-events recordings: the publisher (`endpoint`, `replay_endpoint`, `topic`, `format`), "
                  "`hash_kind` (what `block_hash` holds), batches received and replayed, sequence gaps found, batches "
                  "recovered from the replay socket and `num_unrecovered_batches` (lost: the audit names them), "
                  "`num_malformed_frames`, publisher restarts (`epochs`), `num_duplicate_batches` (received again), "
                  "`num_late_batches` (counted lost, then received), `num_unread_at_stop` (received at the stop with "
                  "no time left to record them; counted lost), `num_touched_blocks` (hits: only "
                  "requests with kv_cache_report_mode full report them), `removal_semantics` (each_copy: a removal "
                  "is one physical copy, as vLLM <= 0.33 publishes; last_copy; unknown) with `removal_semantics_basis`, "
                  "`group_specs` (each KV group's spec kind and window as the stores reported them) and "
                  "`num_reported_outside_window` (blocks of hit reports before a sliding window's resident "
                  "end: reported, never touched, not recorded)."),
}

#: The JSON name of each metadata type, as the docs and `kmesh-trace schema --json` give it.
JSON_TYPE_NAMES: dict[type, str] = {str: "string", int: "integer", bool: "boolean", dict: "object", list: "array"}

#: Views of `METADATA` (unit and meaning; JSON type; least value) for readers that need one column of it.
METADATA_FIELDS: dict[str, tuple[str | None, str]] = {k: (f.unit, f.doc) for k, f in METADATA.items()}
METADATA_TYPES: dict[str, type] = {k: f.type for k, f in METADATA.items()}
METADATA_MINIMUM: dict[str, int] = {k: f.minimum for k, f in METADATA.items() if f.minimum is not None}


# ---- rules over the tables: vocabularies, required-when, joins, required metadata ------------------
# Each rule is one line; `check_rules()` (run by the tests) refuses a rule naming a column that does not exist.

#: The keys a caller puts in vLLM's `SamplingParams.extra_args` (`vllm_xargs` over the OpenAI API) to
#: declare lineage; the capture records them as `family_id`, `parent_id`, `num_expected_children`.
XARG_FAMILY = "kmesh_family"
XARG_PARENT = "kmesh_parent"
XARG_CHILDREN = "kmesh_children"
XARGS: dict[str, str] = {XARG_FAMILY: "family_id", XARG_PARENT: "parent_id", XARG_CHILDREN: "num_expected_children"}

#: Columns that hold only a fixed vocabulary (null aside).
VOCABULARIES: dict[tuple[str, str], tuple[str, ...]] = {
    ("invocations", "status"): INVOCATION_STATUSES,
    ("lineage", "edge_kind"): EDGE_KINDS,
    ("block_events", "event"): BLOCK_EVENT_KINDS,
    ("transfers", "direction"): TRANSFER_DIRECTIONS,
    ("transfers", "status"): TRANSFER_STATUSES,
}

#: Statuses of a request that ran to its end (its timings and outputs are known).
FINISHED_STATUSES = ("finished", "length_capped")


@dataclass(frozen=True)
class When:
    """The rows of a table in which a nullable column must be filled: every row (no condition),
    rows whose `column` is not null, is one of `any_of`, or is none of `none_of`."""

    column: str | None = None
    any_of: tuple[str, ...] | None = None
    none_of: tuple[str, ...] | None = None

    def describe(self) -> str:
        if self.column is None:
            return "always"
        if self.any_of is not None:
            return f"{self.column} in ({', '.join(self.any_of)})"
        if self.none_of is not None:
            return f"{self.column} not in ({', '.join(self.none_of)})"
        return f"{self.column} is not null"


ALWAYS = When()

#: What a capture (a live engine, not an import) must fill beyond the non-nullable columns:
#: (table, column) -> the rows that must have it. The capture audit checks these.
FILLED_WHEN: dict[tuple[str, str], When] = {
    ("invocations", "arrival_ns"): ALWAYS,
    ("invocations", "num_cached_tokens"): ALWAYS,
    ("invocations", "finish_ns"): When("status"),
    ("invocations", "first_scheduled_ns"): When("status", any_of=FINISHED_STATUSES),
    ("invocations", "first_token_ns"): When("status", any_of=FINISHED_STATUSES),
    ("invocations", "output_token_ids"): When("status", any_of=FINISHED_STATUSES),
    ("invocations", "num_output_tokens"): When("status", any_of=FINISHED_STATUSES),
    ("block_events", "block_id"): When("event", none_of=("cleared",)),
    ("block_events", "ref_cnt"): When("event", none_of=("cleared",)),
    ("block_events", "block_hash"): When("event", any_of=("cached", "evicted", "touched")),
}

#: Joins between tables: (table, column) -> (table, column) it refers to, within one engine partition.
JOINS: dict[tuple[str, str], tuple[str, str]] = {
    ("block_events", "request_id"): ("invocations", "request_id"),
    ("transfers", "request_id"): ("invocations", "request_id"),
    ("lineage", "child_request_id"): ("invocations", "request_id"),
    ("lineage", "parent_request_id"): ("invocations", "request_id"),
}

@dataclass(frozen=True)
class Domain:
    """The values a numeric column may hold (null aside): at least `minimum`, and, with `at_most`, no
    more than that other column of the same row (e.g. cached tokens never exceed prompt tokens)."""

    minimum: int | None = 0
    at_most: str | None = None

    def describe(self, column: str) -> str:
        parts = [f"{column} >= {self.minimum}"] if self.minimum is not None else []
        if self.at_most is not None:
            parts.append(f"{column} <= {self.at_most}")
        return " and ".join(parts)


#: The domain of every numeric column that has one: counts and lengths are never negative, hit tokens
#: never exceed the prompt. Times (`*_ns`) are int64 and so always finite; their order is the audit's.
#: Opening a trace refuses a part whose footer statistics break a minimum, `audit capture` checks every
#: row, and the writer refuses rows outside a domain before they become a part.
DOMAINS: dict[tuple[str, str], Domain] = {
    ("invocations", "seq"): Domain(),
    ("invocations", "num_expected_children"): Domain(),
    ("invocations", "num_prompt_tokens"): Domain(),
    ("invocations", "num_output_tokens"): Domain(),
    ("invocations", "num_cached_tokens"): Domain(at_most="num_prompt_tokens"),
    ("invocations", "num_external_tokens"): Domain(at_most="num_prompt_tokens"),
    ("invocations", "num_preemptions"): Domain(),
    ("lineage", "num_shared_tokens"): Domain(),
    ("block_events", "seq"): Domain(),
    ("block_events", "step"): Domain(),
    ("block_events", "block_id"): Domain(),
    ("block_events", "ref_cnt"): Domain(),
    ("block_events", "num_free_blocks"): Domain(),
    ("block_events", "kv_group"): Domain(),
    ("transfers", "num_tokens"): Domain(),
    ("transfers", "num_blocks"): Domain(),
    ("transfers", "num_bytes"): Domain(),
    ("steps", "step"): Domain(),
    ("steps", "num_scheduled_tokens"): Domain(),
    ("steps", "num_prefill_tokens"): Domain(),
    ("steps", "num_decode_tokens"): Domain(),
    ("steps", "batch_size"): Domain(),
    ("steps", "num_prefill_requests"): Domain(),
    ("steps", "num_decode_requests"): Domain(),
    ("steps", "num_context_tokens"): Domain(),
    ("steps", "num_preempted"): Domain(),
    ("steps", "num_waiting"): Domain(),
}


def domain_violations(table_name: str, data) -> list[str]:
    """Each domain rule of `table_name` that rows of `data` (a pyarrow Table or RecordBatch) break, as
    `rule (N rows)`; empty when every row is inside its domain."""
    import pyarrow as pa
    import pyarrow.compute as pc

    found = []
    names = set(data.schema.names)
    for (tname, col), dom in DOMAINS.items():
        if tname != table_name or col not in names:
            continue
        values = data.column(col)
        bad = None
        if dom.minimum is not None:
            bad = pc.less(values, dom.minimum)
        if dom.at_most is not None and dom.at_most in names:
            over = pc.greater(values, data.column(dom.at_most))
            bad = over if bad is None else pc.or_kleene(bad, over)
        n = pc.sum(pc.cast(pc.fill_null(bad, False), pa.int64())).as_py() if bad is not None else 0
        if n:
            found.append(f"{dom.describe(col)} ({n:,} row{'s' if n != 1 else ''} break it)")
    return found


#: Engine-metadata fields a capture must fill (an import may leave the others out).
REQUIRED_CAPTURE_METADATA: tuple[str, ...] = (
    "engine_id", "source", "schema_version", "host", "pid", "engine_index", "engine", "model", "block_size",
    "num_usable_blocks", "wall_anchor_ns", "mono_anchor_ns", "num_dropped_events", "complete",
)

#: `source` of a partition recorded from an engine's published KV events (`kmesh-trace listen`), before the engine.
KV_EVENTS_SOURCE = "kv-events:"
#: Required metadata a KV-events recording may not know (the events carry neither): the audit warns, not blocks.
KV_EVENTS_UNKNOWABLE_METADATA: tuple[str, ...] = ("model", "num_usable_blocks")


def is_kv_events(meta: dict) -> bool:
    """True for an engine partition recorded from published KV events (no requests, no block ids)."""
    return str(meta.get("source", "")).startswith(KV_EVENTS_SOURCE)


#: The `engines` view (`kmesh-trace sql`, `Trace.scan("engines")`): one row per engine partition, the
#: metadata fields as columns (nested values, e.g. capture_config, as JSON text).
ENGINES_VIEW = "engines"


def values(table_name: str, column: str, *names: str) -> tuple[str, ...]:
    """`names`, each checked to be in the vocabulary of `table_name.column` (see VOCABULARIES)."""
    vocab = VOCABULARIES[(table_name, column)]
    for n in names:
        if n not in vocab:
            raise KeyError(f"{table_name}.{column} has no value {n!r}; its values are {', '.join(vocab)}")
    return names


def check_rules() -> None:
    """Every rule names a table and column of the contract, and every required field is declared."""
    for tname, col in [*VOCABULARIES, *FILLED_WHEN, *JOINS, *JOINS.values(), *DOMAINS,
                       *((t, d.at_most) for (t, _), d in DOMAINS.items() if d.at_most)]:
        if col not in table(tname).column_names:
            raise KeyError(f"schema rule names {tname}.{col}, which is not a column")
    for (tname, col), when in FILLED_WHEN.items():
        if when.column is not None and when.column not in table(tname).column_names:
            raise KeyError(f"FILLED_WHEN[{tname}.{col}] depends on {when.column}, which is not a column")
        if not table(tname).column(col).nullable:
            raise KeyError(f"FILLED_WHEN[{tname}.{col}]: the column is never null anyway")
    for name in REQUIRED_CAPTURE_METADATA:
        if name not in METADATA_FIELDS:
            raise KeyError(f"required metadata field {name} is not in METADATA_FIELDS")


def metadata_type_error(name: str, value: object) -> str | None:
    """Why `value` cannot be metadata field `name` (None when it can): the field's JSON type, counts
    never negative, `num_dropped_events` a table -> count mapping."""
    want = METADATA_TYPES.get(name)
    if want is None or value is None:
        return None
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        return f"field {name} is {type(value).__name__}, not {want.__name__}"
    if name in ("num_dropped_events", "num_rows_written"):
        bad = [k for k, v in value.items() if isinstance(v, bool) or not isinstance(v, int) or v < 0]
        if bad:
            return f"field {name} holds counts that are not integers >= 0 ({', '.join(map(str, bad[:3]))})"
    least = METADATA_MINIMUM.get(name)
    if least is not None and value < least:
        return f"field {name} is {value}, below its least value {least}"
    return None



def table(name: str) -> Table:
    try:
        return TABLES[name]
    except KeyError:
        raise KeyError(f"unknown table {name!r}; the tables are {', '.join(TABLES)}") from None


def check_version(version: str | bytes | None, where: str) -> None:
    """Refuse data written under an unknown major schema version."""
    if isinstance(version, bytes):
        version = version.decode()
    if version is None:
        raise SchemaVersionError(f"{where} has no kmesh-trace schema version; it was not written by kmesh-trace.")
    try:
        major = int(str(version).split(".")[0])
    except ValueError:
        raise SchemaVersionError(f"{where} has an unreadable schema version {version!r}.") from None
    if major != SCHEMA_MAJOR:
        raise SchemaVersionError(
            f"{where} uses schema version {version}, but this kmesh-trace reads major version {SCHEMA_MAJOR}; "
            f"install a kmesh-trace release that supports schema {major}."
        )


def type_name(t: "pa.DataType") -> str:
    return str(t).replace("list<item: ", "list<")


def as_dict() -> dict:
    """The contract as plain data: the JSON form of `kmesh-trace schema --json`."""
    return {
        "schema_version": SCHEMA_VERSION,
        "tables": {
            t.name: {
                "doc": t.doc,
                "columns": [
                    {"name": c.name, "type": type_name(c.type), "unit": c.unit, "nullable": c.nullable, "doc": c.doc}
                    for c in t.columns
                ],
            }
            for t in TABLES.values()
        },
        "metadata": {k: {"type": JSON_TYPE_NAMES[f.type], "unit": f.unit, "doc": f.doc,
                         "required_in_capture": k in REQUIRED_CAPTURE_METADATA} for k, f in METADATA.items()},
        "vocabularies": {f"{t}.{c}": list(v) for (t, c), v in VOCABULARIES.items()},
        "filled_when": {f"{t}.{c}": w.describe() for (t, c), w in FILLED_WHEN.items()},
        "joins": {f"{t}.{c}": f"{rt}.{rc}" for (t, c), (rt, rc) in JOINS.items()},
        "domains": {f"{t}.{c}": d.describe(c) for (t, c), d in DOMAINS.items()},
        "metadata_minimum": METADATA_MINIMUM,
        "vllm_xargs": XARGS,
    }


def markdown() -> str:
    """docs/SCHEMA.md, generated from the contract."""
    lines = [
        "# kmesh-trace schema",
        "",
        f"Schema version {SCHEMA_VERSION}. Generated from `kmesh_trace/schema.py` by `kmesh-trace schema --markdown`; do not edit.",
        "",
        "A trace directory is `TRACE/<table>/engine=<engine_id>/part-NNNNN.parquet` (Hive-partitioned) plus",
        "one metadata file per engine partition, `TRACE/engines/<engine_id>.json`.",
        "",
    ]
    for t in TABLES.values():
        lines += [f"## `{t.name}`", "", t.doc, "", "| column | type | unit | nullable | meaning |", "|---|---|---|---|---|"]
        for c in t.columns:
            lines.append(f"| `{c.name}` | `{type_name(c.type)}` | {c.unit or ''} | {'yes' if c.nullable else 'no'} | {c.doc} |")
        lines.append("")
    lines += [
        "## Engine metadata (`engines/<engine_id>.json`, and the `engines` view)", "",
        f"One file per engine partition. `kmesh-trace sql` and `Trace.scan(\"{ENGINES_VIEW}\")` show them as a table",
        f"`{ENGINES_VIEW}`, one row per partition, these fields as columns (nested values as JSON text):",
        f"`SELECT * FROM {ENGINES_VIEW}`. Required: filled by every capture (imports may leave the others out).", "",
        "| field | type | unit | required | meaning |", "|---|---|---|---|---|",
    ]
    for k, f in METADATA.items():
        lines.append(f"| `{k}` | {JSON_TYPE_NAMES[f.type]} | {f.unit or ''} | "
                     f"{'yes' if k in REQUIRED_CAPTURE_METADATA else ''} | {f.doc} |")
    lines += ["", "## Rules", "", "Vocabularies (a column holds only these values, or null):", ""]
    lines += [f"- `{t}.{c}`: {', '.join(f'`{x}`' for x in v)}" for (t, c), v in VOCABULARIES.items()]
    lines += ["", "Filled when (a capture must fill these nullable columns in these rows; `kmesh-trace audit capture` checks):", ""]
    lines += [f"- `{t}.{c}`: {w.describe()}" for (t, c), w in FILLED_WHEN.items()]
    lines += ["", "Joins (within one engine partition):", ""]
    lines += [f"- `{t}.{c}` -> `{rt}.{rc}`" for (t, c), (rt, rc) in JOINS.items()]
    lines += ["", "Domains (every row; opening a trace, the writer and `kmesh-trace audit capture` check them):", ""]
    lines += [f"- `{t}.{c}`: {d.describe(c)}" for (t, c), d in DOMAINS.items()]
    lines += ["", "Least values of integer metadata fields: "
              + ", ".join(f"`{k}` >= {v}" for k, v in METADATA_MINIMUM.items()) + "."]
    lines += ["", "Lineage a caller declares, as `SamplingParams.extra_args` (`vllm_xargs` over the OpenAI API):", ""]
    lines += [f"- `{k}` -> `invocations.{col}`" for k, col in XARGS.items()]
    return "\n".join(lines) + "\n"

