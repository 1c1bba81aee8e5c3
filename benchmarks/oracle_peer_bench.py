"""Oracle against KVCache.AI's `kvcache-simulator` (its C++ backend): whole curves against its sweep.

Benchmark-only dependency: `pip install kvcache-simulator` into the benchmark's environment (not a
project dependency). Its C++ simulator is compiled once (by a warm-up run) before anything is timed.

Streams (both sides read the same Mooncake-format JSONL file):
- the Mooncake conversation trace (../shared/datasets/mooncake, or --src);
- an agentic stream of >= --agentic-reads block reads built from the Claude Code samples in
  ../shared/datasets/weka-claude-code: the conversations (sub-agents' requests flattened in time)
  repeated with fresh ids, copy k starting k * --stagger-s seconds after copy k - 1, all merged in
  time order; 512-token blocks, the id of a block being the id of its last 64-token block (ids are
  prefix hashes), a partial last block getting an id of its own. Written under /tmp.

Timed, whole process, each in a fresh subprocess, rounds alternating ours / peer, medians:
- ours: `kmesh-trace headroom SRC ... --window last-half --json` on the JSONL file as it is (with
  --import-first: `kmesh-trace import mooncake SRC --out T`, then `headroom T`), one arm per `--arms`: `exact` (`--policies lru,belady`: both exact at every capacity from 1 block to the
  working set), `default` (the default curve: those two, and vllm and belady-prefix on the power-of-two grid),
  `same-work` (`--policies lru,belady-prefix --capacity-blocks` the peer's capacities: the peer's work);
- peer: parse the file (`kvcache_sim.trace.parse_trace_file`) and `run_cpp_sweep` at --num-capacities
  capacities (log-spaced from 16 blocks to the working set) for lru and optimal, warm-up = the first
  half of the requests (its default window).
Peak memory: the largest resident set of the process tree (GNU time's %M), per block read.

Hit ratios (not timed): our `belady-prefix` and `lru` against its `optimal` and `lru` at its
capacities, last half of the requests, once on the file as given and once on an aligned copy whose
definitions agree (see `DIFFERENCES`).

With `--baseline COMMIT`, each arm also runs from that commit of this repository (`git archive` into a
temporary directory, imported ahead of the installed tree, the native library copied from this one), in
the same rounds: before / after in one run, on one load.

    .venv/bin/python benchmarks/oracle_peer_bench.py [--rounds 3] [--agentic-reads 10000000] [--json]
        [--arms default,same-work] [--baseline 96c3b47]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from baseline_tree import baseline_command

HERE = Path(__file__).resolve()
DATASETS = Path(os.environ.get("KMESH_DATASETS") or HERE.parents[2] / "shared" / "datasets")
BIN = Path(sys.executable).parent
BLOCK = 512

DIFFERENCES = [
    "eligible reads: ours never count the block holding the prompt's last token (the engine always computes it: "
    "(P - 1) // 512 blocks can hit); the peer counts every listed block, the partial last one included",
    "weighting: our hit ratio is hit block reads / listed block reads; the peer's is hit tokens / prompt tokens "
    "(a partial block weighs its tokens)",
    "next use: ours is the position of the next read of the block; the peer's is the index of the next request that "
    "reads it (blocks of one request tie)",
    "identity: ours is the block hash; the peer's is the (parent node, hash) trie edge (equal for prefix hashes)",
    "lru: ours is block-level LRU touched tail first, the engine's free-queue order; the peer's evicts only leaves "
    "of its trie",
    "window: the peer reports a capacity whose cache never filled during the first half as 'underfilled' (no hit "
    "ratio); ours always gives one",
    "aligned copy: every line keeps only its full blocks and gets input_length = 512 * blocks + 1, so both sides "
    "count the same blocks with the same weight",
]


# ---- the agentic stream --------------------------------------------------------------------------

def _flatten(requests, t0=0.0):
    for r in requests:
        if r.get("type") == "subagent":
            yield from _flatten(r.get("requests", []), t0 + float(r.get("t", 0.0)))
        else:
            yield t0 + float(r["t"]), int(r["in"]), int(r.get("out", 0)), r["hash_ids"]


def agentic_conversations() -> list[list[tuple]]:
    """Per Claude Code sample, its requests (time, input tokens, output tokens, 512-token block ids; -1: a
    partial last block, which gets a fresh id per copy)."""
    files = sorted((DATASETS / "weka-claude-code").glob("trace_*.json"))
    if not files:
        sys.exit(f"no weka-claude-code samples under {DATASETS}")
    convs = []
    for f in files:
        d = json.loads(f.read_text())
        bs = int(d["block_size"])
        per = BLOCK // bs
        reqs = []
        for t, n_in, n_out, hashes in _flatten(d["requests"]):
            n_blocks = -(-n_in // BLOCK)
            ids = [int(hashes[per * (g + 1) - 1]) if per * (g + 1) <= len(hashes) else -1 for g in range(n_blocks)]
            reqs.append((t, n_in, n_out, ids))
        convs.append(reqs)
    return convs


def build_agentic(out: Path, min_reads: int, stagger_s: float) -> dict:
    convs = agentic_conversations()
    reads_per_round = sum(len(r[3]) for c in convs for r in c)
    copies = math.ceil(min_reads / reads_per_round)
    events = []
    for k in range(copies):
        for ci, conv in enumerate(convs):
            for j, (t, n_in, n_out, ids) in enumerate(conv):
                events.append((k * stagger_s + t, k, ci, j))
    events.sort()
    fresh = 1 << 40
    with open(out, "w") as f:
        for t, k, ci, j in events:
            _, n_in, n_out, ids = convs[ci][j]
            base = (k * len(convs) + ci) << 24
            out_ids = []
            for h in ids:
                if h < 0:
                    fresh += 1
                    out_ids.append(fresh)
                else:
                    out_ids.append(base + h)
            f.write(json.dumps({"timestamp": int(t * 1000), "input_length": n_in, "output_length": n_out,
                                "hash_ids": out_ids}) + "\n")
    return {"copies": copies, "requests": len(events), "block_reads": copies * reads_per_round}


def aligned_copy(src: Path, out: Path) -> None:
    """Full blocks only, input_length = 512 * blocks + 1: every listed block is eligible and weighs 512 tokens."""
    with open(src) as f, open(out, "w") as g:
        for line in f:
            rec = json.loads(line)
            n_full = rec["input_length"] // BLOCK
            if n_full == 0:
                continue
            g.write(json.dumps({"timestamp": rec["timestamp"], "input_length": BLOCK * n_full + 1,
                                "output_length": rec.get("output_length", 0), "hash_ids": rec["hash_ids"][:n_full]})
                    + "\n")


# ---- timed runs --------------------------------------------------------------------------------------

def timed(cmd: list[str]) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes of the process tree, stdout) of one command, by GNU time."""
    with tempfile.NamedTemporaryFile(suffix=".time") as tf:
        res = subprocess.run(["/usr/bin/time", "-f", "%e %M", "-o", tf.name, *cmd], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr[-2000:]}")
        wall, kib = Path(tf.name).read_text().split()[-2:]
    return float(wall), int(kib) * 1024, res.stdout


