"""Continuous decode harness (paper 3.6): which requests are active at each decode step.

Rules, shared by :class:`ContinuousDecoder` and :func:`decode_plan_summary`:

- The clock ``t`` starts at 0. At each step, waiting requests with ``arrival_step <= t`` are
  admitted in ``(arrival_step, request_id)`` order while fewer than ``max_active`` are active.
- Rows keep their admission order; a leaving row closes up the gap.
- An admitted request's k-th decode step (k = 0 .. decode_len - 1) has
  ``seq_len = prompt_len + k + 1``: the context already cached plus this step's token.
- A request leaves after its ``decode_len`` steps; a slot it frees is filled at the next step.
- A step with nothing active is not yielded: the clock jumps to the next arrival. So
  ``StepBatch.step`` is the clock (gaps show idle time) and the count of yielded steps is what
  ``max_steps`` bounds.
- The run ends after ``max_steps`` yielded steps or when every request is done.

- Over a fixed KV pool (pkv.pipeline.kv_pool), a request is admitted only when its whole length
  fits beside what the active requests reserve; until then it and every request behind it wait
  (first come, first served), even with a free row. Its pages are taken at admission and on
  growth, and go back to the pool when it leaves, before the next step admits anyone.

Prefill is outside the harness: the prompt's KV is taken as already resident in its pages.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from pkv.pipeline.kv_pool import PAGE_LAYOUTS, KVPool, KVPoolSpec, pages_for_tokens, pool_pages_for
from pkv.pipeline.pages import PageAssignment, assign_pages
from pkv.pipeline.step import StepBatch, build_step
from pkv.pipeline.traces import Request


def _check_limits(max_active, max_steps) -> None:
    if isinstance(max_active, bool) or not isinstance(max_active, (int, np.integer)) or max_active < 1:
        raise ValueError(f"max_active must be an integer >= 1, got {max_active!r}")
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, (int, np.integer)) or max_steps < 1):
        raise ValueError(f"max_steps must be an integer >= 1 or None, got {max_steps!r}")


class _Columns:
    """The trace as arrays, with the admission order fixed once."""

    def __init__(self, requests: Sequence[Request]):
        if len(requests) == 0:
            raise ValueError("requests is empty: a decode run needs at least one request")
        self.ids = np.fromiter((r.request_id for r in requests), dtype=np.int64, count=len(requests))
        self.arrival = np.fromiter((r.arrival_step for r in requests), dtype=np.int64, count=len(requests))
        self.prompt = np.fromiter((r.prompt_len for r in requests), dtype=np.int64, count=len(requests))
        self.decode = np.fromiter((r.decode_len for r in requests), dtype=np.int64, count=len(requests))
        uniq, counts = np.unique(self.ids, return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"request_id {int(uniq[counts > 1][0])} appears more than once in requests")
        self.order = np.lexsort((self.ids, self.arrival))  # by arrival, ties by request id

    def pages_needed(self, page_size: int) -> np.ndarray:
        """Pages each request holds at its last step: ceil(total_len / page_size)."""
        return pages_for_tokens(self.prompt + self.decode, int(page_size))

    def check_pool(self, pool: KVPoolSpec) -> None:
        """Refuse a request that the whole pool could never hold (it would wait forever)."""
        needed = self.pages_needed(pool.page_size)
        over = np.flatnonzero(needed > pool.num_physical_pages)
        if over.size:
            i = int(over[0])
            raise ValueError(
                f"request {int(self.ids[i])} needs {int(needed[i])} pages of {pool.page_size} tokens for "
                f"total_len={int(self.prompt[i] + self.decode[i])}, more than the KV pool's "
                f"{pool.num_physical_pages} pages")


def _schedule(cols: _Columns, max_active: int, max_steps: int | None,
              pool: KVPoolSpec | None = None) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Yield (clock, active request positions in row order, seq_lens) per decode step."""
    n = cols.order.shape[0]
    progress = np.zeros(n, dtype=np.int64)
    active = np.empty(0, dtype=np.int64)
    # Pages reserved per request and in all: with no pool, nothing ever waits for pages.
    need = cols.pages_needed(pool.page_size) if pool is not None else np.zeros(n, dtype=np.int64)
    capacity = pool.num_physical_pages if pool is not None else 0
    reserved = 0
    next_wait = 0
    t = 0
    yielded = 0
    while next_wait < n or active.size:
        if max_steps is not None and yielded >= max_steps:
            return
        if active.size == 0 and cols.arrival[cols.order[next_wait]] > t:
            t = int(cols.arrival[cols.order[next_wait]])
        room = max_active - active.size
        first = next_wait
        while room and next_wait < n and cols.arrival[cols.order[next_wait]] <= t:
            if pool is not None and reserved + need[cols.order[next_wait]] > capacity:
                break
            reserved += int(need[cols.order[next_wait]])
            next_wait += 1
            room -= 1
        if next_wait > first:
            active = np.concatenate([active, cols.order[first:next_wait]])
        seq_lens = cols.prompt[active] + progress[active] + 1
        yield t, active, seq_lens
        yielded += 1
        progress[active] += 1
        done = progress[active] >= cols.decode[active]
        reserved -= int(need[active[done]].sum())
        active = active[~done]
        t += 1


