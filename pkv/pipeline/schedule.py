"""Decode-step plans: length buckets and the compact workqueue (paper 3.3-3.4).

A plan is data. The CUDA kernels and the torch reference engine execute the same plan
objects, so the layouts here follow docs/architecture.md exactly: tiles of 32 tokens,
row-local split ranges, bucket grids (R, Hkv, S) and workqueue tasks
(row, kvh, split, tile_begin, tile_end) with per-pair slot offsets.

Plan arrays are int32 and C-contiguous so they can be uploaded as they are; treat them as
read-only once a plan is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TILE_TOKENS = 32

BUCKET_MODES = ("exact", "masked")
SPLIT_KINDS = ("fixed", "balanced")


def _ceil_div(a, b):
    return -(-a // b)


def row_tiles(seq_lens) -> np.ndarray:
    """Tiles of KV work per row: ceil(seq_len / TILE_TOKENS), int32, same shape as the input."""
    lens = np.asarray(seq_lens)
    if lens.dtype.kind not in "iu":
        raise ValueError(f"seq_lens: expected integers, got dtype {lens.dtype}")
    if lens.size and int(lens.min()) < 0:
        raise ValueError(f"seq_lens: lengths must be >= 0, got {int(lens.min())}")
    return ((lens.astype(np.int64) + (TILE_TOKENS - 1)) // TILE_TOKENS).astype(np.int32)


def split_range(n_tiles: int, num_splits: int, split: int) -> tuple[int, int]:
    """Tile range [begin, end) of one row-local split.

    tiles_per_split = ceil(n / S); split s covers [s * tps, min((s + 1) * tps, n)).
    A split whose begin is >= n owns no tiles (end <= begin): the kernel writes the
    neutral partial state for it and loads nothing.
    """
    n, s_count, s = int(n_tiles), int(num_splits), int(split)
    if n < 0:
        raise ValueError(f"split_range: n_tiles must be >= 0, got {n}")
    if s_count < 1:
        raise ValueError(f"split_range: num_splits must be >= 1, got {s_count}")
    if not 0 <= s < s_count:
        raise ValueError(f"split_range: split must be in [0, {s_count}), got {s}")
    tiles_per_split = _ceil_div(n, s_count)
    begin = s * tiles_per_split
    return begin, min(begin + tiles_per_split, n)


def nonempty_splits(n_tiles, num_splits) -> np.ndarray:
    """How many of a row's S splits own at least one tile (vectorised over rows).

    Empty splits are always the trailing ones, so the non-empty ones are 0..k-1 with
    k = ceil(n / ceil(n / S)); k can be below S (n=5, S=4 gives tps=2 and k=3).
    """
    n = np.asarray(n_tiles, dtype=np.int64)
    s = np.asarray(num_splits, dtype=np.int64)
    tiles_per_split = np.maximum(_ceil_div(n, s), 1)
    return _ceil_div(n, tiles_per_split).astype(np.int32)


def _step_seq_lens(step) -> np.ndarray:
    lens = np.asarray(step.seq_lens)
    if lens.ndim != 1 or lens.size == 0:
        raise ValueError(f"StepBatch.seq_lens: expected a non-empty 1-D array, got shape {lens.shape}")
    if lens.dtype.kind not in "iu":
        raise ValueError(f"StepBatch.seq_lens: expected integers, got dtype {lens.dtype}")
    if int(lens.min()) < 1:
        raise ValueError(f"StepBatch.seq_lens: every row needs seq_len >= 1, got {int(lens.min())}")
    return lens


def _check_heads(num_kv_heads: int, group_size: int) -> None:
    if int(num_kv_heads) < 1:
        raise ValueError(f"num_kv_heads must be >= 1, got {num_kv_heads}")
    if int(group_size) < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")


def _int32_array(values, name: str, ndim: int) -> np.ndarray:
    arr = np.ascontiguousarray(values, dtype=np.int32)
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {arr.shape}")
    return arr


# --------------------------------------------------------------------------------------
# Length buckets


@dataclass(frozen=True, eq=False)
class BucketLaunch:
    """One decode launch over grid (R, Hkv, S); CTA (r, kvh, s) works on row_indices[r]."""

    row_indices: np.ndarray  # int32 [R]
    num_splits: int
    route_len: int

    def __post_init__(self):
        object.__setattr__(self, "row_indices", _int32_array(self.row_indices, "BucketLaunch.row_indices", 1))
        if self.row_indices.size == 0:
            raise ValueError("BucketLaunch.row_indices: a launch needs at least one row")
        if int(self.num_splits) < 1:
            raise ValueError(f"BucketLaunch.num_splits must be >= 1, got {self.num_splits}")
        if int(self.route_len) < 1:
            raise ValueError(f"BucketLaunch.route_len must be >= 1, got {self.route_len}")

    @property
    def num_rows(self) -> int:
        return int(self.row_indices.size)

    def num_slots(self, num_kv_heads: int) -> int:
        """Partial-state slots of this launch: slot (r * Hkv + kvh) * S + s."""
        return self.num_rows * int(num_kv_heads) * int(self.num_splits)


@dataclass(frozen=True, eq=False)
class BucketPlan:
    launches: tuple[BucketLaunch, ...]
    num_kv_heads: int
    group_size: int
    mode: str

    def __post_init__(self):
        object.__setattr__(self, "launches", tuple(self.launches))
        if self.mode not in BUCKET_MODES:
            raise ValueError(f"BucketPlan.mode must be one of {BUCKET_MODES}, got {self.mode!r}")
        _check_heads(self.num_kv_heads, self.group_size)


def plan_buckets(step, num_kv_heads: int, group_size: int, num_splits: int, mode: str = "exact") -> BucketPlan:
    """Length-bucket plan for one step.

    exact: one launch per distinct seq_len, longest first. masked: one launch over every row
    with route_len = max(seq_len); split bounds stay row-local, so short rows get empty
    (neutral) splits instead of padded reads. A launch's split count is capped by its route
    length's tile count, because splits past that can never own a tile.
    """
    if mode not in BUCKET_MODES:
        raise ValueError(f"plan_buckets: mode must be one of {BUCKET_MODES}, got {mode!r}")
    if int(num_splits) < 1:
        raise ValueError(f"plan_buckets: num_splits must be >= 1, got {num_splits}")
    _check_heads(num_kv_heads, group_size)
    lens = _step_seq_lens(step)

    if mode == "masked":
        route_len = int(lens.max())
        splits = min(int(num_splits), int(row_tiles(route_len)))
        launches = (BucketLaunch(np.arange(lens.size, dtype=np.int32), splits, route_len),)
    else:
        # Stable sort by descending length keeps rows of one bucket in ascending row order.
        order = np.argsort(-lens.astype(np.int64), kind="stable")
        sorted_lens = lens[order]
        starts = np.flatnonzero(np.r_[True, sorted_lens[1:] != sorted_lens[:-1]])
        bounds = np.r_[starts, lens.size]
        launches = []
        for b in range(starts.size):
            route_len = int(sorted_lens[bounds[b]])
            splits = min(int(num_splits), int(row_tiles(route_len)))
            launches.append(BucketLaunch(order[bounds[b]:bounds[b + 1]], splits, route_len))
        launches = tuple(launches)
    return BucketPlan(launches, int(num_kv_heads), int(group_size), mode)


# --------------------------------------------------------------------------------------
# Compact workqueue


@dataclass(frozen=True)
class SplitPolicy:
    """How many splits each row gets in the workqueue.

    fixed: splits_i = min(num_splits, row_tiles_i).
    balanced: every task holds about the same number of tiles, so 8K and 64K rows of one
    batch get different split counts:
        tiles_per_task = max(min_tiles_per_split, ceil(sum_i row_tiles_i * Hkv / target_ctas))
        splits_i = clamp(ceil(row_tiles_i / tiles_per_task), 1, max_splits)
    target_ctas = 0 means R * Hkv * num_splits, R the rows that have tokens: the task budget
    of the fixed policy, redistributed by length. (A row of length 0, such as a padding row of a
    CUDA graph's batch bucket, has no task and takes no share of the budget, so a graph replayed
    over a bucket plans a batch as the host plans it alone.)
    """

    kind: str = "fixed"
    num_splits: int = 20
    max_splits: int = 64
    target_ctas: int = 0
    min_tiles_per_split: int = 1

    def __post_init__(self):
        if self.kind not in SPLIT_KINDS:
            raise ValueError(f"SplitPolicy.kind must be one of {SPLIT_KINDS}, got {self.kind!r}")
        for name, low in (("num_splits", 1), ("max_splits", 1), ("target_ctas", 0), ("min_tiles_per_split", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"SplitPolicy.{name} must be an integer >= {low}, got {value!r}")


# The most splits the balanced rule gives a row of a route (above its num_splits where that is larger).
BALANCED_MAX_SPLITS = 64


def workqueue_split_policy(kind: str, num_splits: int, target_ctas: int = 0) -> SplitPolicy:
    """The split rule of a workqueue route (pkv.policy.route.StepRoute) or device step with this
    kind, split count (the balanced rule's budget) and task budget: the one place the balanced
    rule's cap on a row's splits is set."""
    return SplitPolicy(kind=kind, num_splits=num_splits, max_splits=max(BALANCED_MAX_SPLITS, num_splits),
                       target_ctas=target_ctas)


def max_workqueue_tasks(batch: int, num_kv_heads: int, policy: SplitPolicy) -> int:
    """The most tasks ``policy`` gives ``batch`` rows, whatever their lengths: what a device plan's
    buffers and decode grid hold (csrc/split_rule.h, max_workqueue_tasks). Balanced: a row's splits
    are at most tiles / tiles_per_task + 1 and tiles_per_task >= total tiles * Hkv / target, so the
    tasks are at most batch * Hkv + target."""
    pairs = int(batch) * int(num_kv_heads)
    if policy.kind == "fixed":
        return pairs * policy.num_splits
    target = policy.target_ctas or pairs * policy.num_splits
    return min(pairs * policy.max_splits, pairs + target)


def row_splits(seq_lens, num_kv_heads: int, policy: SplitPolicy) -> np.ndarray:
    """Non-empty splits per row (the same for every KV head of the row), int32 [B].

    This is the whole workqueue shape: plan_workqueue expands it into tasks, and the cost
    model reads task and slot counts from it without building the tasks.
    """
    n = row_tiles(seq_lens).astype(np.int64)
    return _row_splits_from_tiles(n, int(num_kv_heads), policy).astype(np.int32)


def balanced_tiles_per_task(total_tiles: int, live_rows: int, num_kv_heads: int, policy: SplitPolicy) -> int:
    """The balanced rule's tiles per task for a step of ``live_rows`` rows with tokens holding
    ``total_tiles`` tiles in all (SplitPolicy): the one place the rule's budget is divided, which
    the cost model's fast paths call with their own counts (csrc/split_rule.h is the kernel's)."""
    target = policy.target_ctas or max(int(live_rows), 1) * int(num_kv_heads) * policy.num_splits
    return max(policy.min_tiles_per_split, -(-int(total_tiles) * int(num_kv_heads) // target))


def _requested_splits(n: np.ndarray, num_kv_heads: int, policy: SplitPolicy) -> np.ndarray:
    if policy.kind == "fixed":
        return np.minimum(policy.num_splits, n)
    tiles_per_task = balanced_tiles_per_task(int(n.sum()), int(np.count_nonzero(n)), num_kv_heads, policy)
    return np.clip(_ceil_div(n, tiles_per_task), 1, policy.max_splits)


def _row_splits_from_tiles(n: np.ndarray, num_kv_heads: int, policy: SplitPolicy) -> np.ndarray:
    requested = _requested_splits(n, num_kv_heads, policy)
    # Requested splits past ceil(n / ceil(n / S)) would own no tiles; keep only the others.
    return _ceil_div(n, _ceil_div(n, np.maximum(requested, 1)))


@dataclass(frozen=True, eq=False)
class WorkqueuePlan:
    """Compact tasks (row, kvh, split, tile_begin, tile_end), longest first.

    Pair p = row * Hkv + kvh owns slots split_offsets[p] .. split_offsets[p+1] - 1 and its
    task for split s writes slot split_offsets[p] + s. max_splits is the largest number of
    splits any pair has; 1 means no merge launch.
    """

    tasks: np.ndarray  # int32 [T, 5]
    split_offsets: np.ndarray  # int32 [B * Hkv + 1]
    num_kv_heads: int
    group_size: int
    max_splits: int

    def __post_init__(self):
        tasks = _int32_array(self.tasks, "WorkqueuePlan.tasks", 2)
        if tasks.shape[1] != 5:
            raise ValueError(f"WorkqueuePlan.tasks: expected shape [T, 5], got {tasks.shape}")
        offsets = _int32_array(self.split_offsets, "WorkqueuePlan.split_offsets", 1)
        if offsets.size < 2 or offsets[0] != 0:
            raise ValueError(f"WorkqueuePlan.split_offsets: expected [0, ...] of length B * Hkv + 1, got {offsets[:4]}")
        _check_heads(self.num_kv_heads, self.group_size)
        object.__setattr__(self, "tasks", tasks)
        object.__setattr__(self, "split_offsets", offsets)

    @property
    def num_tasks(self) -> int:
        return int(self.tasks.shape[0])

    @property
    def num_pairs(self) -> int:
        return int(self.split_offsets.size - 1)

    @property
    def num_slots(self) -> int:
        return int(self.split_offsets[-1])


def plan_workqueue(step, num_kv_heads: int, group_size: int, policy: SplitPolicy) -> WorkqueuePlan:
    """Compact workqueue plan for one step; runs on the host each decode step.

    Only non-empty intervals become tasks. Ordering is longest first, ties by slot. Instead
    of sorting T tasks, this sorts at most 2B groups: every task of a row has length
    tiles_per_split except the last split of each pair (the tail), so a row forms one group
    of full-length tasks and one of tails. Inside a group, tasks are already in slot order,
    and among equal lengths row order is slot order. Each group expands into Hkv blocks of
    consecutive splits; every task column is then one repeat over blocks.
    """
    _check_heads(num_kv_heads, group_size)
    hkv = int(num_kv_heads)
    n = row_tiles(_step_seq_lens(step)).astype(np.int64)
    k = _row_splits_from_tiles(n, hkv, policy)
    tasks, split_offsets = _workqueue_tasks(n, k, hkv)
    return WorkqueuePlan(tasks, split_offsets, hkv, int(group_size), int(k.max()))


def _workqueue_tasks(n: np.ndarray, k: np.ndarray, hkv: int) -> tuple[np.ndarray, np.ndarray]:
    """The tasks and split offsets of rows of ``n`` tiles and ``k`` splits (0 for a row without
    tiles, which gets no task), longest first, ties by slot (plan_workqueue's docstring)."""
    batch = n.size
    tps = _ceil_div(n, np.maximum(k, 1))
    tail = n - (k - 1) * tps  # in 1..tps (0 for a row without tiles)
    tail_differs = tail != tps

    # Group g < B: splits [0, count) of row g, length tps. Group B + i: the tail split of
    # row i alone, present only when it is shorter (otherwise it is part of group i).
    g_len = np.concatenate((tps, tail))
    g_count = np.concatenate((k - tail_differs, tail_differs))
    g_first = np.concatenate((np.zeros_like(k), k - 1))
    g_row = np.concatenate((np.arange(batch), np.arange(batch)))
    order = np.argsort(g_row - g_len * batch, kind="stable")
    order = order[g_count[order] > 0]

    b_group = np.repeat(order, hkv)
    b_count = g_count[b_group]
    b_row = g_row[b_group]
    num_tasks = int(b_count.sum())

    tasks = np.empty((num_tasks, 5), dtype=np.int32)
    tasks[:, 0] = np.repeat(b_row.astype(np.int32), b_count)
    tasks[:, 1] = np.repeat(np.arange(b_group.size, dtype=np.int32) % hkv, b_count)
    # split = first + position inside the block = task index - (block start - first).
    block_base = (np.cumsum(b_count) - b_count - g_first[b_group]).astype(np.int32)
    np.subtract(np.arange(num_tasks, dtype=np.int32), np.repeat(block_base, b_count), out=tasks[:, 2])
    np.multiply(tasks[:, 2], np.repeat(tps[b_row].astype(np.int32), b_count), out=tasks[:, 3])
    np.add(tasks[:, 3], np.repeat(g_len[b_group].astype(np.int32), b_count), out=tasks[:, 4])

    split_offsets = np.zeros(batch * hkv + 1, dtype=np.int32)
    np.cumsum(np.repeat(k.astype(np.int32), hkv), dtype=np.int32, out=split_offsets[1:])
    return tasks, split_offsets


def plan_workqueue_device_order(seq_lens, num_kv_heads: int, group_size: int, policy: SplitPolicy | int,
                                max_tokens: int = 2**31 - 1, row_tokens=None) -> WorkqueuePlan:
    """The plan csrc/device_plan.cu writes on the GPU, as data: ``plan_workqueue``'s split rule
    (``policy``, or a fixed split count) and its tasks in its order (longest first by task length,
    a row's full-length splits and its shorter tail apart, ties by slot), over lengths clamped to
    ``max_tokens`` (a block table's reach) and to ``row_tokens`` where given (each row's page list
    times the page size), the balanced rule's total over the clamped lengths, and rows of length
    0 without tasks. On lengths within the table it is ``plan_workqueue``'s plan exactly. The
    reference engine runs it (``ReferenceEngine(planner="device")``), so the CPU checks the device
    plan's logic against float64, and the GPU tests hold the kernel to it exactly."""
    _check_heads(num_kv_heads, group_size)
    if not isinstance(policy, SplitPolicy):
        policy = SplitPolicy(kind="fixed", num_splits=int(policy))
    hkv = int(num_kv_heads)
    lens = np.clip(np.asarray(seq_lens, dtype=np.int64), 0, int(max_tokens))
    if row_tokens is not None:
        lens = np.maximum(np.minimum(lens, np.asarray(row_tokens, dtype=np.int64)), 0)
    n = _ceil_div(lens, TILE_TOKENS)
    requested = np.maximum(_requested_splits(n, hkv, policy), 1)
    k = np.where(n > 0, _ceil_div(n, np.maximum(_ceil_div(n, requested), 1)), 0)
    tasks, split_offsets = _workqueue_tasks(n, k, hkv)
    return WorkqueuePlan(tasks, split_offsets, hkv, int(group_size), max(int(k.max()), 1))
