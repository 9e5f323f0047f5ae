"""Where the time of one synchronized decode step goes, per engine (a DAG rule and a script).

For each case and engine: plan() host time, the issue of run() (host time until the last launch is
queued), the wait for the GPU after it, their total (the synchronized wall step), and run()'s
device time alone (L2 flushed). Every step is timed twice: in a tight loop, and right after an L2
flush and a GPU hold the host waits out, as the serving harness times its steps. The engines of a
case are timed in turn, in rounds, so that a host whose speed drifts over the run slows them
alike. PersistentKV runs with its C++ planner ("native") and with the numpy planner it is tested
against; the adaptive engine also with its Python policy before the C++ planner ("adaptive/native,
Python policy"), so one run compares the route decided in the planner's call with the route
decided in Python.

    python -m pkv.measure.host_bench --calibration artifacts/h200/calibration/calibration.json \\
        --out artifacts/h200/host_bench/host.json
    python -m pkv.measure.host_bench --calibration conf/gpu/h200.yaml --out /tmp/host.json

Decode kernels of a few tens of microseconds on a fast GPU make the host path a large part of a
serving step, so this is measured, not guessed. On a machine without a GPU it records why it did
not run.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from pkv.atomic_io import write_json_atomic
from pkv.engines import OPTION_NAMES, build_engine, role_policy
from pkv.engines.adaptive import AdaptiveEngine
from pkv.gpu_state import hold_device
from pkv.measure.bench_cli import bench_parser, write_skipped_no_gpu
from pkv.measure.calibration_probe import measure_launch_us
from pkv.measure.kv_data import make_kv_pages, make_queries
from pkv.measure.timing import L2Flusher, WallTimer, rotated, time_device_us
from pkv.pipeline.pages import assign_pages
from pkv.pipeline.step import build_step
from pkv.policy import PinnedRoutePolicy
from pkv.policy.calibration import Calibration, load_calibration
from pkv.policy.route import ROUTE_FLASHINFER
from pkv.provenance import collect_provenance
from pkv.refusal import exit_on_refusal
from pkv.shape import ModelShape

K = 1024
CASES: dict[str, list[int]] = {
    "b1_8k": [8 * K],
    "b1_32k": [32 * K],
    "b8_bimodal": [64 * K, 64 * K, 4 * K, 5632, 7 * K, 8704, 10 * K, 12 * K],
    # Short rows: where the B8+ context gate lies above them, the policy leaves the step to
    # FlashInfer, and the adaptive engine's plan() against FlashInfer's is the cost of its route
    # check. Each record names the route its engine took.
    "b8_short": [512, 1 * K, 1536, 2 * K, 2560, 3 * K, 3584, 4 * K],
    # One long prompt among short rows: a block table padded to the long row is 64 x 8192 entries,
    # the page lists the plan carries instead 8,698 ints (pkv.engines.persistentkv.page_lists_pay).
    "skewed_b64": [128 * K] + [100] * 63,
}
# What a reader calls the cases of mixed lengths (kernel_bench.case_label names the others).
CASE_LABELS = {
    "b8_bimodal": "B8 bimodal (2 x 64K + 6 of 4K-12K)",
    "b8_short": "B8 short (512-4K)",
    "skewed_b64": "skewed B64 (128K + 63 x 100)",
}
PLANNERS = ("native", "numpy")
COLUMNS = ("plan_us", "issue_us", "wait_us", "wall_us")
# Rounds each engine's repetitions are split over, every engine timed in each (in_rounds).
ROUNDS = 5


def engine_specs(device="cuda") -> dict[str, tuple[str, dict]]:
    """label -> (engine role, build_engine options; "python_policy": the adaptive engine's Python
    policy instead of its C++ form, pkv.policy.native; "one_op": its eager step decided, planned
    and launched in one op call, on a GPU only)."""
    specs = {"flashinfer": ("flashinfer", {})}
    for planner in PLANNERS:
        specs[f"adaptive/{planner}"] = ("adaptive", {"planner": planner})
        if planner == "native":
            # The route decided in Python, then planned by the C++ planner: what the one call saves.
            specs["adaptive/native, Python policy"] = ("adaptive", {"planner": planner, "python_policy": True})
            if torch.device(device).type == "cuda":  # and the run folded into the same call
                specs["adaptive/native, one op"] = ("adaptive", {"planner": planner, "one_op": True})
            # The route the adaptive policy picks for the case, pinned: planning it without deciding,
            # so adaptive/native less this row is what deciding costs, in the same process.
            specs["persistentkv_adaptive_route/native"] = ("persistentkv", {"planner": planner,
                                                                            "adaptive_route": True})
        for route in ("bucket_exact", "workqueue"):
            specs[f"persistentkv_{route}/{planner}"] = ("persistentkv", {"route": route, "planner": planner})
    return specs


def wall_samples(engine, q, k, v, step, reps: int, between=None) -> list[tuple]:
    """(plan, run issue, wait for the GPU, the whole synchronized step) in us, of ``reps`` steps on
    q's device. ``between`` runs before each step, outside the timing."""
    samples = []
    for _ in range(reps):
        if between is not None:
            between()
        with WallTimer(q.device) as wall:  # the harness's timer and split
            plan = engine.plan(step)
            planned = time.perf_counter()
            engine.run(q, k, v, plan)
            issued = time.perf_counter()
        plan_us, issue_us = (planned - wall.started) * 1e6, (issued - planned) * 1e6
        samples.append((plan_us, issue_us, wall.elapsed_us - plan_us - issue_us, wall.elapsed_us))
    return samples


