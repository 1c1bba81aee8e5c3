"""Capture fitness of KV-events recordings (`kmesh-trace listen`): partitions with source kv-events:ENGINE.

Such a partition has no requests and no block ids, so the pool checks of `capture.py` do not apply
to it. What is checked instead, per partition:
- batches lost: sequence gaps the replay socket could not fill (`kv_events.num_unrecovered_batches`,
  each range named as epoch:first-last), malformed frames and events (blocking: events are missing);
- rows: `seq` without gaps or repeats (a gap is a dropped row, counted in num_dropped_events too),
  `ts_ns` non-decreasing, `publisher_seq` filled;
- what the source can answer: retention pressure never (no requests, no lineage: blocking for it);
  headroom, tiers and fleet only with hits recorded (kv_cache_report_mode full; blocking for
  headroom without them); removals of blocks stored before the recording began are a warning.
"""

from __future__ import annotations

from kmesh_trace import schema

#: What every KV-events partition says it cannot answer, and why.
NO_REQUESTS = ("a KV-events recording has no requests or lineage (engines publish only block stores, removals and "
               "reported hits): retention pressure cannot run on it; headroom, tiers and fleet run on the access "
               "stream rebuilt from its events. This finding blocks by design, so `audit capture` exits 3 on every "
               "KV-events recording; `kmesh-trace residency` summarises one")


def kv_event_engines(t) -> list[str]:
    return sorted(e for e, meta in t.engines.items() if schema.is_kv_events(meta))


def check_kv_events(t, engines: list[str], ev, f, *, headroom: str, retention: str, warning: str) -> None:
    """Findings for the KV-events partitions `engines` (their block events in `ev`) added to `f`."""
    import polars as pl

    for eid in engines:
        meta = t.engines[eid]
        where = f"engines/{eid}.json"
        st = meta.get("kv_events") if isinstance(meta.get("kv_events"), dict) else {}
        f.add("kv_events_no_requests", NO_REQUESTS, where, blocks=(retention,))
        lost = st.get("num_unrecovered_batches") or 0
        if lost:
            ranges = [f"{where}:kv_events.unrecovered epoch {e} seq {a}-{b}" for e, a, b in st.get("unrecovered", [])]
            f.add("kv_events_lost", "event batches were missed and the publisher's replay buffer no longer held them",
                  ranges or [where], count=lost)
        bad = (st.get("num_malformed_frames") or 0) + (st.get("num_malformed_events") or 0)
        if bad:
            f.add("kv_events_malformed", "frames or events from the publisher could not be decoded (counted, skipped)",
                  [f"{where}: {m}" for m in st.get("malformed", [])] or [where], count=bad)
        if st.get("num_removed_unseen"):
            f.add("kv_events_removed_unseen", "removals of blocks stored before the recording began (their stores "
                  "are not in the trace)", where, severity=warning, count=st["num_removed_unseen"])
        rows = ev.filter(pl.col("engine") == eid).sort("seq") if ev.height else ev
        touched = rows.filter(pl.col("event") == "touched").height if rows.height else 0
        if not touched:
            f.add("kv_events_no_hits", "no request reported its hits (kv_cache_report_mode \"full\"), so the block "
                  "access stream cannot be rebuilt: only `residency` reads this recording", where,
                  blocks=(headroom,))
        if not rows.height:
            continue
        seq = rows.get_column("seq")
        steps = seq.diff().drop_nulls()
        if steps.len() and (steps != 1).any():
            f.add("seq_gap", "block event seq has gaps or repeats", f"block_events:{eid}")
        ts = rows.get_column("ts_ns").diff().drop_nulls()
        if ts.len() and (ts < 0).any():
            f.add("clock_not_monotonic", "block event ts_ns goes back in seq order", f"block_events:{eid}")
        if rows.get_column("publisher_seq").null_count():
            f.add("missing_field", "column block_events.publisher_seq is null in a KV-events recording",
                  f"block_events:{eid}", count=rows.get_column("publisher_seq").null_count())
