"""Table 9: the gain inside a model-shaped decode step, eager and replayed from CUDA graphs.

Per trace and (engine, mode): the route most of its steps took (as Table 2 names it, with its
split count, the steps other split rules and routes took), decode-token throughput and step time
(device), attention's share of the step, host time per step, the ratio to FlashInfer in the same
mode (device time and synchronized wall time, taken per seed between files of one run), the ceiling
of that ratio (FlashInfer's step over the step with attention at the read floor: KV bytes over the
calibration's bandwidth) and the fraction of the ceiling the device ratio captures. Mean and
sample std over the held-out seeds.

No ratio, ceiling or captured fraction is taken against a baseline whose output the float64
reference found wrong on measured steps of the run (metrics.wrong_steps,
pkv.measure.model_step_run), nor for a row whose own output was (a baseline's path: one under study
that is wrong stops the run): the seed is left out with a footnote, as comparisons.compare_in_run
does for the other tables, and ratio cells no seed fills say the baseline was wrong (BaselineWrong).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from pkv.report.table_data.cells import BaselineWrong, Notes, mean_std
from pkv.report.table_data.comparisons import BASELINE_ROUTE_ONLY, metric, took_baseline_route_only, wrong_baseline
from pkv.report.table_data.inputs import Inputs
from pkv.report.table_data.labels import (
    ENGINE_LABELS,
    paper_then_found,
    routes_taken,
    seeds_text,
    trace_label,
)
from pkv.report.table_data.loading import held_out, load_trace_tree

# The traces of config/config.yaml's model_step_traces (Table 2's, and the Azure traces where configured).
MODEL_STEP_TRACES = ("bucketed_b1", "bimodal_b8", "uniform_b8", "zipf_b8", "homogeneous_b8", "bimodal_b4")
ENGINE_ORDER = ("adaptive", "xqa", "flashinfer")
MODE_ORDER = ("eager", "graph")
MODE_LABELS = {"eager": "eager", "graph": "CUDA graph"}
COLUMNS = ("tok_s", "step_ms", "attention_share", "host_ms", "cuda", "wall", "ceiling", "captured")
# The columns taken against the row's baseline: none where that baseline's output was wrong.
RATIO_COLUMNS = ("cuda", "wall", "ceiling", "captured")
# Why attention's share and the ceiling are left out where the step is bound by its host.
HOST_BOUND = ("the step is bound by its host (its host time per step is at least its device time, or its "
              "attention time comes out below the read floor): the device waits between launches, so the "
              "step with attention left out is not shorter by attention's time, and attention's share and "
              "the ceiling cannot be taken from it")


def separable(rec: dict) -> bool:
    """Whether a record's step splits into attention and the rest (the step less the same step
    without attention): not where the host takes as long to issue the step as the device to run
    it, nor where that difference is below the read floor of attention's KV, which no kernel
    reaches. Either way the device waited on the host, as eager steps of a whole model do on a
    fast GPU, and the difference is not attention's time."""
    m = rec.get("metrics") or {}
    attention, floor = m.get("attention_cuda_ms_per_step"), m.get("floor_attention_ms_per_step")
    host, device = m.get("host_ms_per_step"), m.get("cuda_ms_per_step")
    if None in (attention, floor, host, device):
        return False
    return host < device and attention >= floor


def step_ceiling(base: dict) -> float | None:
    """The ceiling of a row's ratio: the baseline's step over the same step with attention at the
    read floor (None where either time is missing)."""
    step, floor = metric(base, "cuda_ms_per_step"), metric(base, "floor_step_ms_per_step")
    return step / floor if step and floor and step > 0 and floor > 0 else None


def _label_parts(label: str) -> tuple[str, str]:
    role, _, mode = label.rpartition("_")
    return (role, mode) if mode in MODE_ORDER else (label, "")


def _order(label: str) -> tuple:
    role, mode = _label_parts(label)
    rank = ENGINE_ORDER.index(role) if role in ENGINE_ORDER else len(ENGINE_ORDER)
    return rank, role, MODE_ORDER.index(mode) if mode in MODE_ORDER else 9


