"""The decode step planned on the GPU: its plan against the host planner, its output against
float64, and CUDA-graph replays for lengths other than the captured ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pkv.engines.dense import dense_decode
from pkv.measure.kv_data import make_kv_pages, make_queries, stored_nhd
from pkv.page_table import PageLists
from pkv.pipeline.schedule import SplitPolicy, plan_workqueue, plan_workqueue_device_order
from pkv.pipeline.step import build_step
from pkv.shape import ModelShape

pytestmark = pytest.mark.gpu

PAGE = 16
EDGE_LENGTHS = [1, PAGE - 1, PAGE, PAGE + 1, 31, 32, 33, 63, 65, 1000, 4097, 20000]


def _pool(shape, dtype, num_pages, seed):
    return make_kv_pages(num_pages, shape, PAGE, dtype, "cuda", seed)


def _tables(lengths, num_pages, max_pages, rng):
    """A StepBatch over distinct random pages of the pool, and its block table padded to max_pages."""
    pages = [-(-n // PAGE) for n in lengths]
    chosen = rng.permutation(num_pages)[:sum(pages)].astype(np.int32)
    rows = np.split(chosen, np.cumsum(pages)[:-1])
    step = build_step(0, np.arange(len(lengths)), np.asarray(lengths, dtype=np.int32), rows, PAGE)
    table = np.zeros((len(lengths), max_pages), dtype=np.int32)
    table[:, :step.block_table.shape[1]] = step.block_table
    return step, torch.from_numpy(table).cuda(), torch.tensor(lengths, dtype=torch.int32, device="cuda")


def _check(out, step, q, k, v, dtype):
    ref = dense_decode(q.double(), k.double(), v.double(), step.seq_lens, step.block_table)
    assert not torch.isnan(out).any(), "an output element was never written"
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    err = (out.double() - ref).abs()
    if dtype == torch.float16:
        assert err.max().item() < 2e-3 and err.mean().item() < 3e-4 and rel < 2e-3, (err.max().item(), rel)
    else:
        assert rel < 1e-2 and err.max().item() < 2e-2, (err.max().item(), rel)


@pytest.mark.parametrize("num_splits", [1, 5, 24, 64])
def test_device_plan_is_the_host_plan_order_included(num_splits):
    from pkv.engines.device_step import DeviceDecodeStep

    shape = ModelShape()
    workspace = DeviceDecodeStep(shape, max_batch=64, num_splits=num_splits)
    rng = np.random.default_rng(num_splits)
    for trial in range(12):
        batch = int(rng.integers(1, 65))
        lengths = [int(x) for x in rng.choice(EDGE_LENGTHS + list(rng.integers(1, 70000, size=8)), size=batch)]
        step, table, lens = _tables(lengths, 10**6, max(-(-n // PAGE) for n in lengths), rng)
        capacity = batch * shape.num_kv_heads * num_splits
        offsets = workspace.split_offsets[:batch * shape.num_kv_heads + 1]
        workspace.ops.plan_workqueue_on_device(lens, shape.num_kv_heads, num_splits, 2**31 - 1,
                                               workspace.tasks[:capacity], offsets, workspace.counts)
        host = plan_workqueue(step, shape.num_kv_heads, shape.group_size, SplitPolicy(num_splits=num_splits))
        live, widest = workspace.counts.tolist()
        assert (live, widest) == (host.num_tasks, host.max_splits), (trial, batch)
        assert np.array_equal(offsets.cpu().numpy(), host.split_offsets)
        tasks = workspace.tasks[:live].cpu().numpy()
        # The kernel writes exactly the host's plan and its CPU mirror, order included.
        assert np.array_equal(tasks, host.tasks), (trial, batch)
        mirror = plan_workqueue_device_order(np.asarray(lengths), shape.num_kv_heads, shape.group_size, num_splits)
        assert np.array_equal(tasks, mirror.tasks) and np.array_equal(offsets.cpu().numpy(), mirror.split_offsets)
        assert np.all(np.diff(tasks[:, 4] - tasks[:, 3]) <= 0), "tasks must come longest (most tiles) first"


@pytest.mark.parametrize("merge", ["launch", "fused"])
@pytest.mark.parametrize("target_ctas", [0, 396, 5000])
def test_the_balanced_device_plan_is_its_cpu_mirror_and_replays_to_float64(target_ctas, merge):
    """The balanced split rule planned on the GPU: exactly the plan plan_workqueue_device_order
    describes (its total over the clamped lengths), the output against float64, a graph captured
    at one set of lengths replayed for fresh ones bit for bit as the eager step."""
    from pkv.engines.device_step import DeviceDecodeStep, GraphedDecodeStep

    shape, dtype, max_pages = ModelShape(), torch.float16, 8192
    rng = np.random.default_rng(target_ctas + 1)
    k, v = _pool(shape, dtype, 40000, seed=12)
    workspace = DeviceDecodeStep(shape, max_batch=64, num_splits=8, merge=merge, split_kind="balanced",
                                 target_ctas=target_ctas)
    graphed = GraphedDecodeStep(workspace, k, v, max_pages)
    # The skewed batch (one long row among short ones, where the fixed rule leaves SMs idle), then
    # ragged batches from the edges.
    batches = [[max_pages * PAGE] + [100] * 63, [max_pages * PAGE] + [1] * 63]
    edge = EDGE_LENGTHS + [8 * 32 - 1, 8 * 32, 8 * 32 + 1]
    batches += [[int(x) for x in rng.choice(edge + list(rng.integers(1, 20000, size=4)), size=64)]
                for _ in range(6)]
    for trial, lengths in enumerate(batches):
        step, table, lens = _tables(lengths, 40000, max_pages, rng)
        q = make_queries(64, shape, dtype, "cuda", seed=200 + trial)
        out = torch.full_like(q, float("nan"))
        workspace.part_acc.fill_(float("nan"))
        workspace.run(q, k, v, table, lens, out)
        torch.cuda.synchronize()
        mirror = plan_workqueue_device_order(np.asarray(lengths), shape.num_kv_heads, shape.group_size,
                                             workspace.split_policy, max_tokens=max_pages * PAGE)
        live, widest = workspace.counts.tolist()
        assert (live, widest) == (mirror.num_tasks, mirror.max_splits), trial
        assert np.array_equal(workspace.tasks[:live].cpu().numpy(), mirror.tasks), trial
        assert np.array_equal(workspace.split_offsets[:64 * shape.num_kv_heads + 1].cpu().numpy(),
                              mirror.split_offsets), trial
        _check(out, step, q, k, v, dtype)
        replayed = graphed.run(q, table, lens).clone()
        torch.cuda.synchronize()
        assert torch.equal(replayed, out), trial
    assert int(workspace.pair_counters.abs().sum()) == 0


@pytest.mark.parametrize("merge", ["launch", "fused"])
@pytest.mark.parametrize("planner", ["plan_kernel", "in_decode"])
@pytest.mark.parametrize("group", [1, 2, 4, 7, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_device_planned_step_matches_float64(group, dtype, planner, merge):
    from pkv.engines.device_step import DeviceDecodeStep

    shape = ModelShape(num_qo_heads=8 * group, num_kv_heads=8)
    rng = np.random.default_rng(group)
    k, v = _pool(shape, dtype, 11000, seed=group)
    for splits in (1, 7, 32):
        workspace = DeviceDecodeStep(shape, max_batch=16, num_splits=splits, stages=2 + splits % 3, planner=planner,
                                     merge=merge)
        lengths = [int(x) for x in rng.choice(EDGE_LENGTHS, size=int(rng.integers(1, 9)))]
        step, table, lens = _tables(lengths, 11000, 1300, rng)
        q = make_queries(len(lengths), shape, dtype, "cuda", seed=splits)
        out = torch.full_like(q, float("nan"))
        workspace.part_acc.fill_(float("nan"))
        workspace.run(q, k, v, table, lens, out)
        torch.cuda.synchronize()
        _check(out, step, q, k, v, dtype)
        assert int(workspace.pair_counters.abs().sum()) == 0, "the fused merge's counters must be zero again"


@pytest.mark.parametrize("planner", ["plan_kernel", "in_decode"])
def test_device_step_reads_nhd_pages_in_place(planner):
    """vLLM's cache layout ([num_pages, P, Hkv, d], viewed as [num_pages, Hkv, P, d]) gives the HND
    pages' output bit for bit, over both page-table forms."""
    from pkv.engines.device_step import DeviceDecodeStep

    shape = ModelShape()
    rng = np.random.default_rng(61)
    k, v = _pool(shape, torch.float16, 9000, seed=8)
    k_nhd, v_nhd = stored_nhd(k), stored_nhd(v)
    workspace = DeviceDecodeStep(shape, max_batch=8, num_splits=12, planner=planner)
    step, table, lens = _tables([20000, 1, 17, 4097, 333], 9000, 1300, rng)
    q = make_queries(5, shape, torch.float16, "cuda", seed=9)
    hnd = workspace.run(q, k, v, table, lens, torch.full_like(q, float("nan"))).clone()
    for page_table in (table, PageLists.from_step(step, "cuda")):
        nhd = workspace.run(q, k_nhd, v_nhd, page_table, lens, torch.full_like(q, float("nan")))
        torch.cuda.synchronize()
        assert torch.equal(nhd, hnd)
    _check(hnd, step, q, k, v, torch.float16)


