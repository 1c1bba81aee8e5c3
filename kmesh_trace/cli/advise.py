"""`advise`: the sizing ladder of a trace on one screen, the verdict first (`kmesh_trace.apps.advise`)."""

from __future__ import annotations

import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer

from kmesh_trace.cli.common import (
    EngineOption,
    KvModelConfigOption,
    Output,
    RequestDatasetFlags,
    Table,
    capacities_of_input,
    check_plot_option,
    emit,
    err,
    handles_errors,
    one_capacity_flag,
    open_input,
    out,
    output_options,
    plot_option,
)
from kmesh_trace.cli.flags import flags, options_of, takes_flags
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.values import MAX_BLOCKS, MAX_KV_BYTES_PER_TOKEN, MAX_TOKENS_PER_S, bounded_int, finite_float

#: The human output's width: one screen of a terminal.
WIDTH = 80


def register(app: typer.Typer) -> None:
    app.command("advise")(advise_cmd)


@flags
class AdviseFlags:
    """`advise`'s flags; the analysis' own options are named as `AdviseOptions` names them."""

    trace: Path = typer.Argument(..., help="Trace directory (a capture, a KV-events recording, an import), a "
                                           "Mooncake/Bailian JSONL file, weka or lmcache-agent directory, or a request "
                                           "dataset (OpenAI-compatible JSONL, ShareGPT JSON, vllm bench custom JSONL).")
    capacity_blocks: Optional[int] = typer.Option(None, "--capacity-blocks", parser=bounded_int(1, MAX_BLOCKS),
                                                  help="The engine's pool in blocks (default: the trace's usable "
                                                       "blocks; an import: where LRU reaches half the infinite "
                                                       "cache's hits).")
    capacity: Optional[str] = typer.Option(None, "--capacity", help="The engine's pool as a size (40GiB: converted "
                                           "with the KV bytes per token, or a hybrid engine's page sizes) or "
                                           "blocks; instead of --capacity-blocks.")
    engines: Optional[int] = typer.Option(None, "--engines", parser=bounded_int(1, 4096),
                                          help="Add the fleet rungs for N engines of the pool's size (default: the "
                                               "trace's engines, when it has several).")
    within: float = typer.Option(5.0, "--within", parser=finite_float(0, 100),
                                 help="Recommend the smallest configuration within this percent of the bound.")
    prefill_tokens_per_s: Optional[float] = typer.Option(
        None, "--prefill-tokens-per-s", parser=finite_float(0, MAX_TOKENS_PER_S, lo_open=True),
        help="Prefill throughput, for seconds (default: fitted to a capture's measured prefills).")
    prefill_rate: Optional[str] = typer.Option(None, "--prefill-rate",
                                               help="A measured prefill rate by its key, for seconds: "
                                                    "llama3-8b-shape/h200/pytorch (kmesh_trace.apps.advise."
                                                    "PREFILL_RATES says where each comes from).")
    kv_bytes_per_token: Optional[int] = typer.Option(
        None, "--kv-bytes-per-token", parser=bounded_int(1, MAX_KV_BYTES_PER_TOKEN),
        help="KV bytes per token, for sizes in bytes (default: the capture's engine metadata).")
    model_config: KvModelConfigOption = None
    dataset: RequestDatasetFlags = RequestDatasetFlags()
    engine: EngineOption = None
    plot: plot_option("Also draw the ladder to FILE.png or FILE.svg.") = None


@handles_errors
@output_options()
@takes_flags
def advise_cmd(f: AdviseFlags, output: Output = None) -> None:
    """The answer in one place: the hit-ratio ladder from the infinite cache to what the engine reached, with
    holds, host/SSD tiers and N engines, and the smallest configuration within --within percent of the bound."""
    from kmesh_trace.apps.advise import AdviseOptions

    options = options_of(AdviseOptions, f)
    options.check()
    one_capacity_flag(f.capacity_blocks, f.capacity)
    check_plot_option(f.plot, [f.trace, f.model_config])
    advice = _advise(f, options)
    for note in advice.notes:
        err.print(f"note: {note}", markup=False, highlight=False)
    d = advice.to_dict()
    if f.plot is not None:
        from kmesh_trace.apps.plots import plot_ladder

        plot_ladder(d, f.plot)
        err.print(f"wrote {f.plot}", markup=False, highlight=False, soft_wrap=True)
    emit(output, d, render=lambda: render(d))


