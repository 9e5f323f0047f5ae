"""What a type cannot say, checked after composing: every error names the YAML file, the field
and the value."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from pkv.config.fields import bounds_problem, calibration_bounds_problem, unknown_key
from pkv.config.schema import (
    CALIBRATION_FITS, CONF_DIR, DEVICES, DRIVERS, DTYPES, EXTERNAL_FAMILY, PLANNERS, PROFILES, ConfigError,
    EngineConfig, ExperimentConfig, PkvConfig, TraceConfig,
)
from pkv.measure.kernel_trace import KERNEL_PROFILERS
from pkv.pipeline.kv_pool import PAGE_LAYOUTS
from pkv.pipeline.pages import PAGE_ORDERS
from pkv.pipeline.schedule import SPLIT_KINDS
from pkv.pipeline.trace_readers import OVERLONG_POLICIES
from pkv.pipeline.traces import TRACE_FAMILIES
from pkv.policy.calibration import Calibration
from pkv.policy.regime import CalibrationError, regime_of
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


def _check_bounds(obj: Any, prefix: str, where: str, only: Sequence[str] | None = None) -> None:
    found = bounds_problem(obj, prefix, only)
    if found:
        raise _fail(where, *found)


def check_calibration_bounds(calib: Calibration, where: str, prefix: str = "gpu.") -> None:
    """The upper ends pkv.config.schema.GPU_BOUNDS puts on a calibration's constants."""
    found = calibration_bounds_problem(calib)
    if found:
        raise _fail(where, f"{prefix}{found[0]}", found[1], found[2])


def _check_trace(trace: TraceConfig, where: str, families: Sequence[str]) -> None:
    def bad(name: str, why: str) -> ConfigError:
        return _fail(where, f"trace.{name}", getattr(trace, name), why)

    _check_bounds(trace, "trace.", where)
    if trace.family != EXTERNAL_FAMILY and trace.family not in families:
        raise bad("family", f"must be one of {sorted(families) + [EXTERNAL_FAMILY]}")
    if trace.name is not None and (not trace.name or "/" in trace.name):
        raise bad("name", "must be a non-empty name without '/'")
    lo_hi = list(trace.decode_len_range)
    if len(lo_hi) != 2 or not 1 <= lo_hi[0] <= lo_hi[1]:
        raise bad("decode_len_range", "must be [lo, hi] with 1 <= lo <= hi")
    # Pages and 32-token tiles must nest in one another; powers of two guarantee it.
    if trace.page_size & (trace.page_size - 1):
        raise bad("page_size", "must be a positive power of two")
    if trace.page_layout not in PAGE_LAYOUTS:
        raise bad("page_layout", f"must be one of {list(PAGE_LAYOUTS)}")
    if trace.page_order not in PAGE_ORDERS:
        raise bad("page_order", f"must be one of {list(PAGE_ORDERS)}")
    if trace.kv_pool_tokens is not None:
        if trace.page_layout != "recycled":
            raise bad("kv_pool_tokens", f"sizes the recycled pool; trace.page_layout is {trace.page_layout!r}")
        if trace.kv_pool_tokens % trace.page_size:
            raise bad("kv_pool_tokens", f"must be a multiple of trace.page_size={trace.page_size}")
    if trace.overlong is not None and trace.overlong not in OVERLONG_POLICIES:
        raise bad("overlong", f"must be one of {list(OVERLONG_POLICIES)} or null")
    if trace.family == EXTERNAL_FAMILY:
        if not trace.path:
            raise bad("path", "an external trace needs trace.path=<CSV/JSON/JSONL file>")
        if not Path(trace.path).exists():
            raise bad("path", "no such file")
        if not Path(trace.path).is_file():
            raise bad("path", "is not a file (a folder?)")
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
    _check_bounds(engine, "engine.", where)


