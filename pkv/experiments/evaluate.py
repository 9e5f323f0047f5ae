"""Trace runs (Tables 2, 3, 4): every engine of the experiment on one trace and seed, side by side.

All engines of a run see the same requests, page tables and K,V tensors (pkv.measure.harness builds them
once), so their files share one run_id and their ratios mean something. Engines that cannot be
built here (library missing, no GPU) get a "skipped" record with the reason; if the baseline is
one of them, nothing can be compared and every engine of the run is recorded as skipped.
"""

from __future__ import annotations

from pathlib import Path

from pkv.config import PkvConfig
from pkv.experiments.common import (
    build_engines,
    engine_file,
    kv_pool_pages,
    load_requests,
    model_shape,
    new_run_id,
    provenance_for,
    resolve_settings,
    run_calibration,
    trace_name,
    trace_record,
    write_all_or_nothing,
)
from pkv.measure.harness import TraceRunSpec, run_trace
from pkv.report.results import result_envelope


def run_trace_experiment(cfg: PkvConfig) -> list[Path]:
    """Run cfg's trace with every engine of cfg.experiment and write out/<engine>.json for each."""
    exp, trace = cfg.experiment, cfg.trace
    settings = resolve_settings(cfg)
    shape = model_shape(cfg)
    calib = run_calibration(cfg)
    requests = load_requests(trace, cfg.seed, settings)
    engines, skipped = build_engines(exp.engines, cfg, shape, settings.device, calib)
    if exp.baseline in skipped:
        reason = f"baseline {exp.baseline} unavailable: {skipped[exp.baseline]}"
        skipped = {label: skipped.get(label, reason) for label in exp.engines}
        engines = {}

    pool_pages = kv_pool_pages(trace, settings, requests)
    metrics = {}
    if engines:
        spec = TraceRunSpec(
            name=trace_name(trace), family=trace.family, seed=cfg.seed, requests=tuple(requests),
            page_size=trace.page_size, hole_fraction=trace.hole_fraction, max_active=trace.max_active,
            page_layout=trace.page_layout, page_order=trace.page_order, kv_pool_pages=pool_pages,
            warmup_steps=settings.warmup_steps, measured_steps=settings.measured_steps,
            dtype=settings.dtype, device=settings.device, check_every=settings.check_every,
            mlp_tail=exp.mlp_tail, flush_l2=exp.flush_l2,
        )
        metrics = run_trace(spec, shape, engines, baseline=exp.baseline, progress=cfg.progress)

    run_id = new_run_id()
    prov = provenance_for(cfg, settings, cfg.seed)
    record_trace = trace_record(trace, cfg.seed, settings, len(requests), pool_pages)
    files = {}
    for label in exp.engines:
        if label in metrics:
            body = {"metrics": metrics[label]}
        elif label in skipped:
            body = {"skipped": skipped[label]}
        else:
            raise RuntimeError(f"pkv.measure.harness.run_trace returned no metrics for engine {label!r}")
        files[engine_file(cfg.out, label)] = result_envelope(
            exp.name, record_trace, label, baseline_engine=exp.baseline, run_id=run_id,
            performance_result=settings.performance_result, variant=cfg.variant, provenance=prov, **body,
        )
    return write_all_or_nothing(files)


run = run_trace_experiment
