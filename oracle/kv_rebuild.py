"""Requests rebuilt from a KV-events recording's block rows, as the engine counted them (`kv_stream.py` uses it).

What vLLM (0.32, 0.33) publishes, read from its scheduler: one batch per engine step, holding that step's
events in order. First the running requests' stores (each continues its request's chain: its parent is
the request's previous block); then the step's admissions in waiting-queue order, each an *admission
group*: its hit report (kv_cache_report_mode "full": the hit blocks re-announced from the first one, parent
None; `touched` rows) followed by the stores of the blocks it computes, or, without a hit, stores from a
first block without parent. The scheduler calls `get_computed_blocks` on every attempt to admit the head of
the waiting queue, so every attempt re-announces the hit; a failed attempt ends the step's admissions (a
store-less report last in its batch) and the same request is the next step's first attempt. A step that
preempts admits nothing; a preempted request goes back to the head of the queue and its re-admission
re-announces its own blocks (the engine counts neither retries nor re-admissions: a request's
`num_cached_tokens` is the hit of the attempt that admitted it the first time).

So the rebuild keeps the *pending* requests, the head of the waiting queue as the events show it: the
store-less report that ended the latest batch with admissions, and those still waiting behind it. A
batch's admission groups take them in order: a group is the next pending request again when it reports
the same first block and the same blocks (fewer where some were evicted since, more where running
requests stored them since), or, when that first block was evicted since, when it stores from a first
block of its own (the attempt found no hit): a retry, whose hit becomes this attempt's. A pending request
that the next group is not had been admitted (a prompt whose every full block was a hit computes no new
block). A report whose blocks are an earlier request's first blocks and whose stores are that request's
next blocks, or, ahead of the pending requests (a preempted request goes back in front of them), one
that covers all of an earlier request's blocks and stores nothing, is that request's re-admission after
a preemption; re-admissions come first in a batch (no waiting request is admitted ahead of a preempted
one). Counted: `num_retried_reports`, `num_readmissions`, and `num_ambiguous_reports` where the
events fit two readings (a store-less re-admission, which a new request sharing every block of an
earlier one would also publish; a pending request whose first block was evicted, whose attempt may have
failed without a report).
"""

from __future__ import annotations

MAX_PREFIX_WALK = 1 << 16  # blocks of one rebuilt prefix (a cycle in bad data must end)