def _check_experiment(exp: ExperimentConfig, where: str) -> None:
    def bad(name: str, why: str) -> ConfigError:
        return _fail(where, f"experiment.{name}", getattr(exp, name), why)

    if exp.driver not in DRIVERS:
        raise bad("driver", f"must be one of {list(DRIVERS)}")
    if exp.driver in ("evaluate", "ablate", "profile", "model_step"):
        if not exp.engines:
            raise bad("engines", "needs at least one engine")
        if len(set(exp.engines)) != len(exp.engines):
            raise bad("engines", "lists an engine twice")
        if exp.baseline not in exp.engines:
            raise bad("baseline", f"must be one of experiment.engines {list(exp.engines)}")
    _check_bounds(exp, "experiment.", where)
    if exp.kernel_profiler not in KERNEL_PROFILERS:
        raise bad("kernel_profiler", f"must be one of {list(KERNEL_PROFILERS)}")
    if exp.driver == "isolated":
        if exp.context_len is None:
            raise bad("context_len", "the isolated experiment needs experiment.context_len")
        if not exp.split_candidates:
            raise bad("split_candidates", "auto split needs at least one candidate")
    if exp.driver == "calibrate":
        for i, ct in enumerate(exp.calibration_traces):
            short = ct.fits == "bucket_tiles_per_split"
            if ct.fits not in CALIBRATION_FITS or (ct.fits not in ("num_splits", "bucket_tiles_per_split")
                                                   and (ct.route != "workqueue" or ct.max_active < 2)):
                raise _fail(where, f"experiment.calibration_traces[{i}].fits", ct.fits,
                            f"must be one of {list(CALIBRATION_FITS)} (uniform_target_ctas and skew_target_ctas "
                            f"with route workqueue and max_active >= 2)")
            if short and (ct.route != "bucket_exact" or ct.max_active != 1 or 1 not in ct.tile_candidates
                          or ct.split_candidates or ct.wave_candidates):
                raise _fail(where, f"experiment.calibration_traces[{i}]", dataclasses.asdict(ct),
                            "fits bucket_tiles_per_split: needs route bucket_exact, max_active 1 and "
                            "tile_candidates with 1 (the rule off) among them, and no split or wave candidates "
                            "(it runs the single-row regime's fitted split count)")
            if short:
                continue
            if ct.tile_candidates:
                raise _fail(where, f"experiment.calibration_traces[{i}].tile_candidates", ct.tile_candidates,
                            "only a trace that fits bucket_tiles_per_split times tiles a split")
            skew = ct.fits == "skew_target_ctas"
            if skew and (not ct.wave_candidates or ct.split_candidates):
                raise _fail(where, f"experiment.calibration_traces[{i}]", dataclasses.asdict(ct),
                            "fits skew_target_ctas: needs wave_candidates (task budgets in waves of the SMs) "
                            "and no split_candidates (its fixed rule runs the regime's fitted split count)")
            if not skew and (ct.route not in ("bucket_exact", "workqueue") or not ct.split_candidates
                             or ct.wave_candidates):
                raise _fail(where, f"experiment.calibration_traces[{i}]", dataclasses.asdict(ct),
                            "needs route bucket_exact or workqueue and at least one split candidate "
                            "(wave_candidates only where it fits skew_target_ctas)")
        # Each trace's split sweep is recorded under its name, its skew fit beside it: a trace listed
        # twice for either would lose a record.
        kinds = {"skew_target_ctas": "a skew budget", "bucket_tiles_per_split": "a short-row rule"}
        names = [(ct.trace, ct.max_active, kinds.get(ct.fits, "a split sweep")) for ct in exp.calibration_traces]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise _fail(where, f"experiment.calibration_traces[{i}]", dataclasses.asdict(exp.calibration_traces[i]),
                            f"lists trace {name[0]} at max_active {name[1]} for {name[2]} a second time")
        uniform = [ct for ct in exp.calibration_traces if ct.fits == "uniform_target_ctas"]
        if uniform and (len({ct.max_active for ct in uniform}) > 1
                        or not set.intersection(*(set(ct.split_candidates) for ct in uniform))):
            raise _fail(where, "experiment.calibration_traces", [dataclasses.asdict(ct) for ct in uniform],
                        "the traces that fit uniform_target_ctas need one max_active and a shared split candidate")
        # Each batch regime fits its own skew budget from its traces.
        skewed = [ct for ct in exp.calibration_traces if ct.fits == "skew_target_ctas"]
        for regime in dict.fromkeys(regime_of(ct.max_active) for ct in skewed):
            mine = [ct for ct in skewed if regime_of(ct.max_active) == regime]
            if not set.intersection(*(set(ct.wave_candidates) for ct in mine)):
                raise _fail(where, "experiment.calibration_traces", [dataclasses.asdict(ct) for ct in mine],
                            f"the traces that fit skew_target_ctas of regime {regime} need a shared wave candidate")
    for name, key in exp.variant_keys.items():
        if not key or "=" in name:
            raise _fail(where, f"experiment.variant_keys.{name}", key, "must map a name to a config key")


