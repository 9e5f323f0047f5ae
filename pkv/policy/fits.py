"""Fits of the calibration: C_min and lambda from timed steps, each regime's operating point from
the split sweeps, the context gates and the routed group sizes, and the decisions that open a
PersistentKV route or rule over its default only where its measured gain clears the noise band of
the steps it was measured on (measured_gain).

Every fit here is a pure function of timings the calibrate rule (pkv.experiments.calibrate)
measured on the calibration seed; nothing here times anything.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import NamedTuple

import numpy as np

from pkv.policy.estimator import Estimator
from pkv.policy.route import ROUTE_FLASHINFER, StepRoute

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
# in either order, with the fastest ahead by about 1%. A tie goes to the count the GPU's conf file
# starts from where that count is tied, else to the fewest splits, which write and merge the
# fewest partial states. The fewest alone is not enough: on a flat optimum several counts sit near
# the band's edge, and an H100 calibration and its repeat at one commit took 16 then 32 at B1 and
# 24 then 32 at B2-7, each within 1% of the fastest in both runs (docs/performance.md, "The
# reference set of dd7a23e"). One count held fixed has one edge to cross, not several.
SPLIT_TIE_FRACTION = 0.01


@dataclass(frozen=True)
class SplitFit:
    num_splits: int
    at_edge: bool  # the fastest or the chosen count is the first or last candidate: one outside may do better
    fastest: int = 0  # the candidate with the least time, which a tie may have passed over
    tied: tuple = ()  # the candidates within tie_fraction of the fastest
    preferred: int | None = None  # the count a tie goes to where it is tied (the configured one), if any


def fit_split_count(device_us_by_splits: Mapping[int, float], tie_fraction: float = SPLIT_TIE_FRACTION,
                    preferred: int | None = None) -> SplitFit:
    """A regime's split count among the candidates whose device time, summed over the traces that
    fit it (one trace alone can rank two neighbouring counts by noise), is within ``tie_fraction``
    of the least: ``preferred`` where it is one of them, else the fewest splits."""
    if not device_us_by_splits:
        raise ValueError("fit_split_count: no split candidate was timed")
    if not (math.isfinite(tie_fraction) and tie_fraction >= 0):
        raise ValueError(f"fit_split_count: tie_fraction must be finite and >= 0, got {tie_fraction!r}")
    fastest = min(device_us_by_splits, key=device_us_by_splits.get)
    limit = device_us_by_splits[fastest] * (1.0 + tie_fraction)
    tied = tuple(sorted(int(s) for s, us in device_us_by_splits.items() if us <= limit))
    best = preferred if preferred in tied else tied[0]
    edges = (min(device_us_by_splits), max(device_us_by_splits))
    at_edge = len(device_us_by_splits) > 1 and (fastest in edges or best in edges)
    return SplitFit(int(best), at_edge, int(fastest), tied, preferred)


# --------------------------------------------------------------------------------------
# Route decisions: a measured gain against its noise band


# The least noise band of a decision that opens a PersistentKV route (or rule) over its default. The
# spread of the paired steps (measured_gain) is the noise inside one calibration; what moves
# between two calibrations of one GPU and commit (clocks, where the page pool lies) shows in no
# single run, and repeated H200 calibrations moved a whole trace's ratio by about 1% (the same
# observation as SPLIT_TIE_FRACTION).
ROUTE_NOISE_FLOOR = SPLIT_TIE_FRACTION
# The gain's interval is two-sided 95% (_t975, Student's t at 0.975): the band is its half-width
# where that is wider than the floor.
# What a regime the calibration may close takes when its measurement does not clear the band (an
# exact tie included): FlashInfer, the route paper 4.4 keeps batches of 2..7 rows on and the one
# every conf/gpu file starts from, so a decision inside the noise comes out the same every run.
REGIME_ROUTE_DEFAULT = ROUTE_FLASHINFER

# Student's t at 0.975 for 1..9 degrees of freedom; from 10 on, the Cornish-Fisher expansion about
# the normal quantile is within 0.003 of it (the calibration's 64-step traces have 63).
_T975_SMALL = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262)


def _t975(df: int) -> float:
    if df < 1:
        raise ValueError(f"_t975: needs at least 1 degree of freedom, got {df}")
    if df <= len(_T975_SMALL):
        return _T975_SMALL[df - 1]
    z = NormalDist().inv_cdf(0.975)
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class GainFit:
    """A candidate's measured gain over a baseline on paired steps, and the band it must clear."""

    gain: float  # summed baseline device time over the candidate's: above 1, the candidate is faster
    noise_band: float  # the gain must exceed 1 + noise_band
    half_width: float  # relative half-width of the gain's interval from the steps' spread (inf below 2 steps)
    steps: int

    @property
    def required(self) -> float:
        return 1.0 + self.noise_band

    @property
    def clears(self) -> bool:
        """Whether the candidate is faster by more than the noise: a gain at the band's edge does not."""
        return self.gain > self.required

    @property
    def within_band(self) -> bool:
        """Whether the gain lies inside the band either way (a tie): neither route is measurably
        faster. False below 2 steps, where the band could not be measured."""
        return self.steps >= 2 and not self.clears and self.gain > 1.0 / self.required

    def verdict(self, candidate: str, default: str) -> str:
        """Why the decision between ``candidate`` and ``default`` came out as it did."""
        band = f"the noise band ({self.noise_band:.1%})" if math.isfinite(self.noise_band) else "the noise band"
        if self.clears:
            return f"{candidate} faster by more than {band}"
        if self.steps < 2:
            return f"fewer than 2 steps, so the noise cannot be measured: {default}"
        if self.within_band:
            return f"within {band}: {default}"
        return f"{default} faster by more than {band}"

    def record(self) -> dict:
        """The fields a calibration records for the decision this gain made."""
        # JSON has no inf or NaN: a band that could not be measured (fewer than 2 steps) is null.
        return {"measured_margin": _finite(self.gain), "noise_band": _finite(self.noise_band),
                "required_margin": _finite(self.required), "interval_half_width": _finite(self.half_width),
                "steps": self.steps}


