"""pkv.report.calibration_report on hand-made calibrations (the CPU DAG test reads a fitted one)."""

from __future__ import annotations

import json

from pkv.policy import Calibration, RegimeParams, save_calibration
from pkv.policy.calibration import LEGACY_SCHEMA
from pkv.report import calibration_report

# The B2-7 gate is the B1 gate and its route FlashInfer.
CALIB = Calibration(gpu="fake", num_sms=4, beta_gbps=100.0, lambda_us=5.0, c_min=1.0,
                    single_row=RegimeParams("persistentkv_bucket", 32, 512, 1.05),
                    few_rows=RegimeParams("flashinfer", 32, 512, 1.50),
                    many_rows=RegimeParams("persistentkv_workqueue", 24, 4096, 1.05),
                    supported_group_sizes=(1, 4))
GATE_CLASSES = {"1024": {"steps": 2, "persistentkv_us": 12.0, "flashinfer_us": 10.0},
                "4096": {"steps": 2, "persistentkv_us": 20.0, "flashinfer_us": 22.0}}
MEASURED = {
    "split_sweeps": {
        "bimodal_b8": {"fits": "regimes.many_rows.num_splits", "selected_splits": 24,
                       "device_us_total_by_splits": {"20": 110.0, "24": 100.0},
                       "flashinfer_device_us_total": 105.0},
        "bimodal_b4": {"fits": "regimes.few_rows.num_splits", "selected_splits": 32,
                       "device_us_total_by_splits": {"32": 100.0}, "flashinfer_device_us_total": 90.0,
                       "regime_route": {"fits": "regimes.few_rows.route", "fitted": "flashinfer",
                                        "applied": True, "speedup": 0.9,
                                        "steps_by_route": {"persistentkv_workqueue S=32": 46,
                                                           "persistentkv_workqueue balanced (132 CTAs)": 20}}}},
    "context_gates": {"regimes.many_rows.min_context_tokens": {
        "regime": "many_rows", "fitted": 4096, "applied": True,
        "reason": "PersistentKV faster in every class measured from 4096", "classes": GATE_CLASSES}},
    "gate_probes": [{"probe": "bimodal_b8 x0.25 G=4", "route": "persistentkv_workqueue", "num_splits": 24,
                     "persistentkv_device_us_total": 50.0, "flashinfer_device_us_total": 60.0,
                     "fits": "regimes.many_rows.min_context_tokens",
                     "steps_by_route": {"persistentkv_workqueue S=24": 5,
                                        "persistentkv_workqueue balanced (396 CTAs)": 3}},
                    {"probe": "bimodal_b8 x1 G=1", "route": "persistentkv_workqueue", "num_splits": 24,
                     "persistentkv_device_us_total": 50.0, "flashinfer_device_us_total": 50.0,
                     "fits": "supported_group_sizes", "steps_by_route": {"persistentkv_workqueue S=24": 8}}],
    "group_sizes": {"probed": [1, 8], "opened": [1], "fitted": [1, 4], "applied": True},
}


def test_report_names_each_choice_and_the_timings_behind_it(tmp_path):
    path = tmp_path / "calibration.json"
    save_calibration(path, CALIB, {"measurements": MEASURED})
    text = calibration_report.report(path)
    assert "B8+ workqueue S=24 from 4096 tokens" in text
    assert "B1 bucket S=32 from 512 tokens" in text and "B2-7 FlashInfer\n" in text
    assert "G routed: 1, 4" in text
    assert "bimodal_b8 -> regimes.many_rows.num_splits: 20: 0.955, 24*: 1.050" in text
    assert ("  B2-7 route flashinfer (0.900x, applied)  (persistentkv_workqueue S=32: 46, "
            "persistentkv_workqueue balanced (132 CTAs): 20)") in text
    assert "B8+   fitted 4096, in use 4096 (applied)" in text
    assert "1024- 0.833, 4096+ 1.100" in text
    assert "bimodal_b8 x0.25 G=4" in text and "1.200" in text and "-> regimes.many_rows.min_context_tokens" in text
    # How many of a probe's steps each rule ran, where the rules split them.
    assert ("-> regimes.many_rows.min_context_tokens  (persistentkv_workqueue S=24: 5, "
            "persistentkv_workqueue balanced (396 CTAs): 3)") in text
    assert "-> supported_group_sizes\n" in text + "\n"
    assert "opened [1]" in text


