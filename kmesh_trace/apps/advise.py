"""`kmesh-trace advise`: the sizing ladder of one trace, and the smallest configuration that gets within a
stated share of the bound.

`advise(source, options)` runs the analyses each rung comes from, as their commands run them, and returns an
`Advice` (`to_dict` is the JSON of `kmesh-trace advise`). A rung is one configuration: its token hit ratio,
block hit ratio, prefill tokens, prefill seconds (when a cost is known), capacity in blocks and bytes, and the
exact command whose `--json` output holds its numbers (`command`, at the key path `at`):

- `infinite`, `bound` (Belady at the pool), `modelled` (the `vllm` pool model), `stock` (the engine as
  captured, when the trace has the engine's hit counts): one `headroom` run at the pool capacity;
- `holds`: `pressure`'s held arm (family holds), when the trace has families (declared, else inferred
  exact-prefix edges);
- `host-50`, `host-90`, `host-99`: a host (CPU) tier below the pool, at the smallest swept size that reaches
  50/90/99% of what lower tiers can add (`tiers --sweep-host`; the largest swept size holds every block the
  trace reads, so its gain is all that tiers can add); `ssd`: the 90% host tier plus the smallest SSD tier that
  reaches 99% (`tiers --sweep-host H --sweep-ssd ...`);
- `fleet-best`, `fleet-global`: N engines of the pool's size, the best routing policy and the global pool
  of N x the pool (`fleet`), when the trace has several engines or `--engines N` is given.

Each rung's `model_error` says how far a real engine may be from it: the `vllm` model's error measured by
replaying traces on vLLM (`kmesh_trace.oracle.model_error`, whose whole object is the JSON's `model_error`), or
"not measured" for the what-ifs no engine replayed (tiers, holds, fleets); bounds and measurements carry none.

Prefill seconds come from `--prefill-tokens-per-s`, else the capture's own timing fit
(`kmesh_trace.oracle.prefill_cost`): shown with its r2 and its median relative error as the error bar, and
withheld (tokens only, with the reason) when the fit is not usable. Tier rungs' seconds exclude restore time.

The recommendation is the first of the candidate configurations, cheapest first (as configured, family
holds, host tiers by size, host + SSD), whose hit tokens reach (100 - within)% of the bound's, spelled as the
settings that realise it (`SETTINGS`: every vLLM flag and LMCache key named here is checked by the tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.model_error import MODEL_ERROR, for_rung
from kmesh_trace.oracle.options import flags, option

__all__ = ["AdviseOptions", "Advice", "Rung", "advise", "VLLM_FLAGS", "LMCACHE_KEYS", "PREFILL_RATES", "PrefillRate"]

#: Tier fractions: the share of what lower tiers can add that each host rung reaches.
TIER_FRACTIONS = (0.5, 0.9, 0.99)

#: vLLM 0.32 engine arguments the recommendations name (tests/test_advise.py parses each with
#: vllm.engine.arg_utils.EngineArgs.add_cli_args on a FlexibleArgumentParser). --kv-offloading-size is in GiB
#: (vllm/config/cache.py: "Size of the KV cache offloading buffer in GiB"); the native backend offloads to CPU.
VLLM_FLAGS = ("--kv-offloading-size", "--kv-offloading-backend", "--kv-transfer-config")
#: LMCache configuration keys the recommendations name, as LMCache documents them
#: (https://docs.lmcache.ai/api_reference/configurations.html, "General Configurations"): local_cpu (true/false),
#: max_local_cpu_size (GB), local_disk ("file:///path/to/cache"), max_local_disk_size (GB), chunk_size (tokens).
LMCACHE_KEYS = ("chunk_size", "local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size")
#: The capture plugin's family hold controller (docs/CAPTURE.md, "The family hold controller").
HOLD_ENV = "KMESH_HOLD"

@dataclass(frozen=True)
class PrefillRate:
    """A measured prefill cost of one model geometry on one GPU, and the command or publication it comes from."""

    key: str  # what --prefill-rate names
    model: str
    gpu: str
    tokens_per_s: float  # at position 0
    attention_factor: float  # extra cost of a token per earlier position, as a fraction of its position-0 cost
    seconds_per_request: float
    source: str

    def cost(self):
        from kmesh_trace.oracle.prefill_cost import PrefillCost

        return PrefillCost.from_throughput(self.tokens_per_s, attention_factor=self.attention_factor,
                                           seconds_per_request=self.seconds_per_request)


#: Measured prefill rates. Only rows whose source can be cited: a command run here, or a published figure.
#: A rate without a source would make every second a guess, so the table stays short.
PREFILL_RATES: tuple[PrefillRate, ...] = (
    PrefillRate("llama3-8b-shape/h200/pytorch", "Llama-3-8B geometry, random bf16 weights", "NVIDIA H200",
                39061.0, 3.537e-5, 0.001348,
                "benchmarks/prefill_rate.py (plain PyTorch 2.11 bf16 forward with SDPA, not vLLM) on one H200, "
                "prompts of 512..32768 tokens from position 0, 5 timed runs each; fitted with "
                "PrefillCost.fit_points, r2 0.99999. A serving engine batches and schedules: treat it as the "
                "GPU's compute rate for this geometry, not as vLLM's."),
)
PREFILL_RATE_KEYS = tuple(r.key for r in PREFILL_RATES)


@dataclass(frozen=True)
class AdviseOptions:
    """What `kmesh-trace advise` is asked (its flags name the fields: `kmesh_trace.oracle.options`)."""

    capacity_blocks: int | None = option("--capacity-blocks")  # the pool (default: the trace's usable blocks)
    engines: int | None = option("--engines")  # fleet size (default: the trace's engines, when several)
    within: float = option("--within", 5.0)  # percent of the bound's hit tokens
    prefill_tokens_per_s: float | None = option("--prefill-tokens-per-s")  # default: the capture's fit
    prefill_rate: str | None = option("--prefill-rate")  # a PREFILL_RATES key
    kv_bytes_per_token: int | None = option("--kv-bytes-per-token")
    model_config: Any = option("--model-config")

    def check(self) -> None:
        if not 0 <= self.within < 100:
            raise KmeshTraceError(f"--within must be a percentage in [0, 100), not {self.within:g}.")
        if self.prefill_rate is not None and self.prefill_rate not in PREFILL_RATE_KEYS:
            raise KmeshTraceError(f"unknown --prefill-rate {self.prefill_rate!r}; the measured rates are: "
                                  f"{', '.join(PREFILL_RATE_KEYS)}.")
        if self.prefill_rate is not None and self.prefill_tokens_per_s is not None:
            raise KmeshTraceError("give --prefill-tokens-per-s or --prefill-rate, not both.")


@dataclass
class Rung:
    """One configuration of the ladder."""

    rung: str
    label: str  # what it is, in a few words
    hit_tokens: int
    num_prompt_tokens: int
    hit_blocks: int | None
    num_reads: int
    capacity_blocks: int
    command: str  # the command whose --json output holds this rung's numbers
    at: str  # where in that output
    hit_tokens_per_request: np.ndarray | None = None  # for seconds
    prompt_tokens_per_request: np.ndarray | None = None
    prefill_s: float | None = None
    prefill_s_error: float | None = None
    capacity_bytes: int | None = None
    detail: dict = field(default_factory=dict)  # the rung's own sizes (gpu/host/ssd blocks, engines)

    @property
    def prefill_tokens(self) -> int:
        return self.num_prompt_tokens - self.hit_tokens

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def hit_ratio(self) -> float | None:
        if self.hit_blocks is None:
            return None
        return self.hit_blocks / self.num_reads if self.num_reads else 0.0

    def to_dict(self) -> dict:
        return {"rung": self.rung, "label": self.label, "token_hit_ratio": self.token_hit_ratio,
                "hit_ratio": self.hit_ratio, "hit_tokens": self.hit_tokens, "prefill_tokens": self.prefill_tokens,
                "prefill_s": self.prefill_s, "prefill_s_error": self.prefill_s_error,
                "capacity_blocks": self.capacity_blocks, "capacity_bytes": self.capacity_bytes,
                **self.detail, "model_error": for_rung(self.rung), "command": self.command, "at": self.at}


@dataclass
class Advice:
    source: str
    block_size: int
    num_requests: int
    num_prompt_tokens: int
    capacity_blocks: int
    capacity_source: str
    kv_bytes_per_token: int | None
    rungs: list[Rung]
    within: float
    prefill: dict  # where seconds come from: source, fit quality, or why there are none
    unanswered: list[dict] = field(default_factory=list)  # {"what", "why", "answer"}
    recommendation: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    block_bytes: int | None = None  # one pool block's bytes (a hybrid engine's: its groups' pages)

    def rung(self, name: str) -> Rung | None:
        return next((r for r in self.rungs if r.rung == name), None)

    @property
    def pool_words(self) -> str:
        """The pool the ladder is at, and where its size comes from."""
        return pool_words(self.capacity_blocks, self.block_bytes, self.capacity_source)

    @property
    def verdict(self) -> str:
        """The answer in one sentence, from the ladder's numbers and the recommendation: the pool first (assumed or
        given), the base rung and the bound at that pool, then what `reaches` says."""
        rec = self.recommendation
        bound = self.rung("bound")
        base = self.rung("stock") or self.rung("modelled")
        what = "as captured" if base.rung == "stock" else "as modelled"
        head = (f"{self.pool_words}. The engine {what} reuses {_pct(base.token_hit_ratio)} of prompt tokens; the "
                f"bound at that pool is {_pct(bound.token_hit_ratio)}")
        if rec["reaches"] and rec["rung"] == base.rung:
            return head + f": already within {self.within:g}% of it, so change nothing."
        if rec["reaches"] and rec["rung"].endswith("-target"):
            return head + f"; the smallest tier that gets within {self.within:g}% of it is {rec['label']}."
        if rec["reaches"]:
            return head + f"; {rec['label']} gets within {self.within:g}% of it."
        if rec["tried"] == [base.rung]:
            return head + (f"; the engine is not within {self.within:g}% of it, and the trace answers no other "
                           "configuration (see what it could not answer).")
        if rec["rung"] == base.rung:
            return head + (f"; nothing tried gets within {self.within:g}% of it, and nothing tried beats the engine "
                           "as it is.")
        return head + f"; nothing tried gets within {self.within:g}% of it: the best is {rec['label']}."

    def violations(self) -> list[str]:
        """The ladder's invariants, each broken one in words (none: the numbers can be read as they are): the
        infinite cache >= the bound >= every rung at the pool; no rung above the infinite cache; the stock rung
        only at the engine's own pool; a recommendation that reaches meets its target."""
        bad: list[str] = []
        inf, bound = self.rung("infinite"), self.rung("bound")
        if inf.hit_tokens < bound.hit_tokens:
            bad.append(f"the infinite cache hits {inf.hit_tokens:,} tokens, below the bound's {bound.hit_tokens:,}")
        for r in self.rungs:
            if r.rung in ("infinite", "bound", "stock") or r.rung.startswith("fleet"):
                continue  # the fleet rungs route every engine's requests, not this engine's; the stock rung is
                # measured, and may count hits the trace cannot explain (`_stock_note`)
            if r.capacity_blocks == self.capacity_blocks and r.hit_tokens > bound.hit_tokens:
                bad.append(f"{r.rung} hits {r.hit_tokens:,} tokens at the pool, above the bound's {bound.hit_tokens:,}")
            if r.hit_tokens > inf.hit_tokens:
                bad.append(f"{r.rung} hits {r.hit_tokens:,} tokens, above the infinite cache's {inf.hit_tokens:,}")
            if r.capacity_blocks < self.capacity_blocks:
                bad.append(f"{r.rung} is at {blocks(r.capacity_blocks)}, below the pool")
        stock = self.rung("stock")
        if stock is not None and stock.capacity_blocks != self.capacity_blocks:
            bad.append(f"the stock rung is at {blocks(stock.capacity_blocks)}, not the pool")
        rec = self.recommendation
        if rec and rec["reaches"] != (self.rung(rec["rung"]).hit_tokens >= rec["target_hit_tokens"]):
            bad.append(f"the recommendation says reaches={rec['reaches']} against its own target")
        return bad

    def to_dict(self) -> dict:
        return {"source": self.source, "verdict": self.verdict, "block_size": self.block_size,
                "num_requests": self.num_requests, "num_prompt_tokens": self.num_prompt_tokens,
                "capacity_blocks": self.capacity_blocks, "capacity_source": self.capacity_source,
                "pool": self.pool_words, "kv_bytes_per_token": self.kv_bytes_per_token,
                "block_bytes": self.block_bytes, "within_pct": self.within,
                "prefill": self.prefill, "ladder": [r.to_dict() for r in self.rungs],
                "recommendation": self.recommendation, "unanswered": self.unanswered, "notes": self.notes,
                "model_error": MODEL_ERROR.to_dict()}


