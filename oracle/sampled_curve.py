"""The headroom curve from a spatial sample of the block ids (`--sample RATE`), or from k partitions of
them simulated apart and merged (`--partitions K`, on Ray tasks with `--ray`): `oracle.sampling` says how,
and why the merge is exact for the infinite cache only.

Every result is labelled: `CurveResult.sampling` says the method, the rate (or the partitions), the
error bound measured at that rate (`sampling.MEASURED_ERROR`) and, on this very stream, the infinite
cache's hit ratio from the sample against the exact one (the one capacity known exactly here). The
policies are the stack curves (`lru`, `belady`, scaled) and `belady-prefix` (a replay per grid capacity,
on the sample at C * rate, or on each partition at C / k); the `vllm` pool model pins the blocks of running
requests, whole requests, which a sample of block ids does not have, so it is not sampled. Without a cost
model (seconds follow from exact curves only).
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.curves import CURVES, HitCurve
from kmesh_trace.oracle.executor import Executor, InProcess, Task
from kmesh_trace.oracle.headroom_curve import WINDOWS, CurveResult, PolicyCurve, grid_capacities
from kmesh_trace.oracle.interruptible import run_all_interruptible
from kmesh_trace.oracle.policies import POLICIES
from kmesh_trace.oracle.policies.infinite import infinite_hits
from kmesh_trace.oracle.sampling import (Share, adjusted_curve, error_bound, measured_eligible, merged_curve, partition_shares,
                                         rate_share, scaled_curve, sub_stream)
from kmesh_trace.oracle.stream import AccessStream
from kmesh_trace.oracle.tasks import stream_at, task_source
from kmesh_trace.oracle.workload import Workload

__all__ = ["CORRECTIONS", "SAMPLED_POLICIES", "curve_of_sample", "partitioned_curve", "partition_levels",
           "sampled_curve"]

SAMPLED_POLICIES = ("lru", "belady-prefix", "belady")


def _names(policies: Sequence[str] | None) -> list[str]:
    names = [n for n in (policies or SAMPLED_POLICIES) if n != "infinite"]
    bad = [n for n in names if n not in SAMPLED_POLICIES]
    if bad:
        raise KmeshTraceError(f"a sampled curve covers {', '.join(SAMPLED_POLICIES)}, not {', '.join(bad)} (the vllm "
                              "pool model pins whole requests, which a sample of block ids does not have); drop it "
                              "from --policies or drop --sample.")
    return names


def _start(stream: AccessStream, window: str) -> int:
    if window not in WINDOWS:
        raise KmeshTraceError(f"unknown window {window!r}; the windows are {', '.join(WINDOWS)}.")
    return stream.num_requests // 2 if window == "last-half" else 0


def _result(stream: AccessStream, start: int, window: str, curves: dict[str, PolicyCurve], grid: list[int],
            num_usable_blocks: int | None, sampling: dict, exact_inf: int | None) -> CurveResult:
    """The result over `stream`'s requests (a sample's carry the whole stream's per-request columns);
    `exact_inf`: the whole stream's infinite-cache hits, None where it was never held (a sample taken at read)."""
    res = CurveResult(stream.block_size, window, stream.num_requests - start, int(stream.num_reads[start:].sum()),
                      int(stream.num_prompt_tokens[start:].sum()), exact_inf, grid, curves, None)
    sampled_ratio = sampling.pop("_inf") / max(res.num_reads, 1)
    if exact_inf is None:
        res.infinite_hit_blocks = round(sampled_ratio * res.num_reads)
        sampling["infinite_check"] = {"exact_hit_ratio": None, "sampled_hit_ratio": sampled_ratio, "delta": None}
    else:
        exact_ratio = exact_inf / res.num_reads if res.num_reads else 0.0
        sampling["infinite_check"] = {"exact_hit_ratio": exact_ratio, "sampled_hit_ratio": sampled_ratio,
                                      "delta": sampled_ratio - exact_ratio}
    res.sampling = sampling
    if num_usable_blocks:
        res.notes.append("a sampled curve has no stock: the vllm pool model is not sampled.")
    return res


