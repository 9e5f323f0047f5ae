"""The roofline-style cost of a route on one decode step (paper 3.5):

    T_r = KVBytes / beta * max(1, C_min / C_r) + L_r * lambda + MergeBytes_r / beta + Plan_r

beta is the measured streaming read bandwidth, C_r the decode CTAs per SM of the route's plan,
C_min the occupancy below which a step cannot reach bandwidth, L_r the route's launches, lambda
the cost of one launch, and Plan_r the route's measured host planning per step (on a GPU whose
kernels take tens of microseconds it decides as many steps as the kernels do). C_min and lambda
are fitted to device times (pkv.policy.fits), so the fit leaves Plan_r out.

The counts come from the rows' lengths as Python ints, the same counts pkv.pipeline.counters reads
off a built plan (tests hold the two equal), because the policy runs this on every decode step
and building plans costs more than the decision is worth. Batches of more than
VECTOR_MIN_ROWS rows come as a NumPy array and are counted with array operations: the same
integers, in a tenth of the time at 256 rows. The estimate models the exact bucket
mode and the merge launch whatever variants a run uses: they are ablations of the same route.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from pkv.pipeline.counters import PARTIAL_STATE_BYTES
from pkv.pipeline.schedule import TILE_TOKENS, balanced_tiles_per_task, nonempty_splits, row_splits, row_tiles
from pkv.policy.calibration import Calibration
from pkv.policy.route import ROUTE_BUCKET, ROUTE_FLASHINFER, ROUTE_WORKQUEUE, StepRoute


# From this many rows on, a step's lengths are counted as one NumPy array (choose() hands them so).
VECTOR_MIN_ROWS = 32


_LOW_32 = (1 << 32) - 1
# The fixed rule's per-length table stops here (32 MiB); steps with longer rows are counted without it.
FIXED_TABLE_MAX_TOKENS = 1 << 22


def total_tokens(lens) -> int:
    return int(lens.sum(dtype=np.int64)) if isinstance(lens, np.ndarray) else sum(lens)


def _long_row_splits(long_tiles: list[int], tiles_per_task: int, max_splits: int) -> tuple[int, int]:
    """The balanced rule (pkv.pipeline.schedule.row_splits) on the rows it splits: (splits beyond
    the one every live row has, slots of the rows that merge) for rows of ``long_tiles`` tiles,
    each longer than ``tiles_per_task`` (a shorter row is one split). A row asks ceil(n / per_task)
    splits, at most max_splits, of which ceil(n / ceil(n / s)) own tiles (schedule.nonempty_splits)."""
    extra = merged = 0
    for n in long_tiles:
        k = -(-n // -(-n // min(-(-n // tiles_per_task), max_splits)))
        extra += k - 1
        if k > 1:
            merged += k
    return extra, merged


@dataclass(frozen=True)
class RouteEstimate:
    """T_r and the terms it is made of, all times in microseconds."""

    route: str
    num_splits: int
    kv_bytes: int
    ctas_per_sm: float
    occupancy_factor: float  # max(1, C_min / C_r)
    launches: int
    merge_bytes: int
    kv_us: float  # KVBytes / beta * occupancy_factor
    launch_us: float  # L_r * lambda
    merge_us: float  # MergeBytes_r / beta
    plan_us: float  # host planning charged to the route
    total_us: float


class Estimator:
    """T_r for one calibration and attention shape."""

    def __init__(self, calib: Calibration, *, num_kv_heads: int, group_size: int, head_dim: int,
                 kv_dtype_bytes: int = 2):
        for name, value in (("num_kv_heads", num_kv_heads), ("group_size", group_size), ("head_dim", head_dim),
                            ("kv_dtype_bytes", kv_dtype_bytes)):
            if int(value) < 1:
                raise ValueError(f"Estimator: {name} must be >= 1, got {value}")
        self.calib = calib
        self.hkv = int(num_kv_heads)
        self._bytes_per_token = self.hkv * int(head_dim) * 2 * int(kv_dtype_bytes)
        self._bytes_per_slot = int(group_size) * (int(head_dim) + 2) * PARTIAL_STATE_BYTES
        self._bytes_per_us = calib.beta_gbps * 1e3  # GB/s = 1e3 bytes per microsecond
        self._us_per_token = self._bytes_per_token / self._bytes_per_us
        self._us_per_slot = self._bytes_per_slot / self._bytes_per_us
        self._occupancy_ctas = calib.c_min * calib.num_sms
        self._fixed_tables: dict[int, np.ndarray] = {}  # split count -> per-length table (_fixed_rule_table)

    # ---- counts --------------------------------------------------------------------------------
    def counts(self, lens: list[int], route: StepRoute) -> tuple[int, int, int]:
        """(decode CTAs, launches, merged partial-state slots) of the route's plan for these rows."""
        hkv = self.hkv
        if isinstance(lens, np.ndarray) and route.name != ROUTE_FLASHINFER:
            return self._counts_vector(lens.astype(np.int64, copy=False), route)
        if route.name == ROUTE_FLASHINFER:
            return max(1, math.ceil(len(lens) * hkv * self.calib.flashinfer_ctas_per_row_head)), 1, 0
        if route.name == ROUTE_BUCKET:
            ctas = launches = merged = 0
            # One row (every B1 step) needs no grouping by length: Counter costs a microsecond.
            for length, rows in (((lens[0], 1),) if len(lens) == 1 else Counter(lens).items()):
                s = min(route.num_splits, -(-length // TILE_TOKENS))
                ctas += rows * hkv * s
                launches += 1
                if s > 1:
                    launches += 1
                    merged += rows * hkv * s
            return ctas, launches, merged
        if route.name == ROUTE_WORKQUEUE:
            policy = route.split_policy
            if policy.kind == "fixed":
                # The fixed rule in one pass over the rows (lists of tiles and splits cost twice as much
                # at B8, on every decode step): ceil(n / ceil(n / S)) splits of a row of n > S tiles.
                cap = policy.num_splits
                total = merged_rows = 0
                for length in lens:
                    tiles = -(-length // TILE_TOKENS)
                    k = tiles if tiles <= cap else -(-tiles // -(-tiles // cap))
                    total += k
                    if k > 1:
                        merged_rows += k
                return hkv * total, 2 if merged_rows else 1, hkv * merged_rows
            tiles = [-(-length // TILE_TOKENS) for length in lens]
            live = sum(1 for n in tiles if n)
            per_task = balanced_tiles_per_task(sum(tiles), live, hkv, policy)
            extra, merged_rows = _long_row_splits([n for n in tiles if n > per_task], per_task, policy.max_splits)
            return hkv * (live + extra), 2 if merged_rows else 1, hkv * merged_rows
        raise ValueError(f"Estimator: unknown route {route.name!r}")

    def _counts_vector(self, lens: np.ndarray, route: StepRoute) -> tuple[int, int, int]:
        """counts() of a NumPy array of lengths: the same integers as the loops above."""
        hkv = self.hkv
        if route.name == ROUTE_BUCKET:
            lengths, rows = np.unique(lens, return_counts=True)
            s = np.minimum(route.num_splits, -(-lengths // TILE_TOKENS))
            split = s > 1
            return (int(hkv * (rows * s).sum()), int(len(lengths) + split.sum()),
                    int(hkv * (rows * s)[split].sum()))
        if route.name == ROUTE_WORKQUEUE:
            policy = route.split_policy
            packed = self._fixed_rule_counts(lens, policy.num_splits) if policy.kind == "fixed" else None
            if packed is not None:
                total, single = packed & _LOW_32, packed >> 32
                merged_rows = total - single  # single-split rows need no merge
                return hkv * total, 2 if merged_rows else 1, hkv * merged_rows
            if policy.kind == "fixed":  # rows past the table's reach: the planner's own rule
                splits = row_splits(lens, hkv, policy).astype(np.int64)
                merged_rows = int(splits[splits > 1].sum())
                return hkv * int(splits.sum()), 2 if merged_rows else 1, hkv * merged_rows
            # The balanced rule: only the rows longer than a task's tiles are split (_long_row_splits),
            # found with three array operations. Each costs about a microsecond whatever its length,
            # and this runs on every skewed decode step (a skewed B64 step: 4.6 us, not 10.4).
            tiles = (lens + (TILE_TOKENS - 1)) // TILE_TOKENS
            live = int(np.count_nonzero(tiles))
            per_task = balanced_tiles_per_task(int(tiles.sum()), live, hkv, policy)
            extra, merged_rows = _long_row_splits(tiles[tiles > per_task].tolist(), per_task, policy.max_splits)
            return hkv * (live + extra), 2 if merged_rows else 1, hkv * merged_rows
        raise ValueError(f"Estimator: unknown route {route.name!r}")

    def _fixed_rule_counts(self, lens: np.ndarray, num_splits: int) -> int | None:
        """The fixed rule's splits of these rows plus 2**32 per single-split row, in two array
        operations (each costs about a microsecond at any length, and this runs on every decode
        step): a gather from the per-length table, then one sum. None for a row past the table's
        reach (FIXED_TABLE_MAX_TOKENS)."""
        try:
            return int(self._fixed_rule_table(num_splits, 0)[lens].sum())
        except IndexError:  # a row longer than the table: grow it to cover the longest
            longest = int(lens.max())
            if longest >= FIXED_TABLE_MAX_TOKENS:
                return None
            return int(self._fixed_rule_table(num_splits, longest)[lens].sum())

    def _fixed_rule_table(self, num_splits: int, longest: int) -> np.ndarray:
        """Per length 0..N: the fixed rule's split count of a row of that length, plus 2**32 if
        it is one split, so one sum over a step's rows gives both the splits and the rows that need
        no merge. A row of n tiles gets ceil(n / ceil(n / S)) splits (n where n <= S). Built for
        lengths up to a power of two above ``longest`` (below FIXED_TABLE_MAX_TOKENS: 8 bytes a
        token), and rebuilt larger when a row outgrows it."""
        table = self._fixed_tables.get(num_splits)
        if table is None or table.shape[0] <= longest:
            splits = nonempty_splits(row_tiles(np.arange(1 << max(12, int(longest).bit_length()))), num_splits)
            table = splits.astype(np.int64) + ((splits == 1).astype(np.int64) << 32)
            self._fixed_tables[num_splits] = table
        return table

    def cost_constants(self) -> tuple[int, float, float, float, float, float, float, float]:
        """(Hkv, us a token, us a merged slot, the occupancy's CTAs, lambda, FlashInfer's CTAs a
        (row, KV head), each route's planning us): the doubles total_us computes with, in the order
        of the native policy's header (pkv.policy.native)."""
        calib = self.calib
        return (self.hkv, self._us_per_token, self._us_per_slot, self._occupancy_ctas, calib.lambda_us,
                calib.flashinfer_ctas_per_row_head, calib.flashinfer_plan_us, calib.persistentkv_plan_us)

    def plan_us(self, route: StepRoute) -> float:
        """The measured host planning per step charged to a route."""
        calib = self.calib
        return calib.flashinfer_plan_us if route.name == ROUTE_FLASHINFER else calib.persistentkv_plan_us

    # ---- times ---------------------------------------------------------------------------------
    def device_terms(self, lens: list[int], route: StepRoute) -> tuple[float, float, int, float]:
        """(KV read us at full occupancy, CTAs per SM, launches, merge us): the parts of T_r that
        do not depend on C_min or lambda, which the fits vary."""
        ctas, launches, merged = self.counts(lens, route)
        return (total_tokens(lens) * self._bytes_per_token / self._bytes_per_us, ctas / self.calib.num_sms, launches,
                merged * self._bytes_per_slot / self._bytes_per_us)

    def total_us(self, lens: list[int], route: StepRoute, tokens: int | None = None) -> float:
        """T_r, host planning included: what the route policy compares on every step. ``tokens``
        is total_tokens(lens) where the caller has it (it estimates two routes per step)."""
        ctas, launches, merged = self.counts(lens, route)
        occupancy = max(1.0, self._occupancy_ctas / ctas)
        tokens = total_tokens(lens) if tokens is None else tokens
        return (tokens * self._us_per_token * occupancy + launches * self.calib.lambda_us
                + merged * self._us_per_slot + self.plan_us(route))

    def estimate(self, lens: list[int], route: StepRoute) -> RouteEstimate:
        """T_r with its terms (reports and tests)."""
        ctas, launches, merged = self.counts(lens, route)
        kv_bytes = total_tokens(lens) * self._bytes_per_token
        ctas_per_sm = ctas / self.calib.num_sms
        occupancy = max(1.0, self.calib.c_min / ctas_per_sm)
        kv_us = kv_bytes / self._bytes_per_us * occupancy
        merge_bytes = merged * self._bytes_per_slot
        merge_us = merge_bytes / self._bytes_per_us
        launch_us = launches * self.calib.lambda_us
        plan_us = self.plan_us(route)
        return RouteEstimate(route=route.name, num_splits=route.num_splits, kv_bytes=kv_bytes,
                             ctas_per_sm=ctas_per_sm, occupancy_factor=occupancy, launches=launches,
                             merge_bytes=merge_bytes, kv_us=kv_us, launch_us=launch_us, merge_us=merge_us,
                             plan_us=plan_us, total_us=kv_us + launch_us + merge_us + plan_us)
