"""The calibration record: regimes, both mapping forms, the file, and the conf/gpu options."""

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from pkv.policy import Calibration, CalibrationError, RegimeParams, load_calibration, save_calibration
from pkv.policy.calibration import LEGACY_FIELDS
from pkv.policy.regime import regime_of
from policy_constants import PAPER

CONF_GPU = Path(__file__).resolve().parents[1] / "conf" / "gpu"
REFERENCE = Path(__file__).resolve().parents[1] / "artifacts" / "reference" / "h200"


def test_paper_defaults_fill_every_regime():
    assert PAPER.single_row == RegimeParams("persistentkv_bucket", 32, 16384, 1.05)
    assert PAPER.few_rows == RegimeParams("flashinfer", 32, 16384, 1.5)
    assert PAPER.many_rows == RegimeParams("persistentkv_workqueue", 20, 16384, 1.05)


def test_mapping_round_trip():
    calib = dataclasses.replace(PAPER, supported_group_sizes=(4, 8), workqueue_split_kind="balanced")
    calib = calib.with_regime("few_rows", route="persistentkv_workqueue", num_splits=36)
    d = calib.to_json_dict()
    assert d["supported_group_sizes"] == [4, 8] and set(d["regimes"]) == {"single_row", "few_rows", "many_rows"}
    assert json.loads(json.dumps(d)) == d
    assert Calibration.from_mapping(d, "mem") == calib


def test_legacy_flat_mapping_lands_in_the_regimes():
    flat = {"gpu": "x", "num_sms": 4, "beta_gbps": 10.0, "lambda_us": 1.0, "c_min": 1.0, "min_context_tokens": 512,
            "boundary_min_context_tokens": None, "workqueue_min_context_tokens": 4096, "b8_margin": 1.2,
            "b4_margin": 1.7, "bucket_num_splits": 36, "workqueue_num_splits": 28, "boundary_num_splits": 24,
            "boundary_route": "persistentkv_workqueue"}
    calib = Calibration.from_mapping(flat, "old.json")
    # b8_margin governed B1 as well as 8+ rows; a null gate meant the B1 gate.
    assert calib.single_row == RegimeParams("persistentkv_bucket", 36, 512, 1.2)
    assert calib.few_rows == RegimeParams("persistentkv_workqueue", 24, 512, 1.7)
    assert calib.many_rows == RegimeParams("persistentkv_workqueue", 28, 4096, 1.2)
    assert set(LEGACY_FIELDS) <= set(flat)
    with pytest.raises(CalibrationError, match=r"old\.json: field boundary_route='persistentkv_bucket'"):
        Calibration.from_mapping({**flat, "boundary_route": "persistentkv_bucket"}, "old.json")


def test_a_skew_budget_written_for_every_regime_lands_in_each():
    """Files written while the skew budget was one top-level value (the H200 run at 23e2ed0) load
    with it in every regime, as the policy applied it; a file that sets it both ways is refused, and
    files without the balanced rule's parameters load with the rule off."""
    path = REFERENCE / "history" / "calibration_full_config_23e2ed0.json"
    assert load_calibration(path).few_rows.skew_target_ctas == 396  # schema pkv.calibration/2
    old = json.loads(path.read_text())["calibration"]
    assert old["skew_target_ctas"] == 396 and "skew_target_ctas" not in old["regimes"]["many_rows"]
    calib = Calibration.from_mapping(old, "old.json")
    assert [calib.regime(r).skew_target_ctas for r in ("single_row", "few_rows", "many_rows")] == [396] * 3
    assert not calib.many_rows.over_split_balanced
    both = {**old, "regimes": {**old["regimes"], "few_rows": {**old["regimes"]["few_rows"], "skew_target_ctas": 264}}}
    with pytest.raises(CalibrationError, match=r"old\.json: field skew_target_ctas=396: set per regime "
                                               r"\(regimes\.few_rows\.skew_target_ctas\)"):
        Calibration.from_mapping(both, "old.json")
    d = PAPER.to_json_dict()
    assert d["regimes"]["many_rows"]["skew_target_ctas"] == 0 and "skew_target_ctas" not in d
    for params in d["regimes"].values():
        del params["skew_target_ctas"], params["over_split_balanced"]
    assert Calibration.from_mapping(d, "mem") == PAPER


def test_file_round_trip_is_atomic(tmp_path):
    path = tmp_path / "calibration" / "calibration.json"
    save_calibration(path, PAPER, {"seed": 20260622, "git_commit": "abc"})
    assert load_calibration(path) == PAPER
    record = json.loads(path.read_text())
    assert record["schema"] == "pkv.calibration/3"
    assert record["provenance"]["seed"] == 20260622
    assert [p.name for p in path.parent.iterdir()] == ["calibration.json"]
    assert path.stat().st_mode & 0o044 == 0o044  # readable by the group and others under umask 0022
    save_calibration(path, dataclasses.replace(PAPER, c_min=2.5), {})
    assert load_calibration(path).c_min == 2.5


def test_save_refuses_non_json_provenance_and_keeps_old_file(tmp_path):
    path = tmp_path / "calibration.json"
    save_calibration(path, PAPER, {})
    with pytest.raises(ValueError):
        save_calibration(path, PAPER, {"bad": float("nan")})
    assert load_calibration(path) == PAPER
    assert [p.name for p in tmp_path.iterdir()] == ["calibration.json"]


@pytest.mark.parametrize("path", sorted(REFERENCE.rglob("calibration*.json")), ids=lambda p: p.parent.name)
def test_every_reference_calibration_still_loads(path):
    calib = load_calibration(path)
    assert calib.gpu == "h200" and calib.single_row.route == "persistentkv_bucket"