def _step_curve(curve: HitCurve) -> PolicyCurve:
    lv, hb = curve.steps()
    return PolicyCurve(curve.policy, True, np.concatenate([[0], lv]), np.concatenate([[0], hb]))


def _grid(curves: dict[str, PolicyCurve], stream: AccessStream, fixed, extra) -> list[int]:
    if fixed:
        return sorted({int(c) for c in fixed})
    depth = max((int(c.capacities[-1]) for c in curves.values()), default=int(stream.num_objects))
    return grid_capacities(depth, extra)


def sampled_curve(stream: AccessStream, rate: float, *, policies: Sequence[str] | None = None, window: str = "all",
                  num_usable_blocks: int | None = None, grid: Sequence[int] | None = None,
                  workers: int | None = None, correction: str = "ratio", extra: dict | None = None) -> CurveResult:
    """The curve of `stream` from its spatial sample at `rate` (SHARDS; `belady-prefix` by mini-simulation),
    labelled with the measured error bound; rate 1 is the exact curve (the same numbers)."""
    start = _start(stream, window)
    share = rate_share(rate)
    sample = stream if share.fraction == 1 else sub_stream(stream, share)
    return curve_of_sample(sample, share.fraction, measured_eligible(stream, start), window=window,
                           policies=policies, num_usable_blocks=num_usable_blocks, grid=grid, workers=workers,
                           correction=correction, num_accesses=len(stream), nominal_rate=rate,
                           exact_inf=int(infinite_hits(stream)[start:].sum()), extra=extra)


#: How a sample's hits are scaled to the whole stream's: by E / E_s, the whole stream's eligible reads over
#: the sample's ("ratio"); SHARDS-adj ("adj": E * R - E_s reads added to the smallest capacity, then 1 / R);
#: or 1 / R alone ("none").
CORRECTIONS = ("ratio", "adj", "none")


def curve_of_sample(sample: AccessStream, fraction: float, eligible: int, *, window: str = "all",
                    policies: Sequence[str] | None = None, num_usable_blocks: int | None = None,
                    grid: Sequence[int] | None = None, workers: int | None = None, correction: str = "ratio",
                    num_accesses: int | None = None, nominal_rate: float | None = None,
                    exact_inf: int | None = None, extra: dict | None = None) -> CurveResult:
    """The whole stream's curve from `sample`, the accesses of the objects whose bucket is below `fraction` *
    SPACE (with the whole stream's per-request columns), however it was taken (after the stream was built:
    `sampled_curve`; while the input was read: oracle/shards.py); `eligible`: the whole stream's eligible reads
    over the measured window."""
    if correction not in CORRECTIONS:
        raise KmeshTraceError(f"unknown sample correction {correction!r}; the corrections are {', '.join(CORRECTIONS)}.")
    names = _names(policies)
    start = _start(sample, window)
    e, e_s = eligible, measured_eligible(sample, start)
    if e_s == 0 and e > 0:
        raise KmeshTraceError(f"the sample at rate {fraction:g} kept none of the {e:,} counted reads; use a larger rate.")
    factor = (e / e_s if e_s else 0.0) if correction == "ratio" else 1 / fraction
    delta = round(e * fraction) - e_s if correction == "adj" else 0
    curves = _stack_curves(sample, start, names, fraction, factor, delta, workers)
    grid_caps = _grid(curves, sample, grid, [num_usable_blocks or 0])
    w = Workload.of_stream(sample)
    for n in names:
        if n not in CURVES:
            hits = mini_simulation(n, w, start, [c * fraction for c in grid_caps]) + delta * (np.asarray(grid_caps) > 0)
            curves[n] = PolicyCurve(n, False, np.asarray(grid_caps, np.int64),
                                    np.rint(np.maximum(hits, 0) * factor).astype(np.int64))
    rate = fraction if nominal_rate is None else nominal_rate
    sampling = {"method": "shards", "rate": rate, "num_sampled_accesses": len(sample),
                "num_accesses": num_accesses, "scale": factor, "correction": correction,
                "error_bound": error_bound("shards", fraction),
                "_inf": round(max(int(infinite_hits(sample)[start:].sum()) + delta, 0) * factor), **(extra or {})}
    return _result(sample, start, window, {n: curves[n] for n in names}, grid_caps, num_usable_blocks, sampling,
                   exact_inf)


