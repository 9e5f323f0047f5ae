"""torch.ops.pkv: loads the CUDA extension and registers fake kernels so the ops trace under
torch.compile. The launch ops mutate their output and scratch arguments and return nothing, so
their fake kernels are empty; run_plan returns a new output shaped like q. adaptive_step has none:
what it returns (a route, a plan of the step's size, an output or not) is decided on the host from
the step's lengths, which a traced graph does not hold."""

from __future__ import annotations

import functools

import torch

from pkv.build import ensure_built, ensure_host_built

# run_plan's merge_kind: how launches with more than one split merge them (MergeKind in
# csrc/step_plan.h): a merge_states launch, the fused completion-counter merge (pair_counters
# required), or the thread-block-cluster merge (bucket route only).
MERGE_LAUNCH, MERGE_FUSED, MERGE_CLUSTER = 0, 1, 2


def _run_plan_fake(q, k_pages, v_pages, meta, layout, sm_scale, stages, merge_kind, pair_counters):
    return torch.empty_like(q)


def _register_fakes() -> None:
    register = getattr(torch.library, "register_fake", None)  # torch >= 2.4
    if register is None:
        return
    for name in ("pkv::bucket_decode", "pkv::workqueue_decode", "pkv::merge_states", "pkv::plan_workqueue_on_device",
                 "pkv::run_workqueue_planned_on_device"):
        register(name)(lambda *args, **kwargs: None)
    register("pkv::run_plan")(_run_plan_fake)


@functools.lru_cache(maxsize=1)
def load() -> object:
    """Build (or reuse) the extension for this GPU and return torch.ops.pkv."""
    ensure_built()
    _register_fakes()
    return torch.ops.pkv


def discard_merged_states(enabled: bool) -> bool:
    """Whether the merge kernels of this process drop the partial states they have read from L2
    without writing them back (csrc DecodeArgs::discard_merged_states), for every launch made
    (or graph captured) after the call; the states are undefined after their merge. Returns the
    setting before the call."""
    return bool(load().set_discard_merged_states(bool(enabled)))


@functools.lru_cache(maxsize=1)
def load_planner() -> object:
    """torch.ops.pkv with the C++ step planner (plan_workqueue, plan_buckets): from the CUDA
    extension where there is a GPU, from the CPU-only planner library elsewhere."""
    if torch.cuda.is_available():
        return load()

    ensure_host_built()
    return torch.ops.pkv
