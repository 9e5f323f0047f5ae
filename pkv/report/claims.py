"""The claims check: every numeric claim of the paper against this GPU's result files.

Each claim carries the paper's value (typed here, from the paper), a measure that computes this
GPU's value from the result files through the same builders as the tables, a stated tolerance and
a verdict: "reproduced", "differs", or "not applicable here" with the reason. No value rests on a
ratio against a baseline the float64 reference found wrong (pkv.report.table_data.comparisons): a
seed whose baseline was wrong is left out, and the value says so; where no seed is left, the claim
is not applicable here, the reason naming the wrong baseline. What a verdict may rest on depends
on the claim's kind:

    performance  a timing or a ratio of timings: only results marked as performance results count;
                 on the CPU profile no verdict on performance is possible
    route        a decision the calibration makes from timings: only a calibrated GPU run counts; the
                 CPU profile's routes are configured (conf/gpu/cpu.yaml)
    structure    counts from the plans of the paper's traces: the CPU profile scales those traces
    policy       a constant of the route policy: compared wherever it is recorded
    correctness  the error bounds: checked on every profile
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from pkv.report import evidence
from pkv.report.results import iter_results, read_json
from pkv.report.table_data import (
    Inputs,
    MeanStd,
    Num,
    aggregate_serving,
    held_out,
    load_ablation,
    load_trace_tree,
    mean_std,
    metric,
    selected_route,
    table1,
    table4,
    table5,
    table7,
)

REPRODUCED = "reproduced"
DIFFERS = "differs"
NOT_APPLICABLE = "not applicable here"
NO_PERFORMANCE_VERDICT = "CPU profile: no verdict on performance is possible"

PERFORMANCE, ROUTE, STRUCTURE, POLICY, CORRECTNESS = "performance", "route", "structure", "policy", "correctness"
# Ratios reported without a spread are held to this absolute tolerance.
RATIO_TOLERANCE = 0.05
# The paper's correctness bounds (3.6) and its hardware (4.1).
MAX_ABS_ERR_BOUND, MEAN_ABS_ERR_BOUND = 2e-3, 3e-4
PAPER_GPU = "RTX 3060"


@dataclass
class Measured:
    """This GPU's value of a claim, whether it holds, and what its inputs were."""

    value: str
    holds: bool | None  # None: nothing to compare (then `missing` says why)
    performance: bool = False  # every input is a performance result
    cpu_only: bool = False  # the inputs ran on the CPU profile
    missing: str | None = None


def _missing(reason: str) -> Measured:
    return Measured("–", None, missing=reason)


def _facts(source: Inputs | dict) -> dict[str, bool]:
    """performance / cpu_only of an Inputs or of a rendered table's header."""
    header = source.header() if isinstance(source, Inputs) else source
    return {"performance": bool(header["performance_result"]),
            "cpu_only": header["performance_note"] == "CPU profile: not a performance result"}


class Results:
    """The result files under one root, read once for all claims."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @cached_property
    def evaluate(self) -> dict:
        return load_trace_tree(self.root / "evaluate")

    @cached_property
    def mlp(self) -> dict:
        return load_trace_tree(self.root / "mlp")

    @cached_property
    def calibration(self) -> dict | None:
        path = self.root / "calibration" / "calibration.json"
        record = read_json(path) if path.is_file() else None
        return record if isinstance(record, dict) else None

    @cached_property
    def tables(self) -> dict[int, dict]:
        return {1: table1(self.root), 4: table4(self.root), 5: table5(self.root), 7: table7(self.root)}

    def serving(self, stage: str, trace: str, tree: dict | None = None):
        """(aggregate over held-out seeds, inputs) of one trace, or (None, reason)."""
        tree = getattr(self, stage) if tree is None else tree  # "evaluate" or "mlp" unless given
        if trace not in tree:
            return None, f"{stage}/{trace}: not run"
        inputs = Inputs()
        seeds = {s: tree[trace][s] for s in held_out(tree[trace])}
        agg = aggregate_serving(seeds, f"{stage}/{trace}", inputs)
        if not agg.ok:
            return None, "; ".join(agg.problems) or f"{stage}/{trace}: no held-out seeds"
        return agg, inputs


# --------------------------------------------------------------------------- measures


def _mean_std_text(values: list[float]) -> tuple[str, float]:
    cell = mean_std(values, 3)
    spread = f" ± {cell.std:.3f}" if cell.std is not None else ""
    return f"{cell.mean:.3f}{spread} ({cell.n} seed{'s' if cell.n != 1 else ''})", cell.mean


def _left_out(aggs) -> str:
    """What a value leaves out for a wrong baseline: the seeds, per trace where there are several."""
    parts = [f"{where + ' ' if len(aggs) > 1 else ''}seed{'s' if len(agg.wrong_baselines) > 1 else ''} "
             + ", ".join(str(s) for s in sorted(agg.wrong_baselines)) for where, agg in aggs if agg.wrong_baselines]
    return f" (left out, baseline wrong against float64: {'; '.join(parts)})" if parts else ""


def serving_ratio(stage: str, trace: str, key: str, paper: float, tolerance: float,
                  tree: Callable[[Results], dict] | None = None) -> Callable[[Results], Measured]:
    """The mean over held-out seeds of Table 2's ratio (key "wall" or "cuda") of one trace."""
    def measure(res: Results) -> Measured:
        agg, inputs = res.serving(stage, trace, tree(res) if tree else None)
        if agg is None:
            return _missing(inputs)
        text, mean = _mean_std_text(agg.wall_ratios if key == "wall" else agg.cuda_ratios)
        return Measured(text + _left_out([(trace, agg)]), abs(mean - paper) <= tolerance, **_facts(inputs))
    return measure


