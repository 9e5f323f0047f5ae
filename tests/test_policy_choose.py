"""RoutePolicy.choose: gates, each regime's route and split count, the margins, and pinned routes."""

import dataclasses

import numpy as np
import pytest

from pkv.policy import FLASHINFER_ROUTE, Estimator, KernelVariants, PinnedRoutePolicy, RoutePolicy, StepRoute
from pkv.policy.choose import GATE_GROUP, GATE_REGIME, bucket_split_count, pinned_route
from pkv.policy.overrides import apply_engine_options, kernel_variants
from pkv.policy.regime import CalibrationError, RegimeParams
from policy_constants import PAPER, SHAPE


@pytest.fixture
def long_batch(make_step):
    return lambda batch, base=20000: make_step([base + 977 * i for i in range(batch)])


def speedup(route: StepRoute, step, calib):
    est = Estimator(calib, **SHAPE)
    lens = step.seq_lens.tolist()
    return est.total_us(lens, FLASHINFER_ROUTE) / est.total_us(lens, route)


@pytest.mark.parametrize("group_size, num_kv_heads", [(1, 32), (8, 4), (2, 16)])
def test_uncalibrated_group_size_goes_to_flashinfer(group_size, num_kv_heads, long_batch):
    policy = RoutePolicy(PAPER, num_kv_heads=num_kv_heads, group_size=group_size, head_dim=128)
    for batch in (1, 8):
        assert policy.choose(long_batch(batch, 65536)) is GATE_GROUP


def test_short_context_goes_to_flashinfer(make_step):
    policy = RoutePolicy(PAPER, **SHAPE)
    assert policy.choose(make_step([16383])).reason == "gate: context"
    assert policy.choose(make_step([4000] * 8)).route == FLASHINFER_ROUTE
    # The gate looks at the longest row: one long row makes the step eligible.
    assert policy.choose(make_step([16384])).route.name == "persistentkv_bucket"


def test_each_regime_has_its_own_context_gate(make_step):
    calib = PAPER.with_regime("few_rows", min_context_tokens=1024, route="persistentkv_workqueue")
    calib = calib.with_regime("many_rows", min_context_tokens=4096)
    policy = RoutePolicy(calib, **SHAPE)
    assert policy.choose(make_step([8000])).reason == "gate: context"
    assert policy.choose(make_step([3000] * 8)).reason == "gate: context"
    assert policy.choose(make_step([5000] * 8)).reason != "gate: context"
    assert policy.choose(make_step([1500] * 4)).reason != "gate: context"
    assert policy.choose(make_step([900] * 4)).reason == "gate: context"


def test_single_row_uses_buckets_with_its_split_count(make_step):
    decision = RoutePolicy(PAPER, **SHAPE).choose(make_step([32768]))
    assert decision.route == StepRoute("persistentkv_bucket", 32)
    assert set(decision.estimates) == {"flashinfer", "persistentkv_bucket"}
    assert decision.estimates["persistentkv_bucket"] < decision.estimates["flashinfer"]
    assert decision.reason.startswith("estimate") and "margin 1.05x" in decision.reason


def test_many_rows_use_the_workqueue_with_its_split_count(long_batch):
    step = long_batch(8)
    decision = RoutePolicy(PAPER, **SHAPE).choose(step)
    assert decision.route == StepRoute("persistentkv_workqueue", 20)
    expected = Estimator(PAPER, **SHAPE).total_us(step.seq_lens.tolist(), decision.route)
    assert decision.estimates["persistentkv_workqueue"] == pytest.approx(expected)


@pytest.mark.parametrize("batch", [2, 3, 4, 5, 6, 7])
def test_a_closed_few_rows_regime_stays_on_flashinfer(batch, long_batch):
    assert RoutePolicy(PAPER, **SHAPE).choose(long_batch(batch)) is GATE_REGIME


@pytest.mark.parametrize("opened_by", ["option", "calibration"])
def test_few_rows_need_their_own_margin_at_their_own_split_count(opened_by, long_batch):
    step = long_batch(4)
    base = PAPER.with_regime("few_rows", num_splits=36)
    base = apply_engine_options(base, open_few_rows=True) if opened_by == "option" else \
        base.with_regime("few_rows", route="persistentkv_workqueue")
    s = speedup(StepRoute("persistentkv_workqueue", 36), step, base)
    assert s != speedup(StepRoute("persistentkv_workqueue", 20), step, base)
    above = base.with_regime("few_rows", margin=s * 1.01).with_regime("many_rows", margin=s * 0.5)
    below = base.with_regime("few_rows", margin=s * 0.99).with_regime("many_rows", margin=s * 2.0)
    assert RoutePolicy(above, **SHAPE).choose(step).route == FLASHINFER_ROUTE
    assert RoutePolicy(below, **SHAPE).choose(step).route == StepRoute("persistentkv_workqueue", 36)