def row_values(seeds: dict, label: str, where: str, problems: list) -> dict[str, list]:
    """Per held-out seed: the row's own metrics and its ratios to the same-mode baseline of the same
    run; ``wrong``: seed -> the wrong steps of the seeds left out of the ratios for them."""
    values: dict[str, Any] = {k: [] for k in (*COLUMNS, "layers", "baseline_route_only")}
    values["undefined"] = {}  # column -> why it has no value on some seed
    values["wrong"] = {}
    for seed in sorted(seeds):
        records = {path.stem: rec for path, rec in seeds[seed]}
        rec = records.get(label)
        if rec is None:
            problems.append(f"{where} seed {seed}: {label} not run")
            continue
        if "skipped" in rec:
            problems.append(rec["skipped"])  # the same reason on every trace and seed: one footnote
            continue
        m = rec["metrics"]
        values["tok_s"].append(metric(rec, "cuda_tok_s"))
        values["step_ms"].append(metric(rec, "cuda_ms_per_step"))
        if separable(rec):
            values["attention_share"].append(metric(rec, "attention_share"))
        else:
            values["undefined"]["attention_share"] = HOST_BOUND
        values["host_ms"].append(metric(rec, "host_ms_per_step"))
        values["layers"].append((m.get("layers_run"), m.get("layers_model")))
        base = records.get(rec.get("baseline_engine") or "")
        if base is None or "skipped" in base or base.get("run_id") != rec.get("run_id"):
            why = "not run" if base is None else base.get("skipped") or "from another run; no ratio taken"
            problems.append(f"{where} seed {seed}: baseline {rec.get('baseline_engine')}: {why}")
            continue
        # Timings of a kernel that computed something else compare nothing: the baseline's wrong
        # steps, or the row's own (a baseline's path beside the run's baseline, such as XQA's).
        wrong = wrong_baseline(base) or wrong_baseline(rec)
        if wrong is not None:
            problems.append(f"{where} seed {seed}: {wrong.describe()}; no ratio taken")
            values["wrong"][seed] = wrong
            continue
        cuda, wall = metric(base, "cuda_ms_per_step"), metric(base, "wall_ms_per_step")
        mine_cuda, mine_wall = metric(rec, "cuda_ms_per_step"), metric(rec, "wall_ms_per_step")
        floor = metric(base, "floor_step_ms_per_step")
        if not all(v and v > 0 for v in (cuda, wall, mine_cuda, mine_wall, floor)):
            problems.append(f"{where} seed {seed}: step times missing or zero")
            continue
        ratio = cuda / mine_cuda
        values["cuda"].append(ratio)
        values["wall"].append(wall / mine_wall)
        # A routed engine whose every step took FlashInfer's route ran the baseline's kernels: its
        # ratio is FlashInfer against itself, and there is no gain to have captured.
        baseline_route_only = took_baseline_route_only([rec])
        values["baseline_route_only"].append(baseline_route_only)
        if not separable(base):
            values["undefined"]["ceiling"] = values["undefined"]["captured"] = HOST_BOUND
            continue
        ceiling = step_ceiling(base)
        values["ceiling"].append(ceiling)
        if label != rec.get("baseline_engine") and ceiling > 1 and not baseline_route_only:
            values["captured"].append((ratio - 1) / (ceiling - 1))
    return values


def _cells(values: dict, notes: Notes, label: str, problems: list) -> dict[str, Any]:
    decimals = {"tok_s": 1, "step_ms": 3, "attention_share": 3, "host_ms": 3, "cuda": 3, "wall": 3,
                "ceiling": 3, "captured": 2}
    cells: dict[str, Any] = {}
    for key in COLUMNS:
        vals = [v for v in values[key] if v is not None]
        if key in values["undefined"]:
            # Not a mean over the seeds where it happens to be defined: the column is left out.
            cells[key] = notes.missing(values["undefined"][key])
        elif vals:
            cells[key] = mean_std(vals, decimals[key], "×" if key in ("cuda", "wall", "ceiling") else "")
        elif key == "captured" and values["cuda"]:
            cells[key] = None  # the baseline's own row, or a ceiling at parity: nothing to capture
        elif key in RATIO_COLUMNS and values["wrong"]:
            cells[key] = _baseline_wrong_cell(key, values["wrong"], notes, problems)
        else:
            cells[key] = notes.missing("; ".join(problems) or f"{label}: {key} not recorded")
    return cells


