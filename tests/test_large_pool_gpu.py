"""Every PersistentKV route over KV pools past 2^32 elements, against float64.

One K and one V pool of 350,823 pages of 16 tokens, 8 KV heads and d = 128: 5.75e9 elements a
tensor (11.5 GB in fp16 or bf16, 16,384 elements a page in HND and NHD alike). A page's element
offset passes 2^31 (and 2^32 bytes) from page 131,072 and 2^32 from page 262,144, so a kernel that
forms page_id * page_stride in 32 bits reads another page there, or memory outside the pool.

Only the pages the tables name hold data (peaked K and V); every other element of both pools is
NaN. No two pages named are congruent modulo 131,072 pages (2^31 elements), so an offset wrapped
modulo 2^31 or 2^32 elements lands on a NaN page or outside the pool, never on another page the
step reads, and the output shows it. Every batch reads the pool's last page as a full page (its
last element included, in both layouts), pages either side of the 2^31- and 2^32-element offsets,
pages near 0 and pages drawn across the pool, in shuffled order. The float64 truth is computed from
the referenced pages only: the values written into the pool, held as a small dense tensor.

Skipped without a GPU, or where the GPU has too little free memory for the two pools.
"""

from __future__ import annotations

import gc
from typing import NamedTuple

import numpy as np
import pytest
import torch
from policy_constants import pinned

from pkv.engines.dense import dense_decode
from pkv.measure.kv_data import make_kv_pages, make_queries
from pkv.page_table import PageLists
from pkv.pipeline.schedule import SplitPolicy
from pkv.pipeline.step import build_step
from pkv.shape import ModelShape

pytestmark = pytest.mark.gpu

SHAPE = ModelShape()  # Hq = 32, Hkv = 8, d = 128: G = 4
PAGE = 16
PAGE_ELEMENTS = PAGE * SHAPE.num_kv_heads * SHAPE.head_dim  # 16,384
NUM_PAGES = 350_823
POOL_BYTES = NUM_PAGES * PAGE_ELEMENTS * 2  # one pool, fp16 or bf16
# Beyond the two pools: the values of the pages read in both dtypes (about 1 GB), the float64
# reference's gathers, the workspaces and the CUDA graphs' memory.
WORKING_BYTES = 4 * 2**30
PAGES_PER_2_31 = 2**31 // PAGE_ELEMENTS  # 131,072: the first page at 2^31 elements (2^32 bytes)
PAGES_PER_2_32 = 2**32 // PAGE_ELEMENTS  # 262,144: the first page at 2^32 elements
LAST_PAGE = NUM_PAGES - 1
assert NUM_PAGES * PAGE_ELEMENTS > 2**32 and LAST_PAGE > PAGES_PER_2_32
# Pages every batch names: the pool's last two, either side of the 2^32- and 2^31-element offsets,
# and near 0; pairwise incongruent modulo PAGES_PER_2_31. Page 0, the block table's padding
# entry, is never named: it stays NaN.
ANCHORS = (LAST_PAGE, LAST_PAGE - 1, PAGES_PER_2_32, PAGES_PER_2_32 + 1, PAGES_PER_2_32 - 1,
           PAGES_PER_2_31 + 2, PAGES_PER_2_31 - 2, 3, 5, 64)
SEED = 20_260_623
DEVICE = "cuda"

