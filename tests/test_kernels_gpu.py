"""The CUDA kernels against float64, on every route (DESIGN.md correctness method).

Outputs and scratch are NaN-poisoned before each run, inputs are fresh and peaked, lengths sit at
the page, tile and split edges, and page tables have holes. Skipped where there is no GPU.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from policy_constants import pinned

pytestmark = pytest.mark.gpu

PAGE = 16
EDGE_LENGTHS = [1, PAGE - 1, PAGE, PAGE + 1, 31, 32, 33, 63, 65, 1000, 4097]


def _case(seq_lens, shape, dtype, seed, peaked=True, hole_fraction=0.5):
    from pkv.measure.kv_data import make_kv_pages, make_queries
    from pkv.pipeline.pages import assign_pages
    from pkv.pipeline.step import build_step

    assignment = assign_pages(seq_lens, PAGE, hole_fraction, seed)
    step = build_step(0, np.arange(len(seq_lens)), np.asarray(seq_lens, dtype=np.int32),
                      assignment.pages, PAGE)
    k, v = make_kv_pages(assignment.num_physical_pages, shape, PAGE, dtype, "cuda", seed, peaked=peaked)
    q = make_queries(len(seq_lens), shape, dtype, "cuda", seed + 1, peaked=peaked)
    return step, q, k, v


def _dense(step, q, k, v):
    from pkv.engines.dense import dense_decode

    return dense_decode(q.double(), k.double(), v.double(), step.seq_lens, step.block_table)


def _check(out, ref, dtype):
    assert not torch.isnan(out).any(), "an output element was never written"
    err = (out.double() - ref).abs()
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    if dtype == torch.float16:
        assert err.max().item() < 2e-3 and err.mean().item() < 3e-4, (err.max().item(), err.mean().item())
        assert rel < 2e-3, rel
    else:
        assert rel < 1e-2, rel
        assert err.max().item() < 2e-2, err.max().item()


_ROUTE_KEYS = ("route", "split_policy", "bucket_num_splits", "fused_merge", "cluster_merge")


def _engine(shape, **kw):
    """The CUDA engine pinned to the route the schedule keywords name; the rest are engine options."""
    from pkv.engines.persistentkv import PersistentKVEngine

    route = {key: kw.pop(key) for key in _ROUTE_KEYS if key in kw}
    return PersistentKVEngine(shape, policy=pinned(**route), **kw)


def _run_poisoned(engine, step, q, k, v):
    plan = engine.plan(step)
    out = torch.full_like(q, float("nan"))
    scratch = engine.scratch(plan, q.device, fill=float("nan"))
    engine.run_into(q, k, v, plan, out, *scratch)
    torch.cuda.synchronize()
    return plan, out, scratch


@pytest.mark.parametrize("fused", [False, True], ids=["merge_kernel", "fused_merge"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("route", ["workqueue", "bucket_exact", "bucket_masked"])
def test_routes_match_float64(route, group, dtype, fused):
    from pkv.pipeline.schedule import SplitPolicy
    from pkv.shape import ModelShape

    shape = ModelShape(num_qo_heads=8 * group, num_kv_heads=8, head_dim=128)
    rng = np.random.default_rng(group * 7 + (dtype == torch.bfloat16) + 100 * fused)
    for trial, splits in enumerate((1, 3, 16, 64)):
        lengths = list(rng.choice(EDGE_LENGTHS, size=int(rng.integers(1, 9))))
        engine = _engine(shape, route=route, split_policy=SplitPolicy(num_splits=splits), bucket_num_splits=splits,
                         fused_merge=fused)
        step, q, k, v = _case(lengths, shape, dtype, seed=1000 * group + trial)
        _, out, _ = _run_poisoned(engine, step, q, k, v)
        _check(out, _dense(step, q, k, v), dtype)
        if fused:
            assert int(engine._counters.abs().sum()) == 0, "fused-merge counters must reset to zero"


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("route", ["workqueue", "bucket_exact"])
def test_ring_depths_match_float64(route, group, stages):
    """Every cp.async ring depth, with warps that own fewer chunks than the page-table lookahead
    (short splits) and many more (long single splits)."""
    from pkv.pipeline.schedule import SplitPolicy
    from pkv.shape import ModelShape

    shape = ModelShape(num_qo_heads=8 * group, num_kv_heads=8, head_dim=128)
    for trial, (lengths, splits) in enumerate(((EDGE_LENGTHS[:6], 1), ([4097, 65, 1000], 1),
                                               ([9000, 33, 2048 + 16], 3), ([20000], 16))):
        engine = _engine(shape, route=route, split_policy=SplitPolicy(num_splits=splits), bucket_num_splits=splits,
                         stages=stages)
        step, q, k, v = _case(lengths, shape, torch.float16, seed=300 * stages + 10 * group + trial)
        _, out, _ = _run_poisoned(engine, step, q, k, v)
        _check(out, _dense(step, q, k, v), torch.float16)


@pytest.mark.parametrize("kind", ["fixed", "balanced"])
@pytest.mark.parametrize("fused", [False, True])
def test_workqueue_random_batches(kind, fused):
    from pkv.pipeline.schedule import SplitPolicy
    from pkv.shape import ModelShape

    shape = ModelShape()
    rng = np.random.default_rng(7 + fused)
    for trial in range(6):
        batch = int(rng.choice([1, 2, 5, 16, 64]))
        lengths = [int(x) for x in rng.integers(1, 6000, size=batch)]
        splits = int(rng.choice([1, 2, 20, 64]))
        policy = SplitPolicy(kind=kind, num_splits=splits, max_splits=64)
        engine = _engine(shape, route="workqueue", split_policy=policy, fused_merge=fused)
        step, q, k, v = _case(lengths, shape, torch.float16, seed=50 + trial, peaked=bool(trial % 2 == 0))
        _, out, _ = _run_poisoned(engine, step, q, k, v)
        _check(out, _dense(step, q, k, v), torch.float16)
        if fused:
            assert int(engine._counters.abs().sum()) == 0, "fused-merge counters must reset to zero"


def test_partial_states_match_reference():
    """The kernels' split states equal the torch reference's, slot by slot."""
    from pkv.engines.reference import ReferenceEngine
    from pkv.pipeline.schedule import SplitPolicy
    from pkv.shape import ModelShape

    shape = ModelShape()
    lengths = [1, 33, 700, 2048, 5000]
    for route in ("workqueue", "bucket_masked"):
        policy = SplitPolicy(num_splits=8)
        engine = _engine(shape, route=route, split_policy=policy, bucket_num_splits=8)
        reference = ReferenceEngine(shape, policy=pinned(route, policy, 8), device="cuda")
        step, q, k, v = _case(lengths, shape, torch.float16, seed=3)
        _, _, (m, l, acc) = _run_poisoned(engine, step, q, k, v)
        rm, rl, racc = reference.partial_states(q, k, v, reference.plan(step))
        written = ~torch.isnan(m[:, 0])
        assert written.any()
        finite = torch.isfinite(rm[written])
        torch.testing.assert_close(m[written][finite], rm[written][finite].float(), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(l[written], rl[written].float(), atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(acc[written], racc[written].float(), atol=1e-3, rtol=1e-4)


def test_long_context_b1():
    from pkv.pipeline.schedule import SplitPolicy
    from pkv.shape import ModelShape

    shape = ModelShape()
    for length, splits, fused in ((32768, 48, False), (32768 + 5, 32, True), (131072 + 17, 64, False),
                                  (131072, 1024, True)):
        engine = _engine(shape, route="bucket_exact", bucket_num_splits=splits,
                         split_policy=SplitPolicy(num_splits=splits), fused_merge=fused)
        step, q, k, v = _case([length], shape, torch.float16, seed=length)
        _, out, _ = _run_poisoned(engine, step, q, k, v)
        _check(out, _dense(step, q, k, v), torch.float16)


@pytest.mark.parametrize("route", ["bucket_exact", "workqueue"])
def test_fused_merge_at_the_split_limit_g8(route):
    """The fused merge's shared-memory scratch at its bound: 1024 slots of G = 8, many of them empty."""
    from pkv.engines.persistentkv import MAX_MERGE_SPLITS
    from pkv.pipeline.schedule import SplitPolicy
    from pkv.shape import ModelShape

    shape = ModelShape(num_qo_heads=64, num_kv_heads=8, head_dim=128)
    policy = SplitPolicy(kind="fixed", num_splits=MAX_MERGE_SPLITS, max_splits=MAX_MERGE_SPLITS)
    engine = _engine(shape, route=route, bucket_num_splits=MAX_MERGE_SPLITS, split_policy=policy,
                     fused_merge=True)
    step, q, k, v = _case([40000 + 3], shape, torch.bfloat16, seed=11)
    _, out, _ = _run_poisoned(engine, step, q, k, v)
    _check(out, _dense(step, q, k, v), torch.bfloat16)
    assert int(engine._counters.abs().sum()) == 0


