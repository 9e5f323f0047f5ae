"""From result files to table rows: every number a rendered table shows is computed here.

The templates in paper_tables/ own the layout; this module owns the arithmetic (ratios within one
run, mean and sample standard deviation over seeds) and says, for every cell it cannot fill, why.
Cells are typed values (Num, MeanStd, Sci, Text, Missing) so that one set of rows renders to both
Markdown and LaTeX; pkv.report.tables formats them.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from pkv.report.results import ResultFileError, read_json, validate_result

CALIBRATION_SEED = 20260622

# What the paper reports; rows it names but the artifact lacks are listed as "not run".
PAPER_ISOLATED_CONTEXTS = (8192, 32768, 65536)
PAPER_SERVING_TRACES = ("bucketed_b1", "bimodal_b8", "uniform_b8", "zipf_b8", "bimodal_b4")
PAPER_MLP_TRACES = ("bimodal_b8",)
COUNTER_TRACE = "bimodal_b8"
GQA_TRACE = "bimodal_b8"

ISOLATED_METHOD_ORDER = ("flashinfer", "vllm", "persistentkv", "trtllm", "sdpa", "reference")
METHOD_LABELS = {
    "flashinfer": "FlashInfer",
    "vllm": "vLLM PagedAttention",
    "persistentkv": "PersistentKV, auto split",
    "trtllm": "TensorRT-LLM MMHA",
    "sdpa": "Repack + PyTorch SDPA",
    "reference": "PersistentKV reference (torch)",
    "dense": "Dense float64 reference",
}
ROUTE_LABELS = {
    "flashinfer": "FlashInfer",
    "sdpa": "SDPA (FlashInfer role)",
    "persistentkv_bucket": "PersistentKV bucket",
    "persistentkv_buckets": "PersistentKV bucket",
    "persistentkv_exact": "PersistentKV exact buckets",
    "persistentkv_masked": "PersistentKV masked bucket",
    "persistentkv_workqueue": "PersistentKV workqueue",
    "persistentkv_fused": "PersistentKV fused workqueue",
}
ENGINE_LABELS = {
    "flashinfer": "FlashInfer",
    "sdpa": "SDPA (FlashInfer role)",
    "adaptive": "Adaptive route",
    "persistentkv": "PersistentKV",
    "reference": "PersistentKV reference",
}
_FAMILY_LABELS = {
    "bucketed": "Bucketed",
    "bimodal": "Bimodal",
    "uniform": "Uniform",
    "zipf": "Zipf",
    "homogeneous": "Homogeneous",
}
# Engines that only ever play the baseline role in a comparison.
_BASELINE_ENGINES = frozenset({"flashinfer", "sdpa"})


# --------------------------------------------------------------------------- cells


@dataclass(frozen=True)
class Num:
    value: float
    decimals: int
    suffix: str = ""


@dataclass(frozen=True)
class MeanStd:
    """Mean over n values and their sample standard deviation (None when n == 1)."""

    mean: float
    std: float | None
    n: int
    decimals: int
    suffix: str = ""


@dataclass(frozen=True)
class Sci:
    """A small magnitude such as an error, shown as mantissa x 10^exponent."""

    value: float
    digits: int = 3


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Missing:
    """A value that is not there; `note` numbers the footnote that says why."""

    reason: str
    note: int


@dataclass(frozen=True)
class NotApplicable:
    """A cell with no meaning in its row (the ms/step of a ratio row)."""


Cell = Union[Num, MeanStd, Sci, Text, Missing, NotApplicable]


class Notes:
    """Numbered footnotes of one table; the same reason gets the same number."""

    def __init__(self) -> None:
        self._numbers: dict[str, int] = {}

    def missing(self, reason: str) -> Missing:
        return Missing(reason, self.number(reason))

    def number(self, reason: str) -> int:
        if reason not in self._numbers:
            self._numbers[reason] = len(self._numbers) + 1
        return self._numbers[reason]

    @property
    def items(self) -> list[tuple[int, str]]:
        return [(n, reason) for reason, n in self._numbers.items()]


def mean_std(values: Iterable[float], decimals: int, suffix: str = "") -> MeanStd:
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("mean_std needs at least one value")
    std = statistics.stdev(vals) if len(vals) > 1 else None
    return MeanStd(statistics.fmean(vals), std, len(vals), decimals, suffix)


# --------------------------------------------------------------------------- table header facts


@dataclass
class Inputs:
    """What a table was computed from: device, commits, performance flag, inputs that are absent."""

    devices: set[str] = field(default_factory=set)
    commits: set[str] = field(default_factory=set)
    files: int = 0
    any_not_performance: bool = False
    any_cpu_only: bool = False
    not_run: list[str] = field(default_factory=list)
    _seen: dict[int, Mapping[str, Any]] = field(default_factory=dict)

    def add(self, record: Mapping[str, Any]) -> None:
        # Several rows may read the same file; count it once. Holding the record keeps its id
        # from being reused by another record.
        if id(record) in self._seen:
            return
        self._seen[id(record)] = record
        self.files += 1
        prov = record.get("provenance") if isinstance(record.get("provenance"), Mapping) else {}
        self.devices.add(_device_label(prov))
        commit = prov.get("git_commit") or "unknown"
        if commit != "unknown":
            commit = commit[:12] + ("-dirty" if prov.get("git_dirty") else "")
            # A dirty commit does not say which code ran; the digest of the sources does
            # (`python -m pkv.provenance` prints it for a checkout).
            if prov.get("git_dirty") and prov.get("source_digest"):
                commit += f" (sources {prov['source_digest']})"
        self.commits.add(commit)
        if not is_performance_record(record):
            self.any_not_performance = True
            if not prov.get("gpu_name"):
                self.any_cpu_only = True

    def missing_input(self, what: str) -> None:
        if what not in self.not_run:
            self.not_run.append(what)

    def performance_note(self) -> str | None:
        """None for a performance result, else the reason the table is not one."""
        if self.files == 0:
            return "Not a performance result: none of its inputs ran"
        if self.any_cpu_only:
            return "CPU profile: not a performance result"
        if self.any_not_performance:
            return "Not a performance result: an input is marked performance_result = false"
        return None

    def header(self) -> dict[str, Any]:
        return {
            "performance_note": self.performance_note(),
            "device": "; ".join(sorted(self.devices)) if self.devices else "unknown (no inputs)",
            "commit": ", ".join(sorted(self.commits)) if self.commits else "unknown (no inputs)",
            # With nothing measured there is no performance result either.
            "performance_result": self.files > 0 and not self.any_not_performance,
            "input_files": self.files,
            "not_run": list(self.not_run),
        }


def _device_label(prov: Mapping[str, Any]) -> str:
    gpu = prov.get("gpu_name")
    if gpu:
        details = [f"driver {prov['driver_version']}" if prov.get("driver_version") else None,
                   f"CUDA {prov['cuda_version']}" if prov.get("cuda_version") else None]
        details = [d for d in details if d]
        return f"{gpu} ({', '.join(details)})" if details else str(gpu)
    return "CPU only (no GPU)" if prov else "unknown device"


def is_performance_record(record: Mapping[str, Any]) -> bool:
    """A record counts as a performance result only if it says so and ran on a GPU."""
    flag = record.get("performance_result")
    if isinstance(flag, bool):
        return flag
    prov = record.get("provenance")
    return isinstance(prov, Mapping) and bool(prov.get("gpu_name"))


# --------------------------------------------------------------------------- loading


Loaded = tuple[Path, dict]


def _seed_of(dirname: str) -> int | None:
    m = re.fullmatch(r"seed(\d+)", dirname)
    return int(m.group(1)) if m else None


def load_seed_dir(seed_dir: Path) -> list[Loaded]:
    out = []
    for path in sorted(seed_dir.glob("*.json")):
        if path.name.startswith("."):
            continue
        out.append((path, validate_result(read_json(path), path)))
    return out


def load_trace_tree(base: Path) -> dict[str, dict[int, list[Loaded]]]:
    """<base>/<trace>/seed<S>/<engine>.json -> {trace: {seed: [(path, record)]}}."""
    tree: dict[str, dict[int, list[Loaded]]] = {}
    if not base.is_dir():
        return tree
    for trace_dir in sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for seed_dir in sorted(p for p in trace_dir.iterdir() if p.is_dir()):
            seed = _seed_of(seed_dir.name)
            if seed is None:
                continue
            records = load_seed_dir(seed_dir)
            if records:
                tree.setdefault(trace_dir.name, {})[seed] = records
    return tree


def load_ablation(root: Path, ablation: str) -> dict[str, dict[str, dict[int, list[Loaded]]]]:
    """ablate/<ablation>/<variant>/<trace>/seed<S>/ -> {variant: {trace: {seed: records}}}."""
    base = root / "ablate" / ablation
    if not base.is_dir():
        # The experiment configs name ablations "ablate_<name>"; accept that folder name too.
        base = root / "ablate" / f"ablate_{ablation}"
    if not base.is_dir():
        return {}
    out = {}
    for variant_dir in sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")):
        tree = load_trace_tree(variant_dir)
        if tree:
            out[variant_dir.name] = tree
    return out


def held_out(seeds: Mapping[int, Any]) -> list[int]:
    """Seeds other than the calibration seed: constants are fitted on that one, so it is not evidence."""
    return sorted(s for s in seeds if s != CALIBRATION_SEED)


# --------------------------------------------------------------------------- pairing within a run


def _engine_key(path: Path, record: Mapping[str, Any]) -> set[str]:
    return {record["engine"], path.stem}


def pick_subject(records: list[Loaded], prefer: Iterable[str] = ("adaptive",)) -> Loaded | None:
    """The engine a comparison is about: the first of `prefer` present, else any non-baseline engine."""
    prefer = tuple(prefer)
    for name in prefer:
        for path, rec in records:
            if name in _engine_key(path, rec):
                return path, rec
    for path, rec in records:
        if rec["engine"] not in _BASELINE_ENGINES and rec.get("baseline_engine") != rec["engine"]:
            return path, rec
    return None


@dataclass
class Comparison:
    """A subject record and its baseline from the same run (or why there is none)."""

    subject: dict | None
    baseline: dict | None
    problem: str | None


def compare_in_run(records: list[Loaded], where: str, prefer: Iterable[str] = ("adaptive",)) -> Comparison:
    picked = pick_subject(records, prefer)
    if picked is None:
        return Comparison(None, None, f"{where}: no engine other than the baseline")
    spath, subject = picked
    if "skipped" in subject:
        return Comparison(subject, None, f"{where}: {subject['engine']} skipped: {subject['skipped']}")
    base_name = subject.get("baseline_engine")
    if not base_name:
        return Comparison(subject, None, f"{where}: {spath.name} names no baseline_engine")
    candidates = [(p, r) for p, r in records if base_name in _engine_key(p, r) and p != spath]
    if not candidates:
        return Comparison(subject, None, f"{where}: baseline {base_name} not run")
    same_run = [r for _, r in candidates if r["run_id"] == subject["run_id"]]
    if not same_run:
        return Comparison(
            subject, None,
            f"{where}: {subject['engine']} (run {subject['run_id']}) and {base_name} "
            f"(run {candidates[0][1]['run_id']}) come from different runs; no ratio taken",
        )
    baseline = same_run[0]
    if "skipped" in baseline:
        return Comparison(subject, None, f"{where}: baseline {base_name} skipped: {baseline['skipped']}")
    return Comparison(subject, baseline, None)


def metric(record: Mapping[str, Any] | None, key: str) -> float | None:
    if not record or not isinstance(record.get("metrics"), Mapping):
        return None
    value = record["metrics"].get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def ratio(cmp: Comparison, key: str) -> float | None:
    num, den = metric(cmp.subject, key), metric(cmp.baseline, key)
    if num is None or den is None or den == 0:
        return None
    return num / den


# --------------------------------------------------------------------------- labels


def trace_label(name: str) -> str:
    """"bimodal_b8" -> "Bimodal B8"; a replayed request file keeps its own name: "fixture_mixed B8"."""
    m = re.fullmatch(r"(.+)_b(\d+)", name)
    if not m:
        return name
    return f"{_FAMILY_LABELS.get(m.group(1), m.group(1))} B{m.group(2)}"


def context_label(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def route_label(route: str | None, num_splits: Any = None) -> str:
    if not route:
        return "unknown route"
    label = ROUTE_LABELS.get(route, route)
    if route.startswith("persistentkv") and isinstance(num_splits, int) and not isinstance(num_splits, bool):
        label += f", split {num_splits}"
    return label


def selected_route(subjects: list[dict]) -> tuple[str | None, str]:
    """(most common raw route, display text with split and how many seeds agree)."""
    routes = []
    for rec in subjects:
        m = rec.get("metrics") or {}
        routes.append((m.get("selected_route"), m.get("num_splits")))
    if not routes:
        return None, ""
    (route, splits), count = Counter(routes).most_common(1)[0]
    text = route_label(route, splits)
    if count < len(routes):
        text += f" ({count}/{len(routes)} seeds)"
    return route, text


def seeds_text(seeds: Iterable[int]) -> str:
    seeds = sorted(set(seeds))
    if not seeds:
        return "none"
    if seeds == list(range(seeds[0], seeds[-1] + 1)) and len(seeds) > 2:
        return f"{seeds[0]}–{seeds[-1]}"
    return ", ".join(str(s) for s in seeds)


# --------------------------------------------------------------------------- serving aggregation


@dataclass
class ServingAggregate:
    """Per-seed comparisons of one trace, reduced to table cells."""

    seeds: list[int]
    subjects: list[dict]
    cuda_ratios: list[float]
    wall_ratios: list[float]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return bool(self.wall_ratios)


def aggregate_serving(seeds: Mapping[int, list[Loaded]], where: str, inputs: Inputs,
                      prefer: Iterable[str] = ("adaptive",)) -> ServingAggregate:
    agg = ServingAggregate([], [], [], [], [])
    for seed in sorted(seeds):
        for _, rec in seeds[seed]:
            inputs.add(rec)
        cmp = compare_in_run(seeds[seed], f"{where} seed {seed}", prefer)
        if cmp.problem:
            agg.problems.append(cmp.problem)
            continue
        cuda, wall = ratio(cmp, "cuda_tok_s"), ratio(cmp, "wall_tok_s")
        if cuda is None or wall is None:
            agg.problems.append(f"{where} seed {seed}: cuda_tok_s or wall_tok_s missing or zero")
            continue
        agg.seeds.append(seed)
        agg.subjects.append(cmp.subject)
        agg.cuda_ratios.append(cuda)
        agg.wall_ratios.append(wall)
    return agg


def _ratio_cells(agg: ServingAggregate, notes: Notes, reason_if_empty: str) -> tuple[Cell, Cell]:
    if not agg.ok:
        reason = "; ".join(agg.problems) if agg.problems else reason_if_empty
        miss = notes.missing(reason)
        return miss, miss
    return mean_std(agg.cuda_ratios, 3), mean_std(agg.wall_ratios, 3)


def _note_partial(agg: ServingAggregate, notes: Notes) -> list[int]:
    """Footnotes for seeds left out of an otherwise filled row."""
    if agg.ok and agg.problems:
        return [notes.number(p) for p in agg.problems]
    return []


# --------------------------------------------------------------------------- Table 1


def table1(root: Path) -> dict[str, Any]:
    notes, inputs = Notes(), Inputs()
    base = root / "isolated"
    files: dict[int, dict] = {}
    if base.is_dir():
        for path in sorted(base.glob("ctx*.json")):
            m = re.fullmatch(r"ctx(\d+)", path.stem)
            if not m:
                continue
            record = read_json(path)
            methods = record.get("methods") if isinstance(record, dict) else None
            if methods is None and isinstance(record, dict):
                methods = (record.get("metrics") or {}).get("methods")
            if not isinstance(methods, dict):
                raise ResultFileError(f"{path}: 'methods' must be an object of method -> result")
            files[int(m.group(1))] = record
            inputs.add(record)
    for ctx in PAPER_ISOLATED_CONTEXTS:
        if ctx not in files:
            inputs.missing_input(f"isolated/ctx{ctx}.json")
    contexts = sorted(files)

    def methods_of(rec: dict) -> dict:
        return rec.get("methods") if "methods" in rec else rec["metrics"]["methods"]

    names = {name for rec in files.values() for name in methods_of(rec)}
    order = [n for n in ISOLATED_METHOD_ORDER if n in names] + sorted(names - set(ISOLATED_METHOD_ORDER))
    rows = []
    for name in order:
        cells, errs = [], []
        for ctx in contexts:
            entry = methods_of(files[ctx]).get(name)
            if entry is None:
                miss = notes.missing(f"{name} not run at {context_label(ctx)}")
                cells.append({"ms": miss, "floor": miss})
                continue
            if "skipped" in entry:
                miss = notes.missing(f"{name}: {entry['skipped']}")
                cells.append({"ms": miss, "floor": miss})
                continue
            median_us = entry.get("median_us")
            if not isinstance(median_us, (int, float)):
                raise ResultFileError(f"{base / f'ctx{ctx}.json'}: methods.{name}.median_us = {median_us!r}")
            floor = entry.get("fraction_of_floor")
            cells.append({
                "ms": Num(median_us / 1000.0, 4),
                "floor": Num(floor, 2) if isinstance(floor, (int, float)) else notes.missing(
                    f"{name}: fraction of the read-bandwidth floor not reported"),
            })
            if isinstance(entry.get("rel_err"), (int, float)):
                errs.append(float(entry["rel_err"]))
        rel = Sci(max(errs)) if errs else notes.missing(f"{name}: no relative error reported")
        rows.append({"method": name, "label": METHOD_LABELS.get(name, name), "cells": cells, "rel_err": rel})
    return {
        **inputs.header(),
        "contexts": [{"tokens": c, "label": context_label(c)} for c in contexts],
        "rows": rows,
        "notes": notes.items,
    }


# --------------------------------------------------------------------------- Table 2


def _ordered(found: Iterable[str], expected: Iterable[str]) -> list[str]:
    found = list(found)
    expected = list(expected)
    return [t for t in expected if t in found] + sorted(t for t in found if t not in expected)


def table2(root: Path) -> dict[str, Any]:
    notes, inputs = Notes(), Inputs()
    tree = load_trace_tree(root / "evaluate")
    rows, all_seeds = [], set()
    for trace in list(PAPER_SERVING_TRACES) + sorted(set(tree) - set(PAPER_SERVING_TRACES)):
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
            rows.append({**row, **dict.fromkeys(("route", "cuda", "wall", "max_err", "mean_err"), miss)})
            continue
        agg = aggregate_serving(seeds, f"evaluate/{trace}", inputs)
        all_seeds.update(agg.seeds)
        cuda, wall = _ratio_cells(agg, notes, "no comparable runs")
        if agg.ok:
            route: Cell = Text(selected_route(agg.subjects)[1])
            errs = {}
            for key in ("max_abs_err", "mean_abs_err"):
                vals = [metric(s, key) for s in agg.subjects]
                # Both error columns report the worst seed: a tolerance holds only if it holds everywhere.
                errs[key] = Sci(max(vals)) if all(v is not None for v in vals) else notes.missing(
                    f"{trace}: {key} not recorded")
            max_err, mean_err = errs["max_abs_err"], errs["mean_abs_err"]
        else:
            route = max_err = mean_err = cuda
        rows.append({**row, "route": route, "cuda": cuda, "wall": wall, "max_err": max_err,
                     "mean_err": mean_err, "seeds": len(agg.seeds), "marks": _note_partial(agg, notes)})
    return {**inputs.header(), "rows": rows, "seeds": seeds_text(all_seeds), "notes": notes.items}


# --------------------------------------------------------------------------- Table 3


def table3(root: Path) -> dict[str, Any]:
    notes, inputs = Notes(), Inputs()
    tree = load_trace_tree(root / "mlp")
    blocks = []
    for trace in _ordered(tree, PAPER_MLP_TRACES):
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
            miss = notes.missing("; ".join(agg.problems) or f"{trace}: no held-out seeds")
            ratio_row = {"cuda": miss, "wall": miss}
        blocks.append({"trace": trace, "label": trace_label(trace), "rows": rows, "ratio": ratio_row,
                       "seeds": seeds_text(agg.seeds), "marks": _note_partial(agg, notes)})
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
            if _engine_key(path, rec) & set(names):
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


# --------------------------------------------------------------------------- Table 5


NCU_COLUMNS = (("time_ms", 3), ("sm_throughput_pct", 2), ("mem_throughput_pct", 2), ("dram_gbps", 1),
               ("l2_hit_pct", 2))


def table5(root: Path) -> dict[str, Any]:
    notes, inputs = Notes(), Inputs()
    path = root / "profile" / "ncu_counters.json"
    rows, skipped = [], None
    if not path.exists():
        inputs.missing_input("profile/ncu_counters.json")
        skipped = "not run"
    else:
        record = read_json(path)
        if not isinstance(record, dict):
            raise ResultFileError(f"{path}: expected a JSON object")
        inputs.add(record)
        if "skipped" in record:
            skipped = str(record["skipped"])
        else:
            kernels = record.get("kernels")
            if not isinstance(kernels, list):
                raise ResultFileError(f"{path}: 'kernels' = {kernels!r} must be a list")
            for i, k in enumerate(kernels):
                if not isinstance(k, dict) or not isinstance(k.get("name"), str):
                    raise ResultFileError(f"{path}: kernels[{i}] needs a string 'name'")
                row = {"name": k["name"], "role": k.get("role") or k["name"]}
                for key, decimals in NCU_COLUMNS:
                    v = k.get(key)
                    row[key] = Num(v, decimals) if isinstance(v, (int, float)) and not isinstance(v, bool) \
                        else notes.missing(f"{k['name']}: {key} not captured")
                rows.append(row)
    return {**inputs.header(), "rows": rows, "skipped": skipped, "notes": notes.items}


# --------------------------------------------------------------------------- Tables 7 and 8


def _variant_int(variant: str, pattern: str) -> int | None:
    m = re.search(pattern, variant, flags=re.IGNORECASE)
    return int(m.group(1)) if m else None


# (ablation folder, engines preferred as the subject, row note). The B4 sweep times PersistentKV's
# workqueue directly: the policy would route B4 to FlashInfer, so the sweep asks what that avoids.
SPLIT_SWEEPS = (
    ("splits", ("adaptive",), "policy with fixed split count"),
    ("b4", ("persistentkv_workqueue", "persistentkv"), "PersistentKV workqueue, B4 allowed"),
)


def table7(root: Path) -> dict[str, Any]:
    notes, inputs = Notes(), Inputs()
    rows, all_seeds = [], set()
    for ablation, prefer, what in SPLIT_SWEEPS:
        sweep = load_ablation(root, ablation)
        if not sweep:
            inputs.missing_input(f"ablate/{ablation}")
            continue
        by_trace: dict[str, list[tuple[int, str]]] = {}
        for variant in sweep:
            splits = _variant_int(variant, r"(\d+)\s*$")
            if splits is None:
                raise ResultFileError(f"{root / 'ablate' / ablation / variant}: variant names no split count")
            for trace in sweep[variant]:
                by_trace.setdefault(trace, []).append((splits, variant))
        for trace in _ordered(by_trace, ("bucketed_b1", "bimodal_b8", "bimodal_b4")):
            points = []
            for splits, variant in sorted(by_trace[trace]):
                # A sensitivity check on held-out data: the calibration seed is left out.
                seeds = {s: sweep[variant][trace][s] for s in held_out(sweep[variant][trace])}
                agg = aggregate_serving(seeds, f"ablate/{ablation}/{variant}/{trace}", inputs, prefer)
                all_seeds.update(agg.seeds)
                cuda, wall = _ratio_cells(agg, notes, "no held-out seeds")
                points.append({"splits": splits, "cuda": cuda, "wall": wall, "seeds": len(agg.seeds),
                               "marks": _note_partial(agg, notes)})
            rows.append({"trace": trace, "label": f"{trace_label(trace)} ({what})", "points": points})
    return {**inputs.header(), "rows": rows, "seeds": seeds_text(all_seeds), "notes": notes.items}


def _find_int(config: Any, keys: tuple[str, ...]) -> int | None:
    """First integer under any of `keys` anywhere in a nested config."""
    if isinstance(config, Mapping):
        for key in keys:
            v = config.get(key)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
        for v in config.values():
            found = _find_int(v, keys)
            if found is not None:
                return found
    return None


def table8(root: Path) -> dict[str, Any]:
    notes, inputs = Notes(), Inputs()
    ablation = load_ablation(root, "gqa")
    if not ablation:
        inputs.missing_input("ablate/gqa")
    rows, all_seeds = [], set()
    for variant in ablation:
        seeds_all = ablation[variant].get(GQA_TRACE)
        if not seeds_all:
            continue
        seeds = {s: seeds_all[s] for s in held_out(seeds_all)}
        agg = aggregate_serving(seeds, f"ablate/gqa/{variant}/{GQA_TRACE}", inputs)
        all_seeds.update(agg.seeds)
        cuda, wall = _ratio_cells(agg, notes, "no held-out seeds")
        group = _variant_int(variant, r"\bG\s*=\s*(\d+)")
        hkv = _variant_int(variant, r"hkv\s*=\s*(\d+)")
        if agg.subjects:
            cfg = (agg.subjects[0].get("provenance") or {}).get("config") or {}
            hq = _find_int(cfg, ("num_q_heads", "num_qo_heads", "hq"))
            if hkv is None:
                hkv = _find_int(cfg, ("num_kv_heads", "hkv"))
            if group is None and hq and hkv:
                group = hq // hkv
            if hkv is None and hq and group:
                hkv = hq // group
        route = Text(selected_route(agg.subjects)[1]) if agg.ok else cuda
        rows.append({
            "variant": variant,
            "group": Num(group, 0) if group is not None else notes.missing(f"{variant}: G not recorded"),
            "hkv": Num(hkv, 0) if hkv is not None else notes.missing(f"{variant}: Hkv not recorded"),
            "route": route, "cuda": cuda, "wall": wall, "sort": group if group is not None else 1 << 30,
            "marks": _note_partial(agg, notes),
        })
    rows.sort(key=lambda r: (r["sort"], r["variant"]))
    return {**inputs.header(), "rows": rows, "trace": trace_label(GQA_TRACE), "seeds": seeds_text(all_seeds),
            "notes": notes.items}


__all__ = [
    "CALIBRATION_SEED", "Cell", "Comparison", "Inputs", "MeanStd", "Missing", "NotApplicable", "Notes", "Num",
    "Sci", "Text", "aggregate_serving", "compare_in_run", "held_out", "load_ablation",
    "load_trace_tree", "mean_std", "ratio", "route_label", "selected_route", "table1", "table2", "table3",
    "table4", "table5", "table7", "table8", "trace_label",
]
