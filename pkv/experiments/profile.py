"""Table 5: Nsight Compute counters of FlashInfer and PersistentKV kernels on a short B8 trace.

The driver runs itself twice. The outer run starts `ncu` around `python -m pkv.cli` with the same
overrides; the inner run (marked by the environment variable below) times the trace with each
engine's decode calls inside an NVTX range of domain "pkv", which is what ncu's --nvtx-include
filters on. The outer run then exports the report as CSV and reduces it to ncu_counters.json.
Range names carry no "/" because ncu reads "/" as nesting; the experiment's engines are
named flashinfer and persistentkv so the ranges are the ones the table expects.

Without a GPU (or without ncu) the driver writes a record that says why, so the table shows the
reason instead of a number.
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from pkv.atomic_io import write_json_atomic, write_text_atomic
from pkv.config import PkvConfig
from pkv.experiments.common import (
    build_engines,
    kv_pool_pages,
    load_requests,
    model_shape,
    provenance_for,
    resolve_settings,
    run_calibration,
    trace_name,
    trace_record,
)
from pkv.measure.harness import TraceRunSpec, run_trace

NCU_SCHEMA = "pkv.ncu/1"
CHILD_ENV = "PKV_NCU_CHILD"
NO_GPU_REASON = "no GPU: Nsight Compute needs one"

# Metric -> (result field, how to convert the exported value). Order is the table's column order.
NCU_METRICS = (
    ("gpu__time_duration.sum", "time_ms"),
    ("sm__throughput.avg.pct_of_peak_sustained_elapsed", "sm_throughput_pct"),
    ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed", "mem_throughput_pct"),
    ("dram__bytes_read.sum.per_second", "dram_gbps"),
    ("lts__t_sector_hit_rate.pct", "l2_hit_pct"),
)
METRIC_LIST = ",".join(name for name, _ in NCU_METRICS)

_TIME_TO_MS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0,
               "second": 1e3, "s": 1e3}
# ncu prints rates with a decimal prefix chosen per value ("Gbyte/second", "Tbyte/s", "B/s").
_RATE_UNIT = re.compile(r"([kmgtp]?)(?:byte|b)/s(?:econd)?")
_PREFIX_TO_GB = {"": 1e-9, "k": 1e-6, "m": 1e-3, "g": 1.0, "t": 1e3, "p": 1e6}


class NcuParseError(ValueError):
    """An ncu CSV export that does not hold the expected columns or values."""


def range_name(label: str) -> str:
    """The NVTX range pkv.measure.harness puts an engine's decode calls in: "<engine label>_decode"."""
    return f"{label}_decode"


def child_overrides(overrides: Sequence[str], out: Path) -> list[str]:
    """The CLI overrides of the run ncu starts: the outer run's, with its own Hydra run folder and an
    ``out`` beside it (the child writes no file, but its out must pass the CLI's checks: a file
    path, not the run folder Hydra has made by then)."""
    child = [o for o in overrides if not o.startswith(("out=", "hydra.run.dir="))]
    # Hydra reads "=" inside a value only when quoted.
    return [*child, f"out='{out.parent / 'ncu_child.json'}'", f"hydra.run.dir='{out.parent / 'ncu_child'}'"]


def ncu_command(ncu: str, report_base: Path, overrides: Sequence[str], labels: Sequence[str]) -> list[str]:
    cmd = [ncu, "--clock-control", "none", "--nvtx"]
    for name in sorted({range_name(label) for label in labels}):
        cmd += ["--nvtx-include", f"pkv@{name}/"]
    cmd += ["--metrics", METRIC_LIST, "-f", "-o", str(report_base), sys.executable, "-m", "pkv.cli", *overrides]
    return cmd


