"""What every experiment driver shares: the effective run settings, traces, engines, result files.

A driver turns one validated `PkvConfig` into result files. The CPU profile is applied here, in
one place, so every driver shrinks the same way and marks its results `performance_result=false`.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pkv.atomic_io import write_json_files_atomic
from pkv.config import (
    DEFAULT_MAX_CONTEXT_TOKENS,
    EXTERNAL_FAMILY,
    MAX_KV_POOL_BYTES,
    ConfigError,
    EngineConfig,
    PkvConfig,
    TraceConfig,
    check_calibration_bounds,
)
from pkv.engines import OPTION_NAMES, EngineUnavailable, build_engine, role_policy
from pkv.pipeline.pages import universe_size
from pkv.pipeline.serving import page_layout
from pkv.pipeline.trace_readers import read_trace
from pkv.pipeline.traces import synthetic_trace
from pkv.policy.calibration import Calibration, load_calibration_record, recorded_profile
from pkv.policy.overrides import apply_engine_options
from pkv.policy.regime import REGIMES, CalibrationError
from pkv.provenance import collect_provenance
from pkv.shape import ModelShape

# Engine labels that are one engine role with fixed options: a run can time several schedules of
# PersistentKV side by side, each written to its own <label>.json.
ENGINE_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "persistentkv_exact": ("persistentkv", {"route": "bucket_exact"}),
    "persistentkv_masked": ("persistentkv", {"route": "bucket_masked"}),
    "persistentkv_workqueue": ("persistentkv", {"route": "workqueue"}),
    "persistentkv_workqueue_fused": ("persistentkv", {"route": "workqueue", "merge": "fused"}),
    "persistentkv_workqueue_graph": ("persistentkv", {"route": "workqueue", "cuda_graph": True}),
}

# EngineConfig fields that say what PersistentKV runs: the run's calibration takes the first five
# (pkv.policy.overrides), the policy of each engine the last two.
_CALIBRATION_OPTIONS = ("num_splits", "bucket_num_splits", "bucket_tiles_per_split", "split_kind", "open_few_rows")
_ROUTE_OPTIONS = ("route", "merge")


@dataclass(frozen=True)
class RunSettings:
    """The effective size, precision and device of a run after the profile is applied."""

    profile: str
    device: str
    dtype: str
    length_scale: float
    num_requests: int
    warmup_steps: int
    measured_steps: int
    check_every: int
    reps: int
    probe_buffer_mib: int
    launch_probe_reps: int
    performance_result: bool
    kv_bytes_per_token: int  # K and V of one token over all KV heads, in the run's dtype


_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def _kv_bytes_per_token(cfg: PkvConfig, dtype: str) -> int:
    return 2 * cfg.model.num_kv_heads * cfg.model.head_dim * _DTYPE_BYTES[dtype]


def resolve_settings(cfg: PkvConfig) -> RunSettings:
    """Apply profile=cpu (shrink, float32, CPU) or check that profile=gpu really has a GPU."""
    exp, trace = cfg.experiment, cfg.trace
    if cfg.profile == "cpu":
        cp = cfg.cpu_profile
        return RunSettings(
            kv_bytes_per_token=_kv_bytes_per_token(cfg, cp.dtype),
            profile="cpu", device="cpu", dtype=cp.dtype,
            length_scale=trace.length_scale * cp.length_scale,
            num_requests=min(trace.num_requests, cp.max_requests),
            warmup_steps=min(exp.warmup_steps, cp.warmup_steps),
            measured_steps=min(exp.measured_steps, cp.measured_steps),
            check_every=min(exp.check_every, cp.check_every),
            reps=min(exp.reps, cp.reps),
            probe_buffer_mib=min(exp.probe_buffer_mib, cp.probe_buffer_mib),
            launch_probe_reps=min(exp.launch_probe_reps, cp.launch_probe_reps),
            performance_result=False,
        )
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"conf/config.yaml (or its override): field 'profile' = {cfg.profile!r}: device=cuda but "
                "torch sees no CUDA GPU; run with profile=cpu on this machine")
    return RunSettings(
        kv_bytes_per_token=_kv_bytes_per_token(cfg, cfg.dtype),
        profile=cfg.profile, device=cfg.device, dtype=cfg.dtype, length_scale=trace.length_scale,
        num_requests=trace.num_requests, warmup_steps=exp.warmup_steps,
        measured_steps=exp.measured_steps, check_every=exp.check_every, reps=exp.reps,
        probe_buffer_mib=exp.probe_buffer_mib, launch_probe_reps=exp.launch_probe_reps,
        # A GPU-profile run on the CPU device is a functional check, not a measurement.
        performance_result=cfg.device == "cuda",
    )


def model_shape(cfg: PkvConfig):
    m = cfg.model
    return ModelShape(num_qo_heads=m.num_qo_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim)


def trace_name(trace: TraceConfig) -> str:
    return trace.name or f"{trace.family}_b{trace.max_active}"


def load_requests(trace: TraceConfig, seed: int, settings: RunSettings) -> list:
    """The trace's requests: a seeded synthetic family or the first num_requests of a file.

    No request may be longer than trace.max_context, or DEFAULT_MAX_CONTEXT_TOKENS when that is
    null: a file's longer request is refused naming its line (or truncated or dropped, as
    trace.overlong says), a synthetic family's naming trace.length_scale. The K and V pages of
    all of them must fit MAX_KV_POOL_BYTES.
    """
    limit = trace.max_context or DEFAULT_MAX_CONTEXT_TOKENS
    if trace.family == EXTERNAL_FAMILY:
        # The default limit refuses what it would otherwise cut; a limit the user set truncates by default.
        overlong = trace.overlong or ("truncate" if trace.max_context else "error")
        options: dict[str, Any] = {"length_scale": settings.length_scale, "max_context": limit, "overlong": overlong}
        if trace.step_ms is not None:
            options["step_ms"] = trace.step_ms
        requests = read_trace(trace.path, **options)[: settings.num_requests]
        if not requests:
            raise ConfigError(f"conf/trace/external.yaml: field 'trace.path' = {trace.path!r}: no requests")
    else:
        options = {"length_scale": settings.length_scale, "decode_len_range": tuple(trace.decode_len_range)}
        for key in ("arrivals", "arrival_rate"):
            if getattr(trace, key) is not None:
                options[key] = getattr(trace, key)
        requests = synthetic_trace(trace.family, settings.num_requests, seed, **options)
        longest = max(requests, key=lambda r: r.total_len)
        if longest.total_len > limit:
            raise ConfigError(
                f"conf/trace/{trace.family}.yaml: field 'trace.length_scale' = {trace.length_scale!r}: request "
                f"{longest.request_id} needs {longest.total_len} tokens, more than the maximum context {limit} "
                f"(trace.max_context, null = {DEFAULT_MAX_CONTEXT_TOKENS})")
    _check_kv_pool(trace, settings, requests)
    return requests


def _check_kv_pool(trace: TraceConfig, settings: RunSettings, requests: list) -> None:
    """Refuse a run whose K and V pages would not fit one H200 (MAX_KV_POOL_BYTES), before allocating.

    An up-front layout holds every request's pages at once; a recycled pool holds what
    kv_pool_pages gives it, which a named size must keep under the same bound and above the
    longest request."""
    if trace.page_layout == "recycled":
        longest = max(requests, key=lambda r: r.total_len)
        if trace.kv_pool_tokens is not None:
            where = f"conf/trace/{trace.family}.yaml: field 'trace.kv_pool_tokens' = {trace.kv_pool_tokens!r}"
            if trace.kv_pool_tokens * settings.kv_bytes_per_token > MAX_KV_POOL_BYTES:
                raise ConfigError(f"{where}: its K and V pages take "
                                  f"{trace.kv_pool_tokens * settings.kv_bytes_per_token / 2**30:.1f} GiB, more than "
                                  f"the {MAX_KV_POOL_BYTES >> 30} GiB one H200 holds for them")
            if -(-longest.total_len // trace.page_size) * trace.page_size > trace.kv_pool_tokens:
                raise ConfigError(f"{where}: request {longest.request_id} needs {longest.total_len} tokens, more "
                                  "than the whole pool holds, so it could never be admitted")
        return
    pages = sum(-(-r.total_len // trace.page_size) for r in requests)
    pool = universe_size(pages, trace.hole_fraction) * trace.page_size * settings.kv_bytes_per_token
    if pool > MAX_KV_POOL_BYTES:
        raise ConfigError(
            f"conf/trace/{trace.family}.yaml: field 'trace.num_requests' = {trace.num_requests!r}: the K and V pages "
            f"of {len(requests)} requests ({pages} pages of {trace.page_size} tokens, hole_fraction "
            f"{trace.hole_fraction}) take {pool / 2**30:.1f} GiB, more than the {MAX_KV_POOL_BYTES >> 30} GiB one "
            "H200 holds for them; use fewer or shorter requests")


def kv_pool_pages(trace: TraceConfig, settings: RunSettings, requests: list) -> int | None:
    """Pages of the run's recycled KV pool (None for the up-front layout, which sizes itself).

    trace.kv_pool_tokens when it is set; else the pages the run's warmup and measured steps
    reserve at their peak over 1 - hole_fraction, at most what the device holds for them: the
    smaller of MAX_KV_POOL_BYTES and half the GPU's memory (the other half is the queries, the
    split scratch, the baselines' workspaces and the float64 checks). A pool that the cap shrinks
    makes requests wait for pages, as a serving engine's scheduler does; the longest request
    always fits."""
    if trace.page_layout != "recycled":
        return None
    if trace.kv_pool_tokens is not None:
        return trace.kv_pool_tokens // trace.page_size
    budget = MAX_KV_POOL_BYTES
    if settings.device == "cuda" and torch.cuda.is_available():
        budget = min(budget, torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory // 2)
    # The size alone: the seed only orders the free list.
    pool = page_layout(requests, layout="recycled", page_size=trace.page_size, hole_fraction=trace.hole_fraction,
                       seed=0, max_active=trace.max_active, max_steps=settings.warmup_steps + settings.measured_steps,
                       max_pool_pages=budget // (trace.page_size * settings.kv_bytes_per_token))
    return pool.num_physical_pages


def trace_record(trace: TraceConfig, seed: int, settings: RunSettings, num_requests: int,
                 pool_pages: int | None = None) -> dict:
    """The `trace` block of a result envelope; ``pool_pages`` is the recycled pool's size."""
    record = {
        "name": trace_name(trace), "family": trace.family, "seed": seed,
        "num_requests": num_requests, "max_active": trace.max_active,
        "measured_steps": settings.measured_steps, "page_size": trace.page_size,
        "hole_fraction": trace.hole_fraction, "length_scale": settings.length_scale,
        "page_layout": trace.page_layout, "page_order": trace.page_order,
    }
    if pool_pages is not None:
        record["kv_pool_pages"] = int(pool_pages)
    if trace.path is not None:
        record["path"] = trace.path
    return record