def _finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def measured_gain(candidate_us: Sequence[float], baseline_us: Sequence[float], *,
                  floor: float = ROUTE_NOISE_FLOOR) -> GainFit:
    """The gain sum(baseline) / sum(candidate) of steps timed on both (paired in order), and its
    noise band: the larger of ``floor`` and the relative half-width of the gain's two-sided 95%
    interval. The interval is the ratio estimator's over the steps: each step's median of several
    repetitions is one paired measurement, so the residuals baseline_i - gain x candidate_i carry
    the repetitions' noise and the steps' own variation. With fewer than 2 steps the spread cannot
    be measured and the band is infinite: the decision takes its default."""
    if len(candidate_us) != len(baseline_us):
        raise ValueError(f"measured_gain: {len(candidate_us)} candidate and {len(baseline_us)} baseline times; "
                         f"one of each per step")
    if not (math.isfinite(floor) and floor >= 0):
        raise ValueError(f"measured_gain: floor must be finite and >= 0, got {floor!r}")
    cand = np.asarray(candidate_us, dtype=np.float64)
    base = np.asarray(baseline_us, dtype=np.float64)
    if not (np.all(np.isfinite(cand)) and np.all(cand > 0) and np.all(np.isfinite(base)) and np.all(base > 0)):
        raise ValueError("measured_gain: every device time must be finite and > 0")
    n = int(cand.size)
    if n == 0:
        return GainFit(math.nan, math.inf, math.inf, 0)
    gain = float(base.sum() / cand.sum())
    if n < 2:
        return GainFit(gain, math.inf, math.inf, n)
    residuals = base - gain * cand
    # Var(gain) ~ sum(r^2) / (n (n - 1)) / mean(candidate)^2; relative to the gain, over mean(baseline).
    rel_se = float(math.sqrt(float((residuals**2).sum()) / (n * (n - 1))) / base.mean())
    half = _t975(n - 1) * rel_se
    return GainFit(gain, max(floor, half), half, n)


