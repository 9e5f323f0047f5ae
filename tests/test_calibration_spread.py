"""The spread report of repeated calibrations: which decisions agree, how far the constants moved."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from pkv.policy.calibration import load_calibration, save_calibration
from pkv.report.calibration_spread import render_markdown, spread

REFERENCE = "artifacts/reference/h200/history/2c0348e_full_dag/calibration.json"


def _variant(tmp_path, name, many_rows_splits=None, lambda_us=None):
    calib = load_calibration(REFERENCE)
    if many_rows_splits is not None:
        calib = calib.with_regime("many_rows", num_splits=many_rows_splits)
    if lambda_us is not None:
        calib = dataclasses.replace(calib, lambda_us=lambda_us)
    path = tmp_path / name
    save_calibration(path, calib, {})
    return path


def test_a_decision_that_moved_is_named_and_the_others_agree(tmp_path):
    first = _variant(tmp_path, "a.json")
    second = _variant(tmp_path, "b.json", many_rows_splits=28, lambda_us=7.0)
    report = spread([first, second])
    by_name = {d["name"]: d for d in report["decisions"]}
    assert not by_name["regimes.many_rows.num_splits"]["agree"]
    assert by_name["regimes.many_rows.num_splits"]["values"][1] == 28
    assert all(d["agree"] for name, d in by_name.items() if name != "regimes.many_rows.num_splits")
    assert {"uniform_target_ctas", "regimes.few_rows.skew_target_ctas", "regimes.many_rows.over_split_balanced"} \
        <= set(by_name)
    lam = next(c for c in report["constants"] if c["name"] == "lambda_us")
    assert lam["rel_spread"] > 0
    text = render_markdown(report)
    assert "Decisions that differ: regimes.many_rows.num_splits" in text and "| **no** |" in text
    # What that does to Table 2: every B8 step the workqueue takes changes split count, B1 none.
    steps = {row["trace"]: row for row in report["steps"]}
    assert steps["bucketed_b1"]["differ"] == [0] and steps["bucketed_b1"]["steps"] == 5 * 64
    assert steps["bimodal_b8"]["differ"][0] > 0
    assert "| bucketed_b1 | 320 | 0 (0%) |" in text


def test_a_skew_budget_that_moved_counts_the_steps_it_moves(tmp_path):
    """Two calibrations alike but for the 8+ rows' skew budget: the skewed trace's steps that take
    the balanced rule differ (its budget), the other traces' steps do not."""
    first = tmp_path / "a.json"
    save_calibration(first, load_calibration(REFERENCE).with_regime("many_rows", skew_target_ctas=396), {})
    second = tmp_path / "b.json"
    save_calibration(second, load_calibration(REFERENCE).with_regime("many_rows", skew_target_ctas=264), {})
    report = spread([first, second])
    by_name = {d["name"]: d for d in report["decisions"]}
    assert by_name["regimes.many_rows.skew_target_ctas"]["values"] == [396, 264]
    steps = {row["trace"]: row for row in report["steps"]}
    assert steps["skewed_b64"]["differ"][0] > 0
    assert steps["bimodal_b8"]["differ"] == [0] and steps["bucketed_b1"]["differ"] == [0]


def test_identical_calibrations_route_every_step_alike(tmp_path):
    report = spread([_variant(tmp_path, "a.json"), _variant(tmp_path, "b.json")])
    assert all(d["agree"] for d in report["decisions"])
    assert all(row["differ"] == [0] for row in report["steps"])
    assert report["performance_result"] and "not a performance result" not in render_markdown(report)


def test_cpu_profile_calibrations_say_their_spread_is_not_a_performance_result(tmp_path):
    paths = []
    for name in ("a.json", "b.json"):
        path = tmp_path / name
        save_calibration(path, load_calibration(REFERENCE), {"measurements": {"performance_result": False}})
        paths.append(path)
    report = spread(paths)
    assert report["performance_result"] is False
    assert render_markdown(report).startswith("**CPU profile: not a performance result.**")


