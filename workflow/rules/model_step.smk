# Table 9: one decode step of a whole model per engine, eager and replayed from CUDA graphs, on
# Table 2's traces and held-out seeds (config model_step_traces). One job times every engine and
# mode of its experiment on the same page tables and writes one file per (engine, mode).


for _name in config.get("model_step_traces") or []:
    check_trace_name("model_step_traces", _name)


rule model_step:
    input:
        calibration=CALIBRATION,
        trace_file=trace_inputs,
    output:
        model_step_files(f"{ROOT}/model_step/{{trace}}/seed{{seed}}"),
    log:
        f"{LOGS}/model_step/{{trace}}/seed{{seed}}.log",
    params:
        cli=lambda wc, input: pkv_cli(
            [
                "experiment=model_step",
                *trace_overrides(wc.trace),
                f"seed={wc.seed}",
                f"calibration={input.calibration}",
            ],
            f"{ROOT}/model_step/{wc.trace}/seed{wc.seed}",
            f"{ROOT}/model_step/{wc.trace}/seed{wc.seed}/.run",
        ),
    threads: 1
    conda:
        CONDA_ENV
    resources:
        gpu=GPU_SLOTS,
    shell:
        f"{GPU_JOB} -m pkv.cli {{params.cli}} > {{log}} 2>&1"


# The figure of Table 9 (pkv.report.figure_data.model_step_ratio), drawn like the figures of
# workflow/rules/tables.smk from the results it reads.
rule model_step_figure:
    input:
        model_step_targets(),
    output:
        png=report(
            f"{ROOT}/figures/model_step_ratio.png",
            caption="../report/figure.rst",
            category="Figures",
            labels={"figure": "model_step_ratio"},
        ),
        pdf=f"{ROOT}/figures/model_step_ratio.pdf",
        caption=f"{ROOT}/figures/model_step_ratio.rst",
    log:
        f"{LOGS}/figures/model_step_ratio.log",
    params:
        out=lambda wc, output: str(Path(output.png).parent),
        root=lambda wc, output: str(Path(output.png).parent.parent),
    threads: 1
    conda:
        CONDA_ENV
    shell:
        f"{REPORT_JOB} -m pkv.report.figures --root {{params.root}} --out {{params.out}} --figure model_step_ratio "
        "> {log} 2>&1"


# `rule all` (Snakefile) asks for TABLES: the figure joins it, as tables.smk's figures do.
TABLES = TABLES + [f"{ROOT}/figures/model_step_ratio.{ext}" for ext in ("png", "pdf", "rst")]
