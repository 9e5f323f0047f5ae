"""The C++ step planner (csrc/step_plan.cpp) against pkv.pipeline.schedule, its specification.

Runs on the CPU: where there is no GPU the planner is built on its own as a CPU library. Every
array of the packed plan must equal the numpy plan's, element by element, for random batches,
edge lengths and every split policy.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from pkv.pipeline.schedule import SplitPolicy, plan_buckets, plan_workqueue
from pkv.policy import StepRoute
from pkv.policy.route import MAX_CLUSTER_SPLITS
from policy_constants import pinned

EDGE_LENGTHS = [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 639, 640, 641, 4097, 65536]
PAGE = 16


@pytest.fixture(scope="module")
def ops():
    from pkv import ops

    return ops.load_planner()


@pytest.fixture
def make_step(make_step):
    """Steps whose rows list their pages in descending order, so a planner that rebuilt the
    block table from page counts instead of copying it would not match."""
    return functools.partial(make_step, page_size=PAGE, reverse_pages=True)


def tensors(step):
    return torch.from_numpy(step.seq_lens.astype(np.int32)), torch.from_numpy(step.block_table.astype(np.int32))


def planner_inputs(step, page_lists: bool) -> tuple:
    """(seq_lens, page table) and, with page lists, their page_indptr: the planner ops' arguments."""
    lens, table = tensors(step)
    if not page_lists:
        return lens, table, None
    return lens, torch.from_numpy(step.kv_indices.astype(np.int32)), torch.from_numpy(step.kv_indptr.astype(np.int32))


def split_packed(packed, step, route_sizes, page_lists: bool = False):
    """[page table parts..., seq_lens, route parts...] of a packed plan, checking the page table."""
    flat = packed.numpy()
    table = [step.batch_size + 1, step.kv_indices.size] if page_lists else [step.block_table.size]
    sizes = [*table, step.batch_size, *route_sizes]
    assert flat.size == sum(sizes)
    parts = np.split(flat, np.cumsum(sizes)[:-1])
    if page_lists:
        assert np.array_equal(parts[0], step.kv_indptr) and np.array_equal(parts[1], step.kv_indices)
    else:
        assert np.array_equal(parts[0], step.block_table.reshape(-1))
    return parts[len(table):]


def random_batches(seed, count):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        batch = int(rng.choice([1, 2, 3, 8, 17, 64]))
        if rng.random() < 0.5:
            yield [int(x) for x in rng.choice(EDGE_LENGTHS, size=batch)]
        else:
            yield [int(x) for x in rng.integers(1, 20000, size=batch)]


POLICIES = [SplitPolicy(num_splits=1), SplitPolicy(num_splits=3), SplitPolicy(num_splits=20),
            SplitPolicy(num_splits=64, max_splits=64),
            SplitPolicy(kind="balanced", num_splits=20, max_splits=64),
            SplitPolicy(kind="balanced", num_splits=4, max_splits=8, target_ctas=300, min_tiles_per_split=4)]


def layout_head(step, page_lists: bool) -> list:
    """[batch, table_width, ...] as csrc/step_plan.h lays them out: width 0 and N entries for lists."""
    return [step.batch_size, 0] if page_lists else [step.batch_size, step.block_table.shape[1]]


def page_entries(step, page_lists: bool) -> int:
    return step.kv_indices.size if page_lists else 0


@pytest.mark.parametrize("page_lists", [False, True], ids=["block_table", "page_lists"])
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p.kind}-S{p.num_splits}")
@pytest.mark.parametrize("num_kv_heads", [1, 8])
def test_workqueue_equals_numpy_plan(ops, policy, num_kv_heads, page_lists, make_step):
    for lengths in random_batches(seed=policy.num_splits * 10 + num_kv_heads, count=12):
        step = make_step(lengths)
        expected = plan_workqueue(step, num_kv_heads, 4, policy)
        lens_in, pages, indptr = planner_inputs(step, page_lists)
        packed, layout = ops.plan_workqueue(lens_in, pages, num_kv_heads, policy.kind == "balanced",
                                            policy.num_splits, policy.max_splits, policy.target_ctas,
                                            policy.min_tiles_per_split, indptr)
        lens, tasks, offsets = split_packed(packed, step, [5 * expected.num_tasks, expected.num_pairs + 1],
                                            page_lists)
        assert np.array_equal(lens, step.seq_lens)
        assert np.array_equal(tasks.reshape(-1, 5), expected.tasks), lengths
        assert np.array_equal(offsets, expected.split_offsets)
        assert list(layout) == [0, *layout_head(step, page_lists), expected.num_slots,
                                page_entries(step, page_lists), expected.num_tasks, expected.max_splits]


