"""KV cache groups: the one description of a hybrid model's caches that captures, recordings and the
pool model share.

vLLM gives every kind of attention layer (full attention, sliding window W, chunked local attention,
Mamba state, MLA) a KV cache group of its own: each group keeps a block table per request, and all
groups draw equal-sized pages from one shared block pool. A prefix hit is the longest prefix that
every group can serve. A trace states its groups in the engine metadata field `kv_cache_groups` (a
list, one entry per group, in vLLM's group order: `block_events.kv_group` is an index into it); a
trace without the field has one full-attention group of the partition's `block_size` (every trace
written before hybrid models were captured).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kmesh_trace.errors import KmeshTraceError

#: Group kinds, as vLLM's KV cache spec classes map onto them (see `kind_of_spec`).
FULL = "full_attention"
SLIDING_WINDOW = "sliding_window"
CHUNKED_LOCAL = "chunked_local"
MAMBA = "mamba"
MLA = "mla"
KINDS = (FULL, SLIDING_WINDOW, CHUNKED_LOCAL, MAMBA, MLA)

#: vLLM spec class name -> group kind (subclasses are matched by their own name first).
_SPEC_KINDS = {
    "FullAttentionSpec": FULL,
    "SlidingWindowSpec": SLIDING_WINDOW,
    "ChunkedLocalAttentionSpec": CHUNKED_LOCAL,
    "MambaSpec": MAMBA,
    "MLAAttentionSpec": MLA,
}


@dataclass(frozen=True)
class KVCacheGroup:
    """One KV cache group: what kind of layers it serves and how much of a prefix it keeps.

    `block_size` is tokens per block of this group; `page_size_bytes` one block of one layer;
    `sliding_window` (sliding-window groups) and `attention_chunk_size` (chunked local) are in tokens.
    """

    kind: str
    block_size: int
    num_layers: int | None = None
    page_size_bytes: int | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise KmeshTraceError(f"unknown KV cache group kind {self.kind!r}; expected one of {', '.join(KINDS)}.")
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 1:
            raise KmeshTraceError(f"a KV cache group's block_size must be a positive integer, not {self.block_size!r}.")
        for name in ("num_layers", "page_size_bytes", "sliding_window", "attention_chunk_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1 or v >= 1 << 62):
                raise KmeshTraceError(f"a KV cache group's {name} must be a positive integer, not {v!r}.")
        if self.kind == SLIDING_WINDOW and self.sliding_window is None:
            raise KmeshTraceError("a sliding_window KV cache group needs its sliding_window (tokens).")
        if self.kind == CHUNKED_LOCAL and self.attention_chunk_size is None:
            raise KmeshTraceError("a chunked_local KV cache group needs its attention_chunk_size (tokens).")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def kv_bytes_per_token(self) -> float | None:
        """Bytes one token occupies in this group across its layers; None when not known."""
        if self.page_size_bytes is None or self.num_layers is None:
            return None
        return self.page_size_bytes * self.num_layers / self.block_size


def full_attention(block_size: int) -> tuple[KVCacheGroup, ...]:
    """The groups of a trace that states none: one full-attention group."""
    return (KVCacheGroup(FULL, block_size),)


def groups_from_metadata(meta: dict) -> tuple[KVCacheGroup, ...]:
    """The partition's KV cache groups: its `kv_cache_groups`, else one full-attention group of `block_size`."""
    raw = meta.get("kv_cache_groups")
    if not raw:
        bs = meta.get("block_size")
        return full_attention(int(bs)) if bs else ()
    if not isinstance(raw, list):
        raise KmeshTraceError("the engine metadata's kv_cache_groups must be a list of groups.")
    out = []
    for i, g in enumerate(raw):
        if not isinstance(g, dict):
            raise KmeshTraceError(f"kv_cache_groups[{i}] in the engine metadata is not an object.")
        known = {k: g.get(k) for k in KVCacheGroup.__dataclass_fields__}
        try:
            out.append(KVCacheGroup(**known))
        except KmeshTraceError as e:
            raise KmeshTraceError(f"kv_cache_groups[{i}] in the engine metadata: {e}") from None
    _check_block_sizes(out, meta.get("block_size"))
    return tuple(out)


