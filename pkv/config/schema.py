"""The dataclass schemas behind every Hydra group, registered with Hydra's ConfigStore, so
OmegaConf rejects an unknown key or a value of the wrong type while composing."""

from __future__ import annotations

import math
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
DRIVERS = ("evaluate", "isolated", "calibrate", "ablate", "profile", "model_step")


class ConfigError(ValueError):
    """A configuration value that composes but cannot be used; the message names file, field, value."""


# ---------------------------------------------------------------------------------------------
# Bounds. Every numeric field below carries one (tests/test_hostile_inputs.py checks that none is
# missing), and `validate` refuses NaN, inf and any value outside it, naming file, field and value,
# before anything is allocated: a value past these fails later deep in torch or numpy, or runs for
# hours into the allocator.


@dataclass(frozen=True)
class Bound:
    """The closed range [lo, hi] a numeric field (each element of a list field) must lie in, or
    (lo, hi] with lo_open; `why` is part of the refusal."""

    lo: float
    hi: float
    why: str
    lo_open: bool = False

    def problem(self, value: Any) -> Optional[str]:
        """Why value is refused, or None."""
        if isinstance(value, float) and not math.isfinite(value):
            return "must be a finite number"
        ok = (self.lo < value if self.lo_open else self.lo <= value) and value <= self.hi
        if ok:
            return None
        return f"must be in {'(' if self.lo_open else '['}{self.lo}, {self.hi}] ({self.why})"


def bounded(default: Any = MISSING, *, bound: Bound, default_factory: Any = None) -> Any:
    """A dataclass field with its Bound in the field's metadata."""
    if default_factory is not None:
        return field(default_factory=default_factory, metadata={"bound": bound})
    return field(default=default, metadata={"bound": bound})


# Seeds: numpy's SeedSequence and torch.manual_seed take any integer in [0, 2**64); one bit more and
# torch fails without naming the field.
SEED = Bound(0, 2**64 - 1, "a 64-bit unsigned seed")

# The longest context (prompt + decode tokens) of one request when trace.max_context is null.
# Chosen from what one H200 holds for a real request: a Llama-3-8B-shaped model (32 layers of this
# shape, 8 KV heads x 128 dims, K and V in fp16) keeps 32 * 2 * 8 * 128 * 2 B = 128 KiB of KV cache
# per token, and 139 GiB of device memory less 15 GiB of weights hold 124 GiB / 128 KiB = 1,015,808
# tokens; half of that, rounded down to a power of two, leaves the rest of a batch its room: 512K,
# four times the longest context this artifact measures (128K).
DEFAULT_MAX_CONTEXT_TOKENS = 1 << 19

# The longest context any field may ask for (trace.max_context, experiment.context_len, decode
# lengths). A run times one layer: at 4M tokens a request's K and V take 4M x 4 KiB = 16 GiB in
# fp16 and the float64 copy the correctness checks make of a row 64 GiB, which together fit one
# H200's 139 GiB; 8M would not.
MAX_CONTEXT_TOKENS = 1 << 22
CONTEXT = Bound(1, MAX_CONTEXT_TOKENS, "tokens; the longest context one H200 holds for one layer")

# The K and V pages of one run (every request of the trace, page holes included, in the run's
# dtype) must fit one H200 beside the queries, the split scratch, FlashInfer's workspace and the
# float64 checks: 96 GiB of its 139 GiB. pkv.experiments.common checks it once the requests are known.
MAX_KV_POOL_BYTES = 96 << 30