@pytest.mark.parametrize("batch, regime, route", [(1, "single_row", StepRoute("persistentkv_bucket", 32)),
                                                  (8, "many_rows", StepRoute("persistentkv_workqueue", 20)),
                                                  (16, "many_rows", StepRoute("persistentkv_workqueue", 20))])
def test_each_regime_reads_its_own_margin(batch, regime, route, long_batch):
    step = long_batch(batch)
    s = speedup(route, step, PAPER)
    blocked = PAPER.with_regime(regime, margin=s * 1.01)
    decision = RoutePolicy(blocked, **SHAPE).choose(step)
    assert decision.route == FLASHINFER_ROUTE and "<" in decision.reason
    assert set(decision.estimates) == {"flashinfer", route.name}
    assert RoutePolicy(PAPER.with_regime(regime, margin=s * 0.99), **SHAPE).choose(step).route == route


def test_policy_follows_calibrated_split_counts(make_step, long_batch):
    calib = PAPER.with_regime("single_row", num_splits=28).with_regime("many_rows", num_splits=24)
    policy = RoutePolicy(calib, **SHAPE)
    assert policy.choose(make_step([65536])).route.num_splits == 28
    assert policy.choose(long_batch(8)).route.num_splits == 24


def test_the_route_carries_the_run_variants_and_split_rule(make_step):
    calib = dataclasses.replace(PAPER, workqueue_split_kind="balanced")
    policy = RoutePolicy(calib, **SHAPE, variants=KernelVariants(bucket_mode="masked", merge="fused"))
    route = policy.choose(make_step([65536])).route
    assert (route.bucket_mode, route.merge, route.split_kind) == ("masked", "fused", "balanced")
    with pytest.raises(ValueError, match="cluster merge is a bucket-route merge"):
        RoutePolicy(calib.with_all_regimes(num_splits=16), **SHAPE, variants=KernelVariants(merge="cluster"))
    with pytest.raises(ValueError, match="at most 16 splits"):
        StepRoute("persistentkv_bucket", 32, merge="cluster")


def test_engine_options_override_the_calibration_once():
    calib = apply_engine_options(PAPER, num_splits=12, bucket_num_splits=40, split_kind="balanced")
    assert [calib.regime(r).num_splits for r in ("single_row", "few_rows", "many_rows")] == [40, 12, 12]
    assert calib.workqueue_split_kind == "balanced"
    assert apply_engine_options(PAPER) == PAPER
    # A fixed split count holds on every step: the uniform cap is lifted with it, and kept without it.
    capped = dataclasses.replace(PAPER, uniform_target_ctas=256)
    assert apply_engine_options(capped, num_splits=12).uniform_target_ctas == 0
    assert apply_engine_options(capped, bucket_num_splits=40).uniform_target_ctas == 256
    skewed = PAPER.with_regime("many_rows", skew_target_ctas=264, over_split_balanced=True)
    lifted = apply_engine_options(skewed, num_splits=12).many_rows
    assert (lifted.skew_target_ctas, lifted.over_split_balanced) == (0, False)
    assert apply_engine_options(skewed, bucket_num_splits=40).many_rows.skew_target_ctas == 264
    opened = PAPER.with_regime("few_rows", route="persistentkv_bucket")
    assert apply_engine_options(opened, open_few_rows=True).few_rows.route == "persistentkv_bucket"
    # The short-row rule: set for the single row; a fixed split count lifts it, as it lifts the others.
    short = apply_engine_options(PAPER, bucket_tiles_per_split=4)
    assert short.single_row.bucket_tiles_per_split == 4 and short.many_rows == PAPER.many_rows
    assert apply_engine_options(short, num_splits=12).single_row.bucket_tiles_per_split == 1
    assert apply_engine_options(short, bucket_num_splits=40).single_row.bucket_tiles_per_split == 1
    assert apply_engine_options(short, bucket_num_splits=40, bucket_tiles_per_split=2).single_row == \
        dataclasses.replace(PAPER.single_row, num_splits=40, bucket_tiles_per_split=2)
    assert kernel_variants("bucket_masked", "fused") == KernelVariants("masked", "fused")
    with pytest.raises(ValueError, match="schedule"):
        kernel_variants("diagonal")


