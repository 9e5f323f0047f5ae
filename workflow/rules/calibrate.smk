# The frozen cost-model constants, measured on the calibration seed only (paper 3.5): every route
# decision of the evaluation and ablation rules reads this file.


rule calibrate:
    input:
        build=BUILD_RECORD,
        gpu_constants=f"conf/gpu/{GPU}.yaml",
        # the sweeps, probes and tolerance: an edit there is a new calibration
        settings="conf/experiment/calibrate.yaml",
    output:
        CALIBRATION,
    log:
        f"{LOGS}/calibrate.log",
    params:
        cli=pkv_cli(
            ["experiment=calibrate", f"seed={config['calibration_seed']}"],
            CALIBRATION,
            f"{ROOT}/calibration/.run",
        ),
    threads: 1
    conda:
        CONDA_ENV
    resources:
        gpu=GPU_SLOTS,
    # First of the GPU jobs: every timed rule but the repeats and the kernel benchmark waits for it.
    priority: 50
    shell:
        f"{GPU_JOB} -m pkv.cli {{params.cli}} > {{log}} 2>&1"


# The same calibration again (calibration_repeats times): a decision that differs between two runs
# on one GPU and one commit is noise the fits did not absorb. The evaluation reads only the first.
rule calibrate_repeat:
    input:
        build=BUILD_RECORD,
        gpu_constants=f"conf/gpu/{GPU}.yaml",
        settings="conf/experiment/calibrate.yaml",
    output:
        f"{ROOT}/calibration/repeat{{k}}/calibration.json",
    log:
        f"{LOGS}/calibrate_repeat{{k}}.log",
    params:
        cli=lambda wc: pkv_cli(
            ["experiment=calibrate", f"seed={config['calibration_seed']}"],
            f"{ROOT}/calibration/repeat{wc.k}/calibration.json",
            f"{ROOT}/calibration/repeat{wc.k}/.run",
        ),
    threads: 1
    conda:
        CONDA_ENV
    resources:
        gpu=GPU_SLOTS,
    shell:
        f"{GPU_JOB} -m pkv.cli {{params.cli}} > {{log}} 2>&1"


rule calibration_spread:
    input:
        [CALIBRATION] + CALIBRATION_REPEATS,
    output:
        CALIBRATION_SPREAD,
    log:
        f"{LOGS}/calibration_spread.log",
    threads: 1
    conda:
        CONDA_ENV
    shell:
        f"{REPORT_JOB} -m pkv.report.calibration_spread {{input}} --out {{output}} > {{log}} 2>&1"
