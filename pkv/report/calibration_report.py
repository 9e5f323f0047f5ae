"""What a calibration fitted, and the measurements behind each choice.

The calibrate rule keeps every timing it decided from in the calibration JSON's provenance. This
prints them as the route policy reads them: the operating point of each batch regime, each split
sweep as FlashInfer / PersistentKV device time per split count (above 1: PersistentKV faster; the
selected count marked), each regime's context gate with its context classes (marked where they
held), the gate probes and the group sizes they opened:

    python -m pkv.report.calibration_report artifacts/h200/calibration/calibration.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pkv.policy.calibration import LEGACY_FIELDS, load_calibration, recorded_profile, regime_field
from pkv.policy.regime import FEW_ROWS, MANY_ROWS, REGIMES, SINGLE_ROW
from pkv.policy.route import ROUTE_BUCKET, ROUTE_FLASHINFER
from pkv.refusal import exit_on_refusal

REGIME_LABELS = {SINGLE_ROW: "B1", FEW_ROWS: "B2-7", MANY_ROWS: "B8+"}
_ROUTE_LABELS = {ROUTE_FLASHINFER: "FlashInfer", ROUTE_BUCKET: "bucket"}


def _recorded(records: dict, regime: str, param: str):
    """A regime parameter's record, under its name or the flat name of files before the regimes."""
    if regime_field(regime, param) in records:
        return records[regime_field(regime, param)]
    legacy = [name for name, target in LEGACY_FIELDS.items() if target == (regime, param)]
    return next((records[name] for name in legacy if name in records), None)


def _band(fit: dict) -> str:
    """The noise band a decision's measured margin had to clear, where the record keeps one (files
    before the band keep none; a band that could not be measured is null)."""
    band, required = fit.get("noise_band"), fit.get("required_margin")
    if "noise_band" not in fit:
        return ""
    if band is None or required is None:
        return "; noise band not measurable (fewer than 2 steps)"
    return f"; noise band {float(band):.1%}, needs > {float(required):.3f}x"


def _ratio(flashinfer_us: float, persistentkv_us: float) -> str:
    return f"{flashinfer_us / persistentkv_us:.3f}" if persistentkv_us > 0 else "-"


def operating_points(calib) -> list[str]:
    """The schedule the route policy uses in each batch regime, and the group sizes it routes."""
    lines = []
    for regime in REGIMES:
        params = calib.regime(regime)
        route = _ROUTE_LABELS.get(params.route, "workqueue")
        if params.route != ROUTE_FLASHINFER:
            route += f" S={params.num_splits} from {params.min_context_tokens} tokens"
        lines.append(f"{REGIME_LABELS[regime]} {route}")
    if calib.uniform_target_ctas:  # the uniform cap, where the calibration set one
        lines.append(f"uniform batches about {calib.uniform_target_ctas} workqueue CTAs")
    for regime in REGIMES:  # the skew rule and the over-split rule, where the calibration set them
        params = calib.regime(regime)
        if params.skew_target_ctas:
            lines.append(f"{REGIME_LABELS[regime]} skewed steps balanced over about {params.skew_target_ctas} "
                         f"workqueue CTAs" + (", over-split steps too" if params.over_split_balanced else ""))
        if params.route == ROUTE_BUCKET and params.bucket_tiles_per_split > 1:  # the short-row rule
            lines.append(f"{REGIME_LABELS[regime]} short rows at least {params.bucket_tiles_per_split} tiles a "
                         f"split (fewer splits, a power of two)")
    return [*lines, f"G routed: {', '.join(str(g) for g in calib.supported_group_sizes)}"]


def split_sweeps(sweeps: dict) -> list[str]:
    lines = []
    for name, sweep in sweeps.items():
        if "device_us_total_by_waves" in sweep:
            lines += _skew_sweep(name, sweep)
            continue
        if "device_us_total_by_tiles" in sweep:
            lines += _short_row_sweep(name, sweep)
            continue
        fi = float(sweep["flashinfer_device_us_total"])
        cells = []
        # In split order: the file's keys are strings, sorted as text ("12" before "2").
        for splits, us in sorted(sweep["device_us_total_by_splits"].items(), key=lambda item: int(item[0])):
            mark = "*" if int(splits) == int(sweep["selected_splits"]) else ""
            cells.append(f"{splits}{mark}: {_ratio(fi, float(us))}")
        fits = sweep.get("fits", "")
        together = sweep.get("fitted_with", [name])
        with_others = f" (with {', '.join(t for t in together if t != name)})" if len(together) > 1 else ""
        lines.append(f"{name} -> {fits}{with_others}: " + ", ".join(cells))
        tied = sweep.get("tied_splits") or []
        if len(tied) > 1:  # files written before the tie rule hold no tied set
            preferred = sweep.get("preferred_splits")  # files before it took the fewest always
            taken = ("the configured count taken" if preferred in tied and preferred == int(sweep["selected_splits"])
                     else "the fewest splits taken")
            lines.append(f"  tied within noise: {', '.join(map(str, tied))}; {taken} "
                         f"(fastest alone: {sweep['fastest_splits']})")
        cap = sweep.get("uniform_target_ctas")
        if cap:
            lines.append(f"  uniform cap {cap['fitted']} CTAs (0: none; the regime's split count is "
                         f"{cap['regime_splits']}), {'applied' if cap['applied'] else 'not applied'}")
        route = sweep.get("regime_route", sweep.get("boundary_route"))  # the latter in files before the regimes
        if route:
            lines.append(f"  B2-7 route {route['fitted']} ({float(route['speedup']):.3f}x{_band(route)}, "
                         f"{'applied' if route['applied'] else 'not applied'})" + _steps_by_route(route))
    return lines


