"""The field names the corpus audit recognises, and what it infers from values and READMEs.

Owns: which keys are timestamps, which name a session, an input or an output; the evidence
categories the analyses need (explicit parent links, start and completion times, engine identity,
exact token ids, physical cache events, per-call cached-token counts) and the key names that count
for each; the timestamp unit inferred from magnitudes; the JSON type name of a value; and the
synthetic / hand-crafted labels of a README. Matching is on lower-cased key names. A key counts for
a category only when its value carries information (not null, not empty, and for token ids a list
of integers), so `"parent_id": null` is not a parent link; it does count as a declared parent field
(a family's root has none), and links are complete when every record declares the field.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

# ---- timestamps --------------------------------------------------------------------------------

_TS_EXACT = {"timestamp", "ts", "time", "created", "datetime"}
_TS_SUFFIXES = ("_ts", "_time", "_timestamp", "_at", "_ns", "_ms", "_us")


def is_timestamp_key(key: str) -> bool:
    low = key.lower()
    return low in _TS_EXACT or low.endswith(_TS_SUFFIXES) or low.startswith("timestamp")


#: Unix-epoch magnitudes: a value in [lo, hi) reads as that unit (1973 to 5138 in each unit).
UNIT_RANGES = (("s", 1e8, 1e11), ("ms", 1e11, 1e14), ("us", 1e14, 1e17), ("ns", 1e17, 1e20))
UNIT_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def unit_of(value: float) -> str:
    v = abs(value)
    for unit, lo, hi in UNIT_RANGES:
        if lo <= v < hi:
            return unit
    return "not_epoch"


@dataclass
class TimestampStats:
    """Magnitudes of one numeric timestamp key within one source."""

    num_values: int = 0
    min: float = math.inf
    max: float = -math.inf
    by_unit: dict[str, int] = field(default_factory=dict)
    #: Greatest common divisor of the integer values: the clock's apparent granularity.
    gcd: int = 0
    num_non_integer: int = 0

    def add(self, v: float) -> None:
        if type(v) is float and not math.isfinite(v):
            return  # 1e999 parses as inf: not a time
        self.num_values += 1
        self.min = min(self.min, v)
        self.max = max(self.max, v)
        u = unit_of(v)
        self.by_unit[u] = self.by_unit.get(u, 0) + 1
        if type(v) is int:
            self.gcd = math.gcd(self.gcd, v)
        else:
            self.num_non_integer += 1

    @property
    def unit(self) -> str:
        """The unit all values agree on, `mixed` when they do not, `not_epoch` when none look like epochs."""
        units = [u for u in self.by_unit if u != "not_epoch"]
        if not units:
            return "not_epoch"
        if len(self.by_unit) > 1:
            return "mixed"
        return units[0]

    def to_dict(self) -> dict:
        unit = self.unit
        granularity = None
        if unit in UNIT_SECONDS and self.gcd and not self.num_non_integer:
            granularity = self.gcd * UNIT_SECONDS[unit]
        return {
            "unit": unit,
            "values": self.num_values,
            "by_unit": dict(sorted(self.by_unit.items())),
            "min": self.min if self.num_values else None,
            "max": self.max if self.num_values else None,
            "span_s": (self.max - self.min) * UNIT_SECONDS[unit] if unit in UNIT_SECONDS else None,
            "granularity_s": granularity,
        }


# ---- sessions and content ----------------------------------------------------------------------

SESSION_KEYS = ("session_id", "session", "conversation_id", "thread_id", "trace_id", "chat_id", "episode_id", "run_id")
INPUT_KEYS = ("input", "prompt", "messages", "request")
OUTPUT_KEYS = ("output", "response", "completion", "answer")

# ---- evidence categories -----------------------------------------------------------------------

PARENT_LINKS = "explicit_parent_links"
#: Records that declare a parent field at all (null for a family's root): what makes links complete.
PARENT_FIELDS = "parent_link_fields"
START_COMPLETION = "start_completion_times"
ENGINE_IDENTITY = "engine_identity"
TOKEN_IDS = "exact_token_ids"
CACHE_EVENTS = "physical_cache_events"
CACHED_TOKENS = "cached_token_counts"
CATEGORIES = (PARENT_LINKS, PARENT_FIELDS, START_COMPLETION, ENGINE_IDENTITY, TOKEN_IDS, CACHE_EVENTS, CACHED_TOKENS)

_START = "start"
_COMPLETION = "completion"

#: Lower-cased key name -> category (start and completion keys are combined per record).
EVIDENCE_KEYS: dict[str, str] = {}
for _k in ("parent_id", "parent", "parent_request_id", "parent_call_id", "parent_span_id", "parent_run_id",
           "parent_uuid", "parentid", "parent_message_id", "kmesh_parent", "previous_response_id", "caused_by"):
    EVIDENCE_KEYS[_k] = PARENT_LINKS
for _k in ("start_time", "started_at", "start_ts", "start_ns", "start_ms", "arrival_time", "arrival_ns",
           "request_time", "sent_at", "queued_ts", "scheduled_ts", "first_scheduled_ns", "request_start"):
    EVIDENCE_KEYS[_k] = _START
for _k in ("end_time", "finish_time", "finished_at", "completed_at", "completion_time", "end_ts", "end_ns",
           "end_ms", "finish_ns", "response_time", "received_at", "last_token_ts", "request_end",
           "duration", "duration_ms", "duration_s", "latency", "latency_ms", "latency_s", "elapsed_ms"):
    EVIDENCE_KEYS[_k] = _COMPLETION
for _k in ("engine_id", "engine_index", "engine_instance", "host", "hostname", "instance_id", "server_id",
           "worker_id", "replica_id", "node_id", "pod", "pod_name", "backend_id"):
    EVIDENCE_KEYS[_k] = ENGINE_IDENTITY
for _k in ("prompt_token_ids", "token_ids", "input_ids", "input_token_ids", "output_token_ids",
           "completion_token_ids", "tokens", "hash_ids", "block_hashes", "prompt_block_hashes"):
    EVIDENCE_KEYS[_k] = TOKEN_IDS
for _k in ("block_events", "kv_events", "cache_events", "kv_cache_events", "block_ids", "block_id",
           "blockstored", "blockremoved", "evicted_blocks", "stored_blocks", "removed_blocks"):
    EVIDENCE_KEYS[_k] = CACHE_EVENTS
for _k in ("num_cached_tokens", "cached_tokens", "prompt_cached_tokens", "cache_read_input_tokens",
           "cache_hit_tokens", "prefix_hit_tokens"):
    EVIDENCE_KEYS[_k] = CACHED_TOKENS


def carries_value(category: str, value: object) -> bool:
    if value is None or value == "" or value == [] or value == {}:
        return False
    if category == TOKEN_IDS:
        return type(value) is list and all(type(x) is int for x in value)
    return True


def evidence_of(obj: dict, out: dict[str, set[str]], prefix: str = "", depth: int = 0) -> None:
    """Add to `out` (category -> key paths) the evidence one record carries; nested objects to depth 2."""
    for k, v in obj.items():
        cat = EVIDENCE_KEYS.get(k.lower())
        if cat is not None and carries_value(cat, v):
            out.setdefault(cat, set()).add(prefix + k)
        if cat == PARENT_LINKS:
            out.setdefault(PARENT_FIELDS, set()).add(prefix + k)
        if type(v) is dict and depth < 2 and v:
            evidence_of(v, out, prefix + k + ".", depth + 1)


def categories_of(found: dict[str, set[str]]) -> dict[str, set[str]]:
    """Fold start/completion keys into the one category that needs both; drop lone halves."""
    start = found.pop(_START, None)
    completion = found.pop(_COMPLETION, None)
    if start and completion:
        found[START_COMPLETION] = start | completion
    return found


# ---- values ------------------------------------------------------------------------------------

_TYPE_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null",
               dict: "object", list: "array"}


def json_type(value: object) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


# ---- READMEs -----------------------------------------------------------------------------------

LABELS = {
    "synthetic": re.compile(r"\bsynthetic\b", re.IGNORECASE),
    "hand-crafted": re.compile(r"\bhand[- ]?(?:crafted|made|written)\b", re.IGNORECASE),
    "simulated": re.compile(r"\bsimulated\b", re.IGNORECASE),
}


def readme_labels(text: str) -> list[tuple[int, str, str]]:
    """(line number, label, line) for each line of a README that labels data as not observed."""
    hits = []
    for i, line in enumerate(text.splitlines(), 1):
        for label, rx in LABELS.items():
            if rx.search(line):
                hits.append((i, label, line))
    return hits