@pytest.mark.parametrize("fused", [False, True], ids=["merge_kernel", "fused_merge"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("route", ["workqueue", "bucket_exact", "bucket_masked"])
def test_run_plan_matches_per_op_launches(route, group, fused):
    """run() plans in C++ and issues every launch from C++ (run_plan, scratch allocated there):
    its output equals the per-op launches of the numpy plan bit for bit, and float64."""
    from pkv.pipeline.schedule import SplitPolicy
    from pkv.shape import ModelShape

    shape = ModelShape(num_qo_heads=8 * group, num_kv_heads=8, head_dim=128)
    rng = np.random.default_rng(31 * group + fused)
    for trial, splits in enumerate((1, 5, 32)):
        lengths = list(rng.choice(EDGE_LENGTHS, size=int(rng.integers(1, 9))))
        kwargs = dict(route=route, split_policy=SplitPolicy(num_splits=splits), bucket_num_splits=splits,
                      fused_merge=fused)
        native, spec = _engine(shape, planner="native", **kwargs), _engine(shape, planner="numpy", **kwargs)
        step, q, k, v = _case(lengths, shape, torch.float16, seed=77 * group + trial)
        native_plan, spec_plan = native.plan(step), spec.plan(step)
        assert native_plan.layout == spec_plan.layout
        assert torch.equal(native_plan.meta, spec_plan.meta)
        assert native_plan.host_meta.is_pinned(), "the native plan is packed into pinned memory (async upload)"
        _, expected, _ = _run_poisoned(spec, step, q, k, v)
        out = native.run(q, k, v, native_plan)
        torch.cuda.synchronize()
        assert torch.equal(out, expected), (route, lengths, splits)
        _check(out, _dense(step, q, k, v), torch.float16)
        if fused:
            assert int(native._counters.abs().sum()) == 0, "fused-merge counters must reset to zero"


def _needs_clusters():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the cluster merge needs thread-block clusters (sm_90)")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("route", ["bucket_exact", "bucket_masked"])
def test_cluster_merge_matches_float64(route, group, dtype):
    """Splits merged through distributed shared memory: every split count up to the 16-CTA
    cluster, fewer splits than query heads (a CTA merges several heads), empty splits at the
    edge lengths, and partial-state scratch that stays untouched (poisoned and still NaN)."""
    from pkv.shape import ModelShape

    _needs_clusters()
    shape = ModelShape(num_qo_heads=8 * group, num_kv_heads=8, head_dim=128)
    rng = np.random.default_rng(500 + group * 7 + (dtype == torch.bfloat16))
    for trial, splits in enumerate((1, 2, 3, 7, 8, 12, 16)):
        lengths = list(rng.choice(EDGE_LENGTHS + [20000], size=int(rng.integers(1, 6))))
        engine = _engine(shape, route=route, bucket_num_splits=splits, cluster_merge=True,
                         stages=2 + trial % 3)
        step, q, k, v = _case(lengths, shape, dtype, seed=2000 * group + trial, peaked=trial % 2 == 0)
        plan, out, scratch = _run_poisoned(engine, step, q, k, v)
        _check(out, _dense(step, q, k, v), dtype)
        assert all(torch.isnan(buf).all() for buf in scratch), "the cluster merge wrote partial states"
        native = engine.run(q, k, v, engine.plan(step))  # run_plan: the same launches from C++
        torch.cuda.synchronize()
        assert torch.equal(native, out), (route, lengths, splits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [3, 5, 6, 7])
def test_group_sizes_between_the_powers_of_two_match_float64(group, dtype):
    """G = 3, 5, 6 and 7 (Llama 3.2 3B, Qwen 2.5's 5 and 7): the G heads fill the first rows of
    the m16 tile like any G; every route, merge and ring depth, with poisoned outputs."""
    from pkv.pipeline.schedule import SplitPolicy
    from pkv.shape import ModelShape

    shape = ModelShape(num_qo_heads=4 * group, num_kv_heads=4, head_dim=128)
    rng = np.random.default_rng(900 + group + 10 * (dtype == torch.bfloat16))
    configs = [dict(route="workqueue", split_policy=SplitPolicy(num_splits=16)),
               dict(route="workqueue", split_policy=SplitPolicy(num_splits=16), fused_merge=True),
               dict(route="bucket_exact", bucket_num_splits=24, stages=3),
               dict(route="bucket_masked", bucket_num_splits=8, fused_merge=True, stages=4)]
    if torch.cuda.get_device_capability()[0] >= 9:
        configs.append(dict(route="bucket_exact", bucket_num_splits=12, cluster_merge=True))
    for trial, config in enumerate(configs):
        lengths = list(rng.choice(EDGE_LENGTHS + [20000], size=int(rng.integers(1, 7))))
        step, q, k, v = _case(lengths, shape, dtype, seed=3000 * group + trial)
        _, out, _ = _run_poisoned(_engine(shape, **config), step, q, k, v)
        _check(out, _dense(step, q, k, v), dtype)


def test_cluster_merge_cuda_graph_replay():
    from pkv.shape import ModelShape

    _needs_clusters()
    shape = ModelShape()
    eager = _engine(shape, route="bucket_exact", bucket_num_splits=16, cluster_merge=True)
    graphed = _engine(shape, route="bucket_exact", bucket_num_splits=16, cluster_merge=True, cuda_graph=True)
    for seed in range(3):
        step, q, k, v = _case([30000 + 999 * seed], shape, torch.float16, seed=seed)
        ref = eager.run(q, k, v, eager.plan(step))
        got = graphed.run(q, k, v, graphed.plan(step))
        torch.testing.assert_close(got, ref, atol=0, rtol=0)
        _check(got, _dense(step, q, k, v), torch.float16)


def _packed_plan(ops, step, route, num_kv_heads, splits, page_lists=False):
    """The C++ planner's packed plan, on the device, as run_plan takes it: over the block table,
    or over the step's page lists."""
    def int32(array):
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32))

    lens = int32(step.seq_lens)
    table, indptr = (int32(step.kv_indices), int32(step.kv_indptr)) if page_lists else (int32(step.block_table), None)
    if route == "workqueue":
        meta, layout = ops.plan_workqueue(lens, table, num_kv_heads, False, splits, splits, 0, 1, indptr)
    else:
        meta, layout = ops.plan_buckets(lens, table, num_kv_heads, splits, route == "bucket_exact", indptr)
    return meta.cuda(), list(layout)


