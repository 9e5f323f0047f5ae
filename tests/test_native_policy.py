"""The route policy's C++ form (csrc/route_policy.cpp through pkv.policy.native) against RoutePolicy,
its specification: the same RouteDecision, estimates bit for bit, on every step of the synthetic
families under every committed calibration, option set and group size, and on random steps built to
reach each rule (gates, the uniform cap, the skew and over-split rules, both split kinds, both
bucket modes). Then the one-call plan (adaptive_plan) against plan_route, and bad policy arrays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pkv import ops
from pkv.engines.adaptive import AdaptiveEngine, AdaptivePlan
from pkv.engines.persistentkv import PersistentKVEngine
from pkv.engines.sdpa import SdpaEngine
from pkv.measure.calibration_probe import trace_steps
from pkv.pipeline.pages import assign_pages
from pkv.pipeline.step import build_step
from pkv.pipeline.traces import synthetic_trace
from pkv.policy import Calibration, RoutePolicy, load_calibration
from pkv.policy.native import NativeRoutePolicy, policy_values
from pkv.policy.overrides import apply_engine_options, kernel_variants
from pkv.policy.regime import MANY_ROWS
from pkv.shape import ModelShape

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("bucketed", "homogeneous", "bimodal", "uniform", "zipf")
OPTION_SETS = {"default": {}, "allow_b4": {"open_few_rows": True}, "splits16": {"num_splits": 16},
               "balanced": {"split_kind": "balanced"}, "masked": {"schedule": "bucket_masked"}}


@pytest.fixture(scope="module")
def planner():
    return ops.load_planner()


def _calibrations() -> dict:
    calibs = {p.relative_to(ROOT).as_posix(): load_calibration(p)
              for p in sorted((ROOT / "artifacts" / "reference").rglob("calibration.json"))}
    for gpu in ("h200", "h100", "cpu"):
        path = ROOT / "conf" / "gpu" / f"{gpu}.yaml"
        if path.exists():
            calibs[f"conf/gpu/{gpu}.yaml"] = Calibration.from_mapping(yaml.safe_load(path.read_text()), str(path))
    return calibs


def _policy(calib, shape, options: dict) -> RoutePolicy:
    options = dict(options)
    variants = kernel_variants(options.pop("schedule", "workqueue"))
    return RoutePolicy(apply_engine_options(calib, **options), num_kv_heads=shape.num_kv_heads,
                       group_size=shape.group_size, head_dim=shape.head_dim, variants=variants)


def _shape(group: int) -> ModelShape:
    return ModelShape(num_qo_heads=8 * group, num_kv_heads=8, head_dim=128)


class Lens:
    """A step as the policies read it: its lengths."""

    def __init__(self, lens):
        self.seq_lens = np.asarray(lens, dtype=np.int32)


def test_the_native_policy_decides_every_trace_step_as_the_python_policy(planner):
    calibs = _calibrations()
    assert len(calibs) >= 8, sorted(calibs)
    checked, mismatches, bases = 0, [], set()
    for group in (1, 4, 8):
        for options in OPTION_SETS.values():
            policies = [_policy(calib, _shape(group), options) for calib in calibs.values()]
            natives = [NativeRoutePolicy(policy, planner) for policy in policies]
            for family in FAMILIES:
                for batch, scale in ((1, 1.0), (4, 1.0), (8, 1.0), (64, 1.0), (1, 1 / 16), (8, 1 / 16)):
                    reqs = synthetic_trace(family, num_requests=2 * batch, seed=20260623, length_scale=scale)
                    _, steps = trace_steps(reqs, page_size=16, hole_fraction=0.1, max_active=batch, num_steps=6,
                                           seed=20260623)
                    for step in steps:
                        for name, policy, native in zip(calibs, policies, natives):
                            want, got = policy.choose(step), native.choose(step)
                            checked += 1
                            bases.add(want.basis)
                            if got != want:
                                mismatches.append((name, options, group, family, batch, want, got))
    assert not mismatches, f"{len(mismatches)} of {checked} decisions differ; first: {mismatches[:2]}"
    assert bases == {"gate: G", "gate: context", "gate: regime", "estimate"}


def _open(calib: Calibration, **fields) -> Calibration:
    """The calibration with every context gate open and ``fields`` replaced."""
    calib = Calibration.from_mapping({**calib.to_json_dict(), **fields}, "test calibration")
    for regime in ("single_row", "few_rows", "many_rows"):
        calib = calib.with_regime(regime, min_context_tokens=0)
    return calib


def _random_steps(rng, count: int):
    """Lengths shaped to reach every rule: uniform batches near the cap's target, one dominating row,
    rows short for the split count, rows of length 0 among others, long rows past 2**22 tokens."""
    for _ in range(count):
        batch = int(rng.choice([1, 2, 3, 5, 7, 8, 9, 16, 31, 32, 33, 64, 100, 256]))
        kind = int(rng.integers(6))
        if kind == 0:
            lens = rng.integers(1, 200_000, batch)
        elif kind == 1:
            lens = np.full(batch, rng.integers(1, 70_000)) + rng.integers(0, 4_000, batch)
        elif kind == 2:
            lens = rng.integers(1, 2_000, batch)
            lens[rng.integers(batch)] = rng.integers(10_000, 300_000)
        elif kind == 3:
            lens = rng.integers(1, 600, batch)
        elif kind == 4:
            lens = rng.integers(0, 50_000, batch)
            lens[0] = max(int(lens[0]), 1)
        else:
            lens = rng.integers(1, 5_000, batch)
            lens[0] = rng.integers(1 << 22, 1 << 23)
        yield Lens(lens)


@pytest.mark.parametrize("options", list(OPTION_SETS.values()), ids=list(OPTION_SETS))
def test_the_native_policy_decides_random_steps_as_the_python_policy(planner, options):
    base = load_calibration(ROOT / "artifacts" / "reference" / "h100" / "calibration" / "calibration.json")
    variants = [_open(base),
                _open(base, uniform_target_ctas=256),
                _open(base, workqueue_split_kind="balanced"),
                _open(base, flashinfer_plan_us=3.5, persistentkv_plan_us=1.25, flashinfer_ctas_per_row_head=0.37)]
    skewed = _open(base)
    for regime in ("few_rows", "many_rows"):
        skewed = skewed.with_regime(regime, route="persistentkv_workqueue", skew_target_ctas=396,
                                    over_split_balanced=True, margin=0.5)
    variants.append(skewed)
    # The short-row rule on the B1 bucket route, and on a bucket route of 2..7 rows (by the longest row).
    variants.append(_open(base).with_regime("single_row", bucket_tiles_per_split=4)
                    .with_regime("few_rows", route="persistentkv_bucket", bucket_tiles_per_split=3, margin=0.5))
    rng = np.random.default_rng(7)
    checked, mismatches, bases, routes, bucket_splits = 0, [], set(), set(), set()
    for calib in variants:
        policy = _policy(calib, _shape(4), options)
        native = NativeRoutePolicy(policy, planner)
        for step in _random_steps(rng, 600):
            want, got = policy.choose(step), native.choose(step)
            checked += 1
            bases.add(want.basis)
            routes.add((want.route.name, want.route.split_kind))
            if want.route.name == "persistentkv_bucket":
                bucket_splits.add(want.route.num_splits)
            if got != want:
                mismatches.append((step.seq_lens[:6], len(step.seq_lens), want, got))
    assert not mismatches, f"{len(mismatches)} of {checked} decisions differ; first: {mismatches[:2]}"
    assert "estimate" in bases
    assert {name for name, _ in routes} == {"flashinfer", "persistentkv_bucket", "persistentkv_workqueue"}
    # The short-row rule's counts were decided (and decided alike), except where a fixed count lifts it.
    assert bucket_splits == {16} if "num_splits" in options else {1, 2, 4} <= bucket_splits


def test_the_native_policy_shares_one_route_object_per_route(planner):
    calib = _open(load_calibration(ROOT / "artifacts" / "reference" / "h100" / "calibration" / "calibration.json"))
    native = NativeRoutePolicy(_policy(calib, _shape(4), {}), planner)
    first, second = native.choose(Lens([40_000] * 8)), native.choose(Lens([40_001] * 8))
    assert first.route == second.route and first.route is second.route


def _engine_inputs(lens, seed=0):
    assignment = assign_pages(lens, 16, 0.0, seed)
    return build_step(0, np.arange(len(lens)), np.asarray(lens, dtype=np.int32), assignment.pages, 16)


@pytest.mark.parametrize("lens", [[8192], [300], [64 * 1024, 4096, 5632, 7168, 8704, 10240, 12288, 64 * 1024],
                                  [128 * 1024] + [100] * 63, [2000] * 4, [500] * 64])
@pytest.mark.parametrize("options", list(OPTION_SETS.values()), ids=list(OPTION_SETS))
def test_one_call_plans_what_the_python_policy_and_planner_plan(lens, options):
    shape = _shape(4)
    calib = _open(load_calibration(ROOT / "artifacts" / "reference" / "h100" / "calibration" / "calibration.json"))
    for regime in ("few_rows", "many_rows"):
        calib = calib.with_regime(regime, skew_target_ctas=396, margin=0.5)
    calib = calib.with_regime("single_row", bucket_tiles_per_split=4)  # [300]: 10 tiles, 2 splits
    policy = _policy(calib, shape, options)
    persistent = PersistentKVEngine(shape, policy=policy, device="cpu")
    engine = AdaptiveEngine(policy, persistent, SdpaEngine(shape, "cpu"))
    step = _engine_inputs(lens)
    want = policy.choose(step)
    plan = engine.plan(step)
    if want.route.name == "flashinfer":
        assert not isinstance(plan, AdaptivePlan)
        return
    assert isinstance(plan, AdaptivePlan) and plan.decision == want and plan.route == want.route.name
    assert plan.num_splits == want.route.num_splits and plan.split_rule == want.route.split_rule
    reference = persistent.plan_route(step, want.route)
    got = plan.inner
    assert got.layout == reference.layout and got.num_splits == reference.num_splits
    assert torch.equal(got.host_meta, reference.host_meta) and torch.equal(got.meta, reference.meta)
    assert (got.merge, got.bucket_mode, got.split_rule) == (reference.merge, reference.bucket_mode,
                                                             reference.split_rule)
    assert type(got.schedule) is type(reference.schedule)


def test_the_adaptive_engine_decides_in_cpp_only_with_the_native_planner():
    shape = _shape(4)
    calib = _open(load_calibration(ROOT / "artifacts" / "reference" / "h100" / "calibration" / "calibration.json"))
    policy = _policy(calib, shape, {})
    native = AdaptiveEngine(policy, PersistentKVEngine(shape, policy=policy, device="cpu"), SdpaEngine(shape, "cpu"))
    numpy = AdaptiveEngine(policy, PersistentKVEngine(shape, policy=policy, device="cpu", planner="numpy"),
                           SdpaEngine(shape, "cpu"))
    step = _engine_inputs([8192] * 8)
    assert native._native is not None and numpy._native is None
    assert native.plan(step).decision == numpy.plan(step).decision


def _values(planner):
    calib = load_calibration(ROOT / "artifacts" / "reference" / "h100" / "calibration" / "calibration.json")
    return policy_values(_policy(calib, _shape(4), {}))


@pytest.mark.parametrize("index,value,message", [
    (0, 3.0, r"unknown policy version \(value \[0\] = 3"),
    (3, 0.0, r"num_kv_heads must be in 1..2\^31-1 \(value \[3\]"),
    (4, float("nan"), r"cost constants must be finite and >= 0 \(value \[4\]"),
    (12, 5.0, r"candidate route code must be -1, 0 or 1 \(value \[12\]"),
    (13, 2.5, r"num_splits must be in 1..1024 \(value \[13\]"),
    (18, 0.0, r"margin must be finite and > 0 \(value \[18\]"),
    (22, 0.0, r"bucket_tiles_per_split must be in 1..1024 \(value \[22\]"),
    (22, 1025.0, r"bucket_tiles_per_split must be in 1..1024 \(value \[22\]"),
])
def test_a_bad_policy_array_is_refused_naming_the_value(planner, index, value, message):
    values = _values(planner)
    values[index] = value
    with pytest.raises(RuntimeError, match=message):
        planner.choose_route(torch.tensor([100], dtype=torch.int32), torch.tensor(values, dtype=torch.float64))


def test_a_policy_array_of_the_wrong_length_or_type_is_refused(planner):
    values = _values(planner)
    lens = torch.tensor([100], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"wrong length \(46 values, expected 47\)"):
        planner.choose_route(lens, torch.tensor(values[:-1], dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous float64 CPU tensor"):
        planner.choose_route(lens, torch.tensor(values, dtype=torch.float32))


def test_a_step_without_tokens_is_refused(planner):
    calib = _open(load_calibration(ROOT / "artifacts" / "reference" / "h100" / "calibration" / "calibration.json"))
    values = torch.tensor(policy_values(_policy(calib, _shape(4), {})), dtype=torch.float64)
    with pytest.raises(RuntimeError, match="rows have no tokens"):
        planner.choose_route(torch.zeros(8, dtype=torch.int32), values)
    with pytest.raises(RuntimeError, match=r"seq_lens\[1\] must be >= 0, got -3"):
        planner.choose_route(torch.tensor([5, -3], dtype=torch.int32), values)


def test_the_native_policy_refuses_a_pinned_policy(planner):
    from pkv.policy import PinnedRoutePolicy, StepRoute
    with pytest.raises(TypeError, match="calibrated RoutePolicy"):
        NativeRoutePolicy(PinnedRoutePolicy(StepRoute("persistentkv_workqueue", 4)), planner)


def test_policy_values_follow_the_resolved_regimes(planner):
    calib = _open(load_calibration(ROOT / "artifacts" / "reference" / "h100" / "calibration" / "calibration.json"))
    calib = calib.with_regime("many_rows", route="persistentkv_workqueue", skew_target_ctas=396)
    values = policy_values(_policy(calib, _shape(4), {}))
    many = 11 + 2 * 12
    assert values[many + 1] == 0.0  # the workqueue's route code
    assert values[many + 9] == 396.0  # its skew budget
    assert len(values) == 47 and all(isinstance(v, float) for v in values)
    # The short-row rule is written as resolved: the bucket route's, and 1 under a workqueue candidate.
    calib = calib.with_regime("single_row", bucket_tiles_per_split=4).with_regime("many_rows", bucket_tiles_per_split=4)
    values = policy_values(_policy(calib, _shape(4), {}))
    assert (values[11 + 1], values[11 + 11]) == (1.0, 4.0) and values[many + 11] == 1.0


def test_a_gated_step_goes_to_flashinfer_without_the_one_call(monkeypatch):
    shape = _shape(4)
    calib = load_calibration(ROOT / "artifacts" / "reference" / "h100" / "calibration" / "calibration.json")
    policy = _policy(calib, shape, {})
    persistent = PersistentKVEngine(shape, policy=policy, device="cpu")
    engine = AdaptiveEngine(policy, persistent, SdpaEngine(shape, "cpu"))
    # Eight rows all below the B8 context gate the reference calibration fitted, whatever it is.
    gate = calib.regime(MANY_ROWS).min_context_tokens
    assert gate >= 16
    short = _engine_inputs([gate * (i + 1) // 9 for i in range(8)])
    assert policy.gate(short).basis == "gate: context" and policy.choose(short).basis == "gate: context"
    assert policy.gate(_engine_inputs([64 * 1024] * 8)) is None

    def no_call(*args):
        raise AssertionError("a gated step reached the C++ call")

    monkeypatch.setattr(persistent, "plan_chosen", no_call)
    assert not isinstance(engine.plan(short), AdaptivePlan)


class _OneOpPersistent:
    """An eager persistent engine on a GPU as the adaptive engine sees it, its launches recorded:
    the one op call decides and plans as plan_chosen does (CPU planner) and "launches" nothing."""

    planner, cuda_graph, device, implementation = "native", False, "cuda", "stand-in"

    def __init__(self, real, flashinfer_steps=()):
        self.real, self.ops, self.calls = real, real.ops, []
        self.flashinfer_steps = flashinfer_steps  # steps whose one call answers "FlashInfer's"

    def plan_route(self, step, route):
        return self.real.plan_route(step, route)

    def plan_chosen(self, step, native):
        self.calls.append("plan_chosen")
        return self.real.plan_chosen(step, native)

    def step_chosen(self, step, native, q, k, v):
        self.calls.append("step_chosen")
        _, choice, estimates, inner = self.real.plan_chosen(step, native)
        if step in self.flashinfer_steps:
            return choice, estimates, None, None
        packed = (inner.host_meta, inner.meta, inner.layout)
        return choice, estimates, packed, ("launched", packed)

    def device_plan_of(self, step, route, packed):
        return self.real.device_plan_of(step, route, packed)

    def run(self, q, k, v, inner):
        self.calls.append("run")
        return ("launched", inner)


class _Fallback:
    implementation = "fallback stand-in"

    def plan(self, step):
        return ("fallback plan", step)

    def run(self, q, k, v, plan):
        return ("fallback run", plan)


def test_a_one_op_step_decides_at_its_first_run_and_replays_its_plan_after():
    from pkv.engines.adaptive import OneOpPlan

    shape = _shape(4)
    calib = load_calibration(ROOT / "artifacts" / "reference" / "h100" / "calibration" / "calibration.json")
    policy = _policy(calib, shape, {})
    step = _engine_inputs([8192])
    persistent = _OneOpPersistent(PersistentKVEngine(shape, policy=policy, device="cpu"))
    engine = AdaptiveEngine(policy, persistent, _Fallback(), one_op_step=True)
    assert engine.implementation.endswith("+one_op")
    plan = engine.plan(step)
    assert isinstance(plan, OneOpPlan) and persistent.calls == []  # nothing decided before the run
    out = engine.run(None, None, None, plan)
    assert persistent.calls == ["step_chosen"] and out[0] == "launched"
    decided = plan.resolved()
    assert isinstance(decided, AdaptivePlan) and decided.decision == policy.choose(step)
    assert out[1] == (decided.inner.host_meta, decided.inner.meta, decided.inner.layout)
    assert decided.inner.layout == persistent.real.plan_route(step, decided.step_route).layout
    assert plan.route == decided.route and plan.num_splits == decided.num_splits
    assert engine.run(None, None, None, plan) == ("launched", decided.inner)  # the same plan, not decided again
    assert persistent.calls == ["step_chosen", "run"]
    # Read before its run: planned then, without a launch, and the run launches that plan.
    persistent.calls.clear()
    early = engine.plan(step)
    assert early.route == decided.route and persistent.calls == ["plan_chosen"]
    assert engine.run(None, None, None, early)[1] is early.resolved().inner
    assert persistent.calls == ["plan_chosen", "run"]
    # A step the one call leaves to FlashInfer runs the fallback's plan, made at that run.
    persistent.flashinfer_steps = (step,)
    persistent.calls.clear()
    left = engine.plan(step)
    assert engine.run(None, None, None, left) == ("fallback run", ("fallback plan", step))
    assert persistent.calls == ["step_chosen"] and left.resolved() == ("fallback plan", step)
    # A gated step goes to FlashInfer at plan(), as without the one op.
    gate = calib.regime(MANY_ROWS).min_context_tokens
    short = _engine_inputs([gate * (i + 1) // 9 for i in range(8)])  # every row below the B8 context gate
    assert engine.plan(short) == ("fallback plan", short)


def test_the_one_op_step_needs_an_eager_gpu_engine_and_the_native_policy():
    shape = _shape(4)
    calib = load_calibration(ROOT / "artifacts" / "reference" / "h100" / "calibration" / "calibration.json")
    policy = _policy(calib, shape, {})
    real = PersistentKVEngine(shape, policy=policy, device="cpu")
    with pytest.raises(ValueError, match="one_op_step needs"):
        AdaptiveEngine(policy, real, _Fallback(), one_op_step=True)  # on the CPU
    graphed = _OneOpPersistent(real)
    graphed.cuda_graph = True
    with pytest.raises(ValueError, match="one_op_step needs"):
        AdaptiveEngine(policy, graphed, _Fallback(), one_op_step=True)
    with pytest.raises(ValueError, match="one_op_step needs"):
        AdaptiveEngine(policy, _OneOpPersistent(real), _Fallback(), native_policy=False, one_op_step=True)
