# Held-out trace runs: Table 2 (evaluate), Table 3 (mlp), Table 1 (isolated). One job times every
# engine of its experiment on the same page tables and writes one file per engine.


rule evaluate:
    input:
        calibration=CALIBRATION,
        trace_file=trace_inputs,
    output:
        result_files(f"{ROOT}/evaluate/{{trace}}/seed{{seed}}", "evaluate"),
    log:
        f"{LOGS}/evaluate/{{trace}}/seed{{seed}}.log",
    params:
        cli=lambda wc, input: pkv_cli(
            ["experiment=evaluate", *trace_overrides(wc.trace), f"seed={wc.seed}", f"calibration={input.calibration}"],
            f"{ROOT}/evaluate/{wc.trace}/seed{wc.seed}",
            f"{ROOT}/evaluate/{wc.trace}/seed{wc.seed}/.run",
        ),
    threads: 1
    conda:
        CONDA_ENV
    resources:
        gpu=GPU_SLOTS,
    shell:
        f"{GPU_JOB} -m pkv.cli {{params.cli}} > {{log}} 2>&1"


rule mlp:
    input:
        calibration=CALIBRATION,
        trace_file=trace_inputs,
    output:
        result_files(f"{ROOT}/mlp/{{trace}}/seed{{seed}}", "mlp"),
    log:
        f"{LOGS}/mlp/{{trace}}/seed{{seed}}.log",
    params:
        cli=lambda wc, input: pkv_cli(
            ["experiment=mlp", *trace_overrides(wc.trace), f"seed={wc.seed}", f"calibration={input.calibration}"],
            f"{ROOT}/mlp/{wc.trace}/seed{wc.seed}",
            f"{ROOT}/mlp/{wc.trace}/seed{wc.seed}/.run",
        ),
    threads: 1
    conda:
        CONDA_ENV
    resources:
        gpu=GPU_SLOTS,
    shell:
        f"{GPU_JOB} -m pkv.cli {{params.cli}} > {{log}} 2>&1"


rule isolated:
    input:
        calibration=CALIBRATION,
        baselines=BASELINE_BUILDS,
    output:
        f"{ROOT}/isolated/ctx{{ctx}}.json",
    log:
        f"{LOGS}/isolated/ctx{{ctx}}.log",
    params:
        cli=lambda wc, input: pkv_cli(
            [
                "experiment=isolated",
                "trace=bucketed",
                f"experiment.context_len={wc.ctx}",
                f"seed={HELD_OUT[0]}",
                f"calibration={input.calibration}",
            ],
            f"{ROOT}/isolated/ctx{wc.ctx}.json",
            f"{ROOT}/isolated/.run_ctx{wc.ctx}",
        ),
    threads: 1
    conda:
        CONDA_ENV
    resources:
        gpu=GPU_SLOTS,
    shell:
        f"{GPU_JOB} -m pkv.cli {{params.cli}} > {{log}} 2>&1"