@pytest.mark.parametrize("route", ["workqueue", "bucket_exact", "bucket_masked"])
def test_run_plan_over_page_lists_is_the_block_tables_step_bit_for_bit(route):
    """A host-planned step packed with page lists (each row's own pages, what page_lists_pay picks
    where the block table pads most) gives the block table's output bit for bit under every merge
    kind, and float64; the engine's per-op path (run_into) over the same plan too."""
    from pkv import ops as pkv_ops
    from pkv.engines.persistentkv import page_lists_pay
    from pkv.ops import MERGE_FUSED, MERGE_LAUNCH
    from pkv.shape import ModelShape

    ops = pkv_ops.load()
    shape = ModelShape()
    rng = np.random.default_rng(5)
    batches = [[65536] + [100] * 15, [1, 17, 4097, 20000, 33], [65] * 3 + [30000]]
    batches += [[int(x) for x in rng.choice(EDGE_LENGTHS, size=int(rng.integers(2, 12)))] for _ in range(4)]
    for trial, lengths in enumerate(batches):
        step, q, k, v = _case(lengths, shape, torch.float16, seed=1200 + trial)
        counters = torch.zeros(len(lengths) * shape.num_kv_heads, dtype=torch.int32, device="cuda")
        for splits in (1, 7, 24):
            table_plan = _packed_plan(ops, step, route, shape.num_kv_heads, splits)
            list_plan = _packed_plan(ops, step, route, shape.num_kv_heads, splits, page_lists=True)
            assert list_plan[0].numel() < table_plan[0].numel() or not page_lists_pay(step)
            for kind in (MERGE_LAUNCH, MERGE_FUSED):
                given = counters if kind == MERGE_FUSED and splits > 1 else None
                by_table = ops.run_plan(q, k, v, *table_plan, shape.sm_scale, 2, kind, given)
                by_lists = ops.run_plan(q, k, v, *list_plan, shape.sm_scale, 2, kind, given)
                torch.cuda.synchronize()
                assert torch.equal(by_lists, by_table), (route, lengths, splits, kind)
                assert int(counters.abs().sum()) == 0
        _check(by_lists, _dense(step, q, k, v), torch.float16)
        engine = _engine(shape, route=route)
        plan, out, _ = _run_poisoned(engine, step, q, k, v)
        assert plan.page_lists == page_lists_pay(step)
        _check(out, _dense(step, q, k, v), torch.float16)