def _advise(f: AdviseFlags, options):
    """The analysis on the input the flags name, with a status line on stderr."""
    from kmesh_trace.apps.advise import advise

    options_in = f.dataset.import_options(f.trace)
    with open_input(f.trace, None, f.engine, False, direct=True, import_options=options_in) as (t, _):
        source = None
        if f.capacity is not None:
            caps = capacities_of_input(f.capacity, t, None, f.engine, f.kv_bytes_per_token, f.model_config)
            if len(caps) != 1:
                raise KmeshTraceError(f"--capacity takes one pool size, not {len(caps)}.")
            options, source = replace(options, capacity_blocks=caps[0]), f"--capacity {f.capacity}"
        with err.status("advise") as status:
            return advise(t, options, source_arg=str(f.trace), engine=f.engine, capacity_source=source,
                          progress=lambda what: status.update(f"advise: {what}"))


def _wrap(text: str, indent: str = "") -> str:
    return "\n".join(textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent or "  ",
                                   break_on_hyphens=False, break_long_words=False))


def _size(nbytes) -> str:
    from kmesh_trace.apps.advise import size_words

    return "-" if nbytes is None else size_words(nbytes)


def _count(n: int) -> str:
    """A token count in at most 7 characters: exact below ten million, else in millions."""
    return f"{n:,}" if n < 10**7 else f"{n / 1e6:,.1f}M"


def _seconds(r: dict) -> str:
    s = r["prefill_s"]
    if s is None:
        return "-"
    text = f"{s:,.0f}" if s >= 100 else f"{s:,.2f}"
    if r["prefill_s_error"] is None or not s:
        return text
    return f"{text}±{r['prefill_s_error'] / s:.0%}"


def _model_error_lines(d: dict) -> list[str]:
    """Beside the ladder: the modelled rung's error against a real engine, and which rungs no engine measured."""
    from kmesh_trace.oracle.model_error import kind

    e = d["model_error"]
    out = [f"modelled: ±{e['max_abs_hit_ratio_error']:.4f} hit ratio against a real engine, {e['num_replays']} "
           f"replays ({e['num_exact']} exact) on {e['engine']} ({e['source']})"]
    kinds: dict[str, list[str]] = {}
    for r in d["ladder"]:
        k = kind(r["rung"])
        if k not in (None, "modelled"):
            kinds.setdefault(k, []).append(r["rung"])
    out += [f"{', '.join(names)}: not measured: {e['unmeasured'][k]}" for k, names in kinds.items()]
    return out


def lines(d: dict) -> list:
    """The human output, from the JSON: the verdict, the ladder, the recommendation, what the trace could not
    answer. Items are strings (lines) or a `Table`."""
    from kmesh_trace.apps.advise import blocks, unanswered_sentence

    items: list = [_wrap(d["verdict"]), ""]
    t = Table(title=f"ladder: {d['num_requests']:,} requests, {d['block_size']}-token blocks, pool "
                    f"{blocks(d['capacity_blocks'])}", title_justify="left")
    for h in ("rung", "tok_hit", "prefill", "prefill_s", "blocks", "size"):
        t.add_column(h, justify="left" if h == "rung" else "right")
    for r in d["ladder"]:
        t.add_row(r["rung"], f"{r['token_hit_ratio']:.1%}", _count(r["prefill_tokens"]), _seconds(r),
                  f"{r['capacity_blocks']:,}", _size(r["capacity_bytes"]))
    items.append(t)
    p = d["prefill"]
    if p.get("source") == "fit":
        items.append(_wrap(f"prefill_s: fitted to {p['n']:,} measured prefills, r2 {p['r2']:.3f}; ± is the fit's "
                           "median relative error per request"))
    elif p.get("source") == "throughput":
        items.append(_wrap(f"prefill_s: at {p['tokens_per_s']:,g} prefill tokens/s (given)"))
    elif p.get("source") == "table":
        items.append(_wrap(f"prefill_s: the measured rate {p['key']} ({p['model']} on {p['gpu']}, "
                           f"{p['tokens_per_s']:,.0f} tokens/s at position 0; its source: --json, key prefill.cited)"))
    items += [_wrap(line) for line in _model_error_lines(d)]
    rec = d["recommendation"]
    items += ["", _wrap(f"recommendation ({'within' if rec['reaches'] else 'not within'} {rec['within_pct']:g}% of "
                        f"the bound): {rec['label']}"), _wrap(rec["how"], "  ")]
    if d["unanswered"]:
        items += ["", "the trace could not answer:"]
        items += [_wrap(f"- {unanswered_sentence(u)}", "    ").replace("    - ", "  - ", 1)
                  for u in d["unanswered"]]
    items += ["", _wrap("tok_hit: hit prompt tokens / prompt tokens; prefill: prompt tokens computed. --json adds "
                        "the block hit ratio and each rung's reproducing command (key `command`).")]
    return items


def render(d: dict) -> None:
    for item in lines(d):
        if isinstance(item, str):
            out.print(item, markup=False, highlight=False, soft_wrap=True)
        else:
            out.print(item)
