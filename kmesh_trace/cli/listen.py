"""`listen`: record the KV events unmodified vLLM / SGLang engines publish, without a plugin.

A SOURCE is a publisher endpoint (`ipc://...`, `tcp://host:port`; its replay endpoint with
`--replay-endpoint`, given once per endpoint in the same order) or an engine server's URL
(`http://host:port`: every DP rank's endpoints from its `GET /kv_event_sources`). One trace
partition per publisher (`capture/listen.py`); SIGINT or SIGTERM ends the recording complete.
`--live` redraws a small table on stderr every few seconds (`capture/live_stats.py`).
"""

from __future__ import annotations

import signal
from pathlib import Path

import typer

from kmesh_trace.cli.common import check_out_dir, err, fail, handles_errors, print_json
from kmesh_trace.cli.flags import flags, takes_flags
from kmesh_trace.schema import MAX_BLOCK_SIZE
from kmesh_trace.values import finite_float

#: The longest interval or duration a flag may give (seconds, about 31 years).
MAX_WAIT_S = 1e9

FORMAT_CHOICES = ("auto", "vllm-map", "vllm-array", "sglang")


def register(app: typer.Typer) -> None:
    app.command("listen")(listen_cmd)


def _specs(sources: list[str], replay: list[str], topic: str, fmt: str, block_size: int | None,
           num_blocks: int | None, bind: bool = False, allow_remote: bool = False):
    from kmesh_trace.capture.endpoints import check_bind, check_endpoint, split_tcp, url_host
    from kmesh_trace.capture.listen import PublisherSpec
    from kmesh_trace.capture.sources import discover

    endpoints = [s for s in sources if not s.startswith(("http://", "https://"))]
    for s in endpoints:
        if not s.startswith(("tcp://", "ipc://")):
            fail(f"{s} is not a source: give a publisher endpoint (tcp://HOST:PORT, ipc://PATH) or an engine "
                 "server's URL (http://HOST:PORT).")
        check_endpoint(s, "publisher endpoint")
    if len(replay) > len(endpoints):
        fail(f"{len(replay)} --replay-endpoint for {len(endpoints)} publisher endpoint(s); give at most one per "
             "endpoint, in the same order (a server URL announces its own).")
    for r in replay:
        check_endpoint(r, "--replay-endpoint")
    specs, named = [], {}
    for s in sources:
        if s in endpoints:
            i = endpoints.index(s)
            specs.append(PublisherSpec(s, replay[i] if i < len(replay) else None, topic))
            named[s] = split_tcp(s)[0] if s.startswith("tcp://") else None
        else:
            for spec in discover(s, allow_remote=allow_remote):
                specs.append(spec)
                named[spec.endpoint] = url_host(s)
    for spec in specs:
        spec.bind = bind and spec.endpoint.startswith("tcp://")
        if spec.bind:
            check_bind(spec.endpoint, named.get(spec.endpoint))
        spec.format = spec.format if fmt == "auto" else fmt
        spec.block_size = block_size or spec.block_size
        spec.num_usable_blocks = num_blocks or spec.num_usable_blocks
    return specs


