"""How much repeated calibrations of one GPU agree: every decision and constant side by side.

A route decision that differs between two calibrations of the same GPU and commit is noise the
fits did not absorb; this report lists each decision (per regime: route, split count, context
gate, margin; the routed group sizes; the split rule) with its value in every file, and each
fitted constant with its spread, so a reader sees which calibration choices are stable.

    python -m pkv.report.calibration_spread calib_a.json calib_b.json [...] [--out spread.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from pkv.atomic_io import write_text_atomic
from pkv.policy.calibration import load_calibration, regime_field
from pkv.policy.regime import REGIMES
from pkv.refusal import exit_on_refusal

DECISION_PARAMS = ("route", "num_splits", "min_context_tokens", "margin")
CONSTANTS = ("beta_gbps", "lambda_us", "c_min", "flashinfer_plan_us", "persistentkv_plan_us",
             "flashinfer_ctas_per_row_head")


def spread(paths: list[Path]) -> dict:
    """{"decisions": [{name, values, agree}], "constants": [{name, values, mean, rel_spread}]}."""
    calibs = [load_calibration(path) for path in paths]  # a bad file is a refusal naming it
    gpus = sorted({c.gpu for c in calibs})
    decisions = []
    for regime in REGIMES:
        for param in DECISION_PARAMS:
            values = [getattr(c.regime(regime), param) for c in calibs]
            decisions.append({"name": regime_field(regime, param), "values": values, "agree": len(set(values)) == 1})
    for name, get in (("supported_group_sizes", lambda c: tuple(c.supported_group_sizes)),
                      ("workqueue_split_kind", lambda c: c.workqueue_split_kind)):
        values = [get(c) for c in calibs]
        decisions.append({"name": name, "values": values, "agree": len(set(values)) == 1})
    constants = []
    for name in CONSTANTS:
        values = [float(getattr(c, name)) for c in calibs]
        mean = statistics.fmean(values)
        constants.append({"name": name, "values": values, "mean": mean,
                          "rel_spread": (max(values) - min(values)) / mean if mean else 0.0})
    return {"files": [str(p) for p in paths], "gpus": gpus, "decisions": decisions, "constants": constants}


def render_markdown(report: dict) -> str:
    files = report["files"]
    head = "| Decision | " + " | ".join(f"[{i + 1}]" for i in range(len(files))) + " | Same in all |"
    rule = "|---|" + "---:|" * len(files) + "---|"
    lines = [f"Calibrations compared ({', '.join(report['gpus'])}):", ""]
    lines += [f"[{i + 1}] `{path}`" for i, path in enumerate(files)] + ["", head, rule]
    for d in report["decisions"]:
        cells = " | ".join(_text(v) for v in d["values"])
        lines.append(f"| {d['name']} | {cells} | {'yes' if d['agree'] else '**no**'} |")
    lines += ["", "| Constant | " + " | ".join(f"[{i + 1}]" for i in range(len(files))) + " | Spread / mean |",
              "|---|" + "---:|" * len(files) + "---:|"]
    for c in report["constants"]:
        cells = " | ".join(f"{v:.4g}" for v in c["values"])
        lines.append(f"| {c['name']} | {cells} | {c['rel_spread']:.1%} |")
    disagree = [d["name"] for d in report["decisions"] if not d["agree"]]
    lines += ["", ("Decisions that differ: " + ", ".join(disagree)) if disagree else "Every decision agrees."]
    return "\n".join(lines) + "\n"


def _text(value) -> str:
    if isinstance(value, tuple):
        return ", ".join(map(str, value))
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("calibrations", nargs="+", type=Path, help="calibration.json files of one GPU")
    parser.add_argument("--out", type=Path, help="write the Markdown here (0644, atomically) as well")
    args = parser.parse_args(argv)
    if len(args.calibrations) < 2:
        parser.error("give at least two calibration files to compare")
    text = render_markdown(spread(args.calibrations))
    if args.out:
        write_text_atomic(args.out, text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_refusal(main))
