"""The calibrate rule's fits on hand-made timings (the CPU DAG runs them end to end), and the
calibration record they write: its two mapping forms and the errors of a bad one."""

from __future__ import annotations

import dataclasses
import json
import types

import numpy as np
import pytest

from pkv.experiments.calibrate import _GateProbes, _SplitSweep
from pkv.policy import Calibration, CalibrationError, RegimeParams, load_calibration, regime_of, save_calibration
from pkv.policy.calibration import LEGACY_SCHEMA, regime_field
from pkv.policy.choose import RuledRoutePolicy
from pkv.policy.regime import FEW_ROWS, MANY_ROWS, REGIME_BATCH, REGIMES, SINGLE_ROW
from pkv.policy.route import FLASHINFER_ROUTE
from pkv.shape import ModelShape


def _timed_one_by_one(trace, runs: dict) -> dict:
    """A fake _TimedTrace.timed from a fake trace's one-run methods (persistentkv(route),
    persistentkv_ruled(policy, fallback), flashinfer()), called in the runs' order."""
    timed = {}
    for key, run in runs.items():
        if isinstance(run, RuledRoutePolicy):
            timed[key] = trace.persistentkv_ruled(run.policy, run.fallback)
        elif run == FLASHINFER_ROUTE:
            timed[key] = trace.flashinfer()
        else:
            timed[key] = trace.persistentkv(run)
    return timed

HARDWARE = dict(gpu="fake", num_sms=4, beta_gbps=100.0, lambda_us=5.0, c_min=1.0)
START = Calibration(**HARDWARE,
                    single_row=RegimeParams("persistentkv_bucket", 32, 8192, 1.05),
                    few_rows=RegimeParams("flashinfer", 32, 8192, 1.50),
                    many_rows=RegimeParams("persistentkv_workqueue", 20, 8192, 1.05))


def _fitted(points: dict) -> Calibration:
    """START with the split counts of ``points`` (the sweep's split_points)."""
    calib = START
    for regime, params in points.items():
        calib = calib.with_regime(regime, **params)
    return calib


def _probes(gate_steps=None, performance_result=True, tolerance=0.0) -> _GateProbes:
    settings = types.SimpleNamespace(performance_result=performance_result)
    return _GateProbes(cfg=None, settings=settings, shape=None, fitted=START, gate_steps=gate_steps or {},
                       tolerance=tolerance)


@pytest.mark.parametrize("batch, regime", [(1, SINGLE_ROW), (2, FEW_ROWS), (7, FEW_ROWS), (8, MANY_ROWS),
                                           (64, MANY_ROWS)])
def test_each_batch_size_has_the_gate_of_its_regime(batch, regime):
    assert regime_of(batch) == regime
    assert regime_of(REGIME_BATCH[regime]) == regime
    assert regime_field(regime_of(batch), "min_context_tokens") == f"regimes.{regime}.min_context_tokens"
    assert START.regime(regime_of(batch)) is START.regime(regime)


def test_each_regime_gate_is_fitted_from_all_of_its_steps():
    sweep = {"source": "split sweep", "contexts": [70000, 70000], "persistentkv_us": [90.0, 90.0],
             "flashinfer_us": [100.0, 100.0]}
    short = {"source": "probe short", "contexts": [1100, 4200], "persistentkv_us": [12.0, 15.0],
             "flashinfer_us": [10.0, 18.0]}
    fits = _probes({MANY_ROWS: [sweep, short], SINGLE_ROW: [sweep]}).fit_context_gates(START)
    # PersistentKV wins at 4K and 64K, loses at 1K: the B8+ gate opens at 4K.
    b8 = fits["regimes.many_rows.min_context_tokens"]
    assert b8["regime"] == MANY_ROWS
    assert b8["fitted"] == 4096 and b8["applied"] is True
    assert b8["sources"] == ["split sweep", "probe short"] and set(b8["classes"]) == {"1024", "4096", "65536"}
    assert fits["regimes.single_row.min_context_tokens"]["fitted"] == 65536
    assert "regimes.few_rows.min_context_tokens" not in fits  # no steps timed there: the configured gate stands
    # 1K loses by 20%, past any tolerance; with 25% it holds too.
    wide = _probes({MANY_ROWS: [sweep, short]}, tolerance=0.25).fit_context_gates(START)
    assert wide["regimes.many_rows.min_context_tokens"]["fitted"] == 1024


def test_a_group_size_opens_only_where_persistentkv_wins_every_probe():
    probes = _probes()
    probes.group_totals = {
        1: [{"persistentkv_device_us_total": 90.0, "flashinfer_device_us_total": 100.0},
            {"persistentkv_device_us_total": 50.0, "flashinfer_device_us_total": 60.0}],
        8: [{"persistentkv_device_us_total": 90.0, "flashinfer_device_us_total": 100.0},
            {"persistentkv_device_us_total": 61.0, "flashinfer_device_us_total": 60.0}],
    }
    fit = probes.fit_group_sizes(START)
    assert fit == {"fitted": [1, 4], "applied": True, "tolerance": 0.0, "probed": [1, 8], "opened": [1]}
    assert _probes(performance_result=False).fit_group_sizes(START)["fitted"] == [4]
    # G = 8 lost one probe by 1.7%: inside a 2% tolerance, but not by the 1% noise floor, so a tie
    # that stays on FlashInfer; lost by 0.5%, it clears the floor too and opens.
    tolerant = _probes(tolerance=0.02)
    tolerant.group_totals = probes.group_totals
    assert tolerant.fit_group_sizes(START)["opened"] == [1]
    tolerant.group_totals = {**probes.group_totals,
                             8: [{"persistentkv_device_us_total": 90.0, "flashinfer_device_us_total": 100.0},
                                 {"persistentkv_device_us_total": 60.3, "flashinfer_device_us_total": 60.0}]}
    assert tolerant.fit_group_sizes(START)["opened"] == [1, 8]


def _timed(total_us, steps=4):
    """A trace timed on one route: ``steps`` steps of equal time adding up to ``total_us``."""
    step = types.SimpleNamespace(seq_lens=[70000])
    return types.SimpleNamespace(total_us=total_us,
                                 samples=[types.SimpleNamespace(step=step, measured_us=total_us / steps)] * steps)


def _swept(name, max_active, regime, totals, fi_total, route="persistentkv_workqueue"):
    timed = {s: _timed(us) for s, us in totals.items()}
    return {"name": name, "max_active": max_active, "route": route, "regime": regime, "steps": 4,
            "timed_by_splits": timed, "timed_fi": _timed(fi_total)}


