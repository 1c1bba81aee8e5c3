"""`tiers` as one call: `run(source, options) -> TiersReport`, `run_family_burst(options) -> ArmsReport`.

`TiersOptions` holds every choice with its default (the CLI's defaults are these); a run reads an opened
trace's engine partition, or a `Workload` (a built-in one, or one already read, with the trace it came
from for the KV bytes per token, the prefill fit and the measured loads).
A run resolves the restore costs, the KV bytes per token and the prefill model, builds the tier
configuration, and simulates either the GPU pool alone and the configuration, or a host x SSD sweep
(one task per configuration, `tiers_point`, in process or on Ray, through one
`kmesh_trace.oracle.executor.Executor`). The
reports give the JSON (`to_dict`) and the human rendering (`lines`, `kmesh_trace.oracle.tiers.render`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kmesh_trace.datasets.workloads.family_burst import family_burst
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.executor import InProcess, Task
from kmesh_trace.oracle.options import option
from kmesh_trace.oracle.stream import RequestBlocks, pool_capacity
from kmesh_trace.oracle.tasks import workload_at
import kmesh_trace.oracle.tier_costs as tc
from kmesh_trace.oracle.tiers.config import SIMPLE_CPU, TIER_NAMES, RestoreCost, TierConfig, TierSpec, simple_cpu
from kmesh_trace.oracle.tiers.family_burst import family_burst_arms
import kmesh_trace.oracle.tiers.render as render
from kmesh_trace.oracle.tiers.result import TierResult
from kmesh_trace.oracle.tiers.simulate import simulate_tiers, with_stream
from kmesh_trace.oracle.tiers.sweep import SweepResult, sweep_tiers
from kmesh_trace.oracle.workload import Workload
from kmesh_trace.resources import check_fits, pool_bytes

__all__ = ["TiersOptions", "TiersReport", "ArmsReport", "run", "run_family_burst", "tiers_point", "workload_of"]


@dataclass(frozen=True)
class TiersOptions:
    """A `tiers` run's choices (the engine partition is the input's; its flags name the fields:
    `kmesh_trace.oracle.options`). Capacities (`host`, `ssd`, the sweeps') are text: blocks, or bytes
    with a unit (40GiB); `read_once` names tiers, comma-separated; the sweeps are comma-separated lists."""

    capacity_blocks: int | None = option("--capacity-blocks", None)  # the GPU pool (default: the trace's usable blocks)
    host: str | None = option("--host", None)
    ssd: str | None = option("--ssd", None)
    host_write: str = option("--host-write", "on-evict")
    ssd_write: str = option("--ssd-write", "on-evict")
    chunk_tokens: int | None = option("--chunk-tokens", None)  # default: one block
    read_once: str | None = option("--read-once", None)
    singleflight: bool = option("--singleflight", False)
    early_prep: bool = option("--early-prep", False)
    prep_lead_s: float | None = option("--prep-lead-s", None)
    connector: str | None = option("--vllm-connector", None)  # "simple-cpu"
    lookup: str = option("--lookup", "any")
    kv_bytes_per_token: int | None = option("--kv-bytes-per-token", None)  # default: the capture's engine metadata
    model_config: Path | None = option("--model-config", None)
    restore_results: Path | None = option("--restore-results", None)
    ssd_route: str | None = option("--ssd-route", None)
    host_gbps: float | None = option("--host-gbps", None)
    ssd_gbps: float | None = option("--ssd-gbps", None)
    host_latency_ms: float = option("--host-latency-ms", 0.0)
    ssd_latency_ms: float = option("--ssd-latency-ms", 0.0)
    prefill_tokens_per_s: float | None = option("--prefill-tokens-per-s", None)  # default: fitted to the capture
    sweep_host: str | None = option("--sweep-host", None)
    sweep_ssd: str | None = option("--sweep-ssd", None)
    within: float = option("--within", 5.0)
    # LMCache's own server instead of the tiers above (`kmesh_trace.oracle.tiers.lmcache`): its configuration,
    # chunk_size=..,l1_size_gb=..,eviction_policy=LRU,fs=DIR, and the capture of another engine sharing it.
    lmcache: str | None = option("--lmcache", None)
    lmcache_peer: Path | None = option("--lmcache-peer", None)
    # The family-burst scenario.
    children: int = option("--children", 5)
    ancestor_mib: float = option("--ancestor-mib", 48)
    chunks: int = option("--chunks", 16)
    #: The flag the capacity came from, as errors name it (the deprecated --gpu-blocks when given so).
    capacity_flag: str = option(None, "--capacity-blocks")

    @property
    def swept(self) -> bool:
        return self.sweep_host is not None or self.sweep_ssd is not None

    def restore_costs(self) -> tuple[dict[str, RestoreCost], list[str]]:
        """(restore cost per tier, notes on where they came from): measured results, then the flags."""
        costs: dict = {}
        notes: list[str] = []
        if self.restore_results is not None:
            costs, notes = tc.restore_costs_from_results(self.restore_results, self.ssd_route)
        for name, gbps, lat in (("host", self.host_gbps, self.host_latency_ms),
                                ("ssd", self.ssd_gbps, self.ssd_latency_ms)):
            if gbps is not None:
                costs[name] = RestoreCost(gbps, lat / 1e3, None, "flag")
            elif name in costs and lat:
                c = costs[name]
                costs[name] = RestoreCost(c.gbps, lat / 1e3, c.gbps_p95, c.source)
        return costs, notes


def workload_of(trace, engine: str | None = None) -> Workload:
    """The workload of an opened trace's engine partition (`engine`, None: the only one), refused when it has
    no requests or models a hybrid engine. A public trace read into memory (`kmesh_trace.sources.PublicInput`)
    is never empty."""
    if trace.invocations_in_memory is None:
        from kmesh_trace.trace import check_has_requests  # deferred: it loads polars, pyarrow and duckdb

        check_has_requests(trace)
    w = Workload.from_trace(trace, engine)
    w.refuse_hybrid("tiers")
    return w


@dataclass
class TiersReport:
    """The GPU pool alone and one configuration (`results`), or a sweep; `head` describes the run;
    `notes` are what a reader must know (printed on stderr); `journal` is set once one is written."""

    head: dict
    results: list[TierResult]
    sweep: SweepResult | None = None
    notes: list[str] = field(default_factory=list)
    journal: dict | None = None

    def to_dict(self) -> dict:
        if self.sweep is not None:
            return {**self.head, "sweep": self.sweep.to_dict()}
        d = {**self.head, "configurations": [r.to_dict() for r in self.results]}
        if self.journal is not None:
            d["journal"] = self.journal
        return d

    def lines(self, d: dict | None = None) -> list:
        d = self.to_dict() if d is None else d
        return render.sweep_lines(d) if self.sweep is not None else render.configuration_lines(d)


@dataclass
class ArmsReport:
    """The family-burst scenario's arms (`kmesh_trace.oracle.tiers.family_burst`)."""

    data: dict

    def to_dict(self) -> dict:
        return self.data

    def lines(self, d: dict | None = None) -> list:
        return render.arms_lines(self.data if d is None else d)


def run_family_burst(options: TiersOptions) -> ArmsReport:
    o = options
    costs, _ = o.restore_costs()
    burst = family_burst(o.children, o.ancestor_mib, o.chunks)
    prefill, prefill_src, _ = tc.prefill_model(None, o.prefill_tokens_per_s)
    arms = family_burst_arms(burst, costs=costs, prefill=prefill)
    return ArmsReport({"scenario": "family-burst", "children": o.children, "ancestor_mib": o.ancestor_mib,
                       "chunks": o.chunks, "block_size": burst.block_size,
                       "kv_bytes_per_token": burst.kv_bytes_per_token,
                       "costs": {k: v.to_dict() for k, v in costs.items()}, "prefill": prefill_src, "arms": arms})


def run(source, options: TiersOptions, executor=None, *, name: str, engine: str | None = None,
        trace=None, peer: tuple | None = None):
    """`options` over `source`: an opened trace (`kmesh_trace.sources.TraceSource`), whose engine partition
    `engine` (None: the only one) is read here; or a `Workload` already built, of `trace` (the opened trace it
    was read from: its engine metadata, prefill timings and transfers) or of none (a built-in workload).
    `name` is how the output names the input (the user's path, or scenario:NAME). A sweep runs one task per
    configuration through `executor` (`kmesh_trace.oracle.executor`; default in this process), whose
    `on_start`/`on_done` follow it; a remote executor's tasks read a trace on disk themselves.
    With `options.lmcache`, the LMCache model over `source` and `peer` (the opened peer trace and its name):
    an `LMCacheReport` (`kmesh_trace.oracle.tiers.lmcache_run`)."""
    if options.lmcache is not None or peer is not None:
        return _run_lmcache(source, options, name, engine, peer)
    if isinstance(source, Workload):
        w, location = source, None
    else:
        trace, w = source, workload_of(source, engine)
        location = None if source.invocations_in_memory is not None else w.location
    requests = list(w.requests)
    metadata = {} if trace is None else trace.engines[engine] if engine is not None else trace.metadata
    o = options
    costs, cost_notes = o.restore_costs()
    kvbpt, kv_src = tc.kv_bytes_per_token(metadata, o.kv_bytes_per_token, o.model_config)
    prefill, prefill_src, fit = tc.prefill_model(trace, o.prefill_tokens_per_s, engine)
    gpu = pool_capacity(o.capacity_blocks, w.num_usable_blocks)
    check_fits(pool_bytes(gpu), o.capacity_flag, "a vLLM pool model")  # the lower tiers grow with the data
    bs = w.block_size
    block_bytes = bs * kvbpt if kvbpt else None
    if o.chunk_tokens is not None and (o.chunk_tokens <= 0 or o.chunk_tokens % bs):
        raise KmeshTraceError(f"--chunk-tokens must be a positive multiple of the block size ({bs}).")
    chunk = (o.chunk_tokens or bs) // bs
    once = {x.strip() for x in (o.read_once or "").split(",") if x.strip()}
    if once - set(TIER_NAMES):
        raise KmeshTraceError(f"--read-once names tiers from {', '.join(TIER_NAMES)} (got {o.read_once!r}).")
    writes = {"host": o.host_write, "ssd": o.ssd_write}

    def spec(name: str, cap: int) -> TierSpec:
        return TierSpec(name, cap, chunk, writes[name], name not in once)

    tiers = tuple(spec(n, tc.parse_capacity(c, block_bytes, f"--{n}")) for n, c in (("host", o.host), ("ssd", o.ssd))
                  if c is not None)
    base = TierConfig(gpu, tiers, o.singleflight, o.early_prep, o.prep_lead_s, o.lookup)
    kw: dict = dict(block_size=bs, kv_bytes_per_token=kvbpt, costs=costs, prefill=prefill)
    notes: list[str] = []
    if o.connector is not None:
        if o.connector != SIMPLE_CPU:
            raise KmeshTraceError(f"unknown connector model {o.connector!r}; the one modelled is simple-cpu.")
        if len(tiers) != 1 or o.swept:
            raise KmeshTraceError("--vllm-connector simple-cpu models one tier: give --host (cpu backend) or --ssd "
                                  "(disk backend), and no sweep.")
        base = simple_cpu(gpu, tiers[0].capacity_blocks, tiers[0].name)
        kw["timed"] = False
        notes.append("the simple-cpu connector model replays the trace sequentially (one request at a time)")
    head = {"trace": name, "block_size": bs, "gpu_blocks": gpu, "kv_bytes_per_token": kvbpt,
            "kv_bytes_source": kv_src, "costs": {k: v.to_dict() for k, v in costs.items()}, "cost_notes": cost_notes,
            "prefill": prefill_src, "prefill_model": prefill.to_json() if prefill is not None else None,
            "prefill_fit": {k: v for k, v in fit.to_json().items() if k != "points"} if fit is not None else None}
    if o.swept:
        hs = [tc.parse_capacity(x, block_bytes, "--sweep-host") for x in (o.sweep_host or "0").split(",")]
        ss = [tc.parse_capacity(x, block_bytes, "--sweep-ssd") for x in (o.sweep_ssd or "0").split(",")]
        sweep_base = TierConfig(gpu, tuple(spec(n, 1) for n in TIER_NAMES), o.singleflight, o.early_prep,
                                o.prep_lead_s, o.lookup)
        sw = sweep_tiers(requests, sweep_base, hs, ss, within_pct=o.within,
                         simulate=lambda configs: _run_configs(requests, (name, location, engine), configs, kw, executor))
        return TiersReport(head, [], sw, notes)
    kw = with_stream(kw, requests)
    results = [simulate_tiers(requests, TierConfig(gpu), **kw)]  # the GPU pool alone, for comparison
    if tiers:
        results.append(simulate_tiers(requests, base, **kw))
    notes.extend(dict.fromkeys(n for r in results for n in r.notes))
    measured = measured_loads(trace, engine)
    if measured is not None and tiers:
        modelled = int(sum(results[-1].hit_blocks_by_tier[t.name].sum() for t in tiers))
        head["measured_loads"] = {**measured, "modelled_lower_tier_hit_blocks": modelled,
                                  "difference_blocks": modelled - measured["num_blocks"]}
        notes.append(f"measured: {measured['num_blocks']:,} blocks loaded by {measured['connector']} in "
                     f"{measured['num_loads']:,} loads (the capture's transfers); modelled: {modelled:,} lower-tier "
                     f"hit blocks; difference {modelled - measured['num_blocks']:+,} blocks")
    return TiersReport(head, results, None, notes)


def _run_lmcache(source, options: TiersOptions, name: str, engine: str | None, peer: tuple | None):
    from kmesh_trace.oracle.tiers.lmcache_run import run_lmcache

    if options.lmcache is None:
        raise KmeshTraceError("--lmcache-peer names another engine sharing LMCache; give --lmcache too.")
    if isinstance(source, Workload):
        raise KmeshTraceError("--lmcache reads captures (a trace directory), not a built-in workload.")
    inputs = [(source, name, engine)] + ([(peer[0], peer[1], None)] if peer is not None else [])
    return run_lmcache(inputs, options, workload_of=workload_of)


def measured_loads(t, engine: str | None) -> dict | None:
    """What the capture's proxy connector recorded loading into engine `engine` (None: any) of trace `t`
    (transfers, direction load, status ok): {connector, num_loads, num_blocks}; None without such transfers."""
    counts = getattr(t, "row_counts", None)  # a public trace read into memory has no tables
    if counts is None or not hasattr(t, "sql") or not counts().get("transfers"):
        return None
    where = "direction = 'load' AND status = 'ok'" + (f" AND engine = '{engine}'" if engine else "")
    rows = t.sql(f"SELECT string_agg(DISTINCT connector, ', '), count(*), sum(num_blocks) FROM transfers "
                 f"WHERE {where}").rows()
    conn, n, blocks = rows[0]
    return {"connector": conn, "num_loads": int(n), "num_blocks": int(blocks or 0)} if n else None


def _run_configs(requests: list[RequestBlocks], where_from: tuple, configs: list[TierConfig], kw: dict,
                 executor) -> list[TierResult]:
    """One task per configuration (`tiers_point`): on a remote executor (Ray) each reads the engine's parts
    itself when the input came from a trace on disk (`where_from`: its name, location or None, and engine); in
    process they share the requests."""
    name, location, engine = where_from
    executor = executor or InProcess()
    where = name if location is None else f"engine={engine}" if engine else "the trace"
    task_source = location if executor.remote and location is not None else requests
    if not executor.remote:  # the configurations share the compiled replay's stream
        kw = with_stream(kw, requests)
    return executor.map(tiers_point, [Task(f"{where}: {c.label}", (task_source, engine, c, kw))
                                      for c in configs])


def tiers_point(source, engine: str | None, config, options: dict):
    """The task of one tier configuration over one engine's requests (`source`: a location, or the
    requests); `options`: simulate_tiers's other keywords (block size, KV bytes per token, costs, prefill)."""
    if isinstance(source, str):
        source = workload_at(source, engine).requests
    return simulate_tiers(source, config, **options)