def test_a_missing_file_is_one_refusal_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pkv.report.calibration_spread", REFERENCE, str(tmp_path / "x.json")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("pkv: ") and "x.json" in proc.stderr


def _with_route(tmp_path, name, route, margin, band, **totals):
    """The reference calibration with the B2-7 route ``route``, decided on ``margin`` against ``band``
    (and, where given, both sides' device-time sums)."""
    path = tmp_path / name
    decision = {"value": route, "measured_margin": margin, "noise_band": band, "required_margin": 1 + band,
                "steps": 64, "default": "flashinfer", "basis": "test", "applied": True, **totals}
    save_calibration(path, load_calibration(REFERENCE).with_regime("few_rows", route=route),
                     {"measurements": {"decisions": {"regimes.few_rows.route": decision}}})
    return path


def test_a_flipped_route_shows_each_runs_margin_and_band(tmp_path):
    first = _with_route(tmp_path, "a.json", "persistentkv_workqueue", 1.0153, 0.0121)
    second = _with_route(tmp_path, "b.json", "flashinfer", 1.0041, 0.0117)
    report = spread([first, second])
    route = {d["name"]: d for d in report["decisions"]}["regimes.few_rows.route"]
    assert not route["agree"] and [e["measured_margin"] for e in route["evidence"]] == [1.0153, 1.0041]
    text = render_markdown(report)
    assert ("| regimes.few_rows.route | persistentkv_workqueue: margin 1.015x; band 1.2%, needs > 1.012x | "
            "flashinfer: margin 1.004x; band 1.2%, needs > 1.012x |") in text
    # What that does to Table 2: the bimodal B4 trace's steps move, the B8 trace's do not.
    steps = {row["trace"]: row for row in report["steps"]}
    assert steps["bimodal_b4"]["differ"][0] > 0 and steps["bimodal_b8"]["differ"] == [0]


def test_a_flipped_route_shows_which_side_moved(tmp_path):
    # The workqueue's sum held still; FlashInfer's moved by 2%.
    first = _with_route(tmp_path, "a.json", "flashinfer", 1.0049, 0.01, default_device_us_total=8082.1,
                        candidate_device_us_total=8042.5)
    second = _with_route(tmp_path, "b.json", "persistentkv_workqueue", 1.0250, 0.01, default_device_us_total=8249.3,
                         candidate_device_us_total=8048.4)
    text = render_markdown(spread([first, second]))
    assert ("| regimes.few_rows.route | flashinfer: margin 1.005x; band 1.0%, needs > 1.010x; flashinfer 8,082.1 us, "
            "candidate 8,042.5 us | persistentkv_workqueue: margin 1.025x; band 1.0%, needs > 1.010x; "
            "flashinfer 8,249.3 us, candidate 8,048.4 us |") in text


def test_a_flipped_split_count_shows_each_runs_tied_candidates(tmp_path):
    paths = []
    for name, splits, tied in (("a.json", 24, [24, 28]), ("b.json", 28, [28])):
        decision = {"value": splits, "measured_margin": 1.0, "noise_band": 0.01, "required_margin": 1 / 1.01,
                    "fastest": 28, "tied": tied}
        paths.append(tmp_path / name)
        save_calibration(paths[-1], load_calibration(REFERENCE).with_regime("many_rows", num_splits=splits),
                         {"measurements": {"decisions": {"regimes.many_rows.num_splits": decision}}})
    text = render_markdown(spread(paths))
    assert ("| regimes.many_rows.num_splits | 24: fastest 28; within 1.0% of it: 24, 28 | "
            "28: fastest 28; within 1.0% of it: 28 |") in text