@pytest.mark.parametrize("route", ["workqueue", "bucket_exact", "bucket_masked"])
def test_run_plan_runs_the_merge_kind_it_is_given(route):
    """run_plan called with each merge kind the route policy may pick: every kind matches float64,
    repeats bit for bit, leaves the fused counters at zero, and a kind the plan cannot run is
    refused with the reason before any launch."""
    from pkv import ops as pkv_ops
    from pkv.ops import MERGE_CLUSTER, MERGE_FUSED, MERGE_LAUNCH
    from pkv.shape import ModelShape

    ops = pkv_ops.load()
    shape = ModelShape(num_qo_heads=32, num_kv_heads=8, head_dim=128)
    kinds = [MERGE_LAUNCH, MERGE_FUSED]
    if route != "workqueue" and torch.cuda.get_device_capability()[0] >= 9:
        kinds.append(MERGE_CLUSTER)
    for trial, splits in enumerate((1, 5, 16)):
        lengths = [4097, 33, 1000, 65][:trial + 2]
        step, q, k, v = _case(lengths, shape, torch.float16, seed=900 + trial)
        meta, layout = _packed_plan(ops, step, route, shape.num_kv_heads, splits)
        run = functools.partial(ops.run_plan, q, k, v, meta, layout, shape.sm_scale, 2)
        ref = _dense(step, q, k, v)
        merges = splits > 1
        counters = torch.zeros(len(lengths) * shape.num_kv_heads, dtype=torch.int32, device="cuda")
        for kind in kinds:
            # A plan of single splits writes `out` directly: the fused kind needs no counters then.
            given = counters if kind == MERGE_FUSED and merges else None
            out = run(kind, given)
            _check(out, ref, torch.float16)
            assert torch.equal(run(kind, given), out), (route, kind, splits)
            assert int(counters.abs().sum()) == 0, "fused-merge counters must reset to zero"
        if not merges:
            continue
        with pytest.raises(RuntimeError, match="needs pair_counters"):
            run(MERGE_FUSED, None)
        with pytest.raises(RuntimeError, match="pair_counters belong to the fused merge"):
            run(MERGE_LAUNCH, counters)
        with pytest.raises(RuntimeError, match="merge_kind must be 0"):
            run(3, None)
        if route == "workqueue":
            with pytest.raises(RuntimeError, match="cluster merge .* is a bucket-route option"):
                run(MERGE_CLUSTER, None)
    step, q, k, v = _case([20000], shape, torch.float16, seed=3)
    meta, layout = _packed_plan(ops, step, "bucket_masked", shape.num_kv_heads, 17)
    with pytest.raises(RuntimeError, match="at most 16 splits"):
        ops.run_plan(q, k, v, meta, layout, shape.sm_scale, 2, MERGE_CLUSTER, None)


