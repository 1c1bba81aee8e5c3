"""`residency`: block lifetimes, reuse gaps, eviction rate and tier movement of a KV-events recording."""

from __future__ import annotations

from pathlib import Path
from typing import Optional
import typer

from kmesh_trace.cli.common import Output, PartitionOption, Table, emit, handles_errors, out, output_options


def register(app: typer.Typer) -> None:
    app.command("residency")(residency_cmd)


def _f(v) -> str:
    return "-" if v is None else f"{v:,.3f}"


@handles_errors
@output_options(csv=True)
def residency_cmd(
    trace: Path = typer.Argument(..., help="Trace directory holding KV-events recordings (`kmesh-trace listen`)."),
    engine: PartitionOption = None,
    bucket_s: Optional[float] = typer.Option(None, "--bucket-s", help="Seconds per eviction-rate bucket "
                                             "(default: a tenth of the recording, at least 1 s)."),
    output: Output = None,
) -> None:
    """How long blocks stay resident, how soon dropped blocks come back, evictions over time, GPU <-> CPU movement."""
    from kmesh_trace.oracle import residency as rs
    from kmesh_trace.trace import open_trace

    with open_trace(trace) as t:
        res = rs.run(t, rs.ResidencyOptions(bucket_s), engine)
    emit(output, res.to_dict(), rows=res.rows(), render=lambda: render(res))


def render(res) -> None:
    """A `ResidencyResult` on the console."""
    for e in res.to_dict()["engines"]:
        mv = e["movement"]
        out.print(f"engine {e['engine']}: {e['span_s']:,.1f} s recorded; {e['num_touched_blocks']:,} touched blocks "
                  f"({'hits recorded' if e['hits_recorded'] else 'no hits: no request reported kv_cache_report_mode full'}); "
                  f"{e['num_cleared']:,} clears; {e['num_removed_unseen']:,} removals of blocks stored before the recording",
                  markup=False, highlight=False)
        t = Table(title="residency by medium", title_justify="left")
        for h in ("medium", "stored", "removed", "still resident", "lifetime p50 (s)", "lifetime p95 (s)",
                  "re-stored", "reuse gap p50 (s)", "reuse gap p95 (s)"):
            t.add_column(h, justify="left" if h == "medium" else "right")
        for m, x in e["media"].items():
            t.add_row(m, f"{x['num_stored']:,}", f"{x['num_removed']:,}", f"{x['num_still_resident']:,}",
                      _f(x["lifetime_s"]["p50"]), _f(x["lifetime_s"]["p95"]), f"{x['num_restored']:,}",
                      _f(x["reuse_gap_s"]["p50"]), _f(x["reuse_gap_s"]["p95"]))
        out.print(t)
        if e.get("by_group"):
            g = Table(title="residency by medium and KV group", title_justify="left")
            for h in ("medium", "group", "stored", "removed", "still resident", "lifetime p50 (s)", "lifetime p95 (s)"):
                g.add_column(h, justify="left" if h == "medium" else "right")
            for x in e["by_group"]:
                g.add_row(x["medium"], "-" if x["kv_group"] is None else str(x["kv_group"]), f"{x['num_stored']:,}",
                          f"{x['num_removed']:,}", f"{x['num_still_resident']:,}", _f(x["lifetime_s"]["p50"]),
                          _f(x["lifetime_s"]["p95"]))
            out.print(g)
        r = Table(title=f"stores and evictions per {e['bucket_s']:g} s", title_justify="left")
        for h in ("from (s)", "stored", "evicted", "evicted/s"):
            r.add_column(h, justify="right")
        for b in e["eviction_rate"]:
            r.add_row(f"{b['start_s']:,.1f}", f"{b['num_stored']:,}", f"{b['num_evicted']:,}",
                      f"{b['num_evicted'] / e['bucket_s']:,.2f}")
        out.print(r)
        out.print(f"tier movement: {mv['gpu_to_lower']:,} GPU -> lower stores, {mv['lower_to_gpu']:,} lower -> GPU, "
                  f"{mv['gpu_evicted_kept_lower']:,} GPU evictions kept below", markup=False, highlight=False)
