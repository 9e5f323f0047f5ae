"""The numbers behind each figure, computed from result files (pkv.report.figures draws them).

Every series here is read from the files under a results root with the table code's readers, so a
figure and its table agree: the isolated calls of Table 1, the kernel benchmark, the per-seed ratios
of Table 2 (same subject, baseline and run_id rule), the routes the adaptive engine took, and the
host-time split of the host benchmark. A figure whose input was skipped or not run carries the
reason instead of series.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pkv.report.results import ResultFileError, read_json
from pkv.report.table_data import (
    METHOD_LABELS,
    PAPER_SERVING_TRACES,
    ROUTE_LABELS,
    STAND_INS,
    Inputs,
    aggregate_serving,
    context_label,
    held_out,
    load_trace_tree,
    pick_subject,
    trace_label,
)
from pkv.report.table_data.labels import ISOLATED_METHOD_ORDER, ordered
from pkv.report.table_data.model_step import MODEL_STEP_TRACES, row_values


@dataclass
class FigureData:
    """One figure's series, the files they came from and the header facts of those files."""

    name: str
    title: str
    what: str  # the caption's sentence on what is drawn
    series: dict[str, Any] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)  # result files, relative to the results root
    inputs: Inputs = field(default_factory=Inputs)
    empty: str | None = None  # why nothing is drawn

    def read(self, root: Path, path: Path) -> Any:
        self.sources.append(path.relative_to(root).as_posix())
        return read_json(path)

    def header(self) -> dict[str, Any]:
        return self.inputs.header()


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# --------------------------------------------------------------------------- Table 1


def isolated_time(root: Path) -> FigureData:
    fig = FigureData("isolated_time", "Isolated B1 decode: time against context",
                     "Median time of one isolated B1 decode call per method against the context length, "
                     "with the read floor (KV bytes over the measured read bandwidth); lower is better.")
    files = {}
    for path in sorted((root / "isolated").glob("ctx*.json")):
        m = re.fullmatch(r"ctx(\d+)", path.stem)
        if m:
            record = fig.read(root, path)
            if not isinstance(record, dict):
                raise ResultFileError(f"{path}: expected a JSON object")
            fig.inputs.add(record)
            files[int(m.group(1))] = record
    if not files:
        fig.empty = "no isolated/ctx*.json results"
        return fig
    contexts = sorted(files)

    def methods_of(rec: dict) -> dict:
        return rec.get("methods") if "methods" in rec else (rec.get("metrics") or {}).get("methods") or {}

    names = {n for rec in files.values() for n in methods_of(rec)}
    order = [n for n in ISOLATED_METHOD_ORDER if n in names] + sorted(names - set(ISOLATED_METHOD_ORDER))
    methods, skipped, floor_ms = {}, {}, []
    for ctx in contexts:
        floor = None
        for entry in methods_of(files[ctx]).values():
            if not isinstance(entry, dict) or "median_us" not in entry:
                continue
            floor = _number(entry.get("floor_us"))
            if floor is None and _number(entry.get("fraction_of_floor")):
                floor = float(entry["median_us"]) * float(entry["fraction_of_floor"])
            if floor is not None:
                break
        floor_ms.append(floor / 1e3 if floor is not None else None)
    for name in order:
        times, label = [], METHOD_LABELS.get(name, name)
        for ctx in contexts:
            entry = methods_of(files[ctx]).get(name) or {}
            if "skipped" in entry:
                skipped[name] = str(entry["skipped"])
            median = _number(entry.get("median_us"))
            times.append(median / 1e3 if median is not None else None)
            implementation = entry.get("implementation")
            stand_in = STAND_INS.get(name, {}).get(str(implementation).split(":", 1)[0]) if implementation else None
            if stand_in and "stand-in" not in label:
                label += f" (stand-in: {stand_in[0]})"
        if any(t is not None for t in times):
            methods[label] = times
    measured = [(files[c].get("metrics") or {}).get("measured_context_len") for c in contexts]
    fig.series = {"contexts": contexts, "labels": [context_label(c) for c in contexts], "methods": methods,
                  "floor_ms": floor_ms, "skipped": skipped,
                  "measured_contexts": measured if any(m not in (None, c) for m, c in zip(measured, contexts))
                  else None}
    return fig