class RouteFit(NamedTuple):
    route: str
    gain: GainFit
    basis: str  # why: the gain cleared the band, lay inside it, or FlashInfer was faster


# A device-time tie goes to the candidate where its measured host planning per step is at most this
# fraction of the default's: the two routes then cost the same on the GPU and the candidate less on
# the host, on every step. Half, so that the two plan times' own spread between calibrations (about
# 30% on one H100 host) cannot reorder them; FlashInfer's plan() measured 8-10 times PersistentKV's.
HOST_TIE_FRACTION = 0.5


def fit_regime_route(persistentkv_us: Sequence[float], flashinfer_us: Sequence[float], candidate: str, *,
                     candidate_plan_us: float | None = None, default_plan_us: float | None = None) -> RouteFit:
    """The route of a regime the calibration may close (batches of 2..7 rows, paper 4.4), from its
    steps timed on its PersistentKV route and on FlashInfer (paired in order): that route where its
    measured gain clears the noise band (measured_gain). A gain inside the band is no evidence either
    way about device time, so a tie is decided by the host: the candidate where its measured plan
    per step is at most HOST_TIE_FRACTION of the default's (both given), else REGIME_ROUTE_DEFAULT;
    either way the same every time."""
    fit = measured_gain(persistentkv_us, flashinfer_us)
    if fit.clears:
        return RouteFit(candidate, fit, fit.verdict(candidate, REGIME_ROUTE_DEFAULT))
    cheaper = (candidate_plan_us is not None and default_plan_us is not None
               and candidate_plan_us <= HOST_TIE_FRACTION * default_plan_us)
    if fit.within_band and cheaper:
        return RouteFit(candidate, fit, f"within the noise band ({fit.noise_band:.1%}) of device time, and its "
                                        f"host plan ({candidate_plan_us:.1f} us) at most {HOST_TIE_FRACTION:g} of "
                                        f"{REGIME_ROUTE_DEFAULT}'s ({default_plan_us:.1f} us): {candidate}")
    return RouteFit(REGIME_ROUTE_DEFAULT, fit, fit.verdict(candidate, REGIME_ROUTE_DEFAULT))


def group_size_holds(records: Iterable[Mapping], tolerance: float) -> bool:
    """A probed group size is routed when PersistentKV's device time held (beat FlashInfer's, or
    came within the tolerance) on every probe of it, by more than the probe's own noise.

    A probe's gain (FlashInfer's summed time over PersistentKV's) must reach 1 / (1 + tolerance)
    with the lower end of its noise band: the larger of ``interval_half_width`` (relative, from
    measured_gain over the probe's steps) and ROUTE_NOISE_FLOOR, the band every route decision
    takes for what moves between two calibrations and shows in no single run (G = 1 on one H100
    measured 0.972x and 0.990x in the calibration and its repeat of one commit, each with an
    interval of 0.5%). A probe whose band straddles that margin is a tie, and a tie keeps the group
    on FlashInfer every time, so two calibrations of one machine do not open and close it on
    noise. A probe whose half-width could not be measured (None: fewer than 2 steps) holds nothing;
    a record without the field (written before it was kept) has the floor alone."""
    required = 1.0 / (1.0 + tolerance)
    for r in records:
        half = r.get("interval_half_width", 0.0)
        if half is None:
            return False
        half = max(half, ROUTE_NOISE_FLOOR)
        gain = r["flashinfer_device_us_total"] / r["persistentkv_device_us_total"]
        if gain * (1.0 - half) < required:
            return False
    return True
