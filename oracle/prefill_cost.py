"""Prefill seconds from prefill tokens: a cost model per prompt position.

Tokens are not equal: a prompt token at position 100,000 attends over 100,000 earlier keys, one at
position 100 over 100. The model charges each computed prompt token at position `pos`

    seconds_per_token + seconds_per_token_position * pos

(the first term: the weights' matrix multiplies, the same for every token; the second: attention
over the earlier positions), plus a fixed `seconds_per_request` for a request that computes
anything. Computing positions [start, end) with [0, start) already cached therefore costs

    seconds_per_request + seconds_per_token * (end - start)
                        + seconds_per_token_position * (end**2 - start**2) / 2.

Where the coefficients come from:
- `PrefillCost.fit(trace)`: least squares (non-negative) over the capture's measured prefills, each
  invocation's first-scheduled -> first-token interval against (cached tokens, prompt tokens). The
  `FitReport` says how many points fitted, how well (r2, median relative error) and holds the
  points for a plot. The interval includes any batching with other requests and, under chunked
  prefill, the steps the prompt waited between chunks; the error figures say how much that matters.
- `PrefillCost.from_throughput(tokens_per_s, attention_factor=...)`: for imported traces, which
  have no timings; `from_geometry` derives the attention factor from the model's size.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.stream import engine_geometry

#: Fewest measured prefills `fit` accepts.
MIN_FIT_POINTS = 3
#: A fit is *usable* (its seconds are printed) when it explains at least this share of the measured
#: variance (r2) ...
MIN_USABLE_R2 = 0.5
#: ... and its median relative error is at most this: below either, its seconds would be guesses.
MAX_USABLE_MEDIAN_RELATIVE_ERROR = 0.5


@dataclass(frozen=True)
class FitReport:
    """How well a fitted `PrefillCost` explains the measured prefills it came from."""

    n: int  # points fitted
    r2: float  # coefficient of determination of the predicted seconds
    median_relative_error: float  # median |predicted - measured| / measured
    num_skipped: int  # invocations without a usable measurement (unfinished, no timing, no cached count)
    # One row per point: (cached tokens, prompt tokens, measured seconds, predicted seconds).
    points: list[tuple[int, int, float, float]] = field(default_factory=list, repr=False)

    @property
    def why_unusable(self) -> str | None:
        """None when the fit is usable (MIN_USABLE_R2, MAX_USABLE_MEDIAN_RELATIVE_ERROR), else why not."""
        bad = []
        if not self.r2 >= MIN_USABLE_R2:
            bad.append(f"r2 {self.r2:.3f} < {MIN_USABLE_R2}")
        if not self.median_relative_error <= MAX_USABLE_MEDIAN_RELATIVE_ERROR:
            bad.append(f"median relative error {self.median_relative_error:.0%} > "
                       f"{MAX_USABLE_MEDIAN_RELATIVE_ERROR:.0%}")
        if not bad:
            return None
        return (f"the prefill cost fitted to {self.n:,} measured prefills is not usable ({', '.join(bad)}), so no "
                "seconds are estimated; give a throughput with --prefill-tokens-per-s")

    @property
    def usable(self) -> bool:
        return self.why_unusable is None

    def to_json(self) -> dict:
        return {"n": self.n, "r2": self.r2, "median_relative_error": self.median_relative_error,
                "num_skipped": self.num_skipped, "usable": self.usable,
                "usable_if": {"min_r2": MIN_USABLE_R2, "max_median_relative_error": MAX_USABLE_MEDIAN_RELATIVE_ERROR},
                "points": [{"cached_tokens": s, "prompt_tokens": e, "measured_s": m, "predicted_s": p}
                           for s, e, m, p in self.points]}


@dataclass(frozen=True)
class PrefillCost:
    """Seconds to compute prompt positions, linear in position per token (module docstring)."""

    seconds_per_token: float
    seconds_per_token_position: float = 0.0
    seconds_per_request: float = 0.0
    source: str = "given"  # "fit", "throughput", "geometry" or "given"

    def __post_init__(self) -> None:
        if min(self.seconds_per_token, self.seconds_per_token_position, self.seconds_per_request) < 0:
            raise KmeshTraceError("prefill cost coefficients must be non-negative.")
        if self.seconds_per_token == 0 and self.seconds_per_token_position == 0:
            raise KmeshTraceError("a prefill cost model needs a positive per-token cost.")

    def seconds(self, start: int, end: int) -> float:
        """Seconds to compute prompt positions [start, end) with [0, start) cached (0 when end <= start)."""
        if end <= start:
            return 0.0
        return (self.seconds_per_request + self.seconds_per_token * (end - start)
                + self.seconds_per_token_position * (float(end) ** 2 - float(start) ** 2) / 2)

    def seconds_array(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """`seconds` elementwise over arrays of starts and ends (float64)."""
        s = np.asarray(start, np.float64)
        e = np.asarray(end, np.float64)
        out = (self.seconds_per_request + self.seconds_per_token * (e - s)
               + self.seconds_per_token_position * (e * e - s * s) / 2)
        return np.where(e > s, out, 0.0)

    def tokens_per_second_at(self, pos: int | float) -> float:
        """Prefill throughput of a token at prompt position `pos` (the per-request overhead excluded)."""
        per_token = self.seconds_per_token + self.seconds_per_token_position * float(pos)
        return 1.0 / per_token if per_token > 0 else float("inf")

    def to_json(self) -> dict:
        d = {k: (float(v) if isinstance(v, (float, np.floating)) else v) for k, v in asdict(self).items()}
        at0 = self.tokens_per_second_at(0)
        d["tokens_per_second_at_0"] = at0 if np.isfinite(at0) else None
        return d

    # ---- constructors ----------------------------------------------------------------------------

    @classmethod
    def from_throughput(cls, tokens_per_s: float, *, attention_factor: float = 0.0,
                        seconds_per_request: float = 0.0) -> "PrefillCost":
        """A model from a prefill throughput: `tokens_per_s` is the rate at position 0, and
        `attention_factor` the extra cost of a token per earlier position, as a fraction of its
        position-0 cost (a token at position p costs (1 + attention_factor * p) / tokens_per_s)."""
        if not tokens_per_s or tokens_per_s <= 0:
            raise KmeshTraceError("the prefill throughput must be a positive number of tokens per second.")
        if attention_factor < 0:
            raise KmeshTraceError("the attention factor must be non-negative.")
        a = 1.0 / float(tokens_per_s)
        return cls(a, a * float(attention_factor), float(seconds_per_request), "throughput")

    @classmethod
    def from_geometry(cls, tokens_per_s: float, *, num_params: float, num_layers: int, attention_dim: int,
                      seconds_per_request: float = 0.0) -> "PrefillCost":
        """A model from a throughput and the model's shape: a token costs about 2 * num_params FLOPs in
        the weights and 4 * num_layers * attention_dim FLOPs per earlier position in attention
        (QK^T and AV), so attention_factor = 2 * num_layers * attention_dim / num_params.
        `attention_dim` is num_attention_heads * head_dim."""
        if num_params <= 0 or num_layers <= 0 or attention_dim <= 0:
            raise KmeshTraceError("model geometry (parameters, layers, attention width) must be positive.")
        m = cls.from_throughput(tokens_per_s, attention_factor=2.0 * num_layers * attention_dim / num_params,
                                seconds_per_request=seconds_per_request)
        return cls(m.seconds_per_token, m.seconds_per_token_position, m.seconds_per_request, "geometry")

    @classmethod
    def fit(cls, trace, engine: str | None = None, *, overhead: bool = True) -> "tuple[PrefillCost, FitReport]":
        """Fit the model to an opened capture's measured prefills (`kmesh_trace.trace.open_trace`)."""
        import polars as pl

        engine_geometry(trace, engine)  # the one error for an ambiguous or unknown engine
        lf = trace.scan("invocations")
        if engine is not None:
            lf = lf.filter(pl.col("engine") == engine)
        df = lf.select("num_cached_tokens", "num_prompt_tokens", "first_scheduled_ns", "first_token_ns").collect()
        ok = df.filter(pl.all_horizontal(pl.all().is_not_null())
                       & (pl.col("first_token_ns") > pl.col("first_scheduled_ns"))
                       & (pl.col("num_prompt_tokens") > pl.col("num_cached_tokens")))
        start = ok["num_cached_tokens"].to_numpy().astype(np.int64)
        end = ok["num_prompt_tokens"].to_numpy().astype(np.int64)
        secs = (ok["first_token_ns"] - ok["first_scheduled_ns"]).to_numpy().astype(np.float64) / 1e9
        return cls.fit_points(start, end, secs, overhead=overhead, num_skipped=df.height - ok.height)

    @classmethod
    def fit_points(cls, start, end, seconds, *, overhead: bool = True,
                   num_skipped: int = 0) -> "tuple[PrefillCost, FitReport]":
        """Fit to measured prefills given as arrays: cached tokens, prompt tokens, seconds."""
        s = np.asarray(start, np.float64)
        e = np.asarray(end, np.float64)
        y = np.asarray(seconds, np.float64)
        if len(y) < MIN_FIT_POINTS:
            raise KmeshTraceError(
                f"only {len(y)} invocation(s) have a measured prefill (first-scheduled and first-token times, "
                f"cached and prompt tokens); a prefill cost fit needs at least {MIN_FIT_POINTS}. Give a "
                "throughput with --prefill-tokens-per-s instead.")
        columns = [e - s, (e * e - s * s) / 2] + ([np.ones_like(y)] if overhead else [])
        coef = _nonnegative_least_squares(np.column_stack(columns), y)
        model = cls(float(coef[0]), float(coef[1]), float(coef[2]) if overhead else 0.0, "fit")
        pred = model.seconds_array(s, e)
        ss_res = float(((y - pred) ** 2).sum())
        ss_tot = float(((y - y.mean()) ** 2).sum())
        r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
        rel = float(np.median(np.abs(pred - y) / y)) if (y > 0).all() else float("nan")
        points = [(int(a), int(b), float(m), float(p)) for a, b, m, p in zip(s, e, y, pred)]
        return model, FitReport(len(y), r2, rel, int(num_skipped), points)


