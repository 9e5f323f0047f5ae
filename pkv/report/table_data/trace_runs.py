"""Tables 2, 3 and 4: serving trace runs (adaptive against its baseline, with and without the MLP
tail) and the hardware-independent counters of the raggedness variants."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pkv.report.table_data.cells import Cell, Notes, Num, Sci, Text, mean_std
from pkv.report.table_data.comparisons import (
    aggregate_serving,
    compare_in_run,
    engine_key,
    metric,
    note_partial,
    pick_subject,
    ratio_cells,
    unfilled_cell,
)
from pkv.report.table_data.inputs import Inputs
from pkv.report.table_data.labels import (
    COUNTER_TRACE,
    ENGINE_LABELS,
    PAPER_MLP_TRACES,
    PAPER_SERVING_TRACES,
    ordered,
    paper_then_found,
    routes_taken,
    seeds_text,
    trace_label,
)
from pkv.report.table_data.loading import Loaded, held_out, load_ablation, load_trace_tree

# --------------------------------------------------------------------------- Table 2

# The second baseline of Table 2: TensorRT-LLM's decode kernel, run in the same trace runs.
SECOND_BASELINE = "xqa"


def _second_baseline_cells(seeds, trace: str, inputs: Inputs, notes: Notes) -> tuple[Cell, Cell, list[int]]:
    """Adaptive against XQA from the same runs; where XQA could not run anywhere, one note with why.
    The marks are the footnotes of seeds left out because XQA's output was wrong there."""
    agg = aggregate_serving(seeds, f"evaluate/{trace}", inputs, baseline=SECOND_BASELINE)
    if agg.ok:
        wrong = [w.describe() for w in agg.wrong_baselines.values()]
        marks = [notes.number(p) for p in agg.problems if any(w in p for w in wrong)]
        return mean_std(agg.cuda_ratios, 3), mean_std(agg.wall_ratios, 3), marks
    if agg.wrong_baselines:
        cell = unfilled_cell(agg, notes, f"{trace}: no comparable {SECOND_BASELINE} runs")
        return cell, cell, []
    marker = f"baseline {SECOND_BASELINE} skipped: "
    reasons = {p.split(marker, 1)[1] for p in agg.problems if marker in p}
    if reasons and all(marker in p for p in agg.problems):
        miss = notes.missing(f"{ENGINE_LABELS[SECOND_BASELINE]} not available: {'; '.join(sorted(reasons))}")
    elif all(f"baseline {SECOND_BASELINE} not run" in p for p in agg.problems):
        miss = notes.missing(f"{ENGINE_LABELS[SECOND_BASELINE]} not in these runs' engines")
    else:
        miss = notes.missing("; ".join(agg.problems) or f"{trace}: no comparable {SECOND_BASELINE} runs")
    return miss, miss, []


def _baseline_path_marks(agg, notes: Notes) -> list[int]:
    """The footnote naming the FlashInfer path the baseline ran on the row's measured steps (its
    best-of engine picks one per batch class from a probe): the baseline of a ratio is that path,
    and a reader can hold it against the kernel benchmark's times of each path. None where the
    results record no path (another baseline, or files from before steps recorded one)."""
    counts: Counter[str] = Counter()
    labels: dict[str, str] = {}
    for record in agg.baselines:
        metrics = record.get("metrics") or {}
        labels.update((metrics.get("flashinfer_paths") or {}).get("paths") or {})
        counts.update(step["variant"] for step in metrics.get("per_step") or [] if step.get("variant"))
    if not counts:
        return []
    total = sum(counts.values())
    ran = ", ".join(f"{labels.get(path, path)} on {n} of {total}" for path, n in counts.most_common())
    return [notes.number(f"FlashInfer's path on the measured steps (its probe's pick per batch class): {ran}")]


