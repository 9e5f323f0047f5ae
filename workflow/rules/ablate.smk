# Ablations: ablate/<ablation>/<variant>/<trace>/seed<S>/<engine>.json. The variant wildcard is
# "<name>=<value>" (splits=24, G=8, route=workqueue); conf/experiment/ablate_<ablation>.yaml says
# which config key it sets and which engines run side by side.


rule ablate_splits:
    # Table 7: split-count sensitivity
    input:
        calibration=CALIBRATION,
        trace_file=trace_inputs,
    output:
        result_files(f"{ROOT}/ablate/splits/{{variant}}/{{trace}}/seed{{seed}}", "ablate_splits"),
    log:
        f"{LOGS}/ablate/splits/{{variant}}/{{trace}}/seed{{seed}}.log",
    params:
        cli=lambda wc, input: pkv_cli(
            [
                "experiment=ablate_splits",
                *trace_overrides(wc.trace),
                variant_override(wc.variant),
                f"seed={wc.seed}",
                f"calibration={input.calibration}",
            ],
            f"{ROOT}/ablate/splits/{wc.variant}/{wc.trace}/seed{wc.seed}",
            f"{ROOT}/ablate/splits/{wc.variant}/{wc.trace}/seed{wc.seed}/.run",
        ),
    threads: 1
    conda:
        CONDA_ENV
    resources:
        gpu=GPU_SLOTS,
    shell:
        f"{GPU_JOB} -m pkv.cli {{params.cli}} > {{log}} 2>&1"


rule ablate_raggedness:
    # Table 4: exact buckets vs masked bucket vs workqueue
    input:
        calibration=CALIBRATION,
        trace_file=trace_inputs,
    output:
        result_files(f"{ROOT}/ablate/raggedness/{{variant}}/{{trace}}/seed{{seed}}", "ablate_raggedness"),
    log:
        f"{LOGS}/ablate/raggedness/{{variant}}/{{trace}}/seed{{seed}}.log",
    params:
        cli=lambda wc, input: pkv_cli(
            [
                "experiment=ablate_raggedness",
                *trace_overrides(wc.trace),
                variant_override(wc.variant),
                f"seed={wc.seed}",
                f"calibration={input.calibration}",
            ],
            f"{ROOT}/ablate/raggedness/{wc.variant}/{wc.trace}/seed{wc.seed}",
            f"{ROOT}/ablate/raggedness/{wc.variant}/{wc.trace}/seed{wc.seed}/.run",
        ),
    threads: 1
    conda:
        CONDA_ENV
    resources:
        gpu=GPU_SLOTS,
    shell:
        f"{GPU_JOB} -m pkv.cli {{params.cli}} > {{log}} 2>&1"


rule ablate_gqa:
    # Table 8: G in {1, 4, 8}
    input:
        calibration=CALIBRATION,
        trace_file=trace_inputs,
    output:
        result_files(f"{ROOT}/ablate/gqa/{{variant}}/{{trace}}/seed{{seed}}", "ablate_gqa"),
    log:
        f"{LOGS}/ablate/gqa/{{variant}}/{{trace}}/seed{{seed}}.log",
    params:
        cli=lambda wc, input: pkv_cli(
            [
                "experiment=ablate_gqa",
                *trace_overrides(wc.trace),
                variant_override(wc.variant),
                f"seed={wc.seed}",
                f"calibration={input.calibration}",
            ],
            f"{ROOT}/ablate/gqa/{wc.variant}/{wc.trace}/seed{wc.seed}",
            f"{ROOT}/ablate/gqa/{wc.variant}/{wc.trace}/seed{wc.seed}/.run",
        ),
    threads: 1
    conda:
        CONDA_ENV
    resources:
        gpu=GPU_SLOTS,
    shell:
        f"{GPU_JOB} -m pkv.cli {{params.cli}} > {{log}} 2>&1"


rule ablate_graph:
    # CUDA graph replay
    input:
        calibration=CALIBRATION,
        trace_file=trace_inputs,
    output:
        result_files(f"{ROOT}/ablate/graph/{{variant}}/{{trace}}/seed{{seed}}", "ablate_graph"),
    log:
        f"{LOGS}/ablate/graph/{{variant}}/{{trace}}/seed{{seed}}.log",
    params:
        cli=lambda wc, input: pkv_cli(
            [
                "experiment=ablate_graph",
                *trace_overrides(wc.trace),
                variant_override(wc.variant),
                f"seed={wc.seed}",
                f"calibration={input.calibration}",
            ],
            f"{ROOT}/ablate/graph/{wc.variant}/{wc.trace}/seed{wc.seed}",
            f"{ROOT}/ablate/graph/{wc.variant}/{wc.trace}/seed{wc.seed}/.run",
        ),
    threads: 1
    conda:
        CONDA_ENV
    resources:
        gpu=GPU_SLOTS,
    shell:
        f"{GPU_JOB} -m pkv.cli {{params.cli}} > {{log}} 2>&1"


rule ablate_fused_merge:
    # fused decode + merge
    input:
        calibration=CALIBRATION,
        trace_file=trace_inputs,
    output:
        result_files(f"{ROOT}/ablate/fused_merge/{{variant}}/{{trace}}/seed{{seed}}", "ablate_fused_merge"),
    log:
        f"{LOGS}/ablate/fused_merge/{{variant}}/{{trace}}/seed{{seed}}.log",
    params:
        cli=lambda wc, input: pkv_cli(
            [
                "experiment=ablate_fused_merge",
                *trace_overrides(wc.trace),
                variant_override(wc.variant),
                f"seed={wc.seed}",
                f"calibration={input.calibration}",
            ],
            f"{ROOT}/ablate/fused_merge/{wc.variant}/{wc.trace}/seed{wc.seed}",
            f"{ROOT}/ablate/fused_merge/{wc.variant}/{wc.trace}/seed{wc.seed}/.run",
        ),
    threads: 1
    conda:
        CONDA_ENV
    resources:
        gpu=GPU_SLOTS,
    shell:
        f"{GPU_JOB} -m pkv.cli {{params.cli}} > {{log}} 2>&1"


rule ablate_b4:
    # the B4 split sweep with engine.open_few_rows
    input:
        calibration=CALIBRATION,
        trace_file=trace_inputs,
    output:
        result_files(f"{ROOT}/ablate/b4/{{variant}}/{{trace}}/seed{{seed}}", "ablate_b4"),
    log:
        f"{LOGS}/ablate/b4/{{variant}}/{{trace}}/seed{{seed}}.log",
    params:
        cli=lambda wc, input: pkv_cli(
            [
                "experiment=ablate_b4",
                *trace_overrides(wc.trace),
                variant_override(wc.variant),
                f"seed={wc.seed}",
                f"calibration={input.calibration}",
            ],
            f"{ROOT}/ablate/b4/{wc.variant}/{wc.trace}/seed{wc.seed}",
            f"{ROOT}/ablate/b4/{wc.variant}/{wc.trace}/seed{wc.seed}/.run",
        ),
    threads: 1
    conda:
        CONDA_ENV
    resources:
        gpu=GPU_SLOTS,
    shell:
        f"{GPU_JOB} -m pkv.cli {{params.cli}} > {{log}} 2>&1"
