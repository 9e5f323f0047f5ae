"""Torch execution of PersistentKV plans: the kernels' partial-state math, on any device.

The reference engine executes exactly the tasks of a ``pkv.pipeline.schedule`` plan (workqueue tasks
or bucket CTAs), writes the split partial states in the layouts of docs/architecture.md and
merges them. GPU tests compare the CUDA kernels' states against ``partial_states`` slot by
slot, and the CPU profile uses this engine as the PersistentKV stand-in.

Partial-state slot layouts (what ``partial_states`` returns):

* WorkqueuePlan: slot ``split_offsets[row * Hkv + kvh] + split``; ``num_slots = split_offsets[-1]``.
* BucketPlan: launch ``j`` owns a block of ``R_j * Hkv * S_j`` slots that follows launch
  ``j - 1``'s block; inside it CTA ``(r, kvh, s)`` has slot ``(r * Hkv + kvh) * S_j + s``.
  Splits that own no tiles hold the neutral state (m = -inf, l = 0, acc = 0).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from pkv.engines.base import Engine, EnginePlan, check_decode_inputs
from pkv.pipeline.schedule import TILE_TOKENS, plan_buckets, plan_workqueue, plan_workqueue_device_order
from pkv.policy.choose import PinnedRoutePolicy, describe_policy, pinned_route
from pkv.policy.route import MERGE_FUSED, ROUTE_BUCKET, ROUTE_WORKQUEUE, StepRoute


# Elements (tokens * head_dim) gathered per K or V chunk: bounds peak memory while keeping
# each chunk large enough that torch's batched matmuls dominate the Python overhead.
_GATHER_BUDGET = 1 << 22


@dataclasses.dataclass(frozen=True)
class WorkItems:
    """Non-empty (row, kvh, token range) items of a plan and the slot each one writes."""

    rows: np.ndarray
    kv_heads: np.ndarray
    token_begin: np.ndarray
    token_end: np.ndarray
    slots: np.ndarray
    neutral_slots: np.ndarray
    num_slots: int


def _tile_items(rows, kv_heads, tile_begin, tile_end, slots, seq_lens, neutral_slots, num_slots) -> WorkItems:
    """WorkItems from tile ranges: tile t holds tokens [32 t, 32 t + 32), cut at the row's length."""
    return WorkItems(
        rows=rows,
        kv_heads=kv_heads,
        token_begin=tile_begin * TILE_TOKENS,
        token_end=np.minimum(tile_end * TILE_TOKENS, seq_lens[rows].astype(np.int64)),
        slots=slots,
        neutral_slots=neutral_slots,
        num_slots=num_slots,
    )


def row_tile_counts(seq_lens: np.ndarray) -> np.ndarray:
    return (np.asarray(seq_lens, dtype=np.int64) + TILE_TOKENS - 1) // TILE_TOKENS


def _workqueue_items(schedule, seq_lens: np.ndarray, num_kv_heads: int) -> WorkItems:
    tasks = np.asarray(schedule.tasks, dtype=np.int64).reshape(-1, 5)
    offsets = np.asarray(schedule.split_offsets, dtype=np.int64)
    batch = seq_lens.shape[0]
    if offsets.shape != (batch * num_kv_heads + 1,):
        raise ValueError(
            f"WorkqueuePlan.split_offsets has shape {offsets.shape}, expected "
            f"({batch * num_kv_heads + 1},) for B={batch}, Hkv={num_kv_heads}"
        )
    rows, kvh, split, tile_begin, tile_end = tasks.T
    if tasks.shape[0] and (rows.min() < 0 or rows.max() >= batch or kvh.min() < 0
                           or kvh.max() >= num_kv_heads):
        raise ValueError("WorkqueuePlan.tasks has a row or kvh outside the step")
    pair = rows * num_kv_heads + kvh
    slots = offsets[pair] + split
    tiles = row_tile_counts(seq_lens)[rows]
    bad = (tile_begin >= tile_end) | (tile_begin < 0) | (tile_end > tiles) | (split < 0) | (
        slots >= offsets[pair + 1]
    )
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"WorkqueuePlan.tasks[{i}] = {tasks[i].tolist()} is invalid for seq_len "
            f"{int(seq_lens[rows[i]])} and split_offsets[{pair[i]}:{pair[i] + 2}] = "
            f"{offsets[pair[i]:pair[i] + 2].tolist()}"
        )
    return _tile_items(rows, kvh, tile_begin, tile_end, slots, seq_lens, np.zeros(0, dtype=np.int64),
                       int(offsets[-1]))


