"""Where a trace run's time went, step by step: the per-step records of result files, grouped.

A result file of the harness (``evaluate``, ``mlp`` and ``ablate`` outputs) keeps one record per
measured step. This groups them by route and kernel family and prints, for each engine of a run
directory, the steps of each group and their mean plan, issue, wall and device time, so a ratio
in a table can be traced to the steps behind it; then each engine's mean plan and wall time by its
place in the step's order and by the engine that ran right before it in the step, both of which the
harness balances (``pkv.measure.harness.engine_order``):

    python -m pkv.report.step_report artifacts/h200/evaluate/bucketed_b1/seed20260623
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from pkv.report.results import read_result

TIMES = ("plan_us", "issue_us", "wall_us", "cuda_us")


def _means_by(per_step: list[dict], key) -> dict:
    """{key(record): {"steps": n, "<time>": mean}} over the records whose key is not None, in
    first-seen order."""
    sums: dict = defaultdict(lambda: {"steps": 0, **{t: 0.0 for t in TIMES}})
    for record in per_step:
        k = key(record)
        if k is None:
            continue
        group = sums[k]
        group["steps"] += 1
        for t in TIMES:
            group[t] += float(record[t])
    return {k: {"steps": g["steps"], **{t: g[t] / g["steps"] for t in TIMES}} for k, g in sums.items()}


def group_steps(per_step: list[dict]) -> dict[tuple[str, str], dict]:
    """{(route, variant): {"steps": n, "<time>": mean}} over the records, in first-seen order."""
    return _means_by(per_step, lambda r: (str(r.get("route")), str(r.get("variant") or "-")))


def wall_by_position(per_step: list[dict]) -> dict[int, dict]:
    """{position: {"steps": n, "<time>": mean}} for the records that carry the engine's place in
    the step's order (0: it ran first). The harness balances the order over steps; a wide gap
    between positions means single-step wall ratios are mostly order noise."""
    means = _means_by(per_step, lambda r: int(r["position"]) if "position" in r else None)
    return dict(sorted(means.items()))


FIRST = "(ran first)"


def wall_by_predecessor(per_step: list[dict]) -> dict[str, dict]:
    """{engine that ran right before in the step, or FIRST: {"steps": n, "<time>": mean}} for the
    records that carry it. A gap here that the places do not show is one engine warming the host
    for another (two engines planning through the same library)."""
    means = _means_by(per_step, lambda r: (r["after"] or FIRST) if "after" in r else None)
    return dict(sorted(means.items()))


def report(run_dir: Path) -> str:
    files = sorted(run_dir.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"{run_dir}: no result files (*.json) here")
    records = {path: read_result(path) for path in files}
    cpu_profile = any(rec.get("performance_result") is False for rec in records.values())
    # On the CPU profile there are no CUDA events: the device-time column is the host clock around each call.
    labels = {t: ("cpu-clock us" if cpu_profile and t == "cuda_us" else t.replace("_us", " us")) for t in TIMES}
    lines = ["CPU profile: not a performance result; cpu-clock us is the host clock around each call"] if cpu_profile \
        else []
    lines.append(f"{'engine':<28}{'route':<24}{'kernels':<9}{'steps':>6}" + "".join(f"{labels[t]:>13}" for t in TIMES))
    positions: dict[str, dict[int, dict]] = {}
    predecessors: dict[str, dict[str, dict]] = {}
    for path, record in records.items():
        metrics = record.get("metrics")
        if metrics is None:
            lines.append(f"{path.stem:<28}skipped")
            continue
        per_step = metrics.get("per_step")
        if not per_step:
            lines.append(f"{path.stem:<28}no per-step records (written before they were kept)")
            continue
        for (route, variant), g in group_steps(per_step).items():
            lines.append(f"{path.stem:<28}{route:<24}{variant:<9}{g['steps']:>6}"
                         + "".join(f"{g[t]:>13.1f}" for t in TIMES))
        positions[path.stem] = wall_by_position(per_step)
        predecessors[path.stem] = wall_by_predecessor(per_step)
    for title, groups, name in (("place in step", positions, ordinal),
                                ("ran right after", predecessors, str)):
        if any(groups.values()):
            lines += ["", f"{'engine':<28}{title:<28}{'steps':>6}{'plan us':>11}{'wall us':>11}"]
            for engine, by_key in groups.items():
                for key, g in by_key.items():
                    lines.append(f"{engine:<28}{name(key):<28}{g['steps']:>6}{g['plan_us']:>11.1f}"
                                 f"{g['wall_us']:>11.1f}")
    return "\n".join(lines)


def ordinal(position: int) -> str:
    return "ran " + {0: "first", 1: "second", 2: "third"}.get(position, f"{position + 1}th")


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