def _graphed_step(shape, dtype, max_pages, planner, seed, debug_checks=False):
    """A pool of 40,000 pages and graphs over a workspace of 8 rows and 24 splits."""
    from pkv.engines.device_step import DeviceDecodeStep, GraphedDecodeStep

    k, v = _pool(shape, dtype, 40000, seed=seed)
    workspace = DeviceDecodeStep(shape, max_batch=8, num_splits=24, planner=planner)
    return k, v, workspace, GraphedDecodeStep(workspace, k, v, max_pages, debug_checks=debug_checks)


@pytest.mark.parametrize("planner", ["plan_kernel", "in_decode"])
def test_graph_replays_for_lengths_other_than_the_captured_ones(planner):
    shape, dtype, max_pages = ModelShape(), torch.float16, 4096
    rng = np.random.default_rng(7)
    k, v, workspace, graphed = _graphed_step(shape, dtype, max_pages, planner, seed=3)
    # Captured at the first lengths; every later step has other lengths, longer and shorter,
    # with rows that need more splits than any captured row and rows of a single tile.
    batches = [[20000, 3000, 17, 65536, 4097, 1, 900, 12000], [1, 1, 1, 1, 1, 1, 1, 1],
               [65536] * 8, [33, 65, 4097, 20000, 31, 32, 16, 60000], [20000, 3000, 17, 65536, 4097, 1, 900, 12000]]
    # Then 20 fresh random sets from the edges: a page either side, the split boundaries of 24
    # splits of 32-token tiles, and the table's maximum (with holes: _tables draws each step's
    # pages at random from the 40,000 of the pool).
    edge = EDGE_LENGTHS + [24 * 32 - 1, 24 * 32, 24 * 32 + 1, max_pages * PAGE]
    batches += [[int(x) for x in rng.choice(edge, size=8)] for _ in range(20)]
    for trial, lengths in enumerate(batches):
        step, table, lens = _tables(lengths, 40000, max_pages, rng)
        q = make_queries(8, shape, dtype, "cuda", seed=100 + trial)
        out = graphed.run(q, table, lens).clone()
        torch.cuda.synchronize()
        _check(out, step, q, k, v, dtype)
        eager = workspace.run(q, k, v, table, lens, torch.empty_like(q))
        assert torch.equal(eager, out), trial  # the replay is the eager step, bit for bit
    assert list(graphed._graphs) == [(8, False)]
    # Another batch size is another graph.
    step, table, lens = _tables([5000, 70], 40000, max_pages, rng)
    q = make_queries(2, shape, dtype, "cuda", seed=1)
    _check(graphed.run(q, table, lens).clone(), step, q, k, v, dtype)
    assert sorted(graphed._graphs) == [(2, False), (8, False)]


