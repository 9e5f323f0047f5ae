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
    shell:
        f"{GPU_JOB} -m pkv.cli {{params.cli}} > {{log}} 2>&1"
