"""The two ways ``time_device_us`` gives the host its lead, timed against each other on the same
calls: "every" (a half-millisecond GPU-side hold before every repetition, how every device time
was taken before) and "queued" (repetitions queued ahead of the device, held only where one
needs it; pkv.measure.timing.QueuedReps).

For each case of the kernel benchmark named, PersistentKV (one pinned route) and FlashInfer's
fa2 paths run one call over the same pages; the two holds time it in turns for several rounds.
The record gives each hold's per-round medians, the ratio queued / every with the rounds' spread,
and the host seconds each hold took for the same repetitions: what the change saves, beside
evidence that it measures the same thing.

    python -m pkv.measure.timing_ab --out artifacts/h200/timing_ab.json
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

from pkv.atomic_io import write_json_atomic
from pkv.engines import EngineUnavailable, build_engine
from pkv.measure.bench_cli import bench_parser, write_skipped_no_gpu
from pkv.measure.kernel_bench import CASES
from pkv.measure.kv_data import make_kv_pages, make_queries
from pkv.measure.timing import HOLDS, L2Flusher, synchronize, time_device_us
from pkv.pipeline.pages import assign_pages
from pkv.pipeline.step import build_step
from pkv.policy.choose import PinnedRoutePolicy
from pkv.policy.route import ROUTE_BUCKET, ROUTE_WORKQUEUE, StepRoute
from pkv.provenance import collect_provenance
from pkv.refusal import exit_on_refusal
from pkv.shape import ModelShape

DEFAULT_CASES = ("b1_8k", "b1_32k", "b4_bimodal", "b8_bimodal", "b64_4k", "short_b64")
ENGINES = ("persistentkv", "flashinfer_cc", "flashinfer_tc")


def _route(batch: int) -> StepRoute:
    return StepRoute(ROUTE_BUCKET, 32) if batch == 1 else StepRoute(ROUTE_WORKQUEUE, 24)


def time_case(name: str, shape, flusher, *, reps: int, rounds: int, seed: int) -> dict:
    """{engine: per-hold round medians, ratio and host seconds} for one case's call."""
    seq_lens = CASES[name]
    device = flusher.device
    assignment = assign_pages(seq_lens, 16, 0.5, seed)
    step = build_step(0, np.arange(len(seq_lens)), np.asarray(seq_lens, dtype=np.int32), assignment.pages, 16)
    k, v = make_kv_pages(assignment.num_physical_pages, shape, 16, "float16", device, seed)
    q = make_queries(len(seq_lens), shape, "float16", device, seed + 1)
    rows = {}
    for role in ENGINES:
        try:
            policy = PinnedRoutePolicy(_route(len(seq_lens))) if role == "persistentkv" else None
            engine = build_engine(role, shape=shape, device=device, policy=policy)
            engine.prepare(step, q, k, v)
            plan = engine.plan(step)
            engine.run(q, k, v, plan)
            synchronize(device)
        except EngineUnavailable as exc:
            rows[role] = {"skipped": exc.reason}
            continue
        medians = {hold: [] for hold in HOLDS}
        host_s = {hold: 0.0 for hold in HOLDS}
        for r in range(rounds):
            for hold in (HOLDS if r % 2 == 0 else HOLDS[::-1]):  # who goes first alternates
                started = time.perf_counter()
                stats = time_device_us(lambda: engine.run(q, k, v, plan), reps=reps, warmup=1, flusher=flusher,
                                       hold=hold)
                host_s[hold] += time.perf_counter() - started
                medians[hold].append(stats.median_us)
        ratios = [queued / every for queued, every in zip(medians["queued"], medians["every"])]
        rows[role] = {"median_us": {hold: statistics.median(values) for hold, values in medians.items()},
                      "round_medians_us": medians, "ratio_queued_over_every": statistics.median(ratios),
                      "ratio_min": min(ratios), "ratio_max": max(ratios), "host_s": host_s,
                      "implementation": engine.implementation}
    return rows


def main(argv=None) -> int:
    parser = bench_parser(__doc__, CASES, reps=30, seed=20260622)
    parser.set_defaults(cases=list(DEFAULT_CASES))
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        return write_skipped_no_gpu(args.out, "pkv.measure.timing_ab/1", None, args.seed)
    shape = ModelShape()
    flusher = L2Flusher("cuda")
    cases = {name: time_case(name, shape, flusher, reps=args.reps, rounds=args.rounds, seed=args.seed)
             for name in args.cases}
    write_json_atomic(args.out, {
        "schema": "pkv.measure.timing_ab/1", "reps": args.reps, "rounds": args.rounds, "cases": cases,
        "command": "python -m pkv.measure.timing_ab " + " ".join(argv or sys.argv[1:]),
        "provenance": collect_provenance(config={"cases": args.cases, "reps": args.reps, "rounds": args.rounds},
                                         seed=args.seed)})
    print("| case | engine | every us | queued us | queued/every (min-max) | host s every | host s queued |")
    print("|---|---|---:|---:|---|---:|---:|")
    for name, rows in cases.items():
        for role, row in rows.items():
            if "skipped" in row:
                print(f"| {name} | {role} | skipped: {row['skipped'][:60]} | | | | |")
                continue
            m, h = row["median_us"], row["host_s"]
            print(f"| {name} | {role} | {m['every']:.1f} | {m['queued']:.1f} | {row['ratio_queued_over_every']:.4f} "
                  f"({row['ratio_min']:.4f}-{row['ratio_max']:.4f}) | {h['every']:.2f} | {h['queued']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_refusal(main))