def test_a_flipped_split_count_shows_each_counts_sums_and_how_far_they_moved(tmp_path):
    """The sums a split count was decided on, summed over the traces that fit it (a trace fitting
    another decision left out), over the counts every such trace swept, in each calibration."""
    paths = []
    runs = (("a.json", 24, {"24": 100.0, "28": 101.0, "32": 104.0}, {"24": 50.0, "28": 50.5}),
            ("b.json", 28, {"24": 103.0, "28": 100.0, "32": 104.0}, {"24": 50.0, "28": 50.0}))
    for name, splits, bimodal, uniform in runs:
        sweeps = {"bimodal_b8": {"fits": "regimes.many_rows.num_splits", "device_us_total_by_splits": bimodal},
                  "zipf_b8": {"fits": "regimes.many_rows.num_splits", "device_us_total_by_splits": uniform},
                  "homogeneous_b8": {"fits": "uniform_target_ctas", "device_us_total_by_splits": {"24": 9e9}}}
        paths.append(tmp_path / name)
        save_calibration(paths[-1], load_calibration(REFERENCE).with_regime("many_rows", num_splits=splits),
                         {"measurements": {"split_sweeps": sweeps}})
    report = spread(paths)
    (moved,) = [d for d in report["decisions"] if d["name"] == "regimes.many_rows.num_splits"]
    assert moved["split_totals"] == [{24: 150.0, 28: 151.5}, {24: 153.0, 28: 150.0}]
    text = render_markdown(report)
    assert "| regimes.many_rows.num_splits | 24 | 28 |\n|---|---:|---:|\n| [1] | 150.0 | 151.5 |" in text
    assert "| [2] | 153.0 | 150.0 |\n| spread / mean | 2.0% | 1.0% |\n\n" in text  # no per-step times kept


def test_a_flipped_split_count_shows_how_far_its_median_step_moved(tmp_path):
    """Where the calibrations kept each step's time, the median over the same steps of how far each
    step moved between them, beside how far the sum moved."""
    paths = []
    runs = (("a.json", 24, {"24": [10.0, 20.0, 30.0, 40.0], "28": [10.0, 20.0, 30.0, 40.0]}),
            ("b.json", 28, {"24": [11.0, 20.0, 30.0, 44.0], "28": [10.0, 20.0, 30.0, 40.0]}))
    for name, splits, by_step in runs:
        totals = {k: sum(v) for k, v in by_step.items()}
        sweeps = {"bimodal_b8": {"fits": "regimes.many_rows.num_splits", "device_us_total_by_splits": totals,
                                 "device_us_by_step": {**by_step, "flashinfer": [1.0] * 4}}}
        paths.append(tmp_path / name)
        save_calibration(paths[-1], load_calibration(REFERENCE).with_regime("many_rows", num_splits=splits),
                         {"measurements": {"split_sweeps": sweeps}})
    report = spread(paths)
    (moved,) = [d for d in report["decisions"] if d["name"] == "regimes.many_rows.num_splits"]
    assert moved["split_step_times"][1] == {24: [11.0, 20.0, 30.0, 44.0], 28: [10.0, 20.0, 30.0, 40.0]}
    text = render_markdown(report)
    # 24: steps moved 1/10.5, 0, 0, 4/42 (median 4.8%); the sum 5/102.5.
    assert "| spread / mean | 4.9% | 0.0% |\n| median step's spread / mean | 4.8% | 0.0% |" in text


def test_a_flipped_group_size_shows_each_probes_margin_and_interval(tmp_path):
    paths = []
    for name, groups, margin, half in (("a.json", (4,), 0.977, 0.004), ("b.json", (1, 4), 0.982, None)):
        decision = {"value": list(groups), "noise_band": 0.02, "required_margin": 1 / 1.02,
                    "by_group": {"1": {"measured_margin": margin, "interval_half_width": half, "opened": 1 in groups}}}
        paths.append(tmp_path / name)
        calib = dataclasses.replace(load_calibration(REFERENCE), supported_group_sizes=groups)
        save_calibration(paths[-1], calib, {"measurements": {"decisions": {"supported_group_sizes": decision}}})
    text = render_markdown(spread(paths))
    assert "| supported_group_sizes | 4: G=1 0.977x ± 0.4% (closed); band 2.0% | 1, 4: G=1 0.982x; band 2.0% |" in text


