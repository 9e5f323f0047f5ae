"""The device-planned step's host-side length check, which needs no GPU."""

from __future__ import annotations

import numpy as np
import pytest

from pkv.engines.device_step import check_lengths


def test_lengths_the_table_addresses_pass():
    check_lengths(np.array([1, 16, 17, 4096, 0]), 256, 16)


@pytest.mark.parametrize("lengths, row, length", [([4097], 0, 4097), ([5, 10, 99999, 5000], 2, 99999),
                                                  ([3, -1], 1, -1)])
def test_the_first_bad_row_is_named_with_its_length_and_the_limit(lengths, row, length):
    with pytest.raises(ValueError, match=rf"row {row} has length {length}; the block table's 256 pages of 16 "
                                         rf"tokens address 0\.\.4096"):
        check_lengths(np.array(lengths), 256, 16)


def test_routed_graph_buckets_and_buffers_on_any_device():
    import torch

    from pkv.engines.routed_graphs import RoutedGraphStep
    from pkv.shape import ModelShape

    shape = ModelShape()
    k = torch.zeros(4, shape.num_kv_heads, 16, shape.head_dim, dtype=torch.float16)
    routed = RoutedGraphStep(None, shape, k, k, max_pages=8, batch_buckets=(8, 1, 2))
    assert routed.batch_buckets == (1, 2, 8)
    assert [routed.bucket_of(b) for b in (1, 2, 3, 8)] == [1, 2, 8, 8]
    with pytest.raises(ValueError, match="batch 9 exceeds the largest bucket 8"):
        routed.bucket_of(9)
    with pytest.raises(ValueError, match=r"write the step into buffers\(3\) first"):
        routed.run(np.array([5, 6, 7]))
    buffers = routed.buffers(3)
    assert buffers.q.shape == (3, shape.num_qo_heads, shape.head_dim) and buffers.block_table.shape == (3, 8)
    assert routed.buffers(5).q.data_ptr() == buffers.q.data_ptr()  # one bucket, one set of tensors
    with pytest.raises(ValueError, match="batch_buckets"):
        RoutedGraphStep(None, shape, k, k, max_pages=8, batch_buckets=())
    listed = RoutedGraphStep(None, shape, k, k, max_pages=8, batch_buckets=(4,), page_lists=True)
    lists = listed.buffers(3)
    assert lists.page_lists.indptr.shape == (4,) and lists.page_lists.indices.shape == (32,)
    assert lists.q.shape[0] == lists.seq_lens.shape[0] == lists.out.shape[0] == 3
    with pytest.raises(ValueError, match=r"planner must be None or one of \('plan_kernel', 'in_decode'\), got 'host'"):
        RoutedGraphStep(None, shape, k, k, max_pages=8, planner="host")


EDGE = [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 4097]


def test_the_device_plan_is_the_host_plan_order_included():
    from types import SimpleNamespace

    from pkv.pipeline.schedule import SplitPolicy, plan_workqueue, plan_workqueue_device_order

    rng = np.random.default_rng(0)
    for trial in range(200):
        batch, splits = int(rng.integers(1, 40)), int(rng.integers(1, 70))
        lens = rng.choice(np.r_[EDGE, rng.integers(1, 70000, size=5)], size=batch).astype(np.int32)
        device = plan_workqueue_device_order(lens, 8, 4, splits)
        host = plan_workqueue(SimpleNamespace(seq_lens=lens), 8, 4, SplitPolicy(num_splits=splits))
        assert np.array_equal(device.split_offsets, host.split_offsets), trial
        assert np.array_equal(device.tasks, host.tasks), trial
        assert np.all(np.diff(device.tasks[:, 4] - device.tasks[:, 3]) <= 0), "tasks longest first"


def test_the_device_plan_of_the_balanced_rule_is_the_host_plans_within_its_capacity():
    """The balanced rule on the device: plan_workqueue's plan, order included, and never more
    tasks than max_workqueue_tasks (the workspace's capacity)."""
    from types import SimpleNamespace

    from pkv.pipeline.schedule import SplitPolicy, max_workqueue_tasks, plan_workqueue, plan_workqueue_device_order

    rng = np.random.default_rng(11)
    widest_seen = 0
    for trial in range(300):
        batch, splits, hkv = int(rng.integers(1, 40)), int(rng.integers(1, 40)), int(rng.choice([1, 2, 8]))
        target = int(rng.choice([0, 1, 7, 132, 396, 5000]))
        policy = SplitPolicy("balanced", splits, int(rng.choice([1, 4, 64])), target)
        lens = rng.choice(np.r_[EDGE, rng.integers(1, 200000, size=5)], size=batch).astype(np.int32)
        device = plan_workqueue_device_order(lens, hkv, 1, policy)
        host = plan_workqueue(SimpleNamespace(seq_lens=lens), hkv, 1, policy)
        assert np.array_equal(device.split_offsets, host.split_offsets), trial
        assert np.array_equal(device.tasks, host.tasks), trial
        assert device.num_tasks <= max_workqueue_tasks(batch, hkv, policy), trial
        widest_seen = max(widest_seen, device.num_tasks / max_workqueue_tasks(batch, hkv, policy))
    assert widest_seen > 0.9  # the bound is close to what some batches take
    # The total counts the clamped lengths, as the kernel sees them.
    policy = SplitPolicy("balanced", 1, 64, 16)
    clamped = plan_workqueue_device_order(np.array([10**6, 640]), 1, 1, policy, max_tokens=640)
    assert clamped.split_offsets.tolist() == plan_workqueue_device_order(np.array([640, 640]), 1, 1,
                                                                         policy).split_offsets.tolist() == [0, 7, 14]
    # Rows of length 0 (a graph bucket's padding) take no share of the default budget.
    for trial in range(50):
        lens = rng.integers(1, 50000, size=int(rng.integers(1, 20)))
        policy = SplitPolicy("balanced", int(rng.integers(1, 40)))
        alone = plan_workqueue_device_order(lens, 8, 1, policy)
        padded = plan_workqueue_device_order(np.r_[lens, np.zeros(int(rng.integers(1, 30)), dtype=np.int64)], 8, 1,
                                             policy)
        assert np.array_equal(padded.tasks, alone.tasks), trial
        assert np.array_equal(padded.split_offsets[:alone.split_offsets.size], alone.split_offsets), trial
    empty = plan_workqueue_device_order(np.zeros(3, dtype=np.int64), 8, 1, SplitPolicy("balanced", 4))
    assert empty.num_tasks == 0 and empty.split_offsets.tolist() == [0] * 25