def test_bad_input_is_refused_before_any_launch():
    from pkv.engines.device_step import DeviceDecodeStep

    shape = ModelShape()
    workspace = DeviceDecodeStep(shape, max_batch=4, num_splits=8)
    k, v = _pool(shape, torch.float16, 64, seed=0)
    q = make_queries(5, shape, torch.float16, "cuda", seed=0)
    table = torch.zeros(5, 4, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="serves 1..4"):
        workspace.run(q, k, v, table, torch.ones(5, dtype=torch.int32, device="cuda"), torch.empty_like(q))
    q = q[:2]
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        workspace.run(q, k, v, table[:2], torch.ones(2, dtype=torch.int64, device="cuda"), torch.empty_like(q))
    with pytest.raises(RuntimeError, match="tasks must be contiguous"):
        workspace.ops.plan_workqueue_on_device(torch.ones(2, dtype=torch.int32, device="cuda"), 8, 8, 64,
                                               workspace.tasks[:3], workspace.split_offsets[:17], workspace.counts)
    # Page lists count entries, not tokens: the op has no page size to assume for them.
    with pytest.raises(RuntimeError, match="page_size \\(tokens a page\\) must be given"):
        workspace.ops.plan_workqueue_on_device(torch.ones(2, dtype=torch.int32, device="cuda"), 8, 8, 64,
                                               workspace.tasks[:2 * 8 * 8], workspace.split_offsets[:17],
                                               workspace.counts, torch.tensor([0, 1, 2], dtype=torch.int32,
                                                                              device="cuda"))
    with pytest.raises(ValueError, match="max_batch"):
        DeviceDecodeStep(shape, max_batch=2000, num_splits=8)
    # The balanced rule's capacity is B * Hkv + target (here 16 + 4), and its fields are checked.
    lens = torch.ones(2, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match=r"tasks must be contiguous \[>= 20 "):
        workspace.ops.plan_workqueue_on_device(lens, 8, 8, 64, workspace.tasks[:19], workspace.split_offsets[:17],
                                               workspace.counts, None, 16, True, 64, 4)
    with pytest.raises(RuntimeError, match="the balanced rule needs max_splits in 1..1024"):
        workspace.ops.plan_workqueue_on_device(lens, 8, 8, 64, workspace.tasks[:20], workspace.split_offsets[:17],
                                               workspace.counts, None, 16, True, 0, 4)


