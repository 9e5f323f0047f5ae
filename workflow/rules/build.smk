# The CUDA extension, built once per source hash for the detected architecture (or a record that
# says why not, on a machine without CUDA). Every timed rule depends on its record.


rule build:
    input:
        sources=sorted(str(p.relative_to(REPO)) for p in (REPO / "csrc").glob("*") if p.is_file()),
        builder="pkv/build.py",
    output:
        BUILD_RECORD,
    log:
        f"{LOGS}/build.log",
    threads: 1
    conda:
        CONDA_ENV
    resources:
        gpu=GPU_SLOTS,
    # No device slot (PYTHON, not GPU_JOB): the build times nothing and every timed rule waits for
    # its record, so there is no job to keep off its device; it only reads the device's capability.
    shell:
        f"{PYTHON} -m pkv.build --record {{output}} > {{log}} 2>&1"
