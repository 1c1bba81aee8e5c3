"""Headroom along the whole capacity axis: hit-ratio curves, the capacities that reach a share of the
infinite cache's hits, the bracket [belady-prefix, belady], and prefill seconds.

- `lru` and `belady` come exact at every capacity from one pass each (`curves`), side by side on two
  threads (their C kernels release the GIL).
- `vllm` (the stock model: running requests pin blocks, not a stack algorithm) and `belady-prefix`
  are replayed at a grid of capacities (powers of two up to the working set, plus the stock
  capacity), in parallel where the machine has cores to spare: on threads for a kernel that releases
  the GIL (both: their replays are C), in forked worker processes otherwise (`--processes` workers
  either way).
- `window`: "all" counts every request; "last-half" warms the caches with the first half of the
  requests and counts the second (the measurement window of KVCache.AI's kvcache-simulator).
- Stock: the capture's measured hits at its usable blocks when every invocation has them, else the
  `vllm` curve. Headroom at each grid capacity = `vllm` prefill - `belady` prefill.
- Seconds (with a `PrefillCost`): a request with h hit blocks computes positions [h * bs, prompt
  tokens), so its prefill seconds are cost.seconds(h * bs, P). `belady`'s hits need not be a prefix;
  they are charged as one, so its seconds are exact only where it agrees with `belady-prefix`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from typing import Sequence

import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.curves import CURVES, HitCurve
from kmesh_trace.oracle.executor import Executor, ForkPool, Task
from kmesh_trace.oracle.hybrid_pool import analysis_note, blocks_per_position
from kmesh_trace.oracle.interruptible import run_all_interruptible
from kmesh_trace.oracle.policies import POLICIES, Workload, get_policy, replay_point
from kmesh_trace.oracle.policies.infinite import infinite_hits
from kmesh_trace.oracle.prefill_cost import PrefillCost
from kmesh_trace.oracle.stream import AccessStream, check_block_size, pool_capacity

#: A bracket wider than this share of belady's hit tokens makes the headroom a range, not a number.
WIDE_BRACKET = 0.05
WINDOWS = ("all", "last-half")
DEFAULT_CURVE_POLICIES = ("lru", "vllm", "belady-prefix", "belady")
FRACTIONS = (0.5, 0.9, 0.99)
QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class PolicyCurve:
    """One policy's hit blocks at its capacities (every step of an exact curve, or the grid)."""

    policy: str
    exact: bool  # True: a one-pass curve, valid at every capacity between the points as a step function
    capacities: np.ndarray
    hit_blocks: np.ndarray
    prefill_seconds: np.ndarray | None = None

    def at(self, capacities: Sequence[int]) -> np.ndarray:
        """Hit blocks at `capacities` (an exact curve anywhere; a grid curve only at its own points)."""
        caps = np.asarray(capacities, np.int64)
        if self.exact:
            i = np.searchsorted(self.capacities, caps, side="right") - 1
            return np.where(i >= 0, self.hit_blocks[np.maximum(i, 0)], 0)
        pos = {int(c): k for k, c in enumerate(self.capacities)}
        return np.array([self.hit_blocks[pos[int(c)]] for c in caps], np.int64)


