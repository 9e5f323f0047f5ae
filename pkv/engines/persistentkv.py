"""The PersistentKV CUDA engine: executes pkv.schedule plans with the torch.ops.pkv kernels.

Same constructor and methods as pkv.engines.reference.ReferenceEngine, which computes the same
plans in torch; the GPU tests compare the two on every route.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from pkv.engines.base import Engine, check_decode_inputs
from pkv.schedule import SplitPolicy, WorkqueuePlan, plan_buckets, plan_workqueue

ROUTES = ("workqueue", "bucket_exact", "bucket_masked")
MAX_MERGE_SPLITS = 1024  # kMaxMergeSlots in csrc/softmax_state.cuh


@dataclasses.dataclass
class DevicePlan:
    """A step's plan with its int32 metadata on the device (uploaded in one copy).

    Bucket slots follow pkv.engines.reference: launch j owns R_j * Hkv * S_j slots after launch
    j-1's, so partial states compare slot by slot (single-split launches write `out` instead).
    """

    route: str
    step: object
    schedule: object
    num_splits: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    tasks: torch.Tensor | None = None
    split_offsets: torch.Tensor | None = None
    bucket_rows: list = dataclasses.field(default_factory=list)
    num_slots: int = 0

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])


class PersistentKVEngine(Engine):
    name = "persistentkv"

    def __init__(self, shape, *, route: str = "workqueue", split_policy: SplitPolicy | None = None,
                 bucket_num_splits: int = 32, fused_merge: bool = False, device: str = "cuda",
                 cuda_graph: bool = False, stages: int = 2):
        if route not in ROUTES:
            raise ValueError(f"persistentkv route must be one of {ROUTES}, got {route!r}")
        from pkv import ops

        self.ops = ops.load()
        self.shape = shape
        self.route = route
        self.split_policy = split_policy or SplitPolicy()
        self.bucket_num_splits = int(bucket_num_splits)
        self.fused_merge = bool(fused_merge)
        self.device = torch.device(device)
        self.cuda_graph = bool(cuda_graph)
        if stages not in (2, 3):
            raise ValueError(f"persistentkv stages must be 2 or 3, got {stages!r}")
        self.stages = int(stages)
        self.implementation = f"cuda:{route}" + ("+fused_merge" if fused_merge else "") + \
            ("+cuda_graph" if cuda_graph else "")
        self._counters = torch.zeros(0, dtype=torch.int32, device=self.device)
        self._graphs: dict[tuple, _GraphedStep] = {}

    # ---- planning (host) -------------------------------------------------------------------
    def plan(self, step) -> DevicePlan:
        return self._plan_route(step, self.route, None)

    def plan_for(self, step, decision) -> DevicePlan:
        """Plan with a route decision's route and split count (used by the adaptive engine)."""
        if decision.route == "persistentkv_workqueue":
            return self._plan_route(step, "workqueue", decision.num_splits)
        if decision.route == "persistentkv_bucket":
            route = self.route if self.route != "workqueue" else "bucket_exact"
            return self._plan_route(step, route, decision.num_splits)
        raise ValueError(f"persistentkv cannot run route {decision.route!r}")

    def _plan_route(self, step, route: str, num_splits: int | None) -> DevicePlan:
        hkv, g = self.shape.num_kv_heads, self.shape.group_size
        if route == "workqueue":
            policy = self.split_policy
            if num_splits is not None and num_splits != policy.num_splits:
                policy = dataclasses.replace(policy, num_splits=int(num_splits))
            host = plan_workqueue(step, hkv, g, policy)
            parts = [step.block_table, step.seq_lens, host.tasks, host.split_offsets]
            splits = int(policy.num_splits) if policy.kind == "fixed" else int(host.max_splits)
        else:
            splits = self.bucket_num_splits if num_splits is None else int(num_splits)
            host = plan_buckets(step, hkv, g, splits, mode="exact" if route == "bucket_exact" else "masked")
            parts = [step.block_table, step.seq_lens] + [launch.row_indices for launch in host.launches]
        widest = int(host.max_splits) if route == "workqueue" else max(int(l.num_splits) for l in host.launches)
        if widest > MAX_MERGE_SPLITS:
            raise ValueError(f"persistentkv merges at most {MAX_MERGE_SPLITS} splits per (row, KV head), "
                             f"the plan has {widest}")
        views = self._upload(parts)
        plan = DevicePlan(route="persistentkv_workqueue" if route == "workqueue" else "persistentkv_bucket",
                          step=step, schedule=host, num_splits=splits,
                          block_table=views[0].view(step.block_table.shape), seq_lens=views[1])
        if route == "workqueue":
            plan.tasks = views[2].view(-1, 5)
            plan.split_offsets = views[3]
            plan.num_slots = int(host.split_offsets[-1])
        else:
            plan.bucket_rows = views[2:]
            plan.num_slots = sum(len(l.row_indices) * hkv * l.num_splits for l in host.launches)
        return plan

    def _upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """One host-to-device copy for all of a step's int32 metadata."""
        flat = [np.ascontiguousarray(a, dtype=np.int32).reshape(-1) for a in arrays]
        sizes = [a.size for a in flat]
        packed = torch.from_numpy(np.concatenate(flat)).to(self.device, non_blocking=False)
        return list(torch.split(packed, sizes))

    # ---- execution (device) ----------------------------------------------------------------
    def _check(self, q, k_pages, v_pages, plan: DevicePlan) -> None:
        """Refuse bad inputs here, with the field named, before any kernel sees them."""
        check_decode_inputs(q, k_pages, v_pages, self.shape, plan.step.page_size)
        for label, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
            if t.dtype not in (torch.float16, torch.bfloat16):
                raise ValueError(f"persistentkv: {label} must be float16 or bfloat16, got {t.dtype}")
            if t.device.type != "cuda":
                raise ValueError(f"persistentkv: {label} must be on a CUDA device, got {t.device}")
        if q.dtype != k_pages.dtype:
            raise ValueError(f"persistentkv: q is {q.dtype} but the pages are {k_pages.dtype}")
        if q.shape[0] != plan.batch_size:
            raise ValueError(f"persistentkv: q has {q.shape[0]} rows, the plan's step has {plan.batch_size}")

    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: DevicePlan) -> torch.Tensor:
        self._check(q, k_pages, v_pages, plan)
        if self.cuda_graph:
            return self._run_graphed(q, k_pages, v_pages, plan)
        out = torch.empty_like(q)
        self._launch(q, k_pages, v_pages, plan, out, *self.scratch(plan, q.device))
        return out

    def run_into(self, q, k_pages, v_pages, plan: DevicePlan, out, part_m, part_l, part_acc) -> None:
        """run() with caller-owned output and scratch (tests poison them first)."""
        self._check(q, k_pages, v_pages, plan)
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
        ops, scale = self.ops, self.shape.sm_scale
        hkv = self.shape.num_kv_heads
        if plan.tasks is not None:
            host: WorkqueuePlan = plan.schedule
            fused = self.fused_merge and host.max_splits > 1
            counters = self._pair_counters(plan.batch_size * hkv) if fused else None
            ops.workqueue_decode(q, k_pages, v_pages, plan.block_table, plan.seq_lens, plan.tasks,
                                 plan.split_offsets, scale, out, part_m, part_l, part_acc, counters, self.stages)
            if host.max_splits > 1 and not fused:
                ops.merge_states(part_m, part_l, part_acc, None, plan.split_offsets, hkv, 0, out)
            return
        offset = 0
        for launch, rows in zip(plan.schedule.launches, plan.bucket_rows):
            s = int(launch.num_splits)
            slots = len(launch.row_indices) * hkv * s
            m, l, acc = part_m[offset:offset + slots], part_l[offset:offset + slots], part_acc[offset:offset + slots]
            fused = self.fused_merge and s > 1
            counters = self._pair_counters(len(launch.row_indices) * hkv) if fused else None
            ops.bucket_decode(q, k_pages, v_pages, plan.block_table, plan.seq_lens, rows, s, scale, out, m, l, acc,
                              counters, self.stages)
            if s > 1 and not fused:
                ops.merge_states(m, l, acc, rows, None, hkv, s, out)
            offset += slots

    # ---- CUDA graph replay (ablation) --------------------------------------------------------
    def _run_graphed(self, q, k_pages, v_pages, plan: DevicePlan) -> torch.Tensor:
        """Replays a captured decode(+merge) whose shapes match this step; the per-step metadata
        is copied into the graph's static buffers. Returns the graph's static output tensor,
        valid until the next run with the same shapes."""
        key = (plan.route, tuple(q.shape), q.dtype, k_pages.data_ptr(), v_pages.data_ptr(),
               tuple(plan.block_table.shape), plan.num_slots,
               None if plan.tasks is None else tuple(plan.tasks.shape),
               tuple((l.num_splits, len(l.row_indices)) for l in getattr(plan.schedule, "launches", ())),
               getattr(plan.schedule, "max_splits", 0))
        graphed = self._graphs.get(key)
        if graphed is None:
            graphed = _GraphedStep(self, q, k_pages, v_pages, plan)
            self._graphs[key] = graphed
        return graphed.replay(q, plan)


