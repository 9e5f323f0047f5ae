"""Table 9: one decode step of a whole model per engine, eager and replayed from CUDA graphs.

The trace, seed and page tables are Table 2's (pkv.experiments.common.load_requests, the harness's
page assignment and continuous batching); every (engine, mode) of a run times the same steps, so
the files of one run share a run_id and their ratios mean something. An (engine, mode) that cannot
run here (no GPU, library missing, no graph path) gets a record "not available: <why>".
"""

from __future__ import annotations

import torch

from pkv.config import ConfigError, PkvConfig
from pkv.config.fields import bounds_problem
from pkv.engines import EngineUnavailable
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
from pkv.measure.model_step import ModelStep, StepShape
from pkv.measure.model_step_paths import (
    MODES,
    AdaptiveGraphPath,
    EagerPath,
    FlashInferGraphPath,
    SkipGraphPath,
    XqaGraphPath,
)
from pkv.measure.model_step_run import ModelStepSpec, run_model_step
from pkv.pipeline.serving import ContinuousDecoder, page_layout
from pkv.report.results import result_envelope

WHERE = "conf/experiment/model_step.yaml (or its override)"
STEP_DTYPES = ("float16", "bfloat16", "float32", "float64")
# Device memory left beside the weights and pools: FlashInfer's and XQA's workspaces (128 MiB each,
# one per graph-captured batch size), the float64 copies of the checks, the L2 flush buffer, the graphs.
RESERVE_BYTES = 8 << 30
WORKSPACE_BYTES = 128 << 20


def _fail(field: str, value, why: str, where: str = WHERE) -> ConfigError:
    return ConfigError(f"{where}: field '{field}' = {value!r}: {why}")


def model_step_shape(cfg: PkvConfig) -> tuple[StepShape, int, str]:
    """(the shape this run times, the model's own layer count, the step's dtype); ConfigError naming
    the field where the model is unknown, out of bounds, or its attention disagrees with model.*."""
    exp = cfg.experiment
    if exp.model not in exp.models:
        raise _fail("experiment.model", exp.model, f"must be one of experiment.models {sorted(exp.models)}")
    preset = exp.models[exp.model]
    found = bounds_problem(preset, f"experiment.models.{exp.model}.")
    if found:
        raise _fail(*found)
    if preset.num_qo_heads % preset.num_kv_heads:
        raise _fail(f"experiment.models.{exp.model}.num_kv_heads", preset.num_kv_heads,
                    f"must divide num_qo_heads = {preset.num_qo_heads}")
    for name in ("num_qo_heads", "num_kv_heads", "head_dim"):
        have, want = getattr(cfg.model, name), getattr(preset, name)
        if have != want:
            raise _fail(f"model.{name}", have, f"experiment.model {exp.model!r} has {name} = {want}; every engine "
                        "runs the model's attention (leave model.* to follow experiment.model)",
                        "conf/config.yaml (or its override)")
    for mode in exp.modes:
        if mode not in MODES:
            raise _fail("experiment.modes", list(exp.modes), f"each mode must be one of {list(MODES)}")
    if not exp.modes or len(set(exp.modes)) != len(exp.modes):
        raise _fail("experiment.modes", list(exp.modes), "needs each mode at most once, at least one")
    if exp.dtype is not None and exp.dtype not in STEP_DTYPES:
        raise _fail("experiment.dtype", exp.dtype, f"must be one of {list(STEP_DTYPES)} or null")
    layers = exp.num_layers if exp.num_layers is not None else preset.num_layers
    if layers > preset.num_layers:
        raise _fail("experiment.num_layers", layers, f"model {exp.model!r} has {preset.num_layers} layers")
    if cfg.profile == "cpu":
        # The CPU profile keeps the attention shape and shrinks the dense widths and the depth.
        shape = StepShape(exp.cpu_hidden, exp.cpu_intermediate, preset.num_qo_heads, preset.num_kv_heads,
                          preset.head_dim, min(layers, exp.cpu_layers))
        return shape, preset.num_layers, cfg.cpu_profile.dtype
    shape = StepShape(preset.hidden, preset.intermediate, preset.num_qo_heads, preset.num_kv_heads,
                      preset.head_dim, layers)
    return shape, preset.num_layers, exp.dtype or cfg.dtype


