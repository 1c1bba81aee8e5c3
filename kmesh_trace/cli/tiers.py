"""`tiers`: what host-memory and SSD tiers below the GPU pool buy on a trace, at a measured restore cost."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
from kmesh_trace.cli.display import Table, prose

from kmesh_trace.cli.common import (
    EngineOption,
    KvModelConfigOption,
    Output,
    RequestDatasetFlags,
    ScenarioOption,
    TraceOrScenarioArgument,
    build_scenario,
    check_out_dir,
    check_out_not_in_input,
    check_plot_option,
    emit,
    err,
    handles_errors,
    out,
    output_options,
    plot_option,
    progress,
    ray_option,
)
from kmesh_trace.cli.flags import aliased, flags, hidden_alias, options_of, takes_flags
from kmesh_trace.distributed import check_ray_option
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.schema import TierConnector, TierLookup, TierWrite
from kmesh_trace.values import (MAX_BLOCKS, MAX_KV_BYTES_PER_TOKEN, MAX_SECONDS, MAX_TOKENS_PER_S, bounded_int,
                                finite_float)


def register(app: typer.Typer) -> None:
    app.command("tiers")(tiers_cmd)


GpuCapacityOption = Annotated[Optional[int], typer.Option(
    "--capacity-blocks", parser=bounded_int(1, MAX_BLOCKS), help="GPU pool usable blocks (default: the trace's).")]


@flags
class TiersFlags:
    """`tiers`'s flags; the analysis' own options are named as `TiersOptions` names them."""

    trace: TraceOrScenarioArgument = None
    scenario: ScenarioOption = None
    capacity_blocks: GpuCapacityOption = None
    gpu_blocks: Optional[int] = hidden_alias(GpuCapacityOption, "--gpu-blocks")
    host: Optional[str] = typer.Option(None, "--host", help="Host-memory tier capacity: blocks, or bytes with a unit (40GiB); absent if not given.")
    ssd: Optional[str] = typer.Option(None, "--ssd", help="SSD tier capacity: blocks, or bytes with a unit; absent if not given.")
    host_write: TierWrite = typer.Option(TierWrite.on_evict, "--host-write", help="When the host tier stores a block.")
    ssd_write: TierWrite = typer.Option(TierWrite.on_evict, "--ssd-write", help="When the SSD tier stores a block.")
    chunk_tokens: Optional[int] = typer.Option(None, "--chunk-tokens", parser=bounded_int(1, MAX_BLOCKS), help="Lower-tier chunk in tokens (a multiple of the block size, e.g. 256; needs write-through). Default: one block.")
    read_once: Optional[str] = typer.Option(None, "--read-once", help="Tiers that drop a chunk once loaded, comma-separated (host, ssd).")
    singleflight: bool = typer.Option(False, "--singleflight/--no-singleflight", help="Concurrent needs of one chunk share one read.")
    early_prep: bool = typer.Option(False, "--early-prep/--no-early-prep", help="Load a declared family's ancestor ahead of its children.")
    prep_lead_s: Optional[float] = typer.Option(None, "--prep-lead-s", parser=finite_float(0, MAX_SECONDS), help="With --early-prep: prepare this long before the first child (default: when the parent finishes).")
    connector: Optional[TierConnector] = typer.Option(None, "--vllm-connector", help="simple-cpu: reproduce vLLM's SimpleCPUOffloadConnector (eager) on one tier, --host (cpu backend) or --ssd (disk backend), replayed sequentially.")
    lookup: TierLookup = typer.Option(TierLookup.any, "--lookup", help="any: GPU then lower tiers block by block; gpu-prefix: lower tiers only extend the GPU prefix (vLLM's connectors).")
    kv_bytes_per_token: Optional[int] = typer.Option(None, "--kv-bytes-per-token", parser=bounded_int(1, MAX_KV_BYTES_PER_TOKEN), help="KV bytes per token (default: the capture's engine metadata).")
    model_config: KvModelConfigOption = None
    restore_results: Optional[Path] = typer.Option(None, "--restore-results", help="A `replay run --out` directory: restore costs measured on the target host.")
    ssd_route: Optional[str] = typer.Option(None, "--ssd-route", help="Which measured route restores the SSD tier (default: the most direct measured).")
    host_gbps: Optional[float] = typer.Option(None, "--host-gbps", parser=finite_float(0, 1e6, lo_open=True), help="Host tier restore throughput, GB/s.")
    ssd_gbps: Optional[float] = typer.Option(None, "--ssd-gbps", parser=finite_float(0, 1e6, lo_open=True), help="SSD tier restore throughput, GB/s.")
    host_latency_ms: float = typer.Option(0.0, "--host-latency-ms", parser=finite_float(0, MAX_SECONDS), help="Host tier latency per request's reads, ms.")
    ssd_latency_ms: float = typer.Option(0.0, "--ssd-latency-ms", parser=finite_float(0, MAX_SECONDS), help="SSD tier latency per request's reads, ms.")
    prefill_tokens_per_s: Optional[float] = typer.Option(None, "--prefill-tokens-per-s", parser=finite_float(0, MAX_TOKENS_PER_S, lo_open=True), help="Prefill throughput (default: fitted on the capture's measured prefills).")
    sweep_host: Optional[str] = typer.Option(None, "--sweep-host", help="Host capacities to sweep, comma-separated (0: absent).")
    sweep_ssd: Optional[str] = typer.Option(None, "--sweep-ssd", help="SSD capacities to sweep, comma-separated (0: absent).")
    within: float = typer.Option(5.0, "--within", parser=finite_float(0, 100), help="With a sweep: report the smallest configuration within this percent of the best.")
    plot: plot_option("With a sweep: write the host x SSD heatmap to FILE.png or FILE.svg.") = None
    journal: Optional[Path] = typer.Option(None, "--journal", help="Write the SSD tier's reads as a replay store (journal + payloads) for `replay run`.")
    journal_max_restores: int = typer.Option(16, "--journal-max-restores", parser=bounded_int(1, 1 << 20), help="With --journal: at most this many restores.")
    children: int = typer.Option(5, "--children", parser=bounded_int(1, 1 << 20), help="family-burst: number of children.")
    ancestor_mib: float = typer.Option(48, "--ancestor-mib", parser=finite_float(0, 1 << 30, lo_open=True), help="family-burst: ancestor size in MiB.")
    chunks: int = typer.Option(16, "--chunks", parser=bounded_int(1, 1 << 20), help="family-burst: chunks per ancestor.")
    lmcache: Optional[str] = typer.Option(None, "--lmcache", help="Model LMCache's server instead: chunk_size=256,l1_size_gb=1,eviction_policy=LRU[,fs=DIR] (its lmcache server flags); stores, loads and external hits beside the capture's.")
    lmcache_peer: Optional[Path] = typer.Option(None, "--lmcache-peer", help="With --lmcache: the capture of another engine sharing that LMCache server.")
    engine: EngineOption = None
    ray: ray_option(" With a sweep: one task per configuration.") = None
    dataset: RequestDatasetFlags = RequestDatasetFlags()

    def options(self):
        """The analysis' options (`TiersOptions`), the capacity from --capacity-blocks or its old name."""
        from kmesh_trace.oracle.tiers import TiersOptions

        capacity, flag = aliased(self.capacity_blocks, "--capacity-blocks", self.gpu_blocks, "--gpu-blocks")
        self.dataset.import_options(self.trace)  # --tokenizer on any other input: refused before anything is read
        return options_of(TiersOptions, self, capacity_blocks=capacity, capacity_flag=flag)


