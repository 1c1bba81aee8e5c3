"""The end-to-end demo: capture a real CPU vLLM engine running the agent workload, then analyse it.

`run_demo(out_dir)` writes into `out_dir`: `model/` (the tiny model config), `trace/` (the
capture), `report.json`, `report.html` (the page of `kmesh-trace report`), `headroom.png`,
`headroom.svg`, `pressure.png`, `pressure.svg` and `timeline.json` (Perfetto). Every
figure of the report is computed by the same public functions the CLI commands use (`info`,
`audit capture`, `headroom`, `pressure`, `export perfetto`) on the captured trace, so rerunning
those commands on `out_dir/trace` reproduces it. Rendering is the CLI's job
(`kmesh_trace.cli.demo`); this module returns plain data.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.writer import write_json_atomic

STAGES = ("engine", "workload", "audit", "headroom", "pressure", "timeline", "page")


@dataclass
class Progress:
    """Callbacks the CLI gives to show progress: stage started, request finished."""

    stage: Callable[[str], None] = lambda name: None
    request_done: Callable[[str], None] = lambda name: None


def sweep_capacities(usable: int) -> list[int]:
    """Capacities the demo sweeps: a quarter of the engine's pool up to four times it."""
    return sorted({max(4, usable // 4), max(4, usable // 2), usable, usable * 2, usable * 4})


def run_demo(out_dir: str | os.PathLike, *, size: str = "full", progress: Progress | None = None) -> dict[str, Any]:
    from kmesh_trace.datasets.workloads.agent import agent_workload

    progress = progress or Progress()
    out = Path(out_dir)
    trace_dir = out / "trace"
    if trace_dir.exists():
        # A previous demo's capture would be appended to as a second engine partition: replace it,
        # but only if a demo wrote it (its report is beside it).
        if not (out / "report.json").is_file():
            raise KmeshTraceError(f"{trace_dir} exists and was not written by a demo; choose another --out.")
        shutil.rmtree(trace_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = agent_workload(size=size)
    report: dict[str, Any] = {"out_dir": str(out.resolve()), "size": size}

    progress.stage("engine")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    run = _capture_workload(plan, out / "model", trace_dir, progress, timings)
    report["workload"] = {
        "num_requests": len(plan.requests), "num_families": len(plan.families),
        "num_children": sum(r.parent is not None for r in plan.requests),
        "num_competitors": sum(r.family is None for r in plan.requests),
        "block_size": plan.block_size, "num_gpu_blocks": plan.num_gpu_blocks, "num_engine_steps": run.num_steps,
    }

    from kmesh_trace.trace import open_trace

    trace = open_trace(trace_dir)
    report["workload"]["num_usable_blocks"] = trace.num_usable_blocks  # vLLM keeps one block as its null block
    report["info"] = {"tables": trace.row_counts(), "engines": trace.engines}
    report["capture_check"] = _check_against_outputs(trace, run)

    progress.stage("audit")
    from kmesh_trace.audit.capture import audit_capture

    report["audit"] = audit_capture(trace).to_dict()

    progress.stage("headroom")
    from kmesh_trace.oracle.headroom import headroom
    from kmesh_trace.apps.plots import plot_headroom

    usable = trace.num_usable_blocks
    if not usable:
        raise KmeshTraceError("the capture has no usable-block count; the demo cannot size its sweep.")
    capacities = sweep_capacities(int(usable))
    hr = headroom(trace, capacities, ["lru", "vllm", "belady"])
    report["headroom"] = hr.to_dict()
    report["headroom"]["capacities"] = capacities
    plots = [str(plot_headroom(hr, out / f"headroom.{ext}")) for ext in ("png", "svg")]

    progress.stage("pressure")
    from kmesh_trace.oracle.pressure import PressureOptions, run
    from kmesh_trace.oracle.workload import Workload

    ts = Workload.from_trace(trace)
    report["pressure"] = run(ts, PressureOptions(capacities=(int(usable),))).to_dict()
    points = run(ts, PressureOptions(capacities=tuple(capacities), sweep=True)).points
    report["pressure_sweep"] = [p.to_dict() for p in points]
    from kmesh_trace.apps.plots import plot_pressure_sweep

    plots += [str(plot_pressure_sweep(points, out / f"pressure.{ext}", ts.block_size)) for ext in ("png", "svg")]

    progress.stage("timeline")
    from kmesh_trace.apps.perfetto import export_perfetto

    report["timeline"] = export_perfetto(trace, out / "timeline.json")

    progress.stage("page")
    from kmesh_trace.apps.report import write_report

    write_report(trace_dir, out / "report.html", capacities=capacities)
    timings["total_s"] = time.perf_counter() - t0
    report["timings"] = {k: round(v, 2) for k, v in timings.items()}
    report["files"] = {"trace": str(trace_dir), "report": str(out / "report.json"), "page": str(out / "report.html"),
                       "plots": plots, "timeline": str(out / "timeline.json")}
    write_json_atomic(out / "report.json", report)
    return report


def _capture_workload(plan, model_dir: Path, trace_dir: Path, progress: Progress, timings: dict):
    from kmesh_trace.capture.session import capture_in_process
    from kmesh_trace.apps.tiny_engine import cpu_engine_env, make_engine, run_workload, write_tiny_model

    cpu_engine_env()
    # vLLM logs to stdout by default; the report is the demo's data, so its logs go to stderr, and
    # only errors among them.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    write_tiny_model(model_dir)
    t = time.perf_counter()
    with capture_in_process(trace_dir):
        llm = make_engine(model_dir, block_size=plan.block_size, num_gpu_blocks=plan.num_gpu_blocks,
                          max_model_len=plan.max_model_len)
        timings["engine_start_s"] = time.perf_counter() - t
        progress.stage("workload")
        t = time.perf_counter()
        run = run_workload(llm, plan, on_finish=progress.request_done)
        timings["workload_s"] = time.perf_counter() - t
    del llm
    return run


def _check_against_outputs(trace, run) -> dict[str, Any]:
    """The capture against what the engine returned to the caller: tokens and cached tokens."""
    inv = trace.frame("invocations")
    by_caller = {r["caller_request_id"] or r["request_id"]: r for r in inv.to_dicts()}
    mismatched_tokens, mismatched_cached, missing = [], [], []
    for name, prompt in run.prompts.items():
        row = by_caller.get(name)
        if row is None:
            missing.append(name)
            continue
        if list(row["prompt_token_ids"] or []) != prompt or list(row["output_token_ids"] or []) != run.outputs[name]:
            mismatched_tokens.append(name)
        if row["num_cached_tokens"] != run.num_cached_tokens[name]:
            mismatched_cached.append(name)
    return {"num_requests": len(run.prompts), "missing": missing, "token_mismatches": mismatched_tokens,
            "cached_token_mismatches": mismatched_cached,
            "ok": not (missing or mismatched_tokens or mismatched_cached)}
