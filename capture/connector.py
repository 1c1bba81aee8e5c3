"""The proxy KV connector: wraps any vLLM KV connector, forwards every call, records each transfer.

Configure vLLM with
`kv_transfer_config={"kv_connector": "KmeshProxyConnector", "kv_connector_module_path":
"kmesh_trace.capture.connector", "kv_role": ..., "kv_connector_extra_config": {"inner": {<the inner
connector's own kv_transfer_config>}}}`. The inner connector is built exactly as vLLM would build
it from that inner configuration, and every method of the connector interface is forwarded to it
unchanged. Recording happens on the scheduler side, in the engine-core process, and only while a
capture is running there (otherwise the proxy is a pure pass-through):

- a *load* opens when the scheduler allocates blocks for externally matched tokens
  (`update_state_after_alloc`); a synchronous load completes with the engine step that ran it, an
  asynchronous one when the workers report it received (`finished_recving`), failed when reported
  in `failed_recving` or when one of its blocks is reported invalid;
- a *store* opens when the inner connector plans it: entries of its step metadata that carry a
  `req_id` and a `save_spec` (LMCache) or an `is_store` flag (vLLM's ExampleConnector, matched to
  the step's new requests by their first KV slot); it completes with the engine step, or, for a
  request whose blocks the connector keeps after finishing (`request_finished` returns True), when
  the workers report it sent (`finished_sending`).
- LMCache's multi-process connector (`LMCacheMPConnector`) says exactly what moves: each entry of its
  step metadata names a `request_id`, a `direction` and an `op` with the token range `[start, end)`.
  A STORE entry is one store of exactly that range (whole LMCache chunks; a request stores several
  over its steps), complete when the workers report the request sent, or when it finishes if the
  connector lets its blocks go at once; a RETRIEVE entry sets the size of the request's load to its
  range (what LMCache retrieves, whole chunks from the one holding the first token vLLM lacks). A
  request's finish is no store of its own there: LMCache stores only what its metadata planned.

Times are the scheduler's view: start when the transfer is handed to the workers, finish when its
completion reaches the scheduler. Transfers still open when the capture closes are `incomplete`, and
so is one that is opened again before it finished (the same request and direction). Per-request
state ends with the request (`request_finished`), so a long-running server's proxy stays bounded.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from typing import Any

from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
    supports_hma,
)

INNER_KEY = "inner"
# Connectors whose step metadata lists every transfer with its token range (`request_id`, `direction`, `op`).
RANGED_METADATA = ("LMCacheMPConnectorMetadata",)


def inner_config(vllm_config):
    """A shallow copy of `vllm_config` whose kv_transfer_config is the inner connector's."""
    ktc = vllm_config.kv_transfer_config
    inner = (ktc.kv_connector_extra_config or {}).get(INNER_KEY)
    if not isinstance(inner, dict) or not inner.get("kv_connector"):
        raise ValueError(
            "KmeshProxyConnector needs kv_connector_extra_config={'inner': {'kv_connector': <name>, ...}} "
            "naming the connector to wrap (with its own kv_role, module path and extra config)."
        )
    inner = dict(inner)
    inner.setdefault("kv_role", ktc.kv_role)
    inner.setdefault("engine_id", ktc.engine_id)
    temp = copy.copy(vllm_config)
    temp.kv_transfer_config = KVTransferConfig(**inner)
    return temp


def _bytes_per_block(kv_cache_config) -> int | None:
    if kv_cache_config is None or not getattr(kv_cache_config, "num_blocks", 0):
        return None
    total = sum(int(t.size) for t in getattr(kv_cache_config, "kv_cache_tensors", []) or [])
    return total // int(kv_cache_config.num_blocks) if total else None