# Rows of one decode step: plans and FlashInfer's indptr are int32 arrays of rows x KV heads x
# splits, and serving engines batch at most a few hundred rows.
BATCH = Bound(1, 4096, "rows of one decode step")
# Requests of one run, all paged at once (the KV pool bound applies as well): 64K is a hundred
# times the longest trace this artifact replays.
REQUESTS = Bound(1, 65_536, "requests of one run")
# kMaxMergeSlots (csrc/decode_constants.h): the merge keeps one weight per split in shared memory.
SPLITS = Bound(1, 1024, "the merge kernel's kMaxMergeSlots")
# The short-row rule's tiles a split (RegimeParams.bucket_tiles_per_split; csrc/route_policy.cpp's bound).
BUCKET_TILES = Bound(1, 1024, "tiles of 32 tokens a split; csrc/route_policy.cpp reads at most 1024")
# A task budget in waves of the GPU's SMs: the balanced rule caps a row at 64 splits, which 64
# waves of any GPU's SMs exceed for every batch.
WAVES = Bound(1, 64, "task budgets in waves of the GPU's SMs")
# A prompt length multiplier: at 1024 a 4K-token prompt is already the longest context.
LENGTH_SCALE = Bound(0, 1024, "multiplies prompt lengths", lo_open=True)
# Step counts of one process: 100K decode steps of a long batch are hours of GPU time.
STEPS = Bound(1, 100_000, "decode steps of one run")
WARMUP = Bound(0, 10_000, "untimed decode steps before the timed ones")
PROFILED = Bound(0, 100_000, "measured steps run again under the CUDA profiler")
# A spin of 10M cycles is 5 ms a layer at 2 GHz, longer than any step it would sit in.
PROBE_CYCLES = Bound(0, 10_000_000, "GPU clock cycles of one clock probe")
REPS = Bound(1, 1_000_000, "repetitions of one timed call")
# The bandwidth probe allocates this much on the device; 64 GiB is under half an H200.
PROBE_MIB = Bound(1, 65_536, "MiB the bandwidth probe allocates")
# The largest models have 128 query heads (Llama-3-405B); FlashInfer's decode takes head dims up
# to 256 (PersistentKV's kernels are built for 128).
HEADS = Bound(1, 128, "attention heads of the largest models")
HEAD_DIM = Bound(1, 256, "FlashInfer's largest decode head dim")
# The model_step experiment's decoder stacks: Llama-3-405B has a 16384-wide residual, a 53248-wide
# MLP and 126 layers.
WIDTH = Bound(1, 131_072, "hidden or MLP width of the largest models")
LAYERS = Bound(1, 256, "decoder layers of the largest models")


@dataclass
class TraceConfig:
    """One request trace: a synthetic family or an external file, and how it is paged and batched."""

    family: str = MISSING  # a pkv.pipeline.traces family, or "external"
    name: Optional[str] = None  # results name; None = "<family>_b<max_active>"
    num_requests: int = bounded(32, bound=REQUESTS)
    max_active: int = bounded(8, bound=BATCH)
    # multiplies every prompt length (the CPU profile scales it further)
    length_scale: float = bounded(1.0, bound=LENGTH_SCALE)
    decode_len_range: List[int] = bounded(bound=CONTEXT, default_factory=lambda: [16, 64])
    # Serving engines page 1..256 tokens (vLLM 16, FlashInfer any power of two); 1024 keeps
    # experiments open while a page of one KV head stays a few hundred KiB.
    page_size: int = bounded(16, bound=Bound(1, 1024, "tokens per page"))
    # Holes grow the page pool by 1 / (1 - h): 0.99 is a 100x pool, and the KV pool bound caps it.
    hole_fraction: float = bounded(0.0, bound=Bound(0.0, 0.99, "fraction of physical pages left empty"))
    # How requests get physical pages (pkv.pipeline.kv_pool.PAGE_LAYOUTS): "recycled", a fixed pool
    # whose pages are taken at admission and on growth and reused once a request finishes, as a
    # serving engine keeps one; "up_front", every request of the trace owns its pages from the
    # start (the paper's section 3.7 layout; the pool grows with the trace).
    page_layout: str = "recycled"
    # The order page IDs are first handed out in (pkv.pipeline.pages.PAGE_ORDERS): "shuffled", one
    # seeded permutation, as a server that has run for a while holds its free list; "in_order",
    # ascending IDs, as a freshly started server's, so each request's prompt pages are neighbours.
    page_order: str = "shuffled"
    # Token slots of the recycled pool (a multiple of page_size). None: the most the run's admitted
    # requests reserve at once over 1 - hole_fraction, at most what the device holds for it
    # (pkv.experiments.common.kv_pool_pages); a smaller pool makes requests wait for pages.
    kv_pool_tokens: Optional[int] = bounded(None, bound=Bound(1, 1 << 36, "token slots of the KV pool"))
    arrivals: Optional[str] = None  # arrival process of pkv.pipeline.traces; None = the generator's default
    # Requests per decode step (Poisson); beyond the largest batch every request arrives at once anyway.
    arrival_rate: Optional[float] = bounded(None, bound=Bound(0, 1e6, "requests per decode step", lo_open=True))
    # external traces only: the file and the reader's options (pkv.pipeline.trace_readers.read_trace)
    path: Optional[str] = None
    # The longest context kept; null = DEFAULT_MAX_CONTEXT_TOKENS (a longer request is refused; set
    # it to truncate or drop). Synthetic traces are refused past it.
    max_context: Optional[int] = bounded(None, bound=Bound(2, MAX_CONTEXT_TOKENS, "tokens; see MAX_CONTEXT_TOKENS"))
    overlong: Optional[str] = None
    # Milliseconds per decode step of timestamped traces; a step of an hour is a unit mistake.
    step_ms: Optional[float] = bounded(None, bound=Bound(0, 3_600_000, "milliseconds per decode step",
                                                         lo_open=True))


