"""Decoding the KV events that unmodified vLLM and SGLang engines publish over ZeroMQ.

Both engines send multipart messages `(topic, seq, payload)`: `seq` the batch's sequence number as
8 bytes big-endian (from 0 per publisher, again from 0 when it restarts), `payload` one msgpack
`KVEventBatch`, a positional array `[ts, events, rank]` (ts: wall-clock seconds; rank: vLLM's data
parallel rank or SGLang's attention-DP rank; vLLM may omit a null rank). The replay socket answers
with the same three frames and ends with an empty topic, seq -1 and an empty payload.

Events, read off the engines' sources (`vllm/distributed/kv_events.py` of vLLM 0.32 and 0.33,
`sglang/srt/disaggregation/kv_events.py` of SGLang 0.5.23):
- `vllm-map` (vLLM since mid-2026): tagged maps, `type` = BlockStored / BlockRemoved / AllBlocksCleared,
  defaults omitted. vLLM always sends `group_idx` (its KV cache group) in stores and removals; an
  offloading tier's stores also carry `kv_cache_spec_kind` and `kv_cache_spec_sliding_window` (the
  group's spec), `locality` (LOCAL / REMOTE) and `ownership` (a secondary tier's owner); stores carry
  the request's `session_id`; 0.33 adds `lookahead_token_ids` (ignored: `hash_lookahead_tokens` in
  the plugin capture's metadata says what it means). `origin` (NEW / REUSED on a store) is read
  when a publisher sends it. A removal is one physical copy (vLLM <= 0.33 frees a block at a time:
  a hash stored in two blocks is removed twice): `removal_semantics` says so in the metadata.
  Hashes are u64 (the low 64 bits of the block's SHA-256), or the whole hash as bytes when
  `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` (their low 64 bits are kept, the same value).
- `vllm-array` (older vLLM): each event a positional array whose first element is the tag.
- `sglang`: tagged maps without `group_idx` (`cache_salt`, `session_id`, `lora_name` when set; `medium`
  on stores and removals);
  media GPU and CPU_PINNED; hashes are **signed** int64, kept as their two's-complement bit pattern
  in the trace's uint64 `block_hash` (`signed_hash` turns one back).

`decode_frames` never raises on bad input: it returns a `Frame` whose `error` says what was wrong
(the listener counts it) and keeps every event it could read. Every value is checked here, at the
typed boundary, against what the trace can hold (`_WIRE_BOUNDS`: a rank, block size or group
outside it, a batch time that is not a finite wall-clock time in int64 nanoseconds) so that a bad
value is a counted malformed event or frame, never a failed write or an unreadable trace. Imports
only msgspec (vLLM and SGLang both depend on it), the standard library and the schema, like the rest
of the capture side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from kmesh_trace.schema import MAX_BLOCK_SIZE

#: What `block_hash` holds, per format (recorded in the partition's metadata as `hash_kind`).
HASH_KINDS = {
    "vllm-map": "vllm:sha256-low64 (the low 64 bits of the block's SHA-256 hash, as vLLM's plugin capture records them)",
    "vllm-array": "vllm:sha256-low64 (the low 64 bits of the block's SHA-256 hash, as vLLM's plugin capture records them)",
    "sglang": "sglang:int64 (SGLang's signed 64-bit block hash, stored as its two's-complement bit pattern; "
              "not comparable with vLLM hashes)",
}
STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
END_SEQ = -1
_U64 = (1 << 64) - 1
#: The least and greatest value of each integer from the wire: what a trace column or metadata field
#: holds (`kv_group` is int32; a rank is a metadata index) and what an engine can mean (a block of
#: more than 2^20 tokens is no engine's).
_WIRE_BOUNDS = {"rank": (0, (1 << 31) - 1), "group_idx": (0, (1 << 31) - 1), "block_size": (1, MAX_BLOCK_SIZE)}
#: Batch times: wall-clock seconds whose nanoseconds fit int64 (`wall_publish_ns`) with room for the
#: listener's clock mapping (the year 2261).
_MAX_TS_S = 9.2e9
_SGLANG_MEDIA = {"CPU_PINNED", "DISK", "EXTERNAL"}
# Positional field order of the older array-like vLLM events (after the tag).
_ARRAY_FIELDS = {
    STORED: ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
             "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "ownership",
             "session_id"),
    REMOVED: ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    CLEARED: (),
}


@dataclass(slots=True)
class Event:
    """One engine event, normalised: hashes as uint64 values, in the engine's own order."""

    kind: str  # BlockStored, BlockRemoved or AllBlocksCleared
    hashes: list[int] = field(default_factory=list)
    parent: int | None = None
    block_size: int | None = None
    num_tokens: int | None = None
    medium: str | None = None
    group: int | None = None
    session_id: str | None = None
    locality: str | None = None  # LOCAL or REMOTE relative to the publisher (vLLM offloading tiers)
    ownership: str | None = None  # the secondary tier that owns the copy (vLLM offloading tiers)
    cache_salt: str | None = None  # SGLang: the salt that namespaces the hashes
    origin: str | None = None  # NEW or REUSED: what a store reports, when the publisher says
    spec_kind: str | None = None  # the group's KV cache spec kind (vLLM offloading tiers' stores)
    sliding_window: int | None = None  # the group's window in tokens, with spec_kind sliding_window


