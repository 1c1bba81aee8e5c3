"""LMCache in multi-process mode, shared by vLLM engines: what it stores, what each engine loads, the external hits.

The model of LMCache 0.5.6's server (`lmcache server`, engine-driven transfers) behind vLLM's
`LMCacheMPConnector`, one server for every engine given, replayed one request at a time in arrival order
across the engines (wall-clock order where the captures anchor their clocks). Its rules, from the
connector's scheduler side (`lmcache/integration/vllm/lmcache_mp_connector.py`, `lmcache_mp_metadata.py`):

- **Chunks**: `chunk_size` tokens (a multiple of the engines' block size), keyed by the whole prefix up to
  the chunk's end, so equal keys mean an equal whole prefix; only whole chunks of the prompt are kept
  (`save_decode_cache` off, LMCache's default: generated tokens are never stored).
- **Local hits**: each engine's own prefix cache is the `vllm` pool model of that engine alone (a block
  loaded from LMCache is cached in the pool as if computed); `local` is its hit in tokens.
- **Lookup**: the longest run of the prompt's leading chunks that LMCache holds (L1 or the fs tier): `hit`
  tokens. The engine loads `hit - local` tokens when that is positive, one fewer when `hit` is the whole
  prompt (vLLM computes the last token): its *external hits* (`vllm:external_prefix_cache_hits_total`).
- **Retrieve**: with a load, LMCache retrieves the chunks from the one holding the first token vLLM lacks
  to `hit`: `[local // chunk_size * chunk_size, hit)`, one retrieve per request.
- **Store**: the prompt's whole chunks from `hit` on, one store per request (its prefill in one step):
  LMCache counts from its own hit, so chunks vLLM's prefix cache served are stored again when LMCache
  lacks them.
- **L1**: an LRU over chunks of `l1_size_gb` GiB (chunk bytes = chunk_size x the KV bytes per token);
  a lookup's hits are refreshed, a store appends. **fs** (`fs=DIR`): every stored chunk is written there
  too and stays (one file per chunk); a chunk found only there comes back into L1.

What the model does not have: LMCache's asynchronous lookups and stores (with requests in flight, a
lookup can run before an earlier request's store has landed: the model, sequential, sees the store),
chunked prefills (several stores for one request) and the L1 allocator's overhead per object.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.blockpool import simulate_pool
from kmesh_trace.oracle.lru_store import LruStore
from kmesh_trace.oracle.stream import RequestBlocks

__all__ = ["LMCacheSpec", "EngineStream", "EngineOutcome", "LMCacheOutcome", "parse_lmcache_spec",
           "simulate_lmcache"]

EVICTION_POLICIES = ("LRU",)


@dataclass(frozen=True)
class LMCacheSpec:
    """An LMCache server's configuration as `lmcache server` takes it (--chunk-size, --l1-size-gb,
    --eviction-policy, an fs --l2-adapter's base_path)."""

    chunk_size: int = 256
    l1_size_gb: float = 1.0
    eviction_policy: str = "LRU"
    fs: str | None = None

    def to_dict(self) -> dict:
        return {"chunk_size": self.chunk_size, "l1_size_gb": self.l1_size_gb,
                "eviction_policy": self.eviction_policy, "fs": self.fs}


def parse_lmcache_spec(text: str) -> LMCacheSpec:
    """`chunk_size=256,l1_size_gb=1,eviction_policy=LRU,fs=DIR` (each optional) as an LMCacheSpec."""
    values: dict = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in ("chunk_size", "l1_size_gb", "eviction_policy", "fs"):
            raise KmeshTraceError(f"--lmcache takes chunk_size=, l1_size_gb=, eviction_policy= and fs= items, "
                                  f"comma-separated (got {item!r}).")
        values[key] = value
    try:
        spec = LMCacheSpec(int(values.get("chunk_size", 256)), float(values.get("l1_size_gb", 1.0)),
                           values.get("eviction_policy", "LRU"), values.get("fs") or None)
    except ValueError:
        raise KmeshTraceError(f"--lmcache: chunk_size must be a whole number of tokens and l1_size_gb a number "
                              f"(got {text!r}).") from None
    if spec.chunk_size <= 0 or not spec.l1_size_gb > 0:
        raise KmeshTraceError("--lmcache: chunk_size and l1_size_gb must be positive.")
    if spec.eviction_policy not in EVICTION_POLICIES:
        raise KmeshTraceError(f"--lmcache: the model has LMCache's {', '.join(EVICTION_POLICIES)} eviction only "
                              f"(got {spec.eviction_policy!r}).")
    return spec


@dataclass
class EngineStream:
    """One engine's requests (arrival order), its pool, and the offset that puts its arrivals on the shared clock."""

    name: str
    requests: list[RequestBlocks]
    block_size: int
    num_usable_blocks: int
    clock_offset_ns: int = 0


@dataclass
class EngineOutcome:
    """What the model gives one engine: its stores and loads (count, tokens) and hits (tokens)."""

    name: str
    num_stores: int = 0
    stored_tokens: int = 0
    num_loads: int = 0
    loaded_tokens: int = 0
    external_hit_tokens: int = 0
    local_hit_tokens: int = 0

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "name"}


