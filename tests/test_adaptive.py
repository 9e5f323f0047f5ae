"""The adaptive engine's dispatch and build_engine's role names on the CPU."""

import numpy as np
import pytest
import torch

from pkv.measure.accuracy import compare
from pkv.engines import ENGINE_NAMES, EngineUnavailable, build_engine
from pkv.engines.adaptive import AdaptiveEngine, AdaptivePlan
from pkv.engines.dense import dense_decode
from pkv.engines.reference import ReferenceEngine
from pkv.engines.sdpa import SdpaEngine
from pkv.measure.kv_data import make_kv_pages, make_queries
from pkv.shape import ModelShape

schedule = pytest.importorskip("pkv.pipeline.schedule")
pages_mod = pytest.importorskip("pkv.pipeline.pages")
step_mod = pytest.importorskip("pkv.pipeline.step")

SHAPE = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=32)


class Decision:
    def __init__(self, route, num_splits, reason="test"):
        self.route, self.num_splits, self.reason, self.estimates = route, num_splits, reason, {}


class LengthPolicy:
    """Stand-in policy: long single rows -> bucket, long batches -> workqueue, else flashinfer."""

    def choose(self, step):
        if int(np.max(step.seq_lens)) < 256:
            return Decision("flashinfer", 0)
        if len(step.seq_lens) == 1:
            return Decision("persistentkv_bucket", 6)
        return Decision("persistentkv_workqueue", 3)


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
        assert plan.decision.route == route
        assert plan.schedule is plan.inner.schedule
    out = engine.run(q, k, v, plan)
    assert compare(out, dense_decode(q, k, v, step.seq_lens, step.block_table))["rel_err"] < 1e-9


def test_adaptive_requires_plan_for():
    with pytest.raises(ValueError, match="plan_for"):
        AdaptiveEngine(LengthPolicy(), SdpaEngine(SHAPE, "cpu"), SdpaEngine(SHAPE, "cpu"))


def test_build_engine_cpu_stand_ins():
    persistent = build_engine("persistentkv", shape=SHAPE, device="cpu",
                              options={"num_splits": 12, "route": "workqueue"})
    assert isinstance(persistent, ReferenceEngine)
    assert persistent.name == "persistentkv" and persistent.implementation == "reference:workqueue"
    assert persistent.split_policy.num_splits == 12
    flashinfer = build_engine("flashinfer", shape=SHAPE, device="cpu")
    assert isinstance(flashinfer, SdpaEngine)
    assert flashinfer.name == "flashinfer" and flashinfer.implementation == "sdpa"
    assert build_engine("sdpa", shape=SHAPE, device="cpu").name == "sdpa"
    bucket = build_engine("reference", shape=SHAPE, device="cpu",
                          options={"route": "bucket_masked", "bucket_num_splits": 9,
                                   "fused_merge": True})
    assert bucket.route == "bucket_masked" and bucket.bucket_num_splits == 9 and bucket.fused_merge


def test_build_engine_reports_unavailable_engines_with_a_reason():
    for name in ("flashinfer_tc", "flashinfer_cc", "vllm", "trtllm"):
        with pytest.raises(EngineUnavailable) as info:
            build_engine(name, shape=SHAPE, device="cpu")
        assert info.value.reason


def test_build_engine_rejects_unknown_names_and_options():
    with pytest.raises(ValueError, match="unknown engine 'flashattn'"):
        build_engine("flashattn", shape=SHAPE, device="cpu")
    with pytest.raises(ValueError, match="num_split"):
        build_engine("reference", shape=SHAPE, device="cpu", options={"num_split": 4})
    with pytest.raises(ValueError, match="calib"):
        build_engine("adaptive", shape=SHAPE, device="cpu")
    assert "adaptive" in ENGINE_NAMES


def test_build_engine_adaptive_with_a_calibration():
    cost_model = pytest.importorskip("pkv.cost_model")
    pytest.importorskip("pkv.route_policy")
    shape = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=32)
    calib = cost_model.Calibration(gpu="cpu", num_sms=2, beta_gbps=10.0, lambda_us=5.0, c_min=1.0,
                                   min_context_tokens=0, supported_group_sizes=(4,),
                                   workqueue_num_splits=4, bucket_num_splits=5)
    engine = build_engine("adaptive", shape=shape, device="cpu", calib=calib)
    assert engine.persistent.split_policy.num_splits == 4
    assert engine.persistent.bucket_num_splits == 5
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
    # The policy hands its split count to the persistent engine with each decision, so a split
    # option of the adaptive engine (the splits ablation) must change the policy's count too.
    cost_model = pytest.importorskip("pkv.cost_model")
    calib = cost_model.Calibration(gpu="cpu", num_sms=2, beta_gbps=10.0, lambda_us=5.0, c_min=1.0,
                                   min_context_tokens=0, supported_group_sizes=(4,),
                                   workqueue_num_splits=4, bucket_num_splits=5,
                                   flashinfer_plan_us=1e4)  # every step past the gates to PersistentKV
    engine = build_engine("adaptive", shape=SHAPE, device="cpu", calib=calib, options=options)
    step, q, k, v = inputs(lens)
    plan = engine.plan(step)
    assert (plan.route, plan.num_splits) == (route, splits)
    if route == "persistentkv_workqueue":
        assert plan.schedule.max_splits == splits
    else:
        assert {launch.num_splits for launch in plan.schedule.launches} == {splits}
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