@dataclass
class CurveResult:
    block_size: int
    window: str
    num_requests: int  # measured
    num_reads: int
    num_prompt_tokens: int
    infinite_hit_blocks: int
    grid: list[int]
    curves: dict[str, PolicyCurve]
    stock: dict | None  # capacity_blocks, hit_blocks, prefill_tokens, source
    cost: PrefillCost | None = None
    cost_fit: dict | None = None
    base_prefill_seconds: float | None = None  # with no cache
    ttft: dict[str, dict] = field(default_factory=dict)  # policy -> prefill-seconds quantiles at stock capacity
    notes: list[str] = field(default_factory=list)
    note: str | None = None  # what a reader must know about the trace (approximate token ids)
    sampling: dict | None = None  # a sampled or partitioned curve (oracle/sampled_curve.py): how, and its error

    def rows(self) -> list[dict]:
        """One row per grid capacity: the table and the CSV (a sampled curve's rows say how it was sampled)."""
        rows = self.along_grid()
        if self.sampling is not None:
            how = (f"shards {self.sampling['rate']:g}" if self.sampling["method"] == "shards"
                   else f"partitions {self.sampling['partitions']}")
            rows = [{**row, "sampled": how} for row in rows]
        return rows

    def prefill_tokens(self, hit_blocks) -> np.ndarray:
        return self.num_prompt_tokens - np.asarray(hit_blocks, np.int64) * self.block_size

    def token_hit_ratio(self, hit_blocks: int) -> float:
        """Hit prompt tokens / prompt tokens (vLLM's prefix_cache_hits / prefix_cache_queries): a hit block
        covers block_size tokens, and no policy hits the block of a prompt's last token."""
        return hit_blocks * self.block_size / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def capacity_for_fraction(self) -> dict[str, dict[str, int | None]]:
        """Per policy, the smallest capacity whose hits reach each fraction of the infinite cache's (on a
        grid curve: the smallest grid capacity, an upper estimate)."""
        out: dict[str, dict[str, int | None]] = {}
        for name, cur in self.curves.items():
            row = {}
            for f in FRACTIONS:
                need = f * self.infinite_hit_blocks
                ok = np.flatnonzero(cur.hit_blocks >= need) if need > 0 else np.array([0])
                row[str(f)] = int(cur.capacities[ok[0]]) if len(ok) else None
            out[name] = row
        return out

    def along_grid(self) -> list[dict]:
        """Per grid capacity: each policy's hit ratio and prefill, headroom and the bracket's width."""
        rows = []
        hits = {name: cur.at(self.grid) for name, cur in self.curves.items()}
        secs = {name: self._seconds_at(name) for name in self.curves}
        for k, c in enumerate(self.grid):
            row: dict = {"capacity_blocks": c}
            for name in self.curves:
                h = int(hits[name][k])
                row[name] = {"hit_blocks": h, "hit_ratio": h / self.num_reads if self.num_reads else 0.0,
                             "token_hit_ratio": self.token_hit_ratio(h),
                             "prefill_tokens": int(self.prefill_tokens(h))}
                if secs[name] is not None:
                    row[name]["prefill_seconds"] = float(secs[name][k])
            if "vllm" in hits and "belady" in hits:
                row["headroom_tokens"] = int(hits["belady"][k] - hits["vllm"][k]) * self.block_size
                if secs["vllm"] is not None:
                    row["headroom_seconds"] = float(secs["vllm"][k] - secs["belady"][k])
            if "belady-prefix" in hits and "belady" in hits:
                row["bracket_width_tokens"] = int(hits["belady"][k] - hits["belady-prefix"][k]) * self.block_size
            rows.append(row)
        return rows

    def _seconds_at(self, name: str) -> np.ndarray | None:
        cur = self.curves[name]
        if cur.prefill_seconds is None:
            return None
        if cur.exact:
            i = np.searchsorted(cur.capacities, np.asarray(self.grid), side="right") - 1
            return np.where(i >= 0, cur.prefill_seconds[np.maximum(i, 0)], self.base_prefill_seconds)
        return cur.prefill_seconds[[list(cur.capacities).index(c) for c in self.grid]]

    def wide_brackets(self) -> list[int]:
        """Grid capacities where belady-prefix falls short of belady by more than WIDE_BRACKET of belady's hits."""
        if "belady-prefix" not in self.curves or "belady" not in self.curves:
            return []
        b, p = self.curves["belady"].at(self.grid), self.curves["belady-prefix"].at(self.grid)
        return [c for c, hb, hp in zip(self.grid, b, p) if hb > 0 and (hb - hp) > WIDE_BRACKET * hb]

    def to_dict(self) -> dict:
        d = {
            "block_size": self.block_size, "window": self.window, "num_requests": self.num_requests,
            "num_reads": self.num_reads, "num_prompt_tokens": self.num_prompt_tokens,
            "infinite": {"hit_blocks": self.infinite_hit_blocks,
                         "hit_ratio": self.infinite_hit_blocks / self.num_reads if self.num_reads else 0.0,
                         "token_hit_ratio": self.token_hit_ratio(self.infinite_hit_blocks)},
            "curves": {name: {"exact": c.exact, "capacities": c.capacities.tolist(), "hit_blocks": c.hit_blocks.tolist(),
                              **({"prefill_seconds": c.prefill_seconds.tolist()} if c.prefill_seconds is not None else {})}
                       for name, c in self.curves.items()},
            "capacity_for_fraction_of_infinite": self.capacity_for_fraction(),
            "grid": self.along_grid(),
            "stock": self.stock,
            "wide_bracket_capacities": self.wide_brackets(),
        }
        if self.cost is not None:
            d["prefill_cost"] = self.cost.to_json()
            d["prefill_cost_fit"] = self.cost_fit
            d["no_cache_prefill_seconds"] = self.base_prefill_seconds
            d["ttft_estimate_seconds"] = self.ttft
        if self.note:
            d["note"] = self.note
        if self.sampling is not None:
            d["sampled"] = self.sampling
        if self.cost is None and self.cost_fit is not None:  # fitted, but not usable: say so in the JSON too
            d["prefill_cost_fit"] = self.cost_fit
        return d


