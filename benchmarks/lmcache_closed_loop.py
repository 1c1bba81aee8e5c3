"""Close the loop on LMCache: a real two-server run on one LMCache 0.5.6 server (tests/lmcache_servers.py),
`kmesh-trace tiers A --lmcache-peer B --lmcache ...` predicted beside what was measured.

Measured, per vLLM server: stores and loads as the proxy connector recorded them around LMCacheMPConnector,
equal to LMCache's own "Stored N" / "Retrieved N" log lines, and the external hits the server counts
(`vllm:external_prefix_cache_hits_total`); for the LMCache server, its log and the fs tier's files.

Usage (LMCache's environment, `make .lmcache-0.5.6/.installed`):

    DO_NOT_TRACK=1 VLLM_NO_USAGE_STATS=1 .lmcache-0.5.6/bin/python benchmarks/lmcache_closed_loop.py \\
        [--in-flight 1] [--no-fs] [--out DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from lmcache_servers import family_prompts, lmcache_spec, prompts, two_server_run  # noqa: E402

KEYS = ("num_stores", "stored_tokens", "num_loads", "loaded_tokens", "external_hit_tokens")


def predicted(run) -> dict:
    cmd = [sys.executable, "-m", "kmesh_trace.cli", "tiers", str(run.trace("A")), "--lmcache-peer", str(run.trace("B")),
           "--lmcache", lmcache_spec(run.fs_dir), "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(p.stdout)


def rows(run, d: dict) -> list[dict]:
    out = []
    for name, e in zip(("A", "B"), d["engines"]):
        out.append({"server": name, **{f"{k}_predicted": e["predicted"][k] for k in KEYS},
                    **{f"{k}_measured": e["measured"][k] for k in KEYS},
                    "external_hits_counter": run.external_hits[name]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--in-flight", type=int, default=1, help="requests sent at once (1: one at a time)")
    ap.add_argument("--no-fs", action="store_true", help="no fs tier under L1")
    ap.add_argument("--out", type=Path, help="keep the run here (default: a temporary directory)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from kmesh_trace.apps.tiny_engine import write_tiny_model

    root = a.out or Path(tempfile.mkdtemp(prefix="lmcache-loop-"))
    model = write_tiny_model(root / "model")
    run = two_server_run(root / "run", model, fs=not a.no_fs, in_flight=a.in_flight,
                         workload=prompts if a.in_flight == 1 else family_prompts)
    d = predicted(run)
    result = {"in_flight": a.in_flight, "lmcache_log": run.lmcache, "fs_files": run.fs_files,
              "predicted_server": d["server"], "servers": rows(run, d)}
    if a.json:
        print(json.dumps(result, indent=2))
        return
    print(f"LMCache logged stores {run.lmcache['stored']} and retrieves {run.lmcache['retrieved']}; fs files "
          f"{run.fs_files} (predicted {d['server']['fs_chunks']})")
    print("server  " + "  ".join(f"{k} (pred/meas)" for k in KEYS) + "  external counter")
    for r in result["servers"]:
        print(f"{r['server']:6}  " + "  ".join(f"{r[k + '_predicted']}/{r[k + '_measured']}".rjust(len(k) + 12)
                                              for k in KEYS) + f"  {r['external_hits_counter']}")


if __name__ == "__main__":
    main()
