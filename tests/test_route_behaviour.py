"""Every step routes, plans and computes as it did before the policy package.

tests/fixtures/route_behaviour.json.gz was recorded from the code before pkv.policy existed: for
every calibration file under artifacts/reference/h200, the conf/gpu starting constants, the engine
options of the ablations and G in {1, 4, 8}, each step of every synthetic family at B1, B4 and
B8 (full-length traces: planning only) with its route, split count, gate and plan digest; and the
adaptive engine's outputs on the CPU profile in float64. `record_cases` and `record_outputs`
compute the same records with today's code.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pkv.engines import build_engine
from pkv.measure.calibration_probe import trace_steps
from pkv.measure.kv_data import make_kv_pages, make_queries
from pkv.pipeline.traces import synthetic_trace
from pkv.policy import Calibration, KernelVariants, RoutePolicy, load_calibration
from pkv.policy.overrides import apply_engine_options, kernel_variants
from pkv.shape import ModelShape

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "route_behaviour.json.gz"
REFERENCE = ROOT / "artifacts" / "reference" / "h200"
# Where the recording's calibration files (named by their place then) now lie, under history/.
MOVED = {"calibration.json": "history/2c0348e_full_dag/calibration.json",
         "calibrated_boundary/calibration.json": "history/a57e8dc_calibrated_boundary/calibration.json",
         "bracketed_splits/calibration.json": "history/7348465_bracketed_splits/calibration.json",
         "measured_gates/calibration.json": "history/4ff4a2f_measured_gates/calibration.json"}
# Engine options as the recorded runs gave them, in today's names.
OPTION_SETS = {"default": {}, "allow_b4": {"open_few_rows": True}, "splits16": {"num_splits": 16},
               "bucket8": {"bucket_num_splits": 8}, "balanced": {"split_kind": "balanced"},
               "masked": {"schedule": "bucket_masked"}}
# The gate of a closed few-rows regime had the name of the B4 boundary.
BASIS_RENAMED = {"B4 boundary": "gate: regime"}


@pytest.fixture(scope="module")
def recorded() -> dict:
    with gzip.open(FIXTURE, "rt") as handle:
        return json.load(handle)


def _calibrations() -> dict:
    calibs = {p.relative_to(REFERENCE).as_posix(): load_calibration(p)
              for p in sorted(REFERENCE.rglob("calibration*.json"))}
    for gpu in ("h200", "cpu"):
        path = ROOT / "conf" / "gpu" / f"{gpu}.yaml"
        calibs[f"conf/gpu/{gpu}.yaml"] = Calibration.from_mapping(yaml.safe_load(path.read_text()), str(path))
    return calibs


def _adaptive(calib, shape, options: dict):
    options = dict(options)
    variants = kernel_variants(options.pop("schedule", "workqueue"))
    policy = RoutePolicy(apply_engine_options(calib, **options), num_kv_heads=shape.num_kv_heads,
                         group_size=shape.group_size, head_dim=shape.head_dim, variants=variants)
    return build_engine("adaptive", shape=shape, device="cpu", policy=policy)


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def _plan_digest(plan):
    schedule = plan.schedule
    if hasattr(schedule, "tasks"):
        return "wq:" + _digest([schedule.tasks, schedule.split_offsets, [schedule.max_splits]])
    parts = []
    for launch in schedule.launches:
        parts += [launch.row_indices, [launch.num_splits, launch.route_len]]
    return f"bk-{schedule.mode}:" + _digest(parts)


def test_fixture_covers_every_route_and_gate(recorded):
    steps = [s for case in recorded["cases"] for s in case["steps"]]
    assert {s[3] for s in steps} == {"flashinfer", "persistentkv_bucket", "persistentkv_workqueue"}
    assert {s[5] for s in steps} >= {"gate: G", "gate: context", "B4 boundary", "estimate"}


def test_every_step_routes_and_plans_as_recorded(recorded):
    calibs = _calibrations()
    mismatches = []
    for case in recorded["cases"]:
        group = case["group_size"]
        shape = ModelShape(num_qo_heads=8 * group, num_kv_heads=8, head_dim=128)
        calib = calibs[MOVED.get(case["calibration"], case["calibration"])]
        engine = _adaptive(calib, shape, OPTION_SETS[case["options"]])
        reqs = synthetic_trace(case["family"], num_requests=4 * case["batch"], seed=20260623, length_scale=1.0)
        _, steps = trace_steps(reqs, page_size=16, hole_fraction=0.1, max_active=case["batch"], num_steps=12,
                               seed=20260623)
        for step, want in zip(steps, case["steps"], strict=True):
            decision = engine.policy.choose(step)
            plan = engine.plan(step)
            got = [step.step, step.batch_size, int(max(step.seq_lens)), plan.route,
                   plan.num_splits if plan.route != "flashinfer" else None, decision.basis,
                   _plan_digest(plan) if plan.route != "flashinfer" else None]
            want = [*want[:5], BASIS_RENAMED.get(want[5], want[5]), want[6]]
            if got != want:
                mismatches.append((case["calibration"], case["options"], group, case["family"], got, want))
    assert not mismatches, f"{len(mismatches)} steps differ; first: {mismatches[:3]}"


# The sum of the recording's first K pages (make_kv_pages, 2 pages, seed 20260624) as torch 2.13 draws
# them. Other torch releases may draw other bits (2.5 does for exponential_, the needle strengths):
# their inputs, and with them the outputs, are not the recorded ones.
RECORDED_KEYS_SUM = 3.5176990595259667
# The trace families the recording replays, in its order.
RECORDED_FAMILIES = ("bucketed", "homogeneous", "bimodal", "uniform", "zipf")


def test_outputs_equal_the_recorded_ones(recorded):
    shape = ModelShape(num_qo_heads=32, num_kv_heads=8, head_dim=128)
    keys_sum = float(make_kv_pages(2, shape, 16, torch.float64, "cpu", 20260624)[0].sum())
    if keys_sum != pytest.approx(RECORDED_KEYS_SUM, rel=1e-12):
        pytest.skip(f"torch {torch.__version__} draws other random K pages than the recording's "
                    f"(key sum {keys_sum!r}, recorded {RECORDED_KEYS_SUM!r}): the outputs cannot be compared")
    calib = load_calibration(REFERENCE / MOVED["calibration.json"])
    # Every gate open, so short CPU-scale steps reach both PersistentKV routes.
    calib = Calibration.from_mapping({**calib.to_json_dict(), "supported_group_sizes": [4]}, "open gates")
    for regime in ("single_row", "few_rows", "many_rows"):
        calib = calib.with_regime(regime, min_context_tokens=0)
    outputs = iter(recorded["outputs"])
    for options in ("default", "allow_b4", "masked"):
        engine = _adaptive(calib, shape, OPTION_SETS[options])
        for family in RECORDED_FAMILIES:
            for batch in (1, 4, 8):
                reqs = synthetic_trace(family, num_requests=2 * batch, seed=20260624, length_scale=1 / 64)
                # The recording predates the recycled KV pool: its pages were assigned up front.
                assignment, steps = trace_steps(reqs, page_size=16, hole_fraction=0.25, max_active=batch,
                                                num_steps=3, seed=20260624, layout="up_front")
                k, v = make_kv_pages(assignment.num_physical_pages, shape, 16, torch.float64, "cpu", 20260624)
                for step in steps:
                    want = next(outputs)
                    assert (want["options"], want["family"], want["batch"], want["step"]) == \
                        (options, family, batch, step.step)
                    q = make_queries(step.batch_size, shape, torch.float64, "cpu", 20260624 + step.step)
                    plan = engine.plan(step)
                    out = engine.run(q, k, v, plan).double()
                    weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
                    assert (plan.route, plan.num_splits) == (want["route"], want["num_splits"])
                    got = (float(out.sum()), float(out.norm()), float((out * weights).sum()))
                    assert got == pytest.approx((want["sum"], want["norm"], want["weighted"]), rel=1e-12, abs=1e-12)
    assert next(outputs, None) is None


def test_variants_reach_the_routes():
    calib = load_calibration(REFERENCE / MOVED["calibration.json"])
    policy = RoutePolicy(calib, num_kv_heads=8, group_size=4, head_dim=128,
                         variants=KernelVariants(bucket_mode="masked", merge="fused"))
    route = policy.candidate(1)
    assert (route.bucket_mode, route.merge) == ("masked", "fused")
