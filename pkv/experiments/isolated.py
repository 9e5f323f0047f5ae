"""Table 1: one isolated B1 decode call per method at one context length, 50% page holes.

FlashInfer is reported as the faster of its tensor-core and CUDA-core paths, PersistentKV as the
fastest split count of a fixed candidate set ("auto split"); all candidates of a method are timed
in the same isolated_batch call, on the same pages as every other method.
"""

from __future__ import annotations

from pathlib import Path

from pkv.atomic_io import write_json_atomic
from pkv.config import ConfigError, PkvConfig
from pkv.engines import EngineUnavailable, build_engine
from pkv.engines.flashinfer import BEST_OF_ROLES
from pkv.experiments.common import (
    model_shape,
    new_run_id,
    provenance_for,
    resolve_settings,
    run_calibration,
    trace_record,
)
from pkv.measure.isolated import isolated_batch
from pkv.policy.choose import PinnedRoutePolicy, pinned_route
from pkv.report.results import RESULT_SCHEMA

# Several engines can play one method (FlashInfer: each of its paths, BEST_OF_ROLES; fa3 is timed
# by the kernel benchmark only); the fastest one that runs is the method's number.


def _candidates(method: str, cfg: PkvConfig, shape, device, calib) -> tuple[dict, dict]:
    """({candidate label: engine}, {candidate label: why it cannot run}) of one method."""
    if method == "persistentkv":
        # The run's schedule at each candidate split count: the method's "auto split".
        wanted = {f"persistentkv_s{s}": ("persistentkv", PinnedRoutePolicy(
                      pinned_route(cfg.engine.route, calib.with_all_regimes(num_splits=s))))
                  for s in cfg.experiment.split_candidates}
    elif method == "flashinfer":
        wanted = {label: (label, None) for label in BEST_OF_ROLES}
    else:
        wanted = {method: (method, None)}
    engines, skipped = {}, {}
    for label, (role, policy) in wanted.items():
        try:
            engines[label] = build_engine(role, shape=shape, device=device, policy=policy)
        except EngineUnavailable as exc:
            skipped[label] = exc.reason
        except ValueError as exc:  # a method no engine runs, misspelt in experiment.methods
            raise ConfigError(f"conf/experiment: experiment.methods = {method!r}: {exc}") from None
    if method == "flashinfer" and not engines:
        # The CPU profile's FlashInfer role has no tensor-core/CUDA-core paths, only the stand-in.
        engines["flashinfer"] = build_engine("flashinfer", shape=shape, device=device)
    return engines, skipped


def _best(method: str, results: dict, skipped: dict) -> dict:
    timed = {label: r for label, r in results.items() if "median_us" in r}
    if not timed:
        reasons = {**skipped, **{label: r.get("skipped") for label, r in results.items()}}
        if list(reasons) == [method]:  # the method's one engine: its reason names it already
            return {"skipped": str(reasons[method])}
        return {"skipped": "; ".join(f"{label}: {why}" for label, why in reasons.items()) or "no engine"}
    label = min(timed, key=lambda k: timed[k]["median_us"])
    entry = {**timed[label], "selected": label,
             "candidates_median_us": {k: r["median_us"] for k, r in timed.items()}}
    if method == "persistentkv":
        entry["num_splits"] = int(label.rsplit("_s", 1)[1])
    return entry


def run(cfg: PkvConfig) -> list[Path]:
    exp, trace = cfg.experiment, cfg.trace
    settings = resolve_settings(cfg)
    shape = model_shape(cfg)
    calib = run_calibration(cfg)
    # The CPU profile shrinks the context like every trace, so the table keeps its shape.
    context_len = max(1, round(exp.context_len * settings.length_scale / trace.length_scale))
    per_method, engines, skipped = {}, {}, {}
    for method in exp.methods:
        built, why = _candidates(method, cfg, shape, settings.device, calib)
        per_method[method] = (list(built), why)
        engines.update(built)
        skipped.update(why)
    results = isolated_batch(
        [context_len], shape, engines, page_size=trace.page_size, hole_fraction=trace.hole_fraction,
        dtype=settings.dtype, device=settings.device, seed=cfg.seed, reps=settings.reps,
        flush_l2=exp.flush_l2, read_gbps=calib.beta_gbps,
    ) if engines else {}
    methods = {}
    for method, (labels, why) in per_method.items():
        methods[method] = _best(method, {label: results[label] for label in labels}, why)
    record = {
        "schema": RESULT_SCHEMA, "experiment": exp.name, "variant": None,
        # One request on pages of its own: the up-front layout, whatever the trace config says.
        "trace": {**trace_record(trace, cfg.seed, settings, 1), "name": f"ctx{exp.context_len}",
                  "page_layout": "up_front"},
        "engine": "all", "baseline_engine": None, "run_id": new_run_id(),
        "performance_result": settings.performance_result,
        # The result envelope holds exactly one of metrics / skipped; per-method skips sit inside.
        "metrics": {"methods": methods, "context_len": exp.context_len,
                    "measured_context_len": context_len, "read_gbps": calib.beta_gbps},
        "provenance": provenance_for(cfg, settings, cfg.seed),
    }
    return [write_json_atomic(cfg.out, record)]
