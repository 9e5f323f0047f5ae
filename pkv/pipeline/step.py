"""One decode step's host-side metadata, in both paged forms (docs/architecture.md, StepBatch).

The native block table (PersistentKV) and FlashInfer's indptr / indices / last-page lengths are
built from the same page lists in one pass, so every engine reads identical physical pages.
``build_step`` runs inside the timed wall step: it is a handful of numpy calls per step, with a
Python loop only over the B row slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import numpy as np

_INT32_MAX = int(np.iinfo(np.int32).max)


@dataclass(frozen=True)
class StepBatch:
    step: int
    request_ids: np.ndarray  # int64 [B]
    seq_lens: np.ndarray  # int32 [B], including this step's token
    block_table: np.ndarray  # int32 [B, max_pages]; entries past ceil(seq_len / P) are 0
    page_size: int
    kv_indptr: np.ndarray  # int32 [B + 1]
    kv_indices: np.ndarray  # int32 [sum pages]
    kv_last_page_len: np.ndarray  # int32 [B], in 1..P

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max())

    @property
    def num_pages_used(self) -> int:
        return int(self.kv_indptr[-1])


def build_step(
    step: int,
    request_ids: Sequence[int] | np.ndarray,
    seq_lens: Sequence[int] | np.ndarray,
    page_lists: Sequence[np.ndarray],
    page_size: int,
) -> StepBatch:
    """Build the step's metadata; row ``i`` reads the first ``ceil(seq_lens[i] / P)`` entries of
    ``page_lists[i]`` (its physical pages in logical order)."""
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size <= 0:
        raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
    page_size = int(page_size)
    ids = np.array(request_ids, dtype=np.int64)  # a copy: callers may reuse their buffer
    lens64 = np.asarray(seq_lens, dtype=np.int64)
    batch = lens64.shape[0]
    if ids.ndim != 1 or lens64.ndim != 1 or ids.shape[0] != batch or len(page_lists) != batch:
        raise ValueError(
            f"request_ids, seq_lens and page_lists must be 1-D with one entry per row, got "
            f"{ids.shape}, {lens64.shape} and {len(page_lists)} page lists"
        )
    if batch == 0:
        raise ValueError("a decode step needs at least one active row")
    if int(lens64.min()) < 1 or int(lens64.max()) > _INT32_MAX:
        i = int(np.flatnonzero((lens64 < 1) | (lens64 > _INT32_MAX))[0])
        raise ValueError(f"seq_lens[{i}] (request {int(ids[i])}) must be in 1..{_INT32_MAX}, got {int(lens64[i])}")

    num_pages = (lens64 + (page_size - 1)) // page_size
    counts = num_pages.tolist()
    block_table = np.zeros((batch, max(counts)), dtype=np.int32)
    for row, (pages, n) in enumerate(zip(page_lists, counts)):
        if len(pages) < n:
            raise ValueError(
                f"row {row} (request {int(ids[row])}) needs {n} pages for seq_len={int(lens64[row])} "
                f"at page_size={page_size} but owns {len(pages)}"
            )
        block_table[row, :n] = pages[:n]
    # Row slices of one table: the FlashInfer form cannot drift from the block table.
    kv_indices = np.concatenate([block_table[row, :n] for row, n in enumerate(counts)])
    kv_indptr = np.fromiter(accumulate(counts, initial=0), dtype=np.int32, count=batch + 1)
    last_page_len = (lens64 - (num_pages - 1) * page_size).astype(np.int32)
    return StepBatch(
        step=int(step),
        request_ids=ids,
        seq_lens=lens64.astype(np.int32),
        block_table=block_table,
        page_size=page_size,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        kv_last_page_len=last_page_len,
    )
