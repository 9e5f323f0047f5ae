"""A decode step planned on the GPU, for a serving engine that plans once per step and replays
CUDA graphs (DESIGN.md, "Inside a serving engine").

``DeviceDecodeStep`` is the workspace: allocated once for (max batch, num_splits), it plans the
compact workqueue from ``seq_lens`` and the page table the caller already holds on the GPU, a
block table or page lists (pkv.page_table; csrc/device_plan.cu: no host synchronization, no copy,
no upload) and runs the decode and merge into a caller-owned ``out``. Its launch shapes depend on
the batch size only, so ``GraphedDecodeStep`` captures one step per batch size and replays it for
any lengths.

The split rule is the workqueue route's (pkv.pipeline.schedule.SplitPolicy): the fixed rule, or
the balanced rule (about the same tiles a task, over the batch's total), with the split count and
task budget of the caller's route (pkv.policy), one per captured graph. Two planners give those
splits (``PLANNERS``): "plan_kernel" launches a planner (one CTA) that writes the compact
workqueue before the decode, under either rule: the host plan's tasks in its order, longest first;
"in_decode" (fixed rule only: its grid has the same split count in every row) launches no planner:
the decode grid is (B, Hkv, S) and each CTA derives its split's tiles from its row's length (the
bucket kernel over every row with the fused merge of a row's live splits only, so splits past a
short row's tiles exit without writing). The tile ranges are the same; what differs is one launch
on the critical path against no longest-first order. Either planner merges a row's splits by a
merge launch after the decode (``merge="launch"``) or in the decode itself, the last split of a
pair merging it (``merge="fused"``, completion counters that are zero again after every launch).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from pkv import ops
from pkv.cuda_graphs import capture_graph
from pkv.engines.persistentkv import check_ring_stages
from pkv.page_table import PageLists, check_page_table, device_token_limits, host_row_pages, kernel_operands
from pkv.pipeline.schedule import SPLIT_KINDS, max_workqueue_tasks, workqueue_split_policy
from pkv.policy.route import MERGE_FUSED, MERGE_LAUNCH, ROUTE_BUCKET, ROUTE_WORKQUEUE, describe_route

MAX_DEVICE_PLAN_ROWS = 1024  # kMaxDevicePlanRows in csrc/device_plan.h: one planner CTA, a thread per row
MAX_SPLITS = 1024  # kMaxMergeSlots in csrc/decode_constants.h
PLANNERS = ("plan_kernel", "in_decode")
# The planner of a device step that names none: the plan kernel's longest-first workqueue holds on
# every batch the H200 measured, while the in-decode grid lost 15-20% on ragged ones
# (docs/performance.md, "The device-planned step on the H200").
DEFAULT_PLANNER = "plan_kernel"
# What each planner's step is called in result records.
PLANNER_LABELS = {"plan_kernel": "device-planned workqueue", "in_decode": "in-decode split grid"}
MERGES = (MERGE_LAUNCH, MERGE_FUSED)
# The merge of every device step that does not name one, measured like DEFAULT_PLANNER.
DEFAULT_MERGE = MERGE_LAUNCH


def device_planner(route_name: str) -> str:
    """The planner a device step runs for a route: a bucket route's grid over every row is the
    in-decode planner's grid, with no plan launch (on the H200 as fast as the host-planned bucket
    launch at B1); every other route keeps the plan kernel's longest-first workqueue."""
    return "in_decode" if route_name == ROUTE_BUCKET else DEFAULT_PLANNER


def device_merge(route_merge: str) -> str:
    """The merge a device step runs for a route's merge kind: the route's own, except the cluster
    merge, which the device step does not have and replaces by a merge launch."""
    return route_merge if route_merge in MERGES else MERGE_LAUNCH


class DeviceStepConfig(NamedTuple):
    """What a DeviceDecodeStep is built with for one PersistentKV route (its keyword arguments)."""

    num_splits: int
    merge: str
    planner: str
    split_kind: str = "fixed"
    target_ctas: int = 0