@pytest.mark.parametrize("page_lists", [False, True], ids=["block_table", "page_lists"])
@pytest.mark.parametrize("mode", ["exact", "masked"])
@pytest.mark.parametrize("num_splits", [1, 7, 32, 1024])
def test_buckets_equal_numpy_plan(ops, mode, num_splits, page_lists, make_step):
    for lengths in random_batches(seed=num_splits + (mode == "exact"), count=12):
        if mode == "exact" and len(lengths) > 2:
            lengths[1] = lengths[0]  # at least one bucket of several rows
        step = make_step(lengths)
        expected = plan_buckets(step, 8, 4, num_splits, mode=mode)
        lens_in, pages, indptr = planner_inputs(step, page_lists)
        packed, layout = ops.plan_buckets(lens_in, pages, 8, num_splits, mode == "exact", indptr)
        lens, rows = split_packed(packed, step, [step.batch_size], page_lists)
        assert np.array_equal(lens, step.seq_lens)
        assert np.array_equal(rows, np.concatenate([launch.row_indices for launch in expected.launches]))
        slots = sum(launch.num_slots(8) for launch in expected.launches)
        shapes = [x for launch in expected.launches for x in (launch.num_rows, launch.num_splits)]
        assert list(layout) == [1, *layout_head(step, page_lists), slots, page_entries(step, page_lists),
                                len(expected.launches), *shapes]


