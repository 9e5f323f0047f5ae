"""Typed configuration: the dataclass schemas behind every Hydra group, and their validation.

Hydra composes `conf/config.yaml` with one option of each group (gpu, trace, engine, experiment);
the schemas registered here make OmegaConf reject an unknown key or a value of the wrong type while
composing (Hydra names the group option, the key and the value). What a type cannot say (a
negative length, an unknown trace family, a page size that is not a power of two, constants that
the cost model refuses) is checked by `validate`, whose errors name the YAML file, the field and
the value.

The `gpu` group files hold the fields of `pkv.policy.Calibration`; that class owns their
meaning, so the schema keeps them as a plain mapping and `validate` hands them to
`Calibration.from_mapping`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from pkv.config.checks import _check_trace, _trace_families, apply_variant, parse_variant, validate
from pkv.config.schema import (
    CONF_DIR, DEVICES, DRIVERS, DTYPES, EXTERNAL_FAMILY, PLANNERS, PROFILES, CalibrationTraceConfig, ConfigError,
    CpuProfileConfig, EngineConfig, ExperimentConfig, GateProbeConfig, ModelConfig, PkvConfig, TraceConfig,
    register_configs,
)

__all__ = ["CONF_DIR", "DEVICES", "DRIVERS", "DTYPES", "EXTERNAL_FAMILY", "PLANNERS", "PROFILES",
           "CalibrationTraceConfig", "ConfigError", "CpuProfileConfig", "EngineConfig", "ExperimentConfig",
           "GateProbeConfig", "ModelConfig", "PkvConfig", "TraceConfig", "apply_variant", "compose",
           "load_trace_option", "parse_variant", "register_configs", "validate"]


# ---------------------------------------------------------------------------------------------
# composing outside @hydra.main (rules that only need a config, tests, the calibration sweep)


def compose(overrides: Sequence[str] = (), *, conf_dir: str | os.PathLike | None = None) -> PkvConfig:
    """Compose conf/config.yaml with Hydra overrides and validate it."""
    conf = Path(conf_dir) if conf_dir is not None else CONF_DIR
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()

    with initialize_config_dir(config_dir=str(conf.resolve()), version_base="1.3"):
        try:
            cfg = hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
        except (HydraException, OmegaConfBaseException) as exc:
            # Hydra names the group option (e.g. 'trace/bimodal') and the key; the cause holds the value.
            cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""
            raise ConfigError(f"{conf}: {exc}{cause}") from exc
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