def test_the_device_plan_clamps_to_the_table_and_gives_empty_rows_no_task():
    from pkv.pipeline.schedule import plan_workqueue_device_order

    plan = plan_workqueue_device_order(np.array([0, 5000, 70, 0]), 2, 4, 8, max_tokens=4096)
    assert set(plan.tasks[:, 0].tolist()) == {1, 2}
    assert plan.tasks[plan.tasks[:, 0] == 1, 4].max() == 4096 // 32  # clamped to the table's tokens
    assert plan.split_offsets.tolist() == [0, 0, 0, 8, 16, 19, 22, 22, 22]


@pytest.mark.parametrize("splits", [1, 5, 24])
def test_the_reference_engine_runs_the_device_plan_to_float64(splits):
    import torch

    from pkv.engines.dense import dense_decode
    from pkv.engines.reference import ReferenceEngine
    from pkv.measure.kv_data import make_kv_pages, make_queries
    from pkv.pipeline.pages import assign_pages
    from pkv.pipeline.step import build_step
    from pkv.policy.choose import PinnedRoutePolicy
    from pkv.policy.route import ROUTE_WORKQUEUE, StepRoute
    from pkv.shape import ModelShape

    shape = ModelShape()
    rng = np.random.default_rng(splits)
    lens = [int(x) for x in rng.choice(EDGE + [3000, 9000], size=6)]
    assignment = assign_pages(lens, 16, 0.5, splits)
    step = build_step(0, np.arange(len(lens)), np.asarray(lens, dtype=np.int32), assignment.pages, 16)
    k, v = make_kv_pages(assignment.num_physical_pages, shape, 16, "float64", "cpu", splits)
    q = make_queries(len(lens), shape, "float64", "cpu", splits + 1)
    engine = ReferenceEngine(shape, policy=PinnedRoutePolicy(StepRoute(ROUTE_WORKQUEUE, splits)), planner="device")
    plan = engine.plan(step)
    assert plan.schedule.tasks[0, 0] == int(np.argmax(lens))  # longest first: a split of the longest row
    out = engine.run(q, k, v, plan)
    ref = dense_decode(q, k, v, step.seq_lens, step.block_table)
    assert torch.allclose(out, ref, rtol=1e-10, atol=1e-12)
    balanced = ReferenceEngine(shape, policy=PinnedRoutePolicy(StepRoute(ROUTE_WORKQUEUE, splits, "balanced",
                                                                          target_ctas=3 * splits)), planner="device")
    assert torch.allclose(balanced.run(q, k, v, balanced.plan(step)), ref, rtol=1e-10, atol=1e-12)


def test_page_lists_are_checked_against_each_rows_own_pages():
    check_lengths(np.array([16, 0, 33]), np.array([1, 0, 3]), 16)
    with pytest.raises(ValueError, match=r"row 2 has length 49; its page list's 3 pages of 16 tokens address "
                                         r"0\.\.48 \(1 row\(s\) out of range\)"):
        check_lengths(np.array([16, 0, 49]), np.array([1, 0, 3]), 16)


def test_the_device_plan_clamps_each_row_to_its_page_list():
    from pkv.pipeline.schedule import plan_workqueue_device_order

    rng = np.random.default_rng(5)
    for trial in range(100):
        batch, splits = int(rng.integers(1, 30)), int(rng.integers(1, 50))
        pages = rng.integers(0, 400, size=batch)
        lens = np.maximum(pages * 16 + rng.integers(-40, 40, size=batch), 0).astype(np.int32)
        clamped = plan_workqueue_device_order(lens, 8, 4, splits, row_tokens=pages * 16)
        expected = plan_workqueue_device_order(np.minimum(lens, pages * 16), 8, 4, splits)
        assert np.array_equal(clamped.tasks, expected.tasks) and np.array_equal(clamped.split_offsets,
                                                                                expected.split_offsets), trial


