"""Where a trace run's time went, step by step: the per-step records of result files, grouped.

A result file of the harness (``evaluate``, ``mlp`` and ``ablate`` outputs) keeps one record per
measured step. This groups them by route and kernel family and prints, for each engine of a run
directory, the steps of each group and their mean plan, issue, wall and device time, so a ratio
in a table can be traced to the steps behind it; then each engine's mean wall time by its place in
the step's order, which the harness rotates:

    python -m pkv.step_report artifacts/h200/evaluate/bucketed_b1/seed20260623
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from pkv.results import read_result

TIMES = ("plan_us", "issue_us", "wall_us", "cuda_us")


def group_steps(per_step: list[dict]) -> dict[tuple[str, str], dict]:
    """{(route, variant): {"steps": n, "<time>": mean}} over the records, in first-seen order."""
    sums: dict[tuple[str, str], dict] = defaultdict(lambda: {"steps": 0, **{t: 0.0 for t in TIMES}})
    for record in per_step:
        key = (str(record.get("route")), str(record.get("variant") or "-"))
        group = sums[key]
        group["steps"] += 1
        for t in TIMES:
            group[t] += float(record[t])
    return {key: {"steps": g["steps"], **{t: g[t] / g["steps"] for t in TIMES}} for key, g in sums.items()}


def wall_by_position(per_step: list[dict]) -> dict[int, dict]:
    """{position: {"steps": n, "wall_us": mean, "plan_us": mean}} for the records that carry the
    engine's place in the step's order (0: it ran first). The harness rotates the order step by
    step; a wide gap between positions means single-step wall ratios are mostly order noise."""
    sums: dict[int, dict] = defaultdict(lambda: {"steps": 0, "wall_us": 0.0, "plan_us": 0.0})
    for record in per_step:
        if "position" not in record:
            continue
        group = sums[int(record["position"])]
        group["steps"] += 1
        group["wall_us"] += float(record["wall_us"])
        group["plan_us"] += float(record["plan_us"])
    return {p: {"steps": g["steps"], "wall_us": g["wall_us"] / g["steps"], "plan_us": g["plan_us"] / g["steps"]}
            for p, g in sorted(sums.items())}


def report(run_dir: Path) -> str:
    files = sorted(run_dir.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"{run_dir}: no result files (*.json) here")
    lines = [f"{'engine':<28}{'route':<24}{'kernels':<9}{'steps':>6}"
             + "".join(f"{t.replace('_us', ' us'):>11}" for t in TIMES)]
    positions: dict[str, dict[int, dict]] = {}
    for path in files:
        metrics = read_result(path).get("metrics")
        if metrics is None:
            lines.append(f"{path.stem:<28}skipped")
            continue
        per_step = metrics.get("per_step")
        if not per_step:
            lines.append(f"{path.stem:<28}no per-step records (written before they were kept)")
            continue
        for (route, variant), g in group_steps(per_step).items():
            lines.append(f"{path.stem:<28}{route:<24}{variant:<9}{g['steps']:>6}"
                         + "".join(f"{g[t]:>11.1f}" for t in TIMES))
        positions[path.stem] = wall_by_position(per_step)
    if any(positions.values()):
        lines += ["", f"{'engine':<28}{'place in step':<16}{'steps':>6}{'plan us':>11}{'wall us':>11}"]
        for engine, by_position in positions.items():
            for place, g in by_position.items():
                lines.append(f"{engine:<28}{ordinal(place):<16}{g['steps']:>6}{g['plan_us']:>11.1f}{g['wall_us']:>11.1f}")
    return "\n".join(lines)


def ordinal(position: int) -> str:
    return {0: "ran first", 1: "ran second"}.get(position, f"ran {position + 1}th")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path, help="directories holding one run's result files")
    args = parser.parse_args(argv)
    for run_dir in args.run_dirs:
        print(f"== {run_dir}")
        print(report(run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
