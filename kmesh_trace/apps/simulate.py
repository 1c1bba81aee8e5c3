"""`simulate`: a trace's requests run through the twin (`kmesh_trace.oracle.twin`), written as a trace.

`plan` turns a workload and the user's engine flags into the twin's inputs (the engine flags, each
request's token ids and arrival); `write_trace` writes the run as a trace directory in the capture schema
(one engine partition, `source` simulate:vllm, the run's flags, step-cost model and arrivals in the
metadata's `simulation`), its invocations carrying what the twin measured (hits, first-scheduled,
first-token and finish times, preemptions) and its steps the twin's scheduler steps, so the analyses read it as they read a capture; `summary`
gives the figures a user reads first (hit ratio, TTFT percentiles, throughput, preemptions).
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.step_cost import StepCost
from kmesh_trace.oracle.stream import RequestBlocks
from kmesh_trace.oracle.twin import EngineFlags, TwinRequest, TwinResult, twin_requests

__all__ = ["SimulateOptions", "plan", "write_trace", "summary", "parse_arrivals", "SIMULATED_SOURCE"]

SIMULATED_SOURCE = "simulate:vllm"
_PART_ROWS = 50_000


@dataclass(frozen=True)
class SimulateOptions:
    """The user's engine flags (None: the trace's, or vLLM's default) and how requests arrive."""

    block_size: int | None = None
    num_gpu_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    chunked_prefill: bool = True
    arrivals: str | None = None  # poisson:RATE (requests per second)
    concurrency: int | None = None
    seed: int = 0
    cost: StepCost = StepCost()


def parse_arrivals(text: str) -> float:
    """The rate of `poisson:RATE` (requests per second, positive, finite)."""
    kind, _, rate = text.partition(":")
    try:
        value = float(rate)
    except ValueError:
        value = float("nan")
    if kind != "poisson" or not (0 < value < float("inf")):
        raise KmeshTraceError(f"--arrivals takes poisson:RATE with RATE requests per second above zero (got {text!r}).")
    return value


def _arrivals(requests: Sequence[RequestBlocks], o: SimulateOptions) -> tuple[list[float] | None, str]:
    """(arrival times or None, how they were placed): Poisson, by concurrency, or the trace's own."""
    if o.arrivals is not None and o.concurrency is not None:
        raise KmeshTraceError("give --arrivals or --concurrency, not both.")
    if o.arrivals is not None:
        rate, rng, t = parse_arrivals(o.arrivals), random.Random(o.seed), 0.0
        times = []
        for _ in requests:
            times.append(t)
            t += rng.expovariate(rate)
        return times, f"{o.arrivals} (seed {o.seed})"
    if o.concurrency is not None:
        return None, f"concurrency:{o.concurrency}"
    if any(r.arrival_ns is None for r in requests):
        raise KmeshTraceError("the source has no arrival times; give --arrivals poisson:RATE or --concurrency N.")
    return None, "the trace's own"


