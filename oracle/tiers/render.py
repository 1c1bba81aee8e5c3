"""The human rendering of a `tiers` run, from its JSON: lines of text, tables as plain rows, and notes.

Each function takes the report's `to_dict()` and returns items in print order: a `str` (a line of
data), a `TableRows` (a table: the display layer draws it), or a `Note` (a line for stderr). Nothing
here knows a terminal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TableRows", "Note", "configuration_lines", "sweep_lines", "arms_lines", "lmcache_lines"]


@dataclass
class TableRows:
    """A titled table: `columns` are (header, justify, short header or None); `rows` are cell texts."""

    title: str
    columns: list[tuple[str, str, str | None]]
    rows: list[list[str]] = field(default_factory=list)


@dataclass
class Note:
    text: str


def _columns(headers, short: dict | None = None) -> list[tuple[str, str, str | None]]:
    """The first column left-justified, the others right; `short` gives the headers' narrow forms."""
    return [(h, "left" if k == 0 else "right", (short or {}).get(h)) for k, h in enumerate(headers)]


def _mib(v) -> str:
    return "-" if v is None else f"{v / 2**20:,.1f}"


def _secs(v) -> str:
    return "-" if v is None else f"{v:,.3f}"


def configuration_lines(d: dict) -> list:
    kv = d["kv_bytes_per_token"]
    kv_text = f"{kv:,} bytes/token ({d['kv_bytes_source']})" if kv else "bytes unknown"
    items: list = [f"GPU pool {d['gpu_blocks']:,} blocks of {d['block_size']} tokens; KV {kv_text}; "
                   f"prefill: {d['prefill']}"]
    fit = d.get("prefill_fit")
    if fit:
        items.append(f"prefill fit: {fit['n']:,} measured prefills, r2 {fit['r2']:.3f}, median relative error "
                     f"{fit['median_relative_error']:.1%} ({fit['num_skipped']:,} without a usable measurement)")
    items.extend(f"restore cost: {n}" for n in d["cost_notes"])
    hits = TableRows("tiers: hit tokens by tier",
                     _columns(("configuration", "gpu", "host", "ssd", "recomputed", "gpu_evictions")))
    short = {"configuration": "config", "host_MiB": "host", "ssd_MiB": "ssd", "read_amp": "amp", "saved_s": "saved",
             "ttft_children": "kids", "ttft_others": "others"}  # at 80 columns, with a legend
    reads = TableRows("tiers: lower-tier reads and estimated seconds",
                      _columns(("configuration", "host_MiB", "ssd_MiB", "read_amp", "saved_s", "ttft_children",
                                "ttft_others"), short))
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

        hits.rows.append([name, f"{ht.get('gpu', 0):,}", f"{ht['host']:,}" if "host" in ht else "-",
                          f"{ht['ssd']:,}" if "ssd" in ht else "-", f"{c['recomputed_tokens']:,}",
                          f"{c['gpu_evictions']:,}"])
        reads.rows.append([name, _mib(rb.get("host")), _mib(rb.get("ssd")), "-" if amp is None else f"{amp:.2f}",
                           _secs(c["prefill_seconds_saved"]), tt("children"), tt("others")])
    items += [hits, reads, "ttft: estimated p50/p95 seconds (restore wait + prefill of recomputed tokens); saved_s: "
              "prefill seconds saved against the GPU pool alone, net of restore waits"]
    if "journal" in d:
        j = d["journal"]
        items.append(f"journal: {j['num_restores']:,} of {j['num_reads_total']:,} {j['tier']} reads in {j['path']}")
    return items


def sweep_lines(d: dict) -> list:
    sw = d["sweep"]
    metric = sw["metric"]
    table = TableRows(f"{metric} by host (rows) x ssd (columns) blocks at {d['gpu_blocks']:,} GPU blocks",
                      [("host \\ ssd", "right", None)] + [(f"{s:,}" if s else "-", "right", None)
                                                          for s in sw["ssd_blocks"]])
    fmt = (lambda v: f"{v:,.3f}") if metric == "prefill_seconds_saved" else (lambda v: f"{v:,.0f}")
    for h, row in zip(sw["host_blocks"], sw["grid"]):
        table.rows.append([f"{h:,}" if h else "-", *(fmt(v) for v in row)])
    return [table, f"best: {sw['best']}; smallest within {sw['within_pct']:g}% of the best: {sw['smallest_within']}"]


def arms_lines(d: dict) -> list:
    table = TableRows(f"family-burst: {d['children']} children, {d['ancestor_mib']:g} MiB ancestor in "
                      f"{d['chunks']} chunks",
                      _columns(("arm", "lower_tier_reads", "MiB_read", "host_reads", "ssd_reads", "shared",
                                "read_amp", "wait_p50_s", "wait_max_s")))
    for a in d["arms"]:
        nr = a["num_reads_by_tier"]
        table.rows.append([a["arm"], f"{a['num_lower_tier_reads']:,}", _mib(a["lower_tier_read_bytes"]),
                           f"{nr.get('host', 0):,}", f"{nr.get('ssd', 0):,}", f"{a['num_shared_reads']:,}",
                           f"{a['read_amplification']:.2f}", _secs(a["restore_wait_p50_s"]),
                           _secs(a["restore_wait_max_s"])])
    items: list = [table]
    if not d["costs"]:
        items.append(Note("no restore costs given (--restore-results or --ssd-gbps/--host-gbps): waits are not "
                          "estimated"))
    return items


def _pair(predicted, measured) -> str:
    return f"{predicted:,}" if measured is None else f"{predicted:,} / {measured:,}"


def lmcache_lines(d: dict) -> list:
    """The human rendering: one row per engine, predicted / measured."""
    s, server = d["lmcache"], d["server"]
    fs = f", fs tier {s['fs']}" if s["fs"] else ""
    items: list = [f"LMCache: chunks of {s['chunk_size']} tokens ({d['chunk_bytes']:,} bytes), L1 {s['l1_size_gb']} GiB "
                   f"= {server['l1_capacity_chunks']:,} chunks ({s['eviction_policy']}){fs}; KV {d['kv_bytes_per_token']:,} "
                   f"bytes/token ({d['kv_bytes_source']})"]
    table = TableRows("tiers --lmcache: predicted / measured",
                      _columns(("engine", "stores", "stored_tokens", "loads", "loaded_tokens", "external_hits")))
    for e in d["engines"]:
        p, m = e["predicted"], e["measured"] or {}
        table.rows.append([e["trace"]] + [_pair(p[k], m.get(k)) for k in (
            "num_stores", "stored_tokens", "num_loads", "loaded_tokens", "external_hit_tokens")])
    items.append(table)
    items.append(f"LMCache predicted: {len(server['stored_tokens']):,} stores, {len(server['retrieved_tokens']):,} "
                 f"retrieves, {server['l1_evictions']:,} L1 evictions"
                 + (f", {server['fs_chunks']:,} chunks in the fs tier" if s["fs"] else ""))
    return items
