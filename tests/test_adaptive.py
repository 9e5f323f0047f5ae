"""The adaptive engine's dispatch and build_engine's role names on the CPU."""

import dataclasses

import numpy as np
import pytest
import torch

from pkv.measure.accuracy import compare
from pkv.engines import ENGINE_NAMES, EngineUnavailable, build_engine
from pkv.engines.adaptive import AdaptiveEngine, AdaptivePlan
from pkv.engines.dense import dense_decode
from pkv.engines.reference import ReferenceEngine
from pkv.engines.sdpa import SdpaEngine
from pkv.engines import role_policy
from pkv.measure.kv_data import make_kv_pages, make_queries
from pkv.policy import (
    FLASHINFER_ROUTE,
    ROUTE_BUCKET,
    ROUTE_WORKQUEUE,
    Calibration,
    KernelVariants,
    PinnedRoutePolicy,
    RegimeParams,
    RouteDecision,
    RoutePolicy,
    StepRoute,
)
from pkv.policy.overrides import apply_engine_options
from pkv.shape import ModelShape

schedule = pytest.importorskip("pkv.pipeline.schedule")
pages_mod = pytest.importorskip("pkv.pipeline.pages")
step_mod = pytest.importorskip("pkv.pipeline.step")

SHAPE = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=32)
# Every context gate open; B1 on buckets of 5 splits, 8+ rows on the workqueue at 4, 2..7 on FlashInfer.
CALIB = Calibration(gpu="cpu", num_sms=2, beta_gbps=10.0, lambda_us=5.0, c_min=1.0,
                    single_row=RegimeParams("persistentkv_bucket", 5, 0, 1.05),
                    few_rows=RegimeParams("flashinfer", 32, 0, 1.50),
                    many_rows=RegimeParams("persistentkv_workqueue", 4, 0, 1.05),
                    supported_group_sizes=(4,))


class LengthPolicy:
    """Stand-in policy: long single rows -> bucket, long batches -> workqueue, else flashinfer."""

    def choose(self, step):
        if int(np.max(step.seq_lens)) < 256:
            return RouteDecision(FLASHINFER_ROUTE, "test", {})
        if len(step.seq_lens) == 1:
            return RouteDecision(StepRoute(ROUTE_BUCKET, 6), "test", {})
        return RouteDecision(StepRoute(ROUTE_WORKQUEUE, 3), "test", {})


def inputs(lens, seed=0):
    assignment = pages_mod.assign_pages(lens, 16, 0.0, seed)
    step = step_mod.build_step(0, np.arange(len(lens)), lens, assignment.pages, 16)
    k, v = make_kv_pages(assignment.num_physical_pages, SHAPE, 16, torch.float64, "cpu", seed)
    q = make_queries(len(lens), SHAPE, torch.float64, "cpu", seed + 1)
    return step, q, k, v


@pytest.mark.parametrize("lens,route,splits", [
    ([100, 200], "flashinfer", None),
    ([1000], "persistentkv_bucket", 6),
    ([300, 1000, 40], "persistentkv_workqueue", 3),
])
def test_adaptive_dispatches_on_the_policy_decision(lens, route, splits):
    engine = AdaptiveEngine(LengthPolicy(), ReferenceEngine(SHAPE), SdpaEngine(SHAPE, "cpu"))
    step, q, k, v = inputs(lens)
    plan = engine.plan(step)
    assert plan.route == route
    assert plan.num_splits == splits
    if route == "flashinfer":
        assert plan.schedule is None
        assert not isinstance(plan, AdaptivePlan), "a FlashInfer step runs the fallback's own plan"
    else:
        assert plan.decision.route.name == route and plan.decision.route.num_splits == splits
        assert plan.schedule is plan.inner.schedule
    out = engine.run(q, k, v, plan)
    assert compare(out, dense_decode(q, k, v, step.seq_lens, step.block_table))["rel_err"] < 1e-9