def _stack_curves(sample, start, names, fraction, factor, delta, workers) -> dict[str, PolicyCurve]:
    """The stack curves (one pass each) of the sample, SHARDS-adj's `delta` added, scaled to the whole stream."""
    one_pass = [n for n in names if n in CURVES]
    made = run_all_interruptible([partial(CURVES[n], sample, start) for n in one_pass], workers)
    if delta:
        made = [adjusted_curve(c, delta) for c in made]
    return {n: _step_curve(scaled_curve(c, fraction, factor) if fraction < 1 else c) for n, c in zip(one_pass, made)}


def mini_simulation(name: str, workload: Workload, start: int, capacities: Sequence[float]) -> np.ndarray:
    """`name`'s hit blocks over the requests from `start` on, replayed on a sample (or a partition) at each of
    `capacities` (fractional: C * rate), interpolated linearly between the whole capacities around it
    (0 blocks hit nothing), each whole capacity replayed once."""
    done: dict[int, float] = {0: 0.0}

    def at(c: int) -> float:
        if c not in done:
            done[c] = float(POLICIES[name].simulate(workload, c).hit_blocks_per_request[start:].sum())
        return done[c]

    out = []
    for c in capacities:
        lo = int(np.floor(c))
        out.append(at(lo) + (c - lo) * (at(lo + 1) - at(lo)) if c > lo else at(lo))
    return np.asarray(out, np.float64)


# ---- k partitions, simulated apart (Ray tasks, or here) and merged ------------------------------------


def partition_levels(source, engine: str | None, share: Share, names: Sequence[str], start: int,
                     grid: Sequence[int], k: int) -> tuple[dict[str, HitCurve], dict[str, np.ndarray], int]:
    """One partition's work (a task): its exact stack curves, `belady-prefix` etc. at each grid capacity C / k
    (hit blocks over the measured requests), and its infinite-cache hits. `source`: a Workload, or a
    trace location (a Ray task reads it: `oracle.tasks.stream_at`)."""
    stream = stream_at(source, engine)
    part = sub_stream(stream, share)
    curves = {n: CURVES[n](part, start) for n in names if n in CURVES}
    w = Workload.of_stream(part)
    grid_hits = {n: mini_simulation(n, w, start, [c / k for c in grid]) for n in names if n not in CURVES}
    return curves, grid_hits, int(infinite_hits(part)[start:].sum())


def partitioned_curve(workload: Workload, k: int, *, policies: Sequence[str] | None = None, window: str = "all",
                      grid: Sequence[int] | None = None, executor: Executor | None = None) -> CurveResult:
    """The curve of `workload` from `k` partitions of its block ids, each a task on `executor` (Ray tasks read
    the trace themselves), merged: exact for the infinite cache, error-bounded at finite capacities."""
    names = _names(policies)
    stream = workload.stream
    start = _start(stream, window)
    executor = executor or InProcess()
    shares = partition_shares(k)
    # The grid needs the curves' depth, known only once they are merged: without a fixed grid, the working
    # set bounds it (the curves go flat there at the latest).
    grid_caps = sorted({int(c) for c in grid}) if grid else grid_capacities(stream.num_objects,
                                                                             [workload.num_usable_blocks or 0])
    source = task_source(workload, executor)
    parts = executor.map(partition_levels, [Task(f"partition {p + 1} of {k}", (source, workload.engine, s, names,
                                                                               start, grid_caps, k))
                                            for p, s in enumerate(shares)])
    curves = {n: _step_curve(merged_curve([c[n] for c, _, _ in parts])) for n in names if n in CURVES}
    for n in names:
        if n not in CURVES:
            curves[n] = PolicyCurve(n, False, np.asarray(grid_caps, np.int64),
                                    np.rint(sum(g[n] for _, g, _ in parts)).astype(np.int64))
    sampling = {"method": "partitions", "partitions": k, "rate": 1.0 / k, "error_bound": error_bound("partitions", k),
                "_inf": sum(i for _, _, i in parts)}
    return _result(stream, start, window, {n: curves[n] for n in names}, grid_caps, workload.num_usable_blocks,
                   sampling, int(infinite_hits(stream)[start:].sum()))
