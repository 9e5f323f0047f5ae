"""Measurements behind the cost-model constants (paper 3.5).

- beta: streaming read bandwidth, a sum over a buffer much larger than L2, so every byte comes
  from memory once (a copy would count writes as well, which decode attention does not do).
- lambda: launch overhead, from many back-to-back tiny launches; the slower of the device-side
  spacing (CUDA events around the burst) and the host-side issue rate, because a decode step
  pays whichever of the two pipelines limits it.
- per-step samples of timed PersistentKV (and FlashInfer-role) runs over a trace, the input of
  `pkv.policy.fits.fit_c_min`, and the split sweep that picks the operating points.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pkv.measure.kv_data import make_queries
from pkv.measure.timing import L2Flusher, rotated, synchronize, time_device_us
from pkv.pipeline.serving import ContinuousDecoder, page_layout
from pkv.policy.fits import CostSample

_MIB = 1 << 20


def measure_read_gbps(device, buffer_mib: int, *, reps: int = 10, warmup: int = 2) -> float:
    """GB/s of a float32 sum over `buffer_mib` MiB (median of `reps`)."""
    if buffer_mib < 1:
        raise ValueError(f"buffer_mib must be >= 1, got {buffer_mib!r}")
    n = buffer_mib * _MIB // 4
    buf = torch.ones(n, dtype=torch.float32, device=device)
    stats = time_device_us(lambda: torch.sum(buf), reps=reps, warmup=warmup, device=device)
    return buf.numel() * 4 / (stats.median_us * 1e3)


def measure_launch_us(device, *, launches: int = 200, reps: int = 5) -> dict:
    """Per-launch cost of `launches` back-to-back in-place adds on a one-element tensor."""
    if launches < 1:
        raise ValueError(f"launches must be >= 1, got {launches!r}")
    x = torch.zeros(1, device=device)

    def burst():
        for _ in range(launches):
            x.add_(1.0)

    device_us = time_device_us(burst, reps=reps, warmup=1, device=device).median_us / launches
    host = []
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        burst()
        host.append((time.perf_counter() - t0) * 1e6 / launches)
        synchronize(device)
    host_us = sorted(host)[len(host) // 2]
    return {"device_us": device_us, "host_us": host_us, "lambda_us": max(device_us, host_us)}


@dataclass
class TimedSteps:
    """Per-step measured times of one engine over a trace (CostSample inputs) and their sum."""

    samples: list
    total_us: float
    plan_us: list


def time_steps_in_turn(runs: dict, steps, shape, k_pages, v_pages, *, dtype, device, seed: int, reps: int,
                       flush_l2: bool = True) -> dict:
    """Median device time of each run on each step (``runs``: key -> (engine, route)), as
    pkv.policy.fits.CostSample rows: an engine runs ``route`` on every step, or with None the route
    its policy picks for each step (each sample records that one). The runs of one step are timed
    one after another, the first of them moving on by one each step. A drift of the GPU's state
    over a trace (its clocks, its temperature) then falls on every run alike; timed one run over
    all steps and then the next, two runs 1% apart could trade places between two calibrations of
    one GPU, and a split count or a route decision with them."""

    flusher = L2Flusher(device) if flush_l2 else None
    keys = list(runs)
    samples, plan_us, total = {k: [] for k in keys}, {k: [] for k in keys}, dict.fromkeys(keys, 0.0)
    for index, step in enumerate(steps):
        q = make_queries(step.batch_size, shape, dtype, device, seed + step.step)
        for key in keys:
            runs[key][0].prepare(step, q, k_pages, v_pages)
        for key in rotated(keys, index):
            engine, route = runs[key]
            synchronize(device)
            t0 = time.perf_counter()
            plan = engine.plan(step)
            synchronize(device)
            plan_us[key].append((time.perf_counter() - t0) * 1e6)
            stats = time_device_us(lambda: engine.run(q, k_pages, v_pages, plan), reps=reps, warmup=1,
                                   flusher=flusher, device=device)
            samples[key].append(CostSample(route if route is not None else engine.policy.choose(step).route, step,
                                           stats.median_us))
            total[key] += stats.median_us
    return {k: TimedSteps(samples=samples[k], total_us=total[k], plan_us=plan_us[k]) for k in keys}


def trace_steps(requests, *, page_size: int, hole_fraction: float, max_active: int, num_steps: int,
                seed: int, layout: str = "recycled", pool_pages: int | None = None, page_order: str = "shuffled"):
    """The page layout (pkv.pipeline.serving.page_layout) and the first num_steps StepBatches of a
    continuous-batching replay."""

    assignment = page_layout(requests, layout=layout, page_size=page_size, hole_fraction=hole_fraction,
                             seed=seed, max_active=max_active, max_steps=num_steps, pool_pages=pool_pages,
                             page_order=page_order)
    steps = list(ContinuousDecoder(list(requests), assignment, max_active, max_steps=num_steps).steps())
    if not steps:
        raise ValueError("the calibration trace produced no decode steps")
    return assignment, steps