def _check_block_sizes(groups: list[KVCacheGroup], block_size: Any) -> None:
    """Every attention group has the partition's block size: block_events and hits count in those blocks, and a
    group of other blocks would be modelled at the wrong size (Mamba groups keep their own, state blocks)."""
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        return
    for i, g in enumerate(groups):
        if g.kind != MAMBA and g.block_size != block_size:
            raise KmeshTraceError(f"kv_cache_groups[{i}] in the engine metadata has blocks of {g.block_size} tokens "
                                  f"but the partition's block_size is {block_size}; the pool model takes one block "
                                  "size for every attention group.")


def is_hybrid(groups: tuple[KVCacheGroup, ...]) -> bool:
    """True when the model has more than one group or a group that is not plain full attention."""
    return len(groups) > 1 or any(g.kind not in (FULL, MLA) for g in groups)


def kind_of_spec(spec: Any) -> str | None:
    """The group kind of a vLLM KV cache spec object (by its class, or the nearest base vLLM names); None if unknown."""
    for cls in type(spec).__mro__:
        if cls.__name__ in _SPEC_KINDS:
            return _SPEC_KINDS[cls.__name__]
    return None


def group_of_vllm(group: Any) -> KVCacheGroup | None:
    """A vLLM `KVCacheGroupSpec` (layer_names + kv_cache_spec) as a KVCacheGroup; None for a kind not modelled."""
    spec = group.kv_cache_spec
    kind = kind_of_spec(spec)
    if kind is None:
        return None
    return KVCacheGroup(
        kind=kind,
        block_size=int(spec.block_size),
        num_layers=len(group.layer_names) or None,
        page_size_bytes=int(spec.page_size_bytes) or None,
        sliding_window=int(spec.sliding_window) if kind == SLIDING_WINDOW else None,
        attention_chunk_size=int(spec.attention_chunk_size) if kind == CHUNKED_LOCAL else None,
    )


def num_skipped_tokens(group: KVCacheGroup, num_computed_tokens: int) -> int:
    """Leading tokens of a request's first `num_computed_tokens` that `group` no longer needs (vLLM's
    `get_num_skipped_tokens`): none for full attention and MLA; those before the window (sliding
    window W: all but the last W - 1); those before the current chunk (chunked local); all but the last
    (Mamba, whose state after the last token is all it needs)."""
    if group.kind == MAMBA:
        return max(0, num_computed_tokens - 1)
    if group.kind == SLIDING_WINDOW:
        return max(0, num_computed_tokens - group.sliding_window + 1)
    if group.kind == CHUNKED_LOCAL:
        return num_computed_tokens // group.attention_chunk_size * group.attention_chunk_size
    return 0


def touched_blocks_of_hit(group: KVCacheGroup, num_hit_tokens: int) -> int | None:
    """Blocks of `group` a prefix hit of `num_hit_tokens` touches (vLLM's `add_local_computed_blocks`:
    the hit's blocks but those skipped, which become the null block); None for Mamba, whose state
    blocks vLLM keeps by its own rule."""
    if group.kind == MAMBA:
        return None
    return num_hit_tokens // group.block_size - num_skipped_tokens(group, num_hit_tokens) // group.block_size

def describe(groups) -> str:
    """`full_attention x2 + sliding_window(128)`: a hybrid layout in a few words."""
    parts: dict[str, int] = {}
    for g in groups:
        name = g.kind + (f"({g.sliding_window})" if g.kind == SLIDING_WINDOW else
                         f"({g.attention_chunk_size})" if g.kind == CHUNKED_LOCAL else "")
        parts[name] = parts.get(name, 0) + 1
    return " + ".join(k if n == 1 else f"{k} x{n}" for k, n in parts.items())


def refuse_hybrid(groups, analysis: str) -> None:
    """Refuse, in one sentence, an analysis that models one full-attention group, on a hybrid engine's trace."""
    if groups and is_hybrid(tuple(groups)):
        raise KmeshTraceError(f"{analysis} models one full-attention KV cache group and this engine has "
                              f"{describe(groups)}; on a hybrid trace, headroom and fleet run.")


def retention_of_metadata(meta: dict) -> int | None:
    """The engine metadata's `prefix_cache_retention_interval` as the model takes it: absent 0 (vLLM's
    default), -1 None (every block)."""
    v = meta.get("prefix_cache_retention_interval")
    return 0 if v is None else None if v == -1 else int(v)
