"""The PersistentKV CUDA engine: executes a policy's routes with the torch.ops.pkv kernels.

Same constructor and methods as pkv.engines.reference.ReferenceEngine, which computes the same
plans in torch; the GPU tests compare the two on every route. The engine plans and runs the
StepRoute it is handed; the route, split count and merge kind are the policy's (pkv.policy).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from pkv import ops
from pkv.cuda_graphs import capture_graph
from pkv.engines.base import Engine, check_decode_inputs
from pkv.pipeline.schedule import BucketLaunch, BucketPlan, SplitPolicy, WorkqueuePlan, plan_buckets, plan_workqueue
from pkv.policy.choose import PinnedRoutePolicy, describe_policy, pinned_route
from pkv.policy.route import MERGE_CLUSTER, MERGE_FUSED, MERGE_LAUNCH, ROUTE_BUCKET, ROUTE_WORKQUEUE, StepRoute
# native: the C++ planner of the extension (csrc/step_plan.cpp); numpy: pkv.pipeline.schedule, the
# specification it is tested against (and the path to compare host time with).
PLANNERS = ("native", "numpy")
RING_STAGES = (2, 3, 4)  # cp.async ring depths the decode kernels are built for (csrc/launch_impl.cuh)
# Shared memory of one ring stage a CTA (csrc/split_decode.cuh, decode_smem_bytes): 4 warps, each
# a 16-token chunk of K and of V, d = 128 elements of 2 bytes.
RING_STAGE_SMEM_BYTES = 4 * 16 * 2 * 128 * 2


def ring_stages_for(device) -> tuple[int, ...]:
    """The ring depths whose shared memory one CTA of this GPU may opt into: all three on an A100
    or an H100/H200, 2 and 3 on GPUs that give a CTA 99 KB (the RTX 3060 of the paper, RTX 40xx,
    L4, L40S)."""
    props = torch.cuda.get_device_properties(device)
    # A CTA may opt into the SM's shared memory less the 1 KB the driver keeps (Ampere and later).
    limit = getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_multiprocessor", 0)
    if not limit:  # a torch that reports neither: every depth, and the launch names any that fails
        return RING_STAGES
    if not getattr(props, "shared_memory_per_block_optin", 0):
        limit -= 1024
    return tuple(s for s in RING_STAGES if s * RING_STAGE_SMEM_BYTES <= limit)


def check_ring_stages(stages, device, where: str) -> None:
    """Refuse a ring depth the kernels lack, or one whose shared memory this GPU cannot give a CTA."""
    if stages not in RING_STAGES:
        raise ValueError(f"{where}: stages must be one of {RING_STAGES}, got {stages!r}")
    device = torch.device(device)
    if device.type == "cuda" and stages not in ring_stages_for(device):
        raise ValueError(f"{where}: stages={stages} needs {stages * RING_STAGE_SMEM_BYTES // 1024} KB of shared "
                         f"memory a CTA; this GPU allows ring depths {ring_stages_for(device)}")


MAX_MERGE_SPLITS = 1024  # kMaxMergeSlots in csrc/decode_constants.h
# The route's merge kind as run_plan's merge_kind code (csrc/step_plan.h).
_MERGE_CODES = {MERGE_LAUNCH: ops.MERGE_LAUNCH, MERGE_FUSED: ops.MERGE_FUSED, MERGE_CLUSTER: ops.MERGE_CLUSTER}


def _int32(array) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.int32)


def page_lists_pay(step) -> bool:
    """Whether a host-planned step uploads its page table as page lists (each row's own pages and
    an indptr) instead of the block table (every row padded to the longest): where the lists hold
    at most half the table's entries. One long row among short ones pads the table most (1 x 128K
    + 63 x 100 tokens: 524,288 ints against 8,698); the page-list lookup costs the decode one
    more dependent read a CTA, 0.1-0.4% of device time on the H200 (docs/performance.md, "Page
    lists, and a step with no plan launch")."""
    return 2 * (len(step.kv_indices) + step.batch_size + 1) <= step.block_table.size


def _step_tensors(step, page_lists: bool) -> tuple:
    """The C++ planner's inputs: the step's seq_lens and its page table as int32 host tensors, the
    block table, or the page lists and their indptr (the planner's page_indptr argument)."""
    lens = torch.from_numpy(_int32(step.seq_lens))
    if page_lists:
        return lens, torch.from_numpy(_int32(step.kv_indices)), torch.from_numpy(_int32(step.kv_indptr))
    return lens, torch.from_numpy(_int32(step.block_table)), None


def _page_table_arrays(step, page_lists: bool) -> list:
    """The page table's arrays in packed order (csrc/step_plan.h): [indptr, lists] or [table]."""
    return [step.kv_indptr, step.kv_indices] if page_lists else [step.block_table]


def _layout_head(route: str, step, page_lists: bool, num_slots: int) -> list:
    """[route, batch, table_width, num_slots, page_entries] (csrc/step_plan.h)."""
    width, entries = (0, len(step.kv_indices)) if page_lists else (step.block_table.shape[1], 0)
    return [_ROUTE_CODES[route], step.batch_size, width, num_slots, entries]


def _pack(arrays: list) -> torch.Tensor:
    """The int32 arrays of a plan, concatenated in one host tensor (one upload)."""
    return torch.from_numpy(np.concatenate([_int32(a).reshape(-1) for a in arrays]))


# Packed plan layout (csrc/step_plan.h): route code, then fields of the int list.
_ROUTE_CODES = {ROUTE_WORKQUEUE: 0, ROUTE_BUCKET: 1}
_ROUTE_FIELDS = 5  # [route, batch, table_width, num_slots, page_entries] come first


@dataclasses.dataclass
class DevicePlan:
    """A step's plan, packed into one int32 buffer and uploaded in one copy.

    ``meta`` (device) holds the page table, [block_table B*W] or [page_indptr B+1][page lists N]
    (``page_lists_pay``), then [seq_lens B], then the route's data: the workqueue's tasks [T, 5]
    and split_offsets [B*Hkv + 1], or the bucket launches' row indices [B].
    ``layout`` is the int list of csrc/step_plan.h that ``torch.ops.pkv.run_plan`` reads.
    Views of ``meta`` and the numpy schedule (for counters and the reference engine) are built
    on first use, off the per-step path.

    Bucket slots follow pkv.engines.reference: launch j owns R_j * Hkv * S_j slots after launch
    j-1's, so partial states compare slot by slot (single-split launches write `out` instead).
    """

    route: str
    step: object
    num_splits: int
    meta: torch.Tensor
    layout: list
    host_meta: torch.Tensor
    num_kv_heads: int
    group_size: int
    bucket_mode: str = "exact"
    merge: str = MERGE_LAUNCH
    split_rule: str | None = None  # StepRoute.split_rule of the route planned
    _schedule: object = None

    @property
    def batch_size(self) -> int:
        return int(self.layout[1])

    @property
    def num_slots(self) -> int:
        return int(self.layout[3])

    @property
    def widest_split(self) -> int:
        """Most splits of any (row, KV head): above 1 the step needs a merge."""
        if self.route == ROUTE_WORKQUEUE:
            return int(self.layout[_ROUTE_FIELDS + 1])
        return max(self.launch_shapes()[1], default=1)

    def launch_shapes(self) -> tuple[list[int], list[int]]:
        """Bucket launches' (row counts, split counts)."""
        pairs = self.layout[_ROUTE_FIELDS + 1:]
        return list(pairs[0::2]), list(pairs[1::2])

    @property
    def page_lists(self) -> bool:
        """Whether the page table is page lists (table width 0) rather than a block table."""
        return int(self.layout[2]) == 0

    def _parts(self, meta: torch.Tensor) -> list:
        """[page table..., seq_lens, route data...]: the page table is one part (the block table)
        or two (page_indptr, then the page lists)."""
        batch = self.batch_size
        table = [batch + 1, int(self.layout[4])] if self.page_lists else [batch * int(self.layout[2])]
        if self.route == ROUTE_WORKQUEUE:
            route = [5 * int(self.layout[_ROUTE_FIELDS]), batch * self.num_kv_heads + 1]
        else:
            route = list(self.launch_shapes()[0])
        return list(torch.split(meta, [*table, batch, *route]))

    @functools.cached_property
    def views(self) -> list:
        return self._parts(self.meta)

    @property
    def _route_start(self) -> int:
        """Index of the route's first part in views: after the page table's parts and seq_lens."""
        return 3 if self.page_lists else 2

    @property
    def block_table(self) -> torch.Tensor:
        """The block table [B, W], or with page lists the concatenated lists [N] (the kernels'
        page-table argument either way)."""
        if self.page_lists:
            return self.views[1]
        return self.views[0].view(self.batch_size, int(self.layout[2]))

    @property
    def page_indptr(self) -> torch.Tensor | None:
        """The page lists' indptr [B + 1], or None for a block table."""
        return self.views[0] if self.page_lists else None

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.views[self._route_start - 1]

    @property
    def tasks(self) -> torch.Tensor | None:
        return self.views[self._route_start].view(-1, 5) if self.route == ROUTE_WORKQUEUE else None

    @property
    def split_offsets(self) -> torch.Tensor | None:
        return self.views[self._route_start + 1] if self.route == ROUTE_WORKQUEUE else None

    @property
    def bucket_rows(self) -> list:
        return self.views[self._route_start:] if self.route == ROUTE_BUCKET else []

    @property
    def schedule(self):
        """The numpy plan (WorkqueuePlan or BucketPlan) this packed plan holds."""
        if self._schedule is None:
            host = [part.numpy() for part in self._parts(self.host_meta)]
            start = self._route_start
            if self.route == ROUTE_WORKQUEUE:
                self._schedule = WorkqueuePlan(host[start].reshape(-1, 5), host[start + 1], self.num_kv_heads,
                                               self.group_size, self.widest_split)
            else:
                lens = host[start - 1]
                launches = tuple(BucketLaunch(rows, splits, int(lens[rows].max()))
                                 for rows, splits in zip(host[start:], self.launch_shapes()[1]))
                self._schedule = BucketPlan(launches, self.num_kv_heads, self.group_size, self.bucket_mode)
        return self._schedule


class PersistentKVEngine(Engine):
    name = "persistentkv"
    held_to_paper_bound = True

    def __init__(self, shape, *, policy=None, device: str = "cuda", cuda_graph: bool = False, stages: int = 2,
                 planner: str = "native"):
        if planner not in PLANNERS:
            raise ValueError(f"persistentkv planner must be one of {PLANNERS}, got {planner!r}")
        check_ring_stages(stages, device, "persistentkv")
        self.device = torch.device(device)
        # On the CPU the engine plans (tests read its packed plans back) but cannot run.
        self.ops = ops.load() if self.device.type == "cuda" else ops.load_planner()
        # Plans bound for a GPU are packed into pinned memory (an async upload); a CPU-only torch has none.
        self._pinned_plans = self.device.type == "cuda"
        self._upload_to = self.device if self.device.type == "cuda" else None  # plan_chosen's upload
        self.shape = shape
        self.policy = policy if policy is not None else PinnedRoutePolicy(pinned_route("workqueue", None))
        self.cuda_graph = bool(cuda_graph)
        self.stages = int(stages)
        self.planner = planner
        self.implementation = f"cuda:{describe_policy(self.policy)}" + ("+cuda_graph" if cuda_graph else "")
        self._counters = torch.zeros(0, dtype=torch.int32, device=self.device)
        self._graphs: dict[tuple, _GraphedStep] = {}
        self._checked: set = set()
        self._warmed: set = set()

    # ---- planning (host) -------------------------------------------------------------------
    def plan(self, step) -> DevicePlan:
        return self.plan_route(step, self.policy.choose(step).route)

    def plan_route(self, step, route: StepRoute) -> DevicePlan:
        """Plan the step on a PersistentKV route the policy chose."""
        lists = self._page_lists(step, route.merge)
        if route.name == ROUTE_WORKQUEUE:
            host_meta, layout, schedule = self._pack_workqueue(step, route.split_policy, lists)
        elif route.name == ROUTE_BUCKET:
            host_meta, layout, schedule = self._pack_buckets(step, route.num_splits, route.bucket_mode, lists)
        else:
            raise ValueError(f"persistentkv cannot run route {route.name!r}")
        # The native planner packs into pinned memory on a GPU: the upload is a true async copy,
        # and torch's host allocator keeps the block until it has run. A pageable source (the
        # numpy planner's) is staged by cudaMemcpyAsync before it returns. Neither waits for the
        # GPU nor races the release of the host buffer.
        return self._device_plan(step, route, host_meta, host_meta.to(self.device, non_blocking=True), layout,
                                 schedule)

    def plan_chosen(self, step, native) -> tuple:
        """Decide and plan in one C++ call (csrc/host_ops.cpp, adaptive_plan): (the StepRoute the
        native route policy (pkv.policy.native.NativeRoutePolicy) chose, its choice ints and
        estimates, the DevicePlan of that route, uploaded, or None where it leaves the step to
        FlashInfer). The same plan as plan_route(step, route) (tests hold the two together)."""
        lens, pages, indptr = _step_tensors(step, self._page_lists(step, native.policy.variants.merge))
        choice, estimates, host_meta, meta, layout = self.ops.adaptive_plan(
            lens, pages, indptr, native.values, self._pinned_plans, self._upload_to)
        route = native.route(choice)
        if meta is None:
            return route, choice, estimates, None
        return route, choice, estimates, self._device_plan(step, route, host_meta, meta, layout, None)

    def step_chosen(self, step, native, q, k_pages, v_pages) -> tuple:
        """plan_chosen and run in one op call (csrc/pkv_ops.cpp, adaptive_step): decide, plan,
        upload and launch. (choice ints, estimates, the packed plan, its output): the packed plan
        (host_meta, meta, layout) is what device_plan_of makes a DevicePlan of, off this path; no
        plan and no output where the step is FlashInfer's. Eager only: a CUDA graph replays
        launches captured from separate ops."""
        if self.cuda_graph:
            raise ValueError("persistentkv: step_chosen issues an eager step; this engine replays CUDA graphs")
        self._check(q, k_pages, v_pages, step)
        merge = native.policy.variants.merge
        lens, pages, indptr = _step_tensors(step, self._page_lists(step, merge))
        counters = self._pair_counters(step.batch_size * self.shape.num_kv_heads) if merge == MERGE_FUSED else None
        choice, estimates, host_meta, meta, layout, out = self.ops.adaptive_step(
            q, k_pages, v_pages, lens, pages, indptr, native.values, self.shape.sm_scale, self.stages,
            _MERGE_CODES[merge], counters)
        if meta is None:
            return choice, estimates, None, None
        return choice, estimates, (host_meta, meta, layout), out

    def device_plan_of(self, step, route: StepRoute, packed: tuple) -> DevicePlan:
        """The DevicePlan of a plan step_chosen packed and uploaded for ``route``."""
        host_meta, meta, layout = packed
        return self._device_plan(step, route, host_meta, meta, layout, None)

    def _page_lists(self, step, merge: str) -> bool:
        """Whether the step's plan carries page lists (page_lists_pay). A graph replays one layout,
        so the graphed engine keeps block tables; so does the cluster merge, whose kernel has been
        tested over block tables only."""
        return not self.cuda_graph and merge != MERGE_CLUSTER and page_lists_pay(step)

    def _device_plan(self, step, route: StepRoute, host_meta, meta, layout: list, schedule) -> DevicePlan:
        """The DevicePlan of a packed plan of ``route``. Its num_splits is the route's split count,
        or under the balanced rule the widest row's."""
        balanced = route.name == ROUTE_WORKQUEUE and route.split_kind != "fixed"
        splits = int(layout[_ROUTE_FIELDS + 1]) if balanced else route.num_splits
        plan = DevicePlan(route=route.name, step=step, num_splits=splits, meta=meta, layout=layout,
                          host_meta=host_meta, num_kv_heads=self.shape.num_kv_heads,
                          group_size=self.shape.group_size, bucket_mode=route.bucket_mode, merge=route.merge,
                          split_rule=route.split_rule, _schedule=schedule)
        if plan.widest_split > MAX_MERGE_SPLITS:
            raise ValueError(f"persistentkv merges at most {MAX_MERGE_SPLITS} splits per (row, KV head), "
                             f"the plan has {plan.widest_split}")
        return plan

    def _pack_workqueue(self, step, policy: SplitPolicy, lists: bool):
        hkv = self.shape.num_kv_heads
        if self.planner == "native":
            lens, pages, indptr = _step_tensors(step, lists)
            meta, layout = self.ops.plan_workqueue(lens, pages, hkv, policy.kind == "balanced", policy.num_splits,
                                                   policy.max_splits, policy.target_ctas, policy.min_tiles_per_split,
                                                   indptr, self._pinned_plans)
            return meta, list(layout), None
        host = plan_workqueue(step, hkv, self.shape.group_size, policy)
        layout = _layout_head(ROUTE_WORKQUEUE, step, lists, host.num_slots) + [host.num_tasks, host.max_splits]
        return _pack([*_page_table_arrays(step, lists), step.seq_lens, host.tasks, host.split_offsets]), layout, host

    def _pack_buckets(self, step, num_splits: int, mode: str, lists: bool):
        hkv = self.shape.num_kv_heads
        if self.planner == "native":
            lens, pages, indptr = _step_tensors(step, lists)
            meta, layout = self.ops.plan_buckets(lens, pages, hkv, num_splits, mode == "exact", indptr,
                                                 self._pinned_plans)
            return meta, list(layout), None
        host = plan_buckets(step, hkv, self.shape.group_size, num_splits, mode=mode)
        layout = _layout_head(ROUTE_BUCKET, step, lists, sum(launch.num_slots(hkv) for launch in host.launches))
        layout.append(len(host.launches))
        for launch in host.launches:
            layout += [launch.num_rows, int(launch.num_splits)]
        rows = [launch.row_indices for launch in host.launches]
        return _pack([*_page_table_arrays(step, lists), step.seq_lens, *rows]), layout, host

    # ---- execution (device) ----------------------------------------------------------------
    def _check(self, q, k_pages, v_pages, step) -> None:
        """Refuse bad inputs here, with the field named, before any kernel sees them. A serving
        loop passes the same tensors step after step, so an accepted signature is remembered."""
        key = (q.shape, q.dtype, q.device, k_pages.shape, k_pages.dtype, k_pages.device, v_pages.shape,
               v_pages.dtype, v_pages.device, step.page_size, step.batch_size)
        if key in self._checked:
            return
        check_decode_inputs(q, k_pages, v_pages, self.shape, step.page_size)
        for label, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
            if t.dtype not in (torch.float16, torch.bfloat16):
                raise ValueError(f"persistentkv: {label} must be float16 or bfloat16, got {t.dtype}")
            if t.device.type != "cuda":
                raise ValueError(f"persistentkv: {label} must be on a CUDA device, got {t.device}")
        if q.dtype != k_pages.dtype:
            raise ValueError(f"persistentkv: q is {q.dtype} but the pages are {k_pages.dtype}")
        if q.shape[0] != step.batch_size:
            raise ValueError(f"persistentkv: q has {q.shape[0]} rows, the plan's step has {step.batch_size}")
        self._checked.add(key)

    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: DevicePlan) -> torch.Tensor:
        self._check(q, k_pages, v_pages, plan.step)
        if self.cuda_graph:
            return self._run_graphed(q, k_pages, v_pages, plan)
        # A plan without a split to merge runs the plain launch, with no counters to hand over.
        merge = plan.merge if plan.widest_split > 1 else MERGE_LAUNCH
        counters = self._pair_counters(plan.batch_size * self.shape.num_kv_heads) if merge == MERGE_FUSED else None
        return self.ops.run_plan(q, k_pages, v_pages, plan.meta, plan.layout, self.shape.sm_scale, self.stages,
                                 _MERGE_CODES[merge], counters)

    def prepare(self, step, q, k_pages, v_pages) -> None:
        self.warm_up(self.plan(step), q, k_pages, v_pages)

    def warm_up(self, plan: DevicePlan, q, k_pages, v_pages) -> None:
        """Runs a plan once, untimed, the first time its kernels are needed. A kernel's first
        launch in a process pays milliseconds of one-off work (lazy module loading, the shared-
        memory opt-in; a CUDA graph's capture): in a timed step that cost lands on whichever
        step first takes the route, and a few milliseconds swamp a 20-100 us step."""
        # Stages and G are fixed per engine; a graph is captured per layout.
        key = (plan.route, plan.merge, plan.widest_split > 1, q.dtype, self.cuda_graph and tuple(plan.layout))
        if key in self._warmed:
            return
        self.run(q, k_pages, v_pages, plan)
        torch.cuda.synchronize(q.device)
        self._warmed.add(key)

    def run_into(self, q, k_pages, v_pages, plan: DevicePlan, out, part_m, part_l, part_acc) -> None:
        """run() with caller-owned output and scratch (tests poison them first)."""
        self._check(q, k_pages, v_pages, plan.step)
        self._launch(q, k_pages, v_pages, plan, out, part_m, part_l, part_acc)

    def scratch(self, plan: DevicePlan, device, fill: float | None = None):
        """(part_m, part_l, part_acc) buffers for the plan's slots, optionally filled."""
        g, d = self.shape.group_size, self.shape.head_dim
        slots = plan.num_slots
        bufs = (torch.empty(slots, g, dtype=torch.float32, device=device),
                torch.empty(slots, g, dtype=torch.float32, device=device),
                torch.empty(slots, g, d, dtype=torch.float32, device=device))
        if fill is not None:
            for b in bufs:
                b.fill_(fill)
        return bufs

    def _pair_counters(self, pairs: int) -> torch.Tensor:
        if self._counters.numel() < pairs:  # zero at rest: the kernel resets what it counts
            self._counters = torch.zeros(pairs, dtype=torch.int32, device=self.device)
        return self._counters

    def _launch(self, q, k_pages, v_pages, plan: DevicePlan, out, part_m, part_l, part_acc) -> None:
        """The step's launches one custom op at a time, into caller-owned buffers (run_into and
        CUDA graph capture; run() issues the same launches from C++ through run_plan)."""
        ops, scale = self.ops, self.shape.sm_scale
        hkv = self.shape.num_kv_heads
        if plan.tasks is not None:
            fused = plan.merge == MERGE_FUSED and plan.widest_split > 1
            counters = self._pair_counters(plan.batch_size * hkv) if fused else None
            ops.workqueue_decode(q, k_pages, v_pages, plan.block_table, plan.seq_lens, plan.tasks,
                                 plan.split_offsets, scale, out, part_m, part_l, part_acc, counters, self.stages,
                                 plan.page_indptr)
            if plan.widest_split > 1 and not fused:
                ops.merge_states(part_m, part_l, part_acc, None, plan.split_offsets, hkv, 0, out)
            return
        offset = 0
        for rows, s in zip(plan.bucket_rows, plan.launch_shapes()[1]):
            slots = rows.numel() * hkv * s
            m, l, acc = part_m[offset:offset + slots], part_l[offset:offset + slots], part_acc[offset:offset + slots]
            fused = plan.merge == MERGE_FUSED and s > 1
            cluster = plan.merge == MERGE_CLUSTER
            counters = self._pair_counters(rows.numel() * hkv) if fused else None
            ops.bucket_decode(q, k_pages, v_pages, plan.block_table, plan.seq_lens, rows, s, scale, out, m, l, acc,
                              counters, self.stages, cluster, plan.page_indptr)
            if s > 1 and not fused and not cluster:
                ops.merge_states(m, l, acc, rows, None, hkv, s, out)
            offset += slots

    # ---- CUDA graph replay (ablation) --------------------------------------------------------
    def captured_graphs(self) -> list:
        """The CUDA graphs a cuda_graph engine has captured, one per layout, in capture order (a
        benchmark replays one bare to time the kernels apart from the plan and its copy)."""
        return [graphed.graph for graphed in self._graphs.values()]

    def _run_graphed(self, q, k_pages, v_pages, plan: DevicePlan) -> torch.Tensor:
        """Replays a captured decode(+merge) whose shapes match this step; the per-step metadata
        is copied into the graph's static buffer. Returns the graph's static output tensor,
        valid until the next run with the same shapes."""
        key = (tuple(q.shape), q.dtype, k_pages.data_ptr(), v_pages.data_ptr(), tuple(plan.layout))
        graphed = self._graphs.get(key)
        if graphed is None:
            graphed = _GraphedStep(self, q, k_pages, v_pages, plan)
            self._graphs[key] = graphed
        return graphed.replay(q, plan)


class _GraphedStep:
    def __init__(self, engine: PersistentKVEngine, q, k_pages, v_pages, plan: DevicePlan):
        self.q = q.clone()
        self.plan = dataclasses.replace(plan, meta=plan.meta.clone())
        self.out = torch.empty_like(q)
        scratch = engine.scratch(plan, q.device)
        self.graph = capture_graph(lambda: engine._launch(self.q, k_pages, v_pages, self.plan, self.out, *scratch))
        self.scratch = scratch

    def replay(self, q, plan: DevicePlan) -> torch.Tensor:
        self.q.copy_(q)
        self.plan.meta.copy_(plan.meta)
        self.graph.replay()
        return self.out