def serving_range(stage: str, traces: tuple[str, ...], low: float, high: float) -> Callable[[Results], Measured]:
    def measure(res: Results) -> Measured:
        means, inputs, aggs = [], Inputs(), []
        for trace in traces:
            agg, found = res.serving(stage, trace)
            if agg is None:
                return _missing(found)
            for rec in agg.subjects:
                inputs.add(rec)
            means.append(sum(agg.wall_ratios) / len(agg.wall_ratios))
            aggs.append((trace, agg))
        text = f"{min(means):.3f}–{max(means):.3f}" + _left_out(aggs)
        holds = all(low - RATIO_TOLERANCE <= m <= high + RATIO_TOLERANCE for m in means)
        return Measured(text, holds, **_facts(inputs))
    return measure


def route_taken(stage: str, trace: str, wanted: tuple[str, ...], tree: Callable[[Results], dict] | None = None,
                splits: int | None = None) -> Callable[[Results], Measured]:
    """The route the adaptive engine selected (most common over held-out seeds), and its split count."""
    def measure(res: Results) -> Measured:
        agg, inputs = res.serving(stage, trace, tree(res) if tree else None)
        if agg is None:
            return _missing(inputs)
        route, text = selected_route(agg.subjects)
        holds = route in wanted
        if splits is not None:
            counts = {(rec.get("metrics") or {}).get("num_splits") for rec in agg.subjects}
            holds = holds and counts == {splits}
        return Measured(text, holds, **_facts(inputs))
    return measure


def _gqa_tree(variant: str) -> Callable[[Results], dict]:
    return lambda res: load_ablation(res.root, "gqa").get(variant, {})


def counter(label: str, key: str, paper: float) -> Callable[[Results], Measured]:
    def measure(res: Results) -> Measured:
        t4 = res.tables[4]
        rows = [r for r in t4["rows"] if r["label"] == label]
        if not rows or not isinstance(rows[0].get(key), Num):
            return _missing(f"Table 4 has no {label} {key}")
        value = rows[0][key].value
        return Measured(f"{value:.2f}", round(value, 2) == paper, **_facts(t4))
    return measure


def isolated_ratio(method: str, baseline: str, paper_low: float, paper_high: float) -> Callable[[Results], Measured]:
    """method / baseline median time per context of Table 1."""
    def measure(res: Results) -> Measured:
        t1 = res.tables[1]
        rows = {r["method"]: r for r in t1["rows"]}
        if method not in rows or baseline not in rows:
            return _missing(f"Table 1 has no {method if method not in rows else baseline} row")
        ratios = []
        for a, b in zip(rows[method]["cells"], rows[baseline]["cells"]):
            if not isinstance(a["ms"], Num) or not isinstance(b["ms"], Num):
                reason = dict(t1["notes"]).get(getattr(a["ms"], "note", None) or getattr(b["ms"], "note", None))
                return _missing(reason or f"isolated: {method} or {baseline} not timed")
            ratios.append(a["ms"].value / b["ms"].value)
        if not ratios:
            return _missing("isolated: no contexts")
        labels = [c["label"] for c in t1["contexts"]]
        text = " / ".join(f"{r:.3f}" for r in ratios) + f" ({', '.join(labels)})"
        holds = all(paper_low - RATIO_TOLERANCE <= r <= paper_high + RATIO_TOLERANCE for r in ratios)
        return Measured(text, holds, **_facts(t1))
    return measure