#: Our arms: the headroom flags of each (the peer always runs lru + optimal at its 10 capacities).
ARMS = {
    "exact": ["--policies", "lru,belady"],  # lru and belady exact at every capacity
    "default": [],  # the default curve: lru, belady exact; vllm, belady-prefix on the power-of-two grid
    "same-work": ["--policies", "lru,belady-prefix", "--capacity-blocks", "{caps}"],  # the peer's capacities
}


#: True: `kmesh-trace headroom SRC.jsonl` reads the file as it is (one process, as users run it now);
#: False (--import-first): `kmesh-trace import` then `headroom` on the trace, two processes.
DIRECT = True


#: commit -> its `kmesh-trace` command (`baseline_tree.baseline_command`), for --baseline.
BASELINE: dict[str, list[str]] = {}
def run_ours(src: Path, tmp: Path, arm: str = "exact", caps: list[int] | None = None) -> tuple[float, int, dict]:
    arm, _, at = arm.partition("@")
    flags = [f.format(caps=",".join(map(str, caps or []))) for f in ARMS[arm]]
    if at:
        w, m, out = timed([*BASELINE[at], "headroom", str(src), *flags, "--window", "last-half", "--json"])
        return w, m, json.loads(out)
    if DIRECT:
        w, m, out = timed([str(BIN / "kmesh-trace"), "headroom", str(src), *flags, "--window", "last-half", "--json"])
        return w, m, json.loads(out)
    trace = tmp / "trace"
    subprocess.run(["rm", "-rf", str(trace)], check=True)
    w1, m1, _ = timed([str(BIN / "kmesh-trace"), "import", "mooncake", str(src), "--out", str(trace)])
    w2, m2, out = timed([str(BIN / "kmesh-trace"), "headroom", str(trace), *flags, "--window", "last-half", "--json"])
    return w1 + w2, max(m1, m2), json.loads(out)