class Rebuild:
    """Feeds on block rows in seq order (`row`), then `finish`; `chains` are the requests."""

    def __init__(self):
        self.chains: list[dict] = []
        self.cursor: dict[int, list[int]] = {}  # block -> chains whose next store continues from it
        self.holders: dict[int, list[int]] = {}  # block -> chains holding it
        self.parent_of: dict[int, int | None] = {}
        self.stored_at: dict[int, int] = {}  # block -> the row seq of its latest store
        self.counts = dict.fromkeys(("num_unreported_prefixes", "num_parent_cycles", "num_retried_reports",
                                     "num_readmissions", "num_ambiguous_reports"), 0)
        self.pending: list[dict] = []  # {"chain", "readmit", "report", "since", "evicted", "covers"}, queue order
        self.taken = 0  # pending requests this batch's admission groups went past
        self.front = True  # no waiting request was admitted yet this batch (re-admissions come first)
        self.group: dict | None = None  # the admission group being read
        self.last_group: dict | None = None
        self.pseq = None
        self.num_batches = 0
        self.prev_hash = None

    # ---- rows ----------------------------------------------------------------------------------------

    def row(self, event: str, h, parent, ts: int, seq: int, pseq) -> None:
        if pseq != self.pseq:
            self._end_batch()
            self.pseq = pseq
        if event == "cleared":
            self._end_group()
            self.cursor.clear()
            self.pending = []
            self.prev_hash = None
            return
        if event == "evicted":
            for p in self.pending:
                p["evicted"].add(h)
            return
        if event not in ("cached", "touched") or h is None:
            return
        if event == "cached":
            self.parent_of.setdefault(h, parent)
            self.stored_at[h] = seq
        g = self.group
        if g is not None and parent is not None and parent == self.prev_hash and \
                (event == "cached" or not g["stores"]):
            (g["stores"] if event == "cached" else g["report"]).append(h)
        elif parent is None:
            self._end_group()
            self.group = {"report": [h] if event == "touched" else [], "stores": [] if event == "touched" else [h],
                          "ts": ts, "seq": seq}
        else:
            self._end_group()
            self._extend(h, parent, ts, seq)
        self.prev_hash = h

    def finish(self) -> list[dict]:
        self._end_batch()
        for p in self.pending:
            self._admitted(p)
        return [c for c in self.chains if not c.get("dropped")]
    # ---- chains --------------------------------------------------------------------------------------

    def _new_chain(self, blocks: list[int], hits: int, ts: int, seq: int) -> int:
        self.chains.append({"blocks": [], "hits": hits, "ts": ts, "seq": seq})
        i = len(self.chains) - 1
        self._set_blocks(i, blocks)
        return i

    def _set_blocks(self, i: int, blocks: list[int]) -> None:
        c = self.chains[i]
        for h in c["blocks"]:
            self.holders[h].remove(i)
        self._move_cursor(i, None)
        c["blocks"] = list(blocks)
        for h in blocks:
            self.holders.setdefault(h, []).append(i)
        if blocks:
            self._move_cursor(i, blocks[-1])

    def _move_cursor(self, i: int, h) -> None:
        c = self.chains[i]
        old = c.get("cursor")
        if old is not None and i in self.cursor.get(old, ()):
            self.cursor[old].remove(i)
            if not self.cursor[old]:
                del self.cursor[old]
        c["cursor"] = h
        if h is not None:
            self.cursor.setdefault(h, []).append(i)

    def _continue(self, i: int, h: int) -> None:
        """Chain i's next store is `h`: a block it holds already (a recompute after preemption) or a new one."""
        c = self.chains[i]
        at = c["blocks"].index(c["cursor"])
        if at + 1 < len(c["blocks"]) and c["blocks"][at + 1] == h:
            self._move_cursor(i, h)
            return
        c["blocks"].append(h)
        self.holders.setdefault(h, []).append(i)
        self._move_cursor(i, h)

    def _extend(self, h: int, parent: int, ts: int, seq: int) -> None:
        """A store continuing from `parent` outside an admission group: a running request's next block."""
        here = self.cursor.get(parent, [])
        waiting = {p["chain"] for p in self.pending}
        running = [i for i in here if i not in waiting]
        if running:  # a running request's next block (a pending request may share the block it ends at)
            self._continue(running[-1], h)
            return
        if here:  # a pending request runs: it had been admitted
            (p,) = [p for p in self.pending if p["chain"] == here[-1]]
            self.pending.remove(p)
            self._admitted(p)
            if self.cursor.get(parent):
                self._continue(self.cursor[parent][-1], h)
                return
        prefix, p, seen = [], parent, {h}
        while p is not None and p not in seen and len(prefix) < MAX_PREFIX_WALK:
            prefix.append(p)
            seen.add(p)
            p = self.parent_of.get(p)
        self.counts["num_parent_cycles"] += p is not None and p in seen  # bad data: a block is its own ancestor
        prefix.reverse()
        self.counts["num_unreported_prefixes"] += 1
        self._new_chain(prefix + [h], len(prefix), ts, seq)

    # ---- admission groups and batches ----------------------------------------------------------------

    def _end_group(self) -> None:
        g, self.group = self.group, None
        if g is None:
            return
        prev, self.last_group = self.last_group, g
        if prev is not None and not prev["stores"]:
            self._admitted(prev)  # a group followed it in its batch: it was admitted, storing nothing
        while self.taken < len(self.pending):
            p = self.pending[self.taken]
            if self._is_retry(p, g):
                self.taken += 1
                self._retry(p, g)
                self.front = self.front and bool(g.get("readmit"))
                return
            if self.taken == 0 and (self._readmit(g) or self._tentative(g) or self._ahead(g)):
                return  # a preempted request goes back in front of the waiting ones
            self.counts["num_ambiguous_reports"] += self.chains[p["chain"]]["blocks"][0] in p["evicted"]
            self.taken += 1  # it had been admitted (or failed without a report: ambiguous)
            self._admitted(p)
        if not (self._readmit(g) or self._tentative(g)):
            g.update(chain=self._new_chain(g["report"] + g["stores"], len(g["report"]), g["ts"], g["seq"]),
                     readmit=False)
            self.front = False

    def _tentative(self, g: dict) -> bool:
        """A store-less report covering an earlier request's every block: a new chain, until its admission
        says whether it was that request's re-admission (`_admitted`)."""
        c = self._covered(g["report"]) if g["report"] and not g["stores"] else None
        if c is None:
            return False
        g.update(chain=self._new_chain(g["report"], len(g["report"]), g["ts"], g["seq"]), readmit=False, covers=c)
        return True

    def _ahead(self, g: dict) -> bool:
        """A failed attempt (a store-less report) in front of the pending requests: a preempted request's
        (or the pending head had been admitted storing nothing: ambiguous); it waits in front of them."""
        if g["stores"] or not g["report"]:
            return False
        self.counts["num_ambiguous_reports"] += 1
        g.update(chain=self._new_chain(g["report"], len(g["report"]), g["ts"], g["seq"]), readmit=False)
        return True

    def _covered(self, r: list[int]) -> int | None:
        """The earlier request whose every block a store-less report covers: a re-admission of it if this
        attempt turns out to have been admitted storing nothing (a new request's attempt that stores nothing
        and is admitted would be a prompt ending within a block of that request's last one)."""
        waiting = {p["chain"] for p in self.pending}
        for i in reversed(self.holders.get(r[-1], ())):
            if i not in waiting and not self.chains[i].get("dropped") and self.chains[i]["blocks"] == r:
                return i
        return None

    def _admitted(self, g: dict) -> None:
        """Store-less group (or pending request) `g` was admitted: a re-admission where it covers an earlier
        request's every block (its chain is dropped; the earlier request continues)."""
        c = g.get("covers")
        if c is None or g.get("readmit") or self.chains[g["chain"]].get("dropped"):
            return
        i = g["chain"]
        self._set_blocks(i, [])
        self.chains[i]["dropped"] = True
        g.update(readmit=True, covers=None)
        self.counts["num_readmissions"] += 1
        self.counts["num_ambiguous_reports"] += 1

    def _is_retry(self, p: dict, g: dict) -> bool:
        """Whether admission group `g` is pending request `p`'s next attempt."""
        r, old = g["report"], p["report"]
        if not r:
            return self.chains[p["chain"]]["blocks"][0] in p["evicted"]
        if r[:1] != old[:1]:
            return False
        if len(r) <= len(old):  # fewer only where the first block it no longer reports was evicted
            return r == old[:len(r)] and (len(r) == len(old) or old[len(r)] in p["evicted"])
        return r[:len(old)] == old and all(self.stored_at.get(h, -1) > p["since"] for h in r[len(old):])

    def _retry(self, p: dict, g: dict) -> None:
        i = p["chain"]
        self.counts["num_retried_reports"] += 1
        c = None if p["readmit"] else self._recomputed(g, skip=i)
        if c is not None:  # it stores an earlier request's blocks again: that request re-admitted
            self.chains[i]["dropped"] = True
            self._set_blocks(i, [])
            self.counts["num_readmissions"] += 1
            g.update(chain=c, readmit=True, covers=None)
            self._recompute(c, g)
            return
        if p["readmit"]:
            self._recompute(i, g)
        else:
            self._set_blocks(i, g["report"] + g["stores"])
            self.chains[i]["hits"] = len(g["report"])
        g.update(chain=i, readmit=p["readmit"], covers=None if g["stores"] else p.get("covers"))

    def _readmit(self, g: dict) -> bool:
        """Whether `g` re-admits an earlier request (after a preemption); if so it continues that request."""
        i = self._recomputed(g) if self.front else None
        if i is None:
            return False
        self.counts["num_readmissions"] += 1
        g.update(chain=i, readmit=True)
        self._recompute(i, g)
        return True

    def _recompute(self, i: int, g: dict) -> None:
        """Re-admitted request i recomputes from the end of its report: its stores are its own blocks again."""
        b = self.chains[i]["blocks"]
        for h in g["report"][len(b):]:
            self._continue(i, h)
        self._move_cursor(i, g["report"][-1] if len(g["report"]) <= len(b) else self.chains[i]["cursor"])
        for h in g["stores"]:
            self._continue(i, h)

    def _recomputed(self, g: dict, skip: int | None = None) -> int | None:
        """The earlier request whose first blocks `g` reports and whose other blocks it stores again."""
        r, s = g["report"], g["stores"]
        if not r or not s:
            return None
        waiting = {p["chain"] for p in self.pending} - {skip}
        for i in reversed(self.holders.get(r[-1], ())):
            b = self.chains[i]["blocks"]
            if i not in waiting and i != skip and b[:len(r)] == r and b[len(r):len(r) + len(s)] == s:
                return i
        return None

    def _end_batch(self) -> None:
        self._end_group()
        g = self.last_group
        if g is not None:
            rest = self.pending[self.taken:]
            if g["report"] and not g["stores"]:
                rest = [{"chain": g["chain"], "readmit": g["readmit"], "report": list(g["report"]),
                         "since": g["seq"], "evicted": set(), "covers": g.get("covers")}] + rest
            self.pending = rest
        self.taken = 0
        self.front = True
        self.last_group = None
        self.prev_hash = None
        self.num_batches += 1