# Batch name -> lengths: 1 token, a page boundary and either side of it, 32-token tile edges,
# lengths that are not multiples of a tile, long rows. Each batch size but 3 has a second set of
# lengths (and pages), which the CUDA graphs replay after capturing the first.
BATCHES = {
    "b1": [40_003],
    "b1_other": [16_000],
    "b3": [17, 1, 3_000],
    "b4": [1, 4_097, 33, 20_015],
    "b4_other": [16, 2_079, 1, 9_000],
    "b8": [1, 15, 16, 17, 31, 65, 1_000, 20_000],
    "b8_other": [33, 32, 1, 4_096, 17, 12_345, 63, 16],
}
# Per batch size: the lengths a graph is captured at, then other lengths, then the first again.
GRAPH_STEPS = (("b1", "b1_other", "b1"), ("b3", "b3"), ("b4", "b4_other", "b4"), ("b8", "b8_other", "b8"))
MAX_PAGES = max(-(-n // PAGE) for lengths in BATCHES.values() for n in lengths)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
LAYOUTS = ("hnd", "nhd")
FORMS = ("block_table", "page_lists")


def _assign_pages(rng) -> dict:
    """Each batch's page lists (name -> one int32 array a row), over the whole pool."""
    taken = {page % PAGES_PER_2_31 for page in ANCHORS}
    residues = iter(r for r in rng.permutation(PAGES_PER_2_31).tolist() if r not in taken)

    def fresh_page() -> int:
        # A residue no page named so far has, so no two named pages are congruent.
        residue = next(residues)
        candidates = [p for p in (residue, residue + PAGES_PER_2_31, residue + 2 * PAGES_PER_2_31) if 0 < p < NUM_PAGES]
        if candidates[-1] >= PAGES_PER_2_32 and rng.random() < 0.6:  # past 2^32 elements, more often than not
            return candidates[-1]
        return int(rng.choice(candidates))

    lists = {}
    for name, lengths in BATCHES.items():
        counts = [-(-n // PAGE) for n in lengths]
        rows = [[None] * count for count in counts]
        longest = int(np.argmax(lengths))
        assert counts[longest] > 1
        # The longest row's first page is full: every token and KV head of the pool's last page is read.
        rows[longest][0] = LAST_PAGE
        rest = list(ANCHORS[1:])
        # The other rows, shortest first, start on the next anchors: the shortest row (one token
        # in most batches) reads the pool's second-to-last page and nothing else.
        for row in sorted(range(len(lengths)), key=lambda r: lengths[r]):
            if row != longest and rest:
                rows[row][0] = rest.pop(0)
        free = [(r, j) for r, count in enumerate(counts) for j in range(count) if rows[r][j] is None]
        for pick in rng.choice(len(free), size=len(rest), replace=False):
            r, j = free[int(pick)]
            rows[r][j] = rest.pop()
        lists[name] = [np.asarray([p if p is not None else fresh_page() for p in row], dtype=np.int32)
                       for row in rows]
    return lists


class _LargePool:
    """The two pools, filled for one (dtype, layout) at a time, and each batch's float64 truth."""

    def __init__(self):
        rng = np.random.default_rng(SEED)
        page_lists = _assign_pages(rng)
        self.steps = {name: build_step(0, np.arange(len(lengths)), np.asarray(lengths, dtype=np.int32),
                                       page_lists[name], PAGE) for name, lengths in BATCHES.items()}
        self.used = np.unique(np.concatenate([step.kv_indices for step in self.steps.values()])).astype(np.int64)
        assert len(np.unique(self.used % PAGES_PER_2_31)) == len(self.used), "two named pages are congruent"
        assert self.used[0] > 0 and self.used[-1] == LAST_PAGE
        dims = (NUM_PAGES, SHAPE.num_kv_heads, PAGE, SHAPE.head_dim)
        self.k_raw = torch.empty(dims, dtype=torch.float16, device=DEVICE)
        self.v_raw = torch.empty(dims, dtype=torch.float16, device=DEVICE)
        self._filled = None  # (dtype, layout) the pools hold now
        self._values: dict = {}  # dtype -> (k, v) of the named pages, [used, Hkv, P, d], ascending page order
        self._cases: dict = {}  # (dtype, batch name) -> (q, float64 reference)

    def release(self) -> None:
        self.k_raw = self.v_raw = None
        self._values.clear()
        self._cases.clear()

    def values(self, dtype):
        if dtype not in self._values:
            self._values[dtype] = make_kv_pages(int(self.used.size), SHAPE, PAGE, dtype, DEVICE, SEED)
        return self._values[dtype]

    def _views(self, dtype, layout):
        """The pools as [num_pages, Hkv, P, d] tensors of ``dtype``: HND storage, or NHD storage
        ([num_pages, P, Hkv, d], vLLM's layout) viewed through permute(0, 2, 1, 3)."""
        views = []
        for raw in (self.k_raw, self.v_raw):
            store = raw.view(dtype)
            if layout == "nhd":
                store = store.view(NUM_PAGES, PAGE, SHAPE.num_kv_heads, SHAPE.head_dim).permute(0, 2, 1, 3)
            views.append(store)
        return tuple(views)

    def pages(self, dtype, layout):
        """(k_pages, v_pages) holding the named pages' values in ``layout``, NaN everywhere else."""
        if self._filled != (dtype, layout):
            self._filled = None
            index = torch.from_numpy(self.used).to(DEVICE)
            for raw, small in zip((self.k_raw, self.v_raw), self.values(dtype)):
                store = raw.view(dtype)
                store.fill_(float("nan"))
                if layout == "nhd":
                    store = store.view(NUM_PAGES, PAGE, SHAPE.num_kv_heads, SHAPE.head_dim)
                    small = small.permute(0, 2, 1, 3).contiguous()
                store.index_copy_(0, index, small)
            self._verify(dtype, layout, index)
            self._filled = (dtype, layout)
        return self._views(dtype, layout)

    def _verify(self, dtype, layout, index) -> None:
        """The pools hold what the reference reads: every named page its values, and the anchors'
        pages read back by plain indexing (64-bit storage offsets formed on the host); the pages
        an offset wrapped at 2^31 or 2^32 elements would reach from them, and page 0, hold NaN."""
        named = set(self.used.tolist())
        for pool, small in zip(self._views(dtype, layout), self.values(dtype)):
            assert torch.equal(pool.index_select(0, index), small), "setup: the named pages do not hold their values"
            for page in ANCHORS:
                slot = int(np.searchsorted(self.used, page))
                assert torch.equal(pool[page], small[slot]), f"setup: page {page} does not hold its values"
                for shift in (-2 * PAGES_PER_2_31, -PAGES_PER_2_31, PAGES_PER_2_31, 2 * PAGES_PER_2_31):
                    other = page + shift
                    if 0 <= other < NUM_PAGES:
                        assert other not in named
                        assert bool(torch.isnan(pool[other]).all()), f"setup: page {other} is not NaN"
            assert bool(torch.isnan(pool[0]).all()), "setup: page 0 is not NaN"

    def case(self, dtype, name):
        """(step, q, float64 output) of a batch: the truth over the named pages' values alone."""
        step = self.steps[name]
        if (dtype, name) not in self._cases:
            q = make_queries(step.batch_size, SHAPE, dtype, DEVICE, SEED + 1 + list(BATCHES).index(name))
            # Each named page's slot in the values; the block table's padding entries are never read.
            slots = np.searchsorted(self.used, step.block_table)
            for row, n in enumerate(np.diff(step.kv_indptr)):
                assert np.array_equal(self.used[slots[row, :n]], step.block_table[row, :n])
            k_small, v_small = self.values(dtype)
            self._cases[(dtype, name)] = (q, dense_decode(q.double(), k_small, v_small, step.seq_lens, slots))
        return (step, *self._cases[(dtype, name)])


@pytest.fixture(scope="module")
def pool():
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    need = 2 * POOL_BYTES + WORKING_BYTES
    if free < need:
        pytest.skip(f"two KV pools past 2^32 elements need {need / 2**30:.1f} GiB of free GPU memory "
                    f"({POOL_BYTES / 2**30:.1f} GiB each, plus working memory); {free / 2**30:.1f} GiB is free")
    large = _LargePool()
    try:
        yield large
    finally:
        large.release()
        del large
        gc.collect()
        torch.cuda.empty_cache()


def _check(out, ref, dtype, what: str) -> None:
    """The tolerances of the other GPU tests against float64."""
    assert not torch.isnan(out).any(), (f"{what}: NaN in the output: a page no table names was read, "
                                        f"or an output element was never written")
    err = (out.double() - ref).abs()
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    if dtype == torch.float16:
        assert err.max().item() < 2e-3 and err.mean().item() < 3e-4 and rel < 2e-3, (what, err.max().item(), rel)
    else:
        assert rel < 1e-2 and err.max().item() < 2e-2, (what, err.max().item(), rel)


def _needs_clusters() -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the cluster merge needs thread-block clusters (sm_90)")


def _int32(array) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32))


def _page_table(step, form: str):
    if form == "page_lists":
        return PageLists.from_step(step, DEVICE)
    return _int32(step.block_table).to(DEVICE)


def _cases(routes: dict, dtypes_layouts, forms=FORMS, skip=lambda form, route: False) -> list:
    """pytest params, grouped by (dtype, layout) so the pools are refilled once per group."""
    return [pytest.param(dtype, layout, form, route, id=f"{dtype}-{layout}-{form}-{name}")
            for dtype, layout in dtypes_layouts for form in forms for name, route in routes.items()
            if not skip(form, route)]


EVERY_DTYPE_AND_LAYOUT = [(dtype, layout) for dtype in DTYPES for layout in LAYOUTS]
FP16_BOTH_LAYOUTS_BF16_HND = [("fp16", "hnd"), ("fp16", "nhd"), ("bf16", "hnd")]


# ---- host-planned routes: run_plan (the C++ step executor) and the per-op launches ------------

class HostRoute(NamedTuple):
    schedule: str  # "bucket_exact", "bucket_masked" or "workqueue"
    splits: int
    merge: str  # pkv.policy.route's MERGE_*
    stages: int
    split_kind: str = "fixed"
    target_ctas: int = 0


HOST_ROUTES = {
    "bucket_exact_s1": HostRoute("bucket_exact", 1, "launch", 2),
    "bucket_exact_launch": HostRoute("bucket_exact", 16, "launch", 3),
    "bucket_exact_fused": HostRoute("bucket_exact", 16, "fused", 4),
    "bucket_exact_cluster": HostRoute("bucket_exact", 16, "cluster", 2),
    "bucket_masked_launch": HostRoute("bucket_masked", 16, "launch", 2),
    "bucket_masked_fused": HostRoute("bucket_masked", 16, "fused", 3),
    "bucket_masked_cluster": HostRoute("bucket_masked", 12, "cluster", 4),
    "workqueue_fixed_launch": HostRoute("workqueue", 20, "launch", 2),
    "workqueue_fixed_fused": HostRoute("workqueue", 20, "fused", 3),
    "workqueue_balanced_launch": HostRoute("workqueue", 20, "launch", 4, "balanced"),
    "workqueue_balanced_fused": HostRoute("workqueue", 20, "fused", 2, "balanced", 396),
}


def _host_plan(engine, step, route: HostRoute, page_lists: bool):
    """The C++ planner's packed plan of the route, over the block table or the page lists (the
    engine's own plan() picks the form by page_lists_pay; here each route runs both)."""
    from pkv.engines.persistentkv import DevicePlan
    from pkv.policy.route import ROUTE_BUCKET, ROUTE_WORKQUEUE

    lens = _int32(step.seq_lens)
    table, indptr = (_int32(step.kv_indices), _int32(step.kv_indptr)) if page_lists else (_int32(step.block_table),
                                                                                         None)
    hkv = SHAPE.num_kv_heads
    if route.schedule == "workqueue":
        policy = SplitPolicy(route.split_kind, route.splits, max(64, route.splits), route.target_ctas)
        host_meta, layout = engine.ops.plan_workqueue(lens, table, hkv, policy.kind == "balanced", policy.num_splits,
                                                      policy.max_splits, policy.target_ctas,
                                                      policy.min_tiles_per_split, indptr)
        name, mode = ROUTE_WORKQUEUE, "exact"
    else:
        host_meta, layout = engine.ops.plan_buckets(lens, table, hkv, route.splits,
                                                    route.schedule == "bucket_exact", indptr)
        name, mode = ROUTE_BUCKET, route.schedule.removeprefix("bucket_")
    plan = DevicePlan(route=name, step=step, num_splits=route.splits, meta=host_meta.to(DEVICE), layout=list(layout),
                      host_meta=host_meta, num_kv_heads=hkv, group_size=SHAPE.group_size, bucket_mode=mode,
                      merge=route.merge)
    assert plan.page_lists == page_lists
    return plan


@pytest.mark.parametrize(
    "dtype, layout, form, route",
    # The engine runs the cluster merge over block tables only (PersistentKVEngine.plan_route).
    _cases(HOST_ROUTES, EVERY_DTYPE_AND_LAYOUT, skip=lambda form, route: route.merge == "cluster"
           and form == "page_lists"))
def test_host_planned_routes_read_pools_past_2_32_elements(pool, dtype, layout, form, route):
    from pkv.engines.persistentkv import PersistentKVEngine

    if route.merge == "cluster":
        _needs_clusters()
    torch_dtype = DTYPES[dtype]
    k, v = pool.pages(torch_dtype, layout)
    engine = PersistentKVEngine(SHAPE, stages=route.stages)
    nan = float("nan")
    for name in BATCHES:
        step, q, ref = pool.case(torch_dtype, name)
        plan = _host_plan(engine, step, route, form == "page_lists")
        out = engine.run(q, k, v, plan)  # run_plan: every launch issued from C++
        per_op = torch.full_like(q, nan)
        engine.run_into(q, k, v, plan, per_op, *engine.scratch(plan, q.device, fill=nan))
        torch.cuda.synchronize()
        _check(out, ref, torch_dtype, f"{name} run_plan")
        assert torch.equal(per_op, out), f"{name}: the per-op launches differ from run_plan"
        assert int(engine._counters.abs().sum()) == 0, "fused-merge counters must reset to zero"


@pytest.mark.parametrize("route", ["workqueue_fixed_fused", "bucket_exact_cluster"])
def test_host_planned_graphs_replay_over_pools_past_2_32_elements(pool, route):
    """The engine's CUDA-graph ablation: a graph per plan layout, replayed over the large pools."""
    from pkv.engines.persistentkv import PersistentKVEngine

    spec = HOST_ROUTES[route]
    if spec.merge == "cluster":
        _needs_clusters()
    k, v = pool.pages(torch.float16, "hnd")
    policy = pinned(spec.schedule, SplitPolicy(num_splits=spec.splits), spec.splits,
                    fused_merge=spec.merge == "fused", cluster_merge=spec.merge == "cluster")
    eager = PersistentKVEngine(SHAPE, policy=policy, stages=spec.stages)
    graphed = PersistentKVEngine(SHAPE, policy=policy, stages=spec.stages, cuda_graph=True)
    for name in ("b8", "b1", "b4", "b8"):
        step, q, ref = pool.case(torch.float16, name)
        expected = eager.run(q, k, v, eager.plan(step))
        got = graphed.run(q, k, v, graphed.plan(step)).clone()
        torch.cuda.synchronize()
        _check(got, ref, torch.float16, f"{name} graph replay")
        assert torch.equal(got, expected), name


# ---- the device-planned step: eager, and CUDA graphs replayed for other lengths ---------------

class DeviceConfig(NamedTuple):
    planner: str
    merge: str
    stages: int
    split_kind: str = "fixed"
    target_ctas: int = 0


DEVICE_CONFIGS = {
    "plan_kernel_fixed_launch": DeviceConfig("plan_kernel", "launch", 2),
    "plan_kernel_fixed_fused": DeviceConfig("plan_kernel", "fused", 3),
    "plan_kernel_balanced_launch": DeviceConfig("plan_kernel", "launch", 4, "balanced"),
    "plan_kernel_balanced_fused": DeviceConfig("plan_kernel", "fused", 2, "balanced", 264),
    "in_decode_launch": DeviceConfig("in_decode", "launch", 3),
    "in_decode_fused": DeviceConfig("in_decode", "fused", 4),
}


@pytest.mark.parametrize("dtype, layout, form, config", _cases(DEVICE_CONFIGS, FP16_BOTH_LAYOUTS_BF16_HND))
def test_device_planned_step_reads_pools_past_2_32_elements(pool, dtype, layout, form, config):
    from pkv.engines.device_step import DeviceDecodeStep, GraphedDecodeStep

    torch_dtype = DTYPES[dtype]
    k, v = pool.pages(torch_dtype, layout)
    workspace = DeviceDecodeStep(SHAPE, max_batch=8, num_splits=16, device=DEVICE, stages=config.stages,
                                 planner=config.planner, merge=config.merge, split_kind=config.split_kind,
                                 target_ctas=config.target_ctas)
    graphed = GraphedDecodeStep(workspace, k, v, MAX_PAGES, debug_checks=True)
    for names in GRAPH_STEPS:
        for name in names:
            step, q, ref = pool.case(torch_dtype, name)
            table = _page_table(step, form)
            lens = _int32(step.seq_lens).to(DEVICE)
            workspace.part_acc.fill_(float("nan"))
            eager = workspace.run(q, k, v, table, lens, torch.full_like(q, float("nan")), host_lens=step.seq_lens)
            torch.cuda.synchronize()
            _check(eager, ref, torch_dtype, f"{name} eager")
            assert int(workspace.pair_counters.abs().sum()) == 0, "the fused merge's counters must be zero again"
            # The first step of a batch size captures its graph; the others replay it for their lengths.
            replayed = graphed.run(q, table, lens).clone()
            torch.cuda.synchronize()
            _check(replayed, ref, torch_dtype, f"{name} graph replay")
            assert torch.equal(replayed, eager), f"{name}: the replay differs from the eager step"
    assert len(graphed.captured_graphs()) == len(GRAPH_STEPS)


# ---- routed CUDA graphs (the serving form), every PersistentKV route ---------------------------

ROUTED_ROUTES = {
    "workqueue_fixed_launch": pinned("workqueue", SplitPolicy(num_splits=16)),
    "workqueue_balanced_fused": pinned("workqueue", SplitPolicy("balanced", 16, 64), fused_merge=True),
    # A bucket route's device step is the in-decode grid; its cluster merge runs as a merge launch.
    "bucket_exact_cluster": pinned("bucket_exact", bucket_num_splits=16, cluster_merge=True),
    "bucket_masked_fused": pinned("bucket_masked", bucket_num_splits=16, fused_merge=True),
}


@pytest.mark.parametrize("dtype, layout, form, policy", _cases(ROUTED_ROUTES, FP16_BOTH_LAYOUTS_BF16_HND))
def test_routed_graphs_read_pools_past_2_32_elements(pool, dtype, layout, form, policy):
    """Buckets of 1, 4 and 8 rows: the 3-row batch replays the 4-row bucket with a padding row."""
    from pkv.engines.routed_graphs import RoutedGraphStep

    torch_dtype = DTYPES[dtype]
    k, v = pool.pages(torch_dtype, layout)
    lists = form == "page_lists"
    routed = RoutedGraphStep(policy, SHAPE, k, v, max_pages=MAX_PAGES, batch_buckets=(1, 4, 8), debug_checks=True,
                             page_lists=lists)
    for names in GRAPH_STEPS:
        for name in names:
            step, q, ref = pool.case(torch_dtype, name)
            buffers = routed.buffers(step.batch_size)
            buffers.q.copy_(q)
            if lists:
                buffers.page_lists.indptr.copy_(_int32(step.kv_indptr))
                buffers.page_lists.indices[:step.kv_indices.size].copy_(_int32(step.kv_indices))
                host_table = (step.kv_indptr, step.kv_indices)
            else:
                host_table = np.zeros((step.batch_size, MAX_PAGES), dtype=np.int32)
                host_table[:, :step.block_table.shape[1]] = step.block_table
                buffers.block_table.copy_(_int32(host_table))
            buffers.seq_lens.copy_(_int32(step.seq_lens))
            buffers.out.fill_(float("nan"))
            out = routed.run(step.seq_lens, host_table=host_table).clone()
            torch.cuda.synchronize()
            _check(out, ref, torch_dtype, f"{name} routed replay")
            assert routed.last_route == policy.route


def test_the_tables_reach_past_2_32_elements_and_the_pools_last_page(pool):
    k, v = pool.pages(torch.float16, "hnd")
    assert k.numel() > 2**32 and v.numel() > 2**32
    for name, step in pool.steps.items():
        pages = step.kv_indices.astype(np.int64)
        assert LAST_PAGE in pages, name
        assert (pages * PAGE_ELEMENTS >= 2**32).sum() >= 3, name
        assert ((pages * PAGE_ELEMENTS >= 2**31) & (pages * PAGE_ELEMENTS < 2**32)).any(), name
        assert (pages < 100).any(), name
