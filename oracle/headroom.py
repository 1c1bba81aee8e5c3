"""The headroom bound: how many prefill tokens the stock prefix cache left on the table.

Replays a trace's block access stream through each requested policy at each capacity and compares
the stock cache with the Belady bound (docs/DESIGN.md, "Definitions"). Stock is read
from the capture when every invocation has an engine hit count (`num_cached_tokens`), else it is
the `vllm` block-pool model. headroom_tokens = stock prefill - belady prefill, at the capacity the
stock cache had: the trace's usable blocks when the trace records them (and, for a modelled stock,
they are among the capacities asked for), else the first capacity asked for.

What each policy counts as a hit (all share the token rules in `policies.base`):
- infinite: any eligible prompt read of a block written before;
- lru, vllm: a prefix lookup, stopping at the request's first miss;
- belady: any eligible prompt read of a resident block, the cache chosen with the future known;
- belady-prefix: a prefix lookup on a prefix-tree cache chosen with the future known (reachable).
[belady-prefix, belady] brackets the best any prefix cache could do; a wide bracket is noted.
With a `PrefillCost`, every policy's prefill is also given in seconds (`prefill_seconds`), and the
headroom too. Whole curves over capacity are `headroom_curve`'s.
A read is eligible when it is one of the first (num_prompt_tokens - 1) // block_size blocks; every
prompt block hash the trace lists (an import's partial last block included) is one read.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.executor import Executor, InProcess, Task
from kmesh_trace.oracle.headroom_curve import WIDE_BRACKET, headroom_curve, stock_choice
from kmesh_trace.oracle.hybrid_pool import analysis_note
from kmesh_trace.oracle.options import option
from kmesh_trace.oracle.policies import PolicyResult, get_policy, replay_point
from kmesh_trace.oracle.policies.base import result_of
from kmesh_trace.oracle.prefill_cost import PrefillCost, usable_fit
from kmesh_trace.oracle.sampled_curve import CORRECTIONS, SAMPLED_POLICIES, partitioned_curve, sampled_curve
from kmesh_trace.oracle.sampling import accesses_for_bytes, bounded_rate
from kmesh_trace.oracle.stream import RequestBlocks, check_block_size, pool_capacity
from kmesh_trace.oracle.tasks import task_source, workload_at
from kmesh_trace.oracle.workload import Workload
from kmesh_trace.resources import MEMORY_FRACTION, available_memory, check_fits, pool_bytes

DEFAULT_POLICIES = ("infinite", "lru", "vllm", "belady-prefix", "belady")
#: Replays (policy, capacity) points and returns their results in the same order.
Simulate = Callable[[list[tuple[str, int]]], list[PolicyResult]]


@dataclass
class HeadroomResult:
    block_size: int
    results: list[PolicyResult]
    headroom_tokens: int | None
    headroom_capacity_blocks: int | None
    stock_source: str | None  # "capture", "vllm", or None when no stock could be had
    stock: PolicyResult | None = None
    notes: list[str] = field(default_factory=list)
    bound: PolicyResult | None = None
    cost: PrefillCost | None = None  # when set, to_dict adds prefill seconds
    note: str | None = None  # what a reader must know about the trace (approximate token ids)

    def bracket(self) -> dict | None:
        """[belady-prefix, belady] prefill tokens at the headroom capacity, when both were replayed there."""
        low = _find(self.results, "belady-prefix", self.headroom_capacity_blocks)
        if low is None or self.bound is None:
            return None
        width = low.prefill_tokens - self.bound.prefill_tokens
        return {"belady_prefix_prefill_tokens": low.prefill_tokens, "belady_prefill_tokens": self.bound.prefill_tokens,
                "width_tokens": width, "wide": width > WIDE_BRACKET * max(self.bound.hit_tokens, 1)}

    def to_dict(self) -> dict:
        rows = [r.to_dict() for r in self.results]
        if self.stock is not None and self.stock_source == "capture":
            rows.append(self.stock.to_dict())
        d = {
            "block_size": self.block_size,
            "results": rows,
            "headroom_tokens": self.headroom_tokens,
            "headroom_capacity_blocks": self.headroom_capacity_blocks,
            "stock_source": self.stock_source,
        }
        if (bracket := self.bracket()) is not None:
            d["bracket"] = bracket
        if self.cost is not None:
            results = self.results + ([self.stock] if self.stock is not None and self.stock_source == "capture" else [])
            for row, r in zip(rows, results):
                row["prefill_seconds"] = prefill_seconds(r, self.cost)
            d["prefill_cost"] = self.cost.to_json()
            if self.stock is not None and self.bound is not None:
                d["headroom_seconds"] = prefill_seconds(self.stock, self.cost) - prefill_seconds(self.bound, self.cost)
        if self.note:
            d["note"] = self.note
        return d

    def rows(self) -> list[dict]:
        """One row per (policy, capacity) replay: the table and the CSV."""
        return self.to_dict()["results"]


def prefill_seconds(result: PolicyResult, cost: PrefillCost) -> float:
    """Prefill seconds of a replay: each request computes positions [hit tokens, prompt tokens)."""
    return float(cost.seconds_array(result.hit_tokens_per_request, result.num_prompt_tokens).sum())


def headroom(trace, capacities: Sequence[int] | None = None, policies: Sequence[str] | None = None, *,
             engine: str | None = None, simulate: Simulate | None = None) -> HeadroomResult:
    """Headroom of an opened trace (`kmesh_trace.trace.open_trace`)."""
    w = Workload.from_trace(trace, engine)
    return headroom_of_requests(w.requests, w.block_size, capacities, policies, num_usable_blocks=w.num_usable_blocks,
                                simulate=simulate, groups=w.groups, retention_interval=w.retention_interval)


def headroom_of_requests(requests: Sequence[RequestBlocks], block_size: int | None,
                         capacities: Sequence[int] | None = None, policies: Sequence[str] | None = None, *,
                         num_usable_blocks: int | None = None, simulate: Simulate | None = None,
                         groups: tuple = (), retention_interval: int | None = 0) -> HeadroomResult:
    """`simulate(points)`, when given, replays the (policy, capacity) points (e.g. as distributed tasks,
    `headroom_point`) and returns their results in order. `groups`: the engine's
    KV cache groups (and vLLM's retention interval); on a hybrid engine each replay is `policies.replay_point`'s
    (docs/DESIGN.md, "Hybrid models")."""
    block_size = check_block_size(block_size)
    names = list(policies or DEFAULT_POLICIES)
    for name in names:
        get_policy(name)
    caps = [int(c) for c in capacities] if capacities else [pool_capacity(None, num_usable_blocks)]
    if any(c <= 0 for c in caps):
        raise KmeshTraceError("capacities must be positive block counts.")
    workload = Workload(block_size, requests, num_usable_blocks=num_usable_blocks, groups=tuple(groups),
                        retention_interval=retention_interval)
    points = [(name, c) for name in names for c in caps]
    if simulate is not None:
        results = simulate(points)
    else:
        results = [replay_point(workload, name, c) for name, c in points]

    notes: list[str] = []
    if workload.hybrid:
        notes.append(analysis_note(workload.groups))
    tokens, stock_notes = stock_choice(workload, "model")
    if tokens is not None:
        cap = int(num_usable_blocks)
        stock, source = result_of("stock", cap, workload.stream, tokens // block_size), "capture"
        stock.measured_hit_tokens = tokens
    else:
        cap = int(num_usable_blocks) if num_usable_blocks in caps else caps[0]
        notes += stock_notes
        stock = _find(results, "vllm", cap) or replay_point(workload, "vllm", cap)
        source = "vllm"
    bound = _find(results, "belady", cap) or replay_point(workload, "belady", cap)
    res = HeadroomResult(block_size, results, stock.prefill_tokens - bound.prefill_tokens, cap, source, stock, notes, bound)
    if (b := res.bracket()) is not None and b["wide"]:
        notes.append(f"the bracket [belady-prefix, belady] is {b['width_tokens']:,} prefill tokens wide at {cap:,} blocks: "
                     "a prefix cache may not reach belady, so the headroom is a range, not a number.")
    return res


def headroom_point(source, engine: str | None, policy: str, capacity: int) -> PolicyResult:
    """The task of one policy at one capacity over one engine's requests (`source`: a location, or a
    Workload: `oracle.tasks.workload_at`); on a hybrid engine's trace as `policies.replay_point` replays it."""
    return replay_point(workload_at(source, engine), policy, capacity)


