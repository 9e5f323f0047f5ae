# Helpers shared by the rules: the GPU name and results root, the trace axes, and the one way every
# rule calls the package's Hydra entry point.

import os
import re
import shlex
import sys
from pathlib import Path

import yaml
from snakemake.utils import validate


validate(config, "../schemas/config.schema.yaml")

REPO = Path(workflow.basedir)
# The environment every rule runs in, for --use-conda / --software-deployment-method conda.
CONDA_ENV = str(REPO / "environment.yml")


def _normalized(name):
    return re.sub(r"[^a-z0-9]", "", name.lower().replace("nvidia", "").replace("geforce", ""))


def detect_gpu():
    """conf/gpu option of the visible GPU: "cpu" when torch sees no CUDA device."""
    try:
        import torch
    except ImportError:
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    device = torch.cuda.get_device_name(0)
    key = _normalized(device)
    options = sorted(p.stem for p in (REPO / "conf" / "gpu").glob("*.yaml") if p.stem != "cpu")
    # "NVIDIA H100 80GB HBM3" -> "h10080gbhbm3" matches option "h100": the longest prefix wins.
    matches = [o for o in options if key.startswith(_normalized(o))]
    if not matches:
        raise WorkflowError(
            f"GPU {device!r} has no conf/gpu/<name>.yaml among {options}: add one (README, 'A new GPU') "
            "or pass --config gpu=<name>"
        )
    return max(matches, key=len)


def _options(group):
    return sorted(p.stem for p in (REPO / "conf" / group).glob("*.yaml"))


def config_error(field, value, why):
    """The one-line refusal of a config value: names the config, the field and the value."""
    return WorkflowError(f"config/config.yaml (or --config/--configfile): field '{field}' = {value!r}: {why}")


GPU = detect_gpu() if config["gpu"] == "auto" else config["gpu"]
if not (REPO / "conf" / "gpu" / f"{GPU}.yaml").is_file():
    raise config_error("gpu", GPU, f"no such file conf/gpu/{GPU}.yaml (options: {', '.join(_options('gpu'))})")
# The profile: "auto" is the GPU profile where a CUDA device is visible and the CPU profile
# elsewhere; profile=cpu runs a GPU's constants through the CPU profile (the new-GPU procedure,
# tried on a machine without one), and its results land under <artifacts_root>/<gpu>-cpu/.
PROFILE = config.get("profile", "auto")
if PROFILE == "auto":
    PROFILE = "gpu" if GPU != "cpu" and detect_gpu() != "cpu" else "cpu"
if PROFILE == "gpu" and GPU == "cpu":
    raise config_error("profile", PROFILE, "the GPU profile needs a GPU's conf/gpu file, not cpu")
ON_GPU = PROFILE == "gpu"
# Rules that time on the device hold the GPU alone; on the CPU profile they run side by side.
GPU_SLOTS = 1 if ON_GPU else 0
ROOT = f"{config['artifacts_root']}/{GPU}" + ("-cpu" if GPU != "cpu" and not ON_GPU else "")
LOGS = f"{ROOT}/logs"

CALIBRATION = f"{ROOT}/calibration/calibration.json"
CALIBRATION_REPEATS = [f"{ROOT}/calibration/repeat{k}/calibration.json"
                       for k in range(1, int(config.get("calibration_repeats", 0)) + 1)]
CALIBRATION_SPREAD = f"{ROOT}/calibration/spread.md"
BUILD_RECORD = f"{ROOT}/build/extension.json"
KERNEL_BENCH = f"{ROOT}/kernel_bench/decode.json"
# vLLM's rows (workflow/rules/vllm.smk): on the GPU profile the timing rules that run them wait for
# this record, so vLLM's kernels compile in a job of their own, never inside a timed one. The CPU
# profile leaves it out: it would need PyPI, and the rows cannot run there anyway.
VLLM_RECORD = f"{ROOT}/build/vllm.json"
BASELINE_BUILDS = [VLLM_RECORD] if ON_GPU else []
HOST_BENCH = f"{ROOT}/host_bench/host.json"
HELD_OUT = [int(s) for s in config["held_out_seeds"]]
TRACE_NAME = re.compile(r"([a-z]+)_b([0-9]+)")


# Rows of one decode step (pkv.config.schema BATCH).
MAX_ACTIVE = 4096


def check_trace_name(field, name):
    """A trace of the axes names a conf/trace family and a batch, or an external trace: fail at
    parse time (snakemake -n), not when its job runs."""
    if name in (config.get("external_traces") or {}):
        return
    families = [f for f in _options("trace") if f != "external"]
    m = TRACE_NAME.fullmatch(name)
    if not m:
        raise config_error(field, name, f"must be <family>_b<max_active> (families: {', '.join(families)}) "
                           "or a name under external_traces")
    if m.group(1) not in families:
        raise config_error(field, name, f"no trace family {m.group(1)!r} (conf/trace/{m.group(1)}.yaml does not "
                           f"exist; families: {', '.join(families)})")
    if not 1 <= int(m.group(2)) <= MAX_ACTIVE:
        raise config_error(field, name, f"max_active {m.group(2)} must be in [1, {MAX_ACTIVE}]")