def test_bad_inputs_name_the_field(ops, make_step):
    step = make_step([40, 7])
    lens, table = tensors(step)
    with pytest.raises(RuntimeError, match=r"seq_lens\[1\] must be >= 0, got -3"):
        ops.plan_workqueue(torch.tensor([5, -3], dtype=torch.int32), table, 8, False, 4, 64, 0, 1)
    with pytest.raises(RuntimeError, match="seq_lens must be a contiguous int32"):
        ops.plan_workqueue(lens.long(), table, 8, False, 4, 64, 0, 1)
    with pytest.raises(RuntimeError, match="block_table must be"):
        ops.plan_buckets(lens, table[:1], 8, 4, True)
    with pytest.raises(RuntimeError, match="num_splits must be >= 1, got 0"):
        ops.plan_buckets(lens, table, 8, 0, True)
    with pytest.raises(RuntimeError, match=r"seq_lens >= 1, seq_lens\[0\] is 0"):
        ops.plan_buckets(torch.tensor([0, 7], dtype=torch.int32), table, 8, 4, True)
    # Page lists: indptr of B + 1 entries from 0 to the lists' length, never falling.
    _, pages, indptr = planner_inputs(step, True)
    with pytest.raises(RuntimeError, match=r"page_indptr must be a contiguous int32 CPU tensor \[B \+ 1 = 3\]"):
        ops.plan_buckets(lens, pages, 8, 4, True, indptr[:2])
    with pytest.raises(RuntimeError, match=r"page_indptr must run from 0 to the 4 entries of the page lists, got 0..3"):
        ops.plan_buckets(lens, pages, 8, 4, True, torch.tensor([0, 3, 3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"page_indptr must not fall, row 1 runs from 5 to 4"):
        ops.plan_workqueue(lens, pages, 8, False, 4, 64, 0, 1, torch.tensor([0, 5, 4], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"the page table must be the contiguous int32 CPU page lists"):
        ops.plan_workqueue(lens, table, 8, False, 4, 64, 0, 1, indptr)


@pytest.mark.parametrize("route", ["workqueue", "bucket_exact", "bucket_masked"])
def test_engine_plans_read_back_as_the_numpy_plan(ops, route, make_step):
    """The CUDA engine's packed plan (planned on the CPU here) holds the numpy plan: both planners
    give the same buffer and layout, and its views and schedule read back exactly."""
    from pkv.engines.persistentkv import PersistentKVEngine, page_lists_pay
    from pkv.shape import ModelShape

    shape = ModelShape()
    policy = SplitPolicy(num_splits=7)
    engines = {planner: PersistentKVEngine(shape, policy=pinned(route, policy, 7), device="cpu", planner=planner)
               for planner in ("native", "numpy")}
    forms = set()
    for lengths in [*random_batches(seed=11, count=8), [65536] + [100] * 15]:
        step = make_step(lengths)
        native, spec = engines["native"].plan(step), engines["numpy"].plan(step)
        assert native.layout == spec.layout and torch.equal(native.meta, spec.meta)
        # The page table travels as page lists where they hold at most half the table's entries.
        assert native.page_lists == page_lists_pay(step)
        forms.add(native.page_lists)
        if native.page_lists:
            assert torch.equal(native.block_table, torch.from_numpy(step.kv_indices.astype(np.int32)))
            assert torch.equal(native.page_indptr, torch.from_numpy(step.kv_indptr.astype(np.int32)))
        else:
            assert torch.equal(native.block_table, torch.from_numpy(step.block_table))
            assert native.page_indptr is None
        assert torch.equal(native.seq_lens, torch.from_numpy(step.seq_lens))
        if route == "workqueue":
            expected = plan_workqueue(step, 8, 4, policy)
            assert np.array_equal(native.schedule.tasks, expected.tasks)
            assert np.array_equal(native.tasks.numpy(), expected.tasks)
            assert np.array_equal(native.split_offsets.numpy(), expected.split_offsets)
            assert native.widest_split == expected.max_splits and native.num_slots == expected.num_slots
        else:
            expected = plan_buckets(step, 8, 4, 7, mode=route.split("_")[1])
            got = native.schedule.launches
            assert [(x.row_indices.tolist(), x.num_splits, x.route_len) for x in got] == \
                [(x.row_indices.tolist(), x.num_splits, x.route_len) for x in expected.launches]
            assert [r.tolist() for r in native.bucket_rows] == [x.row_indices.tolist() for x in expected.launches]
            assert native.widest_split == max(x.num_splits for x in expected.launches)
            assert native.num_slots == sum(x.num_slots(8) for x in expected.launches)
    assert forms == {False, True}
    # A graphed engine replays one layout, so it keeps the block table.
    graphed = PersistentKVEngine(shape, policy=pinned(route, policy, 7), device="cpu", cuda_graph=True)
    assert not graphed.plan(step).page_lists


@pytest.mark.parametrize("planner", ["native", "numpy"])
def test_plan_route_plans_with_the_routes_split_count(ops, planner, make_step):
    """The adaptive engine hands each step's route to the persistent engine (the few-rows split
    count differs from the many-rows one); the plan must be the one of that route, on every call."""
    from pkv.engines.persistentkv import PersistentKVEngine
    from pkv.shape import ModelShape

    shape = ModelShape()
    engine = PersistentKVEngine(shape, device="cpu", planner=planner)
    for lengths in random_batches(seed=5, count=4):
        step = make_step(lengths)
        for splits in (36, 20, 36):
            plan = engine.plan_route(step, StepRoute("persistentkv_workqueue", splits))
            expected = plan_workqueue(step, 8, 4, SplitPolicy(num_splits=splits))
            assert plan.num_splits == splits
            assert np.array_equal(plan.tasks.numpy(), expected.tasks)
            assert np.array_equal(plan.split_offsets.numpy(), expected.split_offsets)


def test_engine_refuses_to_run_off_the_gpu(ops, make_step):
    from pkv.engines.persistentkv import PersistentKVEngine
    from pkv.shape import ModelShape

    shape = ModelShape()
    engine = PersistentKVEngine(shape, device="cpu")
    step = make_step([40, 7])
    q = torch.zeros(2, 32, 128, dtype=torch.float16)
    pages = torch.zeros(4, 8, PAGE, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="q must be on a CUDA device"):
        engine.run(q, pages, pages, engine.plan(step))


def test_cluster_merge_routes_are_checked(ops, make_step):
    from pkv.engines.persistentkv import PersistentKVEngine
    from pkv.shape import ModelShape

    shape = ModelShape()
    with pytest.raises(ValueError, match="cluster merge is a bucket-route merge"):
        pinned("workqueue", cluster_merge=True)
    engine = PersistentKVEngine(shape, device="cpu", policy=pinned("bucket_exact", bucket_num_splits=MAX_CLUSTER_SPLITS,
                                                                   cluster_merge=True))
    step = make_step([4097, 65536])
    plan = engine.plan(step)
    assert plan.widest_split == MAX_CLUSTER_SPLITS and plan.merge == "cluster"
    assert "+cluster_merge" in engine.implementation
    with pytest.raises(ValueError, match=f"num_splits={MAX_CLUSTER_SPLITS + 1}"):
        pinned("bucket_masked", bucket_num_splits=MAX_CLUSTER_SPLITS + 1, cluster_merge=True)


def test_python_limits_mirror_the_kernel_constants():
    import re
    from pathlib import Path

    from pkv.engines.persistentkv import MAX_MERGE_SPLITS

    header = (Path(__file__).resolve().parent.parent / "csrc" / "decode_constants.h").read_text()
    constants = {name: int(value) for name, value in re.findall(r"constexpr int (\w+) = (\d+);", header)}
    assert constants["kMaxMergeSlots"] == MAX_MERGE_SPLITS
    assert constants["kMaxClusterSplits"] == MAX_CLUSTER_SPLITS


def test_python_merge_kinds_mirror_the_header():
    import re
    from pathlib import Path

    from pkv.ops import MERGE_CLUSTER, MERGE_FUSED, MERGE_LAUNCH

    header = (Path(__file__).resolve().parent.parent / "csrc" / "step_plan.h").read_text()
    body = re.search(r"enum class MergeKind : int \{([^}]*)\}", header).group(1)
    codes = {name: int(value) for name, value in re.findall(r"(\w+) = (\d+)", body)}
    assert codes == {"kLaunch": MERGE_LAUNCH, "kFused": MERGE_FUSED, "kCluster": MERGE_CLUSTER}
