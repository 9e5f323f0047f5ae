"""Ratios within one run and their spread over seeds.

A subject engine is compared only with its baseline from the same run (same run_id); the ratios of
the held-out seeds are then reduced to mean and sample standard deviation cells. No ratio is taken
against a baseline whose output the float64 reference found wrong on measured steps of the run
(metrics.wrong_steps, pkv.measure.harness): the seed is left out with a footnote, and a cell no
seed fills says the baseline was wrong (BaselineWrong).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pkv.policy.route import ROUTE_FLASHINFER
from pkv.report.table_data.cells import BaselineWrong, Cell, Notes, mean_std
from pkv.report.table_data.inputs import Inputs
from pkv.report.table_data.loading import Loaded

# Engines that only ever play the baseline role in a comparison.
_BASELINE_ENGINES = frozenset({"flashinfer", "sdpa", "xqa"})


def engine_key(path: Path, record: Mapping[str, Any]) -> set[str]:
    return {record["engine"], path.stem}


def pick_subject(records: list[Loaded], prefer: Iterable[str] = ("adaptive",)) -> Loaded | None:
    """The engine a comparison is about: the first of `prefer` present, else any non-baseline engine."""
    prefer = tuple(prefer)
    for name in prefer:
        for path, rec in records:
            if name in engine_key(path, rec):
                return path, rec
    for path, rec in records:
        if rec["engine"] not in _BASELINE_ENGINES and rec.get("baseline_engine") != rec["engine"]:
            return path, rec
    return None


@dataclass(frozen=True)
class WrongBaseline:
    """A baseline record whose output was wrong against the float64 reference on ``steps`` of its
    ``of`` measured steps, relative error up to ``rel_err`` (inf: an output that was not finite);
    ``first`` says where it first was."""

    engine: str
    steps: int
    of: int
    rel_err: float
    first: str | None

    def describe(self) -> str:
        first = f"; first: {self.first}" if self.first else ""
        error = f"relative error up to {self.rel_err:.3e}" if math.isfinite(self.rel_err) else \
            "an output that was not finite"
        return (f"baseline {self.engine} wrong against the float64 reference on {self.steps} of {self.of} "
                f"measured steps ({error}{first})")


def wrong_baseline(record: Mapping[str, Any] | None) -> WrongBaseline | None:
    """What the harness recorded of a baseline's wrong measured steps, or None where it had none
    (or the record predates the field)."""
    steps = metric(record, "wrong_steps")
    if not steps or steps <= 0:
        return None
    first = record["metrics"].get("first_wrong_step")
    rel = metric(record, "wrong_max_rel_err")  # null: a wrong output that was not finite
    return WrongBaseline(record["engine"], int(steps), int(metric(record, "steps") or 0),
                         math.inf if rel is None else rel, first if isinstance(first, str) else None)


@dataclass
class Comparison:
    """A subject record and its baseline from the same run (or why there is none; ``wrong`` where
    that is the baseline's wrong output)."""

    subject: dict | None
    baseline: dict | None
    problem: str | None
    wrong: WrongBaseline | None = None


def compare_in_run(records: list[Loaded], where: str, prefer: Iterable[str] = ("adaptive",),
                   baseline: str | None = None) -> Comparison:
    """The subject against the run's baseline engine, or against ``baseline`` where given (a
    second baseline of the same run, such as XQA)."""
    picked = pick_subject(records, prefer)
    if picked is None:
        return Comparison(None, None, f"{where}: no engine other than the baseline")
    spath, subject = picked
    if "skipped" in subject:
        return Comparison(subject, None, f"{where}: {subject['engine']} skipped: {subject['skipped']}")
    base_name = baseline or subject.get("baseline_engine")
    if not base_name:
        return Comparison(subject, None, f"{where}: {spath.name} names no baseline_engine")
    candidates = [(p, r) for p, r in records if base_name in engine_key(p, r) and p != spath]
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
    wrong = wrong_baseline(baseline)
    if wrong is not None:
        # Its timings are of a kernel that computed something else: the ratio would not compare like with like.
        return Comparison(subject, None, f"{where}: {wrong.describe()}; no ratio taken", wrong)
    return Comparison(subject, baseline, None)


def metric(record: Mapping[str, Any] | None, key: str) -> float | None:
    if not record or not isinstance(record.get("metrics"), Mapping):
        return None
    value = record["metrics"].get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


# The note of a routed row whose every step took FlashInfer's route.
BASELINE_ROUTE_ONLY = ("every step took FlashInfer's route (the policy's gates): the row ran the baseline's "
                       "kernels, so its ratio is FlashInfer against itself")


def took_baseline_route_only(records: Iterable[Mapping[str, Any]]) -> bool:
    """Whether every step of every one of these routed records took FlashInfer's route (each
    records its steps per route in metrics.routes)."""
    routes = [(rec.get("metrics") or {}).get("routes") for rec in records]
    return bool(routes) and all(isinstance(r, Mapping) and set(r) == {ROUTE_FLASHINFER} for r in routes)


def ratio(cmp: Comparison, key: str) -> float | None:
    num, den = metric(cmp.subject, key), metric(cmp.baseline, key)
    if num is None or den is None or den == 0:
        return None
    return num / den


@dataclass
class ServingAggregate:
    """Per-seed comparisons of one trace, reduced to table cells."""

    seeds: list[int]
    subjects: list[dict]
    cuda_ratios: list[float]
    wall_ratios: list[float]
    problems: list[str]
    # seed -> its baseline's wrong steps, for the seeds left out for that (also among the problems)
    wrong_baselines: dict[int, WrongBaseline] = field(default_factory=dict)
    baselines: list[dict] = field(default_factory=list)  # the baseline's record of each seed in `seeds`

    @property
    def ok(self) -> bool:
        return bool(self.wall_ratios)


def aggregate_serving(seeds: Mapping[int, list[Loaded]], where: str, inputs: Inputs,
                      prefer: Iterable[str] = ("adaptive",), baseline: str | None = None) -> ServingAggregate:
    agg = ServingAggregate([], [], [], [], [])
    for seed in sorted(seeds):
        for _, rec in seeds[seed]:
            inputs.add(rec)
        cmp = compare_in_run(seeds[seed], f"{where} seed {seed}", prefer, baseline)
        if cmp.problem:
            agg.problems.append(cmp.problem)
            if cmp.wrong is not None:
                agg.wrong_baselines[seed] = cmp.wrong
            continue
        cuda, wall = ratio(cmp, "cuda_tok_s"), ratio(cmp, "wall_tok_s")
        if cuda is None or wall is None:
            agg.problems.append(f"{where} seed {seed}: cuda_tok_s or wall_tok_s missing or zero")
            continue
        agg.seeds.append(seed)
        agg.subjects.append(cmp.subject)
        agg.baselines.append(cmp.baseline)
        agg.cuda_ratios.append(cuda)
        agg.wall_ratios.append(wall)
    return agg


def unfilled_cell(agg: ServingAggregate, notes: Notes, reason_if_empty: str) -> Cell:
    """The cell of a ratio no seed gave, its footnote the reasons: where a baseline was wrong, the
    cell says so (its wrong steps over those seeds' measured steps, the largest relative error)."""
    reason = "; ".join(agg.problems) if agg.problems else reason_if_empty
    wrong = list(agg.wrong_baselines.values())
    if wrong:
        return BaselineWrong(sum(w.steps for w in wrong), sum(w.of for w in wrong),
                             max(w.rel_err for w in wrong), notes.number(reason))
    return notes.missing(reason)


def ratio_cells(agg: ServingAggregate, notes: Notes, reason_if_empty: str) -> tuple[Cell, Cell]:
    if not agg.ok:
        miss = unfilled_cell(agg, notes, reason_if_empty)
        return miss, miss
    return mean_std(agg.cuda_ratios, 3), mean_std(agg.wall_ratios, 3)


def note_partial(agg: ServingAggregate, notes: Notes) -> list[int]:
    """Footnotes for seeds left out of an otherwise filled row."""
    if agg.ok and agg.problems:
        return [notes.number(p) for p in agg.problems]
    return []