def check_axes():
    """Every trace, variant and external file the axes name exists."""
    for key in ("evaluate_traces", "mlp_traces"):
        for name in config[key]:
            check_trace_name(key, name)
    for name, spec in (config.get("external_traces") or {}).items():
        if not Path(spec["path"]).is_file():
            raise config_error(f"external_traces.{name}.path", spec["path"], "no such file")
    for ablation, spec in config["ablations"].items():
        path = REPO / "conf" / "experiment" / f"ablate_{ablation}.yaml"
        keys = (yaml.safe_load(path.read_text())["experiment"].get("variant_keys") or {}) if path.is_file() else {}
        for trace, variants in spec["variants"].items():
            check_trace_name(f"ablations.{ablation}.variants", trace)
            for variant in variants:
                if variant.partition("=")[0] not in keys:
                    raise config_error(f"ablations.{ablation}.variants.{trace}", variant,
                                       f"<name>=<value> with <name> one of {sorted(keys)} ({path.relative_to(REPO)})")


def experiment_engines(experiment):
    """Engine labels of conf/experiment/<experiment>.yaml: one result file each."""
    path = REPO / "conf" / "experiment" / f"{experiment}.yaml"
    data = yaml.safe_load(path.read_text())
    try:
        return list(data["experiment"]["engines"])
    except (KeyError, TypeError):
        raise WorkflowError(f"{path}: field 'experiment.engines' is missing") from None


def seeds_of(value):
    """An ablation's seeds: a list, or "held_out" for every held-out seed."""
    return HELD_OUT if value == "held_out" else [int(s) for s in value]


def trace_overrides(name):
    """Hydra overrides that select a results trace name: bimodal_b8, or an external trace's name."""
    external = config.get("external_traces") or {}
    if name in external:
        spec = external[name]
        return [
            "trace=external",
            f"trace.path={spec['path']}",
            f"trace.name={name}",
            f"trace.max_active={spec['max_active']}",
        ]
    m = TRACE_NAME.fullmatch(name)
    if not m:
        raise WorkflowError(f"config: trace {name!r} must be <family>_b<max_active> or an external_traces name")
    return [f"trace={m.group(1)}", f"trace.max_active={m.group(2)}"]


def trace_inputs(wildcards):
    """An external trace's file, so a missing or edited trace file is noticed."""
    external = config.get("external_traces") or {}
    return [external[wildcards.trace]["path"]] if wildcards.trace in external else []


def hydra_override(word):
    """key=value with the value quoted for Hydra when it holds "=" (variant dirs such as splits=24)."""
    key, _, value = word.partition("=")
    if re.search(r"[=\s,\[\]{}()'\"]", value):
        return f"{key}='{value}'"
    return word


def pkv_cli(overrides, out, run_dir):
    """The shell words of one `python -m pkv.cli` call; the checkout's package comes first on the path."""
    words = [f"gpu={GPU}", f"profile={PROFILE}", *overrides, f"out={out}", f"hydra.run.dir={run_dir}"]
    return " ".join(shlex.quote(hydra_override(w)) for w in words)


# Every rule runs the checkout's package with the interpreter that runs Snakemake, one thread per
# job on the CPU (Snakemake runs jobs side by side instead).
# Absolute but not resolved: a virtual environment's python is a symlink to the base interpreter,
# and following it would leave the environment's packages behind.
INTERPRETER = shlex.quote(os.path.abspath(sys.executable))
PYTHON = (
    f"PYTHONPATH={shlex.quote(str(REPO))}${{{{PYTHONPATH:+:$PYTHONPATH}}}} OMP_NUM_THREADS={{threads}} "
    f"{INTERPRETER}"
)
# The lock files of the device slots: one folder for every job of the run, so --resources gpu=N runs
# N GPU jobs each on a device of its own. PKV_SLOT_DIR, read by the wrapper when the job runs, shares
# one folder between DAG runs with other artifacts roots; it stays out of the command, whose text
# Snakemake compares (rerun-triggers: code), so setting it reruns nothing.
SLOT_DIR = f"{config['artifacts_root']}/.slots"
# The rules that time (gpu=GPU_SLOTS) run their command through pkv.device_slots: on the GPU profile
# it takes a free device, narrows CUDA_VISIBLE_DEVICES to it and records it for the result's
# provenance. --warm hands the `python -m` call to that slot's warm worker (pkv.worker), which keeps
# Python, torch, the CUDA context and FlashInfer loaded from one job to the next and puts back what
# each job leaves behind, so a job pays none of that start-up; PKV_WORKER=0 (read when the job runs,
# so setting it reruns nothing) runs each job in a fresh process instead, and so does a Slurm job.
# On the CPU profile there is no device (--devices 0: no detection) and the slot is a CPU worker's,
# one per usable core.
_SLOTS = f"{PYTHON} -m pkv.device_slots run --slot-dir {shlex.quote(SLOT_DIR)}" + ("" if ON_GPU else " --devices 0")
GPU_JOB = f"{_SLOTS} --warm -- {INTERPRETER}"
# A fresh process on a device of its own: the profile rule, which runs ncu around a second process.
DEVICE_JOB = f"{_SLOTS} -- {INTERPRETER}" if ON_GPU else GPU_JOB
# The tables, figures and calibration spread: on the CPU profile in the CPU workers, like every
# other job there; on the GPU profile processes, a handful of jobs on the host's other cores beside
# the device jobs, where a worker would only add one more process start.
REPORT_JOB = PYTHON if ON_GPU else f"{_SLOTS} --warm -- {INTERPRETER}"


