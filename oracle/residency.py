"""Residency of blocks in a KV-events recording: what any events trace answers, with or without hits.

Per engine partition, replaying its rows in seq order (times: the publisher's wall clock):
- *lifetime* of a stored block: from its store to its removal (or to a clear), per medium; blocks
  still resident at the end are counted apart (their lifetime is unknown, at least the time left);
- *reuse gap* of a re-stored block: from a hash's removal to the next store of the same hash on the
  same medium (the engine recomputed, or reloaded, what it had dropped);
- *eviction rate over time*: stores and removals per bucket of `bucket_s` seconds;
- *tier movement* between media (vLLM's offloading connectors publish CPU / STORAGE stores and
  removals; SGLang's host cache CPU_PINNED): a block stored on a lower medium while, or after, it
  was on the GPU is an offload (GPU -> lower); a block stored on the GPU while resident lower is a
  reload (lower -> GPU); a GPU removal of a block then resident lower is kept below.
Keys are (medium, KV group, hash); duplicates of one key (two requests computed the same block)
are matched first in, first out.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from kmesh_trace import schema
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.options import option

GPU = "GPU"


def _dist(values: list[float]) -> dict:
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p95": None, "max": None}
    a = np.asarray(values, dtype=float)
    return {"count": int(a.size), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p95": float(np.percentile(a, 95)), "max": float(a.max())}


@dataclass
class Residency:
    engine: str
    span_s: float
    bucket_s: float
    media: dict[str, dict] = field(default_factory=dict)  # medium -> counts, lifetime, reuse gap
    buckets: list[dict] = field(default_factory=list)
    movement: dict[str, int] = field(default_factory=dict)
    num_cleared: int = 0
    num_touched: int = 0
    num_removed_unseen: int = 0
    hits_recorded: bool = False
    #: a recording of more than one KV cache group: each (medium, group)'s stores, removals, lifetimes
    by_group: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"engine": self.engine, "span_s": self.span_s, "bucket_s": self.bucket_s, "media": self.media,
                "eviction_rate": self.buckets, "movement": self.movement, "num_cleared": self.num_cleared,
                "num_touched_blocks": self.num_touched, "num_removed_unseen": self.num_removed_unseen,
                "hits_recorded": self.hits_recorded, **({"by_group": self.by_group} if self.by_group else {})}


@dataclass(frozen=True)
class ResidencyOptions:
    """What `kmesh-trace residency` is asked (its flags name the fields; `oracle/options.py`)."""

    bucket_s: float | None = option("--bucket-s")  # None: a tenth of the recording, at least 1 s


@dataclass
class ResidencyResult:
    """`residency`'s result: one `Residency` per KV-events partition read."""

    engines: list[Residency]

    def to_dict(self) -> dict:
        return {"engines": [r.to_dict() for r in self.engines]}

    def rows(self) -> list[dict]:
        """One row per (engine, medium): the counts, and the p50 / p95 of lifetimes and reuse gaps."""
        return [{"engine": r.engine, "medium": m, **{k: v for k, v in x.items() if not isinstance(v, dict)},
                 **{f"lifetime_{q}_s": x["lifetime_s"][q] for q in ("p50", "p95")},
                 **{f"reuse_gap_{q}_s": x["reuse_gap_s"][q] for q in ("p50", "p95")}}
                for r in self.engines for m, x in r.media.items()]


def run(trace, options: ResidencyOptions, engine: str | None = None) -> ResidencyResult:
    """The residency `options` ask for, over engine `engine` (None: every KV-events one) of an opened trace."""
    return ResidencyResult(residency(trace, engine, options.bucket_s))


#: The shortest eviction-rate bucket, and the most buckets one recording is cut into.
MIN_BUCKET_S = 1e-3
#: The longest bucket (seconds, about 31 years): a finite number is not yet a sane one.
MAX_BUCKET_S = 1e9
MAX_BUCKETS = 1_000_000


def residency(trace, engine: str | None = None, bucket_s: float | None = None) -> list[Residency]:
    """Residency of each chosen KV-events partition (all of them when `engine` is None)."""
    engines = [engine] if engine is not None else sorted(trace.engines)
    for e in engines:
        if e not in trace.engines:
            raise KmeshTraceError(f"the trace has no engine {e!r}; its engines are {', '.join(trace.engines)}.")
    kv = [e for e in engines if schema.is_kv_events(trace.engines[e])]
    if not kv:
        raise KmeshTraceError("residency reads KV-events recordings (`kmesh-trace listen`); this trace has none "
                              f"({', '.join(engines)} {'is' if len(engines) == 1 else 'are'} not).")
    if bucket_s is not None and not MIN_BUCKET_S <= bucket_s <= MAX_BUCKET_S:  # NaN fails too
        raise KmeshTraceError(f"--bucket-s must be a finite number of seconds, at least {MIN_BUCKET_S:g}, at most "
                              f"{MAX_BUCKET_S:,.0f}, not {bucket_s:g}.")
    cols = ("seq", "event", "block_hash", "kv_group", "medium", "wall_publish_ns", "ts_ns")
    frames = (trace.scan("block_events").filter(pl.col("engine").is_in(kv)).select("engine", *cols)
              .sort("engine", "seq").collect())
    return [_one(e, frames.filter(pl.col("engine") == e), bucket_s) for e in kv]


