"""Small fleet workloads built in code: hand-built requests and a multi-engine trace directory."""

from __future__ import annotations

import random
from pathlib import Path

from kmesh_trace.oracle.workload import Workload as FleetWorkload
from kmesh_trace.oracle.stream import RequestBlocks
from kmesh_trace.writer import TraceWriter

BLOCK_SIZE = 4


def req(i: int, hashes: list[int], *, family: str | None = None, parent: int | None = None,
        arrival: int | None = None, finish: int | None = None, n_out: int = 1) -> RequestBlocks:
    """A request whose prompt is exactly its blocks plus one token, so every listed block can hit."""
    return RequestBlocks(index=i, request_id=f"r{i}", num_prompt_tokens=len(hashes) * BLOCK_SIZE + 1,
                         num_output_tokens=n_out, prompt_hashes=list(hashes), arrival_ns=arrival, finish_ns=finish,
                         family_id=family, parent_index=parent)


def workload(requests: list[RequestBlocks]) -> FleetWorkload:
    return FleetWorkload(BLOCK_SIZE, requests)


def random_rows(seed: int, num_requests: int = 60, num_families: int = 8, timed: bool = True) -> list[dict]:
    """Families of requests that extend a shared per-family prefix, arriving interleaved."""
    rng = random.Random(seed)
    prefixes = [[rng.getrandbits(62) for _ in range(rng.randint(1, 6))] for _ in range(num_families)]
    rows, t = [], 0
    for i in range(num_requests):
        f = rng.randrange(num_families)
        hashes = prefixes[f] + [rng.getrandbits(62) for _ in range(rng.randint(0, 4))]
        t += rng.randint(0, 3)
        rows.append({"request_id": f"q{i}", "seq": i, "family_id": f"f{f}",
                     "num_prompt_tokens": len(hashes) * BLOCK_SIZE + rng.randint(0, 3),
                     "num_output_tokens": rng.randint(1, 9), "prompt_block_hashes": hashes,
                     "arrival_ns": t if timed else None, "finish_ns": t + rng.randint(1, 12) if timed else None})
    return rows


def write_fleet_trace(out: Path, *, num_engines: int = 3, seed: int = 0, num_usable_blocks: int = 24,
                      timed: bool = True) -> Path:
    """A trace of `num_engines` engine partitions, the requests dealt to them in turn (seq per engine)."""
    rows = random_rows(seed, timed=timed)
    for e in range(num_engines):
        mine = [dict(r, seq=k) for k, r in enumerate(rows[e::num_engines])]
        with TraceWriter(out, f"e{e}", {"block_size": BLOCK_SIZE, "num_usable_blocks": num_usable_blocks}) as w:
            w.write("invocations", {k: [r[k] for r in mine] for k in mine[0]})
    return Path(out)
