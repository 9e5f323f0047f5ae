"""ReferenceEngine executes pkv.pipeline.schedule plans exactly: compared with the float64 dense path."""

import numpy as np
import pytest
import torch

from pkv.measure.accuracy import PAPER_MAX_ABS, PAPER_MEAN_ABS, check_within, compare
from pkv.engines.dense import dense_decode
from pkv.engines.reference import ReferenceEngine, work_items
from pkv.measure.kv_data import make_kv_pages, make_queries
from pkv.shape import ModelShape
from pkv.policy import FLASHINFER_ROUTE, StepRoute, pinned_route
from policy_constants import pinned

schedule = pytest.importorskip("pkv.pipeline.schedule")
pages_mod = pytest.importorskip("pkv.pipeline.pages")

P = 16
ROUTES = ("workqueue", "bucket_exact", "bucket_masked")
# Page and tile edges, a split boundary and rows far shorter than the split count.
EDGE_LENS = [1, P - 1, P, P + 1, 31, 33, 32 * 7, 32 * 7 + 1, 2, 500]


def num_physical_pages(step, hole_fraction):
    """The page universe assign_pages scatters ``step``'s rows over (make_step's holes layout)."""
    return pages_mod.universe_size(step.num_pages_used, hole_fraction)


@pytest.fixture
def inputs(make_step):
    """``inputs(lens, shape, dtype, seed=0, hole_fraction=0.5)``: a step with holes, its queries and
    its K and V pages."""

    def build(lens, shape, dtype, seed=0, hole_fraction=0.5):
        step = make_step(lens, P, hole_fraction=hole_fraction, seed=seed)
        k, v = make_kv_pages(num_physical_pages(step, hole_fraction), shape, P, dtype, "cpu", seed)
        q = make_queries(len(lens), shape, dtype, "cpu", seed + 100)
        return step, q, k, v

    return build


def engine(shape, route, splits):
    return ReferenceEngine(shape, policy=pinned(route, schedule.SplitPolicy(num_splits=splits), splits))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("group_size", [1, 2, 4, 5, 7, 8])
def test_float64_matches_dense_on_edge_lengths(route, group_size, inputs):
    shape = ModelShape(num_qo_heads=2 * group_size, num_kv_heads=2, head_dim=32)
    step, q, k, v = inputs(EDGE_LENS, shape, torch.float64, seed=group_size)
    ref = dense_decode(q, k, v, step.seq_lens, step.block_table)
    for splits in (1, 3, 8):
        eng = engine(shape, route, splits)
        out = eng.run(q, k, v, eng.plan(step))
        assert out.dtype == torch.float64
        assert not torch.isnan(out).any()
        assert compare(out, ref)["rel_err"] < 1e-6, (route, splits)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_float64_matches_dense_on_random_batches(route, seed, inputs):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 700, size=int(rng.integers(1, 9))).tolist()
    shape = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=64)
    step, q, k, v = inputs(lens, shape, torch.float64, seed=seed, hole_fraction=[0.0, 0.5][seed % 2])
    ref = dense_decode(q, k, v, step.seq_lens, step.block_table)
    eng = engine(shape, route, int(rng.integers(1, 24)))
    assert compare(eng.run(q, k, v, eng.plan(step)), ref)["rel_err"] < 1e-6


@pytest.mark.parametrize("route", ROUTES)
def test_fp16_inputs_within_paper_bounds_on_peaked_attention(route, inputs):
    shape = ModelShape(num_qo_heads=32, num_kv_heads=8, head_dim=128)
    lens = [1, 17, 33, 1000, 2047, 4096]
    step, q, k, v = inputs(lens, shape, torch.float16, seed=7)
    ref = dense_decode(q, k, v, step.seq_lens, step.block_table)
    eng = engine(shape, route, 20)
    out = eng.run(q, k, v, eng.plan(step))
    assert out.dtype == torch.float16
    errors = compare(out, ref)
    assert check_within(errors, max_abs=PAPER_MAX_ABS, mean_abs=PAPER_MEAN_ABS, rel=2e-3), errors


def test_peaked_inputs_make_a_dropped_tile_visible(inputs):
    # The point of peaked inputs: losing part of the context must break the bounds.
    shape = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=64)
    lens = [2048, 4096]
    step, q, k, v = inputs(lens, shape, torch.float32, seed=3)
    full = dense_decode(q, k, v, step.seq_lens, step.block_table)
    truncated = dense_decode(q, k, v, step.seq_lens - 32 * 8, step.block_table)
    assert not check_within(compare(truncated, full))


def test_partial_states_merge_equals_run_and_slots_follow_contract(inputs):
    shape = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=32)
    lens = [3, 40, 300]
    step, q, k, v = inputs(lens, shape, torch.float64, seed=5)
    for route in ROUTES:
        eng = engine(shape, route, 4)
        plan = eng.plan(step)
        m, l, acc = eng.partial_states(q, k, v, plan)
        assert m.dtype == l.dtype == acc.dtype == torch.float64
        assert not torch.isnan(m).any() and not torch.isnan(acc).any()
        torch.testing.assert_close(eng.merge_states(m, l, acc, plan).to(q.dtype),
                                   eng.run(q, k, v, plan), rtol=0, atol=0)
        if route == "workqueue":
            assert m.shape[0] == int(plan.schedule.split_offsets[-1])
        else:
            expected = sum(len(x.row_indices) * 2 * x.num_splits for x in plan.schedule.launches)
            assert m.shape[0] == expected


