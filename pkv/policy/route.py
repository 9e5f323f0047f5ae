"""A step route: everything the engines need to run one decode step, decided by the policy.

One vocabulary for routes. ``name`` is what results count steps by ("flashinfer",
"persistentkv_bucket", "persistentkv_workqueue"); the rest says how PersistentKV runs it: the split
count and rule, the bucket mode, and the merge of split states. Engines read a StepRoute and never
decide any of it again.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from pkv.pipeline.schedule import SPLIT_KINDS, SplitPolicy, workqueue_split_policy

ROUTE_FLASHINFER = "flashinfer"
ROUTE_BUCKET = "persistentkv_bucket"  # length buckets: one launch per distinct length (or one masked)
ROUTE_WORKQUEUE = "persistentkv_workqueue"  # the compact workqueue of non-empty (row, KV head, split) tasks
ROUTES = (ROUTE_FLASHINFER, ROUTE_BUCKET, ROUTE_WORKQUEUE)

BUCKET_MODES = ("exact", "masked")

# How the split states of a (row, KV head) are merged. A pair with one split is written to `out`
# by the decode kernel whatever the merge kind: that is execution, not a choice.
MERGE_LAUNCH = "launch"  # a merge launch after the decode launch
MERGE_FUSED = "fused"  # the last task of a pair to finish merges (completion counters)
MERGE_CLUSTER = "cluster"  # a pair's splits are one thread-block cluster, merged through DSMEM
MERGE_KINDS = (MERGE_LAUNCH, MERGE_FUSED, MERGE_CLUSTER)
MAX_CLUSTER_SPLITS = 16  # kMaxClusterSplits in csrc/decode_constants.h

# The user-facing names of the PersistentKV schedules (conf/engine: `route`), each a route name
# and a bucket mode. The one place they are read.
SCHEDULES = {"workqueue": (ROUTE_WORKQUEUE, "exact"), "bucket_exact": (ROUTE_BUCKET, "exact"),
             "bucket_masked": (ROUTE_BUCKET, "masked")}

# Split counts of a PersistentKV engine built without a calibration (tests, scripts).
DEFAULT_BUCKET_SPLITS = 32
DEFAULT_WORKQUEUE_SPLITS = 20


@dataclass(frozen=True)
class StepRoute:
    """What one decode step runs. Built once per policy and shared by the steps that take it."""

    name: str
    num_splits: int = 0  # PersistentKV: the fixed split count, or the balanced rule's budget; 0 on FlashInfer
    split_kind: str = "fixed"  # workqueue: pkv.pipeline.schedule.SplitPolicy.kind
    bucket_mode: str = "exact"  # bucket route: one launch per distinct length, or one masked launch
    merge: str = MERGE_LAUNCH
    target_ctas: int = 0  # balanced rule: the task budget; 0 = rows with tokens x Hkv x num_splits

    def __post_init__(self):
        if self.name not in ROUTES:
            raise ValueError(f"StepRoute.name must be one of {ROUTES}, got {self.name!r}")
        if self.name == ROUTE_FLASHINFER:
            if self.num_splits != 0:
                raise ValueError(f"StepRoute: FlashInfer plans its own splits; num_splits must be 0, "
                                 f"got {self.num_splits!r}")
            return
        if isinstance(self.num_splits, bool) or not isinstance(self.num_splits, int) or self.num_splits < 1:
            raise ValueError(f"StepRoute.num_splits must be an integer >= 1 on {self.name}, got {self.num_splits!r}")
        if self.split_kind not in SPLIT_KINDS:
            raise ValueError(f"StepRoute.split_kind must be one of {SPLIT_KINDS}, got {self.split_kind!r}")
        if self.bucket_mode not in BUCKET_MODES:
            raise ValueError(f"StepRoute.bucket_mode must be one of {BUCKET_MODES}, got {self.bucket_mode!r}")
        if self.merge not in MERGE_KINDS:
            raise ValueError(f"StepRoute.merge must be one of {MERGE_KINDS}, got {self.merge!r}")
        if self.merge == MERGE_CLUSTER:
            if self.name != ROUTE_BUCKET:
                raise ValueError("StepRoute: the cluster merge is a bucket-route merge (workqueue tasks of one "
                                 f"pair are not one cluster), got route {self.name!r}")
            if self.num_splits > MAX_CLUSTER_SPLITS:
                raise ValueError(f"StepRoute: the cluster merge takes at most {MAX_CLUSTER_SPLITS} splits (one "
                                 f"thread-block cluster per (row, KV head)), got num_splits={self.num_splits}")

    @property
    def engine(self) -> str:
        return "flashinfer" if self.name == ROUTE_FLASHINFER else "persistentkv"

    @functools.cached_property
    def split_policy(self) -> SplitPolicy:
        """The workqueue's split rule (pkv.pipeline.schedule.workqueue_split_policy)."""
        return workqueue_split_policy(self.split_kind, self.num_splits, self.target_ctas)

    @functools.cached_property
    def split_rule(self) -> str | None:
        """The workqueue's split rule as results count steps by: "fixed", or "balanced" with its task
        budget ("balanced (396 CTAs)"); None on other routes (a bucket's grid is the fixed count)."""
        if self.name != ROUTE_WORKQUEUE:
            return None
        if self.split_kind == "fixed":
            return "fixed"
        return f"{self.split_kind} ({self.target_ctas} CTAs)" if self.target_ctas else self.split_kind


FLASHINFER_ROUTE = StepRoute(ROUTE_FLASHINFER)


def describe_route(route: StepRoute) -> str:
    """The route as results name its code: the schedule (a key of SCHEDULES), and a merge other than
    the launch."""
    if route.name == ROUTE_FLASHINFER:
        return ROUTE_FLASHINFER
    schedule = "workqueue" if route.name == ROUTE_WORKQUEUE else f"bucket_{route.bucket_mode}"
    return schedule + ("" if route.merge == MERGE_LAUNCH else f"+{route.merge}_merge")


@dataclass(frozen=True)
class KernelVariants:
    """How PersistentKV routes run, set per run (an ablation picks a bucket mode or a merge); the
    policy builds them into every route it returns."""

    bucket_mode: str = "exact"
    merge: str = MERGE_LAUNCH

    def __post_init__(self):
        if self.bucket_mode not in BUCKET_MODES:
            raise ValueError(f"KernelVariants.bucket_mode must be one of {BUCKET_MODES}, got {self.bucket_mode!r}")
        if self.merge not in MERGE_KINDS:
            raise ValueError(f"KernelVariants.merge must be one of {MERGE_KINDS}, got {self.merge!r}")

    def route(self, name: str, num_splits: int, split_kind: str) -> StepRoute:
        """A PersistentKV route with these variants."""
        return StepRoute(name, int(num_splits), split_kind, self.bucket_mode, self.merge)
