"""The route policy's C++ form (csrc/route_policy.h): a RoutePolicy as the flat array C++ reads,
and the decisions C++ hands back as the policy's own RouteDecision and StepRoute.

An eager decode step decides its route, plans and packs it in one op call
(``torch.ops.pkv.adaptive_plan``), where the Python policy and the planner op cost several
microseconds more (docs/performance.md, "What 15 us of eager host time takes"). RoutePolicy stays
the specification: ``NativeRoutePolicy.choose`` gives the same decisions and the same estimates,
bit for bit, and tests hold the two together on synthetic and recorded steps.
"""

from __future__ import annotations

import numpy as np
import torch

from pkv.policy.choose import RouteDecision, RoutePolicy
from pkv.policy.regime import REGIMES
from pkv.policy.route import FLASHINFER_ROUTE, ROUTE_BUCKET, ROUTE_FLASHINFER, ROUTE_WORKQUEUE, StepRoute

POLICY_VERSION = 2  # kPolicyVersion in csrc/route_policy.h
# RouteBasis codes (csrc/route_policy.h) as RouteDecision.basis reads them.
BASES = ("gate: G", "gate: context", "gate: regime", "estimate")
ESTIMATE = BASES.index("estimate")
# Route codes: FlashInfer, then csrc/step_plan.h's PlanRoute.
ROUTE_CODES = {ROUTE_FLASHINFER: -1, ROUTE_WORKQUEUE: 0, ROUTE_BUCKET: 1}
ROUTE_NAMES = {code: name for name, code in ROUTE_CODES.items()}


def _route_values(route: StepRoute | None, fallback_splits: int) -> list:
    """[route code, num_splits, balanced, target_ctas, max_splits, min_tiles_per_split]."""
    if route is None:
        return [ROUTE_CODES[ROUTE_FLASHINFER], fallback_splits, 0, 0, 1, 1]
    split = route.split_policy
    return [ROUTE_CODES[route.name], route.num_splits, int(split.kind == "balanced"), split.target_ctas,
            split.max_splits, split.min_tiles_per_split]


def policy_values(policy: RoutePolicy) -> list[float]:
    """The flat array of csrc/route_policy.h (kPolicyValues doubles) for ``policy``."""
    values = [POLICY_VERSION, int(policy.group_supported), int(policy.variants.bucket_mode == "exact"),
              *policy.estimator.cost_constants()]
    for regime in REGIMES:
        gate, candidate, margin, uniform_ctas, skew_route, over_split, bucket_tiles = policy.regime_rules(regime)
        splits = policy.calib.regime(regime).num_splits
        skew_ctas = skew_route.target_ctas if skew_route is not None else 0
        values += [gate, *_route_values(candidate, splits), margin, uniform_ctas, skew_ctas, int(over_split),
                   bucket_tiles]
    return [float(v) for v in values]


class NativeRoutePolicy:
    """A RoutePolicy decided in C++: its array (``values``, a float64 CPU tensor) and the routes its
    decisions name."""

    def __init__(self, policy: RoutePolicy, ops):
        if not isinstance(policy, RoutePolicy):
            raise TypeError(f"NativeRoutePolicy: needs a calibrated RoutePolicy, got {type(policy).__name__}")
        self.policy = policy
        self.ops = ops
        self.values = torch.tensor(policy_values(policy), dtype=torch.float64)
        self._routes: dict[tuple, StepRoute] = {}

    def route(self, choice) -> StepRoute:
        """The StepRoute a C++ choice takes (its ints: basis, route, candidate route, num_splits,
        balanced, target_ctas, ...); one object per distinct route, as RoutePolicy shares them."""
        key = tuple(choice[1:6])
        route = self._routes.get(key)
        if route is None:
            route = self._routes[key] = self._build_route(key)
        return route

    def _build_route(self, key: tuple) -> StepRoute:
        code, _, splits, balanced, target = key
        if code == ROUTE_CODES[ROUTE_FLASHINFER]:
            return FLASHINFER_ROUTE
        variants = self.policy.variants
        return StepRoute(ROUTE_NAMES[code], int(splits), "balanced" if balanced else "fixed", variants.bucket_mode,
                         variants.merge, int(target))

    def decision(self, choice, estimates) -> RouteDecision:
        """The RouteDecision of a C++ choice and its estimates, as RoutePolicy.choose builds it."""
        basis = int(choice[0])
        if basis != ESTIMATE:
            return RouteDecision(FLASHINFER_ROUTE, BASES[basis], {})
        flashinfer_us, candidate_us, speedup, margin = estimates
        candidate = self._build_route((choice[2], None, *choice[3:6]))
        return RouteDecision(self.route(choice), "estimate",
                             {ROUTE_FLASHINFER: flashinfer_us, candidate.name: candidate_us}, speedup, margin)

    def choose(self, step) -> RouteDecision:
        """RoutePolicy.choose through C++."""
        lens = torch.from_numpy(np.ascontiguousarray(step.seq_lens, dtype=np.int32))
        return self.decision(*self.ops.choose_route(lens, self.values))
