# What a reader opens: every table of the paper and the claims check (Markdown, LaTeX, and an HTML
# page for `snakemake --report`), rendered from the results through paper_tables/, and the figures
# (PNG for the report, PDF for a paper, each with its caption). Every number comes from the result
# files through pkv.report. The report's captions are workflow/report/*.rst.


report: "../report/workflow.rst"


TABLE_PAGES = {k: f"{ROOT}/tables/table{k}.html" for k in TABLE_IDS}
CLAIMS = [f"{ROOT}/tables/claims.md", f"{ROOT}/tables/claims.tex"]
CLAIMS_PAGE = f"{ROOT}/tables/claims.html"

# Each figure and the results it is drawn from (pkv.report.figure_data).
FIGURE_INPUTS = {
    "isolated_time": isolated_targets,
    "kernel_floor": lambda: [KERNEL_BENCH],
    "serving_ratio": evaluate_targets,
    "route_mix": evaluate_targets,
    "host_device": lambda: [HOST_BENCH],
}
FIGURES = [f"{ROOT}/figures/{name}.{ext}" for name in FIGURE_INPUTS for ext in ("png", "pdf", "rst")]


rule tables:
    input:
        results=RESULTS,
        templates=sorted(str(p.relative_to(REPO)) for p in (REPO / "paper_tables").glob("*.j2")),
    output:
        TABLES,
        CLAIMS,
        pages=[
            report(page, caption=f"../report/table{k}.rst", category="Tables", labels={"table": f"Table {k}"})
            for k, page in TABLE_PAGES.items()
        ],
        claims_page=report(
            CLAIMS_PAGE, caption="../report/claims.rst", category="Claims check", labels={"table": "Claims check"}
        ),
    log:
        f"{LOGS}/tables.log",
    params:
        # artifacts/<gpu>/tables/table1.md -> artifacts/<gpu>/tables and artifacts/<gpu>
        out=lambda wc, output: str(Path(output[0]).parent),
        root=lambda wc, output: str(Path(output[0]).parent.parent),
    threads: 1
    conda:
        CONDA_ENV
    shell:
        f"{REPORT_JOB} -m pkv.report.tables --root {{params.root}} --out {{params.out}} > {{log}} 2>&1"


rule figure:
    input:
        lambda wc: FIGURE_INPUTS[wc.figure](),
    output:
        png=report(
            f"{ROOT}/figures/{{figure}}.png",
            caption="../report/figure.rst",
            category="Figures",
            labels={"figure": "{figure}"},
        ),
        pdf=f"{ROOT}/figures/{{figure}}.pdf",
        caption=f"{ROOT}/figures/{{figure}}.rst",
    log:
        f"{LOGS}/figures/{{figure}}.log",
    wildcard_constraints:
        figure="|".join(FIGURE_INPUTS),
    params:
        # artifacts/<gpu>/figures/<name>.png -> artifacts/<gpu>/figures and artifacts/<gpu>
        out=lambda wc, output: str(Path(output.png).parent),
        root=lambda wc, output: str(Path(output.png).parent.parent),
    threads: 1
    conda:
        CONDA_ENV
    shell:
        f"{REPORT_JOB} -m pkv.report.figures --root {{params.root}} --out {{params.out}} --figure {{wildcards.figure}} "
        "> {log} 2>&1"


# `rule all` (Snakefile) asks for TABLES: the HTML pages, the claims check and the figures join that
# list, so the default target, and with it `snakemake --report`, holds every table and figure.
TABLES = TABLES + list(TABLE_PAGES.values()) + CLAIMS + [CLAIMS_PAGE] + FIGURES