def _find(results: list[PolicyResult], policy: str, capacity: int) -> PolicyResult | None:
    return next((r for r in results if r.policy == policy and r.capacity_blocks == capacity), None)


# ---- one run of the analysis, as `kmesh-trace headroom` and the report's section run it ------------


@dataclass(frozen=True)
class HeadroomOptions:
    """What `kmesh-trace headroom` is asked (its flags name the fields; `kmesh_trace.oracle.options`)."""

    capacities: tuple[int, ...] | None = option("--capacity-blocks")  # None: the curve
    policies: tuple[str, ...] | None = option("--policies")  # None: every one
    curve: bool = option("--curve", False)
    window: str = option("--window", "all")
    tokens_per_s: float | None = option("--prefill-tokens-per-s")  # None: fitted to a capture's prefills
    attention_factor: float = option("--attention-factor", 0.0)
    sample: float | None = option("--sample")  # a spatial sample of the block ids (oracle/sampled_curve.py)
    partitions: int | None = option("--partitions")  # k partitions of the block ids, simulated apart and merged
    memory_budget_gib: float | None = option("--memory-budget")  # what the exact curves may take (None: half the room)
    sample_memory_mib: float | None = option("--sample-memory")  # a fixed-size sample within this many MiB
    sample_correction: str = option("--sample-correction", "ratio")  # how a sample's hits scale (CORRECTIONS)

    @property
    def sampled(self) -> bool:
        return self.sample is not None or self.partitions is not None or self.sample_memory_mib is not None

    @property
    def wants_curve(self) -> bool:
        """The curve's result: no capacities given, or a window (at the given capacities, if any)."""
        return self.capacities is None or self.window != "all"

    @property
    def needs_requests(self) -> bool:
        """A curve replays an access stream and the requests' columns (no RequestBlocks, where the trace lets:
        `Workload.from_trace(requests=False)`)."""
        return not self.wants_curve

    def check(self) -> None:
        """Refuse contradictory options, and pools too large for memory, before any work."""
        if self.curve and self.capacities is not None:
            raise KmeshTraceError("--curve covers every capacity; drop --capacity-blocks (or --curve).")
        if self.sample is not None and self.partitions is not None:
            raise KmeshTraceError("--sample and --partitions are two ways of splitting the block ids; give one.")
        if self.sample_memory_mib is not None and (self.partitions is not None or self.sample == 1):
            raise KmeshTraceError("--sample-memory bounds a sample; drop --partitions or --sample 1.")
        if self.sample_correction not in CORRECTIONS:
            raise KmeshTraceError(f"--sample-correction is one of {', '.join(CORRECTIONS)}, not {self.sample_correction!r}.")
        if self.sampled and not self.wants_curve:
            raise KmeshTraceError("--sample and --partitions make a curve; drop --capacity-blocks or add --window.")
        if self.capacities is None:
            return
        if self.policies is None or "vllm" in self.policies:
            check_fits(pool_bytes(max(self.capacities)), "--capacity-blocks", "a vLLM pool model")
        elif {"belady", "belady-prefix"} & set(self.policies):
            check_fits(pool_bytes(max(self.capacities), vllm=False), "--capacity-blocks", "a Belady heap")

    def check_executor(self, executor: Executor) -> None:
        """A remote executor distributes the replays at given capacities only (a curve is one pass each)."""
        if self.wants_curve and executor.remote and self.partitions is None:
            raise KmeshTraceError("--ray distributes the replays at given capacities, or a curve's --partitions; add "
                                  "--capacity-blocks (without --window) or --partitions.")

    def prefill_cost(self) -> PrefillCost | None:
        if self.tokens_per_s is None:
            return None
        return PrefillCost.from_throughput(self.tokens_per_s, attention_factor=self.attention_factor)


