"""Start-up benchmark: wall time of `kmesh-trace --help`, of every command's --help and of
a command's first line, whole process, as a user runs them; goal <= 0.15 s each.

Baseline, measured in the same run, interleaved: `python -c pass` (the interpreter's own start) and
`python -c "import typer"` (the CLI framework every command needs: the floor of any command). Medians of
--rounds runs. "first line" is the time until the process writes its first byte (stdout or stderr), read
through a pipe: a usage error's `Error:` line, or an analysis' first progress line.

Bytecode: the runs use a private __pycache__ prefix (a temporary directory, warmed by one untimed round),
as an installed package runs from its .pyc files, even where PYTHONDONTWRITEBYTECODE is set.

With `--baseline COMMIT`, every kmesh-trace job also runs as of that commit (benchmarks/baseline_tree.py),
interleaved in the same rounds: before / after on one load.

With `--wheel`, three jobs also run from a wheel of this checkout installed into a temporary virtual
environment (its dependencies read from this environment's site-packages), as `pip install kmesh-trace`
installs it: this checkout's editable install adds its own import hook to every start (setuptools' finder,
~25 ms here), which an installed package does not have.

    .venv/bin/python benchmarks/startup_bench.py [--rounds 15] [--only help] [--json] [--baseline 96c3b47] [--wheel]
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MOONCAKE = Path(__file__).resolve().parents[1].parent / "shared" / "datasets" / "mooncake" / "conversation_trace.jsonl"


def until_exit(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - t0


def until_first_byte(cmd: list[str], env: dict) -> float:
    """Seconds from the start until the first byte on stdout or stderr; the process is then ended."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    sel.register(p.stderr, selectors.EVENT_READ)
    try:
        sel.select(timeout=120)
        return time.perf_counter() - t0
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
        p.stderr.close()


#: The jobs that --wheel also runs from the installed wheel.
WHEEL_JOBS = ("kmesh-trace --help", "kmesh-trace headroom --help", "first line: headroom --window bad")


def installed_wheel(venv: Path) -> str:
    """`kmesh-trace` of a wheel of this checkout installed into a new virtual environment at `venv`, whose other
    packages are this environment's (a .pth line naming its site-packages)."""
    import sysconfig

    repo = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    (site / "_kmesh_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheels = venv / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(repo)], check=True)
    (wheel,) = wheels.glob("kmesh_trace-*.whl")
    # its own Python runs pip (read from this environment), so the script's first line names that Python
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)
    return str(venv / "bin" / "kmesh-trace")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--only", default="", help="Time only the jobs whose name contains this text (and the baselines).")
    ap.add_argument("--json", action="store_true", help="Also print the results as one JSON line.")
    ap.add_argument("--baseline", help="Also run every kmesh-trace job as of this commit (before / after).")
    ap.add_argument("--wheel", action="store_true", help="Also time three jobs from a wheel installed into a temporary "
                    "virtual environment (no editable import hook).")
    args = ap.parse_args()
    exe = shutil.which("kmesh-trace", path=str(Path(sys.executable).parent)) or "kmesh-trace"
    commands = ["schema", "info", "sql", "import", "capture", "listen", "residency", "headroom", "pressure", "tiers",
                "fleet", "demo", "report", "lineage", "export", "replay", "audit"]
    jobs = {
        "python -c pass": (until_exit, [sys.executable, "-c", "pass"]),
        "python -c 'import typer'": (until_exit, [sys.executable, "-c", "import typer"]),
        "kmesh-trace --help": (until_exit, [exe, "--help"]),
        **{f"kmesh-trace {c} --help": (until_exit, [exe, c, "--help"]) for c in commands},
        "first line: headroom --no-such-option": (until_first_byte, [exe, "headroom", "--no-such-option"]),
        "first line: headroom --window bad": (until_first_byte, [exe, "headroom", "--window", "bad"]),
        "first line: info (missing directory)": (until_first_byte, [exe, "info", "/nonexistent-trace"]),
    }
    if MOONCAKE.exists():
        jobs["first line: headroom mooncake.jsonl"] = (until_first_byte, [exe, "headroom", str(MOONCAKE)])
    jobs = {k: v for k, v in jobs.items() if k.startswith("python") or args.only in k}
    with tempfile.TemporaryDirectory(prefix="kmesh-startup-pyc-") as pyc:
        if args.baseline:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from baseline_tree import baseline_command

            before = baseline_command(args.baseline, Path(pyc) / "trees")
            jobs.update({f"{k} @{args.baseline}": (how, [*before, *cmd[1:]]) for k, (how, cmd) in jobs.items()
                         if cmd[0] == exe})
        if args.wheel:
            installed = installed_wheel(Path(pyc) / "wheel-venv")
            jobs.update({f"installed wheel: {k}": (how, [installed, *cmd[1:]]) for k, (how, cmd) in jobs.items()
                         if k in WHEEL_JOBS})
        env = {**os.environ, "PYTHONPYCACHEPREFIX": pyc}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        for how, cmd in jobs.values():  # one untimed round writes the bytecode
            how(cmd, env)
        times: dict[str, list[float]] = {k: [] for k in jobs}
        for _ in range(args.rounds):  # interleaved, so drift in the machine's load hits every job alike
            for name, (how, cmd) in jobs.items():
                times[name].append(how(cmd, env))
    base = statistics.median(times["python -c pass"])
    floor = statistics.median(times["python -c 'import typer'"])
    rows = {k: {"median_s": round(statistics.median(v), 4), "min_s": round(min(v), 4),
                "x_python": round(statistics.median(v) / base, 2), "x_typer": round(statistics.median(v) / floor, 2)}
            for k, v in times.items()}
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.rounds} rounds")
    print(f"{'job':48s} {'median':>8s} {'min':>8s} {'x typer':>8s}")
    for k, r in rows.items():
        print(f"{k:48s} {r['median_s']:7.3f}s {r['min_s']:7.3f}s {r['x_typer']:7.2f}x")
    if args.json:
        print(json.dumps({"rounds": args.rounds, "load": os.getloadavg(), "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
