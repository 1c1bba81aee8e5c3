"""Where the tier simulation's costs come from: KV bytes per token, restore cost per tier, prefill cost.

- KV bytes per token: the capture's engine metadata (`kv_bytes_per_token`) when present, else the
  caller's number, else a Hugging Face `config.json` (2 x layers x KV heads x head dim x dtype bytes).
- Restore cost per tier, from a `kmesh-trace replay run` results directory: the SSD tier uses one
  measured route's restores (`restores.parquet`: bytes / timer 1, bytes in place, per measured and
  accepted restore; its median is the p50 throughput, its 5th percentile the throughput of a p95
  restore), else `summary.json`'s p50/p95 times with the store's bytes per restore; the host tier uses
  the pinned host-to-GPU copy time `bench.json` records (`h2d_copy_ms_per_restore`) when present. The
  latency is 0 unless given (restores of one size cannot separate it from the throughput). Flags
  override any of it.
- Prefill cost: `kmesh_trace.oracle.prefill_cost.PrefillCost`, from a given throughput or fitted on the
  capture's measured prefill times (the fit report is shown).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from kmesh_trace.errors import InputFormatError, KmeshTraceError
from kmesh_trace.oracle.prefill_cost import PrefillCost, usable_fit
from kmesh_trace.oracle.tiers.config import RestoreCost
from kmesh_trace.values import ReplayBench, ReplaySummary, kv_bytes_refusal, read_json_file, read_model_config

__all__ = ["kv_bytes_per_token", "kv_bytes_from_config", "restore_costs_from_results", "prefill_model",
           "parse_capacity", "SSD_ROUTES"]

#: Routes that restore into GPU memory, most direct first (the SSD tier's default is the first measured).
SSD_ROUTES = ("cufile", "dmabuf_fixed", "host_fixed", "host")

_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float8_e4m3fn": 1,
                "float8_e5m2": 1, "fp8": 1, "int8": 1}


def kv_bytes_from_config(path: Path, dtype: str | None = None) -> int:
    """KV bytes per token of a Hugging Face `config.json` (a file or a directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    cfg = read_model_config(path)  # every shape field a positive integer, or one error naming it
    kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    if head_dim <= 0:
        raise InputFormatError(f"{path}: hidden_size {cfg.hidden_size} is smaller than num_attention_heads "
                               f"{cfg.num_attention_heads}; pass --kv-bytes-per-token instead.")
    layers = cfg.num_hidden_layers
    name = str(dtype or cfg.torch_dtype or cfg.dtype or "bfloat16").replace("torch.", "")
    if name not in _DTYPE_BYTES:
        raise KmeshTraceError(f"unknown KV dtype {name!r} in {path}; pass --kv-bytes-per-token instead.")
    return 2 * layers * kv_heads * head_dim * _DTYPE_BYTES[name]


def kv_bytes_per_token(metadata: dict | None, given: int | None = None,
                       config: Path | None = None) -> tuple[int | None, str]:
    """(KV bytes per token, where it came from): the caller's value, the model config, the capture."""
    if given is not None:
        value, src, source = int(given), "flag", "--kv-bytes-per-token"
    elif config is not None:
        value, src, source = kv_bytes_from_config(config), f"config:{config}", f"the model config {config}"
    else:
        v = (metadata or {}).get("kv_bytes_per_token")
        if not v:
            return None, "unknown"
        value, src, source = int(v), "capture", "the capture's engine metadata"
    why = kv_bytes_refusal(value, source)
    if why:
        raise KmeshTraceError(why)
    return value, src


def restore_costs_from_results(path: Path, ssd_route: str | None = None) -> tuple[dict[str, RestoreCost], list[str]]:
    """Restore costs of the tiers from a `replay run` results directory, and notes on what was used."""
    path = Path(path)
    if not (path / "summary.json").is_file():
        raise KmeshTraceError(f"{path} has no summary.json; give a `kmesh-trace replay run --out` directory.")
    summary = read_json_file(path / "summary.json", ReplaySummary, "replay summary")
    routes = {name: r for name, r in summary.routes.items() if r and r.timer1 and r.timer1.p50_ms}
    if not routes:
        raise KmeshTraceError(f"{path} measured no route; run `kmesh-trace replay run` with a route this host has.")
    if ssd_route is None:
        ssd_route = next((r for r in SSD_ROUTES if r in routes), None)
    if ssd_route not in routes:
        raise KmeshTraceError(f"{path} has no measured route {ssd_route!r}; it measured {', '.join(routes)}.")
    r = routes[ssd_route]
    measured = _measured_restores(path, ssd_route)
    if measured:  # per-restore throughputs: restores of different sizes (a `tiers --journal` store) mix fairly
        rates = np.array([b / t for b, t in measured])  # bytes per ns = GB/s
        gbps, gbps_p95 = float(np.percentile(rates, 50)), float(np.percentile(rates, 5))
        nbytes = int(np.median([b for b, _ in measured]))
        how = f"{len(measured)} measured restores, median {nbytes / 2**20:.1f} MiB"
    else:
        nbytes = _summary_restore_bytes(path, summary)
        p50, p95 = r.timer1.p50_ms, r.timer1.p95_ms or r.timer1.p50_ms
        gbps, gbps_p95 = nbytes / (p50 * 1e-3) / 1e9, nbytes / (p95 * 1e-3) / 1e9
        how = f"{nbytes / 2**20:.1f} MiB restores, p50 {p50:.2f} ms, p95 {p95:.2f} ms (summary.json)"
    src = f"{path.name}:{ssd_route}"
    mode = r.mode
    if mode:
        src += f" ({mode})"
    costs = {"ssd": RestoreCost(gbps, 0.0, gbps_p95, src)}
    notes = [f"ssd tier: route {ssd_route}{f' ({mode} mode)' if mode else ''}, {how}: {gbps:.2f} GB/s p50, {gbps_p95:.2f} GB/s at the p95 restore"]
    bench = path / "bench.json"
    if bench.is_file():
        b = read_json_file(bench, ReplayBench, "replay bench record")
        h2d, per = b.h2d_copy_ms_per_restore, (b.bytes or 0) // (b.files or 1)
        if h2d and per:
            costs["host"] = RestoreCost(per / (h2d * 1e-3) / 1e9, 0.0, None, f"{path.name}:bench.json h2d copy")
            notes.append(f"host tier: pinned host-to-GPU copy, {h2d:.2f} ms per {per / 2**20:.1f} MiB (bench.json)")
    return costs, notes


def _measured_restores(path: Path, route: str) -> list[tuple[int, int]]:
    """(bytes, timer-1 ns) of the route's measured, accepted restores in restores.parquet (empty without it)."""
    rp = path / "restores.parquet"
    if not rp.is_file():
        return []
    import pyarrow.parquet as pq

    try:
        t = pq.read_table(rp, columns=["route", "kind", "num_bytes", "timer1_ns", "accepted"]).to_pydict()
    except Exception as e:  # pyarrow raises several types for a damaged or foreign file
        raise InputFormatError(f"cannot read {rp}: {e}; re-run `replay run --out`.") from e
    rows = [(b, t1) for r, k, b, t1, ok in zip(t["route"], t["kind"], t["num_bytes"], t["timer1_ns"], t["accepted"])
            if r == route and k == "measured" and ok and b is not None and t1 is not None]
    bad = sum(b <= 0 or t1 <= 0 for b, t1 in rows)
    if bad:  # a negative or zero size or time is no measurement: it would make a restore free
        raise InputFormatError(f"{rp}: {bad} measured restore(s) of route {route} have a size or time that is not "
                               "positive; re-run `replay run --out`.")
    return rows


def _summary_restore_bytes(path: Path, summary) -> int:
    if summary.store_bytes and summary.num_store_restores:
        if summary.store_bytes < summary.num_store_restores:  # under a byte per restore: no measurement
            raise InputFormatError(f"{path}: store_bytes {summary.store_bytes} is less than one byte for each of "
                                   f"its {summary.num_store_restores} restores; re-run `replay run --out`.")
        return summary.store_bytes // summary.num_store_restores
    raise KmeshTraceError(f"{path} does not say how many bytes a restore moved (no restores.parquet); "
                          "re-run `replay run --out`.")


def prefill_model(trace=None, tokens_per_s: float | None = None, engine: str | None = None):
    """(prefill cost model, a description, its FitReport or None): a given throughput wins; else the
    capture's measured prefill times are fitted; else (None, what to do, None)."""
    if tokens_per_s is not None:
        return PrefillCost.from_throughput(tokens_per_s), f"{tokens_per_s:,.0f} tokens/s (--prefill-tokens-per-s)", None
    if trace is None:
        return None, "no prefill cost: pass --prefill-tokens-per-s", None
    cost, report, why = usable_fit(trace, engine)
    if cost is None:
        return None, f"no prefill cost ({why})", report
    return cost, "fitted on the capture's measured prefills", report


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


#: A tier's capacity is an int64 block count (the simulation's counters are int64).
MAX_TIER_BLOCKS = (1 << 62) - 1


def parse_capacity(text: str, block_bytes: int | None, what: str) -> int:
    """A capacity in blocks: a plain integer is blocks; a size with a unit (512MiB, 40GB) is bytes,
    converted with the block size in bytes (rounded down to whole blocks)."""
    m = _SIZE.match(str(text))
    if not m:
        raise KmeshTraceError(f"{what} must be a block count or a size such as 40GiB (got {text!r}).")
    num, unit = m.group(1), m.group(2)
    if len(num.split(".")[0].lstrip("0")) > 24:  # beyond any pool (and beyond a float: 10^400 GiB is inf)
        raise KmeshTraceError(f"{what} must be at most {MAX_TIER_BLOCKS:,} blocks (got a number of "
                              f"{len(num.split('.')[0].lstrip('0')):,} digits).")
    if unit is None:
        if "." in num:
            raise KmeshTraceError(f"{what} in blocks must be a whole number (got {text!r}).")
        if int(num) > MAX_TIER_BLOCKS:
            raise KmeshTraceError(f"{what} must be at most {MAX_TIER_BLOCKS:,} blocks (got {text!r}).")
        return int(num)
    if not block_bytes:
        raise KmeshTraceError(f"{what} is given in bytes, but the KV bytes per token are unknown; "
                              "pass --kv-bytes-per-token or --model-config, or give blocks.")
    blocks = int(float(num) * _UNITS[unit.lower()]) // block_bytes
    if blocks > MAX_TIER_BLOCKS:
        raise KmeshTraceError(f"{what} must be at most {MAX_TIER_BLOCKS:,} blocks (got {text!r}).")
    return blocks