@pytest.mark.parametrize("page_lists", [False, True], ids=["block_table", "page_lists"])
@pytest.mark.parametrize("planner", ["plan_kernel", "in_decode"])
def test_lengths_past_a_rows_pages_are_clamped_to_them(planner, page_lists):
    """A length its pages cannot address (what plan() and decode() take without the eager check,
    as a graph replays it) reads no page past the row's own: the step attends over the pages the
    row has, under either planner and page-table form."""
    from pkv.engines.device_step import DeviceDecodeStep

    shape = ModelShape()
    rng = np.random.default_rng(11)
    k, v = _pool(shape, torch.float16, 512, seed=5)
    workspace = DeviceDecodeStep(shape, max_batch=2, num_splits=8, planner=planner)
    step, table, _ = _tables([64 * PAGE, 3 * PAGE], 512, 64, rng)
    page_table = PageLists.from_step(step, "cuda") if page_lists else table
    q = make_queries(2, shape, torch.float16, "cuda", seed=2)
    # Row 0 runs past the table's width; with page lists row 1 also runs past its own 3 pages (a
    # block table's row 1 addresses the table's whole width, so there it stays in range).
    too_long = torch.tensor([10**6, 3 * PAGE + (5 if page_lists else 0)], dtype=torch.int32, device="cuda")
    workspace.plan(page_table, too_long, PAGE)
    out = workspace.decode(q, k, v, page_table, too_long, torch.empty_like(q))
    torch.cuda.synchronize()
    _check(out, step, q, k, v, torch.float16)


def test_lengths_past_the_table_are_refused_in_eager_mode_and_caught_on_the_device_under_replay():
    from pkv.engines.device_step import DeviceDecodeStep, GraphedDecodeStep

    shape = ModelShape()
    rng = np.random.default_rng(3)
    k, v = _pool(shape, torch.float16, 4000, seed=0)
    workspace = DeviceDecodeStep(shape, max_batch=4, num_splits=8)
    step, table, lens = _tables([100, 4000, 17], 4000, 256, rng)
    q = make_queries(3, shape, torch.float16, "cuda", seed=0)
    too_long = lens.clone()
    too_long[1] = 256 * PAGE + 1
    for host_lens in (None, too_long.cpu().numpy()):
        with pytest.raises(ValueError, match=r"row 1 has length 4097; .* 256 pages of 16 tokens address 0\.\.4096"):
            workspace.run(q, k, v, table, too_long, torch.empty_like(q), host_lens=host_lens)
    graphed = GraphedDecodeStep(workspace, k, v, 256, debug_checks=True)
    _check(graphed.run(q, table, lens).clone(), step, q, k, v, torch.float16)
    with pytest.raises(ValueError, match=r"debug check on the device\): row 1 has length 4097"):
        graphed.run(q, table, too_long)
    _check(graphed.run(q, table, lens).clone(), step, q, k, v, torch.float16)  # the graph still serves