def test_adaptive_requires_plan_route():
    with pytest.raises(ValueError, match="plan_route"):
        AdaptiveEngine(LengthPolicy(), SdpaEngine(SHAPE, "cpu"), SdpaEngine(SHAPE, "cpu"))


def test_build_engine_cpu_stand_ins():
    persistent = build_engine("persistentkv", shape=SHAPE, device="cpu",
                              policy=PinnedRoutePolicy(StepRoute(ROUTE_WORKQUEUE, 12)))
    assert isinstance(persistent, ReferenceEngine)
    assert persistent.name == "persistentkv" and persistent.implementation == "reference:workqueue"
    step, *_ = inputs([300, 1000, 40])
    plan = persistent.plan(step)
    assert (plan.route, plan.num_splits) == ("persistentkv_workqueue", 12)
    # Without a policy: the workqueue at its default split count on every step.
    default = build_engine("reference", shape=SHAPE, device="cpu")
    assert default.implementation == "reference:workqueue" and default.plan(step).num_splits == 20
    flashinfer = build_engine("flashinfer", shape=SHAPE, device="cpu")
    assert isinstance(flashinfer, SdpaEngine)
    assert flashinfer.name == "flashinfer" and flashinfer.implementation == "sdpa"
    assert build_engine("sdpa", shape=SHAPE, device="cpu").name == "sdpa"
    # A schedule, split count and merge reach the engine as its pinned route (the run's options
    # through pkv.engines.role_policy).
    calib = apply_engine_options(CALIB, bucket_num_splits=9)
    policy = role_policy("reference", {"route": "bucket_masked", "merge": "fused"}, SHAPE, calib)
    assert policy.route == StepRoute(ROUTE_BUCKET, 9, bucket_mode="masked", merge="fused")
    bucket = build_engine("reference", shape=SHAPE, device="cpu", policy=policy)
    assert bucket.implementation == "reference:bucket_masked+fused_merge"
    step, *_ = inputs([1000, 600])
    plan = bucket.plan(step)
    assert (plan.route, plan.num_splits, plan.merge) == ("persistentkv_bucket", 9, "fused")
    assert plan.schedule.mode == "masked"


def test_build_engine_reports_unavailable_engines_with_a_reason():
    for name in ("flashinfer_tc", "flashinfer_cc", "vllm"):
        with pytest.raises(EngineUnavailable) as info:
            build_engine(name, shape=SHAPE, device="cpu")
        assert info.value.reason


def test_build_engine_rejects_unknown_names_and_options():
    for name in ("flashattn", "trtllm"):  # trtllm: no longer an engine
        with pytest.raises(ValueError, match=f"unknown engine '{name}'"):
            build_engine(name, shape=SHAPE, device="cpu")
    with pytest.raises(ValueError, match="num_split"):
        build_engine("reference", shape=SHAPE, device="cpu", options={"num_split": 4})
    # What a route is (schedule, split count, merge) is the policy's, not an engine option.
    for option in ({"num_splits": 4}, {"route": "workqueue"}, {"fused_merge": True}, {"merge": "fused"}):
        with pytest.raises(ValueError, match="unknown option"):
            build_engine("reference", shape=SHAPE, device="cpu", options=option)
    with pytest.raises(ValueError, match="policy"):
        build_engine("adaptive", shape=SHAPE, device="cpu")
    with pytest.raises(ValueError, match="RoutePolicy"):
        build_engine("adaptive", shape=SHAPE, device="cpu", policy=PinnedRoutePolicy(StepRoute(ROUTE_WORKQUEUE, 4)))
    assert "adaptive" in ENGINE_NAMES and "trtllm" not in ENGINE_NAMES


def test_the_one_op_step_is_an_adaptive_option_of_an_eager_cuda_engine():
    """one_op_step reaches the adaptive engine only; where that engine cannot take it (off a CUDA
    device) the option is refused by name, and the other roles do not read it."""
    policy = _policy(CALIB)
    with pytest.raises(ValueError, match="one_op_step needs .* CUDA device") as err:
        build_engine("adaptive", shape=SHAPE, device="cpu", policy=policy, options={"one_op_step": True})
    assert str(err.value).endswith(" on cpu")
    assert build_engine("adaptive", shape=SHAPE, device="cpu", policy=policy,
                        options={"one_op_step": False}).one_op_step is False
    build_engine("reference", shape=SHAPE, device="cpu", options={"one_op_step": True})