def engine_role_and_options(label: str, engine: EngineConfig) -> tuple[str, dict[str, Any]]:
    """(role for build_engine, the EngineConfig fields that apply to it); the label's own win."""
    role, fixed = ENGINE_VARIANTS.get(label, (label, {}))
    options = {k: getattr(engine, k) for k in (*_ROUTE_OPTIONS, *OPTION_NAMES) if hasattr(engine, k)}
    options.update(fixed)
    return role, {k: v for k, v in options.items() if v is not None}


# conf/gpu/cpu.yaml's gpu: the CPU profile's own constants, its gates written in the profile's tokens.
CPU_STAND_IN = "cpu"


def scaled_gates(calib: Calibration, length_scale: float) -> Calibration:
    """The calibration with every regime's context gate scaled by ``length_scale`` (at least 1 token)."""
    for regime in REGIMES:
        gate = calib.regime(regime).min_context_tokens
        calib = calib.with_regime(regime, min_context_tokens=max(1, round(gate * length_scale)))
    return calib


def gates_for_profile(calib: Calibration, cfg: PkvConfig, in_profile_tokens: bool = False) -> Calibration:
    """The calibration as the run's profile reads it. The CPU profile scales every trace's lengths
    (cpu_profile.length_scale), so a GPU's gates, in that GPU's tokens, are scaled the same way and
    each scaled step falls on the side of a gate that its full length would (README, "A new GPU").
    conf/gpu/cpu.yaml and a calibration the CPU profile wrote (``in_profile_tokens``) are in the
    profile's tokens already."""
    if cfg.profile != "cpu" or calib.gpu == CPU_STAND_IN or in_profile_tokens:
        return calib
    return scaled_gates(calib, cfg.cpu_profile.length_scale)


