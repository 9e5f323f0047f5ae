# The decode-kernel benchmark: PersistentKV's split points against every baseline (FlashInfer's
# decode paths, XQA, vLLM's kernels) on the same page tables, L2 flushed, as ratios and fractions of the read floor;
# and the host-time split of one serving step per engine (docs/performance.md). On a machine
# without a GPU each records why it did not run.


rule kernel_bench:
    input:
        build=BUILD_RECORD,
        baselines=BASELINE_BUILDS,
    output:
        KERNEL_BENCH,
    log:
        f"{LOGS}/kernel_bench.log",
    threads: 1
    conda:
        CONDA_ENV
    resources:
        gpu=GPU_SLOTS,
    shell:
        f"{GPU_JOB} -m pkv.measure.kernel_bench --out {{output}}"
        + (" --fa3" if config.get("kernel_bench_fa3", False) else "")
        + " > {log} 2>&1"


rule host_bench:
    input:
        build=BUILD_RECORD,
        calibration=CALIBRATION,
    output:
        HOST_BENCH,
    log:
        f"{LOGS}/host_bench.log",
    threads: 1
    conda:
        CONDA_ENV
    resources:
        gpu=GPU_SLOTS,
    shell:
        f"{GPU_JOB} -m pkv.measure.host_bench --calibration {{input.calibration}} --out {{output}} > {{log}} 2>&1"
