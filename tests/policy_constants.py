"""Calibrations and pinned routes the policy, engine and kernel tests share."""

from pkv.pipeline.schedule import SplitPolicy
from pkv.policy import Calibration, PinnedRoutePolicy, StepRoute
from pkv.policy.route import MERGE_CLUSTER, MERGE_FUSED, MERGE_LAUNCH, ROUTE_WORKQUEUE, SCHEDULES

# The paper's RTX 3060 constants (section 3.5) in the flat form of the first calibration files:
# the defaults of that form give every regime its paper value.
PAPER = Calibration.from_mapping({"gpu": "rtx3060", "num_sms": 28, "beta_gbps": 331.2, "lambda_us": 8.19,
                                  "c_min": 4.0}, "paper")
SHAPE = dict(num_kv_heads=8, group_size=4, head_dim=128)


def pinned(route: str = "workqueue", split_policy=None, bucket_num_splits: int = 32, fused_merge: bool = False,
           cluster_merge: bool = False) -> PinnedRoutePolicy:
    """A pinned policy from a schedule name and its split settings, as the kernel tests state them."""
    merge = MERGE_CLUSTER if cluster_merge else MERGE_FUSED if fused_merge else MERGE_LAUNCH
    name, bucket_mode = SCHEDULES[route]
    if name == ROUTE_WORKQUEUE:
        policy = split_policy or SplitPolicy()
        return PinnedRoutePolicy(StepRoute(name, policy.num_splits, policy.kind, merge=merge,
                                           target_ctas=policy.target_ctas))
    return PinnedRoutePolicy(StepRoute(name, bucket_num_splits, bucket_mode=bucket_mode, merge=merge))
