"""The cost model T_r, its counts against the plans' structural counters, and the fits."""

import dataclasses

import numpy as np
import pytest

from pkv.pipeline.counters import counters_for_buckets, counters_for_workqueue
from pkv.pipeline.schedule import plan_buckets, plan_workqueue
from pkv.policy import FLASHINFER_ROUTE, Calibration, Estimator, StepRoute
from pkv.policy.fits import (
    CostSample,
    SplitFit,
    context_class,
    fit_c_min,
    fit_context_gate,
    fit_regime_route,
    fit_split_count,
    group_size_holds,
)
from policy_constants import PAPER, SHAPE

BUCKET32 = StepRoute("persistentkv_bucket", 32)
WORKQUEUE20 = StepRoute("persistentkv_workqueue", 20)


def estimator(calib=PAPER):
    return Estimator(calib, **SHAPE)


def test_flashinfer_b1_estimate_by_hand():
    n = 32768
    est = estimator().estimate([n], FLASHINFER_ROUTE)
    kv_bytes = n * 8 * 128 * 2 * 2
    ctas_per_sm = 8 / 28  # one CTA per (row, KV head): far below C_min = 4
    assert est.kv_bytes == kv_bytes
    assert est.occupancy_factor == pytest.approx(4 / ctas_per_sm)
    assert est.launches == 1 and est.merge_bytes == 0
    assert est.total_us == pytest.approx(kv_bytes / 331.2e3 * (4 / ctas_per_sm) + 8.19)
    assert est.num_splits == 0


def test_bucket_b1_estimate_by_hand():
    n = 32768
    est = estimator().estimate([n], BUCKET32)
    kv_bytes = n * 8 * 128 * 2 * 2
    merge_bytes = 8 * 32 * 4 * 130 * 4  # 256 slots
    assert est.num_splits == 32 and est.launches == 2
    assert est.ctas_per_sm == pytest.approx(256 / 28)
    assert est.occupancy_factor == 1.0
    assert est.merge_bytes == merge_bytes
    assert est.total_us == pytest.approx(kv_bytes / 331.2e3 + 2 * 8.19 + merge_bytes / 331.2e3)
    assert est.total_us == pytest.approx(est.kv_us + est.launch_us + est.merge_us + est.plan_us)


def test_split_count_and_plan_time():
    lens = [20000, 30000]
    calib = dataclasses.replace(PAPER, flashinfer_plan_us=12.5)
    wq4 = estimator(calib).estimate(lens, StepRoute("persistentkv_workqueue", 4))
    assert wq4.ctas_per_sm == pytest.approx(2 * 8 * 4 / 28)
    assert wq4.occupancy_factor == pytest.approx(4 / (64 / 28))
    assert estimator(calib).estimate(lens, FLASHINFER_ROUTE).plan_us == 12.5
    assert estimator(calib).estimate(lens, WORKQUEUE20).plan_us == 0.0


@pytest.mark.parametrize("kind", ["fixed", "balanced"])
def test_counts_equal_the_counters_of_the_built_plans(kind, make_step):
    """The estimator counts from lengths what pkv.pipeline.counters reads off a built plan."""
    calib = dataclasses.replace(PAPER, flashinfer_plan_us=7.0, flashinfer_ctas_per_row_head=1.5)
    est = estimator(calib)
    rng = np.random.default_rng(11)
    for _ in range(20):
        lens = rng.integers(1, 70000, size=int(rng.integers(1, 12)))
        lens[: int(rng.integers(0, lens.size))] = lens[0]  # repeated lengths share a bucket
        step = make_step(lens)
        splits = int(rng.integers(1, 40))
        bucket = StepRoute("persistentkv_bucket", splits)
        workqueue = StepRoute("persistentkv_workqueue", splits, kind)
        plans = ((bucket, counters_for_buckets(plan_buckets(step, 8, 4, splits, mode="exact"), step, 28, 128)),
                 (workqueue, counters_for_workqueue(plan_workqueue(step, 8, 4, workqueue.split_policy), step,
                                                    28, 128)))
        for route, counters in plans:
            lens_list = lens.tolist()
            estimate = est.estimate(lens_list, route)
            assert estimate.launches == counters.launches
            assert estimate.ctas_per_sm == pytest.approx(counters.decode_ctas_per_sm, rel=1e-12)
            assert estimate.merge_bytes == counters.merge_bytes
            assert estimate.kv_bytes == counters.useful_kv_bytes
            assert est.total_us(lens_list, route) == pytest.approx(estimate.total_us, rel=1e-12)


def test_unknown_route_is_refused():
    with pytest.raises(ValueError, match="StepRoute.name"):
        StepRoute("sdpa")
    with pytest.raises(ValueError, match="head_dim"):
        Estimator(PAPER, num_kv_heads=8, group_size=4, head_dim=0)