def layers_that_fit(shape: StepShape, num_pages: int, page_size: int, element_bytes: int, device,
                    graph_batches: int, trace_label: str) -> int:
    """How many of shape's layers (weights plus their own K/V pool) fit the device's free memory."""
    device = torch.device(device)
    if device.type != "cuda":
        return shape.num_layers
    free, _total = torch.cuda.mem_get_info(device)
    per_layer = (shape.weight_elements_per_layer()
                 + num_pages * page_size * shape.kv_elements_per_token()) * element_bytes
    budget = free - RESERVE_BYTES - 2 * graph_batches * WORKSPACE_BYTES
    fits = int(max(budget, 0) // per_layer)
    if fits < 1:
        raise _fail("trace.num_requests", trace_label,
                    f"one layer (weights and a {num_pages}-page K/V pool) takes {per_layer / 2**30:.1f} GiB; "
                    f"{free / 2**30:.1f} GiB are free", "conf/trace (selected option)")
    return min(shape.num_layers, fits)


def _graph_path(label: str, role_engine, model, max_pages: int, max_batch: int, role: str):
    if role == "flashinfer":
        return FlashInferGraphPath(label, model, max_pages, role_engine)
    if role == "xqa":
        return XqaGraphPath(label, model, max_pages, role_engine)
    if role == "adaptive":
        fallback = FlashInferGraphPath(label, model, max_pages, role_engine.fallback)
        return AdaptiveGraphPath(label, model, max_pages, role_engine, fallback, max_batch)
    raise EngineUnavailable(f"no CUDA-graph path for engine {role!r} in the model step")


def _paths(cfg, engines: dict, skipped: dict, model, max_pages: int) -> tuple[dict, dict]:
    paths, reasons = {}, {}
    for role in cfg.experiment.engines:
        for mode in cfg.experiment.modes:
            label = f"{role}_{mode}"
            if role in skipped:
                reasons[label] = f"not available: {skipped[role]}"
            elif mode == "eager":
                paths[label] = EagerPath(label, engines[role], model)
            else:
                try:
                    paths[label] = _graph_path(label, engines[role], model, max_pages, cfg.trace.max_active, role)
                except EngineUnavailable as exc:
                    reasons[label] = f"not available: {exc.reason}"
    return paths, reasons


def run(cfg: PkvConfig) -> list:
    """Time cfg's trace with every engine and mode of the experiment; write out/<engine>_<mode>.json."""
    exp, trace = cfg.experiment, cfg.trace
    shape, layers_model, dtype = model_step_shape(cfg)
    settings = resolve_settings(cfg)
    if exp.clock_probe_cycles and torch.device(settings.device).type != "cuda":
        raise _fail("experiment.clock_probe_cycles", exp.clock_probe_cycles,
                    f"a spin of GPU clock cycles needs a CUDA device; this run's is {settings.device!r}")
    calib = run_calibration(cfg)
    requests = load_requests(trace, cfg.seed, settings)
    attention = model_shape(cfg)
    engines, skipped = build_engines(exp.engines, cfg, attention, settings.device, calib)
    # Table 2's page tables: the harness's layout of the same requests and seed.
    pool_pages = kv_pool_pages(trace, settings, requests)
    assignment = page_layout(requests, layout=trace.page_layout, page_size=trace.page_size,
                             hole_fraction=trace.hole_fraction, seed=cfg.seed, max_active=trace.max_active,
                             max_steps=settings.warmup_steps + settings.measured_steps, pool_pages=pool_pages,
                             page_order=trace.page_order)
    max_pages = max(-(-r.total_len // trace.page_size) for r in requests)
    element_bytes = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    layers = layers_that_fit(shape, assignment.num_physical_pages, trace.page_size, element_bytes,
                             settings.device, trace.max_active, trace_name(trace))
    metrics, reasons = {}, {}
    baseline = f"{exp.baseline}_{exp.modes[0]}"
    if exp.baseline in skipped:
        reasons = {f"{r}_{m}": f"not available: baseline {exp.baseline} unavailable: {skipped[exp.baseline]}"
                   for r in exp.engines for m in exp.modes}
    else:
        model = ModelStep(shape, layers=layers, num_pages=assignment.num_physical_pages, page_size=trace.page_size,
                          dtype=dtype, device=settings.device, seed=cfg.seed,
                          clock_probe_cycles=exp.clock_probe_cycles)
        paths, reasons = _paths(cfg, engines, skipped, model, max_pages)
        if baseline not in paths:
            raise ConfigError(f"{WHERE}: field 'experiment.baseline' = {exp.baseline!r}: its {exp.modes[0]} path "
                              f"cannot run here ({reasons.get(baseline)})")
        rests = {"eager": EagerPath("rest_eager", None, model)}
        if any(p.mode == "graph" for p in paths.values()):
            rests["graph"] = SkipGraphPath("rest_graph", model, max_pages)
        decoder = ContinuousDecoder(requests, assignment, trace.max_active,
                                    max_steps=settings.warmup_steps + settings.measured_steps)
        spec = ModelStepSpec(name=trace_name(trace), seed=cfg.seed, warmup_steps=settings.warmup_steps,
                             measured_steps=settings.measured_steps, check_every=settings.check_every,
                             beta_gbps=float(calib.beta_gbps), baseline=baseline, flush_l2=exp.flush_l2,
                             kernel_profile_steps=exp.kernel_profile_steps, kernel_profiler=exp.kernel_profiler)
        metrics = run_model_step(spec, model, decoder, paths, rests, layers_model=layers_model,
                                 progress=cfg.progress)
        for label, path in paths.items():
            if isinstance(path, FlashInferGraphPath):
                metrics[label]["flashinfer_graph_paths"] = path.path_labels()
            elif isinstance(path, AdaptiveGraphPath):
                metrics[label]["flashinfer_graph_paths"] = path.flashinfer_path.path_labels()
            elif isinstance(path, EagerPath):
                # The FlashInfer path each batch class ran eagerly (the probe's pick, shared by the
                # engines of the process): it may be the holistic kernel, which no graph runs.
                path_record = path.engine.path_record()
                if path_record is not None:
                    metrics[label]["flashinfer_paths"] = path_record

    model_record = {"name": exp.model, "hidden": shape.hidden, "intermediate": shape.intermediate,
                    "num_qo_heads": shape.num_qo_heads, "num_kv_heads": shape.num_kv_heads,
                    "head_dim": shape.head_dim, "layers_model": layers_model, "layers_run": layers, "dtype": dtype,
                    "beta_gbps": float(calib.beta_gbps)}
    run_id = new_run_id()
    prov = provenance_for(cfg, settings, cfg.seed)
    record_trace = trace_record(trace, cfg.seed, settings, len(requests), pool_pages)
    files = {}
    for role in exp.engines:
        for mode in exp.modes:
            label = f"{role}_{mode}"
            if label in metrics:
                body = {"metrics": {**metrics[label], "role": role, "model": model_record}}
            elif label in reasons:
                body = {"skipped": reasons[label]}
            else:
                raise RuntimeError(f"pkv.measure.model_step_run returned no metrics for {label!r}")
            files[engine_file(cfg.out, label)] = result_envelope(
                exp.name, record_trace, label, baseline_engine=f"{exp.baseline}_{mode}", run_id=run_id,
                performance_result=settings.performance_result, variant=cfg.variant, provenance=prov, **body)
    return write_all_or_nothing(files)
