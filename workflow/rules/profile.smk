# Table 5: Nsight Compute counters of a short B8 bimodal run. The driver runs ncu around itself on
# a GPU and records why it cannot on a machine without one.


rule profile:
    input:
        calibration=CALIBRATION,
    output:
        f"{ROOT}/profile/ncu_counters.json",
    log:
        f"{LOGS}/profile.log",
    params:
        cli=lambda wc, input: pkv_cli(
            [
                "experiment=profile",
                "trace=bimodal",
                "trace.max_active=8",
                f"seed={HELD_OUT[0]}",
                f"calibration={input.calibration}",
            ],
            f"{ROOT}/profile/ncu_counters.json",
            f"{ROOT}/profile/.run",
        ),
    threads: 1
    conda:
        CONDA_ENV
    resources:
        gpu=GPU_SLOTS,
    # ncu runs a second process around the job's own: a fresh process, never a warm worker, on a GPU.
    shell:
        f"{DEVICE_JOB} -m pkv.cli {{params.cli}} > {{log}} 2>&1"
