"""Seeded physical page assignment with holes (paper 3.7).

Request ``i`` reserves its exact length (prompt + decode) rounded up to the page size, or to a
bucket length in bucketed experiments, and so owns ``L_i = ceil(reserved_i / P)`` logical pages.
With ``L = sum L_i`` and hole fraction ``rho``, the physical universe has ``ceil(L / (1 - rho))``
page IDs. One seeded permutation of the universe is cut into consecutive slices, request after
request: logical order is kept inside a block table while physical IDs are scattered, and the
``U - L`` IDs past the last slice are the holes no request owns. With page order "in_order"
(PAGE_ORDERS) the universe is cut in ID order instead, and each request's pages are consecutive.

This is not a production allocator (no eviction or reuse; pkv.pipeline.kv_pool is the recycled
pool a serving engine keeps, and runs use it unless trace.page_layout is "up_front"); its job is
to give every engine the same fragmented layout. The arrays are read-only for the same reason: one assignment is shared
by all engines of a run, and none may alter it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

import numpy as np

PAGE_ORDERS = ("shuffled", "in_order")
"""The order in which a run's page IDs are first handed out: ``shuffled``, one seeded permutation
(a server that has been running for a while, whose free list has long lost its order), or
``in_order``, ascending IDs (a freshly started server: vLLM's free block queue starts as the
blocks in ID order), so a request's prompt pages are consecutive IDs, neighbours in memory."""

_INT32_MAX = np.iinfo(np.int32).max


def first_order(num_pages: int, seed: int, page_order: str) -> np.ndarray:
    """The page IDs 0..num_pages-1 in the order PAGE_ORDERS names."""
    if page_order == "shuffled":
        return np.random.default_rng(int(seed)).permutation(num_pages)
    if page_order == "in_order":
        return np.arange(num_pages)
    raise ValueError(f"page order must be one of {PAGE_ORDERS}, got {page_order!r}")


@dataclass(frozen=True)
class PageAssignment:
    page_size: int
    num_physical_pages: int
    hole_fraction: float
    seed: int
    reserved_pages: np.ndarray  # int32 [num_requests]: L_i
    pages: tuple[np.ndarray, ...]  # int32 [L_i] physical page IDs of request i, in logical order

    @property
    def num_requests(self) -> int:
        return len(self.pages)

    @property
    def num_assigned_pages(self) -> int:
        return int(self.reserved_pages.sum())

    @property
    def realized_hole_fraction(self) -> float:
        """The share of physical IDs no request owns (>= hole_fraction because of the ceiling)."""
        return 1.0 - self.num_assigned_pages / self.num_physical_pages


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def universe_size(num_logical_pages: int, hole_fraction: float) -> int:
    """ceil(L / (1 - rho)), exact for the decimal the caller wrote (0.2 means 1/5, not the float)."""
    rho = Fraction(repr(float(hole_fraction)))
    return math.ceil(Fraction(num_logical_pages) / (1 - rho))


def assign_pages(
    reserved_lens: Sequence[int] | np.ndarray,
    page_size: int,
    hole_fraction: float,
    seed: int,
    bucket_size: int | None = None,
    page_order: str = "shuffled",
) -> PageAssignment:
    """Assign physical pages to requests whose exact lengths (tokens, >= 1) are ``reserved_lens``.

    Request ``i`` of the result corresponds to ``reserved_lens[i]``. ``page_order`` (PAGE_ORDERS)
    orders the universe before it is cut: "in_order" gives each request consecutive IDs.
    """
    page_size = _positive_int("page_size", page_size)
    if isinstance(hole_fraction, bool) or not isinstance(hole_fraction, (int, float)) or not 0 <= hole_fraction < 1:
        raise ValueError(f"hole_fraction must be a number with 0 <= hole_fraction < 1, got {hole_fraction!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    granule = page_size
    if bucket_size is not None:
        granule = _positive_int("bucket_size", bucket_size)
        if granule % page_size:
            raise ValueError(f"bucket_size={granule} must be a multiple of page_size={page_size}")

    lens = np.asarray(reserved_lens)
    if lens.ndim != 1 or lens.size == 0:
        raise ValueError(f"reserved_lens must be a non-empty 1-D sequence of lengths, got shape {lens.shape}")
    if not np.issubdtype(lens.dtype, np.integer):
        raise ValueError(f"reserved_lens must hold integers, got dtype {lens.dtype}")
    lens = lens.astype(np.int64)
    bad = np.flatnonzero(lens < 1)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"reserved_lens[{i}] must be >= 1 token, got {int(lens[i])}")

    reserved = -(-lens // granule) * granule
    num_pages = reserved // page_size
    total = int(num_pages.sum())
    universe = universe_size(total, hole_fraction)
    if universe > _INT32_MAX:
        raise ValueError(f"page universe of {universe} IDs does not fit int32 page IDs")

    perm = first_order(universe, seed, page_order).astype(np.int32)
    perm.flags.writeable = False
    ends = np.cumsum(num_pages)
    starts = ends - num_pages
    pages = tuple(perm[s:e] for s, e in zip(starts.tolist(), ends.tolist()))
    reserved_pages = num_pages.astype(np.int32)
    reserved_pages.flags.writeable = False
    return PageAssignment(
        page_size=page_size,
        num_physical_pages=universe,
        hole_fraction=float(hole_fraction),
        seed=int(seed),
        reserved_pages=reserved_pages,
        pages=pages,
    )