def test_workqueue_partial_state_of_a_task_is_its_tile_range(inputs):
    shape = ModelShape(num_qo_heads=4, num_kv_heads=1, head_dim=16)
    lens = [200]
    step, q, k, v = inputs(lens, shape, torch.float64, seed=9)
    eng = engine(shape, "workqueue", 3)
    plan = eng.plan(step)
    m, l, acc = eng.partial_states(q, k, v, plan)
    # Task of split 1: recompute its softmax state directly from the tokens it covers.
    task = next(t for t in plan.schedule.tasks if t[2] == 1)
    lo, hi = 32 * int(task[3]), min(32 * int(task[4]), lens[0])
    tokens = np.arange(lo, hi)
    pages = step.block_table[0, tokens // P]
    keys = k[pages, 0, tokens % P]
    values = v[pages, 0, tokens % P]
    scores = q[0] @ keys.T * shape.sm_scale
    slot = int(plan.schedule.split_offsets[0]) + 1
    torch.testing.assert_close(m[slot], scores.max(dim=-1).values)
    weights = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
    torch.testing.assert_close(l[slot], weights.sum(-1))
    torch.testing.assert_close(acc[slot], weights @ values)


def test_empty_bucket_splits_hold_the_neutral_state(inputs):
    shape = ModelShape(num_qo_heads=4, num_kv_heads=2, head_dim=16)
    lens = [1, 640]  # masked bucket: row 0 owns 1 tile of the 20 splits
    step, q, k, v = inputs(lens, shape, torch.float64, seed=1)
    eng = engine(shape, "bucket_masked", 20)
    plan = eng.plan(step)
    m, l, acc = eng.partial_states(q, k, v, plan)
    splits = plan.schedule.launches[0].num_splits
    row0 = slice(0, 2 * splits)
    m0 = m[row0].reshape(2, splits, -1)
    assert torch.isneginf(m0[:, 1:]).all() and torch.isfinite(m0[:, 0]).all()
    assert (l[row0].reshape(2, splits, -1)[:, 1:] == 0).all()
    assert (acc[row0].reshape(2, splits, shape.group_size, 16)[:, 1:] == 0).all()


def test_output_is_poisoned_where_a_plan_writes_nothing(inputs):
    shape = ModelShape(num_qo_heads=4, num_kv_heads=2, head_dim=16)
    step, q, k, v = inputs([50, 70], shape, torch.float32, seed=2)
    eng = engine(shape, "bucket_exact", 2)
    plan = eng.plan(step)
    # Drop the launch that holds row 1: its output must stay NaN, not zeros or stale data.
    kept = tuple(x for x in plan.schedule.launches if 1 not in x.row_indices.tolist())
    plan.schedule = schedule.BucketPlan(kept, 2, 2, "exact")
    out = eng.run(q, k, v, plan)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()


def test_invalid_workqueue_task_is_rejected_with_its_index(inputs):
    shape = ModelShape(num_qo_heads=4, num_kv_heads=1, head_dim=16)
    step, q, k, v = inputs([64], shape, torch.float32, seed=2)
    eng = engine(shape, "workqueue", 2)
    plan = eng.plan(step)
    tasks = plan.schedule.tasks.copy()
    tasks[0, 4] = 99  # tile_end past the row's 2 tiles
    plan.schedule = schedule.WorkqueuePlan(tasks, plan.schedule.split_offsets, 1, 4,
                                           plan.schedule.max_splits)
    with pytest.raises(ValueError, match=r"tasks\[0\]"):
        work_items(plan, 1)


def test_plan_route_uses_the_routes_kernel_and_splits(inputs):
    shape = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=32)
    step, q, k, v = inputs([100, 900], shape, torch.float64, seed=4)
    ref = dense_decode(q, k, v, step.seq_lens, step.block_table)
    eng = engine(shape, "workqueue", 20)
    wq = eng.plan_route(step, StepRoute("persistentkv_workqueue", 5))
    assert wq.route == "persistentkv_workqueue" and wq.num_splits == 5
    assert int(np.diff(wq.schedule.split_offsets).max()) == 5
    bucket = eng.plan_route(step, StepRoute("persistentkv_bucket", 7))
    assert bucket.route == "persistentkv_bucket"
    assert max(x.num_splits for x in bucket.schedule.launches) == 7
    for plan in (wq, bucket):
        assert compare(eng.run(q, k, v, plan), ref)["rel_err"] < 1e-6
    with pytest.raises(ValueError, match="flashinfer"):
        eng.plan_route(step, FLASHINFER_ROUTE)


def test_a_pinned_schedule_must_be_known():
    with pytest.raises(ValueError, match="schedule"):
        pinned_route("buckets", None)


@pytest.mark.parametrize("page_size", [1, 8, 12, 64])
def test_page_sizes_that_do_not_match_the_tile(page_size, make_step):
    shape = ModelShape(num_qo_heads=4, num_kv_heads=2, head_dim=16)
    lens = [1, page_size - 1 or 1, page_size + 1, 31, 33, 97, 260]
    step = make_step(lens, page_size, hole_fraction=0.5, seed=3)
    k, v = make_kv_pages(num_physical_pages(step, 0.5), shape, page_size, torch.float64, "cpu", 3)
    q = make_queries(len(lens), shape, torch.float64, "cpu", 4)
    ref = dense_decode(q, k, v, step.seq_lens, step.block_table)
    for route in ROUTES:
        eng = engine(shape, route, 3)
        assert compare(eng.run(q, k, v, eng.plan(step)), ref)["rel_err"] < 1e-6, route