def _bucket_items(schedule, seq_lens: np.ndarray, num_kv_heads: int) -> WorkItems:
    parts = []
    neutral = []
    base = 0
    for j, launch in enumerate(schedule.launches):
        row_indices = np.asarray(launch.row_indices, dtype=np.int64)
        splits = int(launch.num_splits)
        if splits < 1:
            raise ValueError(f"BucketPlan.launches[{j}].num_splits = {splits}, must be >= 1")
        if row_indices.size and (row_indices.min() < 0 or row_indices.max() >= seq_lens.shape[0]):
            raise ValueError(f"BucketPlan.launches[{j}].row_indices has rows outside the step")
        r, h, s = np.meshgrid(
            np.arange(row_indices.size), np.arange(num_kv_heads), np.arange(splits), indexing="ij"
        )
        r, h, s = r.ravel(), h.ravel(), s.ravel()
        rows = row_indices[r]
        # Row-local bounds: the split range comes from the row's own length, never route_len.
        tiles = row_tile_counts(seq_lens)[rows]
        per_split = (tiles + splits - 1) // splits
        tile_begin = s * per_split
        tile_end = np.minimum(tile_begin + per_split, tiles)
        slots = base + (r * num_kv_heads + h) * splits + s
        empty = tile_begin >= tiles
        neutral.append(slots[empty])
        keep = ~empty
        parts.append((rows[keep], h[keep], tile_begin[keep], tile_end[keep], slots[keep]))
        base += row_indices.size * num_kv_heads * splits
    if not parts:
        raise ValueError("BucketPlan has no launches")
    rows, kvh, tile_begin, tile_end, slots = (np.concatenate(c) for c in zip(*parts))
    return _tile_items(rows, kvh, tile_begin, tile_end, slots, seq_lens, np.concatenate(neutral), base)


def work_items(plan: EnginePlan, num_kv_heads: int) -> WorkItems:
    """Expand a plan into the token ranges its CTAs (or tasks) read."""
    seq_lens = np.asarray(plan.step.seq_lens, dtype=np.int64)
    schedule = plan.schedule
    if hasattr(schedule, "tasks"):
        return _workqueue_items(schedule, seq_lens, num_kv_heads)
    if hasattr(schedule, "launches"):
        return _bucket_items(schedule, seq_lens, num_kv_heads)
    raise ValueError(f"plan.schedule is neither a WorkqueuePlan nor a BucketPlan: {type(schedule)!r}")


def _compute_dtype(q: torch.Tensor, k_pages: torch.Tensor) -> torch.dtype:
    if q.dtype == torch.float64 or k_pages.dtype == torch.float64:
        return torch.float64
    return torch.float32