def test_pinned_routes(make_step):
    assert pinned_route("bucket_masked", PAPER) == StepRoute("persistentkv_bucket", 32, bucket_mode="masked")
    assert pinned_route("workqueue", PAPER.with_all_regimes(num_splits=8)) == StepRoute("persistentkv_workqueue", 8)
    assert pinned_route("workqueue", None) == StepRoute("persistentkv_workqueue", 20)
    policy = PinnedRoutePolicy(pinned_route("bucket_exact", PAPER))
    assert policy.choose(make_step([100] * 5)).route == StepRoute("persistentkv_bucket", 32)
    with pytest.raises(ValueError, match="FlashInfer"):
        PinnedRoutePolicy(FLASHINFER_ROUTE)


def test_uniform_batches_take_at_most_the_calibrated_ctas_and_ragged_ones_their_regimes_splits(make_step):
    """uniform_target_ctas caps a workqueue step's splits at the count whose CTAs come nearest the
    target where its rows have about one length: B8 of 32K rows (64 pairs) at 256 CTAs takes 4
    splits; a ragged B8, a batch whose pairs alone lie past 1.5x the target, and a calibration
    without a cap keep the regime's 20."""
    from pkv.policy.choose import UNIFORM_LENGTH_FRACTION, uniform_split_count

    calib = dataclasses.replace(PAPER, uniform_target_ctas=256)
    policy = RoutePolicy(calib, **SHAPE)
    uniform = make_step([32768 + 17 * i for i in range(8)])
    assert policy.choose(uniform).route == StepRoute("persistentkv_workqueue", 4)
    assert policy.choose(uniform).route is policy.choose(make_step([32800] * 8)).route  # built once
    assert policy.choose(make_step([32768] * 4 + [4096] * 4)).route.num_splits == 20
    assert RoutePolicy(PAPER, **SHAPE).choose(uniform).route.num_splits == 20
    # Rounded to the nearest count, kept within 1.5x of the target either way: B9 takes 4 (288
    # CTAs), B17 2 (272), B48 1 (384); B49's 392 CTAs at one split are past 384: no cap.
    counts = {b: uniform_split_count([20000] * b, 20000, 8, 20, 256) for b in (2, 5, 9, 13, 17, 22, 48, 49, 64)}
    assert counts == {2: 16, 5: 6, 9: 4, 13: 2, 17: 2, 22: 1, 48: 1, 49: 20, 64: 20}
    assert uniform_split_count([20000] * 2, 20000, 8, 16, 256) == 16  # the cap only lowers a count
    # The estimate is of the capped route, so the margin still decides.
    decision = policy.choose(uniform)
    assert decision.estimates["persistentkv_workqueue"] == pytest.approx(
        Estimator(calib, **SHAPE).total_us(uniform.seq_lens.tolist(), decision.route))
    # The boundary of "about one length", with lists and arrays alike.
    import numpy as np
    longest = 10000
    edge = [longest, int(np.ceil(UNIFORM_LENGTH_FRACTION * longest))]
    assert uniform_split_count(edge, longest, 8, 20, 256) == 16
    assert uniform_split_count(np.array(edge), longest, 8, 20, 256) == 16
    assert uniform_split_count([longest, edge[1] - 1], longest, 8, 20, 256) == 20
    # The balanced rule has its own budget: no cap.
    balanced = RoutePolicy(dataclasses.replace(calib, workqueue_split_kind="balanced"), **SHAPE)
    assert balanced.choose(uniform).route.num_splits == 20