def test_traces_of_one_operating_point_are_decided_by_their_summed_time():
    sweep = _SplitSweep(cfg=None, settings=types.SimpleNamespace(performance_result=True), shape=ModelShape(),
                        calib=START)
    sweep._swept = [
        # The ragged batch ranks 28 a hair ahead of 24; rows of one length separate them clearly.
        _swept("bimodal_b8", 8, MANY_ROWS, {24: 100.2, 28: 100.0, 32: 101.0}, 105.0),
        _swept("homogeneous_b8", 8, MANY_ROWS, {24: 200.0, 28: 204.0, 32: 203.0}, 201.0),
        _swept("bimodal_b4", 4, FEW_ROWS, {32: 90.0, 36: 88.0}, 89.0),
    ]
    points = sweep.split_points()
    assert points == {MANY_ROWS: {"num_splits": 24}, FEW_ROWS: {"num_splits": 36}}
    assert sweep.regime_routes(points, _fitted(points)) == {FEW_ROWS: {"route": "persistentkv_workqueue"}}
    assert sweep.records["homogeneous_b8"]["fitted_with"] == ["bimodal_b8", "homogeneous_b8"]
    assert sweep.records["bimodal_b8"]["selected_splits"] == 24
    assert sweep.records["bimodal_b8"]["fits"] == "regimes.many_rows.num_splits"
    assert sweep.records["bimodal_b4"]["fits"] == "regimes.few_rows.num_splits"
    route = sweep.records["bimodal_b4"]["regime_route"]
    assert route["fits"] == "regimes.few_rows.route" and route["fitted"] == "persistentkv_workqueue"
    assert route["speedup"] == pytest.approx(89.0 / 88.0)
    # Every step measured the same ratio: the band is the floor, which a 1.1% gain clears.
    assert route["measured_margin"] == pytest.approx(89.0 / 88.0) and route["noise_band"] == pytest.approx(0.01)
    assert route["default"] == "flashinfer" and route["num_splits"] == 36
    # Both sides' sums, kept with the decision: which one moved, where calibrations disagree.
    decision = sweep.decisions["regimes.few_rows.route"]
    assert decision["value"] == "persistentkv_workqueue"
    assert decision["candidate_device_us_total"] == pytest.approx(88.0)
    assert decision["default_device_us_total"] == pytest.approx(89.0)
    # A split count records the fastest candidate and those tied with it, the fewest taken.
    splits = sweep.decisions["regimes.many_rows.num_splits"]
    assert (splits["value"], splits["fastest"], splits["tied"], splits["measured_margin"]) == (24, 24, [24], 1.0)
    splits = sweep.decisions["regimes.few_rows.num_splits"]
    assert (splits["value"], splits["fastest"], splits["tied"]) == (36, 36, [36]) and splits["noise_band"] == 0.01
    # Each regime's steps at its fitted split count are the long end of its context gate.
    assert set(sweep.gate_steps(points, _fitted(points))) == {MANY_ROWS, FEW_ROWS}


def test_a_uniform_trace_fits_the_cap_in_ctas_and_only_below_the_regimes_split_count():
    """A batch of rows of one length fits uniform_target_ctas: its fastest split count (ties to the
    fewest) times its (row, KV head) pairs; 0 where that count is not below the regime's."""
    from pkv.config import ConfigError

    shape = types.SimpleNamespace(num_kv_heads=8)
    sweep = _SplitSweep(cfg=None, settings=types.SimpleNamespace(performance_result=True), shape=shape, calib=START)
    assert sweep.uniform_target_ctas({}) is None  # no uniform trace: the calibration keeps its own
    sweep._uniform = [_swept("homogeneous_b8", 8, MANY_ROWS, {2: 280.0, 4: 252.0, 6: 251.0, 8: 290.0, 24: 258.0},
                             255.0)]
    assert sweep.uniform_target_ctas({MANY_ROWS: {"num_splits": 24}}) == 4 * 8 * 8  # 6 ties 4 within 1%
    record = sweep.records["homogeneous_b8"]
    assert record["fits"] == "uniform_target_ctas" and record["selected_splits"] == 4
    assert record["uniform_target_ctas"] == {"fitted": 256, "regime_splits": 24, "applied": True}
    # The regime's own count is as fast: no cap (the regime's fitted count, else the calibration's).
    assert sweep.uniform_target_ctas({MANY_ROWS: {"num_splits": 4}}) == 0
    sweep.calib = START.with_regime(MANY_ROWS, num_splits=3)
    assert sweep.uniform_target_ctas({}) == 0
    # The uniform traces are fitted together, over the split counts they share.
    sweep._uniform.append(_swept("homogeneous_b8_other", 8, MANY_ROWS, {6: 100.0, 24: 80.0}, 99.0))
    assert sweep.uniform_target_ctas({MANY_ROWS: {"num_splits": 24}}) == 0  # 24 is the fastest of 6 and 24
    assert sweep.records["homogeneous_b8"]["fitted_with"] == ["homogeneous_b8", "homogeneous_b8_other"]
    sweep._uniform[1] = _swept("homogeneous_b8_other", 8, MANY_ROWS, {16: 100.0}, 99.0)
    with pytest.raises(ConfigError, match="share no split candidate"):
        sweep.uniform_target_ctas({})


def test_the_uniform_traces_steps_stay_out_of_c_min_and_the_plan_times(monkeypatch):
    """Only the cap is fitted from a uniform trace: its timed steps join neither the C_min fit nor
    the plan-time medians, so no other decision moves with it."""
    from pkv.experiments import calibrate

    class FakeTrace:
        timed = _timed_one_by_one

        def __init__(self, cfg, settings, shape, trace):
            self.kv_dtype_bytes, self.steps, self.name = 2, [], trace.family

        def persistentkv(self, route):
            return types.SimpleNamespace(samples=[(self.name, route.num_splits)], plan_us=[1.0], total_us=1.0)

        def flashinfer(self):
            self.flashinfer_paths = {"probed": [self.name]}  # the best-of engine's picks so far
            return types.SimpleNamespace(samples=[(self.name, "fi")], plan_us=[2.0], total_us=1.0)

    monkeypatch.setattr(calibrate, "_TimedTrace", FakeTrace)
    sweep = _SplitSweep(cfg=None, settings=types.SimpleNamespace(performance_result=True),
                        shape=types.SimpleNamespace(num_kv_heads=8), calib=START)
    for trace, fits in (("bimodal", "num_splits"), ("homogeneous", "uniform_target_ctas")):
        sweep.run(types.SimpleNamespace(trace=trace, max_active=8, route="workqueue", split_candidates=[4, 24],
                                        fits=fits, length_scale=1.0))
    assert sweep.samples == [("bimodal", 4), ("bimodal", 24), ("bimodal", "fi")]
    assert sweep.persistentkv_plan_us == [1.0, 1.0] and sweep.flashinfer_plan_us == [2.0]
    assert [t["name"] for t in sweep._swept] == ["bimodal_b8"] and [t["name"] for t in sweep._uniform] == [
        "homogeneous_b8"]
    # FlashInfer's path picks are the process's, every class so far: the last trace's record holds them.
    assert sweep.flashinfer_paths == {"probed": ["homogeneous"]}