@dataclass
class EngineConfig:
    """Options of the engines under test (pkv.engines.build_engine options); None = engine default."""

    route: str = "workqueue"
    num_splits: Optional[int] = bounded(None, bound=SPLITS)
    split_kind: Optional[str] = None
    bucket_num_splits: Optional[int] = bounded(None, bound=SPLITS)
    bucket_tiles_per_split: Optional[int] = bounded(None, bound=BUCKET_TILES)
    merge: str = "launch"
    open_few_rows: bool = False
    use_tensor_cores: Optional[bool] = None
    cuda_graph: bool = False
    planner: str = "native"
    # The merge kernel (merge: launch) drops the partial states it has read from L2 without writing
    # them back (csrc DecodeArgs::discard_merged_states): a setting of the run's process. None: on
    # where the run's device is CUDA; true: on, and a run on another device is refused; false: off.
    discard_merged_states: Optional[bool] = None
    # The adaptive engine's eager step decided, planned and launched in one op call (CUDA, the native
    # planner, no CUDA graph; pkv.engines.adaptive.OneOpPlan); other engines do not read it.
    one_op_step: bool = False


# What a calibration trace's split sweep fits (CalibrationTraceConfig.fits).
CALIBRATION_FITS = ("num_splits", "uniform_target_ctas", "skew_target_ctas", "bucket_tiles_per_split")


@dataclass
class CalibrationTraceConfig:
    """A trace the calibration sweep times PersistentKV on (a conf/trace option and its batch)."""

    trace: str = MISSING
    max_active: int = bounded(bound=BATCH)
    # bucket_exact fits Calibration.bucket_num_splits; workqueue fits workqueue_num_splits, or at
    # max_active 2..7 boundary_num_splits and boundary_route
    route: str = MISSING
    split_candidates: List[int] = bounded(bound=SPLITS, default_factory=list)
    # "num_splits": the regime's split count (above); "uniform_target_ctas": a batch of rows of one
    # length (the workqueue) fits Calibration.uniform_target_ctas instead; "skew_target_ctas": the
    # workqueue's skewed steps (pkv.policy.choose.is_skewed) fit the skew_target_ctas of the trace's
    # regime from wave_candidates, against the regime's fitted split count, and need no
    # split_candidates; their over-split steps (is_over_split), timed in the same runs, fit the
    # regime's over_split_balanced. A trace may be listed once for a split sweep and once for this.
    # "bucket_tiles_per_split": a single-row trace on the bucket route fits the short-row rule of
    # that regime (RegimeParams.bucket_tiles_per_split) from tile_candidates, at the regime's fitted
    # split count, and needs no split_candidates.
    fits: str = "num_splits"
    # skew_target_ctas: the balanced rule's task budgets to time, in waves of the GPU's SMs
    wave_candidates: List[int] = bounded(bound=WAVES, default_factory=list)
    # bucket_tiles_per_split: the tiles a split to time (1, the rule off, among them)
    tile_candidates: List[int] = bounded(bound=BUCKET_TILES, default_factory=list)
    # Multiplies the trace's prompt lengths (its conf/trace option's length_scale too): the short
    # rows of the short-row fit are the bucketed trace at 1/32 (256 to 2K tokens).
    length_scale: float = bounded(1.0, bound=LENGTH_SCALE)


