"""Roofline-style route cost model (paper 3.5) and its calibration constants.

For route r on one decode step:

    T_r = KVBytes / beta * max(1, C_min / C_r) + L_r * lambda + MergeBytes_r / beta + Plan_r

Plan_r is the route's measured host planning per step (flashinfer_plan_us, persistentkv_plan_us):
on a GPU whose kernels take tens of microseconds it decides as many steps as the kernels do.
C_min and lambda are fitted to device times, so the fit leaves Plan_r out.

beta is measured streaming read bandwidth, C_r the decode CTAs per SM of the route's plan,
C_min the occupancy below which a step cannot reach bandwidth, L_r the route's launches and
lambda the cost of one launch. The constants are fitted per GPU; they are not hardware
invariants, and a GPU without a calibration should not trust the route policy.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import NamedTuple

import numpy as np

from pkv.pipeline.counters import (
    PARTIAL_STATE_BYTES,
    StepCounters,
    counters_for_buckets,
    counters_for_flashinfer,
    estimate_workqueue_counters,
)
from pkv.pipeline.schedule import SPLIT_KINDS, TILE_TOKENS, SplitPolicy, plan_buckets

ROUTE_FLASHINFER = "flashinfer"
ROUTE_BUCKET = "persistentkv_bucket"
ROUTE_WORKQUEUE = "persistentkv_workqueue"
ROUTES = (ROUTE_FLASHINFER, ROUTE_BUCKET, ROUTE_WORKQUEUE)
# Where batches of 2..7 rows may go: only FlashInfer and the workqueue serve several rows.
BOUNDARY_ROUTES = (ROUTE_FLASHINFER, ROUTE_WORKQUEUE)

CALIBRATION_SCHEMA = "pkv.calibration/1"

# Batches below this (and above 1) are the B4 boundary regime.
FULL_BATCH = 8


def is_boundary_batch(batch_size: int) -> bool:
    """Batches of 2..7 rows: the B4 boundary regime (paper 4.4)."""
    return 1 < batch_size < FULL_BATCH


# The Calibration field holding each batch regime's context gate, keyed by a batch size of the
# regime: B1, 2..7 rows, 8+ rows.
CONTEXT_GATE_FIELDS = {1: "min_context_tokens", FULL_BATCH - 1: "boundary_min_context_tokens",
                       FULL_BATCH: "workqueue_min_context_tokens"}


def context_gate_field(batch_size: int) -> str:
    """The Calibration field holding the context gate of this batch size's regime."""
    if batch_size <= 1:
        return CONTEXT_GATE_FIELDS[1]
    return CONTEXT_GATE_FIELDS[FULL_BATCH - 1 if is_boundary_batch(batch_size) else FULL_BATCH]


# Range searched by fit_c_min: from a quarter CTA per SM (below any useful target) to 64
# CTAs per SM (above what one SM can keep resident for these kernels), step 0.25.
C_MIN_GRID = np.arange(1, 257) * 0.25


class CalibrationError(ValueError):
    """A calibration mapping or file that cannot be used."""