class KmeshProxyConnector(KVConnectorBase_V1, SupportsHMA):
    """Forwards to the inner connector; records loads and stores into the running capture.

    vLLM asks a connector's class whether it supports the hybrid KV cache manager (`SupportsHMA`)
    before it builds one, and calls `request_finished_all_groups` on one that does, `request_finished`
    on one that does not. The proxy says yes, so that vLLM keeps its hybrid manager and calls an HMA
    inner connector exactly as it would unwrapped; a finished request reaches an inner connector
    without HMA through its own `request_finished` (what vLLM calls on it). Such an inner connector
    cannot serve more than one KV cache group: the proxy refuses that engine, as vLLM refuses it
    unwrapped once its hybrid manager is on (`--disable-hybrid-kv-cache-manager` turns it off)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        temp = inner_config(vllm_config)
        inner_cls = KVConnectorFactory.get_connector_class(temp.kv_transfer_config)
        self._inner_hma = supports_hma(inner_cls)
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        if not self._inner_hma and len(groups) > 1:
            raise ValueError(f"KmeshProxyConnector: the inner connector {inner_cls.__name__} does not support "
                             f"the hybrid KV cache manager, and this engine has {len(groups)} KV cache groups; "
                             "start it with --disable-hybrid-kv-cache-manager.")
        self._inner = inner_cls(temp, role, kv_cache_config)
        self._inner_name = type(self._inner).__name__
        self._block_size = int(vllm_config.cache_config.block_size)
        self._bytes_per_block = _bytes_per_block(kv_cache_config)
        self._mgr = None
        self._rec = None
        self._async_load: dict[str, bool] = {}
        # Open transfers: (request id, direction) -> [tokens, blocks, start_ns, block ids]
        self._open: dict[tuple[str, str], list] = {}
        self._step_batches: deque[list[tuple[str, str]]] = deque()
        self._step_sync: list[tuple[str, str]] = []
        self._ranged_metadata = False  # set by the first step metadata the inner connector builds

    # ---- the recorder ------------------------------------------------------------------------

    def _recorder(self):
        if self._rec is not None and self._rec.closed:  # the capture ended: a pure pass-through again
            self._rec = None
            self._mgr = None
        if self._rec is None and self._mgr is not None:
            from kmesh_trace.capture.hooks import recorder_of

            rec = recorder_of(self._mgr.block_pool)
            if rec is not None:
                self._rec = rec
                rec.on_step(self._on_step_done)
                rec.on_close(self._on_close)
        return self._rec

    def _open_transfer(self, request_id: str, direction: str, num_tokens: int, block_ids=(), sync=True,
                       part: int | None = None) -> None:
        if self._recorder() is None or num_tokens <= 0:
            return
        num_blocks = -(-num_tokens // self._block_size)
        # A request's stores over several steps (ranged metadata) are told apart by where they start.
        key = (request_id, direction) if part is None else (request_id, direction, part)
        if key in self._open:  # reopened (e.g. a load again after preemption): the first never finished
            self._close_transfer(key, "incomplete", None)
            self._forget_in_batches(key)
        self._open[key] = [num_tokens, num_blocks, time.monotonic_ns(), set(block_ids)]
        if sync:
            self._step_sync.append(key)

    def _close_transfer(self, key: tuple, status: str, finish_ns: int | None) -> None:
        t = self._open.pop(key, None)
        if t is None or self._rec is None:
            return
        num_tokens, num_blocks, start_ns, _ = t
        self._rec.record_transfer((
            key[0], key[1], num_tokens, num_blocks,
            num_blocks * self._bytes_per_block if self._bytes_per_block is not None else None,
            start_ns, finish_ns, status, self._inner_name,
        ))

    def _on_step_done(self) -> None:
        if self._step_batches:
            now = time.monotonic_ns()
            for key in self._step_batches.popleft():
                self._close_transfer(key, "ok", now)

    def _on_close(self) -> None:
        for key in list(self._open):
            self._close_transfer(key, "incomplete", None)

    # ---- scheduler side: recorded ------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._mgr = kv_cache_manager
        return self._inner.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        n, load_async = self._inner.get_num_new_matched_tokens(request, num_computed_tokens)
        if n:
            self._async_load[request.request_id] = bool(load_async)
        return n, load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        ret = self._inner.update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens > 0:
            load_async = self._async_load.pop(request.request_id, False)
            ids: list[int] = []
            try:  # only to mark the load failed if one of its blocks is later reported invalid
                ids = list(blocks.get_block_ids()[0])
            except (AttributeError, IndexError, TypeError):
                ids = []
            self._open_transfer(request.request_id, "load", num_external_tokens, ids, sync=not load_async)
        return ret

    def build_connector_meta(self, scheduler_output):
        meta = self._inner.build_connector_meta(scheduler_output)
        self._ranged_metadata = type(meta).__name__ in RANGED_METADATA
        if self._recorder() is not None:
            if self._ranged_metadata:
                self._record_ranged_entries(meta)
            else:
                self._record_planned_stores(meta, scheduler_output)
            self._step_batches.append(self._step_sync)
            self._step_sync = []
        return meta

    def _record_ranged_entries(self, meta) -> None:
        """LMCacheMPConnector's entries: a STORE is one store of its range, a RETRIEVE sizes the load."""
        for entry in getattr(meta, "requests", None) or ():
            rid, op = entry.request_id, entry.op
            num_tokens = int(op.end) - int(op.start)
            if entry.direction == "STORE":
                self._open_transfer(rid, "store", num_tokens, sync=False, part=int(op.start))
            elif entry.direction == "RETRIEVE":
                load = self._open.get((rid, "load"))
                if load is None:  # its allocation came before the capture: the range alone
                    self._open_transfer(rid, "load", num_tokens, sync=False)
                elif num_tokens > 0:
                    load[0], load[1] = num_tokens, -(-num_tokens // self._block_size)

    def _close_stores(self, request_id: str, now: int) -> None:
        for key in [k for k in self._open if k[0] == request_id and k[1] == "store"]:
            self._close_transfer(key, "ok", now)

    def _record_planned_stores(self, meta, scheduler_output) -> None:
        entries = getattr(meta, "requests", None)
        if not entries:
            return
        new_reqs = list(getattr(scheduler_output, "scheduled_new_reqs", []) or [])
        cursor = 0
        for entry in entries:
            rid = getattr(entry, "req_id", None)
            if rid is not None:  # LMCache-style entries name their request
                spec = getattr(entry, "save_spec", None)
                if spec is not None and getattr(spec, "can_save", False):
                    n = len(entry.token_ids) - int(getattr(spec, "skip_leading_tokens", 0))
                    self._open_transfer(rid, "store", n)
                continue
            if not hasattr(entry, "is_store"):
                continue
            # ExampleConnector-style entries follow the order of the step's new requests.
            slot = entry.slot_mapping
            first_slot = int(slot[0]) if len(slot) else None
            while cursor < len(new_reqs):
                nr = new_reqs[cursor]
                cursor += 1
                ids = nr.block_ids[0] if nr.block_ids else []
                if ids and first_slot is not None and ids[0] * self._block_size == first_slot:
                    if entry.is_store:
                        self._open_transfer(nr.req_id, "store", len(entry.token_ids))
                    break

    def update_connector_output(self, connector_output):
        ret = self._inner.update_connector_output(connector_output)
        if self._recorder() is not None:
            now = time.monotonic_ns()
            failed = set(getattr(connector_output, "failed_recving", ()) or ())
            invalid = set(getattr(connector_output, "invalid_block_ids", ()) or ())
            if invalid:
                for key, t in list(self._open.items()):
                    if key[1] == "load" and t[3] & invalid:
                        self._close_transfer(key, "failed", now)
                        self._forget_in_batches(key)
            for rid in connector_output.finished_recving or ():
                self._close_transfer((rid, "load"), "failed" if rid in failed else "ok", now)
            for rid in failed:
                self._close_transfer((rid, "load"), "failed", now)
            for rid in connector_output.finished_sending or ():
                self._close_stores(rid, now)
        return ret

    def _forget_in_batches(self, key) -> None:
        for batch in (*self._step_batches, self._step_sync):
            if key in batch:
                batch.remove(key)

    def request_finished_all_groups(self, request, block_ids):
        if self._inner_hma:
            return self._finished(request, self._inner.request_finished_all_groups(request, block_ids),
                                  max((len(b) for b in block_ids), default=0))
        return self.request_finished(request, block_ids[0])

    def request_finished(self, request, block_ids):
        return self._finished(request, self._inner.request_finished(request, block_ids), len(block_ids))

    def _finished(self, request, ret, num_blocks: int):
        delay, params = ret
        # A request matched but never allocated (aborted, or finished first) ends here too.
        self._async_load.pop(request.request_id, None)
        if self._ranged_metadata:  # its stores are those the metadata planned, none at the finish
            if not delay and self._recorder() is not None:
                self._close_stores(request.request_id, time.monotonic_ns())
        elif delay and self._recorder() is not None and (request.request_id, "store") not in self._open:
            self._open_transfer(request.request_id, "store", num_blocks * self._block_size, sync=False)
        return delay, params

    # ---- everything else: forwarded ----------------------------------------------------------

    @property
    def inner(self) -> KVConnectorBase_V1:
        return self._inner

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self._inner.supports_divergent_local_hybrid_hits

    @property
    def requires_kv_delivery(self) -> bool:
        return self._inner.requires_kv_delivery

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes the proxy lacks (methods some inner connectors add).
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        temp = inner_config(vllm_config)
        return KVConnectorFactory.get_connector_class(temp.kv_transfer_config).get_required_kvcache_layout(temp)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        inner = (extra_config or {}).get(INNER_KEY) or {}
        if not inner.get("kv_connector"):
            return False
        inner_cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**inner))
        return inner_cls.requires_piecewise_for_cudagraph(inner.get("kv_connector_extra_config") or {})


def _forwarder(name: str):
    def method(self, *args, **kwargs):
        return getattr(self._inner, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"Forwarded unchanged to the inner connector's `{name}`."
    return method


# Every other instance method of the connector interface goes straight to the inner connector, so
# the base class's defaults never answer in its place.
for _name, _member in vars(KVConnectorBase_V1).items():
    if (callable(_member) and not _name.startswith("__") and not isinstance(_member, (classmethod, staticmethod))
            and _name not in vars(KmeshProxyConnector)):
        setattr(KmeshProxyConnector, _name, _forwarder(_name))
KmeshProxyConnector.__abstractmethods__ = frozenset()
