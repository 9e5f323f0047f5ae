"""How much repeated calibrations of one GPU agree: every decision and constant side by side.

A route decision that differs between two calibrations of the same GPU and commit is noise the
fits did not absorb; this report lists each decision (per regime: route, split count, context
gate, margin; the routed group sizes; the split rule) with its value in every file, each fitted
constant with its spread, and what the differences do to Table 2: the route and split count each
calibration gives every measured decode step of Table 2's synthetic traces on the held-out seeds
(the lengths decide a route, so no GPU is needed to count them), against the first calibration's.

    python -m pkv.report.calibration_spread calib_a.json calib_b.json [...] [--out spread.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import yaml

from pkv.atomic_io import write_text_atomic
from pkv.pipeline.pages import assign_pages
from pkv.pipeline.serving import ContinuousDecoder
from pkv.pipeline.traces import synthetic_trace
from pkv.policy.calibration import load_calibration, regime_field
from pkv.policy.choose import RoutePolicy
from pkv.policy.regime import REGIMES
from pkv.shape import ModelShape
from pkv.refusal import exit_on_refusal

DECISION_PARAMS = ("route", "num_splits", "min_context_tokens", "margin")
# Table 2's synthetic traces (config/config.yaml's evaluate_traces), its held-out seeds and the
# steps its evaluate runs measure after their warm-up (conf/experiment/evaluate.yaml).
CONF = Path(__file__).resolve().parents[2] / "conf"
TABLE2_TRACES = (("bucketed", 1), ("homogeneous", 8), ("bimodal", 8), ("uniform", 8), ("zipf", 8), ("bimodal", 4))
HELD_OUT_SEEDS = (20260623, 20260624, 20260625, 20260626, 20260627)
WARMUP_STEPS, MEASURED_STEPS = 4, 64

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
    return {"files": [str(p) for p in paths], "gpus": gpus, "decisions": decisions, "constants": constants,
            "steps": step_decisions(calibs)}


def _trace_steps(family: str, max_active: int, seed: int) -> list:
    """The measured steps of one Table 2 run, as the harness replays them (lengths only matter)."""
    conf = yaml.safe_load((CONF / "trace" / f"{family}.yaml").read_text())
    requests = synthetic_trace(family, int(conf["num_requests"]), seed, length_scale=float(conf["length_scale"]),
                               decode_len_range=tuple(conf["decode_len_range"]), arrivals=conf["arrivals"],
                               arrival_rate=float(conf["arrival_rate"]))
    assignment = assign_pages([r.total_len for r in requests], int(conf["page_size"]), float(conf["hole_fraction"]),
                              seed)
    steps = list(ContinuousDecoder(requests, assignment, max_active,
                                   max_steps=WARMUP_STEPS + MEASURED_STEPS).steps())
    return steps[WARMUP_STEPS:]


def step_decisions(calibs, shape: ModelShape = ModelShape()) -> list[dict]:
    """Per Table 2 trace: its measured steps over the held-out seeds, and for each calibration after
    the first how many of them take another route or split count than under the first."""
    policies = [RoutePolicy(c, num_kv_heads=shape.num_kv_heads, group_size=shape.group_size,
                            head_dim=shape.head_dim) for c in calibs]
    rows = []
    for family, batch in TABLE2_TRACES:
        steps, differ = 0, [0] * (len(policies) - 1)
        for seed in HELD_OUT_SEEDS:
            for step in _trace_steps(family, batch, seed):
                routes = [p.choose(step).route for p in policies]
                picked = [(r.name, r.num_splits if r.name != "flashinfer" else None) for r in routes]
                steps += 1
                for i, other in enumerate(picked[1:]):
                    differ[i] += other != picked[0]
        rows.append({"trace": f"{family}_b{batch}", "steps": steps, "differ": differ})
    return rows


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
    others = [f"[{i + 1}]" for i in range(1, len(files))]
    lines += ["", "Table 2's measured steps (held-out seeds) that take another route or split count than under [1]:",
              "", "| Trace | Steps | " + " | ".join(others) + " |", "|---|---:|" + "---:|" * len(others)]
    for row in report["steps"]:
        cells = " | ".join(f"{n} ({n / row['steps']:.0%})" for n in row["differ"])
        lines.append(f"| {row['trace']} | {row['steps']} | {cells} |")
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