def blocks(n: int) -> str:
    """`n` blocks, in words."""
    return f"{n:,} block" + ("" if n == 1 else "s")


def _pct(ratio: float) -> str:
    """A ratio as a percentage a reader can compare: one decimal, two below 1% (never "0.0%" for a non-zero one)."""
    if 0 < ratio < 0.01:
        return f"{ratio:.2%}" if ratio >= 0.0001 else "<0.01%"
    return f"{ratio:.1%}"


def round_up(x: float, digits: int = 3) -> float:
    """`x` > 0 rounded up to `digits` significant figures (a size is never below what it sizes)."""
    if x <= 0:
        return 0.0
    places = digits - 1 - math.floor(math.log10(x))
    scale = 10.0 ** places
    return math.ceil(round(x * scale, 6)) / scale


def _figures(x: float, digits: int = 3) -> str:
    """`x` rounded up to `digits` significant figures, without trailing zeros."""
    v = round_up(x, digits)
    places = max(digits - 1 - math.floor(math.log10(v)), 0) if v else 0
    text = f"{v:,.{places}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def size_words(nbytes: int) -> str:
    """A size in bytes as a buyer reads it: three significant figures (rounded up) in the largest binary unit it
    fills; bytes below 1 KiB. Never "0.00 GiB"."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{_figures(nbytes / scale)} {unit}"
    return f"{nbytes:,} B"


def capacity_words(num_blocks: int, block_bytes: int | None) -> str:
    """A capacity in blocks, and in bytes when the block's bytes are known: "80 blocks (1.25 MiB)"."""
    return blocks(num_blocks) + (f" ({size_words(num_blocks * block_bytes)})" if block_bytes else "")