def _medians(samples: list[tuple]) -> dict[str, float]:
    return {name: statistics.median(column) for name, column in zip(COLUMNS, zip(*samples))}


def in_rounds(engines: dict, time_one, reps: int, rounds: int) -> dict[str, list[list[tuple]]]:
    """{label: each round's samples}: every engine's ``reps`` steps split over ``rounds`` rounds (at
    least one step a round), each round timing every engine in turn (``time_one(label, engine,
    steps)``), the first of them moving on by one each round. A host whose speed drifts over the
    run (its clocks, other processes) then slows every engine alike, so two engines' figures
    compare within one run."""
    labels = list(engines)
    per_round = max(1, reps // rounds)
    samples = {label: [] for label in labels}
    for r in range(rounds):
        for label in rotated(labels, r):
            samples[label].append(time_one(label, engines[label], per_round))
    return samples


def run_case(name, seq_lens, shape, calib, flusher, reps, seed, log, *, dtype="float16", rounds=ROUNDS) -> dict:
    """Every engine of engine_specs on one case, on the flusher's device (on the CPU, the roles'
    stand-ins: the torch reference engine for PersistentKV, repack + SDPA for FlashInfer), the
    engines timed in turn (in_rounds)."""
    device = flusher.device
    assignment = assign_pages(seq_lens, 16, 0.0, seed)
    step = build_step(0, np.arange(len(seq_lens)), np.asarray(seq_lens, dtype=np.int32), assignment.pages, 16)
    k, v = make_kv_pages(assignment.num_physical_pages, shape, 16, dtype, device, seed)
    q = make_queries(len(seq_lens), shape, dtype, device, seed + 1)
    rows, engines = {}, {}
    chosen = role_policy("adaptive", {}, shape, calib).choose(step).route
    for label, (role, options) in engine_specs(device).items():
        if options.get("adaptive_route"):
            if chosen.name == ROUTE_FLASHINFER:
                rows[label] = {"skipped": "the adaptive policy leaves this case to FlashInfer", "route": chosen.name}
                continue
            policy = PinnedRoutePolicy(chosen)
        else:
            policy = role_policy(role, options, shape, calib)
        engine = build_engine(role, shape=shape, device=device, policy=policy,
                              options={k: v for k, v in options.items() if k in OPTION_NAMES})
        if options.get("python_policy"):
            engine = AdaptiveEngine(engine.policy, engine.persistent, engine.fallback, native_policy=False)
        if options.get("one_op"):
            engine = AdaptiveEngine(engine.policy, engine.persistent, engine.fallback, one_op_step=True)
        engine.prepare(step, q, k, v)
        for _ in range(5):
            engine.run(q, k, v, engine.plan(step))
        engines[label] = engine
    tight = in_rounds(engines, lambda label, engine, n: wall_samples(engine, q, k, v, step, n), reps, rounds)
    flushed = in_rounds(engines, lambda label, engine, n: wall_samples(
        engine, q, k, v, step, n, between=lambda: (flusher.flush(), hold_device(device))), reps, rounds)
    for label, engine in engines.items():
        plan = engine.plan(step)
        rows[label] = {
            "tight": _medians([sample for part in tight[label] for sample in part]),
            # Each round's median plan + issue: how far one engine's host time moved within the run.
            "tight_plan_issue_us_by_round": [statistics.median(p + i for p, i, _, _ in part) for part in tight[label]],
            "after_flush_and_hold": _medians([sample for part in flushed[label] for sample in part]),
            "device_us": time_device_us(lambda: engine.run(q, k, v, plan), flusher=flusher).median_us,
            "route": getattr(plan, "route", None),
        }
        row = rows[label]["tight"]
        log(f"{name:<11}{label:<34}" + "".join(f"{row[c]:>8.1f}" for c in COLUMNS)
            + f"{rows[label]['device_us']:>8.1f}  | after flush + hold: wall "
            + f"{rows[label]['after_flush_and_hold']['wall_us']:.1f}")
    return {"seq_lens": list(map(int, seq_lens)), "engines": rows}


def load_bench_calibration(path: Path) -> Calibration:
    """The calibrate rule's JSON, or the starting constants of a conf/gpu/<gpu>.yaml."""
    if path.suffix == ".json":
        return load_calibration(path)
    return Calibration.from_mapping(yaml.safe_load(path.read_text()), str(path))


def run_cases(cases: dict, shape, calib, reps, seed, log, *, device="cuda", dtype="float16") -> tuple[dict, float]:
    """({name: run_case's record} of each of ``cases``' lengths on ``device``, the host time of one
    plain torch op there)."""
    log(f"{'case':<11}{'engine':<34}" + "".join(f"{c[:-3]:>8}" for c in COLUMNS) + f"{'device':>8}  (us)")
    flusher = L2Flusher(device)
    records = {name: run_case(name, seq_lens, shape, calib, flusher, reps, seed, log, dtype=dtype)
               for name, seq_lens in cases.items()}
    # How fast this host issues a plain torch op, to compare runs on different machines.
    op_issue_us = measure_launch_us(device)["host_us"]
    log(f"one torch op (x.add_(1)) issue: {op_issue_us:.1f} us")
    return records, op_issue_us


def main(argv=None) -> int:
    parser = bench_parser(__doc__, CASES, reps=50, seed=1)
    parser.add_argument("--calibration", type=Path, required=True,
                        help="the calibrate rule's JSON, or a conf/gpu/<gpu>.yaml for its starting constants")
    args = parser.parse_args(argv)

    config = {"cases": args.cases, "reps": args.reps, "calibration": str(args.calibration)}
    if not torch.cuda.is_available():
        return write_skipped_no_gpu(args.out, "pkv.measure.host_bench/1", config, args.seed)
    calib = load_bench_calibration(args.calibration)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    start = time.time()
    cases, op_issue_us = run_cases({name: CASES[name] for name in args.cases}, ModelShape(), calib, args.reps,
                                   args.seed, log)
    record = {"schema": "pkv.measure.host_bench/1", "seconds": time.time() - start, "reps": args.reps,
              "torch_op_issue_us": op_issue_us, "cases": cases,
              "command": "python -m pkv.measure.host_bench " + " ".join(argv or sys.argv[1:]),
              "provenance": collect_provenance(config=config, seed=args.seed)}
    write_json_atomic(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_refusal(main))