@flags
class ListenFlags:
    """`listen`'s flags."""

    sources: list[str] = typer.Argument(..., help="Publisher endpoints (tcp://, ipc://) or engine server URLs (http://).")
    out_dir: Path = typer.Option(..., "--out", "-o", help="Trace directory (created if missing; an existing recording "
                                 "of the same publishers is resumed).")
    replay: list[str] = typer.Option([], "--replay-endpoint", help="Replay endpoint of each publisher endpoint, in order.")
    topic: str = typer.Option("", "--topic", help="Topic the publishers were given (for endpoints; a URL announces it).")
    fmt: str = typer.Option("auto", "--format", help=f"Event format: {', '.join(FORMAT_CHOICES)} (auto detects it).")
    block_size: int = typer.Option(None, "--block-size", min=1, max=MAX_BLOCK_SIZE, help="Tokens per block (default: what the server or "
                                   "the events say).")
    num_blocks: int = typer.Option(None, "--num-blocks", min=1, help="The engine's usable KV blocks (default: what the "
                                   "server's /metrics says); the analyses and --live's LRU model need it.")
    bind: bool = typer.Option(False, "--bind", help="Bind the tcp:// endpoints instead of connecting: for engines "
                              "given a concrete address (tcp://HOST:PORT), which then connect to the listener.")
    allow_remote: bool = typer.Option(False, "--allow-remote", help="Connect to publishers a server on a loopback URL "
                                      "announces on other hosts (refused by default).")
    flush_s: float = typer.Option(1.0, "--flush-s", parser=finite_float(0, MAX_WAIT_S, lo_open=True), help="Write a Parquet part at least this often (seconds, > 0).")
    max_buffered_events: int = typer.Option(524288, "--max-buffered-events", min=1,
                                            help="Block events held between writes per publisher; more are counted as dropped.")
    live: bool = typer.Option(False, "--live", help="Redraw a table of rates and hit ratios on stderr.")
    live_s: float = typer.Option(3.0, "--live-interval", parser=finite_float(0, MAX_WAIT_S, lo_open=True), help="Seconds between --live redraws (> 0).")
    duration_s: float = typer.Option(None, "--duration", parser=finite_float(0, MAX_WAIT_S, lo_open=True), help="Stop after this many seconds (default: until SIGINT/SIGTERM).")
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON on stdout when the recording ends.")

    def check(self) -> None:
        """Refuse what cannot record: the optional libraries missing, an unknown format, a time not above zero."""
        try:
            import msgspec  # noqa: F401
            import zmq  # noqa: F401
        except ImportError as e:
            fail(f"listen needs {e.name}, which is not installed: pip install 'kmesh-trace[listen]'.")
        if self.fmt not in FORMAT_CHOICES:
            fail(f"--format must be one of {', '.join(FORMAT_CHOICES)}, not {self.fmt!r}.")
        if not self.flush_s > 0 or not self.live_s > 0 or (self.duration_s is not None and not self.duration_s > 0):
            fail("--flush-s, --live-interval and --duration must be > 0 seconds.")


@handles_errors
@takes_flags
def listen_cmd(f: ListenFlags) -> None:
    """Record the KV events of unmodified vLLM or SGLang engines into a trace at --out, until Ctrl-C.

    Exit codes: 0 recorded (every partition complete); 1 could not start (a bad source, an unreachable server)."""
    f.check()
    from kmesh_trace.capture.listen import Listener

    out_dir = check_out_dir(f.out_dir, "--out").resolve()
    specs = _specs(f.sources, f.replay, f.topic, f.fmt, f.block_size, f.num_blocks, f.bind, f.allow_remote)
    listener = Listener(out_dir, specs, flush_interval_s=f.flush_s, max_buffered_events=f.max_buffered_events)
    signals = _record(listener, out_dir, f.live, f.live_s, f.duration_s)
    summary = summarize(out_dir, listener, signals)
    if f.as_json:
        print_json(summary)
    else:
        _render_summary(summary)
    _maybe_exit_now()


def _record(listener, out_dir: Path, live: bool, live_s: float, duration_s: float | None) -> list[str]:
    """Record until SIGINT or SIGTERM (or `duration_s`), with `live`'s table redrawn on stderr: the signals
    that ended it. The signals are caught before the first line says the recording started."""
    signals: list[str] = []

    def stop(signum, _frame):
        signals.append(signal.Signals(signum).name)
        listener.stop.set()

    saved = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    for rec in listener.recorders:
        err.print(f"listening to {rec.spec.endpoint} -> {out_dir}/block_events/engine={rec.engine_id}",
                  markup=False, highlight=False, soft_wrap=True)
    try:
        if live:
            from rich.live import Live

            with Live(live_table(listener, None), console=err.console, auto_refresh=False) as view:
                listener.run(on_tick=lambda: view.update(live_table(listener, True), refresh=True), tick_s=live_s,
                             duration_s=duration_s)
        else:
            listener.run(duration_s=duration_s)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    return signals