def test_skewed_steps_take_the_balanced_rule_with_the_calibrated_budget(make_step):
    """skew_target_ctas gives a workqueue step whose longest row holds more than 2/3 of its tokens
    the balanced rule with that task budget; other steps, a calibration without it and a run whose
    rule is already balanced keep their route."""
    import numpy as np

    from pkv.policy.choose import is_skewed

    # Margins opened, so the rule's route, not the estimate against FlashInfer, is what is tested.
    calib = dataclasses.replace(PAPER, uniform_target_ctas=256).with_all_regimes(margin=0.1, skew_target_ctas=264)
    calib = calib.with_regime("few_rows", route="persistentkv_workqueue")
    policy = RoutePolicy(calib, **SHAPE)
    skewed = make_step([131072] + [100] * 63)  # the kernel benchmark's skewed batch
    decision = policy.choose(skewed)
    assert decision.route == StepRoute("persistentkv_workqueue", 20, "balanced", target_ctas=264)
    assert decision.route is policy.choose(make_step([131072] + [200] * 63)).route  # built once
    # The estimate is of the balanced route.
    assert decision.estimates["persistentkv_workqueue"] == pytest.approx(
        Estimator(calib, **SHAPE).total_us(skewed.seq_lens, decision.route))
    # Short batches count as lists, long ones as arrays: the same decision.
    assert policy.choose(make_step([65536, 1000, 2000])).route == StepRoute("persistentkv_workqueue", 32, "balanced",
                                                                          target_ctas=264)
    # Two long rows among short ones, a ragged B8 and a uniform one are not skewed.
    assert policy.choose(make_step([131072] * 2 + [100] * 62)).route == StepRoute("persistentkv_workqueue", 20)
    assert policy.choose(make_step([32768] * 4 + [4096] * 4)).route.split_kind == "fixed"
    assert policy.choose(make_step([32768] * 8)).route == StepRoute("persistentkv_workqueue", 4)
    unset = calib.with_all_regimes(skew_target_ctas=0)
    assert RoutePolicy(unset, **SHAPE).choose(skewed).route == StepRoute("persistentkv_workqueue", 20)
    # The boundary: more than twice the other rows' tokens together.
    assert is_skewed(3, 2001, 3001) and not is_skewed(3, 2000, 3000) and not is_skewed(1, 5000, 5000)
    assert is_skewed(64, int(np.int64(131072)), int(np.int64(131072 + 6300)))
    # The B1 bucket route and a pinned balanced rule are left as they are.
    assert policy.choose(make_step([131072])).route.name == "persistentkv_bucket"
    balanced = RoutePolicy(dataclasses.replace(calib, workqueue_split_kind="balanced"), **SHAPE)
    assert balanced.choose(skewed).route == StepRoute("persistentkv_workqueue", 20, "balanced")


def test_over_split_steps_take_the_balanced_rule_where_the_calibration_opened_it(make_step):
    """over_split_balanced gives a workqueue step whose mean row holds fewer than 2 tiles per split
    of the regime's count (64 rows of about 500 tokens: the fixed rule's tasks hold one tile) the
    skew rule's balanced route; without it, or without a skew budget, such a step keeps the fixed
    rule, and steps with longer rows keep theirs."""
    from pkv.policy.calibration import CalibrationError
    from pkv.policy.choose import OVER_SPLIT_TILES, is_over_split
    from pkv.pipeline.schedule import TILE_TOKENS

    calib = PAPER.with_all_regimes(margin=0.1, min_context_tokens=0, skew_target_ctas=396, over_split_balanced=True)
    policy = RoutePolicy(calib, **SHAPE)
    rng = np.random.default_rng(5)
    short = make_step(rng.integers(64, 1024, size=64).tolist())
    balanced = StepRoute("persistentkv_workqueue", 20, "balanced", target_ctas=396)
    assert policy.choose(short).route == balanced
    assert policy.choose(make_step([500] * 8)).route == balanced  # 8 rows as a list, not an array
    # Rows long enough for their splits, and a closed rule, keep the fixed rule.
    assert policy.choose(make_step([4096] * 3 + [32768] * 5)).route == StepRoute("persistentkv_workqueue", 20)
    closed = RoutePolicy(calib.with_all_regimes(over_split_balanced=False), **SHAPE)
    assert closed.choose(short).route.split_kind == "fixed"
    # The boundary: a mean row of 2 tiles per split is not over-split; one token fewer is.
    edge = OVER_SPLIT_TILES * TILE_TOKENS * 20
    assert not is_over_split(4, 4 * edge, 20) and is_over_split(4, 4 * edge - 1, 20) and not is_over_split(1, 1, 20)
    # The rule rides on the skew budget, and the calibration refuses it alone.
    with pytest.raises(CalibrationError, match="over_split_balanced=True.*skew_target_ctas=0"):
        calib.with_regime("many_rows", skew_target_ctas=0)
    with pytest.raises(CalibrationError, match="over_split_balanced='yes'"):
        calib.with_regime("many_rows", over_split_balanced="yes")


@pytest.mark.parametrize("tokens, splits, tiles_per_split, want", [
    (384, 32, 1, 32),     # the rule off: the planner cuts the row's 12 tiles into 12 one-tile splits
    (384, 32, 4, 2),      # 12 tiles hold 3 splits of 4 tiles; a power of two below: 2
    (384, 32, 3, 4),      # 4 splits of 3 tiles
    (2048, 32, 4, 16),    # 64 tiles, 16 splits of 4
    (2048, 32, 3, 16),    # 21 would hold 3 tiles each; 16
    (8192, 32, 4, 32),    # 256 tiles: 64 splits of 4 would fit, so the regime's 32
    (100, 32, 4, 1),      # 4 tiles: one split of 4
    (31, 32, 4, 1),       # one tile, fewer than asked: still one split
    (0, 32, 4, 1),
])
def test_a_short_rows_bucket_split_count(tokens, splits, tiles_per_split, want):
    assert bucket_split_count(tokens, splits, tiles_per_split) == want