def plan(requests: Sequence[RequestBlocks], block_size: int, usable: int | None, o: SimulateOptions
         ) -> tuple[EngineFlags, list[TwinRequest], str]:
    """(the engine flags, the twin's requests, how they arrive) of a workload's requests under options `o`."""
    if not requests:
        raise KmeshTraceError("the source has no requests to simulate.")
    blocks = o.num_gpu_blocks if o.num_gpu_blocks is not None else usable
    if blocks is None:
        raise KmeshTraceError("the source does not state its engine's KV pool; give --num-gpu-blocks-override N.")
    times, how = _arrivals(requests, o)
    reqs = twin_requests(requests, block_size, times)
    bs = o.block_size or block_size
    longest = max(q.num_prompt_tokens + q.num_output_tokens for q in reqs)
    flags = EngineFlags(bs, blocks, o.max_model_len or -(-longest // bs) * bs, o.max_num_seqs,
                        o.max_num_batched_tokens, o.chunked_prefill)
    return flags, reqs, how


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    a = np.asarray(values, float)
    return {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}


def summary(res: TwinResult, arrivals: str, wall_s: float | None = None) -> dict:
    """The run's figures: hits, TTFT and queue-wait percentiles, throughput, preemptions, what was refused."""
    recs = res.requests
    done = [r for r in recs if r.status == "finished"]
    prompt = sum(r.num_prompt_tokens for r in done)
    hits = sum(r.num_cached_tokens or 0 for r in done)
    start = min((r.arrival_s for r in recs), default=0.0)
    span = res.end_s - start
    out_tokens = sum(r.num_output_tokens for r in done)
    return {
        "simulated": True, "engine": res.engine, "arrivals": arrivals,
        "num_requests": len(recs), "num_finished": len(done),
        "num_never_fit": sum(r.status == "error" for r in recs), "num_refused": sum(r.status == "refused" for r in recs),
        "prompt_tokens": prompt, "hit_tokens": hits, "hit_ratio": hits / prompt if prompt else None,
        "ttft_s": _percentiles([r.ttft_s for r in done]), "queue_wait_s": _percentiles([r.queue_wait_s for r in done]),
        "simulated_s": span, "requests_per_s": len(done) / span if span > 0 else None,
        "output_tokens_per_s": out_tokens / span if span > 0 else None,
        "num_preemptions": sum(r.num_preemptions for r in recs),
        "num_preempted_requests": sum(r.num_preemptions > 0 for r in recs),
        "num_steps": len(res.steps), "flags": asdict(res.flags), "step_cost": asdict(res.cost),
        "wall_s": wall_s, "steps_per_wall_s": len(res.steps) / wall_s if wall_s else None,
    }


def _ns(s: float | None) -> int | None:
    return None if s is None else int(round(s * 1e9))


def _rows(requests: Sequence[RequestBlocks], reqs: Sequence[TwinRequest], res: TwinResult, hashes: bool) -> list[dict]:
    """One invocation row per request (arrival order): the source's prompt (ids, or its block hashes when
    `hashes`), the tokens the twin sampled, and what vLLM's scheduler did with it."""
    ids = [r.request_id for r in requests]
    rows = []
    for k, (r, q, rec) in enumerate(zip(requests, reqs, res.requests)):
        finished = rec.status == "finished"
        prompt, output = q.tokens() if finished or not hashes else (None, None)
        rows.append({
            "request_id": r.request_id, "seq": k, "family_id": r.family_id,
            "parent_id": None if r.parent_index is None else ids[r.parent_index],
            "num_expected_children": r.num_expected_children, "num_prompt_tokens": q.num_prompt_tokens,
            "num_output_tokens": q.num_output_tokens if finished else None,
            "prompt_token_ids": None if hashes else prompt, "output_token_ids": output if finished else None,
            "prompt_block_hashes": [h & ((1 << 64) - 1) for h in r.prompt_hashes] if hashes else None,
            "arrival_ns": _ns(rec.arrival_s), "first_scheduled_ns": _ns(rec.first_scheduled_s),
            "first_token_ns": _ns(rec.first_token_s), "finish_ns": _ns(rec.finish_s),
            "status": "finished" if finished else "error", "num_cached_tokens": rec.num_cached_tokens or 0,
            "num_external_tokens": 0, "num_preemptions": rec.num_preemptions})
    return rows


def write_trace(out: Path, requests: Sequence[RequestBlocks], reqs: Sequence[TwinRequest], res: TwinResult,
                source_block_size: int, info: dict) -> None:
    """Write the run as a trace directory at `out` (one engine partition, marked simulated; see the module)."""
    from kmesh_trace.writer import TraceWriter

    hashes = all(r.prompt_token_ids is None for r in requests) and res.flags.block_size == source_block_size
    approximate = not hashes and any(r.prompt_token_ids is None for r in requests)
    meta = {"engine_index": 0, "engine": f"{res.engine} (simulated: kmesh-trace twin)", "model": "none (twin: no weights)",
            "block_size": res.flags.block_size, "num_usable_blocks": res.flags.num_gpu_blocks, "null_block_id": 0,
            "wall_anchor_ns": time.time_ns(), "mono_anchor_ns": 0, "simulation": info,
            **({"token_ids_approximate": True, "tokenizer": "ids derived from block hashes"} if approximate else {})}
    with TraceWriter(out, "twin-0", meta, source=SIMULATED_SOURCE) as w:
        rows = _rows(requests, reqs, res, hashes)
        for lo in range(0, len(rows), _PART_ROWS):
            w.write("invocations", rows[lo:lo + _PART_ROWS])
        for lo in range(0, len(res.steps), _PART_ROWS):
            w.write("steps", _step_columns(res.steps[lo:lo + _PART_ROWS], lo))


def _step_columns(steps, first: int) -> dict:
    """The steps rows of the twin's steps (numbered from `first` + 1; a decode computes one token)."""
    start = [_ns(s.start_s) for s in steps]
    return {"step": list(range(first + 1, first + 1 + len(steps))), "start_ns": start,
            "finish_ns": [a + _ns(s.duration_s) for a, s in zip(start, steps)],
            "num_scheduled_tokens": [s.num_prefill_tokens + s.num_decode_seqs for s in steps],
            "num_prefill_tokens": [s.num_prefill_tokens for s in steps],
            "num_decode_tokens": [s.num_decode_seqs for s in steps], "batch_size": [s.batch_size for s in steps],
            "num_prefill_requests": [s.batch_size - s.num_decode_seqs for s in steps],
            "num_decode_requests": [s.num_decode_seqs for s in steps],
            "num_context_tokens": [s.num_context_tokens for s in steps],
            "num_preempted": [s.num_preempted for s in steps], "num_waiting": [None] * len(steps)}