# ---------------------------------------------------------------- fitting C_min and lambda


def synthetic_samples(truth, make_step, rng=None, noise=0.0):
    """Measured times generated from known constants over routes, batches and split counts."""
    samples = []
    est = estimator(truth)
    for lens in ([8192], [32768], [65536], [16384, 40000, 9000, 30000], [8192 + 37 * i for i in range(8)]):
        step = make_step(lens)
        routes = [FLASHINFER_ROUTE]
        routes += [StepRoute("persistentkv_bucket", s) for s in (1, 2, 4, 8, 16, 32)]
        routes += [StepRoute("persistentkv_workqueue", s) for s in (1, 2, 4, 20)]
        for route in routes:
            t = est.total_us(lens, route)
            if noise:
                t *= 1.0 + noise * rng.standard_normal()
            samples.append(CostSample(route, step, t))
    return samples


def test_fit_recovers_known_constants(make_step):
    truth = dataclasses.replace(PAPER, c_min=4.0, lambda_us=8.19)
    samples = synthetic_samples(truth, make_step)
    start = estimator(dataclasses.replace(PAPER, c_min=1.0, lambda_us=0.0))
    fit = fit_c_min(samples, start)
    assert fit.c_min == 4.0
    assert fit.lambda_us == pytest.approx(8.19, rel=1e-9)
    assert fit.rms_rel_error < 1e-12
    assert fit.num_samples == len(samples)


def test_fit_recovers_other_constants_under_noise(make_step):
    truth = Calibration.from_mapping({"gpu": "h200", "num_sms": 132, "beta_gbps": 4256.0, "lambda_us": 4.5,
                                      "c_min": 6.0}, "truth")
    samples = synthetic_samples(truth, make_step, np.random.default_rng(20260622), noise=0.01)
    fit = fit_c_min(samples, estimator(dataclasses.replace(truth, c_min=1.0, lambda_us=20.0)))
    assert abs(fit.c_min - 6.0) <= 0.5
    assert fit.lambda_us == pytest.approx(4.5, rel=0.1)
    assert 0.002 < fit.rms_rel_error < 0.03


def test_fit_with_lambda_held_fixed(make_step):
    truth = dataclasses.replace(PAPER, c_min=2.75)
    fit = fit_c_min(synthetic_samples(truth, make_step), estimator(truth), refit_lambda=False)
    assert fit.c_min == 2.75 and fit.lambda_us == truth.lambda_us


def test_fit_rejects_bad_samples(make_step):
    with pytest.raises(ValueError, match="at least one"):
        fit_c_min([], estimator())
    with pytest.raises(ValueError, match=r"samples\[0\]\.measured_us=-1\.0"):
        fit_c_min([(FLASHINFER_ROUTE, make_step([100]), -1.0)], estimator())
    with pytest.raises(ValueError, match="grid"):
        fit_c_min([(FLASHINFER_ROUTE, make_step([100]), 5.0)], estimator(), grid=[])


# ---------------------------------------------------------------- operating points and gates


def test_split_count_fit_sums_and_flags_the_edge():
    assert fit_split_count({16: 10.0, 24: 9.0, 32: 9.5}) == SplitFit(24, False, 24, (24,))
    assert fit_split_count({16: 10.0, 24: 9.0, 32: 8.0}) == SplitFit(32, True, 32, (32,))
    assert fit_split_count({24: 1.0}) == SplitFit(24, False, 24, (24,))


def test_split_counts_within_noise_resolve_to_the_fewest_splits_whatever_their_order():
    # Two calibrations of one GPU that rank 24 and 28 in either order, 0.6% apart: the same pick.
    first = fit_split_count({20: 103.0, 24: 100.6, 28: 100.0, 32: 101.8})
    second = fit_split_count({20: 103.1, 24: 100.0, 28: 100.5, 32: 101.5})
    assert first.num_splits == second.num_splits == 24
    assert (first.fastest, first.tied) == (28, (24, 28)) and second.tied == (24, 28)
    # A real gap (2%) is not a tie; a zero tolerance takes the fastest as before.
    assert fit_split_count({24: 102.0, 28: 100.0, 32: 103.0}).num_splits == 28
    assert fit_split_count({24: 100.6, 28: 100.0, 32: 103.0}, tie_fraction=0.0).num_splits == 28
    with pytest.raises(ValueError, match="tie_fraction"):
        fit_split_count({24: 1.0}, tie_fraction=float("nan"))
    with pytest.raises(ValueError, match="no split candidate"):
        fit_split_count({})