def _policy(calib, shape=SHAPE, variants=KernelVariants()):
    return RoutePolicy(calib, num_kv_heads=shape.num_kv_heads, group_size=shape.group_size,
                       head_dim=shape.head_dim, variants=variants)


def test_build_engine_adaptive_with_a_calibration():
    shape = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=32)
    policy = _policy(CALIB, shape)
    engine = build_engine("adaptive", shape=shape, device="cpu", policy=policy)
    assert engine.policy is policy and engine.persistent.policy is policy
    assert policy.candidate(8).num_splits == 4
    assert policy.candidate(1).num_splits == 5
    assert policy.candidate(4) is None  # batches of 2..7 stay on FlashInfer
    assert isinstance(engine.fallback, SdpaEngine)
    for lens in ([900], [300, 40, 1000, 77, 500, 600, 700, 800]):
        step, q, k, v = inputs(lens)
        plan = engine.plan(step)
        assert plan.route in ("flashinfer", "persistentkv_bucket", "persistentkv_workqueue")
        out = engine.run(q, k, v, plan)
        assert compare(out, dense_decode(q, k, v, step.seq_lens, step.block_table))["rel_err"] < 1e-9


@pytest.mark.parametrize("options,lens,route,splits", [
    ({"num_splits": 3}, [900], "persistentkv_bucket", 3),
    ({"num_splits": 3}, [300, 40, 1000, 77, 500, 600, 700, 800], "persistentkv_workqueue", 3),
    ({"bucket_num_splits": 6}, [900], "persistentkv_bucket", 6),
    ({"bucket_num_splits": 6}, [300, 40, 1000, 77, 500, 600, 700, 800], "persistentkv_workqueue", 4),
])
def test_adaptive_split_options_reach_the_plans_that_run(options, lens, route, splits):
    # The policy hands its split count to the persistent engine with each route, so a split
    # option of the run (the splits ablation) must change the policy's count too.
    calib = dataclasses.replace(CALIB, flashinfer_plan_us=1e4)  # every step past the gates to PersistentKV
    engine = build_engine("adaptive", shape=SHAPE, device="cpu", policy=_policy(apply_engine_options(calib, **options)))
    step, q, k, v = inputs(lens)
    plan = engine.plan(step)
    assert (plan.route, plan.num_splits) == (route, splits)
    assert plan.decision.basis == "estimate"
    if route == "persistentkv_workqueue":
        assert plan.schedule.max_splits == splits
    else:
        assert {launch.num_splits for launch in plan.schedule.launches} == {splits}
    out = engine.run(q, k, v, plan)
    assert compare(out, dense_decode(q, k, v, step.seq_lens, step.block_table))["rel_err"] < 1e-9