def _check_top(cfg: PkvConfig) -> None:
    where = "conf/config.yaml (or its override)"
    # trace, engine and experiment are checked with the file they come from
    _check_bounds(cfg, "", where, only=("seed", "model", "cpu_profile"))
    if cfg.profile not in PROFILES:
        raise _fail(where, "profile", cfg.profile, f"must be one of {list(PROFILES)}")
    if cfg.dtype not in DTYPES:
        raise _fail(where, "dtype", cfg.dtype, f"must be one of {list(DTYPES)}")
    if cfg.cpu_profile.dtype not in DTYPES:
        raise _fail(where, "cpu_profile.dtype", cfg.cpu_profile.dtype, f"must be one of {list(DTYPES)}")
    if cfg.device not in DEVICES:
        raise _fail(where, "device", cfg.device, f"must be one of {list(DEVICES)}")
    if not cfg.out:
        raise _fail(where, "out", cfg.out, "needs an output path (out=...)")
    m = cfg.model
    if m.num_qo_heads % m.num_kv_heads:
        raise _fail(where, "model", OmegaConf.to_container(OmegaConf.structured(m)),
                    "needs num_qo_heads divisible by num_kv_heads")


def _check_paths(cfg: PkvConfig) -> None:
    """The files a run reads and the output it writes are of the right kind before it starts."""
    where = "command line"
    if cfg.calibration is not None:
        path = Path(cfg.calibration)
        if not path.exists():
            raise _fail(where, "calibration", cfg.calibration, "no such file (write it with experiment=calibrate)")
        if not path.is_file():
            raise _fail(where, "calibration", cfg.calibration, "is not a file (a folder?)")
    out = Path(cfg.out)
    # Drivers of trace runs write one file per engine into the out folder; the others one file.
    wants_folder = cfg.experiment.driver in ("evaluate", "ablate", "model_step")
    if wants_folder and out.exists() and not out.is_dir():
        raise _fail(where, "out", cfg.out, "is a file; this experiment writes one file per engine into a folder")
    if not wants_folder and out.is_dir():
        raise _fail(where, "out", cfg.out, "is a folder; this experiment writes one file")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise _fail(where, "out", cfg.out, f"cannot be created: {parent} is not a folder")


def _check_gpu(gpu: Mapping[str, Any], where: str) -> None:
    try:
        calib = Calibration.from_mapping(dict(gpu), where)
    except (TypeError, KeyError, CalibrationError) as exc:
        raise ConfigError(str(exc) if isinstance(exc, CalibrationError) else f"{where}: {exc}") from None
    check_calibration_bounds(calib, where)