def stock_choice(workload: Workload, model: str) -> tuple[np.ndarray | None, list[str]]:
    """The one choice of a headroom's stock, for the point and the curve: the engine's measured hit tokens per
    request (a capture's) when every request has them and the usable blocks they were measured at are known;
    else None (the `vllm` model stands in), with the note a reader needs when the hit counts exist without a
    usable-block count (`model`: what stands in, the vllm "model" or "curve")."""
    tokens = workload.stock_tokens
    if tokens is None:
        return None, []
    if workload.num_usable_blocks:
        return tokens, []
    return None, [f"the capture has engine hit counts but no usable-block count; stock is the vllm {model}."]


def grid_capacities(max_capacity: int, extra: Sequence[int] = ()) -> list[int]:
    """Powers of two from 1 up to the first at or above `max_capacity`, plus `extra`, and the powers of two
    below the largest of `extra`: a capture whose curves go flat at 4 blocks in an engine of 8,191 reads
    1, 2, 4, 8, ..., 4,096, 8,191, with no jump from 4 to 8,191."""
    extra = {int(c) for c in extra if c and c > 0}
    top = max(2 * max(int(max_capacity), 1) - 1, max(extra, default=0) - 1)
    caps = {1 << k for k in range(top.bit_length()) if (1 << k) <= top}
    return sorted(caps | extra)