def table2(root: Path) -> dict[str, Any]:
    notes, inputs = Notes(), Inputs()
    tree = load_trace_tree(root / "evaluate")
    rows, all_seeds = [], set()
    for trace in paper_then_found(PAPER_SERVING_TRACES, tree):
        row: dict[str, Any] = {"trace": trace, "label": trace_label(trace), "seeds": 0, "marks": []}
        seeds = {s: tree[trace][s] for s in held_out(tree.get(trace, {}))}
        if not seeds:
            if trace in tree:
                reason = f"{trace}: only the calibration seed ran"
                inputs.missing_input(f"evaluate/{trace}: held-out seeds")
            else:
                reason = f"{trace}: not run"
                inputs.missing_input(f"evaluate/{trace}")
            miss = notes.missing(reason)
            rows.append({**row, **dict.fromkeys(
                ("route", "cuda", "wall", "cuda_xqa", "wall_xqa", "max_err", "mean_err", "rel_err"), miss)})
            continue
        agg = aggregate_serving(seeds, f"evaluate/{trace}", inputs)
        all_seeds.update(agg.seeds)
        cuda, wall = ratio_cells(agg, notes, "no comparable runs")
        cuda_xqa, wall_xqa, xqa_marks = _second_baseline_cells(seeds, trace, inputs, notes)
        if agg.ok:
            # The route the run took: the most common over its steps and seeds, then any other
            # route its steps took (bimodal B4's route is the calibration's B2-7 decision).
            route: Cell = Text(routes_taken(agg.subjects))
            errs = {}
            for key in ("max_abs_err", "mean_abs_err", "ref_max_rel_err"):
                vals = [metric(s, key) for s in agg.subjects]
                # Both error columns report the worst seed: a tolerance holds only if it holds everywhere.
                errs[key] = Sci(max(vals)) if all(v is not None for v in vals) else notes.missing(
                    f"{trace}: {key} not recorded")
            max_err, mean_err, rel_err = errs["max_abs_err"], errs["mean_abs_err"], errs["ref_max_rel_err"]
        else:
            route = max_err = mean_err = rel_err = cuda
        rows.append({**row, "route": route, "cuda": cuda, "wall": wall, "cuda_xqa": cuda_xqa,
                     "wall_xqa": wall_xqa, "max_err": max_err, "rel_err": rel_err,
                     "mean_err": mean_err, "seeds": len(agg.seeds),
                     "marks": note_partial(agg, notes) + xqa_marks + _baseline_path_marks(agg, notes)})
    return {**inputs.header(), "rows": rows, "seeds": seeds_text(all_seeds), "notes": notes.items}


# --------------------------------------------------------------------------- Table 3


def table3(root: Path) -> dict[str, Any]:
    notes, inputs = Notes(), Inputs()
    tree = load_trace_tree(root / "mlp")
    blocks = []
    for trace in ordered(tree, PAPER_MLP_TRACES):
        seeds = {s: tree[trace][s] for s in held_out(tree[trace])}
        agg = aggregate_serving(seeds, f"mlp/{trace}", inputs)
        per_engine: dict[str, list[dict]] = {}
        for seed in agg.seeds:
            cmp_records = seeds[seed]
            cmp = compare_in_run(cmp_records, f"mlp/{trace} seed {seed}")
            per_engine.setdefault(cmp.baseline["engine"], []).append(cmp.baseline)
            per_engine.setdefault(cmp.subject["engine"], []).append(cmp.subject)
        rows = []
        for engine, recs in per_engine.items():
            row = {"engine": engine, "label": ENGINE_LABELS.get(engine, engine) + " + MLP tail"}
            for key, decimals in (("cuda_tok_s", 1), ("cuda_ms_per_step", 3),
                                  ("wall_tok_s", 1), ("wall_ms_per_step", 3)):
                vals = [metric(r, key) for r in recs]
                row[key] = mean_std(vals, decimals) if vals and all(v is not None for v in vals) else \
                    notes.missing(f"{trace}: {engine} did not record {key}")
            rows.append(row)
        if agg.ok:
            ratio_row = {"cuda": mean_std(agg.cuda_ratios, 3, "×"), "wall": mean_std(agg.wall_ratios, 3, "×")}
        else:
            miss = unfilled_cell(agg, notes, f"{trace}: no held-out seeds")
            ratio_row = {"cuda": miss, "wall": miss}
        blocks.append({"trace": trace, "label": trace_label(trace), "rows": rows, "ratio": ratio_row,
                       "seeds": seeds_text(agg.seeds), "marks": note_partial(agg, notes)})
    for trace in PAPER_MLP_TRACES:
        if trace not in tree:
            inputs.missing_input(f"mlp/{trace}")
    return {**inputs.header(), "blocks": blocks, "notes": notes.items}


# --------------------------------------------------------------------------- Table 4