@pytest.mark.parametrize("route", ["workqueue", "bucket_exact"])
def test_run_plan_scratch_alignment_with_odd_head_counts(route):
    """Hkv = 3, G = 2: slot counts that are not multiples of 4, so run_plan's padding between the
    m and l regions of its one scratch buffer is exercised."""
    from pkv.pipeline.schedule import SplitPolicy
    from pkv.shape import ModelShape

    shape = ModelShape(num_qo_heads=6, num_kv_heads=3, head_dim=128)
    for splits, lengths in ((3, [33, 1000, 17]), (5, [4097]), (7, [65, 1, 2500, 700, 31])):
        kwargs = dict(route=route, split_policy=SplitPolicy(num_splits=splits), bucket_num_splits=splits)
        native, spec = _engine(shape, **kwargs), _engine(shape, planner="numpy", **kwargs)
        step, q, k, v = _case(lengths, shape, torch.float16, seed=splits)
        _, expected, _ = _run_poisoned(spec, step, q, k, v)
        out = native.run(q, k, v, native.plan(step))
        torch.cuda.synchronize()
        assert torch.equal(out, expected), (route, lengths, splits)
        _check(out, _dense(step, q, k, v), torch.float16)


@pytest.mark.parametrize("route", ["workqueue", "bucket_exact"])
def test_cuda_graph_replay_matches_eager(route):
    from pkv.pipeline.schedule import SplitPolicy
    from pkv.shape import ModelShape

    shape = ModelShape()
    eager = _engine(shape, route=route, split_policy=SplitPolicy(num_splits=20))
    graphed = _engine(shape, route=route, split_policy=SplitPolicy(num_splits=20), cuda_graph=True)
    for seed in range(3):
        step, q, k, v = _case([4000, 9000, 100, 30000], shape, torch.float16, seed=seed)
        ref = eager.run(q, k, v, eager.plan(step))
        got = graphed.run(q, k, v, graphed.plan(step))
        torch.testing.assert_close(got, ref, atol=0, rtol=0)


