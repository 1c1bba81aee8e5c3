"""Retention-pressure benchmark: the family-hold what-if against a plain stock replay of the same stream.

Streams (each of at least --min-reads block reads; a block read = one prompt block hash listed):
- `mooncake`: the Mooncake conversation trace (../shared/datasets, or --src), imported, families
  inferred from block hashes (`infer_exact_prefix_edges`), tiled with fresh hashes per copy up to
  --min-reads; skipped with a message when the file is absent;
- `synthetic`: a generated family workload (parents, children extending parent prompt + output,
  unrelated requests, exact repeats), 16-token blocks.

Timed, best of --repeat: `stock` = `simulate_pool` without holds; `held` = `simulate_pool` with the
holds `what_if` would apply (the edges and hold policy built outside the timing; their cost is
reported on its own line). Reported: block reads per second for each, and held / stock (goal <= 1.5).

    .venv/bin/python benchmarks/pressure_bench.py [--src conversation_trace.jsonl] [--min-reads 1000000]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path
from time import perf_counter

from kmesh_trace.oracle.blockpool import simulate_pool
from kmesh_trace.oracle.families import infer_exact_prefix_edges
from kmesh_trace.oracle.pressure import hold_policy
from kmesh_trace.oracle.stream import RequestBlocks
from oracle_bench import best_of  # same folder: the script's directory is on sys.path

DATASETS = Path(os.environ.get("KMESH_DATASETS", Path(__file__).resolve().parents[2] / "shared" / "datasets"))
DEFAULT_SRC = DATASETS / "mooncake" / "conversation_trace.jsonl"


def mooncake(src: Path) -> tuple[list[RequestBlocks], int]:
    from kmesh_trace.datasets.importers.mooncake import import_mooncake
    from kmesh_trace.oracle.workload import request_blocks
    from kmesh_trace.trace import open_trace

    with tempfile.TemporaryDirectory() as d:
        import_mooncake(src, Path(d) / "trace")
        with open_trace(Path(d) / "trace") as t:
            return request_blocks(t), t.block_size


def tile(reqs: list[RequestBlocks], min_reads: int) -> list[RequestBlocks]:
    """Copies of the stream back to back, hashes made distinct per copy (h + copy << 64)."""
    reads = sum(len(r.prompt_hashes) for r in reqs)
    copies = max(1, -(-min_reads // reads))
    out = []
    for k in range(copies):
        off = k << 64
        for r in reqs:
            out.append(RequestBlocks(len(out), f"{r.request_id}#{k}", r.num_prompt_tokens, r.num_output_tokens,
                                     [h + off for h in r.prompt_hashes], [h + off for h in r.output_hashes]))
    return out


def synthetic(min_reads: int, block_size: int = 16, seed: int = 0) -> list[RequestBlocks]:
    """Families and bystanders, generated as block hashes (a fresh int is a fresh block)."""
    rng = random.Random(seed)
    fresh = iter(range(1, 1 << 62))
    reqs: list[RequestBlocks] = []
    parents: list[int] = []
    reads = 0

    def add(prompt_tokens: int, prompt_hashes: list[int], num_out: int, parent: int | None = None,
            n_children: int | None = None) -> None:
        nonlocal reads
        n_chain = (prompt_tokens + num_out) // block_size
        out_hashes = [next(fresh) for _ in range(max(0, n_chain - len(prompt_hashes)))]
        reqs.append(RequestBlocks(len(reqs), str(len(reqs)), prompt_tokens, num_out, prompt_hashes, out_hashes,
                                  family_id=None if parent is None and n_children is None else f"f{parent or len(reqs)}",
                                  parent_index=parent, num_expected_children=n_children))
        reads += len(prompt_hashes)

    repeatable: list[int] = []
    while reads < min_reads:
        u = rng.random()
        if u < 0.2 or not parents:
            tokens = rng.randrange(8, 64) * block_size + rng.randrange(block_size)
            add(tokens, [next(fresh) for _ in range(tokens // block_size)], rng.randrange(1, 64), None, rng.randrange(1, 5))
            parents.append(len(reqs) - 1)
            parents = parents[-50:]  # children arrive close to their parent
        elif u < 0.6:
            p = reqs[rng.choice(parents)]
            chain = p.prompt_hashes + p.output_hashes
            tokens = p.num_prompt_tokens + p.num_output_tokens + rng.randrange(1, 16 * block_size)
            add(tokens, chain + [next(fresh) for _ in range(tokens // block_size - len(chain))],
                rng.randrange(1, 64), p.index)
        elif u < 0.75 and repeatable:
            q = reqs[rng.choice(repeatable)]
            add(q.num_prompt_tokens, list(q.prompt_hashes), rng.randrange(1, 64))
        else:
            tokens = rng.randrange(4, 48) * block_size + rng.randrange(block_size)
            add(tokens, [next(fresh) for _ in range(tokens // block_size)], rng.randrange(1, 64))
            repeatable.append(len(reqs) - 1)
            repeatable = repeatable[-200:]
    return reqs


def bench(name: str, reqs: list[RequestBlocks], block_size: int, capacity: int, edges: dict[int, int] | None,
          repeat: int) -> None:
    reads = sum(len(r.prompt_hashes) for r in reqs)
    t0 = perf_counter()
    if edges is None:
        edges = infer_exact_prefix_edges(reqs, block_size)
        kind = "inferred"
    else:
        kind = "declared"
    policy = hold_policy(reqs, edges)
    t_policy = perf_counter() - t0
    t_stock, stock = best_of(lambda: simulate_pool(reqs, block_size=block_size, num_usable_blocks=capacity), repeat)
    t_held, held = best_of(lambda: simulate_pool(reqs, block_size=block_size, num_usable_blocks=capacity, holds=policy),
                           repeat)
    holds = sum(1 for h in held.holds if h.status == "taken")
    print(f"{name}: {len(reqs):,} requests, {reads:,} block reads, {block_size}-token blocks, capacity {capacity:,} "
          f"blocks, {len(edges):,} {kind} edges, {holds:,} holds taken")
    print(f"  edges + hold policy  {t_policy:8.3f} s")
    print(f"  stock replay         {t_stock:8.3f} s  {reads / t_stock:12,.0f} block reads/s")
    print(f"  held replay          {t_held:8.3f} s  {reads / t_held:12,.0f} block reads/s")
    print(f"  held / stock         {t_held / t_stock:8.3f}   (goal <= 1.5)")
    print(f"  net cached tokens    {held.total_hit_tokens - stock.total_hit_tokens:,} "
          f"(stock {stock.total_hit_tokens:,}, held {held.total_hit_tokens:,})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=DEFAULT_SRC, help="Mooncake conversation_trace.jsonl")
    ap.add_argument("--min-reads", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--mooncake-capacity", type=int, default=5_000, help="usable 512-token blocks")
    ap.add_argument("--synthetic-capacity", type=int, default=4_000, help="usable 16-token blocks")
    args = ap.parse_args()
    if args.src.is_file():
        reqs, bs = mooncake(args.src)
        bench("mooncake conversation (tiled)", tile(reqs, args.min_reads), bs, args.mooncake_capacity, None, args.repeat)
    else:
        print(f"mooncake: skipped, {args.src} is absent (set KMESH_DATASETS or --src)")
    reqs = synthetic(args.min_reads)
    edges = {r.index: r.parent_index for r in reqs if r.parent_index is not None}
    bench("synthetic families", reqs, 16, args.synthetic_capacity, edges, args.repeat)


if __name__ == "__main__":
    main()