def stop_workers():
    """Stop this host's warm workers in the run's slot folder (onsuccess/onerror: a finished DAG
    leaves no process behind; a killed one's workers exit after PKV_WORKER_IDLE_S idle seconds).
    PKV_WORKER_KEEP=1 leaves them warm for the next DAG run, until that idle timeout."""
    import subprocess

    if os.environ.get("PKV_WORKER_KEEP", "0") not in ("", "0"):
        return
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    subprocess.run([sys.executable, "-m", "pkv.worker", "stop", "--slot-dir", SLOT_DIR], env=env, cwd=str(REPO),
                   stdout=subprocess.DEVNULL, check=False, timeout=60)


def result_files(folder, experiment):
    return [f"{folder}/{engine}.json" for engine in experiment_engines(experiment)]


def variant_override(variant):
    return f"variant={variant}"


def ablation_folder(ablation, wc=None):
    """An ablation run's results folder: with the wildcards of a job, or as the output pattern."""
    if wc is None:
        return f"{ROOT}/ablate/{ablation}/{{variant}}/{{trace}}/seed{{seed}}"
    return f"{ROOT}/ablate/{ablation}/{wc.variant}/{wc.trace}/seed{wc.seed}"


def ablation_cli(ablation):
    """The pkv.cli words of an ablation's job: its experiment, trace, variant, seed and calibration."""

    def cli(wc, input):
        folder = ablation_folder(ablation, wc)
        overrides = [f"experiment=ablate_{ablation}", *trace_overrides(wc.trace), variant_override(wc.variant),
                     f"seed={wc.seed}", f"calibration={input.calibration}"]
        return pkv_cli(overrides, folder, f"{folder}/.run")

    return cli


# --- what `rule all` asks for -----------------------------------------------------------------


def evaluate_targets():
    traces = list(config["evaluate_traces"]) + list((config.get("external_traces") or {}))
    return [
        f
        for trace in traces
        for seed in HELD_OUT
        for f in result_files(f"{ROOT}/evaluate/{trace}/seed{seed}", "evaluate")
    ]


def mlp_targets():
    return [
        f
        for trace in config["mlp_traces"]
        for seed in HELD_OUT
        for f in result_files(f"{ROOT}/mlp/{trace}/seed{seed}", "mlp")
    ]


def ablation_targets():
    files = []
    for ablation, spec in config["ablations"].items():
        for trace, variants in spec["variants"].items():
            for variant in variants:
                for seed in seeds_of(spec["seeds"]):
                    folder = f"{ROOT}/ablate/{ablation}/{variant}/{trace}/seed{seed}"
                    files += result_files(folder, f"ablate_{ablation}")
    return files


def isolated_targets():
    return [f"{ROOT}/isolated/ctx{ctx}.json" for ctx in config["isolated_contexts"]]


def model_step_files(folder):
    """Table 9's files of one run: <engine>_<mode>.json for each engine and mode of conf/experiment/model_step.yaml."""
    modes = yaml.safe_load((REPO / "conf" / "experiment" / "model_step.yaml").read_text())["experiment"]["modes"]
    return [f"{folder}/{engine}_{mode}.json" for engine in experiment_engines("model_step") for mode in modes]


def model_step_targets():
    return [
        f
        for trace in config.get("model_step_traces") or []
        for seed in HELD_OUT
        for f in model_step_files(f"{ROOT}/model_step/{trace}/seed{seed}")
    ]


check_axes()

TABLE_IDS = list(range(1, 10))
TABLES = [f"{ROOT}/tables/table{k}.{ext}" for k in TABLE_IDS for ext in ("md", "tex")]
RESULTS = (
    evaluate_targets()
    + mlp_targets()
    + ablation_targets()
    + isolated_targets()
    + model_step_targets()
    + [f"{ROOT}/profile/ncu_counters.json", KERNEL_BENCH, HOST_BENCH, CALIBRATION, BUILD_RECORD]
    + ([CALIBRATION_SPREAD] if CALIBRATION_REPEATS else [])
)


wildcard_constraints:
    trace=r"[A-Za-z0-9_]+",
    seed=r"[0-9]+",
    variant=r"[A-Za-z0-9_.]+=[A-Za-z0-9_.]+",
    ctx=r"[0-9]+",
    k=r"[0-9]+",
