"""`simulate --calibrate CAPTURE`: the twin's step-cost model fitted to a capture's scheduler steps.

A capture's `steps` table holds, per scheduler step, what it computed (prefill tokens, decoding requests,
context tokens) and how long it took (`finish_ns - start_ns`). `fit_step_cost` fits the linear model of
`kmesh_trace.oracle.step_cost.StepCost` to them by least squares with coefficients kept non-negative (a
column whose coefficient would be negative is dropped and the rest refitted), on four steps in five; the
fifth (every step k with k % 5 == 4, in step order) is held out and the fit is judged there: the median
and mean relative error of a step's predicted duration, and the error of the held-out steps' total time
(what throughput reads).
"""

from __future__ import annotations

import numpy as np

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.oracle.step_cost import StepCost

__all__ = ["fit_step_cost", "MIN_STEPS", "HELD_OUT_EVERY"]

#: Steps a capture needs for a fit (the held-out fifth included).
MIN_STEPS = 20
HELD_OUT_EVERY = 5
_FEATURES = ("num_prefill_tokens", "num_decode_requests", "num_context_tokens")


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: the most negative one is fixed at zero and the rest refitted."""
    keep = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while keep:
        sol, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (sol >= 0).all():
            coef[keep] = sol
            break
        del keep[int(np.argmin(sol))]
    return coef


def _errors(pred: np.ndarray, y: np.ndarray) -> dict:
    rel = np.abs(pred - y) / np.maximum(y, 1e-12)
    total = float(y.sum())
    return {"num_steps": int(y.size), "median_rel_error": float(np.median(rel)), "mean_rel_error": float(rel.mean()),
            "total_time_rel_error": float(abs(pred.sum() - total) / total) if total > 0 else None}


def fit_step_cost(trace, where: str) -> tuple[StepCost, dict]:
    """(the fitted model, the fit's report: coefficients' basis, training and held-out errors) of a trace's steps."""
    import polars as pl

    steps = (trace.frame("steps").filter(pl.col("finish_ns").is_not_null()).sort("engine", "step"))
    if steps.height < MIN_STEPS:
        raise KmeshTraceError(f"{where} holds {steps.height} finished scheduler steps; --calibrate needs at least "
                              f"{MIN_STEPS} (a capture by kmesh-trace {'' if steps.height else 'with a steps table '}"
                              "of some load).")
    y = ((steps["finish_ns"] - steps["start_ns"]).to_numpy() / 1e9).astype(float)
    x = np.column_stack([np.ones(steps.height)] + [steps[c].to_numpy().astype(float) for c in _FEATURES])
    held = (np.arange(steps.height) % HELD_OUT_EVERY) == HELD_OUT_EVERY - 1
    coef = _nonneg_lstsq(x[~held], y[~held])
    cost = StepCost(*map(float, coef), source=f"calibrated on {where} ({int((~held).sum())} steps)")
    fit = {"input": where, "features": ["1", *_FEATURES], "train": _errors(x[~held] @ coef, y[~held]),
           "held_out": _errors(x[held] @ coef, y[held]), "mean_step_s": float(y.mean())}
    return cost, fit