def _baseline_wrong_cell(key: str, wrong: dict, notes: Notes, problems: list):
    """A ratio column no seed filled because its baseline was wrong: the ratios say on how many
    steps (comparisons.unfilled_cell's cell); the ceiling and the captured fraction, taken from the
    same baseline, point to the same footnote."""
    reason = "; ".join(problems)
    if key in ("cuda", "wall"):
        found = list(wrong.values())
        return BaselineWrong(sum(w.steps for w in found), sum(w.of for w in found), max(w.rel_err for w in found),
                             notes.number(reason))
    return notes.missing(reason)


def route_cell(seeds: dict, label: str) -> str:
    """The row's route over its held-out seeds: Table 2's "Selected route" text (the route most
    seeds' steps took, its split count, the steps of other split rules) and the steps of any other
    route; "–" where its records count no routes (a row that did not run)."""
    subjects = [rec for recs in seeds.values() for path, rec in recs
                if path.stem == label and (rec.get("metrics") or {}).get("routes")]
    if not subjects:
        return "–"
    return routes_taken(subjects)


def _graph_path_marks(seeds: dict, label: str, notes: Notes) -> list[int]:
    """The footnote naming the fa2 path FlashInfer's CUDA-graph decode ran at each batch size (its
    wrapper has no holistic kernel; the record says where the probe picked that), where the
    results record it: the graph rows' baseline is that path."""
    seeds_by_path: dict[int, Counter] = {}
    for recs in seeds.values():
        for file, rec in recs:
            if file.stem == label:
                for batch, path in ((rec.get("metrics") or {}).get("flashinfer_graph_paths") or {}).items():
                    seeds_by_path.setdefault(int(batch), Counter())[path] += 1
    if not seeds_by_path:
        return []
    ran = "; ".join(f"B{batch}: " + ", ".join(f"{path} ({n} seed{'s' if n > 1 else ''})"
                                              for path, n in seeds_by_path[batch].most_common())
                    for batch in sorted(seeds_by_path))
    return [notes.number(f"FlashInfer's CUDA-graph decode ran, by batch size: {ran}")]


def table9(root: Path) -> dict[str, Any]:
    notes, inputs = Notes(), Inputs()
    tree = load_trace_tree(root / "model_step")
    blocks, all_seeds, models = [], set(), set()
    for trace in paper_then_found(MODEL_STEP_TRACES, tree):
        seeds = {s: tree[trace][s] for s in held_out(tree.get(trace, {}))}
        if not seeds:
            inputs.missing_input(f"model_step/{trace}" + (": held-out seeds" if trace in tree else ""))
            continue
        labels = sorted({p.stem for recs in seeds.values() for p, _ in recs}, key=_order)
        rows = []
        for seed, recs in seeds.items():
            for _, rec in recs:
                inputs.add(rec)
                model = (rec.get("metrics") or {}).get("model")
                if model:
                    models.add(f"{model['name']} ({model['layers_run']} of {model['layers_model']} layers, "
                               f"{model['dtype']})")
        for label in labels:
            problems: list[str] = []
            values = row_values(seeds, label, f"model_step/{trace}", problems)
            problems = list(dict.fromkeys(problems))
            role, mode = _label_parts(label)
            layers = sorted({lr for lr in values["layers"] if lr[0] is not None})
            cells = _cells(values, notes, label, problems)
            # Seeds left out of a row that shows values; where no seed gave a ratio, the ratio
            # cells' own footnote already says why.
            marks = [notes.number(p) for p in problems] if values["step_ms"] and values["cuda"] and problems else []
            gated = values["baseline_route_only"]
            if role != "flashinfer" and any(gated):
                marks.append(notes.number(f"{BASELINE_ROUTE_ONLY}, with nothing to capture" if all(gated) else
                                          f"{BASELINE_ROUTE_ONLY} on {sum(gated)} of {len(gated)} seeds, left out of "
                                          "the captured fraction"))
            marks += _graph_path_marks(seeds, label, notes) if role == "flashinfer" else []
            rows.append({"label": label, "engine": ENGINE_LABELS.get(role, role), "mode": MODE_LABELS.get(mode, mode),
                         "route": route_cell(seeds, label),
                         "layers": ", ".join(f"{a}/{b}" for a, b in layers) or "–",
                         "seeds": len(values["step_ms"]), **cells, "marks": marks})
            all_seeds.update(s for s in seeds)
        blocks.append({"trace": trace, "label": trace_label(trace), "rows": rows})
    return {**inputs.header(), "blocks": blocks, "seeds": seeds_text(all_seeds),
            "models": "; ".join(sorted(models)) or "none", "notes": notes.items}