def isolated_fastest(method: str) -> Callable[[Results], Measured]:
    def measure(res: Results) -> Measured:
        t1 = res.tables[1]
        fastest = []
        for i, ctx in enumerate(t1["contexts"]):
            timed = {r["label"]: r["cells"][i]["ms"].value for r in t1["rows"] if isinstance(r["cells"][i]["ms"], Num)}
            if timed:
                fastest.append((ctx["label"], min(timed, key=timed.get)))
        if not fastest:
            return _missing("isolated: not run")
        rows = {r["method"]: r["label"] for r in t1["rows"]}
        text = ", ".join(f"{ctx}: {label}" for ctx, label in fastest)
        return Measured(text, all(label == rows.get(method) for _, label in fastest), **_facts(t1))
    return measure


def ncu_higher(column: str) -> Callable[[Results], Measured]:
    def measure(res: Results) -> Measured:
        t5 = res.tables[5]
        if t5["skipped"]:
            return _missing(f"profile/ncu_counters.json: {t5['skipped']}")
        by_role = {r["role"]: r.get(column) for r in t5["rows"]}
        pkv, fi = by_role.get("PersistentKV decode"), by_role.get("FlashInfer decode")
        if not isinstance(pkv, Num) or not isinstance(fi, Num):
            return _missing(f"Table 5 lacks a decode kernel's {column}")
        return Measured(f"{pkv.value:.2f} vs {fi.value:.2f}", pkv.value > fi.value, **_facts(t5))
    return measure


def split_sweep(trace: str, check: Callable[[list[float]], bool], what: str) -> Callable[[Results], Measured]:
    def measure(res: Results) -> Measured:
        t7 = res.tables[7]
        rows = [r for r in t7["rows"] if r["trace"] == trace]
        if not rows:
            return _missing(f"Table 7 has no {trace} sweep")
        # A split count whose every step took FlashInfer's route was never applied: not graded.
        unapplied = [p["splits"] for p in rows[0]["points"] if p.get("baseline_route_only")]
        points = [(p["splits"], p["wall"]) for p in rows[0]["points"]
                  if isinstance(p["wall"], MeanStd) and p["splits"] not in unapplied]
        if not points:
            why = "took FlashInfer's route on every step" if unapplied else "has no wall ratio"
            return _missing(f"Table 7's {trace} sweep {why}")
        means = [w.mean for _, w in points]
        text = f"{what}: " + " / ".join(f"S={s} {w.mean:.3f}" for s, w in points)
        if unapplied:
            text += " (not applied, every step on FlashInfer's route: " + ", ".join(f"S={s}" for s in unapplied) + ")"
        return Measured(text, check(means), **_facts(t7))
    return measure


def errors_within_bounds(res: Results) -> Measured:
    worst_max = worst_mean = 0.0
    inputs = Inputs()
    for trace in res.evaluate:
        agg, _ = res.serving("evaluate", trace)
        if agg is None:
            continue
        for rec in agg.subjects:
            inputs.add(rec)
            worst_max = max(worst_max, metric(rec, "max_abs_err") or 0.0)
            worst_mean = max(worst_mean, metric(rec, "mean_abs_err") or 0.0)
    if inputs.files == 0:
        return _missing("evaluate: not run")
    return Measured(f"max {worst_max:.3e}, mean {worst_mean:.3e}",
                    worst_max < MAX_ABS_ERR_BOUND and worst_mean < MEAN_ABS_ERR_BOUND, **_facts(inputs))


def calibration_value(read: Callable[[dict], Any], fmt: str,
                      check: Callable[[Any], bool]) -> Callable[[Results], Measured]:
    def measure(res: Results) -> Measured:
        record = res.calibration
        if record is None:
            return _missing("calibration/calibration.json: not run")
        try:
            value = read(record)
        except (KeyError, TypeError):
            return _missing("calibration/calibration.json: the value is not recorded")
        prov = record.get("provenance") or {}
        on_gpu = bool(prov.get("gpu_name"))
        performance = on_gpu and (prov.get("measurements") or {}).get("performance_result") is not False
        return Measured(fmt.format(value), check(value), performance=performance, cpu_only=not on_gpu)
    return measure


def _regime(name: str, field: str) -> Callable[[dict], Any]:
    return lambda record: record["calibration"]["regimes"][name][field]


