"""The block access stream of a KV-events recording (`kmesh-trace listen`), rebuilt as invocations.

A recording of an engine's published events has no request rows: it holds stores (`cached`),
re-announced hits (`touched`: what vLLM publishes for requests sent with kv_cache_report_mode
"full"), removals and clears. The simulators read invocations, so each partition's GPU events are
regrouped into *chains*, one per request as the engine counted them (`kv_rebuild.py`: the step order of
vLLM's batches tells an admission from the re-announced hit of a retried admission attempt or of a
re-admission after preemption; those are counted, not made requests):
- a hit report (or a store without parent) at an admission starts a chain, unless it is such a retry or
  re-admission;
- a store continuing a chain's last block extends it (the rest of a prompt after its hit, then the full
  blocks generation completes);
- a store whose parent ends no chain is a request that reused a prefix without reporting it: its
  chain is that prefix (walked back through the recorded parents) followed by the new blocks, and
  the prefix counts as its hit (`num_unreported_prefixes` says how many). A walk ends where the
  recorded parents loop back (bad data; `num_parent_cycles` counts them), so a rebuilt prefix never
  repeats a block and a recording of N stores rebuilds at most N blocks per chain.
Each chain becomes one invocation: `prompt_block_hashes` = its blocks, `num_prompt_tokens` = blocks
x block size + 1 (the events do not say where the prompt ended; the engine always computes at least
one token past its reusable blocks, so every block of the chain may be a hit and one token is
compulsory), `num_cached_tokens` = its hit blocks x block size (the stock), `arrival_ns` = its first
event. A chain's later blocks (generation) stay with it, at its arrival: an approximation of their
timing, not of their identity.

Without any hit (no request reported kv_cache_report_mode full), the stream cannot be rebuilt: a
hit and a fresh store look alike in the order the analyses need, so they refuse, in one sentence.
"""

from __future__ import annotations

import polars as pl
import pyarrow as pa

from kmesh_trace import schema
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.kv_rebuild import Rebuild
from kmesh_trace.oracle.stream import check_block_size
from kmesh_trace.writer import to_contract



def kv_event_engines(trace, engine: str | None = None) -> list[str]:
    """The chosen engine partitions (one, or all) that are KV-events recordings."""
    engines = [engine] if engine is not None else list(trace.engines)
    return [e for e in engines if schema.is_kv_events(trace.engines.get(e, {}))]


def no_hits_reason(engine: str) -> str:
    return (f"engine {engine} is a KV-events recording without hits (no request set kv_cache_report_mode "
            "\"full\"), so its block access stream cannot be rebuilt; `kmesh-trace residency` reads it as is.")


def refuse_without_requests(trace, engine: str | None, analysis: str) -> None:
    """One sentence for an analysis of requests and lineage (retention pressure) on a KV-events recording."""
    kv = kv_event_engines(trace, engine)
    if kv:
        raise KmeshTraceError(f"engine {kv[0]} is a KV-events recording: it has no requests or lineage, so {analysis} "
                              "cannot run on it; capture the engine with the plugin (`kmesh-trace capture`).")


def rebuilt_rows(events: pl.DataFrame, block_size: int, engine: str) -> tuple[list[dict], dict]:
    """Invocation rows (contract columns) from one partition's block events sorted by seq, and counts
    (`kv_rebuild.py`: one request per admission, however often the engine re-announced its hit)."""
    rebuild = Rebuild()
    cols = ("event", "block_hash", "parent_block_hash", "ts_ns", "seq")
    pseqs = events.get_column("publisher_seq").to_list() if "publisher_seq" in events.columns else [None] * events.height
    for (event, h, parent, ts, seq), pseq in zip(zip(*(events.get_column(c).to_list() for c in cols)), pseqs):
        rebuild.row(event, h, parent, ts, seq, pseq)
    chains = rebuild.finish()
    rows = [{"request_id": f"{engine}:{c['seq']}", "seq": i, "num_prompt_tokens": len(c["blocks"]) * block_size + 1,
             "num_output_tokens": 0, "prompt_block_hashes": c["blocks"], "arrival_ns": c["ts"],
             "num_cached_tokens": c["hits"] * block_size} for i, c in enumerate(chains)]
    return rows, {"num_chains": len(chains), **rebuild.counts}


def rebuilt_invocations(trace, engine: str) -> pl.DataFrame:
    """One KV-events partition's rebuilt invocations, with the `engine` column, as `Trace.scan` gives them."""
    block_size = check_block_size(trace.engines[engine].get("block_size"))
    ev = (trace.scan("block_events").filter(pl.col("engine") == engine)
          .filter(pl.col("medium").is_null() | (pl.col("medium") == "GPU"))
          .select("seq", "ts_ns", "event", "block_hash", "parent_block_hash", "publisher_seq").sort("seq").collect())
    if ev.filter(pl.col("event") == "touched").height == 0:
        raise KmeshTraceError(no_hits_reason(engine))
    rows, _ = rebuilt_rows(ev, block_size, engine)
    table = to_contract("invocations", rows) if rows else schema.INVOCATIONS.arrow_schema().empty_table()
    table = table.append_column("engine", pa.array([engine] * table.num_rows, pa.string()))
    return pl.from_arrow(table)


def scan_invocations(trace, engine: str | None = None) -> pl.LazyFrame:
    """`trace.scan("invocations")`, with each KV-events partition's invocations rebuilt from its events."""
    lf = trace.scan("invocations")
    kv = kv_event_engines(trace, engine)
    if not kv:
        return lf
    rebuilt = [rebuilt_invocations(trace, e).lazy() for e in kv]
    others = lf.filter(~pl.col("engine").is_in(kv))
    return pl.concat([others.cast(rebuilt[0].collect_schema()), *rebuilt], how="vertical")
