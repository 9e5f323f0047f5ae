"""Route policy: gates, candidates per batch size, and the promotion margins."""

import dataclasses
import time

import numpy as np
import pytest

from pkv.cost_model import Calibration, estimate_route_us
from pkv.route_policy import RouteDecision, RoutePolicy
from pkv.pipeline.step import build_step

PAPER = Calibration(gpu="rtx3060", num_sms=28, beta_gbps=331.2, lambda_us=8.19, c_min=4.0)
SHAPE = dict(num_kv_heads=8, group_size=4, head_dim=128)


def make_step(seq_lens, page_size=16):
    lens = np.asarray(seq_lens, dtype=np.int64)
    pages = -(-lens // page_size)
    starts = np.concatenate(([0], np.cumsum(pages)[:-1]))
    page_lists = [np.arange(s, s + n, dtype=np.int32) for s, n in zip(starts, pages)]
    return build_step(0, np.arange(lens.size), lens, page_lists, page_size)


def long_batch(batch, base=20000):
    return make_step([base + 977 * i for i in range(batch)])


def speedup(route, step, calib, num_splits):
    fi = estimate_route_us("flashinfer", step, calib, **SHAPE).total_us
    return fi / estimate_route_us(route, step, calib, **SHAPE, num_splits=num_splits).total_us


@pytest.mark.parametrize("group_size, num_kv_heads", [(1, 32), (8, 4), (2, 16)])
def test_uncalibrated_group_size_goes_to_flashinfer(group_size, num_kv_heads):
    policy = RoutePolicy(PAPER, num_kv_heads=num_kv_heads, group_size=group_size, head_dim=128)
    for batch in (1, 8):
        decision = policy.choose(long_batch(batch, 65536))
        assert decision == RouteDecision("flashinfer", 0, "gate: G", {})


def test_short_context_goes_to_flashinfer():
    policy = RoutePolicy(PAPER, **SHAPE)
    assert policy.choose(make_step([16383])).reason == "gate: context"
    assert policy.choose(make_step([4000] * 8)).route == "flashinfer"
    # The gate looks at the longest row: one long row makes the step eligible.
    assert policy.choose(make_step([16384])).route == "persistentkv_bucket"


def test_each_batch_regime_has_its_own_context_gate():
    calib = dataclasses.replace(PAPER, min_context_tokens=16384, boundary_min_context_tokens=1024,
                                workqueue_min_context_tokens=4096, boundary_route="persistentkv_workqueue")
    policy = RoutePolicy(calib, **SHAPE)
    assert policy.choose(make_step([8000])).reason == "gate: context"
    assert policy.choose(make_step([3000] * 8)).reason == "gate: context"
    assert policy.choose(make_step([5000] * 8)).reason != "gate: context"
    assert policy.choose(make_step([1500] * 4)).reason != "gate: context"
    assert policy.choose(make_step([900] * 4)).reason == "gate: context"


def test_b1_long_context_uses_buckets_with_bucket_splits():
    decision = RoutePolicy(PAPER, **SHAPE).choose(make_step([32768]))
    assert decision.route == "persistentkv_bucket" and decision.num_splits == 32
    assert set(decision.estimates) == {"flashinfer", "persistentkv_bucket"}
    assert decision.estimates["persistentkv_bucket"] < decision.estimates["flashinfer"]
    assert decision.reason.startswith("estimate") and "margin 1.05x" in decision.reason


def test_b8_long_context_uses_workqueue_with_workqueue_splits():
    step = long_batch(8)
    decision = RoutePolicy(PAPER, **SHAPE).choose(step)
    assert decision.route == "persistentkv_workqueue" and decision.num_splits == 20
    expected = estimate_route_us("persistentkv_workqueue", step, PAPER, **SHAPE).total_us
    assert decision.estimates["persistentkv_workqueue"] == pytest.approx(expected)


@pytest.mark.parametrize("batch", [2, 3, 4, 5, 6, 7])
def test_b4_boundary_stays_on_flashinfer_by_default(batch):
    decision = RoutePolicy(PAPER, **SHAPE).choose(long_batch(batch))
    assert decision == RouteDecision("flashinfer", 0, "B4 boundary", {})


@pytest.mark.parametrize("opened_by", ["allow_b4", "calibration"])
def test_b4_boundary_needs_the_stricter_margin_at_the_boundary_split_count(opened_by):
    step = long_batch(4)
    base = dataclasses.replace(PAPER, boundary_num_splits=36)
    if opened_by == "calibration":
        base = dataclasses.replace(base, boundary_route="persistentkv_workqueue")
    allow_b4 = opened_by == "allow_b4"
    s = speedup("persistentkv_workqueue", step, base, 36)
    assert s != speedup("persistentkv_workqueue", step, base, 20)
    above = dataclasses.replace(base, b4_margin=s * 1.01, b8_margin=s * 0.5)
    below = dataclasses.replace(base, b4_margin=s * 0.99, b8_margin=s * 2.0)
    assert RoutePolicy(above, **SHAPE, allow_b4=allow_b4).choose(step).route == "flashinfer"
    decision = RoutePolicy(below, **SHAPE, allow_b4=allow_b4).choose(step)
    assert decision.route == "persistentkv_workqueue" and decision.num_splits == 36


def test_calibration_rejects_a_boundary_route_that_cannot_serve_several_rows():
    with pytest.raises(ValueError, match="boundary_route='persistentkv_bucket'"):
        dataclasses.replace(PAPER, boundary_route="persistentkv_bucket")
    with pytest.raises(ValueError, match="boundary_num_splits=0"):
        dataclasses.replace(PAPER, boundary_num_splits=0)


@pytest.mark.parametrize("batch, route, splits", [(1, "persistentkv_bucket", 32), (8, "persistentkv_workqueue", 20),
                                                  (16, "persistentkv_workqueue", 20)])
def test_b1_and_b8_use_the_b8_margin(batch, route, splits):
    step = long_batch(batch)
    s = speedup(route, step, PAPER, splits)
    blocked = dataclasses.replace(PAPER, b8_margin=s * 1.01, b4_margin=s * 0.5)
    passed = dataclasses.replace(PAPER, b8_margin=s * 0.99, b4_margin=s * 2.0)
    decision = RoutePolicy(blocked, **SHAPE).choose(step)
    assert decision.route == "flashinfer" and "<" in decision.reason
    assert set(decision.estimates) == {"flashinfer", route}
    assert RoutePolicy(passed, **SHAPE).choose(step).route == route


def test_policy_follows_calibrated_split_counts():
    calib = dataclasses.replace(PAPER, bucket_num_splits=28, workqueue_num_splits=24)
    policy = RoutePolicy(calib, **SHAPE)
    assert policy.choose(make_step([65536])).num_splits == 28
    assert policy.choose(long_batch(8)).num_splits == 24


def test_policy_rejects_bad_shape():
    with pytest.raises(ValueError, match="head_dim"):
        RoutePolicy(PAPER, num_kv_heads=8, group_size=4, head_dim=0)


def test_choose_host_time(capsys):
    """Choosing runs every step; its host cost is printed, not asserted."""
    policy = RoutePolicy(PAPER, **SHAPE)
    for batch in (1, 8, 64):
        step = long_batch(batch)
        policy.choose(step)
        reps = 200
        start = time.perf_counter()
        for _ in range(reps):
            policy.choose(step)
        with capsys.disabled():
            print(f"\nRoutePolicy.choose B={batch}: {(time.perf_counter() - start) / reps * 1e6:.1f} us")