@pytest.fixture
def discarding_merges():
    from pkv import ops

    before = ops.discard_merged_states(True)
    yield
    ops.discard_merged_states(before)


@pytest.mark.parametrize("route", ["workqueue", "bucket_exact", "bucket_masked"])
def test_merges_that_discard_their_states_match_float64(route, discarding_merges):
    from pkv.pipeline.schedule import SplitPolicy
    from pkv.shape import ModelShape

    shape = ModelShape()
    rng = np.random.default_rng(31)
    for trial, splits in enumerate((3, 20, 64)):
        lengths = [int(n) for n in rng.choice(EDGE_LENGTHS, size=6)] + [30000]
        engine = _engine(shape, route=route, split_policy=SplitPolicy(num_splits=splits), bucket_num_splits=splits)
        step, q, k, v = _case(lengths, shape, torch.float16, seed=500 + trial)
        ref = _dense(step, q, k, v)
        for _ in range(2):  # the second run merges states written after the first run's were dropped
            _, out, _ = _run_poisoned(engine, step, q, k, v)
            _check(out, ref, torch.float16)


def test_graph_replays_that_discard_merged_states_match_eager(discarding_merges):
    from pkv.pipeline.schedule import SplitPolicy
    from pkv.shape import ModelShape

    shape = ModelShape()
    eager = _engine(shape, route="workqueue", split_policy=SplitPolicy(num_splits=20))
    graphed = _engine(shape, route="workqueue", split_policy=SplitPolicy(num_splits=20), cuda_graph=True)
    for seed, lengths in enumerate(([4000, 9000, 100, 30000], [17, 65000, 2048, 4097], [30000, 1, 33, 8000])):
        step, q, k, v = _case(lengths, shape, torch.float16, seed=seed)
        ref = _dense(step, q, k, v)
        got = graphed.run(q, k, v, graphed.plan(step))
        _check(got, ref, torch.float16)
        torch.testing.assert_close(got, eager.run(q, k, v, eager.plan(step)), atol=0, rtol=0)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("route", ["workqueue", "bucket_masked"])
def test_nhd_pages_are_read_in_place(route, group):
    """Pages stored NHD give the HND pages' output bit for bit: one kernel, the token stride taken
    from the tensor; and so do pages inside vLLM's combined [2, num_pages, P, Hkv, d] cache."""
    from pkv.measure.kv_data import stored_nhd
    from pkv.pipeline.schedule import SplitPolicy
    from pkv.shape import ModelShape

    shape = ModelShape(num_qo_heads=8 * group, num_kv_heads=8, head_dim=128)
    engine = _engine(shape, route=route, split_policy=SplitPolicy(num_splits=16), bucket_num_splits=16,
                     fused_merge=True)
    step, q, k, v = _case([1, 17, 4097, 1000, 65], shape, torch.float16, seed=50 + group)
    _, hnd, _ = _run_poisoned(engine, step, q, k, v)
    k_nhd, v_nhd = stored_nhd(k), stored_nhd(v)
    assert k_nhd.stride(2) == shape.num_kv_heads * shape.head_dim
    _, nhd, _ = _run_poisoned(engine, step, q, k_nhd, v_nhd)
    torch.testing.assert_close(nhd, hnd, atol=0, rtol=0)
    combined = torch.stack((k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)))  # [2, N, P, Hkv, d]
    _, from_cache, _ = _run_poisoned(engine, step, q, combined[0].permute(0, 2, 1, 3),
                                     combined[1].permute(0, 2, 1, 3))
    torch.testing.assert_close(from_cache, hnd, atol=0, rtol=0)
    _check(nhd, _dense(step, q, k, v), torch.float16)


