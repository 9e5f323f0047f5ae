"""Isolated native-paged decode benchmark (Table 1): one batch, one call per engine, timed.

Every engine reads the same fragmented pages (50% holes by default) through the same page
ids. Times are CUDA-event medians with the L2 flushed before each repetition; each engine is
also checked against the float64 dense reference, and its time is put next to the read
floor (KV bytes / measured read bandwidth) when the bandwidth is given.
"""

from __future__ import annotations

import numpy as np
import torch

from pkv.engines.base import EngineUnavailable
from pkv.engines.dense import dense_decode
from pkv.measure.accuracy import compare
from pkv.measure.kv_data import make_kv_pages, make_queries, resolve_dtype
from pkv.measure.timing import L2Flusher, time_device_us
from pkv.pipeline.pages import assign_pages
from pkv.pipeline.step import build_step


def kv_bytes_read(seq_lens, shape, dtype_bytes: int) -> int:
    """Bytes of K and V a decode step must read: every token of every row, once."""
    return 2 * int(np.sum(seq_lens)) * shape.num_kv_heads * shape.head_dim * int(dtype_bytes)


def isolated_batch(seq_lens: list[int], shape, engines: dict, *, page_size: int = 16,
                   hole_fraction: float = 0.5, dtype="float16", device="cuda", seed: int = 0,
                   reps: int = 30, warmup: int = 5, flush_l2: bool = True,
                   read_gbps: float | None = None) -> dict:
    """Time one decode call per engine on one batch; returns {engine name: result dict}.

    Result: median_us, mean_us, p10_us, p90_us, n, kv_bytes, achieved_gbps, floor_us and
    fraction_of_floor (None without ``read_gbps``), rel_err, max_abs_err, mean_abs_err and
    implementation; ``{"skipped": reason}`` for an engine that raises EngineUnavailable.
    """
    lens = [int(n) for n in seq_lens]
    if not lens or min(lens) < 1:
        raise ValueError(f"seq_lens must be a non-empty list of lengths >= 1, got {seq_lens!r}")
    if read_gbps is not None and not read_gbps > 0:
        raise ValueError(f"read_gbps must be positive, got {read_gbps!r}")
    device = torch.device(device)
    dtype = resolve_dtype(dtype)
    assignment = assign_pages(lens, page_size, hole_fraction, seed)
    step = build_step(0, np.arange(len(lens)), lens, assignment.pages, page_size)
    k_pages, v_pages = make_kv_pages(assignment.num_physical_pages, shape, page_size, dtype,
                                     device, seed)
    q = make_queries(len(lens), shape, dtype, device, seed + 1)
    reference = dense_decode(q, k_pages, v_pages, step.seq_lens, step.block_table, shape.sm_scale)
    kv_bytes = kv_bytes_read(lens, shape, k_pages.element_size())
    floor_us = kv_bytes / (read_gbps * 1e9) * 1e6 if read_gbps else None
    flusher = L2Flusher(device) if flush_l2 else None

    results = {}
    for name, engine in engines.items():
        try:
            engine.prepare(step, q, k_pages, v_pages)
            plan = engine.plan(step)
            out = engine.run(q, k_pages, v_pages, plan)
        except EngineUnavailable as exc:
            results[name] = {"skipped": exc.reason}
            continue
        errors = compare(out, reference)

        def call(engine=engine, plan=plan):
            engine.run(q, k_pages, v_pages, plan)

        stats = time_device_us(call, reps=reps, warmup=warmup, flusher=flusher, device=device)
        results[name] = {
            **stats.to_dict(),
            "kv_bytes": kv_bytes,
            "achieved_gbps": kv_bytes / (stats.median_us * 1e3),
            "floor_us": floor_us,
            "fraction_of_floor": floor_us / stats.median_us if floor_us is not None else None,
            "rel_err": errors["rel_err"],
            "max_abs_err": errors["max_abs_err"],
            "mean_abs_err": errors["mean_abs_err"],
            "implementation": engine.implementation,
        }
    return results


def autotune_splits(seq_lens: list[int], shape, make_engine, candidates, **kwargs) -> tuple[int, dict]:
    """Pick the split count with the lowest median time ("PersistentKV, auto split").

    ``make_engine(num_splits)`` builds one engine per candidate; all candidates are timed in
    one ``isolated_batch`` call on the same pages. Returns (best split count, all results).
    """
    candidates = [int(c) for c in candidates]
    if not candidates:
        raise ValueError("autotune_splits needs at least one candidate split count")
    engines = {f"splits={c}": make_engine(c) for c in candidates}
    results = isolated_batch(seq_lens, shape, engines, **kwargs)
    timed = {c: results[f"splits={c}"] for c in candidates if "median_us" in results[f"splits={c}"]}
    if not timed:
        reasons = {name: r.get("skipped") for name, r in results.items()}
        raise EngineUnavailable(f"no split candidate could run: {reasons}")
    best = min(timed, key=lambda c: timed[c]["median_us"])
    return best, results