# --------------------------------------------------------------------------- the claims


@dataclass(frozen=True)
class Claim:
    claim: str
    where: str
    kind: str
    paper: str
    tolerance: str
    measure: Callable[[Results], Measured]
    needs_paper_gpu: bool = False  # a constant of the paper's GPU, comparable only on one


def _pm(mean: float, std: float) -> str:
    return f"{mean:.3f} ± {std:.3f}"


def _serving_claim(claim: str, where: str, stage: str, trace: str, key: str, mean: float, std: float) -> Claim:
    return Claim(claim, where, PERFORMANCE, _pm(mean, std), f"± {2 * std:.3f} (2 std of the paper)",
                 serving_ratio(stage, trace, key, mean, 2 * std))


B8_TRACES = ("bimodal_b8", "uniform_b8", "zipf_b8")
B8_WALL_RANGE = (1.044, 1.080)

CLAIMS: tuple[Claim, ...] = (
    Claim("B8 bimodal, uniform and Zipf: mean wall gain of the policy", "abstract, 4.3", PERFORMANCE,
          f"{B8_WALL_RANGE[0]:.3f}–{B8_WALL_RANGE[1]:.3f}×", f"each mean within the range ± {RATIO_TOLERANCE:.2f}",
          serving_range("evaluate", B8_TRACES, *B8_WALL_RANGE)),
    _serving_claim("Bucketed B1: wall gain", "abstract, Table 2", "evaluate", "bucketed_b1", "wall", 1.403, 0.065),
    _serving_claim("Bucketed B1: device-time gain", "Table 2", "evaluate", "bucketed_b1", "cuda", 1.471, 0.037),
    _serving_claim("Bimodal B8: wall gain", "Table 2", "evaluate", "bimodal_b8", "wall", 1.080, 0.050),
    _serving_claim("Bimodal B8: device-time gain", "Table 2", "evaluate", "bimodal_b8", "cuda", 1.106, 0.042),
    _serving_claim("Uniform B8: wall gain", "Table 2", "evaluate", "uniform_b8", "wall", 1.044, 0.022),
    _serving_claim("Uniform B8: device-time gain", "Table 2", "evaluate", "uniform_b8", "cuda", 1.076, 0.029),
    _serving_claim("Zipf B8: wall gain", "Table 2", "evaluate", "zipf_b8", "wall", 1.068, 0.028),
    _serving_claim("Zipf B8: device-time gain", "Table 2", "evaluate", "zipf_b8", "cuda", 1.105, 0.026),
    Claim("Bucketed B1 routed to PersistentKV buckets", "Table 2", ROUTE, "PersistentKV bucket", "same route",
          route_taken("evaluate", "bucketed_b1", ("persistentkv_bucket", "persistentkv_buckets"))),
    Claim("Bimodal B8 routed to the PersistentKV workqueue", "Table 2", ROUTE, "PersistentKV workqueue",
          "same route", route_taken("evaluate", "bimodal_b8", ("persistentkv_workqueue",))),
    Claim("B4 boundary routed to FlashInfer", "abstract, Table 2", ROUTE, "FlashInfer", "same route",
          route_taken("evaluate", "bimodal_b4", ("flashinfer", "sdpa"))),
    Claim("Uncalibrated G = 1 routed to FlashInfer", "abstract, Table 8", ROUTE, "FlashInfer", "same route",
          route_taken("ablate/gqa/G=1", "bimodal_b8", ("flashinfer", "sdpa"), _gqa_tree("G=1"))),
    Claim("Uncalibrated G = 8 routed to FlashInfer", "abstract, Table 8", ROUTE, "FlashInfer", "same route",
          route_taken("ablate/gqa/G=8", "bimodal_b8", ("flashinfer", "sdpa"), _gqa_tree("G=8"))),
    Claim("Split count of the B1 bucket route", "Table 2", PERFORMANCE, "32", "equal",
          route_taken("evaluate", "bucketed_b1", ("persistentkv_bucket",), splits=32)),
    Claim("Split count of the bimodal B8 workqueue", "Table 2", PERFORMANCE, "20", "equal",
          route_taken("evaluate", "bimodal_b8", ("persistentkv_workqueue",), splits=20)),
    Claim("Short-context gate: steps below 16K tokens go to FlashInfer (B8+)", "3.5", ROUTE, "16384 tokens",
          "equal", calibration_value(_regime("many_rows", "min_context_tokens"), "{} tokens", lambda v: v == 16384)),
    Claim("Promotion margin of supported B8 steps", "3.5", POLICY, "1.05×", "equal",
          calibration_value(_regime("many_rows", "margin"), "{:.2f}×", lambda v: abs(v - 1.05) < 1e-9)),
    Claim("Promotion margin of the B4 boundary", "3.5", POLICY, "1.50×", "equal",
          calibration_value(_regime("few_rows", "margin"), "{:.2f}×", lambda v: abs(v - 1.50) < 1e-9)),
    Claim("Launches per step, exact length buckets (held-out bimodal B8)", "abstract, Table 4", STRUCTURE, "16.00",
          "equal at two decimals", counter("PersistentKV exact buckets", "launches_per_step", 16.00)),
    Claim("Launches per step, compact workqueue (held-out bimodal B8)", "abstract, Table 4", STRUCTURE, "2.00",
          "equal at two decimals", counter("PersistentKV workqueue", "launches_per_step", 2.00)),
    Claim("Launches per step, adaptive route (held-out bimodal B8)", "Table 4", STRUCTURE, "2.00",
          "equal at two decimals", counter("Adaptive route", "launches_per_step", 2.00)),
    Claim("Merge launches per step, exact buckets", "4.3, Table 4", STRUCTURE, "8.00", "equal at two decimals",
          counter("PersistentKV exact buckets", "merge_launches", 8.00)),
    Claim("Merge launches per step, workqueue", "4.3, Table 4", STRUCTURE, "1.00", "equal at two decimals",
          counter("PersistentKV workqueue", "merge_launches", 1.00)),
    Claim("Merge-state traffic per step, exact buckets (MB)", "4.3, Table 4", STRUCTURE, "4.06",
          "equal at two decimals", counter("PersistentKV exact buckets", "merge_mib", 4.06)),
    Claim("Merge-state traffic per step, workqueue (MB)", "4.3, Table 4", STRUCTURE, "2.54",
          "equal at two decimals", counter("PersistentKV workqueue", "merge_mib", 2.54)),
    _serving_claim("Decode + MLP timing point: wall gain (bimodal B8)", "Table 3, 6", "mlp", "bimodal_b8", "wall",
                   1.105, 0.061),
    _serving_claim("Decode + MLP timing point: device-time gain", "Table 3", "mlp", "bimodal_b8", "cuda",
                   1.097, 0.039),
    Claim("External trace fixture: wall gain", "4.3, 6", PERFORMANCE, "1.212", f"± {RATIO_TOLERANCE:.2f}",
          serving_ratio("evaluate", "fixture_mixed_b8", "wall", 1.212, RATIO_TOLERANCE)),
    Claim("External trace fixture: device-time gain", "4.3", PERFORMANCE, "1.236", f"± {RATIO_TOLERANCE:.2f}",
          serving_ratio("evaluate", "fixture_mixed_b8", "cuda", 1.236, RATIO_TOLERANCE)),
    Claim("G = 4 in the GQA sweep: wall gain", "Table 8", PERFORMANCE, "1.256", f"± {RATIO_TOLERANCE:.2f}",
          serving_ratio("ablate/gqa/G=4", "bimodal_b8", "wall", 1.256, RATIO_TOLERANCE, _gqa_tree("G=4"))),
    Claim("Isolated B1: FlashInfer is the fastest kernel", "4.2, 6", PERFORMANCE, "FlashInfer at 8K, 32K, 64K",
          "fastest at every context", isolated_fastest("flashinfer")),
    Claim("Isolated B1: PersistentKV over FlashInfer time", "4.2", PERFORMANCE, "1.044–1.045×",
          f"each context within the range ± {RATIO_TOLERANCE:.2f}", isolated_ratio("persistentkv", "flashinfer",
                                                                                   1.044, 1.045)),
    Claim("Isolated B1: PersistentKV over vLLM time", "4.2", PERFORMANCE, "0.794–0.817×",
          f"each context within the range ± {RATIO_TOLERANCE:.2f}", isolated_ratio("persistentkv", "vllm",
                                                                                   0.794, 0.817)),
    Claim("B1 split counts near the optimum stay wall-positive", "Table 7", PERFORMANCE, "1.282–1.516×",
          "every wall ratio > 1", split_sweep("bucketed_b1", lambda ms: all(m > 1 for m in ms), "wall")),
    Claim("B4 workqueue sweep: no robust wall win", "4.4", PERFORMANCE, "best mean 1.005×",
          f"best mean < {evidence.POSITIVE_AT_LEAST:.2f} (Table 6's win threshold)",
          split_sweep("bimodal_b4", lambda ms: max(ms) < evidence.POSITIVE_AT_LEAST, "wall")),
    Claim("Nsight Compute: PersistentKV decode above FlashInfer in SM throughput (%)", "Table 5", PERFORMANCE,
          "17.21 vs 9.55", "higher", ncu_higher("sm_throughput_pct")),
    Claim("Nsight Compute: PersistentKV decode above FlashInfer in memory throughput (%)", "Table 5", PERFORMANCE,
          "74.48 vs 62.72", "higher", ncu_higher("mem_throughput_pct")),
    Claim("Serving errors within max|e| < 2e-3 and mean|e| < 3e-4 (largest max 6.104e-05)", "3.6, 3.9",
          CORRECTNESS, "all rows pass", "below both bounds", errors_within_bounds),
    Claim("Measured read bandwidth beta (GB/s)", "3.5, 4.1", PERFORMANCE, "331.2", "± 10%",
          calibration_value(lambda r: r["calibration"]["beta_gbps"], "{:.1f}", lambda v: abs(v / 331.2 - 1) <= 0.1),
          needs_paper_gpu=True),
    Claim("Launch overhead lambda (us)", "3.5", PERFORMANCE, "8.19", "± 10%",
          calibration_value(lambda r: r["calibration"]["lambda_us"], "{:.2f}", lambda v: abs(v / 8.19 - 1) <= 0.1),
          needs_paper_gpu=True),
    Claim("Occupancy target C_min (CTAs/SM)", "3.5", PERFORMANCE, "4", "equal",
          calibration_value(lambda r: r["calibration"]["c_min"], "{:g}", lambda v: v == 4), needs_paper_gpu=True),
    Claim("SMs of the GPU", "4.1", PERFORMANCE, "28", "equal",
          calibration_value(lambda r: r["calibration"]["num_sms"], "{}", lambda v: v == 28), needs_paper_gpu=True),
)


