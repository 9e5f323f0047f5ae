"""The dataclass schemas behind every Hydra group, registered with Hydra's ConfigStore, so
OmegaConf rejects an unknown key or a value of the wrong type while composing."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

# The repository's conf/ folder; rules and tests compose from it.
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

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


