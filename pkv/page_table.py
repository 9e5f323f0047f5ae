"""How a decode step on the GPU names each row's pages: a block table, or page lists.

A block table is an int32 tensor [B, max_pages] (vLLM's form): row r's pages are its row. Page
lists are FlashInfer's and SGLang's form (``paged_kv_indptr`` / ``paged_kv_indices``): row r's
pages are ``indices[indptr[r]:indptr[r + 1]]``, so no row is padded to the longest. The device
step (pkv.engines.device_step) reads either in place; this module owns what each form allows a
row to address, on the host and on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PageLists:
    """Each row's pages as a slice of one flat list.

    ``host_indptr`` is the caller's host copy of ``indptr`` where it has one (a serving scheduler
    builds the lists on the host): eager calls then check lengths without a device-to-host copy."""

    indptr: torch.Tensor  # int32 [B + 1] on the device, non-decreasing from 0
    indices: torch.Tensor  # int32 [>= indptr[B]] on the device: physical page ids
    host_indptr: np.ndarray | None = None

    @property
    def batch_size(self) -> int:
        return int(self.indptr.shape[0]) - 1

    @classmethod
    def from_step(cls, step, device) -> "PageLists":
        """The lists of a pkv.pipeline.step.StepBatch (the pages its block table holds), uploaded."""
        indptr = np.ascontiguousarray(step.kv_indptr, dtype=np.int32)
        return cls(torch.from_numpy(indptr).to(device), torch.from_numpy(
            np.ascontiguousarray(step.kv_indices, dtype=np.int32)).to(device), indptr)


def check_page_table(table, batch: int, device, where: str) -> None:
    """Refuse a page table of the wrong form, dtype, batch or device, naming what it got."""
    if isinstance(table, PageLists):
        indptr, indices = table.indptr, table.indices
        if (indptr.dim() != 1 or indptr.shape[0] != batch + 1 or indptr.dtype != torch.int32
                or indptr.device != device):
            raise ValueError(f"{where}: page_table.indptr must be int32 [{batch + 1}] on {device}, got "
                             f"{indptr.dtype} {tuple(indptr.shape)} on {indptr.device}")
        # At least one entry: a row with an empty list looks entry 0 up and discards it, so the
        # kernels' page lookup needs no check of its own.
        if indices.dim() != 1 or indices.shape[0] < 1 or indices.dtype != torch.int32 or indices.device != device:
            raise ValueError(f"{where}: page_table.indices must be int32 [num_entries >= 1] on {device}, got "
                             f"{indices.dtype} {tuple(indices.shape)} on {indices.device}")
        if table.host_indptr is not None and np.shape(table.host_indptr) != (batch + 1,):
            raise ValueError(f"{where}: page_table.host_indptr must have {batch + 1} entries, got "
                             f"{np.shape(table.host_indptr)}")
        return
    if not isinstance(table, torch.Tensor):
        raise ValueError(f"{where}: page_table must be a block table tensor or PageLists, got {type(table).__name__}")
    if table.dim() != 2 or table.shape[0] != batch or table.dtype != torch.int32 or table.device != device:
        raise ValueError(f"{where}: block_table must be int32 [{batch}, max_pages] on {device}, got "
                         f"{table.dtype} {tuple(table.shape)} on {table.device}")


def host_row_pages(table, where: str = "page_table") -> int | np.ndarray:
    """The entries each row may address, on the host: a block table's width (one int for every
    row), or each row's list length (one synchronization where the caller gave no host copy).
    Page lists whose indptr would send a row outside ``indices`` are refused, naming the row."""
    if not isinstance(table, PageLists):
        return int(table.shape[1])
    indptr = table.host_indptr if table.host_indptr is not None else table.indptr.cpu().numpy()
    return list_lengths(indptr, int(table.indices.shape[0]), where)


def list_lengths(indptr, entries: int, where: str = "page_table") -> np.ndarray:
    """Each row's page-list length from a host indptr over ``entries`` flat entries; an indptr that
    would send a row outside them is refused, naming the row."""
    indptr = np.asarray(indptr, dtype=np.int64)
    # A slice difference and one reduction: np.diff and a comparison with .any() cost 2-3 us more
    # on every eager step over page lists.
    counts = indptr[1:] - indptr[:-1]
    if indptr[0] < 0 or indptr[-1] > entries or (counts.size and counts.min() < 0):
        bad = np.flatnonzero((indptr[1:] < indptr[:-1]) | (indptr[1:] > entries) | (indptr[:-1] < 0))
        row = int(bad[0]) if bad.size else 0
        raise ValueError(f"{where}: page_table.indptr must rise from 0 or more to at most the {entries} entries of "
                         f"indices; row {row} spans indptr[{row}]={int(indptr[row])} .. "
                         f"indptr[{row + 1}]={int(indptr[row + 1])}")
    return counts


def host_row_entries(host_table, row: int, count: int) -> np.ndarray:
    """The first ``count`` page ids of a row from a host page table: a block table, or page lists
    as the pair (indptr, indices)."""
    if isinstance(host_table, tuple):
        indptr, indices = host_table
        return np.asarray(indices[int(indptr[row]):int(indptr[row]) + count], dtype=np.int32)
    return np.asarray(host_table[row, :count], dtype=np.int32)


def device_token_limits(table, page_size: int) -> torch.Tensor | int:
    """What each row may address in tokens, as device ops a CUDA graph captures (no host sync).
    A page-list row that leaves the flat list (indptr out of order, or past indices) gets -1: no
    length of it is in range."""
    if isinstance(table, PageLists):
        starts, ends = table.indptr[:-1].to(torch.int64), table.indptr[1:].to(torch.int64)
        outside = (ends < starts) | (starts < 0) | (ends > table.indices.shape[0])
        return torch.where(outside, -1, (ends - starts) * int(page_size))
    return int(table.shape[1]) * int(page_size)


def kernel_operands(table) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the table the kernels read, page_indptr or None): what the pkv ops take."""
    if isinstance(table, PageLists):
        return table.indices, table.indptr
    return table, None
