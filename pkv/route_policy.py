"""Per-step route choice between FlashInfer and the PersistentKV schedules (paper 3.5).

Gates first (a group size the calibration did not open, then a short context: each batch regime has its own
context gate, fitted by the calibrate rule), then one PersistentKV candidate per
batch size: length buckets at batch 1, where splitting the sequence is the only source of
CTAs, and the compact workqueue at batch >= 2. The candidate is promoted only when the cost
model estimates it faster than FlashInfer by a no-regression margin. Batches 2..7 sit at
the merge/launch break-even point (paper 4.4): they stay on FlashInfer unless the calibration
measured the workqueue faster there (Calibration.boundary_route, at boundary_num_splits) or
allow_b4 is set.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from pkv.cost_model import (
    ROUTE_BUCKET,
    ROUTE_FLASHINFER,
    ROUTE_WORKQUEUE,
    FULL_BATCH,
    Calibration,
    RouteEstimator,
    is_boundary_batch,
)

@dataclass(frozen=True)
class RouteDecision:
    route: str
    num_splits: int  # PersistentKV split count of the chosen route; 0 for FlashInfer
    basis: str  # the gate that decided, or "estimate"
    estimates: Mapping[str, float]  # route -> estimated us; empty when a gate decided
    speedup: float = 0.0  # FlashInfer's estimate over the candidate's; 0 when a gate decided
    margin: float = 0.0  # the speedup the candidate needed

    @property
    def reason(self) -> str:
        # Built on demand: formatting it in choose() would cost every decode step.
        if self.basis != "estimate":
            return self.basis
        relation = ">=" if self.speedup >= self.margin else "<"
        return f"estimate {self.speedup:.3f}x {relation} margin {self.margin:.2f}x"


# Gate decisions carry no per-step data, so each is built once (with a read-only empty mapping:
# every step that a gate decides shares the same object).
_NO_ESTIMATES = MappingProxyType({})
_GATE_GROUP = RouteDecision(ROUTE_FLASHINFER, 0, "gate: G", _NO_ESTIMATES)
_GATE_CONTEXT = RouteDecision(ROUTE_FLASHINFER, 0, "gate: context", _NO_ESTIMATES)
_GATE_BOUNDARY = RouteDecision(ROUTE_FLASHINFER, 0, "B4 boundary", _NO_ESTIMATES)


class RoutePolicy:
    def __init__(self, calib: Calibration, *, num_kv_heads: int, group_size: int, head_dim: int,
                 allow_b4: bool = False, kv_dtype_bytes: int = 2):
        for name, value in (("num_kv_heads", num_kv_heads), ("group_size", group_size), ("head_dim", head_dim),
                            ("kv_dtype_bytes", kv_dtype_bytes)):
            if int(value) < 1:
                raise ValueError(f"RoutePolicy: {name} must be >= 1, got {value}")
        self.calib = calib
        self.num_kv_heads = int(num_kv_heads)
        self.group_size = int(group_size)
        self.head_dim = int(head_dim)
        self.kv_dtype_bytes = int(kv_dtype_bytes)
        self.allow_b4 = bool(allow_b4)
        self._group_supported = self.group_size in calib.supported_group_sizes
        self._boundary_open = self.allow_b4 or calib.boundary_route == ROUTE_WORKQUEUE
        # One context gate per batch regime, read once here: choose() runs on every decode step.
        self._gate_b1 = calib.context_gate(1)
        self._gate_boundary = calib.context_gate(FULL_BATCH - 1)
        self._gate_full = calib.context_gate(FULL_BATCH)
        self._estimator = RouteEstimator(calib, num_kv_heads=self.num_kv_heads, group_size=self.group_size,
                                         head_dim=self.head_dim, kv_dtype_bytes=self.kv_dtype_bytes)

    def candidate(self, batch_size: int) -> tuple[str, int]:
        """The PersistentKV route and split count considered for a batch of this size."""
        if batch_size == 1:
            return ROUTE_BUCKET, self.calib.bucket_num_splits
        if is_boundary_batch(batch_size):
            return ROUTE_WORKQUEUE, self.calib.boundary_num_splits
        return ROUTE_WORKQUEUE, self.calib.workqueue_num_splits

    def choose(self, step) -> RouteDecision:
        if not self._group_supported:
            return _GATE_GROUP
        lens = np.asarray(step.seq_lens).tolist()
        batch = len(lens)
        if batch == 0:
            raise ValueError("RoutePolicy.choose: StepBatch.seq_lens is empty; a decode step needs a row")
        boundary = is_boundary_batch(batch)
        gate = self._gate_b1 if batch == 1 else self._gate_boundary if boundary else self._gate_full
        if max(lens) < gate:
            return _GATE_CONTEXT
        if boundary and not self._boundary_open:
            return _GATE_BOUNDARY

        route, splits = self.candidate(batch)
        estimates = self._estimator.totals_for_lengths(lens, {ROUTE_FLASHINFER: None, route: splits})
        speedup = estimates[ROUTE_FLASHINFER] / estimates[route]
        margin = self.calib.b4_margin if boundary else self.calib.b8_margin
        chosen = (route, splits) if speedup >= margin else (ROUTE_FLASHINFER, 0)
        return RouteDecision(*chosen, "estimate", estimates, speedup, margin)