def test_a_short_single_row_takes_fewer_splits_where_its_regime_asks_for_several_tiles_a_split(make_step):
    calib = PAPER.with_all_regimes(min_context_tokens=0, margin=0.1)
    short = RoutePolicy(calib.with_regime("single_row", bucket_tiles_per_split=4), **SHAPE)
    plain = RoutePolicy(calib, **SHAPE)
    decision = short.choose(make_step([384]))
    assert decision.route == StepRoute("persistentkv_bucket", 2) == short.ruled_route(make_step([384]))
    assert decision.estimates["persistentkv_bucket"] == Estimator(calib, **SHAPE).total_us([384], decision.route)
    assert plain.choose(make_step([384])).route == StepRoute("persistentkv_bucket", 32)
    # One route object per count (a graphed server keys its graphs by it); long rows keep the regime's count.
    assert short.choose(make_step([390])).route is decision.route
    assert short.choose(make_step([32768])).route == plain.choose(make_step([32768])).route
    # The workqueue's regimes do not read it, whatever they hold.
    wq = RoutePolicy(calib.with_all_regimes(bucket_tiles_per_split=4), **SHAPE)
    assert wq.choose(make_step([300] * 8)).route == plain.choose(make_step([300] * 8)).route


@pytest.mark.parametrize("value", [0, -4, 2.5, True])
def test_a_bad_bucket_tiles_per_split_is_refused_by_name(value):
    fields = dict(route="persistentkv_bucket", num_splits=32, min_context_tokens=0, margin=1.05)
    with pytest.raises(CalibrationError, match=r"bucket_tiles_per_split"):
        RegimeParams.from_mapping({**fields, "bucket_tiles_per_split": value}, "regimes.single_row")
    # A file written before the rule reads as the rule off.
    assert RegimeParams.from_mapping(fields, "regimes.single_row").bucket_tiles_per_split == 1


def test_the_ruled_route_is_what_choose_estimates_whatever_the_gates_and_margins(make_step):
    """RoutePolicy.ruled_route (what a calibration probe times) is the route choose() weighs against
    FlashInfer on every step past the gates, and it is given for steps the gates or the estimate
    send to FlashInfer too; a regime whose route is FlashInfer has none, and RuledRoutePolicy
    refuses to probe it closed."""
    from pkv.policy.choose import RuledRoutePolicy

    calib = dataclasses.replace(PAPER, uniform_target_ctas=256).with_all_regimes(skew_target_ctas=264,
                                                                                 over_split_balanced=True)
    calib = calib.with_regime("few_rows", route="persistentkv_workqueue")
    opened = RoutePolicy(calib.with_all_regimes(margin=0.1, min_context_tokens=0), **SHAPE)
    gated = RoutePolicy(calib.with_all_regimes(margin=100.0, min_context_tokens=1 << 20), **SHAPE)
    rng = np.random.default_rng(7)
    steps = [make_step([131072] + [100] * 63), make_step([500] * 8), make_step([32768] * 8),
             make_step([32768] * 4 + [4096] * 4), make_step([65536, 1000, 2000]), make_step([131072]),
             make_step(rng.integers(64, 70000, size=24).tolist())]
    for step in steps:
        assert opened.ruled_route(step) == opened.choose(step).route
        assert gated.choose(step).route.name == FLASHINFER_ROUTE.name
        assert gated.ruled_route(step) == opened.ruled_route(step)
        assert RuledRoutePolicy(gated).choose(step).route == opened.ruled_route(step)
    closed = RoutePolicy(calib.with_regime("few_rows", route=FLASHINFER_ROUTE.name), **SHAPE)
    assert closed.ruled_route(make_step([65536, 1000, 2000])) is None
    with pytest.raises(ValueError, match="B3 regime's route is FlashInfer"):
        RuledRoutePolicy(closed).choose(make_step([65536, 1000, 2000]))
    # A probe of another regime runs such a step on its own candidate.
    probed = closed.candidate(8)
    assert RuledRoutePolicy(closed, probed).choose(make_step([65536, 1000, 2000])).route is probed