def test_a_tie_goes_to_the_configured_count_where_it_is_tied_so_a_flat_optimum_decides_alike():
    """The H100 calibration and its repeat of one commit (dd7a23e; FlashInfer over PersistentKV per
    count, as summed device-time ratios): the fewest within 1% of the fastest took 24, then 32, at
    B2-7, since 24 sat on the band's edge; the configured 32 is tied in both and taken in both."""
    runs = ({16: 0.988, 20: 0.990, 24: 0.995, 28: 0.990, 32: 1.003, 36: 1.004, 40: 1.002, 44: 0.997, 48: 1.001},
            {16: 0.990, 20: 0.995, 24: 0.998, 28: 0.995, 32: 1.008, 36: 1.008, 40: 1.005, 44: 1.000, 48: 1.004})
    summed = [{s: 1000.0 / ratio for s, ratio in run.items()} for run in runs]
    assert [fit_split_count(run).num_splits for run in summed] == [24, 32]
    fits = [fit_split_count(run, preferred=32) for run in summed]
    assert [f.num_splits for f in fits] == [32, 32] and fits[0].preferred == 32 and fits[0].fastest == 36
    # Outside the band the preference does nothing: the fastest's band decides, fewest first.
    assert fit_split_count({24: 100.0, 28: 100.5, 32: 103.0}, preferred=32).num_splits == 24
    assert fit_split_count({24: 100.6, 28: 100.0}, preferred=20).num_splits == 24  # not a candidate
    assert fit_split_count({24: 100.6, 28: 100.0}, preferred=28) == SplitFit(28, True, 28, (24, 28), 28)


def test_regime_route_fit_needs_a_device_time_win():
    fit = fit_regime_route([45.0, 45.0], [50.0, 50.0], "persistentkv_workqueue")
    assert fit.route == "persistentkv_workqueue" and fit.gain.gain == pytest.approx(100 / 90)
    assert fit_regime_route([50.0, 50.0], [50.0, 50.0], "persistentkv_workqueue").route == "flashinfer"


def test_a_device_tie_goes_to_the_route_whose_host_plan_is_at_most_half_the_default():
    tie = ([50.0, 80.0], [50.0, 80.0])
    wq = "persistentkv_workqueue"
    fit = fit_regime_route(*tie, wq, candidate_plan_us=43.0, default_plan_us=436.0)
    assert fit.route == wq and "host plan (43.0 us) at most 0.5 of flashinfer's (436.0 us)" in fit.basis
    # Half exactly is enough; more is not, nor plan times that were not measured.
    assert fit_regime_route(*tie, wq, candidate_plan_us=50.0, default_plan_us=100.0).route == wq
    assert fit_regime_route(*tie, wq, candidate_plan_us=50.1, default_plan_us=100.0).route == "flashinfer"
    assert fit_regime_route(*tie, wq, candidate_plan_us=43.0).route == "flashinfer"
    # Outside the band the device decides whatever the host: FlashInfer faster by more than the band
    # stays on FlashInfer, and one step (no band) takes the default.
    slower = fit_regime_route([55.0, 88.0], [50.0, 80.0], wq, candidate_plan_us=43.0, default_plan_us=436.0)
    assert slower.route == "flashinfer" and "flashinfer faster" in slower.basis
    one = fit_regime_route([50.0], [50.0], wq, candidate_plan_us=43.0, default_plan_us=436.0)
    assert one.route == "flashinfer" and "fewer than 2 steps" in one.basis


def test_group_size_holds_on_every_probe_within_the_tolerance():
    # 0.995x and 1.11x of FlashInfer: both clear 1 / 1.02 by the 1% floor of the noise band.
    records = [{"persistentkv_device_us_total": 100.5, "flashinfer_device_us_total": 100.0},
               {"persistentkv_device_us_total": 90.0, "flashinfer_device_us_total": 100.0}]
    assert group_size_holds(records, 0.02) and not group_size_holds(records, 0.0)
    assert not group_size_holds(records, 0.015)  # 0.995 x 0.99 falls short of 1 / 1.015


def test_a_group_probe_whose_interval_straddles_the_margin_is_a_tie_and_stays_closed():
    # 0.977x and 0.982x of FlashInfer against a 2% tolerance (0.980x): the two calibrations of one
    # H100 that opened and closed G = 1 on them. With their intervals (0.5%) both straddle the margin.
    margin_of = lambda gain, half: [{"persistentkv_device_us_total": 100.0, "flashinfer_device_us_total": 100.0 * gain,
                                     "interval_half_width": half}]
    assert not group_size_holds(margin_of(0.977, 0.005), 0.02)
    assert not group_size_holds(margin_of(0.982, 0.005), 0.02)
    # The calibration and repeat of one H100 at a later commit: 0.972x and 0.990x, intervals of
    # 0.5%, 1.8% apart. The interval clears the margin at 0.990x; the 1% floor does not, so both close.
    assert not group_size_holds(margin_of(0.972, 0.004), 0.02)
    assert not group_size_holds(margin_of(0.990, 0.005), 0.02)
    assert not group_size_holds(margin_of(0.982, 0.0), 0.02)  # a record without an interval: the floor alone
    assert group_size_holds(margin_of(0.995, 0.0), 0.02)
    assert group_size_holds(margin_of(1.10, 0.02), 0.02)  # clears the margin by more than its interval
    assert not group_size_holds(margin_of(1.10, None), 0.02)  # one step: no interval, no evidence


