"""The rebuild of requests from KV events (`oracle/kv_rebuild.py`) on random scheduler histories (Hypothesis),
published the way vLLM's scheduler publishes them: per step, the running requests' new blocks, then the
waiting queue's head in order, each attempt re-announcing its hit (kv_cache_report_mode "full"); a failed
attempt (its report, no store) ends the step's admissions; a step that preempts admits nothing and the
preempted request goes back in front of the queue, its re-admission re-announcing its own blocks. Whatever
the history, the rebuild has one request per request, each with its first admission's hit."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kv_wire import rebuild_rows  # tests/ is on sys.path


class History:
    """A scheduler history drawn step by step; `rows` are its block rows, `hits` the engine's count."""

    def __init__(self, draw, n: int):
        self.draw, self.rows, self.pseq, self.decoded, self.stored = draw, [], 0, 0, set()
        self.reqs = []
        for r in range(n):
            system = draw(st.integers(0, 2))
            prefix = [1000 * system + i for i in range(3)]
            k = draw(st.integers(0, 3))
            self.reqs.append({"blocks": prefix + [10**6 + 100 * r + i for i in range(draw(st.integers(1, 3)))],
                              "k": k, "hit": None})
        self.waiting, self.running = list(range(n)), []

    def __repr__(self) -> str:
        return f"History(rows={self.rows}, hits={[q['hit'] for q in self.reqs]})"

    def emit(self, blocks: list[int], parent, event: str) -> None:
        for h in blocks:
            self.rows.append((event, h, parent, self.pseq))
            self.stored.add(h)
            parent = h

    def attempt(self, r: int, admit: bool) -> bool:
        q = self.reqs[r]
        if q["hit"] is None:  # a hit is what others stored of its prefix
            k = next((j for j in range(q["k"]) if q["blocks"][j] not in self.stored), q["k"])
        else:  # a re-admission re-announces its own blocks
            k = q["readmit_k"]
        report = q["blocks"][:k]
        self.emit(report, None, "touched")
        if admit:
            self.emit(q["blocks"][k:], report[-1] if report else None, "cached")
            q["hit"] = k if q["hit"] is None else q["hit"]  # the first admission's hit is the engine's count
        return admit

    def step(self) -> None:
        for r in self.running:
            if self.draw(st.booleans()):
                self.decoded += 1
                self.emit([2 * 10**6 + self.decoded], self.reqs[r]["blocks"][-1], "cached")
                self.reqs[r]["blocks"].append(2 * 10**6 + self.decoded)
        if self.running and not any(self.reqs[r]["hit"] is not None for r in self.waiting) and \
                self.draw(st.integers(0, 4)) == 0:  # one preempted request waits at a time
            r = self.running.pop(self.draw(st.integers(0, len(self.running) - 1)))
            self.reqs[r]["readmit_k"] = self.draw(st.integers(1, len(self.reqs[r]["blocks"])))
            self.waiting.insert(0, r)
        else:
            for _ in range(self.draw(st.integers(1, 3))):
                if not self.waiting:
                    break
                r = self.waiting[0]
                if not self.attempt(r, self.draw(st.booleans())):
                    break
                self.running.append(self.waiting.pop(0))
        self.pseq += 1


@st.composite
def histories(draw):
    h = History(draw, draw(st.integers(1, 8)))
    for _ in range(draw(st.integers(1, 40))):
        h.step()
    while h.waiting:  # the rest admitted, one a step
        h.attempt(h.waiting[0], True)
        h.running.append(h.waiting.pop(0))
        h.pseq += 1
    return h


@settings(max_examples=300, deadline=None)
@given(histories())
def test_retries_and_readmissions_rebuild_the_engines_requests(h):
    rows, counts = rebuild_rows(h.rows)
    admitted = [q for q in h.reqs if q["hit"] is not None]
    assert sorted(r["num_cached_tokens"] for r in rows) == sorted(32 * q["hit"] for q in admitted)