def test_bad_inputs_name_the_field():
    from pkv.shape import ModelShape

    shape = ModelShape()
    engine = _engine(shape, route="workqueue")
    step, q, k, v = _case([100, 200], shape, torch.float16, seed=0)
    plan = engine.plan(step)
    with pytest.raises(ValueError, match="q must be float16 or bfloat16"):
        engine.run(q.float(), k, v, plan)
    with pytest.raises(ValueError, match="v_pages"):
        engine.run(q, k, v[:, :4], plan)
    # A head-dim row that is not contiguous cannot be copied in 16-byte pieces.
    def strided(pages):
        return pages.transpose(2, 3).contiguous().transpose(2, 3)

    with pytest.raises(RuntimeError, match="k_pages must be .* with contiguous d"):
        engine.run(q, strided(k), strided(v), plan)
    with pytest.raises(ValueError, match="2 rows"):
        engine.run(q, k, v, engine.plan(_case([100, 200, 300], shape, torch.float16, seed=1)[0]))
    # A layout that names both page-table forms, or neither, or metadata of another size.
    from pkv.ops import MERGE_LAUNCH

    meta, layout = _packed_plan(engine.ops, step, "workqueue", shape.num_kv_heads, 4, page_lists=True)
    run = functools.partial(engine.ops.run_plan, q, k, v)
    for bad, width, entries in ((layout, 1, layout[4]), (layout, 0, 0)):
        changed = list(bad)
        changed[2], changed[4] = width, entries
        with pytest.raises(RuntimeError, match=rf"block-table width {width} and {entries} page-list entries"):
            run(meta, changed, shape.sm_scale, 2, MERGE_LAUNCH, None)
    with pytest.raises(RuntimeError, match="plan metadata holds"):
        run(meta[:-1], layout, shape.sm_scale, 2, MERGE_LAUNCH, None)


def test_warm_up_runs_each_kernel_set_once():
    """prepare() runs a plan untimed the first time its kernels are needed, then never again for
    the same kernels; a step that needs the merge too is a new kernel set."""
    from pkv.pipeline.schedule import SplitPolicy
    from pkv.shape import ModelShape

    shape = ModelShape()
    engine = _engine(shape, route="workqueue", split_policy=SplitPolicy(num_splits=4))
    runs = []
    run = engine.run
    engine.run = lambda *args: runs.append(args[-1].route) or run(*args)
    single = _case([20, 17], shape, torch.float16, seed=5)  # one tile a row: one split, no merge
    merged = _case([4000, 33], shape, torch.float16, seed=6)
    for step, q, k, v in (single, single, merged, merged, single):
        engine.prepare(step, q, k, v)
    assert runs == ["persistentkv_workqueue", "persistentkv_workqueue"]


@pytest.mark.parametrize("options", [{}, {"schedule": "bucket_masked"}, {"split_kind": "balanced"},
                                     {"bucket_tiles_per_split": 4}])
def test_the_adaptive_steps_one_call_plan_runs_as_the_python_policys_plan(options):
    """The adaptive engine's C++ decision and plan (adaptive_plan, uploaded in the same call) run
    bit for bit as the Python policy's route planned by plan_route, and match float64, on steps
    that take the bucket, the fixed and the balanced workqueue routes, and a short row under the
    short-row rule."""
    from pkv.engines.adaptive import AdaptiveEngine, AdaptivePlan
    from pkv.engines.persistentkv import PersistentKVEngine
    from pkv.engines.sdpa import SdpaEngine
    from pkv.policy import Calibration, RoutePolicy
    from pkv.policy.overrides import apply_engine_options, kernel_variants
    from pkv.shape import ModelShape

    shape = ModelShape()
    options = dict(options)
    variants = kernel_variants(options.pop("schedule", "workqueue"))
    calib = Calibration.from_mapping({"gpu": "test", "num_sms": 132, "beta_gbps": 3000.0, "lambda_us": 5.0,
                                      "c_min": 0.25, "supported_group_sizes": [4]}, "test")
    for regime in ("single_row", "few_rows", "many_rows"):
        calib = calib.with_regime(regime, min_context_tokens=0, margin=0.01)
    calib = calib.with_regime("single_row", route="persistentkv_bucket", num_splits=16)
    calib = calib.with_regime("many_rows", route="persistentkv_workqueue", num_splits=20, skew_target_ctas=396)
    policy = RoutePolicy(apply_engine_options(calib, **options), num_kv_heads=shape.num_kv_heads,
                         group_size=shape.group_size, head_dim=shape.head_dim, variants=variants)
    persistent = PersistentKVEngine(shape, policy=policy)
    engine = AdaptiveEngine(policy, persistent, SdpaEngine(shape, "cuda"))
    assert engine._native is not None
    cases = ([8192], [4097], [384], [4000, 9000, 100, 30000, 17, 65000, 2048, 4097], [131072] + [100] * 63)
    for seed, lengths in enumerate(cases):
        step, q, k, v = _case(lengths, shape, torch.float16, seed=seed)
        plan = engine.plan(step)
        assert isinstance(plan, AdaptivePlan) and plan.decision == policy.choose(step)
        if lengths == [384]:  # 12 tiles: the regime's 16 (12 one-tile splits), or 2 of 6 under the short-row rule
            assert plan.num_splits == (2 if options.get("bucket_tiles_per_split") else 16)
        got = engine.run(q, k, v, plan)
        want = persistent.run(q, k, v, persistent.plan_route(step, plan.decision.route))
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        _check(got, _dense(step, q, k, v), torch.float16)


