"""The device-planned step's host-side length check, which needs no GPU."""

from __future__ import annotations

import numpy as np
import pytest

from pkv.engines.device_step import check_lengths


def test_lengths_the_table_addresses_pass():
    check_lengths(np.array([1, 16, 17, 4096, 0]), 256, 16)


@pytest.mark.parametrize("lengths, row, length", [([4097], 0, 4097), ([5, 10, 99999, 5000], 2, 99999),
                                                  ([3, -1], 1, -1)])
def test_the_first_bad_row_is_named_with_its_length_and_the_limit(lengths, row, length):
    with pytest.raises(ValueError, match=rf"row {row} has length {length}; the block table's 256 pages of 16 "
                                         rf"tokens address 0\.\.4096"):
        check_lengths(np.array(lengths), 256, 16)


def test_routed_graph_buckets_and_buffers_on_any_device():
    import torch

    from pkv.engines.routed_graphs import RoutedGraphStep
    from pkv.shape import ModelShape

    shape = ModelShape()
    k = torch.zeros(4, shape.num_kv_heads, 16, shape.head_dim, dtype=torch.float16)
    routed = RoutedGraphStep(None, shape, k, k, max_pages=8, batch_buckets=(8, 1, 2))
    assert routed.batch_buckets == (1, 2, 8)
    assert [routed.bucket_of(b) for b in (1, 2, 3, 8)] == [1, 2, 8, 8]
    with pytest.raises(ValueError, match="batch 9 exceeds the largest bucket 8"):
        routed.bucket_of(9)
    with pytest.raises(ValueError, match=r"write the step into buffers\(3\) first"):
        routed.run(np.array([5, 6, 7]))
    buffers = routed.buffers(3)
    assert buffers.q.shape == (3, shape.num_qo_heads, shape.head_dim) and buffers.block_table.shape == (3, 8)
    assert routed.buffers(5).q.data_ptr() == buffers.q.data_ptr()  # one bucket, one set of tensors
    with pytest.raises(ValueError, match="batch_buckets"):
        RoutedGraphStep(None, shape, k, k, max_pages=8, batch_buckets=())