@handles_errors
@output_options()
@takes_flags
def tiers_cmd(f: TiersFlags, output: Output = None) -> None:
    """Simulate the trace through the GPU pool and host/SSD tiers; hits by tier, bytes read, seconds saved, TTFT."""
    options = f.options()
    _check_outputs(f.trace, f.scenario, options, f.ray, f.plot, f.journal)
    report = _tiers(f, options)
    d = report.to_dict()
    emit(output, d, render=lambda: render(report))


def _tiers(f: TiersFlags, options):
    """The analysis on the input the flags name: a built-in family burst, or a trace or scenario's workload."""
    from kmesh_trace.oracle import tiers as tm

    if f.scenario is not None and f.scenario.value == "family-burst":
        return tm.run_family_burst(options)
    from kmesh_trace.oracle.executor import InProcess, OnRay

    executor = InProcess() if f.ray is None else OnRay(f.ray)
    with (_input(f.trace, f.scenario, direct=f.ray is None, import_options=f.dataset.import_options(f.trace))
          as (source, name), _peer(f.lmcache_peer) as peer, _sweep_progress(executor)):
        report = tm.run(source, options, executor, name=name, engine=f.engine, peer=peer)
    for note in report.notes:
        err.print(f"note: {note}")
    if f.plot is not None:
        from kmesh_trace.apps.plots import plot_tier_sweep

        plot_tier_sweep(report.sweep, f.plot, report.head["block_size"])
        err.print(f"wrote {f.plot}", markup=False, highlight=False, soft_wrap=True)
    if f.journal is not None:
        report.journal = _write_journal(report.results[-1], f.journal, f.journal_max_restores, report.head["trace"])
    return report


