# Ablations: ablate/<ablation>/<variant>/<trace>/seed<S>/<engine>.json. The variant wildcard is
# "<name>=<value>" (splits=24, G=8, route=workqueue); conf/experiment/ablate_<ablation>.yaml says
# which config key it sets and which engines run side by side. Every ablation's job is the same run
# of its own experiment: ablate_splits is written out, and each other ablation is that rule with its
# own name, folder and experiment (`use rule ... with`; ablation_folder and ablation_cli in common.smk).


rule ablate_splits:
    # Table 7: split-count sensitivity
    input:
        calibration=CALIBRATION,
        trace_file=trace_inputs,
    output:
        result_files(ablation_folder("splits"), "ablate_splits"),
    log:
        f"{LOGS}/ablate/splits/{{variant}}/{{trace}}/seed{{seed}}.log",
    params:
        cli=ablation_cli("splits"),
    threads: 1
    conda:
        CONDA_ENV
    resources:
        gpu=GPU_SLOTS,
    shell:
        f"{GPU_JOB} -m pkv.cli {{params.cli}} > {{log}} 2>&1"


# Table 4: exact buckets vs masked bucket vs workqueue
use rule ablate_splits as ablate_raggedness with:
    output:
        result_files(ablation_folder("raggedness"), "ablate_raggedness"),
    log:
        f"{LOGS}/ablate/raggedness/{{variant}}/{{trace}}/seed{{seed}}.log",
    params:
        cli=ablation_cli("raggedness"),


# Table 8: G in {1, 4, 8}
use rule ablate_splits as ablate_gqa with:
    output:
        result_files(ablation_folder("gqa"), "ablate_gqa"),
    log:
        f"{LOGS}/ablate/gqa/{{variant}}/{{trace}}/seed{{seed}}.log",
    params:
        cli=ablation_cli("gqa"),


# CUDA graph replay
use rule ablate_splits as ablate_graph with:
    output:
        result_files(ablation_folder("graph"), "ablate_graph"),
    log:
        f"{LOGS}/ablate/graph/{{variant}}/{{trace}}/seed{{seed}}.log",
    params:
        cli=ablation_cli("graph"),


# fused decode + merge
use rule ablate_splits as ablate_fused_merge with:
    output:
        result_files(ablation_folder("fused_merge"), "ablate_fused_merge"),
    log:
        f"{LOGS}/ablate/fused_merge/{{variant}}/{{trace}}/seed{{seed}}.log",
    params:
        cli=ablation_cli("fused_merge"),


# the B4 split sweep with engine.open_few_rows
use rule ablate_splits as ablate_b4 with:
    output:
        result_files(ablation_folder("b4"), "ablate_b4"),
    log:
        f"{LOGS}/ablate/b4/{{variant}}/{{trace}}/seed{{seed}}.log",
    params:
        cli=ablation_cli("b4"),


# Table 7: the B1 short-row rule's tiles a split, on real conversation traffic
use rule ablate_splits as ablate_short_rows with:
    output:
        result_files(ablation_folder("short_rows"), "ablate_short_rows"),
    log:
        f"{LOGS}/ablate/short_rows/{{variant}}/{{trace}}/seed{{seed}}.log",
    params:
        cli=ablation_cli("short_rows"),