class ContinuousDecoder:
    """Replays ``requests`` as continuous-batching decode steps over ``assignment``.

    ``assignment`` is a fixed KV pool (a :class:`KVPoolSpec`: pages taken and recycled as the
    requests come and go) or an up-front :class:`PageAssignment`, whose ``pages[i]`` belongs to
    ``requests[i]`` (list position, not request id), as produced by
    ``assign_pages([r.total_len for r in requests], ...)``. ``steps()`` can be called again for an
    identical replay (a fresh pool each time), so every engine of a run sees the same steps.
    """

    def __init__(self, requests: list[Request], assignment: PageAssignment | KVPoolSpec, max_active: int,
                 max_steps: int | None = None):
        _check_limits(max_active, max_steps)
        self.requests = tuple(requests)
        self._cols = _Columns(self.requests)
        self.assignment = assignment
        self.max_active = int(max_active)
        self.max_steps = None if max_steps is None else int(max_steps)
        if isinstance(assignment, KVPoolSpec):
            self._cols.check_pool(assignment)
            return
        if len(assignment.pages) != len(self.requests):
            raise ValueError(
                f"page assignment covers {len(assignment.pages)} requests but the trace has {len(self.requests)}"
            )
        page_size = assignment.page_size
        needed = -(-(self._cols.prompt + self._cols.decode) // page_size)
        owned = np.asarray(assignment.reserved_pages, dtype=np.int64)
        short = np.flatnonzero(owned < needed)
        if short.size:
            i = int(short[0])
            raise ValueError(
                f"request {int(self._cols.ids[i])} needs {int(needed[i])} pages of {page_size} tokens for "
                f"total_len={int(self._cols.prompt[i] + self._cols.decode[i])} but the assignment gives it {int(owned[i])}"
            )

    @property
    def pool(self) -> KVPoolSpec | None:
        return self.assignment if isinstance(self.assignment, KVPoolSpec) else None

    def steps(self) -> Iterator[StepBatch]:
        if self.pool is not None:
            yield from self._pool_steps(self.pool)
            return
        pages = self.assignment.pages
        page_size = self.assignment.page_size
        ids = self._cols.ids
        for t, active, seq_lens in _schedule(self._cols, self.max_active, self.max_steps):
            yield build_step(t, ids[active], seq_lens, [pages[i] for i in active.tolist()], page_size)

    def _pool_steps(self, spec: KVPoolSpec) -> Iterator[StepBatch]:
        pool = KVPool(spec)
        page_size = spec.page_size
        ids = self._cols.ids
        held: dict[int, list[int]] = {}  # request position -> its pages in logical order
        for t, active, seq_lens in _schedule(self._cols, self.max_active, self.max_steps, spec):
            rows = active.tolist()
            # Who left after the last step gives its pages back before anyone takes new ones.
            for gone in held.keys() - set(rows):
                pool.give_back(held.pop(gone))
            page_lists = []
            for i, length in zip(rows, seq_lens.tolist()):
                pages = held.setdefault(i, [])
                short = -(-length // page_size) - len(pages)
                if short > 0:
                    pages.extend(pool.take(short))
                page_lists.append(pages)
            yield build_step(t, ids[active], seq_lens, page_lists, page_size)

    def __iter__(self) -> Iterator[StepBatch]:
        return self.steps()

    def summary(self) -> dict:
        return decode_plan_summary(self.requests, self.max_active, self.max_steps, pool=self.pool)


def decode_plan_summary(requests: Sequence[Request], max_active: int, max_steps: int | None = None,
                        pool: KVPoolSpec | None = None, page_size: int = 1) -> dict:
    """Counts of the run ``ContinuousDecoder`` would replay, without building any step.

    Jumps from event to event (an arrival that finds room, a departure, the step limit) instead
    of stepping the clock, so a production log of 20k requests summarises in a fraction of a second.

    Keys: ``steps`` (yielded steps), ``decode_tokens`` (sum of active rows over the steps),
    ``mean_active``, ``peak_active``, ``requests_admitted``, ``requests_finished``,
    ``end_step`` (the clock after the last step) and ``peak_reserved_pages`` (the most pages the
    admitted requests reserved at once, in pages of ``pool``'s page size, else of ``page_size``).
    """
    _check_limits(max_active, max_steps)
    cols = _Columns(list(requests))
    if pool is not None:
        cols.check_pool(pool)
    n = cols.order.shape[0]
    # Python lists: the active set is at most max_active long, where numpy calls cost more than they save.
    arrival = cols.arrival[cols.order].tolist()
    decode = cols.decode[cols.order].tolist()
    need = cols.pages_needed(pool.page_size if pool is not None else page_size)[cols.order].tolist()
    capacity = pool.num_physical_pages if pool is not None else None
    remaining: list[int] = []
    held: list[int] = []  # pages each active request reserves, in the order of remaining
    next_wait = t = steps = tokens = finished = peak = peak_pages = 0
    while next_wait < n or remaining:
        if max_steps is not None and steps >= max_steps:
            break
        if not remaining and arrival[next_wait] > t:
            t = arrival[next_wait]
        room = max_active - len(remaining)
        reserved = sum(held)
        while room and next_wait < n and arrival[next_wait] <= t:
            if capacity is not None and reserved + need[next_wait] > capacity:
                break
            remaining.append(decode[next_wait])
            held.append(need[next_wait])
            reserved += need[next_wait]
            next_wait += 1
            room -= 1
        peak = max(peak, len(remaining))
        peak_pages = max(peak_pages, reserved)
        span = min(remaining)
        if room and next_wait < n and arrival[next_wait] > t:  # the next arrival joins as soon as it comes
            span = min(span, arrival[next_wait] - t)
        if max_steps is not None:
            span = min(span, max_steps - steps)
        steps += span
        tokens += span * len(remaining)
        t += span
        before = len(remaining)
        kept = [i for i, r in enumerate(remaining) if r > span]
        remaining = [remaining[i] - span for i in kept]
        held = [held[i] for i in kept]
        finished += before - len(remaining)
    return {
        "steps": steps,
        "decode_tokens": tokens,
        "mean_active": tokens / steps if steps else 0.0,
        "peak_active": peak,
        "requests_admitted": next_wait,
        "requests_finished": finished,
        "end_step": t,
        "peak_reserved_pages": peak_pages,
    }


def page_layout(requests: Sequence[Request], *, layout: str, page_size: int, hole_fraction: float, seed: int,
                max_active: int, max_steps: int | None = None, pool_pages: int | None = None,
                max_pool_pages: int | None = None, page_order: str = "shuffled") -> PageAssignment | KVPoolSpec:
    """Where a replay of ``requests`` finds its pages (pkv.pipeline.kv_pool.PAGE_LAYOUTS).

    ``recycled``: a fixed pool of ``pool_pages`` pages, or when that is None the pages the replay's
    first ``max_steps`` steps reserve at their peak over ``1 - hole_fraction``, at most
    ``max_pool_pages`` and at least the longest request (pkv.pipeline.kv_pool.pool_pages_for). ``up_front``: assign_pages over every request, which
    takes ``hole_fraction`` as its share of empty pages and ignores ``pool_pages``. ``page_order``
    (pkv.pipeline.pages.PAGE_ORDERS) is the order either hands out its first pages in.
    """
    if layout == "up_front":
        return assign_pages([r.total_len for r in requests], page_size, hole_fraction, seed, page_order=page_order)
    if layout != "recycled":
        raise ValueError(f"page layout must be one of {PAGE_LAYOUTS}, got {layout!r}")
    if pool_pages is None:
        peak = decode_plan_summary(requests, max_active, max_steps, page_size=page_size)["peak_reserved_pages"]
        longest = max(pages_for_tokens(r.total_len, page_size) for r in requests)
        pool_pages = pool_pages_for(peak, hole_fraction, longest_pages=longest, max_pages=max_pool_pages)
    return KVPoolSpec(int(pool_pages), int(page_size), int(seed), page_order)
