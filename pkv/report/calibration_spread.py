"""How much repeated calibrations of one GPU agree: every decision and constant side by side.

A route decision that differs between two calibrations of the same GPU and commit is noise the
fits did not absorb; this report lists each decision (per regime: route, split count, context
gate, margin; the routed group sizes; the split rule) with its value in every file, each fitted
constant with its spread, and what the differences do to Table 2: the route and split count each
calibration gives every measured decode step of Table 2's synthetic traces on the held-out seeds
(the lengths decide a route, so no GPU is needed to count them), against the first calibration's.
A decision that differs is shown with the measured margin and the noise band each calibration
judged it by (``provenance.measurements.decisions``; "not recorded" in files written before it),
and a split count that differs with every swept count's summed device time in each calibration.

    python -m pkv.report.calibration_spread calib_a.json calib_b.json [...] [--out spread.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import yaml

from pkv.atomic_io import write_text_atomic
from pkv.measure.calibration_probe import trace_steps
from pkv.pipeline.traces import synthetic_trace
from pkv.policy.calibration import load_calibration_record, recorded_profile, regime_field
from pkv.policy.choose import RoutePolicy
from pkv.policy.regime import FEW_ROWS, REGIMES
from pkv.refusal import exit_on_refusal
from pkv.shape import ModelShape

DECISION_PARAMS = ("route", "num_splits", "min_context_tokens", "margin", "skew_target_ctas",
                   "over_split_balanced", "bucket_tiles_per_split")
# Where Table 2's runs are defined: its traces and held-out seeds (the DAG's axes), the steps an
# evaluate run measures after its warm-up, and each trace family's requests.
REPO = Path(__file__).resolve().parents[2]
DAG_CONFIG = REPO / "config" / "config.yaml"
EVALUATE = REPO / "conf" / "experiment" / "evaluate.yaml"
TRACE_CONF = REPO / "conf" / "trace"

CONSTANTS = ("beta_gbps", "lambda_us", "c_min", "flashinfer_plan_us", "persistentkv_plan_us",
             "flashinfer_ctas_per_row_head")


def spread(paths: list[Path]) -> dict:
    """{"decisions": [{name, values, agree}], "constants": [{name, values, mean, rel_spread}],
    "steps": step_decisions(...), "performance_result": False where any file is a CPU-profile calibration}."""
    loaded = [load_calibration_record(path) for path in paths]  # a bad file is a refusal naming it
    calibs = [calib for calib, _ in loaded]
    gpus = sorted({c.gpu for c in calibs})
    cpu_profile = any(recorded_profile(record) == "cpu" for _, record in loaded)
    decisions = []
    for regime in REGIMES:
        for param in DECISION_PARAMS:
            values = [getattr(c.regime(regime), param) for c in calibs]
            decisions.append({"name": regime_field(regime, param), "values": values, "agree": len(set(values)) == 1})
    for name, get in (("supported_group_sizes", lambda c: tuple(c.supported_group_sizes)),
                      ("workqueue_split_kind", lambda c: c.workqueue_split_kind),
                      ("uniform_target_ctas", lambda c: c.uniform_target_ctas)):
        values = [get(c) for c in calibs]
        decisions.append({"name": name, "values": values, "agree": len(set(values)) == 1})
    for d in decisions:
        d["evidence"] = [decision_evidence(record, d["name"]) for _, record in loaded]
        if d["name"].endswith(".num_splits"):
            d["split_totals"] = [split_totals(record, d["name"]) for _, record in loaded]
            d["split_step_times"] = [split_step_times(record, d["name"]) for _, record in loaded]
    constants = []
    for name in CONSTANTS:
        values = [float(getattr(c, name)) for c in calibs]
        mean = statistics.fmean(values)
        constants.append({"name": name, "values": values, "mean": mean,
                          "rel_spread": (max(values) - min(values)) / mean if mean else 0.0})
    return {"files": [str(p) for p in paths], "gpus": gpus, "decisions": decisions, "constants": constants,
            "flashinfer_picks": [flashinfer_picks(record) for _, record in loaded],
            "steps": step_decisions(calibs), "performance_result": not cpu_profile}


def flashinfer_picks(record: dict) -> dict[tuple[int, int], dict] | None:
    """{(rows, longest row as a power of two): {"picked", "measured"}} of FlashInfer's path probes
    on the model's shape (measurements.flashinfer_paths); None where the calibration kept none. The
    baseline side of every route decision runs these picks, so calibrations whose picks differ
    measured different FlashInfer kernels."""
    measured = (record.get("provenance") or {}).get("measurements") or {}
    paths = measured.get("flashinfer_paths")
    if not isinstance(paths, dict):
        return None
    return {(int(p["batch"]), int(p["longest_pow2"])): {"picked": p.get("picked"), "measured": p.get("measured") or {}}
            for p in paths.get("probed", [])}


def _pick_text(entry: dict | None) -> str:
    """"cc (cc 75.4, tc 85.9, holistic 78.2 us)": a class's pick and each path's probed decode time."""
    if entry is None:
        return "not probed"
    times = ", ".join(f"{path} {m['device_us']:.1f}" for path, m in sorted(entry["measured"].items())
                      if isinstance(m, dict) and isinstance(m.get("device_us"), (int, float)))
    return f"{entry['picked']} ({times} us)" if times else str(entry["picked"])


def decision_evidence(record: dict, name: str) -> dict | None:
    """What a calibration record kept of how it took decision ``name``: its measured margin and
    noise band (measurements.decisions); for the B2-7 route of files written before those, the
    margin alone (its split sweep's speedup); None where it kept neither."""
    measured = (record.get("provenance") or {}).get("measurements") or {}
    entry = (measured.get("decisions") or {}).get(name)
    if isinstance(entry, dict):
        return entry
    if name == regime_field(FEW_ROWS, "route"):
        for sweep in (measured.get("split_sweeps") or {}).values():
            route = sweep.get("regime_route") or sweep.get("boundary_route")
            if isinstance(route, dict) and "speedup" in route:
                return {"value": route.get("fitted"), "measured_margin": route["speedup"]}
    return None


def _fitting_sweeps(record: dict, name: str) -> list[dict]:
    """The split sweeps (measurements.split_sweeps) of the traces that fit decision ``name``, by trace name."""
    sweeps = ((record.get("provenance") or {}).get("measurements") or {}).get("split_sweeps") or {}
    return [sweeps[trace] for trace in sorted(sweeps) if sweeps[trace].get("fits") == name
            and isinstance(sweeps[trace].get("device_us_total_by_splits"), dict)]


def _shared_counts(sweeps: list[dict]) -> list[str]:
    """The split counts every one of ``sweeps`` timed, in numeric order (JSON keys)."""
    return sorted(set.intersection(*(set(sweep["device_us_total_by_splits"]) for sweep in sweeps)), key=int)


def split_totals(record: dict, name: str) -> dict[int, float] | None:
    """Each swept split count's device time, us, summed over the traces whose sweep fits split-count
    decision ``name``, over the counts they all swept: what the decision compared. None where the
    calibration kept no such sweep."""
    sweeps = _fitting_sweeps(record, name)
    if not sweeps:
        return None
    return {int(k): sum(float(sweep["device_us_total_by_splits"][k]) for sweep in sweeps)
            for k in _shared_counts(sweeps)}


def split_step_times(record: dict, name: str) -> dict[int, list[float]] | None:
    """The per-step device times behind split_totals (each fitting trace's steps in order, the traces
    by name), where the calibration kept them (``device_us_by_step``); else None."""
    sweeps = _fitting_sweeps(record, name)
    if not sweeps or not all(isinstance(sweep.get("device_us_by_step"), dict) for sweep in sweeps):
        return None
    shared = _shared_counts(sweeps)
    if not all(k in sweep["device_us_by_step"] for sweep in sweeps for k in shared):
        return None
    return {int(k): [float(us) for sweep in sweeps for us in sweep["device_us_by_step"][k]] for k in shared}


def _spread_across_runs(runs: list[list[float]]) -> list[float]:
    """Each position's (max - min) / mean over runs of the same positions (steps, split counts)."""
    return [(max(times) - min(times)) / statistics.fmean(times) for times in zip(*runs)]


def _interval_text(entry: dict) -> str:
    """" ± h" of a group probe's relative interval half-width, where the calibration kept one."""
    half = entry.get("interval_half_width")
    return f" ± {half:.1%}" if isinstance(half, (int, float)) else ""


def _worst_probe_text(entry: dict) -> str:
    """" (probe: FlashInfer x us on <picks>, PersistentKV y us)" of a group size's worst probe,
    where the calibration kept its sums."""
    fi_us, pkv_us = entry.get("flashinfer_device_us_total"), entry.get("persistentkv_device_us_total")
    if not isinstance(fi_us, (int, float)) or not isinstance(pkv_us, (int, float)):
        return ""
    picks = entry.get("flashinfer_picks") or {}
    on = f" on {', '.join(f'{cls} {path}' for cls, path in sorted(picks.items()))}" if picks else ""
    return f" ({entry.get('probe', 'worst probe')}: FlashInfer {fi_us:,.1f} us{on}, PersistentKV {pkv_us:,.1f} us)"


def evidence_text(entry: dict | None) -> str:
    """One decision's margin and band as spread.md prints them."""
    if not entry:
        return "not recorded"
    band = entry.get("noise_band")
    band_text = f"band {band:.1%}" if isinstance(band, (int, float)) else "band not recorded"
    if "by_group" in entry:  # the group sizes: each probed G's worst probe
        groups = ", ".join(f"G={g} {e['measured_margin']:.3f}x{_interval_text(e)}"
                           f"{'' if e.get('opened') else ' (closed)'}{_worst_probe_text(e)}"
                           for g, e in sorted(entry["by_group"].items(), key=lambda item: int(item[0])))
        return f"{groups}; {band_text}"
    margin = entry.get("measured_margin")
    if "tied" in entry:  # a split count: the candidates tied with the fastest, the fewest taken
        within = f"within {band:.1%} of it" if isinstance(band, (int, float)) else "tied with it"
        return f"fastest {entry['fastest']}; {within}: {', '.join(map(str, entry['tied']))}"
    text = f"margin {margin:.3f}x" if isinstance(margin, (int, float)) else "margin not measured"
    if "boundary_class" in entry:  # a context gate: the class at its boundary, and the one below
        text = f"class {entry['boundary_class']} {text}"
        if isinstance(entry.get("margin_below"), (int, float)):
            text += f", the class below {entry['margin_below']:.3f}x"
    required = entry.get("required_margin")
    if isinstance(required, (int, float)):
        relation = ">=" if required < 1 else ">"
        band_text += f", needs {relation} {required:.3f}x"
    default_us, candidate_us = entry.get("default_device_us_total"), entry.get("candidate_device_us_total")
    if isinstance(default_us, (int, float)) and isinstance(candidate_us, (int, float)):
        # Both sides' sums, so calibrations that disagree show which side moved.
        band_text += f"; {entry.get('default', 'default')} {default_us:,.1f} us, candidate {candidate_us:,.1f} us"
    return f"{text}; {band_text}"


def _table2_runs() -> tuple[list[tuple[str, int]], list[int], int, int]:
    """([(family, max_active)] of the DAG's synthetic evaluate traces, held-out seeds, warm-up and
    measured steps of an evaluate run), read where the DAG and the experiment read them."""
    axes = yaml.safe_load(DAG_CONFIG.read_text())
    experiment = yaml.safe_load(EVALUATE.read_text())["experiment"]
    traces = []
    for name in axes["evaluate_traces"]:
        family, _, batch = name.rpartition("_b")
        traces.append((family, int(batch)))
    return traces, [int(s) for s in axes["held_out_seeds"]], experiment["warmup_steps"], experiment["measured_steps"]


def step_decisions(calibs, shape: ModelShape = ModelShape()) -> list[dict]:
    """Per Table 2 trace: its measured steps over the held-out seeds (replayed as the harness
    replays them; a route depends only on the lengths), and for each calibration after the first
    how many of them take another route than under the first: another engine, split count, split
    rule or balanced budget."""
    policies = [RoutePolicy(c, num_kv_heads=shape.num_kv_heads, group_size=shape.group_size,
                            head_dim=shape.head_dim) for c in calibs]
    traces, seeds, warmup, measured = _table2_runs()
    rows = []
    for family, batch in traces:
        conf = yaml.safe_load((TRACE_CONF / f"{family}.yaml").read_text())
        steps, differ = 0, [0] * (len(policies) - 1)
        for seed in seeds:
            requests = synthetic_trace(family, int(conf["num_requests"]), seed,
                                       length_scale=float(conf["length_scale"]),
                                       decode_len_range=tuple(conf["decode_len_range"]), arrivals=conf["arrivals"],
                                       arrival_rate=float(conf["arrival_rate"]))
            _, replayed = trace_steps(requests, page_size=int(conf["page_size"]),
                                      hole_fraction=float(conf["hole_fraction"]), max_active=batch,
                                      num_steps=warmup + measured, seed=seed,
                                      layout=conf.get("page_layout", "recycled"),
                                      page_order=conf.get("page_order", "shuffled"))
            for step in replayed[warmup:]:
                routes = [p.choose(step).route for p in policies]
                steps += 1
                for i, other in enumerate(routes[1:]):
                    differ[i] += other != routes[0]
        rows.append({"trace": f"{family}_b{batch}", "steps": steps, "differ": differ})
    return rows


def render_markdown(report: dict) -> str:
    files = report["files"]
    head = "| Decision | " + " | ".join(f"[{i + 1}]" for i in range(len(files))) + " | Same in all |"
    rule = "|---|" + "---:|" * len(files) + "---|"
    lines = [] if report.get("performance_result", True) else [
        "**CPU profile: not a performance result.** These calibrations fit CPU timings; their spread says "
        "nothing about a GPU's.", ""]
    lines += [f"Calibrations compared ({', '.join(report['gpus'])}):", ""]
    lines += [f"[{i + 1}] `{path}`" for i, path in enumerate(files)] + ["", head, rule]
    for d in report["decisions"]:
        cells = " | ".join(_text(v) for v in d["values"])
        lines.append(f"| {d['name']} | {cells} | {'yes' if d['agree'] else '**no**'} |")
    lines += ["", "| Constant | " + " | ".join(f"[{i + 1}]" for i in range(len(files))) + " | Spread / mean |",
              "|---|" + "---:|" * len(files) + "---:|"]
    for c in report["constants"]:
        cells = " | ".join(f"{v:.4g}" for v in c["values"])
        lines.append(f"| {c['name']} | {cells} | {c['rel_spread']:.1%} |")
    disagree = [d for d in report["decisions"] if not d["agree"]]
    lines += ["", ("Decisions that differ: " + ", ".join(d["name"] for d in disagree)) if disagree
              else "Every decision agrees."]
    if disagree:
        # Each differing decision as each calibration took it: the value, the measured margin (the
        # default's device time over the candidate's) and the noise band it had to clear.
        lines += ["", "Each decision that differs, with its measured margin and noise band in every calibration:",
                  "", "| Decision | " + " | ".join(f"[{i + 1}]" for i in range(len(files))) + " |",
                  "|---|" + "---|" * len(files)]
        for d in disagree:
            cells = " | ".join(f"{_text(v)}: {evidence_text(e)}" for v, e in zip(d["values"], d.get("evidence")
                                                                                 or [None] * len(files)))
            lines.append(f"| {d['name']} | {cells} |")
    totals = [d for d in disagree if d.get("split_totals") and all(d["split_totals"])]
    if totals:
        # The sums a split count was decided on, run by run: a count whose sum moves between runs by
        # as much as the gaps between counts decides on noise, whichever rule breaks the tie.
        lines += ["", "Each split count's device time (us) summed over the traces that fit the decision, in every "
                  "calibration, and how far it moved between them:"]
        for d in totals:
            counts = sorted(set.intersection(*(set(t) for t in d["split_totals"])))
            lines += ["", f"| {d['name']} | " + " | ".join(map(str, counts)) + " |", "|---|" + "---:|" * len(counts)]
            lines += [f"| [{i + 1}] | " + " | ".join(f"{t[c]:,.1f}" for c in counts) + " |"
                      for i, t in enumerate(d["split_totals"])]
            moved = _spread_across_runs([[t[c] for c in counts] for t in d["split_totals"]])
            lines.append("| spread / mean | " + " | ".join(f"{m:.1%}" for m in moved) + " |")
            steps = d.get("split_step_times") or []
            # Only where every calibration kept the same steps of every count.
            if steps and all(steps) and all(c in t for t in steps for c in counts) and all(
                    len({len(t[c]) for t in steps}) == 1 for c in counts):
                # The same steps' times run by run: where the median step moved about as much as the sum,
                # the count's steps moved together (a drift of the run); where it moved several times as
                # much, each step's timing is noisy and the sum averages it down.
                step_moved = [statistics.median(_spread_across_runs([t[c] for t in steps])) for c in counts]
                lines.append("| median step's spread / mean | " + " | ".join(f"{m:.1%}" for m in step_moved) + " |")
    picks = report.get("flashinfer_picks") or []
    if len(picks) == len(files) and all(p is not None for p in picks):
        classes = sorted(set().union(*picks))
        differ = [c for c in classes if len({(p.get(c) or {}).get("picked") for p in picks}) > 1]
        if differ:
            lines += ["", "FlashInfer's path per batch class (the model's shape) where the calibrations' probes "
                      "picked differently, with each path's probed decode time:", "",
                      "| Class | " + " | ".join(f"[{i + 1}]" for i in range(len(files))) + " |",
                      "|---|" + "---|" * len(files)]
            lines += [f"| B{rows} {longest} | " + " | ".join(_pick_text(p.get((rows, longest))) for p in picks) + " |"
                      for rows, longest in differ]
        else:
            lines += ["", f"FlashInfer's probes picked the same path for every batch class in all ({len(classes)} "
                      "classes of the model's shape)."]
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
