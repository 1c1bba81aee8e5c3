"""`replay probe|prepare|run`: the native replay of KV restorations, rendered for people or as JSON.

The work lives in kmesh_trace.native (store, routes, runner); this module parses options, shows a
progress bar on stderr and renders results. It imports only pyarrow/numpy/stdlib paths, so it runs on
GPU hosts that have no polars, DuckDB or vLLM.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer
from kmesh_trace.cli.display import Table

from kmesh_trace.cli.common import EXIT_BLOCKING, check_out_dir, check_out_not_in_input, err, fail, handles_errors, out, print_json, progress
from kmesh_trace.cli.flags import flags, options_of, takes_flags
from kmesh_trace.values import bounded_int

replay_app = typer.Typer(help="Replay KV restorations natively (io_uring, O_DIRECT, GPU routes) and verify them.",
                         no_args_is_help=True)

_ALL_ROUTES = "host,host_fixed,cufile,dmabuf_fixed"


def register(app: typer.Typer) -> None:
    app.add_typer(replay_app, name="replay")


def _routes(text: str) -> list[str]:
    return [r.strip() for r in text.split(",") if r.strip()]


@replay_app.command("probe")
@handles_errors
def probe_cmd(
    routes: str = typer.Option(_ALL_ROUTES, "--routes", help="Comma-separated routes to probe."),
    directory: Path = typer.Option(None, "--dir", help="Where payload stores live (O_DIRECT is tried there); "
                                   "default: the temporary directory."),
    steps: bool = typer.Option(False, "--steps", help="Show every precondition checked, not only the first failure."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output (always includes the steps)."),
) -> None:
    """Say which replay routes this host can run: `ok`, or `unavailable: <first failed precondition>`.

    Exit codes: 0 the probe ran (unavailable routes included); 1 could not run (usage or I/O error)."""
    from kmesh_trace.native.routes import probe_route

    results = [probe_route(r, directory) for r in _routes(routes)]
    if as_json:
        print_json([p.as_dict() for p in results])
        return
    width = max(len(p.route) for p in results)
    for p in results:
        out.print(f"{p.route:<{width}}  {'ok' if p.ok else 'unavailable: ' + p.reason}", markup=False, highlight=False)
        if steps:
            for s in p.steps:
                out.print(f"{'':<{width}}    [{'x' if s.ok else ' '}] {s.name}: {s.detail}", markup=False,
                          highlight=False)


@replay_app.command("prepare")
@handles_errors
def prepare_cmd(
    out_dir: Path = typer.Option(..., "--out", help="Directory to create the store in."),
    from_trace: Path = typer.Option(None, "--from", help="Size restores from this trace's completed load transfers."),
    num_restores: int = typer.Option(1, "--num-restores", parser=bounded_int(1, 1 << 20), help="Restores to write (ignored with --from)."),
    chunks: int = typer.Option(16, "--chunks", parser=bounded_int(1, 1 << 20), help="Chunks per restore (ignored with --from)."),
    chunk_bytes: int = typer.Option(3 << 20, "--chunk-bytes", parser=bounded_int(1, 1 << 40), help="Bytes per chunk; a multiple of 4096."),
    max_restores: int = typer.Option(64, "--max-restores", parser=bounded_int(1, 1 << 20), help="With --from: at most this many restores."),
    seed: int = typer.Option(0, "--seed", help="Seed of the deterministic payload content."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Write payload files (deterministic pseudo-random) and a Parquet journal; default: one 48 MiB ancestor.

    Exit codes: 0 ok; 1 could not run (usage, input or I/O error)."""
    from kmesh_trace.native import store as st
    from kmesh_trace.paths import FREE_SPACE_MARGIN, free_space

    st.check_seed(seed)
    check_out_dir(out_dir, "--out")
    if from_trace is not None:
        room = free_space(out_dir) - FREE_SPACE_MARGIN
        plan, source = st.plan_from_trace(from_trace, chunk_bytes, max_restores, room), f"trace:{from_trace}"
    else:
        plan, source = st.plan_uniform(num_restores, chunks, chunk_bytes), "uniform"
    check_out_not_in_input(out_dir, [from_trace])
    with progress() as bar:
        task = bar.add_task("writing payloads", total=len(plan))
        s = st.prepare(out_dir, plan, seed=seed, source=source, progress=lambda done, _: bar.update(task, completed=done))
    info = {"store": str(s.path), "journal": str(s.path / st.JOURNAL), "num_restores": len(s.restores),
            "num_chunks": sum(len(c) for c in s.restores.values()), "num_bytes": s.num_bytes, "seed": s.seed,
            "source": source}
    if as_json:
        print_json(info)
        return
    out.print(f"store {info['store']}: {info['num_restores']} restores, {info['num_chunks']} chunks, "
              f"{info['num_bytes'] / 2**20:,.1f} MiB; journal {info['journal']}", markup=False, highlight=False)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _render(summary: dict) -> None:
    from rich import box

    t = Table(title="replay: accepted measured restores, warm-ups excluded (times in ms; t1 I/O done, "
                  "t2 GPU consumer done)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for h in ("route", "n", "t1 p50", "t1 p95", "t2 p50", "t2 p95", "GB/s", "MiB", "rej", "drained"):
        t.add_column(h, justify="left" if h == "route" else "right", no_wrap=True)
    for name, r in summary["routes"].items():
        t2 = r["timer2"] or {}
        own = r["ownership"] or {}
        t.add_row(name, str(r["num_measured"]), _ms(r["timer1"]["p50_ms"]), _ms(r["timer1"]["p95_ms"]),
                  _ms(t2.get("p50_ms")), _ms(t2.get("p95_ms")),
                  "-" if r["p50_gbps_timer1"] is None else f"{r['p50_gbps_timer1']:.2f}",
                  f"{r['bytes_moved'] / 2**20:,.0f}", str(r["num_rejected"]),
                  {True: "yes", None: "n/a"}.get(own.get("drained"), "NO"))
    out.print(t)
    p = Table(title="per pair (A B, then B A, ...)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for h in ("pair", "route", "position", "n", "t1 p50", "t1 p95", "t2 p50", "t2 p95"):
        p.add_column(h, justify="left" if h == "route" else "right", no_wrap=True)
    for row in summary["pairs"]:
        p.add_row(str(row["pair"]), row["route"], str(row["position"]), str(row["num_measured"]),
                  _ms(row["timer1"]["p50_ms"]), _ms(row["timer1"]["p95_ms"]), _ms(row["timer2"]["p50_ms"]),
                  _ms(row["timer2"]["p95_ms"]))
    out.print(p)
    out.print(f"corruptions rejected: {summary['corruptions_rejected']}/{summary['corruption_checks']}; "
              f"unexpected rejections: {len(summary['unexpected_rejections'])}; "
              f"all buffers returned: {_ownership_word(summary['all_buffers_returned'])}"
              + (f" (not measured: {', '.join(summary['ownership_not_measured'])})"
                 if summary.get("ownership_not_measured") else ""), markup=False)
    if summary.get("results"):
        out.print(f"samples: {summary['results']}", markup=False, highlight=False)


@flags
class RunFlags:
    """`replay run`'s flags; the run's own options are named as `RunConfig` names them."""

    store: Path = typer.Argument(..., help="Store directory written by `replay prepare`.")
    routes: str = typer.Option("host", "--routes", help="Comma-separated routes, alternated in pairs.")
    pairs: int = typer.Option(4, "--pairs", parser=bounded_int(1, 1 << 20), help="Pairs of arms (A B, B A, ...).")
    restores: int = typer.Option(100, "--restores", parser=bounded_int(1, 1 << 30), help="Measured restores per route, spread over the pairs.")
    warmup: int = typer.Option(5, "--warmup", parser=bounded_int(0, 1 << 30), help="Warm-up restores at the start of each arm (excluded).")
    corrupt: int = typer.Option(0, "--corrupt", parser=bounded_int(0, 1 << 30), help="Flip bytes in N payloads; each must be rejected.")
    depth: int = typer.Option(8, "--depth", parser=bounded_int(1, 4096), help="io_uring queue depth per worker.")
    workers: int = typer.Option(1, "--workers", parser=bounded_int(1, 1024), help="Worker rings (threads) per restore.")
    seed: int = typer.Option(0, "--seed", help="Seed that picks the corrupted payloads.")
    results: Path = typer.Option(None, "--out", help="Results directory (default: STORE/runs/<UTC time>).")
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON.")


@replay_app.command("run")
@handles_errors
@takes_flags
def run_cmd(f: RunFlags) -> None:
    """Restore the store's journal through each route, verify every byte, keep every sample.

    Exit codes: 0 every restore verified; 1 could not run (usage, input or I/O error); 3 ran and a verification failed (a corrupted payload accepted, an intact one rejected, a buffer not returned)."""
    from kmesh_trace.native.runner import RunConfig, open_run

    cfg = options_of(RunConfig, f, routes=_routes(f.routes))
    open_run(f.store, cfg)  # options, journal and run size: refused before the progress bar starts
    if f.results is not None:  # written after the whole run: refuse a place it cannot go before it
        check_out_dir(f.results, "--out")
        check_out_not_in_input(f.results, [f.store / "payload", f.store / "journal.parquet"])
    result = _run(f.store, cfg, f.results or f.store / "runs" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    summary = {**result.summary, "results": str(result.out)}
    if f.as_json:
        print_json(summary)
    else:
        _render(summary)
    if not summary["ok"]:
        err.print()
        fail("; ".join(_problems(summary)) + f"; see {result.out}", EXIT_BLOCKING)


def _run(store: Path, cfg, results: Path):
    """The replay, with a progress bar on the restores."""
    from kmesh_trace.native.runner import run

    with progress() as bar:
        task = bar.add_task("restoring", total=None)
        return run(store, cfg, on_progress=lambda done, total: bar.update(task, completed=done, total=total), out=results)


def _problems(summary: dict) -> list[str]:
    """What a run that failed its verification got wrong, one phrase each."""
    problems = []
    if summary["missed_corruptions"]:
        problems.append(f"{len(summary['missed_corruptions'])} corrupted payload(s) were not rejected")
    if summary["unexpected_rejections"]:
        problems.append(f"{len(summary['unexpected_rejections'])} intact restore(s) failed verification")
    if summary["all_buffers_returned"] is False:
        problems.append("not every buffer was returned")
    if any(r["consumer_mismatches"] for r in summary["routes"].values()):
        problems.append("a GPU consumer read bytes other than those verified")
    return problems


def _ownership_word(drained: bool | None) -> str:
    return "not measured" if drained is None else ("yes" if drained else "NO")