def _render_summary(summary: dict) -> None:
    """The recording's summary on stderr: one line per publisher, then the trace."""
    for eid, e in summary["publishers"].items():
        err.print(f"publisher {e['endpoint']} ({eid}): {e['num_batches']:,} batches, {e['rows']:,} block events "
                  f"({e['num_touched_blocks']:,} touched), gaps {e['num_gaps']:,} ({e['num_recovered_batches']:,} "
                  f"batches recovered, {e['num_unrecovered_batches']:,} lost, {e['num_unread_at_stop']:,} of them unread at "
                  f"the stop), {e['num_duplicate_batches']:,} duplicates, malformed "
                  f"{e['num_malformed_frames']:,} frames / {e['num_malformed_events']:,} events; "
                  f"{'complete' if e['complete'] else 'INCOMPLETE'}", markup=False, highlight=False, soft_wrap=True)
    err.print(f"trace: {summary['trace']}", markup=False, highlight=False)


def _maybe_exit_now() -> None:
    """Run as the program, end as soon as the trace is closed and the summary written: tearing down the
    interpreter after a long recording (every object it made) takes longer than the one second a
    stopped recording is allowed. In-process callers (tests, notebooks) simply return."""
    import os
    import sys

    from kmesh_trace import cli

    if getattr(sys.modules.get("__main__"), "main", None) is cli.main:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def summarize(out_dir: Path, listener, signals: list[str]) -> dict:
    pubs = {}
    for rec in listener.recorders:
        st = rec.stats
        pubs[rec.engine_id] = {
            "endpoint": rec.spec.endpoint, "format": st["format"], "rows": rec.writer.num_rows["block_events"],
            **{k: st[k] for k in ("num_batches", "num_replayed_batches", "num_gaps", "num_recovered_batches",
                                  "num_unrecovered_batches", "num_malformed_frames", "num_malformed_events",
                                  "num_touched_blocks", "num_duplicate_batches", "num_late_batches",
                                  "num_unread_at_stop")},
            "num_epochs": len(st["epochs"]), "complete": bool(rec.writer.metadata.get("complete"))}
    return {"trace": str(out_dir), "signals": signals, "publishers": pubs}


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def live_table(listener, take: bool | None):
    """One row per publisher: stored/evicted blocks per second, and with hits the stock ratio and the LRU model."""
    from kmesh_trace.cli.display import Table

    table = Table(title="kmesh-trace listen", title_justify="left")
    # Short headers where an engine's name (its endpoint, an ipc:// path) leaves no room at 120 columns.
    short = {"evicted/s": "evict/s", "touched": "hits", "stock hit": "stock", "gaps lost": "lost", "malformed": "bad"}
    for col in ("engine", "stored/s", "evicted/s", "touched", "stock hit", "LRU 1x", "LRU 2x", "LRU 4x", "gaps lost",
                "malformed"):
        table.add_column(col, justify="left" if col == "engine" else "right", short=short.get(col))
    for rec in listener.recorders:
        r = rec.live.take_rates() if take else {"stored_per_s": 0.0, "evicted_per_s": 0.0, "stock_hit_ratio": None,
                                                "lru_hit_ratio": {}}
        hits = rec.stats["num_touched_blocks"] > 0
        lru = r["lru_hit_ratio"]
        table.add_row(rec.engine_id, f"{r['stored_per_s']:.1f}", f"{r['evicted_per_s']:.1f}",
                      f"{rec.stats['num_touched_blocks']:,}", _ratio(r["stock_hit_ratio"]),
                      *(_ratio(lru.get(m)) if hits else "-" for m in ("1x", "2x", "4x")),
                      f"{rec.stats['num_unrecovered_batches']:,}",
                      f"{rec.stats['num_malformed_frames'] + rec.stats['num_malformed_events']:,}")
    notes = []
    if any(not rec.live.models for rec in listener.recorders):
        notes.append("LRU columns need the engine's blocks (--num-blocks, or a server URL)")
    if any(rec.stats["num_touched_blocks"] == 0 for rec in listener.recorders):
        notes.append("hit ratios need requests with kv_cache_report_mode \"full\"")
    if notes:
        table.caption = "; ".join(notes)
    return table