def test_report_names_the_uniform_cap_and_the_sweep_it_came_from(tmp_path):
    import dataclasses

    path = tmp_path / "calibration.json"
    uniform = {"fits": "uniform_target_ctas", "selected_splits": 4,
               "device_us_total_by_splits": {"4": 250.0, "24": 256.0}, "flashinfer_device_us_total": 255.0,
               "uniform_target_ctas": {"fitted": 256, "regime_splits": 24, "applied": True}}
    measured = {**MEASURED, "split_sweeps": {**MEASURED["split_sweeps"], "homogeneous_b8": uniform}}
    save_calibration(path, dataclasses.replace(CALIB, uniform_target_ctas=256), {"measurements": measured})
    text = calibration_report.report(path)
    assert "uniform batches about 256 workqueue CTAs\nG routed: 1, 4" in text
    assert "homogeneous_b8 -> uniform_target_ctas: 4*: 1.020, 24: 0.996" in text
    assert "  uniform cap 256 CTAs (0: none; the regime's split count is 24), applied" in text


def test_report_names_the_skew_budget_and_its_sweep(tmp_path):
    path = tmp_path / "calibration.json"
    skewed = {"fits": "skew_target_ctas", "steps": 49, "regime_splits": 20, "fixed_device_us_total": 220.0,
              "device_us_total_by_waves": {"1": 210.0, "2": 200.0, "12": 230.0}, "flashinfer_device_us_total": 240.0,
              "skew_target_ctas": {"fitted": 264, "selected_waves": 2, "tied_waves": [2], "selected_at_edge": False,
                                   "speedup_over_fixed": 1.1, "num_sms": 132, "applied": True}}
    measured = {**MEASURED, "split_sweeps": {**MEASURED["split_sweeps"], "skewed_b64": skewed}}
    save_calibration(path, CALIB.with_regime("many_rows", skew_target_ctas=264), {"measurements": measured})
    text = calibration_report.report(path)
    # A file from before the budget was per regime: its record names the field alone.
    assert "B8+ skewed steps balanced over about 264 workqueue CTAs\nG routed: 1, 4" in text
    assert "skewed_b64 -> skew_target_ctas (49 skewed steps): fixed S=20: 1.091, 1w: 1.143, 2w*: 1.200, 12w: 1.043" \
        in text
    assert "  skew budget 264 CTAs (0: the fixed rule; 1.100x the fixed rule at 2 waves of 132 SMs), applied" in text
    assert "over-split" not in text  # a file from before the over-split rule

    # With its over-split steps: their ratios to FlashInfer and whether the rule was opened.
    skewed["fits"] = "regimes.many_rows.skew_target_ctas"
    skewed["over_split_steps"] = {"steps": 15, "fixed_device_us_total": 30.0, "flashinfer_device_us_total": 21.0,
                                  "device_us_total_by_waves": {"1": 21.0, "2": 20.0, "12": 28.0}}
    skewed["over_split_balanced"] = {"fitted": True, "steps": 15, "speedup_over_fixed": 1.5, "applied": True}
    save_calibration(path, CALIB.with_regime("many_rows", skew_target_ctas=264, over_split_balanced=True),
                     {"measurements": measured})
    text = calibration_report.report(path)
    assert "B8+ skewed steps balanced over about 264 workqueue CTAs, over-split steps too" in text
    assert "skewed_b64 -> regimes.many_rows.skew_target_ctas (49 skewed steps): fixed S=20" in text
    assert "  over-split steps (15): fixed S=20: 0.700, 1w: 1.000, 2w*: 1.050, 12w: 0.750" in text
    assert "  over-split rule open (1.500x the fixed rule at the budget, over the regime's skewed traces' " \
           "over-split steps), applied" in text
    skewed["over_split_steps"]["steps"] = 0
    skewed["over_split_balanced"] = {"fitted": False, "steps": 0, "speedup_over_fixed": None, "applied": True}
    save_calibration(path, CALIB.with_regime("many_rows", skew_target_ctas=264), {"measurements": measured})
    assert "  over-split steps: none at S=20, so the over-split rule stays closed" in calibration_report.report(path)