# --------------------------------------------------------------------------- kernel benchmark


def _skipped_record(fig: FigureData, root: Path, rel: str) -> dict | None:
    """The record at rel, or None with fig.empty set when it is absent or says it was skipped."""
    path = root / rel
    if not path.is_file():
        fig.empty = f"{rel}: not run"
        fig.inputs.missing_input(rel)
        return None
    record = fig.read(root, path)
    if not isinstance(record, dict):
        raise ResultFileError(f"{path}: expected a JSON object")
    fig.inputs.add(record)
    if "skipped" in record:
        fig.empty = f"{rel}: skipped: {record['skipped']}"
        return None
    return record


def _benchmark_cases(fig: FigureData, root: Path, rel: str) -> dict | None:
    """The "cases" of a benchmark record, or None with fig.empty set where it did not run."""
    record = _skipped_record(fig, root, rel)
    if record is None:
        return None
    cases = record.get("cases")
    if not isinstance(cases, dict) or not cases:
        raise ResultFileError(f"{root / rel}: 'cases' must be a non-empty object")
    return cases


def kernel_floor(root: Path) -> FigureData:
    fig = FigureData("kernel_floor", "Decode kernels: fraction of the read floor",
                     "Fraction of the read-bandwidth floor (floor time over median time; 1 is the floor) "
                     "per kernel-benchmark case and engine, every engine on the same page tables.")
    cases = _benchmark_cases(fig, root, "kernel_bench/decode.json")
    if cases is None:
        return fig
    engines: dict[str, list[float | None]] = {}
    names = list(cases)
    for i, (case, data) in enumerate(cases.items()):
        floor = _number(data.get("floor_us"))
        for engine, timing in (data.get("engines") or {}).items():
            median = _number((timing or {}).get("median_us"))
            engines.setdefault(engine, [None] * len(names))[i] = floor / median if floor and median else None
    fig.series = {"cases": names, "engines": engines}
    return fig


# --------------------------------------------------------------------------- Table 2


def _serving(root: Path) -> tuple[FigureData, dict[str, dict]]:
    """(figure shell with inputs and sources, {trace: {seed: records}} of the held-out seeds)."""
    fig = FigureData("", "", "")
    tree = load_trace_tree(root / "evaluate")
    traces = {}
    for trace in ordered(tree, PAPER_SERVING_TRACES):
        seeds = {s: tree[trace][s] for s in held_out(tree[trace])}
        if seeds:
            traces[trace] = seeds
            for records in seeds.values():
                for path, _ in records:
                    fig.sources.append(path.relative_to(root).as_posix())
    return fig, traces


def serving_ratio(root: Path) -> FigureData:
    fig, traces = _serving(root)
    fig.name, fig.title = "serving_ratio", "Serving: adaptive over baseline per trace"
    fig.what = ("Table 2's ratios per trace: adaptive over the FlashInfer-role baseline in decode-token "
                "throughput, one point per held-out seed (within one run), the bar the mean and the line "
                "the sample standard deviation; 1 is parity.")
    rows = []
    for trace, seeds in traces.items():
        agg = aggregate_serving(seeds, f"evaluate/{trace}", fig.inputs)
        if agg.ok:
            rows.append({"trace": trace, "label": trace_label(trace), "seeds": agg.seeds,
                         "wall": agg.wall_ratios, "device": agg.cuda_ratios})
    if not rows:
        fig.empty = "no held-out evaluate results with a ratio"
    fig.series = {"rows": rows, "timer": fig.inputs.header()["timer"]}
    return fig


