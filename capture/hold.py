"""The family hold controller: docs/DESIGN.md's family hold applied inside a live vLLM engine (opt-in).

Off unless `KMESH_HOLD=1` (caps: `KMESH_HOLD_MAX_BLOCKS`, `KMESH_HOLD_MAX_FAMILIES`; expiry:
`KMESH_HOLD_EXPIRY_S`). Families come from the declared lineage in `SamplingParams.extra_args`: a
request declaring `kmesh_children` = N > 0 is a parent; a request whose `kmesh_parent` names it (by
the caller's id, as for capture) is one of its children. The semantics are those of the `vllm`
block-pool model's holds (`kmesh_trace.oracle.blockpool`), so `kmesh_trace.oracle.pressure.what_if`
predicts a held run:

- when a parent finishes, before its own references are freed, the controller takes one extra
  reference (`BlockPool.touch`) on each of its full, cached blocks (a partial tail cannot be held);
  nothing is copied;
- the hold is released (`BlockPool.free_blocks`, tail first, so the blocks join the LRU end like any
  freed cached block) once the parent's expected children have been admitted (counted when a child's
  first `allocate_slots` succeeds, i.e. after its prefix lookup touched the held blocks), at expiry
  (checked at each request arrival, oldest hold first), when an expected child is aborted before
  admission (`cancelled`), under pressure (an allocation that would fail releases the oldest holds
  first: a hold never blocks an admission) and at engine close;
- a hold that would exceed the caps (held block references, families with an active hold) is refused,
  and so is one for a parent whose caller id already has an active hold (`refused_duplicate`:
  children name their parent by that id, so a second hold could never be told apart).

With a capture running, every reference the controller takes or drops is recorded as a `held` or
`released` block event for the parent's request id. `HoldController.records` keeps one record per
parent (status, blocks, children served, release reason) for callers and tests.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from kmesh_trace.capture.attach import Attachments
from kmesh_trace.capture.env import hold_enabled  # noqa: F401 (re-exported)
from kmesh_trace.capture.hooks import recorder_of
from kmesh_trace.capture.rows import caller_id_of, declared
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.holds import hold_status
from kmesh_trace.lineage import ParentResolver, names_of

log = logging.getLogger("kmesh_trace.capture")

MAX_RECORDS = 4096  # hold records kept (num_by_status counts them all)
MAX_EARLY_PARENTS = 65536  # parents with children admitted before they finished, remembered at most


@dataclass(frozen=True)
class HoldConfig:
    max_held_blocks: int | None = None
    max_families: int | None = None
    expiry_s: float | None = None

    @classmethod
    def from_env(cls) -> HoldConfig:
        """From `KMESH_HOLD_*` (checked like the capture's knobs: KmeshTraceError names a bad one)."""
        from kmesh_trace.capture.config import hold_config_from_env

        return cls(**hold_config_from_env())


@dataclass
class LiveHold:
    """One parent's hold. status: taken, refused_blocks, refused_families, refused_duplicate (a hold
    under the same caller id is still active: caller ids are the key children name), empty,
    not_needed, cancelled. `HoldController.num_by_status` counts every status."""

    parent_request_id: str
    caller_id: str | None
    family: str
    status: str
    num_blocks: int = 0
    num_children_served: int = 0
    release_reason: str | None = None  # children, expiry, cancelled, pressure or close
    taken_ns: int | None = None
    released_ns: int | None = None


class _Hold:
    __slots__ = ("blocks", "record", "remaining")

    def __init__(self, record: LiveHold, blocks: list, remaining: int):
        self.record, self.blocks, self.remaining = record, blocks, remaining


class HoldController:
    """Holds family ancestors in one engine's block pool. Created by `install(scheduler)`."""

    def __init__(self, scheduler, config: HoldConfig | None = None):
        self.config = config or HoldConfig.from_env()
        self.scheduler = scheduler
        self.mgr = scheduler.kv_cache_manager
        self.pool = self.mgr.block_pool
        self.active: OrderedDict[str, _Hold] = OrderedDict()  # parent caller key -> hold, oldest first
        # Bounded for long-running servers: the latest records, and counts of every outcome.
        self.records: deque[LiveHold] = deque(maxlen=MAX_RECORDS)
        self.num_by_status: Counter[str] = Counter()
        self.num_held_refs = 0
        self.family_refs: dict[str, int] = {}
        self.children_admitted: OrderedDict[str, int] = OrderedDict()  # declared name -> early child admissions
        self.names = ParentResolver()  # every name of a held parent -> its request id (the lineage table's rule)
        self.key_of: dict[str, str] = {}  # held parent's request id -> its key in `active`
        self.closed = False
        self.attachments = Attachments()

    # ---- the recorder (optional) -------------------------------------------------------------

    def _pool_op(self, op, blocks: list, event: str, request_id: str) -> None:
        """`op(blocks)`; with a capture running, its pool events are recorded as `event` for the parent."""
        rec = recorder_of(self.pool)
        if rec is None:
            op(blocks)
        else:
            rec.act_as(event, request_id, op, blocks)

    # ---- taking and releasing ----------------------------------------------------------------

    @staticmethod
    def parent_key(request) -> str:
        return caller_id_of(request) or request.request_id

    def _lookup(self, declared: Any) -> str | None:
        """The active hold's key a child's declared parent names (response id, client id, caller id or
        engine id: `kmesh_trace.lineage`), else the declared name itself (its parent has no hold yet)."""
        if declared is None:
            return None
        rid = self.names.resolve(declared)
        return self.key_of[rid] if rid is not None else str(declared)

    def take(self, request) -> None:
        """The parent finished: hold its full cached blocks before its own references are freed."""
        family, _, expected = declared(request)
        if not expected or expected <= 0:
            return
        key = self.parent_key(request)
        family = family if family is not None else f"parent-{key}"
        blocks = []
        for b in self.mgr.coordinator.single_type_managers[0].req_to_blocks.get(request.request_id, ()):
            if b.is_null or b.block_hash is None:
                break
            blocks.append(b)
        exact, derived = names_of(request.request_id, caller_id_of(request))
        # Children admitted before the parent finished, under any of its names.
        early = sum(self.children_admitted.pop(n, 0) for n in exact + derived)
        remaining = expected - early
        rec = LiveHold(request.request_id, key, family, "taken", len(blocks))
        self.records.append(rec)
        cfg = self.config
        if request.status.name in ("FINISHED_ABORTED", "FINISHED_ERROR"):
            rec.status = "cancelled"
        else:
            rec.status = hold_status(remaining_children=remaining, num_blocks=len(blocks),
                                     num_held_refs=self.num_held_refs, max_held_blocks=cfg.max_held_blocks,
                                     family=family, family_refs=self.family_refs, max_families=cfg.max_families)
        if rec.status == "taken" and key in self.active:
            rec.status = "refused_duplicate"
        self.num_by_status[rec.status] += 1
        if rec.status != "taken":
            return
        rec.taken_ns = time.monotonic_ns()
        self._pool_op(self.pool.touch, blocks, "held", request.request_id)
        self.active[key] = _Hold(rec, blocks, remaining)
        self.names.add(request.request_id, caller_id_of(request))
        self.key_of[request.request_id] = key
        self.num_held_refs += len(blocks)
        self.family_refs[family] = self.family_refs.get(family, 0) + 1

    def release(self, key: str, reason: str) -> None:
        h = self.active.pop(key)
        self.names.remove(h.record.parent_request_id)
        self.key_of.pop(h.record.parent_request_id, None)
        h.record.release_reason = reason
        h.record.released_ns = time.monotonic_ns()
        self.num_held_refs -= len(h.blocks)
        n = self.family_refs[h.record.family] - 1
        if n:
            self.family_refs[h.record.family] = n
        else:
            del self.family_refs[h.record.family]
        self._pool_op(self.pool.free_blocks, h.blocks[::-1], "released", h.record.parent_request_id)

    def child_admitted(self, request) -> None:
        key = self._lookup(declared(request)[1])
        if key is None:
            return
        h = self.active.get(key)
        if h is None:
            self.children_admitted[key] = self.children_admitted.get(key, 0) + 1
            if len(self.children_admitted) > MAX_EARLY_PARENTS:
                self.children_admitted.popitem(last=False)
            return
        h.record.num_children_served += 1
        h.remaining -= 1
        if h.remaining <= 0:
            self.release(key, "children")

    def child_cancelled(self, request) -> None:
        key = self._lookup(declared(request)[1])
        h = self.active.get(key) if key is not None else None
        if h is not None:
            h.remaining -= 1
            if h.remaining <= 0:
                self.release(key, "cancelled")

    def expire(self, now_ns: int) -> None:
        if self.config.expiry_s is None:
            return
        limit = int(self.config.expiry_s * 1e9)
        while self.active:
            key, h = next(iter(self.active.items()))
            if h.record.taken_ns + limit > now_ns:
                break
            self.release(key, "expiry")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for key in list(self.active):
            self.release(key, "close")

    # ---- the wrappers ------------------------------------------------------------------------

    def install(self) -> HoldController:
        sched, mgr = self.scheduler, self.mgr
        orig_add = sched.add_request
        orig_free_request = sched._free_request
        orig_shutdown = sched.shutdown
        orig_allocate = mgr.allocate_slots
        orig_free = mgr.free

        def add_request(request):
            if not self.closed:
                self.expire(time.monotonic_ns())  # a request boundary
            return orig_add(request)

        def allocate_slots(request, *args, **kwargs):
            ret = orig_allocate(request, *args, **kwargs)
            while ret is None and self.active:  # a hold never blocks an allocation
                self.release(next(iter(self.active)), "pressure")
                ret = orig_allocate(request, *args, **kwargs)
            if ret is not None and not getattr(request, "_kmesh_hold_admitted", False):
                request._kmesh_hold_admitted = True
                if declared(request)[1] is not None:
                    self.child_admitted(request)
            return ret

        def free(request):
            if request.is_finished() and not self.closed:
                self.take(request)
            return orig_free(request)

        def _free_request(request, *args, **kwargs):
            if (not getattr(request, "_kmesh_hold_admitted", False)
                    and declared(request)[1] is not None):
                self.child_cancelled(request)
            return orig_free_request(request, *args, **kwargs)

        def shutdown():
            self.close()
            self.attachments.detach()  # the engine calls what lies below again (the capture's, or vLLM's)
            return orig_shutdown()

        self.attachments.attach(sched, {"add_request": add_request, "_free_request": _free_request,
                                        "shutdown": shutdown})
        self.attachments.attach(mgr, {"allocate_slots": allocate_slots, "free": free})
        sched._kmesh_hold = self
        rec = recorder_of(self.pool)
        if rec is not None:  # a capture taken with holds on says so in its metadata
            rec.record_config("hold", dict(self.config.__dict__))
        log.info("kmesh-trace: family hold controller on (%s)", self.config)
        return self


def install(scheduler, config: HoldConfig | None = None) -> HoldController:
    """Start holding family ancestors in `scheduler`'s engine; install after the capture hooks.

    A hybrid model (more than one KV cache group) is refused: a hold keeps one group's blocks, and a
    prefix hit needs every group's."""
    groups = getattr(getattr(scheduler, "kv_cache_config", None), "kv_cache_groups", None) or ()
    if len(groups) > 1:
        raise KmeshTraceError(f"the family hold controller holds one KV cache group's blocks, and this engine has "
                              f"{len(groups)} (a hybrid model).")
    return HoldController(scheduler, config).install()