def test_device_planned_ops_compile_with_torch_compile():
    from pkv.engines.device_step import DeviceDecodeStep

    shape = ModelShape()
    rng = np.random.default_rng(11)
    k, v = _pool(shape, torch.float16, 6000, seed=2)
    workspace = DeviceDecodeStep(shape, max_batch=4, num_splits=16)
    step, table, lens = _tables([5000, 33, 16, 1], 6000, 400, rng)
    q = make_queries(4, shape, torch.float16, "cuda", seed=4)

    def decode(q, table, lens, out):
        workspace.plan(table, lens, PAGE)
        return workspace.decode(q, k, v, table, lens, out)

    compiled = torch.compile(decode, fullgraph=True)
    out = compiled(q, table, lens, torch.full_like(q, float("nan")))
    torch.cuda.synchronize()
    _check(out, step, q, k, v, torch.float16)
    # The one-call form too: its eager length check stands aside while torch.compile traces.
    whole = torch.compile(lambda q, table, lens, out: workspace.run(q, k, v, table, lens, out), fullgraph=True)
    _check(whole(q, table, lens, torch.full_like(q, float("nan"))), step, q, k, v, torch.float16)


def _lists(step, trailing=0, rng=None):
    """The step's pages as PageLists, with ``trailing`` junk entries after the last row's list (a
    serving engine's flat list is a buffer longer than the step's pages)."""
    lists = PageLists.from_step(step, "cuda")
    if not trailing:
        return lists
    junk = torch.tensor(rng.integers(0, 2**30, size=trailing), dtype=torch.int32, device="cuda")
    return PageLists(lists.indptr, torch.cat((lists.indices, junk)), lists.host_indptr)


@pytest.mark.parametrize("num_splits", [1, 8, 40])
def test_device_plan_clamps_each_row_to_its_page_list(num_splits):
    from pkv.engines.device_step import DeviceDecodeStep

    shape = ModelShape()
    workspace = DeviceDecodeStep(shape, max_batch=32, num_splits=num_splits)
    rng = np.random.default_rng(40 + num_splits)
    for trial in range(10):
        batch = int(rng.integers(1, 33))
        pages = rng.integers(0, 300, size=batch).astype(np.int32)
        indptr = np.r_[0, np.cumsum(pages)].astype(np.int32)
        # Lengths inside, at and past each row's pages: the plan clamps each row to its own list.
        lengths = np.minimum(pages.astype(np.int64) * PAGE + rng.integers(-40, 40, size=batch), 2**31 - 1)
        lengths = np.maximum(lengths, 0).astype(np.int32)
        lens = torch.tensor(lengths, device="cuda")
        capacity = batch * shape.num_kv_heads * num_splits
        offsets = workspace.split_offsets[:batch * shape.num_kv_heads + 1]
        workspace.ops.plan_workqueue_on_device(lens, shape.num_kv_heads, num_splits, 2**31 - 1,
                                               workspace.tasks[:capacity], offsets, workspace.counts,
                                               torch.tensor(indptr, device="cuda"), PAGE)
        mirror = plan_workqueue_device_order(lengths, shape.num_kv_heads, shape.group_size, num_splits,
                                             row_tokens=pages.astype(np.int64) * PAGE)
        live = workspace.counts[0].item()
        assert np.array_equal(workspace.tasks[:live].cpu().numpy(), mirror.tasks), trial
        assert np.array_equal(offsets.cpu().numpy(), mirror.split_offsets), trial