def _check_gpu_name(gpu: Mapping[str, Any], option: str, where: str) -> None:
    """A conf/gpu file's ``gpu`` field is its own name: the calibration, its spread and every result
    record that field as the GPU, so a file copied from another GPU's and left unchanged would
    label this GPU's measurements as that one's."""
    name = gpu.get("gpu")
    if name != option:
        raise _fail(where, "gpu", name, f"must be {option!r}, this file's name (the calibration and every result "
                                        f"record it as the GPU): set `gpu: {option}` in conf/gpu/{option}.yaml")


def _normalized(name: str) -> str:
    """A GPU name as auto-detection compares it (workflow/rules/common.smk): "NVIDIA H100 80GB HBM3"
    -> "h10080gbhbm3", option "h100" -> "h100"."""
    return re.sub(r"[^a-z0-9]", "", name.lower().replace("nvidia", "").replace("geforce", ""))


def _card(option: str) -> str | None:
    """The card an option's name starts with (letters then digits: "h100" of "h100_lab", "rtx3060"),
    or None for a name that names no card ("mygpu"), which cannot be judged against a device."""
    m = re.match(r"[a-z]+\d+", _normalized(option))
    return m.group(0) if m else None


def gpu_device_problem(option: str, device: str, options: Sequence[str]) -> str | None:
    """Why the conf/gpu option ``option`` is not for the device torch names ``device``, or None where
    it is or that cannot be judged. It is for the device when the device's name starts with the
    option's name or its card (as auto-detection matches them) and no other option's name matches
    it longer; it is not when another option matches the device, or when the option names a card
    the device's name does not start with. An option that names no card is not judged."""
    key = _normalized(device)
    card = _card(option)
    matched = max((len(n) for n in (_normalized(option), card) if n and key.startswith(n)), default=0)
    better = [o for o in options if o not in (option, "cpu") and key.startswith(_normalized(o))
              and len(_normalized(o)) > matched]
    if better:
        other = max(better, key=lambda o: len(_normalized(o)))
        return (f"the device is {device!r}, which conf/gpu/{other}.yaml is for: pass gpu={other} (the DAG: "
                f"--config gpu={other}, or gpu: auto)")
    if matched or card is None:
        return None
    return (f"names another card than the device torch sees, {device!r}: pass this device's conf/gpu option, or "
            f"add conf/gpu/<name>.yaml for it (README, 'A new GPU')")


def _visible_device_name() -> str | None:
    """The name of the CUDA device a run times on (device 0 of those visible), None without one."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _check_gpu_device(cfg: PkvConfig, option: str, conf: Path = CONF_DIR) -> None:
    """Refuse a GPU-profile run whose conf/gpu option is another card's than the device it times on:
    its calibration, results and tables would carry that card's name and constants. The CPU
    profile and the cpu option time no GPU, and an option that names no card is not judged."""
    if option == "cpu" or cfg.profile != "gpu" or cfg.device != "cuda":
        return
    device = _visible_device_name()
    if device is None:
        return
    options = sorted(p.stem for p in (conf / "gpu").glob("*.yaml"))
    problem = gpu_device_problem(option, device, options)
    if problem:
        raise _fail("command line", "gpu", option, problem)


def _trace_families() -> tuple[str, ...]:
    return tuple(TRACE_FAMILIES)


def validate(cfg: DictConfig, choices: Mapping[str, Any] | None = None) -> PkvConfig:
    """A composed config as typed dataclasses, or ConfigError naming the file, field and value.

    `choices` are Hydra's group choices (`HydraConfig.get().runtime.choices`), used to name the
    YAML file a bad value came from.
    """
    choices = dict(choices or {})
    unknown = unknown_key(cfg, PkvConfig, "")
    if unknown:
        key, value, why = unknown
        raise _fail("command line", key, value, why)
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
    option = choices.get("gpu")
    _check_gpu(obj.gpu, f"conf/gpu/{option or '?'}.yaml")
    if option:
        _check_gpu_name(obj.gpu, option, f"conf/gpu/{option}.yaml")
        _check_gpu_device(obj, option)
    _check_paths(obj)
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