def _skew_sweep(name: str, sweep: dict) -> list[str]:
    """A trace that fit skew_target_ctas: its skewed steps by rule (_by_rule_cells), the budget
    fitted, and its over-split steps."""
    fit = sweep["skew_target_ctas"]
    fits = sweep.get("fits", "skew_target_ctas")  # the field alone in files before the budget was per regime
    return [f"{name} -> {fits} ({sweep['steps']} skewed steps): " + _by_rule_cells(sweep, sweep),
            f"  skew budget {fit['fitted']} CTAs (0: the fixed rule; {float(fit['speedup_over_fixed']):.3f}x the "
            f"fixed rule at {fit['selected_waves']} waves of {fit['num_sms']} SMs{_band(fit)}), "
            f"{'applied' if fit['applied'] else 'not applied'}", *_over_split_lines(sweep)]


def _short_row_sweep(name: str, sweep: dict) -> list[str]:
    """A single-row trace that fit the short-row rule: each tiles a split against one tile a split
    (the rule off; the selected one starred), the splits each cut the rows into, and the fit."""
    fits = sweep["fits"]
    fit = sweep[fits]
    off = float(sweep["device_us_total_by_tiles"]["1"])

    def by_number(items):  # the file's keys are strings, sorted as text ("32" before "4")
        return sorted(items, key=lambda item: int(item[0]))

    cells = [f"{tiles}{'*' if int(tiles) == int(fit['selected_tiles']) else ''}: {_ratio(off, float(us))}"
             for tiles, us in by_number(sweep["device_us_total_by_tiles"].items())]
    cut = "; ".join(f"{tiles}: " + ", ".join(f"S={s} on {n}" for s, n in by_number(splits.items()))
                    for tiles, splits in by_number(sweep["splits_by_tiles"].items()))
    return [f"{name} -> {fits} ({sweep['steps']} steps, the regime's S={sweep['regime_splits']}; over one tile a "
            f"split): " + ", ".join(cells),
            f"  splits cut by tiles a split: {cut}",
            f"  short-row rule fitted at {fit['fitted']} tiles a split (1: off; {float(fit['measured_margin']):.3f}x "
            f"one tile a split at {fit['selected_tiles']}{_band(fit)}), "
            f"{'applied' if fit['applied'] else 'not applied'}"]


def _by_rule_cells(sweep: dict, times: dict) -> str:
    """FlashInfer's time over the fixed rule's and over the balanced rule's at each budget (in waves
    of the SMs, the selected one starred), from ``times``: a skew fit's record or its over-split steps."""
    fi = float(times["flashinfer_device_us_total"])
    selected = int(sweep["skew_target_ctas"]["selected_waves"])
    cells = [f"fixed S={sweep['regime_splits']}: {_ratio(fi, float(times['fixed_device_us_total']))}"]
    for waves, us in sorted(times["device_us_total_by_waves"].items(), key=lambda item: int(item[0])):
        cells.append(f"{waves}w{'*' if int(waves) == selected else ''}: {_ratio(fi, float(us))}")
    return ", ".join(cells)


def _over_split_lines(sweep: dict) -> list[str]:
    """The over-split steps of a skewed trace (files before the over-split rule hold none): the
    same ratios as its skewed steps', and whether the rule was opened."""
    steps, fit = sweep.get("over_split_steps"), sweep.get("over_split_balanced")
    if not steps or not fit:
        return []
    if not steps["steps"]:
        return [f"  over-split steps: none at S={sweep['regime_splits']}, so the over-split rule stays closed"]
    gain = fit["speedup_over_fixed"]
    return [f"  over-split steps ({steps['steps']}): " + _by_rule_cells(sweep, steps),
            f"  over-split rule {'open' if fit['fitted'] else 'closed'} ({float(gain):.3f}x the fixed rule at the "
            f"budget, over the regime's skewed traces' over-split steps{_band(fit)}), "
            f"{'applied' if fit['applied'] else 'not applied'}"]


