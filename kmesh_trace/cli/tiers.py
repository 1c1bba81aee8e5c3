"""`tiers`: what host-memory and SSD tiers below the GPU pool buy on a trace, at a measured restore cost."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from kmesh_trace.cli.display import Table

from kmesh_trace.cli.common import (
    Output,
    ScenarioOption,
    build_scenario,
    check_out_dir,
    check_out_not_in_input,
    check_plot_option,
    emit,
    err,
    handles_errors,
    out,
    output_options,
    progress,
    run_tasks_with_progress,
)
from kmesh_trace.distributed import RAY_HELP, check_ray_option
from kmesh_trace.errors import KmeshTraceError, NeedsParameterError
from kmesh_trace.values import MAX_BLOCKS, MAX_SECONDS, bounded_int, finite_float


class Write(str, Enum):
    on_evict = "on-evict"
    write_through = "write-through"


class Connector(str, Enum):
    simple_cpu = "simple-cpu"


class Lookup(str, Enum):
    any = "any"
    gpu_prefix = "gpu-prefix"


def register(app: typer.Typer) -> None:
    app.command("tiers")(tiers_cmd)


@handles_errors
@output_options()
def tiers_cmd(
    trace: Optional[Path] = typer.Argument(None, help="Trace directory (or use --scenario)."),
    scenario: ScenarioOption = None,
    gpu_blocks: Optional[int] = typer.Option(None, "--gpu-blocks", parser=bounded_int(1, MAX_BLOCKS), help="GPU pool usable blocks (default: the trace's)."),
    host: Optional[str] = typer.Option(None, "--host", help="Host-memory tier capacity: blocks, or bytes with a unit (40GiB); absent if not given."),
    ssd: Optional[str] = typer.Option(None, "--ssd", help="SSD tier capacity: blocks, or bytes with a unit; absent if not given."),
    host_write: Write = typer.Option(Write.on_evict, "--host-write", help="When the host tier stores a block."),
    ssd_write: Write = typer.Option(Write.on_evict, "--ssd-write", help="When the SSD tier stores a block."),
    chunk_tokens: Optional[int] = typer.Option(None, "--chunk-tokens", parser=bounded_int(1, MAX_BLOCKS), help="Lower-tier chunk in tokens (a multiple of the block size, e.g. 256; needs write-through). Default: one block."),
    read_once: Optional[str] = typer.Option(None, "--read-once", help="Tiers that drop a chunk once loaded, comma-separated (host, ssd)."),
    singleflight: bool = typer.Option(False, "--singleflight/--no-singleflight", help="Concurrent needs of one chunk share one read."),
    early_prep: bool = typer.Option(False, "--early-prep/--no-early-prep", help="Load a declared family's ancestor ahead of its children."),
    prep_lead_s: Optional[float] = typer.Option(None, "--prep-lead-s", parser=finite_float(0, MAX_SECONDS), help="With --early-prep: prepare this long before the first child (default: when the parent finishes)."),
    vllm_connector: Optional[Connector] = typer.Option(None, "--vllm-connector", help="simple-cpu: reproduce vLLM's SimpleCPUOffloadConnector (eager) on one tier, --host (cpu backend) or --ssd (disk backend), replayed sequentially."),
    lookup: Lookup = typer.Option(Lookup.any, "--lookup", help="any: GPU then lower tiers block by block; gpu-prefix: lower tiers only extend the GPU prefix (vLLM's connectors)."),
    kv_bytes: Optional[int] = typer.Option(None, "--kv-bytes-per-token", parser=bounded_int(1, 1 << 40), help="KV bytes per token (default: the capture's engine metadata)."),
    model_config: Optional[Path] = typer.Option(None, "--model-config", help="Hugging Face config.json giving the KV bytes per token."),
    restore_results: Optional[Path] = typer.Option(None, "--restore-results", help="A `replay run --out` directory: restore costs measured on the target host."),
    ssd_route: Optional[str] = typer.Option(None, "--ssd-route", help="Which measured route restores the SSD tier (default: the most direct measured)."),
    host_gbps: Optional[float] = typer.Option(None, "--host-gbps", parser=finite_float(0, 1e6, lo_open=True), help="Host tier restore throughput, GB/s."),
    ssd_gbps: Optional[float] = typer.Option(None, "--ssd-gbps", parser=finite_float(0, 1e6, lo_open=True), help="SSD tier restore throughput, GB/s."),
    host_latency_ms: float = typer.Option(0.0, "--host-latency-ms", parser=finite_float(0, MAX_SECONDS), help="Host tier latency per request's reads, ms."),
    ssd_latency_ms: float = typer.Option(0.0, "--ssd-latency-ms", parser=finite_float(0, MAX_SECONDS), help="SSD tier latency per request's reads, ms."),
    prefill_tps: Optional[float] = typer.Option(None, "--prefill-tokens-per-s", parser=finite_float(0, lo_open=True), help="Prefill throughput (default: fitted on the capture's measured prefills)."),
    sweep_host: Optional[str] = typer.Option(None, "--sweep-host", help="Host capacities to sweep, comma-separated (0: absent)."),
    sweep_ssd: Optional[str] = typer.Option(None, "--sweep-ssd", help="SSD capacities to sweep, comma-separated (0: absent)."),
    within: float = typer.Option(5.0, "--within", parser=finite_float(0, 100), help="With a sweep: report the smallest configuration within this percent of the best."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="With a sweep: write the host x SSD heatmap to FILE.png or FILE.svg."),
    journal: Optional[Path] = typer.Option(None, "--journal", help="Write the SSD tier's reads as a replay store (journal + payloads) for `replay run`."),
    journal_max_restores: int = typer.Option(16, "--journal-max-restores", parser=bounded_int(1, 1 << 20), help="With --journal: at most this many restores."),
    children: int = typer.Option(5, "--children", parser=bounded_int(1, 1 << 20), help="family-burst: number of children."),
    ancestor_mib: float = typer.Option(48, "--ancestor-mib", parser=finite_float(0, 1 << 30, lo_open=True), help="family-burst: ancestor size in MiB."),
    chunks: int = typer.Option(16, "--chunks", parser=bounded_int(1, 1 << 20), help="family-burst: chunks per ancestor."),
    engine: Optional[str] = typer.Option(None, "--engine", help="Engine partition, for traces with several."),
    ray: Optional[str] = typer.Option(None, "--ray", help=RAY_HELP + " With a sweep: one task per configuration."),
    output: Output = None,
) -> None:
    """Simulate the trace through the GPU pool and host/SSD tiers; hits by tier, bytes read, seconds saved, TTFT."""
    from kmesh_trace.oracle import tier_costs as tc
    from kmesh_trace.oracle import tiers as tm

    if (trace is None) == (scenario is None):
        raise KmeshTraceError("give either a TRACE directory or --scenario, not both and not neither.")
    swept = sweep_host is not None or sweep_ssd is not None
    if ray is not None and not swept:
        raise KmeshTraceError("--ray runs a sweep's configurations as tasks; add --sweep-host and/or --sweep-ssd.")
    if plot is not None and not swept:
        raise KmeshTraceError("--plot draws a host x SSD sweep; add --sweep-host and/or --sweep-ssd.")
    check_plot_option(plot, [trace, restore_results, model_config])
    check_ray_option(ray)
    if journal is not None:
        check_out_dir(journal, "--journal")
        check_out_not_in_input(journal, [trace, restore_results, model_config], "--journal")

    costs: dict = {}
    notes: list[str] = []
    if restore_results is not None:
        costs, notes = tc.restore_costs_from_results(restore_results, ssd_route)
    for name, gbps, lat in (("host", host_gbps, host_latency_ms), ("ssd", ssd_gbps, ssd_latency_ms)):
        if gbps is not None:
            costs[name] = tm.RestoreCost(gbps, lat / 1e3, None, "flag")
        elif name in costs and lat:
            c = costs[name]
            costs[name] = tm.RestoreCost(c.gbps, lat / 1e3, c.gbps_p95, c.source)

    if scenario is not None and scenario.value == "family-burst":
        from kmesh_trace.datasets.workloads.family_burst import family_burst

        burst = family_burst(children, ancestor_mib, chunks)
        prefill, prefill_src, _ = tc.prefill_model(None, prefill_tps)
        arms = tm.family_burst_arms(burst, costs=costs, prefill=prefill)
        d = {"scenario": scenario.value, "children": children, "ancestor_mib": ancestor_mib, "chunks": chunks,
             "block_size": burst.block_size, "kv_bytes_per_token": burst.kv_bytes_per_token,
             "costs": {k: v.to_dict() for k, v in costs.items()}, "prefill": prefill_src, "arms": arms}
        emit(output, d, render=lambda: _render_arms(d))
        return

    from kmesh_trace.oracle.stream import engine_geometry, pool_capacity, request_blocks
    from kmesh_trace.trace import check_has_requests, open_trace

    if scenario is not None:  # any other built-in workload: a stream with no capture metadata
        w = build_scenario(scenario)
        reqs, block_size, usable = w.requests, w.block_size, w.num_usable_blocks
        kvbpt, kv_src = tc.kv_bytes_per_token({}, kv_bytes, model_config)
        prefill, prefill_src, fit = tc.prefill_model(None, prefill_tps)
    else:
        with open_trace(trace) as t:
            check_has_requests(t)
            block_size, usable = engine_geometry(t, engine)
            reqs = request_blocks(t, engine)
            meta = t.engines[engine] if engine is not None else t.metadata
            kvbpt, kv_src = tc.kv_bytes_per_token(meta, kv_bytes, model_config)
            prefill, prefill_src, fit = tc.prefill_model(t, prefill_tps, engine)
    try:
        gpu = pool_capacity(gpu_blocks, usable)
    except NeedsParameterError as e:  # the pool's capacity is --gpu-blocks here
        raise KmeshTraceError(f"{e.reason}; pass --gpu-blocks N.") from None
    from kmesh_trace.resources import check_fits, pool_bytes

    check_fits(pool_bytes(gpu), "--gpu-blocks", "a vLLM pool model")  # the lower tiers grow with the data
    block_bytes = block_size * kvbpt if kvbpt else None
    if chunk_tokens is not None and (chunk_tokens <= 0 or chunk_tokens % block_size):
        raise KmeshTraceError(f"--chunk-tokens must be a positive multiple of the block size ({block_size}).")
    chunk = (chunk_tokens or block_size) // block_size
    once = {x.strip() for x in (read_once or "").split(",") if x.strip()}
    if once - set(tm.TIER_NAMES):
        raise KmeshTraceError(f"--read-once names tiers from {', '.join(tm.TIER_NAMES)} (got {read_once!r}).")
    writes = {"host": host_write.value, "ssd": ssd_write.value}

    def spec(name: str, cap: int) -> tm.TierSpec:
        return tm.TierSpec(name, cap, chunk, writes[name], name not in once)

    tiers = tuple(spec(n, tc.parse_capacity(c, block_bytes, f"--{n}")) for n, c in (("host", host), ("ssd", ssd))
                  if c is not None)
    base = tm.TierConfig(gpu, tiers, singleflight, early_prep, prep_lead_s, lookup.value)
    kw = dict(block_size=block_size, kv_bytes_per_token=kvbpt, costs=costs, prefill=prefill)
    if vllm_connector is not None:
        if len(tiers) != 1 or swept:
            raise KmeshTraceError("--vllm-connector simple-cpu models one tier: give --host (cpu backend) or --ssd "
                                  "(disk backend), and no sweep.")
        base = tm.simple_cpu(gpu, tiers[0].capacity_blocks, tiers[0].name)
        kw["timed"] = False
        err.print("note: the simple-cpu connector model replays the trace sequentially (one request at a time)")
    source = str(trace) if trace is not None else f"scenario:{scenario.value}"
    head = {"trace": source, "block_size": block_size, "gpu_blocks": gpu, "kv_bytes_per_token": kvbpt,
            "kv_bytes_source": kv_src, "costs": {k: v.to_dict() for k, v in costs.items()}, "cost_notes": notes,
            "prefill": prefill_src, "prefill_model": prefill.to_json() if prefill is not None else None,
            "prefill_fit": {k: v for k, v in fit.to_json().items() if k != "points"} if fit is not None else None}
    if swept:
        hs = [tc.parse_capacity(x, block_bytes, "--sweep-host") for x in (sweep_host or "0").split(",")]
        ss = [tc.parse_capacity(x, block_bytes, "--sweep-ssd") for x in (sweep_ssd or "0").split(",")]
        base_tiers = tuple(spec(n, 1) for n in tm.TIER_NAMES)
        base_config = tm.TierConfig(gpu, base_tiers, singleflight, early_prep, prep_lead_s, lookup.value)
        if ray is not None:  # one task per configuration, each reading the engine's parts itself
            from kmesh_trace.distributed import Task
            from kmesh_trace.oracle.tasks import tiers_point

            where = source if trace is None else f"engine={engine}" if engine else "the trace"
            task_source = reqs if trace is None else str(trace)
            sw = tm.sweep_tiers(reqs, base_config, hs, ss, within_pct=within, simulate=lambda configs: run_tasks_with_progress(
                tiers_point, [Task(f"{where}: {c.label}", (task_source, engine, c, kw)) for c in configs],
                ray=ray, label="tiers"))
        else:
            with progress() as bar:
                task = bar.add_task("simulating tiers", total=len(hs) * len(ss))
                sw = tm.sweep_tiers(reqs, base_config, hs, ss, within_pct=within,
                                    progress=lambda done, _: bar.update(task, completed=done), **kw)
        if plot is not None:
            from kmesh_trace.apps.plots import plot_tier_sweep

            plot_tier_sweep(sw, plot, block_size)
            err.print(f"wrote {plot}")
        d = {**head, "sweep": sw.to_dict()}
        emit(output, d, render=lambda: _render_sweep(d))
        return
    results = [tm.simulate_tiers(reqs, tm.TierConfig(gpu), **kw)]  # the GPU pool alone, for comparison
    if tiers:
        results.append(tm.simulate_tiers(reqs, base, **kw))
    for note in dict.fromkeys(n for r in results for n in r.notes):
        err.print(f"note: {note}")
    d = {**head, "configurations": [r.to_dict() for r in results]}
    if journal is not None:
        d["journal"] = _write_journal(results[-1], journal, journal_max_restores, source)
    emit(output, d, render=lambda: _render_configs(d))


def _write_journal(result, path: Path, max_restores: int, source: str) -> dict:
    """The SSD tier's reads (else the host tier's) as a replay store, one restore per request's reads."""
    from kmesh_trace.native import store as st

    if not result.kv_bytes_per_token:
        raise KmeshTraceError("--journal needs the KV bytes per token to size the reads; pass --kv-bytes-per-token.")
    names = [t.name for t in result.config.tiers]
    tier = "ssd" if "ssd" in names else (names[0] if names else None)
    reads = [r for r in result.reads if r.tier == tier]
    if not reads:
        raise KmeshTraceError("the simulation issued no lower-tier reads, so there is nothing to journal.")
    chunk_bytes = {t.name: t.chunk_blocks * result.block_bytes for t in result.config.tiers}[tier]
    aligned = -(-chunk_bytes // st.ALIGNMENT) * st.ALIGNMENT
    plan = [[aligned] * r.num_chunks for r in reads[:max_restores]]
    with progress() as bar:
        task = bar.add_task("writing payloads", total=len(plan))
        s = st.prepare(path, plan, source=f"tiers:{source}:{tier}", progress=lambda done, _: bar.update(task, completed=done))
    err.print(f"wrote a replay store of {len(plan):,} restores ({s.num_bytes / 2**20:,.1f} MiB) to {path}; "
              f"run `kmesh-trace replay run {path} --out DIR` on the GPU host and feed DIR back with --restore-results")
    return {"path": str(path), "tier": tier, "num_restores": len(plan), "num_reads_total": len(reads),
            "chunk_bytes": aligned, "chunk_bytes_unaligned": chunk_bytes, "num_bytes": s.num_bytes}


def _mib(v) -> str:
    return "-" if v is None else f"{v / 2**20:,.1f}"


def _secs(v) -> str:
    return "-" if v is None else f"{v:,.3f}"


def _render_configs(d: dict) -> None:
    kv = d["kv_bytes_per_token"]
    kv_text = f"{kv:,} bytes/token ({d['kv_bytes_source']})" if kv else "bytes unknown"
    out.print(f"GPU pool {d['gpu_blocks']:,} blocks of {d['block_size']} tokens; KV {kv_text}; prefill: {d['prefill']}",
              markup=False, highlight=False)
    fit = d.get("prefill_fit")
    if fit:
        out.print(f"prefill fit: {fit['n']:,} measured prefills, r2 {fit['r2']:.3f}, median relative error "
                  f"{fit['median_relative_error']:.1%} ({fit['num_skipped']:,} without a usable measurement)",
                  markup=False, highlight=False)
    for n in d["cost_notes"]:
        out.print(f"restore cost: {n}", markup=False, highlight=False)
    ht_ = Table(title="tiers: hit tokens by tier", title_justify="left")
    for h in ("configuration", "gpu", "host", "ssd", "recomputed", "gpu_evictions"):
        ht_.add_column(h, justify="left" if h == "configuration" else "right")
    rt = Table(title="tiers: lower-tier reads and estimated seconds", title_justify="left")
    short = {"configuration": "config", "host_MiB": "host", "ssd_MiB": "ssd", "read_amp": "amp", "saved_s": "saved",
             "ttft_children": "kids", "ttft_others": "others"}  # at 80 columns, with a legend
    for h in ("configuration", "host_MiB", "ssd_MiB", "read_amp", "saved_s", "ttft_children", "ttft_others"):
        rt.add_column(h, justify="left" if h == "configuration" else "right", short=short[h])
    for c in d["configurations"]:
        ht = c["hit_tokens_by_tier"]
        rb = c["read_bytes_by_tier"] or {}
        ttft = c["ttft"] or {}
        amp = c["read_amplification"]
        name = (c["label"] + (" sf" if c["singleflight"] else "") + (" prep" if c["early_prep"] else "")
                + (f" {c['connector']}" if c["connector"] else ""))

        def tt(g):
            v = ttft.get(g)
            return "-" if not v or v["p50_s"] is None else f"{v['p50_s']:.3f}/{v['p95_s']:.3f}"

        ht_.add_row(name, f"{ht.get('gpu', 0):,}", f"{ht['host']:,}" if "host" in ht else "-",
                    f"{ht['ssd']:,}" if "ssd" in ht else "-", f"{c['recomputed_tokens']:,}", f"{c['gpu_evictions']:,}")
        rt.add_row(name, _mib(rb.get("host")), _mib(rb.get("ssd")), "-" if amp is None else f"{amp:.2f}",
                   _secs(c["prefill_seconds_saved"]), tt("children"), tt("others"))
    out.print(ht_)
    out.print(rt)
    out.print("ttft: estimated p50/p95 seconds (restore wait + prefill of recomputed tokens); saved_s: prefill "
              "seconds saved against the GPU pool alone, net of restore waits", markup=False, highlight=False)
    if "journal" in d:
        j = d["journal"]
        out.print(f"journal: {j['num_restores']:,} of {j['num_reads_total']:,} {j['tier']} reads in {j['path']}",
                  markup=False, highlight=False)


def _render_sweep(d: dict) -> None:
    sw = d["sweep"]
    metric = sw["metric"]
    rt = Table(title=f"{metric} by host (rows) x ssd (columns) blocks at {d['gpu_blocks']:,} GPU blocks",
                   title_justify="left")
    rt.add_column("host \\ ssd", justify="right")
    for s in sw["ssd_blocks"]:
        rt.add_column(f"{s:,}" if s else "-", justify="right")
    fmt = (lambda v: f"{v:,.3f}") if metric == "prefill_seconds_saved" else (lambda v: f"{v:,.0f}")
    for h, row in zip(sw["host_blocks"], sw["grid"]):
        rt.add_row(f"{h:,}" if h else "-", *(fmt(v) for v in row))
    out.print(rt)
    out.print(f"best: {sw['best']}; smallest within {sw['within_pct']:g}% of the best: {sw['smallest_within']}",
              markup=False, highlight=False)


def _render_arms(d: dict) -> None:
    rt = Table(title=f"family-burst: {d['children']} children, {d['ancestor_mib']:g} MiB ancestor in "
                         f"{d['chunks']} chunks", title_justify="left")
    for h in ("arm", "lower_tier_reads", "MiB_read", "host_reads", "ssd_reads", "shared", "read_amp",
              "wait_p50_s", "wait_max_s"):
        rt.add_column(h, justify="left" if h == "arm" else "right")
    for a in d["arms"]:
        nr = a["num_reads_by_tier"]
        rt.add_row(a["arm"], f"{a['num_lower_tier_reads']:,}", _mib(a["lower_tier_read_bytes"]),
                   f"{nr.get('host', 0):,}", f"{nr.get('ssd', 0):,}", f"{a['num_shared_reads']:,}",
                   f"{a['read_amplification']:.2f}", _secs(a["restore_wait_p50_s"]), _secs(a["restore_wait_max_s"]))
    out.print(rt)
    if not d["costs"]:
        err.print("note: no restore costs given (--restore-results or --ssd-gbps/--host-gbps): waits are not estimated")