def pool_words(capacity: int, block_bytes: int | None, source: str) -> str:
    """"Pool: N blocks (size), SOURCE", or, when no pool is recorded, "Pool assumed: ..." with the flags that set it."""
    size = capacity_words(capacity, block_bytes)
    if source.startswith("no pool size recorded"):
        return (f"Pool assumed: {size}, as {source.removeprefix('no pool size recorded: ')} (no pool size recorded; "
                "give --capacity-blocks or --capacity)")
    return f"Pool: {size}, {source}"


def unanswered_sentence(u: dict) -> str:
    """One "could not answer" entry in words: what, why, and the flag or input that answers it (when one does)."""
    text = f"{u['what']}: {u['why']}"
    return text + (f"; answer with {u['answer']}." if u.get("answer") else ".")


# ---- the run -------------------------------------------------------------------------------------


@dataclass
class _Context:
    source: Any  # an opened Trace or a PublicInput
    source_arg: str
    engine: str | None
    options: AdviseOptions
    workload: Any
    capacity: int
    block_bytes: int | None  # one pool block's bytes, when the KV geometry is known
    cost: Any  # PrefillCost or None
    error: float | None  # the fit's median relative error
    stock_measured_at: int | None = None  # the pool the engine's own hits were measured at, when it has them
    tier_runs: dict = field(default_factory=dict)  # (host blocks, ssd blocks or None) -> (TierResult, options)
    tier_gain: tuple[int, int] | None = None  # hit tokens of the pool alone, and with a tier holding everything

    def command(self, name: str, text: str) -> str:
        engine = f" --engine {self.engine}" if self.engine else ""
        return f"kmesh-trace {name} {_quoted(self.source_arg)}{text}{engine} --json"

    def nbytes(self, blocks: int) -> int | None:
        return blocks * self.block_bytes if self.block_bytes else None

    def seconds(self, rung: Rung) -> None:
        if self.cost is None or rung.hit_tokens_per_request is None:
            return
        rung.prefill_s = float(self.cost.seconds_array(rung.hit_tokens_per_request,
                                                        rung.prompt_tokens_per_request).sum())
        if self.error is not None:
            rung.prefill_s_error = rung.prefill_s * self.error