@pytest.mark.parametrize("options", [{}, {"schedule": "bucket_masked"}, {"split_kind": "balanced"}, {"merge": "fused"},
                                     {"bucket_tiles_per_split": 4}])
def test_the_one_op_step_runs_as_the_adaptive_steps_two_calls(options):
    """An eager step decided, planned, uploaded and launched in one op call (adaptive_step) gives the
    two-call step's output bit for bit and matches float64, on the bucket, the fixed and balanced
    workqueue routes and with the fused merge; a second run of its plan replays that plan; a step
    a gate leaves to FlashInfer runs the fallback's own plan, made at plan()."""
    from pkv.engines.adaptive import AdaptiveEngine, AdaptivePlan, OneOpPlan
    from pkv.engines.persistentkv import PersistentKVEngine
    from pkv.engines.sdpa import SdpaEngine
    from pkv.policy import Calibration, RoutePolicy
    from pkv.policy.overrides import apply_engine_options, kernel_variants
    from pkv.shape import ModelShape

    shape = ModelShape()
    options = dict(options)
    variants = kernel_variants(options.pop("schedule", "workqueue"), options.pop("merge", "launch"))
    calib = Calibration.from_mapping({"gpu": "test", "num_sms": 132, "beta_gbps": 3000.0, "lambda_us": 5.0,
                                      "c_min": 0.25, "supported_group_sizes": [4]}, "test")
    for regime in ("single_row", "few_rows", "many_rows"):
        calib = calib.with_regime(regime, min_context_tokens=0, margin=0.01)
    calib = calib.with_regime("single_row", route="persistentkv_bucket", num_splits=16)
    calib = calib.with_regime("few_rows", route="flashinfer")
    calib = calib.with_regime("many_rows", route="persistentkv_workqueue", num_splits=20, skew_target_ctas=396)
    policy = RoutePolicy(apply_engine_options(calib, **options), num_kv_heads=shape.num_kv_heads,
                         group_size=shape.group_size, head_dim=shape.head_dim, variants=variants)
    persistent = PersistentKVEngine(shape, policy=policy)
    fallback = SdpaEngine(shape, "cuda")
    two_calls = AdaptiveEngine(policy, persistent, fallback)
    one_op = AdaptiveEngine(policy, persistent, fallback, one_op_step=True)
    cases = ([8192], [4097], [384], [3000, 5000], [4000, 9000, 100, 30000, 17, 65000, 2048, 4097],
             [131072] + [100] * 63)
    for seed, lengths in enumerate(cases):
        step, q, k, v = _case(lengths, shape, torch.float16, seed=seed)
        want = two_calls.run(q, k, v, two_calls.plan(step))
        plan = one_op.plan(step)
        if policy.gate(step) is not None:  # the few-rows regime, closed here: FlashInfer's plan at once
            # The fallback's own plan and run (a stand-in here, whose kernels need not repeat to the
            # bit from run to run: held to float64).
            assert not isinstance(plan, OneOpPlan), lengths
            _check(one_op.run(q, k, v, plan), _dense(step, q, k, v), torch.float16)
            continue
        assert isinstance(plan, OneOpPlan)
        got = one_op.run(q, k, v, plan)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        _check(got, _dense(step, q, k, v), torch.float16)
        decided = plan.resolved()
        assert isinstance(decided, AdaptivePlan) and decided.decision == policy.choose(step), lengths
        torch.testing.assert_close(one_op.run(q, k, v, plan), want, atol=0, rtol=0)
        read_first = one_op.plan(step)  # read before its run: planned then, launched by the run
        assert read_first.route == plan.route
        torch.testing.assert_close(one_op.run(q, k, v, read_first), want, atol=0, rtol=0)