def test_skewed_and_over_split_steps_run_the_balanced_rule_with_the_calibrated_budget():
    """With skew_target_ctas set, a step one row dominates is planned by the balanced rule (the long
    row cut into more tasks than the regime's fixed count gives it) and matches float64; a ragged
    step that is not skewed keeps the fixed rule. With over_split_balanced too, so does a step of
    short rows."""
    calib = dataclasses.replace(CALIB, flashinfer_plan_us=1e4).with_all_regimes(skew_target_ctas=24)
    engine = build_engine("adaptive", shape=SHAPE, device="cpu", policy=_policy(calib))
    skewed = [4000] + [20, 33, 17, 40, 25, 31, 18]
    step, q, k, v = inputs(skewed)
    plan = engine.plan(step)
    assert plan.decision.route == StepRoute(ROUTE_WORKQUEUE, 4, "balanced", target_ctas=24)
    # What results count the step by, on the adaptive plan and the plan that runs.
    assert plan.split_rule == plan.inner.split_rule == "balanced (24 CTAs)"
    splits = schedule.row_splits(np.array(skewed), SHAPE.num_kv_heads, plan.decision.route.split_policy)
    assert splits[0] > 4 and (splits[1:] == 1).all()  # more than the fixed rule's 4 for the long row
    out = engine.run(q, k, v, plan)
    assert compare(out, dense_decode(q, k, v, step.seq_lens, step.block_table))["rel_err"] < 1e-9
    step, q, k, v = inputs([300, 40, 1000, 77, 500, 600, 700, 800])
    assert engine.plan(step).decision.route == StepRoute(ROUTE_WORKQUEUE, 4)
    assert engine.plan(step).split_rule == "fixed"
    # With over_split_balanced, a step of rows short for 4 splits (a mean row under 2 x 32 x 4
    # tokens) takes the same balanced route; the ragged step above is not over-split.
    engine = build_engine("adaptive", shape=SHAPE, device="cpu",
                          policy=_policy(calib.with_all_regimes(over_split_balanced=True)))
    assert engine.plan(step).split_rule == "fixed"
    short = [200, 40, 250, 77, 190, 230, 130, 80]
    step, q, k, v = inputs(short)
    plan = engine.plan(step)
    assert plan.decision.route == StepRoute(ROUTE_WORKQUEUE, 4, "balanced", target_ctas=24)
    splits = schedule.row_splits(np.array(short), SHAPE.num_kv_heads, plan.decision.route.split_policy)
    fixed = schedule.row_splits(np.array(short), SHAPE.num_kv_heads, schedule.SplitPolicy(num_splits=4))
    assert splits.sum() < fixed.sum()  # fewer, longer tasks than the fixed rule's
    out = engine.run(q, k, v, plan)
    assert compare(out, dense_decode(q, k, v, step.seq_lens, step.block_table))["rel_err"] < 1e-9


def test_adaptive_variants_reach_the_plans_that_run():
    calib = dataclasses.replace(CALIB, flashinfer_plan_us=1e4)
    policy = _policy(calib, variants=KernelVariants(bucket_mode="masked", merge="fused"))
    engine = build_engine("adaptive", shape=SHAPE, device="cpu", policy=policy)
    for lens, route in (([900], "persistentkv_bucket"), ([300, 40, 1000, 77, 500, 600, 700, 800],
                                                          "persistentkv_workqueue")):
        step, q, k, v = inputs(lens)
        plan = engine.plan(step)
        assert (plan.route, plan.merge) == (route, "fused")
        assert plan.decision.route.bucket_mode == "masked"
        out = engine.run(q, k, v, plan)
        assert compare(out, dense_decode(q, k, v, step.seq_lens, step.block_table))["rel_err"] < 1e-9


def test_cuda_graph_option_needs_the_cuda_engine():
    with pytest.raises(EngineUnavailable, match="cuda_graph"):
        build_engine("persistentkv", shape=SHAPE, device="cpu", options={"cuda_graph": True})
    engine = build_engine("persistentkv", shape=SHAPE, device="cpu", options={"cuda_graph": False})
    assert isinstance(engine, ReferenceEngine)


class WarmUpSpy(ReferenceEngine):
    """The reference engine, recording the plans it is asked to warm up."""

    def __init__(self, shape):
        super().__init__(shape)
        self.warmed = []

    def warm_up(self, plan, q, k_pages, v_pages):
        self.warmed.append((plan.route, plan.num_splits))


def test_prepare_warms_the_route_the_policy_picks():
    """A route's first launch carries one-off costs (lazy module loading on the GPU): prepare,
    untimed, must run the route and split count of the coming step, and only PersistentKV's."""
    spy = WarmUpSpy(SHAPE)
    engine = AdaptiveEngine(LengthPolicy(), spy, SdpaEngine(SHAPE, "cpu"))
    for lens in ([100, 200], [1000], [300, 1000, 40]):
        engine.prepare(*inputs(lens))
    assert spy.warmed == [("persistentkv_bucket", 6), ("persistentkv_workqueue", 3)]
