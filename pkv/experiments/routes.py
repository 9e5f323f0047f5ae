"""Which route the calibrated policy gives each step of a trace, without a GPU and without running
an engine: the trace's steps as a run of the same overrides would decode them (the same requests,
seed, KV pool and continuous batching), each handed to ``RoutePolicy.choose``.

    python -m pkv.experiments.routes trace=bimodal trace.max_active=8 seed=20260623 gpu=h100 \\
        calibration=artifacts/reference/h100/calibration/calibration.json
    python -m pkv.experiments.routes trace=external trace.path=my_trace.csv trace.max_active=8 \\
        calibration=artifacts/h200/calibration/calibration.json --json /tmp/routes.json --all-steps

It prints the steps by row count (with their longest rows), then each route (with its split count
and rule) and decision basis, and how many steps took it. The lengths are the GPU profile's (no
CPU scaling) unless ``profile=cpu`` is given; without a ``device=`` override the steps are built
on the CPU, which is all the policy reads. By default the steps are those an evaluate or
model-step run of the same overrides times (warm-up and measured); ``--all-steps`` replays the
whole trace. ``--json`` writes every step's record and the counts.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from pkv.atomic_io import write_json_atomic
from pkv.config import compose
from pkv.engines import role_policy
from pkv.experiments.common import (
    engine_role_and_options,
    kv_pool_pages,
    load_requests,
    model_shape,
    resolve_settings,
    run_calibration,
    trace_name,
)
from pkv.measure.calibration_probe import trace_steps
from pkv.policy.route import MERGE_LAUNCH, ROUTE_FLASHINFER
from pkv.provenance import collect_provenance
from pkv.report.table_data.labels import route_label
from pkv.refusal import exit_on_refusal

SCHEMA = "pkv.experiments.routes/1"


def step_route_label(route) -> str:
    """A route as the tables name it (with its split count), its merge where a PersistentKV route
    does not launch one, and its split rule where not the fixed one."""
    label = route_label(route.name, int(route.num_splits))
    if route.name != ROUTE_FLASHINFER and route.merge != MERGE_LAUNCH:
        label += f", {route.merge} merge"
    rule = route.split_rule
    return label + (f"; {rule}" if rule and rule != "fixed" else "")


def replay_routes(cfg, *, all_steps: bool = False) -> dict:
    """The adaptive policy's decision on every step of cfg's trace: {"steps": [...], "counts": [...]}.
    Each step record has its position, batch size, longest row, tokens, route label and decision
    basis; counts are (route label, basis, steps) rows, most steps first."""
    settings = resolve_settings(cfg)
    calib = run_calibration(cfg)
    requests = load_requests(cfg.trace, cfg.seed, settings)
    role, options = engine_role_and_options("adaptive", cfg.engine)  # the run's variants (a merge, a bucket mode)
    policy = role_policy(role, options, model_shape(cfg), calib)
    trace = cfg.trace
    _, decoded = trace_steps(
        requests, page_size=trace.page_size, hole_fraction=trace.hole_fraction, max_active=trace.max_active,
        num_steps=None if all_steps else settings.warmup_steps + settings.measured_steps, seed=cfg.seed,
        layout=trace.page_layout, pool_pages=kv_pool_pages(trace, settings, requests), page_order=trace.page_order)
    steps = []
    for position, step in enumerate(decoded):
        decision = policy.choose(step)
        lens = [int(n) for n in step.seq_lens]
        steps.append({"step": position, "batch": len(lens), "max_len": max(lens), "tokens": sum(lens),
                      "route": step_route_label(decision.route), "basis": decision.basis,
                      "reason": decision.reason})
    counts = Counter((s["route"], s["basis"]) for s in steps)
    return {"steps": steps,
            "counts": [{"route": r, "basis": b, "steps": n} for (r, b), n in counts.most_common()]}


def rows_line(steps: list[dict]) -> str:
    """The steps by row count, each with its longest rows' range: a trace's max_active is a cap, and
    its steps may hold fewer rows (one request at a time of a conversation trace: B1 throughout)."""
    by_batch: dict[int, list[int]] = {}
    for s in steps:
        by_batch.setdefault(s["batch"], []).append(s["max_len"])
    return "rows: " + "; ".join(f"B{b} on {len(longest)} (longest row {min(longest)}-{max(longest)} tokens)"
                                for b, longest in sorted(by_batch.items()))


def _overrides(given: list[str]) -> list[str]:
    """The caller's overrides, plus what a replay needs and a run would take from the caller: the
    steps built on the CPU (the policy reads lengths only) and an ``out`` the replay never writes."""
    named = {o.lstrip("+~").split("=", 1)[0] for o in given}
    return [*given, *(f"{key}={value}" for key, value in (("device", "cpu"), ("out", "unused")) if key not in named)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as pkv.cli takes them")
    parser.add_argument("--json", help="write every step's route and the counts to this file")
    parser.add_argument("--all-steps", action="store_true", help="replay the whole trace, not only the timed steps")
    args = parser.parse_args(argv)
    overrides = _overrides(args.overrides)
    cfg = compose(overrides)
    replay = replay_routes(cfg, all_steps=args.all_steps)
    source = cfg.calibration or f"conf/gpu/{cfg.gpu.get('gpu', '?')}.yaml (no calibration= given)"
    print(f"{trace_name(cfg.trace)}, seed {cfg.seed}, {len(replay['steps'])} steps; policy from {source}")
    print(rows_line(replay["steps"]))
    width = max([len(c["route"]) for c in replay["counts"]] + [5])
    print(f"{'route':<{width}}  {'basis':<14} {'steps':>6} {'share':>6}")
    for row in replay["counts"]:
        share = row["steps"] / len(replay["steps"])
        print(f"{row['route']:<{width}}  {row['basis']:<14} {row['steps']:>6} {share:>6.1%}")
    if args.json:
        write_json_atomic(args.json, {"schema": SCHEMA, "trace": trace_name(cfg.trace), "seed": cfg.seed,
                                      "calibration": source, "overrides": overrides, **replay,
                                      "provenance": collect_provenance(config={"overrides": overrides},
                                                                       seed=cfg.seed)})
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_refusal(main))
