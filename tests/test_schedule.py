"""Plans: tiles, row-local split ranges, length buckets and the compact workqueue."""

import numpy as np
import pytest

from pkv.pipeline.schedule import (
    TILE_TOKENS,
    SplitPolicy,
    nonempty_splits,
    plan_buckets,
    plan_workqueue,
    row_splits,
    row_tiles,
    split_range,
)

EDGE_LENGTHS = [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 639, 640, 641]


def test_row_tiles_edges():
    lens = np.array([1, 31, 32, 33, 64, 65], dtype=np.int32)
    assert TILE_TOKENS == 32
    assert row_tiles(lens).tolist() == [1, 1, 1, 2, 2, 3]
    assert row_tiles(lens).dtype == np.int32
    with pytest.raises(ValueError, match="-3"):
        row_tiles(np.array([4, -3]))
    with pytest.raises(ValueError, match="dtype"):
        row_tiles(np.array([1.5]))


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 31, 32, 33, 100])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 4, 8, 20, 32, 64])
def test_split_ranges_partition_row_in_order(n, num_splits):
    ranges = [split_range(n, num_splits, s) for s in range(num_splits)]
    owned = [r for r in ranges if r[0] < r[1]]
    # Non-empty splits come first, contiguous, and cover [0, n) exactly.
    assert ranges[: len(owned)] == owned
    assert all(b >= n for b, _ in ranges[len(owned):])
    covered = [t for b, e in owned for t in range(b, e)]
    assert covered == list(range(n))
    assert len(owned) == int(nonempty_splits(n, num_splits))


def test_split_range_rows_shorter_than_split_count():
    # 3 tiles over 8 splits: one tile each for splits 0..2, the rest own nothing.
    assert [split_range(3, 8, s) for s in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]
    # 5 tiles over 4 splits: tps = 2, so split 3 begins at 6 >= 5 and is empty.
    assert [split_range(5, 4, s) for s in range(4)] == [(0, 2), (2, 4), (4, 5), (6, 5)]
    # A row of length 33 has two tiles, the second holding one token.
    n = int(row_tiles(33))
    assert [split_range(n, 20, s) for s in range(3)] == [(0, 1), (1, 2), (2, 2)]


def test_split_range_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_splits"):
        split_range(4, 0, 0)
    with pytest.raises(ValueError, match="split"):
        split_range(4, 2, 2)
    with pytest.raises(ValueError, match="n_tiles"):
        split_range(-1, 2, 0)


def check_workqueue(plan, seq_lens, num_kv_heads):
    tasks = plan.tasks
    n = row_tiles(seq_lens)
    batch = len(seq_lens)
    assert tasks.dtype == np.int32 and tasks.shape[1] == 5 and tasks.flags.c_contiguous
    assert plan.split_offsets.dtype == np.int32
    assert plan.split_offsets.shape == (batch * num_kv_heads + 1,)
    row, kvh, split, begin, end = tasks.T.astype(np.int64)
    assert np.all(begin < end), "only non-empty intervals are tasks"
    assert np.all((kvh >= 0) & (kvh < num_kv_heads)) and np.all((row >= 0) & (row < batch))

    # Every (row, kvh, tile) exactly once.
    cover = np.zeros((batch, num_kv_heads, int(n.max())), dtype=np.int64)
    for r, h, b, e in zip(row, kvh, begin, end):
        cover[r, h, b:e] += 1
    for r in range(batch):
        assert np.all(cover[r, :, : n[r]] == 1)
        assert np.all(cover[r, :, n[r]:] == 0)

    # Slots: each task owns a distinct slot of its pair; every pair has a task.
    pair = row * num_kv_heads + kvh
    offsets = plan.split_offsets.astype(np.int64)
    counts = np.diff(offsets)
    assert np.all(counts >= 1)
    assert np.all(split < counts[pair])
    slot = offsets[pair] + split
    assert sorted(slot.tolist()) == list(range(plan.num_tasks))
    assert plan.max_splits == int(counts.max())

    # Within a pair, split s covers the contract's row-local range for S = its split count.
    for t in range(plan.num_tasks):
        assert (begin[t], end[t]) == split_range(n[row[t]], counts[pair[t]], split[t])

    # Longest first, ties by slot.
    key = list(zip((-(end - begin)).tolist(), slot.tolist()))
    assert key == sorted(key)
    return counts.reshape(batch, num_kv_heads)


