"""Result files: the envelope every DAG output shares, and reading them back.

Files are written and parsed by pkv.atomic_io (re-exported here), so a reader never sees half a file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pkv.atomic_io import JsonFileError, read_json, write_json_atomic, write_text_atomic

__all__ = ["RESULT_SCHEMA", "JsonFileError", "ResultFileError", "read_json", "write_json_atomic",
           "write_text_atomic", "result_envelope", "iter_results"]

RESULT_SCHEMA = "pkv.result/1"

# Folders under a results root that hold rendered outputs, not results.
_NOT_RESULTS = frozenset({"tables"})


class ResultFileError(JsonFileError):
    """A result file that does not follow the result envelope (or cannot be read or written)."""


def _require_str(field: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, str) or not value:
        raise ResultFileError(f"result envelope: {field} = {value!r} must be a non-empty string")


def _check_wrong_steps(metrics: Mapping[str, Any], source: Any) -> None:
    """The record of steps the float64 reference found wrong (pkv.measure.harness), where a result
    carries it: tables take no ratio against a baseline with wrong measured steps, so the count
    must be one they can read. Results written before the record existed have none of its fields."""
    counts = {}
    for field in ("wrong_steps", "wrong_warmup_steps"):
        if field in metrics:
            value = metrics[field]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ResultFileError(f"{source}: metrics.{field} = {value!r} must be an int >= 0")
            counts[field] = value
    steps = metrics.get("steps")
    if counts.get("wrong_steps") and isinstance(steps, int) and counts["wrong_steps"] > steps:
        raise ResultFileError(f"{source}: metrics.wrong_steps = {counts['wrong_steps']} exceeds metrics.steps = {steps}")
    rel = metrics.get("wrong_max_rel_err")
    if rel is not None and (isinstance(rel, bool) or not isinstance(rel, (int, float)) or not rel >= 0):
        raise ResultFileError(f"{source}: metrics.wrong_max_rel_err = {rel!r} must be a number >= 0 or null "
                              "(null: an output that was not finite)")
    first = metrics.get("first_wrong_step")
    if first is not None and (not isinstance(first, str) or not first):
        raise ResultFileError(f"{source}: metrics.first_wrong_step = {first!r} must be a non-empty string or null")
    if sum(counts.values()) and first is None:
        raise ResultFileError(f"{source}: metrics records wrong steps ({counts}) but no first_wrong_step")


def result_envelope(
    experiment: str,
    trace: Mapping[str, Any],
    engine: str,
    *,
    baseline_engine: str | None,
    run_id: str,
    performance_result: bool,
    metrics: Mapping[str, Any] | None = None,
    skipped: str | None = None,
    variant: str | None = None,
    provenance: Mapping[str, Any],
) -> dict:
    """One trace-run result (docs/architecture.md, "Result files").

    Exactly one of metrics (it ran) or skipped (why it could not run) is given.
    """
    _require_str("experiment", experiment)
    _require_str("engine", engine)
    _require_str("baseline_engine", baseline_engine, allow_none=True)
    _require_str("run_id", run_id)
    _require_str("variant", variant, allow_none=True)
    if not isinstance(trace, Mapping) or not isinstance(trace.get("name"), str) or not trace.get("name"):
        raise ResultFileError(f"result envelope: trace = {trace!r} must be a mapping with a non-empty 'name'")
    if not isinstance(performance_result, bool):
        raise ResultFileError(f"result envelope: performance_result = {performance_result!r} must be a bool")
    if (metrics is None) == (skipped is None):
        raise ResultFileError(
            f"result envelope for {engine} on {trace['name']}: give exactly one of metrics or skipped "
            f"(metrics={'set' if metrics is not None else None}, skipped={skipped!r})"
        )
    if metrics is not None and not isinstance(metrics, Mapping):
        raise ResultFileError(f"result envelope: metrics must be a mapping, got {type(metrics).__name__}")
    if metrics is not None:
        _check_wrong_steps(metrics, f"result envelope for {engine} on {trace['name']}")
    if skipped is not None:
        _require_str("skipped", skipped)
    if not isinstance(provenance, Mapping):
        raise ResultFileError(f"result envelope: provenance must be a mapping, got {type(provenance).__name__}")
    record: dict[str, Any] = {
        "schema": RESULT_SCHEMA,
        "experiment": experiment,
        "variant": variant,
        "trace": dict(trace),
        "engine": engine,
        "baseline_engine": baseline_engine,
        "run_id": run_id,
        "performance_result": performance_result,
    }
    if metrics is not None:
        record["metrics"] = dict(metrics)
    else:
        record["skipped"] = skipped
    record["provenance"] = dict(provenance)
    return record


def validate_result(record: Any, source: str | os.PathLike = "<result>") -> dict:
    """Check a parsed result against the envelope; errors name the source file and the field."""
    if not isinstance(record, dict):
        raise ResultFileError(f"{source}: a result must be a JSON object, got {type(record).__name__}")
    if record.get("schema") != RESULT_SCHEMA:
        raise ResultFileError(f"{source}: schema = {record.get('schema')!r}, expected {RESULT_SCHEMA!r}")
    for field in ("experiment", "engine", "run_id"):
        if not isinstance(record.get(field), str) or not record[field]:
            raise ResultFileError(f"{source}: {field} = {record.get(field)!r} must be a non-empty string")
    trace = record.get("trace")
    if not isinstance(trace, dict) or not isinstance(trace.get("name"), str):
        raise ResultFileError(f"{source}: trace = {trace!r} must be an object with a 'name'")
    if not isinstance(record.get("performance_result"), bool):
        raise ResultFileError(
            f"{source}: performance_result = {record.get('performance_result')!r} must be true or false"
        )
    has_metrics = isinstance(record.get("metrics"), dict)
    has_skipped = isinstance(record.get("skipped"), str)
    if has_metrics == has_skipped:
        raise ResultFileError(f"{source}: a result needs exactly one of 'metrics' (object) or 'skipped' (string)")
    if has_metrics:
        _check_wrong_steps(record["metrics"], source)
    if not isinstance(record.get("provenance"), dict):
        raise ResultFileError(f"{source}: provenance is missing or not an object")
    return record


def read_result(path: str | os.PathLike) -> dict:
    """Read and validate one trace-run result file."""
    return validate_result(read_json(path), path)


def iter_results(root: str | os.PathLike) -> Iterator[tuple[Path, dict]]:
    """(path, record) for every trace-run result under root, in sorted path order.

    Other JSON under the root (calibration constants, the build record, profiler counters) is
    passed over; a file that claims the result schema but breaks the envelope raises.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: results root is not a directory")
    for path in sorted(root.rglob("*.json")):
        rel = path.relative_to(root).parts
        if rel[0] in _NOT_RESULTS or any(part.startswith(".") for part in rel):
            continue
        record = read_json(path)
        if isinstance(record, dict) and record.get("schema") == RESULT_SCHEMA:
            yield path, validate_result(record, path)