@dataclass
class FittedPrefill:
    """The prefill cost fitted to a capture's measured prefills (`prefill_cost.usable_fit`)."""

    cost: PrefillCost | None  # None: no fit, or the fit is not usable
    fit: Any  # the FitReport, or None
    why: str | None  # why there are no seconds

    @property
    def report(self) -> dict | None:
        """The fit as the JSON gives it (without its points), with why it is unusable when it is."""
        if self.fit is None:
            return None
        d = {k: v for k, v in self.fit.to_json().items() if k != "points"}
        if self.why:
            d["why_unusable"] = self.why
        return d


def fitted_prefill(trace, engine: str | None = None) -> FittedPrefill:
    return FittedPrefill(*usable_fit(trace, engine))


def run(workload: Workload, options: HeadroomOptions, executor: Executor | None = None, *,
        fitted: FittedPrefill | None = None, progress=None, note: str | None = None):
    """Headroom of `workload` as `options` ask: the CurveResult (no capacities, or a window), else the
    HeadroomResult at the given capacities. `executor` runs the curve's grid replays (forked workers
    share the workload) or, when remote (Ray), the replays at given capacities, one task per point
    reading the trace itself. `fitted`: the trace's fitted prefill cost, used without a throughput."""
    executor = executor or InProcess()
    cost, fit = options.prefill_cost(), None
    if cost is None and fitted is not None:
        cost, fit = fitted.cost, fitted.report
    names = list(options.policies) if options.policies is not None else None
    caps = list(options.capacities) if options.capacities is not None else None
    options.check_executor(executor)
    if options.sampled and options.sample != 1 and workload.hybrid:
        raise KmeshTraceError("--sample and --partitions cover engines with one full-attention KV cache group; this "
                              "engine is hybrid (its pool serves prefix positions across groups): drop them.")
    exact = options.sample == 1 or workload.hybrid  # the whole stream: the exact curve, whatever the budget
    if exact:
        options = replace(options, sample=None)
    elif options.wants_curve and (options.sampled or executor.remote):
        return _sampled(workload, options, names, caps, executor, note)
    budget = None if options.memory_budget_gib is None else int(options.memory_budget_gib * 2**30)
    rate = auto_sample_rate(len(workload.stream), budget) if options.wants_curve and not exact else None
    if rate is not None:
        return _sampled(workload, replace(options, sample=rate), names, caps, executor, note, auto=True)
    if options.wants_curve:  # a window: the curve's result, at the given capacities if any
        res = headroom_curve(workload, policies=names, window=options.window, cost=cost, cost_fit=fit,
                             executor=executor, progress=progress, grid=caps)
        res.note = note
        return res
    simulate = None
    if executor.remote:  # one task per (policy, capacity) point, each reading its own input
        source, engine = task_source(workload, executor), workload.engine
        where = f"engine={engine}" if engine else "the trace"
        simulate = lambda points: executor.map(  # noqa: E731
            headroom_point, [Task(f"{where}: {p} at {c} blocks", (source, engine, p, c)) for p, c in points])
    result = headroom_of_requests(workload.requests, workload.block_size, caps, names,
                                  num_usable_blocks=workload.num_usable_blocks, simulate=simulate,
                                  groups=workload.groups, retention_interval=workload.retention_interval)
    result.cost, result.note = cost, note
    return result


