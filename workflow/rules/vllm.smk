# The vLLM baseline rows: vLLM's sources, fetched from the pinned sdists into the git-ignored
# third_party/vllm (pkv.engines.vllm_sources), and (pkv.engines.vllm_build), where torch sees a CUDA GPU, the PagedAttention
# build and the Triton kernel's import. On the GPU profile the isolated and kernel benchmarks wait
# for it (BASELINE_BUILDS); without network or GPU it records the reason instead (tables print
# "not available: <reason>"). The CPU profile leaves it out: it would need PyPI the first time.
#
#   snakemake --cores 1 vllm_sources


rule vllm_sources:
    input:
        fetcher="pkv/engines/vllm_sources.py",
        builder="pkv/engines/vllm_build.py",
        binding=sorted(str(p.relative_to(REPO)) for p in (REPO / "csrc" / "vllm_binding").rglob("*") if p.is_file()),
    output:
        VLLM_RECORD,
    log:
        f"{LOGS}/vllm_sources.log",
    # One nvcc at a time (pkv.build.compile_library), so one thread.
    threads: 1
    conda:
        CONDA_ENV
    # nvcc work: no device slot and no gpu resource, since it times nothing. It builds beside the
    # calibration (the longest GPU job) instead of holding the GPU behind it; the timing rules that
    # run vLLM's rows wait for its record.
    shell:
        f"{PYTHON} -m pkv.engines.vllm_build record --record {{output}} > {{log}} 2>&1"
