"""Where a decode step's route is decided (paper 3.5).

Gates first: a group size the calibration did not open, a longest row shorter than the regime's
context gate, a regime whose calibrated route is FlashInfer. Then the regime's PersistentKV route
is estimated against FlashInfer and taken only when its estimated speedup reaches the regime's
margin (a no-regression margin). The decision is a complete StepRoute: engines run it as it is.

A workqueue step whose rows all have about one length (a uniform batch) takes fewer splits where
the calibration measured that faster (``Calibration.uniform_target_ctas``): its tasks are all one
size, so they finish wave by wave and a last wave that is mostly empty costs up to a fifth of the
step; fewer CTAs than one resident wave avoid it (docs/performance.md, "Split counts and waves
in the kernel benchmark"). Ragged batches keep the regime's split count, which their long rows
need.

A workqueue step one row dominates (a skewed step: ``is_skewed``) gives its rows splits by the
balanced rule where the calibration measured that faster (its regime's ``skew_target_ctas``):
under the fixed rule that row's S x Hkv tasks carry most of the step's bytes while the other rows'
tasks finish early, so the step ends on a partial wave of long tasks; the balanced rule cuts the
long row into as many tasks as its share of the budget. The budget is per regime: at B64 the
short rows' one-tile tasks are most of a step's tasks, at B4 the long row's (docs/performance.md,
"Which rule those B4 steps run").

A workqueue step whose rows are short for the regime's split count (an over-split step:
``is_over_split``) takes the same balanced rule where the calibration measured that faster too
(the regime's ``over_split_balanced``): the fixed rule cuts a row of fewer than S tiles into one
task per tile, so 64 rows of about 500 tokens become some 6,800 tasks of one or two tiles whose
Q loads, partial states and merge outweigh their reads (0.69x FlashInfer on the H200's held-out
steps of that kind, docs/performance.md); the balanced rule sizes tasks from the step's bytes, so
such a step gets about one task per (row, KV head) and, mostly, no merge.

A bucket step whose longest row is short for the regime's split count (a conversation turn of a
few hundred tokens at the B1 count of 32) takes fewer splits where its regime's
``bucket_tiles_per_split`` asks for several tiles a split (``bucket_split_count``): the bucket
planner cuts any row into min(S, tiles) splits, so such a row's CTAs would read one tile each and a
merge would follow.

A run that pins one schedule (the standalone PersistentKV engine of an ablation) uses
``PinnedRoutePolicy``: every step on one route, built from the same calibration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from pkv.pipeline.schedule import TILE_TOKENS
from pkv.policy.calibration import Calibration
from pkv.policy.estimator import VECTOR_MIN_ROWS, Estimator, total_tokens
from pkv.policy.regime import REGIMES, regime_of
from pkv.policy.route import (
    DEFAULT_BUCKET_SPLITS,
    DEFAULT_WORKQUEUE_SPLITS,
    FLASHINFER_ROUTE,
    ROUTE_BUCKET,
    ROUTE_FLASHINFER,
    ROUTE_WORKQUEUE,
    SCHEDULES,
    KernelVariants,
    StepRoute,
    describe_route,
)


class RouteDecision(NamedTuple):
    """What choose() decided and why. Immutable, and a tuple: one is built on every decode step,
    in a fifth of the time a frozen dataclass takes."""

    route: StepRoute
    basis: str  # the gate that decided, "estimate", or "pinned"
    estimates: Mapping[str, float]  # route name -> estimated us; empty when a gate decided
    speedup: float = 0.0  # FlashInfer's estimate over the candidate's; 0 when a gate decided
    margin: float = 0.0  # the speedup the candidate needed

    @property
    def reason(self) -> str:
        # Built on demand: formatting it in choose() would cost every decode step.
        if self.basis != "estimate":
            return self.basis
        relation = ">=" if self.speedup >= self.margin else "<"
        return f"estimate {self.speedup:.3f}x {relation} margin {self.margin:.2f}x"


# Gate decisions carry no per-step data, so each is built once (with a read-only empty mapping:
# every step that a gate decides shares the same object).
_NO_ESTIMATES = MappingProxyType({})
GATE_GROUP = RouteDecision(FLASHINFER_ROUTE, "gate: G", _NO_ESTIMATES)
GATE_CONTEXT = RouteDecision(FLASHINFER_ROUTE, "gate: context", _NO_ESTIMATES)
GATE_REGIME = RouteDecision(FLASHINFER_ROUTE, "gate: regime", _NO_ESTIMATES)

# A batch is uniform when its shortest row holds at least this fraction of its longest row's tokens.
UNIFORM_LENGTH_FRACTION = 0.9
# A uniform step takes the split count whose CTAs come nearest the calibrated target only where
# they lie within this factor of it either way. The H200 measured half the target (128 CTAs) and
# twice it (512) 9-18% slower than the target (256) on uniform batches; between those, untested.
UNIFORM_CTA_TOLERANCE = 1.5


def is_skewed(batch: int, longest: int, tokens: int) -> bool:
    """Whether a step of ``batch`` rows, the longest of ``longest`` tokens and ``tokens`` in all,
    is skewed: more than one row, and the longest holds more than 2/3 of the tokens (more than
    twice all the other rows together; in integers, so the boundary is exact)."""
    return batch > 1 and 3 * longest > 2 * tokens


# A step is over-split when its mean row holds fewer than this many tiles per split of the regime's
# split count: the fixed rule's tasks then hold one or two tiles. On every synthetic family of the
# held-out seeds the fixed rule's mean task holds 1.3-1.5 tiles on over-split steps and at least
# 4.8 on all others, so the boundary sits in a wide gap.
OVER_SPLIT_TILES = 2


def is_over_split(batch: int, tokens: int, num_splits: int) -> bool:
    """Whether a step of ``batch`` rows and ``tokens`` tokens in all is over-split by the fixed
    rule at ``num_splits``: more than one row, and the mean row under OVER_SPLIT_TILES tiles per
    split (in integers, so the boundary is exact)."""
    return batch > 1 and tokens < OVER_SPLIT_TILES * TILE_TOKENS * num_splits * batch


def uniform_split_count(lens, longest: int, num_kv_heads: int, num_splits: int, target_ctas: int) -> int:
    """The split count of a workqueue step under the uniform cap: the count whose CTAs come nearest
    ``target_ctas`` (B x Hkv x S, S >= 1), where those CTAs lie within UNIFORM_CTA_TOLERANCE of the
    target, the count is below ``num_splits`` and the rows are uniform (UNIFORM_LENGTH_FRACTION);
    else ``num_splits``. ``lens`` is a list of ints or an array, ``longest`` its largest."""
    pairs = len(lens) * num_kv_heads
    capped = max(1, (2 * target_ctas + pairs) // (2 * pairs))  # target / pairs, rounded half up
    ctas = capped * pairs
    if capped >= num_splits or not target_ctas / UNIFORM_CTA_TOLERANCE <= ctas <= target_ctas * UNIFORM_CTA_TOLERANCE:
        return num_splits
    shortest = min(lens) if isinstance(lens, list) else int(lens.min())
    return capped if shortest >= UNIFORM_LENGTH_FRACTION * longest else num_splits


def bucket_split_count(longest: int, num_splits: int, tiles_per_split: int) -> int:
    """The split count of a bucket step whose longest row holds ``longest`` tokens: ``num_splits``
    where its splits would hold at least ``tiles_per_split`` tiles each (or that is 1), else the
    largest power of two of splits that do (at least one). A power of two, so that the graphs a
    server captures for short rows stay few: one per count, whatever the lengths."""
    if tiles_per_split <= 1:
        return num_splits
    fits = -(-longest // TILE_TOKENS) // tiles_per_split  # splits of at least tiles_per_split tiles
    if fits >= num_splits:
        return num_splits
    return 1 << (fits.bit_length() - 1) if fits > 1 else 1


def _lengths(step) -> tuple:
    """(the step's lengths, the longest): Python ints below VECTOR_MIN_ROWS rows, where they count
    fastest, else the NumPy array."""
    lens = np.asarray(step.seq_lens)
    if len(lens) == 0:
        raise ValueError("RoutePolicy.choose: StepBatch.seq_lens is empty; a decode step needs a row")
    if len(lens) < VECTOR_MIN_ROWS:
        lens = lens.tolist()
        return lens, max(lens)
    return lens, int(lens.max())  # builtins.max would walk the array element by element


def _gate_of(rules: tuple, longest: int) -> RouteDecision | None:
    """A regime's context and route gates (its resolved rules, RoutePolicy._regimes) on a step whose
    longest row holds ``longest`` tokens: the gate decision, or None."""
    if longest < rules[0]:
        return GATE_CONTEXT
    return GATE_REGIME if rules[1] is None else None


class RoutePolicy:
    """The calibrated policy of one attention shape and one run's kernel variants."""

    def __init__(self, calib: Calibration, *, num_kv_heads: int, group_size: int, head_dim: int,
                 kv_dtype_bytes: int = 2, variants: KernelVariants = KernelVariants()):
        self.calib = calib
        self.group_size = int(group_size)
        self.variants = variants
        self._estimator = Estimator(calib, num_kv_heads=num_kv_heads, group_size=group_size, head_dim=head_dim,
                                    kv_dtype_bytes=kv_dtype_bytes)
        self._num_kv_heads = int(num_kv_heads)
        self._capped: dict[tuple[StepRoute, int], StepRoute] = {}  # (route, splits) -> the route with them
        self._group_supported = self.group_size in calib.supported_group_sizes
        # Everything per regime is resolved once here: choose() runs on every decode step.
        self._regimes = {}
        for name in REGIMES:
            params = calib.regime(name)
            candidate = None
            if params.route != ROUTE_FLASHINFER:
                candidate = variants.route(params.route, params.num_splits, calib.workqueue_split_kind)
            # The uniform cap and the skew rule: the fixed rule's workqueue only (the balanced rule
            # has its own budget).
            fixed = candidate is not None and candidate.name == ROUTE_WORKQUEUE and candidate.split_kind == "fixed"
            uniform_ctas = calib.uniform_target_ctas if fixed else 0
            skew_route, over_split = None, False
            if fixed and params.skew_target_ctas:
                skew_route = dataclasses.replace(candidate, split_kind="balanced", target_ctas=params.skew_target_ctas)
                over_split = params.over_split_balanced
            # The short-row rule: the bucket route only (the workqueue's rows have the rules above).
            bucket_tiles = params.bucket_tiles_per_split if candidate is not None and candidate.name == ROUTE_BUCKET \
                else 1
            self._regimes[name] = (params.min_context_tokens, candidate, params.margin, uniform_ctas, skew_route,
                                   over_split, bucket_tiles)

    def candidate(self, batch_size: int) -> StepRoute | None:
        """The PersistentKV route a step of this many rows is estimated on; None where its regime
        stays on FlashInfer."""
        return self._regimes[regime_of(batch_size)][1]

    @property
    def group_supported(self) -> bool:
        return self._group_supported

    @property
    def estimator(self) -> Estimator:
        return self._estimator

    def regime_rules(self, regime: str) -> tuple:
        """What choose() reads for a regime's steps: (context gate, candidate route or None, margin,
        the uniform cap's CTA target or 0, the skew rule's route or None, whether over-split steps
        take it, the short-row rule's tiles per split or 1). The native policy (pkv.policy.native)
        is written from these."""
        return self._regimes[regime]

    def choose(self, step) -> RouteDecision:
        if not self._group_supported:
            return GATE_GROUP
        # _lengths, inlined: choose() runs on every decode step, and the call cost it 0.1 us of 2-9.
        lens = np.asarray(step.seq_lens)
        batch = len(lens)
        if batch == 0:
            raise ValueError("RoutePolicy.choose: StepBatch.seq_lens is empty; a decode step needs a row")
        if batch < VECTOR_MIN_ROWS:
            lens = lens.tolist()
            longest = max(lens)
        else:
            longest = int(lens.max())
        rules = self._regimes[regime_of(batch)]
        gated = _gate_of(rules, longest)
        if gated is not None:
            return gated
        margin = rules[2]
        tokens = total_tokens(lens)
        candidate = self._ruled(rules, lens, batch, longest, tokens)
        estimator = self._estimator
        flashinfer_us = estimator.total_us(lens, FLASHINFER_ROUTE, tokens)
        candidate_us = estimator.total_us(lens, candidate, tokens)
        speedup = flashinfer_us / candidate_us
        chosen = candidate if speedup >= margin else FLASHINFER_ROUTE
        return RouteDecision(chosen, "estimate", {ROUTE_FLASHINFER: flashinfer_us, candidate.name: candidate_us},
                             speedup, margin)

    def _ruled(self, rules: tuple, lens, batch: int, longest: int, tokens: int) -> StepRoute:
        """The regime's candidate as its step rules leave it for these lengths: the balanced rule
        on a skewed or over-split step where the regime takes it, else the uniform cap's count; on
        the bucket route, the short-row rule's count."""
        _, candidate, _, uniform_ctas, skew_route, over_split, bucket_tiles = rules
        if skew_route is not None and (is_skewed(batch, longest, tokens)
                                       or over_split and is_over_split(batch, tokens, candidate.num_splits)):
            return skew_route
        splits = candidate.num_splits
        if uniform_ctas:
            splits = uniform_split_count(lens, longest, self._num_kv_heads, splits, uniform_ctas)
        elif bucket_tiles > 1:
            splits = bucket_split_count(longest, splits, bucket_tiles)
        return candidate if splits == candidate.num_splits else self._capped_route(candidate, splits)

    def ruled_route(self, step) -> StepRoute | None:
        """The route choose() estimates ``step`` on, gates and estimate aside: the regime's candidate
        under its step rules. None where the regime's route is FlashInfer."""
        lens, longest = _lengths(step)
        rules = self._regimes[regime_of(len(lens))]
        if rules[1] is None:
            return None
        return self._ruled(rules, lens, len(lens), longest, total_tokens(lens))

    def gate(self, step) -> RouteDecision | None:
        """The gate that sends ``step`` to FlashInfer (choose()'s first tests), or None where its
        route is estimated. Cheaper than choose() on a gated step, and it needs nothing but the
        lengths, so a caller that decides in C++ (pkv.policy.native) skips the call on such steps."""
        if not self._group_supported:
            return GATE_GROUP
        lens, longest = _lengths(step)
        return _gate_of(self._regimes[regime_of(len(lens))], longest)

    def _capped_route(self, route: StepRoute, splits: int) -> StepRoute:
        key = (route, splits)
        capped = self._capped.get(key)
        if capped is None:
            capped = self._capped[key] = dataclasses.replace(route, num_splits=splits)
        return capped


def pinned_route(schedule: str, calib: Calibration | None, variants: KernelVariants = KernelVariants()) -> StepRoute:
    """The route of a PersistentKV engine that runs one schedule on every step ("workqueue",
    "bucket_exact", "bucket_masked"): its split count is the calibrated one of the regime that
    schedule serves (B1 for buckets, 8+ rows for the workqueue), or the default without one."""
    if schedule not in SCHEDULES:
        raise ValueError(f"persistentkv schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    name, bucket_mode = SCHEDULES[schedule]
    if name == ROUTE_BUCKET:
        splits = calib.single_row.num_splits if calib else DEFAULT_BUCKET_SPLITS
    else:
        splits = calib.many_rows.num_splits if calib else DEFAULT_WORKQUEUE_SPLITS
    split_kind = calib.workqueue_split_kind if calib else "fixed"
    return StepRoute(name, splits, split_kind, bucket_mode, variants.merge)


class PinnedRoutePolicy:
    """Every step on one route."""

    def __init__(self, route: StepRoute):
        if route.name == ROUTE_FLASHINFER:
            raise ValueError("PinnedRoutePolicy: pin a PersistentKV route; FlashInfer is its own engine")
        self.route = route
        self._decision = RouteDecision(route, "pinned", _NO_ESTIMATES)

    def candidate(self, batch_size: int) -> StepRoute:
        return self.route

    def choose(self, step) -> RouteDecision:
        return self._decision


class RuledRoutePolicy:
    """Every step on the route its regime's step rules give it (RoutePolicy.ruled_route), with the
    gates and the estimate left out: what a calibration probe times against FlashInfer to place a
    gate, so the probe measures the route the policy would run on each step it would open. A step
    of fewer rows can fall in a regime the policy keeps on FlashInfer; it runs ``fallback`` (the
    probed regime's candidate) where one is given."""

    def __init__(self, policy: RoutePolicy, fallback: StepRoute | None = None):
        self.policy = policy
        self.fallback = fallback

    def candidate(self, batch_size: int) -> StepRoute | None:
        return self.policy.candidate(batch_size)

    def choose(self, step) -> RouteDecision:
        route = self.policy.ruled_route(step) or self.fallback
        if route is None:
            raise ValueError(f"RuledRoutePolicy: the B{len(step.seq_lens)} regime's route is FlashInfer; "
                             "open it (Calibration.with_regime(..., route=...)) to probe it")
        return RouteDecision(route, "rules", _NO_ESTIMATES)


def describe_policy(policy) -> str:
    """What an engine driven by ``policy`` runs, for its ``implementation`` record."""
    if isinstance(policy, PinnedRoutePolicy):
        return describe_route(policy.route)
    return "routed"
