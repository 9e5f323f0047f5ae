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

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from pkv.pipeline.schedule import SPLIT_KINDS
from pkv.policy.calibration import Calibration
from pkv.policy.route import MERGE_KINDS, SCHEDULES

# The repository's conf/ folder; rules and tests compose from it.
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

EXTERNAL_FAMILY = "external"
PROFILES = ("cpu", "gpu")
DTYPES = ("float16", "bfloat16", "float32", "float64")
DEVICES = ("cpu", "cuda")
PLANNERS = ("native", "numpy")
# Which module of pkv.experiments runs an experiment; several experiments share a driver.
DRIVERS = ("evaluate", "isolated", "calibrate", "ablate", "profile")


class ConfigError(ValueError):
    """A configuration value that composes but cannot be used; the message names file, field, value."""


@dataclass
class TraceConfig:
    """One request trace: a synthetic family or an external file, and how it is paged and batched."""

    family: str = MISSING  # a pkv.pipeline.traces family, or "external"
    name: Optional[str] = None  # results name; None = "<family>_b<max_active>"
    num_requests: int = 32
    max_active: int = 8
    length_scale: float = 1.0  # multiplies every prompt length (the CPU profile scales it further)
    decode_len_range: List[int] = field(default_factory=lambda: [16, 64])
    page_size: int = 16
    hole_fraction: float = 0.0
    arrivals: Optional[str] = None  # arrival process of pkv.pipeline.traces; None = the generator's default
    arrival_rate: Optional[float] = None
    # external traces only: the file and the reader's options (pkv.pipeline.trace_readers.read_trace)
    path: Optional[str] = None
    max_context: Optional[int] = None
    overlong: Optional[str] = None
    step_ms: Optional[float] = None


@dataclass
class EngineConfig:
    """Options of the engines under test (pkv.engines.build_engine options); None = engine default."""

    route: str = "workqueue"
    num_splits: Optional[int] = None
    split_kind: Optional[str] = None
    bucket_num_splits: Optional[int] = None
    merge: str = "launch"
    open_few_rows: bool = False
    use_tensor_cores: Optional[bool] = None
    cuda_graph: bool = False
    planner: str = "native"


@dataclass
class CalibrationTraceConfig:
    """A trace the calibration sweep times PersistentKV on (a conf/trace option and its batch)."""

    trace: str = MISSING
    max_active: int = MISSING
    # bucket_exact fits Calibration.bucket_num_splits; workqueue fits workqueue_num_splits, or at
    # max_active 2..7 boundary_num_splits and boundary_route
    route: str = MISSING
    split_candidates: List[int] = field(default_factory=list)


@dataclass
class GateProbeConfig:
    """Steps the calibration times on PersistentKV and FlashInfer only to place a gate.

    The batch (max_active) picks the regime, and PersistentKV runs that regime's fitted route and
    split count. Without group_size the probe's steps join the regime's context-gate fit
    (length_scale < 1 reaches the short contexts the split sweeps leave out); with a group_size
    other than the model's, it decides whether that G is routed to PersistentKV at all.
    """

    trace: str = MISSING
    max_active: int = MISSING
    length_scale: float = 1.0
    group_size: Optional[int] = None
    num_requests: Optional[int] = None


@dataclass
class ExperimentConfig:
    """What one invocation measures; `driver` picks the pkv.experiments module that runs it."""

    name: str = MISSING
    driver: str = MISSING
    engines: List[str] = field(default_factory=lambda: ["adaptive", "flashinfer"])
    baseline: str = "flashinfer"
    mlp_tail: bool = False
    warmup_steps: int = 4
    measured_steps: int = 64
    check_every: int = 16
    flush_l2: bool = True
    # ablations: the variant's name -> the config key it sets ("splits" -> "engine.num_splits")
    variant_keys: Dict[str, str] = field(default_factory=dict)
    # isolated: one context length per invocation, PersistentKV's auto-split candidates, repetitions
    context_len: Optional[int] = None
    split_candidates: List[int] = field(default_factory=list)
    reps: int = 30
    methods: List[str] = field(default_factory=list)
    # calibrate: the only seed it accepts, the buffer of the bandwidth probe, the timed sweep
    calibration_seed: int = 20260622
    probe_buffer_mib: int = 1024
    launch_probe_reps: int = 200
    calibration_traces: List[CalibrationTraceConfig] = field(default_factory=list)
    gate_probes: List[GateProbeConfig] = field(default_factory=list)
    # A gate's context class (or a probed group size) holds when PersistentKV's device time is
    # within this fraction of FlashInfer's or better.
    gate_tolerance: float = 0.02


@dataclass
class ModelConfig:
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128


@dataclass
class CpuProfileConfig:
    """How profile=cpu shrinks a run so the whole DAG fits a laptop; results are not performance."""

    length_scale: float = 0.015625  # multiplies trace.length_scale: 64K-token prompts become 1K
    max_requests: int = 16
    warmup_steps: int = 1
    measured_steps: int = 6
    check_every: int = 3
    reps: int = 3
    probe_buffer_mib: int = 64
    launch_probe_reps: int = 50
    dtype: str = "float32"


@dataclass
class PkvConfig:
    """The composed top-level config of `python -m pkv.cli`."""

    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    gpu: Dict[str, Any] = field(default_factory=dict)
    model: ModelConfig = field(default_factory=ModelConfig)
    profile: str = "gpu"  # cpu | gpu
    cpu_profile: CpuProfileConfig = field(default_factory=CpuProfileConfig)
    seed: int = 20260623
    out: str = MISSING  # output file, or folder for drivers that write one file per engine
    variant: Optional[str] = None  # ablation variant, "<name>=<value>" with name in variant_keys
    calibration: Optional[str] = None  # calibration JSON the adaptive policy reads
    dtype: str = "float16"
    device: str = "cuda"
    progress: bool = True


def register_configs() -> None:
    """Register the schema; conf/config.yaml names `pkv_schema` first in its defaults.

    Only the top level is registered: it types every group's package (trace, engine, experiment),
    so a group file is checked where it lands without a schema option of its own to choose.
    """
    ConfigStore.instance().store(name="pkv_schema", node=PkvConfig)


register_configs()


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
    from pkv.pipeline.traces import TRACE_FAMILIES

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


# ---------------------------------------------------------------------------------------------
# composing outside @hydra.main (rules that only need a config, tests, the calibration sweep)


def compose(overrides: Sequence[str] = (), *, conf_dir: str | os.PathLike | None = None) -> PkvConfig:
    """Compose conf/config.yaml with Hydra overrides and validate it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    conf = Path(conf_dir) if conf_dir is not None else CONF_DIR
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    from hydra.errors import HydraException

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
