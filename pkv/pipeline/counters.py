"""Scheduler-derived structural counters per decode step (paper Table 4).

The counters are read off a plan, not measured: launches, decode CTAs, the KV bytes a
step must read and the partial-state bytes its splits write for the merge.

    decode launches   one per bucket launch; one for the workqueue
    merge launches    one per bucket launch with S > 1; workqueue: 1 if any pair has more
                      than one split (0 on either route for the fused-merge variant, which
                      merges in the decode kernel, and for the bucket route's cluster merge)
    launches          decode launches + merge launches
    decode CTAs       sum of R * Hkv * S over bucket launches; T tasks for the workqueue
    useful KV bytes   sum_i seq_len_i * Hkv * d * 2 (K and V) * dtype bytes
    merge bytes       partial states (m, l, acc in float32) written for a merge:
                      slots * G * (d + 2) * 4. A bucket launch with S > 1 writes every
                      slot of its grid, empty splits included; the workqueue writes the
                      slots of pairs with more than one split (a single-split pair writes
                      out directly). The cluster merge writes none: its splits merge through
                      distributed shared memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pkv.pipeline.schedule import BucketPlan, WorkqueuePlan

MIB = 2**20
PARTIAL_STATE_BYTES = 4  # m, l and acc are float32


@dataclass(frozen=True)
class StepCounters:
    launches: int
    decode_ctas: int
    decode_ctas_per_sm: float
    useful_kv_bytes: int
    merge_bytes: int
    merge_launches: int


def _check_common(num_sms: int, head_dim: int, kv_dtype_bytes: int) -> None:
    if int(num_sms) < 1:
        raise ValueError(f"num_sms must be >= 1, got {num_sms}")
    if int(head_dim) < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    if int(kv_dtype_bytes) < 1:
        raise ValueError(f"kv_dtype_bytes must be >= 1, got {kv_dtype_bytes}")


def useful_kv_bytes(step, num_kv_heads: int, head_dim: int, kv_dtype_bytes: int = 2) -> int:
    """Bytes of K and V the step must read: every engine reads exactly these."""
    tokens = int(np.asarray(step.seq_lens, dtype=np.int64).sum())
    return tokens * int(num_kv_heads) * int(head_dim) * 2 * int(kv_dtype_bytes)


def partial_state_bytes(num_slots: int, group_size: int, head_dim: int) -> int:
    """Bytes of m [G], l [G] and acc [G, d] for num_slots slots."""
    return int(num_slots) * int(group_size) * (int(head_dim) + 2) * PARTIAL_STATE_BYTES


def counters_for_buckets(plan: BucketPlan, step, num_sms: int, head_dim: int, kv_dtype_bytes: int = 2,
                         fused_merge: bool = False, cluster_merge: bool = False) -> StepCounters:
    _check_common(num_sms, head_dim, kv_dtype_bytes)
    hkv = plan.num_kv_heads
    decode_ctas = 0
    merged_slots = 0
    merge_launches = 0
    for launch in plan.launches:
        slots = launch.num_slots(hkv)
        decode_ctas += slots
        if launch.num_splits > 1 and not cluster_merge:
            merged_slots += slots
            merge_launches += 0 if fused_merge else 1
    return StepCounters(
        launches=len(plan.launches) + merge_launches,
        decode_ctas=decode_ctas,
        decode_ctas_per_sm=decode_ctas / int(num_sms),
        useful_kv_bytes=useful_kv_bytes(step, hkv, head_dim, kv_dtype_bytes),
        merge_bytes=partial_state_bytes(merged_slots, plan.group_size, head_dim),
        merge_launches=merge_launches,
    )


def _workqueue_counters(
    pair_splits: np.ndarray, step, num_kv_heads: int, group_size: int, num_sms: int, head_dim: int,
    kv_dtype_bytes: int, fused_merge: bool,
) -> StepCounters:
    _check_common(num_sms, head_dim, kv_dtype_bytes)
    num_tasks = int(pair_splits.sum())
    merged_slots = int(pair_splits[pair_splits > 1].sum())
    merge_launches = 1 if (merged_slots > 0 and not fused_merge) else 0
    return StepCounters(
        launches=1 + merge_launches,
        decode_ctas=num_tasks,
        decode_ctas_per_sm=num_tasks / int(num_sms),
        useful_kv_bytes=useful_kv_bytes(step, num_kv_heads, head_dim, kv_dtype_bytes),
        merge_bytes=partial_state_bytes(merged_slots, group_size, head_dim),
        merge_launches=merge_launches,
    )


def counters_for_workqueue(
    plan: WorkqueuePlan, step, num_sms: int, head_dim: int, kv_dtype_bytes: int = 2, fused_merge: bool = False
) -> StepCounters:
    pair_splits = np.diff(plan.split_offsets.astype(np.int64))
    return _workqueue_counters(
        pair_splits, step, plan.num_kv_heads, plan.group_size, num_sms, head_dim, kv_dtype_bytes, fused_merge
    )





def counters_for_flashinfer(
    step, num_sms: int, head_dim: int, kv_dtype_bytes: int = 2, *, num_kv_heads: int, ctas_per_row_head: float = 1.0
) -> StepCounters:
    """One library call, no separate merge.

    num_kv_heads is keyword-only and required: with no plan to read it from, a positional
    call written for the plan-based counters would otherwise shift every argument.

    FlashInfer picks its own grid, so decode_ctas is the cost model's assumption of
    ctas_per_row_head CTAs per (row, KV head), not a count read from a plan; tables that
    report plan-derived CTA work show no number for FlashInfer.
    """
    _check_common(num_sms, head_dim, kv_dtype_bytes)
    if not ctas_per_row_head > 0:
        raise ValueError(f"ctas_per_row_head must be > 0, got {ctas_per_row_head}")
    batch = int(np.asarray(step.seq_lens).size)
    decode_ctas = max(1, math.ceil(batch * int(num_kv_heads) * float(ctas_per_row_head)))
    return StepCounters(
        launches=1,
        decode_ctas=decode_ctas,
        decode_ctas_per_sm=decode_ctas / int(num_sms),
        useful_kv_bytes=useful_kv_bytes(step, num_kv_heads, head_dim, kv_dtype_bytes),
        merge_bytes=0,
        merge_launches=0,
    )


def summarize(counters: list[StepCounters]) -> dict:
    """Per-step means, in the units of Table 4 (MiB = 2**20 bytes)."""
    if not counters:
        raise ValueError("summarize: need the counters of at least one step, got an empty list")
    steps = len(counters)
    return {
        "launches_per_step": sum(c.launches for c in counters) / steps,
        "decode_ctas_per_sm": sum(c.decode_ctas_per_sm for c in counters) / steps,
        "useful_kv_mib": sum(c.useful_kv_bytes for c in counters) / steps / MIB,
        "merge_mib": sum(c.merge_bytes for c in counters) / steps / MIB,
        "merge_launches": sum(c.merge_launches for c in counters) / steps,
    }
