"""Where the time of one synchronized wall step goes, per engine: plan(), the issue of run() (host
time until the last launch is queued), the wait for the GPU after it, their total, and the
device time of run() alone (L2 flushed). PersistentKV runs with its C++ planner ("native") and
with the numpy planner it is tested against.

    python scripts/host_overhead.py            # on a GPU machine; prints a table (microseconds)

Decode kernels of a few tens of microseconds on a fast GPU make the host path a large part of a
serving step, so this is measured, not guessed.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from pkv.cost_model import Calibration
from pkv.engines import build_engine
from pkv.kv_data import make_kv_pages, make_queries
from pkv.pages import assign_pages
from pkv.shape import ModelShape
from pkv.step import build_step
from pkv.timing import L2Flusher, hold_device, time_device_us

K = 1024
CASES = {"b1_8k": [8 * K], "b1_32k": [32 * K],
         "b8_bimodal": [64 * K, 64 * K, 4 * K, 5632, 7 * K, 8704, 10 * K, 12 * K]}
REPS = 50


def host_us(fn, reps=REPS):
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def wall_split(engine, q, k, v, step, reps=REPS, between=None):
    """Median plan, run-issue, sync-wait and total of synchronized wall steps (microseconds).
    ``between`` runs before each step (outside the timing), as the harness's flush and hold do."""
    parts = []
    for _ in range(reps):
        if between is not None:
            between()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        plan = engine.plan(step)
        t1 = time.perf_counter()
        engine.run(q, k, v, plan)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        parts.append(((t1 - t0) * 1e6, (t2 - t1) * 1e6, (t3 - t2) * 1e6, (t3 - t0) * 1e6))
    return [statistics.median(column) for column in zip(*parts)]


def main() -> None:
    import yaml

    shape = ModelShape()
    flusher = L2Flusher("cuda")
    calib = Calibration.from_mapping(yaml.safe_load(open("conf/gpu/h200.yaml")), "conf/gpu/h200.yaml")
    print(f"{'case':<11}{'engine':<24}{'plan':>7}{'issue':>7}{'sync':>7}{'wall':>7}{'device':>8}"
          f"  | after flush + hold: {'plan':>7}{'issue':>7}{'wall':>7}")
    for name, lens in CASES.items():
        a = assign_pages(lens, 16, 0.0, 1)
        step = build_step(0, np.arange(len(lens)), np.asarray(lens, dtype=np.int32), a.pages, 16)
        k, v = make_kv_pages(a.num_physical_pages, shape, 16, "float16", "cuda", 1)
        q = make_queries(len(lens), shape, "float16", "cuda", 2)
        engines = {"flashinfer": build_engine("flashinfer", shape=shape, device="cuda", calib=calib)}
        for planner in ("native", "numpy"):
            engines[f"adaptive/{planner}"] = build_engine("adaptive", shape=shape, device="cuda", calib=calib,
                                                          options={"planner": planner})
            for route in ("bucket_exact", "workqueue"):
                engines[f"pkv_{route.split('_')[0]}/{planner}"] = build_engine(
                    "persistentkv", shape=shape, device="cuda", calib=calib,
                    options={"route": route, "planner": planner})
        for label, engine in engines.items():
            engine.prepare(step, q, k, v)
            for _ in range(5):
                engine.run(q, k, v, engine.plan(step))
            plan_us, issue_us, sync_us, wall_us = wall_split(engine, q, k, v, step)
            plan = engine.plan(step)
            device_us = time_device_us(lambda: engine.run(q, k, v, plan), flusher=flusher).median_us
            # The harness's order: flush L2, then a half-millisecond GPU hold the host waits out.
            busy_plan, busy_issue, _, busy_wall = wall_split(
                engine, q, k, v, step, between=lambda: (flusher.flush(), hold_device("cuda")))
            print(f"{name:<11}{label:<24}{plan_us:>7.1f}{issue_us:>7.1f}{sync_us:>7.1f}{wall_us:>7.1f}{device_us:>8.1f}"
                  f"  | {'':>20}{busy_plan:>7.1f}{busy_issue:>7.1f}{busy_wall:>7.1f}")
    x = torch.zeros(1, device="cuda")
    print(f"one torch op (x.add_(1)) issue: {host_us(lambda: x.add_(1)):.1f} us")


if __name__ == "__main__":
    main()
