"""`simulate SOURCE --out DIR`: the source's requests through vLLM's own scheduler in simulated time, as a trace."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer

from kmesh_trace.cli.common import (
    AllowIncompleteOption,
    EngineOption,
    SummaryJsonOption,
    err,
    handles_errors,
    open_input,
    out,
    print_json,
    progress,
)
from kmesh_trace.cli.display import Table
from kmesh_trace.cli.flags import flags, takes_flags
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.paths import check_out_dir
from kmesh_trace.values import MAX_BLOCKS, bounded_int


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate_cmd)


@flags
class SimulateFlags:
    """`simulate`'s flags: the source, the output, `vllm serve`'s engine flags, the arrivals and the step cost."""

    trace: Path = typer.Argument(..., help="Trace directory (a capture, a KV-events recording, an import), or a "
                                 "Mooncake/Bailian JSONL file or weka directory read as it is.")
    out_dir: Path = typer.Option(..., "--out", help="Trace directory to write the simulated run to (new or empty).")
    block_size: Optional[int] = typer.Option(None, "--block-size", parser=bounded_int(1, 1 << 20), help="Tokens per KV block (default: the source's).")
    num_gpu_blocks: Optional[int] = typer.Option(None, "--num-gpu-blocks-override", parser=bounded_int(1, MAX_BLOCKS),
                                                 help="Usable KV blocks of the GPU pool (default: the source engine's).")
    max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs", parser=bounded_int(1, 1 << 20), help="Requests in a batch at most (vLLM's default when left out).")
    max_num_batched_tokens: Optional[int] = typer.Option(None, "--max-num-batched-tokens", parser=bounded_int(1, 1 << 30),
                                                         help="Tokens in a step at most (vLLM's default when left out).")
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", parser=bounded_int(1, 1 << 30),
                                                help="Longest request (prompt + output) in tokens; longer ones are refused (default: the source's longest).")
    chunked_prefill: bool = typer.Option(True, "--enable-chunked-prefill/--no-enable-chunked-prefill", help="vLLM's chunked prefill.")
    arrivals: Optional[str] = typer.Option(None, "--arrivals", help="poisson:RATE: requests arrive at RATE per second (for a source without times, or to replace them).")
    concurrency: Optional[int] = typer.Option(None, "--concurrency", parser=bounded_int(1, 1 << 20), help="Keep N requests in the engine: a new one enters when one finishes.")
    seed: int = typer.Option(0, "--seed", parser=bounded_int(0, 1 << 62), help="Seed of the Poisson arrivals.")
    step_cost: Optional[Path] = typer.Option(None, "--step-cost", help="JSON object of the step-cost model's seconds: base_s, prefill_token_s, decode_seq_s, context_token_s (default: stated assumptions).")
    calibrate: Optional[Path] = typer.Option(None, "--calibrate", help="A capture whose scheduler steps the step-cost model is fitted to (judged on held-out steps; the error is printed and kept in the run's metadata).")
    engine: EngineOption = None
    allow_incomplete: AllowIncompleteOption = False
    as_json: SummaryJsonOption = False

    def options(self):
        from kmesh_trace.apps.simulate import SimulateOptions, parse_arrivals
        from kmesh_trace.oracle.step_cost import StepCost

        check_out_dir(self.out_dir, "--out")
        if self.out_dir.is_dir() and any(self.out_dir.iterdir()):
            raise KmeshTraceError(f"--out {self.out_dir} is not empty; give a new or empty directory.")
        if self.arrivals is not None:
            parse_arrivals(self.arrivals)
        if self.step_cost is not None and self.calibrate is not None:
            raise KmeshTraceError("give --step-cost or --calibrate, not both.")
        cost = StepCost() if self.step_cost is None else StepCost.from_file(self.step_cost)
        return SimulateOptions(self.block_size, self.num_gpu_blocks, self.max_model_len, self.max_num_seqs,
                               self.max_num_batched_tokens, self.chunked_prefill, self.arrivals, self.concurrency,
                               self.seed, cost)


@handles_errors
@takes_flags
def simulate_cmd(f: SimulateFlags) -> None:
    """Run the source's requests through vLLM's own scheduler and KV cache manager in simulated time (no model, no
    GPU) and write the run as a trace: hits, TTFT, throughput and preemptions under the engine flags you give.

    Each step's cost comes from a linear step-cost model (--step-cost FILE, or defaults that are stated
    assumptions); the hits are vLLM's own. The output directory reads as a capture (advise, headroom, sql).
    Exit codes: 0 ok; 1 could not run (usage, input, a configuration vLLM refuses, vLLM missing)."""
    from kmesh_trace.apps import simulate as sim
    from kmesh_trace.oracle.twin import build_scheduler, run_twin
    from kmesh_trace.oracle.workload import Workload

    options = f.options()
    calibration = None
    if f.calibrate is not None:
        options, calibration = _calibrated(options, f.calibrate)
    with open_input(f.trace, None, f.engine, f.allow_incomplete) as (t, _):
        w = Workload.from_trace(t, f.engine)
        w.refuse_hybrid("simulate")
        requests = list(w.requests)
        flags_, reqs, how = sim.plan(requests, w.block_size, w.num_usable_blocks, options)
    err.print("building vLLM's scheduler ...", markup=False, highlight=False)
    scheduler = build_scheduler(flags_)
    started = time.perf_counter()
    with progress() as bar:
        task = bar.add_task("simulating", total=len(reqs))
        res = run_twin(reqs, flags_, options.cost, concurrency=options.concurrency, scheduler=scheduler,
                       on_progress=lambda n: bar.advance(task, n))
    wall = time.perf_counter() - started
    info = {"engine": res.engine, "flags": asdict(res.flags), "step_cost": asdict(options.cost),
            "arrivals": how, "input": str(f.trace), **({"calibration": calibration} if calibration else {})}
    sim.write_trace(f.out_dir, requests, reqs, res, w.block_size, info)
    report = sim.summary(res, how, wall) | {"out": str(f.out_dir), "calibration": calibration}
    if f.as_json:
        return print_json(report)
    render(report)


def _calibrated(options, capture: Path):
    """`options` with the step-cost model fitted to `capture`'s steps, and the fit's report (printed here)."""
    from dataclasses import replace

    from kmesh_trace.apps.calibrate import fit_step_cost

    from kmesh_trace.trace import open_trace

    with open_trace(capture) as t:  # only its steps are read: a capture of any requests, complete or not
        cost, fit = fit_step_cost(t, str(capture))
    h = fit["held_out"]
    err.print(f"step cost calibrated on {capture}: held-out steps ({h['num_steps']:,}) median error "
              f"{100 * h['median_rel_error']:.1f}%, total time error {100 * (h['total_time_rel_error'] or 0):.1f}%",
              markup=False, highlight=False, soft_wrap=True)
    return replace(options, cost=cost), fit


def _s(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def render(d: dict) -> None:
    """The summary as a table (<= 80 columns) and a line saying it is simulated."""
    t = Table(title=f"simulated run ({d['engine']}, arrivals: {d['arrivals']})")
    t.add_column("figure")
    t.add_column("value", justify="right")
    hr = "-" if d["hit_ratio"] is None else f"{100 * d['hit_ratio']:.2f}%"
    rows = [("requests finished", f"{d['num_finished']:,} of {d['num_requests']:,}"),
            ("hit tokens / prompt tokens", f"{d['hit_tokens']:,} / {d['prompt_tokens']:,} ({hr})"),
            ("TTFT p50 / p90 / p99 (s)", " / ".join(_s(d["ttft_s"][k]) for k in ("p50", "p90", "p99"))),
            ("queue wait p50 / p90 (s)", " / ".join(_s(d["queue_wait_s"][k]) for k in ("p50", "p90"))),
            ("throughput (requests/s)", _s(d["requests_per_s"])),
            ("throughput (output tokens/s)", _s(d["output_tokens_per_s"])),
            ("preemptions (requests)", f"{d['num_preemptions']:,} ({d['num_preempted_requests']:,})"),
            ("scheduler steps", f"{d['num_steps']:,} in {d['simulated_s']:.1f} simulated s")]
    if d.get("calibration"):
        h = d["calibration"]["held_out"]
        rows.append(("step cost: held-out error (median / total)",
                     f"{100 * h['median_rel_error']:.1f}% / {100 * (h['total_time_rel_error'] or 0):.1f}%"))
    if d["num_never_fit"] or d["num_refused"]:
        rows.append(("never fit the pool / refused (too long)", f"{d['num_never_fit']:,} / {d['num_refused']:,}"))
    for k, v in rows:
        t.add_row(k, v)
    out.print(t)
    err.print(f"wrote {d['out']} (simulated; step costs: {d['step_cost']['source']})", markup=False, highlight=False,
              soft_wrap=True)