def test_report_names_the_short_row_rule_and_its_sweep(tmp_path):
    path = tmp_path / "calibration.json"
    field = "regimes.single_row.bucket_tiles_per_split"
    short = {"route": "persistentkv_bucket", "fits": field, "steps": 64, "regime_splits": 32,
             "device_us_total_by_tiles": {"1": 120.0, "2": 110.0, "4": 100.0, "3": 105.0},
             "splits_by_tiles": {"1": {"12": 40, "32": 24}, "2": {"4": 40, "32": 24}, "3": {"4": 40, "32": 24},
                                 "4": {"2": 40, "32": 24}},
             field: {"fitted": 4, "selected_tiles": 4, "measured_margin": 1.2, "noise_band": 0.03,
                     "required_margin": 1.03, "applied": True}}
    measured = {**MEASURED, "split_sweeps": {**MEASURED["split_sweeps"], "bucketed_b1 x0.03125 (short rows)": short}}
    save_calibration(path, CALIB.with_regime("single_row", bucket_tiles_per_split=4), {"measurements": measured})
    text = calibration_report.report(path)
    assert "B1 short rows at least 4 tiles a split (fewer splits, a power of two)" in text
    assert ("bucketed_b1 x0.03125 (short rows) -> regimes.single_row.bucket_tiles_per_split (64 steps, the regime's "
            "S=32; over one tile a split): 1: 1.000, 2: 1.091, 3: 1.143, 4*: 1.200") in text
    assert "  splits cut by tiles a split: 1: S=12 on 40, S=32 on 24; 2: S=4 on 40, S=32 on 24;" in text
    assert ("  short-row rule fitted at 4 tiles a split (1: off; 1.200x one tile a split at 4; noise band 3.0%, "
            "needs > 1.030x), applied") in text


def test_report_of_a_file_written_before_the_regimes(tmp_path):
    # Schema /1: the flat calibration, and measurements named by the flat fields they fitted.
    flat = {"gpu": "fake", "num_sms": 4, "beta_gbps": 100.0, "lambda_us": 5.0, "c_min": 1.0,
            "min_context_tokens": 512, "boundary_min_context_tokens": None, "workqueue_min_context_tokens": 4096,
            "workqueue_num_splits": 24, "supported_group_sizes": [1, 4]}
    measured = {
        "split_sweeps": {"bimodal_b8": {**MEASURED["split_sweeps"]["bimodal_b8"], "fits": "workqueue_num_splits"},
                         "bimodal_b4": {"fits": "boundary_num_splits", "selected_splits": 32,
                                        "device_us_total_by_splits": {"32": 100.0},
                                        "flashinfer_device_us_total": 90.0,
                                        "boundary_route": {"fitted": "flashinfer", "applied": True, "speedup": 0.9}}},
        "context_gates": {"workqueue_min_context_tokens": {
            "fitted": 4096, "applied": True, "reason": "PersistentKV faster in every class measured from 4096",
            "classes": GATE_CLASSES}},
    }
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"schema": LEGACY_SCHEMA, "calibration": flat,
                                "provenance": {"measurements": measured}}))
    text = calibration_report.report(path)
    assert "B8+ workqueue S=24 from 4096 tokens" in text
    assert "B1 bucket S=32 from 512 tokens" in text and "B2-7 FlashInfer\n" in text
    assert "bimodal_b8 -> workqueue_num_splits: 20: 0.955, 24*: 1.050" in text
    assert "  B2-7 route flashinfer (0.900x, applied)\n" in text
    assert "B8+   fitted 4096, in use 4096 (applied)" in text and "1024- 0.833, 4096+ 1.100" in text


def test_report_of_a_file_without_measurements(tmp_path, capsys):
    path = tmp_path / "calibration.json"
    save_calibration(path, CALIB, {})
    assert calibration_report.main([str(path)]) == 0
    assert "no measurements recorded" in capsys.readouterr().out