def test_a_flipped_group_size_shows_which_side_of_its_worst_probe_moved(tmp_path):
    paths = []
    for name, groups, fi_us, pick in (("a.json", (1, 4), 4805.6, "holistic"), ("b.json", (4,), 4048.5, "cc")):
        worst = {"measured_margin": fi_us / 4116.0, "interval_half_width": 0.001, "opened": 1 in groups,
                 "probe": "bucketed_b1 x1 G=1", "flashinfer_device_us_total": fi_us,
                 "persistentkv_device_us_total": 4116.0, "flashinfer_picks": {"B1 32768": pick}}
        decision = {"value": list(groups), "noise_band": 0.02, "required_margin": 1 / 1.02, "by_group": {"1": worst}}
        paths.append(tmp_path / name)
        calib = dataclasses.replace(load_calibration(REFERENCE), supported_group_sizes=groups)
        save_calibration(paths[-1], calib, {"measurements": {"decisions": {"supported_group_sizes": decision}}})
    text = render_markdown(spread(paths))
    assert ("1, 4: G=1 1.168x ± 0.1% (bucketed_b1 x1 G=1: FlashInfer 4,805.6 us on B1 32768 holistic, "
            "PersistentKV 4,116.0 us); band 2.0%") in text
    assert "(bucketed_b1 x1 G=1: FlashInfer 4,048.5 us on B1 32768 cc, PersistentKV 4,116.0 us)" in text


def test_a_file_from_before_the_decisions_were_recorded_still_compares(tmp_path):
    """A pkv.calibration/3 file without measurements.decisions: the B2-7 route's margin from its split
    sweep, its band not recorded; any other decision not recorded."""
    old = tmp_path / "old.json"
    sweep = {"bimodal_b4": {"regime_route": {"fits": "regimes.few_rows.route", "fitted": "persistentkv_workqueue",
                                             "applied": True, "speedup": 1.0229}}}
    save_calibration(old, load_calibration(REFERENCE).with_regime("few_rows", route="persistentkv_workqueue")
                     .with_regime("many_rows", num_splits=28), {"measurements": {"split_sweeps": sweep}})
    new = _with_route(tmp_path, "new.json", "flashinfer", 1.0041, 0.0117)
    text = render_markdown(spread([old, new]))
    assert "| regimes.few_rows.route | persistentkv_workqueue: margin 1.023x; band not recorded |" in text
    assert "| regimes.many_rows.num_splits | 28: not recorded |" in text


def test_classes_whose_flashinfer_pick_differs_are_listed_with_each_paths_probe(tmp_path):
    paths = []
    for name, pick, holistic_us in (("a.json", "cc", 78.2), ("b.json", "holistic", 66.8)):
        probed = [{"batch": 4, "longest_pow2": 16384, "picked": pick,
                   "measured": {"cc": {"device_us": 75.4, "plan_us": 400.0},
                                "holistic": {"device_us": holistic_us, "plan_us": 410.0}}},
                  {"batch": 8, "longest_pow2": 65536, "picked": "tc",
                   "measured": {"tc": {"device_us": 355.0, "plan_us": 300.0}}}]
        paths.append(tmp_path / name)
        save_calibration(paths[-1], load_calibration(REFERENCE),
                         {"measurements": {"flashinfer_paths": {"paths": {}, "probed": probed}}})
    text = render_markdown(spread(paths))
    assert "| B4 16384 | cc (cc 75.4, holistic 78.2 us) | holistic (cc 75.4, holistic 66.8 us) |" in text
    assert "B8 65536" not in text  # the same pick in both
    same = render_markdown(spread([paths[0], paths[0]]))
    assert "FlashInfer's probes picked the same path for every batch class in all (2 classes" in same