class _GraphedStep:
    def __init__(self, engine: PersistentKVEngine, q, k_pages, v_pages, plan: DevicePlan):
        self.q = q.clone()
        self.plan = dataclasses.replace(plan)
        self.plan.block_table = plan.block_table.clone()
        self.plan.seq_lens = plan.seq_lens.clone()
        if plan.tasks is not None:
            self.plan.tasks = plan.tasks.clone()
            self.plan.split_offsets = plan.split_offsets.clone()
        self.plan.bucket_rows = [r.clone() for r in plan.bucket_rows]
        self.out = torch.empty_like(q)
        scratch = engine.scratch(plan, q.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up outside capture (smem opt-in, lazy init)
            engine._launch(self.q, k_pages, v_pages, self.plan, self.out, *scratch)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            engine._launch(self.q, k_pages, v_pages, self.plan, self.out, *scratch)
        self.scratch = scratch

    def replay(self, q, plan: DevicePlan) -> torch.Tensor:
        self.q.copy_(q)
        self.plan.block_table.copy_(plan.block_table)
        self.plan.seq_lens.copy_(plan.seq_lens)
        if plan.tasks is not None:
            self.plan.tasks.copy_(plan.tasks)
            self.plan.split_offsets.copy_(plan.split_offsets)
        for static, rows in zip(self.plan.bucket_rows, plan.bucket_rows):
            static.copy_(rows)
        self.graph.replay()
        return self.out