def _check_outputs(trace, scenario, options, ray, plot, journal) -> None:
    """What the command line asks that no analysis could: one input, and outputs a sweep or a trace gives."""
    if (trace is None) == (scenario is None):
        raise KmeshTraceError("give either a TRACE directory or --scenario, not both and not neither.")
    if ray is not None and not options.swept:
        raise KmeshTraceError("--ray runs a sweep's configurations as tasks; add --sweep-host and/or --sweep-ssd.")
    if plot is not None and not options.swept:
        raise KmeshTraceError("--plot draws a host x SSD sweep; add --sweep-host and/or --sweep-ssd.")
    check_plot_option(plot, [trace, options.restore_results, options.model_config])
    check_ray_option(ray)
    if journal is not None and options.lmcache is not None:
        raise KmeshTraceError("--journal writes the SSD tier's reads; the LMCache model (--lmcache) has none.")
    if journal is not None:
        check_out_dir(journal, "--journal")
        check_out_not_in_input(journal, [trace, options.restore_results, options.model_config], "--journal")


@contextmanager
def _input(trace: Optional[Path], scenario, *, direct: bool, import_options: dict | None = None):
    """(the run's input, its name in the output): a trace (kept open: the prefill fit reads it), a public
    trace read as it is (`direct`: not for Ray tasks, which read a trace directory), or a built-in workload."""
    if scenario is not None:  # any built-in workload but family-burst: a stream with no capture metadata
        yield build_scenario(scenario), f"scenario:{scenario.value}"
        return
    from kmesh_trace.sources import open_as_trace, read_directly

    public = read_directly(trace, on_import=err.print) if direct else None
    if public is not None:  # in memory, as its import would read: the same requests, no prefill timings
        yield public, str(trace)
        return

    with open_as_trace(trace, on_import=err.print, until_exit=True, import_options=import_options) as t:  # imported first
        yield t, str(trace)


@contextmanager
def _peer(path: Optional[Path]):
    """(the opened peer capture, its name) for --lmcache-peer, or None."""
    if path is None:
        yield None
        return
    from kmesh_trace.sources import open_as_trace

    with open_as_trace(path, on_import=err.print) as t:
        yield t, str(path)


@contextmanager
def _sweep_progress(executor):
    """A sweep's progress bar on `executor`'s tasks, started once the sweep's tasks are known."""
    bar = task = None

    def on_start(num_tasks: int) -> None:
        nonlocal bar, task
        bar = progress()
        bar.start()
        task = bar.add_task("tiers" if executor.remote else "simulating tiers", total=num_tasks)

    executor.on_start, executor.on_done = on_start, lambda _: bar.advance(task)
    try:
        yield
    finally:
        if bar is not None:
            bar.stop()


def render(report) -> None:
    """A `TiersReport` or the family burst's `ArmsReport` on the consoles: its lines, tables and notes
    (`oracle/tiers/render.py` lays them out)."""
    from kmesh_trace.oracle.tiers.render import Note, TableRows

    for item in report.lines():
        if isinstance(item, TableRows):
            table = Table(title=item.title, title_justify="left")
            for header, justify, short in item.columns:
                table.add_column(header, justify=justify, short=short)
            for row in item.rows:
                table.add_row(*row)
            out.print(table)
        elif isinstance(item, Note):
            err.print(f"note: {item.text}")
        else:
            prose(item)


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