def route_mix(root: Path) -> FigureData:
    fig, traces = _serving(root)
    fig.name, fig.title = "route_mix", "Routes the policy took per trace"
    fig.what = ("Share of the measured decode steps that the adaptive engine ran on each route, per trace, "
                "over its held-out seeds (the result files' per-run route counts).")
    rows = []
    for trace, seeds in traces.items():
        counts: Counter[str] = Counter()
        for records in seeds.values():
            for _, rec in records:
                fig.inputs.add(rec)
            picked = pick_subject(records)
            if picked is None or "skipped" in picked[1]:
                continue
            for route, steps in ((picked[1].get("metrics") or {}).get("routes") or {}).items():
                if _number(steps):
                    counts[route] += int(steps)
        if counts:
            total = sum(counts.values())
            rows.append({"trace": trace, "label": trace_label(trace), "steps": total,
                         "shares": {ROUTE_LABELS.get(r, r): n / total for r, n in sorted(counts.items())}})
    if not rows:
        fig.empty = "no held-out evaluate results with route counts"
    fig.series = {"rows": rows}
    return fig


# --------------------------------------------------------------------------- host benchmark

HOST_PARTS = (("plan_us", "plan()"), ("issue_us", "run() issue"), ("wait_us", "wait for the device"))


def host_device(root: Path) -> FigureData:
    fig = FigureData("host_device", "Host against device time per step",
                     "Where one serving step's synchronized wall time goes per engine, in a tight loop: host "
                     "planning, issuing the run and waiting for the device (stacked), against the device "
                     "time of the same step (marker).")
    cases = _benchmark_cases(fig, root, "host_bench/host.json")
    if cases is None:
        return fig
    out = []
    for case, data in cases.items():
        engines = []
        for engine, timing in (data.get("engines") or {}).items():
            if "skipped" in (timing or {}):  # a row the case has no step for (a route left to FlashInfer)
                continue
            tight = (timing or {}).get("tight") or {}
            engines.append({"engine": engine, "route": timing.get("route"),
                            "parts": {label: _number(tight.get(key)) or 0.0 for key, label in HOST_PARTS},
                            "device_us": _number(timing.get("device_us"))})
        out.append({"case": case, "engines": engines})
    fig.series = {"cases": out}
    return fig


# --------------------------------------------------------------------------- Table 9


def model_step_ratio(root: Path) -> FigureData:
    fig = FigureData("model_step_ratio", "Model step: adaptive over FlashInfer per trace",
                     "Table 9's ratios per trace: the adaptive engine's whole model-shaped decode step over "
                     "FlashInfer's in the same mode (eager, CUDA graph), in device time and in synchronized wall "
                     "time; the bar is the mean over held-out seeds, the line the sample standard deviation, "
                     "the points the seeds; 1 is parity. A trace marked * took FlashInfer's route on every step "
                     "(the policy's gates): its ratio is FlashInfer against itself.")
    tree = load_trace_tree(root / "model_step")
    rows = []
    for trace in ordered(tree, MODEL_STEP_TRACES):
        seeds = {s: tree[trace][s] for s in held_out(tree[trace])}
        for records in seeds.values():
            for path, rec in records:
                fig.sources.append(path.relative_to(root).as_posix())
                fig.inputs.add(rec)
        series, gated = {}, []
        for mode in ("eager", "graph"):
            values = row_values(seeds, f"adaptive_{mode}", f"model_step/{trace}", [])
            gated += values["baseline_route_only"]
            for key, label in (("cuda", "device"), ("wall", "wall")):
                if values[key]:
                    series[f"{label}, {mode}"] = values[key]
        if series:
            mark = "*" if gated and all(gated) else ""
            rows.append({"trace": trace, "label": trace_label(trace) + mark, "series": series})
    if not tree:
        fig.empty = "model_step: not run"
        fig.inputs.missing_input("model_step")
    elif not rows:
        fig.empty = "no held-out model_step results with a ratio"
    fig.series = {"rows": rows}
    return fig


FIGURE_DATA = {
    "isolated_time": isolated_time,
    "kernel_floor": kernel_floor,
    "serving_ratio": serving_ratio,
    "route_mix": route_mix,
    "host_device": host_device,
    "model_step_ratio": model_step_ratio,
}
