"""`python -m pkv.experiments.routes`: the calibrated policy's route for each step of a trace, on the CPU."""

import json
from pathlib import Path

import pytest

from pkv.experiments import routes
from pkv.policy.choose import is_skewed

H100_REFERENCE = Path(__file__).resolve().parents[1] / "artifacts/reference/h100"
# A calibration that routes batches of 2-7 rows to the workqueue (the set of 487846a, kept in
# history), and the reference set's own, whichever way it routes them.
H100_CALIBRATION = str(H100_REFERENCE / "history/487846a/calibration/calibration.json")
REFERENCE_CALIBRATION = H100_REFERENCE / "calibration/calibration.json"


def _replay(tmp_path, *overrides, all_steps=False):
    out = tmp_path / "routes.json"
    argv = [*overrides, "--json", str(out)] + (["--all-steps"] if all_steps else [])
    assert routes.main(argv) == 0
    return json.loads(out.read_text())


def test_skewed_steps_take_the_balanced_rule_and_the_others_do_not(tmp_path, capsys):
    # The H100 calibration gives B2-7 steps one row dominates the balanced rule (its few_rows
    # skew budget); bimodal B4 has both kinds of step.
    replay = _replay(tmp_path, "trace=bimodal", "trace.max_active=4", "gpu=h100", f"calibration={H100_CALIBRATION}")
    steps = replay["steps"]
    assert len(steps) == 68  # the evaluate experiment's warm-up and measured steps
    assert sum(row["steps"] for row in replay["counts"]) == len(steps)
    skewed = [is_skewed(s["batch"], s["max_len"], s["tokens"]) for s in steps]
    assert any(skewed) and not all(skewed)
    for step, is_skew in zip(steps, skewed):
        assert ("balanced" in step["route"]) == is_skew, step
        assert step["route"].startswith("PersistentKV workqueue, split 32") and step["basis"] == "estimate"
    printed = capsys.readouterr().out
    assert printed.startswith(f"bimodal_b4, seed 20260623, 68 steps; policy from {H100_CALIBRATION}")
    assert printed.splitlines()[1] == routes.rows_line(steps)
    assert replay["provenance"]["seed"] == 20260623


def test_the_rows_line_counts_steps_by_rows_with_their_longest_rows():
    steps = [{"batch": 1, "max_len": 375}, {"batch": 3, "max_len": 7447}, {"batch": 1, "max_len": 410},
             {"batch": 3, "max_len": 134}]
    assert routes.rows_line(steps) == ("rows: B1 on 2 (longest row 375-410 tokens); "
                                       "B3 on 2 (longest row 134-7447 tokens)")


def test_a_regime_calibrated_to_flashinfer_sends_every_step_there(tmp_path):
    calibration = json.loads(REFERENCE_CALIBRATION.read_text())["calibration"]
    if calibration["regimes"]["few_rows"]["route"] != "flashinfer":
        pytest.skip("the reference calibration routes batches of 2-7 rows to PersistentKV")
    replay = _replay(tmp_path, "trace=bimodal", "trace.max_active=4", "gpu=h100",
                     f"calibration={REFERENCE_CALIBRATION}")
    multi_row = [s for s in replay["steps"] if 2 <= s["batch"] <= 7]
    assert multi_row and all(s["route"] == "FlashInfer" and s["basis"] == "gate: regime" for s in multi_row)


def test_all_steps_replays_past_the_timed_steps(tmp_path):
    timed = _replay(tmp_path, "trace=bimodal", "gpu=h100", f"calibration={H100_CALIBRATION}",
                    "experiment=model_step")
    whole = _replay(tmp_path, "trace=bimodal", "gpu=h100", f"calibration={H100_CALIBRATION}",
                    "experiment=model_step", all_steps=True)
    assert len(timed["steps"]) == 36 < len(whole["steps"])
    assert whole["steps"][:36] == timed["steps"]


def test_a_missing_calibration_is_refused_naming_the_field(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        routes.exit_on_refusal(lambda: routes.main(["trace=bimodal", "gpu=h100",
                                                    f"calibration={tmp_path / 'none.json'}"]))
    assert exit_info.value.code == 2
    assert "field 'calibration'" in capsys.readouterr().err


def test_overrides_keep_the_callers_device_and_out():
    assert routes._overrides(["trace=bimodal"]) == ["trace=bimodal", "device=cpu", "out=unused"]
    assert routes._overrides(["device=cuda", "out=/tmp/o"]) == ["device=cuda", "out=/tmp/o"]


def test_the_runs_engine_options_reach_the_policy(tmp_path):
    # engine.merge is a kernel variant every PersistentKV route of the run carries.
    replay = _replay(tmp_path, "trace=bucketed", "trace.max_active=1", "gpu=h100", f"calibration={H100_CALIBRATION}",
                     "engine.merge=fused")
    assert {s["route"] for s in replay["steps"]} == {"PersistentKV bucket, split 16, fused merge"}
