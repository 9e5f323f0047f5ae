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
