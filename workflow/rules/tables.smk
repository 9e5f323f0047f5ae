# Every table of the paper, Markdown and LaTeX, rendered from the results through paper_tables/.


rule tables:
    input:
        results=RESULTS,
        templates=sorted(str(p.relative_to(REPO)) for p in (REPO / "paper_tables").glob("*.j2")),
    output:
        TABLES,
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
        f"{PYTHON} -m pkv.report.tables --root {{params.root}} --out {{params.out}} > {{log}} 2>&1"
