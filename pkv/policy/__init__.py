"""The route policy: what each decode step runs, decided in one place.

- ``route``: StepRoute, the complete route of a step (engine, kernel family, bucket mode, split
  count and rule, merge), and the route vocabulary.
- ``regime``: the batch regimes (one row, 2..7 rows, 8+ rows) and their parameters.
- ``calibration``: the calibration record and its file.
- ``estimator``: the cost model T_r.
- ``fits``: the calibration's fits from timed steps.
- ``choose``: RoutePolicy.choose(step) -> RouteDecision, and the pinned route of an ablation.
- ``overrides``: a run's engine options applied to the calibration, once.
"""

from pkv.policy.calibration import Calibration, load_calibration, save_calibration
from pkv.policy.choose import PinnedRoutePolicy, RouteDecision, RoutePolicy, pinned_route
from pkv.policy.estimator import Estimator, RouteEstimate
from pkv.policy.regime import FEW_ROWS, MANY_ROWS, REGIMES, SINGLE_ROW, CalibrationError, RegimeParams, regime_of
from pkv.policy.route import (
    FLASHINFER_ROUTE,
    ROUTE_BUCKET,
    ROUTE_FLASHINFER,
    ROUTE_WORKQUEUE,
    ROUTES,
    KernelVariants,
    StepRoute,
)

__all__ = ["Calibration", "CalibrationError", "Estimator", "FEW_ROWS", "FLASHINFER_ROUTE", "KernelVariants",
           "MANY_ROWS", "PinnedRoutePolicy", "REGIMES", "ROUTES", "ROUTE_BUCKET", "ROUTE_FLASHINFER",
           "ROUTE_WORKQUEUE", "RegimeParams", "RouteDecision", "RouteEstimate", "RoutePolicy", "SINGLE_ROW",
           "StepRoute", "load_calibration", "pinned_route", "regime_of", "save_calibration"]