def context_gates(gates: dict, calib) -> list[str]:
    lines = []
    for regime in REGIMES:
        label = REGIME_LABELS[regime]
        gate = _recorded(gates, regime, "min_context_tokens")
        if gate is None:
            continue
        fitted = int(gate["fitted"])
        classes = []
        for cls, totals in sorted(gate["classes"].items(), key=lambda kv: int(kv[0])):
            held = "+" if int(cls) >= fitted else "-"
            classes.append(f"{cls}{held} {_ratio(float(totals['flashinfer_us']), float(totals['persistentkv_us']))}")
        lines.append(f"{label:<5} fitted {fitted}, in use {calib.regime(regime).min_context_tokens}"
                     f" ({'applied' if gate['applied'] else 'not applied'}): {gate['reason']}")
        lines.append("      " + ", ".join(classes))
    return lines


def profile_note(record: dict) -> str | None:
    """Why the fitted routes, gates and group sizes below read "not applied", where a profile says so."""
    if recorded_profile(record) != "cpu":
        return None
    # The conf/gpu file the run started from: cpu.yaml, or a GPU's file tried through the CPU profile.
    gpu = (((record.get("provenance") or {}).get("config") or {}).get("gpu") or {})
    name = gpu.get("gpu") if isinstance(gpu, dict) else None
    starting = f"conf/gpu/{name}.yaml's" if name else "the run's conf/gpu file's"
    if name and name != "cpu":  # a GPU's file: its gates scaled as the traces are (pkv.experiments.calibrate)
        starting += " (its context gates scaled by the profile's length scale, as the traces are)"
    return ("CPU profile (not a performance model): the routes, context gates and group sizes in use are "
            f"{starting}; what the CPU timings fit is recorded below as 'not applied', because "
            "CPU times decide nothing. The split counts and constants are fitted as on a GPU.")


def unreached_routes(gates: dict, calib) -> dict[str, str]:
    """{regime: why} for a regime whose PersistentKV route starts past every step the calibration
    measured in it: the route is in use, but no measured step of that regime takes it."""
    notes = {}
    for regime in REGIMES:
        params = calib.regime(regime)
        gate = _recorded(gates, regime, "min_context_tokens")
        if params.route == ROUTE_FLASHINFER or not gate or not gate.get("classes"):
            continue
        longest = max(int(c) for c in gate["classes"])
        if params.min_context_tokens > longest:
            label = REGIME_LABELS[regime]
            notes[regime] = (f"  (the gate lies past every {label} step measured, whose context classes end at "
                             f"{longest} tokens: none of them takes this route)")
    return notes


def annotated_operating_points(calib, gates: dict) -> list[str]:
    """operating_points, each regime followed by the reason where no measured step takes its route."""
    unreached = unreached_routes(gates, calib)
    points = operating_points(calib)
    lines = []
    for i, regime in enumerate(REGIMES):
        lines.append(points[i])
        if regime in unreached:
            lines.append(unreached[regime])
    return lines + points[len(REGIMES):]


def report(path: Path) -> str:
    calib = load_calibration(path)
    record = json.loads(Path(path).read_text())
    measured = record.get("provenance", {}).get("measurements", {})
    note = profile_note(record)
    lines = [f"== {path}", *([note] if note else []),
             *annotated_operating_points(calib, measured.get("context_gates") or {}),
             f"beta {calib.beta_gbps:.0f} GB/s, lambda {calib.lambda_us:.2f} us, C_min {calib.c_min:g}, plan us "
             f"FlashInfer {calib.flashinfer_plan_us:.1f} / PersistentKV {calib.persistentkv_plan_us:.1f}"]
    if measured.get("split_sweeps"):
        lines += ["", "split sweeps (FlashInfer / PersistentKV device time; * selected):",
                  *split_sweeps(measured["split_sweeps"])]
    if measured.get("context_gates"):
        lines += ["", "context gates (FlashInfer / PersistentKV device time per class; + at or above the gate):",
                  *context_gates(measured["context_gates"], calib)]
    if measured.get("gate_probes"):
        lines += ["", "gate probes:"]
        for probe in measured["gate_probes"]:
            lines.append(f"{probe['probe']:<32}{probe['route']:<24}S={probe['num_splits']:<4}"
                         f"{_ratio(float(probe['flashinfer_device_us_total']), float(probe['persistentkv_device_us_total']))}"
                         f"  -> {probe['fits']}" + _steps_by_route(probe))
    if measured.get("group_sizes"):
        groups = measured["group_sizes"]
        lines.append(f"group sizes probed {groups['probed']}, opened {groups['opened']}, "
                     f"fitted {groups['fitted']} ({'applied' if groups['applied'] else 'not applied'})")
    if not measured:
        lines.append("(no measurements recorded: a configured, not a calibrated, file)")
    return "\n".join(lines)


def _steps_by_route(record: dict) -> str:
    """How many of a probe's (or the B2-7 route decision's) steps each rule's route ran, where
    more than one did (calibrations before the step rules were followed record none)."""
    routes = record.get("steps_by_route") or {}
    if len(routes) < 2:
        return ""
    return "  (" + ", ".join(f"{route}: {steps}" for route, steps in routes.items()) + ")"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("calibrations", nargs="+", type=Path, help="calibration JSON files")
    args = parser.parse_args(argv)
    for path in args.calibrations:
        print(report(path))
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_refusal(main))