# ---- a sampled or partitioned curve, and when the exact one would not fit ------------------------------

#: Bytes per access the exact curves take beyond the stream, which is built (14 B an access) before this is
#: decided: the lru and belady kernels side by side (their own peaks 6.6-10.9 and 2.6-4.4 B an access in the
#: curve scaling series of benchmarks/README.md) with the grid replays beside them. Measured whole, `headroom`
#: on 10 M agentic reads peaks at 29.6 B a read with or without `--sample` (the stream's build is the peak).
EXACT_CURVE_BYTES_PER_ACCESS = 16
#: The rates `auto_sample_rate` picks from, largest first (those whose error benchmarks/ measured).
AUTO_RATES = (0.1, 0.01, 0.001)


def auto_sample_rate(num_accesses: int, budget: int | None) -> float | None:
    """None when the exact curves of `num_accesses` fit `budget` bytes (None: half the memory available
    here, `resources.check_fits`'s rule), else the largest of AUTO_RATES whose sample fits."""
    if budget is None:
        room = available_memory()
        if room is None:
            return None
        budget = int(room * MEMORY_FRACTION)
    need = num_accesses * EXACT_CURVE_BYTES_PER_ACCESS
    if need <= budget:
        return None
    return next((r for r in AUTO_RATES if need * r <= budget), AUTO_RATES[-1])


def _sampled(workload: Workload, options: HeadroomOptions, names, caps, executor: Executor, note, *, auto=False):
    if auto:  # policies the sample cannot replay are left out, and said so
        names = [n for n in names or SAMPLED_POLICIES if n in SAMPLED_POLICIES]
    if options.partitions is not None:
        res = partitioned_curve(workload, options.partitions, policies=names, window=options.window, grid=caps,
                                executor=executor)
    else:
        rate, extra = options.sample, None
        if options.sample_memory_mib is not None:  # the fixed-size sample of the built stream
            bound = accesses_for_bytes(int(options.sample_memory_mib * 2**20))
            rate = min(bounded_rate(workload.stream, bound), options.sample or 1.0)
            extra = {"max_sampled_accesses": bound, "rate_asked": options.sample or 1.0}
        res = sampled_curve(workload.stream, rate, policies=names, window=options.window,
                            num_usable_blocks=workload.num_usable_blocks, grid=caps,
                            correction=options.sample_correction, extra=extra)
    if auto:
        need = len(workload.stream) * EXACT_CURVE_BYTES_PER_ACCESS
        res.sampling["why"] = (f"the exact curves of {len(workload.stream):,} accesses would take about "
                               f"{need / 2**30:,.1f} GiB beyond the stream, over the memory budget; --sample 1 "
                               "forces them")
    res.note = note
    return res
