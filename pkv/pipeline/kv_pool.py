"""A fixed KV pool that recycles pages as a serving engine's block manager does.

A serving engine allocates one pool of physical pages when it starts and never grows it. A
request takes pages when it is admitted (its prompt and the first decoded token) and one more
each time its length crosses a page boundary; when it finishes, its pages go back to the free
list and are handed out again. The free list is first-in first-out (vLLM's free block queue:
allocation pops the front, a freed page joins the back), and it starts as one seeded permutation
of the pool (page order "shuffled", pkv.pipeline.pages.PAGE_ORDERS), so the layout is scattered
from the first step, as in a server that has been running for a while, and gets more scattered as
requests come and go; or in ID order ("in_order"), as a freshly started server's.

Admission control reserves a request's whole length (prompt + decode tokens) before it is
admitted, and the pages themselves are taken lazily, step by step. A request whose reservation
does not fit waits, first come first served, as vLLM's scheduler makes it wait; no admitted
request is ever preempted, so every engine of a run replays exactly the same steps. A request
longer than the whole pool can never run and is refused.

``pool_pages_for`` sizes the pool when the run does not name one: the most pages the run's
admitted requests ever reserve at once (pkv.pipeline.serving.decode_plan_summary's
``peak_reserved_pages``), over ``1 - hole_fraction`` (the share of the pool left
free at that peak), capped by what the device holds; a capped pool makes requests wait.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pkv.pipeline.pages import PAGE_ORDERS, first_order, universe_size

PAGE_LAYOUTS = ("recycled", "up_front")
"""How a run's requests get their physical pages: ``recycled`` (this module: a fixed pool whose
pages are reused) or ``up_front`` (pkv.pipeline.pages.assign_pages: every request of the trace
owns its pages from the start and none is reused; the paper's section 3.7 layout)."""

_INT32_MAX = np.iinfo(np.int32).max


def pages_for_tokens(tokens, page_size: int):
    """ceil(tokens / page_size), elementwise for arrays."""
    return -(-tokens // page_size)


@dataclass(frozen=True)
class KVPoolSpec:
    """The pool a run decodes over: its size in pages and its initial free list (seed and order)."""

    num_physical_pages: int
    page_size: int
    seed: int
    page_order: str = "shuffled"

    def __post_init__(self) -> None:
        for name in ("num_physical_pages", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"KVPoolSpec.{name} must be a positive integer, got {value!r}")
        if self.num_physical_pages > _INT32_MAX:
            raise ValueError(f"KVPoolSpec.num_physical_pages={self.num_physical_pages} does not fit int32 page IDs")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ValueError(f"KVPoolSpec.seed must be a non-negative integer, got {self.seed!r}")
        if self.page_order not in PAGE_ORDERS:
            raise ValueError(f"KVPoolSpec.page_order must be one of {PAGE_ORDERS}, got {self.page_order!r}")

    @property
    def capacity_tokens(self) -> int:
        return self.num_physical_pages * self.page_size


class KVPool:
    """The free list of one pool: ``take`` pops pages from the front, ``give_back`` appends."""

    def __init__(self, spec: KVPoolSpec):
        self.spec = spec
        self._free = deque(first_order(spec.num_physical_pages, spec.seed, spec.page_order).tolist())

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int]:
        if count > len(self._free):
            # Admission reserves every admitted request's whole length, so this is a bookkeeping bug.
            raise RuntimeError(f"KV pool of {self.spec.num_physical_pages} pages has {len(self._free)} free, "
                               f"asked for {count}")
        return [self._free.popleft() for _ in range(count)]

    def give_back(self, pages: Sequence[int]) -> None:
        self._free.extend(pages)


def pool_pages_for(peak_pages: int, hole_fraction: float, longest_pages: int = 1, max_pages: int | None = None) -> int:
    """The default pool: ``peak_pages / (1 - hole_fraction)`` pages, at most ``max_pages``, and at
    least ``longest_pages`` (the longest request of the trace, which must be admitted some day even
    when the steps the peak was taken over never reach it)."""
    if not 0 <= hole_fraction < 1:
        raise ValueError(f"hole_fraction must be in [0, 1), got {hole_fraction!r}")
    pages = max(1, universe_size(int(peak_pages), hole_fraction))
    if max_pages is not None:
        pages = min(pages, int(max_pages))
    return max(pages, int(longest_pages))