@dataclass(frozen=True)
class Calibration:
    gpu: str
    num_sms: int
    beta_gbps: float
    lambda_us: float
    c_min: float
    # The context gate of each batch regime: steps whose longest row is shorter stay on FlashInfer.
    # min_context_tokens is the B1 (bucket) gate; batches of 2..7 and of 8+ rows have their own,
    # and None there means min_context_tokens (calibrations written before the per-regime fit).
    min_context_tokens: int = 16384
    boundary_min_context_tokens: int | None = None
    workqueue_min_context_tokens: int | None = None
    supported_group_sizes: tuple[int, ...] = (4,)
    b8_margin: float = 1.05
    b4_margin: float = 1.50
    bucket_num_splits: int = 32
    workqueue_num_splits: int = 20
    workqueue_split_kind: str = "fixed"
    # Batches of 2..7 rows (the B4 boundary): FlashInfer unless the calibrate rule measured the
    # workqueue at boundary_num_splits faster on the calibration seed's boundary steps.
    boundary_route: str = ROUTE_FLASHINFER
    boundary_num_splits: int = 32
    flashinfer_plan_us: float = 0.0
    persistentkv_plan_us: float = 0.0
    flashinfer_ctas_per_row_head: float = 1.0
    source: str = "config"

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            _check_type(f.name, value)
        object.__setattr__(self, "supported_group_sizes", tuple(int(g) for g in self.supported_group_sizes))
        for name in ("beta_gbps", "lambda_us", "c_min", "b8_margin", "b4_margin", "flashinfer_plan_us",
                     "persistentkv_plan_us", "flashinfer_ctas_per_row_head"):
            object.__setattr__(self, name, float(getattr(self, name)))
        checks = (
            ("gpu", bool(self.gpu), "a non-empty name"),
            ("num_sms", self.num_sms >= 1, ">= 1"),
            ("beta_gbps", math.isfinite(self.beta_gbps) and self.beta_gbps > 0, "finite and > 0"),
            ("lambda_us", math.isfinite(self.lambda_us) and self.lambda_us >= 0, "finite and >= 0"),
            ("c_min", math.isfinite(self.c_min) and self.c_min >= 0, "finite and >= 0"),
            ("min_context_tokens", self.min_context_tokens >= 0, ">= 0"),
            ("boundary_min_context_tokens",
             self.boundary_min_context_tokens is None or self.boundary_min_context_tokens >= 0, "null or >= 0"),
            ("workqueue_min_context_tokens",
             self.workqueue_min_context_tokens is None or self.workqueue_min_context_tokens >= 0, "null or >= 0"),
            ("supported_group_sizes", all(g >= 1 for g in self.supported_group_sizes), "group sizes >= 1"),
            ("b8_margin", math.isfinite(self.b8_margin) and self.b8_margin > 0, "finite and > 0"),
            ("b4_margin", math.isfinite(self.b4_margin) and self.b4_margin > 0, "finite and > 0"),
            ("bucket_num_splits", self.bucket_num_splits >= 1, ">= 1"),
            ("workqueue_num_splits", self.workqueue_num_splits >= 1, ">= 1"),
            ("workqueue_split_kind", self.workqueue_split_kind in SPLIT_KINDS, f"one of {SPLIT_KINDS}"),
            ("boundary_route", self.boundary_route in BOUNDARY_ROUTES, f"one of {BOUNDARY_ROUTES}"),
            ("boundary_num_splits", self.boundary_num_splits >= 1, ">= 1"),
            ("flashinfer_plan_us", math.isfinite(self.flashinfer_plan_us) and self.flashinfer_plan_us >= 0,
             "finite and >= 0"),
            ("persistentkv_plan_us", math.isfinite(self.persistentkv_plan_us) and self.persistentkv_plan_us >= 0,
             "finite and >= 0"),
            ("flashinfer_ctas_per_row_head",
             math.isfinite(self.flashinfer_ctas_per_row_head) and self.flashinfer_ctas_per_row_head > 0,
             "finite and > 0"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise CalibrationError(f"field {name}={getattr(self, name)!r}: must be {rule}")

    @classmethod
    def from_mapping(cls, d: Mapping, where: str) -> "Calibration":
        """Build from a YAML/JSON mapping; errors name `where`, the key and the value."""
        if not isinstance(d, Mapping):
            raise CalibrationError(f"{where}: expected a mapping of calibration fields, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        for key, value in d.items():
            if key not in known:
                raise CalibrationError(
                    f"{where}: unknown key {key!r} (value {value!r}); known keys: {', '.join(sorted(known))}"
                )
        required = [f.name for f in fields(cls) if f.default is MISSING]
        missing = [name for name in required if name not in d]
        if missing:
            raise CalibrationError(f"{where}: missing required key(s) {', '.join(missing)}")
        values = {}
        for key, value in d.items():
            # OmegaConf hands lists over as ListConfig; errors should still show a plain list.
            if isinstance(value, Sequence) and not isinstance(value, (str, list, tuple)):
                value = list(value)
            values[key] = value
        try:
            return cls(**values)
        except CalibrationError as err:
            raise CalibrationError(f"{where}: {err}") from None

    def context_gate(self, batch_size: int) -> int:
        """Tokens the longest row of a step of ``batch_size`` rows needs before PersistentKV is
        considered: the gate of its batch regime (B1, 2..7 rows, 8+ rows)."""
        gate = getattr(self, context_gate_field(batch_size))
        return self.min_context_tokens if gate is None else gate

    def to_json_dict(self) -> dict:
        out = asdict(self)
        out["supported_group_sizes"] = list(self.supported_group_sizes)
        return out


_FIELD_TYPES = {
    "gpu": str, "source": str, "workqueue_split_kind": str, "boundary_route": str,
    "num_sms": int, "min_context_tokens": int, "boundary_min_context_tokens": "int?",
    "workqueue_min_context_tokens": "int?", "bucket_num_splits": int, "workqueue_num_splits": int,
    "boundary_num_splits": int,
    "beta_gbps": float, "lambda_us": float, "c_min": float, "b8_margin": float, "b4_margin": float,
    "flashinfer_plan_us": float, "persistentkv_plan_us": float, "flashinfer_ctas_per_row_head": float,
    "supported_group_sizes": tuple,
}


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_type(name: str, value) -> None:
    kind = _FIELD_TYPES[name]
    if kind == "int?":
        ok = value is None or _is_int(value)
        wanted = "null or an integer"
    elif kind is str:
        ok = isinstance(value, str)
        wanted = "a string"
    elif kind is int:
        ok = _is_int(value)
        wanted = "an integer"
    elif kind is float:
        ok = _is_int(value) or (isinstance(value, (float, np.floating)))
        wanted = "a number"
    else:
        ok = isinstance(value, (tuple, list)) and len(value) > 0 and all(_is_int(v) for v in value)
        wanted = "a non-empty list of integers"
    if not ok:
        raise CalibrationError(f"field {name}={value!r}: must be {wanted}")


def load_calibration(path) -> Calibration:
    """Read a calibration JSON written by save_calibration."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CalibrationError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(record, dict) or record.get("schema") != CALIBRATION_SCHEMA:
        found = record.get("schema") if isinstance(record, dict) else type(record).__name__
        raise CalibrationError(f"{path}: field schema={found!r}: expected {CALIBRATION_SCHEMA!r}")
    if "calibration" not in record:
        raise CalibrationError(f"{path}: missing field 'calibration'")
    return Calibration.from_mapping(record["calibration"], where=f"{path}: calibration")


def save_calibration(path, calib: Calibration, provenance: Mapping) -> None:
    """Write the calibration JSON atomically (temp file in the same folder, then rename)."""
    path = Path(path)
    record = {"schema": CALIBRATION_SCHEMA, "calibration": calib.to_json_dict(), "provenance": dict(provenance)}
    text = json.dumps(record, indent=2, sort_keys=True, allow_nan=False) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# --------------------------------------------------------------------------------------
# Estimates


@dataclass(frozen=True)
class RouteEstimate:
    """T_r and the terms it is made of, all times in microseconds."""

    route: str
    num_splits: int  # PersistentKV split count the estimate assumed; 0 for FlashInfer
    kv_bytes: int
    ctas_per_sm: float
    occupancy_factor: float  # max(1, C_min / C_r)
    launches: int
    merge_bytes: int
    kv_us: float  # KVBytes / beta * occupancy_factor
    launch_us: float  # L_r * lambda
    merge_us: float  # MergeBytes_r / beta
    plan_us: float  # host planning charged to the route (its engine's measured plan call)
    total_us: float


def host_plan_us(route: str, calib: Calibration) -> float:
    """The measured host planning per step charged to a route."""
    return calib.flashinfer_plan_us if route == ROUTE_FLASHINFER else calib.persistentkv_plan_us


def _bytes_to_us(num_bytes: int, beta_gbps: float) -> float:
    # beta in GB/s = 1e3 bytes per microsecond
    return num_bytes / (beta_gbps * 1e3)


def workqueue_split_policy(calib: Calibration, num_splits: int | None = None) -> SplitPolicy:
    """The SplitPolicy whose plan the workqueue estimate describes; engines plan with it too."""
    splits = calib.workqueue_num_splits if num_splits is None else int(num_splits)
    return SplitPolicy(kind=calib.workqueue_split_kind, num_splits=splits, max_splits=max(64, splits))


def route_counters(
    route: str, step, calib: Calibration, *, num_kv_heads: int, group_size: int, head_dim: int,
    kv_dtype_bytes: int = 2, num_splits: int | None = None,
) -> tuple[StepCounters, int]:
    """Structural counters of a route's plan for this step, and the split count used."""
    if route == ROUTE_FLASHINFER:
        counters = counters_for_flashinfer(
            step, calib.num_sms, head_dim, kv_dtype_bytes, num_kv_heads=num_kv_heads,
            ctas_per_row_head=calib.flashinfer_ctas_per_row_head,
        )
        return counters, 0
    if route == ROUTE_BUCKET:
        splits = calib.bucket_num_splits if num_splits is None else int(num_splits)
        plan = plan_buckets(step, num_kv_heads, group_size, splits, mode="exact")
        return counters_for_buckets(plan, step, calib.num_sms, head_dim, kv_dtype_bytes), splits
    if route == ROUTE_WORKQUEUE:
        policy = workqueue_split_policy(calib, num_splits)
        counters = estimate_workqueue_counters(
            step, num_kv_heads, group_size, policy, calib.num_sms, head_dim, kv_dtype_bytes
        )
        return counters, policy.num_splits
    raise ValueError(f"route must be one of {ROUTES}, got {route!r}")


def _estimate_from_counters(
    route: str, counters: StepCounters, splits: int, calib: Calibration, c_min: float, lambda_us: float
) -> RouteEstimate:
    occupancy = max(1.0, c_min / counters.decode_ctas_per_sm)
    kv_us = _bytes_to_us(counters.useful_kv_bytes, calib.beta_gbps) * occupancy
    launch_us = counters.launches * lambda_us
    merge_us = _bytes_to_us(counters.merge_bytes, calib.beta_gbps)
    plan_us = host_plan_us(route, calib)
    return RouteEstimate(
        route=route, num_splits=splits, kv_bytes=counters.useful_kv_bytes,
        ctas_per_sm=counters.decode_ctas_per_sm, occupancy_factor=occupancy, launches=counters.launches,
        merge_bytes=counters.merge_bytes, kv_us=kv_us, launch_us=launch_us, merge_us=merge_us,
        plan_us=plan_us, total_us=kv_us + launch_us + merge_us + plan_us,
    )


def estimate_route_us(
    route: str, step, calib: Calibration, *, num_kv_heads: int, group_size: int, head_dim: int,
    kv_dtype_bytes: int = 2, num_splits: int | None = None,
) -> RouteEstimate:
    """Estimated step time of `route`; num_splits overrides the calibrated split count."""
    counters, splits = route_counters(
        route, step, calib, num_kv_heads=num_kv_heads, group_size=group_size, head_dim=head_dim,
        kv_dtype_bytes=kv_dtype_bytes, num_splits=num_splits,
    )
    return _estimate_from_counters(route, counters, splits, calib, calib.c_min, calib.lambda_us)


class RouteEstimator:
    """estimate_route_us(...).total_us for a fixed calibration and shape, cheap enough to run
    on every decode step.

    The route policy needs only the totals. Building plans and counter objects costs more
    than the decision is worth at B <= 64, so this recomputes the same counts from the row
    lengths as Python ints; tests hold it equal to estimate_route_us. Everything that does not
    depend on the step (split policies, per-route constants) is resolved once here: on a slow
    host each Python object built per step costs microseconds of wall time on every step,
    including the steps that end on FlashInfer.
    """

    def __init__(self, calib: Calibration, *, num_kv_heads: int, group_size: int, head_dim: int,
                 kv_dtype_bytes: int = 2):
        self.calib = calib
        self.hkv = int(num_kv_heads)
        self._us_per_token = self.hkv * int(head_dim) * 2 * int(kv_dtype_bytes) / (calib.beta_gbps * 1e3)
        self._us_per_slot = int(group_size) * (int(head_dim) + 2) * PARTIAL_STATE_BYTES / (calib.beta_gbps * 1e3)
        self._occupancy_ctas = calib.c_min * calib.num_sms
        self._policies: dict[int | None, SplitPolicy] = {}

    def _total(self, kv_us: float, ctas: int, launches: int, merged_slots: int) -> float:
        occupancy = max(1.0, self._occupancy_ctas / ctas)
        return kv_us * occupancy + launches * self.calib.lambda_us + merged_slots * self._us_per_slot

    def _workqueue_policy(self, num_splits: int | None) -> SplitPolicy:
        policy = self._policies.get(num_splits)
        if policy is None:
            policy = self._policies[num_splits] = workqueue_split_policy(self.calib, num_splits)
        return policy

    def totals_us(self, step, routes: Mapping[str, int | None]) -> dict[str, float]:
        """Estimated us for each route in `routes` (route -> split count, None = calibrated)."""
        return self.totals_for_lengths(np.asarray(step.seq_lens).tolist(), routes)

    def totals_for_lengths(self, lens: list[int], routes: Mapping[str, int | None]) -> dict[str, float]:
        """totals_us from the step's row lengths as a list of ints."""
        kv_us = sum(lens) * self._us_per_token
        hkv = self.hkv
        out = {}
        for route, num_splits in routes.items():
            if route == ROUTE_FLASHINFER:
                ctas = max(1, math.ceil(len(lens) * hkv * self.calib.flashinfer_ctas_per_row_head))
                total = self._total(kv_us, ctas, 1, 0)
            elif route == ROUTE_BUCKET:
                splits = self.calib.bucket_num_splits if num_splits is None else int(num_splits)
                ctas = launches = merged = 0
                for length, rows in Counter(lens).items():
                    s = min(splits, -(-length // TILE_TOKENS))
                    ctas += rows * hkv * s
                    launches += 1
                    if s > 1:
                        launches += 1
                        merged += rows * hkv * s
                total = self._total(kv_us, ctas, launches, merged)
            elif route == ROUTE_WORKQUEUE:
                total = self._workqueue_total(kv_us, lens, self._workqueue_policy(num_splits))
            else:
                raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
            out[route] = total + host_plan_us(route, self.calib)
        return out

    def _workqueue_total(self, kv_us: float, lens: list[int], policy: SplitPolicy) -> float:
        tiles = [-(-length // TILE_TOKENS) for length in lens]
        if policy.kind == "fixed":
            cap = policy.num_splits
            requested = [cap if cap < n else n for n in tiles]
        else:
            target = policy.target_ctas or len(tiles) * self.hkv * policy.num_splits
            per_task = max(policy.min_tiles_per_split, -(-sum(tiles) * self.hkv // target))
            requested = [min(max(-(-n // per_task), 1), policy.max_splits) for n in tiles]
        # Splits past ceil(n / ceil(n / s)) would own no tiles (schedule.nonempty_splits).
        splits = [-(-n // -(-n // s)) for n, s in zip(tiles, requested)]
        merged_rows = sum(k for k in splits if k > 1)
        return self._total(kv_us, self.hkv * sum(splits), 2 if merged_rows else 1, self.hkv * merged_rows)


# --------------------------------------------------------------------------------------
# Fitting C_min and lambda from measured steps


class CostSample(NamedTuple):
    """One measured step: route, StepBatch, measured time in us, optional split override."""

    route: str
    step: object
    measured_us: float
    num_splits: int | None = None


@dataclass(frozen=True)
class CostFit:
    c_min: float
    lambda_us: float
    rms_rel_error: float  # sqrt(mean(((T_pred - T_meas) / T_meas)^2)) at the fitted constants
    num_samples: int


def _sample_terms(samples, calib, num_kv_heads, group_size, head_dim, kv_dtype_bytes):
    """Per-sample pieces of T_r that do not depend on C_min or lambda."""
    rows = []
    for i, raw in enumerate(samples):
        sample = CostSample(*raw)
        measured = float(sample.measured_us)
        if not (math.isfinite(measured) and measured > 0):
            raise ValueError(f"samples[{i}].measured_us={sample.measured_us!r}: must be finite and > 0")
        counters, _ = route_counters(
            sample.route, sample.step, calib, num_kv_heads=num_kv_heads, group_size=group_size,
            head_dim=head_dim, kv_dtype_bytes=kv_dtype_bytes, num_splits=sample.num_splits,
        )
        # measured_us is device time (CUDA events): no host planning term on this side either.
        rows.append((
            _bytes_to_us(counters.useful_kv_bytes, calib.beta_gbps),
            counters.decode_ctas_per_sm,
            counters.launches,
            _bytes_to_us(counters.merge_bytes, calib.beta_gbps),
            measured,
        ))
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


def fit_lambda(
    samples: Iterable, calib: Calibration, *, num_kv_heads: int, group_size: int, head_dim: int,
    kv_dtype_bytes: int = 2, c_min: float | None = None,
) -> float:
    """Launch cost lambda (us) minimising relative squared error, C_min held fixed."""
    terms = _sample_terms(samples, calib, num_kv_heads, group_size, head_dim, kv_dtype_bytes)
    fixed_c_min = calib.c_min if c_min is None else float(c_min)
    lam, _ = _lambda_for(np.array([fixed_c_min]), terms)
    return float(lam[0])


def fit_c_min(
    samples: Iterable, calib: Calibration, *, num_kv_heads: int, group_size: int, head_dim: int,
    kv_dtype_bytes: int = 2, grid: Sequence[float] | None = None, refit_lambda: bool = True,
) -> CostFit:
    """Grid search of C_min over C_MIN_GRID (0.25 .. 64 CTAs/SM) with lambda refit per point.

    beta and the FlashInfer constants are taken from calib (beta is measured directly by a
    copy benchmark). C_min only shows in steps whose C_r is below it, so the samples must
    include under-occupied steps (B1 with few splits, FlashInfer at B1); where several grid
    points fit equally well the smallest is returned. With refit_lambda=False, lambda stays
    at calib.lambda_us.
    """
    terms = _sample_terms(samples, calib, num_kv_heads, group_size, head_dim, kv_dtype_bytes)
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