def test_context_gate_opens_where_persistentkv_wins_every_longer_class():
    assert [context_class(n) for n in (1, 8191, 8192, 8200, 16383)] == [1, 4096, 8192, 8192, 8192]
    # wins at 8K and 16K (class totals, not single steps: one 8K step loses, the class wins)
    fit = fit_context_gate([8200, 8300, 17000], [13.0, 9.0, 20.0], [12.0, 12.0, 25.0], configured=16384)
    assert fit.min_context_tokens == 8192 and fit.classes[8192]["steps"] == 2
    # a loss at 8K keeps 8K gated; the gate opens at 16K
    assert fit_context_gate([8200, 17000], [13.0, 20.0], [12.0, 25.0], 4096).min_context_tokens == 16384
    # a loss in the longest class moves the gate past it, never below the configured gate
    assert fit_context_gate([8200, 17000], [10.0, 26.0], [12.0, 25.0], 4096).min_context_tokens == 32768
    assert fit_context_gate([8200, 17000], [10.0, 26.0], [12.0, 25.0], 65536).min_context_tokens == 65536
    assert fit_context_gate([], [], [], 16384).min_context_tokens == 16384
    with pytest.raises(ValueError, match="one of each per step"):
        fit_context_gate([8200], [1.0], [], 16384)


def test_context_gate_tolerance_lets_a_tie_hold():
    # 8K: PersistentKV 1.5% slower; 16K: faster.
    args = ([8200, 17000], [10.15, 20.0], [10.0, 25.0], 4096)
    assert fit_context_gate(*args).min_context_tokens == 16384
    fit = fit_context_gate(*args, tolerance=0.02)
    assert fit.min_context_tokens == 8192 and "within 2%" in fit.reason
    lost = fit_context_gate([17000], [26.0], [25.0], 4096, tolerance=0.02)
    assert lost.min_context_tokens == 32768 and "by more than 2%" in lost.reason
    with pytest.raises(ValueError, match="tolerance"):
        fit_context_gate([17000], [26.0], [25.0], 4096, tolerance=-0.1)


@pytest.mark.parametrize("route", [BUCKET32, WORKQUEUE20, StepRoute("persistentkv_workqueue", 1),
                                   StepRoute("persistentkv_workqueue", 8, "balanced", target_ctas=264),
                                   StepRoute("persistentkv_workqueue", 4, "balanced")])
def test_an_array_of_lengths_counts_as_the_same_integers_as_a_list(route):
    est = estimator()
    rng = np.random.default_rng(5)
    for trial in range(40):
        batch = int(rng.integers(1, 300))
        lens = rng.choice(np.r_[1, 31, 32, 33, 64, 65, 4096, rng.integers(1, 70000, size=6)], size=batch)
        array = lens.astype(np.int32)
        assert est.counts(array, route) == est.counts(array.tolist(), route), (trial, batch)
        assert est.total_us(array, route) == est.total_us(array.tolist(), route)


def test_the_fixed_rules_table_grows_for_longer_rows_and_counts_as_the_loop_does():
    est = estimator()
    for lengths in ([100, 4000], [5000, 1], [1 << 20, 17], [3, 3, 3], [(1 << 20) + 1, 16 * 20 + 1, 16 * 20]):
        array = np.asarray(lengths, dtype=np.int32)
        assert est.counts(array, WORKQUEUE20) == est.counts(list(lengths), WORKQUEUE20), lengths
    assert est._fixed_tables[20].shape[0] == 1 << 21  # covers the longest row seen, to the next power of two


def test_rows_past_the_tables_reach_are_counted_without_it(monkeypatch):
    from pkv.policy import estimator as est_module

    monkeypatch.setattr(est_module, "FIXED_TABLE_MAX_TOKENS", 1 << 13)
    est = estimator()
    lengths = [1 << 14, 100, 16 * 20]
    assert est.counts(np.asarray(lengths, dtype=np.int32), WORKQUEUE20) == est.counts(lengths, WORKQUEUE20)
    assert est._fixed_tables[20].shape[0] < 1 << 14  # not grown to the long row
