"""vLLM's OpenAI server (the tiny model) started under the capture, publishing KV events, on 127.0.0.1."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
import pytest

from heartbeat import waiting


START_TIMEOUT_S = 300


KMESH = str(Path(sys.executable).with_name("kmesh-trace"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_captured_server(root: Path, model: Path, sock_dir: Path, num_gpu_blocks: int):
    """The OpenAI API server on the tiny model at `model`, under `kmesh-trace capture --out root/plugin`,
    publishing its KV events on ipc:// endpoints in `sock_dir`: (process, url, log file, tail of the log)."""
    port = _free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{sock_dir}/ev.sock",
              "replay_endpoint": f"ipc://{sock_dir}/replay.sock", "topic": "kv"}
    cmd = [KMESH, "capture", "--out", str(root / "plugin"), "--", sys.executable, "-m",
           "vllm.entrypoints.openai.api_server", "--model", str(model), "--load-format", "dummy",
           "--skip-tokenizer-init", "--block-size", "32", "--enable-prefix-caching", "--max-model-len", "512",
           "--num-gpu-blocks-override", str(num_gpu_blocks), "--kv-cache-memory-bytes", str(64 << 20),
           "--enforce-eager", "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port),
           "--kv-events-config", json.dumps(events)]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
           "KMESH_TRACE_FLUSH_S": "0.5"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    log = open(root / "server.log", "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def tail() -> str:
        log.flush()
        return (root / "server.log").read_text()[-4000:]

    return server, f"http://127.0.0.1:{port}", log, tail


def wait_healthy(server: subprocess.Popen, url: str, tail) -> None:
    """Until the server answers /health; fails the test if it exits or takes longer than START_TIMEOUT_S."""
    with waiting(f"the vLLM server at {url} to answer /health"):
        _wait_healthy(server, url, tail)


def _wait_healthy(server: subprocess.Popen, url: str, tail) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if server.poll() is not None:
            pytest.fail(f"the server exited with {server.returncode}:\n{tail()}")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not start within {START_TIMEOUT_S} s:\n{tail()}")
            time.sleep(0.5)
