"""Batch regimes: a step's row count decides which calibrated parameters govern its route.

- ``single_row`` (B1): splitting the sequence is the only source of CTAs; length buckets.
- ``few_rows`` (2..7 rows): the merge/launch break-even of paper 4.4; FlashInfer unless the
  calibration measured the workqueue faster there.
- ``many_rows`` (8+ rows): the compact workqueue.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import MISSING, dataclass, fields

from pkv.policy.route import ROUTES

SINGLE_ROW = "single_row"
FEW_ROWS = "few_rows"
MANY_ROWS = "many_rows"
REGIMES = (SINGLE_ROW, FEW_ROWS, MANY_ROWS)
MANY_ROWS_FROM = 8  # the smallest batch of the many_rows regime


def regime_of(batch_size: int) -> str:
    """The regime of a step of ``batch_size`` rows."""
    if batch_size <= 1:
        return SINGLE_ROW
    return FEW_ROWS if batch_size < MANY_ROWS_FROM else MANY_ROWS


# A batch size of each regime, for probes and reports that need one.
REGIME_BATCH = {SINGLE_ROW: 1, FEW_ROWS: MANY_ROWS_FROM - 1, MANY_ROWS: MANY_ROWS_FROM}


class CalibrationError(ValueError):
    """A calibration mapping or file that cannot be used; the message names where, field and value."""


def is_int(value) -> bool:
    """An integer of Python or numpy, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A real number of Python or numpy, not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class RegimeParams:
    """What the calibration fixed for one regime."""

    route: str  # the route its steps take when the estimate agrees; "flashinfer" closes the regime
    num_splits: int  # PersistentKV's split count (the balanced rule's budget) in this regime
    min_context_tokens: int  # steps whose longest row is shorter stay on FlashInfer
    margin: float  # the estimated speedup over FlashInfer that the route needs
    # A skewed workqueue step (pkv.policy.choose, is_skewed) of this regime gives its rows splits by
    # the balanced rule with about this many tasks instead of the fixed split count; 0: never.
    skew_target_ctas: int = 0
    # An over-split workqueue step (pkv.policy.choose, is_over_split) of this regime takes that
    # balanced rule too; only with a skew budget.
    over_split_balanced: bool = False
    # A bucket step of this regime whose longest row is short for num_splits gives it fewer splits
    # of at least this many tiles each (pkv.policy.choose, bucket_split_count); 1: num_splits, down
    # to one tile a split, as the bucket planner cuts any row.
    bucket_tiles_per_split: int = 1

    def __post_init__(self):
        for name in ("num_splits", "min_context_tokens", "skew_target_ctas", "bucket_tiles_per_split"):
            value = getattr(self, name)
            if not is_int(value):
                raise CalibrationError(f"field {name}={value!r}: must be an integer")
            object.__setattr__(self, name, int(value))
        if not is_number(self.margin):
            raise CalibrationError(f"field margin={self.margin!r}: must be a number")
        object.__setattr__(self, "margin", float(self.margin))
        checks = (("route", self.route in ROUTES, f"one of {list(ROUTES)}"),
                  ("num_splits", self.num_splits >= 1, ">= 1"),
                  ("min_context_tokens", self.min_context_tokens >= 0, ">= 0"),
                  ("margin", math.isfinite(self.margin) and self.margin > 0, "finite and > 0"),
                  ("skew_target_ctas", self.skew_target_ctas >= 0, ">= 0"),
                  ("over_split_balanced", isinstance(self.over_split_balanced, bool), "true or false"),
                  ("bucket_tiles_per_split", self.bucket_tiles_per_split >= 1, ">= 1"))
        for name, ok, rule in checks:
            if not ok:
                raise CalibrationError(f"field {name}={getattr(self, name)!r}: must be {rule}")
        if self.over_split_balanced and not self.skew_target_ctas:
            raise CalibrationError("field over_split_balanced=True: needs a balanced budget, but skew_target_ctas=0")

    @classmethod
    def from_mapping(cls, d, where: str) -> "RegimeParams":
        known = [f.name for f in fields(cls)]
        if not hasattr(d, "items"):
            raise CalibrationError(f"{where}: expected a mapping with keys {known}, got {d!r}")
        unknown = sorted(set(d) - set(known))
        # The step rules' parameters may be left out (files written before they were per regime).
        missing = [f.name for f in fields(cls) if f.name not in d and f.default is MISSING]
        if unknown:
            raise CalibrationError(f"{where}: unknown key {unknown[0]!r} (value {d[unknown[0]]!r}); known keys: "
                                   f"{', '.join(known)}")
        if missing:
            raise CalibrationError(f"{where}: missing key(s) {', '.join(missing)}")
        try:
            return cls(**{k: d[k] for k in known if k in d})
        except CalibrationError as err:
            raise CalibrationError(f"{where}: {err}") from None