def _quoted(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def advise(source, options: AdviseOptions, *, source_arg: str, engine: str | None = None,
           progress: Callable[[str], None] | None = None, capacity_source: str | None = None) -> Advice:
    """The ladder of `source` (an opened trace or a public trace read into memory) as `options` ask.
    `capacity_source`: how the user gave `options.capacity_blocks` (default: "--capacity-blocks")."""
    from kmesh_trace.oracle import tier_costs as tc
    from kmesh_trace.oracle.workload import Workload

    options.check()
    step = progress or (lambda what: None)
    w = Workload.from_trace(source, engine)
    meta = source.engines[engine] if engine is not None else source.metadata
    kvbpt, _ = tc.kv_bytes_per_token(meta, options.kv_bytes_per_token, options.model_config)
    unanswered: list[dict] = []
    notes: list[str] = []
    kvbpt, block_bytes = _kv_geometry(w, kvbpt, options, notes)
    if meta.get("token_ids_approximate"):
        notes.append(f"the token ids are approximate ({meta.get('tokenizer') or 'an importer'}'s, not the serving "
                     "model's): block counts and ratios are estimates")
    capacity, pool_source = _pool(w, options, step)
    if options.capacity_blocks is not None and capacity_source:
        pool_source = capacity_source
    notes += [n for n in [_small_pool_note(w, capacity)] if n]
    cost, prefill = _prefill(source, engine, options)
    if cost is None:
        unanswered.append({"what": "prefill seconds", "why": _why_no_seconds(prefill["why"]),
                           "answer": "--prefill-tokens-per-s R, --prefill-rate KEY (a measured rate), or a capture "
                                     "with timings (kmesh-trace capture)"})
    ctx = _Context(source, source_arg, engine, options, w, capacity, block_bytes, cost,
                   prefill.get("median_relative_error") if prefill.get("source") == "fit" else None)
    step("headroom")
    rungs = _headroom_rungs(ctx)
    unanswered += _stock_unanswered(ctx, rungs)
    notes += [n for n in [_stock_note(rungs)] if n]
    rungs += _refusable(ctx, "family holds", "pressure", _holds_rung, unanswered, step)
    rungs += _refusable(ctx, "host and SSD tiers", "tiers", lambda c: _tier_rungs(c, notes), unanswered, step)
    n = options.engines or (len(source.engines) if len(source.engines) > 1 else None)
    if n is not None:
        rungs += _refusable(ctx, "routing over several engines", "fleet", lambda c: _fleet_rungs(c, n), unanswered,
                            step)
        if len(source.engines) > 1:
            notes.append(f"the fleet rungs route every engine's requests ({len(source.engines)} engines); the other "
                         f"rungs are engine {engine}'s")
    else:
        unanswered.append({"what": "routing over several engines", "why": "the trace has one engine",
                           "answer": "--engines N"})
    if block_bytes is None:
        unanswered.append(_no_bytes(w))
    advice = Advice(source_arg, w.block_size, w.stream.num_requests, int(w.stream.num_prompt_tokens.sum()), capacity,
                    pool_source, kvbpt, rungs, options.within, prefill, unanswered, notes=notes,
                    block_bytes=block_bytes)
    advice.recommendation = _recommend(advice, ctx)
    _finish(advice, ctx)
    return advice


def _kv_geometry(w, kvbpt: int | None, options: AdviseOptions, notes: list[str]) -> tuple[int | None, int | None]:
    """(KV bytes per token, one pool block's bytes). A hybrid engine's block is its KV cache groups' largest page
    times its layers, as `headroom --capacity` reads it: it has no one KV bytes per token, and a flag giving one
    sizes nothing (said in a note); any other engine's block is block size x KV bytes per token."""
    if not w.hybrid:
        return kvbpt, (w.block_size * kvbpt if kvbpt else None)
    from kmesh_trace.oracle.hybrid_pool import pool_block_bytes

    given = [flag for flag, v in (("--kv-bytes-per-token", options.kv_bytes_per_token),
                                  ("--model-config", options.model_config)) if v is not None]
    if given:
        notes.append(f"{' and '.join(given)} not used: a hybrid engine's pool block is its KV cache groups' "
                     "largest page times its layers (as headroom --capacity reads it)")
    return None, pool_block_bytes(w.groups)


def _no_bytes(w) -> dict:
    """The "could not answer" entry for sizes in bytes: what would give them."""
    if w.hybrid:
        return {"what": "capacities in bytes", "why": "the engine's KV cache groups do not state their page sizes "
                "and layers (a hybrid engine's pool block is their largest page times its layers)",
                "answer": "a capture of the engine, whose metadata records its KV cache groups (kmesh-trace capture)"}
    return {"what": "capacities in bytes", "why": "no KV bytes per token (the trace's engine metadata has no model "
            "geometry)", "answer": "--kv-bytes-per-token B or --model-config FILE"}


def _finish(advice: Advice, ctx: _Context) -> None:
    """Every rung's seconds and bytes; the invariants checked (a broken one is a bug: the words would contradict
    the numbers)."""
    for r in advice.rungs:
        ctx.seconds(r)
        if r.capacity_bytes is None:
            r.capacity_bytes = ctx.nbytes(r.capacity_blocks)
    advice.recommendation["capacity_bytes"] = advice.rung(advice.recommendation["rung"]).capacity_bytes
    bad = advice.violations()
    if bad:
        raise AssertionError("advise: the ladder breaks its invariants: " + "; ".join(bad))


def _stock_note(rungs: list[Rung]) -> str | None:
    """What a stock rung above the models means: the engine hit blocks the trace never shows being stored."""
    by = {r.rung: r for r in rungs}
    stock, bound, inf = by.get("stock"), by.get("bound"), by.get("infinite")
    if stock is None or bound is None or stock.hit_tokens <= bound.hit_tokens:
        return None
    over, top = ("the infinite cache's", inf) if inf is not None and stock.hit_tokens > inf.hit_tokens else \
        ("the bound's", bound)
    return (f"the engine measured {stock.hit_tokens:,} hit tokens, above {over} {top.hit_tokens:,}: it hit blocks the trace "
            "never shows being stored (a cache already warm when the recording began, or a KV connector's loads); "
            "the modelled rungs start from an empty cache")


def _stock_unanswered(ctx: _Context, rungs: list[Rung]) -> list[dict]:
    """Why the ladder has no stock rung, when it has none."""
    w = ctx.workload
    if any(r.rung == "stock" for r in rungs):
        return []
    if ctx.stock_measured_at is not None:
        return [{"what": f"the engine as captured at {blocks(ctx.capacity)} (stock)",
                 "why": f"the engine's hits were measured at its own pool of {blocks(ctx.stock_measured_at)}, not "
                        f"{blocks(ctx.capacity)}", "answer": "the ladder at the engine's pool (no --capacity-blocks)"}]
    out = [{"what": "the engine as captured (stock)", "why": "the trace has no engine hit counts (an import, or a "
            "recording without them)", "answer": "a capture (kmesh-trace capture)"}]
    if not w.num_usable_blocks and ctx.options.capacity_blocks is None:
        out.insert(0, {"what": "the engine's pool size", "why": "the trace does not record usable blocks (an import); "
                       f"the ladder assumes {blocks(ctx.capacity)}", "answer": "--capacity-blocks N or --capacity "
                       "SIZE (or a capture: kmesh-trace capture)"})
    return out


def _refusable(ctx: _Context, what: str, command: str, rungs_of, unanswered: list[dict], step) -> list[Rung]:
    """The rungs `rungs_of(ctx)` gives, or none when the analysis `command` refuses the trace (or has nothing to
    say): its reason, in its own words, under "could not answer"."""
    step(command)
    try:
        rungs, why, answer = rungs_of(ctx)
    except KmeshTraceError as e:
        rungs, why, answer = [], f"kmesh-trace {command} refuses it: {str(e).rstrip('.')}", None
    if why is not None:
        unanswered.append({"what": what, "why": why, "answer": answer})
    return rungs


def _why_no_seconds(why: str | None) -> str:
    """The prefill fit's reason, without its advice (the ladder names the flag itself)."""
    text = str(why or "no prefill timings").removeprefix("no prefill seconds: ")
    return text.split("; give")[0].split(". Give")[0].rstrip(".")


def _pool(w, options: AdviseOptions, step) -> tuple[int, str]:
    """The pool capacity of the ladder: the user's, the engine's usable blocks, else (an import) the smallest
    capacity at which LRU reaches half the infinite cache's hits (as the report chooses), raised to the largest
    request's blocks (prompt + output) when that is larger: an engine serves its longest request."""
    if options.capacity_blocks is not None:
        return int(options.capacity_blocks), "--capacity-blocks"
    if w.num_usable_blocks:
        return int(w.num_usable_blocks), "the engine's usable blocks"
    from kmesh_trace.oracle.headroom_curve import headroom_curve
    from kmesh_trace.oracle.workload import Workload

    step("choosing a pool size")
    curve = headroom_curve(Workload(w.block_size, w.requests), policies=["lru"])
    half = curve.capacity_for_fraction()["lru"]["0.5"] or 0  # 0: nothing repeats, so no cache size helps
    longest = _longest_blocks(w)
    if longest >= half:
        return int(longest), "no pool size recorded: the blocks of the longest request (prompt + output)"
    return int(half), "no pool size recorded: the capacity at which LRU reaches half the infinite cache's hits"


def _longest_blocks(w) -> int:
    """The blocks of the trace's longest request, prompt + output: the smallest pool an engine serves it in."""
    bs = w.block_size
    return max(-(-(r.num_prompt_tokens + (r.num_output_tokens or 0)) // bs) for r in w.requests)


def _small_pool_note(w, capacity: int) -> str | None:
    """Said when the pool cannot hold the longest request: no engine of that pool serves the trace as it is."""
    longest = _longest_blocks(w)
    if capacity >= longest:
        return None
    return (f"the pool ({blocks(capacity)}) is smaller than the longest request ({blocks(longest)}, prompt + "
            "output): vLLM serves only requests that fit its pool, so no engine of this pool serves the trace as it "
            "is; its rungs at the pool are the models' figures, not a configuration to run")


def _prefill(source, engine, options: AdviseOptions):
    """(cost or None, what the JSON says about it)."""
    from kmesh_trace.oracle.headroom import fitted_prefill
    from kmesh_trace.oracle.prefill_cost import PrefillCost

    if options.prefill_tokens_per_s is not None:
        cost = PrefillCost.from_throughput(options.prefill_tokens_per_s)
        return cost, {"source": "throughput", "tokens_per_s": options.prefill_tokens_per_s, "why": None}
    if options.prefill_rate is not None:
        row = next(r for r in PREFILL_RATES if r.key == options.prefill_rate)
        return row.cost(), {"source": "table", "key": row.key, "model": row.model, "gpu": row.gpu,
                            "tokens_per_s": row.tokens_per_s, "cited": row.source, "why": None}
    f = fitted_prefill(source, engine)
    d: dict = {"source": "fit" if f.cost is not None else None, "why": f.why}
    if f.fit is not None:
        d.update(n=f.fit.n, r2=f.fit.r2, median_relative_error=f.fit.median_relative_error, usable=f.fit.usable)
    return f.cost, d


def _headroom_rungs(ctx: _Context) -> list[Rung]:
    from kmesh_trace.oracle import headroom as hr

    w = ctx.workload
    opts = hr.HeadroomOptions(capacities=(ctx.capacity,), policies=("infinite", "vllm", "belady"))
    res = hr.run(w, opts)
    command = ctx.command("headroom", flags(opts))
    reads = int(w.stream.num_reads.sum())
    names = {"infinite": ("infinite", "infinite cache"), "belady": ("bound", "Belady bound at the pool"),
             "vllm": ("modelled", "vLLM pool model"), "stock": ("stock", "the engine as captured")}
    out = []
    measured = res.stock_source == "capture"
    if measured:
        ctx.stock_measured_at = int(w.num_usable_blocks)
    results = list(res.results) + ([res.stock] if measured and ctx.capacity == w.num_usable_blocks else [])
    for k, r in enumerate(results):
        rung, label = names[r.policy]
        cap = w.stream.num_objects if r.policy == "infinite" else ctx.capacity  # infinite: every distinct block
        out.append(Rung(rung, label, r.hit_tokens, int(r.num_prompt_tokens.sum()), r.hit_blocks, reads, int(cap),
                        command, f"results[{k}]", r.hit_tokens_per_request, r.num_prompt_tokens))
    order = ["infinite", "bound", "stock", "modelled"]
    return sorted(out, key=lambda r: order.index(r.rung))


def _holds_rung(ctx: _Context) -> tuple[list[Rung], str | None, str | None]:
    """`pressure`'s held arm at the pool, when the trace has families; else (no rung, why not, what answers it).
    Raises what `pressure` raises on a trace it refuses."""
    from kmesh_trace.oracle import pressure as pr

    w = ctx.workload
    pr.check_has_requests(ctx.source, ctx.engine)
    w.refuse_hybrid("pressure")
    if any(r.parent_index is not None for r in w.requests):
        edges = pr.PressureEdges.declared
    elif pr.lineage_for(w, "inferred") or pr.infer_exact_prefix_edges(list(w.requests), w.block_size):
        edges = pr.PressureEdges.inferred
    else:
        return [], ("the trace has no families: no declared parents, and no request's prompt extends an earlier "
                    "request's whole prompt"), "requests that declare kmesh_parent/kmesh_children, captured " \
                                               "(kmesh-trace capture)"
    opts = pr.PressureOptions(edges, (ctx.capacity,))
    res = pr.run(w, opts)
    held = res.held
    label = "family holds" + (" (inferred families)" if edges == pr.PressureEdges.inferred else "")
    return [Rung("holds", label, held.total_hit_tokens, int(sum(held.num_prompt_tokens)), held.total_hit_blocks,
                 int(w.stream.num_reads.sum()), ctx.capacity, ctx.command("pressure", flags(opts)), "arms.held",
                 np.asarray(held.hit_tokens, np.int64), np.asarray(held.num_prompt_tokens, np.int64),
                 detail={"net_cached_tokens": res.net_cached_tokens, "edges": edges.value})], None, None


def _tier_sizes(capacity: int, distinct: int) -> list[int]:
    """Lower-tier sizes to sweep: doubling from a quarter of the pool, up to every distinct block the trace reads
    (the largest: a tier that holds everything, hence all that tiers can add)."""
    sizes, s = [], max(capacity // 4, 1)
    while s < distinct:
        sizes.append(s)
        s *= 2
    return sizes + [max(distinct, 1)]


def _tier_run(ctx: _Context, host: int, ssd: int | None = None):
    """`tiers` at one configuration (a host tier of `host` blocks, and an SSD tier of `ssd` below it): its
    TierResult and options (the command reproduces it at `sweep.configurations[0]`). Runs are kept: the
    bisections ask for a size again."""
    from kmesh_trace.oracle import tiers as tm

    key = (host, ssd)
    if key not in ctx.tier_runs:
        o = ctx.options
        opts = tm.TiersOptions(capacity_blocks=ctx.capacity, kv_bytes_per_token=o.kv_bytes_per_token,
                               model_config=o.model_config, prefill_tokens_per_s=o.prefill_tokens_per_s,
                               sweep_host=str(host), **({} if ssd is None else {"sweep_ssd": str(ssd)}))
        res = tm.run(ctx.workload, opts, name=ctx.source_arg, engine=ctx.engine, trace=ctx.source).sweep
        ctx.tier_runs[key] = (res.results[0][0], opts)
    return ctx.tier_runs[key]


def smallest(reaches: Callable[[int], bool], lo: int, hi: int) -> int:
    """The smallest size in (lo, hi] that reaches, by bisection: `lo` does not, `hi` does (sizes between grid
    points are tried one at a time; hit tokens grow with a tier's size)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if reaches(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _sized(ctx: _Context, grid: list[int], hits_at: Callable[[int], int], goal: float) -> int:
    """The smallest size reaching `goal` hit tokens: the first grid size that does, then bisection down to the
    grid size below it (the last grid size when none does)."""
    i = next((k for k, size in enumerate(grid) if hits_at(size) >= goal), None)
    if i is None:
        return grid[-1]
    return grid[0] if i == 0 else smallest(lambda size: hits_at(size) >= goal, grid[i - 1], grid[i])


def _tier_rungs(ctx: _Context, notes: list[str]) -> tuple[list[Rung], None, None]:
    """The host-50/90/99 and ssd rungs: each the smallest tier size reaching its share of what lower tiers can add
    (a doubling grid, then bisection between its points). Raises what `tiers` raises on a trace it refuses."""
    w = ctx.workload
    w.refuse_hybrid("tiers")
    grid = [0] + _tier_sizes(ctx.capacity, w.stream.num_objects)
    host_hits = lambda size: _tier_run(ctx, size)[0].hit_tokens  # noqa: E731
    h0, hmax = host_hits(0), host_hits(grid[-1])
    if hmax <= h0:
        notes.append(f"lower tiers add nothing at {blocks(ctx.capacity)}: a tier holding every block the trace "
                     "reads hits no more than the pool alone")
        return [], None, None
    ctx.tier_gain = (h0, hmax)
    out, sizes = [], {}
    for f in TIER_FRACTIONS:
        sizes[f] = _sized(ctx, grid, host_hits, h0 + f * (hmax - h0))
        out.append(_tier_rung(ctx, f"host-{round(f * 100)}", sizes[f], None, (h0, hmax)))
    if host_hits(sizes[0.9]) >= h0 + 0.99 * (hmax - h0):
        notes.append("no SSD rung: the 90% host tier already reaches 99% of what lower tiers can add")
        return out, None, None
    ssd_hits = lambda size: _tier_run(ctx, sizes[0.9], size)[0].hit_tokens  # noqa: E731
    ssd = _sized(ctx, grid, ssd_hits, h0 + 0.99 * (hmax - h0))
    return out + [_tier_rung(ctx, "ssd", sizes[0.9], ssd, (h0, hmax))], None, None


def _tier_rung(ctx: _Context, name: str, host: int, ssd: int | None, gain: tuple[int, int]) -> Rung:
    """The rung of `tiers` at one configuration; `gain`: the hit tokens of the pool alone and of a tier holding
    everything (for its share of what lower tiers can add)."""
    r, opts = _tier_run(ctx, host, ssd)
    h0, hmax = gain
    label = f"a {_size(ctx, host)} host tier" + (f" + a {_size(ctx, ssd)} SSD tier" if ssd is not None else "")
    return Rung(name, label, r.hit_tokens, int(np.sum(r.pool.num_prompt_tokens)), int(r.hit_blocks.sum()),
                int(ctx.workload.stream.num_reads.sum()), ctx.capacity + host + (ssd or 0),
                ctx.command("tiers", flags(opts)), "sweep.configurations[0]", r.hit_tokens_per_request,
                np.asarray(r.pool.num_prompt_tokens, np.int64),
                detail={"gpu_blocks": ctx.capacity, "host_blocks": host, "ssd_blocks": ssd or 0,
                        "share_of_tier_gain": (r.hit_tokens - h0) / (hmax - h0)})


def _size(ctx: _Context, num_blocks: int) -> str:
    """A tier's size in words: bytes (with its blocks) when the KV geometry is known, else blocks."""
    b = ctx.nbytes(num_blocks)
    return f"{num_blocks:,}-block" if b is None else f"{size_words(b)} ({blocks(num_blocks)})"


def _fleet_rungs(ctx: _Context, n: int) -> tuple[list[Rung], None, None]:
    from kmesh_trace.oracle import fleet

    opts = fleet.FleetOptions(None if ctx.options.engines is None else (n,), (ctx.capacity,))
    res = fleet.run(ctx.source, opts)
    d = res.to_dict()
    runs = d["points"][0]["runs"]
    command = ctx.command("fleet", flags(opts)).replace(f" --engine {ctx.engine}", "")  # fleet routes every engine
    routed = [(k, r) for k, r in enumerate(runs) if r["policy"] != fleet.GLOBAL]
    k, best = min(routed, key=lambda kr: (kr[1]["prefill_tokens"], kr[0]))
    g = next((k, r) for k, r in enumerate(runs) if r["policy"] == fleet.GLOBAL)
    num_reads = res.points[0].runs[0].num_reads
    out = []
    for name, label, (idx, r) in (("fleet-best", f"{n} engines, {best['policy']} routing", (k, best)),
                                  ("fleet-global", f"{n} engines sharing one global pool", g)):
        out.append(Rung(name, label, r["hit_tokens"], r["hit_tokens"] + r["prefill_tokens"], r["hit_blocks"],
                        num_reads, n * ctx.capacity, command, f"points[0].runs[{idx}]",
                        detail={"num_engines": n, "policy": r["policy"]}))
    return out, None, None


# ---- the recommendation --------------------------------------------------------------------------


def _gb(nbytes: int, unit: int) -> str:
    """A size in `unit` bytes (GiB for vLLM's flag, GB for LMCache's keys), rounded up to three significant
    figures: never below what the ladder sized, never 0."""
    return _figures(nbytes / unit) if nbytes else "0"


def _settings(rung: Rung, ctx: _Context) -> tuple[list[dict], str]:
    """The settings that realise `rung`, and one line that says how."""
    if rung.rung in ("stock", "modelled"):
        return [], "keep the engine as it is (automatic prefix caching on, vLLM's default)"
    if rung.rung == "holds":
        return ([{"tool": "kmesh-trace capture plugin", "env": HOLD_ENV, "value": "1"}],
                f"{HOLD_ENV}=1 in each engine's environment (the capture plugin's hold controller; requests declare "
                "kmesh_parent / kmesh_children)")
    host, ssd = rung.detail.get("host_blocks", 0), rung.detail.get("ssd_blocks", 0)
    hb, sb = ctx.nbytes(host), ctx.nbytes(ssd)
    if hb is None:
        return [], (f"a host tier of {host:,} blocks" + (f" and an SSD tier of {ssd:,} blocks" if ssd else "")
                    + "; give --kv-bytes-per-token or --model-config for the sizes in GiB")
    if not ssd:
        gib = _gb(hb, 2**30)
        return ([{"tool": "vllm", "flag": "--kv-offloading-size", "value": gib},
                 {"tool": "vllm", "flag": "--kv-offloading-backend", "value": "native"},
                 {"tool": "lmcache", "key": "local_cpu", "value": True},
                 {"tool": "lmcache", "key": "max_local_cpu_size", "value": float(_gb(hb, 10**9))}],
                f"vllm serve ... --kv-offloading-size {gib} --kv-offloading-backend native (or LMCache: local_cpu: "
                f"true, max_local_cpu_size: {_gb(hb, 10**9)})")
    connector = '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'
    return ([{"tool": "vllm", "flag": "--kv-transfer-config", "value": connector},
             {"tool": "lmcache", "key": "local_cpu", "value": True},
             {"tool": "lmcache", "key": "max_local_cpu_size", "value": float(_gb(hb, 10**9))},
             {"tool": "lmcache", "key": "local_disk", "value": "file:///PATH/TO/SSD/CACHE"},
             {"tool": "lmcache", "key": "max_local_disk_size", "value": float(_gb(sb, 10**9))}],
            f"vllm serve ... --kv-transfer-config '{connector}' with LMCache: local_cpu: true, max_local_cpu_size: "
            f"{_gb(hb, 10**9)}, local_disk: file:///PATH/TO/SSD/CACHE, max_local_disk_size: {_gb(sb, 10**9)}")


def _recommend(advice: Advice, ctx: _Context) -> dict:
    """The first candidate, cheapest first, within `within`% of the bound's hit tokens (a tier: the smallest size
    that is, by bisection below the first rung that reaches); else the best one."""
    bound = advice.rung("bound")
    target = bound.hit_tokens * (1 - advice.within / 100)
    base = advice.rung("stock") or advice.rung("modelled")
    names = [base.rung, "holds", "host-50", "host-90", "host-99", "ssd"]
    cands = [r for r in (advice.rung(n) for n in names) if r is not None]
    pick = next((r for r in cands if r.hit_tokens >= target), None)
    reaches = pick is not None
    if pick is None:
        pick = max(cands, key=lambda r: (r.hit_tokens, -cands.index(r)))
    elif pick.rung.startswith(("host-", "ssd")):
        pick = _target_rung(advice, ctx, pick, target)
    settings, how = _settings(pick, ctx)
    label = "the engine as it is" if pick.rung in ("stock", "modelled") else pick.label
    return {"rung": pick.rung, "label": label, "reaches": reaches, "tried": [r.rung for r in cands],
            "within_pct": advice.within,
            "target_hit_tokens": int(np.ceil(target)),
            "target_token_hit_ratio": target / bound.num_prompt_tokens if bound.num_prompt_tokens else 0.0,
            "token_hit_ratio": pick.token_hit_ratio, "capacity_blocks": pick.capacity_blocks,
            "capacity_bytes": pick.capacity_bytes, "settings": settings, "how": how, "command": pick.command}


def _target_rung(advice: Advice, ctx: _Context, pick: Rung, target: float) -> Rung:
    """The smallest tier of `pick`'s kind that reaches `target` hit tokens: bisection between the largest size
    tried that does not and `pick`'s (the host tier; for ssd, the SSD tier below the same host tier). A smaller
    one is added to the ladder as `host-target` / `ssd-target`, before `pick`."""
    host, ssd = pick.detail["host_blocks"], (pick.detail["ssd_blocks"] if pick.rung == "ssd" else None)

    def hits(size: int) -> int:
        return _tier_run(ctx, size, None)[0].hit_tokens if ssd is None else _tier_run(ctx, host, size)[0].hit_tokens

    if ssd is None:
        tried = [h for (h, s) in ctx.tier_runs if s is None]
    else:
        tried = [s for (h, s) in ctx.tier_runs if h == host and s is not None]
    top = host if ssd is None else ssd
    below = [size for size in tried if size < top and hits(size) < target]
    size = smallest(lambda n: hits(n) >= target, max(below), top) if below else top
    if size == top:
        return pick
    name = "host-target" if ssd is None else "ssd-target"
    rung = _tier_rung(ctx, name, size if ssd is None else host, None if ssd is None else size, ctx.tier_gain)
    advice.rungs.insert(advice.rungs.index(pick), rung)
    return rung