@pytest.mark.parametrize("planner", ["plan_kernel", "in_decode"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_page_lists_give_the_block_tables_output_bit_for_bit(dtype, planner):
    """The same pages named as page lists or as a block table: one plan, one kernel, the same
    output; and it matches float64."""
    from pkv.engines.device_step import DeviceDecodeStep

    shape = ModelShape()
    rng = np.random.default_rng(23)
    k, v = _pool(shape, dtype, 20000, seed=4)
    workspace = DeviceDecodeStep(shape, max_batch=12, num_splits=16, planner=planner)
    for trial in range(6):
        lengths = [int(x) for x in rng.choice(EDGE_LENGTHS, size=int(rng.integers(1, 13)))]
        step, table, lens = _tables(lengths, 20000, 1400, rng)
        q = make_queries(len(lengths), shape, dtype, "cuda", seed=300 + trial)
        by_table = workspace.run(q, k, v, table, lens, torch.full_like(q, float("nan"))).clone()
        lists = _lists(step, trailing=trial % 3 * 50, rng=rng)
        by_lists = workspace.run(q, k, v, lists, lens, torch.full_like(q, float("nan")),
                                 host_lens=step.seq_lens)
        torch.cuda.synchronize()
        _check(by_lists, step, q, k, v, dtype)
        assert torch.equal(by_lists, by_table), trial


@pytest.mark.parametrize("planner", ["plan_kernel", "in_decode"])
def test_graph_over_page_lists_replays_for_fresh_lengths_and_checks_each_row_on_the_device(planner):
    shape, dtype, max_pages = ModelShape(), torch.float16, 4096
    rng = np.random.default_rng(29)
    k, v, workspace, graphed = _graphed_step(shape, dtype, max_pages, planner, seed=6, debug_checks=True)
    edge = EDGE_LENGTHS + [max_pages * PAGE, 24 * 32, 24 * 32 + 1]
    for trial in range(20):
        lengths = [int(x) for x in rng.choice(edge, size=8)]
        step, _, lens = _tables(lengths, 40000, max_pages, rng)
        q = make_queries(8, shape, dtype, "cuda", seed=400 + trial)
        out = graphed.run(q, _lists(step, trailing=trial % 2 * 7, rng=rng), lens).clone()
        torch.cuda.synchronize()
        _check(out, step, q, k, v, dtype)
    assert list(graphed._graphs) == [(8, True)]
    step, _, lens = _tables([100, 4000, 17, 5, 5, 5, 5, 5], 40000, max_pages, rng)
    lists = _lists(step)
    too_long = lens.clone()
    too_long[1] = 4001 + PAGE  # its list holds 250 pages: 4000 tokens
    with pytest.raises(ValueError, match=r"debug check on the device\): row 1 has length 4017; its pages address "
                                         r"0\.\.4000 tokens"):
        graphed.run(q, lists, too_long)
    with pytest.raises(ValueError, match=r"row 1 has length 4017; its page list's 250 pages of 16 tokens"):
        workspace.run(q, k, v, lists, too_long, torch.empty_like(q))


class _RouteByBatch:
    """A stand-in policy: FlashInfer for the batch sizes named, a workqueue of `splits` under
    `split_kind` otherwise."""

    def __init__(self, flashinfer_batches, splits, split_kind="fixed"):
        from pkv.policy.route import ROUTE_WORKQUEUE, StepRoute

        self.flashinfer_batches = set(flashinfer_batches)
        self.workqueue = StepRoute(ROUTE_WORKQUEUE, splits, split_kind)

    def choose(self, step):
        from pkv.policy.choose import RouteDecision
        from pkv.policy.route import FLASHINFER_ROUTE

        route = FLASHINFER_ROUTE if len(step.seq_lens) in self.flashinfer_batches else self.workqueue
        return RouteDecision(route, "test", {})


def test_a_calibrated_policy_replays_the_skew_rule_and_the_fixed_rule_in_one_bucket():
    """The route policy with skew_target_ctas and over_split_balanced: a step one row dominates and
    a step of rows short for the split count replay the balanced rule's graph, the others of the
    same bucket the fixed rule's; every replay with fresh lengths matches float64 and plans the
    tasks the host planner gives the same route."""
    from pkv.engines.device_step import device_step_config
    from pkv.engines.routed_graphs import RoutedGraphStep
    from pkv.policy import Calibration, RegimeParams, RoutePolicy

    pytest.importorskip("flashinfer")
    shape = ModelShape()
    # Every step on the workqueue, skewed and over-split ones on the balanced rule.
    open_regime = RegimeParams("persistentkv_workqueue", 16, 0, 0.1, skew_target_ctas=264, over_split_balanced=True)
    calib = Calibration(gpu="h200", num_sms=132, beta_gbps=4300.0, lambda_us=5.0, c_min=0.25,
                        single_row=RegimeParams("persistentkv_bucket", 16, 0, 0.1), few_rows=open_regime,
                        many_rows=open_regime)
    policy = RoutePolicy(calib, num_kv_heads=shape.num_kv_heads, group_size=shape.group_size,
                         head_dim=shape.head_dim)
    rng = np.random.default_rng(23)
    max_pages = 4200
    k, v = _pool(shape, torch.float16, 30000, seed=11)
    routed = RoutedGraphStep(policy, shape, k, v, max_pages=max_pages, batch_buckets=(8,), debug_checks=True)
    batches = [([60000, 17, 100, 5, 33, 16, 1, 2000], "balanced"), ([20000, 20000, 17, 1, 4097, 65], "fixed"),
               ([4000] * 8, "fixed"), ([33000, 1, 15, 16, 17], "balanced"), ([5000, 5000, 100], "fixed"),
               ([9000, 10, 20], "balanced"),
               # Over-split at S = 16 (mean row under 2 x 32 x 16 tokens), and just above it.
               ([700, 900, 300, 1000, 5, 800, 600, 64], "balanced"), ([1100] * 7 + [900], "fixed")]
    for trial, (lengths, kind) in enumerate(batches * 2):
        step, table, lens = _tables(lengths, 30000, max_pages, rng)
        q = make_queries(len(lengths), shape, torch.float16, "cuda", seed=300 + trial)
        buffers = routed.buffers(len(lengths))
        buffers.q.copy_(q)
        buffers.block_table.copy_(table)
        buffers.seq_lens.copy_(lens)
        buffers.out.fill_(float("nan"))
        out = routed.run(step.seq_lens).clone()
        torch.cuda.synchronize()
        _check(out, step, q, k, v, torch.float16)
        route = routed.last_route
        assert route.split_kind == kind and route.target_ctas == (264 if kind == "balanced" else 0), (trial, route)
        host = plan_workqueue(step, shape.num_kv_heads, shape.group_size, route.split_policy)
        graph_counts = routed._graphed(device_step_config(route)).step.counts.tolist()
        assert graph_counts == [host.num_tasks, host.max_splits], (trial, lengths)


@pytest.mark.parametrize("page_lists", [False, True], ids=["block_table", "page_lists"])
@pytest.mark.parametrize("planner", ["plan_kernel", "in_decode", "balanced"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_routed_graphs_replay_every_route_for_fresh_lengths(dtype, planner, page_lists):
    """"balanced": the workqueue route names the balanced rule with its default budget, and the
    graph (over a bucket with padding rows) plans each batch's tasks as the host plans them."""
    from pkv.engines.device_step import device_step_config
    from pkv.engines.routed_graphs import RoutedGraphStep

    flashinfer = pytest.importorskip("flashinfer")
    del flashinfer
    shape = ModelShape()
    rng = np.random.default_rng(17)
    max_pages = 4200
    k, v = _pool(shape, dtype, 30000, seed=9)
    balanced = planner == "balanced"
    policy = _RouteByBatch({3}, splits=16, split_kind="balanced" if balanced else "fixed")
    routed = RoutedGraphStep(policy, shape, k, v, max_pages=max_pages, batch_buckets=(1, 4, 8), debug_checks=True,
                             planner=None if balanced else planner, page_lists=page_lists)
    # Batch 3 goes to FlashInfer, the others to the device-planned workqueue; 3 and 4 share a
    # bucket, so one bucket replays both routes, with padding rows in between.
    batches = [[65536], [20000, 17, 1, 4097], [1, 16, 4096], [33, 65], [60000, 100, 5, 16, 17, 1000, 3000],
               [7, 7, 7], [1], [4000] * 8, [15, 16, 17, 33]]
    for trial, lengths in enumerate(batches * 2):
        step, table, lens = _tables(lengths, 30000, max_pages, rng)
        q = make_queries(len(lengths), shape, dtype, "cuda", seed=200 + trial)
        buffers = routed.buffers(len(lengths))
        buffers.q.copy_(q)
        if page_lists:  # a serving engine's flat list: the step's lists, then stale entries
            buffers.page_lists.indptr.copy_(torch.from_numpy(step.kv_indptr))
            buffers.page_lists.indices[:step.kv_indices.size].copy_(torch.from_numpy(step.kv_indices))
            host_table = (step.kv_indptr, step.kv_indices)
        else:
            buffers.block_table.copy_(table)
            host_table = table.cpu().numpy()
        buffers.seq_lens.copy_(lens)
        buffers.out.fill_(float("nan"))
        out = routed.run(step.seq_lens, host_table=host_table).clone()
        torch.cuda.synchronize()
        _check(out, step, q, k, v, dtype)
        assert (routed.last_route.name == "flashinfer") == (len(lengths) == 3)
        if balanced and len(lengths) != 3:
            host = plan_workqueue(step, shape.num_kv_heads, shape.group_size, policy.workqueue.split_policy)
            graph_counts = routed._graphed(device_step_config(policy.workqueue)).step.counts.tolist()
            assert graph_counts == [host.num_tasks, host.max_splits], (trial, lengths)
