"""Start-up benchmark (issue 26, item 4): wall time of `kmesh-trace --help` and of a command's first line,
whole process, as a user runs them; goal <= 0.15 s each.

Baseline, measured in the same run, interleaved: `python -c pass` (the interpreter's own start) and
`python -c "import typer"` (the CLI framework every command needs). Medians of --rounds runs.

    .venv/bin/python benchmarks/startup_bench.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    exe = shutil.which("kmesh-trace", path=str(Path(sys.executable).parent)) or "kmesh-trace"
    jobs = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -c 'import typer'": [sys.executable, "-c", "import typer"],
        "kmesh-trace --help": [exe, "--help"],
        "kmesh-trace headroom --help": [exe, "headroom", "--help"],
        "kmesh-trace headroom (bad option: first line)": [exe, "headroom", "--no-such-option"],
    }
    times: dict[str, list[float]] = {k: [] for k in jobs}
    for _ in range(args.rounds):  # interleaved, so drift in the machine's load hits every job alike
        for name, cmd in jobs.items():
            times[name].append(timed(cmd))
    base = statistics.median(times["python -c pass"])
    rows = {k: {"median_s": round(statistics.median(v), 4), "x_python": round(statistics.median(v) / base, 2)}
            for k, v in times.items()}
    for k, r in rows.items():
        print(f"{k:48s} {r['median_s']:.3f} s  {r['x_python']:.2f}x python")
    print(json.dumps({"rounds": args.rounds, "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