class ReferenceEngine(Engine):
    """PersistentKV's routes executed with torch ops (same constructor as the CUDA engine)."""

    held_to_paper_bound = True

    def __init__(self, shape, *, policy=None, device="cpu", planner: str = "host") -> None:
        if planner not in ("host", "device"):
            raise ValueError(f"ReferenceEngine: planner must be 'host' or 'device', got {planner!r}")
        self.shape = shape
        self.policy = policy if policy is not None else PinnedRoutePolicy(pinned_route("workqueue", None))
        self.device = torch.device(device)
        # planner="device": workqueue steps run the plan the GPU planner writes
        # (plan_workqueue_device_order), so its logic is checked on the CPU.
        self.planner = planner
        self.name = "reference"
        # The merge is the same exact reduction whatever its kind; the route is recorded so
        # results say which variant's plan was executed.
        self.implementation = f"reference:{describe_policy(self.policy)}"

    # -- planning -------------------------------------------------------------------------

    def plan(self, step) -> EnginePlan:
        return self.plan_route(step, self.policy.choose(step).route)

    def plan_route(self, step, route: StepRoute) -> EnginePlan:
        """Plan the step on a PersistentKV route the policy chose."""
        if route.name == ROUTE_WORKQUEUE:
            return self._plan_workqueue(step, route)
        if route.name == ROUTE_BUCKET:
            return self._plan_buckets(step, route)
        raise ValueError(f"{type(self).__name__} cannot execute route {route.name!r}; "
                         f"expected {ROUTE_WORKQUEUE!r} or {ROUTE_BUCKET!r}")

    def _plan_workqueue(self, step, route: StepRoute) -> EnginePlan:
        policy = route.split_policy
        if self.planner == "device":
            schedule = plan_workqueue_device_order(step.seq_lens, self.shape.num_kv_heads, self.shape.group_size,
                                                   policy)
        else:
            schedule = plan_workqueue(step, self.shape.num_kv_heads, self.shape.group_size, policy)
        splits = int(policy.num_splits) if policy.kind == "fixed" else int(schedule.max_splits)
        plan = EnginePlan(route=ROUTE_WORKQUEUE, step=step, schedule=schedule, num_splits=splits, merge=route.merge,
                          split_rule=route.split_rule)
        if route.merge == MERGE_FUSED:
            # One completion counter per (row, kvh) pair, zero at rest (the fused variant's plan).
            pairs = len(step.seq_lens) * self.shape.num_kv_heads
            plan.tensors["pair_counters"] = torch.zeros(pairs, dtype=torch.int32, device=self.device)
        return self._upload(plan)

    def _plan_buckets(self, step, route: StepRoute) -> EnginePlan:
        schedule = plan_buckets(step, self.shape.num_kv_heads, self.shape.group_size, route.num_splits,
                                mode=route.bucket_mode)
        splits = max((int(launch.num_splits) for launch in schedule.launches), default=route.num_splits)
        plan = EnginePlan(route=ROUTE_BUCKET, step=step, schedule=schedule, num_splits=splits,
                          merge=route.merge, extra={"bucket_mode": route.bucket_mode})
        return self._upload(plan)

    def _upload(self, plan: EnginePlan) -> EnginePlan:
        step = plan.step
        plan.tensors["block_table"] = torch.as_tensor(
            np.asarray(step.block_table), dtype=torch.int64).to(self.device)
        plan.tensors["seq_lens"] = torch.as_tensor(
            np.asarray(step.seq_lens), dtype=torch.int64).to(self.device)
        return plan

    # -- execution ------------------------------------------------------------------------

    def partial_states(self, q, k_pages, v_pages, plan: EnginePlan):
        """Split partial states (m, l, acc) for exactly the plan's tasks, in the plan's slots.

        float32 states (float64 when q or the pages are float64). Slots no task writes keep
        NaN, so a plan that leaves a slot uncovered poisons the merged output.
        """
        check_decode_inputs(q, k_pages, v_pages, self.shape, plan.step.page_size)
        if q.shape[0] != len(plan.step.seq_lens):
            raise ValueError(f"q has {q.shape[0]} rows, the plan's step has {len(plan.step.seq_lens)}")
        items = work_items(plan, self.shape.num_kv_heads)
        group, head_dim = self.shape.group_size, self.shape.head_dim
        dtype = _compute_dtype(q, k_pages)
        device = q.device
        m = torch.full((items.num_slots, group), float("nan"), dtype=dtype, device=device)
        l = torch.full_like(m, float("nan"))
        acc = torch.full((items.num_slots, group, head_dim), float("nan"), dtype=dtype, device=device)
        if items.neutral_slots.size:
            neutral = torch.as_tensor(items.neutral_slots, device=device)
            m[neutral] = float("-inf")
            l[neutral] = 0.0
            acc[neutral] = 0.0

        block_table = plan.tensors["block_table"].to(device)
        q_grouped = q.reshape(q.shape[0], self.shape.num_kv_heads, group, head_dim)
        lengths = items.token_end - items.token_begin
        order = np.argsort(-lengths, kind="stable")
        start = 0
        while start < order.size:
            longest = int(lengths[order[start]]) + 2 * k_pages.shape[2]  # page-aligned span
            count = max(1, _GATHER_BUDGET // (longest * head_dim))
            chunk = order[start:start + count]
            start += count
            self._compute_chunk(items, chunk, longest, q_grouped, k_pages, v_pages, block_table,
                                dtype, m, l, acc)
        return m, l, acc

    def _compute_chunk(self, items, chunk, longest, q_grouped, k_pages, v_pages, block_table,
                       dtype, m_out, l_out, acc_out) -> None:
        device = q_grouped.device
        page_size = k_pages.shape[2]
        rows = torch.as_tensor(items.rows[chunk], device=device)
        kv_heads = torch.as_tensor(items.kv_heads[chunk], device=device)
        slots = torch.as_tensor(items.slots[chunk], device=device)
        begin = items.token_begin[chunk]
        end = items.token_end[chunk]

        # Gather whole pages (P * d contiguous elements each) rather than single tokens: the
        # item's range starts `lead` tokens into its first page and the rest is masked.
        first_page = begin // page_size
        last_page = (end - 1) // page_size
        lead = torch.as_tensor(begin - first_page * page_size, device=device)
        length = torch.as_tensor(end - begin, device=device)
        span = int((last_page - first_page).max()) + 1
        logical = torch.as_tensor(first_page, device=device)[:, None] + torch.arange(span, device=device)
        # Padding pages repeat the item's last page (always a real page) and are masked.
        logical = torch.minimum(logical, torch.as_tensor(last_page, device=device)[:, None])
        physical = block_table[rows[:, None], logical]                        # [C, span]
        keys = k_pages[physical, kv_heads[:, None]].to(dtype).flatten(1, 2)   # [C, span*P, d]
        values = v_pages[physical, kv_heads[:, None]].to(dtype).flatten(1, 2)
        offsets = torch.arange(span * page_size, device=device)[None, :]
        valid = (offsets >= lead[:, None]) & (offsets < (lead + length)[:, None])
        query = q_grouped[rows, kv_heads].to(dtype)                           # [C, G, d]

        scores = torch.bmm(query, keys.transpose(1, 2)) * self.shape.sm_scale  # [C, G, L]
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        m = scores.amax(dim=-1)
        p = torch.exp(scores - m[..., None])
        m_out[slots] = m
        l_out[slots] = p.sum(dim=-1)
        acc_out[slots] = torch.bmm(p, values)

    def merge_states(self, m, l, acc, plan: EnginePlan):
        """Exact split merge (docs/architecture.md); returns [B, Hq, d] in the states' dtype."""
        batch = len(plan.step.seq_lens)
        num_kv_heads, group, head_dim = self.shape.num_kv_heads, self.shape.group_size, \
            self.shape.head_dim
        schedule = plan.schedule
        if hasattr(schedule, "tasks"):
            offsets = np.asarray(schedule.split_offsets, dtype=np.int64)
            pairs = batch * num_kv_heads
            pair_of_slot = torch.as_tensor(
                np.repeat(np.arange(pairs), np.diff(offsets)), device=m.device)
            m_max = torch.full((pairs, group), float("-inf"), dtype=m.dtype, device=m.device)
            m_max = m_max.scatter_reduce(0, pair_of_slot[:, None].expand_as(m), m, reduce="amax",
                                         include_self=True)
            weight = _merge_weight(m, m_max[pair_of_slot])
            l_sum = torch.zeros_like(m_max).index_add_(0, pair_of_slot, weight * l)
            acc_sum = torch.zeros(pairs, group, head_dim, dtype=acc.dtype, device=acc.device)
            acc_sum.index_add_(0, pair_of_slot, weight[..., None] * acc)
            return (acc_sum / l_sum[..., None]).reshape(batch, num_kv_heads * group, head_dim)
        if hasattr(schedule, "launches"):
            out = torch.full((batch, num_kv_heads * group, head_dim), float("nan"), dtype=acc.dtype,
                             device=acc.device)
            base = 0
            for launch in schedule.launches:
                rows = np.asarray(launch.row_indices, dtype=np.int64)
                splits = int(launch.num_splits)
                size = rows.size * num_kv_heads * splits
                m_j = m[base:base + size].reshape(rows.size, num_kv_heads, splits, group)
                l_j = l[base:base + size].reshape(rows.size, num_kv_heads, splits, group)
                acc_j = acc[base:base + size].reshape(rows.size, num_kv_heads, splits, group, head_dim)
                base += size
                weight = _merge_weight(m_j, m_j.amax(dim=2, keepdim=True))
                l_sum = (weight * l_j).sum(dim=2)
                acc_sum = (weight[..., None] * acc_j).sum(dim=2)
                merged = (acc_sum / l_sum[..., None]).reshape(rows.size, -1, head_dim)
                out[torch.as_tensor(rows, device=out.device)] = merged
            return out
        raise ValueError(f"plan.schedule is neither a WorkqueuePlan nor a BucketPlan: {type(schedule)!r}")

    def run(self, q, k_pages, v_pages, plan: EnginePlan):
        m, l, acc = self.partial_states(q, k_pages, v_pages, plan)
        return self.merge_states(m, l, acc, plan).to(q.dtype)


def _merge_weight(m: torch.Tensor, m_max: torch.Tensor) -> torch.Tensor:
    """exp(m_s - m) with neutral slots (m_s = -inf) weighted exactly zero."""
    weight = torch.exp(m - m_max)
    return torch.where(torch.isneginf(m), torch.zeros_like(weight), weight)