def _number(text: str, where: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        raise NcuParseError(f"{where}: value {text!r} is not a number") from None


def _convert(field: str, value: float, unit: str, where: str) -> float:
    unit_key = unit.strip().lower()
    if field == "time_ms":
        if unit_key not in _TIME_TO_MS:
            raise NcuParseError(f"{where}: unknown time unit {unit!r}")
        return value * _TIME_TO_MS[unit_key]
    if field == "dram_gbps":
        rate = _RATE_UNIT.fullmatch(unit_key)
        if rate is None:
            raise NcuParseError(f"{where}: unknown rate unit {unit!r}")
        return value * _PREFIX_TO_GB[rate.group(1)]
    if unit_key not in ("%", ""):
        raise NcuParseError(f"{where}: expected a percentage, got unit {unit!r}")
    return value


def _engine_of(row: dict[str, str]) -> str | None:
    # The NVTX columns hold the range stack as text; search every field so column naming across
    # ncu versions does not matter.
    text = " ".join(v for k, v in row.items() if k and k != "Kernel Name")
    for engine in ("persistentkv", "flashinfer"):
        if f"{engine}_decode" in text:
            return engine
    return None


def parse_ncu_csv(text: str, source: str = "<ncu csv>") -> list[dict]:
    """Per kernel name: invocations and the mean of each metric, from `ncu --csv --page raw`."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("==")]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 2:
        raise NcuParseError(f"{source}: no header and unit rows (did ncu capture any kernel?)")
    header, units = rows[0], rows[1]
    missing = [name for name, _ in NCU_METRICS if name not in header] + (
        [] if "Kernel Name" in header else ["Kernel Name"])
    if missing:
        raise NcuParseError(f"{source}: missing columns {missing}")
    kernels: dict[str, dict] = {}
    for line_no, cells in enumerate(rows[2:], start=3):
        if len(cells) != len(header):
            raise NcuParseError(f"{source}: line {line_no} has {len(cells)} fields, header has {len(header)}")
        row = dict(zip(header, cells))
        name = row["Kernel Name"]
        entry = kernels.setdefault(name, {"name": name, "engine": _engine_of(row),
                                          "samples": {f: [] for _, f in NCU_METRICS}})
        for metric, field in NCU_METRICS:
            col = header.index(metric)
            where = f"{source}: line {line_no}, {metric}"
            entry["samples"][field].append(_convert(field, _number(cells[col], where), units[col], where))
    if not kernels:
        raise NcuParseError(f"{source}: the report holds no kernel inside the NVTX ranges")
    out = []
    for entry in kernels.values():
        samples = entry.pop("samples")
        engine = entry["engine"]
        kind = "merge" if "merge" in entry["name"].lower() else "decode"
        entry["role"] = f"{'PersistentKV' if engine == 'persistentkv' else 'FlashInfer'} {kind}" if engine else None
        entry["invocations"] = len(samples["time_ms"])
        entry["total_time_ms"] = sum(samples["time_ms"])
        for _, field in NCU_METRICS:
            entry[field] = statistics.fmean(samples[field])
        out.append(entry)
    return out


def _profiled_trace(cfg: PkvConfig) -> None:
    """The inner run under ncu; pkv.measure.harness puts each engine's run() in the range "<engine>_decode"."""
    exp, trace = cfg.experiment, cfg.trace
    settings = resolve_settings(cfg)
    shape = model_shape(cfg)
    engines, skipped = build_engines(exp.engines, cfg, shape, settings.device, run_calibration(cfg))
    if skipped:
        raise RuntimeError(f"profile: engines unavailable: {skipped}")
    requests = load_requests(trace, cfg.seed, settings)
    spec = TraceRunSpec(
        name=trace_name(trace), family=trace.family, seed=cfg.seed,
        requests=tuple(requests), page_size=trace.page_size,
        hole_fraction=trace.hole_fraction, max_active=trace.max_active, page_layout=trace.page_layout,
        page_order=trace.page_order,
        kv_pool_pages=kv_pool_pages(trace, settings, requests),
        warmup_steps=settings.warmup_steps, measured_steps=settings.measured_steps,
        dtype=settings.dtype, device=settings.device, check_every=settings.check_every,
        mlp_tail=False, flush_l2=exp.flush_l2,
    )
    run_trace(spec, shape, engines, baseline=exp.baseline, progress=cfg.progress)


def _record(cfg: PkvConfig, settings, **body) -> dict:
    requests = load_requests(cfg.trace, cfg.seed, settings)
    return {
        "schema": NCU_SCHEMA, "experiment": cfg.experiment.name,
        "trace": trace_record(cfg.trace, cfg.seed, settings, len(requests),
                              kv_pool_pages(cfg.trace, settings, requests)),
        "engines": list(cfg.experiment.engines), "metrics_collected": [m for m, _ in NCU_METRICS],
        "performance_result": settings.performance_result and "skipped" not in body,
        **body, "provenance": provenance_for(cfg, settings, cfg.seed),
    }


def run(cfg: PkvConfig, overrides: Sequence[str] = ()) -> list[Path]:
    """Write cfg.out (ncu_counters.json); `overrides` are the CLI's, replayed for the inner run."""

    settings = resolve_settings(cfg)
    if os.environ.get(CHILD_ENV) == "1":
        _profiled_trace(cfg)
        return []
    out = Path(cfg.out)
    if settings.device != "cuda" or not torch.cuda.is_available():
        return [write_json_atomic(out, _record(cfg, settings, skipped=NO_GPU_REASON))]
    ncu = shutil.which("ncu")
    if ncu is None:
        return [write_json_atomic(out, _record(cfg, settings, skipped="ncu (Nsight Compute) not on PATH"))]

    report_base = out.parent / "profile"
    env = {**os.environ, CHILD_ENV: "1"}
    proc = subprocess.run(ncu_command(ncu, report_base, child_overrides(overrides, out), cfg.experiment.engines),
                          env=env,
                          capture_output=True, text=True, check=False)
    log = out.parent / "ncu.log"
    write_text_atomic(log, proc.stdout + proc.stderr)
    report = report_base.with_suffix(".ncu-rep")
    if proc.returncode != 0 or not report.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        reason = f"ncu exited with {proc.returncode}: {' | '.join(tail)} (see {log})"
        return [write_json_atomic(out, _record(cfg, settings, skipped=reason))]
    export = subprocess.run([ncu, "--import", str(report), "--csv", "--page", "raw", "--metrics", METRIC_LIST],
                            capture_output=True, text=True, check=True)
    # The raw export stays beside the report, so the counters can be re-derived without ncu.
    write_text_atomic(out.parent / "ncu_raw.csv", export.stdout)
    kernels = parse_ncu_csv(export.stdout, str(report))
    return [write_json_atomic(out, _record(cfg, settings, kernels=kernels, report=report.name))]
