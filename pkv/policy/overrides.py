"""A run's engine options applied to its calibration, once per run.

Ablations change what the policy decides with (a fixed split count, an opened regime, a merge
kind); they do it here, before any engine is built, so every engine of the run and its policy read
the same calibration, and the result files record it (pkv.experiments.common).
"""

from __future__ import annotations

import dataclasses

from pkv.policy.calibration import Calibration
from pkv.policy.regime import FEW_ROWS, SINGLE_ROW
from pkv.policy.route import MERGE_LAUNCH, ROUTE_FLASHINFER, ROUTE_WORKQUEUE, SCHEDULES, KernelVariants


def apply_engine_options(calib: Calibration, *, num_splits: int | None = None, bucket_num_splits: int | None = None,
                         bucket_tiles_per_split: int | None = None, split_kind: str | None = None,
                         open_few_rows: bool = False) -> Calibration:
    """The calibration a run decides with.

    num_splits fixes every regime's split count, on every step (the uniform cap, the skew rule, the
    over-split rule and the short-row rule are lifted);
    bucket_num_splits then the single-row (bucket) one, on every step (its short-row rule lifted);
    bucket_tiles_per_split then sets the single-row short-row rule (pkv.policy.choose,
    bucket_split_count); split_kind the workqueue's split rule;
    open_few_rows routes batches of 2..7 rows by the estimate (on the workqueue) even where the
    calibration kept them on FlashInfer.
    """
    if num_splits is not None:
        calib = dataclasses.replace(calib.with_all_regimes(num_splits=int(num_splits), skew_target_ctas=0,
                                                           over_split_balanced=False, bucket_tiles_per_split=1),
                                    uniform_target_ctas=0)
    if bucket_num_splits is not None:
        calib = calib.with_regime(SINGLE_ROW, num_splits=int(bucket_num_splits), bucket_tiles_per_split=1)
    if bucket_tiles_per_split is not None:
        calib = calib.with_regime(SINGLE_ROW, bucket_tiles_per_split=int(bucket_tiles_per_split))
    if split_kind is not None:
        calib = dataclasses.replace(calib, workqueue_split_kind=str(split_kind))
    if open_few_rows and calib.few_rows.route == ROUTE_FLASHINFER:
        calib = calib.with_regime(FEW_ROWS, route=ROUTE_WORKQUEUE)
    return calib


def kernel_variants(schedule: str = "workqueue", merge: str = MERGE_LAUNCH) -> KernelVariants:
    """The variants of a run: the bucket mode its schedule names ("bucket_masked": one masked
    launch) and its merge kind."""
    if schedule not in SCHEDULES:
        raise ValueError(f"persistentkv schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    return KernelVariants(bucket_mode=SCHEDULES[schedule][1], merge=merge)
