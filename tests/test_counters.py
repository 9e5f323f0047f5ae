"""Structural counters: the Table 4 arithmetic, checked by hand on small batches."""

import pytest

from pkv.pipeline.counters import (
    MIB,
    StepCounters,
    counters_for_buckets,
    counters_for_flashinfer,
    counters_for_workqueue,
    summarize,
)
from pkv.pipeline.schedule import SplitPolicy, plan_buckets, plan_workqueue

HKV, G, D = 8, 4, 128


# Eight distinct rows, two long and six short as in the bimodal trace, holding 140928
# tokens: 140928 * 8 heads * 128 * 2 (K, V) * 2 bytes = 550.5 MiB. Each row's tile count n
# keeps all 20 workqueue splits non-empty (n > 19 * ceil(n / 20)), as Table 4's 1280 needs.
TABLE4_LENS = [40960, 8320, 9600, 8960, 40320, 10240, 10880, 11648]


def test_table4_arithmetic_buckets(make_step):
    step = make_step(TABLE4_LENS)
    assert sum(TABLE4_LENS) == 140928
    plan = plan_buckets(step, HKV, G, num_splits=32, mode="exact")
    c = counters_for_buckets(plan, step, num_sms=28, head_dim=D)
    assert c.launches == 16 and c.merge_launches == 8
    assert c.decode_ctas == 8 * 8 * 32
    assert round(c.decode_ctas_per_sm, 1) == 73.1
    assert c.merge_bytes == 2048 * 4 * (128 + 2) * 4
    assert round(c.merge_bytes / MIB, 2) == 4.06
    assert c.useful_kv_bytes / MIB == 550.5


def test_table4_arithmetic_workqueue_and_flashinfer(make_step):
    step = make_step(TABLE4_LENS)
    plan = plan_workqueue(step, HKV, G, SplitPolicy(num_splits=20))
    c = counters_for_workqueue(plan, step, num_sms=28, head_dim=D)
    assert c.launches == 2 and c.merge_launches == 1
    assert c.decode_ctas == 1280
    assert round(c.decode_ctas_per_sm, 1) == 45.7
    assert round(c.merge_bytes / MIB, 2) == 2.54
    assert c.useful_kv_bytes / MIB == 550.5
    fi = counters_for_flashinfer(step, 28, D, num_kv_heads=HKV)
    assert (fi.launches, fi.merge_launches, fi.merge_bytes) == (1, 0, 0)
    assert fi.useful_kv_bytes == c.useful_kv_bytes
    assert fi.decode_ctas == 8 * 8


def test_small_batch_by_hand(make_step):
    # Tiles: 40 tokens -> 2, 100 -> 4. Hkv = 2, G = 4, d = 8: a slot is 4 * 10 * 4 = 160 bytes.
    step = make_step([40, 100, 100])
    kv = (40 + 100 + 100) * 2 * 8 * 2 * 2
    exact = counters_for_buckets(plan_buckets(step, 2, 4, 4, "exact"), step, num_sms=4, head_dim=8)
    # Launch len 100: 2 rows x 2 heads x 4 splits; launch len 40: 1 x 2 x 2 (capped by 2 tiles).
    assert exact == StepCounters(launches=4, decode_ctas=20, decode_ctas_per_sm=5.0, useful_kv_bytes=kv,
                                 merge_bytes=20 * 160, merge_launches=2)
    masked = counters_for_buckets(plan_buckets(step, 2, 4, 4, "masked"), step, num_sms=4, head_dim=8)
    # One 3 x 2 x 4 grid; the short row's empty splits still write neutral states.
    assert masked == StepCounters(launches=2, decode_ctas=24, decode_ctas_per_sm=6.0, useful_kv_bytes=kv,
                                  merge_bytes=24 * 160, merge_launches=1)
    wq = counters_for_workqueue(plan_workqueue(step, 2, 4, SplitPolicy(num_splits=4)), step, 4, 8)
    assert wq == StepCounters(launches=2, decode_ctas=20, decode_ctas_per_sm=5.0, useful_kv_bytes=kv,
                              merge_bytes=20 * 160, merge_launches=1)
    fused = counters_for_workqueue(plan_workqueue(step, 2, 4, SplitPolicy(num_splits=4)), step, 4, 8,
                                   fused_merge=True)
    assert (fused.launches, fused.merge_launches, fused.merge_bytes) == (1, 0, 20 * 160)
    # The cluster merge combines a pair's splits in distributed shared memory: no merge launch,
    # no partial state written.
    cluster = counters_for_buckets(plan_buckets(step, 2, 4, 4, "exact"), step, 4, 8, cluster_merge=True)
    assert (cluster.launches, cluster.merge_launches, cluster.merge_bytes, cluster.decode_ctas) == (2, 0, 0, 20)


def test_single_split_pairs_write_no_partial_state(make_step):
    # 10 tokens is one tile, so that row's pairs write out directly and skip the merge.
    step = make_step([10, 100])
    c = counters_for_workqueue(plan_workqueue(step, 2, 4, SplitPolicy(num_splits=4)), step, 4, 8)
    assert c.decode_ctas == 2 * 1 + 2 * 4
    assert c.merge_bytes == 2 * 4 * 160
    one = counters_for_workqueue(plan_workqueue(step, 2, 4, SplitPolicy(num_splits=1)), step, 4, 8)
    assert (one.launches, one.merge_launches, one.merge_bytes) == (1, 0, 0)
    exact = counters_for_buckets(plan_buckets(step, 2, 4, 1, "exact"), step, 4, 8)
    assert (exact.launches, exact.merge_launches, exact.merge_bytes) == (2, 0, 0)





def test_flashinfer_needs_kv_heads_by_name(make_step):
    step = make_step([100])
    with pytest.raises(TypeError):
        counters_for_flashinfer(step, 28, D, 2)
    assert counters_for_flashinfer(step, 28, D, 2, num_kv_heads=8, ctas_per_row_head=2.0).decode_ctas == 16


def test_summarize_means_in_mib():
    a = StepCounters(launches=2, decode_ctas=10, decode_ctas_per_sm=1.0, useful_kv_bytes=MIB,
                     merge_bytes=2 * MIB, merge_launches=1)
    b = StepCounters(launches=4, decode_ctas=30, decode_ctas_per_sm=3.0, useful_kv_bytes=3 * MIB,
                     merge_bytes=0, merge_launches=0)
    assert summarize([a, b]) == {"launches_per_step": 3.0, "decode_ctas_per_sm": 2.0, "useful_kv_mib": 2.0,
                                 "merge_mib": 1.0, "merge_launches": 0.5}
    with pytest.raises(ValueError, match="empty"):
        summarize([])


def test_counters_reject_bad_arguments(make_step):
    step = make_step([100])
    plan = plan_buckets(step, HKV, G, 4)
    with pytest.raises(ValueError, match="num_sms"):
        counters_for_buckets(plan, step, 0, D)
    with pytest.raises(ValueError, match="head_dim"):
        counters_for_buckets(plan, step, 28, 0)
