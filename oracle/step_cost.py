"""The twin's step-cost model: the seconds one scheduler step takes, linear in what it computes.

    seconds = base_s + prefill_token_s * prefill tokens + decode_seq_s * decode sequences
              + context_token_s * context tokens (the tokens the step's requests attend over)

`StepCost.from_file` reads the four coefficients from a JSON object (`--step-cost FILE`); keys left out keep
their defaults. The defaults are assumptions, not measurements: a mid-size dense model (about 8B parameters,
16-bit weights) on one current data-centre GPU, with a fixed 8 ms per step (weights read once per step),
50 us per prefill token (20,000 prompt tokens/s), 50 us per decoding sequence and 20 ns per context token.
A figure simulated with them says what the scheduler and the cache do to the order and the overlap of the
work, not how fast a given GPU is: calibrate them on a measurement to read the seconds as seconds.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

from kmesh_trace.errors import KmeshTraceError

__all__ = ["StepCost"]


@dataclass(frozen=True)
class StepCost:
    base_s: float = 8e-3
    prefill_token_s: float = 5e-5
    decode_seq_s: float = 5e-5
    context_token_s: float = 2e-8
    source: str = "defaults (assumed: ~8B dense model, one data-centre GPU)"

    def seconds(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        return (self.base_s + self.prefill_token_s * prefill_tokens + self.decode_seq_s * decode_seqs
                + self.context_token_s * context_tokens)

    @classmethod
    def coefficients(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name != "source")

    @classmethod
    def from_dict(cls, obj: object, where: str) -> "StepCost":
        """The model of a JSON object's coefficients (seconds, finite, not negative); one sentence when not."""
        names = cls.coefficients()
        if not isinstance(obj, dict):
            raise KmeshTraceError(f"{where}: a step-cost file holds one JSON object with keys {', '.join(names)}.")
        unknown = sorted(set(obj) - set(names) - {"source", "fit"})
        if unknown:
            raise KmeshTraceError(f"{where}: unknown step-cost key {unknown[0]!r}; the keys are {', '.join(names)}.")
        values = {}
        for k in names:
            if k not in obj:
                continue
            v = obj[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise KmeshTraceError(f"{where}: {k} must be a finite number of seconds, not negative (got {v!r}).")
            values[k] = float(v)
        return cls(**values, source=str(obj.get("source") or where))

    @classmethod
    def from_file(cls, path: str | Path) -> "StepCost":
        p = Path(path)
        try:
            obj = json.loads(p.read_text())
        except OSError as e:
            raise KmeshTraceError(f"cannot read the step-cost file {p}: {e.strerror or e}.") from e
        except (ValueError, UnicodeDecodeError) as e:
            raise KmeshTraceError(f"{p} is not JSON ({e}); a step-cost file holds one JSON object.") from e
        return cls.from_dict(obj, str(p))
