"""Cost model: calibration files, the T_r estimate, and fitting C_min and lambda."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from pkv.cost_model import (
    ROUTES,
    Calibration,
    CalibrationError,
    CostSample,
    RouteEstimator,
    estimate_route_us,
    fit_c_min,
    fit_lambda,
    load_calibration,
    save_calibration,
)
from pkv.pipeline.step import build_step

CONF_GPU = Path(__file__).resolve().parents[1] / "conf" / "gpu"
SHAPE = dict(num_kv_heads=8, group_size=4, head_dim=128)
PAPER = Calibration(gpu="rtx3060", num_sms=28, beta_gbps=331.2, lambda_us=8.19, c_min=4.0)


def make_step(seq_lens, page_size=16):
    lens = np.asarray(seq_lens, dtype=np.int64)
    pages = -(-lens // page_size)
    starts = np.concatenate(([0], np.cumsum(pages)[:-1]))
    page_lists = [np.arange(s, s + n, dtype=np.int32) for s, n in zip(starts, pages)]
    return build_step(0, np.arange(lens.size), lens, page_lists, page_size)


# ---------------------------------------------------------------- calibration records


def test_mapping_round_trip():
    calib = dataclasses.replace(PAPER, supported_group_sizes=(4, 8), workqueue_split_kind="balanced")
    d = calib.to_json_dict()
    assert d["supported_group_sizes"] == [4, 8]
    assert json.loads(json.dumps(d)) == d
    assert Calibration.from_mapping(d, "mem") == calib


def test_file_round_trip_is_atomic(tmp_path):
    path = tmp_path / "calibration" / "calibration.json"
    save_calibration(path, PAPER, {"seed": 20260622, "git_commit": "abc"})
    assert load_calibration(path) == PAPER
    record = json.loads(path.read_text())
    assert record["schema"] == "pkv.calibration/1"
    assert record["provenance"]["seed"] == 20260622
    assert [p.name for p in path.parent.iterdir()] == ["calibration.json"]
    save_calibration(path, dataclasses.replace(PAPER, c_min=2.5), {})
    assert load_calibration(path).c_min == 2.5


def test_save_refuses_non_json_provenance_and_keeps_old_file(tmp_path):
    path = tmp_path / "calibration.json"
    save_calibration(path, PAPER, {})
    with pytest.raises(ValueError):
        save_calibration(path, PAPER, {"bad": float("nan")})
    assert load_calibration(path) == PAPER
    assert [p.name for p in tmp_path.iterdir()] == ["calibration.json"]


@pytest.mark.parametrize(
    "patch, words",
    [
        ({"c_mni": 4.0}, ["where.yaml", "'c_mni'", "4.0"]),
        ({"num_sms": "28"}, ["where.yaml", "num_sms", "'28'"]),
        ({"num_sms": True}, ["where.yaml", "num_sms", "True"]),
        ({"beta_gbps": -1.0}, ["where.yaml", "beta_gbps", "-1.0"]),
        ({"workqueue_split_kind": "greedy"}, ["where.yaml", "workqueue_split_kind", "'greedy'"]),
        ({"supported_group_sizes": []}, ["where.yaml", "supported_group_sizes", "[]"]),
        ({"supported_group_sizes": [4, "8"]}, ["where.yaml", "supported_group_sizes", "'8'"]),
        ({"bucket_num_splits": 0}, ["where.yaml", "bucket_num_splits", "0"]),
        ({"boundary_min_context_tokens": -1}, ["where.yaml", "boundary_min_context_tokens", "-1"]),
        ({"workqueue_min_context_tokens": "4096"}, ["where.yaml", "workqueue_min_context_tokens", "'4096'"]),
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
    typo.write_text(json.dumps({"schema": "pkv.calibration/1", "calibration": {**PAPER.to_json_dict(), "lamda_us": 1}}))
    with pytest.raises(CalibrationError, match=r"typo\.json: calibration: unknown key 'lamda_us'"):
        load_calibration(typo)


@pytest.mark.parametrize("gpu", ["cpu", "rtx3060", "h200"])
def test_gpu_configs_hold_exactly_the_calibration_fields(gpu):
    path = CONF_GPU / f"{gpu}.yaml"
    d = yaml.safe_load(path.read_text())
    assert set(d) == {f.name for f in dataclasses.fields(Calibration)}
    calib = Calibration.from_mapping(d, str(path))
    assert calib.gpu == gpu


def test_rtx3060_config_holds_the_paper_constants():
    calib = Calibration.from_mapping(yaml.safe_load((CONF_GPU / "rtx3060.yaml").read_text()), "rtx3060")
    assert (calib.num_sms, calib.beta_gbps, calib.lambda_us, calib.c_min) == (28, 331.2, 8.19, 4.0)
    assert (calib.b8_margin, calib.b4_margin, calib.min_context_tokens) == (1.05, 1.5, 16384)


# ---------------------------------------------------------------- estimates


def test_flashinfer_b1_estimate_by_hand():
    n = 32768
    est = estimate_route_us("flashinfer", make_step([n]), PAPER, **SHAPE)
    kv_bytes = n * 8 * 128 * 2 * 2
    ctas_per_sm = 8 / 28  # one CTA per (row, KV head): far below C_min = 4
    assert est.kv_bytes == kv_bytes
    assert est.occupancy_factor == pytest.approx(4 / ctas_per_sm)
    assert est.launches == 1 and est.merge_bytes == 0
    expected = kv_bytes / 331.2e3 * (4 / ctas_per_sm) + 8.19
    assert est.total_us == pytest.approx(expected)
    assert est.num_splits == 0


def test_bucket_b1_estimate_by_hand():
    n = 32768
    est = estimate_route_us("persistentkv_bucket", make_step([n]), PAPER, **SHAPE)
    kv_bytes = n * 8 * 128 * 2 * 2
    merge_bytes = 8 * 32 * 4 * 130 * 4  # 256 slots
    assert est.num_splits == 32 and est.launches == 2
    assert est.ctas_per_sm == pytest.approx(256 / 28)
    assert est.occupancy_factor == 1.0
    assert est.merge_bytes == merge_bytes
    assert est.total_us == pytest.approx(kv_bytes / 331.2e3 + 2 * 8.19 + merge_bytes / 331.2e3)
    assert est.total_us == pytest.approx(est.kv_us + est.launch_us + est.merge_us + est.plan_us)


def test_split_override_and_flashinfer_plan_time():
    step = make_step([20000, 30000])
    calib = dataclasses.replace(PAPER, flashinfer_plan_us=12.5)
    wq4 = estimate_route_us("persistentkv_workqueue", step, calib, **SHAPE, num_splits=4)
    wq20 = estimate_route_us("persistentkv_workqueue", step, calib, **SHAPE)
    assert (wq4.num_splits, wq20.num_splits) == (4, 20)
    assert wq4.ctas_per_sm == pytest.approx(2 * 8 * 4 / 28)
    assert wq4.occupancy_factor == pytest.approx(4 / (64 / 28))
    fi = estimate_route_us("flashinfer", step, calib, **SHAPE)
    assert fi.plan_us == 12.5 and wq20.plan_us == 0.0
    with pytest.raises(ValueError, match="route"):
        estimate_route_us("sdpa", step, calib, **SHAPE)


@pytest.mark.parametrize("kind", ["fixed", "balanced"])
def test_route_estimator_matches_estimate_route_us(kind):
    calib = dataclasses.replace(PAPER, workqueue_split_kind=kind, flashinfer_plan_us=7.0,
                                flashinfer_ctas_per_row_head=1.5)
    estimator = RouteEstimator(calib, **SHAPE)
    rng = np.random.default_rng(11)
    for _ in range(20):
        lens = rng.integers(1, 70000, size=int(rng.integers(1, 12)))
        lens[: int(rng.integers(0, lens.size))] = lens[0]  # repeated lengths share a bucket
        step = make_step(lens)
        routes = {route: (None if rng.random() < 0.5 else int(rng.integers(1, 40))) for route in ROUTES}
        totals = estimator.totals_us(step, routes)
        for route, splits in routes.items():
            expected = estimate_route_us(route, step, calib, **SHAPE, num_splits=splits).total_us
            assert totals[route] == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------- fitting


def synthetic_samples(truth, rng=None, noise=0.0):
    """Measured times generated from known constants over routes, batches and split counts."""
    samples = []
    for lens in ([8192], [32768], [65536], [16384, 40000, 9000, 30000], [8192 + 37 * i for i in range(8)]):
        step = make_step(lens)
        routes = [("flashinfer", None)]
        routes += [("persistentkv_bucket", s) for s in (1, 2, 4, 8, 16, 32)]
        routes += [("persistentkv_workqueue", s) for s in (1, 2, 4, 20)]
        for route, splits in routes:
            t = estimate_route_us(route, step, truth, **SHAPE, num_splits=splits).total_us
            if noise:
                t *= 1.0 + noise * rng.standard_normal()
            samples.append(CostSample(route, step, t, splits))
    return samples


def test_fit_recovers_known_constants():
    truth = dataclasses.replace(PAPER, c_min=4.0, lambda_us=8.19)
    samples = synthetic_samples(truth)
    start = dataclasses.replace(PAPER, c_min=1.0, lambda_us=0.0)
    fit = fit_c_min(samples, start, **SHAPE)
    assert fit.c_min == 4.0
    assert fit.lambda_us == pytest.approx(8.19, rel=1e-9)
    assert fit.rms_rel_error < 1e-12
    assert fit.num_samples == len(samples)
    assert fit_lambda(samples, start, **SHAPE, c_min=4.0) == pytest.approx(8.19, rel=1e-9)


def test_fit_recovers_other_constants_under_noise():
    truth = Calibration(gpu="h200", num_sms=132, beta_gbps=4256.0, lambda_us=4.5, c_min=6.0)
    samples = synthetic_samples(truth, np.random.default_rng(20260622), noise=0.01)
    start = dataclasses.replace(truth, c_min=1.0, lambda_us=20.0)
    fit = fit_c_min(samples, start, **SHAPE)
    assert abs(fit.c_min - 6.0) <= 0.5
    assert fit.lambda_us == pytest.approx(4.5, rel=0.1)
    assert 0.002 < fit.rms_rel_error < 0.03


def test_fit_with_lambda_held_fixed():
    truth = dataclasses.replace(PAPER, c_min=2.75)
    fit = fit_c_min(synthetic_samples(truth), truth, **SHAPE, refit_lambda=False)
    assert fit.c_min == 2.75 and fit.lambda_us == truth.lambda_us


def test_fit_rejects_bad_samples():
    with pytest.raises(ValueError, match="at least one"):
        fit_c_min([], PAPER, **SHAPE)
    with pytest.raises(ValueError, match=r"samples\[0\]\.measured_us=-1\.0"):
        fit_lambda([("flashinfer", make_step([100]), -1.0)], PAPER, **SHAPE)
    with pytest.raises(ValueError, match="grid"):
        fit_c_min([("flashinfer", make_step([100]), 5.0)], PAPER, **SHAPE, grid=[])


def test_routes_are_the_three_candidates():
    assert ROUTES == ("flashinfer", "persistentkv_bucket", "persistentkv_workqueue")


# ---------------------------------------------------------------- the context gate


def test_context_gate_opens_where_persistentkv_wins_every_longer_class():
    from pkv.cost_model import context_class, fit_context_gate

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


def test_each_batch_regime_reads_its_own_context_gate():
    calib = dataclasses.replace(PAPER, min_context_tokens=8192, boundary_min_context_tokens=2048,
                                workqueue_min_context_tokens=4096)
    assert [calib.context_gate(b) for b in (1, 2, 7, 8, 64)] == [8192, 2048, 2048, 4096, 4096]
    # Calibrations written before the per-regime fit hold one gate for every batch size.
    old = PAPER.to_json_dict()
    del old["boundary_min_context_tokens"], old["workqueue_min_context_tokens"]
    loaded = Calibration.from_mapping(old, "old.json")
    assert [loaded.context_gate(b) for b in (1, 4, 8)] == [PAPER.min_context_tokens] * 3


def test_context_gate_tolerance_lets_a_tie_hold():
    from pkv.cost_model import fit_context_gate

    # 8K: PersistentKV 1.5% slower; 16K: faster.
    args = ([8200, 17000], [10.15, 20.0], [10.0, 25.0], 4096)
    assert fit_context_gate(*args).min_context_tokens == 16384
    fit = fit_context_gate(*args, tolerance=0.02)
    assert fit.min_context_tokens == 8192 and "within 2%" in fit.reason
    # Losing the longest class by more than the tolerance moves the gate past it.
    lost = fit_context_gate([17000], [26.0], [25.0], 4096, tolerance=0.02)
    assert lost.min_context_tokens == 32768 and "by more than 2%" in lost.reason
    with pytest.raises(ValueError, match="tolerance"):
        fit_context_gate([17000], [26.0], [25.0], 4096, tolerance=-0.1)
