"""Fits of the calibration: C_min and lambda from timed steps, each regime's operating point from
the split sweeps, the context gates and the routed group sizes.

Every fit here is a pure function of timings the calibrate rule (pkv.experiments.calibrate)
measured on the calibration seed; nothing here times anything.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pkv.policy.estimator import Estimator
from pkv.policy.route import StepRoute

# Range searched by fit_c_min: from a quarter CTA per SM (below any useful target) to 64
# CTAs per SM (above what one SM can keep resident for these kernels), step 0.25.
C_MIN_GRID = np.arange(1, 257) * 0.25


# --------------------------------------------------------------------------------------
# Fitting C_min and lambda from measured steps


class CostSample(NamedTuple):
    """One measured step: the route it ran, its StepBatch and its device time in us."""

    route: StepRoute
    step: object
    measured_us: float


@dataclass(frozen=True)
class CostFit:
    c_min: float
    lambda_us: float
    rms_rel_error: float  # sqrt(mean(((T_pred - T_meas) / T_meas)^2)) at the fitted constants
    num_samples: int


def _sample_terms(samples, estimator: Estimator):
    """Per-sample pieces of T_r that do not depend on C_min or lambda."""
    rows = []
    for i, raw in enumerate(samples):
        sample = CostSample(*raw)
        measured = float(sample.measured_us)
        if not (math.isfinite(measured) and measured > 0):
            raise ValueError(f"samples[{i}].measured_us={sample.measured_us!r}: must be finite and > 0")
        lens = np.asarray(sample.step.seq_lens).tolist()
        # measured_us is device time (CUDA events): no host planning term on this side either.
        rows.append((*estimator.device_terms(lens, sample.route), measured))
    if not rows:
        raise ValueError("need at least one measured sample to fit the cost model, got none")
    return np.array(rows, dtype=np.float64).T  # kv_us, ctas_per_sm, launches, fixed_us, measured


def _lambda_for(c_min: np.ndarray, terms) -> tuple[np.ndarray, np.ndarray]:
    """Best lambda >= 0 and the weighted squared error, for each C_min in c_min.

    Weights 1 / measured^2 make it a fit of relative error, so B1 and B8 steps, whose
    times differ by an order of magnitude, count alike. lambda has a closed form.
    """
    kv_us, ctas, launches, fixed_us, measured = terms
    weight = 1.0 / measured**2
    base = kv_us[None, :] * np.maximum(1.0, c_min[:, None] / ctas[None, :]) + fixed_us[None, :]
    resid = measured[None, :] - base
    lam = np.maximum(0.0, (weight * launches * resid).sum(axis=1) / (weight * launches**2).sum())
    err = (weight * (base + lam[:, None] * launches[None, :] - measured[None, :]) ** 2).sum(axis=1)
    return lam, err


def fit_c_min(samples: Iterable, estimator: Estimator, *, grid: Sequence[float] | None = None,
              refit_lambda: bool = True) -> CostFit:
    """Grid search of C_min over C_MIN_GRID (0.25 .. 64 CTAs/SM) with lambda refit per point.

    beta and the FlashInfer constants are taken from calib (beta is measured directly by a
    copy benchmark). C_min only shows in steps whose C_r is below it, so the samples must
    include under-occupied steps (B1 with few splits, FlashInfer at B1); where several grid
    points fit equally well the smallest is returned. With refit_lambda=False, lambda stays
    at calib.lambda_us.
    """
    calib = estimator.calib
    terms = _sample_terms(samples, estimator)
    c_grid = np.asarray(C_MIN_GRID if grid is None else grid, dtype=np.float64)
    if c_grid.ndim != 1 or c_grid.size == 0 or not np.all(np.isfinite(c_grid)) or c_grid.min() < 0:
        raise ValueError(f"grid: expected a non-empty list of finite C_min values >= 0, got {grid!r}")
    if refit_lambda:
        lam, err = _lambda_for(c_grid, terms)
    else:
        kv_us, ctas, launches, fixed_us, measured = terms
        lam = np.full(c_grid.size, calib.lambda_us)
        pred = kv_us * np.maximum(1.0, c_grid[:, None] / ctas) + fixed_us + calib.lambda_us * launches
        err = (((pred - measured) / measured) ** 2).sum(axis=1)
    # Flat stretches of err (C_min below every sample's C_r) are ties; relative tolerance
    # keeps float noise from picking an arbitrary point inside one.
    best = int(np.flatnonzero(err <= err.min() * (1 + 1e-9) + 1e-18)[0])
    num_samples = terms.shape[1]
    return CostFit(
        c_min=float(c_grid[best]), lambda_us=float(lam[best]),
        rms_rel_error=float(math.sqrt(err[best] / num_samples)), num_samples=num_samples,
    )


# --------------------------------------------------------------------------------------
# Fitting the context gates


def context_class(tokens: int) -> int:
    """The power of two at or below ``tokens`` (at least 1): steps are compared per class."""
    return 1 << (max(int(tokens), 1).bit_length() - 1)


@dataclass(frozen=True)
class GateFit:
    min_context_tokens: int
    classes: dict  # context class -> {"steps", "persistentkv_us", "flashinfer_us"} totals
    reason: str


def fit_context_gate(contexts: Sequence[int], persistentkv_us: Sequence[float], flashinfer_us: Sequence[float],
                     configured: int, tolerance: float = 0.0) -> GateFit:
    """A context gate (Calibration.min_context_tokens, or the gate of batches of 2..7 or 8+ rows)
    from steps of that batch regime timed on both routes.

    Steps are grouped by context class. A class holds when PersistentKV's device time is at most
    FlashInfer's times (1 + ``tolerance``): a tie within the spread of the measurement goes to
    the route with the cheaper host path. The gate opens at the shortest class from which every
    longer class measured holds; shorter contexts, measured or not, stay on FlashInfer. When the
    longest class measured does not hold, the gate moves past it (never below ``configured``).
    With no steps, ``configured`` stands.
    """
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"fit_context_gate: tolerance must be finite and >= 0, got {tolerance!r}")
    if not len(contexts) == len(persistentkv_us) == len(flashinfer_us):
        raise ValueError(f"fit_context_gate: {len(contexts)} contexts, {len(persistentkv_us)} PersistentKV "
                         f"and {len(flashinfer_us)} FlashInfer times; one of each per step")
    if not contexts:
        return GateFit(int(configured), {}, "no steps timed: configured gate kept")
    classes: dict[int, dict] = {}
    for tokens, pkv, fi in zip(contexts, persistentkv_us, flashinfer_us):
        totals = classes.setdefault(context_class(tokens), {"steps": 0, "persistentkv_us": 0.0, "flashinfer_us": 0.0})
        totals["steps"] += 1
        totals["persistentkv_us"] += float(pkv)
        totals["flashinfer_us"] += float(fi)
    ordered = sorted(classes)
    gate = None
    for cls in reversed(ordered):
        if classes[cls]["persistentkv_us"] > classes[cls]["flashinfer_us"] * (1.0 + tolerance):
            break
        gate = cls
    if gate is None:
        gate = max(int(configured), 2 * ordered[-1])
        margin = f" by more than {tolerance:.0%}" if tolerance else ""
        reason = f"FlashInfer faster{margin} in the longest class measured ({ordered[-1]} tokens)"
    else:
        band = f" (or within {tolerance:.0%})" if tolerance else ""
        reason = f"PersistentKV faster{band} in every class measured from {gate} to {ordered[-1]} tokens"
    return GateFit(int(gate), {int(k): classes[k] for k in ordered}, reason)


# --------------------------------------------------------------------------------------
# Fitting the operating points and the routed group sizes


# Split candidates whose summed device time lies within this fraction of the fastest are tied:
# repeated calibrations on one H200 and one commit ranked neighbouring counts (24 and 28 on B8)
# in either order, with the fastest ahead by about 1%. A tie goes to the fewest splits, which
# writes and merges the fewest partial states, so a repeated calibration resolves it the same way.
SPLIT_TIE_FRACTION = 0.01


@dataclass(frozen=True)
class SplitFit:
    num_splits: int
    at_edge: bool  # the fastest or the chosen count is the first or last candidate: one outside may do better
    fastest: int = 0  # the candidate with the least time, which a tie may have passed over
    tied: tuple = ()  # the candidates within tie_fraction of the fastest


def fit_split_count(device_us_by_splits: Mapping[int, float], tie_fraction: float = SPLIT_TIE_FRACTION) -> SplitFit:
    """A regime's split count: the fewest splits among the candidates whose device time, summed
    over the traces that fit it (one trace alone can rank two neighbouring counts by noise), is
    within ``tie_fraction`` of the least."""
    if not device_us_by_splits:
        raise ValueError("fit_split_count: no split candidate was timed")
    if not (math.isfinite(tie_fraction) and tie_fraction >= 0):
        raise ValueError(f"fit_split_count: tie_fraction must be finite and >= 0, got {tie_fraction!r}")
    fastest = min(device_us_by_splits, key=device_us_by_splits.get)
    limit = device_us_by_splits[fastest] * (1.0 + tie_fraction)
    tied = tuple(sorted(int(s) for s, us in device_us_by_splits.items() if us <= limit))
    best = tied[0]
    edges = (min(device_us_by_splits), max(device_us_by_splits))
    at_edge = len(device_us_by_splits) > 1 and (fastest in edges or best in edges)
    return SplitFit(best, at_edge, int(fastest), tied)


def fit_regime_route(persistentkv_us: float, flashinfer_us: float, candidate: str) -> tuple[str, float]:
    """(route, speedup) of a regime the calibration may close (batches of 2..7 rows, paper 4.4):
    its PersistentKV route where that route's summed device time beat FlashInfer's, else FlashInfer."""
    speedup = flashinfer_us / persistentkv_us
    return (candidate if speedup > 1.0 else "flashinfer"), speedup


def group_size_holds(records: Iterable[Mapping], tolerance: float) -> bool:
    """A probed group size is routed when PersistentKV's device time held (beat FlashInfer's, or
    came within the tolerance) on every probe of it."""
    return all(r["persistentkv_device_us_total"] <= r["flashinfer_device_us_total"] * (1.0 + tolerance)
               for r in records)