PEER = """
import json, sys
from kvcache_sim.trace import parse_trace_file
from kvcache_sim.cpp_backend import run_cpp_sweep
trace = parse_trace_file(sys.argv[1], block_size=512)
caps = [int(c) for c in sys.argv[2].split(",")]
res = run_cpp_sweep(trace, capacities=caps, policies=["lru", "optimal"], warmup_requests=trace.request_count // 2)
print(json.dumps({"unique_blocks": res.unique_blocks, "block_reads": len(trace.ids),
                  "points": {f"{p}:{c}": [r.hitTokens, r.totalTokens, r.measurementMode] for (p, c), r in res.results.items()}}))
"""


def run_peer(src: Path, caps: list[int]) -> tuple[float, int, dict]:
    w, m, out = timed([sys.executable, "-c", PEER, str(src), ",".join(map(str, caps))])
    return w, m, json.loads(out)


def peer_capacities(working_set: int, n: int) -> list[int]:
    return sorted({int(round(x)) for x in np.geomspace(16, max(working_set, 32), n)})


def ours_hit_ratios(src: Path, caps: list[int]) -> dict:
    """Our belady-prefix and lru at `caps`, last half of the requests, read straight from the JSONL."""
    from kmesh_trace.oracle.policies import POLICIES, Workload
    from kmesh_trace.oracle.stream import requests_from_rows

    with open(src) as f:
        rows = [{"request_id": str(i), "num_prompt_tokens": r["input_length"], "prompt_block_hashes": r["hash_ids"]}
                for i, r in enumerate(map(json.loads, f))]
    w = Workload(BLOCK, requests_from_rows(rows, BLOCK))
    half = w.stream.num_requests // 2
    reads = int(w.stream.num_reads[half:].sum())
    out = {}
    for name in ("belady-prefix", "lru"):
        for c in caps:
            out[f"{name}:{c}"] = int(POLICIES[name].simulate(w, c).hit_blocks_per_request[half:].sum()) / reads
    return out


def peer_hit_ratios(peer: dict) -> dict:
    return {k: (h / t if mode == "fixed_window" and t else None) for k, (h, t, mode) in peer["points"].items()}


def bench(name: str, src: Path, rounds: int, n_caps: int, tmp: Path, arms: list[str]) -> dict:
    _, _, warm = run_ours(src, tmp)  # numba's cache and the OS page cache, outside the timing
    caps = peer_capacities(int(warm["curves"]["lru"]["capacities"][-1]), n_caps)
    for arm in arms:
        run_ours(src, tmp, arm, caps)  # each arm's kernels compiled once
    run_peer(src, caps[:1])  # compiles the peer's C++ simulator once
    ours: dict[str, list] = {arm: [] for arm in arms}
    peer = []
    for _ in range(rounds):  # interleaved: every arm of ours, then the peer, in each round
        for arm in arms:
            w, m, d = run_ours(src, tmp, arm, caps)
            ours[arm].append((w, m))
        w, m, p = run_peer(src, caps)
        peer.append((w, m))
    reads = p["block_reads"]
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    row = {"stream": name, "block_reads": reads, "requests": d["num_requests"] * 2, "peer_capacities": caps,
           "ours_capacities": int(warm["curves"]["lru"]["capacities"][-1]), "peer_s": med(peer, 0),
           "peer_peak_bytes": med(peer, 1), "rounds": rounds, "arms": {}}
    row["peer_bytes_per_read"] = row["peer_peak_bytes"] / reads
    row["load_average"] = os.getloadavg()
    for arm in arms:
        a = {"ours_s": med(ours[arm], 0), "ours_peak_bytes": med(ours[arm], 1)}
        a["time_ratio"] = a["ours_s"] / row["peer_s"]
        a["ours_bytes_per_read"] = a["ours_peak_bytes"] / reads
        a["memory_ratio"] = a["ours_peak_bytes"] / row["peer_peak_bytes"]
        row["arms"][arm] = a
    return row


