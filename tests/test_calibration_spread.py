"""The spread report of repeated calibrations: which decisions agree, how far the constants moved."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from pkv.policy.calibration import load_calibration, save_calibration
from pkv.report.calibration_spread import render_markdown, spread

REFERENCE = "artifacts/reference/h200/calibration.json"


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