def device_step_config(route, planner: str | None = None) -> DeviceStepConfig:
    """The device step of a PersistentKV route: its split count, its merge (device_merge), its
    planner (device_planner, unless ``planner`` pins one for every route) and, on the workqueue
    route, its split rule (a bucket route's grid has the same split count in every row)."""
    workqueue = route.name == ROUTE_WORKQUEUE
    planner = planner or device_planner(route.name)
    split_kind = route.split_kind if workqueue else "fixed"
    check_planner_runs_rule(planner, split_kind,
                            f"device step: the route {describe_route(route)} (S={route.num_splits}) names")
    return DeviceStepConfig(int(route.num_splits), device_merge(route.merge), planner, split_kind,
                            int(route.target_ctas) if workqueue else 0)


def check_planner_runs_rule(planner: str, split_kind: str, where: str) -> None:
    """Refuse a split rule the planner cannot run: the in-decode grid gives every row the same
    split count, so only the plan kernel runs a rule other than the fixed one. ``where`` opens the
    error with what named the pair."""
    if split_kind != "fixed" and planner != "plan_kernel":
        raise ValueError(f"{where} the {split_kind!r} split rule, which planner {planner!r} cannot run (its grid "
                         f"gives every row the same split count); it needs planner 'plan_kernel'")


def check_lengths(host_lens, row_pages, page_size: int, where: str = "DeviceDecodeStep") -> None:
    """Refuse, before any launch, a length the page table cannot address: the error names the row,
    its length and the limit. ``row_pages`` is a block table's width, or each row's page-list
    length. The device planner would clamp such a row to its pages, which computes attention over
    fewer tokens than the caller asked for."""
    lens = np.asarray(host_lens, dtype=np.int64)
    limits = np.asarray(row_pages, dtype=np.int64) * int(page_size)
    out_of_range = (lens > limits) | (lens < 0)
    if out_of_range.any():  # the usual case costs these three array operations and no more
        pages = np.broadcast_to(np.asarray(row_pages, dtype=np.int64), lens.shape)
        limits = pages * int(page_size)
        bad = np.flatnonzero(out_of_range)
        row = int(bad[0])
        source = "the block table's" if np.ndim(row_pages) == 0 else "its page list's"
        raise ValueError(f"{where}: row {row} has length {int(lens[row])}; {source} {int(pages[row])} pages "
                         f"of {page_size} tokens address 0..{int(limits[row])} ({bad.size} row(s) out of range)")


