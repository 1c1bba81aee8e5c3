"""Native replay GPU routes; skipped on hosts without a CUDA device (CI). Run on the lent H200.

`host_fixed` end to end (every byte read back from the GPU arena and verified, corruptions rejected,
the consumer's sum equal to the verified bytes' sum, every buffer returned); `cufile` and
`dmabuf_fixed` probed: each either works or names the precondition that failed.
"""

from __future__ import annotations

import ctypes.util
import json

import pytest

if ctypes.util.find_library("cuda") is None:  # decide before importing PyTorch (seconds on a CPU host)
    pytest.skip("needs an NVIDIA driver and a CUDA device (runs on the GPU host)", allow_module_level=True)

from kmesh_trace.native import store as st
from kmesh_trace.native.routes import probe_route
from kmesh_trace.native.runner import RunConfig, run
from replay_support import ddir  # noqa: F401  (the O_DIRECT directory fixture; tests/ is on sys.path)

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU host)")


def test_host_fixed_end_to_end(ddir):  # noqa: F811
    st.prepare(ddir / "s", st.plan_uniform(2, 4, 256 * 1024), seed=5)
    cfg = RunConfig(routes=["host", "host_fixed"], pairs=2, restores=4, warmup=1, corrupt=1)
    sm = run(ddir / "s", cfg, out=ddir / "res").summary
    f = sm["routes"]["host_fixed"]
    assert (f["num_measured"], f["num_warmup"], f["num_rejected"], f["consumer_mismatches"]) == (4, 2, 1, 0)
    assert f["timer2"]["p50_ms"] >= f["timer1"]["p50_ms"] > 0
    assert f["ownership"]["drained"] and f["ownership"]["num_acquired"] == (4 + 2 + 1) * 4
    assert sm["ok"] and (sm["corruptions_rejected"], sm["corruption_checks"]) == (2, 2)  # one per route
    assert [(p["pair"], p["route"], p["position"]) for p in sm["pairs"]] == [
        (0, "host", 0), (1, "host", 1), (0, "host_fixed", 1), (1, "host_fixed", 0)]


@pytest.mark.parametrize("route", ["cufile", "dmabuf_fixed"])
def test_probe_names_a_result_for_every_step(ddir, route):  # noqa: F811
    p = probe_route(route, ddir)
    d = p.as_dict()
    print(json.dumps(d, indent=1))  # kept in the H200 log
    assert d["status"] == ("ok" if p.ok else "unavailable")
    assert p.ok or d["reason"] == next(f"{s['step']}: {s['detail']}" for s in d["steps"] if not s["ok"])