def test_page_table_forms_are_checked_and_read_on_any_device():
    import torch

    from pkv.engines.device_step import _first_out_of_range
    from pkv.page_table import PageLists, check_page_table, device_token_limits, host_row_pages, kernel_operands
    from pkv.pipeline.step import build_step

    step = build_step(0, [7, 8, 9], [17, 1, 64], [np.array([4, 5]), np.array([9]), np.array([1, 2, 3, 6])], 16)
    lists = PageLists.from_step(step, "cpu")
    assert lists.batch_size == 3 and lists.indices.tolist() == [4, 5, 9, 1, 2, 3, 6]
    check_page_table(lists, 3, torch.device("cpu"), "here")
    assert host_row_pages(lists).tolist() == [2, 1, 4]
    # Without a host copy the lengths come from the device tensor.
    assert host_row_pages(PageLists(lists.indptr, lists.indices)).tolist() == [2, 1, 4]
    table = torch.from_numpy(step.block_table)
    assert host_row_pages(table) == 4 and kernel_operands(table) == (table, None)
    # An indptr that sends a row outside the flat list is refused before anything reads it.
    for indptr, row in (([0, 2, 1, 7], 1), ([0, 2, 3, 8], 2), ([-1, 2, 3, 7], 0)):
        with pytest.raises(ValueError, match=rf"here: page_table.indptr must rise .* 7 entries of indices; row {row} "):
            host_row_pages(PageLists(torch.tensor(indptr, dtype=torch.int32), lists.indices,
                                     np.asarray(indptr)), "here")
    assert kernel_operands(lists) == (lists.indices, lists.indptr)
    assert device_token_limits(lists, 16).tolist() == [32, 16, 64] and device_token_limits(table, 16) == 64
    with pytest.raises(ValueError, match=r"here: page_table.indptr must be int32 \[4\]"):
        check_page_table(PageLists(lists.indptr[:3], lists.indices), 3, torch.device("cpu"), "here")
    with pytest.raises(ValueError, match=r"here: page_table.indices must be int32"):
        check_page_table(PageLists(lists.indptr, lists.indices.long()), 3, torch.device("cpu"), "here")
    # Every row empty still needs one entry: an empty row's lookup reads entry 0 and discards it.
    empty = PageLists(torch.zeros(4, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"here: page_table.indices must be int32 \[num_entries >= 1\].*\(0,\)"):
        check_page_table(empty, 3, torch.device("cpu"), "here")
    with pytest.raises(ValueError, match=r"here: block_table must be int32 \[2, max_pages\]"):
        check_page_table(table, 2, torch.device("cpu"), "here")
    with pytest.raises(ValueError, match="must be a block table tensor or PageLists, got list"):
        check_page_table([1, 2], 3, torch.device("cpu"), "here")
    # The graphs' device-side debug record: the first row past its own pages, with its limit.
    lens = torch.tensor([17, 17, 64], dtype=torch.int32)
    assert _first_out_of_range(lens, device_token_limits(lists, 16)).tolist() == [1, 1, 17, 16]
    assert _first_out_of_range(lens, 64).tolist()[0] == 0
    assert _first_out_of_range(torch.tensor([1, -1], dtype=torch.int32), 64).tolist() == [1, 1, -1, 64]
    # A row whose list leaves the flat list has no length in range (limit -1).
    leaving = PageLists(torch.tensor([0, 2, 9, 7], dtype=torch.int32), lists.indices)
    assert device_token_limits(leaving, 16).tolist() == [32, -1, -1]
    assert _first_out_of_range(torch.tensor([1, 0, 0], dtype=torch.int32),
                               device_token_limits(leaving, 16)).tolist() == [1, 1, 0, -1]


def test_the_in_decode_grid_covers_the_fixed_rules_tile_ranges():
    """planner="in_decode" launches the bucket grid (B, Hkv, S) over every row; its non-empty CTAs
    must own exactly the workqueue's tasks under the fixed split rule (what the plan kernel writes)."""
    from pkv.pipeline.schedule import plan_workqueue_device_order, split_range

    rng = np.random.default_rng(9)
    for trial in range(100):
        batch, splits = int(rng.integers(1, 20)), int(rng.integers(1, 70))
        lens = rng.choice(np.r_[EDGE, rng.integers(1, 70000, size=5)], size=batch)
        grid = sorted((row, kvh, split, *split_range(-(-int(lens[row]) // 32), splits, split))
                      for row in range(batch) for kvh in range(2) for split in range(splits)
                      if split_range(-(-int(lens[row]) // 32), splits, split)[0] < -(-int(lens[row]) // 32))
        plan = plan_workqueue_device_order(lens, 2, 4, splits)
        assert grid == sorted(map(tuple, plan.tasks.tolist())), trial


def test_a_bucket_route_runs_the_in_decode_grid_and_every_other_route_the_plan_kernel():
    from pkv.engines.device_step import DEFAULT_PLANNER, device_planner
    from pkv.policy.route import ROUTE_BUCKET, ROUTE_FLASHINFER, ROUTE_WORKQUEUE

    assert device_planner(ROUTE_BUCKET) == "in_decode"
    assert device_planner(ROUTE_WORKQUEUE) == DEFAULT_PLANNER == "plan_kernel"
    assert device_planner(ROUTE_FLASHINFER) == DEFAULT_PLANNER


def test_a_routes_merge_maps_to_the_device_steps():
    from pkv.engines.device_step import MERGES, device_merge
    from pkv.policy.route import MERGE_CLUSTER, MERGE_FUSED, MERGE_LAUNCH

    assert MERGES == (MERGE_LAUNCH, MERGE_FUSED)
    assert [device_merge(m) for m in (MERGE_LAUNCH, MERGE_FUSED, MERGE_CLUSTER)] == [MERGE_LAUNCH, MERGE_FUSED,
                                                                                      MERGE_LAUNCH]


# ----------------------------------------------------------------- the whole step, ops in torch


@pytest.fixture
def reference_ops(monkeypatch):
    """DeviceDecodeStep over the torch reference of its ops (tests/device_ops_reference.py)."""
    from device_ops_reference import ReferenceOps

    from pkv import ops

    monkeypatch.setattr(ops, "load", ReferenceOps)


def _cpu_step(lengths, seed, page=16):
    import torch

    from pkv.measure.kv_data import make_kv_pages, make_queries
    from pkv.pipeline.step import build_step
    from pkv.shape import ModelShape

    shape = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=16)
    rng = np.random.default_rng(seed)
    counts = [-(-n // page) for n in lengths]
    pool = sum(counts) * 2 + 4
    rows = np.split(rng.permutation(pool)[:sum(counts)].astype(np.int32), np.cumsum(counts)[:-1])
    step = build_step(0, np.arange(len(lengths)), np.asarray(lengths, dtype=np.int32), rows, page)
    k, v = make_kv_pages(pool, shape, page, torch.float32, "cpu", seed)
    q = make_queries(len(lengths), shape, torch.float32, "cpu", seed + 1)
    return shape, step, q, k, v


def _float64(step, q, k, v):
    from pkv.engines.dense import dense_decode

    return dense_decode(q.double(), k.double(), v.double(), step.seq_lens, step.block_table)


@pytest.mark.parametrize("page_lists", [False, True], ids=["block_table", "page_lists"])
@pytest.mark.parametrize("merge", ["launch", "fused"])
@pytest.mark.parametrize("planner", ["plan_kernel", "in_decode"])
def test_the_device_step_matches_float64_with_its_ops_in_torch(reference_ops, planner, merge, page_lists):
    """The device step's own logic end to end on the CPU: per-batch views reused across batch
    sizes, each planner and merge, both page-table forms, edge lengths, poisoned outputs."""
    import torch

    from pkv.engines.device_step import DeviceDecodeStep
    from pkv.page_table import PageLists

    workspace = None
    for trial, lengths in enumerate(([1, 15, 16, 17, 33, 100, 300], [64, 5], [1, 15, 16, 17, 33, 100, 300],
                                     [1000, 31, 32, 65])):
        shape, step, q, k, v = _cpu_step(lengths, seed=trial)
        if workspace is None:
            workspace = DeviceDecodeStep(shape, max_batch=8, num_splits=5, device="cpu", planner=planner,
                                         merge=merge)
        table = torch.from_numpy(step.block_table)
        page_table = PageLists.from_step(step, "cpu") if page_lists else table
        out = torch.full_like(q, float("nan"))
        workspace.part_acc.fill_(float("nan"))
        workspace.run(q, k, v, page_table, torch.from_numpy(step.seq_lens), out, host_lens=step.seq_lens)
        torch.testing.assert_close(out.double(), _float64(step, q, k, v), rtol=1e-5, atol=1e-5)
    assert sorted(workspace._views) == [2, 4, 7]  # one set of views per batch size, made once


@pytest.mark.parametrize("page_lists", [False, True], ids=["block_table", "page_lists"])
@pytest.mark.parametrize("merge", ["launch", "fused"])
@pytest.mark.parametrize("target_ctas", [0, 6, 40])
def test_the_balanced_device_step_matches_float64_with_its_ops_in_torch(reference_ops, target_ctas, merge,
                                                                        page_lists):
    """The balanced rule's workspace: its capacity per batch size holds every plan, rows get other
    split counts than the fixed rule's, and the output is float64's."""
    import torch

    from pkv.engines.device_step import DeviceDecodeStep
    from pkv.page_table import PageLists

    workspace = None
    for trial, lengths in enumerate(([1, 15, 16, 17, 33, 100, 3000], [64, 5], [2000, 31, 32, 65])):
        shape, step, q, k, v = _cpu_step(lengths, seed=20 + trial)
        if workspace is None:
            workspace = DeviceDecodeStep(shape, max_batch=8, num_splits=3, device="cpu", merge=merge,
                                         split_kind="balanced", target_ctas=target_ctas)
        page_table = PageLists.from_step(step, "cpu") if page_lists else torch.from_numpy(step.block_table)
        out = torch.full_like(q, float("nan"))
        workspace.part_acc.fill_(float("nan"))
        workspace.run(q, k, v, page_table, torch.from_numpy(step.seq_lens), out, host_lens=step.seq_lens)
        torch.testing.assert_close(out.double(), _float64(step, q, k, v), rtol=1e-5, atol=1e-5)
        pairs = len(lengths) * shape.num_kv_heads
        capacity = workspace._views[len(lengths)].tasks.shape[0]
        assert capacity == min(pairs * 64, pairs + (target_ctas or pairs * 3)) >= int(workspace.counts[0])
    # The 3000-token row's 94 tiles: a budget of 40 tasks gives it more splits than the fixed 3.
    if target_ctas == 40:
        assert int(workspace.counts[1]) > 3


def test_a_device_step_refuses_a_split_rule_its_planner_cannot_run():
    from pkv.engines.device_step import DeviceDecodeStep, DeviceStepConfig, device_step_config
    from pkv.policy.route import ROUTE_BUCKET, ROUTE_WORKQUEUE, StepRoute
    from pkv.shape import ModelShape

    with pytest.raises(ValueError, match="the 'balanced' split rule, which planner 'in_decode' cannot run"):
        DeviceDecodeStep(ModelShape(), max_batch=2, num_splits=2, device="cpu", planner="in_decode",
                         split_kind="balanced")
    with pytest.raises(ValueError, match="split_kind must be one of"):
        DeviceDecodeStep(ModelShape(), max_batch=2, num_splits=2, device="cpu", split_kind="even")
    # A workqueue route's rule reaches its device step; a bucket route's grid is the fixed rule.
    assert device_step_config(StepRoute(ROUTE_WORKQUEUE, 8, "balanced", target_ctas=396)) == DeviceStepConfig(
        8, "launch", "plan_kernel", "balanced", 396)
    assert device_step_config(StepRoute(ROUTE_BUCKET, 8, "balanced")) == DeviceStepConfig(8, "launch", "in_decode")
    # A planner pinned for every route cannot run a rule its grid does not have: refused, by name.
    with pytest.raises(ValueError, match=r"route workqueue \(S=8\) names the 'balanced' split rule, which "
                                         r"planner 'in_decode' cannot run"):
        device_step_config(StepRoute(ROUTE_WORKQUEUE, 8, "balanced"), "in_decode")
    assert device_step_config(StepRoute(ROUTE_WORKQUEUE, 8), "in_decode").planner == "in_decode"


@pytest.mark.parametrize("page_lists", [False, True], ids=["block_table", "page_lists"])
@pytest.mark.parametrize("planner", ["plan_kernel", "in_decode"])
def test_lengths_past_a_rows_pages_attend_over_the_pages_it_has(reference_ops, planner, page_lists):
    """The clamp both planners share (csrc/split_decode.cuh row_length), through plan() and
    decode(), which run without the eager length check as a graph replays them."""
    import torch

    from pkv.engines.device_step import DeviceDecodeStep
    from pkv.page_table import PageLists

    shape, step, q, k, v = _cpu_step([64, 48], seed=7)
    table = torch.from_numpy(step.block_table)  # 4 pages a row: row 1's fourth entry is padding
    page_table = PageLists.from_step(step, "cpu") if page_lists else table
    workspace = DeviceDecodeStep(shape, max_batch=2, num_splits=3, device="cpu", planner=planner)
    too_long = torch.tensor([10**6, 48 + (5 if page_lists else 0)], dtype=torch.int32)
    workspace.plan(page_table, too_long, 16)
    out = workspace.decode(q, k, v, page_table, too_long, torch.full_like(q, float("nan")))
    torch.testing.assert_close(out.double(), _float64(step, q, k, v), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="row 0 has length 1000000"):
        workspace.run(q, k, v, page_table, too_long, torch.empty_like(q))


def test_ring_depths_follow_the_gpus_shared_memory(monkeypatch):
    """stages=4 takes 128 KB a CTA: an H200 (227 KB) runs every depth, a GPU that gives a CTA 99 KB
    (the paper's RTX 3060) only 2 and 3, and a sweep on it leaves 4 out."""
    from types import SimpleNamespace

    import torch

    from pkv.engines import persistentkv
    from pkv.measure.kernel_bench import BALANCED_WAVES, device_step_configs, persistentkv_configs

    for optin, per_sm, depths in ((232448, 233472, (2, 3, 4)), (101376, 102400, (2, 3)), (0, 102400, (2, 3))):
        props = SimpleNamespace(shared_memory_per_block_optin=optin, shared_memory_per_multiprocessor=per_sm)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, props=props: props)
        assert persistentkv.ring_stages_for("cuda") == depths
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace())
    assert persistentkv.ring_stages_for("cuda") == (2, 3, 4)  # a torch that reports neither: all depths
    assert {stages for *_, stages in persistentkv_configs([8192] * 8, 28, ring_stages=(2, 3))} == {2, 3}
    assert {stages for *_, stages in device_step_configs([8192], 132, ring_stages=(2, 3))} == {2, 3}
    # The device sweep covers the host sweep's balanced budgets, under the plan kernel only.
    balanced = [config for _, config, _ in device_step_configs([8192] * 8, 132, ring_stages=(2,))
                if config.split_kind != "fixed"]
    assert {(c.planner, c.target_ctas) for c in balanced} == {("plan_kernel", w * 132) for w in BALANCED_WAVES}
    # At B1 the host sweep has no balanced rule, so neither has the device sweep.
    assert {config.split_kind for _, config, _ in device_step_configs([8192], 132, ring_stages=(2,))} == {"fixed"}


@pytest.fixture
def recorded_graphs(monkeypatch, reference_ops):
    """CUDA graphs on the CPU: capture keeps the reference ops' calls and replay does them again
    (tests/device_ops_reference.py, RecordedGraph), so the routed graphs run end to end here."""
    from device_ops_reference import install_recorded_graphs

    install_recorded_graphs(monkeypatch)


@pytest.mark.parametrize("page_lists", [False, True], ids=["block_table", "page_lists"])
@pytest.mark.parametrize("merge", ["launch", "fused"])
@pytest.mark.parametrize("route, planner", [("workqueue", "plan_kernel"), ("workqueue", "in_decode"),
                                            ("workqueue", None), ("bucket", None), ("balanced", None)])
def test_routed_graphs_replay_fresh_lengths_on_the_cpu(recorded_graphs, route, planner, merge, page_lists):
    """RoutedGraphStep end to end: one graph per bucket and split count, captured at the first
    step of the bucket and replayed for others with padding rows (length 0, empty page lists),
    against float64. With no planner named, each route runs its own (device_planner); a balanced
    workqueue route's graphs plan its rule on the device."""
    import torch

    from pkv.engines.routed_graphs import RoutedGraphStep
    from pkv.measure.kv_data import make_kv_pages, make_queries
    from pkv.pipeline.step import build_step
    from pkv.policy.choose import PinnedRoutePolicy
    from pkv.policy.route import ROUTE_BUCKET, ROUTE_WORKQUEUE, StepRoute
    from pkv.shape import ModelShape

    shape = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=16)
    pool, page, max_pages = 200, 16, 32
    k, v = make_kv_pages(pool, shape, page, torch.float32, "cpu", seed=3)
    pinned = {"workqueue": StepRoute(ROUTE_WORKQUEUE, 5, merge=merge),
              "bucket": StepRoute(ROUTE_BUCKET, 5, merge=merge),
              "balanced": StepRoute(ROUTE_WORKQUEUE, 5, "balanced", merge=merge, target_ctas=12)}[route]
    routed = RoutedGraphStep(PinnedRoutePolicy(pinned), shape, k, v,
                             max_pages=max_pages, batch_buckets=(2, 4), planner=planner, page_lists=page_lists,
                             debug_checks=True)
    rng = np.random.default_rng(4)
    for trial, lengths in enumerate(([300, 17], [1, 64, 33], [500, 1, 16, 40], [7], [200, 300, 2], [33, 512])):
        counts = [-(-n // page) for n in lengths]
        rows = np.split(rng.permutation(pool)[:sum(counts)].astype(np.int32), np.cumsum(counts)[:-1])
        step = build_step(trial, np.arange(len(lengths)), np.asarray(lengths, dtype=np.int32), rows, page)
        q = make_queries(len(lengths), shape, torch.float32, "cpu", seed=10 + trial)
        buffers = routed.buffers(len(lengths))
        buffers.q.copy_(q)
        if page_lists:
            buffers.page_lists.indptr.copy_(torch.from_numpy(step.kv_indptr))
            buffers.page_lists.indices[:step.kv_indices.size].copy_(torch.from_numpy(step.kv_indices))
            host_table = (step.kv_indptr, step.kv_indices)
        else:
            buffers.block_table.zero_()
            buffers.block_table[:, :step.block_table.shape[1]].copy_(torch.from_numpy(step.block_table))
            host_table = step.block_table
        buffers.seq_lens.copy_(torch.from_numpy(step.seq_lens))
        buffers.out.fill_(float("nan"))
        out = routed.run(step.seq_lens, host_table=host_table)
        assert out.shape[0] == len(lengths)
        torch.testing.assert_close(out.double(), _float64(step, q, k, v), rtol=1e-5, atol=1e-5)
    ran = planner or {"workqueue": "plan_kernel", "bucket": "in_decode", "balanced": "plan_kernel"}[route]
    config = (5, merge, ran) + (("balanced", 12) if route == "balanced" else ("fixed", 0))
    assert list(routed._persistent) == [config]
    graphed = routed._persistent[config]
    assert graphed.step.planner == ran
    assert len(graphed.captured_graphs()) == 2  # one per bucket, replayed for every later step of it
    assert routed.captured_graphs() == graphed.captured_graphs()
    with pytest.raises(ValueError, match="row 0 has length 600"):
        routed.run(np.array([600]), host_table=host_table if not page_lists else (np.array([0, 2]), np.arange(2)))


def test_routes_that_differ_only_in_their_split_rule_replay_their_own_graphs(recorded_graphs):
    """The fixed and the balanced rule at one split count are two device steps: a step routed to
    either replays its own rule's graph, each against float64. The balanced route has the default
    budget (rows with tokens x Hkv x S): the bucket's padding row takes no share of it, so the
    graph plans the rows' splits as the host plans the three rows alone."""
    from types import SimpleNamespace

    import torch

    from pkv.engines.device_step import device_step_config
    from pkv.engines.routed_graphs import RoutedGraphStep
    from pkv.pipeline.schedule import row_splits
    from pkv.policy.route import ROUTE_WORKQUEUE, StepRoute

    fixed, balanced = StepRoute(ROUTE_WORKQUEUE, 2), StepRoute(ROUTE_WORKQUEUE, 2, "balanced")
    shape, step, q, k, v = _cpu_step([2000, 40, 33], seed=31)
    routes = iter([fixed, balanced, fixed, balanced])
    policy = SimpleNamespace(choose=lambda step: SimpleNamespace(route=next(routes)))
    routed = RoutedGraphStep(policy, shape, k, v, max_pages=step.block_table.shape[1], batch_buckets=(4,))
    buffers = routed.buffers(3)
    buffers.q.copy_(q)
    buffers.block_table.copy_(torch.from_numpy(step.block_table))
    buffers.seq_lens.copy_(torch.from_numpy(step.seq_lens))
    most_splits = []
    for _ in range(4):
        out = routed.run(step.seq_lens)
        torch.testing.assert_close(out.double(), _float64(step, q, k, v), rtol=1e-5, atol=1e-5)
        most_splits.append(int(routed._graphed(device_step_config(routed.last_route)).step.counts[1]))
    assert sorted(config.split_kind for config in routed._persistent) == ["balanced", "fixed"]
    host = row_splits(step.seq_lens, shape.num_kv_heads, balanced.split_policy)
    assert host.tolist() == [6, 1, 1]
    assert most_splits == [2, 6, 2, 6]


def test_a_short_single_row_replays_the_graph_of_its_short_row_count(recorded_graphs):
    """Under the short-row rule a B1 row short for the split count routes to fewer splits (a power of
    two) and replays that count's graph; a long row keeps the regime's count and its own graph. Both
    against float64, each row's graph captured once and replayed for the next row of its kind."""
    import torch

    from pkv.engines.routed_graphs import RoutedGraphStep
    from pkv.pipeline.step import build_step
    from pkv.policy import Calibration, RoutePolicy

    calib = Calibration.from_mapping({"gpu": "test", "num_sms": 4, "beta_gbps": 100.0, "lambda_us": 5.0,
                                      "c_min": 1.0, "supported_group_sizes": [4]}, "test")
    calib = calib.with_all_regimes(min_context_tokens=0, margin=0.01)
    calib = calib.with_regime("single_row", route="persistentkv_bucket", num_splits=8, bucket_tiles_per_split=2)
    shape, _, q, k, v = _cpu_step([512], seed=41)  # a pool of 2 x 32 pages + 4 for the rows below
    policy = RoutePolicy(calib, num_kv_heads=shape.num_kv_heads, group_size=shape.group_size,
                         head_dim=shape.head_dim)
    routed = RoutedGraphStep(policy, shape, k, v, max_pages=32, batch_buckets=(1,))
    splits = []
    for trial, length in enumerate((96, 512, 90, 500)):  # 3 tiles: 1 split of 3; 16 tiles: the regime's 8
        pages = np.random.default_rng(trial).permutation(k.shape[0])[:-(-length // 16)].astype(np.int32)
        row = build_step(trial, np.arange(1), np.asarray([length], dtype=np.int32), [pages], 16)
        query = q if trial == 0 else torch.randn_like(q)
        buffers = routed.buffers(1)
        buffers.q.copy_(query)
        buffers.block_table.zero_()
        buffers.block_table[:, :row.block_table.shape[1]].copy_(torch.from_numpy(row.block_table))
        buffers.seq_lens.copy_(torch.from_numpy(row.seq_lens))
        out = routed.run(row.seq_lens, host_table=row.block_table)
        torch.testing.assert_close(out.double(), _float64(row, query, k, v), rtol=1e-5, atol=1e-5)
        splits.append(routed.last_route.num_splits)
    assert splits == [1, 8, 1, 8]
    assert sorted(config.num_splits for config in routed._persistent) == [1, 8]
    assert all(len(graphed.captured_graphs()) == 1 for graphed in routed._persistent.values())


@pytest.mark.parametrize("page_lists", [False, True], ids=["block_table", "page_lists"])
def test_graphed_step_copies_each_step_into_its_own_buffers_on_the_cpu(recorded_graphs, page_lists):
    """GraphedDecodeStep.run: one graph for the batch size, each step copied into its static
    buffers (a block table narrower than the graph's, or page lists inside a longer flat buffer
    of which only indptr's span is copied), against float64."""
    import torch

    from pkv.engines.device_step import DeviceDecodeStep, GraphedDecodeStep
    from pkv.measure.kv_data import make_kv_pages, make_queries
    from pkv.page_table import PageLists
    from pkv.pipeline.step import build_step
    from pkv.shape import ModelShape

    shape = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=16)
    pool, page = 120, 16
    k, v = make_kv_pages(pool, shape, page, torch.float32, "cpu", seed=5)
    graphed = GraphedDecodeStep(DeviceDecodeStep(shape, max_batch=3, num_splits=4, device="cpu"), k, v, 32)
    rng = np.random.default_rng(6)
    for trial, lengths in enumerate(([100, 1, 40], [512, 17, 16], [3, 3, 300])):
        counts = [-(-n // page) for n in lengths]
        rows = np.split(rng.permutation(pool)[:sum(counts)].astype(np.int32), np.cumsum(counts)[:-1])
        step = build_step(trial, np.arange(3), np.asarray(lengths, dtype=np.int32), rows, page)
        q = make_queries(3, shape, torch.float32, "cpu", seed=20 + trial)
        if page_lists:  # a pool-sized flat buffer: more entries than the graph holds, the step's first
            flat = np.concatenate((step.kv_indices, rng.integers(0, pool, size=200))).astype(np.int32)
            page_table = PageLists(torch.from_numpy(step.kv_indptr), torch.from_numpy(flat), step.kv_indptr)
        else:
            page_table = torch.from_numpy(step.block_table)
        out = graphed.run(q, page_table, torch.from_numpy(step.seq_lens))
        torch.testing.assert_close(out.double(), _float64(step, q, k, v), rtol=1e-5, atol=1e-5)
    assert list(graphed._graphs) == [(3, page_lists)]


def test_flashinfer_graph_plan_keeps_each_row_to_its_own_pages():
    """A length past a row's own pages attends over the pages it has on the FlashInfer route too,
    as the PersistentKV routes' kernels clamp it: never into the next row's pages."""
    from pkv.engines.routed_graphs import _FlashInferGraphPath

    class Recording:
        def plan(self, indptr, indices, last, q_dtype, kv_dtype):
            self.planned = (list(indptr), list(indices), list(last))

    path = _FlashInferGraphPath.__new__(_FlashInferGraphPath)
    path.bucket, path.page_size, path.decode = 4, 16, Recording()
    lists = (np.array([0, 2, 4]), np.array([10, 11, 20, 21]))
    path.plan(np.array([40, 17]), lists, None, None)  # row 0 asks for 3 pages, has 2
    indptr, indices, last = path.decode.planned
    assert indices[:4] == [10, 11, 20, 21] and indptr[:3] == [0, 2, 4] and last[:2] == [16, 1]
    path.plan(np.array([40, 17]), np.array([[10, 11], [20, 21]]), None, None)  # block table of width 2
    assert path.decode.planned == (indptr, indices, last)


def test_routed_debug_check_names_a_host_indptr_of_the_wrong_length(recorded_graphs):
    import torch

    from pkv.engines.routed_graphs import RoutedGraphStep
    from pkv.policy.choose import PinnedRoutePolicy
    from pkv.policy.route import ROUTE_WORKQUEUE, StepRoute
    from pkv.shape import ModelShape

    shape = ModelShape(num_qo_heads=8, num_kv_heads=2, head_dim=16)
    k = torch.zeros(8, 2, 16, 16)
    routed = RoutedGraphStep(PinnedRoutePolicy(StepRoute(ROUTE_WORKQUEUE, 2)), shape, k, k, max_pages=4,
                             batch_buckets=(4,), page_lists=True, debug_checks=True)
    routed.buffers(2)
    with pytest.raises(ValueError, match=r"host_table's indptr must have 3 entries .*got \(5,\)"):
        routed.run(np.array([16, 16]), host_table=(np.array([0, 1, 2, 2, 2]), np.arange(8)))


def test_a_ring_depth_the_kernels_lack_is_refused_as_such():
    from pkv.engines.device_step import DeviceDecodeStep
    from pkv.shape import ModelShape

    with pytest.raises(ValueError, match=r"DeviceDecodeStep: stages must be one of \(2, 3, 4\), got 5"):
        DeviceDecodeStep(ModelShape(), max_batch=2, num_splits=2, device="cpu", stages=5)


@pytest.mark.parametrize("planner", ["plan_kernel", "in_decode"])
def test_the_benchmark_repeats_an_eager_steps_op_calls_alone(reference_ops, planner):
    """device_step_bench's launch_host_us times the op calls one eager step made, without the
    checks around them: repeating them writes the same output, and the workspace keeps its ops."""
    import torch

    from pkv.engines.device_step import DeviceDecodeStep
    from pkv.measure.device_step_bench import _recorded_launches

    shape, step, q, k, v = _cpu_step([40, 300, 17], seed=5)
    workspace = DeviceDecodeStep(shape, max_batch=4, num_splits=4, planner=planner, device="cpu")
    table, lens = torch.from_numpy(step.block_table), torch.from_numpy(step.seq_lens)
    out = torch.full_like(q, float("nan"))
    ops = workspace.ops
    launches = _recorded_launches(workspace, lambda: workspace.run(q, k, v, table, lens, out))
    assert workspace.ops is ops
    want = out.clone()
    out.fill_(float("nan"))
    launches()
    assert torch.equal(out, want)
    # Each op call alone, by name: the plan kernel's planner plans, then decodes; the in-decode grid
    # decodes, then merges.
    assert [name for name, _ in launches.by_op] == (
        ["plan_workqueue_on_device", "run_workqueue_planned_on_device"] if planner == "plan_kernel"
        else ["bucket_decode", "merge_states"])
    torch.testing.assert_close(out.double(), _float64(step, q, k, v), rtol=1e-5, atol=1e-5)
