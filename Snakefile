# PersistentKV artifact: build -> calibrate -> evaluate / ablate / isolated / profile -> tables.
#
#   snakemake --cores all                      # the whole DAG; the CPU profile on a machine without a GPU
#   snakemake --cores all --config gpu=h200    # pick conf/gpu/h200.yaml instead of auto-detecting
#
# Axes (seeds, traces, ablation variants) live in config/config.yaml; per-run parameters in conf/.
# Everything is written under artifacts/<gpu>/.

from snakemake.utils import min_version

min_version("8.0")


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/build.smk"
include: "workflow/rules/vllm.smk"
include: "workflow/rules/calibrate.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/ablate.smk"
include: "workflow/rules/profile.smk"
include: "workflow/rules/benchmark.smk"
include: "workflow/rules/tables.smk"
include: "workflow/rules/model_step.smk"


# The results are targets too, not only inputs of the tables: Snakemake treats a missing
# intermediate file as disposable, so a deleted result is rebuilt only if it is asked for.
rule all:
    default_target: True
    input:
        TABLES,
        RESULTS,


# The warm workers the jobs started (pkv.worker) end with the run, whether it succeeded or not.
onsuccess:
    stop_workers()


onerror:
    stop_workers()


# Said once before the first job, so a run's console says what its numbers are.
onstart:
    if ON_GPU:
        print(f"PersistentKV: GPU profile, conf/gpu/{GPU}.yaml; results under {ROOT}/", file=sys.stderr)
    else:
        print(f"PersistentKV: CPU profile, conf/gpu/{GPU}.yaml; results under {ROOT}/. It checks the pipeline "
              "end to end with small inputs and reference engines: its times are not a performance result.",
              file=sys.stderr)