def headroom_curve(workload: Workload, *, policies: Sequence[str] | None = None, window: str = "all",
                   cost: PrefillCost | None = None, cost_fit: dict | None = None, grid: Sequence[int] | None = None,
                   processes: int | None = None, progress=None, executor: Executor | None = None) -> CurveResult:
    """Curves of `policies` over `workload`: its requests (arrival order), or its bare access stream (with the
    engine's measured hit tokens per request, `Workload.stock_tokens`, when known; `vllm` needs the requests'
    `columns` beside it); see the module docstring. The grid replays run on `executor` (default: `processes`
    forked workers). On a hybrid engine's workload (its KV cache groups) the `vllm` curve replays its pool;
    the others replay prefix positions (`policies.replay_point`)."""
    block_size = check_block_size(workload.block_size)
    num_usable_blocks = workload.num_usable_blocks
    if window not in WINDOWS:
        raise KmeshTraceError(f"unknown window {window!r}; the windows are {', '.join(WINDOWS)}.")
    names = list(policies or DEFAULT_CURVE_POLICIES)
    for name in names:
        get_policy(name)
    names = [n for n in names if n != "infinite"]  # always reported, as the reference
    if workload.requests is None and workload.columns is None and "vllm" in names:
        raise KmeshTraceError("the vllm policy replays requests, not a bare access stream; build the workload from a trace.")
    # A one-pass curve is over prefix positions; on a hybrid engine a pool of C blocks serves C // n of them
    # (n full-attention groups), so its steps sit at n times its capacities.
    per_position = 1
    if workload.hybrid and any(n != "vllm" for n in names):
        per_position = blocks_per_position(workload.groups)
    stream = workload.stream
    start = stream.num_requests // 2 if window == "last-half" else 0
    step = progress or (lambda what: None)

    fixed = sorted({int(c) for c in grid}) if grid else None
    if fixed is not None and any(c <= 0 for c in fixed):
        raise KmeshTraceError("capacities must be positive block counts.")
    # The vllm grid replays the pool at the trace's usable blocks too: a size from metadata is checked as a flag's.
    extra = [pool_capacity(None, num_usable_blocks) if num_usable_blocks and "vllm" in names else num_usable_blocks or 0]
    P = stream.num_prompt_tokens
    base = None if cost is None else cost.seconds_array(np.zeros_like(P[start:]), P[start:])  # no cache

    def exact_curve(name: str, hit_curve: HitCurve) -> PolicyCurve:
        """A one-pass curve's steps (and seconds), made as its pass ends: its histograms over every level go."""
        lv, hb = hit_curve.steps()
        cur = PolicyCurve(name, True, np.concatenate([[0], lv]) * per_position, np.concatenate([[0], hb]))
        if cost is not None:
            cur.prefill_seconds = float(base.sum()) - hit_curve.saved_seconds(cur.capacities, cost)
        return cur

    executor = executor or ForkPool(processes)
    workers = _thread_workers(executor, [n for n in names if n not in CURVES])
    if workers is not None:
        curves, grid, per_request = _curves_and_grid(workload, start, names, fixed, extra, workers, step, exact_curve)
    else:
        curves, grid, per_request = _curves_then_grid(workload, start, names, fixed, extra, executor, step,
                                                      exact_curve)
    for name, rows in per_request.items():
        curves[name] = PolicyCurve(name, False, np.asarray(grid, np.int64), rows[:, start:].sum(axis=1))

    curves = {name: curves[name] for name in names}  # in the order asked for
    inf = infinite_hits(stream)
    res = CurveResult(block_size, window, stream.num_requests - start, int(stream.num_reads[start:].sum()),
                      int(P[start:].sum()), int(inf[start:].sum()), grid, curves, None, cost, cost_fit)
    if workload.hybrid:
        res.notes.append(analysis_note(workload.groups))

    # Stock: measured (capture), else the vllm model at the usable blocks.
    stock_tokens, stock_notes = stock_choice(workload, "curve")
    if stock_tokens is not None:
        hit = int(stock_tokens[start:].sum())
        res.stock = {"source": "capture", "capacity_blocks": int(num_usable_blocks), "hit_tokens": hit,
                     "prefill_tokens": res.num_prompt_tokens - hit}
    elif num_usable_blocks and "vllm" in curves:
        if curves["vllm"].exact or num_usable_blocks in grid:
            h = int(curves["vllm"].at([num_usable_blocks])[0])
        else:  # a grid given without the stock capacity
            h = int(POLICIES["vllm"].simulate(workload, num_usable_blocks).hit_blocks_per_request[start:].sum())
        res.stock = {"source": "vllm", "capacity_blocks": int(num_usable_blocks), "hit_tokens": h * block_size,
                     "prefill_tokens": res.num_prompt_tokens - h * block_size}
    res.notes += stock_notes

    if cost is not None:
        res.base_prefill_seconds = float(base.sum())
        for name, cur in curves.items():
            if not cur.exact:  # an exact curve's seconds came with it
                hits = per_request[name][:, start:]
                cur.prefill_seconds = np.array([cost.seconds_array(h * block_size, P[start:]).sum() for h in hits])
        if res.stock is not None:
            cap = res.stock["capacity_blocks"]
            if stock_tokens is not None:
                res.stock["prefill_seconds"] = float(cost.seconds_array(stock_tokens[start:], P[start:]).sum())
                res.ttft["stock"] = _quantiles(cost.seconds_array(stock_tokens[start:], P[start:]))
            for name in names:
                if name in per_request and cap in grid:
                    h = per_request[name][grid.index(cap), start:]
                else:
                    h = _replay_point(name, workload, cap)[start:]
                res.ttft[name] = _quantiles(cost.seconds_array(h * block_size, P[start:]))
            res.ttft["no cache"] = _quantiles(base)
    if res.wide_brackets():
        res.notes.append(f"the bracket [belady-prefix, belady] is wider than {WIDE_BRACKET:.0%} of belady's hits at "
                         f"{len(res.wide_brackets())} capacities: the headroom there is a range, not a number "
                         "(a prefix cache may not reach belady).")
    return res


def _quantiles(x: np.ndarray) -> dict:
    if len(x) == 0:
        return {}
    return {"mean": float(x.mean()), **{f"p{int(q * 100)}": float(np.quantile(x, q)) for q in QUANTILES}}


# ---- the one-pass curves and the grid replays ----------------------------------------------------------


def _grid_for(exact: dict[str, PolicyCurve], stream: AccessStream, extra) -> list[int]:
    """The grid reaches the depth where the exact curves go flat, their last step (every object, without one)."""
    return grid_capacities(max((int(c.capacities[-1]) for c in exact.values()), default=int(stream.num_objects)),
                           extra)


def _thread_workers(executor: Executor, on_grid: Sequence[str]) -> int | None:
    """Threads for the curves and the grid replays in one pool (every kernel releases the GIL), or None when
    the grid must run on `executor` itself (forked workers, Ray, or an executor that reports progress)."""
    if not isinstance(executor, ForkPool) or executor.on_start is not None or executor.on_done is not None:
        return None
    if not all(getattr(POLICIES[name], "releases_gil", False) for name in on_grid):
        return None
    return executor.processes or os.cpu_count() or 1


def _one_pass(name: str, stream: AccessStream, start: int, exact_curve) -> PolicyCurve:
    """`name`'s one-pass curve as `exact_curve` makes it, on the worker that ran the pass (its histograms over
    every level are gone when the call returns)."""
    return exact_curve(name, CURVES[name](stream, start))