@dataclass(slots=True)
class Frame:
    """One message off the wire: its seq (None when unreadable), the batch, what could not be read."""

    seq: int | None
    ts: float | None = None
    rank: int | None = None
    events: list[Event] = field(default_factory=list)
    format: str | None = None  # detected from the events; None when they do not tell (e.g. only clears)
    error: str | None = None  # why the frame (or some of its events) could not be read
    num_bad_events: int = 0
    is_end: bool = False  # the replay socket's end marker
    digest: int = 0  # of the payload: tells a repeated batch from a new one at the same seq


def signed_hash(value: int) -> int:
    """An SGLang hash as SGLang published it (signed int64), from the uint64 the trace stores."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _hash(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError("a block hash is a boolean")
    if isinstance(value, int):
        if value < -(1 << 63) or value > _U64:
            raise ValueError(f"block hash {value} does not fit in 64 bits")
        return value & _U64
    if isinstance(value, (bytes, bytearray, memoryview)):
        if not len(value):
            raise ValueError("an empty block hash")
        return int.from_bytes(bytes(value)[-8:], "big")
    raise TypeError(f"a block hash is {type(value).__name__}")


def _opt_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} is {type(value).__name__}, not an integer")
    lo, hi = _WIRE_BOUNDS.get(name, (None, None))
    if lo is not None and not lo <= value <= hi:
        raise ValueError(f"{name} {value} is outside {lo}..{hi}")
    return value


def _opt_str(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name} is {type(value).__name__}, not a string")
    return value


#: The longest value an enumerated string field (medium, locality, ownership, spec kind, origin) may have.
MAX_ENUM_CHARS = 256
#: A store's origin: the only values it has.
ORIGINS = ("NEW", "REUSED")


def _enum_str(value: Any, name: str, allowed: tuple[str, ...] = ()) -> str | None:
    """An enumerated string field: printable, at most MAX_ENUM_CHARS, one of `allowed` (any case) when given.
    Anything else makes the event malformed, so no terminal escape or megabyte string reaches a recording."""
    value = _opt_str(value, name)
    if value is None:
        return None
    if len(value) > MAX_ENUM_CHARS or not value.isprintable():
        raise ValueError(f"{name} is not a printable name of at most {MAX_ENUM_CHARS} characters")
    if allowed and value.upper() not in allowed:
        raise ValueError(f"{name} is {value[:40]!r}, not one of {', '.join(allowed)}")
    return value.upper() if allowed else value


def _fields(raw: Any) -> tuple[str, dict, str]:
    """(kind, fields, the format this encoding shows)."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        fmt = "vllm-map" if "group_idx" in raw else "sglang" if ("cache_salt" in raw or raw.get("medium") in _SGLANG_MEDIA) else ""
        return kind, raw, fmt
    if isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _ARRAY_FIELDS.get(kind)
        if names is None:
            return kind, {}, "vllm-array"
        if len(raw) - 1 > len(names):
            raise ValueError(f"a {kind} array has {len(raw) - 1} fields, more than the {len(names)} vLLM defines")
        return kind, dict(zip(names, raw[1:])), "vllm-array"
    raise TypeError(f"an event is {type(raw).__name__}, neither a tagged map nor a tagged array")


