"""Small decode cases for compute-sanitizer (memcheck, racecheck): every kernel and route once,
and the device-planned step (both planners and merges, block table and page lists, eager and
replayed), then the launched merges again with their read states discarded
(engine.discard_merged_states).

    compute-sanitizer --tool memcheck python scripts/sanitize_cases.py
    compute-sanitizer --tool racecheck python scripts/sanitize_cases.py
"""

from __future__ import annotations

import numpy as np
import torch

from pkv import ops
from pkv.engines.device_step import MERGES, PLANNERS, DeviceDecodeStep, GraphedDecodeStep
from pkv.engines.persistentkv import PersistentKVEngine
from pkv.measure.kv_data import make_kv_pages, make_queries
from pkv.page_table import PageLists
from pkv.pipeline.pages import assign_pages
from pkv.pipeline.step import build_step
from pkv.policy.choose import PinnedRoutePolicy
from pkv.policy.route import MERGE_CLUSTER, MERGE_FUSED, ROUTE_BUCKET, ROUTE_WORKQUEUE, StepRoute
from pkv.shape import ModelShape


def main() -> None:
    lengths = [1, 17, 33, 640, 3000]
    clustered = ()  # the cluster merge needs sm_90
    if torch.cuda.get_device_capability()[0] >= 9:
        clustered = ((StepRoute(ROUTE_BUCKET, 16, merge=MERGE_CLUSTER), 2),
                     (StepRoute(ROUTE_BUCKET, 5, bucket_mode="masked", merge=MERGE_CLUSTER), 3))
    for group, dtype in ((4, "float16"), (8, "bfloat16"), (1, "float16")):
        shape = ModelShape(num_qo_heads=8 * group, num_kv_heads=8)
        assignment = assign_pages(lengths, 16, 0.5, seed=group)
        step = build_step(0, np.arange(len(lengths)), np.asarray(lengths, dtype=np.int32), assignment.pages, 16)
        k, v = make_kv_pages(assignment.num_physical_pages, shape, 16, dtype, "cuda", seed=group)
        q = make_queries(len(lengths), shape, dtype, "cuda", seed=group + 1)
        for route, stages in ((StepRoute(ROUTE_WORKQUEUE, 8), 2),
                              (StepRoute(ROUTE_WORKQUEUE, 8, merge=MERGE_FUSED), 2),
                              (StepRoute(ROUTE_BUCKET, 16, bucket_mode="masked"), 2),
                              (StepRoute(ROUTE_BUCKET, 16, bucket_mode="masked", merge=MERGE_FUSED), 2),
                              (StepRoute(ROUTE_BUCKET, 1), 2),
                              (StepRoute(ROUTE_BUCKET, 8), 2),
                              (StepRoute(ROUTE_BUCKET, 1), 3),
                              (StepRoute(ROUTE_WORKQUEUE, 2), 4),
                              *clustered):
            engine = PersistentKVEngine(shape, policy=PinnedRoutePolicy(route), stages=stages)
            out = engine.run(q, k, v, engine.plan(step))
            torch.cuda.synchronize()
            assert not torch.isnan(out).any()
        device_step_cases(shape, step, q, k, v)
        if group == 4:
            discard_cases(shape, step, q, k, v)
    print("sanitize cases ran")


def discard_cases(shape, step, q, k, v) -> None:
    """The routes whose merge is the merge kernel, and the device-planned step, with the merge
    dropping the L2 lines of the partial states it read (a process setting, put back after)."""
    before = ops.discard_merged_states(True)
    try:
        for route in (StepRoute(ROUTE_WORKQUEUE, 8), StepRoute(ROUTE_BUCKET, 16, bucket_mode="masked"),
                      StepRoute(ROUTE_BUCKET, 8)):
            engine = PersistentKVEngine(shape, policy=PinnedRoutePolicy(route))
            out = engine.run(q, k, v, engine.plan(step))
            torch.cuda.synchronize()
            assert not torch.isnan(out).any()
        device_step_cases(shape, step, q, k, v)
    finally:
        ops.discard_merged_states(before)


def device_step_cases(shape, step, q, k, v) -> None:
    """The device-planned step over both page-table forms, eager and from a graph replayed with
    other lengths (shorter rows, a row of one token): each planner and merge under the fixed
    rule, and the plan kernel under the balanced rule (a budget of 40 tasks)."""
    table = torch.from_numpy(step.block_table).cuda()
    lens = torch.from_numpy(step.seq_lens).cuda()
    lists = PageLists.from_step(step, "cuda")
    shorter = torch.clamp(lens // 3, min=1)
    configs = [dict(planner=p, merge=m) for p in PLANNERS for m in MERGES]
    configs += [dict(planner="plan_kernel", merge=m, split_kind="balanced", target_ctas=40) for m in MERGES]
    for config in configs:
        workspace = DeviceDecodeStep(shape, max_batch=step.batch_size, num_splits=8, **config)
        for page_table in (table, lists):
            out = workspace.run(q, k, v, page_table, lens, torch.empty_like(q), host_lens=step.seq_lens)
            graphed = GraphedDecodeStep(workspace, k, v, table.shape[1], debug_checks=True)
            graphed.run(q, page_table, lens)
            replayed = graphed.run(q, page_table, shorter)
            torch.cuda.synchronize()
            assert not torch.isnan(out).any() and not torch.isnan(replayed).any()


if __name__ == "__main__":
    main()