class DeviceDecodeStep:
    """Workspace and launches of a device-planned decode step for up to ``max_batch`` rows."""

    def __init__(self, shape, *, max_batch: int, num_splits: int, device="cuda", stages: int = 2,
                 planner: str = DEFAULT_PLANNER, merge: str = DEFAULT_MERGE, split_kind: str = "fixed",
                 target_ctas: int = 0):
        if planner not in PLANNERS:
            raise ValueError(f"DeviceDecodeStep: planner must be one of {PLANNERS}, got {planner!r}")
        if merge not in MERGES:
            raise ValueError(f"DeviceDecodeStep: merge must be one of {MERGES}, got {merge!r}")
        if not 1 <= int(max_batch) <= MAX_DEVICE_PLAN_ROWS:
            raise ValueError(f"DeviceDecodeStep: max_batch must be in 1..{MAX_DEVICE_PLAN_ROWS}, got {max_batch!r}")
        if not 1 <= int(num_splits) <= MAX_SPLITS:
            raise ValueError(f"DeviceDecodeStep: num_splits must be in 1..{MAX_SPLITS}, got {num_splits!r}")
        if not 0 <= int(target_ctas) <= 2**31 - 1:
            raise ValueError(f"DeviceDecodeStep: target_ctas must be in 0..2^31-1, got {target_ctas!r}")
        if split_kind not in SPLIT_KINDS:
            raise ValueError(f"DeviceDecodeStep: split_kind must be one of {SPLIT_KINDS}, got {split_kind!r}")
        check_planner_runs_rule(planner, split_kind, "DeviceDecodeStep: the step names")
        check_ring_stages(stages, device, "DeviceDecodeStep")
        self.shape = shape
        self.max_batch = int(max_batch)
        self.num_splits = int(num_splits)
        # The plan kernel's rule; the in-decode grid is the fixed rule by construction.
        self.split_policy = workqueue_split_policy(split_kind, self.num_splits, int(target_ctas))
        self.stages = int(stages)
        self.planner, self.merge = planner, merge
        self.ops = ops.load()
        self.device = torch.empty(0, device=device).device  # "cuda" resolved to its index, as tensors report it
        capacity = self._capacity(self.max_batch)
        g, d = shape.group_size, shape.head_dim
        int32 = dict(dtype=torch.int32, device=self.device)
        # Zeroed: the decode grid of the capacity loads every slot's task, used or not.
        self.tasks = torch.zeros(capacity, 5, **int32)
        self.split_offsets = torch.empty(self.max_batch * shape.num_kv_heads + 1, **int32)
        self.counts = torch.zeros(2, **int32)  # (live tasks, most splits of a row) of the last plan
        # One slot per possible task: a plan never has more slots than tasks.
        self.part_m = torch.empty(capacity, g, dtype=torch.float32, device=self.device)
        self.part_l = torch.empty(capacity, g, dtype=torch.float32, device=self.device)
        self.part_acc = torch.empty(capacity, g, d, dtype=torch.float32, device=self.device)
        # in_decode: the decode grid's rows; the fused merge's counters (zero between launches).
        self.rows = torch.arange(self.max_batch, **int32)
        self.pair_counters = torch.zeros(self.max_batch * shape.num_kv_heads, **int32)
        self.sm_scale = shape.sm_scale
        self._views: dict[int, _BatchViews] = {}  # batch size -> the workspace's views for it

    def _capacity(self, batch: int) -> int:
        """Task slots (and partial states) a step of ``batch`` rows can need: the decode grid."""
        if self.planner == "in_decode":
            return batch * self.shape.num_kv_heads * self.num_splits
        return max_workqueue_tasks(batch, self.shape.num_kv_heads, self.split_policy)

    def _check(self, q, page_table, seq_lens, out) -> int:
        batch = q.shape[0]
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"DeviceDecodeStep: q has {batch} rows; this workspace serves 1..{self.max_batch}")
        if tuple(seq_lens.shape) != (batch,) or seq_lens.dtype != torch.int32 or seq_lens.device != self.device:
            raise ValueError(f"DeviceDecodeStep: seq_lens must be int32 [{batch}] on {self.device}, got "
                             f"{seq_lens.dtype} {tuple(seq_lens.shape)} on {seq_lens.device}")
        check_page_table(page_table, batch, self.device, "DeviceDecodeStep")
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"DeviceDecodeStep: out must be {q.dtype} {tuple(q.shape)} like q, got "
                             f"{out.dtype} {tuple(out.shape)}")
        return batch

    def plan(self, page_table, seq_lens, page_size: int) -> None:
        """Plan the step's workqueue on the GPU from the lengths and the page table (a block table
        [B, max_pages] or PageLists); with planner "in_decode" there is nothing to launch. A model
        step plans once and decodes every layer with it (the lengths are the same in every layer).
        No page past a row's own is ever read: under both planners a length past a row's pages is
        clamped to them (csrc/split_decode.cuh, row_length), as the plan kernel clamps it."""
        batch = int(seq_lens.shape[0])
        if not 1 <= batch <= self.max_batch or seq_lens.dtype != torch.int32 or seq_lens.device != self.device:
            raise ValueError(f"DeviceDecodeStep.plan: seq_lens must be int32 [1..{self.max_batch}] on {self.device}, "
                             f"got {seq_lens.dtype} {tuple(seq_lens.shape)} on {seq_lens.device}")
        check_page_table(page_table, batch, self.device, "DeviceDecodeStep.plan")
        self._launch_plan(self._batch_views(batch), *kernel_operands(page_table), seq_lens, page_size)

    def decode(self, q, k_pages, v_pages, page_table, seq_lens, out) -> torch.Tensor:
        """Decode into ``out`` with the last ``plan`` (of this batch size); returns ``out``."""
        views = self._batch_views(self._check(q, page_table, seq_lens, out))
        return self._launch_decode(views, q, k_pages, v_pages, *kernel_operands(page_table), seq_lens, out)

    def run(self, q, k_pages, v_pages, page_table, seq_lens, out, host_lens=None) -> torch.Tensor:
        """Plan on the GPU and decode into ``out``; returns ``out``. ``page_table`` is a block
        table [B, max_pages] or PageLists (pkv.page_table).

        Eager calls check every length against its row's pages before launching: from
        ``host_lens`` (and PageLists.host_indptr) where the caller has them (a serving scheduler
        does), else from copies of the device tensors (a synchronization). Under CUDA-graph
        capture and torch.compile there is no host check; ``GraphedDecodeStep(debug_checks=True)``
        checks on the device instead."""
        batch = self._check(q, page_table, seq_lens, out)
        # No host check while a graph is captured or torch.compile traces: both need the step
        # free of host synchronization (the debug check of GraphedDecodeStep runs on the device).
        if not (torch.compiler.is_compiling() or (q.is_cuda and torch.cuda.is_current_stream_capturing())):
            check_lengths(seq_lens.cpu().numpy() if host_lens is None else host_lens,
                          host_row_pages(page_table, "DeviceDecodeStep"), k_pages.shape[2])
        views = self._batch_views(batch)
        table, page_indptr = kernel_operands(page_table)
        self._launch_plan(views, table, page_indptr, seq_lens, k_pages.shape[2])
        return self._launch_decode(views, q, k_pages, v_pages, table, page_indptr, seq_lens, out)

    # The launches, after the checks of the public calls (each input checked once per call).
    def _batch_views(self, batch: int) -> "_BatchViews":
        # Slicing a tensor costs about a microsecond and a step needs seven: made once per batch size.
        # Under torch.compile they are made in the traced graph and never stored on the object.
        compiling = torch.compiler.is_compiling()
        views = None if compiling else self._views.get(batch)
        if views is None:
            pairs = batch * self.shape.num_kv_heads
            capacity = self._capacity(batch)
            views = _BatchViews(self.tasks[:capacity], self.split_offsets[:pairs + 1], self.part_m[:capacity],
                                self.part_l[:capacity], self.part_acc[:capacity], self.rows[:batch],
                                self.pair_counters[:pairs])
            if not compiling:
                self._views[batch] = views
        return views

    # `table` and `page_indptr` are the page table as the ops take it (pkv.page_table.kernel_operands).
    def _launch_plan(self, views: "_BatchViews", table, page_indptr, seq_lens, page_size: int) -> None:
        if self.planner == "in_decode":
            return  # the decode CTAs plan their own splits
        # A block table clamps every row to its width (max_tokens); page lists clamp each row to its
        # own list, and the planner reads no max_tokens for them.
        max_tokens = 2**31 - 1 if page_indptr is not None else min(table.shape[1] * int(page_size), 2**31 - 1)
        policy = self.split_policy
        self.ops.plan_workqueue_on_device(seq_lens, self.shape.num_kv_heads, self.num_splits, max_tokens,
                                          views.tasks, views.split_offsets, self.counts, page_indptr, int(page_size),
                                          policy.kind == "balanced", policy.max_splits, policy.target_ctas,
                                          policy.min_tiles_per_split)

    def _launch_decode(self, views: "_BatchViews", q, k_pages, v_pages, table, page_indptr, seq_lens,
                       out) -> torch.Tensor:
        counters = views.pair_counters if self.merge == MERGE_FUSED else None
        if self.planner == "plan_kernel":
            self.ops.run_workqueue_planned_on_device(q, k_pages, v_pages, table, seq_lens, views.tasks,
                                                     views.split_offsets, self.counts, self.sm_scale, self.stages,
                                                     out, views.part_m, views.part_l, views.part_acc, page_indptr,
                                                     counters)
            return out
        # in_decode, fused: only a row's live splits are merged, so its empty CTAs write nothing;
        # with a merge launch every split of the grid holds a state (empty ones the neutral state).
        self.ops.bucket_decode(q, k_pages, v_pages, table, seq_lens, views.rows, self.num_splits, self.sm_scale,
                               out, views.part_m, views.part_l, views.part_acc, counters, self.stages, False,
                               page_indptr, counters is not None)
        if counters is None and self.num_splits > 1:
            self.ops.merge_states(views.part_m, views.part_l, views.part_acc, views.rows, None,
                                  self.shape.num_kv_heads, self.num_splits, out)
        return out


