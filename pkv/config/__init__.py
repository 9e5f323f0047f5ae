"""Typed configuration: the dataclass schemas behind every Hydra group, and their validation.

Hydra composes `conf/config.yaml` with one option of each group (gpu, trace, engine, experiment);
the schemas registered here make OmegaConf reject an unknown key or a value of the wrong type while
composing (Hydra names the group option, the key and the value). What a type cannot say (a
negative length, an unknown trace family, a page size that is not a power of two, constants that
the cost model refuses) is checked by `validate`, whose errors name the YAML file, the field and
the value. Every key is checked, also one added with Hydra's `+key=value` (which would otherwise
slip past the typed schema), and every numeric field lies within the Bound the schema states for
it (pkv.config.fields walks them), NaN and inf refused.

The `gpu` group files hold the fields of `pkv.policy.Calibration`; that class owns their
meaning, so the schema keeps them as a plain mapping and `validate` hands them to
`Calibration.from_mapping`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from pkv.config.checks import (
    _check_trace, _trace_families, apply_variant, check_calibration_bounds, parse_variant, validate,
)
from pkv.config.fields import schema_key_problem
from pkv.config.schema import (
    CONF_DIR, DEFAULT_MAX_CONTEXT_TOKENS, DEVICES, DRIVERS, DTYPES, EXTERNAL_FAMILY, MAX_CONTEXT_TOKENS,
    MAX_KV_POOL_BYTES, PLANNERS, PROFILES, Bound, CalibrationTraceConfig, ConfigError, CpuProfileConfig, EngineConfig,
    ExperimentConfig, GateProbeConfig, ModelConfig, PkvConfig, TraceConfig, register_configs,
)

__all__ = ["CONF_DIR", "DEFAULT_MAX_CONTEXT_TOKENS", "DEVICES", "DRIVERS", "DTYPES", "EXTERNAL_FAMILY",
           "MAX_CONTEXT_TOKENS", "MAX_KV_POOL_BYTES", "PLANNERS", "PROFILES", "Bound", "CalibrationTraceConfig",
           "ConfigError", "CpuProfileConfig", "EngineConfig", "ExperimentConfig", "GateProbeConfig", "ModelConfig",
           "PkvConfig", "TraceConfig", "apply_variant", "check_calibration_bounds", "check_overrides", "compose", "load_trace_option",
           "parse_variant", "register_configs", "validate"]


# ---------------------------------------------------------------------------------------------
# composing outside @hydra.main (rules that only need a config, tests, the calibration sweep)


def _one_line(text: str) -> str:
    return "; ".join(line.strip() for line in str(text).splitlines() if line.strip())


def check_overrides(overrides: Sequence[str], conf: Path = CONF_DIR) -> None:
    """Refuse, before Hydra composes, an override whose key is no field of the schema (written with
    ``+``/``++`` or not) or whose group option has no file: ConfigError naming field and value."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:
        raise ConfigError(f"command line: {_one_line(exc)}") from None
    for o in parsed:
        key = o.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")) or o.package is not None or o.is_sweep_override():
            continue  # Hydra's own settings, and forms Hydra checks itself
        if "." not in key and (conf / key).is_dir():
            value = o.value()
            if isinstance(value, str) and not (conf / key / f"{value}.yaml").is_file():
                options = sorted(p.stem for p in (conf / key).glob("*.yaml"))
                raise ConfigError(f"command line: field '{key}' = {value!r}: no file conf/{key}/{value}.yaml "
                                  f"(options: {', '.join(options)})")
            continue
        why = schema_key_problem(key)
        if why:
            raise ConfigError(f"command line: field '{key}' = {o.value()!r}: {why}")


def _compose_error(conf: Path, exc: Exception) -> str:
    """Hydra's several-line composition error as one line naming the file, field and value."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    m = re.match(r"In '([^']+)': ", first)
    where = f"{conf}/{m.group(1)}.yaml" if m else "command line" if "override" in first else str(conf)
    err = exc if isinstance(exc, OmegaConfBaseException) else exc.__cause__
    if isinstance(err, OmegaConfBaseException) and getattr(err, "full_key", None):
        why = _one_line(err.msg or err).split("; full_key:")[0]
        value = f" = {err.value!r}" if getattr(err, "value", None) is not None else ""
        return f"{where}: field '{err.full_key}'{value}: {why}"
    cause = f" ({_one_line(exc.__cause__)})" if exc.__cause__ is not None else ""
    return f"{where}: {_one_line(exc)}{cause}"


def compose(overrides: Sequence[str] = (), *, conf_dir: str | os.PathLike | None = None) -> PkvConfig:
    """Compose conf/config.yaml with Hydra overrides and validate it."""
    conf = Path(conf_dir) if conf_dir is not None else CONF_DIR
    check_overrides(overrides, conf)
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()

    with initialize_config_dir(config_dir=str(conf.resolve()), version_base="1.3"):
        try:
            cfg = hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
        except (HydraException, OmegaConfBaseException) as exc:
            raise ConfigError(_compose_error(conf, exc)) from exc
    choices = dict(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    return validate(apply_variant(cfg), choices)


def load_trace_option(option: str, *, conf_dir: str | os.PathLike | None = None) -> TraceConfig:
    """conf/trace/<option>.yaml on its own, typed (the calibration sweep visits several traces)."""
    conf = Path(conf_dir) if conf_dir is not None else CONF_DIR
    path = conf / "trace" / f"{option}.yaml"
    if not path.is_file():
        raise ConfigError(f"{path}: no such trace option {option!r}")
    try:
        data = OmegaConf.load(path)
        merged = OmegaConf.merge(OmegaConf.structured(TraceConfig), data)
        trace = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    _check_trace(trace, str(path), _trace_families())
    return trace