# --------------------------------------------------------------------------- verdicts


def _calibrated_on_gpu(res: Results) -> bool:
    record = res.calibration or {}
    prov = record.get("provenance") or {}
    return bool(prov.get("gpu_name")) and (prov.get("measurements") or {}).get("performance_result") is not False


def verdict(claim: Claim, measured: Measured, res: Results, device: str, cpu_profile: bool) -> str:
    """cpu_profile: the run as a whole is the CPU profile (its claims without a value included)."""
    if (measured.cpu_only or cpu_profile) and claim.kind == PERFORMANCE:
        also = f"; besides, {measured.missing}" if measured.missing else ""
        return f"{NOT_APPLICABLE}: {NO_PERFORMANCE_VERDICT}{also}"
    if measured.missing:
        return f"{NOT_APPLICABLE}: {measured.missing}"
    if measured.cpu_only and claim.kind == STRUCTURE:
        return f"{NOT_APPLICABLE}: the CPU profile scales the paper's traces (lengths and requests)"
    if claim.kind == PERFORMANCE and not measured.performance:
        return f"{NOT_APPLICABLE}: an input is not a performance result"
    if claim.kind == ROUTE and not _calibrated_on_gpu(res):
        return f"{NOT_APPLICABLE}: routes here come from conf/gpu, not from a calibration on a GPU"
    if claim.needs_paper_gpu and PAPER_GPU.lower() not in device.lower():
        return f"{NOT_APPLICABLE}: a constant of the paper's {PAPER_GPU}"
    return REPRODUCED if measured.holds else DIFFERS


def claims_check(root: Path) -> dict[str, Any]:
    """Rows of the claims table and its header facts."""
    res = Results(Path(root))
    # The header facts (device, commits, performance) of every result file under the root.
    everything = Inputs()
    if res.root.is_dir():
        for _, record in iter_results(res.root):
            everything.add(record)
    header = everything.header()
    rows = []
    for claim in CLAIMS:
        m = claim.measure(res)
        v = verdict(claim, m, res, header["device"], cpu_profile=everything.any_cpu_only)
        rows.append({"claim": claim.claim, "where": claim.where, "kind": claim.kind, "paper": claim.paper,
                     "value": m.value, "tolerance": claim.tolerance, "verdict": v})
    counts = {k: sum(1 for r in rows if r["verdict"].startswith(k)) for k in (REPRODUCED, DIFFERS, NOT_APPLICABLE)}
    return {**header, "rows": rows, "counts": counts, "paper_gpu": PAPER_GPU, "notes": []}