@dataclass
class GateProbeConfig:
    """Steps the calibration times on PersistentKV and FlashInfer only to place a gate.

    The batch (max_active) picks the regime, and PersistentKV runs that regime's fitted route and
    split count. Without group_size the probe's steps join the regime's context-gate fit
    (length_scale < 1 reaches the short contexts the split sweeps leave out); with a group_size
    other than the model's, it decides whether that G is routed to PersistentKV at all.
    """

    trace: str = MISSING
    max_active: int = bounded(bound=BATCH)
    length_scale: float = bounded(1.0, bound=LENGTH_SCALE)
    group_size: Optional[int] = bounded(None, bound=HEADS)
    num_requests: Optional[int] = bounded(None, bound=REQUESTS)


@dataclass
class ModelPresetConfig:
    """A decoder stack the model_step experiment times (experiment.models in conf/experiment/model_step.yaml)."""

    hidden: int = bounded(4096, bound=WIDTH)
    intermediate: int = bounded(14336, bound=WIDTH)
    num_qo_heads: int = bounded(32, bound=HEADS)
    num_kv_heads: int = bounded(8, bound=HEADS)
    head_dim: int = bounded(128, bound=HEAD_DIM)
    num_layers: int = bounded(32, bound=LAYERS)


@dataclass
class ExperimentConfig:
    """What one invocation measures; `driver` picks the pkv.experiments module that runs it."""

    name: str = MISSING
    driver: str = MISSING
    engines: List[str] = field(default_factory=lambda: ["adaptive", "flashinfer"])
    baseline: str = "flashinfer"
    mlp_tail: bool = False
    warmup_steps: int = bounded(4, bound=WARMUP)
    measured_steps: int = bounded(64, bound=STEPS)
    check_every: int = bounded(16, bound=STEPS)
    flush_l2: bool = True
    # ablations: the variant's name -> the config key it sets ("splits" -> "engine.num_splits")
    variant_keys: Dict[str, str] = field(default_factory=dict)
    # isolated: one context length per invocation, PersistentKV's auto-split candidates, repetitions
    context_len: Optional[int] = bounded(None, bound=CONTEXT)
    split_candidates: List[int] = bounded(bound=SPLITS, default_factory=list)
    reps: int = bounded(30, bound=REPS)
    methods: List[str] = field(default_factory=list)
    # calibrate: the only seed it accepts, the buffer of the bandwidth probe, the timed sweep
    calibration_seed: int = bounded(20260622, bound=SEED)
    probe_buffer_mib: int = bounded(1024, bound=PROBE_MIB)
    launch_probe_reps: int = bounded(200, bound=REPS)
    calibration_traces: List[CalibrationTraceConfig] = field(default_factory=list)
    gate_probes: List[GateProbeConfig] = field(default_factory=list)
    # A gate's context class (or a probed group size) holds when PersistentKV's device time is
    # within this fraction of FlashInfer's or better; at 0.5 a route half again as slow would pass.
    gate_tolerance: float = bounded(0.02, bound=Bound(0.0, 0.5, "fraction of FlashInfer's device time"))
    # model_step: the model timed (a key of `models`), its layers (null: the model's; fewer run where
    # memory is short), the modes (eager, graph), the step's dtype (null: the run's) and the CPU
    # profile's widths and layers (the attention shape stays the model's)
    model: Optional[str] = None
    models: Dict[str, ModelPresetConfig] = field(default_factory=dict)
    num_layers: Optional[int] = bounded(None, bound=LAYERS)
    modes: List[str] = field(default_factory=lambda: ["eager", "graph"])
    dtype: Optional[str] = None
    cpu_hidden: int = bounded(256, bound=WIDTH)
    cpu_intermediate: int = bounded(512, bound=WIDTH)
    cpu_layers: int = bounded(2, bound=LAYERS)
    # model_step: the first this many measured steps run once more per path under the CUDA profiler,
    # untimed, for each path's kernels and attention's share of them (pkv.measure.kernel_trace); 0: none
    kernel_profile_steps: int = bounded(0, bound=PROFILED)
    # model_step: who traces those steps (pkv.measure.kernel_trace.KERNEL_PROFILERS): "torch", the
    # CUDA profiler inside the run; "external", nothing inside it: each path's run sits in an NVTX
    # range trace_<path> (domain pkv) for a profiler started around the run, such as ncu
    # (scripts/gemm_counters.sh), which cannot share the device's profiling interface with torch's
    kernel_profiler: str = "torch"
    # model_step: a spin of this many SM clock cycles (torch.cuda._sleep) right after each layer's
    # attention and after its gate/up GEMM, in every path and in the step without attention, so a
    # kernel trace times the SM clock there (a spin's time is its cycles over the clock); 0: none.
    # A diagnostic: it adds its spins to every step's time.
    clock_probe_cycles: int = bounded(0, bound=PROBE_CYCLES)


