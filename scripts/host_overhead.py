"""Where the host time of one decode step goes, per engine: plan(), the issue of run() (host time
until the last launch is queued) and its parts for PersistentKV, and the synchronized wall step.

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


def main() -> None:
    import yaml

    shape = ModelShape()
    calib = Calibration.from_mapping(yaml.safe_load(open("conf/gpu/h200.yaml")), "conf/gpu/h200.yaml")
    print(f"{'case':<11}{'engine':<22}{'plan':>8}{'run issue':>10}{'wall':>8}  parts of run (PersistentKV)")
    for name, lens in CASES.items():
        a = assign_pages(lens, 16, 0.0, 1)
        step = build_step(0, np.arange(len(lens)), np.asarray(lens, dtype=np.int32), a.pages, 16)
        k, v = make_kv_pages(a.num_physical_pages, shape, 16, "float16", "cuda", 1)
        q = make_queries(len(lens), shape, "float16", "cuda", 2)
        engines = {
            "flashinfer": build_engine("flashinfer", shape=shape, device="cuda", calib=calib),
            "adaptive": build_engine("adaptive", shape=shape, device="cuda", calib=calib),
            "pkv_bucket": build_engine("persistentkv", shape=shape, device="cuda", calib=calib,
                                       options={"route": "bucket_exact"}),
            "pkv_workqueue": build_engine("persistentkv", shape=shape, device="cuda", calib=calib,
                                          options={"route": "workqueue"}),
        }
        for label, engine in engines.items():
            engine.prepare(step, q, k, v)
            plan = engine.plan(step)
            for _ in range(5):
                engine.run(q, k, v, engine.plan(step))
            plan_us = host_us(lambda: engine.plan(step))
            run_us = host_us(lambda: engine.run(q, k, v, plan))

            def wall():
                engine.run(q, k, v, engine.plan(step))
                torch.cuda.synchronize()

            wall_us = host_us(wall)
            parts = ""
            inner = getattr(engine, "persistent", engine)
            inner_plan = getattr(plan, "inner", plan)
            if hasattr(inner, "_launch") and hasattr(inner_plan, "bucket_rows"):
                out = torch.empty_like(q)
                scratch = inner.scratch(inner_plan, q.device)
                parts = (f"check {host_us(lambda: inner._check(q, k, v, inner_plan)):.1f}"
                         f" | alloc {host_us(lambda: (torch.empty_like(q), inner.scratch(inner_plan, q.device))):.1f}"
                         f" | launches {host_us(lambda: inner._launch(q, k, v, inner_plan, out, *scratch)):.1f}"
                         f" ({inner_plan.route})")
            print(f"{name:<11}{label:<22}{plan_us:>8.1f}{run_us:>10.1f}{wall_us:>8.1f}  {parts}")
    x = torch.zeros(1, device="cuda")
    print(f"one torch op (x.add_(1)) issue: {host_us(lambda: x.add_(1)):.1f} us")


if __name__ == "__main__":
    main()