def compare_hits(src: Path, caps: list[int], tmp: Path) -> dict:
    out = {}
    for label, path in (("as given", src), ("aligned", tmp / "aligned.jsonl")):
        if label == "aligned":
            aligned_copy(src, path)
        ours = ours_hit_ratios(path, caps)
        peer = peer_hit_ratios(run_peer(path, caps)[2])
        out[label] = [{"capacity_blocks": c, "ours_belady_prefix": ours[f"belady-prefix:{c}"],
                       "peer_optimal": peer.get(f"optimal:{c}"), "ours_lru": ours[f"lru:{c}"],
                       "peer_lru": peer.get(f"lru:{c}")} for c in caps]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, default=DATASETS / "mooncake" / "conversation_trace.jsonl")
    ap.add_argument("--agentic-reads", type=int, default=10_000_000, help="block reads of the agentic stream (0: skip)")
    ap.add_argument("--stagger-s", type=float, default=60.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-capacities", type=int, default=10)
    ap.add_argument("--arms", default="exact,default,same-work", help=f"our arms, from {', '.join(ARMS)}")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--import-first", action="store_true", help="ours as `import` then `headroom` on the trace "
                    "(default: `headroom` on the JSONL file itself)")
    ap.add_argument("--baseline", help="also run every arm from this commit of the repository (before / after)")
    args = ap.parse_args()
    global DIRECT
    DIRECT = not args.import_first
    try:
        import kvcache_sim  # noqa: F401
    except ImportError:
        sys.exit("kvcache-simulator is not installed: pip install kvcache-simulator (benchmark only)")
    if not args.src.is_file():
        sys.exit(f"{args.src} not found; pass --src with the Mooncake conversation_trace.jsonl")
    report: dict = {"differences": DIFFERENCES, "rows": []}
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        tmp = Path(d)
        arms = [a for a in args.arms.split(",") if a]
        if args.baseline:
            BASELINE[args.baseline] = baseline_command(args.baseline, tmp)
            arms += [f"{a}@{args.baseline}" for a in arms]
        row = bench(args.src.name, args.src, args.rounds, args.num_capacities, tmp, arms)
        report["rows"].append(row)
        report["hit_ratios"] = compare_hits(args.src, row["peer_capacities"], tmp)
        if args.agentic_reads:
            big = tmp / "agentic.jsonl"
            report["agentic"] = build_agentic(big, args.agentic_reads, args.stagger_s)
            report["rows"].append(bench(f"agentic x{report['agentic']['copies']}", big, args.rounds,
                                        args.num_capacities, tmp, arms))
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for r in report["rows"]:
        print(f"{r['stream']}: {r['block_reads']:,} block reads, {r['requests']:,} requests; medians of {r['rounds']} "
              f"(load average at the end {' '.join(f'{x:.2f}' for x in r['load_average'])})")
        print(f"  peer ({len(r['peer_capacities'])} capacities, lru + optimal): {r['peer_s']:.2f} s, "
              f"peak {r['peer_peak_bytes'] / 2**20:,.0f} MiB ({r['peer_bytes_per_read']:.0f} B/read)")
        for arm, a in r["arms"].items():
            print(f"  ours, {arm} ({' '.join(ARMS[arm.partition('@')[0]]) or 'default policies'}): {a['ours_s']:.2f} s, "
                  f"peak {a['ours_peak_bytes'] / 2**20:,.0f} MiB ({a['ours_bytes_per_read']:.0f} B/read); "
                  f"time ours / peer {a['time_ratio']:.3f}, memory {a['memory_ratio']:.3f}")
    for label, rows in report["hit_ratios"].items():
        print(f"hit ratios, last half, {args.src.name} ({label}): capacity, ours belady-prefix, peer optimal, ours lru, peer lru")
        for h in rows:
            f = lambda x: "underfilled" if x is None else f"{x:.4f}"  # noqa: E731
            print(f"  {h['capacity_blocks']:>8,}  {f(h['ours_belady_prefix'])}  {f(h['peer_optimal'])}  "
                  f"{f(h['ours_lru'])}  {f(h['peer_lru'])}")


if __name__ == "__main__":
    main()
