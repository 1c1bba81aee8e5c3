"""Restore timing: when a lower tier's reads complete.

A tier serves reads one after another, across requests: a request's first read on a tier starts when
both the request issues it and the tier has finished the reads issued before (plus the tier's latency,
once per request); each chunk then takes bytes / throughput. Two clocks run side by side, one at the
p50 throughput and one at the p95 restore's. Untimed (sequential) replays start every request at 0 and
never carry the tier's busy time over, so a request's completion is the sum of its read durations.
"""

from __future__ import annotations

from kmesh_trace.oracle.tiers.config import RestoreCost

__all__ = ["ReadQueue"]


class ReadQueue:
    """One tier's reads in issue order. `busy`: when the reads issued so far complete (p50, p95 clocks);
    it advances only in timed replays."""

    __slots__ = ("cost", "busy", "timed")

    def __init__(self, cost: RestoreCost | None, timed: bool):
        self.cost = cost
        self.timed = timed
        self.busy = (0, 0)

    def complete(self, clock: list | None, t_ns: int, nbytes: int) -> tuple[list | None, tuple[int, int]]:
        """Issue one chunk read of `nbytes` at `t_ns`, after the request's earlier reads on this tier
        (`clock`: their completion, None before its first); returns (the request's clock now, when this
        read completes at p50 and p95). Without a restore cost a read completes when issued."""
        c = self.cost
        if c is None:
            return clock, (t_ns, t_ns)
        if clock is None:  # a request's first read on this tier queues behind earlier requests' reads
            lat = int(c.latency_s * 1e9)
            clock = [max(t_ns, self.busy[0]) + lat, max(t_ns, self.busy[1]) + lat]
        clock[0] += int(nbytes / (c.gbps * 1e9) * 1e9)
        clock[1] += int(nbytes / ((c.gbps_p95 or c.gbps) * 1e9) * 1e9)
        done = (clock[0], clock[1])
        if self.timed:
            self.busy = done
        return clock, done
