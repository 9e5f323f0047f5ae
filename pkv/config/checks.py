"""What a type cannot say, checked after composing: every error names the YAML file, the field
and the value."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from pkv.config.schema import (
    DEVICES, DRIVERS, DTYPES, EXTERNAL_FAMILY, PLANNERS, PROFILES, ConfigError, EngineConfig, ExperimentConfig,
    PkvConfig, TraceConfig,
)
from pkv.pipeline.schedule import SPLIT_KINDS
from pkv.pipeline.traces import TRACE_FAMILIES
from pkv.policy.calibration import Calibration
from pkv.policy.route import MERGE_KINDS, SCHEDULES

# ---------------------------------------------------------------------------------------------
# validation


def _source(group: str, choices: Mapping[str, Any]) -> str:
    choice = choices.get(group)
    if choice:
        return f"conf/{group}/{choice}.yaml (or its override)"
    return "conf/config.yaml (or its override)"


def _fail(where: str, key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{where}: field '{key}' = {value!r}: {why}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_trace(trace: TraceConfig, where: str, families: Sequence[str]) -> None:
    def bad(name: str, why: str) -> ConfigError:
        return _fail(where, f"trace.{name}", getattr(trace, name), why)

    if trace.family != EXTERNAL_FAMILY and trace.family not in families:
        raise bad("family", f"must be one of {sorted(families) + [EXTERNAL_FAMILY]}")
    if trace.name is not None and (not trace.name or "/" in trace.name):
        raise bad("name", "must be a non-empty name without '/'")
    if trace.num_requests < 1:
        raise bad("num_requests", "must be >= 1")
    if trace.max_active < 1:
        raise bad("max_active", "must be >= 1")
    if not trace.length_scale > 0:
        raise bad("length_scale", "must be > 0")
    lo_hi = list(trace.decode_len_range)
    if len(lo_hi) != 2 or not 1 <= lo_hi[0] <= lo_hi[1]:
        raise bad("decode_len_range", "must be [lo, hi] with 1 <= lo <= hi")
    # Pages and 32-token tiles must nest in one another; powers of two guarantee it.
    if trace.page_size < 1 or trace.page_size & (trace.page_size - 1):
        raise bad("page_size", "must be a positive power of two")
    if not 0.0 <= trace.hole_fraction < 1.0:
        raise bad("hole_fraction", "must be in [0, 1)")
    if trace.arrival_rate is not None and not trace.arrival_rate > 0:
        raise bad("arrival_rate", "must be > 0 when given")
    if trace.family == EXTERNAL_FAMILY:
        if not trace.path:
            raise bad("path", "an external trace needs trace.path=<CSV/JSON/JSONL file>")
        if not Path(trace.path).is_file():
            raise bad("path", "no such file")
        if trace.max_context is not None and trace.max_context < 1:
            raise bad("max_context", "must be >= 1 when given")
        if trace.step_ms is not None and not trace.step_ms > 0:
            raise bad("step_ms", "must be > 0 when given")
    elif trace.path is not None:
        raise bad("path", f"only an external trace reads a file (trace.family = {trace.family!r})")


def _check_engine(engine: EngineConfig, where: str) -> None:
    if engine.route not in SCHEDULES:
        raise _fail(where, "engine.route", engine.route, f"must be one of {list(SCHEDULES)}")
    if engine.merge not in MERGE_KINDS:
        raise _fail(where, "engine.merge", engine.merge, f"must be one of {list(MERGE_KINDS)}")
    if engine.split_kind is not None and engine.split_kind not in SPLIT_KINDS:
        raise _fail(where, "engine.split_kind", engine.split_kind, f"must be one of {list(SPLIT_KINDS)} or null")
    if engine.planner not in PLANNERS:
        raise _fail(where, "engine.planner", engine.planner, f"must be one of {list(PLANNERS)}")
    for name in ("num_splits", "bucket_num_splits"):
        value = getattr(engine, name)
        if value is not None and value < 1:
            raise _fail(where, f"engine.{name}", value, "must be >= 1 (or null for the policy's choice)")


def _check_experiment(exp: ExperimentConfig, where: str) -> None:
    def bad(name: str, why: str) -> ConfigError:
        return _fail(where, f"experiment.{name}", getattr(exp, name), why)

    if exp.driver not in DRIVERS:
        raise bad("driver", f"must be one of {list(DRIVERS)}")
    if exp.driver in ("evaluate", "ablate", "profile"):
        if not exp.engines:
            raise bad("engines", "needs at least one engine")
        if len(set(exp.engines)) != len(exp.engines):
            raise bad("engines", "lists an engine twice")
        if exp.baseline not in exp.engines:
            raise bad("baseline", f"must be one of experiment.engines {list(exp.engines)}")
    if exp.warmup_steps < 0:
        raise bad("warmup_steps", "must be >= 0")
    if exp.measured_steps < 1:
        raise bad("measured_steps", "must be >= 1")
    if exp.check_every < 1:
        raise bad("check_every", "must be >= 1")
    if exp.reps < 1:
        raise bad("reps", "must be >= 1")
    if any(s < 1 for s in exp.split_candidates):
        raise bad("split_candidates", "split counts must be >= 1")
    if exp.driver == "isolated":
        if exp.context_len is None or exp.context_len < 1:
            raise bad("context_len", "the isolated experiment needs experiment.context_len >= 1")
        if not exp.split_candidates:
            raise bad("split_candidates", "auto split needs at least one candidate")
    if exp.driver == "calibrate":
        if exp.probe_buffer_mib < 1:
            raise bad("probe_buffer_mib", "must be >= 1")
        if exp.launch_probe_reps < 1:
            raise bad("launch_probe_reps", "must be >= 1")
        for i, ct in enumerate(exp.calibration_traces):
            if (ct.max_active < 1 or ct.route not in ("bucket_exact", "workqueue") or not ct.split_candidates
                    or any(s < 1 for s in ct.split_candidates)):
                raise _fail(where, f"experiment.calibration_traces[{i}]", dataclasses.asdict(ct),
                            "needs max_active >= 1, route bucket_exact or workqueue, split_candidates >= 1")
        if not (math.isfinite(exp.gate_tolerance) and 0 <= exp.gate_tolerance < 1):
            raise bad("gate_tolerance", "must be a fraction in [0, 1)")
        for i, probe in enumerate(exp.gate_probes):
            if (probe.max_active < 1 or not probe.length_scale > 0 or not math.isfinite(probe.length_scale)
                    or (probe.group_size is not None and probe.group_size < 1)
                    or (probe.num_requests is not None and probe.num_requests < 1)):
                raise _fail(where, f"experiment.gate_probes[{i}]", dataclasses.asdict(probe),
                            "needs max_active >= 1, a finite length_scale > 0, group_size and "
                            "num_requests null or >= 1")
    for name, key in exp.variant_keys.items():
        if not key or "=" in name:
            raise _fail(where, f"experiment.variant_keys.{name}", key, "must map a name to a config key")


def _check_top(cfg: PkvConfig) -> None:
    where = "conf/config.yaml (or its override)"
    if cfg.profile not in PROFILES:
        raise _fail(where, "profile", cfg.profile, f"must be one of {list(PROFILES)}")
    if cfg.dtype not in DTYPES:
        raise _fail(where, "dtype", cfg.dtype, f"must be one of {list(DTYPES)}")
    if cfg.cpu_profile.dtype not in DTYPES:
        raise _fail(where, "cpu_profile.dtype", cfg.cpu_profile.dtype, f"must be one of {list(DTYPES)}")
    if cfg.device not in DEVICES:
        raise _fail(where, "device", cfg.device, f"must be one of {list(DEVICES)}")
    if not _is_int(cfg.seed) or cfg.seed < 0:
        raise _fail(where, "seed", cfg.seed, "must be a non-negative int")
    if not cfg.out:
        raise _fail(where, "out", cfg.out, "needs an output path (out=...)")
    m = cfg.model
    if min(m.num_qo_heads, m.num_kv_heads, m.head_dim) < 1 or m.num_qo_heads % m.num_kv_heads:
        raise _fail(where, "model", OmegaConf.to_container(OmegaConf.structured(m)),
                    "needs positive sizes with num_qo_heads divisible by num_kv_heads")
    cp = cfg.cpu_profile
    if not cp.length_scale > 0 or min(cp.max_requests, cp.measured_steps, cp.check_every, cp.reps,
                                      cp.probe_buffer_mib, cp.launch_probe_reps) < 1 or cp.warmup_steps < 0:
        raise _fail(where, "cpu_profile", dataclasses.asdict(cp), "needs positive sizes and scale")


def _check_gpu(gpu: Mapping[str, Any], where: str) -> None:
    try:
        Calibration.from_mapping(dict(gpu), where)
    except (TypeError, KeyError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _trace_families() -> tuple[str, ...]:
    return tuple(TRACE_FAMILIES)


def validate(cfg: DictConfig, choices: Mapping[str, Any] | None = None) -> PkvConfig:
    """A composed config as typed dataclasses, or ConfigError naming the file, field and value.

    `choices` are Hydra's group choices (`HydraConfig.get().runtime.choices`), used to name the
    YAML file a bad value came from.
    """
    choices = dict(choices or {})
    try:
        obj = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as exc:
        key = getattr(exc, "full_key", None) or "?"
        group = key.split(".", 1)[0]
        raise _fail(_source(group, choices), key, "???", "is required and has no value") from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"config: {exc}") from exc
    if not isinstance(obj, PkvConfig):
        raise ConfigError(f"config: composed into {type(obj).__name__}, expected PkvConfig "
                          "(conf/config.yaml must list pkv_schema first in its defaults)")
    _check_top(obj)
    _check_trace(obj.trace, _source("trace", choices), _trace_families())
    _check_engine(obj.engine, _source("engine", choices))
    _check_experiment(obj.experiment, _source("experiment", choices))
    if obj.variant is not None:
        parse_variant(obj.variant, obj.experiment)
    _check_gpu(obj.gpu, f"conf/gpu/{choices.get('gpu', '?')}.yaml")
    return obj


def parse_variant(variant: str, experiment: ExperimentConfig) -> tuple[str, str, str]:
    """("splits", "engine.num_splits", "24") from "splits=24"; ConfigError if it is not a known key."""
    name, sep, value = variant.partition("=")
    if not sep or not value or name not in experiment.variant_keys:
        raise _fail("command line", "variant", variant,
                    f"must be <name>=<value> with <name> one of {sorted(experiment.variant_keys)} "
                    f"(experiment {experiment.name!r})")
    return name, experiment.variant_keys[name], value


def apply_variant(cfg: DictConfig) -> DictConfig:
    """A copy of cfg with its ablation variant written into the key the experiment names.

    The key "model.group_size" is not stored: it sets num_kv_heads = num_qo_heads / G, because the
    GQA ablation varies G at a fixed number of query heads.
    """
    if cfg.get("variant") is None:
        return cfg
    exp = OmegaConf.to_object(cfg.experiment)
    _, key, raw = parse_variant(cfg.variant, exp)
    out = cfg.copy()
    value = yaml.safe_load(raw)  # "24" -> 24, "true" -> True, "masked" -> "masked"
    if key == "model.group_size":
        g = int(raw)
        hq = int(cfg.model.num_qo_heads)
        if g < 1 or hq % g:
            raise _fail("command line", "variant", cfg.variant, f"G must divide num_qo_heads={hq}")
        OmegaConf.update(out, "model.num_kv_heads", hq // g, merge=False)
    else:
        try:
            OmegaConf.update(out, key, value, merge=False)
        except OmegaConfBaseException as exc:
            raise _fail("command line", "variant", cfg.variant, f"cannot set {key}: {exc}") from None
    return out