class _BatchViews(NamedTuple):
    """A DeviceDecodeStep's buffers cut to one batch size: what its launches take."""

    tasks: torch.Tensor
    split_offsets: torch.Tensor
    part_m: torch.Tensor
    part_l: torch.Tensor
    part_acc: torch.Tensor
    rows: torch.Tensor
    pair_counters: torch.Tensor


class GraphedDecodeStep:
    """CUDA graphs over a DeviceDecodeStep, replayed whatever the lengths.

    ``run`` copies the step's inputs into static buffers of its own (one graph per batch size and
    page-table form); ``replay_static`` replays a graph captured over buffers the caller owns and
    writes in place (one graph per set of buffers), as a serving engine's persistent input buffers
    are used. ``max_pages`` bounds a row's pages: a block table's width, and for page lists the
    static list holds ``batch * max_pages`` entries."""

    def __init__(self, step: DeviceDecodeStep, k_pages, v_pages, max_pages: int, *, debug_checks: bool = False):
        self.step = step
        self.k_pages, self.v_pages = k_pages, v_pages
        self.max_pages = int(max_pages)
        # debug_checks: each graph also records, on the device, the first row whose length its
        # pages cannot address; a replay reads it afterwards (one synchronization) and raises.
        self.debug_checks = bool(debug_checks)
        self._graphs: dict[object, tuple] = {}  # key -> (graph, q, page table, lens, out, debug record)

    def captured_graphs(self) -> list:
        """The CUDA graphs captured so far, in capture order (a benchmark replays one bare to time
        the launch apart from the copies and checks around it)."""
        return [entry[0] for entry in self._graphs.values()]

    def _capture(self, key, static) -> tuple:
        static_q, static_table, static_lens, static_out = static
        debug = None

        def step():
            nonlocal debug
            if self.debug_checks:  # the captured run's result tensor is the one replays write
                debug = _first_out_of_range(static_lens, device_token_limits(static_table, self.k_pages.shape[2]))
            self.step.run(static_q, self.k_pages, self.v_pages, static_table, static_lens, static_out)
        graph = capture_graph(step)
        self._graphs[key] = (graph, *static, debug)
        return self._graphs[key]

    def _replay(self, entry) -> torch.Tensor:
        graph, _, _, _, static_out, debug = entry
        graph.replay()
        if debug is not None:
            found, row, length, limit = debug.tolist()
            if found and limit < 0:
                raise ValueError(f"GraphedDecodeStep (debug check on the device): row {row}'s page list leaves "
                                 f"the flat list (page_table.indptr out of order or past indices)")
            if found:
                raise ValueError(f"GraphedDecodeStep (debug check on the device): row {row} has length {length}; "
                                 f"its pages address 0..{limit} tokens")
        return static_out

    def _static_table(self, page_table, batch: int, device):
        if isinstance(page_table, PageLists):
            return PageLists(torch.zeros(batch + 1, dtype=torch.int32, device=device),
                             torch.zeros(batch * self.max_pages, dtype=torch.int32, device=device))
        return torch.zeros(batch, self.max_pages, dtype=torch.int32, device=device)

    def _copy_table(self, static_table, page_table) -> None:
        if isinstance(page_table, PageLists):
            # The entries the step uses where the caller has indptr on the host (its flat list may be
            # a pool-sized buffer), else the whole list.
            used = page_table.indices.shape[0] if page_table.host_indptr is None else int(page_table.host_indptr[-1])
            if used > static_table.indices.shape[0]:
                raise ValueError(f"GraphedDecodeStep: the step's page lists hold {used} entries; the graphs hold "
                                 f"{static_table.indices.shape[0]} (batch x max_pages {self.max_pages})")
            static_table.indptr.copy_(page_table.indptr)
            static_table.indices[:used].copy_(page_table.indices[:used])
            return
        if page_table.shape[1] > self.max_pages:
            raise ValueError(f"GraphedDecodeStep: block_table has {page_table.shape[1]} pages a row; the "
                             f"graphs were sized for {self.max_pages}")
        static_table[:, :page_table.shape[1]].copy_(page_table)

    def run(self, q, page_table, seq_lens) -> torch.Tensor:
        """The output of one replayed step: the graph's static output, valid until the next replay
        of this batch size. ``page_table`` is a block table or PageLists (pkv.page_table)."""
        batch = q.shape[0]
        check_page_table(page_table, batch, q.device, "GraphedDecodeStep")
        key = (batch, isinstance(page_table, PageLists))
        entry = self._graphs.get(key)
        if entry is None:
            static = (torch.zeros_like(q), self._static_table(page_table, batch, q.device),
                      torch.ones(batch, dtype=torch.int32, device=q.device), torch.empty_like(q))
            self._copy_table(static[1], page_table)
            static[2].copy_(seq_lens)  # the first (untimed) launch plans these lengths
            entry = self._capture(key, static)
        _, static_q, static_table, static_lens, _, _ = entry
        static_q.copy_(q)
        self._copy_table(static_table, page_table)
        static_lens.copy_(seq_lens)
        return self._replay(entry)

    def replay_static(self, buffers) -> torch.Tensor:
        """Replay the graph of these caller-owned (q, page_table, seq_lens, out) buffers, capturing
        it on first use; the caller has written the step into them. Returns ``out``."""
        return self.static_replay(buffers)()

    def static_replay(self, buffers):
        """A callable that replays the graph of these caller-owned buffers (captured now, if this
        is their first use) and returns ``out``: a caller that replays the same buffers every step
        holds it and pays no lookup per step."""
        key = ("static", buffers[0].data_ptr(), buffers[0].shape[0])
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(key, tuple(buffers))
        return functools.partial(self._replay, entry)


def _first_out_of_range(lens: torch.Tensor, limits) -> torch.Tensor:
    """[any, first row, its length, its limit] of the rows outside 0..limit (an int, or one per
    row), computed by device ops that a graph captures (no host synchronization inside the graph)."""
    # A fill kernel for one limit (a host-to-device copy of it could not be captured).
    limits = torch.full_like(lens, limits, dtype=torch.int64) if isinstance(limits, int) else limits
    bad = (lens > limits) | (lens < 0)
    # The row as a one-element index tensor: indexing with a 0-d tensor would read it on the host.
    row = torch.argmax(bad.to(torch.int32)).view(1)
    return torch.cat((bad.any().to(torch.int64).view(1), row, lens.gather(0, row).to(torch.int64),
                      limits.gather(0, row)))