def test_cpu_profile_report_says_why_its_routes_are_configured(tmp_path):
    # The CPU profile keeps conf/gpu/cpu.yaml's routes and gates: CPU times decide nothing. A B1
    # gate past every B1 step measured means no measured B1 step takes the bucket route.
    cpu = Calibration(gpu="cpu", num_sms=2, beta_gbps=30.0, lambda_us=2.7, c_min=64.0,
                      single_row=RegimeParams("persistentkv_bucket", 40, 256, 1.05),
                      few_rows=RegimeParams("flashinfer", 36, 256, 1.50),
                      many_rows=RegimeParams("persistentkv_workqueue", 40, 256, 1.05),
                      supported_group_sizes=(4,))
    b1_gate = {"regime": "single_row", "fitted": 256, "applied": False, "reason": "FlashInfer faster",
               "classes": {"16": {"steps": 2, "persistentkv_us": 3.0, "flashinfer_us": 1.0},
                           "128": {"steps": 2, "persistentkv_us": 3.0, "flashinfer_us": 2.0}}}
    measured = {"performance_result": False,
                "context_gates": {"regimes.single_row.min_context_tokens": b1_gate,
                                  "regimes.many_rows.min_context_tokens": {
                                      **b1_gate, "regime": "many_rows", "classes": GATE_CLASSES}}}
    path = tmp_path / "calibration.json"
    save_calibration(path, cpu, {"measurements": measured})
    assert "in use are the run's conf/gpu file's" in calibration_report.report(path)
    # A GPU's constants tried through the CPU profile (README, "A new GPU"): its own file is named.
    save_calibration(path, cpu, {"measurements": measured, "config": {"gpu": {"gpu": "h200"}}})
    lines = calibration_report.report(path).splitlines()
    assert lines[1].startswith("CPU profile (not a performance model)") and "are conf/gpu/h200.yaml's" in lines[1]
    assert "context gates scaled by the profile's length scale" in lines[1]
    assert lines[2] == "B1 bucket S=40 from 256 tokens"
    assert "past every B1 step measured" in lines[3] and "end at 128 tokens" in lines[3]
    assert lines[4] == "B2-7 FlashInfer" and lines[5] == "B8+ workqueue S=40 from 256 tokens"
    # A GPU calibration reads as before: no profile line.
    gpu = tmp_path / "gpu.json"
    save_calibration(gpu, CALIB, {"measurements": MEASURED})
    assert calibration_report.report(gpu).splitlines()[1] == "B1 bucket S=32 from 512 tokens"


def test_a_tie_of_split_counts_is_shown_with_the_fastest_alone():
    from pkv.report.calibration_report import split_sweeps

    sweep = {**MEASURED["split_sweeps"]["bimodal_b8"], "selected_splits": 24, "fastest_splits": 28,
             "tied_splits": [24, 28]}
    lines = split_sweeps({"bimodal_b8": sweep})
    assert "  tied within noise: 24, 28; the fewest splits taken (fastest alone: 28)" in lines
    assert not any("tied" in line for line in split_sweeps(MEASURED["split_sweeps"]))
    # The configured count taken from a tie, where the calibration records one.
    held = {**sweep, "selected_splits": 28, "tied_splits": [20, 24, 28], "preferred_splits": 28}
    assert ("  tied within noise: 20, 24, 28; the configured count taken (fastest alone: 28)"
            in split_sweeps({"bimodal_b8": held}))


def test_report_names_the_noise_band_a_route_decision_had_to_clear(tmp_path):
    path = tmp_path / "calibration.json"
    route = {"fits": "regimes.few_rows.route", "fitted": "flashinfer", "applied": True, "speedup": 1.0041,
             "measured_margin": 1.0041, "noise_band": 0.0117, "required_margin": 1.0117, "steps": 64}
    b4 = {**MEASURED["split_sweeps"]["bimodal_b4"], "regime_route": route}
    save_calibration(path, CALIB, {"measurements": {**MEASURED, "split_sweeps": {"bimodal_b4": b4}}})
    text = calibration_report.report(path)
    assert "  B2-7 route flashinfer (1.004x; noise band 1.2%, needs > 1.012x, applied)" in text
