"""Tier simulation benchmark: `simulate_tiers` against the single-tier `vllm` model on the same stream.

The stream is `pressure_bench.synthetic` (families and bystanders, 16-token blocks, sequential) of at least
--min-reads block reads. Timed, best of --repeat, in the same run: `vllm` = `simulate_pool` (the GPU pool
alone, as `headroom`'s vllm row, building its access stream from the requests as `headroom` does), and the
same given the stream already built (the pool's kernel and its result alone); `tiers` = `simulate_tiers`
with a host and an SSD tier (on-evict, one-block chunks), and with one write-through SSD tier of 256-token
chunks (compiled: `kmesh_trace.oracle.tiers.compiled`), from the requests and given its stream (`TierStream`)
already built, as a sweep's configurations share it; with --reference also the Python `TierReplay` (the
reference the compiled replay is tested equal to). Reported: block reads per second and tiers / vllm (goal
<= 1.3 for two on-evict tiers), in CPU seconds of this process (`time.process_time`: the machine these run
on is shared, and CPU time is far less disturbed by other processes than wall time, also shown). A warm-up
on the first requests loads the compiled kernels first.

    .venv/bin/python benchmarks/tier_bench.py [--min-reads 10000000] [--repeat 1] [--reference]
"""

from __future__ import annotations

import argparse
from time import perf_counter, process_time

from kmesh_trace.oracle.blockpool import simulate_pool
from kmesh_trace.oracle.stream import AccessStream
from kmesh_trace.oracle.tiers import RestoreCost, TierConfig, TierSpec, simulate_tiers
from kmesh_trace.oracle.tiers.compiled import tier_stream
from kmesh_trace.oracle.tiers.replay import TierReplay
from pressure_bench import synthetic  # same folder: the script's directory is on sys.path


def best_of(fn, repeat: int):
    """(best CPU seconds, wall seconds of that run, result)."""
    best = (float("inf"), 0.0, None)
    for _ in range(repeat):
        c, w = process_time(), perf_counter()
        out = fn()
        c, w = process_time() - c, perf_counter() - w
        if c < best[0]:
            best = (c, w, out)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-reads", type=int, default=10_000_000)
    ap.add_argument("--capacity-blocks", "--gpu-blocks", dest="gpu_blocks", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--reference", action="store_true", help="also time the Python TierReplay (slow)")
    a = ap.parse_args()
    bs = 16
    t0 = perf_counter()
    reqs = synthetic(a.min_reads, bs)
    reads = sum(len(r.prompt_hashes) for r in reqs)
    print(f"synthetic: {len(reqs):,} requests, {reads:,} block reads, {bs}-token blocks, GPU {a.gpu_blocks:,} blocks "
          f"(generated in {perf_counter() - t0:.1f} s)")
    costs = {"host": RestoreCost(50.0), "ssd": RestoreCost(1.7)}
    configs = {
        "host+ssd on-evict": TierConfig(a.gpu_blocks, (TierSpec("host", 4 * a.gpu_blocks), TierSpec("ssd", 16 * a.gpu_blocks))),
        "ssd write-through 256-token": TierConfig(a.gpu_blocks, (TierSpec("ssd", 16 * a.gpu_blocks, chunk_blocks=256 // bs,
                                                                          write="write-through"),)),
    }
    for cfg in configs.values():  # warm-up: load the compiled kernels
        simulate_tiers(reqs[:50], cfg, block_size=bs, kv_bytes_per_token=131072, costs=costs)
    simulate_pool(reqs[:50], block_size=bs, num_usable_blocks=a.gpu_blocks)
    t_pool, w_pool, pool = best_of(lambda: simulate_pool(reqs, block_size=bs, num_usable_blocks=a.gpu_blocks), a.repeat)
    print(f"  vllm (GPU pool alone)            {t_pool:8.2f} CPU s ({w_pool:6.2f} wall)  {reads / t_pool:10,.0f} "
          f"block reads/CPU s  hit blocks {pool.total_hit_blocks:,}")
    stream = AccessStream.from_requests(reqs, bs)
    t_kernel, w_kernel, _ = best_of(lambda: simulate_pool(reqs, block_size=bs, num_usable_blocks=a.gpu_blocks,
                                                          stream=stream), a.repeat)
    print(f"  vllm, its stream prebuilt        {t_kernel:8.2f} CPU s ({w_kernel:6.2f} wall)")
    for name, cfg in configs.items():
        t, w, res = best_of(lambda: simulate_tiers(reqs, cfg, block_size=bs, kv_bytes_per_token=131072, costs=costs),
                            a.repeat)
        print(f"  tiers: {name:<27} {t:8.2f} CPU s ({w:6.2f} wall)  {reads / t:10,.0f} block reads/CPU s  "
              f"tiers/vllm {t / t_pool:5.2f} (wall {w / w_pool:5.2f})  "
              f"hits by tier { {k: int(v.sum()) for k, v in res.hit_blocks_by_tier.items()} }")
        tstream = tier_stream(reqs, bs)
        tk, wk, _ = best_of(lambda: simulate_tiers(reqs, cfg, block_size=bs, kv_bytes_per_token=131072, costs=costs,
                                                   stream=tstream), a.repeat)
        print(f"         its stream prebuilt         {tk:8.2f} CPU s ({wk:6.2f} wall)  tiers/vllm, both streams "
              f"prebuilt {tk / t_kernel:5.2f} (wall {wk / w_kernel:5.2f})")
        if a.reference:
            def python():
                sim = TierReplay(reqs, bs, cfg, 131072, costs, False, {})
                return sim.result(sim.run(), None)
            tp, wp, ref = best_of(python, 1)
            same = all(v.tolist() == res.hit_blocks_by_tier[k].tolist() for k, v in ref.hit_blocks_by_tier.items())
            print(f"         Python TierReplay           {tp:8.2f} CPU s ({wp:6.2f} wall)  compiled is {tp / t:5.1f}x "
                  f"faster; hits per request {'equal' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