def random_lengths(rng, batch):
    pool = np.array(EDGE_LENGTHS + [2048, 8191, 8192, 8193])
    lens = rng.integers(1, 5000, size=batch)
    edge = rng.random(batch) < 0.4
    lens[edge] = rng.choice(pool, size=int(edge.sum()))
    return lens.astype(np.int32)


@pytest.mark.parametrize("kind", ["fixed", "balanced"])
def test_workqueue_covers_every_tile_once(kind, make_step):
    rng = np.random.default_rng(20260622 if kind == "fixed" else 20260623)
    for _ in range(25):
        batch = int(rng.integers(1, 12))
        hkv = int(rng.choice([1, 2, 4, 8]))
        lens = random_lengths(rng, batch)
        policy = SplitPolicy(
            kind=kind, num_splits=int(rng.integers(1, 40)), max_splits=int(rng.integers(1, 70)),
            target_ctas=int(rng.choice([0, 16, 200])), min_tiles_per_split=int(rng.integers(1, 4)),
        )
        plan = plan_workqueue(make_step(lens), hkv, 4, policy)
        counts = check_workqueue(plan, lens, hkv)
        assert np.all(counts == counts[:, :1]), "every KV head of a row gets the same splits"
        n = row_tiles(lens).astype(np.int64)
        if kind == "fixed":
            expected = nonempty_splits(n, np.minimum(policy.num_splits, n))
        else:
            target = policy.target_ctas or batch * hkv * policy.num_splits
            per_task = max(policy.min_tiles_per_split, -(-int(n.sum()) * hkv // target))
            expected = nonempty_splits(n, np.clip(-(-n // per_task), 1, policy.max_splits))
        assert counts[:, 0].tolist() == expected.tolist()
        assert row_splits(lens, hkv, policy).tolist() == expected.tolist()


def test_workqueue_edge_lengths_with_many_splits(make_step):
    lens = np.array(EDGE_LENGTHS, dtype=np.int32)
    plan = plan_workqueue(make_step(lens), 2, 4, SplitPolicy(num_splits=32))
    counts = check_workqueue(plan, lens, 2)
    # Rows shorter than the split count get one split per tile.
    assert counts[:, 0].tolist() == row_tiles(lens).tolist()


def test_workqueue_single_split_has_no_merge(make_step):
    lens = np.array([100, 5000, 17], dtype=np.int32)
    plan = plan_workqueue(make_step(lens), 8, 4, SplitPolicy(num_splits=1))
    assert plan.max_splits == 1
    assert plan.num_tasks == 3 * 8
    assert np.array_equal(np.diff(plan.split_offsets), np.ones(24))


def test_balanced_gives_long_rows_more_splits(make_step):
    # The paper's future-work case: 8K and 64K rows in one batch.
    lens = np.array([8192, 65536, 16384, 32768], dtype=np.int32)
    hkv = 8
    plan = plan_workqueue(make_step(lens), hkv, 4, SplitPolicy(kind="balanced", num_splits=16, max_splits=128))
    counts = check_workqueue(plan, lens, hkv)[:, 0]
    # 512 tasks over 30720 (row, kvh) tiles: 60 tiles per task, so ceil(tiles / 60) splits.
    assert counts.tolist() == [5, 35, 9, 18]
    sizes = plan.tasks[:, 4] - plan.tasks[:, 3]
    assert sizes.max() <= 2 * sizes.min()
    fixed = plan_workqueue(make_step(lens), hkv, 4, SplitPolicy(kind="fixed", num_splits=16))
    fixed_sizes = fixed.tasks[:, 4] - fixed.tasks[:, 3]
    assert fixed_sizes.max() / fixed_sizes.min() > sizes.max() / sizes.min()


def test_balanced_respects_bounds(make_step):
    lens = np.array([32, 1_000_000], dtype=np.int32)
    plan = plan_workqueue(make_step(lens), 1, 4, SplitPolicy(kind="balanced", target_ctas=1000, max_splits=64))
    counts = check_workqueue(plan, lens, 1)[:, 0]
    assert counts.tolist() == [1, 64]
    plan = plan_workqueue(make_step(lens), 1, 4, SplitPolicy(kind="balanced", target_ctas=1000, min_tiles_per_split=4096))
    assert check_workqueue(plan, lens, 1)[:, 0].tolist() == [1, 8]


def test_split_policy_validation():
    with pytest.raises(ValueError, match="kind"):
        SplitPolicy(kind="greedy")
    with pytest.raises(ValueError, match="num_splits"):
        SplitPolicy(num_splits=0)
    with pytest.raises(ValueError, match="target_ctas"):
        SplitPolicy(target_ctas=-1)
    with pytest.raises(ValueError, match="max_splits"):
        SplitPolicy(max_splits=True)


def test_exact_buckets_one_launch_per_length(make_step):
    lens = np.array([4096, 100, 4096, 33, 100, 65536], dtype=np.int32)
    plan = plan_buckets(make_step(lens), 8, 4, num_splits=32, mode="exact")
    assert plan.mode == "exact" and plan.num_kv_heads == 8 and plan.group_size == 4
    got = [(l.route_len, l.row_indices.tolist(), l.num_splits) for l in plan.launches]
    assert got == [
        (65536, [5], 32),
        (4096, [0, 2], 32),
        (100, [1, 4], 4),  # 4 tiles: splits past the tile count cannot own work
        (33, [3], 2),
    ]
    for launch in plan.launches:
        assert launch.row_indices.dtype == np.int32
        assert np.all(lens[launch.row_indices] == launch.route_len)


def test_masked_bucket_is_one_launch_with_row_local_bounds(make_step):
    lens = np.array([4096, 100, 33, 65536], dtype=np.int32)
    plan = plan_buckets(make_step(lens), 8, 4, num_splits=32, mode="masked")
    assert len(plan.launches) == 1
    launch = plan.launches[0]
    assert launch.row_indices.tolist() == [0, 1, 2, 3]
    assert launch.route_len == 65536 and launch.num_splits == 32
    assert launch.num_slots(8) == 4 * 8 * 32
    # Short rows keep their own bounds: the 33-token row owns only splits 0 and 1.
    owned = [split_range(int(row_tiles(33)), launch.num_splits, s) for s in range(launch.num_splits)]
    assert sum(e > b for b, e in owned) == 2


def test_masked_bucket_caps_splits_by_longest_row(make_step):
    plan = plan_buckets(make_step([40, 64]), 2, 4, num_splits=32, mode="masked")
    assert plan.launches[0].num_splits == 2


def test_plans_reject_bad_input(make_step):
    step = make_step([100, 200])
    with pytest.raises(ValueError, match="mode"):
        plan_buckets(step, 8, 4, 32, mode="padded")
    with pytest.raises(ValueError, match="num_splits"):
        plan_buckets(step, 8, 4, 0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        plan_workqueue(step, 0, 4, SplitPolicy())

    class Bad:
        seq_lens = np.array([5, 0], dtype=np.int32)

    with pytest.raises(ValueError, match="seq_len"):
        plan_workqueue(Bad(), 8, 4, SplitPolicy())


def test_workqueue_covers_a_large_batch_with_64_splits(make_step):
    """B=64 rows of 8K to 64K tokens over Hkv=8 with 64 splits, both split kinds: every tile
    once, and the split counts the per-row rule gives."""
    rng = np.random.default_rng(20260622)
    step = make_step(rng.integers(8192, 65536, size=64))
    for kind in ("fixed", "balanced"):
        policy = SplitPolicy(kind=kind, num_splits=64)
        counts = check_workqueue(plan_workqueue(step, 8, 4, policy), step.seq_lens, 8)
        assert counts[:, 0].tolist() == row_splits(step.seq_lens, 8, policy).tolist()
