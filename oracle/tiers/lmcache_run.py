"""`tiers TRACE --lmcache SPEC [--lmcache-peer PEER]`: the LMCache model (`kmesh_trace.oracle.tiers.lmcache`) on
the captures of the engines that share one LMCache server, with what the captures measured beside it.

Measured, per engine, from its capture: the stores and loads the proxy connector recorded around
`LMCacheMPConnector` (transfers of status ok: count and tokens) and the external hits (the invocations'
`num_external_tokens`, what vLLM counts in `vllm:external_prefix_cache_hits_total`). A trace without
transfers (no proxy connector) shows the model alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import kmesh_trace.oracle.tier_costs as tc
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.tiers.lmcache import EngineStream, LMCacheOutcome, parse_lmcache_spec, simulate_lmcache
import kmesh_trace.oracle.tiers.render as render

__all__ = ["LMCacheReport", "run_lmcache"]

#: Options of `tiers` that configure its own tiers, not LMCache's.
OTHER_TIER_OPTIONS = ("host", "ssd", "sweep_host", "sweep_ssd", "connector", "chunk_tokens")


@dataclass
class LMCacheReport:
    """The model's outcome per engine beside each capture's measurement."""

    data: dict

    @property
    def notes(self) -> list[str]:
        return self.data["notes"]

    def to_dict(self) -> dict:
        return self.data

    def lines(self, d: dict | None = None) -> list:
        return render.lmcache_lines(self.data if d is None else d)


def _check_options(options) -> None:
    given = [name for name in OTHER_TIER_OPTIONS if getattr(options, name) is not None]
    if given:
        flags = ", ".join("--" + ("vllm-connector" if n == "connector" else n.replace("_", "-")) for n in given)
        raise KmeshTraceError(f"--lmcache models LMCache's own tiers (L1 and fs); drop {flags}.")


def _clock_offset(metadata: dict) -> int | None:
    """What maps the engine's monotonic clock to wall time (its capture's anchors), or None without them."""
    wall, mono = metadata.get("wall_anchor_ns"), metadata.get("mono_anchor_ns")
    return None if wall is None or mono is None else int(wall) - int(mono)


def measured_lmcache(t, engine: str | None) -> dict | None:
    """What capture `t` (engine partition `engine`, None: any) measured: stores and loads the proxy recorded
    (status ok) and the external hit tokens; None for a trace without tables (a public trace in memory)."""
    if not hasattr(t, "sql") or getattr(t, "row_counts", None) is None:
        return None
    where = f" AND engine = '{engine}'" if engine else ""
    out = {"num_stores": 0, "stored_tokens": 0, "num_loads": 0, "loaded_tokens": 0, "connector": None}
    if t.row_counts().get("transfers"):
        rows = t.sql("SELECT direction, count(*), sum(num_tokens), string_agg(DISTINCT connector, ', ') "
                     f"FROM transfers WHERE status = 'ok'{where} GROUP BY direction").rows()
        for direction, n, tokens, connector in rows:
            key = "stores" if direction == "store" else "loads"
            out[f"num_{key}"], out["connector"] = int(n), connector
            out["stored_tokens" if key == "stores" else "loaded_tokens"] = int(tokens or 0)
    where = f" WHERE engine = '{engine}'" if engine else ""
    ((external, local),) = t.sql("SELECT sum(num_external_tokens), sum(num_cached_tokens) FROM invocations"
                                 f"{where}").rows()
    out["external_hit_tokens"] = None if external is None else int(external)
    out["local_hit_tokens"] = None if local is None else int(local)
    return out


def run_lmcache(inputs: list[tuple], options, *, workload_of) -> LMCacheReport:
    """The LMCache model over `inputs`: (opened trace, its name in the output, engine or None) for the trace
    and each peer, in that order; `workload_of(trace, engine)` reads one engine's workload."""
    _check_options(options)
    spec = parse_lmcache_spec(options.lmcache)
    streams, metas, notes = [], [], []
    for t, name, engine in inputs:
        w = workload_of(t, engine)
        if w.num_usable_blocks is None:
            raise KmeshTraceError(f"{name} does not record its pool's usable blocks; the model needs each engine's.")
        meta = t.engines[engine] if engine is not None else t.metadata
        metas.append(meta)
        streams.append(EngineStream(name, list(w.requests), w.block_size, int(w.num_usable_blocks),
                                    _clock_offset(meta) or 0))
    if len(streams) > 1 and any(_clock_offset(m) is None for m in metas):
        for s in streams:
            s.clock_offset_ns = 0
        notes.append("arrivals compared on the engines' monotonic clocks as recorded (a trace lacks the wall-clock "
                     "anchors): right only for engines on one host")
    kvbpt, kv_src = tc.kv_bytes_per_token(metas[0], options.kv_bytes_per_token, options.model_config)
    if not kvbpt:
        raise KmeshTraceError("the LMCache model sizes L1 in chunks of KV bytes; the capture does not record "
                              "them: give --kv-bytes-per-token or --model-config.")
    outcome = simulate_lmcache(streams, spec, kvbpt)
    notes.append("the LMCache model replays the engines' requests one at a time in arrival order; with requests "
                 "in flight LMCache's lookups can run before an earlier request's store has landed")
    return LMCacheReport(_report(spec, kvbpt, kv_src, outcome, inputs, notes))


def _report(spec, kvbpt: int, kv_src: str, outcome: LMCacheOutcome, inputs: list[tuple], notes: list[str]) -> dict:
    engines = [{"trace": name, "engine": engine, "predicted": o.to_dict(), "measured": measured_lmcache(t, engine)}
               for (t, name, engine), o in zip(inputs, outcome.engines)]
    return {"trace": inputs[0][1], "lmcache": spec.to_dict(), "kv_bytes_per_token": kvbpt, "kv_bytes_source": kv_src,
            "chunk_bytes": spec.chunk_size * kvbpt, "server": outcome.to_dict(), "engines": engines, "notes": notes}