def decode_event(raw: Any) -> tuple[Event, str]:
    """One raw (msgpack-decoded) event -> (Event, the format it shows or '')."""
    kind, f, fmt = _fields(raw)
    if kind not in (STORED, REMOVED, CLEARED):
        raise ValueError(f"unknown event type {kind!r}")
    if kind == CLEARED:
        return Event(CLEARED), fmt
    hashes = f.get("block_hashes")
    if not isinstance(hashes, (list, tuple)):
        raise TypeError(f"{kind}.block_hashes is {type(hashes).__name__}, not a list")
    values = [_hash(h) for h in hashes]
    if any(isinstance(h, int) and not isinstance(h, bool) and h < 0 for h in hashes):
        fmt = fmt or "sglang"  # vLLM's hashes are unsigned
    ev = Event(kind, values, medium=_enum_str(f.get("medium"), "medium"), group=_opt_int(f.get("group_idx"), "group_idx"),
               locality=_enum_str(f.get("locality"), "locality"), ownership=_enum_str(f.get("ownership"), "ownership"))
    if kind == STORED:
        parent = f.get("parent_block_hash")
        ev.parent = None if parent is None else _hash(parent)
        ev.block_size = _opt_int(f.get("block_size"), "block_size")
        tokens = f.get("token_ids")
        if tokens is not None and not isinstance(tokens, (list, tuple)):
            raise TypeError(f"BlockStored.token_ids is {type(tokens).__name__}, not a list")
        ev.num_tokens = None if tokens is None else len(tokens)
        ev.session_id = _opt_str(f.get("session_id"), "session_id")
        ev.cache_salt = _opt_str(f.get("cache_salt"), "cache_salt")
        ev.origin = _enum_str(f.get("origin"), "origin", ORIGINS)
        ev.spec_kind = _enum_str(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind")
        window = _opt_int(f.get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window")
        if window is not None and window < 1:
            raise ValueError(f"kv_cache_spec_sliding_window {window} is not a window in tokens")
        ev.sliding_window = window
    return ev, fmt


#: vLLM's `KVCacheSpecKind` values (a store's `kv_cache_spec_kind`) -> kmesh_trace.kv_groups kinds.
SPEC_KINDS = {
    "full_attention": "full_attention",
    "sink_full_attention": "full_attention",
    "mla_attention": "mla",
    "sliding_window": "sliding_window",
    "sliding_window_mla": "sliding_window",
    "chunked_local_attention": "chunked_local",
    "mamba": "mamba",
}
#: Engine versions whose removal semantics were read off their sources: every BlockRemoved is one
#: physical copy leaving its tier (a hash held by two blocks is removed twice).
EACH_COPY_VERSIONS = {"vllm": ((0, 0), (0, 33))}


def removal_semantics(fmt: str | None, engine: str | None) -> str:
    """`each_copy` when the publisher's engine and version are ones whose sources say so, else `unknown`."""
    name, _, version = (engine or "").partition(" ")
    bounds = EACH_COPY_VERSIONS.get(name or (fmt or "").split("-")[0])
    try:
        v = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return "unknown"
    return "each_copy" if bounds is not None and len(v) == 2 and bounds[0] <= v <= bounds[1] else "unknown"


def decode_frames(frames: list[bytes]) -> Frame:
    """A multipart message `(topic, seq, payload)` (or a replay reply) -> Frame; never raises."""
    if len(frames) != 3:
        return Frame(None, error=f"a message has {len(frames)} frames, not 3 (topic, seq, payload)")
    _, seq_bytes, payload = frames
    if len(seq_bytes) != 8:
        return Frame(None, error=f"the sequence frame has {len(seq_bytes)} bytes, not 8")
    seq = int.from_bytes(seq_bytes, "big", signed=True)
    if seq == END_SEQ:
        return Frame(seq, is_end=True)
    if seq < 0:
        return Frame(None, error=f"sequence number {seq} is negative")
    frame = _decode_batch(seq, payload)
    frame.digest = hash(payload)
    return frame


def _decode_batch(seq: int, payload: bytes) -> Frame:
    try:
        batch = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError, RecursionError) as e:
        return Frame(seq, error=f"the payload is not msgpack ({e})")
    if not isinstance(batch, (list, tuple)) or not 2 <= len(batch) <= 3:
        return Frame(seq, error="the payload is not a batch [ts, events, rank]")
    ts, raw_events = batch[0], batch[1]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not isinstance(raw_events, (list, tuple)):
        return Frame(seq, error="the payload is not a batch [ts, events, rank]")
    if not 0 <= ts <= _MAX_TS_S:  # NaN fails both comparisons
        return Frame(seq, error=f"the batch time {ts!r} is not a wall-clock time in seconds")
    try:
        rank = _opt_int(batch[2] if len(batch) == 3 else None, "rank")
    except (TypeError, ValueError) as e:
        return Frame(seq, error=f"the batch's rank is unusable ({e})")
    out = Frame(seq, float(ts), rank)
    formats = set()
    for raw in raw_events:
        try:
            ev, fmt = decode_event(raw)
        except (TypeError, ValueError, AttributeError) as e:
            out.num_bad_events += 1
            out.error = out.error or f"an event could not be read ({e})"
            continue
        out.events.append(ev)
        if fmt:
            formats.add(fmt)
    if len(formats) == 1:
        out.format = formats.pop()
    elif formats:
        out.error = out.error or f"one batch mixes event formats ({', '.join(sorted(formats))})"
    return out