def _one(engine: str, ev: pl.DataFrame, bucket_s: float | None) -> Residency:
    t = [w if w is not None else ts for w, ts in zip(ev.get_column("wall_publish_ns").to_list(),
                                                       ev.get_column("ts_ns").to_list())]
    t0 = t[0] if t else 0
    span = (t[-1] - t0) / 1e9 if t else 0.0
    bucket = bucket_s or max(span / 10, 1.0)
    if span / bucket > MAX_BUCKETS:
        raise KmeshTraceError(f"--bucket-s {bucket:g} cuts {engine}'s {span:,.0f} s into more than {MAX_BUCKETS:,} "
                              "buckets; give a larger one.")
    res = Residency(engine, span, bucket)
    stored_at: dict[tuple, deque] = defaultdict(deque)
    removed_at: dict[tuple, int] = {}
    lower_resident: dict[tuple, int] = defaultdict(int)  # (group, hash) -> copies below the GPU
    gpu_seen: set[tuple] = set()
    lifetimes: dict[str, list] = defaultdict(list)
    gaps: dict[str, list] = defaultdict(list)
    counts: dict[str, dict] = defaultdict(lambda: {"num_stored": 0, "num_removed": 0, "num_restored": 0})
    per_group: dict[tuple, dict] = defaultdict(lambda: {"num_stored": 0, "num_removed": 0, "lifetimes": []})
    buckets: dict[int, dict] = defaultdict(lambda: {"num_stored": 0, "num_evicted": 0})
    move = {"gpu_to_lower": 0, "lower_to_gpu": 0, "gpu_evicted_kept_lower": 0}
    cols = ("event", "block_hash", "kv_group", "medium")
    for now, (event, h, group, medium) in zip(t, zip(*(ev.get_column(c).to_list() for c in cols))):
        medium = medium or GPU
        b = buckets[int((now - t0) / 1e9 // bucket)]
        if event == "cleared":
            res.num_cleared += 1
            for key in [k for k in stored_at if k[0] == GPU]:
                for s in stored_at.pop(key):
                    lifetimes[GPU].append((now - s) / 1e9)
                removed_at[key] = now
            continue
        key, block = (medium, group, h), (group, h)
        if event == "touched":
            res.num_touched += 1
        elif event == "cached":
            c = counts[medium]
            c["num_stored"] += 1
            b["num_stored"] += 1
            per_group[(medium, group)]["num_stored"] += 1
            if key in removed_at:
                c["num_restored"] += 1
                gaps[medium].append((now - removed_at.pop(key)) / 1e9)
            stored_at[key].append(now)
            if medium == GPU:
                if lower_resident[block]:
                    move["lower_to_gpu"] += 1
                gpu_seen.add(block)
            else:
                if block in gpu_seen:
                    move["gpu_to_lower"] += 1
                lower_resident[block] += 1
        elif event == "evicted":
            counts[medium]["num_removed"] += 1
            b["num_evicted"] += 1
            g = per_group[(medium, group)]
            g["num_removed"] += 1
            q = stored_at.get(key)
            if not q:
                res.num_removed_unseen += 1
            else:
                lifetimes[medium].append((now - q.popleft()) / 1e9)
                g["lifetimes"].append(lifetimes[medium][-1])
                if not q:
                    del stored_at[key]
            removed_at[key] = now
            if medium == GPU:
                if lower_resident[block]:
                    move["gpu_evicted_kept_lower"] += 1
            elif lower_resident[block]:
                lower_resident[block] -= 1
    still: dict[str, int] = defaultdict(int)
    for (medium, _, _), q in stored_at.items():
        still[medium] += len(q)
    for medium in sorted(set(counts) | set(still)):
        res.media[medium] = {**counts[medium], "num_still_resident": still[medium],
                             "lifetime_s": _dist(lifetimes[medium]), "reuse_gap_s": _dist(gaps[medium])}
    if len({g for _, g in per_group}) > 1:
        left = Counter((m, g) for (m, g, _), q in stored_at.items() for _ in q)
        res.by_group = [{"medium": m, "kv_group": g, "num_stored": v["num_stored"], "num_removed": v["num_removed"],
                         "num_still_resident": left[(m, g)], "lifetime_s": _dist(v["lifetimes"])}
                        for (m, g), v in sorted(per_group.items(), key=lambda kv: (kv[0][0], kv[0][1] is None, kv[0][1] or 0))]
    res.buckets = [{"start_s": k * bucket, **v} for k, v in sorted(buckets.items())]
    res.movement = move
    res.hits_recorded = res.num_touched > 0
    return res