@dataclass
class ModelConfig:
    num_qo_heads: int = bounded(32, bound=HEADS)
    num_kv_heads: int = bounded(8, bound=HEADS)
    head_dim: int = bounded(128, bound=HEAD_DIM)


@dataclass
class CpuProfileConfig:
    """How profile=cpu shrinks a run so the whole DAG fits a laptop; results are not performance."""

    # multiplies trace.length_scale: 64K-token prompts become 1K; the CPU profile only shrinks
    length_scale: float = bounded(0.015625, bound=Bound(0, 1, "the CPU profile only shrinks", lo_open=True))
    max_requests: int = bounded(16, bound=REQUESTS)
    warmup_steps: int = bounded(1, bound=WARMUP)
    measured_steps: int = bounded(6, bound=STEPS)
    check_every: int = bounded(3, bound=STEPS)
    reps: int = bounded(3, bound=REPS)
    probe_buffer_mib: int = bounded(64, bound=PROBE_MIB)
    launch_probe_reps: int = bounded(50, bound=REPS)
    dtype: str = "float32"


@dataclass
class PkvConfig:
    """The composed top-level config of `python -m pkv.cli`."""

    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    gpu: Dict[str, Any] = field(default_factory=dict)  # bounded by GPU_BOUNDS
    model: ModelConfig = field(default_factory=ModelConfig)
    profile: str = "gpu"  # cpu | gpu
    cpu_profile: CpuProfileConfig = field(default_factory=CpuProfileConfig)
    seed: int = bounded(20260623, bound=SEED)
    out: str = MISSING  # output file, or folder for drivers that write one file per engine
    variant: Optional[str] = None  # ablation variant, "<name>=<value>" with name in variant_keys
    calibration: Optional[str] = None  # calibration JSON the adaptive policy reads
    dtype: str = "float16"
    device: str = "cuda"
    progress: bool = True


# The numeric fields of a conf/gpu file and of a calibration JSON (pkv.policy.Calibration, which
# owns their meaning and checks their signs; these are the upper ends), by path; "regimes.*" is
# each regime.
GPU_BOUNDS: Dict[str, Bound] = {
    "num_sms": Bound(1, 1024, "SMs of one GPU; the H200 has 132"),
    "beta_gbps": Bound(0, 100_000, "GB/s; the H200 reads 4.8 TB/s", lo_open=True),
    "lambda_us": Bound(0, 1e6, "microseconds per launch"),
    "c_min": Bound(0, 1024, "CTAs per SM"),
    "flashinfer_plan_us": Bound(0, 1e6, "microseconds per step"),
    "persistentkv_plan_us": Bound(0, 1e6, "microseconds per step"),
    "flashinfer_ctas_per_row_head": Bound(0, 1024, "CTAs per (row, KV head)", lo_open=True),
    "supported_group_sizes": HEADS,
    "uniform_target_ctas": Bound(0, 2**31 - 1, "CTAs of one step; a plan indexes its tasks in int32"),
    "regimes.*.num_splits": SPLITS,
    "regimes.*.min_context_tokens": Bound(0, MAX_CONTEXT_TOKENS, "tokens; see MAX_CONTEXT_TOKENS"),
    "regimes.*.margin": Bound(0, 100, "estimated speedup a route needs", lo_open=True),
    "regimes.*.skew_target_ctas": Bound(0, 2**31 - 1, "CTAs of one step; a plan indexes its tasks in int32"),
    "regimes.*.bucket_tiles_per_split": BUCKET_TILES,
}


def register_configs() -> None:
    """Register the schema; conf/config.yaml names `pkv_schema` first in its defaults.

    Only the top level is registered: it types every group's package (trace, engine, experiment),
    so a group file is checked where it lands without a schema option of its own to choose.
    """
    ConfigStore.instance().store(name="pkv_schema", node=PkvConfig)


register_configs()


