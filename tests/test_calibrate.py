"""The calibrate rule's gate fits, on hand-made timings (the CPU DAG runs them end to end)."""

from __future__ import annotations

import types

import pytest

from pkv.cost_model import Calibration
from pkv.cost_model import CONTEXT_GATE_FIELDS, context_gate_field
from pkv.experiments.calibrate import _GateProbes

START = Calibration(gpu="fake", num_sms=4, beta_gbps=100.0, lambda_us=5.0, c_min=1.0, min_context_tokens=8192)


def _probes(gate_steps=None, performance_result=True, tolerance=0.0) -> _GateProbes:
    settings = types.SimpleNamespace(performance_result=performance_result)
    return _GateProbes(cfg=None, settings=settings, shape=None, fitted=START, gate_steps=gate_steps or {},
                       tolerance=tolerance)


@pytest.mark.parametrize("batch, field", [(1, "min_context_tokens"), (2, "boundary_min_context_tokens"),
                                          (7, "boundary_min_context_tokens"), (8, "workqueue_min_context_tokens"),
                                          (64, "workqueue_min_context_tokens")])
def test_each_batch_size_has_the_gate_of_its_regime(batch, field):
    assert context_gate_field(batch) == field
    assert context_gate_field({f: b for b, f in CONTEXT_GATE_FIELDS.items()}[field]) == field


def test_each_regime_gate_is_fitted_from_all_of_its_steps():
    sweep = {"source": "split sweep", "contexts": [70000, 70000], "persistentkv_us": [90.0, 90.0],
             "flashinfer_us": [100.0, 100.0]}
    short = {"source": "probe short", "contexts": [1100, 4200], "persistentkv_us": [12.0, 15.0],
             "flashinfer_us": [10.0, 18.0]}
    fits = _probes({"workqueue_min_context_tokens": [sweep, short], "min_context_tokens": [sweep]}).fit_context_gates(START)
    # PersistentKV wins at 4K and 64K, loses at 1K: the B8+ gate opens at 4K.
    b8 = fits["workqueue_min_context_tokens"]
    assert b8["fitted"] == 4096 and b8["applied"] is True
    assert b8["sources"] == ["split sweep", "probe short"] and set(b8["classes"]) == {"1024", "4096", "65536"}
    assert fits["min_context_tokens"]["fitted"] == 65536
    assert "boundary_min_context_tokens" not in fits  # no steps timed there: the configured gate stands
    # 1K loses by 20%, past any tolerance; with 25% it holds too.
    wide = _probes({"workqueue_min_context_tokens": [sweep, short]}, tolerance=0.25).fit_context_gates(START)
    assert wide["workqueue_min_context_tokens"]["fitted"] == 1024


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
    # G = 8 lost one probe by 1.7%: a tie inside a 2% tolerance.
    tolerant = _probes(tolerance=0.02)
    tolerant.group_totals = probes.group_totals
    assert tolerant.fit_group_sizes(START)["opened"] == [1, 8]


def _swept(name, max_active, field, totals, fi_total, bucket=False):
    timed = {s: types.SimpleNamespace(total_us=us, samples=[]) for s, us in totals.items()}
    return {"name": name, "max_active": max_active, "bucket": bucket, "field": field,
            "steps": 4, "timed_by_splits": timed, "timed_fi": types.SimpleNamespace(total_us=fi_total, samples=[])}


def test_traces_of_one_operating_point_are_decided_by_their_summed_time():
    from pkv.experiments.calibrate import _SplitSweep

    sweep = _SplitSweep(cfg=None, settings=types.SimpleNamespace(performance_result=True), shape=None, calib=START)
    sweep._swept = [
        # The ragged batch ranks 28 a hair ahead of 24; rows of one length separate them clearly.
        _swept("bimodal_b8", 8, "workqueue_num_splits", {24: 100.2, 28: 100.0, 32: 101.0}, 105.0),
        _swept("homogeneous_b8", 8, "workqueue_num_splits", {24: 200.0, 28: 204.0, 32: 203.0}, 201.0),
        _swept("bimodal_b4", 4, "boundary_num_splits", {32: 90.0, 36: 88.0}, 89.0),
    ]
    points = sweep.operating_points()
    assert points == {"workqueue_num_splits": 24, "boundary_num_splits": 36,
                      "boundary_route": "persistentkv_workqueue"}
    assert sweep.records["homogeneous_b8"]["fitted_with"] == ["bimodal_b8", "homogeneous_b8"]
    assert sweep.records["bimodal_b8"]["selected_splits"] == 24
    assert sweep.records["bimodal_b4"]["boundary_route"]["speedup"] == pytest.approx(89.0 / 88.0)