@dataclass
class LMCacheOutcome:
    """The model's result: per engine (in the order given), and the server's L1 and fs tier."""

    engines: list[EngineOutcome]
    l1_capacity_chunks: int
    l1_evictions: int = 0
    fs_chunks: int = 0
    stores: list[tuple[str, int]] = field(default_factory=list)  # (engine, tokens) in store order
    retrieves: list[tuple[str, int]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"l1_capacity_chunks": self.l1_capacity_chunks, "l1_evictions": self.l1_evictions,
                "fs_chunks": self.fs_chunks, "stored_tokens": [n for _, n in self.stores],
                "retrieved_tokens": [n for _, n in self.retrieves]}


class _Server:
    """LMCache's chunks: an L1 LRU of `capacity` chunks and, with an fs tier, the set of chunks written there."""

    def __init__(self, capacity: int, fs: bool, chunk_size: int, blocks_per_chunk: int):
        self.l1, self.capacity = LruStore(), capacity
        self.chunk_size, self.blocks_per_chunk = chunk_size, blocks_per_chunk
        self.fs: set | None = set() if fs else None
        self.evictions = 0

    def prefix(self, keys: list) -> int:
        """How many leading `keys` the server holds, each refreshed (one found only in fs comes back to L1)."""
        n = 0
        for k in keys:
            if k in self.l1:
                self.l1.touch(k)
            elif self.fs is not None and k in self.fs:
                self._put([k])
            else:
                break
            n += 1
        return n

    def store(self, keys: list) -> None:
        self._put(keys)
        if self.fs is not None:
            self.fs.update(keys)

    def _put(self, keys: list) -> None:
        left, _ = self.l1.put(keys, self.capacity)
        self.evictions += len(left)


def _chunk_keys(r: RequestBlocks, blocks_per_chunk: int) -> list:
    """The keys of the prompt's whole chunks: the chained hash of each chunk's last block."""
    return r.prompt_hashes[blocks_per_chunk - 1::blocks_per_chunk]


def simulate_lmcache(engines: list[EngineStream], spec: LMCacheSpec, kv_bytes_per_token: int) -> LMCacheOutcome:
    """The requests of `engines` through one LMCache server configured by `spec` (module docstring)."""
    block_sizes = {e.block_size for e in engines}
    if len(block_sizes) != 1:
        raise KmeshTraceError(f"the engines sharing LMCache have different block sizes ({sorted(block_sizes)}); "
                              "the model needs one.")
    (bs,) = block_sizes
    if spec.chunk_size % bs:
        raise KmeshTraceError(f"--lmcache chunk_size ({spec.chunk_size}) must be a multiple of the block size ({bs}).")
    chunk_bytes = spec.chunk_size * kv_bytes_per_token
    capacity = int(spec.l1_size_gb * (1 << 30)) // chunk_bytes
    if capacity <= 0:
        raise KmeshTraceError(f"--lmcache l1_size_gb {spec.l1_size_gb} holds no chunk of {chunk_bytes:,} bytes.")
    server = _Server(capacity, spec.fs is not None, spec.chunk_size, spec.chunk_size // bs)
    out = LMCacheOutcome([EngineOutcome(e.name) for e in engines], capacity)
    for k, r, local in _arrivals(engines):
        _replay_request(r, local, server, out.engines[k], out)
    out.l1_evictions = server.evictions
    out.fs_chunks = len(server.fs) if server.fs is not None else 0
    return out


def _arrivals(engines: list[EngineStream]) -> list[tuple[int, RequestBlocks, int]]:
    """(engine index, request, its local hit tokens) in arrival order on the shared clock (engine, then
    arrival order, for requests without a time)."""
    rows = []
    for k, e in enumerate(engines):
        pool = simulate_pool(e.requests, block_size=e.block_size, num_usable_blocks=e.num_usable_blocks, timed=False)
        for r, local in zip(e.requests, pool.hit_tokens):
            at = None if r.arrival_ns is None else r.arrival_ns + e.clock_offset_ns
            rows.append(((at is None, at or 0, k, r.index), k, r, local))
    rows.sort(key=lambda row: row[0])
    return [row[1:] for row in rows]


def _replay_request(r: RequestBlocks, local: int, server: _Server, engine: EngineOutcome,
                    out: LMCacheOutcome) -> None:
    """One request's lookup, load and store (module docstring), counted on its engine and the server."""
    chunk = server.chunk_size
    keys = _chunk_keys(r, server.blocks_per_chunk)
    hit = server.prefix(keys) * chunk
    need = max(0, hit - local)
    if hit and hit == r.num_prompt_tokens:
        need = max(0, need - 1)
    engine.local_hit_tokens += local
    if need > 0:
        retrieved = hit - local // chunk * chunk
        engine.num_loads += 1
        engine.loaded_tokens += retrieved
        engine.external_hit_tokens += need
        out.retrieves.append((engine.name, retrieved))
    new = keys[hit // chunk:]
    if new:
        server.store(new)
        engine.num_stores += 1
        engine.stored_tokens += len(new) * chunk
        out.stores.append((engine.name, len(new) * chunk))