def usable_fit(trace, engine: str | None = None) -> "tuple[PrefillCost | None, FitReport | None, str | None]":
    """The prefill cost fitted to an opened capture, when the fit is usable: (cost, report, None);
    else (None, the report or None, why there are no seconds). Every why names --prefill-tokens-per-s,
    the flag that gives the seconds anyway."""
    no_timings = "an import has no prefill timings; give --prefill-tokens-per-s for seconds"
    if trace.invocations_in_memory is not None:  # a public trace read as it is: as its import
        return None, None, no_timings
    try:
        cost, report = PrefillCost.fit(trace, engine)
    except KmeshTraceError as e:
        if str(trace.metadata.get("source", "")).startswith("import"):
            return None, None, no_timings
        why = f"no prefill seconds: {str(e).rstrip('.')}"
        return None, None, why if "--prefill-tokens-per-s" in why else f"{why}; give --prefill-tokens-per-s for seconds"
    why = report.why_unusable
    return (None if why else cost), report, why


def _nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||x c - y|| over c >= 0, for the few columns here: the best unconstrained fit over every
    subset of columns whose solution is non-negative (exact, as the optimum's support is one of them)."""
    k = x.shape[1]
    best, best_res = None, np.inf
    for r in range(k, 0, -1):
        for cols in itertools.combinations(range(k), r):
            c, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if (c < 0).any():
                continue
            res = float(((x[:, cols] @ c - y) ** 2).sum())
            if res < best_res:
                full = np.zeros(k)
                full[list(cols)] = c
                best, best_res = full, res
    if best is None or not (best[:2] > 0).any():
        raise KmeshTraceError("the measured prefills do not fit a positive per-token cost; give a throughput with "
                              "--prefill-tokens-per-s instead.")
    return best