@pytest.mark.parametrize(
    "patch, words",
    [
        ({"c_mni": 4.0}, ["where.yaml", "'c_mni'", "4.0"]),
        ({"num_sms": "28"}, ["where.yaml", "num_sms", "'28'"]),
        ({"num_sms": True}, ["where.yaml", "num_sms", "True"]),
        ({"beta_gbps": -1.0}, ["where.yaml", "beta_gbps", "-1.0"]),
        ({"beta_gbps": float("inf")}, ["where.yaml", "beta_gbps", "inf"]),
        ({"workqueue_split_kind": "greedy"}, ["where.yaml", "workqueue_split_kind", "'greedy'"]),
        ({"supported_group_sizes": []}, ["where.yaml", "supported_group_sizes", "[]"]),
        ({"supported_group_sizes": [4, "8"]}, ["where.yaml", "supported_group_sizes", "'8'"]),
        ({"regimes": {"single_row": {}}}, ["where.yaml", "regimes", "single_row"]),
    ],
)
def test_mapping_errors_name_where_key_and_value(patch, words):
    d = PAPER.to_json_dict()
    d.update(patch)
    with pytest.raises(CalibrationError) as err:
        Calibration.from_mapping(d, "where.yaml")
    assert isinstance(err.value, ValueError)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("param, value, words", [
    ("num_splits", 0, ["regimes.many_rows", "num_splits=0"]),
    ("min_context_tokens", "4096", ["regimes.many_rows", "min_context_tokens='4096'"]),
    ("margin", -1.0, ["regimes.many_rows", "margin=-1.0"]),
    ("route", "sdpa", ["regimes.many_rows", "route='sdpa'"]),
    ("splits", 4, ["regimes.many_rows", "unknown key 'splits'"]),
])
def test_regime_errors_name_the_regime_field_and_value(param, value, words):
    d = PAPER.to_json_dict()
    d["regimes"]["many_rows"][param] = value
    with pytest.raises(CalibrationError) as err:
        Calibration.from_mapping(d, "where.yaml")
    for word in ["where.yaml", *words]:
        assert word in str(err.value)


def test_mapping_missing_required_key():
    d = PAPER.to_json_dict()
    del d["lambda_us"]
    with pytest.raises(CalibrationError, match=r"where\.yaml: missing required key\(s\) lambda_us"):
        Calibration.from_mapping(d, "where.yaml")


def test_load_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CalibrationError, match="bad.json"):
        load_calibration(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"schema": "pkv.result/1"}))
    with pytest.raises(CalibrationError, match=r"wrong\.json.*schema='pkv\.result/1'"):
        load_calibration(wrong)
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"schema": "pkv.calibration/2", "calibration": {**PAPER.to_json_dict(), "lamda_us": 1}}))
    with pytest.raises(CalibrationError, match=r"typo\.json: calibration: unknown key 'lamda_us'"):
        load_calibration(typo)
    with pytest.raises(CalibrationError, match="is a folder"):
        load_calibration(tmp_path)
    latin = tmp_path / "latin.json"
    latin.write_bytes('{"schema": "caf\xe9"}'.encode("latin-1"))
    with pytest.raises(CalibrationError, match=r"latin\.json: not UTF-8"):
        load_calibration(latin)


@pytest.mark.parametrize("gpu", sorted(p.stem for p in CONF_GPU.glob("*.yaml")))
def test_gpu_configs_hold_exactly_the_calibration_fields(gpu):
    path = CONF_GPU / f"{gpu}.yaml"
    d = yaml.safe_load(path.read_text())
    regimes = {"single_row", "few_rows", "many_rows"}
    assert set(d) == {f.name for f in dataclasses.fields(Calibration)} - regimes | {"regimes"}
    assert set(d["regimes"]) == regimes
    calib = Calibration.from_mapping(d, str(path))
    assert calib.gpu == gpu


def test_rtx3060_config_holds_the_paper_constants():
    calib = Calibration.from_mapping(yaml.safe_load((CONF_GPU / "rtx3060.yaml").read_text()), "rtx3060")
    assert (calib.num_sms, calib.beta_gbps, calib.lambda_us, calib.c_min) == (28, 331.2, 8.19, 4.0)
    assert calib.single_row == PAPER.single_row and calib.few_rows == PAPER.few_rows
    assert calib.many_rows == PAPER.many_rows


def test_regime_lookup():
    assert [PAPER.regime(regime_of(b)).route for b in (1, 2, 7, 8, 64)] == [
        "persistentkv_bucket", "flashinfer", "flashinfer", "persistentkv_workqueue", "persistentkv_workqueue"]
    with pytest.raises(ValueError, match="unknown regime"):
        PAPER.regime("b4")


def test_a_calibrations_profile_is_read_from_its_config_then_its_measurements_then_its_source():
    from pkv.policy.calibration import recorded_profile

    assert recorded_profile({"provenance": {"config": {"profile": "gpu"},
                                            "measurements": {"performance_result": False}}}) == "gpu"
    assert recorded_profile({"provenance": {"measurements": {"performance_result": False}}}) == "cpu"
    assert recorded_profile({"provenance": {"measurements": {"performance_result": True}}}) == "gpu"
    assert recorded_profile({"calibration": {"source": "calibrate rule: seed 1, profile cpu (not ...)"}}) == "cpu"
    assert recorded_profile({"calibration": {"source": "config"}, "provenance": None}) is None
    assert recorded_profile({}) is None