def run_calibration(cfg: PkvConfig):
    """The calibration every engine of this run decides with: the frozen calibration JSON when
    given (else the starting constants of conf/gpu/<gpu>.yaml), its gates as the run's profile
    reads them (gates_for_profile), with the run's engine options (an ablation's split count or
    opened regime) applied once, here. A calibration file that is missing, a folder, not JSON or
    out of bounds is a ConfigError naming it."""
    if cfg.calibration:
        path = cfg.calibration
        try:
            calib, record = load_calibration_record(path)
        except (CalibrationError, OSError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).removeprefix(f"{path}: ")
            raise ConfigError(f"{path}: field 'calibration' = {path!r}: {why}") from None
        check_calibration_bounds(calib, path, prefix="calibration.")
        # A calibration the CPU profile wrote has its gates in that profile's tokens already.
        calib = gates_for_profile(calib, cfg, in_profile_tokens=recorded_profile(record) == "cpu")
    else:
        calib = gates_for_profile(Calibration.from_mapping(dict(cfg.gpu), "conf/gpu (selected option)"), cfg)
    return apply_engine_options(calib, **{k: getattr(cfg.engine, k) for k in _CALIBRATION_OPTIONS})


def build_engines(labels: Iterable[str], cfg: PkvConfig, shape, device: str, calib) -> tuple[dict, dict]:
    """({label: Engine}, {label: reason}) for the labels that could and could not be built, each
    with the policy of its role over the run's calibration."""
    engines, skipped = {}, {}
    discard = cfg.engine.discard_merged_states
    cuda = torch.device(device).type == "cuda"
    if discard and not cuda:
        raise ConfigError(f"conf/engine: field 'engine.discard_merged_states' = True: the merge kernels "
                          f"run on a CUDA device; this run's is {device!r}")
    if cfg.engine.one_op_step and not cuda:
        raise ConfigError(f"conf/engine: field 'engine.one_op_step' = True: the adaptive engine's one-op step "
                          f"launches on a CUDA device; this run's is {device!r}")
    if discard is None and cuda:
        # On by default: the dead states' write-back otherwise lands on the kernel after the merge
        # (docs/performance.md, "The discard switch, measured").
        discard = True
    if discard:
        # A setting of the process's merge launches, not of one engine: set once, before any capture.
        from pkv import ops

        ops.discard_merged_states(True)
    for label in labels:
        role, options = engine_role_and_options(label, cfg.engine)
        try:
            policy = role_policy(role, options, shape, calib)
            engines[label] = build_engine(role, shape=shape, device=device, policy=policy,
                                          options={k: v for k, v in options.items() if k in OPTION_NAMES})
        except EngineUnavailable as exc:
            skipped[label] = exc.reason
        except ValueError as exc:
            # A route this run cannot take (say the cluster merge on the workqueue) is the config's error.
            raise ConfigError(f"conf/engine: engine {label!r} with options {options}: {exc}") from None
    return engines, skipped


def new_run_id() -> str:
    return uuid.uuid4().hex


def provenance_for(cfg: PkvConfig, settings: RunSettings, seed: int) -> dict:
    return collect_provenance({**dataclasses.asdict(cfg), "effective": dataclasses.asdict(settings)}, seed)


def write_all_or_nothing(files: Mapping[str | os.PathLike, Any]) -> list[Path]:
    """Write every JSON of a run as one set: all replaced, or none (pkv.atomic_io.write_json_files_atomic).

    A run that times several engines produces one file per engine; a reader (and Snakemake) must
    never find some engines of a run without the others, nor one engine of an older run beside a
    newer one: a failed write leaves the previous run's files as they were.
    """
    return write_json_files_atomic(files)


def engine_file(out_dir: str | os.PathLike, label: str) -> Path:
    return Path(out_dir) / f"{label}.json"