def test_a_skewed_trace_fits_the_balanced_budget_on_its_skewed_steps_and_checks_it_on_over_split_ones(
        monkeypatch):
    """skew_target_ctas: the skewed steps of the trace (the ones the rule applies to) timed on the
    fixed rule at the regime's fitted split count and on the balanced rule at each budget; the
    fewest waves within 1% of the fastest, where they beat the fixed rule by more than 1%, else 0.
    over_split_balanced: the trace's over-split steps, timed in the same runs, where the budget
    beats the fixed rule on them too. Steps of neither kind are not timed; none of the timed
    steps joins C_min or the plan times."""
    from pkv.config import ConfigError
    from pkv.experiments import calibrate

    timed_routes = []
    skewed_us_by_waves = {1: 90.0, 2: 80.0, 3: 80.5, 4: 85.0}
    # Two steps of each kind: a decision needs at least two paired steps to measure their noise.
    skewed = [types.SimpleNamespace(step=i, batch_size=4, seq_lens=[9000, 100, 100, 100]) for i in (0, 3)]
    # Two long rows: neither skewed nor over-split (18,200 tokens >= 2 tiles x 20 splits x 4 rows).
    neither = types.SimpleNamespace(step=1, batch_size=4, seq_lens=[9000, 9000, 100, 100])
    over_split = [types.SimpleNamespace(step=i, batch_size=4, seq_lens=[500, 400, 300, 600]) for i in (2, 4)]

    def step_us(route, step):
        if step in over_split:
            return over_split_us[route.split_kind]
        return fixed_us if route.split_kind == "fixed" else skewed_us_by_waves[route.target_ctas // 132]

    class FakeTrace:
        timed = _timed_one_by_one

        def __init__(self, cfg, settings, shape, trace):
            self.kv_dtype_bytes = 2
            self.steps = [skewed[0], neither, over_split[0], skewed[1], over_split[1]]

        def _timed(self, us_of):
            samples = [types.SimpleNamespace(step=s, measured_us=us_of(s)) for s in self.steps]
            return types.SimpleNamespace(samples=samples, plan_us=[1.0], total_us=sum(x.measured_us for x in samples))

        def persistentkv(self, route):
            timed_routes.append((route.split_kind, route.num_splits, route.target_ctas, len(self.steps)))
            return self._timed(lambda s: step_us(route, s))

        def flashinfer(self):
            return self._timed(lambda s: 10.0 if s in over_split else 100.0)

    monkeypatch.setattr(calibrate, "_TimedTrace", FakeTrace)
    fixed_us, over_split_us = 88.0, {"fixed": 20.0, "balanced": 15.0}
    calib = dataclasses.replace(START, num_sms=132)
    sweep = _SplitSweep(cfg=None, settings=types.SimpleNamespace(performance_result=True),
                        shape=types.SimpleNamespace(num_kv_heads=8), calib=calib)
    assert sweep.balanced_rule_fits({}) == {}  # no skewed trace: the calibration keeps its own

    def fit(points):
        sweep._skewed, sweep.records = [], {}
        sweep.run(types.SimpleNamespace(trace="skewed", max_active=64, route="workqueue", split_candidates=[],
                                        wave_candidates=[1, 2, 3, 4], fits="skew_target_ctas", length_scale=1.0))
        return sweep.balanced_rule_fits(points)[MANY_ROWS]

    timed_routes.clear()
    assert fit({MANY_ROWS: {"num_splits": 20}}) == {"skew_target_ctas": 2 * 132, "over_split_balanced": True}
    assert sweep.samples == [] and sweep.persistentkv_plan_us == []
    assert timed_routes[0] == ("fixed", 20, 0, 4)  # the regime's fitted count, on the skewed and over-split steps
    assert {r[2] for r in timed_routes[1:]} == {132, 264, 396, 528}
    record = sweep.records["skewed_b64"]
    assert record["fits"] == "regimes.many_rows.skew_target_ctas" and record["steps"] == 2
    assert record["regime_splits"] == 20
    assert record["device_us_total_by_waves"] == {"1": 180.0, "2": 160.0, "3": 161.0, "4": 170.0}
    assert record["skew_target_ctas"]["fitted"] == 264 and record["skew_target_ctas"]["tied_waves"] == [2, 3]
    assert record["skew_target_ctas"]["speedup_over_fixed"] == pytest.approx(88.0 / 80.0)
    # The measured margin and the band it cleared: both steps alike, so the floor.
    assert record["skew_target_ctas"]["measured_margin"] == pytest.approx(88.0 / 80.0)
    assert record["skew_target_ctas"]["noise_band"] == pytest.approx(0.01)
    assert record["skew_target_ctas"]["default"] == 0
    assert record["flashinfer_device_us_total"] == 200.0
    assert record["over_split_steps"] == {"steps": 2, "fixed_device_us_total": 40.0, "flashinfer_device_us_total": 20.0,
                                          "device_us_total_by_waves": {"1": 30.0, "2": 30.0, "3": 30.0, "4": 30.0}}
    assert record["over_split_balanced"]["fitted"] is True
    assert record["over_split_balanced"]["fits"] == "regimes.many_rows.over_split_balanced"
    assert record["over_split_balanced"]["speedup_over_fixed"] == pytest.approx(20.0 / 15.0)
    assert record["over_split_balanced"]["measured_margin"] == pytest.approx(20.0 / 15.0)
    decisions = sweep.decisions
    assert decisions["regimes.many_rows.skew_target_ctas"]["value"] == 264
    assert decisions["regimes.many_rows.over_split_balanced"]["value"] is True
    assert decisions["regimes.many_rows.over_split_balanced"]["noise_band"] == pytest.approx(0.01)
    # The balanced rule within 1% of the fixed one on the over-split steps: they keep the fixed rule.
    over_split_us = {"fixed": 15.1, "balanced": 15.0}
    assert fit({MANY_ROWS: {"num_splits": 20}}) == {"skew_target_ctas": 264, "over_split_balanced": False}
    # Within 1% of the fixed rule on the skewed steps: no budget, so no over-split rule either.
    fixed_us, over_split_us = 80.5, {"fixed": 20.0, "balanced": 15.0}
    assert fit({}) == {"skew_target_ctas": 0, "over_split_balanced": False}
    assert timed_routes[-6][1] == START.regime(MANY_ROWS).num_splits  # no fitted count: the calibration's
    assert "within the noise band" in sweep.decisions["regimes.many_rows.skew_target_ctas"]["basis"]
    # A split count at which no step is over-split: the rule is not fitted.
    fixed_us = 88.0
    assert fit({MANY_ROWS: {"num_splits": 4}}) == {"skew_target_ctas": 264, "over_split_balanced": False}
    assert sweep.records["skewed_b64"]["over_split_balanced"]["steps"] == 0
    # Each regime fits its budget on its own traces; a trace that also had a split sweep keeps that
    # record, the skew fit's lying beside it.
    sweep._skewed, sweep.records = [], {"bimodal_b4": {"fits": "regimes.few_rows.num_splits"}}
    sweep.run(types.SimpleNamespace(trace="skewed", max_active=64, route="workqueue", split_candidates=[],
                                    wave_candidates=[1, 2, 3, 4], fits="skew_target_ctas", length_scale=1.0))
    sweep.run(types.SimpleNamespace(trace="bimodal", max_active=4, route="workqueue", split_candidates=[],
                                    wave_candidates=[1, 2], fits="skew_target_ctas", length_scale=1.0))
    fits = sweep.balanced_rule_fits({MANY_ROWS: {"num_splits": 20}, FEW_ROWS: {"num_splits": 24}})
    assert fits == {MANY_ROWS: {"skew_target_ctas": 264, "over_split_balanced": True},
                    FEW_ROWS: {"skew_target_ctas": 264, "over_split_balanced": True}}
    assert sweep.records["bimodal_b4"] == {"fits": "regimes.few_rows.num_splits"}
    beside = sweep.records["bimodal_b4 (skewed steps)"]
    assert beside["regime_splits"] == 24 and beside["fitted_with"] == ["bimodal_b4"]
    assert beside["fits"] == "regimes.few_rows.skew_target_ctas"
    assert sweep.records["skewed_b64"]["fitted_with"] == ["skewed_b64"]
    # A trace without a skewed step fits nothing.
    FakeTrace.__init__ = lambda self, *args: setattr(self, "steps", [types.SimpleNamespace(
        batch_size=2, seq_lens=[100, 100])]) or setattr(self, "kv_dtype_bytes", 2)
    with pytest.raises(ConfigError, match="none of its steps is skewed"):
        sweep.run(types.SimpleNamespace(trace="bimodal", max_active=8, route="workqueue", split_candidates=[],
                                        wave_candidates=[2], fits="skew_target_ctas", length_scale=1.0))


def test_short_single_rows_fit_the_short_row_rule_where_it_clears_the_noise_band(monkeypatch):
    """bucket_tiles_per_split: every step of a single-row trace run on the route the policy gives it
    under each tiles a split, at the single-row regime's fitted split count (a short row at fewer
    splits, a long one at the count); the fewest tiles within 1% of the fastest, where they beat one
    tile a split (the rule off) by more than the noise band, else 1. None of the steps joins C_min
    or the plan times."""
    from pkv.experiments import calibrate

    ran = []
    # Two short rows (12 and 13 tiles) and one long one (256 tiles): the rule moves the short ones only.
    steps = [types.SimpleNamespace(step=i, batch_size=1, seq_lens=np.asarray([n], dtype=np.int32))
             for i, n in enumerate((384, 8192, 410))]

    class FakeTrace:
        timed = _timed_one_by_one

        def __init__(self, cfg, settings, shape, trace):
            self.kv_dtype_bytes, self.steps = 2, steps
            ran.append(trace.length_scale)

        def persistentkv_ruled(self, policy, fallback):
            samples = []
            for step in self.steps:
                route = policy.ruled_route(step)
                samples.append(types.SimpleNamespace(step=step, route=route, measured_us=us_by_splits[
                    min(route.num_splits, -(-int(step.seq_lens[0]) // 32))]))
            return types.SimpleNamespace(samples=samples, plan_us=[1.0], total_us=sum(x.measured_us for x in samples))

    monkeypatch.setattr(calibrate, "_TimedTrace", FakeTrace)
    sweep = _SplitSweep(cfg=None, settings=types.SimpleNamespace(performance_result=True), shape=ModelShape(),
                        calib=START)
    assert sweep.short_row_fits({}, START) == {}  # no such trace: the calibration keeps its own

    def fit(points):
        sweep._short_rows, sweep.records, sweep.decisions = [], {}, {}
        sweep.run(types.SimpleNamespace(trace="bucketed", max_active=1, route="bucket_exact", split_candidates=[],
                                        tile_candidates=[1, 2, 3, 4], fits="bucket_tiles_per_split",
                                        length_scale=1 / 32))
        return sweep.short_row_fits(points, _fitted(points))[SINGLE_ROW]

    # 12 and 13 tiles: one split a tile at T = 1, 4 splits at T = 2 and 3, 2 splits at T = 4; the
    # long row keeps the regime's 32 at every T.
    us_by_splits = {12: 10.0, 13: 10.0, 4: 9.0, 2: 8.0, 32: 1.0}
    assert fit({SINGLE_ROW: {"num_splits": 32}}) == {"bucket_tiles_per_split": 4}
    assert ran[-1] == pytest.approx(1 / 32)  # the trace's own length scale (1), times the entry's
    assert sweep.samples == [] and sweep.persistentkv_plan_us == []
    record = sweep.records["bucketed_b1 x0.03125 (short rows)"]
    assert record["fits"] == "regimes.single_row.bucket_tiles_per_split" and record["regime_splits"] == 32
    assert record["splits_by_tiles"] == {"1": {"12": 1, "13": 1, "32": 1}, "2": {"4": 2, "32": 1},
                                         "3": {"4": 2, "32": 1}, "4": {"2": 2, "32": 1}}
    assert record["device_us_total_by_tiles"] == {"1": 21.0, "2": 19.0, "3": 19.0, "4": 17.0}
    fitted = record["regimes.single_row.bucket_tiles_per_split"]
    assert (fitted["fitted"], fitted["selected_tiles"], fitted["default"]) == (4, 4, 1)
    assert fitted["measured_margin"] == pytest.approx(21.0 / 17.0) and "faster by more than" in fitted["basis"]
    assert sweep.decisions["regimes.single_row.bucket_tiles_per_split"]["value"] == 4
    # Every T within 1% of the fastest: a tie goes to the fewest tiles, the rule off.
    us_by_splits.update({4: 9.98, 2: 9.95})
    assert fit({SINGLE_ROW: {"num_splits": 32}}) == {"bucket_tiles_per_split": 1}
    assert "one tile a split is the fastest" in sweep.decisions["regimes.single_row.bucket_tiles_per_split"]["basis"]
    # One tile a split faster; and with no fitted count, the calibration's (START's 32).
    us_by_splits.update({4: 11.0, 2: 11.0})
    assert fit({}) == {"bucket_tiles_per_split": 1}
    assert sweep.records["bucketed_b1 x0.03125 (short rows)"]["regime_splits"] == 32


def test_a_closed_regime_stays_closed_when_the_timings_are_not_a_performance_result():
    sweep = _SplitSweep(cfg=None, settings=types.SimpleNamespace(performance_result=False), shape=ModelShape(),
                        calib=START)
    sweep._swept = [_swept("bimodal_b4", 4, FEW_ROWS, {32: 90.0, 36: 88.0}, 89.0)]
    points = sweep.split_points()
    assert points == {FEW_ROWS: {"num_splits": 36}} and sweep.regime_routes(points, _fitted(points)) == {}
    assert sweep.records["bimodal_b4"]["regime_route"]["applied"] is False


# --------------------------------------------------------------------------------------
# Route decisions against the noise band of their paired steps


def _noisy_b4(seed, gain=1.0, sigma=0.03, n=64):
    """(PersistentKV, FlashInfer) device times of one calibration's B4 steps: the same steps every
    run (40-400 us, the bimodal trace's spread), each route's median off by ``sigma`` noise drawn
    from ``seed``; FlashInfer ``gain`` times slower on average."""
    import numpy as np

    steps = np.random.default_rng(20260622).uniform(40.0, 400.0, n)
    rng = np.random.default_rng(seed)
    return (list(steps * (1 + sigma * rng.standard_normal(n))),
            list(steps * gain * (1 + sigma * rng.standard_normal(n))))


def test_noise_that_straddles_the_margin_decides_the_same_route_in_both_runs():
    """Two calibrations of one GPU whose B4 gains fall either side of 1.0 (seeds 0 and 1 of the
    noise): a bare 'PersistentKV faster' rule flips between them, the noise band does not."""
    from pkv.policy.fits import fit_regime_route

    fits = [fit_regime_route(*_noisy_b4(seed), "persistentkv_workqueue") for seed in (0, 1)]
    gains = [f.gain.gain for f in fits]
    assert gains[0] < 1.0 < gains[1]  # the noise straddles the margin
    assert [f.route for f in fits] == ["flashinfer", "flashinfer"]
    for f in fits:
        # The band comes from the steps' own spread (wider than the 1% floor here) and is recorded.
        assert 0.01 < f.gain.noise_band < 0.02 and f.gain.steps == 64
        assert "within the noise band" in f.basis
    # Over many runs of that noise the bare rule goes either way about half the time; the band
    # opens the route at most once in 200 (a two-sided 95% interval's upper tail is 2.5%).
    runs = [_noisy_b4(seed) for seed in range(200)]
    bare = sum(sum(fi) > sum(pkv) for pkv, fi in runs)
    banded = sum(fit_regime_route(pkv, fi, "persistentkv_workqueue").route != "flashinfer" for pkv, fi in runs)
    assert 60 < bare < 140 and banded <= 5


def test_a_gain_well_past_the_band_opens_the_route_in_every_run():
    from pkv.policy.fits import fit_regime_route

    assert all(fit_regime_route(*_noisy_b4(seed, gain=1.05), "persistentkv_workqueue").route
               == "persistentkv_workqueue" for seed in range(50))


def test_a_tie_always_goes_to_flashinfer_and_too_few_steps_to_the_default():
    import json

    from pkv.policy.fits import fit_regime_route, measured_gain

    times = [50.0, 80.0, 120.0, 300.0]
    for order in (times, times[::-1]):
        tie = fit_regime_route(order, list(order), "persistentkv_workqueue")
        assert tie.route == "flashinfer" and tie.gain.gain == 1.0 and tie.gain.noise_band == pytest.approx(0.01)
    # Exactly at the band's edge is still inside it.
    edge = measured_gain([100.0, 100.0], [101.0, 101.0])
    assert edge.required == pytest.approx(1.01) and not edge.clears
    # One step: no spread to measure, the default, and a record that JSON can hold.
    one = fit_regime_route([50.0], [80.0], "persistentkv_workqueue")
    assert one.route == "flashinfer" and "fewer than 2 steps" in one.basis
    record = one.gain.record()
    assert record["noise_band"] is None and record["measured_margin"] == pytest.approx(1.6)
    json.dumps(record, allow_nan=False)
    with pytest.raises(ValueError, match="one of each per step"):
        measured_gain([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="finite and > 0"):
        measured_gain([1.0, 0.0], [1.0, 1.0])


def test_the_few_rows_route_records_its_margin_and_band_and_two_noisy_runs_agree():
    """The calibrate rule's B4 route from steps whose noise straddles the margin: the same route in
    both runs, each recording its measured margin and noise band (measurements.decisions)."""
    import json

    decided = []
    for seed in (0, 1):
        pkv, fi = _noisy_b4(seed)
        step = types.SimpleNamespace(seq_lens=[70000])
        timed = {36: types.SimpleNamespace(total_us=sum(pkv), samples=[types.SimpleNamespace(step=step, measured_us=us)
                                                                         for us in pkv])}
        trace = {"name": "bimodal_b4", "max_active": 4, "route": "persistentkv_workqueue", "regime": FEW_ROWS,
                 "steps": 64, "timed_by_splits": timed,
                 "timed_fi": types.SimpleNamespace(total_us=sum(fi), samples=[types.SimpleNamespace(step=step,
                                                                                                    measured_us=us)
                                                                              for us in fi])}
        sweep = _SplitSweep(cfg=None, settings=types.SimpleNamespace(performance_result=True), shape=ModelShape(),
                            calib=START)
        sweep._swept = [trace]
        points = sweep.split_points()
        points[FEW_ROWS].update(sweep.regime_routes(points, _fitted(points))[FEW_ROWS])
        route = sweep.records["bimodal_b4"]["regime_route"]
        decision = sweep.decisions["regimes.few_rows.route"]
        assert points[FEW_ROWS]["route"] == route["fitted"] == decision["value"]
        assert decision["measured_margin"] == pytest.approx(sum(fi) / sum(pkv))
        assert decision["noise_band"] == route["noise_band"] > 0.01
        assert decision["required_margin"] == pytest.approx(1 + decision["noise_band"])
        assert decision["default"] == "flashinfer" and decision["steps"] == 64 and decision["applied"] is True
        json.dumps(sweep.decisions, allow_nan=False)
        decided.append(decision["value"])
    assert decided == ["flashinfer", "flashinfer"]


def test_a_device_tie_of_the_few_rows_route_goes_to_the_cheaper_host_plan_in_both_runs():
    """The same noisy B4 steps, with the sweep's plan times: FlashInfer's plan() 436 us a step, the
    workqueue's 43. Device time ties in both runs, so the host decides, the same way in both."""
    decided = []
    for seed in (0, 1):
        pkv, fi = _noisy_b4(seed)
        step = types.SimpleNamespace(seq_lens=[70000])
        samples = lambda times: [types.SimpleNamespace(step=step, measured_us=us) for us in times]  # noqa: E731
        trace = {"name": "bimodal_b4", "max_active": 4, "route": "persistentkv_workqueue", "regime": FEW_ROWS,
                 "steps": 64, "timed_by_splits": {36: types.SimpleNamespace(total_us=sum(pkv), samples=samples(pkv))},
                 "timed_fi": types.SimpleNamespace(total_us=sum(fi), samples=samples(fi))}
        sweep = _SplitSweep(cfg=None, settings=types.SimpleNamespace(performance_result=True), shape=ModelShape(),
                            calib=START)
        sweep._swept = [trace]
        sweep.persistentkv_plan_us, sweep.flashinfer_plan_us = [40.0, 43.0, 50.0], [400.0, 436.0, 600.0]
        points = sweep.split_points()
        points[FEW_ROWS].update(sweep.regime_routes(points, _fitted(points))[FEW_ROWS])
        decision = sweep.decisions["regimes.few_rows.route"]
        assert points[FEW_ROWS]["route"] == decision["value"] == "persistentkv_workqueue"
        assert "within the noise band" in decision["basis"] and "host plan (43.0 us)" in decision["basis"]
        record = sweep.records["bimodal_b4"]["regime_route"]
        assert record["candidate_plan_us"] == 43.0 and record["default_plan_us"] == 436.0
        decided.append(decision["value"])
    assert decided == ["persistentkv_workqueue"] * 2


def test_gate_and_group_size_decisions_record_the_margin_at_their_boundary():
    sweep = {"source": "split sweep", "contexts": [70000, 70000], "persistentkv_us": [90.0, 90.0],
             "flashinfer_us": [100.0, 100.0]}
    short = {"source": "probe short", "contexts": [1100, 4200], "persistentkv_us": [12.0, 15.0],
             "flashinfer_us": [10.0, 18.0]}
    probes = _probes({MANY_ROWS: [sweep, short]}, tolerance=0.02)
    probes.group_totals = {8: [{"persistentkv_device_us_total": 60.3, "flashinfer_device_us_total": 60.0}]}
    gates = probes.fit_context_gates(START)
    decisions = probes.decisions(gates, probes.fit_group_sizes(START))
    gate = decisions["regimes.many_rows.min_context_tokens"]
    assert gate["value"] == 4096 and gate["boundary_class"] == 4096
    assert gate["measured_margin"] == pytest.approx(18.0 / 15.0) and gate["margin_below"] == pytest.approx(10.0 / 12.0)
    assert gate["noise_band"] == 0.02 and gate["required_margin"] == pytest.approx(1 / 1.02)
    groups = decisions["supported_group_sizes"]
    sums = {"persistentkv_device_us_total": 60.3, "flashinfer_device_us_total": 60.0}
    assert groups["value"] == [4, 8] and groups["by_group"] == {"8": {"measured_margin": pytest.approx(60 / 60.3),
                                                                     "interval_half_width": None,
                                                                     "opened": True, **sums}}
    # The same margin with its interval (2%) straddling 1 / 1.02: a tie, kept on FlashInfer.
    probes.group_totals[8][0]["interval_half_width"] = 0.02
    decisions = probes.decisions(gates, probes.fit_group_sizes(START))
    assert decisions["supported_group_sizes"]["value"] == [4]
    assert decisions["supported_group_sizes"]["by_group"]["8"] == {
        "measured_margin": pytest.approx(60 / 60.3), "interval_half_width": 0.02, "opened": False, **sums}
    # The worst probe's sums and FlashInfer's picks on it go with the decision.
    probes.group_totals[8].append({"probe": "bimodal_b8 x1 G=8", "persistentkv_device_us_total": 62.0,
                                   "flashinfer_device_us_total": 55.0, "flashinfer_picks": {"B8 65536": "tc"}})
    decisions = probes.decisions(gates, probes.fit_group_sizes(START))
    assert decisions["supported_group_sizes"]["by_group"]["8"] == {
        "measured_margin": pytest.approx(55 / 62), "interval_half_width": None, "opened": False,
        "probe": "bimodal_b8 x1 G=8", "persistentkv_device_us_total": 62.0, "flashinfer_device_us_total": 55.0,
        "flashinfer_picks": {"B8 65536": "tc"}}


# --------------------------------------------------------------------------------------
# The record: the regimes form, the flat form of files before the regimes, and bad input

FLAT = {**HARDWARE, "min_context_tokens": 512, "boundary_min_context_tokens": None,
        "workqueue_min_context_tokens": 4096, "b8_margin": 1.2, "b4_margin": 1.7, "bucket_num_splits": 16,
        "boundary_num_splits": 24, "workqueue_num_splits": 28, "boundary_route": "persistentkv_workqueue",
        "supported_group_sizes": [1, 4], "workqueue_split_kind": "balanced", "source": "old file"}


def test_a_flat_mapping_loads_to_the_same_regimes():
    calib = Calibration.from_mapping(FLAT, "old.json")
    # b8_margin governed B1 as well as 8+ rows; a null boundary gate is the single-row gate.
    assert calib.single_row == RegimeParams("persistentkv_bucket", 16, 512, 1.2)
    assert calib.few_rows == RegimeParams("persistentkv_workqueue", 24, 512, 1.7)
    assert calib.many_rows == RegimeParams("persistentkv_workqueue", 28, 4096, 1.2)
    assert calib.supported_group_sizes == (1, 4) and calib.workqueue_split_kind == "balanced"
    assert (calib.gpu, calib.num_sms, calib.beta_gbps, calib.source) == ("fake", 4, 100.0, "old file")
    # The regimes form of the same record reads back equal.
    assert Calibration.from_mapping(calib.to_json_dict(), "new.json") == calib


def test_a_flat_mapping_takes_the_flat_defaults_and_null_gates_take_the_single_row_gate():
    calib = Calibration.from_mapping({**HARDWARE, "min_context_tokens": 2048,
                                      "workqueue_min_context_tokens": None}, "old.json")
    assert calib.single_row == RegimeParams("persistentkv_bucket", 32, 2048, 1.05)
    assert calib.few_rows == RegimeParams("flashinfer", 32, 2048, 1.50)
    assert calib.many_rows == RegimeParams("persistentkv_workqueue", 20, 2048, 1.05)
    assert calib.with_regime(FEW_ROWS, route="persistentkv_workqueue").few_rows.route == "persistentkv_workqueue"
    opened = calib.with_all_regimes(min_context_tokens=0)
    assert {opened.regime(r).min_context_tokens for r in REGIMES} == {0}
    assert opened.single_row.num_splits == 32 and opened.many_rows.num_splits == 20


def test_an_old_schema_file_loads_and_a_new_one_reads_back_equal(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"schema": LEGACY_SCHEMA, "calibration": FLAT, "provenance": {}}))
    calib = load_calibration(old)
    assert calib == Calibration.from_mapping(FLAT, "old.json")
    new = tmp_path / "new.json"
    save_calibration(new, calib, {"note": "x"})
    record = json.loads(new.read_text())
    assert record["schema"] == "pkv.calibration/3" and set(record["calibration"]["regimes"]) == set(REGIMES)
    assert load_calibration(new) == calib


def _regimes_form(**regime_changes) -> dict:
    d = START.to_json_dict()
    for regime, changes in regime_changes.items():
        d["regimes"][regime].update(changes)
    return d


@pytest.mark.parametrize("mapping, pattern", [
    ({**_regimes_form(), "num_smz": 8}, r"conf/gpu/x\.yaml: unknown key 'num_smz' \(value 8\)"),
    ({**FLAT, "b8_margn": 1.1}, r"conf/gpu/x\.yaml: unknown key 'b8_margn' \(value 1\.1\)"),
    ({**FLAT, "regimes": _regimes_form()["regimes"]}, r"conf/gpu/x\.yaml: unknown key 'min_context_tokens'"),
    (_regimes_form(few_rows={"margn": 2.0}),
     r"conf/gpu/x\.yaml: regimes\.few_rows: unknown key 'margn' \(value 2\.0\)"),
    (_regimes_form(few_rows={"route": "diagonal"}), r"conf/gpu/x\.yaml: regimes\.few_rows\b.*route='diagonal'"),
    (_regimes_form(many_rows={"num_splits": 0}), r"conf/gpu/x\.yaml: regimes\.many_rows\b.*num_splits=0"),
    (_regimes_form(single_row={"margin": 0}), r"conf/gpu/x\.yaml: regimes\.single_row\b.*margin=0"),
    (_regimes_form(single_row={"min_context_tokens": -1}),
     r"conf/gpu/x\.yaml: regimes\.single_row\b.*min_context_tokens=-1"),
    (_regimes_form(many_rows={"num_splits": "abc"}), r"conf/gpu/x\.yaml: regimes\.many_rows\b.*num_splits='abc'"),
    ({**_regimes_form(), "regimes": {SINGLE_ROW: START.to_json_dict()["regimes"][SINGLE_ROW]}},
     r"conf/gpu/x\.yaml: field regimes=\['single_row'\]"),
    ({**_regimes_form(), "num_sms": 0}, r"conf/gpu/x\.yaml: field num_sms=0"),
    ({**FLAT, "boundary_route": "persistentkv_bucket"},
     r"conf/gpu/x\.yaml: field boundary_route='persistentkv_bucket'"),
    ({**FLAT, "b8_margin": -1}, r"conf/gpu/x\.yaml: regimes\.single_row\b.*margin=-1"),
])
def test_a_bad_mapping_names_where_the_field_and_the_value(mapping, pattern):
    with pytest.raises(CalibrationError, match=pattern):
        Calibration.from_mapping(mapping, "conf/gpu/x.yaml")


def test_a_bad_file_names_the_file_and_the_field(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"schema": "pkv.calibration/9", "calibration": FLAT}))
    with pytest.raises(CalibrationError, match=r"calibration\.json: field schema='pkv\.calibration/9'"):
        load_calibration(path)
    path.write_text(json.dumps({"schema": LEGACY_SCHEMA, "calibration": {**FLAT, "boundary_route": "x"}}))
    with pytest.raises(CalibrationError, match=r"calibration\.json: calibration: field boundary_route='x'"):
        load_calibration(path)


def test_a_gpus_gates_are_read_in_the_cpu_profiles_tokens(tmp_path):
    """The CPU profile scales every trace by 1/64; a GPU's gates (its file, or a calibration made on
    it) are scaled alike wherever a run loads them, and nothing else is."""
    import yaml

    from pkv.config import compose
    from pkv.experiments.common import run_calibration

    reference = "artifacts/reference/h200/history/2c0348e_full_dag/calibration.json"
    gates = {r: load_calibration(reference).regime(r).min_context_tokens for r in REGIMES}

    def gates_of(*overrides):
        calib = run_calibration(compose(["out=x", *overrides]))
        return {r: calib.regime(r).min_context_tokens for r in REGIMES}

    scaled = {r: max(1, round(g / 64)) for r, g in gates.items()}
    assert gates_of("profile=cpu", f"calibration={reference}") == scaled
    assert gates_of("profile=gpu", "device=cpu", f"calibration={reference}") == gates
    # A calibration the CPU profile wrote is in its tokens already; so is conf/gpu/cpu.yaml. One a
    # GPU-profile run wrote on the CPU device (not a performance result either) is in the GPU's.
    record = json.loads(open(reference).read())
    record["provenance"]["measurements"] = {"performance_result": False}
    for profile, want in (("cpu", gates), ("gpu", scaled)):
        record["provenance"]["config"] = {"profile": profile}
        written = tmp_path / f"{profile}_profile.json"
        written.write_text(json.dumps(record))
        assert gates_of("profile=cpu", f"calibration={written}") == want
    # A provenance that is not an object says nothing about the profile: the gates count as a GPU's.
    record["provenance"] = "hand-written"
    written.write_text(json.dumps(record))
    assert gates_of("profile=cpu", f"calibration={written}") == scaled
    cpu = yaml.safe_load(open("conf/gpu/cpu.yaml"))["regimes"]
    assert gates_of("profile=cpu", "gpu=cpu") == {r: cpu[r]["min_context_tokens"] for r in REGIMES}


def test_a_gate_probe_times_each_step_on_the_route_the_policy_would_run_there(monkeypatch):
    """A probe places a regime's context gate by the steps it would open: each step timed on the
    regime's candidate as the step rules leave it (the balanced rule on an over-split or skewed
    step where the regime takes it), not on the candidate's fixed split count."""
    from pkv.experiments import calibrate
    from pkv.policy.choose import RuledRoutePolicy
    from pkv.shape import ModelShape

    over_split = types.SimpleNamespace(step=0, batch_size=8, seq_lens=[600] * 8)  # 4,800 tokens < 2 x 64 x 20 x 8
    skewed = types.SimpleNamespace(step=1, batch_size=8, seq_lens=[60000] + [500] * 7)
    ragged = types.SimpleNamespace(step=2, batch_size=8, seq_lens=[30000, 20000] + [4000] * 6)
    few = types.SimpleNamespace(step=0, batch_size=4, seq_lens=[600] * 4)
    seen = []

    class FakeTrace:
        timed = _timed_one_by_one

        def __init__(self, cfg, settings, shape, trace):
            self.steps = [over_split, skewed, ragged] if trace.max_active == 8 else [few]
            self.flashinfer_paths = None

        def persistentkv_ruled(self, policy, fallback):
            seen.append(policy)
            ruled = RuledRoutePolicy(policy, fallback)
            samples = [types.SimpleNamespace(step=s, route=ruled.choose(s).route,
                                             measured_us=10.0 if ruled.choose(s).route.split_kind == "balanced"
                                             else 12.0) for s in self.steps]
            return types.SimpleNamespace(samples=samples, total_us=sum(x.measured_us for x in samples))

        def flashinfer(self):
            samples = [types.SimpleNamespace(step=s, measured_us=11.0) for s in self.steps]
            return types.SimpleNamespace(samples=samples, total_us=11.0 * len(samples))

    monkeypatch.setattr(calibrate, "_TimedTrace", FakeTrace)
    fitted = dataclasses.replace(START, num_sms=132).with_regime(MANY_ROWS, skew_target_ctas=264,
                                                                over_split_balanced=True)
    probes = _GateProbes(cfg=None, settings=types.SimpleNamespace(performance_result=True), shape=ModelShape(),
                         fitted=fitted, gate_steps={}, tolerance=0.02)
    probes.run(types.SimpleNamespace(trace="bimodal", max_active=8, length_scale=1 / 64, num_requests=None,
                                     group_size=None))
    (record,) = probes.records
    assert record["route"] == "persistentkv_workqueue" and record["num_splits"] == 20
    assert record["steps_by_route"] == {"persistentkv_workqueue balanced (264 CTAs)": 2,
                                        "persistentkv_workqueue S=20": 1}
    (rows,) = probes.gate_steps[MANY_ROWS]
    assert rows["persistentkv_us"] == [10.0, 10.0, 12.0] and rows["contexts"] == [600, 60000, 30000]
    # A regime the calibration closed is opened for its probe, with its own rules.
    probes.run(types.SimpleNamespace(trace="bimodal", max_active=4, length_scale=1 / 64, num_requests=None,
                                     group_size=None))
    assert seen[-1].candidate(4).name == "persistentkv_workqueue" and seen[-1].candidate(4).num_splits == 32
    # START's few-rows regime has no skew budget: its over-split step keeps the fixed count.
    assert probes.records[-1]["steps_by_route"] == {"persistentkv_workqueue S=32": 1}


def test_the_few_rows_route_and_gates_read_each_step_on_the_route_the_policy_runs_it_on():
    """The B2-7 route decision and the gates' long end read each sweep step at the fitted split
    count as the policy would run it: a skewed step on the balanced rule at the fitted budget,
    from the skew fit's run of the same step (matched by index and lengths); a step of fewer rows
    (another regime's route) and a step the skew fit did not time keep the sweep's own time."""
    skewed = types.SimpleNamespace(step=0, batch_size=4, seq_lens=[9000, 100, 100, 100])
    ragged = types.SimpleNamespace(step=1, batch_size=4, seq_lens=[9000, 9000, 100, 100])
    single = types.SimpleNamespace(step=2, batch_size=1, seq_lens=[5000])
    skewed_untimed = types.SimpleNamespace(step=3, batch_size=4, seq_lens=[8000, 100, 100, 100])
    steps = [skewed, ragged, single, skewed_untimed]

    def timed(us):
        samples = [types.SimpleNamespace(step=s, measured_us=us) for s in steps]
        return types.SimpleNamespace(samples=samples, total_us=us * len(steps))

    trace = {"name": "bimodal_b4", "max_active": 4, "route": "persistentkv_workqueue", "regime": FEW_ROWS,
             "steps": 4, "timed_by_splits": {28: timed(110.0), 32: timed(100.0)}, "timed_fi": timed(96.0)}
    sweep = _SplitSweep(cfg=None, settings=types.SimpleNamespace(performance_result=True), shape=ModelShape(),
                        calib=START)
    sweep._swept = [trace]
    # The skew fit's run: step 0 on the balanced rule at 264 CTAs; step 3 there under other lengths.
    sweep._balanced_by_step = {"bimodal_b4": {264: {0: ((9000, 100, 100, 100), 80.0),
                                                    3: ((7000, 100, 100, 100), 10.0)}}}
    points = sweep.split_points()
    assert points == {FEW_ROWS: {"num_splits": 32}}
    fitted = dataclasses.replace(_fitted(points), num_sms=132).with_regime(FEW_ROWS, skew_target_ctas=264)
    times, counts = sweep.ruled_samples(trace, 32, fitted)
    assert times == [80.0, 100.0, 100.0, 100.0]
    assert counts == {"persistentkv_workqueue balanced (264 CTAs)": 1, "persistentkv_workqueue S=32": 1,
                      "persistentkv_bucket S=32 (not timed: S=32's time)": 1,
                      "persistentkv_workqueue balanced (264 CTAs) (not timed: S=32's time)": 1}
    # On the fixed rule at S = 32 the workqueue loses to FlashInfer (400 against 384 us); on the
    # routes the policy runs it still does (380), and the record says which steps ran what.
    assert sweep.regime_routes(points, fitted) == {FEW_ROWS: {"route": "flashinfer"}}
    record = sweep.records["bimodal_b4"]["regime_route"]
    assert record["candidate_device_us_total"] == 380.0 and record["steps_by_route"] == dict(counts)
    sweep._balanced_by_step["bimodal_b4"][264][3] = ((8000, 100, 100, 100), 60.0)
    assert sweep.ruled_samples(trace, 32, fitted)[0] == [80.0, 100.0, 100.0, 60.0]
    sweep.regime_routes(points, fitted)
    record = sweep.records["bimodal_b4"]["regime_route"]
    assert record["candidate_device_us_total"] == 340.0
    assert record["measured_margin"] == pytest.approx(384.0 / 340.0)
    # Without a skew budget every B4 step keeps the fixed rule's time; the gate rows say so too.
    (rows,) = sweep.gate_steps(points, _fitted(points))[FEW_ROWS]
    assert rows["persistentkv_us"] == [100.0] * 4 and rows["contexts"] == [9000, 9000, 5000, 8000]


def test_a_split_count_tie_goes_to_the_configured_count_and_the_record_says_so():
    sweep = _SplitSweep(cfg=None, settings=types.SimpleNamespace(performance_result=True), shape=ModelShape(),
                        calib=START)
    # B2-7 counts within 1% of the fastest (36): 24, 32 and 36; START configures 32.
    sweep._swept = [_swept("bimodal_b4", 4, FEW_ROWS, {24: 100.5, 32: 100.8, 36: 100.0, 40: 102.0}, 101.0)]
    assert sweep.split_points() == {FEW_ROWS: {"num_splits": 32}}
    decision = sweep.decisions["regimes.few_rows.num_splits"]
    assert decision["basis"] == "the configured count, within the band of the fastest"
    assert (decision["preferred"], decision["fastest"], decision["tied"]) == (32, 36, [24, 32, 36])
    assert sweep.records["bimodal_b4"]["preferred_splits"] == 32
    # Configured outside the tie (START's B8+ count, 20): the fewest tied count, as before.
    sweep._swept = [_swept("bimodal_b8", 8, MANY_ROWS, {20: 103.0, 24: 100.5, 28: 100.0}, 101.0)]
    assert sweep.split_points() == {MANY_ROWS: {"num_splits": 24}}
    basis = sweep.decisions["regimes.many_rows.num_splits"]["basis"]
    assert basis == "the fewest splits within the band of the fastest"


def test_a_sweep_step_of_a_closed_regime_keeps_the_sweeps_own_time():
    """A B8 trace's step of three rows falls in the B2-7 regime; closed there (START's B2-7 route is
    FlashInfer), the policy would not run PersistentKV on it, and the sweep's time stands, counted
    as not timed on its route."""
    steps = [types.SimpleNamespace(step=0, batch_size=8, seq_lens=[30000, 20000] + [4000] * 6),
             types.SimpleNamespace(step=1, batch_size=3, seq_lens=[30000, 20000, 4000])]
    samples = [types.SimpleNamespace(step=s, measured_us=100.0) for s in steps]
    trace = {"name": "bimodal_b8", "max_active": 8, "route": "persistentkv_workqueue", "regime": MANY_ROWS,
             "steps": 2, "timed_by_splits": {20: types.SimpleNamespace(samples=samples, total_us=200.0)},
             "timed_fi": types.SimpleNamespace(samples=samples, total_us=200.0)}
    sweep = _SplitSweep(cfg=None, settings=types.SimpleNamespace(performance_result=True), shape=ModelShape(),
                        calib=START)
    times, counts = sweep.ruled_samples(trace, 20, START)
    assert times == [100.0, 100.0]
    assert counts == {"persistentkv_workqueue S=20": 1, "flashinfer (not timed: S=20's time)": 1}


def test_the_runs_of_a_trace_are_timed_step_by_step_in_turn():
    """time_steps_in_turn: every run times each step, the runs of one step one after another and
    the first of them moving on by one each step, so no run always goes first or last; each run
    keeps its own samples, totals and plan times, on the route it was pinned to."""
    import time

    from pkv.measure.calibration_probe import time_steps_in_turn
    from pkv.policy.route import ROUTE_WORKQUEUE, StepRoute

    order = []

    class Engine:
        def __init__(self, name, us):
            self.name, self.us = name, us

        def prepare(self, step, q, k_pages, v_pages):
            pass

        def plan(self, step):
            return step

        def run(self, q, k_pages, v_pages, plan):
            order.append((plan.step, self.name))
            # Wall time on the CPU: a spin of at least this long.
            deadline = time.perf_counter() + self.us * 1e-6
            while time.perf_counter() < deadline:
                pass

    steps = [types.SimpleNamespace(step=i, batch_size=1, seq_lens=[100]) for i in range(4)]
    route = StepRoute(ROUTE_WORKQUEUE, 8)
    runs = {"a": (Engine("a", 200.0), route), "b": (Engine("b", 2000.0), FLASHINFER_ROUTE),
            "c": (Engine("c", 200.0), route)}
    timed = time_steps_in_turn(runs, steps, ModelShape(), None, None, dtype="float32", device="cpu", seed=0,
                               reps=2, flush_l2=False)
    # One warm-up and two timed repetitions per (step, run), the step's runs contiguous.
    firsts = [order[i * 9][1] for i in range(4)]
    assert firsts == ["a", "b", "c", "a"]
    assert [name for s, name in order[9:18:3]] == ["b", "c", "a"]
    assert all({s for s, _ in order[i * 9:(i + 1) * 9]} == {i} for i in range(4))
    for key in runs:
        assert [sample.step.step for sample in timed[key].samples] == [0, 1, 2, 3]
        assert len(timed[key].plan_us) == 4
        assert timed[key].total_us == pytest.approx(sum(s.measured_us for s in timed[key].samples))
    assert {s.route for s in timed["b"].samples} == {FLASHINFER_ROUTE} and timed["a"].samples[0].route == route
    # Each run's samples are its own: every repetition of "b" spins for at least 2 ms.
    assert all(sample.measured_us >= 2000.0 for sample in timed["b"].samples)
