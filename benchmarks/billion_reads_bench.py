"""The exact default curve on 10^7 .. 10^9 block reads in bounded memory: time, peak memory, bytes per read.

The agentic stream is built as benchmarks/oracle_peer_bench.py builds it (the Claude Code samples in
$KMESH_DATASETS/weka-claude-code, sub-agents' requests flattened in time, repeated with fresh ids, copy k
starting k * 30 s after copy k - 1, merged in time order, 512-token blocks), written once under /tmp for the
largest size asked; each smaller point of the series is a prefix of it (whole lines, cut at the first line
that reaches the size: the same time-ordered merge, shorter). Fresh ids here start at 2^62 (the peer bench's
2^40 meets the copies' own ids past 65,536 conversation copies).

Each point runs `kmesh-trace headroom FILE --window last-half --json` in a fresh process under GNU time
(whole process: wall seconds, CPU seconds, peak RSS), by the bounded-memory path (forced: `--sample 1` with a
`--memory-budget` the in-memory curve does not fit), the in-memory one (a budget it fits) or the one `headroom`
chooses; with --peer-python, kvcache-simulator's sweep on the same file right after (its warm-up run untimed).

    KMESH_DATASETS=/work/shared/datasets .venv/bin/python benchmarks/billion_reads_bench.py build --reads 1e9
    .venv/bin/python benchmarks/billion_reads_bench.py run --reads 1e7,1e8 [--paths streamed,in-memory,auto]
        [--as-limit-gib G] [--out FILE.jsonl] [--peer-python /tmp/peer/bin/python]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from oracle_peer_bench import PEER, agentic_conversations

HERE = Path(__file__).resolve()
BIN = Path(sys.executable).parent
WORK = Path("/tmp/billion")
FRESH = 1 << 62


def build(out: Path, min_reads: int, stagger_s: float = 30.0) -> dict:
    """The agentic stream of at least `min_reads` block reads (oracle_peer_bench.build_agentic's, fresh ids
    from 2^62), and where it reaches each size of the series (`out`.index.json: reads -> bytes of whole lines)."""
    convs = agentic_conversations()
    reads_per_round = sum(len(r[3]) for c in convs for r in c)
    copies = math.ceil(min_reads / reads_per_round)
    events = [(k * stagger_s + t, k, ci, j) for k in range(copies) for ci, conv in enumerate(convs)
              for j, (t, _, _, _) in enumerate(conv)]
    events.sort()
    import numpy as np

    # Per request: its ids as an array and where its fresh ids (-1: a partial last block) are.
    arrays = [[(np.array(ids, np.int64), [g for g, h in enumerate(ids) if h < 0]) for _, _, _, ids in conv]
              for conv in convs]
    fresh = FRESH
    marks, reads, written = {}, 0, 0
    wanted = sorted({int(x) for x in (1e7, 2e7, 5e7, 1e8, 2e8, 5e8, 1e9, 2e9)})
    with open(out, "w", buffering=16 << 20) as f:
        for t, k, ci, j in events:
            _, n_in, n_out, ids = convs[ci][j]
            arr, holes = arrays[ci][j]
            out_ids = (arr + ((k * len(convs) + ci) << 24)).tolist()
            for g in holes:
                fresh += 1
                out_ids[g] = fresh
            line = json.dumps({"timestamp": int(t * 1000), "input_length": n_in, "output_length": n_out,
                               "hash_ids": out_ids}) + "\n"
            f.write(line)
            written += len(line)  # ASCII: characters are bytes
            reads += len(ids)
            while wanted and reads >= wanted[0]:
                marks[wanted.pop(0)] = {"bytes": written, "reads": reads}
    meta = {"copies": copies, "requests": len(events), "block_reads": reads, "bytes": written, "prefixes": marks}
    Path(str(out) + ".index.json").write_text(json.dumps(meta, indent=1))
    return meta


def build_fast(out: Path, min_reads: int, stagger_s: float = 30.0) -> dict:
    """`build`'s file, byte for byte, written by benchmarks/agentic_lines.c (compiled here with `cc`): the
    Python writer takes about a minute per 10^8 reads on an idle core, this one seconds."""
    import numpy as np

    convs = agentic_conversations()
    reqs = [(n_in, n_out, ci, len(ids), t, ids) for ci, conv in enumerate(convs) for t, n_in, n_out, ids in conv]
    reads_per_round = sum(r[3] for r in reqs)
    copies = math.ceil(min_reads / reads_per_round)
    base_t = np.array([r[4] for r in reqs])
    ci = np.array([r[2] for r in reqs])
    j = np.array([j for conv in convs for j in range(len(conv))])
    n = len(reqs)
    k = np.repeat(np.arange(copies, dtype=np.int64), n)
    times = k * stagger_s + np.tile(base_t, copies)  # as the Python writer adds them: float(k) * stagger + t
    order = np.lexsort((np.tile(j, copies), np.tile(ci, copies), k, times))
    events = np.stack([order // n, order % n], axis=1).astype(np.int64)
    del k, times, order
    exe = WORK / "agentic_lines"
    subprocess.run(["cc", "-O2", "-o", str(exe), str(HERE.parent / "agentic_lines.c")], check=True)
    blob = WORK / "agentic_lines.in"
    with open(blob, "wb") as f:
        np.array([n, len(events), len(convs), FRESH], np.int64).tofile(f)
        for n_in, n_out, c, num, t, _ in reqs:
            np.array([n_in, n_out, c, num], np.int64).tofile(f)
            np.array([t], np.float64).tofile(f)
        np.array([h for r in reqs for h in r[5]], np.int64).tofile(f)
        events.tofile(f)
    wanted = sorted({int(x) for x in (1e7, 2e7, 5e7, 1e8, 2e8, 5e8, 1e9, 2e9)})
    with open(out, "wb") as f:
        res = subprocess.run([str(exe), str(blob), *map(str, wanted)], stdout=f, stderr=subprocess.PIPE, text=True,
                             check=True)
    blob.unlink()
    marks = {int(a): {"reads": int(b), "bytes": int(c)} for a, b, c in (ln.split() for ln in res.stderr.split("\n") if ln)}
    meta = {"copies": copies, "requests": len(events), "block_reads": copies * reads_per_round,
            "bytes": out.stat().st_size, "prefixes": marks}
    Path(str(out) + ".index.json").write_text(json.dumps(meta, indent=1))
    return meta


def prefix(src: Path, reads: int, out: Path) -> dict:
    """The first whole lines of `src` that hold at least `reads` block reads, copied to `out`."""
    got = lines = 0
    with open(src, "rb") as f, open(out, "wb") as g:
        for line in f:
            g.write(line)
            lines += 1
            got += line.count(b",") - 2  # 3 commas between the fields, k - 1 between k ids
            if got >= reads:
                break
    if got < reads:
        sys.exit(f"{src} holds {got:,} block reads, fewer than {reads:,}")
    return {"block_reads": got, "requests": lines, "bytes": out.stat().st_size}


def timed(cmd: list[str], as_limit: int | None = None) -> dict:
    """Wall seconds, user + system seconds and peak RSS (GNU time, whole process) of `cmd`, its stdout and the
    tail of its stderr; under `prlimit --as` when `as_limit` bytes are given."""
    pre = ["prlimit", f"--as={as_limit}"] if as_limit else []
    with tempfile.NamedTemporaryFile(suffix=".time") as tf:
        res = subprocess.run([*pre, "/usr/bin/time", "-f", "%e %U %S %M", "-o", tf.name, *cmd], capture_output=True,
                             text=True)
        last = Path(tf.name).read_text().split("\n")
    wall, user, sys_s, kib = [ln for ln in last if ln.strip()][-1].split()
    return {"rc": res.returncode, "wall_s": float(wall), "cpu_s": float(user) + float(sys_s),
            "peak_rss_bytes": int(kib) * 1024, "stdout": res.stdout, "stderr_tail": res.stderr[-3000:]}


IN_MEMORY = ("import sys; import kmesh_trace.oracle.streamed_curve as s; s.STREAMED_FROM_READS = 1 << 62; "
             "from kmesh_trace.cli import main; sys.argv[0] = 'kmesh-trace'; main()")


def run_point(src: Path, path: str, as_limit: int | None) -> dict:
    """`headroom SRC --window last-half --json` by `path`: "streamed" (forced: --sample 1 under a budget the
    in-memory curve does not fit), "in-memory" (a budget it fits, and the disk path's length rule,
    `streamed_curve.STREAMED_FROM_READS`, off), "exact" (--sample 1) or "auto" (no flag: what users run)."""
    flags = {"streamed": ["--sample", "1", "--memory-budget", "0.001"], "in-memory": ["--memory-budget", "64"],
             "exact": ["--sample", "1"], "auto": []}[path]
    # The in-memory path at any length: the CLI with the disk path's length rule switched off.
    cli = [sys.executable, "-c", IN_MEMORY] if path == "in-memory" else [str(BIN / "kmesh-trace")]
    cmd = [*cli, "headroom", str(src), "--window", "last-half", "--json", *flags]
    r = timed(cmd, as_limit)
    r["command"] = " ".join(cmd if path != "in-memory" else ["kmesh-trace (disk path's length rule off)", *cmd[3:]])
    r["path"] = path
    r["bounded_note"] = "bounded memory" in r["stderr_tail"]
    if r["rc"] == 0:
        d = json.loads(r.pop("stdout"))
        r["num_reads_measured"] = d["num_reads"]
        r["result_sha256"] = __import__("hashlib").sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()
        r["curves"] = {k: len(v["capacities"]) for k, v in d["curves"].items()}
        r["lru_last_capacity"] = d["curves"]["lru"]["capacities"][-1]
        r["infinite_hit_ratio"] = d["infinite"]["hit_ratio"]
        r["grid"] = len(d["grid"])
    else:
        r.pop("stdout")
    return r


def run_peer(src: Path, caps: list[int], python: str) -> dict:
    """kvcache-simulator's sweep (lru + optimal at `caps`, warm-up the first half), benchmarks/oracle_peer_bench.py's
    script, whole process."""
    cmd = [python, "-c", PEER, str(src), ",".join(map(str, caps))]
    r = timed(cmd)
    r["command"] = f"{python} -c PEER {src} {','.join(map(str, caps))}"
    r["path"] = "peer"
    if r["rc"] == 0:
        out = json.loads(r.pop("stdout"))
        r.update(unique_blocks=out["unique_blocks"], block_reads=out["block_reads"])
    return r


def record(row: dict, out: Path | None) -> None:
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def plot(series: Path, out: Path, title: str) -> None:
    """Wall seconds, CPU seconds and peak RSS against block reads, log-log, one line per path (or per row's
    `label`, where the plot input gives one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in series.read_text().splitlines() if line.strip()]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in rows:
        r.setdefault("label", r["path"])
    for path in sorted({r["label"] for r in rows}):
        pts = sorted((r["reads"], r["wall_s"], r["cpu_s"], r["peak_rss_bytes"]) for r in rows
                     if r["label"] == path and r.get("rc") == 0)
        if not pts:
            continue
        x = [p[0] for p in pts]
        ax_t.plot(x, [p[1] for p in pts], "o-", label=f"{path}: wall")
        ax_t.plot(x, [p[2] for p in pts], "s--", label=f"{path}: CPU (user + system)")
        ax_m.plot(x, [p[3] / 2**30 for p in pts], "o-", label=path)
    ax_m.axhline(8e9 / 2**30, color="red", lw=0.8, ls=":", label="8 GB")
    for ax, what in ((ax_t, "seconds"), (ax_m, "peak RSS, GiB (whole process)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("block reads")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"headroom FILE --window last-half --json (default curve), agentic stream; {title}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--reads", type=float, default=1e9)
    b.add_argument("--out", type=Path, default=WORK / "agentic-1e9.jsonl")
    b.add_argument("--python", action="store_true", help="the Python writer (slow) instead of agentic_lines.c")
    r = sub.add_parser("run")
    r.add_argument("--src", type=Path, default=WORK / "agentic-1e9.jsonl")
    r.add_argument("--reads", default="1e7,1e8")
    r.add_argument("--paths", default="streamed", help="comma-separated: streamed, in-memory, auto")
    r.add_argument("--as-limit-gib", type=float, default=None, help="prlimit --as for every run")
    r.add_argument("--out", type=Path, default=None, help="append one JSON line per run to this file")
    r.add_argument("--keep", action="store_true", help="keep the prefix files")
    r.add_argument("--peer-python", default=None, help="also run kvcache-simulator (installed for this python) "
                   "after ours on each size, at 10 capacities from 16 blocks to our lru curve's depth")
    pl = sub.add_parser("plot")
    pl.add_argument("series", type=Path)
    pl.add_argument("--out", type=Path, required=True)
    pl.add_argument("--title", default="2-core machine", help="what the plot's title says of the machine")
    args = ap.parse_args()
    if args.cmd == "plot":
        plot(args.series, args.out, args.title)
        return
    if args.cmd == "build":
        WORK.mkdir(exist_ok=True)
        t0 = time.time()
        meta = (build if args.python else build_fast)(args.out, int(args.reads))
        print(json.dumps({**meta, "seconds": round(time.time() - t0, 1)}))
        return
    as_limit = int(args.as_limit_gib * 2**30) if args.as_limit_gib else None
    for n in (int(float(x)) for x in args.reads.split(",")):
        src = args.src
        made = None
        info = {}
        index = Path(str(src) + ".index.json")
        whole = json.loads(index.read_text())["block_reads"] if index.exists() else None
        if whole is None or whole > 1.01 * n:  # a prefix of the file
            made = WORK / f"agentic-{n:.0e}.jsonl".replace("+", "")
            if not made.exists():
                info = prefix(src, n, made)
            src = made
        for path in args.paths.split(","):
            row = {"reads": n, "file": str(src), "file_bytes": src.stat().st_size, **info,
                   "load_avg": os.getloadavg(), **run_point(src, path, as_limit)}
            row["load_avg_after"] = os.getloadavg()
            row["bytes_per_read"] = round(row["peak_rss_bytes"] / n, 2)
            record(row, args.out)
        if args.peer_python:
            import numpy as np

            depth = row.get("lru_last_capacity") or 2**20
            caps = sorted({int(round(x)) for x in np.geomspace(16, max(depth, 32), 10)})
            run_peer(src, caps[:1], args.peer_python)  # compiles its C++ simulator once, outside the timing
            peer = {"reads": n, "file": str(src), "load_avg": os.getloadavg(), "capacities": caps,
                    **run_peer(src, caps, args.peer_python)}
            peer["load_avg_after"] = os.getloadavg()
            peer["bytes_per_read"] = round(peer["peak_rss_bytes"] / n, 2)
            record(peer, args.out)
        if made is not None and not args.keep:
            made.unlink()


if __name__ == "__main__":
    main()