COUNTER_COLUMNS = (
    ("launches_per_step", 2),
    ("decode_ctas_per_sm", 1),
    ("useful_kv_mib", 1),
    ("merge_mib", 2),
    ("merge_launches", 2),
)


def _counter_row(label: str, records: list[dict], notes: Notes, where: str) -> dict[str, Any]:
    row: dict[str, Any] = {"label": label, "seeds": len(records)}
    for key, decimals in COUNTER_COLUMNS:
        vals = []
        for rec in records:
            counters = (rec.get("metrics") or {}).get("counters") or {}
            value = counters.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                vals.append(float(value))
        if not vals:
            row[key] = notes.missing(f"{where}: counter {key} not reported")
            continue
        row[key] = Num(statistics.fmean(vals), decimals)
        if len(vals) < len(records):
            # A mean over fewer seeds than the row claims must say so.
            row.setdefault("marks", []).append(
                notes.number(f"{where}: {key} reported by {len(vals)} of {len(records)} seeds; mean over those"))
    row.setdefault("marks", [])
    return row


def _records_named(seeds: Mapping[int, list[Loaded]], names: Iterable[str]) -> tuple[list[dict], list[str]]:
    names = tuple(names)
    found, skipped = [], []
    for seed in held_out(seeds):
        for path, rec in seeds[seed]:
            if engine_key(path, rec) & set(names):
                if "skipped" in rec:
                    skipped.append(rec["skipped"])
                else:
                    found.append(rec)
                break
    return found, skipped


RAGGEDNESS_LABELS = {0: "PersistentKV exact buckets", 1: "PersistentKV masked bucket", 2: "PersistentKV workqueue"}


def _raggedness_kind(variant: str) -> int:
    v = variant.lower()
    if "exact" in v or v.endswith("bucket") or v.endswith("buckets"):
        return 0
    if "masked" in v:
        return 1
    if "workqueue" in v and "fused" not in v:
        return 2
    return 3


def table4(root: Path) -> dict[str, Any]:
    notes, inputs = Notes(), Inputs()
    evaluate = load_trace_tree(root / "evaluate").get(COUNTER_TRACE, {})
    ragged = load_ablation(root, "raggedness")
    rows = []

    def add_row(label: str, seeds: Mapping[int, list[Loaded]], names: Iterable[str], where: str) -> None:
        for seed in held_out(seeds):
            for _, rec in seeds[seed]:
                inputs.add(rec)
        recs, skipped = _records_named(seeds, names)
        if not recs:
            if skipped:
                miss = notes.missing(f"{where}: skipped: {skipped[0]}")
            else:
                miss = notes.missing(f"{where}: not run")
                inputs.missing_input(where)
            rows.append({"label": label, "seeds": 0, "marks": [], **{k: miss for k, _ in COUNTER_COLUMNS}})
        else:
            rows.append(_counter_row(label, recs, notes, where))

    baseline_names = ("flashinfer", "sdpa")
    add_row("FlashInfer", evaluate, baseline_names, f"evaluate/{COUNTER_TRACE}")
    variants = sorted(ragged, key=lambda v: (_raggedness_kind(v), v))
    kinds_seen = set()
    for variant in variants:
        seeds = ragged[variant].get(COUNTER_TRACE, {})
        kinds_seen.add(_raggedness_kind(variant))
        picked = [pick_subject(seeds[s], ("persistentkv", "reference")) for s in held_out(seeds)]
        names = {p[1]["engine"] for p in picked if p} or {"persistentkv"}
        kind = _raggedness_kind(variant)
        label = RAGGEDNESS_LABELS[kind] if kind in RAGGEDNESS_LABELS else f"PersistentKV {variant}"
        add_row(label, seeds, names, f"ablate/raggedness/{variant}/{COUNTER_TRACE}")
    for kind in (0, 2):
        if kind not in kinds_seen:
            label = RAGGEDNESS_LABELS[kind]
            add_row(label, {}, (), f"ablate/raggedness ({label} variant, {COUNTER_TRACE})")
    add_row("Adaptive route", evaluate, ("adaptive",), f"evaluate/{COUNTER_TRACE}")
    return {**inputs.header(), "rows": rows, "trace": trace_label(COUNTER_TRACE),
            "seeds": seeds_text(held_out(evaluate)), "notes": notes.items}