def _curves_and_grid(workload: Workload, start: int, names: list[str], fixed: list[int] | None, extra,
                     workers: int, step, exact_curve) -> tuple[dict[str, PolicyCurve], list[int], dict[str, np.ndarray]]:
    """The one-pass curves and the grid replays on one pool of `workers` threads: a grid capacity is replayed
    as soon as it is known to be on the grid (a finished curve's depth is a lower bound of the grid's, and
    the grid only grows with it), so the replays fill the cores while the longest curve still runs. The
    same results as `_curves_then_grid`."""
    stream = workload.stream
    one_pass = [n for n in names if n in CURVES]
    on_grid = [n for n in names if n not in CURVES]
    step(", ".join(filter(None, [" and ".join(one_pass) + (" curves" if len(one_pass) > 1 else " curve") if one_pass else "",
                                 " and ".join(on_grid) + " on a grid of capacities" if on_grid else ""])))
    exact: dict[str, PolicyCurve] = {}
    hits: dict[tuple[str, int], np.ndarray] = {}
    tags: list[tuple] = [("curve", n) for n in one_pass]  # what call i computes

    def replays(capacities) -> list:
        calls = []  # the largest capacities first, the policies alternating: the longest replays start first,
        for c in sorted(capacities, reverse=True):  # and two large pools of one policy rarely run at once
            for name in on_grid:
                if ("grid", name, c) not in tags_seen:
                    tags_seen.add(("grid", name, c))
                    tags.append(("grid", name, c))
                    calls.append(partial(_replay_point, name, workload, c))
        return calls

    def then(i: int, result) -> list:
        kind, *key = tags[i]
        if kind == "grid":
            hits[tuple(key)] = result
            return []
        exact[key[0]] = result
        return replays(fixed or _grid_for(exact, stream, extra))  # at most the final grid: it only grows

    tags_seen: set = set()
    first = [partial(_one_pass, n, stream, start, exact_curve) for n in one_pass]
    if fixed is not None or not one_pass:  # the grid is known before any curve
        first += replays(fixed or _grid_for(exact, stream, extra))
    run_all_interruptible(first, workers, then=then)
    grid = fixed or _grid_for(exact, stream, extra)
    empty = np.zeros((0, stream.num_requests), np.int64)
    return ({n: exact[n] for n in one_pass}, grid,
            {n: np.vstack([hits[(n, c)] for c in grid]) if grid else empty for n in on_grid})


def _curves_then_grid(workload: Workload, start: int, names: list[str], fixed: list[int] | None, extra,
                      executor: Executor, step, exact_curve) -> tuple[dict[str, PolicyCurve], list[int],
                                                                      dict[str, np.ndarray]]:
    """The one-pass curves side by side (their kernels release the GIL), then each grid policy's replays on
    `executor`."""
    stream = workload.stream
    one_pass = [n for n in names if n in CURVES]
    exact: dict[str, PolicyCurve] = {}
    if one_pass:
        step(" and ".join(one_pass) + (" curves" if len(one_pass) > 1 else " curve"))
        made = run_all_interruptible([partial(_one_pass, n, stream, start, exact_curve) for n in one_pass])
        exact = dict(zip(one_pass, made))
    grid = fixed or _grid_for(exact, stream, extra)
    per_request = {}
    for name in names:
        if name not in CURVES:
            step(f"{name} at {len(grid)} capacities")
            per_request[name] = simulate_grid(name, workload, grid, executor=executor)
    return exact, grid, per_request


# ---- replaying a policy at many capacities, in parallel where cores allow ---------------------------


def _replay_point(name: str, workload: Workload, cap: int) -> np.ndarray:
    return replay_point(workload, name, cap).hit_blocks_per_request


def simulate_grid(name: str, workload: Workload, capacities: Sequence[int], processes: int | None = None,
                  executor: Executor | None = None) -> np.ndarray:
    """Per-request hit blocks of `name` at each capacity (rows), on `executor` (default: worker processes
    forked when more than one core is free and the platform forks, sharing the workload; else one after
    another). A policy whose kernel releases the GIL (`releases_gil`) runs on as many threads instead of
    forked processes: the same parallelism, without the fork or its copied pages."""
    workload.stream  # built once, before any fork or thread
    executor = executor or ForkPool(processes)
    if isinstance(executor, ForkPool) and getattr(POLICIES[name], "releases_gil", False):
        executor = executor.threads()
    rows = executor.map(_replay_point, [Task(f"{name} at {int(c)} blocks", (name, workload, int(c))) for c in capacities])
    return np.vstack(rows) if rows else np.zeros((0, workload.stream.num_requests), np.int64)
